//! The device view's `allocated` map (which the publisher puts on the Node)
//! and its holdings (which the device metrics are labelled with), kept equal
//! to the allocations in the checkpoint once the binding index is attached
//! to a view.

use std::collections::BTreeMap;
use std::sync::{Mutex, OnceLock, PoisonError};

use crate::agent::holders::Holding;
use crate::agent::state::ViewTx;

/// The device view the binding index keeps, once attached.
#[derive(Debug, Default)]
pub(super) struct AllocatedView {
    view: OnceLock<ViewTx>,
    /// The checkpoint generation last put into the view.
    shown_generation: Mutex<u64>,
}

impl AllocatedView {
    /// Attaches `view`; `false` (and `view` is dropped) when one is attached already.
    pub(super) fn attach(&self, view: ViewTx) -> bool {
        self.view.set(view).is_ok()
    }

    pub(super) fn is_attached(&self) -> bool {
        self.view.get().is_some()
    }

    /// Puts the allocated set of checkpoint `generation` and its holdings
    /// into the view, unless a newer one is there already (two changes
    /// racing to the view).
    pub(super) fn show(
        &self,
        generation: u64,
        (allocated, holdings): (BTreeMap<String, String>, Vec<Holding>),
    ) {
        let Some(view) = self.view.get() else {
            return;
        };
        let mut shown = self
            .shown_generation
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if *shown > generation {
            return;
        }
        *shown = generation;
        view.send_if_modified(|state| {
            if state.allocated == allocated && state.holdings == holdings {
                false
            } else {
                state.allocated = allocated;
                state.holdings = holdings;
                true
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use crate::agent::binding::Binder;
    use crate::agent::binding::BindingConfig;
    use crate::agent::binding::checkpoint::{Allocation, Checkpoint, CheckpointWriter};
    use crate::agent::binding::index::BindingIndex;
    use crate::agent::binding::ledger::UNBOUND;
    use crate::agent::binding::test_pods::{ids, pod};
    use crate::agent::holders::Holder;
    use crate::agent::state::{ViewRx, channel};

    fn owners(view: &ViewRx) -> Vec<(String, String)> {
        view.borrow()
            .allocated
            .iter()
            .map(|(device, owner)| (device.clone(), owner.clone()))
            .collect()
    }

    fn pairs(owners: &[(&str, &str)]) -> Vec<(String, String)> {
        owners
            .iter()
            .map(|(device, owner)| (device.to_string(), owner.to_string()))
            .collect()
    }

    #[test]
    fn the_view_follows_the_checkpoint() {
        let index = BindingIndex::open(BindingConfig::in_memory());
        let (tx, mut rx) = channel("fake");
        let mut shard = pod("uid-a", "Pending", "g0,g1");
        shard.metadata.labels = Some(
            [
                (
                    tessera_core::api::INSTANCE_LABEL.to_string(),
                    "llama".to_string(),
                ),
                (
                    tessera_core::api::SHARD_ANNOTATION.to_string(),
                    "1".to_string(),
                ),
            ]
            .into(),
        );
        index.resync([shard.clone()]);
        assert!(!index.keeps_allocated_view());
        index.keep_view(tx.clone());
        assert!(index.keeps_allocated_view());
        assert!(owners(&rx).is_empty());

        rx.mark_unchanged();
        index.check_allocate(&ids(&["g1", "g0"])).unwrap();
        assert!(rx.has_changed().unwrap());
        assert_eq!(owners(&rx), pairs(&[("g0", "uid-a"), ("g1", "uid-a")]));
        // Held by the shard its pod's labels name.
        let holders: Vec<_> = rx
            .borrow()
            .holdings
            .iter()
            .map(|h| (h.device.clone(), h.holder.clone()))
            .collect();
        let shard_1 = Holder {
            namespace: "ns".into(),
            pod: "pod-uid-a".into(),
            instance: "llama".into(),
            replica: "0".into(),
            shard: "1".into(),
        };
        assert_eq!(
            holders,
            [
                ("g0".to_string(), shard_1.clone()),
                ("g1".to_string(), shard_1)
            ]
        );
        // A device no plan names goes to a pod the agent cannot identify.
        index.check_allocate(&ids(&["g5"])).unwrap();
        assert_eq!(
            owners(&rx),
            pairs(&[("g0", "uid-a"), ("g1", "uid-a"), ("g5", UNBOUND)])
        );
        assert_eq!(rx.borrow().allocated, index.allocated_devices());

        // A pod update that changes nothing recorded does not touch the view.
        shard.status.as_mut().unwrap().phase = Some("Running".into());
        rx.mark_unchanged();
        index.apply_pod(&shard);
        assert!(!rx.has_changed().unwrap());

        // The pod ends: its devices leave the view.
        shard.status.as_mut().unwrap().phase = Some("Succeeded".into());
        index.apply_pod(&shard);
        assert_eq!(owners(&rx), pairs(&[("g5", UNBOUND)]));
        assert_eq!(rx.borrow().allocated, index.allocated_devices());
        assert!(rx.borrow().holdings.is_empty());

        // Only the first view is kept.
        let (other, other_rx) = channel("fake");
        index.keep_view(other);
        assert!(owners(&other_rx).is_empty());
    }

    #[test]
    fn the_view_is_seeded_from_the_checkpoint_and_tidied_by_the_first_list() {
        let dir = std::env::temp_dir().join(format!("tessera-binding-view-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let path = dir.join("checkpoint.json");
        let mut pods = BTreeMap::new();
        for (uid, device) in [("uid-live", "g0"), ("uid-gone", "g1")] {
            pods.insert(
                uid.to_string(),
                Allocation {
                    pod: format!("ns/pod-{uid}"),
                    devices: ids(&[device]),
                    time: "2025-01-01T00:00:00Z".into(),
                },
            );
        }
        let checkpoint = Checkpoint {
            pods,
            ..Checkpoint::default()
        };
        CheckpointWriter::new(path.clone(), false)
            .write(1, &serde_json::to_vec(&checkpoint).unwrap());

        let index = BindingIndex::open(BindingConfig::at(&path));
        let (tx, rx) = channel("fake");
        index.keep_view(tx);
        // Before the pods are listed every recorded allocation counts.
        assert_eq!(
            owners(&rx),
            pairs(&[("g0", "uid-live"), ("g1", "uid-gone")])
        );
        index.resync([pod("uid-live", "Running", "g0")]);
        assert_eq!(owners(&rx), pairs(&[("g0", "uid-live")]));
        // The pod is deleted.
        index.delete_pod(&pod("uid-live", "Running", "g0"));
        assert!(owners(&rx).is_empty());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
