//! Replicas a smaller count removes leave their Services before their pods
//! go. Every shard pod is made with the readiness gate `tessera.dev/serving`,
//! which the controller holds True while the pod is wanted ([`open_gate`]).
//! When its replica is no longer wanted the gate turns False and the time is
//! noted on the pod (`tessera.dev/draining-since`): the kubelet reports the
//! pod not Ready, and every Service stops sending it requests. The pods are
//! deleted once a read of the runtime taken [`SETTLE`] after that finds
//! nothing running or waiting, right after [`SETTLE`] where the runtime is
//! not measured (or names no port to measure it on), or when the drain
//! timeout has passed: a runtime that stopped answering may still be
//! finishing requests. Pods made before the gate existed have nothing to
//! turn: they are deleted at once, as before.
//! A moved replica's old copy leaves its Services the same way before it is
//! evicted ([`before_eviction`]).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::jiff::Timestamp;
use kube::ResourceExt;
use kube::api::{Api, Patch, PatchParams};
use serde_json::json;

use super::{ApplyError, retry};
use crate::controller::events::EventNote;
use crate::controller::measure::ReplicaMeasure;

/// The readiness gate every shard pod is made with.
pub(crate) const SERVING_GATE: &str = "tessera.dev/serving";
/// Pod annotation: when its replica left its Services to drain.
pub(crate) const DRAINING_ANNOTATION: &str = "tessera.dev/draining-since";
/// How long after a replica leaves its Services a read of its runtime
/// counts: EndpointSlices, and the proxies and clients that follow them,
/// take a moment, during which requests may still arrive.
pub(crate) const SETTLE: Duration = Duration::from_secs(5);

/// What a leaving replica's pods are due.
#[derive(Debug, PartialEq)]
pub(crate) enum DrainStep {
    /// Take them out of their Services now.
    Start,
    /// Keep them: requests may still be in flight.
    Wait,
    /// Delete them, for the reason given.
    Delete(String),
}

/// The step for one leaving replica's pods, from what is noted on them and
/// the last read of its runtime.
pub(crate) fn step(
    pods: &[&Pod],
    measure: Option<&ReplicaMeasure>,
    now: Timestamp,
    timeout: Duration,
) -> DrainStep {
    if pods.iter().any(|pod| !has_gate(pod)) {
        return DrainStep::Delete("its pods were made without the serving gate".into());
    }
    let Some(since) = pods.iter().filter_map(|pod| draining_since(pod)).min() else {
        return DrainStep::Start;
    };
    let waited = now.duration_since(since).unsigned_abs();
    if waited >= timeout {
        return DrainStep::Delete(format!(
            "it still had requests after the drain timeout ({} s)",
            timeout.as_secs()
        ));
    }
    if waited < SETTLE {
        return DrainStep::Wait;
    }
    let settled = since.checked_add(SETTLE).unwrap_or(Timestamp::MAX);
    match measure {
        None | Some(ReplicaMeasure::NoEndpoint(_)) => DrainStep::Delete(format!(
            "its runtime is not measured; it has been out of its Services for {} s",
            waited.as_secs()
        )),
        Some(ReplicaMeasure::Measured { measurement, at })
            if *at >= settled && measurement.in_flight_now() == 0.0 =>
        {
            DrainStep::Delete(format!(
                "its runtime finished its requests {} s after it left its Services",
                waited.as_secs()
            ))
        }
        Some(_) => DrainStep::Wait,
    }
}

/// Carries every leaving replica one step; returns the pods to keep for
/// now (the rest of what is not wanted is deleted).
pub(crate) async fn drain(
    api: &Api<Pod>,
    leaving: &BTreeMap<u32, Vec<Arc<Pod>>>,
    measured: Option<&BTreeMap<u32, ReplicaMeasure>>,
    timeout: Duration,
    notes: &mut Vec<EventNote>,
) -> Result<Vec<String>, ApplyError> {
    let now = Timestamp::now();
    let mut keep = Vec::new();
    for (replica, pods) in leaving {
        let refs: Vec<&Pod> = pods.iter().map(AsRef::as_ref).collect();
        let measure = measured.and_then(|m| m.get(replica));
        match step(&refs, measure, now, timeout) {
            DrainStep::Start => {
                close_gates(api, &refs).await?;
                notes.push(EventNote {
                    warning: false,
                    reason: "Draining",
                    message: format!(
                        "replica {replica} is no longer needed: out of its Services, its pods go once its runtime has finished its requests (at most {} s)",
                        timeout.as_secs()
                    ),
                });
                keep.extend(refs.iter().map(|p| p.name_any()));
            }
            DrainStep::Wait => keep.extend(refs.iter().map(|p| p.name_any())),
            DrainStep::Delete(why) => notes.push(EventNote {
                warning: false,
                reason: "Drained",
                message: format!("replica {replica} removed: {why}"),
            }),
        }
    }
    Ok(keep)
}

