//! A move in the moved instance's reconcile, pure: a handed move taken into
//! the status (nothing started before it is written), the surge copy kept
//! while it readies, the switch once every pod of it is Ready, the old
//! copy drained, or the move abandoned with the old copy untouched.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::jiff::Timestamp;
use kube::ResourceExt;

use super::book::Handed;
use super::metrics::MoveOutcome;
use crate::controller::desired::pod_name_of;
use crate::controller::events::EventNote;
use crate::controller::held::Held;
use tessera_core::api::{DEVICES_ANNOTATION, MoveInFlight, MovePhase, PlannedShard};

/// What the reconcile does about moves this time.
#[derive(Debug, Default, PartialEq)]
pub(crate) struct MoveStep {
    /// The move the status carries after this reconcile.
    pub(crate) record: Option<MoveInFlight>,
    /// The new copy's pods are wanted (the move is in the status already).
    pub(crate) surge: bool,
    /// The moved replica's plan from now on: set at the switch.
    pub(crate) switched: Option<(u32, Vec<PlannedShard>)>,
    /// Pods of the old copy to evict.
    pub(crate) evict: Vec<String>,
    pub(crate) note: Option<EventNote>,
    /// Set when the move ended: how, and the GPU-seconds both copies held.
    pub(crate) ended: Option<(MoveOutcome, f64)>,
    /// The replica whose move was abandoned: not moved again for a while.
    pub(crate) back_off: Option<u32>,
}

/// What the move step reads.
pub(crate) struct MoveInputs<'a> {
    pub(crate) instance: &'a str,
    pub(crate) recorded: Option<&'a MoveInFlight>,
    pub(crate) handed: Option<Handed>,
    /// Each replica's shards as the status has them.
    pub(crate) current: &'a [Vec<PlannedShard>],
    /// Whether this reconcile keeps a replica's plan as it is.
    pub(crate) kept: &'a dyn Fn(u32) -> bool,
    /// The instance's shard pods by name.
    pub(crate) pods: &'a BTreeMap<String, Arc<Pod>>,
    /// What others hold.
    pub(crate) held: &'a Held,
    /// Why the target's nodes would refuse the replica's pods, if they would.
    pub(crate) refused_node: &'a dyn Fn(&str) -> Option<String>,
    pub(crate) now: Timestamp,
    /// How long a surge copy has to become Ready.
    pub(crate) timeout: Duration,
}

pub(crate) fn step(inputs: MoveInputs) -> MoveStep {
    match inputs.recorded {
        None => match &inputs.handed {
            Some(handed) => take(&inputs, handed),
            None => MoveStep::default(),
        },
        Some(record) if record.phase == MovePhase::Surging => surging(&inputs, record),
        Some(record) => draining(&inputs, record),
    }
}

/// A handed move becomes the status's record, if it still holds.
fn take(inputs: &MoveInputs, handed: &Handed) -> MoveStep {
    let current = inputs.current.get(handed.replica as usize);
    let still_there = current.is_some_and(|plan| same_devices(plan, &handed.from));
    let free = handed.to.iter().all(|shard| {
        shard.devices.iter().all(|device| {
            inputs
                .held
                .get(&(shard.node.clone(), device.clone()))
                .is_none()
        })
    });
    let refused = handed
        .to
        .iter()
        .find_map(|shard| (inputs.refused_node)(&shard.node));
    if !still_there || !free || refused.is_some() || !(inputs.kept)(handed.replica) {
        tracing::info!(
            instance = inputs.instance,
            replica = handed.replica,
            refused = refused.as_deref().unwrap_or_default(),
            "a move handed on no longer holds; not started"
        );
        return MoveStep::default();
    }
    let record = MoveInFlight {
        replica: handed.replica,
        phase: MovePhase::Surging,
        from: handed.from.clone(),
        to: handed.to.clone(),
        started: inputs.now.to_string(),
        reason: handed.reason.clone(),
        waiting: Some("the move is being recorded".into()),
    };
    MoveStep {
        note: Some(EventNote {
            warning: false,
            reason: "MoveStarted",
            message: format!(
                "replica {} moves from {} to {} {}; a new copy starts first",
                record.replica,
                places(&record.from),
                places(&record.to),
                record.reason
            ),
        }),
        record: Some(record),
        ..MoveStep::default()
    }
}

