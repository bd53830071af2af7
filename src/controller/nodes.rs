//! Nodes as the controller sees them: published GPU state, readiness, and
//! whether new shards may go there (cordons and taints). Also the trimming
//! applied before Nodes enter the cache, which keeps thousands of them cheap.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use k8s_openapi::api::core::v1::{Node, NodeCondition, NodeSpec, NodeStatus, Taint, Toleration};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use k8s_openapi::jiff::Timestamp;

use crate::api::{GPU_STATE_ANNOTATION, NodeGpuState};
use crate::translate::ClusterNode;

/// A GPU node: its published state plus what decides whether it can take work.
#[derive(Clone, Debug, PartialEq)]
pub struct NodeInfo {
    pub(crate) gpus: ClusterNode,
    pub(crate) readiness: Readiness,
    /// `spec.unschedulable` (cordoned).
    pub(crate) cordoned: bool,
    pub(crate) taints: Vec<Taint>,
}

#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Readiness {
    Ready,
    /// Ready is `False` or `Unknown`; `since` is the condition's last transition.
    NotReady {
        since: Option<Timestamp>,
    },
    /// No Ready condition at all: a kubelet that never reported. Treated as
    /// ready, since the agent publishing GPU state is alive on it.
    Unreported,
}

impl NodeInfo {
    /// Reads a Node. `Ok(None)` for nodes without GPU state; `Err` for a
    /// malformed state, which callers skip with a warning.
    pub fn from_node(node: &Node) -> Result<Option<Self>, crate::api::GpuStateError> {
        let Some(gpus) = ClusterNode::from_node(node)? else {
            return Ok(None);
        };
        let spec = node.spec.as_ref();
        Ok(Some(Self {
            gpus,
            readiness: readiness(node),
            cordoned: spec.and_then(|s| s.unschedulable).unwrap_or(false),
            taints: spec.and_then(|s| s.taints.clone()).unwrap_or_default(),
        }))
    }

    pub(crate) fn name(&self) -> &str {
        &self.gpus.name
    }

    /// True when the node has been NotReady for longer than `grace`: its
    /// shards count as lost.
    pub(crate) fn lost(&self, now: Timestamp, grace: Duration) -> bool {
        match &self.readiness {
            Readiness::NotReady { since: Some(t) } => now
                .duration_since(*t)
                .try_into()
                .is_ok_and(|d: Duration| d > grace),
            // Without a transition time there is no way to wait out the grace period.
            Readiness::NotReady { since: None } => true,
            Readiness::Ready | Readiness::Unreported => false,
        }
    }

    /// Whether a new shard with these tolerations may be placed here, and if
    /// not, why (for the explanation of an unsatisfiable plan).
    pub(crate) fn accepts(&self, tolerations: &[Toleration]) -> Result<(), String> {
        if self.cordoned {
            return Err(format!("node {} is cordoned", self.name()));
        }
        if matches!(self.readiness, Readiness::NotReady { .. }) {
            return Err(format!("node {} is not ready", self.name()));
        }
        for taint in &self.taints {
            let blocking = taint.effect == "NoSchedule" || taint.effect == "NoExecute";
            if blocking && !tolerations.iter().any(|tol| tolerates(tol, taint)) {
                return Err(format!(
                    "node {} has taint {}{}:{} that the shard pod template does not tolerate",
                    self.name(),
                    taint.key,
                    taint
                        .value
                        .as_deref()
                        .map(|v| format!("={v}"))
                        .unwrap_or_default(),
                    taint.effect
                ));
            }
        }
        Ok(())
    }
}

fn readiness(node: &Node) -> Readiness {
    let ready = node
        .status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .and_then(|c| c.iter().find(|c| c.type_ == "Ready"));
    match ready {
        None => Readiness::Unreported,
        Some(condition) if condition.status == "True" => Readiness::Ready,
        Some(condition) => Readiness::NotReady {
            since: condition.last_transition_time.as_ref().map(|t| t.0),
        },
    }
}

