//! When an existing shard pod must go, and when its whole replica must:
//! `restartPolicy: RecreatePod` replaces only the pods that cannot stay,
//! `RecreateReplica` replaces every pod of a replica once one of its started
//! shards is lost. Pure; `apply` does the deleting.

use std::collections::BTreeMap;
use std::sync::Arc;

use k8s_openapi::api::core::v1::Pod;
use kube::ResourceExt;

use super::hashes::recorded_pod_hash;
use super::held::finished;

/// Why an existing pod cannot stay, and whether that is a loss (warning)
/// rather than a planned change.
pub(crate) fn replace_reason(have: &Pod, want: &Pod, node: &str) -> Option<(String, bool)> {
    if finished(have) {
        return Some((format!("pod failed ({})", failure(have)), true));
    }
    let bound_to = have.spec.as_ref().and_then(|s| s.node_name.as_deref());
    if let Some(other) = bound_to.filter(|n| *n != node) {
        return Some((
            format!("pod runs on node {other}, planned for {node}"),
            true,
        ));
    }
    if recorded_pod_hash(have) != recorded_pod_hash(want) {
        return Some(("the plan or the pod template changed".to_string(), false));
    }
    None
}

/// Why a finished pod ended, in its status's words: the pod's reason and
/// message (an eviction, say), else its first container that ended badly
/// with its exit code, else `ended`.
fn failure(pod: &Pod) -> String {
    let status = pod.status.as_ref();
    let with_message = |reason: &str, message: Option<&str>| match message {
        Some(message) if !message.is_empty() => format!("{reason}: {message}"),
        _ => reason.to_string(),
    };
    if let Some(reason) = status.and_then(|s| s.reason.as_deref()) {
        return with_message(reason, status.and_then(|s| s.message.as_deref()));
    }
    let ended = status
        .into_iter()
        .flat_map(|s| {
            s.init_container_statuses
                .iter()
                .chain(&s.container_statuses)
        })
        .flatten()
        .find_map(|c| {
            let ended = c.state.as_ref()?.terminated.as_ref()?;
            (ended.exit_code != 0).then_some((c.name.as_str(), ended))
        });
    match ended {
        Some((container, ended)) => with_message(
            &format!(
                "container {container} exited with code {}{}",
                ended.exit_code,
                ended
                    .reason
                    .as_deref()
                    .map(|r| format!(", {r}"))
                    .unwrap_or_default()
            ),
            ended.message.as_deref(),
        ),
        None => "ended".to_string(),
    }
}

