//! The driver's gRPC services on its socket, as kubelet calls them:
//! `DRAPlugin` v1 and v1beta1 (the same work in two message sets, so a
//! kubelet of either generation can prepare claims) and `DRAResourceHealth`,
//! which streams each device's health to kubelets that read it (feature gate
//! ResourceHealthStatus) for the status of the pods using it.

use std::sync::Arc;

use tokio::sync::{mpsc, watch};
use tokio_stream::wrappers::ReceiverStream;
use tonic::service::Routes;
use tonic::{Request, Response, Status};

use super::device_names::device_names;
use super::driver::{ClaimReader, ClaimRef, Driver};
use super::kubelet_api::{health, v1, v1beta1};
use super::prepared::PreparedDevice;
use crate::agent::state::DeviceView;
use crate::backend::RawHealth;

/// kubelet truncates longer health messages.
const MAX_HEALTH_MESSAGE: usize = 1024;
/// Every device's health is sent again this often even when nothing changed:
/// kubelet reports a device it has no fresh news of as Unknown after
/// [`HEALTH_TIMEOUT_SECONDS`], which is how a dead agent shows in pod status.
const HEALTH_RESEND: std::time::Duration = std::time::Duration::from_secs(10);
const HEALTH_TIMEOUT_SECONDS: i64 = 30;

/// All of the driver's services, ready to serve; `stop` ends the health streams.
pub(crate) fn routes<C: ClaimReader>(
    driver: Arc<Driver<C>>,
    stop: watch::Receiver<bool>,
) -> Routes {
    Routes::new(v1::dra_plugin_server::DraPluginServer::new(V1(
        driver.clone()
    )))
    .add_service(v1beta1::dra_plugin_server::DraPluginServer::new(V1beta1(
        driver.clone(),
    )))
    .add_service(
        health::dra_resource_health_server::DraResourceHealthServer::new(Health {
            driver,
            stop,
            resend: HEALTH_RESEND,
        }),
    )
}

struct V1<C>(Arc<Driver<C>>);
struct V1beta1<C>(Arc<Driver<C>>);

/// `DRAPlugin` of one API version on `$service`: the same work, the version's
/// messages (`$device` turns a prepared device into the version's `Device`).
macro_rules! dra_plugin {
    ($service:ident, $api:ident, $device:expr) => {
        #[tonic::async_trait]
        impl<C: ClaimReader> $api::dra_plugin_server::DraPlugin for $service<C> {
            async fn node_prepare_resources(
                &self,
                request: Request<$api::NodePrepareResourcesRequest>,
            ) -> Result<Response<$api::NodePrepareResourcesResponse>, Status> {
                let claims = claim_refs(request.into_inner().claims, |c| {
                    (c.namespace, c.uid, c.name)
                });
                let claims = self
                    .0
                    .prepare(&claims)
                    .await
                    .into_iter()
                    .map(|(uid, answer)| {
                        let (devices, error) = match answer {
                            Ok(devices) => (devices, String::new()),
                            Err(error) => (Vec::new(), error),
                        };
                        let devices = devices.into_iter().map($device).collect();
                        (uid, $api::NodePrepareResourceResponse { devices, error })
                    })
                    .collect();
                Ok(Response::new($api::NodePrepareResourcesResponse { claims }))
            }

            async fn node_unprepare_resources(
                &self,
                request: Request<$api::NodeUnprepareResourcesRequest>,
            ) -> Result<Response<$api::NodeUnprepareResourcesResponse>, Status> {
                let claims = claim_refs(request.into_inner().claims, |c| {
                    (c.namespace, c.uid, c.name)
                });
                let claims = self
                    .0
                    .unprepare(&claims)
                    .await
                    .into_iter()
                    .map(|(uid, answer)| {
                        let error = answer.err().unwrap_or_default();
                        (uid, $api::NodeUnprepareResourceResponse { error })
                    })
                    .collect();
                Ok(Response::new($api::NodeUnprepareResourcesResponse {
                    claims,
                }))
            }
        }
    };
}

dra_plugin!(V1, v1, |d: PreparedDevice| v1::Device {
    request_names: d.request_names,
    pool_name: d.pool,
    device_name: d.device,
    cdi_device_ids: d.cdi_ids,
    share_id: d.share_id,
});
dra_plugin!(V1beta1, v1beta1, |d: PreparedDevice| v1beta1::Device {
    request_names: d.request_names,
    pool_name: d.pool,
    device_name: d.device,
    cdi_device_ids: d.cdi_ids,
});