fn surging(inputs: &MoveInputs, record: &MoveInFlight) -> MoveStep {
    let elapsed = elapsed(record, inputs.now);
    let abandon = |why: String| MoveStep {
        note: Some(EventNote {
            warning: true,
            reason: "MoveAbandoned",
            message: format!(
                "replica {} stays on {}: {why}; the new copy on {} is removed",
                record.replica,
                places(&record.from),
                places(&record.to)
            ),
        }),
        ended: Some((MoveOutcome::Abandoned, gpu_seconds(&record.to, elapsed))),
        back_off: Some(record.replica),
        ..MoveStep::default()
    };
    if !(inputs.kept)(record.replica) {
        return abandon("the replica is being planned anew".into());
    }
    let (ready, total) = ready_pods(inputs.pods, inputs.instance, &record.to);
    if ready == total && total > 0 {
        return MoveStep {
            record: Some(MoveInFlight {
                phase: MovePhase::Draining,
                waiting: None,
                ..record.clone()
            }),
            switched: Some((record.replica, record.to.clone())),
            evict: existing_pods(inputs.pods, inputs.instance, &record.from),
            ..MoveStep::default()
        };
    }
    // A failed pod (refused at admission, or its container ended under
    // restartPolicy Never) never turns Ready: waiting out the bound would only
    // hold its devices.
    if let Some((name, why)) = failed_pod(inputs.pods, inputs.instance, record) {
        return abandon(format!("its new copy's pod {name} failed ({why})"));
    }
    if elapsed.is_none_or(|elapsed| elapsed > inputs.timeout) {
        return abandon(format!(
            "its new copy was not Ready within {}s ({ready} of {total} pods)",
            inputs.timeout.as_secs()
        ));
    }
    MoveStep {
        record: Some(MoveInFlight {
            waiting: Some(format!("the new copy: {ready} of {total} pods Ready")),
            ..record.clone()
        }),
        surge: true,
        ..MoveStep::default()
    }
}

fn draining(inputs: &MoveInputs, record: &MoveInFlight) -> MoveStep {
    let left = existing_pods(inputs.pods, inputs.instance, &record.from);
    if left.is_empty() {
        return MoveStep {
            note: Some(EventNote {
                warning: false,
                reason: "Moved",
                message: format!(
                    "replica {} moved from {} to {} {}",
                    record.replica,
                    places(&record.from),
                    places(&record.to),
                    record.reason
                ),
            }),
            ended: Some((
                MoveOutcome::Moved,
                gpu_seconds(&record.to, elapsed(record, inputs.now)),
            )),
            ..MoveStep::default()
        };
    }
    MoveStep {
        record: Some(record.clone()),
        evict: left,
        ..MoveStep::default()
    }
}

/// How long ago the move started; `None` when its start cannot be read (a
/// hand-edited status): such a surge is abandoned rather than kept for ever,
/// and counts no GPU-seconds.
fn elapsed(record: &MoveInFlight, now: Timestamp) -> Option<Duration> {
    let started = record.started.parse::<Timestamp>().ok()?;
    now.duration_since(started).try_into().ok()
}

fn same_devices(a: &[PlannedShard], b: &[PlannedShard]) -> bool {
    a.len() == b.len()
        && a.iter()
            .zip(b)
            .all(|(a, b)| a.node == b.node && a.devices == b.devices && a.copy == b.copy)
}

/// Pods of `shards` that are Ready, bound where planned, on the planned
/// devices; and how many shards there are.
fn ready_pods(
    pods: &BTreeMap<String, Arc<Pod>>,
    instance: &str,
    shards: &[PlannedShard],
) -> (usize, usize) {
    let ready = shards
        .iter()
        .filter(|shard| {
            let name = pod_name_of(instance, shard);
            pods.get(&name).is_some_and(|pod| {
                let bound = pod.spec.as_ref().and_then(|s| s.node_name.as_deref())
                    == Some(shard.node.as_str());
                let devices = pod
                    .annotations()
                    .get(DEVICES_ANNOTATION)
                    .map(String::as_str)
                    == Some(shard.devices.join(",").as_str());
                let ready = pod
                    .status
                    .as_ref()
                    .and_then(|s| s.conditions.as_ref())
                    .is_some_and(|c| c.iter().any(|c| c.type_ == "Ready" && c.status == "True"));
                bound && devices && ready && pod.metadata.deletion_timestamp.is_none()
            })
        })
        .count();
    (ready, shards.len())
}

