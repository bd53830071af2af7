//! What the controller keeps of a Node: its name, its resource version and
//! its GPU state, parsed once when the Node arrives from the watch. The rest
//! (the annotation's JSON text, images, addresses, managed fields, most of
//! the status) is dropped there, before the cache stores anything: at
//! thousands of nodes the text and the parse side by side doubled the cache.
//! The watch filter, the state reports and every reconcile read this one
//! parse.

use std::collections::HashMap;
use std::sync::Arc;

use k8s_openapi::api::core::v1::Node;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::runtime::watcher;

use super::cached_resource::cached_resource;
use super::nodes::NodeInfo;
use tessera_core::translate::ClusterNode;

/// A Node as the controller's cache holds it. A `Resource` of the Node's own
/// kind, so kube-runtime's reflector and the controller's triggers take it
/// as they would the Node; it reads from a Node's JSON too.
#[derive(Clone, Debug, serde::Deserialize)]
#[serde(from = "Node")]
pub struct CachedNode {
    metadata: ObjectMeta,
    /// The node as planning reads it; `None` for a node without GPU state or
    /// with one the controller must skip (then `report` says why).
    pub(crate) info: Option<Arc<NodeInfo>>,
    /// What to say about the state beyond using it: why it is skipped, or
    /// which fields (from a newer agent, or a typo) were ignored.
    pub(crate) report: Option<String>,
}

impl From<Node> for CachedNode {
    fn from(node: Node) -> Self {
        let (info, report) = match ClusterNode::from_node_listing_unknown(&node) {
            Ok(None) => (None, None),
            Err(e) => (None, Some(format!("skipping the node's GPU state: {e}"))),
            Ok(Some((gpus, unknown))) => {
                let report = (!unknown.is_empty()).then(|| {
                    format!(
                        "ignoring fields of the node's GPU state this controller does not know: {}",
                        unknown.join(", ")
                    )
                });
                (Some(Arc::new(NodeInfo::with_gpus(&node, gpus))), report)
            }
        };
        Self {
            metadata: ObjectMeta {
                name: node.metadata.name,
                resource_version: node.metadata.resource_version,
                ..ObjectMeta::default()
            },
            info,
            report,
        }
    }
}

/// The watch's events with each Node turned into what the cache keeps.
pub(crate) fn cached(event: watcher::Event<Node>) -> watcher::Event<CachedNode> {
    use watcher::Event;
    match event {
        Event::Apply(node) => Event::Apply(node.into()),
        Event::Delete(node) => Event::Delete(node.into()),
        Event::InitApply(node) => Event::InitApply(node.into()),
        Event::Init => Event::Init,
        Event::InitDone => Event::InitDone,
    }
}

/// The GPU nodes among a cache's nodes.
pub fn gpu_nodes(nodes: &[Arc<CachedNode>]) -> Vec<Arc<NodeInfo>> {
    nodes.iter().filter_map(|n| n.info.clone()).collect()
}

/// Each node's report, logged when it first appears, not on every Node
/// update.
#[derive(Default)]
pub(crate) struct StateReports(HashMap<String, String>);

impl StateReports {
    /// Logs what is new about this node's state; returns it too.
    pub(crate) fn observe<'a>(&mut self, node: &'a CachedNode) -> Option<&'a str> {
        let name = node.metadata.name.as_deref().unwrap_or_default();
        let Some(report) = &node.report else {
            self.0.remove(name);
            return None;
        };
        if self.0.get(name) == Some(report) {
            return None;
        }
        tracing::warn!(node = %name, "{report}");
        self.0.insert(name.to_string(), report.clone());
        Some(report)
    }
}

cached_resource!(CachedNode, Node);

#[cfg(test)]
mod tests {
    use k8s_openapi::api::core::v1::{NodeSpec, NodeStatus};
    use kube::ResourceExt;

    use super::*;
    use crate::controller::nodes::tests::{gpu_node, ready, taint};
    use tessera_core::api::GPU_STATE_ANNOTATION;

    fn with_state(mut node: Node, text: &str) -> Node {
        node.metadata
            .annotations
            .get_or_insert_with(Default::default)
            .insert(GPU_STATE_ANNOTATION.to_string(), text.to_string());
        node
    }