/// Why the replica whose desired pods (with their nodes) are `desired` must
/// be recreated whole, if it must: one of its pods is bound and may stay (a
/// rank that has started, or will), while another shard has no pod, a pod
/// going away, or one that must be replaced. The started ranks could not take
/// that shard's new pod into their group.
///
/// A replica none of whose pods is bound has started nothing: its missing
/// pods are simply created. So is one whose every pod is going away, which
/// is also how a recreation ends: once the old pods are gone the replica
/// starts afresh, all of its pods bound together.
pub(crate) fn lost_rank(
    desired: &[(Pod, String)],
    existing: &BTreeMap<String, Arc<Pod>>,
) -> Option<String> {
    let mut running = false;
    let mut lost = None;
    for (want, node) in desired {
        let name = want.name_any();
        let why = match existing.get(&name) {
            None => Some("its pod is gone".to_string()),
            Some(have) if have.metadata.deletion_timestamp.is_some() => {
                Some("its pod is being deleted".to_string())
            }
            Some(have) => match replace_reason(have, want, node) {
                Some((why, _)) => Some(why),
                None => {
                    running |= have.spec.as_ref().is_some_and(|s| s.node_name.is_some());
                    None
                }
            },
        };
        if lost.is_none()
            && let Some(why) = why
        {
            lost = Some(format!("{name}: {why}"));
        }
    }
    lost.filter(|_| running)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::controller::desired::shard_pods;
    use crate::controller::testkit::*;
    use k8s_openapi::api::core::v1::PodStatus;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
    use tessera_core::api::PlannedShard;

    fn plan(stages: u32) -> Vec<PlannedShard> {
        (0..stages)
            .map(|i| PlannedShard {
                copy: 0,
                replica: 0,
                shard: i,
                node: format!("n{i}"),
                devices: vec![format!("n{i}-g0")],
                layer_start: i * 8,
                layer_end: (i + 1) * 8,
                predicted_memory_gib: 10.0,
                share: None,
            })
            .collect()
    }

    /// Existing pods by name, as the cache shows them.
    type Existing = BTreeMap<String, Arc<Pod>>;

    /// The desired pods of a three-stage replica, and the same pods as they
    /// exist once bound to their nodes.
    fn replica() -> (Vec<(Pod, String)>, Existing) {
        let mi = instance("llama", SMALL);
        let plan = plan(3);
        let pods = shard_pods(&mi, &plan, |_| "tessera.dev/gpu".into());
        let existing = pods
            .iter()
            .zip(&plan)
            .map(|(pod, shard)| {
                let mut bound = pod.clone();
                bound.spec.as_mut().unwrap().node_name = Some(shard.node.clone());
                (pod.name_any(), Arc::new(bound))
            })
            .collect();
        let desired = pods
            .into_iter()
            .zip(plan.iter().map(|s| s.node.clone()))
            .collect();
        (desired, existing)
    }

    fn edit(existing: &mut Existing, name: &str, change: impl FnOnce(&mut Pod)) {
        let mut pod = Pod::clone(&existing[name]);
        change(&mut pod);
        existing.insert(name.to_string(), Arc::new(pod));
    }

    #[test]
    fn a_settled_replica_keeps_its_pods() {
        let (desired, existing) = replica();
        assert_eq!(lost_rank(&desired, &existing), None);
    }

    #[test]
    fn a_failed_gone_moved_or_changed_pod_beside_a_bound_one_loses_the_replica() {
        let (desired, settled) = replica();
        let mut failed = settled.clone();
        edit(&mut failed, "llama-shard-1", |p| {
            p.status = Some(PodStatus {
                phase: Some("Failed".into()),
                reason: Some("Error".into()),
                ..Default::default()
            })
        });
        let mut gone = settled.clone();
        gone.remove("llama-shard-2");
        let mut deleting = settled.clone();
        edit(&mut deleting, "llama-shard-0", |p| {
            p.metadata.deletion_timestamp = Some(Time(now()))
        });
        let mut elsewhere = settled.clone();
        edit(&mut elsewhere, "llama-shard-1", |p| {
            p.spec.as_mut().unwrap().node_name = Some("n9".into())
        });
        let mut moved = settled.clone();
        edit(&mut moved, "llama-shard-2", |p| {
            p.metadata
                .annotations
                .as_mut()
                .unwrap()
                .insert("tessera.dev/spec-hash".into(), "0".into());
        });
        for (existing, want) in [
            (failed, "llama-shard-1: pod failed (Error)"),
            (gone, "llama-shard-2: its pod is gone"),
            (deleting, "llama-shard-0: its pod is being deleted"),
            (
                elsewhere,
                "llama-shard-1: pod runs on node n9, planned for n1",
            ),
            (moved, "llama-shard-2: the plan or the pod template changed"),
        ] {
            assert_eq!(lost_rank(&desired, &existing).as_deref(), Some(want));
        }
    }

    #[test]
    fn a_replica_that_has_started_nothing_is_not_recreated() {
        let (desired, settled) = replica();
        // Nothing created yet, or created and not bound (waiting on a node).
        assert_eq!(lost_rank(&desired, &BTreeMap::new()), None);
        let mut unbound = settled.clone();
        for (pod, _) in &desired {
            edit(&mut unbound, &pod.name_any(), |p| {
                p.spec.as_mut().unwrap().node_name = None
            });
        }
        unbound.remove("llama-shard-2");
        assert_eq!(lost_rank(&desired, &unbound), None);
        // A recreation under way: every old pod going away or gone.
        let mut ending = settled.clone();
        ending.remove("llama-shard-0");
        for name in ["llama-shard-1", "llama-shard-2"] {
            edit(&mut ending, name, |p| {
                p.metadata.deletion_timestamp = Some(Time(now()))
            });
        }
        assert_eq!(lost_rank(&desired, &ending), None);
    }

    #[test]
    fn a_failure_is_told_by_the_pod_or_the_container_that_ended() {
        use k8s_openapi::api::core::v1::{
            ContainerState, ContainerStateTerminated, ContainerStatus,
        };
        let (desired, _) = replica();
        let (want, node) = &desired[0];
        let ended = |reason: Option<&str>, containers: Vec<(i32, Option<&str>)>| {
            let mut pod = want.clone();
            pod.status = Some(PodStatus {
                phase: Some("Failed".into()),
                reason: reason.map(Into::into),
                container_statuses: Some(
                    containers
                        .into_iter()
                        .enumerate()
                        .map(|(i, (code, why))| ContainerStatus {
                            name: format!("c{i}"),
                            state: Some(ContainerState {
                                terminated: Some(ContainerStateTerminated {
                                    exit_code: code,
                                    reason: why.map(Into::into),
                                    message: (code == 137).then(|| "killed".into()),
                                    ..Default::default()
                                }),
                                ..Default::default()
                            }),
                            ..Default::default()
                        })
                        .collect(),
                ),
                ..Default::default()
            });
            replace_reason(&pod, want, node).map(|(why, _)| why)
        };
        assert_eq!(
            ended(Some("Evicted"), vec![(1, Some("Error"))]).as_deref(),
            Some("pod failed (Evicted)")
        );
        assert_eq!(
            ended(None, vec![(0, None), (1, Some("Error"))]).as_deref(),
            Some("pod failed (container c1 exited with code 1, Error)")
        );
        assert_eq!(
            ended(None, vec![(137, Some("OOMKilled"))]).as_deref(),
            Some("pod failed (container c0 exited with code 137, OOMKilled: killed)")
        );
        assert_eq!(ended(None, vec![]).as_deref(), Some("pod failed (ended)"));
    }

    #[test]
    fn a_bound_shard_waiting_for_its_peers_binding_is_not_a_loss() {
        let (desired, settled) = replica();
        let mut waiting = settled;
        edit(&mut waiting, "llama-shard-1", |p| {
            p.spec.as_mut().unwrap().node_name = None
        });
        assert_eq!(lost_rank(&desired, &waiting), None);
    }
}
