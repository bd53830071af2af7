//! Running the device plugin for as long as the agent runs: serve our socket,
//! register with kubelet, and keep both true across kubelet restarts.
//!
//! Every [`PluginConfig::poll_interval`] (500 ms) the plugin directory is
//! checked:
//!
//! - our socket file gone or replaced (kubelet wipes the directory when it
//!   starts; a person may delete it) → the server is restarted on a fresh
//!   socket and registered again;
//! - `kubelet.sock` recreated (a new inode or change time: kubelet restarted)
//!   → registered again at once;
//! - registration failing (kubelet not there yet, a stale socket, an error
//!   answer) → retried with exponential backoff (200 ms doubling to 10 s),
//!   restarting at 200 ms whenever `kubelet.sock` changes.
//!
//! The view is never touched by any of this, so nothing is lost: kubelet gets
//! the current device list on its next `ListAndWatch`.

use std::future::Future;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use hyper_util::rt::TokioIo;
use tokio::net::UnixStream;
use tokio::time::Instant;
use tonic::transport::{Channel, Endpoint, Uri};

use super::allocation_metrics::AllocationMetrics;
use super::kubelet_api::v1beta1::RegisterRequest;
use super::kubelet_api::v1beta1::registration_client::RegistrationClient;
use super::kubelet_api::{DEFAULT_PLUGIN_DIR, KUBELET_SOCKET, VERSION};
use super::server::{PluginServer, PluginService, plugin_options};
use crate::agent::binding::{Binder, NoBinder};
use crate::agent::container_devices::RuntimeOptions;
use crate::agent::state::{ViewRx, ViewTx};

/// The extended resource offered unless configured otherwise.
pub(crate) const DEFAULT_RESOURCE_NAME: &str = "tessera.dev/gpu";

/// Connecting to and calling kubelet's registration socket may take this long.
const REGISTER_TIMEOUT: Duration = Duration::from_secs(5);
const BACKOFF_START: Duration = Duration::from_millis(200);
const BACKOFF_MAX: Duration = Duration::from_secs(10);

#[derive(Clone)]
pub struct PluginConfig {
    /// Kubelet's device plugin directory (holds `kubelet.sock` and our socket).
    pub plugin_dir: PathBuf,
    /// The extended resource, e.g. `tessera.dev/gpu`.
    pub resource_name: String,
    /// Also name allocated devices as CDI devices.
    pub cdi: bool,
    /// The controller's planned bindings ([`NoBinder`] until there are any).
    pub binder: Arc<dyn Binder>,
    /// Where the host's sysfs and procfs are mounted (device node numbers).
    pub sysfs_root: PathBuf,
    pub procfs_root: PathBuf,
    /// How often the plugin directory is checked.
    pub poll_interval: Duration,
    /// Where Allocate counts and latencies are recorded.
    pub allocation_metrics: AllocationMetrics,
    /// How long after a registration kubelet may take to open `ListAndWatch`
    /// before the plugin reports that kubelet cannot reach it.
    pub list_and_watch_grace: Duration,
}

impl Default for PluginConfig {
    fn default() -> Self {
        let runtime = RuntimeOptions::default();
        Self {
            plugin_dir: PathBuf::from(DEFAULT_PLUGIN_DIR),
            resource_name: DEFAULT_RESOURCE_NAME.to_string(),
            cdi: runtime.cdi,
            binder: Arc::new(NoBinder),
            sysfs_root: runtime.sysfs_root,
            procfs_root: runtime.procfs_root,
            poll_interval: Duration::from_millis(500),
            allocation_metrics: AllocationMetrics::default(),
            list_and_watch_grace: Duration::from_secs(20),
        }
    }
}

impl std::fmt::Debug for PluginConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PluginConfig")
            .field("plugin_dir", &self.plugin_dir)
            .field("resource_name", &self.resource_name)
            .field("cdi", &self.cdi)
            .field("sysfs_root", &self.sysfs_root)
            .field("procfs_root", &self.procfs_root)
            .field("poll_interval", &self.poll_interval)
            .finish_non_exhaustive()
    }
}

impl PluginConfig {
    /// Our socket's file name: `tessera-<resource name, / and . as ->.sock`.
    pub(crate) fn socket_name(&self) -> String {
        socket_name(&self.resource_name)
    }

    pub fn socket_path(&self) -> PathBuf {
        self.plugin_dir.join(self.socket_name())
    }

    pub(crate) fn kubelet_socket(&self) -> PathBuf {
        self.plugin_dir.join(KUBELET_SOCKET)
    }
}

/// `tessera.dev/gpu` → `tessera-tessera-dev-gpu.sock`.
pub(crate) fn socket_name(resource_name: &str) -> String {
    format!("tessera-{}.sock", resource_name.replace(['/', '.'], "-"))
}