/// The Kubernetes toleration rule: an empty key with `Exists` tolerates
/// everything; an empty effect matches every effect.
fn tolerates(tol: &Toleration, taint: &Taint) -> bool {
    if let Some(effect) = tol.effect.as_deref()
        && !effect.is_empty()
        && effect != taint.effect
    {
        return false;
    }
    let key = tol.key.as_deref().unwrap_or("");
    match tol.operator.as_deref().unwrap_or("Equal") {
        "Exists" => key.is_empty() || key == taint.key,
        _ => {
            key == taint.key
                && tol.value.as_deref().unwrap_or("") == taint.value.as_deref().unwrap_or("")
        }
    }
}

/// Parsed GPU states by node, re-parsed only when a Node's resource version
/// changes: reading a thousand annotations costs tens of milliseconds, far
/// more than the rest of a reconcile.
#[derive(Default)]
pub struct ParsedNodes(Mutex<HashMap<String, Parsed>>);

/// A node's resource version and what its annotation said (`None`: no GPU
/// state, or a malformed one).
type Parsed = (String, Option<Arc<NodeInfo>>);

impl ParsedNodes {
    /// The GPU nodes among `nodes`. A Node without a resource version (never
    /// the case for API objects) is parsed every time.
    pub fn read(&self, nodes: &[Arc<Node>]) -> Vec<Arc<NodeInfo>> {
        let mut cache = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        let mut out = Vec::new();
        let mut seen = HashSet::with_capacity(nodes.len());
        for node in nodes {
            let name = node.metadata.name.as_deref().unwrap_or_default();
            seen.insert(name);
            let version = node.metadata.resource_version.as_deref();
            let hit = match (cache.get(name), version) {
                (Some((v, info)), Some(now)) if v == now => Some(info.clone()),
                _ => None,
            };
            let info = hit.unwrap_or_else(|| {
                let info = NodeInfo::from_node(node).ok().flatten().map(Arc::new);
                if let Some(v) = version {
                    cache.insert(name.to_string(), (v.to_string(), info.clone()));
                }
                info
            });
            out.extend(info);
        }
        cache.retain(|name, _| seen.contains(name.as_str()));
        out
    }
}

/// What the controller says about a Node's GPU state beyond using it: a state
/// it must skip, or fields it ignored (written by a newer agent, or by hand
/// with a typo). Each is logged when it first appears for a node, not on
/// every Node update.
#[derive(Default)]
pub(crate) struct StateReports(HashMap<String, String>);

impl StateReports {
    /// Logs what is new about this node's state; returns it too.
    pub(crate) fn observe(&mut self, node: &Node) -> Option<String> {
        let name = node.metadata.name.clone().unwrap_or_default();
        let Some(report) = state_report(node) else {
            self.0.remove(&name);
            return None;
        };
        if self.0.get(&name) == Some(&report) {
            return None;
        }
        tracing::warn!(node = %name, "{report}");
        self.0.insert(name, report.clone());
        Some(report)
    }
}

fn state_report(node: &Node) -> Option<String> {
    let text = NodeGpuState::annotation_of(&node.metadata)?;
    match NodeGpuState::from_json_listing_unknown(text) {
        Err(e) => Some(format!("skipping the node's GPU state: {e}")),
        Ok((_, unknown)) if !unknown.is_empty() => Some(format!(
            "ignoring fields of the node's GPU state this controller does not know: {}",
            unknown.join(", ")
        )),
        Ok(_) => None,
    }
}