    #[test]
    fn keeps_what_planning_reads_and_drops_the_rest() {
        let mut n = gpu_node("a");
        n.metadata.resource_version = Some("7".into());
        n.metadata.labels = Some([("topology.kubernetes.io/zone".into(), "z1".into())].into());
        n.metadata.managed_fields = Some(vec![Default::default()]);
        n.spec = Some(NodeSpec {
            pod_cidr: Some("10.0.0.0/24".into()),
            taints: Some(vec![taint("k", None, "NoSchedule")]),
            unschedulable: Some(true),
            ..Default::default()
        });
        let mut status: NodeStatus = ready("False", "2026-01-01T00:00:00Z");
        status.images = Some(vec![Default::default()]);
        n.status = Some(status);
        let parsed = NodeInfo::from_node(&n).unwrap().unwrap();

        let cached = CachedNode::from(n);
        assert_eq!(cached.info.as_deref(), Some(&parsed));
        assert_eq!(cached.name_any(), "a");
        assert_eq!(cached.resource_version().as_deref(), Some("7"));
        assert!(cached.annotations().is_empty(), "the JSON text is not kept");
        assert!(cached.labels().is_empty(), "labels live in the parse");
        assert!(cached.managed_fields().is_empty());
        assert_eq!(cached.report, None);
    }

    #[test]
    fn nodes_without_gpu_state_are_kept_without_a_parse() {
        let mut n = gpu_node("cpu");
        n.metadata.annotations = None;
        let cached = CachedNode::from(n);
        assert!(cached.info.is_none());
        assert_eq!(cached.report, None);
    }

    #[test]
    fn malformed_states_are_skipped_and_unknown_fields_tolerated_with_a_report() {
        let bad = CachedNode::from(with_state(gpu_node("a"), "{broken"));
        assert!(bad.info.is_none());
        let report = bad.report.unwrap();
        assert!(report.contains("skipping the node's GPU state"), "{report}");

        let wrong = CachedNode::from(with_state(
            gpu_node("a"),
            r#"{"version":"v9","backend":"fake"}"#,
        ));
        assert!(wrong.info.is_none());
        assert!(wrong.report.unwrap().contains("v9"));

        let newer = CachedNode::from(with_state(
            gpu_node("a"),
            r#"{"version":"v1","backend":"fake","coolant":"water"}"#,
        ));
        assert!(newer.info.is_some(), "still planned on");
        let report = newer.report.unwrap();
        assert!(report.contains("does not know: coolant"), "{report}");
    }

    #[test]
    fn reports_are_logged_once_per_change() {
        let mut reports = StateReports::default();
        let clean = CachedNode::from(gpu_node("a"));
        let newer = CachedNode::from(with_state(
            gpu_node("a"),
            r#"{"version":"v1","backend":"fake","coolant":"water"}"#,
        ));
        let broken = CachedNode::from(with_state(
            gpu_node("a"),
            r#"{"version":"v1","backend":"fake","devices":[{}]}"#,
        ));
        assert_eq!(reports.observe(&clean), None, "a clean state says nothing");
        assert!(reports.observe(&newer).is_some());
        assert_eq!(
            reports.observe(&newer),
            None,
            "the same report is not repeated"
        );
        assert!(reports.observe(&broken).is_some());
        assert_eq!(reports.observe(&clean), None);
        assert!(
            reports.observe(&broken).is_some(),
            "a problem that comes back is reported again"
        );
    }

    #[test]
    fn reads_from_a_nodes_json() {
        let json = serde_json::to_value(gpu_node("a")).unwrap();
        let cached: CachedNode = serde_json::from_value(json).unwrap();
        assert_eq!(cached.name_any(), "a");
        assert!(cached.info.is_some());
        let broken: Result<CachedNode, _> = serde_json::from_str(r#"{"metadata": []}"#);
        assert!(broken.is_err());
    }

    #[test]
    fn events_keep_their_kind() {
        use watcher::Event;
        let node = gpu_node("a");
        assert!(matches!(cached(Event::Apply(node.clone())), Event::Apply(n) if n.info.is_some()));
        assert!(matches!(
            cached(Event::Delete(node.clone())),
            Event::Delete(_)
        ));
        assert!(matches!(
            cached(Event::InitApply(node)),
            Event::InitApply(_)
        ));
        assert!(matches!(cached(Event::Init), Event::Init));
        assert!(matches!(cached(Event::InitDone), Event::InitDone));
    }

    #[test]
    fn the_cache_reports_the_gpu_nodes() {
        let mut cpu = gpu_node("cpu");
        cpu.metadata.annotations = None;
        let nodes = [gpu_node("a"), cpu, gpu_node("b")].map(|n| Arc::new(CachedNode::from(n)));
        let gpus = gpu_nodes(&nodes);
        let names: Vec<&str> = gpus.iter().map(|i| i.name()).collect();
        assert_eq!(names, ["a", "b"]);
        assert!(Arc::ptr_eq(&gpus[0], nodes[0].info.as_ref().unwrap()));
    }
}
