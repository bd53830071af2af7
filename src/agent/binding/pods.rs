//! What the binding index keeps of one pod on the node ([`PodInfo`]), read
//! from the Pod object: its phase, its planned devices (annotation
//! `tessera.dev/devices`) and how many devices of the served resource it
//! asks for.

use std::collections::HashSet;

use k8s_openapi::api::core::v1::{Container, Pod};
use k8s_openapi::jiff::Timestamp;

use crate::agent::holders::Holder;
use tessera_core::api::DEVICES_ANNOTATION;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Phase {
    /// Pending, or no status yet: not started.
    Waiting,
    Running,
    /// Succeeded or Failed: holds no devices.
    Finished,
    Unknown,
}

/// The devices a pod was planned on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Plan {
    /// In the annotation's order, without duplicates: what kubelet is offered.
    pub(super) devices: Vec<String>,
    /// The same sorted, for comparing with requests.
    pub(super) sorted: Vec<String>,
}

/// What the index keeps of one pod on the node.
#[derive(Clone, Debug)]
pub(super) struct PodInfo {
    /// `namespace/name`.
    pub(super) key: String,
    pub(super) created: Option<Timestamp>,
    pub(super) phase: Phase,
    pub(super) deleting: bool,
    pub(super) plan: Option<Plan>,
    /// Devices of our resource the pod asks for.
    pub(super) wants: u64,
    /// The pod and, for a tessera shard, which one (its labels).
    pub(super) holder: Holder,
}

impl PodInfo {
    pub(super) fn live(&self) -> bool {
        self.phase != Phase::Finished
    }

    /// Planned, not started and not going away: still waiting for its devices.
    pub(super) fn pending(&self) -> bool {
        self.plan.is_some() && self.phase == Phase::Waiting && !self.deleting
    }

    /// A pod without a binding that may use (or be about to use) our devices.
    pub(super) fn ordinary_user(&self) -> bool {
        self.plan.is_none() && self.live() && self.wants > 0
    }

    /// Oldest first: creation time (unknown last), then `namespace/name`.
    pub(super) fn age_key(&self) -> (bool, Option<Timestamp>, &str) {
        (self.created.is_none(), self.created, &self.key)
    }
}

/// The pod's UID and what the index keeps of it; `None` without a UID.
pub(super) fn pod_info(pod: &Pod, resource: &str) -> Option<(String, PodInfo)> {
    let uid = pod.metadata.uid.clone().filter(|uid| !uid.is_empty())?;
    let key = pod_key(pod);
    let info = PodInfo {
        created: pod.metadata.creation_timestamp.as_ref().map(|time| time.0),
        phase: phase_of(pod),
        deleting: pod.metadata.deletion_timestamp.is_some(),
        plan: plan_of(pod, &key),
        wants: devices_wanted(pod, resource),
        holder: Holder::from_labels(
            pod.metadata.namespace.as_deref().unwrap_or("default"),
            pod.metadata.name.as_deref().unwrap_or(""),
            pod.metadata.labels.as_ref(),
        ),
        key,
    };
    Some((uid, info))
}

/// `namespace/name`.
pub(super) fn pod_key(pod: &Pod) -> String {
    format!(
        "{}/{}",
        pod.metadata.namespace.as_deref().unwrap_or("default"),
        pod.metadata.name.as_deref().unwrap_or("")
    )
}

fn phase_of(pod: &Pod) -> Phase {
    match pod
        .status
        .as_ref()
        .and_then(|status| status.phase.as_deref())
    {
        None | Some("Pending") => Phase::Waiting,
        Some("Running") => Phase::Running,
        Some("Succeeded" | "Failed") => Phase::Finished,
        Some(_) => Phase::Unknown,
    }
}

/// The pod's planned devices; an annotation naming none is ignored with a warning.
fn plan_of(pod: &Pod, key: &str) -> Option<Plan> {
    let annotation = pod
        .metadata
        .annotations
        .as_ref()
        .and_then(|annotations| annotations.get(DEVICES_ANNOTATION))?;
    let Some(devices) = parse_plan(annotation) else {
        tracing::warn!(pod = %key, value = %annotation, "ignoring a {DEVICES_ANNOTATION} annotation that names no device");
        return None;
    };
    let mut sorted = devices.clone();
    sorted.sort();
    Some(Plan { devices, sorted })
}

/// Comma-separated device IDs, first occurrence kept; `None` when there are none.
fn parse_plan(value: &str) -> Option<Vec<String>> {
    let mut seen = HashSet::new();
    let plan: Vec<String> = value
        .split(',')
        .map(str::trim)
        .filter(|device| !device.is_empty() && seen.insert(*device))
        .map(str::to_string)
        .collect();
    (!plan.is_empty()).then_some(plan)
}

/// The number of devices of `resource` a pod asks for: its app containers
/// together, or its largest init container if that is more.
fn devices_wanted(pod: &Pod, resource: &str) -> u64 {
    let Some(spec) = &pod.spec else { return 0 };
    let app_containers: u64 = spec
        .containers
        .iter()
        .map(|container| container_wants(container, resource))
        .sum();
    let largest_init_container = spec
        .init_containers
        .iter()
        .flatten()
        .map(|container| container_wants(container, resource))
        .max()
        .unwrap_or(0);
    app_containers.max(largest_init_container)
}

/// The container's limit of `resource`, else its request; 0 when it names neither.
fn container_wants(container: &Container, resource: &str) -> u64 {
    let Some(resources) = &container.resources else {
        return 0;
    };
    let quantity = resources
        .limits
        .as_ref()
        .and_then(|limits| limits.get(resource))
        .or_else(|| {
            resources
                .requests
                .as_ref()
                .and_then(|requests| requests.get(resource))
        });
    quantity
        .and_then(|quantity| quantity.0.trim().parse::<u64>().ok())
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::agent::binding::test_pods::ids;

    #[test]
    fn plans_parse_in_order_without_duplicates() {
        assert_eq!(parse_plan(" a, b,,a ,c"), Some(ids(&["a", "b", "c"])));
        assert_eq!(parse_plan(" , "), None);
    }
}
