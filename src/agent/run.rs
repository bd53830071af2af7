//! `tessera agent`: wires the backend poller, the kubelet-facing plugin (the
//! device plugin or the DRA driver, see [`AllocationMode`]), the node state
//! publisher and the HTTP endpoints together, and shuts them down in order on
//! SIGTERM or SIGINT (stop serving, remove our sockets, stop polling).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use tokio::sync::watch;

use super::binding::{BindingConfig, BindingIndex, run_pod_watch};
use super::container_devices::RuntimeOptions;
use super::device_plugin::registration::{PluginConfig, PluginRunner};
use super::dra::slice_publisher::delete_node_slices;
use super::dra::{DraConfig, DraHandle};
use super::http::{AgentMetrics, Counters, router, serve as serve_http};
use super::publisher::{PublisherConfig, PublisherStats, run_publisher};
use super::state::{ViewRx, ViewTx, channel, spawn_poller_with_ids};
use crate::backend::detect::{DetectOptions, detect};
use crate::backend::health::{HealthPolicy, HealthTracker};
use crate::backend::registry::Registry;
pub use crate::kubernetes::allocation_mode::AllocationMode;
use crate::kubernetes::allocation_mode::serves_dra;
use crate::kubernetes::api_requests::ApiRequests;
use crate::kubernetes::client::kube_client;
use crate::process::signal::terminated;
use tessera_core::api::{ResourceName, Vendor};

/// How long `auto` waits for kubelet to register the DRA driver before it
/// offers the GPUs through the device plugin instead. Kubelet's plugin
/// watcher sees a new socket within a second.
const DRA_REGISTRATION_WAIT: Duration = Duration::from_secs(20);

pub struct AgentConfig {
    pub detect: DetectOptions,
    pub health: HealthPolicy,
    pub poll_interval: Duration,
    /// Device registry file; `None` keeps none.
    pub registry: Option<PathBuf>,
    /// The extended resource (with `{vendor}`, the node's vendor fills it
    /// in); `plugin.resource_name` is set from it at start.
    pub resource: ResourceName,
    pub plugin: PluginConfig,
    /// Allocation checkpoint of the planned bindings (used when publishing).
    pub checkpoint: PathBuf,
    /// `None` runs without an API server (`--no-publish`).
    pub publish: Option<PublishOptions>,
    pub allocation: AllocationMode,
    pub dra: DraConfig,
    pub listen: SocketAddr,
}

pub struct PublishOptions {
    pub node_name: String,
    /// Kubeconfig file; `None` uses the in-cluster config (or `KUBECONFIG`).
    pub kubeconfig: Option<PathBuf>,
    pub min_interval: Duration,
}

#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    #[error("{0}")]
    Backend(#[from] crate::backend::BackendError),
    #[error("cannot reach the Kubernetes API: {0}")]
    Kube(String),
    #[error("{0}")]
    Resource(String),
    #[error("{0}")]
    Mode(String),
    #[error("cannot serve the HTTP endpoints on {addr}: {source}")]
    Listen {
        addr: SocketAddr,
        source: std::io::Error,
    },
}

/// Runs the agent until SIGTERM/SIGINT.
pub async fn run(config: AgentConfig) -> Result<(), AgentError> {
    let backend = detect(&config.detect)?;
    tracing::info!(backend = backend.name(), "GPU backend selected");
    let (tx, rx) = channel(backend.name());
    let stop_polling = Arc::new(AtomicBool::new(false));
    // The registry of the last run keeps device IDs stable across restarts
    // (a GPU lost meanwhile keeps its UUID rather than a positional ID).
    let known = config.registry.as_deref().and_then(Registry::load);
    let poller = spawn_poller_with_ids(
        backend,
        HealthTracker::new(config.health),
        config.poll_interval,
        tx.clone(),
        stop_polling.clone(),
        known,
    );
    let result = serve(config, rx, tx).await;
    stop_polling.store(true, Ordering::Relaxed);
    let _ = tokio::task::spawn_blocking(move || poller.join()).await;
    result
}