/// What `/readyz` and the metrics want to know about the plugin.
#[derive(Debug, Default)]
pub struct PluginStatus {
    registrations: AtomicU64,
    registered: AtomicBool,
    serving: AtomicBool,
    list_and_watch_calls: Arc<AtomicU64>,
    kubelet_silent: AtomicBool,
}

/// Why kubelet may register a plugin and then never call it.
pub(crate) const SILENT_KUBELET: &str = "registered with kubelet, but kubelet has not opened ListAndWatch: kubelets before v1.26 (without kubernetes/kubernetes#112597) send the socket path as the HTTP/2 :authority, which this plugin's HTTP/2 server must refuse; tessera needs kubelet v1.26 or later, or one with that fix";

impl PluginStatus {
    /// Successful registrations with kubelet since start.
    pub fn registrations(&self) -> u64 {
        self.registrations.load(Ordering::Relaxed)
    }

    /// Registered with the kubelet that is there now, serving our socket.
    pub fn is_registered(&self) -> bool {
        self.registered.load(Ordering::Relaxed)
    }

    /// Our socket is being served.
    pub fn is_serving(&self) -> bool {
        self.serving.load(Ordering::Relaxed)
    }

    /// `ListAndWatch` streams kubelet has opened since start.
    pub fn list_and_watch_calls(&self) -> u64 {
        self.list_and_watch_calls.load(Ordering::Relaxed)
    }

    /// Registered, but kubelet has not called within the grace period
    /// (`SILENT_KUBELET` says why that happens).
    pub fn kubelet_silent(&self) -> bool {
        self.kubelet_silent.load(Ordering::Relaxed)
    }

    /// A registration with kubelet succeeded.
    pub(crate) fn record_registration(&self) {
        self.registrations.fetch_add(1, Ordering::Relaxed);
        self.registered.store(true, Ordering::Relaxed);
    }
}

#[derive(Debug, thiserror::Error)]
pub enum PluginError {
    #[error("the device view closed before the first snapshot was read")]
    ViewClosed,
}

/// A tonic channel over a unix socket (the URI is a placeholder; every
/// connection goes to `path`).
pub async fn connect_unix(path: &Path) -> Result<Channel, tonic::transport::Error> {
    let path = path.to_path_buf();
    Endpoint::from_static("http://localhost")
        .connect_timeout(REGISTER_TIMEOUT)
        .connect_with_connector(tower::service_fn(move |_: Uri| {
            let path = path.clone();
            async move { UnixStream::connect(path).await.map(TokioIo::new) }
        }))
        .await
}

#[derive(Debug, thiserror::Error)]
pub(crate) enum RegisterError {
    #[error("connecting to kubelet at {path}: {source}")]
    Connect {
        path: String,
        source: tonic::transport::Error,
    },
    #[error("kubelet refused the registration: {0}")]
    Refused(tonic::Status),
    #[error("kubelet did not answer within {0:?}")]
    Timeout(Duration),
}

/// Registers our socket `endpoint` (a file name in kubelet's directory) for
/// `resource_name` with the kubelet listening at `kubelet_socket`.
pub(crate) async fn register(
    kubelet_socket: &Path,
    endpoint: &str,
    resource_name: &str,
) -> Result<(), RegisterError> {
    let call = async {
        let channel =
            connect_unix(kubelet_socket)
                .await
                .map_err(|source| RegisterError::Connect {
                    path: kubelet_socket.display().to_string(),
                    source,
                })?;
        RegistrationClient::new(channel)
            .register(RegisterRequest {
                version: VERSION.to_string(),
                endpoint: endpoint.to_string(),
                resource_name: resource_name.to_string(),
                options: Some(plugin_options()),
            })
            .await
            .map_err(RegisterError::Refused)?;
        Ok(())
    };
    tokio::time::timeout(REGISTER_TIMEOUT, call)
        .await
        .map_err(|_| RegisterError::Timeout(REGISTER_TIMEOUT))?
}

/// Identity of `kubelet.sock`: device, inode and change time. A restarted
/// kubelet makes a new socket, which differs in at least one of them.
fn kubelet_identity(path: &Path) -> Option<KubeletId> {
    use std::os::unix::fs::MetadataExt;
    let metadata = std::fs::symlink_metadata(path).ok()?;
    Some((
        metadata.dev(),
        metadata.ino(),
        metadata.ctime(),
        metadata.ctime_nsec(),
    ))
}

/// The device plugin: serve, register, watch for kubelet restarts, until
/// `shutdown` resolves; then stop serving and remove our socket.
pub(crate) struct PluginRunner {
    config: PluginConfig,
    view: ViewRx,
    tx: ViewTx,
    status: Arc<PluginStatus>,
}