/// The first pod of `record`'s new copy that failed, with why as its status
/// says. A pod of the same name made before the move started, or going, is
/// one an earlier move left and not this copy's.
fn failed_pod(
    pods: &BTreeMap<String, Arc<Pod>>,
    instance: &str,
    record: &MoveInFlight,
) -> Option<(String, String)> {
    let started = record.started.parse::<Timestamp>().ok();
    record.to.iter().find_map(|shard| {
        let name = pod_name_of(instance, shard);
        let pod = pods.get(&name)?;
        // Creation times are whole seconds.
        let earlier = match (&pod.metadata.creation_timestamp, started) {
            (Some(created), Some(started)) => created.0 + Duration::from_secs(1) < started,
            _ => false,
        };
        if earlier || pod.metadata.deletion_timestamp.is_some() {
            return None;
        }
        let status = pod.status.as_ref()?;
        if status.phase.as_deref() != Some("Failed") {
            return None;
        }
        let why = match (status.reason.as_deref(), status.message.as_deref()) {
            (Some(reason), Some(message)) => format!("{reason}: {message}"),
            (Some(said), None) | (None, Some(said)) => said.to_string(),
            (None, None) => "phase Failed".to_string(),
        };
        Some((name, why))
    })
}

/// Names of the pods of `shards` that still exist (terminating ones too:
/// they hold their devices until they are gone).
fn existing_pods(
    pods: &BTreeMap<String, Arc<Pod>>,
    instance: &str,
    shards: &[PlannedShard],
) -> Vec<String> {
    shards
        .iter()
        .map(|shard| pod_name_of(instance, shard))
        .filter(|name| pods.contains_key(name))
        .collect()
}

/// The GPU-seconds a copy on `shards` held devices for `elapsed`.
fn gpu_seconds(shards: &[PlannedShard], elapsed: Option<Duration>) -> f64 {
    let gpus: f64 = shards.iter().map(|shard| shard.devices.len() as f64).sum();
    gpus * elapsed.unwrap_or_default().as_secs_f64()
}

/// `n1 [g0,g1]`, shard by shard.
pub(crate) fn places(shards: &[PlannedShard]) -> String {
    shards
        .iter()
        .map(|shard| format!("{} [{}]", shard.node, shard.devices.join(",")))
        .collect::<Vec<_>>()
        .join(", ")
}

