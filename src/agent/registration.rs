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
use super::devices_env::RuntimeOptions;
use super::kubelet_api::v1beta1::RegisterRequest;
use super::kubelet_api::v1beta1::registration_client::RegistrationClient;
use super::kubelet_api::{DEFAULT_PLUGIN_DIR, KUBELET_SOCKET, VERSION};
use super::plugin::{Binder, NoBinder, PluginServer, PluginService, plugin_options};
use super::state::{ViewRx, ViewTx};

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
fn kubelet_identity(path: &Path) -> Option<(u64, u64, i64, i64)> {
    use std::os::unix::fs::MetadataExt;
    let m = std::fs::symlink_metadata(path).ok()?;
    Some((m.dev(), m.ino(), m.ctime(), m.ctime_nsec()))
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
            },
        )
        .with_metrics(config.allocation_metrics.clone())
        .counting_list_and_watch(status.list_and_watch_calls.clone());
        let socket = config.socket_path();
        let endpoint = config.socket_name();
        let kubelet = config.kubelet_socket();

        let mut server: Option<PluginServer> = None;
        // The kubelet socket we are registered with, if any.
        let mut registered_with = None;
        // The kubelet socket last seen, to notice a new one.
        let mut seen = None;
        let mut backoff = BACKOFF_START;
        let mut next_attempt = Instant::now();
        // Log a failing bind once, not every poll.
        let mut serve_failing = false;
        // When we last registered, and how many ListAndWatch calls there were then.
        let mut awaiting_call: Option<(Instant, u64)> = None;

        loop {
            // Our socket: (re)serve when it is gone or replaced.
            if !server.as_ref().is_some_and(PluginServer::is_intact) {
                if let Some(old) = server.take() {
                    tracing::warn!(socket = %socket.display(), "our socket is gone; serving again");
                    old.stop().await;
                }
                status.serving.store(false, Ordering::Relaxed);
                status.registered.store(false, Ordering::Relaxed);
                registered_with = None;
                match PluginServer::start(&socket, service.clone()).await {
                    Ok(s) => {
                        server = Some(s);
                        serve_failing = false;
                        status.serving.store(true, Ordering::Relaxed);
                        next_attempt = Instant::now();
                        backoff = BACKOFF_START;
                    }
                    Err(e) if !serve_failing => {
                        serve_failing = true;
                        tracing::warn!(socket = %socket.display(), error = %e, "cannot serve the device plugin socket; retrying");
                    }
                    Err(e) => {
                        tracing::debug!(socket = %socket.display(), error = %e, "still cannot serve the device plugin socket");
                    }
                }
            }

            // Kubelet: (re)register when its socket is new or we are not registered.
            let current = kubelet_identity(&kubelet);
            if current != seen {
                if current.is_some() && seen.is_some() {
                    tracing::info!(
                        "kubelet.sock was recreated (kubelet restarted?); registering again"
                    );
                }
                seen = current;
                next_attempt = Instant::now();
                backoff = BACKOFF_START;
            }
            if current.is_none() && registered_with.is_some() {
                tracing::warn!(socket = %kubelet.display(), "kubelet.sock is gone");
            }
            if registered_with.is_some() && registered_with != current {
                registered_with = None;
                status.registered.store(false, Ordering::Relaxed);
            }
            if server.is_some()
                && current.is_some()
                && registered_with.is_none()
                && Instant::now() >= next_attempt
            {
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
                        registered_with = current;
                        status.record_registration();
                        awaiting_call = Some((Instant::now(), calls_before));
                        backoff = BACKOFF_START;
                        tracing::info!(
                            resource = %config.resource_name,
                            endpoint = %endpoint,
                            "registered with kubelet"
                        );
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, retry_in = ?backoff, "registering with kubelet failed");
                        next_attempt = Instant::now() + backoff;
                        backoff = (backoff * 2).min(BACKOFF_MAX);
                    }
                }
            }

            if registered_with.is_none() {
                awaiting_call = None;
            }
            if let Some((since, calls)) = awaiting_call {
                if status.list_and_watch_calls() > calls {
                    awaiting_call = None;
                    if status.kubelet_silent.swap(false, Ordering::Relaxed) {
                        tracing::info!("kubelet opened ListAndWatch after all");
                    }
                } else if since.elapsed() >= config.list_and_watch_grace
                    && !status.kubelet_silent.swap(true, Ordering::Relaxed)
                {
                    tracing::error!(waited = ?config.list_and_watch_grace, "{SILENT_KUBELET}");
                }
            }

            // Wake early for a registration retry that is due before the next poll.
            let mut wake = Instant::now() + config.poll_interval;
            if registered_with.is_none() && current.is_some() && server.is_some() {
                wake = wake.min(next_attempt);
            }
            tokio::select! {
                _ = tokio::time::sleep_until(wake) => {}
                _ = &mut shutdown => break,
            }
        }

        status.registered.store(false, Ordering::Relaxed);
        status.serving.store(false, Ordering::Relaxed);
        if let Some(s) = server {
            s.stop().await;
        }
        tracing::info!("device plugin stopped");
        Ok(())
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
