//! Keeping the checkpoint in step with the pods on the node: entries of pods
//! that ended are dropped, running bound pods without one are recorded, an
//! `unbound` entry is resolved to the pod it was for once that pod shows up,
//! and `unbound` entries no pod can explain any more expire.

use k8s_openapi::jiff::Timestamp;

use super::changes::CheckpointChange;
use super::checkpoint::Allocation;
use super::device_set::sorted_set;
use super::ledger::Ledger;
use super::pods::{Phase, PodInfo};

/// An `unbound` entry this young is kept even when no pod seems to ask for
/// it: the pod may simply not have reached the watch yet.
pub(super) const UNBOUND_GRACE_SECS: i64 = 120;

impl Ledger {
    /// Drops entries of pods that are gone or finished, records running bound
    /// pods that have no entry (e.g. after a lost checkpoint) and trims
    /// `unbound` to what pods without a binding ask for. Every change to the
    /// checkpoint is added to `changes`. Nothing happens before the pods have
    /// been listed: until then an absent pod may just not be known yet.
    pub(super) fn tidy(&mut self, changes: &mut Vec<CheckpointChange>) {
        if !self.synced {
            return;
        }
        self.forget_ended_pods(changes);
        self.resolve_unbound_to_pods(changes);
        self.adopt_running_pods(changes);
        self.expire_unexplained_unbound(changes);
    }

    fn forget_ended_pods(&mut self, changes: &mut Vec<CheckpointChange>) {
        let pods = &self.pods;
        self.checkpoint.pods.retain(|uid, allocation| {
            let live = pods.get(uid).is_some_and(PodInfo::live);
            if !live {
                changes.push(CheckpointChange::Forgot {
                    pod: allocation.pod.clone(),
                    uid: uid.clone(),
                    devices: std::mem::take(&mut allocation.devices),
                });
            }
            live
        });
    }

    /// Kubelet may admit a bound pod before the watch shows its binding: its
    /// Allocate then matched no plan and went under `unbound`. Once the pod
    /// shows up, an `unbound` allocation of exactly its planned devices,
    /// made after the pod was created, was that pod's.
    fn resolve_unbound_to_pods(&mut self, changes: &mut Vec<CheckpointChange>) {
        for (uid, pod) in &self.pods {
            let Some(plan) = &pod.plan else {
                continue;
            };
            if !pod.live() || self.checkpoint.pods.contains_key(uid) {
                continue;
            }
            let made_after_pod =
                |allocation: &Allocation| match (pod.created, allocation.recorded_at()) {
                    (Some(created), Some(recorded)) => recorded >= created,
                    _ => false,
                };
            let Some(position) = self.checkpoint.unbound.iter().position(|allocation| {
                sorted_set(&allocation.devices) == plan.sorted && made_after_pod(allocation)
            }) else {
                continue;
            };
            let mut allocation = self.checkpoint.unbound.remove(position);
            changes.push(CheckpointChange::Resolved {
                pod: pod.key.clone(),
                devices: allocation.devices.clone(),
            });
            allocation.pod = pod.key.clone();
            self.checkpoint.pods.insert(uid.clone(), allocation);
        }
    }

    /// A running bound pod without an entry (a lost checkpoint, or one
    /// started before the agent enforced bindings) holds its planned devices.
    fn adopt_running_pods(&mut self, changes: &mut Vec<CheckpointChange>) {
        for (uid, pod) in &self.pods {
            if pod.phase == Phase::Running
                && !self.checkpoint.pods.contains_key(uid)
                && let Some(plan) = &pod.plan
            {
                changes.push(CheckpointChange::Adopted {
                    pod: pod.key.clone(),
                    devices: plan.devices.clone(),
                });
                let allocation = Allocation::recorded_now(pod.key.clone(), plan.devices.clone());
                self.checkpoint.pods.insert(uid.clone(), allocation);
            }
        }
    }

    /// `unbound` entries cannot be tied to a pod: they are dropped oldest
    /// first, once past their grace, while they hold more devices than the
    /// live pods without a binding ask for.
    fn expire_unexplained_unbound(&mut self, changes: &mut Vec<CheckpointChange>) {
        let wanted: u64 = self
            .pods
            .values()
            .filter(|pod| pod.ordinary_user())
            .map(|pod| pod.wants)
            .sum();
        let mut held: u64 = self
            .checkpoint
            .unbound
            .iter()
            .map(|allocation| allocation.devices.len() as u64)
            .sum();
        let now = Timestamp::now().as_second();
        let past_grace = |allocation: &Allocation| {
            allocation
                .recorded_at()
                .is_none_or(|recorded| now - recorded.as_second() >= UNBOUND_GRACE_SECS)
        };
        while held > wanted && self.checkpoint.unbound.first().is_some_and(past_grace) {
            let expired = self.checkpoint.unbound.remove(0);
            held -= expired.devices.len() as u64;
            changes.push(CheckpointChange::ForgotUnbound {
                devices: expired.devices,
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
    use k8s_openapi::jiff::SignedDuration;

    use super::*;
    use crate::agent::binding::Binder;
    use crate::agent::binding::BindingConfig;
    use crate::agent::binding::index::BindingIndex;
    use crate::agent::binding::ledger::UNBOUND;
    use crate::agent::binding::test_pods::{ids, pod};

    #[test]
    fn an_allocation_made_before_the_binding_was_seen_is_resolved_to_the_pod() {
        let index = BindingIndex::open(BindingConfig::in_memory());
        index.resync([]);
        // Kubelet admits the shard before the watch has shown it.
        index.check_allocate(&ids(&["g5", "g4"])).unwrap();
        assert_eq!(
            index.allocated_devices(),
            [("g4", UNBOUND), ("g5", UNBOUND)]
                .map(|(device, owner)| (device.to_string(), owner.to_string()))
                .into()
        );
        let mut shard = pod("uid-s", "Pending", "g4,g5");
        shard.metadata.creation_timestamp = Some(Time("2026-01-01T00:00:00Z".parse().unwrap()));
        // A pod whose plan is only part of the allocation is not it.
        let mut partial = pod("uid-p", "Pending", "g4");
        partial.metadata.creation_timestamp = shard.metadata.creation_timestamp.clone();
        index.apply_pod(&partial);
        assert_eq!(index.allocated_devices()["g4"], UNBOUND);
        index.delete_pod(&partial);

        index.apply_pod(&shard);
        let owners = index.allocated_devices();
        assert_eq!(owners["g4"], "uid-s");
        assert_eq!(owners["g5"], "uid-s");
        assert!(index.checkpoint().unbound.is_empty());
        // The shard's next container is admitted on the same devices; no one else is.
        index.check_allocate(&ids(&["g4", "g5"])).unwrap();
        let refused = index.check_allocate(&ids(&["g4"])).unwrap_err();
        assert!(
            refused.contains("already allocated to pod ns/pod-uid-s"),
            "{refused}"
        );
    }

    #[test]
    fn an_unbound_allocation_older_than_the_pod_is_not_the_pods() {
        let index = BindingIndex::open(BindingConfig::in_memory());
        index.resync([]);
        index.check_allocate(&ids(&["g4"])).unwrap();
        let mut later = pod("uid-l", "Pending", "g4");
        later.metadata.creation_timestamp =
            Some(Time(Timestamp::now() + SignedDuration::from_secs(60)));
        index.apply_pod(&later);
        assert_eq!(index.allocated_devices()["g4"], UNBOUND);
    }
}
