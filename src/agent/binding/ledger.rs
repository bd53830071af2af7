//! The allocation ledger the binding index keeps behind its lock: the pods on
//! the node, the allocations recorded for them (the checkpoint), whether the
//! pods have been listed, and which version of the checkpoint this is; with
//! the questions the binding rules ask of it.

use std::collections::{BTreeMap, HashSet};

use super::checkpoint::Checkpoint;
use super::pods::{Plan, PodInfo};
use crate::agent::holders::{Holder, Holding};

/// The owner [`BindingIndex::allocated_devices`](super::BindingIndex::allocated_devices)
/// gives devices recorded under `unbound`.
pub const UNBOUND: &str = tessera_core::api::NodeGpuState::UNBOUND_OWNER;

pub(super) struct Ledger {
    /// Every pod on the node the watch has reported, by UID.
    pub(super) pods: BTreeMap<String, PodInfo>,
    pub(super) checkpoint: Checkpoint,
    /// The pod list has been read at least once: absent pods are really gone.
    pub(super) synced: bool,
    /// Bumped on every checkpoint change; writers skip stale versions.
    pub(super) generation: u64,
}

impl Ledger {
    /// No pods known yet, and `checkpoint` as read at start.
    pub(super) fn new(checkpoint: Checkpoint) -> Self {
        Self {
            pods: BTreeMap::new(),
            checkpoint,
            synced: false,
            generation: 0,
        }
    }

    /// Whether the recorded pod `uid` may still hold its devices.
    pub(super) fn holds(&self, uid: &str) -> bool {
        !self.synced || self.pods.get(uid).is_some_and(PodInfo::live)
    }

    /// Device ID → pod UID (or [`UNBOUND`]) for every recorded allocation.
    pub(super) fn allocated_map(&self) -> BTreeMap<String, String> {
        let mut owners = BTreeMap::new();
        for allocation in &self.checkpoint.unbound {
            for device in &allocation.devices {
                owners.insert(device.clone(), UNBOUND.to_string());
            }
        }
        for (uid, allocation) in &self.checkpoint.pods {
            for device in &allocation.devices {
                owners.insert(device.clone(), uid.clone());
            }
        }
        owners
    }

    /// What the device view shows: the allocated map and its holdings.
    pub(super) fn handed_out(&self) -> (BTreeMap<String, String>, Vec<Holding>) {
        (self.allocated_map(), self.holdings())
    }

    /// Who holds each device allocated to a pod; the pod's labels where the
    /// pod is known, its recorded name otherwise.
    pub(super) fn holdings(&self) -> Vec<Holding> {
        let mut holdings = Vec::new();
        for (uid, allocation) in &self.checkpoint.pods {
            let holder = match self.pods.get(uid) {
                Some(pod) => pod.holder.clone(),
                None => Holder::from_pod_key(&allocation.pod),
            };
            holdings.extend(allocation.devices.iter().map(|device| Holding {
                device: device.clone(),
                memory_share_bytes: None,
                holder: holder.clone(),
            }));
        }
        holdings
    }

    /// Devices recorded as in use.
    pub(super) fn in_use(&self) -> HashSet<&str> {
        let mut used: HashSet<&str> = HashSet::new();
        for (uid, allocation) in &self.checkpoint.pods {
            if self.holds(uid) {
                used.extend(allocation.devices.iter().map(String::as_str));
            }
        }
        for allocation in &self.checkpoint.unbound {
            used.extend(allocation.devices.iter().map(String::as_str));
        }
        used
    }

    /// Pending pods (planned, not started) without a recorded allocation.
    pub(super) fn pending(&self) -> impl Iterator<Item = PendingPlan<'_>> {
        self.pods.iter().filter_map(|(uid, pod)| {
            let plan = pod.plan.as_ref()?;
            (pod.pending() && !self.checkpoint.pods.contains_key(uid)).then_some(PendingPlan {
                uid,
                pod,
                plan,
            })
        })
    }
}

/// A pending pod and its plan.
#[derive(Clone, Copy, Debug)]
pub(super) struct PendingPlan<'a> {
    pub(super) uid: &'a str,
    pub(super) pod: &'a PodInfo,
    pub(super) plan: &'a Plan,
}

impl PendingPlan<'_> {
    /// The oldest of `plans` (see [`PodInfo::age_key`]).
    pub(super) fn oldest<'a>(
        plans: impl IntoIterator<Item = PendingPlan<'a>>,
    ) -> Option<PendingPlan<'a>> {
        plans
            .into_iter()
            .min_by(|left, right| left.pod.age_key().cmp(&right.pod.age_key()))
    }
}