/// What a moved replica's old copy is due before its eviction.
#[derive(Debug, PartialEq)]
pub(crate) enum Leave {
    /// Take it out of its Services now (once its eviction would be allowed).
    Start,
    /// Keep it: the endpoints are still following.
    Wait,
    /// Evict it.
    Evict,
}

/// A moved replica's old copy leaves its Services before it is evicted, as
/// a removed replica does: its gates turn False, and its eviction waits
/// [`SETTLE`] for the endpoints to follow. The new copy serves meanwhile;
/// the old one is no longer measured, so nothing longer is waited for: its
/// runtime finishes what is in flight within the pod's termination grace
/// period.
pub(crate) fn before_eviction(
    existing: &BTreeMap<String, Arc<Pod>>,
    names: &[String],
    now: Timestamp,
    timeout: Duration,
) -> Leave {
    let pods: Vec<&Pod> = names
        .iter()
        .filter_map(|name| existing.get(name))
        .map(AsRef::as_ref)
        .filter(|pod| pod.metadata.deletion_timestamp.is_none())
        .collect();
    if pods.is_empty() {
        return Leave::Evict;
    }
    match step(&pods, None, now, timeout) {
        DrainStep::Start => Leave::Start,
        DrainStep::Wait => Leave::Wait,
        DrainStep::Delete(_) => Leave::Evict,
    }
}

/// Takes `pods` out of their Services (serving gate False, the time noted).
pub(crate) async fn close_gates(api: &Api<Pod>, pods: &[&Pod]) -> Result<(), ApplyError> {
    let now = Timestamp::now();
    for pod in pods {
        set_gate(api, pod, false, Some(now)).await?;
    }
    Ok(())
}

/// Holds a wanted pod's serving gate True (a replica wanted again while it
/// drained comes back into its Services).
pub(crate) async fn open_gate(api: &Api<Pod>, pod: &Pod) -> Result<(), ApplyError> {
    if !has_gate(pod) || (gate_open(pod) && draining_since(pod).is_none()) {
        return Ok(());
    }
    set_gate(api, pod, true, None).await
}

async fn set_gate(
    api: &Api<Pod>,
    pod: &Pod,
    open: bool,
    draining: Option<Timestamp>,
) -> Result<(), ApplyError> {
    let name = pod.name_any();
    let params = PatchParams::default();
    if draining.is_some() || draining_since(pod).is_some() {
        let since = draining.map(|t| t.to_string());
        let note = json!({"metadata": {"annotations": {DRAINING_ANNOTATION: since}}});
        let note = Patch::Merge(&note);
        retry(&format!("note the drain of pod {name}"), || {
            api.patch(&name, &params, &note)
        })
        .await?;
    }
    let (status, reason) = if open {
        ("True", "Wanted")
    } else {
        ("False", "Draining")
    };
    let condition = json!({"status": {"conditions": [{
        "type": SERVING_GATE,
        "status": status,
        "reason": reason,
        "lastTransitionTime": Timestamp::now().to_string(),
    }]}});
    let condition = Patch::Strategic(&condition);
    retry(&format!("set the serving gate of pod {name}"), || {
        api.patch_status(&name, &params, &condition)
    })
    .await
    .map(|_| ())
}

fn has_gate(pod: &Pod) -> bool {
    pod.spec
        .as_ref()
        .and_then(|s| s.readiness_gates.as_ref())
        .is_some_and(|gates| gates.iter().any(|g| g.condition_type == SERVING_GATE))
}

fn gate_open(pod: &Pod) -> bool {
    pod.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|c| {
            c.iter()
                .any(|c| c.type_ == SERVING_GATE && c.status == "True")
        })
}

fn draining_since(pod: &Pod) -> Option<Timestamp> {
    pod.annotations().get(DRAINING_ANNOTATION)?.parse().ok()
}

#[cfg(test)]
mod tests {
    use k8s_openapi::api::core::v1::{PodReadinessGate, PodSpec};

    use super::*;
    use crate::controller::measure::measured_after;

    fn pod(gate: bool, since: Option<Timestamp>) -> Pod {
        let mut pod = Pod {
            spec: Some(PodSpec {
                readiness_gates: gate.then(|| {
                    vec![PodReadinessGate {
                        condition_type: SERVING_GATE.into(),
                    }]
                }),
                ..PodSpec::default()
            }),
            ..Pod::default()
        };
        if let Some(since) = since {
            pod.annotations_mut()
                .insert(DRAINING_ANNOTATION.into(), since.to_string());
        }
        pod
    }