impl PluginRunner {
    pub(crate) fn new(config: PluginConfig, view: ViewRx, tx: ViewTx) -> Self {
        Self {
            config,
            view,
            tx,
            status: Arc::new(PluginStatus::default()),
        }
    }

    /// Shared with `/readyz` and the metrics.
    pub(crate) fn status(&self) -> Arc<PluginStatus> {
        self.status.clone()
    }

    pub(crate) async fn run(self, shutdown: impl Future<Output = ()>) -> Result<(), PluginError> {
        tokio::pin!(shutdown);
        let config = &self.config;
        let status = &self.status;

        // Registering before the first snapshot would show kubelet no devices.
        let mut first = self.view.clone();
        tokio::select! {
            r = first.wait_for(|v| v.ready) => { r.map_err(|_| PluginError::ViewClosed)?; }
            _ = &mut shutdown => return Ok(()),
        }

        let service = PluginService::new(
            &config.resource_name,
            self.view.clone(),
            self.tx.clone(),
            config.binder.clone(),
            RuntimeOptions {
                cdi: config.cdi,
                sysfs_root: config.sysfs_root.clone(),
                procfs_root: config.procfs_root.clone(),
                ..RuntimeOptions::default()
            },
        )
        .with_metrics(config.allocation_metrics.clone())
        .counting_list_and_watch(status.list_and_watch_calls.clone());
        let socket = config.socket_path();
        let endpoint = config.socket_name();
        let kubelet = config.kubelet_socket();

        let mut state = RegistrationState::new();
        loop {
            state.keep_serving(&socket, &service, status).await;
            let current = kubelet_identity(&kubelet);
            state.notice_kubelet(current, &kubelet, status);
            if state.registration_due(current) {
                // Counted before the call: kubelet may open ListAndWatch
                // before it answers the registration.
                let calls_before = status.list_and_watch_calls();
                let attempt = register(&kubelet, &endpoint, &config.resource_name);
                let result = tokio::select! {
                    r = attempt => r,
                    _ = &mut shutdown => break,
                };
                match result {
                    Ok(()) => {
                        state.registered(current, calls_before, status);
                        tracing::info!(
                            resource = %config.resource_name,
                            endpoint = %endpoint,
                            "registered with kubelet"
                        );
                    }
                    Err(e) => state.registration_failed(&e),
                }
            }
            state.watch_for_a_silent_kubelet(status, config.list_and_watch_grace);
            let wake = state.next_wake(current, config.poll_interval);
            tokio::select! {
                _ = tokio::time::sleep_until(wake) => {}
                _ = &mut shutdown => break,
            }
        }
        state.stop(status).await;
        tracing::info!("device plugin stopped");
        Ok(())
    }
}

/// `kubelet.sock`'s identity (see [`kubelet_identity`]).
type KubeletId = (u64, u64, i64, i64);

/// Where the serve-and-register loop stands between two polls.
struct RegistrationState {
    server: Option<PluginServer>,
    /// The kubelet socket we are registered with, if any.
    registered_with: Option<KubeletId>,
    /// The kubelet socket last seen, to notice a new one.
    seen: Option<KubeletId>,
    backoff: Duration,
    next_attempt: Instant,
    /// Log a failing bind once, not every poll.
    serve_failing: bool,
    /// When we last registered, and how many ListAndWatch calls there were then.
    awaiting_call: Option<(Instant, u64)>,
}

impl RegistrationState {
    fn new() -> Self {
        Self {
            server: None,
            registered_with: None,
            seen: None,
            backoff: BACKOFF_START,
            next_attempt: Instant::now(),
            serve_failing: false,
            awaiting_call: None,
        }
    }

    /// Our socket: (re)serve when it is gone or replaced.
    async fn keep_serving(
        &mut self,
        socket: &Path,
        service: &PluginService,
        status: &PluginStatus,
    ) {
        if self.server.as_ref().is_some_and(PluginServer::is_intact) {
            return;
        }
        if let Some(old) = self.server.take() {
            tracing::warn!(socket = %socket.display(), "our socket is gone; serving again");
            old.stop().await;
        }
        status.serving.store(false, Ordering::Relaxed);
        status.registered.store(false, Ordering::Relaxed);
        self.registered_with = None;
        match PluginServer::start(socket, service.clone()).await {
            Ok(server) => {
                self.server = Some(server);
                self.serve_failing = false;
                status.serving.store(true, Ordering::Relaxed);
                self.next_attempt = Instant::now();
                self.backoff = BACKOFF_START;
            }
            Err(e) if !self.serve_failing => {
                self.serve_failing = true;
                tracing::warn!(socket = %socket.display(), error = %e, "cannot serve the device plugin socket; retrying");
            }
            Err(e) => {
                tracing::debug!(socket = %socket.display(), error = %e, "still cannot serve the device plugin socket");
            }
        }
    }