/// Everything but the poller, until SIGTERM/SIGINT.
async fn serve(config: AgentConfig, rx: ViewRx, tx: ViewTx) -> Result<(), AgentError> {
    let (stop_tx, stop_rx) = watch::channel(false);
    let stopped = move || {
        let mut rx = stop_rx.clone();
        async move {
            let _ = rx.wait_for(|s| *s).await;
        }
    };

    let api_requests = ApiRequests::default();
    let client = match &config.publish {
        Some(p) => Some(
            kube_client(p.kubeconfig.as_deref(), &api_requests)
                .await
                .map_err(AgentError::Kube)?,
        ),
        None => None,
    };
    let listener = tokio::net::TcpListener::bind(config.listen)
        .await
        .map_err(|source| AgentError::Listen {
            addr: config.listen,
            source,
        })?;

    let runtime = RuntimeOptions {
        cdi: config.plugin.cdi,
        sysfs_root: config.plugin.sysfs_root.clone(),
        procfs_root: config.plugin.procfs_root.clone(),
        driver_root: config.dra.driver_root.clone(),
        host_driver_root: config.dra.host_driver_root.clone(),
        cdi_spec_dirs: config.dra.cdi_spec_dirs.clone(),
    };
    let dra = match (&config.publish, &client) {
        (Some(p), Some(client)) => {
            start_dra(&config, &p.node_name, client, runtime, &rx, &tx).await?
        }
        _ if config.allocation == AllocationMode::Dra => {
            return Err(AgentError::Mode(
                "--allocation dra needs the API server (claims are read there, slices written there): drop --no-publish".into(),
            ));
        }
        _ => None,
    };

    let allocation = config.plugin.allocation_metrics.clone();
    let (plugin, plugin_status) = match &dra {
        Some(_) => (None, None),
        None => {
            // `auto` may have offered the GPUs through DRA in an earlier run.
            if let (AllocationMode::Auto, Some(p), Some(client)) =
                (config.allocation, &config.publish, &client)
            {
                forget_dra_slices(client, &config.dra.driver_name, &p.node_name).await;
            }
            let (task, status) =
                start_device_plugin(&config, client.as_ref(), &rx, &tx, &stopped).await?;
            (Some(task), Some(status))
        }
    };

    let publisher_stats = Arc::new(PublisherStats::default());
    // The node the device metrics are labelled with (none without publishing).
    let node = config
        .publish
        .as_ref()
        .map_or_else(String::new, |publish| publish.node_name.clone());
    let publisher = match (config.publish, client) {
        (Some(p), Some(client)) => {
            let mut pc = PublisherConfig::new(p.node_name);
            pc.min_interval = p.min_interval;
            Some(tokio::spawn(run_publisher(
                client,
                pc,
                rx.clone(),
                publisher_stats.clone(),
                stopped(),
            )))
        }
        _ => None,
    };

    if let Some(path) = config.registry.clone() {
        let mut first = rx.clone();
        tokio::spawn(async move {
            if first.wait_for(|v| v.ready).await.is_ok() {
                let devices = first
                    .borrow()
                    .snapshot
                    .devices
                    .iter()
                    .map(|d| d.info.clone())
                    .collect();
                let mut registry =
                    Registry::load(&path).unwrap_or_else(|| Registry::new(Vec::new()));
                registry.devices = devices;
                if let Err(e) = registry.save(&path) {
                    tracing::warn!(path = %path.display(), error = %e, "could not write the device registry");
                }
            }
        });
    }

    let counters = Counters {
        plugin: plugin_status,
        publisher: publisher.as_ref().map(|_| publisher_stats.clone()),
        dra: dra.as_ref().map(|d| d.status.clone()),
        slices: dra.as_ref().map(|d| d.slice_stats.clone()),
    };
    let mut metrics = AgentMetrics::new(&allocation, &node);
    api_requests.register(metrics.registry_mut());
    let app = router(rx.clone(), counters, Arc::new(metrics));
    let http = tokio::spawn(serve_http(listener, app, stopped()));

    terminated().await;
    tracing::info!("shutting down");
    let _ = stop_tx.send(true);
    if let Some(plugin) = plugin
        && let Ok(Err(e)) = plugin.await
    {
        tracing::warn!(error = %e, "device plugin stopped with an error");
    }
    if let Some(dra) = dra {
        dra.stop().await;
    }
    if let Some(p) = publisher
        && let Ok(Err(e)) = p.await
    {
        tracing::warn!(error = %e, "publisher stopped with an error");
    }
    if let Ok(Err(e)) = http.await {
        tracing::warn!(error = %e, "HTTP endpoints stopped with an error");
    }
    Ok(())
}

