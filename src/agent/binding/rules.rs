//! The binding rules that answer kubelet's two questions about a request:
//! which planned devices to prefer ([`Ledger::preferred_plan`]) and whether
//! an allocation may go ahead ([`Ledger::check`]). A refusal
//! ([`AllocationRefused`]) names the pod and the device sets involved, so
//! the pod fails admission with a reason and the controller re-places it.

use std::collections::HashSet;

use super::changes::CheckpointChange;
use super::checkpoint::Allocation;
use super::device_set::{contains, overlaps, sorted_set};
use super::ledger::{Ledger, PendingPlan};
use super::pods::Phase;

/// Why an allocation was refused. The text is what kubelet reports for the
/// failed container, so it says what to look at.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub(super) enum AllocationRefused {
    /// Before the first list of the node's pods a plan cannot be told apart
    /// from no plan.
    #[error(
        "the pods on this node have not been listed yet, so planned bindings cannot be checked; refusing {} for now",
        show(.requested)
    )]
    PodsNotListed { requested: Vec<String> },

    /// Some of the devices are recorded for a pod that still holds them.
    #[error(
        "{} already allocated to pod {pod} (uid {uid}){}; refusing to hand out {} twice",
        devices_are(.held),
        recorded_since(.since),
        show(.requested)
    )]
    AlreadyAllocated {
        /// `namespace/name` of the holder.
        pod: String,
        uid: String,
        /// When the holder's allocation was recorded, if known.
        since: Option<String>,
        /// The requested devices the holder has.
        held: Vec<String>,
        requested: Vec<String>,
    },

    /// The request is exactly a pending pod's plan, but a device of it is
    /// still recorded for a pod without a binding.
    #[error(
        "pod {pod} was planned on {} but {} still recorded for a pod without a binding; refusing so the controller can re-place it",
        show(.planned),
        devices_are(.held_unbound)
    )]
    PlanHeldUnbound {
        pod: String,
        planned: Vec<String>,
        held_unbound: Vec<String>,
    },

    /// The request overlaps pending plans without equalling any; `pod` is
    /// the oldest of them.
    #[error(
        "pod {pod} was planned on {} but kubelet chose {}{}; refusing so the controller can re-place it",
        show(.planned),
        show(.requested),
        more_pending(.other_pending)
    )]
    NotThePlan {
        pod: String,
        planned: Vec<String>,
        requested: Vec<String>,
        /// Further pending pods whose plans overlap the request.
        other_pending: usize,
    },

    /// The request overlaps no plan, yet only the planned pod `pod` waits
    /// for this many devices.
    #[error(
        "pod {pod} was planned on {} but kubelet chose {}, and no pod without a binding is waiting for devices on this node; refusing so the controller can re-place it",
        show(.planned),
        show(.requested)
    )]
    PlanPassedOver {
        pod: String,
        planned: Vec<String>,
        requested: Vec<String>,
    },
}

/// `[a, b]`.
fn show(devices: &[String]) -> String {
    format!("[{}]", devices.join(", "))
}

/// `device a is` or `devices [a, b] are`.
fn devices_are(devices: &[String]) -> String {
    match devices {
        [device] => format!("device {device} is"),
        _ => format!("devices {} are", show(devices)),
    }
}

/// ` since <time>`, when the time is known.
fn recorded_since(recorded: &Option<String>) -> String {
    recorded
        .as_ref()
        .map(|time| format!(" since {time}"))
        .unwrap_or_default()
}

fn more_pending(others: &usize) -> String {
    match others {
        0 => String::new(),
        1 => " (1 more pending pod is planned on some of them)".to_string(),
        count => format!(" ({count} more pending pods are planned on some of them)"),
    }
}

/// The plan kubelet is pointed to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Preference {
    /// `namespace/name` of the planned pod.
    pub(super) pod: String,
    pub(super) devices: Vec<String>,
    /// How many pending plans fit the request.
    pub(super) candidates: usize,
}

impl Ledger {
    /// The plan of the oldest pending pod that fits kubelet's request (all
    /// planned devices offered, every must-include device planned, `size`
    /// devices) and whose devices are not recorded as in use.
    pub(super) fn preferred_plan(
        &self,
        available: &[String],
        must_include: &[String],
        size: usize,
    ) -> Option<Preference> {
        if !self.synced {
            return None;
        }
        let fitting = self.plans_fitting(available, must_include, size);
        // Devices recorded as in use are not offered, even if kubelet lists them.
        let used = self.in_use();
        let chosen = fitting.iter().find(|pending| {
            pending
                .plan
                .devices
                .iter()
                .all(|device| !used.contains(device.as_str()))
        })?;
        Some(Preference {
            pod: chosen.pod.key.clone(),
            devices: chosen.plan.devices.clone(),
            candidates: fitting.len(),
        })
    }

