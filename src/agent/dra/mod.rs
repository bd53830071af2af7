//! The agent as a DRA driver (`gpu.tessera.dev` unless configured
//! otherwise): the node's GPUs published as ResourceSlices, and kubelet's
//! `DRAPlugin` calls answered by preparing each claim's devices as a CDI spec.
//! Beside the device plugin (`super::device_plugin`); a node runs one of the
//! two (`super::run` decides), never both, so no GPU is offered twice.
//!
//! - `kubelet_api`: the generated kubelet APIs and their constants;
//! - `device_names`, `slices`, `slice_publisher`: what the slices say and
//!   writing them;
//! - `allocation`, `cdi`, `prepared`, `driver`: preparing claims;
//! - `grpc`, `registration`: the services kubelet calls and keeping them
//!   registered.

mod allocation;
mod cdi;
pub mod device_names;
mod driver;
mod grpc;
pub mod kubelet_api;
mod partition_devices;
mod prepared;
pub(crate) mod registration;
mod slice_fields;
pub mod slice_publisher;
pub(crate) mod slices;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio::task::JoinHandle;

use self::allocation::DriverOnNode;
use self::cdi::CdiDir;
use self::driver::Driver;
use self::prepared::PreparedClaims;
pub use self::registration::DraStatus;
use self::registration::{SocketPaths, run_driver};
pub use self::slice_publisher::SliceStats;
use self::slice_publisher::run_slice_publisher;
use crate::agent::container_devices::RuntimeOptions;
use crate::agent::state::{ViewRx, ViewTx};

/// The DRA driver name unless configured otherwise.
pub const DEFAULT_DRIVER_NAME: &str = "gpu.tessera.dev";
/// The file, in the driver's plugin directory, recording prepared claims.
const PREPARED_FILE: &str = "prepared-claims.json";

#[derive(Clone, Debug)]
pub struct DraConfig {
    /// The driver name: slices, DeviceClass and claims' results carry it.
    pub driver_name: String,
    /// Kubelet's plugin registration directory.
    pub registry_dir: PathBuf,
    /// Kubelet's plugins directory (the driver's socket and record go in
    /// `<dir>/<driver name>/`).
    pub plugins_dir: PathBuf,
    /// Where CDI specs go (a directory the container runtime reads).
    pub cdi_dir: PathBuf,
    /// Where the node's CDI specs are read (a vendor's CDI device is named
    /// in a claim's answer only where one of them defines it).
    pub cdi_spec_dirs: Vec<PathBuf>,
    /// The host's driver root as the agent sees it: claims on nodes whose
    /// CDI specs do not define their GPUs get the driver's libraries from
    /// here. `None`: they get none from tessera.
    pub driver_root: Option<PathBuf>,
    /// That directory's path on the host.
    pub host_driver_root: PathBuf,
    /// How often the sockets are checked.
    pub poll_interval: Duration,
    /// Offer whole GPUs for memory shares (consumable capacity): several
    /// claims may each take part of a GPU's memory.
    pub memory_shares: bool,
}

impl Default for DraConfig {
    fn default() -> Self {
        Self {
            driver_name: DEFAULT_DRIVER_NAME.to_string(),
            registry_dir: PathBuf::from(kubelet_api::DEFAULT_REGISTRY_DIR),
            plugins_dir: PathBuf::from(kubelet_api::DEFAULT_PLUGINS_DIR),
            cdi_dir: PathBuf::from("/var/run/cdi"),
            cdi_spec_dirs: RuntimeOptions::default().cdi_spec_dirs,
            driver_root: None,
            host_driver_root: PathBuf::from("/"),
            poll_interval: Duration::from_millis(500),
            memory_shares: false,
        }
    }
}

/// Whether `name` can be a DRA driver name: a DNS subdomain of at most 63
/// characters (the API server's rule for `spec.driver`).
pub fn check_driver_name(name: &str) -> Result<(), String> {
    let labels_ok = name.split('.').all(|label| {
        !label.is_empty()
            && label
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
            && !label.starts_with('-')
            && !label.ends_with('-')
    });
    if name.is_empty() || name.len() > 63 || !labels_ok {
        return Err(format!(
            "{name:?} is not a DRA driver name: lowercase DNS labels joined by dots, at most 63 characters (e.g. gpu.tessera.dev)"
        ));
    }
    Ok(())
}