/// The DRA driver, when the mode asks for it and (for `auto`) the API
/// server serves DRA and kubelet registers the driver; `None`: the device
/// plugin it is.
async fn start_dra(
    config: &AgentConfig,
    node_name: &str,
    client: &kube::Client,
    runtime: RuntimeOptions,
    rx: &ViewRx,
    tx: &ViewTx,
) -> Result<Option<DraHandle>, AgentError> {
    match config.allocation {
        AllocationMode::DevicePlugin => return Ok(None),
        AllocationMode::Auto => match serves_dra(client).await {
            Ok(true) => {}
            Ok(false) => {
                tracing::info!(
                    "the API server does not serve resource.k8s.io/v1: offering the GPUs through the device plugin"
                );
                return Ok(None);
            }
            Err(e) => {
                tracing::warn!(error = %e, "cannot tell whether the API server serves DRA: offering the GPUs through the device plugin");
                return Ok(None);
            }
        },
        AllocationMode::Dra => {}
    }
    let mut dra = DraHandle::serve(
        &config.dra,
        node_name,
        client.clone(),
        runtime,
        rx.clone(),
        tx.clone(),
    )
    .await;
    if config.allocation == AllocationMode::Auto {
        let word = dra.registered_within(DRA_REGISTRATION_WAIT).await;
        if word != Some(true) {
            let why = match word {
                Some(_) => format!(
                    "kubelet refused it: {}",
                    dra.status.refusal().unwrap_or_default()
                ),
                None => format!(
                    "kubelet did not register it within {DRA_REGISTRATION_WAIT:?} (is {} the kubelet's plugin registration directory?)",
                    config.dra.registry_dir.display()
                ),
            };
            tracing::warn!(driver = %config.dra.driver_name, "not a DRA driver on this node, {why}: offering the GPUs through the device plugin");
            dra.stop().await;
            return Ok(None);
        }
    }
    dra.publish_slices(
        client.clone(),
        &config.dra.driver_name,
        node_name,
        (rx.clone(), tx.clone()),
        config.dra.memory_shares,
    );
    tracing::info!(driver = %config.dra.driver_name, mode = config.allocation.as_str(), "offering the GPUs through DRA");
    Ok(Some(dra))
}

/// A node on the device plugin offers nothing through DRA: slices left by an
/// earlier run go (best effort; an API server without DRA has none).
async fn forget_dra_slices(client: &kube::Client, driver: &str, node_name: &str) {
    match delete_node_slices(client.clone(), driver, node_name).await {
        Ok(0) => {}
        Ok(n) => tracing::info!(
            slices = n,
            "deleted this node's ResourceSlices: the GPUs are offered through the device plugin"
        ),
        Err(kube::Error::Api(e)) if e.code == 404 => {}
        Err(e) => {
            tracing::warn!(error = %e, "could not delete this node's ResourceSlices of an earlier DRA run")
        }
    }
}

type PluginTask =
    tokio::task::JoinHandle<Result<(), super::device_plugin::registration::PluginError>>;

/// The device plugin, with the planned bindings where there is an API server.
async fn start_device_plugin<S, F>(
    config: &AgentConfig,
    client: Option<&kube::Client>,
    rx: &ViewRx,
    tx: &ViewTx,
    stopped: &S,
) -> Result<
    (
        PluginTask,
        Arc<super::device_plugin::registration::PluginStatus>,
    ),
    AgentError,
>
where
    S: Fn() -> F,
    F: std::future::Future<Output = ()> + Send + 'static,
{
    let mut plugin_config = config.plugin.clone();
    plugin_config.resource_name = node_resource(&config.resource, rx.clone()).await?;
    tracing::info!(resource = %plugin_config.resource_name, "offering the GPUs as");

    // Planned bindings need the API server; without it (`--no-publish`) kubelet
    // gets the plain topology-aware choice, and the view's allocated set only
    // grows (the plugin records what it hands out; no pod watch clears it).
    let binding = match (&config.publish, client) {
        (Some(p), Some(client)) => {
            let index = Arc::new(BindingIndex::open(BindingConfig {
                checkpoint: Some(config.checkpoint.clone()),
                resource_name: plugin_config.resource_name.clone(),
                ..BindingConfig::default()
            }));
            // The published allocated set follows the checkpoint: seeded
            // from it now, cleared as the pod watch sees pods end.
            index.keep_view(tx.clone());
            index.catch_up_with(client.clone(), &p.node_name);
            tokio::spawn(run_pod_watch(
                client.clone(),
                p.node_name.clone(),
                index.clone(),
                stopped(),
            ));
            Some(index)
        }
        _ => None,
    };
    if let Some(index) = &binding {
        plugin_config.binder = index.clone();
    }
    let runner = PluginRunner::new(plugin_config, rx.clone(), tx.clone());
    let plugin_status = runner.status();
    let plugin_stop = stopped();
    let stop_waiting = stopped();
    let plugin = tokio::spawn(async move {
        if let Some(index) = binding {
            tokio::select! {
                _ = index.synced() => {}
                _ = tokio::time::sleep(Duration::from_secs(30)) => tracing::warn!(
                    "the pods on this node were not listed within 30 s; serving kubelet anyway (allocations are refused until they are)"
                ),
                // SIGTERM while waiting: nothing is served yet, nothing to stop.
                _ = stop_waiting => return Ok(()),
            }
        }
        runner.run(plugin_stop).await
    });
    Ok((plugin, plugin_status))
}

