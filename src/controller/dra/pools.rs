//! What the node agents publish as DRA drivers, read from their
//! ResourceSlices: which nodes offer their GPUs through DRA, and each
//! device's name in its pool (an allocation names the slice's device; plans
//! name tessera's device ID, the `id` attribute).

use std::collections::BTreeMap;
use std::sync::Arc;

use k8s_openapi::api::resource::v1::{Device, ResourceSlice, ResourceSliceSpec};
use tessera_core::api::DRA_ID_ATTRIBUTE;

/// One node's pool: device ID → device name, at the pool's generation.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct Pool {
    pub(crate) generation: i64,
    pub(crate) names: BTreeMap<String, String>,
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
pub(crate) struct Pools {
    by_node: BTreeMap<String, Pool>,
}

impl Pools {
    /// The pools of `driver` in `slices`. Per pool only the newest
    /// generation's slices count (older ones are being replaced).
    pub(crate) fn of(slices: &[Arc<ResourceSlice>], driver: &str) -> Self {
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
                    names: BTreeMap::new(),
                };
            }
            for device in spec.devices.iter().flatten() {
                let id = device
                    .attributes
                    .as_ref()
                    .and_then(|a| a.get(DRA_ID_ATTRIBUTE))
                    .and_then(|a| a.string.clone());
                if let Some(id) = id {
                    pool.names.insert(id, device.name.clone());
                }
            }
        }
        Self { by_node }
    }

    /// Drops what `of` does not read from a slice the controller caches:
    /// the devices' other attributes, capacity and taints, labels, owners
    /// and managed fields. At 5,000 nodes the slices kept whole took most of
    /// the controller's memory.
    pub(crate) fn keep_what_is_read(slice: &mut ResourceSlice) {
        let metadata = &mut slice.metadata;
        metadata.managed_fields = None;
        metadata.labels = None;
        metadata.annotations = None;
        metadata.owner_references = None;
        let spec = std::mem::take(&mut slice.spec);
        slice.spec = ResourceSliceSpec {
            driver: spec.driver,
            node_name: spec.node_name,
            pool: spec.pool,
            devices: spec.devices.map(|devices| {
                devices
                    .into_iter()
                    .map(|device| Device {
                        name: device.name,
                        attributes: device.attributes.and_then(|mut attributes| {
                            attributes
                                .remove_entry(DRA_ID_ATTRIBUTE)
                                .map(|id| BTreeMap::from([id]))
                        }),
                        ..Device::default()
                    })
                    .collect()
            }),
            ..ResourceSliceSpec::default()
        };
    }

    /// The node's pool, when the node offers its GPUs through DRA.
    pub(crate) fn node(&self, node: &str) -> Option<&Pool> {
        self.by_node.get(node)
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use k8s_openapi::api::resource::v1::{
        DeviceAttribute, DeviceCapacity, DeviceTaint, ResourcePool,
    };
    use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

    use super::*;

    /// A slice of `driver` for `node` at `generation` with `(id, name)` devices.
    pub(crate) fn slice(
        driver: &str,
        node: &str,
        generation: i64,
        devices: &[(&str, &str)],
    ) -> Arc<ResourceSlice> {
        Arc::new(ResourceSlice {
            metadata: ObjectMeta {
                name: Some(format!("{node}-{generation}")),
                ..ObjectMeta::default()
            },
            spec: ResourceSliceSpec {
                driver: driver.into(),
                node_name: Some(node.into()),
                pool: ResourcePool {
                    name: node.into(),
                    generation,
                    resource_slice_count: 1,
                },
                devices: Some(
                    devices
                        .iter()
                        .map(|(id, name)| Device {
                            name: (*name).into(),
                            attributes: Some(BTreeMap::from([(
                                DRA_ID_ATTRIBUTE.to_string(),
                                DeviceAttribute {
                                    string: Some((*id).into()),
                                    ..DeviceAttribute::default()
                                },
                            )])),
                            ..Device::default()
                        })
                        .collect(),
                ),
                ..ResourceSliceSpec::default()
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
    fn a_slice_kept_small_gives_the_same_pools() {
        let d = "gpu.tessera.dev";
        let mut whole = (*slice(d, "n1", 3, &[("GPU-A", "gpu-a"), ("GPU-B", "gpu-b")])).clone();
        whole.metadata.labels = Some(BTreeMap::from([("a".to_string(), "b".to_string())]));
        let text = |value: &str| DeviceAttribute {
            string: Some(value.into()),
            ..DeviceAttribute::default()
        };
        for device in whole.spec.devices.iter_mut().flatten() {
            let attributes = device.attributes.get_or_insert_default();
            attributes.insert("vendor".into(), text("nvidia"));
            attributes.insert("uuid".into(), text("GPU-0000"));
            device.capacity = Some(BTreeMap::from([(
                "memory".to_string(),
                DeviceCapacity {
                    value: Quantity("80Gi".into()),
                    ..DeviceCapacity::default()
                },
            )]));
            device.taints = Some(vec![DeviceTaint {
                key: "gpu.tessera.dev/unhealthy".into(),
                effect: "NoSchedule".into(),
                ..DeviceTaint::default()
            }]);
        }
        // A device without the ID attribute stays, named, with none.
        let mut unnamed = whole.spec.devices.as_ref().unwrap()[0].clone();
        unnamed.name = "no-id".into();
        unnamed
            .attributes
            .as_mut()
            .unwrap()
            .remove(DRA_ID_ATTRIBUTE);
        whole.spec.devices.as_mut().unwrap().push(unnamed);
        let mut kept = whole.clone();
        Pools::keep_what_is_read(&mut kept);
        assert_eq!(
            Pools::of(&[Arc::new(kept.clone())], d),
            Pools::of(&[Arc::new(whole)], d)
        );
        assert_eq!(kept.metadata.labels, None);
        assert_eq!(
            (kept.spec.pool.name.as_str(), kept.spec.pool.generation),
            ("n1", 3)
        );
        let devices = kept.spec.devices.unwrap();
        assert_eq!(devices.len(), 3);
        for device in &devices {
            assert!(device.capacity.is_none() && device.taints.is_none());
        }
        assert_eq!(devices[0].attributes.as_ref().unwrap().len(), 1);
        assert_eq!(devices[2].attributes, None);
    }
}