/// What of a Node the controller keeps in its cache. Images, addresses,
/// managed fields and the rest of the status are dropped: with thousands of
/// nodes they would dominate the controller's memory.
pub fn trim_node(node: &mut Node) {
    let meta = std::mem::take(&mut node.metadata);
    let annotations = meta.annotations.and_then(|mut a| {
        let keep = a.remove(GPU_STATE_ANNOTATION)?;
        Some(
            [(GPU_STATE_ANNOTATION.to_string(), keep)]
                .into_iter()
                .collect(),
        )
    });
    node.metadata = ObjectMeta {
        name: meta.name,
        uid: meta.uid,
        resource_version: meta.resource_version,
        labels: meta.labels,
        annotations,
        ..ObjectMeta::default()
    };
    node.spec = node.spec.take().map(|s| NodeSpec {
        taints: s.taints,
        unschedulable: s.unschedulable,
        ..NodeSpec::default()
    });
    let ready: Option<Vec<NodeCondition>> = node.status.take().and_then(|s| {
        s.conditions
            .map(|c| c.into_iter().filter(|c| c.type_ == "Ready").collect())
    });
    node.status = ready.map(|conditions| NodeStatus {
        conditions: Some(conditions),
        ..NodeStatus::default()
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::NodeGpuState;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

    pub(crate) fn gpu_node(name: &str) -> Node {
        let state = NodeGpuState::from_json(r#"{"version":"v1","backend":"fake"}"#).unwrap();
        Node {
            metadata: ObjectMeta {
                name: Some(name.into()),
                annotations: Some(
                    [
                        (GPU_STATE_ANNOTATION.to_string(), state.to_json()),
                        ("other".to_string(), "x".to_string()),
                    ]
                    .into_iter()
                    .collect(),
                ),
                ..Default::default()
            },
            ..Default::default()
        }
    }

    #[test]
    fn unknown_fields_and_malformed_states_are_reported_once_per_change() {
        let mut reports = StateReports::default();
        let mut n = gpu_node("a");
        assert_eq!(reports.observe(&n), None, "a clean state says nothing");
        let with = |n: &mut Node, text: &str| {
            n.metadata
                .annotations
                .as_mut()
                .unwrap()
                .insert(GPU_STATE_ANNOTATION.to_string(), text.to_string());
        };
        with(
            &mut n,
            r#"{"version":"v1","backend":"fake","coolant":"water"}"#,
        );
        let first = reports.observe(&n).unwrap();
        assert!(first.contains("does not know: coolant"), "{first}");
        assert_eq!(reports.observe(&n), None, "the same report is not repeated");
        // Tolerated: the node is still planned on.
        assert!(NodeInfo::from_node(&n).unwrap().is_some());
        with(
            &mut n,
            r#"{"version":"v1","backend":"fake","devices":[{}]}"#,
        );
        let bad = reports.observe(&n).unwrap();
        assert!(bad.contains("skipping the node's GPU state"), "{bad}");
        with(&mut n, r#"{"version":"v1","backend":"fake"}"#);
        assert_eq!(reports.observe(&n), None);
        with(
            &mut n,
            r#"{"version":"v1","backend":"fake","devices":[{}]}"#,
        );
        assert!(
            reports.observe(&n).is_some(),
            "a problem that comes back is reported again"
        );
    }

    fn taint(key: &str, value: Option<&str>, effect: &str) -> Taint {
        Taint {
            key: key.into(),
            value: value.map(Into::into),
            effect: effect.into(),
            time_added: None,
        }
    }

    fn toleration(
        key: Option<&str>,
        op: &str,
        value: Option<&str>,
        effect: Option<&str>,
    ) -> Toleration {
        Toleration {
            key: key.map(Into::into),
            operator: Some(op.into()),
            value: value.map(Into::into),
            effect: effect.map(Into::into),
            toleration_seconds: None,
        }
    }

    fn ready(status: &str, at: &str) -> NodeStatus {
        NodeStatus {
            conditions: Some(vec![NodeCondition {
                type_: "Ready".into(),
                status: status.into(),
                last_transition_time: Some(Time(at.parse().unwrap())),
                ..Default::default()
            }]),
            ..Default::default()
        }
    }

    #[test]
    fn readiness_and_grace() {
        let now: Timestamp = "2026-01-01T00:10:00Z".parse().unwrap();
        let grace = Duration::from_secs(300);
        let mut n = gpu_node("a");
        let info = NodeInfo::from_node(&n).unwrap().unwrap();
        assert_eq!(info.readiness, Readiness::Unreported);
        assert!(info.accepts(&[]).is_ok());
        n.status = Some(ready("False", "2026-01-01T00:08:00Z"));
        let info = NodeInfo::from_node(&n).unwrap().unwrap();
        assert!(
            !info.lost(now, grace),
            "2 minutes is within the grace period"
        );
        assert!(info.accepts(&[]).unwrap_err().contains("not ready"));
        n.status = Some(ready("Unknown", "2026-01-01T00:01:00Z"));
        assert!(NodeInfo::from_node(&n).unwrap().unwrap().lost(now, grace));
        n.status = Some(ready("True", "2026-01-01T00:01:00Z"));
        let info = NodeInfo::from_node(&n).unwrap().unwrap();
        assert_eq!(info.readiness, Readiness::Ready);
        assert!(!info.lost(now, grace));
    }

    #[test]
    fn cordons_and_taints_keep_new_shards_away() {
        let mut n = gpu_node("a");
        n.spec = Some(NodeSpec {
            unschedulable: Some(true),
            ..Default::default()
        });
        assert!(
            NodeInfo::from_node(&n)
                .unwrap()
                .unwrap()
                .accepts(&[])
                .unwrap_err()
                .contains("cordoned")
        );
        n.spec = Some(NodeSpec {
            taints: Some(vec![
                taint("nvidia.com/gpu", Some("present"), "NoSchedule"),
                taint("soft", None, "PreferNoSchedule"),
            ]),
            ..Default::default()
        });
        let info = NodeInfo::from_node(&n).unwrap().unwrap();
        let e = info.accepts(&[]).unwrap_err();
        assert!(e.contains("nvidia.com/gpu=present:NoSchedule"), "{e}");
        for (tol, ok) in [
            (
                toleration(Some("nvidia.com/gpu"), "Exists", None, None),
                true,
            ),
            (
                toleration(
                    Some("nvidia.com/gpu"),
                    "Equal",
                    Some("present"),
                    Some("NoSchedule"),
                ),
                true,
            ),
            (
                toleration(Some("nvidia.com/gpu"), "Equal", Some("other"), None),
                false,
            ),
            (
                toleration(Some("nvidia.com/gpu"), "Exists", None, Some("NoExecute")),
                false,
            ),
            (toleration(None, "Exists", None, None), true),
        ] {
            assert_eq!(
                info.accepts(std::slice::from_ref(&tol)).is_ok(),
                ok,
                "{tol:?}"
            );
        }
    }

    #[test]
    fn nodes_without_or_with_broken_state() {
        let mut n = gpu_node("a");
        n.metadata.annotations = None;
        assert_eq!(NodeInfo::from_node(&n).unwrap(), None);
        n.metadata.annotations = Some(
            [(GPU_STATE_ANNOTATION.to_string(), "[]".to_string())]
                .into_iter()
                .collect(),
        );
        assert!(NodeInfo::from_node(&n).is_err());
    }

    #[test]
    fn parsed_nodes_follow_resource_versions() {
        let cache = ParsedNodes::default();
        let mut a = gpu_node("a");
        a.metadata.resource_version = Some("1".into());
        let mut cpu = gpu_node("cpu");
        cpu.metadata.annotations = None;
        cpu.metadata.resource_version = Some("1".into());
        let first = cache.read(&[Arc::new(a.clone()), Arc::new(cpu)]);
        assert_eq!(first.len(), 1, "nodes without GPU state are left out");
        let again = cache.read(&[Arc::new(a.clone())]);
        assert!(
            Arc::ptr_eq(&first[0], &again[0]),
            "an unchanged node is not parsed again"
        );
        a.metadata.resource_version = Some("2".into());
        a.metadata.annotations =
            Some([(GPU_STATE_ANNOTATION.to_string(), "{broken".to_string())].into());
        assert!(
            cache.read(&[Arc::new(a)]).is_empty(),
            "a changed node is parsed again"
        );
        assert_eq!(
            cache.0.lock().unwrap().len(),
            1,
            "nodes that left are forgotten"
        );
    }

    #[test]
    fn trimming_keeps_what_planning_reads() {
        let mut n = gpu_node("a");
        n.metadata.managed_fields = Some(vec![Default::default()]);
        n.spec = Some(NodeSpec {
            pod_cidr: Some("10.0.0.0/24".into()),
            taints: Some(vec![taint("k", None, "NoSchedule")]),
            ..Default::default()
        });
        let mut status = ready("True", "2026-01-01T00:00:00Z");
        status.images = Some(vec![Default::default()]);
        n.status = Some(status);
        let before = NodeInfo::from_node(&n).unwrap().unwrap();
        trim_node(&mut n);
        assert_eq!(NodeInfo::from_node(&n).unwrap().unwrap(), before);
        assert!(n.metadata.managed_fields.is_none());
        assert_eq!(n.metadata.annotations.as_ref().unwrap().len(), 1);
        assert!(n.spec.as_ref().unwrap().pod_cidr.is_none());
        assert!(n.status.as_ref().unwrap().images.is_none());
    }
}