    /// Pending plans of `size` offered devices including every must-include
    /// one, oldest first.
    fn plans_fitting(
        &self,
        available: &[String],
        must_include: &[String],
        size: usize,
    ) -> Vec<PendingPlan<'_>> {
        let offered: HashSet<&str> = available
            .iter()
            .chain(must_include)
            .map(String::as_str)
            .collect();
        let mut fitting: Vec<PendingPlan<'_>> = self
            .pending()
            .filter(|pending| {
                let plan = pending.plan;
                plan.devices.len() == size
                    && plan
                        .devices
                        .iter()
                        .all(|device| offered.contains(device.as_str()))
                    && must_include
                        .iter()
                        .all(|device| contains(&plan.sorted, device))
            })
            .collect();
        fitting.sort_by(|left, right| left.pod.age_key().cmp(&right.pod.age_key()));
        fitting
    }

    /// Whether `requested` is what the index expects kubelet to ask for: a
    /// pending pod's plan, or again the devices of a pod still being
    /// admitted. Anything else may concern a pod the watch has not
    /// delivered yet.
    pub(super) fn expects(&self, requested: &[String]) -> bool {
        if !self.synced {
            return false;
        }
        let wanted = sorted_set(requested);
        self.pending().any(|pending| pending.plan.sorted == wanted)
            || self.checkpoint.pods.iter().any(|(uid, allocation)| {
                sorted_set(&allocation.devices) == wanted && self.holds(uid)
            })
    }

    /// The verdict on `requested` (one container's devices), and the
    /// checkpoint change it made.
    pub(super) fn check(
        &mut self,
        requested: &[String],
    ) -> Result<Option<CheckpointChange>, AllocationRefused> {
        if !self.synced {
            return Err(AllocationRefused::PodsNotListed {
                requested: requested.to_vec(),
            });
        }
        let wanted = sorted_set(requested);
        let overlapping: Vec<PendingPlan<'_>> = self
            .pending()
            .filter(|pending| overlaps(&pending.plan.sorted, &wanted))
            .collect();
        if let Some((uid, allocation)) = self.live_allocation_sharing(&wanted) {
            if self.readmits(uid, allocation, &wanted, overlapping.is_empty()) {
                return Ok(None);
            }
            return Err(already_allocated(uid, allocation, &wanted, requested));
        }
        if let Some(oldest) = PendingPlan::oldest(overlapping.iter().copied()) {
            let (uid, allocation) =
                self.planned_allocation(&overlapping, oldest, &wanted, requested)?;
            return Ok(Some(self.record_for_pod(uid, allocation)));
        }
        if let Some(refusal) = self.planned_pod_passed_over(&wanted, requested) {
            return Err(refusal);
        }
        Ok(Some(self.record_unbound(&wanted, requested)))
    }

    /// The first recorded allocation sharing a device with `wanted` whose
    /// pod may still hold it.
    fn live_allocation_sharing(&self, wanted: &[String]) -> Option<(&String, &Allocation)> {
        self.checkpoint.pods.iter().find(|(uid, allocation)| {
            allocation
                .devices
                .iter()
                .any(|device| contains(wanted, device))
                && self.holds(uid)
        })
    }

    /// Kubelet asking again for the very devices of a pod it is still
    /// admitting (an init container, then the app container) is fine.
    fn readmits(
        &self,
        uid: &str,
        allocation: &Allocation,
        wanted: &[String],
        no_plan_overlaps: bool,
    ) -> bool {
        sorted_set(&allocation.devices) == wanted
            && no_plan_overlaps
            && self
                .pods
                .get(uid)
                .is_some_and(|pod| pod.phase == Phase::Waiting)
    }

    /// The request overlaps the pending plans `overlapping` (`oldest` the
    /// oldest of them): what to record for the oldest pod planned on exactly
    /// the requested devices, or a refusal when there is none or a device of
    /// its plan is still recorded under `unbound`.
    fn planned_allocation(
        &self,
        overlapping: &[PendingPlan<'_>],
        oldest: PendingPlan<'_>,
        wanted: &[String],
        requested: &[String],
    ) -> Result<(String, Allocation), AllocationRefused> {
        let exact = overlapping
            .iter()
            .copied()
            .filter(|pending| pending.plan.sorted == wanted);
        let Some(exact) = PendingPlan::oldest(exact) else {
            return Err(not_the_plan(oldest, overlapping.len() - 1, requested));
        };
        let held_unbound = self.held_unbound(&exact.plan.sorted);
        if !held_unbound.is_empty() {
            return Err(AllocationRefused::PlanHeldUnbound {
                pod: exact.pod.key.clone(),
                planned: exact.plan.devices.clone(),
                held_unbound,
            });
        }
        let allocation =
            Allocation::recorded_now(exact.pod.key.clone(), exact.plan.devices.clone());
        Ok((exact.uid.to_string(), allocation))
    }

    /// Records `allocation` for the pod `uid`.
    fn record_for_pod(&mut self, uid: String, allocation: Allocation) -> CheckpointChange {
        let change = CheckpointChange::Allocated {
            pod: allocation.pod.clone(),
            devices: allocation.devices.clone(),
        };
        self.checkpoint.pods.insert(uid, allocation);
        change
    }

    /// Devices of the sorted set `devices` recorded under `unbound`.
    fn held_unbound(&self, devices: &[String]) -> Vec<String> {
        self.checkpoint
            .unbound
            .iter()
            .flat_map(|allocation| &allocation.devices)
            .filter(|device| contains(devices, device))
            .cloned()
            .collect()
    }

    /// A request that overlaps no plan: were only planned pods waiting for
    /// this many devices, it must be one of them getting devices it was not
    /// planned on.
    fn planned_pod_passed_over(
        &self,
        wanted: &[String],
        requested: &[String],
    ) -> Option<AllocationRefused> {
        let ordinary_waiting = self
            .pods
            .values()
            .any(|pod| pod.ordinary_user() && pod.phase == Phase::Waiting && !pod.deleting);
        if ordinary_waiting {
            return None;
        }
        let same_size = self
            .pending()
            .filter(|pending| pending.plan.sorted.len() == wanted.len());
        let passed_over = PendingPlan::oldest(same_size)?;
        Some(AllocationRefused::PlanPassedOver {
            pod: passed_over.pod.key.clone(),
            planned: passed_over.plan.devices.clone(),
            requested: requested.to_vec(),
        })
    }

    /// Records `requested` under `unbound`.
    fn record_unbound(&mut self, wanted: &[String], requested: &[String]) -> CheckpointChange {
        // A device handed out again without a binding: its older entry is stale.
        for allocation in &mut self.checkpoint.unbound {
            allocation
                .devices
                .retain(|device| !contains(wanted, device));
        }
        self.checkpoint
            .unbound
            .retain(|allocation| !allocation.devices.is_empty());
        self.checkpoint
            .unbound
            .push(Allocation::recorded_now(String::new(), requested.to_vec()));
        CheckpointChange::AllocatedUnbound {
            devices: requested.to_vec(),
        }
    }
}

