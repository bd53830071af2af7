//! Catching up with kubelet. Kubelet learns that a pod is bound to this node
//! from its own watch, and may ask for the pod's devices before the agent's
//! pod watch has delivered the same pod (seen on a real kubelet admitting a
//! burst of pods). A request the index cannot match to a plan it knows is
//! therefore first checked against a fresh list of the node's pods: the
//! binding kubelet acts on is committed, so a list read from the API server
//! now contains it.

use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ListParams};

/// How long a request may wait for the list before it is answered with what
/// the index knows (kubelet waits for the answer to admit the pod).
const LIST_TIMEOUT: Duration = Duration::from_secs(2);

/// The field selector for the pods bound to `node_name`.
pub(super) fn node_field_selector(node_name: &str) -> String {
    format!("spec.nodeName={node_name}")
}

/// Lists the pods bound to one node.
pub(crate) struct NodePods {
    pods: Api<Pod>,
    params: ListParams,
}

impl NodePods {
    pub(crate) fn new(client: kube::Client, node_name: &str) -> Self {
        Self {
            pods: Api::all(client),
            params: ListParams::default().fields(&node_field_selector(node_name)),
        }
    }

    /// The pods on the node, or `None` (logged) when the list failed or
    /// took too long.
    pub(crate) async fn list(&self) -> Option<Vec<Pod>> {
        match tokio::time::timeout(LIST_TIMEOUT, self.pods.list(&self.params)).await {
            Ok(Ok(list)) => Some(list.items),
            Ok(Err(error)) => {
                tracing::warn!(error = %error, "listing the pods on this node to match kubelet's request failed");
                None
            }
            Err(_) => {
                tracing::warn!(
                    "listing the pods on this node to match kubelet's request took over {} s; answering with what the pod watch delivered",
                    LIST_TIMEOUT.as_secs()
                );
                None
            }
        }
    }
}
