//! Keeping the driver known to kubelet for as long as the agent runs: the
//! driver's own socket (`<plugins dir>/<driver>/dra.sock`) and the
//! registration socket kubelet's plugin watcher finds
//! (`<plugins_registry>/<driver>-reg.sock`). Kubelet does the rest: it calls
//! `GetInfo` when the registration socket appears and again after it
//! restarts, and says through `NotifyRegistrationStatus` whether it took us.
//!
//! Every `poll_interval` both sockets are checked; one removed or replaced
//! (or its server ended) is served again, which makes kubelet register the
//! driver anew. On shutdown both are removed, which makes kubelet drop it.

use std::future::Future;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::watch;
use tonic::service::Routes;
use tonic::{Request, Response, Status};

use super::driver::{ClaimReader, Driver};
use super::grpc::routes;
use super::kubelet_api::registration::registration_server::{Registration, RegistrationServer};
use super::kubelet_api::registration::{
    InfoRequest, PluginInfo, RegistrationStatus, RegistrationStatusResponse,
};
use super::kubelet_api::{PLUGIN_TYPE, SUPPORTED_VERSIONS};
use crate::agent::unix_server::{Authority, UnixServer};

/// Where the driver's two sockets go.
#[derive(Clone, Debug)]
pub(crate) struct SocketPaths {
    /// `<plugins_registry>/<driver>-reg.sock`.
    pub(crate) registration: PathBuf,
    /// `<plugins dir>/<driver>/dra.sock`.
    pub(crate) driver: PathBuf,
}

impl SocketPaths {
    pub(crate) fn new(
        registry_dir: &std::path::Path,
        plugins_dir: &std::path::Path,
        driver: &str,
    ) -> Self {
        Self {
            registration: registry_dir.join(format!("{driver}-reg.sock")),
            driver: plugins_dir.join(driver).join("dra.sock"),
        }
    }
}

/// What kubelet last said about the registration, for `/readyz`, the
/// metrics and the choice of allocation mode.
#[derive(Debug, Default)]
pub struct DraStatus {
    registrations: AtomicU64,
    serving: AtomicBool,
    /// `Some(true)` registered, `Some(false)` refused, `None` not heard yet.
    registered: Mutex<Option<bool>>,
    refusal: Mutex<Option<String>>,
    changed: watch::Sender<u64>,
}

impl DraStatus {
    /// Times kubelet accepted the driver since start.
    pub fn registrations(&self) -> u64 {
        self.registrations.load(Ordering::Relaxed)
    }

    /// Kubelet's last word: accepted (`Some(true)`), refused, or none yet.
    pub fn registered(&self) -> Option<bool> {
        self.registered.lock().map(|r| *r).unwrap_or(None)
    }

    /// Why kubelet refused the driver, when it did.
    pub fn refusal(&self) -> Option<String> {
        self.refusal.lock().ok().and_then(|r| r.clone())
    }

    pub fn is_serving(&self) -> bool {
        self.serving.load(Ordering::Relaxed)
    }

    /// Resolves at kubelet's next word on the registration.
    pub(crate) fn subscribe(&self) -> watch::Receiver<u64> {
        self.changed.subscribe()
    }

    fn record(&self, status: &RegistrationStatus) {
        if status.plugin_registered {
            self.registrations.fetch_add(1, Ordering::Relaxed);
        }
        if let Ok(mut registered) = self.registered.lock() {
            *registered = Some(status.plugin_registered);
        }
        if let Ok(mut refusal) = self.refusal.lock() {
            *refusal = (!status.plugin_registered).then(|| status.error.clone());
        }
        self.changed.send_modify(|n| *n += 1);
    }
}

/// `Registration`, as kubelet's plugin watcher calls it.
struct RegistrationService {
    driver_name: String,
    endpoint: String,
    status: Arc<DraStatus>,
}

#[tonic::async_trait]
impl Registration for RegistrationService {
    async fn get_info(
        &self,
        _request: Request<InfoRequest>,
    ) -> Result<Response<PluginInfo>, Status> {
        Ok(Response::new(PluginInfo {
            r#type: PLUGIN_TYPE.to_string(),
            name: self.driver_name.clone(),
            endpoint: self.endpoint.clone(),
            supported_versions: SUPPORTED_VERSIONS
                .iter()
                .map(|v| (*v).to_string())
                .collect(),
        }))
    }

    async fn notify_registration_status(
        &self,
        request: Request<RegistrationStatus>,
    ) -> Result<Response<RegistrationStatusResponse>, Status> {
        let status = request.into_inner();
        if status.plugin_registered {
            tracing::info!(driver = %self.driver_name, "kubelet registered the DRA driver");
        } else {
            tracing::warn!(driver = %self.driver_name, error = %status.error, "kubelet refused the DRA driver");
        }
        self.status.record(&status);
        Ok(Response::new(RegistrationStatusResponse {}))
    }
}

