//! What kubelet says each running container holds, read from its PodResources
//! API: the devices the device plugins and the DRA drivers handed out, and for
//! a shared device its share ID. Monitoring agents (DCGM-exporter among them)
//! attribute devices to pods this way, so the end-to-end tests read it too to
//! check that kubelet can tell the tenants of one GPU apart.

pub mod kubelet_api;

use std::path::Path;

use serde::Serialize;

use crate::agent::device_plugin::registration::connect_unix;
use kubelet_api::v1::ListPodResourcesRequest;
use kubelet_api::v1::pod_resources_lister_client::PodResourcesListerClient;

/// One device a container holds, as kubelet records it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct HeldDevice {
    pub namespace: String,
    pub pod: String,
    pub container: String,
    /// The device plugin's extended resource, or the DRA driver.
    pub source: String,
    /// The device: its ID for a device plugin, its name in the pool for DRA.
    pub device: String,
    /// `namespace/name` of the ResourceClaim (DRA only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub claim: Option<String>,
    /// The pool (DRA only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pool: Option<String>,
    /// The share ID of a device several claims share (DRA only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub share_id: Option<String>,
}

/// Every device kubelet's PodResources `List` at `socket` names, one row per
/// device and container.
pub async fn list(socket: &Path) -> Result<Vec<HeldDevice>, String> {
    let channel = connect_unix(socket).await.map_err(|e| {
        format!(
            "connecting to kubelet's PodResources at {}: {e}",
            socket.display()
        )
    })?;
    let answer = PodResourcesListerClient::new(channel)
        .list(ListPodResourcesRequest {})
        .await
        .map_err(|e| format!("kubelet's PodResources List: {}", e.message()))?
        .into_inner();
    let mut rows = Vec::new();
    for pod in answer.pod_resources {
        for container in pod.containers {
            let row = |source: &str, device: &str| HeldDevice {
                namespace: pod.namespace.clone(),
                pod: pod.name.clone(),
                container: container.name.clone(),
                source: source.to_string(),
                device: device.to_string(),
                claim: None,
                pool: None,
                share_id: None,
            };
            for devices in &container.devices {
                for id in &devices.device_ids {
                    rows.push(row(&devices.resource_name, id));
                }
            }
            for claim in &container.dynamic_resources {
                for resource in &claim.claim_resources {
                    rows.push(HeldDevice {
                        claim: Some(format!("{}/{}", claim.claim_namespace, claim.claim_name)),
                        pool: Some(resource.pool_name.clone()),
                        share_id: resource.share_id.clone(),
                        ..row(&resource.driver_name, &resource.device_name)
                    });
                }
            }
        }
    }
    Ok(rows)
}

#[cfg(test)]
mod tests {
    use super::kubelet_api::v1::pod_resources_lister_server::{
        PodResourcesLister, PodResourcesListerServer,
    };
    use super::kubelet_api::v1::{
        ClaimResource, ContainerDevices, ContainerResources, DynamicResource,
        ListPodResourcesResponse, PodResources,
    };
    use super::*;
    use tokio_stream::wrappers::UnixListenerStream;

    /// A kubelet's PodResources answer: one pod with a device-plugin GPU,
    /// and one whose claim holds a memory share.
    struct Kubelet;

    #[tonic::async_trait]
    impl PodResourcesLister for Kubelet {
        async fn list(
            &self,
            _request: tonic::Request<ListPodResourcesRequest>,
        ) -> Result<tonic::Response<ListPodResourcesResponse>, tonic::Status> {
            let container = |devices, dynamic_resources| ContainerResources {
                name: "shard".into(),
                devices,
                dynamic_resources,
            };
            Ok(tonic::Response::new(ListPodResourcesResponse {
                pod_resources: vec![
                    PodResources {
                        name: "a-shard-0".into(),
                        namespace: "ml".into(),
                        containers: vec![container(
                            vec![ContainerDevices {
                                resource_name: "tessera.dev/gpu".into(),
                                device_ids: vec!["GPU-1".into()],
                            }],
                            Vec::new(),
                        )],
                    },
                    PodResources {
                        name: "b-shard-0".into(),
                        namespace: "ml".into(),
                        containers: vec![container(
                            Vec::new(),
                            vec![DynamicResource {
                                claim_name: "b-shard-0-gpus".into(),
                                claim_namespace: "ml".into(),
                                claim_resources: vec![ClaimResource {
                                    cdi_devices: Vec::new(),
                                    driver_name: "gpu.tessera.dev".into(),
                                    pool_name: "node-1".into(),
                                    device_name: "gpu-0".into(),
                                    share_id: Some("s-1".into()),
                                }],
                            }],
                        )],
                    },
                ],
            }))
        }
    }

    #[tokio::test]
    async fn every_device_of_every_container_is_read_with_its_share_id() {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("kubelet.sock");
        let listener = tokio::net::UnixListener::bind(&socket).unwrap();
        tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(PodResourcesListerServer::new(Kubelet))
                .serve_with_incoming(UnixListenerStream::new(listener)),
        );
        let rows = list(&socket).await.unwrap();
        assert_eq!(rows.len(), 2, "{rows:?}");
        assert_eq!(
            (
                rows[0].pod.as_str(),
                rows[0].source.as_str(),
                rows[0].device.as_str()
            ),
            ("a-shard-0", "tessera.dev/gpu", "GPU-1")
        );
        assert_eq!(rows[0].share_id, None);
        assert_eq!(rows[1].claim.as_deref(), Some("ml/b-shard-0-gpus"));
        assert_eq!(rows[1].share_id.as_deref(), Some("s-1"));
        assert_eq!(
            serde_json::to_value(&rows[1]).unwrap()["shareId"],
            "s-1",
            "JSON for the end-to-end checks"
        );
    }

    #[tokio::test]
    async fn no_kubelet_is_an_error_naming_the_socket() {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("absent.sock");
        let error = list(&socket).await.unwrap_err();
        assert!(error.contains("absent.sock"), "{error}");
    }
}