/// The running driver: its sockets, and (once started) its slices.
pub(crate) struct DraHandle {
    pub(crate) status: Arc<DraStatus>,
    pub(crate) slice_stats: Arc<SliceStats>,
    stop: watch::Sender<bool>,
    driver_task: JoinHandle<()>,
    slice_task: Option<JoinHandle<()>>,
}

impl DraHandle {
    /// Serves the driver's sockets (registration included), so kubelet can
    /// register it; slices are published only once [`Self::publish_slices`].
    pub(crate) async fn serve(
        config: &DraConfig,
        node_name: &str,
        client: kube::Client,
        runtime: RuntimeOptions,
        view: ViewRx,
        tx: ViewTx,
    ) -> Self {
        let plugin_dir = config.plugins_dir.join(&config.driver_name);
        let driver = Driver::new(
            DriverOnNode {
                driver: config.driver_name.clone(),
                node_name: node_name.to_string(),
            },
            CdiDir {
                dir: config.cdi_dir.clone(),
                driver: config.driver_name.clone(),
            },
            runtime,
            view,
            client,
            PreparedClaims::open(plugin_dir.join(PREPARED_FILE)),
        )
        .keep_view(tx)
        .await;
        let status = Arc::new(DraStatus::default());
        let (stop, stop_rx) = watch::channel(false);
        let paths = SocketPaths::new(
            &config.registry_dir,
            &config.plugins_dir,
            &config.driver_name,
        );
        let driver = Arc::new(driver);
        tokio::spawn(forget_gone_claims(
            driver.clone(),
            stopped(stop.subscribe()),
        ));
        let driver_task = tokio::spawn(run_driver(
            driver,
            paths,
            status.clone(),
            config.poll_interval,
            stopped(stop_rx),
        ));
        Self {
            status,
            slice_stats: Arc::new(SliceStats::default()),
            stop,
            driver_task,
            slice_task: None,
        }
    }

    /// Kubelet's word on the registration, waiting up to `wait` for it.
    pub(crate) async fn registered_within(&self, wait: Duration) -> Option<bool> {
        let mut changes = self.status.subscribe();
        let status = self.status.clone();
        let heard = async move {
            loop {
                if let Some(word) = status.registered() {
                    return word;
                }
                if changes.changed().await.is_err() {
                    return false;
                }
            }
        };
        tokio::time::timeout(wait, heard).await.ok()
    }

    /// Starts publishing the node's slices.
    pub(crate) fn publish_slices(
        &mut self,
        client: kube::Client,
        driver: &str,
        node_name: &str,
        view: (ViewRx, ViewTx),
        memory_shares: bool,
    ) {
        self.slice_task = Some(tokio::spawn(run_slice_publisher(
            client,
            driver.to_string(),
            node_name.to_string(),
            view,
            memory_shares,
            self.slice_stats.clone(),
            stopped(self.stop.subscribe()),
        )));
    }

    /// Stops serving and publishing (the slices stay).
    pub(crate) async fn stop(self) {
        let _ = self.stop.send(true);
        let _ = self.driver_task.await;
        if let Some(task) = self.slice_task {
            let _ = task.await;
        }
    }
}

/// How often recorded claims are checked against the API server.
const FORGET_GONE_EVERY: Duration = Duration::from_secs(300);

/// At start and then every [`FORGET_GONE_EVERY`]: claims prepared here that
/// no longer exist are unprepared (see `Driver::forget_gone_claims`).
async fn forget_gone_claims(
    driver: Arc<Driver<kube::Client>>,
    shutdown: impl std::future::Future<Output = ()>,
) {
    tokio::pin!(shutdown);
    loop {
        driver.forget_gone_claims().await;
        tokio::select! {
            _ = tokio::time::sleep(FORGET_GONE_EVERY) => {}
            _ = &mut shutdown => return,
        }
    }
}

async fn stopped(mut rx: watch::Receiver<bool>) {
    let _ = rx.wait_for(|s| *s).await;
}

#[cfg(test)]
mod tests {
    use super::check_driver_name;

    #[test]
    fn driver_names_are_dns_subdomains_of_63_characters() {
        for good in ["gpu.tessera.dev", "a", "gpu-1.example.com"] {
            assert_eq!(check_driver_name(good), Ok(()), "{good}");
        }
        for bad in [
            "",
            "GPU.tessera.dev",
            "gpu..dev",
            "-gpu.dev",
            "gpu_1.dev",
            &"a".repeat(64),
            "gpu.dev-",
        ] {
            let err = check_driver_name(bad).unwrap_err();
            assert!(err.contains("is not a DRA driver name"), "{bad}: {err}");
        }
    }
}
