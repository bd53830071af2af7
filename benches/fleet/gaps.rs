//! The simulated Nodes' writes as a Node watcher in this process sees them,
//! from the first publish to the end of the churn (an API server restart,
//! which holds watch events back, is left out): before every write that
//! changed telemetry alone (no device's health, no allocation), how long
//! since that Node's previous write. The steady-state target (at most one
//! write per node per 5 minutes while only telemetry drifts) holds when no
//! such gap is shorter than the publish interval; unlike a count over one
//! window, this does not depend on where the window falls. The times are when
//! the events were read here, so a busy simulator or API server that delays
//! one event shortens the next gap by as much. (The API server's own
//! managed-fields time would be exact, but a 1.24 API server does not move it
//! when only a value changes.)

use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use futures::StreamExt;
use k8s_openapi::api::core::v1::Node;
use kube::api::Api;
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Client, ResourceExt};
use tessera::api::{GPU_STATE_ANNOTATION, Health, NodeGpuState};

/// What placement sees of a node's state: each device's health, and the
/// allocations. A write that leaves it unchanged changed telemetry alone.
type PlacementPart = (
    Vec<(String, Health, Option<String>)>,
    BTreeMap<String, String>,
);

fn placement_part(state: &NodeGpuState) -> PlacementPart {
    (
        state
            .devices
            .iter()
            .map(|d| (d.id.clone(), d.health, d.health_reason.clone()))
            .collect(),
        state.allocated.clone(),
    )
}

struct Last {
    annotation: String,
    placement: Option<PlacementPart>,
    at: Instant,
}

#[derive(Default)]
pub struct DriftGaps {
    last: Mutex<HashMap<String, Last>>,
    gaps: Mutex<Vec<Duration>>,
}

impl DriftGaps {
    fn observe(&self, node: &Node, now: Instant) {
        let Some(annotation) = node.annotations().get(GPU_STATE_ANNOTATION) else {
            return;
        };
        let Ok(mut last) = self.last.lock() else {
            return;
        };
        let name = node.name_any();
        let previous = last.get(&name);
        if previous.is_some_and(|p| p.annotation == *annotation) {
            return;
        }
        let placement = NodeGpuState::from_json(annotation)
            .ok()
            .map(|s| placement_part(&s));
        if let Some(previous) = previous
            && placement.is_some()
            && previous.placement == placement
            && let Ok(mut gaps) = self.gaps.lock()
        {
            gaps.push(now.saturating_duration_since(previous.at));
        }
        last.insert(
            name,
            Last {
                annotation: annotation.clone(),
                placement,
                at: now,
            },
        );
    }

    /// The gaps before telemetry-only writes, shortest first.
    pub fn gaps(&self) -> Vec<Duration> {
        let mut gaps = self.gaps.lock().map(|g| g.clone()).unwrap_or_default();
        gaps.sort();
        gaps
    }

    /// Runs until dropped.
    pub async fn watch(&self, client: Client, label_selector: String) {
        let nodes: Api<Node> = Api::all(client);
        let stream = tessera::watch_backoff::with_backoff(
            "simulated Nodes (drift gaps)",
            watcher(nodes, watcher::Config::default().labels(&label_selector)),
        )
        .touched_objects();
        let mut stream = std::pin::pin!(stream);
        while let Some(event) = stream.next().await {
            if let Ok(node) = event {
                self.observe(&node, Instant::now());
            }
        }
    }
}