/// The claims of a request of either version: `(namespace, uid, name)` of each.
fn claim_refs<T>(claims: Vec<T>, fields: impl Fn(T) -> (String, String, String)) -> Vec<ClaimRef> {
    claims
        .into_iter()
        .map(|claim| {
            let (namespace, uid, name) = fields(claim);
            ClaimRef {
                namespace,
                uid,
                name,
            }
        })
        .collect()
}

struct Health<C> {
    driver: Arc<Driver<C>>,
    stop: watch::Receiver<bool>,
    resend: std::time::Duration,
}

#[tonic::async_trait]
impl<C: ClaimReader> health::dra_resource_health_server::DraResourceHealth for Health<C> {
    type NodeWatchResourcesStream =
        ReceiverStream<Result<health::NodeWatchResourcesResponse, Status>>;

    async fn node_watch_resources(
        &self,
        _request: Request<health::NodeWatchResourcesRequest>,
    ) -> Result<Response<Self::NodeWatchResourcesStream>, Status> {
        let (out, stream) = mpsc::channel(4);
        let mut view = self.driver.view().clone();
        let mut stop = self.stop.clone();
        let pool = self.driver.on().node_name.clone();
        let mut resend = tokio::time::interval(self.resend);
        resend.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        tokio::spawn(async move {
            let mut sent = None;
            // The first tick is at once, and the first message goes anyway.
            resend.tick().await;
            loop {
                let now = device_health(&view.borrow_and_update());
                if sent.as_ref() != Some(&now) {
                    let message = health::NodeWatchResourcesResponse {
                        devices: now
                            .iter()
                            .map(|(device, (status, message))| health::DeviceHealth {
                                device: Some(health::DeviceIdentifier {
                                    pool_name: pool.clone(),
                                    device_name: device.clone(),
                                }),
                                health: *status as i32,
                                last_updated_time: unix_now(),
                                health_check_timeout_seconds: HEALTH_TIMEOUT_SECONDS,
                                message: message.clone(),
                            })
                            .collect(),
                    };
                    if out.send(Ok(message)).await.is_err() {
                        return;
                    }
                    sent = Some(now);
                }
                tokio::select! {
                    changed = view.changed() => if changed.is_err() { return },
                    _ = resend.tick() => sent = None,
                    _ = stop.wait_for(|s| *s) => return,
                }
            }
        });
        Ok(Response::new(ReceiverStream::new(stream)))
    }
}

type DeviceHealths = std::collections::BTreeMap<String, (health::HealthStatus, String)>;

/// Each device's health by its slice name (before the first reading: none).
fn device_health(view: &DeviceView) -> DeviceHealths {
    if !view.ready {
        return DeviceHealths::new();
    }
    let names = device_names(view.snapshot.devices.iter().map(|d| d.info.id.as_str()));
    view.snapshot
        .devices
        .iter()
        .filter_map(|d| {
            let name = names.get(&d.info.id)?.clone();
            let health = match &d.health {
                RawHealth::Healthy => (health::HealthStatus::Healthy, String::new()),
                RawHealth::Unhealthy(why) => {
                    let mut message = why.clone();
                    if message.len() > MAX_HEALTH_MESSAGE {
                        let mut end = MAX_HEALTH_MESSAGE;
                        while !message.is_char_boundary(end) {
                            end -= 1;
                        }
                        message.truncate(end);
                    }
                    (health::HealthStatus::Unhealthy, message)
                }
            };
            Some((name, health))
        })
        .collect()
}

fn unix_now() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX))
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use tokio_stream::StreamExt;

    use super::*;
    use crate::agent::dra::driver::tests::{Claims, setup};
    use health::dra_resource_health_server::DraResourceHealth;

    #[tokio::test]
    async fn health_is_sent_again_while_nothing_changes() {
        let s = setup("2xH100-80GiB");
        let (_stop_tx, stop) = watch::channel(false);
        let service = Health {
            driver: Arc::new(s.driver(Claims::default())),
            stop,
            resend: Duration::from_millis(30),
        };
        let mut stream = service
            .node_watch_resources(Request::new(health::NodeWatchResourcesRequest {}))
            .await
            .unwrap()
            .into_inner();
        for _ in 0..3 {
            let message = tokio::time::timeout(Duration::from_secs(5), stream.next())
                .await
                .expect("a message within the resend interval")
                .unwrap()
                .unwrap();
            assert_eq!(message.devices.len(), 2);
            assert!(message.devices.iter().all(|d| {
                d.health == health::HealthStatus::Healthy as i32
                    && d.health_check_timeout_seconds == 30
                    && d.last_updated_time > 0
            }));
        }
    }
}
