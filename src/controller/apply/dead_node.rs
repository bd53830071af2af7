//! Pods on a node that has been NotReady past `--node-grace-period` have no
//! kubelet to confirm their deletion: deleted the usual way they stay
//! `Terminating` for as long as the node is down, and the replica's
//! re-placed shard cannot be created under the same name (a replica's pods
//! are bound all together, so the whole replica waits). tessera owns these
//! pods and has re-planned their shards already, so once such a pod is
//! being deleted it deletes it again with a grace period of 0: the API
//! server removes it at once. Its devices are not given twice: the re-plan
//! never planned on a lost node's devices, and when the node comes back
//! its kubelet finds the pod gone and stops its containers, which releases
//! the device plugin's binding and unprepares its DRA claim. (The pod GC of
//! kube-controller-manager does the same for pods of a deleted Node.)

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::jiff::Timestamp;
use kube::ResourceExt;
use kube::api::Api;

use super::ApplyError;
use crate::controller::events::EventNote;
use crate::controller::nodes::NodeInfo;

/// The node `pod` is being deleted on, when that node has been NotReady
/// for longer than `grace`.
pub(crate) fn stranded_on<'a>(
    pod: &'a Pod,
    nodes: &[Arc<NodeInfo>],
    now: Timestamp,
    grace: Duration,
) -> Option<&'a str> {
    pod.metadata.deletion_timestamp.as_ref()?;
    let node = pod.spec.as_ref()?.node_name.as_deref()?;
    nodes
        .iter()
        .find(|n| n.name() == node)
        .is_some_and(|n| n.lost(now, grace))
        .then_some(node)
}

/// Deletes every one of `mine` stranded on a lost node with a grace period
/// of 0 (the very pod seen: UID precondition).
pub(crate) async fn release(
    api: &Api<Pod>,
    mine: &BTreeMap<String, Arc<Pod>>,
    nodes: &[Arc<NodeInfo>],
    grace: Duration,
    notes: &mut Vec<EventNote>,
) -> Result<(), ApplyError> {
    let now = Timestamp::now();
    for pod in mine.values() {
        let Some(node) = stranded_on(pod, nodes, now, grace) else {
            continue;
        };
        if !super::delete_within(api, pod, Some(0)).await? {
            continue;
        }
        let name = pod.name_any();
        notes.push(EventNote {
            warning: true,
            reason: "PodReleased",
            message: format!(
                "pod {name} deleted at once: node {node} has been NotReady for more than {} s and no kubelet confirms its deletion; its shard runs elsewhere",
                grace.as_secs()
            ),
        });
    }
    Ok(())
}
