//! What the node agents publish as DRA drivers, read from their
//! ResourceSlices: which nodes offer their GPUs through DRA, and each
//! device's name in its pool (an allocation names the slice's device; plans
//! name tessera's device ID, the `id` attribute).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use super::cached_slice::CachedSlice;
use crate::controller::lock;

/// One node's pool: device ID → device name, at the pool's generation.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Pool {
    pub(crate) generation: i64,
    pub(crate) names: BTreeMap<String, String>,
    /// Device name → its memory capacity in bytes, where published.
    pub(crate) memory: BTreeMap<String, u64>,
    /// Counter set → counter → how much the devices consuming it may use together.
    pub(crate) counters: BTreeMap<String, Counters>,
    /// Device name → what it consumes, by counter set.
    pub(crate) consumes: BTreeMap<String, BTreeMap<String, Counters>>,
}

/// Counter name → amount.
pub(crate) type Counters = BTreeMap<String, u64>;

/// A slice's counters as amounts; one that is not a quantity counts as none
/// (for a counter set) or all (for a consumption): a conflict, never room.
fn amounts(
    counters: &BTreeMap<String, super::cached_slice::CachedCounter>,
    unreadable: u64,
) -> Counters {
    counters
        .iter()
        .map(|(name, counter)| {
            let amount =
                crate::kubernetes::quantity::whole_units(&counter.value).unwrap_or(unreadable);
            (name.clone(), amount)
        })
        .collect()
}

impl Pool {
    /// The device ID of the device named `name` in this pool.
    pub(crate) fn id_of(&self, name: &str) -> Option<&str> {
        self.names
            .iter()
            .find(|(_, n)| n.as_str() == name)
            .map(|(id, _)| id.as_str())
    }
}

/// Every node's pool of the driver, by node (= pool) name.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Pools {
    by_node: BTreeMap<String, Pool>,
}

impl Pools {
    /// The pools of `driver` in `slices`. Per pool only the newest
    /// generation's slices count (older ones are being replaced).
    pub fn of(slices: &[Arc<CachedSlice>], driver: &str) -> Self {
        let mut by_node: BTreeMap<String, Pool> = BTreeMap::new();
        for slice in slices {
            let spec = &slice.spec;
            if spec.driver != driver || spec.node_name.as_deref() != Some(spec.pool.name.as_str()) {
                continue;
            }
            let pool = by_node.entry(spec.pool.name.clone()).or_default();
            if spec.pool.generation < pool.generation {
                continue;
            }
            if spec.pool.generation > pool.generation {
                *pool = Pool {
                    generation: spec.pool.generation,
                    ..Pool::default()
                };
            }
            for device in spec.devices.iter().flatten() {
                if let Some(id) = &device.id {
                    pool.names.insert(id.clone(), device.name.clone());
                }
                if let Some(memory) = device.memory {
                    pool.memory.insert(device.name.clone(), memory);
                }
                if !device.consumes.is_empty() {
                    let consumes = device
                        .consumes
                        .iter()
                        .map(|c| (c.counter_set.clone(), amounts(&c.counters, u64::MAX)))
                        .collect();
                    pool.consumes.insert(device.name.clone(), consumes);
                }
            }
            for set in &spec.shared_counters {
                pool.counters
                    .insert(set.name.clone(), amounts(&set.counters, 0));
            }
        }
        Self { by_node }
    }

    /// The node's pool, when the node offers its GPUs through DRA.
    pub fn node(&self, node: &str) -> Option<&Pool> {
        self.by_node.get(node)
    }
}

/// The pools of the cached slices, built again only when the slices changed:
/// every reconcile reads them, and building them from 5,000 nodes' slices
/// takes 30 ms (`cargo bench --bench controller`). A slice the store replaced
/// is a new `Arc`, so the slices are the same when the store gives back the
/// very same `Arc`s in the same order. The memo holds the slices it was built
/// from: a freed one's address could come back as a new slice's.
#[derive(Default)]
pub(crate) struct PoolsMemo {
    last: Mutex<Option<Built>>,
}

struct Built {
    driver: String,
    slices: Vec<Arc<CachedSlice>>,
    pools: Arc<Pools>,
}