fn already_allocated(
    uid: &str,
    allocation: &Allocation,
    wanted: &[String],
    requested: &[String],
) -> AllocationRefused {
    AllocationRefused::AlreadyAllocated {
        pod: allocation.pod.clone(),
        uid: uid.to_string(),
        since: (!allocation.time.is_empty()).then(|| allocation.time.clone()),
        held: allocation
            .devices
            .iter()
            .filter(|device| contains(wanted, device))
            .cloned()
            .collect(),
        requested: requested.to_vec(),
    }
}

/// The request overlaps pending plans without equalling any: the oldest
/// of them was passed over.
fn not_the_plan(
    oldest: PendingPlan<'_>,
    other_pending: usize,
    requested: &[String],
) -> AllocationRefused {
    AllocationRefused::NotThePlan {
        pod: oldest.pod.key.clone(),
        planned: oldest.plan.devices.clone(),
        requested: requested.to_vec(),
        other_pending,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::agent::binding::checkpoint::Checkpoint;
    use crate::agent::binding::pods::pod_info;
    use crate::agent::binding::test_pods::{ids, pod};
    use tessera_core::api::DEFAULT_RESOURCE_NAME;

    /// A ledger after the first list of `pods`.
    fn listed(pods: &[(&str, &str, &str)]) -> Ledger {
        let mut ledger = Ledger::new(Checkpoint::default());
        for (uid, phase, devices) in pods {
            let (uid, info) = pod_info(&pod(uid, phase, devices), DEFAULT_RESOURCE_NAME)
                .expect("a test pod has a UID");
            ledger.pods.insert(uid, info);
        }
        ledger.synced = true;
        ledger
    }

    #[test]
    fn nothing_is_allowed_before_the_pods_are_listed() {
        let mut ledger = Ledger::new(Checkpoint::default());
        let refusal = ledger.check(&ids(&["g1"])).unwrap_err();
        assert_eq!(
            refusal,
            AllocationRefused::PodsNotListed {
                requested: ids(&["g1"])
            }
        );
        assert_eq!(
            refusal.to_string(),
            "the pods on this node have not been listed yet, so planned bindings cannot be checked; refusing [g1] for now"
        );
    }

    #[test]
    fn a_request_equal_to_a_plan_is_recorded_for_its_pod() {
        let mut ledger = listed(&[("uid-a", "Pending", "g0,g1")]);
        let change = ledger.check(&ids(&["g1", "g0"])).unwrap();
        assert_eq!(
            change,
            Some(CheckpointChange::Allocated {
                pod: "ns/pod-uid-a".into(),
                devices: ids(&["g0", "g1"]),
            })
        );
        assert_eq!(ledger.checkpoint.pods["uid-a"].devices, ids(&["g0", "g1"]));
        // The same pod's next container asks again for the same devices.
        assert_eq!(ledger.check(&ids(&["g0", "g1"])), Ok(None));
    }

    #[test]
    fn a_request_overlapping_a_plan_names_the_pod_and_both_sets() {
        let mut ledger = listed(&[("uid-a", "Pending", "g0,g1"), ("uid-b", "Pending", "g1,g2")]);
        let refusal = ledger.check(&ids(&["g1", "g3"])).unwrap_err();
        let AllocationRefused::NotThePlan {
            pod,
            planned,
            requested,
            other_pending,
        } = &refusal
        else {
            panic!("{refusal:?}");
        };
        assert_eq!(pod, "ns/pod-uid-a");
        assert_eq!(planned, &ids(&["g0", "g1"]));
        assert_eq!(requested, &ids(&["g1", "g3"]));
        assert_eq!(*other_pending, 1);
        assert_eq!(
            refusal.to_string(),
            "pod ns/pod-uid-a was planned on [g0, g1] but kubelet chose [g1, g3] (1 more pending pod is planned on some of them); refusing so the controller can re-place it"
        );
    }

    #[test]
    fn devices_of_a_live_pod_are_not_handed_out_twice() {
        let mut ledger = listed(&[("uid-a", "Running", "g0,g1")]);
        ledger.checkpoint.pods.insert(
            "uid-a".into(),
            Allocation {
                pod: "ns/pod-uid-a".into(),
                devices: ids(&["g0", "g1"]),
                time: "2025-06-01T12:00:00Z".into(),
            },
        );
        let refusal = ledger.check(&ids(&["g1", "g2"])).unwrap_err();
        assert_eq!(
            refusal,
            AllocationRefused::AlreadyAllocated {
                pod: "ns/pod-uid-a".into(),
                uid: "uid-a".into(),
                since: Some("2025-06-01T12:00:00Z".into()),
                held: ids(&["g1"]),
                requested: ids(&["g1", "g2"]),
            }
        );
        assert_eq!(
            refusal.to_string(),
            "device g1 is already allocated to pod ns/pod-uid-a (uid uid-a) since 2025-06-01T12:00:00Z; refusing to hand out [g1, g2] twice"
        );
    }

    #[test]
    fn a_plan_still_held_unbound_is_refused() {
        let mut ledger = listed(&[("uid-a", "Pending", "g0,g1")]);
        ledger
            .checkpoint
            .unbound
            .push(Allocation::recorded_now(String::new(), ids(&["g1"])));
        let refusal = ledger.check(&ids(&["g0", "g1"])).unwrap_err();
        assert_eq!(
            refusal.to_string(),
            "pod ns/pod-uid-a was planned on [g0, g1] but device g1 is still recorded for a pod without a binding; refusing so the controller can re-place it"
        );
    }

    #[test]
    fn a_request_matching_no_plan_while_only_planned_pods_wait_is_refused() {
        let mut ledger = listed(&[("uid-a", "Pending", "g0,g1")]);
        let refusal = ledger.check(&ids(&["g4", "g5"])).unwrap_err();
        assert_eq!(
            refusal,
            AllocationRefused::PlanPassedOver {
                pod: "ns/pod-uid-a".into(),
                planned: ids(&["g0", "g1"]),
                requested: ids(&["g4", "g5"]),
            }
        );
        // A request of another size is some other pod's, recorded as unbound.
        assert_eq!(
            ledger.check(&ids(&["g4"])),
            Ok(Some(CheckpointChange::AllocatedUnbound {
                devices: ids(&["g4"])
            }))
        );
    }

    #[test]
    fn the_oldest_free_fitting_plan_is_preferred() {
        let ledger = listed(&[("uid-a", "Pending", "g0,g1"), ("uid-b", "Pending", "g2,g3")]);
        let preference = ledger
            .preferred_plan(&ids(&["g0", "g1", "g2", "g3"]), &ids(&["g2"]), 2)
            .unwrap();
        assert_eq!(preference.pod, "ns/pod-uid-b");
        assert_eq!(preference.devices, ids(&["g2", "g3"]));
        assert_eq!(preference.candidates, 1);
        assert_eq!(ledger.preferred_plan(&ids(&["g0"]), &[], 2), None);
    }
}
