//! `tessera agent`'s flags and the agent configuration they make.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use super::exit::block_on;
use super::gpus::{BackendFlags, HealthFlags};
use super::values::{AllocationFlag, driver_name, resource_name};
use crate::agent::device_plugin::registration::PluginConfig;
use crate::agent::dra::DraConfig;
use crate::agent::run::{AgentConfig, PublishOptions};
use crate::api::ResourceName;

#[derive(clap::Args)]
pub struct AgentFlags {
    #[command(flatten)]
    gpus: BackendFlags,
    /// Where the host's procfs is mounted (NVIDIA device minors).
    #[arg(long, value_name = "DIR", default_value = "/proc")]
    procfs_root: PathBuf,
    /// Kubelet's device plugin directory.
    #[arg(
        long,
        value_name = "DIR",
        default_value = "/var/lib/kubelet/device-plugins"
    )]
    plugin_dir: PathBuf,
    /// Extended resource the GPUs are registered as; `{vendor}` in it
    /// (e.g. `tessera.dev/{vendor}-gpu`) gives each vendor its own.
    #[arg(long, value_name = "NAME", default_value = crate::api::DEFAULT_RESOURCE_NAME, value_parser = resource_name)]
    resource_name: ResourceName,
    /// Also name allocated devices as the vendors' CDI devices.
    #[arg(long)]
    cdi: bool,
    /// How kubelet hands out the GPUs: `device-plugin` (an extended
    /// resource), `dra` (ResourceSlices and claims, Kubernetes 1.34+), or
    /// `auto`: DRA where the API server serves resource.k8s.io/v1 and kubelet
    /// registers the driver, else the device plugin.
    #[arg(long, value_name = "MODE", value_enum, default_value_t = AllocationFlag::DevicePlugin)]
    allocation: AllocationFlag,
    /// The DRA driver name (ResourceSlices, the DeviceClass and claims carry it).
    #[arg(long, value_name = "NAME", default_value = crate::agent::dra::DEFAULT_DRIVER_NAME, value_parser = driver_name)]
    dra_driver_name: String,
    /// Kubelet's plugin registration directory (DRA).
    #[arg(
        long,
        value_name = "DIR",
        default_value = "/var/lib/kubelet/plugins_registry"
    )]
    kubelet_registry_dir: PathBuf,
    /// Kubelet's plugins directory: the DRA driver's socket and its record of
    /// prepared claims go in `<DIR>/<driver name>/`.
    #[arg(long, value_name = "DIR", default_value = "/var/lib/kubelet/plugins")]
    kubelet_plugins_dir: PathBuf,
    /// Where the DRA driver writes a CDI spec per prepared claim (a directory
    /// the container runtime reads CDI specs from).
    #[arg(long, value_name = "DIR", default_value = "/var/run/cdi")]
    cdi_dir: PathBuf,
    /// A directory of the node's CDI specs, as the agent sees it (repeat for
    /// several): the DRA driver names a vendor's CDI device (nvidia.com/gpu=<UUID>)
    /// for a claim only where a spec here defines it.
    #[arg(long = "cdi-spec-dir", value_name = "DIR", default_values = ["/etc/cdi", "/var/run/cdi"])]
    cdi_spec_dirs: Vec<PathBuf>,
    /// The host's GPU driver root as the agent sees it: where no CDI spec of
    /// the node defines a claim's GPUs, the DRA driver mounts the driver's
    /// libraries found under it into the claim's containers. Unset: none.
    #[arg(long, value_name = "DIR")]
    driver_root: Option<PathBuf>,
    /// The same directory's path on the host (the mounts' host paths).
    #[arg(long, value_name = "DIR", default_value = "/")]
    host_driver_root: PathBuf,
    /// Offer whole GPUs for memory shares through DRA (consumable capacity):
    /// instances with `placement.sharing: Shared` may then take part of a
    /// GPU's memory beside others, with no isolation between them. Claims
    /// that ask for no capacity still get whole GPUs.
    #[arg(long)]
    memory_shares: bool,
    /// Device registry file.
    #[arg(
        long,
        value_name = "FILE",
        default_value = "/var/lib/tessera/registry.json"
    )]
    registry: PathBuf,
    /// Allocation checkpoint: which pod got which planned devices, kept across agent restarts.
    #[arg(
        long,
        value_name = "FILE",
        default_value = "/var/lib/tessera/checkpoint.json"
    )]
    checkpoint: PathBuf,
    /// Kubeconfig file; default: in-cluster configuration or KUBECONFIG.
    #[arg(long, value_name = "FILE")]
    kubeconfig: Option<PathBuf>,
    /// Do not talk to the API server: serve kubelet only.
    #[arg(long)]
    no_publish: bool,
    /// Seconds between publishes of telemetry-only changes (each node adds
    /// up to a tenth, fixed by its name, so a fleet does not write in step).
    #[arg(long, value_name = "SECONDS", default_value = "300", value_parser = clap::value_parser!(u64).range(1..=3600))]
    publish_interval: u64,
    /// Milliseconds between reads of the GPUs.
    #[arg(long, value_name = "MS", default_value = "500", value_parser = clap::value_parser!(u64).range(50..=60000))]
    poll_interval_ms: u64,
    #[command(flatten)]
    health: HealthFlags,
    /// Address of /healthz, /readyz and /metrics.
    #[arg(long, value_name = "ADDR", default_value = "0.0.0.0:8080")]
    listen: std::net::SocketAddr,
}

impl AgentFlags {
    pub fn run(self) -> ExitCode {
        let Self {
            gpus,
            procfs_root,
            plugin_dir,
            resource_name,
            cdi,
            allocation,
            dra_driver_name,
            kubelet_registry_dir,
            kubelet_plugins_dir,
            cdi_dir,
            cdi_spec_dirs,
            driver_root,
            host_driver_root,
            memory_shares,
            registry,
            checkpoint,
            kubeconfig,
            no_publish,
            publish_interval,
            poll_interval_ms,
            health,
            listen,
        } = self;
        use crate::agent::run::run;
        let detect = gpus.options();
        let publish = if no_publish {
            None
        } else {
            match detect.node_name.clone() {
                Some(node_name) => Some(PublishOptions {
                    node_name,
                    kubeconfig,
                    min_interval: Duration::from_secs(publish_interval),
                }),
                None => {
                    eprintln!(
                        "error: the node name is needed to publish GPU state: set NODE_NAME or --node-name, or use --no-publish"
                    );
                    return ExitCode::from(1);
                }
            }
        };
        let sysfs_root = detect.sysfs_root.clone();
        let config = AgentConfig {
            detect,
            health: health.policy(),
            poll_interval: Duration::from_millis(poll_interval_ms),
            registry: Some(registry),
            checkpoint,
            resource: resource_name,
            plugin: PluginConfig {
                plugin_dir,
                cdi,
                sysfs_root,
                procfs_root,
                ..PluginConfig::default()
            },
            publish,
            allocation: allocation.into(),
            dra: DraConfig {
                driver_name: dra_driver_name,
                registry_dir: kubelet_registry_dir,
                plugins_dir: kubelet_plugins_dir,
                cdi_dir,
                cdi_spec_dirs,
                driver_root,
                host_driver_root,
                memory_shares,
                ..DraConfig::default()
            },
            listen,
        };
        block_on(run(config))
    }
}