    /// Kubelet: a new socket means a restarted kubelet, to register with at once.
    fn notice_kubelet(
        &mut self,
        current: Option<KubeletId>,
        kubelet: &Path,
        status: &PluginStatus,
    ) {
        if current != self.seen {
            if current.is_some() && self.seen.is_some() {
                tracing::info!(
                    "kubelet.sock was recreated (kubelet restarted?); registering again"
                );
            }
            self.seen = current;
            self.next_attempt = Instant::now();
            self.backoff = BACKOFF_START;
        }
        if current.is_none() && self.registered_with.is_some() {
            tracing::warn!(socket = %kubelet.display(), "kubelet.sock is gone");
        }
        if self.registered_with.is_some() && self.registered_with != current {
            self.registered_with = None;
            status.registered.store(false, Ordering::Relaxed);
        }
    }

    /// Serving, a kubelet is there, we are not registered with it, and no
    /// backoff holds us back.
    fn registration_due(&self, current: Option<KubeletId>) -> bool {
        self.server.is_some()
            && current.is_some()
            && self.registered_with.is_none()
            && Instant::now() >= self.next_attempt
    }

    fn registered(&mut self, current: Option<KubeletId>, calls_before: u64, status: &PluginStatus) {
        self.registered_with = current;
        status.record_registration();
        self.awaiting_call = Some((Instant::now(), calls_before));
        self.backoff = BACKOFF_START;
    }

    fn registration_failed(&mut self, error: &RegisterError) {
        tracing::warn!(error = %error, retry_in = ?self.backoff, "registering with kubelet failed");
        self.next_attempt = Instant::now() + self.backoff;
        self.backoff = (self.backoff * 2).min(BACKOFF_MAX);
    }

    /// A kubelet that takes the registration but never opens ListAndWatch
    /// (see [`SILENT_KUBELET`]) is reported once, and again when it recovers.
    fn watch_for_a_silent_kubelet(&mut self, status: &PluginStatus, grace: Duration) {
        if self.registered_with.is_none() {
            self.awaiting_call = None;
        }
        let Some((since, calls)) = self.awaiting_call else {
            return;
        };
        if status.list_and_watch_calls() > calls {
            self.awaiting_call = None;
            if status.kubelet_silent.swap(false, Ordering::Relaxed) {
                tracing::info!("kubelet opened ListAndWatch after all");
            }
        } else if since.elapsed() >= grace && !status.kubelet_silent.swap(true, Ordering::Relaxed) {
            tracing::error!(waited = ?grace, "{SILENT_KUBELET}");
        }
    }

    /// The next poll, or earlier for a registration retry that is due before it.
    fn next_wake(&self, current: Option<KubeletId>, poll_interval: Duration) -> Instant {
        let wake = Instant::now() + poll_interval;
        if self.registered_with.is_none() && current.is_some() && self.server.is_some() {
            wake.min(self.next_attempt)
        } else {
            wake
        }
    }

    async fn stop(self, status: &PluginStatus) {
        status.registered.store(false, Ordering::Relaxed);
        status.serving.store(false, Ordering::Relaxed);
        if let Some(server) = self.server {
            server.stop().await;
        }
    }
}

/// Runs the device plugin until `shutdown` resolves (see `PluginRunner`);
/// progress is visible through `status`.
pub async fn run_device_plugin(
    config: PluginConfig,
    status: Arc<PluginStatus>,
    view: ViewRx,
    tx: ViewTx,
    shutdown: impl Future<Output = ()>,
) -> Result<(), PluginError> {
    let plugin = PluginRunner {
        config,
        view,
        tx,
        status,
    };
    plugin.run(shutdown).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn socket_names() {
        assert_eq!(
            socket_name("tessera.dev/gpu"),
            "tessera-tessera-dev-gpu.sock"
        );
        assert_eq!(
            socket_name("example.com/a.b"),
            "tessera-example-com-a-b.sock"
        );
        let c = PluginConfig::default();
        assert_eq!(
            c.socket_path(),
            Path::new("/var/lib/kubelet/device-plugins/tessera-tessera-dev-gpu.sock")
        );
        assert_eq!(
            c.kubelet_socket(),
            Path::new("/var/lib/kubelet/device-plugins/kubelet.sock")
        );
        assert!(!c.cdi);
    }

    #[tokio::test]
    async fn register_without_kubelet_is_a_connect_error() {
        let err = register(
            Path::new("/nonexistent/kubelet.sock"),
            "x.sock",
            DEFAULT_RESOURCE_NAME,
        )
        .await
        .unwrap_err();
        assert!(matches!(err, RegisterError::Connect { .. }), "{err}");
        assert!(err.to_string().contains("/nonexistent/kubelet.sock"));
    }
}