#[cfg(test)]
mod tests {
    use k8s_openapi::api::core::v1::{PodCondition, PodSpec, PodStatus};
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};

    use super::*;
    use crate::controller::testkit::now;

    fn shard(node: &str, device: &str, copy: u32) -> PlannedShard {
        PlannedShard {
            replica: 1,
            copy,
            shard: 0,
            node: node.into(),
            devices: vec![device.into()],
            layer_start: 0,
            layer_end: 32,
            predicted_memory_gib: 20.0,
            share: None,
        }
    }

    fn pod(shard: &PlannedShard, ready: bool) -> (String, Arc<Pod>) {
        let name = pod_name_of("small", shard);
        let pod = Pod {
            metadata: ObjectMeta {
                name: Some(name.clone()),
                annotations: Some(
                    [(DEVICES_ANNOTATION.to_string(), shard.devices.join(","))].into(),
                ),
                ..ObjectMeta::default()
            },
            spec: Some(PodSpec {
                node_name: Some(shard.node.clone()),
                ..PodSpec::default()
            }),
            status: Some(PodStatus {
                conditions: Some(vec![PodCondition {
                    type_: "Ready".into(),
                    status: if ready { "True" } else { "False" }.into(),
                    ..PodCondition::default()
                }]),
                ..PodStatus::default()
            }),
        };
        (name, Arc::new(pod))
    }

    fn handed() -> Handed {
        Handed {
            replica: 1,
            from: vec![shard("a", "a-g0", 0)],
            to: vec![shard("b", "b-g0", 1)],
            reason: "to make room for ml/big replica 0".into(),
        }
    }

    fn record(phase: MovePhase, started: &str) -> MoveInFlight {
        MoveInFlight {
            replica: 1,
            phase,
            from: vec![shard("a", "a-g0", 0)],
            to: vec![shard("b", "b-g0", 1)],
            started: started.into(),
            reason: "to make room for ml/big replica 0".into(),
            waiting: None,
        }
    }

    /// The step with replica 1 on `a-g0`, kept, and the pods given.
    fn step_with(
        recorded: Option<&MoveInFlight>,
        handed: Option<Handed>,
        pods: &BTreeMap<String, Arc<Pod>>,
        held: &Held,
    ) -> MoveStep {
        let current = vec![vec![], vec![shard("a", "a-g0", 0)]];
        step(MoveInputs {
            instance: "small",
            recorded,
            handed,
            current: &current,
            kept: &|_| true,
            pods,
            held,
            refused_node: &|_| None,
            now: now(),
            timeout: Duration::from_secs(600),
        })
    }

    #[test]
    fn a_handed_move_is_recorded_before_anything_starts() {
        let step = step_with(None, Some(handed()), &BTreeMap::new(), &Held::new());
        let record = step.record.expect("recorded");
        assert_eq!(record.phase, MovePhase::Surging);
        assert_eq!(record.started, now().to_string());
        assert!(!step.surge, "no new pods before the record is written");
        assert_eq!(step.note.map(|n| n.reason), Some("MoveStarted"));
    }

    #[test]
    fn a_handed_move_that_no_longer_holds_is_dropped() {
        // Its target taken meanwhile.
        let mut held = Held::new();
        held.insert(("b".into(), "b-g0".into()), "pod ml/other".into());
        assert_eq!(
            step_with(None, Some(handed()), &BTreeMap::new(), &held),
            MoveStep::default()
        );
        // The replica no longer where the planner saw it.
        let mut moved = handed();
        moved.from = vec![shard("a", "a-g1", 0)];
        assert_eq!(
            step_with(None, Some(moved), &BTreeMap::new(), &Held::new()),
            MoveStep::default()
        );
    }

    #[test]
    fn a_surge_copy_is_kept_until_every_pod_is_ready_then_the_replica_switches() {
        let surging = record(MovePhase::Surging, "2026-06-01T11:58:00Z");
        let old = pod(&surging.from[0], true);
        let new = pod(&surging.to[0], false);
        let pods = BTreeMap::from([old.clone(), new]);
        let step = step_with(Some(&surging), None, &pods, &Held::new());
        assert!(step.surge);
        assert_eq!(step.switched, None);
        assert!(step.evict.is_empty(), "nothing evicted before the switch");
        assert_eq!(
            step.record.and_then(|r| r.waiting).as_deref(),
            Some("the new copy: 0 of 1 pods Ready")
        );

        let pods = BTreeMap::from([old, pod(&surging.to[0], true)]);
        let step = step_with(Some(&surging), None, &pods, &Held::new());
        assert_eq!(step.switched, Some((1, surging.to.clone())));
        assert_eq!(step.evict, ["small-r1-shard-0"]);
        assert_eq!(step.record.map(|r| r.phase), Some(MovePhase::Draining));
        assert_eq!(step.ended, None);
    }

    #[test]
    fn a_surge_copy_not_ready_in_time_is_abandoned_and_the_old_copy_stays() {
        // Started 11 minutes before now, with a 10-minute bound.
        let surging = record(MovePhase::Surging, "2026-06-01T11:49:00Z");
        let pods = BTreeMap::from([pod(&surging.from[0], true), pod(&surging.to[0], false)]);
        let step = step_with(Some(&surging), None, &pods, &Held::new());
        assert_eq!(step.record, None, "the record goes, so the new copy does");
        assert!(!step.surge);
        assert!(step.evict.is_empty(), "the old copy is untouched");
        assert_eq!(step.switched, None);
        assert_eq!(step.back_off, Some(1));
        let (outcome, gpu_seconds) = step.ended.expect("ended");
        assert_eq!(outcome, MoveOutcome::Abandoned);
        assert_eq!(gpu_seconds, 660.0);
        let note = step.note.expect("told");
        assert!((note.warning, note.reason) == (true, "MoveAbandoned"));
        assert!(
            note.message.contains("not Ready within 600s"),
            "{}",
            note.message
        );
    }

    #[test]
    fn a_surge_copy_whose_pod_failed_is_abandoned_at_once() {
        // A minute in, well within the bound: kubelet refused the new pod.
        let surging = record(MovePhase::Surging, "2026-06-01T11:59:00Z");
        let (name, failed) = pod(&surging.to[0], false);
        let mut failed = Pod::clone(&failed);
        let status = failed.status.get_or_insert_with(PodStatus::default);
        status.phase = Some("Failed".into());
        status.reason = Some("UnexpectedAdmissionError".into());
        status.message = Some("Allocate failed due to no devices".into());
        failed.metadata.creation_timestamp = Some(Time("2026-06-01T11:59:00Z".parse().unwrap()));
        let pods = BTreeMap::from([
            pod(&surging.from[0], true),
            (name.clone(), Arc::new(failed.clone())),
        ]);
        let step = step_with(Some(&surging), None, &pods, &Held::new());
        assert_eq!(step.record, None, "the record goes, so the new copy does");
        assert!(step.evict.is_empty(), "the old copy is untouched");
        assert_eq!(step.back_off, Some(1));
        assert_eq!(step.ended, Some((MoveOutcome::Abandoned, 60.0)));
        let note = step.note.expect("told");
        assert_eq!(note.reason, "MoveAbandoned");
        assert!(
            note.message.contains(
                "its new copy's pod small-r1-m-shard-0 failed (UnexpectedAdmissionError: Allocate failed due to no devices)"
            ),
            "{}",
            note.message
        );
        // Running, or not yet started, it is waited for as before; so is a
        // failed pod an earlier move left (made before this one started) or
        // one being deleted.
        let pods = BTreeMap::from([pod(&surging.from[0], true), pod(&surging.to[0], false)]);
        assert!(step_with(Some(&surging), None, &pods, &Held::new()).surge);
        let mut left = failed.clone();
        left.metadata.creation_timestamp = Some(Time("2026-06-01T11:50:00Z".parse().unwrap()));
        let pods = BTreeMap::from([(name.clone(), Arc::new(left))]);
        assert!(step_with(Some(&surging), None, &pods, &Held::new()).surge);
        let mut going = failed;
        going.metadata.deletion_timestamp = Some(Time(now()));
        let pods = BTreeMap::from([(name, Arc::new(going))]);
        assert!(step_with(Some(&surging), None, &pods, &Held::new()).surge);
    }

    #[test]
    fn a_replica_planned_anew_abandons_its_move() {
        let surging = record(MovePhase::Surging, "2026-06-01T11:59:00Z");
        let current = vec![vec![], vec![shard("a", "a-g0", 0)]];
        let step = step(MoveInputs {
            instance: "small",
            recorded: Some(&surging),
            handed: None,
            current: &current,
            kept: &|_| false,
            pods: &BTreeMap::new(),
            held: &Held::new(),
            refused_node: &|_| None,
            now: now(),
            timeout: Duration::from_secs(600),
        });
        assert_eq!(step.record, None);
        assert_eq!(step.ended.map(|e| e.0), Some(MoveOutcome::Abandoned));
    }

    #[test]
    fn the_old_copy_is_evicted_until_it_is_gone_then_the_move_is_done() {
        let draining = record(MovePhase::Draining, "2026-06-01T11:58:00Z");
        let pods = BTreeMap::from([pod(&draining.from[0], true), pod(&draining.to[0], true)]);
        let step = step_with(Some(&draining), None, &pods, &Held::new());
        assert_eq!(step.evict, ["small-r1-shard-0"]);
        assert_eq!(step.record, Some(draining.clone()));

        let pods = BTreeMap::from([pod(&draining.to[0], true)]);
        let step = step_with(Some(&draining), None, &pods, &Held::new());
        assert_eq!(step.record, None);
        assert_eq!(step.ended, Some((MoveOutcome::Moved, 120.0)));
        let note = step.note.expect("told");
        assert_eq!(note.reason, "Moved");
        assert!(
            note.message.contains("from a [a-g0] to b [b-g0]"),
            "{}",
            note.message
        );
    }

    #[test]
    fn an_unreadable_start_ends_the_surge() {
        let surging = record(MovePhase::Surging, "yesterday");
        let step = step_with(Some(&surging), None, &BTreeMap::new(), &Held::new());
        assert_eq!(step.ended, Some((MoveOutcome::Abandoned, 0.0)));
    }
}