impl PoolsMemo {
    /// `Pools::of(slices, driver)`, from the last call's when it had the same.
    pub(crate) fn of(&self, slices: Vec<Arc<CachedSlice>>, driver: &str) -> Arc<Pools> {
        let mut last = lock(&self.last);
        if let Some(built) = last.as_ref()
            && built.driver == driver
            && built.slices.len() == slices.len()
            && built
                .slices
                .iter()
                .zip(&slices)
                .all(|(a, b)| Arc::ptr_eq(a, b))
        {
            return Arc::clone(&built.pools);
        }
        let pools = Arc::new(Pools::of(&slices, driver));
        *last = Some(Built {
            driver: driver.to_string(),
            slices,
            pools: Arc::clone(&pools),
        });
        pools
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

    use super::*;
    use crate::controller::dra::cached_slice::{CachedDevice, CachedPool, CachedSliceSpec};

    /// A slice of `driver` for `node` at `generation` with `(id, name)` devices.
    pub(crate) fn slice(
        driver: &str,
        node: &str,
        generation: i64,
        devices: &[(&str, &str)],
    ) -> Arc<CachedSlice> {
        Arc::new(CachedSlice {
            metadata: ObjectMeta {
                name: Some(format!("{node}-{generation}")),
                ..ObjectMeta::default()
            },
            spec: CachedSliceSpec {
                driver: driver.into(),
                node_name: Some(node.into()),
                pool: CachedPool {
                    name: node.into(),
                    generation,
                },
                devices: Some(
                    devices
                        .iter()
                        .map(|(id, name)| CachedDevice {
                            name: (*name).into(),
                            id: Some((*id).into()),
                            memory: Some(80 << 30),
                            consumes: Vec::new(),
                        })
                        .collect(),
                ),
                shared_counters: Vec::new(),
            },
        })
    }

    #[test]
    fn each_node_pool_maps_ids_to_names_at_its_newest_generation() {
        let d = "gpu.tessera.dev";
        let pools = Pools::of(
            &[
                slice(d, "n1", 1, &[("GPU-A", "old-a")]),
                slice(d, "n1", 2, &[("GPU-A", "gpu-a"), ("GPU-B", "gpu-b")]),
                slice(d, "n2", 1, &[("X", "x")]),
                slice("other.dev", "n3", 1, &[("Y", "y")]),
            ],
            d,
        );
        let n1 = pools.node("n1").unwrap();
        assert_eq!(n1.generation, 2);
        assert_eq!(n1.names["GPU-A"], "gpu-a");
        assert_eq!(n1.names.len(), 2);
        assert_eq!(pools.node("n2").unwrap().names["X"], "x");
        assert!(
            pools.node("n3").is_none(),
            "another driver's node is not a DRA node of ours"
        );
    }

    #[test]
    fn the_memo_builds_again_exactly_when_the_slices_changed() {
        let d = "gpu.tessera.dev";
        let memo = PoolsMemo::default();
        let n1 = slice(d, "n1", 1, &[("GPU-A", "gpu-a")]);
        let n2 = slice(d, "n2", 1, &[("GPU-B", "gpu-b")]);
        let first = memo.of(vec![Arc::clone(&n1), Arc::clone(&n2)], d);
        let again = memo.of(vec![Arc::clone(&n1), Arc::clone(&n2)], d);
        assert!(
            Arc::ptr_eq(&first, &again),
            "the same slices: not built again"
        );

        // The store replaced n2's slice: a new object.
        let n2_again = slice(d, "n2", 2, &[("GPU-B", "gpu-b2")]);
        let changed = memo.of(vec![Arc::clone(&n1), Arc::clone(&n2_again)], d);
        assert_eq!(changed.node("n2").unwrap().names["GPU-B"], "gpu-b2");

        let gone = memo.of(vec![Arc::clone(&n1)], d);
        assert!(gone.node("n2").is_none(), "a deleted slice's node goes");
        let reordered = memo.of(vec![Arc::clone(&n2_again), Arc::clone(&n1)], d);
        assert_eq!(*reordered, Pools::of(&[n1.clone(), n2_again.clone()], d));
        let other_driver = memo.of(vec![Arc::clone(&n1), Arc::clone(&n2_again)], "other.dev");
        assert!(
            other_driver.node("n1").is_none(),
            "the driver is part of the key"
        );
    }
}