/// Serves both sockets until `shutdown`, then removes them.
pub(crate) async fn run_driver<C: ClaimReader>(
    driver: Arc<Driver<C>>,
    paths: SocketPaths,
    status: Arc<DraStatus>,
    poll_interval: Duration,
    shutdown: impl Future<Output = ()>,
) {
    tokio::pin!(shutdown);
    let driver_name = driver.on().driver.clone();
    let mut plugin: Option<UnixServer> = None;
    let mut registration: Option<UnixServer> = None;
    loop {
        if !plugin.as_ref().is_some_and(UnixServer::is_intact) {
            if let Some(old) = plugin.take() {
                old.stop().await;
            }
            let (stop, stop_rx) = watch::channel(false);
            match UnixServer::start(
                "DRA driver",
                &paths.driver,
                Authority::FromPluginWatcher,
                routes(driver.clone(), stop_rx),
                stop,
            ) {
                Ok(server) => plugin = Some(server),
                Err(e) => {
                    tracing::warn!(socket = %paths.driver.display(), error = %e, "cannot serve the DRA driver")
                }
            }
            // A new driver socket: kubelet must read the registration again.
            if let Some(old) = registration.take() {
                old.stop().await;
            }
        }
        if plugin.is_some() && !registration.as_ref().is_some_and(UnixServer::is_intact) {
            if let Some(old) = registration.take() {
                old.stop().await;
            }
            let service = RegistrationService {
                driver_name: driver_name.clone(),
                endpoint: paths.driver.display().to_string(),
                status: status.clone(),
            };
            let (stop, _) = watch::channel(false);
            let routes = Routes::new(RegistrationServer::new(service));
            match UnixServer::start(
                "DRA registration",
                &paths.registration,
                Authority::FromPluginWatcher,
                routes,
                stop,
            ) {
                Ok(server) => registration = Some(server),
                Err(e) => {
                    tracing::warn!(socket = %paths.registration.display(), error = %e, "cannot serve the DRA registration")
                }
            }
        }
        status.serving.store(
            plugin.is_some() && registration.is_some(),
            Ordering::Relaxed,
        );
        tokio::select! {
            _ = tokio::time::sleep(poll_interval) => {}
            _ = &mut shutdown => break,
        }
    }
    // The registration first, so kubelet stops calling before the driver goes.
    if let Some(server) = registration {
        server.stop().await;
    }
    if let Some(server) = plugin {
        server.stop().await;
    }
    status.serving.store(false, Ordering::Relaxed);
    tracing::info!("DRA driver stopped");
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use tokio_stream::StreamExt;

    use super::*;
    use crate::agent::device_plugin::registration::connect_unix;
    use crate::agent::dra::driver::tests::{one_claim, setup};
    use crate::agent::dra::kubelet_api::registration::registration_client::RegistrationClient;
    use crate::agent::dra::kubelet_api::{health, v1, v1beta1};
    use crate::backend::RawHealth;

    async fn wait_for(path: &std::path::Path) {
        for _ in 0..100 {
            if path.exists() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        panic!("{} never appeared", path.display());
    }

    #[tokio::test]
    async fn kubelet_finds_registers_and_calls_the_driver_on_its_sockets() {
        let s = setup("2xH100-80GiB");
        let d = "gpu.tessera.dev";
        let mut claims = one_claim("u1", &[(d, "node-1", &s.names[1])]);
        // A memory share of the other GPU, whose share ID kubelet must be told.
        claims.by_name.insert(
            "ns/share".into(),
            crate::agent::dra::allocation::tests::as_share(
                crate::agent::dra::allocation::tests::claim("u2", &[(d, "node-1", &s.names[0])]),
                "20Gi",
            ),
        );
        let driver = Arc::new(s.driver(claims));
        let paths = SocketPaths::new(
            &s.dir.path().join("registry"),
            &s.dir.path().join("plugins"),
            d,
        );
        let status = Arc::new(DraStatus::default());
        let (stop, stop_rx) = watch::channel(false);
        let mut stopped = stop_rx.clone();
        let task = tokio::spawn(run_driver(
            driver,
            paths.clone(),
            status.clone(),
            Duration::from_millis(20),
            async move {
                let _ = stopped.wait_for(|s| *s).await;
            },
        ));
        wait_for(&paths.registration).await;
        assert!(
            paths
                .registration
                .ends_with("registry/gpu.tessera.dev-reg.sock")
        );
        assert!(paths.driver.ends_with("plugins/gpu.tessera.dev/dra.sock"));

        let mut registration =
            RegistrationClient::new(connect_unix(&paths.registration).await.unwrap());
        let info = registration
            .get_info(InfoRequest {})
            .await
            .unwrap()
            .into_inner();
        assert_eq!(info.r#type, "DRAPlugin");
        assert_eq!(info.name, d);
        assert_eq!(info.endpoint, paths.driver.display().to_string());
        assert_eq!(
            info.supported_versions,
            ["v1.DRAPlugin", "v1beta1.DRAPlugin"]
        );
        assert_eq!(status.registered(), None);
        registration
            .notify_registration_status(RegistrationStatus {
                plugin_registered: false,
                error: "no DRA here".into(),
            })
            .await
            .unwrap();
        assert_eq!(
            (status.registered(), status.refusal().as_deref()),
            (Some(false), Some("no DRA here"))
        );
        registration
            .notify_registration_status(RegistrationStatus {
                plugin_registered: true,
                error: String::new(),
            })
            .await
            .unwrap();
        assert_eq!(
            (status.registered(), status.registrations()),
            (Some(true), 1)
        );

        let channel = connect_unix(&paths.driver).await.unwrap();
        let claim = v1::Claim {
            namespace: "ns".into(),
            uid: "u1".into(),
            name: "c".into(),
        };
        let prepared = v1::dra_plugin_client::DraPluginClient::new(channel.clone())
            .node_prepare_resources(v1::NodePrepareResourcesRequest {
                claims: vec![claim],
            })
            .await
            .unwrap()
            .into_inner();
        let answer = &prepared.claims["u1"];
        assert_eq!(answer.error, "");
        assert_eq!(answer.devices[0].device_name, s.names[1]);
        assert_eq!(
            answer.devices[0].cdi_device_ids,
            ["gpu.tessera.dev/claim=u1-gpus"]
        );
        assert_eq!(
            answer.devices[0].share_id, None,
            "a whole GPU has no share ID"
        );
        let shared = v1::dra_plugin_client::DraPluginClient::new(channel.clone())
            .node_prepare_resources(v1::NodePrepareResourcesRequest {
                claims: vec![v1::Claim {
                    namespace: "ns".into(),
                    uid: "u2".into(),
                    name: "share".into(),
                }],
            })
            .await
            .unwrap()
            .into_inner();
        let answer = &shared.claims["u2"];
        assert_eq!(answer.error, "");
        assert_eq!(
            answer.devices[0].share_id.as_deref(),
            Some("0b8a1e52-3c4d-4e5f-8a9b-0c1d2e3f4a5b"),
            "the memory share's ID reaches kubelet"
        );

        // The older kubelet API gets the same answer, and an unknown claim its own error.
        let mut beta = v1beta1::dra_plugin_client::DraPluginClient::new(channel.clone());
        let claims = ["u1", "u9"].map(|uid| v1beta1::Claim {
            namespace: "ns".into(),
            uid: uid.into(),
            name: if uid == "u1" {
                "c".into()
            } else {
                "missing".into()
            },
        });
        let prepared = beta
            .node_prepare_resources(v1beta1::NodePrepareResourcesRequest {
                claims: claims.to_vec(),
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(prepared.claims["u1"].devices[0].device_name, s.names[1]);
        assert!(
            prepared.claims["u9"]
                .error
                .contains("claim ns/missing does not exist"),
            "{:?}",
            prepared.claims["u9"]
        );
        let unprepared = beta
            .node_unprepare_resources(v1beta1::NodeUnprepareResourcesRequest {
                claims: claims.to_vec(),
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(unprepared.claims["u1"].error, "");
        assert_eq!(unprepared.claims["u9"].error, "");

        // Health: every device at once, then a change as it happens.
        let mut health = health::dra_resource_health_client::DraResourceHealthClient::new(channel)
            .node_watch_resources(health::NodeWatchResourcesRequest {})
            .await
            .unwrap()
            .into_inner();
        let first = health.next().await.unwrap().unwrap();
        assert_eq!(first.devices.len(), 2);
        assert!(
            first
                .devices
                .iter()
                .all(|d| d.health == health::HealthStatus::Healthy as i32)
        );
        assert_eq!(
            first.devices[0].device.as_ref().unwrap().pool_name,
            "node-1"
        );
        s.tx.send_modify(|v| v.snapshot.devices[0].health = RawHealth::Unhealthy("XID 79".into()));
        let second = health.next().await.unwrap().unwrap();
        let sick: Vec<_> = second
            .devices
            .iter()
            .filter(|d| d.health == health::HealthStatus::Unhealthy as i32)
            .collect();
        assert_eq!(sick.len(), 1);
        assert_eq!(sick[0].message, "XID 79");
        assert_eq!(sick[0].device.as_ref().unwrap().device_name, s.names[0]);

        // A removed registration socket is served again (kubelet then registers anew).
        std::fs::remove_file(&paths.registration).unwrap();
        wait_for(&paths.registration).await;
        assert!(status.is_serving());

        stop.send(true).unwrap();
        task.await.unwrap();
        assert!(!paths.registration.exists() && !paths.driver.exists());
        assert!(!status.is_serving());
    }
}
