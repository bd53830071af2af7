//! Which Node updates wake instances. Every agent's write reaches the
//! controller, but most only move telemetry (temperature, power, free
//! memory). Waking every waiting instance on each of them starves those
//! instances at scale: the reconcile queue's debounce restarts with every
//! trigger, and a thousand nodes write several times a second. So a change
//! to what placement hinges on (devices, health, allocations, links,
//! readiness, cordon, taints, labels) wakes at once; telemetry alone wakes
//! at most once per [`TELEMETRY_WAKE_EVERY`] for the whole cluster, which is
//! enough for a waiting instance to notice a device that cooled down or
//! memory that was freed. The cache itself sees every update either way.

use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::time::{Duration, Instant};

use kube::ResourceExt;

use super::node_cache::CachedNode;
use super::nodes::NodeInfo;
use super::triggers::Touch;
use tessera_core::translate::ClusterNode;

/// How often telemetry-only updates may wake instances.
pub(crate) const TELEMETRY_WAKE_EVERY: Duration = Duration::from_secs(10);

#[derive(Default)]
pub(crate) struct NodeChanges {
    /// A fingerprint of each GPU node as last seen, telemetry left out (a
    /// hash, so five thousand nodes cost kilobytes, not megabytes).
    seen: HashMap<String, u64>,
    last_telemetry_wake: Option<Instant>,
}

impl NodeChanges {
    /// Whether this touch of `node` should wake the instances it concerns.
    pub(crate) fn wakes(&mut self, node: &CachedNode, touch: Touch, now: Instant) -> bool {
        let name = node.name_any();
        if touch == Touch::Deleted {
            return self.seen.remove(&name).is_some();
        }
        let Some(info) = &node.info else {
            // Not (or no longer) a GPU node the controller can plan on: that
            // matters once, to instances planned on it.
            return self.seen.remove(&name).is_some();
        };
        let fingerprint = fingerprint(&without_telemetry(info));
        if self.seen.insert(name, fingerprint) != Some(fingerprint) {
            return true;
        }
        let due = self
            .last_telemetry_wake
            .is_none_or(|last| now.saturating_duration_since(last) >= TELEMETRY_WAKE_EVERY);
        if due {
            self.last_telemetry_wake = Some(now);
        }
        due
    }
}

/// Every field takes part through its debug form (floats have no `Hash`).
fn fingerprint(info: &NodeInfo) -> u64 {
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    format!("{info:?}").hash(&mut hasher);
    hasher.finish()
}

/// What is telemetry is the API's one definition (`api::telemetry`); the
/// state is copied once, without it.
fn without_telemetry(info: &NodeInfo) -> NodeInfo {
    NodeInfo {
        gpus: ClusterNode {
            name: info.gpus.name.clone(),
            labels: info.gpus.labels.clone(),
            gpu_state: info.gpus.gpu_state.without_telemetry(),
        },
        readiness: info.readiness.clone(),
        cordoned: info.cordoned,
        taints: info.taints.clone(),
    }
}

#[cfg(test)]
mod tests {
    use k8s_openapi::api::core::v1::Node;
    use serde_json::json;

    use super::*;
    use tessera_core::api::GPU_STATE_ANNOTATION;

    fn node(temperature: f64, health: &str, allocated: Option<&str>) -> CachedNode {
        let mut state = json!({"version": "v1", "backend": "fake", "devices": [{
            "id": "g0", "index": 0, "vendor": "nvidia", "product": "H100",
            "memoryTotalBytes": 85899345920u64, "memoryFreeBytes": 80000000000u64,
            "fp16Tflops": 989.0, "memoryBandwidthGbps": 3350.0,
            "temperatureC": temperature, "health": health,
        }]});
        if let Some(uid) = allocated {
            state["allocated"] = json!({"g0": uid});
        }
        let node: Node = serde_json::from_value(json!({
            "metadata": {"name": "n1", "annotations": {GPU_STATE_ANNOTATION: state.to_string()}},
        }))
        .unwrap();
        node.into()
    }

    fn cpu_node() -> CachedNode {
        let node: Node = serde_json::from_value(json!({"metadata": {"name": "n1"}})).unwrap();
        node.into()
    }

    #[test]
    fn placement_changes_wake_at_once_and_telemetry_at_most_every_ten_seconds() {
        let mut changes = NodeChanges::default();
        let t0 = Instant::now();
        assert!(
            changes.wakes(&node(40.0, "Healthy", None), Touch::Applied, t0),
            "a new node"
        );
        // Telemetry alone: the first wakes, the next ones within the period do not.
        assert!(changes.wakes(&node(41.0, "Healthy", None), Touch::Applied, t0));
        assert!(!changes.wakes(
            &node(42.0, "Healthy", None),
            Touch::Applied,
            t0 + Duration::from_secs(1)
        ));
        assert!(!changes.wakes(
            &node(43.0, "Healthy", None),
            Touch::Applied,
            t0 + Duration::from_secs(9)
        ));
        // What placement hinges on wakes at once, however recent the last wake.
        let t1 = t0 + Duration::from_secs(9);
        assert!(changes.wakes(&node(43.0, "Healthy", Some("pod-a")), Touch::Applied, t1));
        assert!(changes.wakes(&node(43.0, "Unhealthy", Some("pod-a")), Touch::Applied, t1));
        assert!(!changes.wakes(&node(44.0, "Unhealthy", Some("pod-a")), Touch::Applied, t1));
        assert!(changes.wakes(
            &node(44.0, "Unhealthy", Some("pod-a")),
            Touch::Applied,
            t0 + TELEMETRY_WAKE_EVERY
        ));
    }

    #[test]
    fn nodes_without_gpu_state_wake_only_when_they_stop_publishing() {
        let mut changes = NodeChanges::default();
        let t0 = Instant::now();
        let cpu_node = cpu_node();
        assert!(
            !changes.wakes(&cpu_node, Touch::Applied, t0),
            "never a GPU node"
        );
        assert!(changes.wakes(&node(40.0, "Healthy", None), Touch::Applied, t0));
        assert!(
            changes.wakes(&cpu_node, Touch::Applied, t0),
            "its state went away"
        );
        assert!(!changes.wakes(&cpu_node, Touch::Applied, t0));
    }

    #[test]
    fn a_deleted_gpu_node_wakes_once() {
        let mut changes = NodeChanges::default();
        let t0 = Instant::now();
        let gpu_node = node(40.0, "Healthy", None);
        assert!(changes.wakes(&gpu_node, Touch::Applied, t0));
        // As it was last seen: nothing in it changed, yet it is gone.
        assert!(changes.wakes(&gpu_node, Touch::Deleted, t0));
        assert!(!changes.wakes(&gpu_node, Touch::Deleted, t0));
        let cpu_node = cpu_node();
        assert!(
            !changes.wakes(&cpu_node, Touch::Deleted, t0),
            "never a GPU node"
        );
    }
}