    fn at(seconds: i64) -> Timestamp {
        Timestamp::from_second(1_800_000_000 + seconds).unwrap()
    }

    const TIMEOUT: Duration = Duration::from_secs(120);

    #[test]
    fn a_moved_copy_leaves_its_services_before_its_eviction() {
        let named = |pod: Pod| BTreeMap::from([("old".to_string(), Arc::new(pod))]);
        let old = ["old".to_string()];
        let leave =
            |pods: &BTreeMap<String, Arc<Pod>>, now| before_eviction(pods, &old, at(now), TIMEOUT);
        assert_eq!(leave(&named(pod(true, None)), 0), Leave::Start);
        assert_eq!(leave(&named(pod(true, Some(at(0)))), 2), Leave::Wait);
        // Not measured: the endpoints' settle time is all it waits.
        assert_eq!(leave(&named(pod(true, Some(at(0)))), 6), Leave::Evict);
        assert_eq!(leave(&named(pod(false, None)), 0), Leave::Evict);
        assert_eq!(leave(&BTreeMap::new(), 0), Leave::Evict, "already gone");
    }

    #[test]
    fn a_replica_leaves_its_services_then_waits_for_its_runtime() {
        let fresh = pod(true, None);
        assert_eq!(step(&[&fresh], None, at(0), TIMEOUT), DrainStep::Start);
        let leaving = pod(true, Some(at(0)));
        assert_eq!(step(&[&leaving], None, at(2), TIMEOUT), DrainStep::Wait);
        // measured_after's runtime has 2 requests running, read at 10 s.
        let busy = measured_after(100);
        assert_eq!(
            step(&[&leaving], Some(&busy), at(11), TIMEOUT),
            DrainStep::Wait
        );
        assert!(matches!(
            step(&[&leaving], Some(&busy), at(120), TIMEOUT),
            DrainStep::Delete(why) if why.contains("drain timeout")
        ));
        let failed = ReplicaMeasure::Failed("timed out".into());
        assert_eq!(
            step(&[&leaving], Some(&failed), at(60), TIMEOUT),
            DrainStep::Wait
        );
        // A runtime with no port to read is not measured: nothing to wait for.
        let no_port = ReplicaMeasure::NoEndpoint("no container port named metrics or http".into());
        assert!(matches!(
            step(&[&leaving], Some(&no_port), at(6), TIMEOUT),
            DrainStep::Delete(why) if why.contains("not measured")
        ));
    }

    #[test]
    fn an_idle_read_after_the_settle_time_or_no_measuring_lets_the_pods_go() {
        let leaving = pod(true, Some(at(0)));
        let ReplicaMeasure::Measured { measurement, .. } = measured_after(100) else {
            panic!("measured");
        };
        let idle_window = {
            let mut w = tessera_core::measure::Window::new(60.0);
            let text = crate::controller::measure::vllm_exposition(100)
                .replace("vllm:num_requests_running 2", "vllm:num_requests_running 0");
            for at in [0.0, 10.0] {
                w.push(
                    at,
                    tessera_core::measure::Scrape::parse(&text, tessera_core::api::Runtime::Vllm)
                        .unwrap(),
                );
            }
            w.measurement().unwrap()
        };
        assert!(measurement.in_flight_now() > 0.0);
        assert_eq!(
            idle_window.in_flight_now(),
            0.0,
            "the exposition's running gauge was zeroed"
        );
        let idle_early = ReplicaMeasure::Measured {
            measurement: idle_window.clone(),
            at: at(3),
        };
        assert_eq!(
            step(&[&leaving], Some(&idle_early), at(6), TIMEOUT),
            DrainStep::Wait,
            "read before the endpoints settled"
        );
        let idle = ReplicaMeasure::Measured {
            measurement: idle_window,
            at: at(6),
        };
        assert!(matches!(
            step(&[&leaving], Some(&idle), at(7), TIMEOUT),
            DrainStep::Delete(_)
        ));
        assert!(
            matches!(step(&[&leaving], None, at(5), TIMEOUT), DrainStep::Delete(why) if why.contains("not measured"))
        );
    }

    #[test]
    fn pods_made_without_the_gate_go_at_once() {
        let old = pod(false, None);
        let new = pod(true, None);
        assert!(matches!(
            step(&[&new, &old], None, at(0), TIMEOUT),
            DrainStep::Delete(_)
        ));
    }
}
