//! One pending shard pod per node and device count. Kubelet does not tell a
//! device plugin which pod it is admitting, so the node agent matches a
//! request to a planned binding by its size and devices alone (see
//! `agent::binding`). Two pods bound to one node with plans of the same size
//! and not yet admitted could be confused: kubelet may hand one pod the
//! devices planned for the other (seen on a real kubelet admitting a burst of
//! pods after a restart). So a pod is bound only when no other pod with as
//! many planned devices is waiting for its devices on that node; the node is
//! held until kubelet has dealt with the pod (the agent reports its devices
//! allocated, or the pod runs, ends or goes), or [`HOLD_LIMIT`] passes.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Pod;
use kube::ResourceExt;

use super::nodes::NodeInfo;
use tessera_core::api::DEVICES_ANNOTATION;

/// How long a bound pod may hold its node before the next is bound anyway
/// (an agent that does not report allocations, a kubelet that is down).
pub(crate) const HOLD_LIMIT: Duration = Duration::from_secs(30);

/// A pod absent from the cache this soon after binding may just not be
/// there yet; later its absence means it is gone.
const CACHE_LAG: Duration = Duration::from_secs(5);

/// What the caches say about a bound pod.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum BoundPod {
    /// Bound and waiting for kubelet to allocate its devices.
    Waiting,
    /// Its devices are allocated, or it runs, has ended or is being deleted.
    Admitted,
    /// Not in the cache.
    Unseen,
}

struct Hold {
    uid: String,
    since: Instant,
}

#[derive(Default)]
pub(crate) struct NodeGate {
    holds: Mutex<HashMap<(String, usize), Hold>>,
}

impl NodeGate {
    /// Whether the pod `uid` with `devices` planned devices may be bound to
    /// `node` now; if so the node is held for it. `state` reports on the pod
    /// holding the node.
    pub(crate) fn try_enter(
        &self,
        node: &str,
        devices: usize,
        uid: &str,
        state: impl Fn(&str) -> BoundPod,
        now: Instant,
    ) -> bool {
        let Ok(mut holds) = self.holds.lock() else {
            return true;
        };
        let key = (node.to_string(), devices);
        if let Some(hold) = holds.get(&key)
            && hold.uid != uid
        {
            let age = now.saturating_duration_since(hold.since);
            let free = match state(&hold.uid) {
                BoundPod::Admitted => true,
                BoundPod::Unseen => age >= CACHE_LAG,
                BoundPod::Waiting => false,
            } || age >= HOLD_LIMIT;
            if !free {
                return false;
            }
            if age >= HOLD_LIMIT {
                tracing::warn!(%node, pod_uid = %hold.uid, "a pod bound {}s ago still has no devices; binding the next one to the node anyway", age.as_secs());
            }
        }
        holds.insert(
            key,
            Hold {
                uid: uid.to_string(),
                since: now,
            },
        );
        true
    }
}

/// Whether a shard pod may be bound to `node` now (see [`NodeGate`]), judged
/// from what this reconcile observed.
pub(crate) fn may_bind<'a>(
    gate: &'a NodeGate,
    nodes: &'a [Arc<NodeInfo>],
    pods: &'a [Arc<Pod>],
    now: Instant,
) -> impl Fn(&str, &Pod) -> bool + 'a {
    move |node, pod| {
        let devices = pod
            .annotations()
            .get(DEVICES_ANNOTATION)
            .map_or(0, |d| d.split(',').filter(|id| !id.is_empty()).count());
        gate.try_enter(
            node,
            devices,
            pod.uid().as_deref().unwrap_or_default(),
            |uid| bound_pod(nodes, pods, node, uid),
            now,
        )
    }
}

/// What the observed nodes and pods say about a pod bound to `node`.
fn bound_pod(nodes: &[Arc<NodeInfo>], pods: &[Arc<Pod>], node: &str, uid: &str) -> BoundPod {
    let allocated = nodes.iter().any(|n| {
        n.name() == node
            && n.gpus
                .gpu_state
                .allocated
                .values()
                .any(|owner| owner == uid)
    });
    if allocated {
        return BoundPod::Admitted;
    }
    let Some(pod) = pods.iter().find(|p| p.uid().as_deref() == Some(uid)) else {
        return BoundPod::Unseen;
    };
    let phase = pod.status.as_ref().and_then(|s| s.phase.as_deref());
    if pod.metadata.deletion_timestamp.is_some()
        || matches!(phase, Some("Running" | "Succeeded" | "Failed"))
    {
        BoundPod::Admitted
    } else {
        BoundPod::Waiting
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_pod_of_the_same_size_waits_until_the_first_is_admitted() {
        let gate = NodeGate::default();
        let t0 = Instant::now();
        let waiting = |_: &str| BoundPod::Waiting;
        assert!(gate.try_enter("n1", 1, "a", waiting, t0));
        assert!(
            gate.try_enter("n1", 1, "a", waiting, t0),
            "the holder again"
        );
        assert!(!gate.try_enter("n1", 1, "b", waiting, t0));
        assert!(gate.try_enter("n1", 2, "c", waiting, t0), "another size");
        assert!(gate.try_enter("n2", 1, "d", waiting, t0), "another node");
        let admitted = |uid: &str| {
            if uid == "a" {
                BoundPod::Admitted
            } else {
                BoundPod::Waiting
            }
        };
        assert!(gate.try_enter("n1", 1, "b", admitted, t0));
        assert!(
            !gate.try_enter("n1", 1, "e", admitted, t0),
            "b holds it now"
        );
    }

    #[test]
    fn an_unseen_pod_holds_briefly_and_a_stuck_one_until_the_limit() {
        let gate = NodeGate::default();
        let t0 = Instant::now();
        assert!(gate.try_enter("n", 1, "a", |_| BoundPod::Waiting, t0));
        assert!(!gate.try_enter("n", 1, "b", |_| BoundPod::Unseen, t0 + CACHE_LAG / 2));
        assert!(gate.try_enter("n", 1, "b", |_| BoundPod::Unseen, t0 + CACHE_LAG));
        assert!(!gate.try_enter("n", 1, "c", |_| BoundPod::Waiting, t0 + HOLD_LIMIT));
        assert!(gate.try_enter(
            "n",
            1,
            "c",
            |_| BoundPod::Waiting,
            t0 + CACHE_LAG + HOLD_LIMIT
        ));
    }
}