/// The resource this node's GPUs are offered as. Per vendor, the node's one
/// vendor decides after the first reading of the GPUs; a node mixing vendors
/// cannot be offered that way (one plugin serves one resource).
async fn node_resource(name: &ResourceName, mut rx: ViewRx) -> Result<String, AgentError> {
    if !name.per_vendor() {
        return Ok(name.to_string());
    }
    let fail = |why: String| {
        AgentError::Resource(format!(
            "the per-vendor resource name {name} needs this node's GPU vendor: {why}"
        ))
    };
    let view = rx
        .wait_for(|v| v.ready || v.error.is_some())
        .await
        .map_err(|_| fail("the GPU poller stopped".into()))?;
    if !view.ready {
        let error = view.error.clone().unwrap_or_default();
        return Err(fail(format!("reading the GPUs failed: {error}")));
    }
    let vendors: std::collections::BTreeSet<Vendor> = view
        .snapshot
        .devices
        .iter()
        .map(|d| d.info.vendor)
        .filter(|v| *v != Vendor::Unknown)
        .collect();
    match vendors.into_iter().collect::<Vec<_>>()[..] {
        [vendor] => Ok(name.for_vendor(vendor)),
        [] => Err(fail("no NVIDIA or AMD GPU was found".into())),
        ref many => Err(fail(format!(
            "it has GPUs of {}; use a name without {{vendor}} on mixed nodes",
            many.iter()
                .map(|v| v.as_str())
                .collect::<Vec<_>>()
                .join(" and ")
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::fake::FakeBackend;
    use crate::backend::snapshot;

    fn read(spec: &str) -> ViewRx {
        let (tx, rx) = channel("fake");
        let snap = snapshot(&mut FakeBackend::new(spec).unwrap()).unwrap();
        tx.send_modify(|v| {
            v.snapshot = snap;
            v.ready = true;
        });
        rx
    }

    fn resolve(name: &str, rx: ViewRx) -> Result<String, String> {
        let name: ResourceName = name.parse().unwrap();
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        rt.block_on(node_resource(&name, rx))
            .map_err(|e| e.to_string())
    }

    #[test]
    fn the_nodes_vendor_fills_in_a_per_vendor_name() {
        assert_eq!(
            resolve("tessera.dev/{vendor}-gpu", read("2xMI300X-192GiB")).unwrap(),
            "tessera.dev/amd-gpu"
        );
        assert_eq!(
            resolve("tessera.dev/{vendor}-gpu", read("4xH100-80GiB")).unwrap(),
            "tessera.dev/nvidia-gpu"
        );
        // One name for all does not wait for the GPUs.
        let (_tx, rx) = channel("fake");
        assert_eq!(resolve("tessera.dev/gpu", rx).unwrap(), "tessera.dev/gpu");
    }

    #[test]
    fn a_per_vendor_name_on_a_mixed_empty_or_failing_node_is_refused() {
        let err = resolve(
            "tessera.dev/{vendor}-gpu",
            read("1xH100-80GiB,1xMI300X-192GiB"),
        )
        .unwrap_err();
        assert!(err.contains("GPUs of nvidia and amd"), "{err}");
        assert!(err.contains("tessera.dev/{vendor}-gpu"), "{err}");

        let (tx, rx) = channel("fake");
        tx.send_modify(|v| v.ready = true);
        let err = resolve("tessera.dev/{vendor}-gpu", rx).unwrap_err();
        assert!(err.contains("no NVIDIA or AMD GPU"), "{err}");

        let (tx, rx) = channel("fake");
        tx.send_modify(|v| v.error = Some("NVML: driver not loaded".into()));
        let err = resolve("tessera.dev/{vendor}-gpu", rx).unwrap_err();
        assert!(
            err.contains("reading the GPUs failed: NVML: driver not loaded"),
            "{err}"
        );
    }
}
