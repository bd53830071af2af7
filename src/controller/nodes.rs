//! Nodes as the controller sees them: published GPU state, readiness, and
//! whether new shards may go there (cordons and taints).

use std::time::Duration;

use k8s_openapi::api::core::v1::{Node, Taint, Toleration};
use k8s_openapi::jiff::Timestamp;

use tessera_core::translate::ClusterNode;

/// The tolerations of an instance's shard pods (its template's).
pub(crate) fn tolerations_of(spec: &tessera_core::api::ModelInstanceSpec) -> Vec<Toleration> {
    spec.template
        .as_ref()
        .and_then(|t| t.spec.as_ref())
        .and_then(|s| s.tolerations.clone())
        .unwrap_or_default()
}

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
    pub fn from_node(node: &Node) -> Result<Option<Self>, tessera_core::api::GpuStateError> {
        let Some(gpus) = ClusterNode::from_node(node)? else {
            return Ok(None);
        };
        Ok(Some(Self::with_gpus(node, gpus)))
    }

    /// The node with its GPU state already read.
    pub(crate) fn with_gpus(node: &Node, gpus: ClusterNode) -> Self {
        let spec = node.spec.as_ref();
        Self {
            gpus,
            readiness: readiness(node),
            cordoned: spec.and_then(|s| s.unschedulable).unwrap_or(false),
            taints: spec.and_then(|s| s.taints.clone()).unwrap_or_default(),
        }
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

#[cfg(test)]
pub(crate) mod tests {
    use k8s_openapi::api::core::v1::{NodeCondition, NodeSpec, NodeStatus};
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};

    use super::*;
    use tessera_core::api::{GPU_STATE_ANNOTATION, NodeGpuState};

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

    pub(crate) fn taint(key: &str, value: Option<&str>, effect: &str) -> Taint {
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

    pub(crate) fn ready(status: &str, at: &str) -> NodeStatus {
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
}
