//! The `tessera` command: flags -> config structs -> library calls; the work lives in
//! the library.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use tessera::DiscoverArgs;
use tessera::PlaceArgs;
use tessera::api::ResourceName;
use tessera::backend::detect::{BackendChoice, DetectOptions};
use tessera::backend::health::HealthPolicy;
use tessera::cli::discover::DiscoverOutput;
use tessera::cli::place::PlaceOutput;
use tessera::cli::{LogFormat, init_logging};
use tessera::controller::model_cache::ModelCacheDir;

// Why jemalloc: see its entry in Cargo.toml.
#[cfg(target_os = "linux")]
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

/// Places large models across the GPUs of a Kubernetes cluster.
#[derive(Parser)]
#[command(name = "tessera", version)]
struct Cli {
    /// Log line format on stderr (level from RUST_LOG, default warn).
    #[arg(long, value_enum, default_value = "text", global = true)]
    log_format: LogFormat,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Plan ModelInstances on a cluster description, without a cluster.
    ///
    /// With no files, plans the built-in sample: three Llama-class models on a
    /// mixed NVIDIA + AMD cluster of four nodes. Exit code 0 when every instance
    /// has a plan, 2 when one is unsatisfiable, 1 for bad input.
    Place(PlaceFlags),
    /// Print the ModelInstance CustomResourceDefinition as YAML.
    Crd,
    /// Run the node agent (DaemonSet): kubelet device plugin, GPU health, and the
    /// node's GPU state published on its Node object.
    Agent(Box<AgentFlags>),
    /// Run the controller (Deployment): reconcile ModelInstances into placed
    /// shard pods bound to their planned nodes and devices.
    Controller(ControllerFlags),
    /// List this node's GPUs as the node agent sees them, or summarise the GPU
    /// states of a whole cluster (`--summary`).
    Discover(DiscoverFlags),
}

// The flags of `tessera place`.
#[derive(clap::Args)]
struct PlaceFlags {
    /// ModelInstance YAML file (several documents allowed; repeat the flag for
    /// more files; `-` reads stdin). Default: the built-in samples.
    #[arg(short = 'f', long = "instance", value_name = "FILE")]
    instances: Vec<PathBuf>,
    /// Cluster description: a `nodes:` list of NodeGpuStates with labels, or
    /// `kubectl get nodes -o yaml` output. Default: the built-in sample cluster.
    #[arg(short, long, value_name = "FILE")]
    cluster: Option<PathBuf>,
    /// Output format.
    #[arg(short, long, value_enum, default_value = "table")]
    output: PlaceOutput,
    /// Search steps the solver may spend per instance before it returns the
    /// best plan found (the instance's deadlineMs also applies).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    max_steps: Option<u64>,
}

impl PlaceFlags {
    fn run(self) -> ExitCode {
        let Self {
            instances,
            cluster,
            output,
            max_steps,
        } = self;
        let args = PlaceArgs {
            instances,
            cluster,
            output,
            max_steps,
        };
        match tessera::place(&args) {
            Ok(report) => {
                print!("{}", report.render(output));
                if report.all_placed() {
                    ExitCode::SUCCESS
                } else {
                    ExitCode::from(2)
                }
            }
            Err(e) => {
                eprintln!("error: {e}");
                ExitCode::from(1)
            }
        }
    }
}

// The flags of `tessera agent`.
#[derive(clap::Args)]
struct AgentFlags {
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
    #[arg(long, value_name = "NAME", default_value = tessera::api::DEFAULT_RESOURCE_NAME, value_parser = resource_name)]
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
    #[arg(long, value_name = "NAME", default_value = tessera::agent::dra::DEFAULT_DRIVER_NAME, value_parser = driver_name)]
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
    fn run(self) -> ExitCode {
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
        use std::time::Duration;
        use tessera::{AgentConfig, DraConfig, PluginConfig, PublishOptions, run_agent as run};
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

// The flags of `tessera controller`.
#[derive(clap::Args)]
struct ControllerFlags {
    /// Kubeconfig file; default: in-cluster configuration or KUBECONFIG.
    #[arg(long, value_name = "FILE")]
    kubeconfig: Option<PathBuf>,
    /// Watch ModelInstances (and their pods) in this namespace only; default all.
    #[arg(long, value_name = "NS", value_parser = non_empty)]
    namespace: Option<String>,
    /// Address of /healthz, /readyz and /metrics.
    #[arg(long, value_name = "ADDR", default_value = "0.0.0.0:8081")]
    listen: std::net::SocketAddr,
    /// Address of the read-only cluster map (HTML: every node's GPUs and who
    /// holds them, each instance's plan); default: not served.
    #[arg(long, value_name = "ADDR")]
    map_listen: Option<std::net::SocketAddr>,
    /// Act only while holding a coordination.k8s.io Lease, so that replicas
    /// never act at once.
    #[arg(long, value_name = "BOOL", default_value = "true", action = clap::ArgAction::Set)]
    leader_elect: bool,
    /// Name of the Lease.
    #[arg(long, value_name = "NAME", default_value = "tessera-controller", value_parser = non_empty)]
    lease_name: String,
    /// Namespace of the Lease (the controller's own).
    #[arg(long, env = "POD_NAMESPACE", value_name = "NS", value_parser = non_empty)]
    lease_namespace: Option<String>,
    /// This replica's name in the Lease; default: the host name.
    #[arg(long, env = "POD_NAME", value_name = "ID", value_parser = non_empty)]
    identity: Option<String>,
    /// Extended resource the node agents register the GPUs as (the same
    /// value as theirs, `{vendor}` included).
    #[arg(long, value_name = "NAME", default_value = tessera::api::DEFAULT_RESOURCE_NAME, value_parser = resource_name)]
    resource_name: ResourceName,
    /// Seconds a NotReady node keeps its shards before they are re-placed.
    #[arg(long, value_name = "SECONDS", default_value = "300", value_parser = clap::value_parser!(u64).range(0..=86400))]
    node_grace_period: u64,
    /// Solver steps per plan before the best plan found is taken.
    #[arg(long, value_name = "N", default_value = "250000", value_parser = clap::value_parser!(u64).range(1..))]
    max_steps: u64,
    /// How the caches' watches get their first copy of everything: `stream`
    /// (WatchList, Kubernetes 1.32+, a server on etcd 3.5.13+), `list` (one
    /// paged LIST), or `auto`: stream where the API server offers it.
    #[arg(long, value_name = "HOW", value_enum, default_value_t = tessera::initial_list::InitialList::Auto)]
    initial_list: tessera::initial_list::InitialList,
    /// How shards get their devices: `device-plugin` (the extended resource),
    /// `dra` (a ResourceClaim the controller allocates, on nodes whose agent
    /// publishes ResourceSlices of the driver; needs resource.k8s.io/v1), or
    /// `auto`: `dra` where the API server serves resource.k8s.io/v1.
    #[arg(long, value_name = "MODE", value_enum, default_value_t = AllocationFlag::DevicePlugin)]
    allocation: AllocationFlag,
    /// The DRA driver of the node agents (the same value as theirs).
    #[arg(long, value_name = "NAME", default_value = tessera::agent::dra::DEFAULT_DRIVER_NAME, value_parser = driver_name)]
    dra_driver_name: String,
    /// Host directory for model weights that outlive a pod: a shard pod whose
    /// template mounts the volume `tessera-model-cache` without defining it
    /// gets `<DIR>/<namespace>` of its node (created if missing). Unset: such
    /// templates are refused.
    #[arg(long, value_name = "DIR", value_parser = model_cache_dir)]
    model_cache_dir: Option<ModelCacheDir>,
}

impl ControllerFlags {
    fn run(self) -> ExitCode {
        let Self {
            kubeconfig,
            namespace,
            listen,
            map_listen,
            leader_elect,
            lease_name,
            lease_namespace,
            identity,
            resource_name,
            node_grace_period,
            max_steps,
            initial_list,
            allocation,
            dra_driver_name,
            model_cache_dir,
        } = self;
        use tessera::{
            ControllerConfig, ControllerSettings as Settings, LeaderElection, run_controller as run,
        };
        let leader_election = if leader_elect {
            let Some(lease_namespace) = lease_namespace else {
                eprintln!(
                    "error: leader election needs the Lease's namespace: set POD_NAMESPACE or --lease-namespace, or use --leader-elect=false"
                );
                return ExitCode::from(1);
            };
            let Some(identity) = identity.or_else(host_name) else {
                eprintln!("error: no identity for the Lease: set POD_NAME or --identity");
                return ExitCode::from(1);
            };
            Some(LeaderElection {
                lease_name,
                lease_namespace,
                identity,
            })
        } else {
            None
        };
        block_on(run(ControllerConfig {
            kubeconfig,
            namespace,
            listen,
            map_listen,
            leader_election,
            settings: Settings {
                resource_name,
                node_grace: std::time::Duration::from_secs(node_grace_period),
                max_steps,
                dra_driver: Some(dra_driver_name),
                model_cache: model_cache_dir,
            },
            initial_list,
            allocation: allocation.into(),
        }))
    }
}

// The flags of `tessera discover`.
#[derive(clap::Args)]
struct DiscoverFlags {
    #[command(flatten)]
    gpus: BackendFlags,
    /// Device registry to read and update (keeps device IDs and probe results
    /// across runs); the agent uses /var/lib/tessera/registry.json.
    #[arg(long, value_name = "FILE")]
    registry: Option<PathBuf>,
    /// Also verify each device with CUDA and measure P2P access and bandwidth.
    #[arg(long)]
    probe: bool,
    /// `table`, or `json`: the exact NodeGpuState the agent publishes.
    #[arg(short, long, value_enum, default_value = "table")]
    output: DiscoverOutput,
    /// Refresh until interrupted.
    #[arg(long)]
    watch: bool,
    /// Seconds between refreshes with --watch.
    #[arg(long, value_name = "SECONDS", default_value = "2", value_parser = clap::value_parser!(u64).range(1..=3600))]
    interval: u64,
    #[command(flatten)]
    health: HealthFlags,
    /// Summarise these GPU states instead of this node: cluster descriptions,
    /// `kubectl get nodes -o yaml` output or `discover -o json` files.
    #[arg(long, value_name = "FILE", num_args = 1.., conflicts_with_all = ["probe", "watch", "backend"])]
    summary: Vec<PathBuf>,
}

impl DiscoverFlags {
    fn run(self) -> ExitCode {
        let Self {
            gpus,
            registry,
            probe,
            output,
            watch,
            interval,
            summary,
            health,
        } = self;
        let result = if summary.is_empty() {
            let args = DiscoverArgs {
                detect: gpus.options(),
                registry,
                probe,
                output,
                health: health.policy(),
            };
            tessera::discover(
                &args,
                watch.then(|| std::time::Duration::from_secs(interval)),
            )
        } else {
            tessera::discover_summary(&summary).map(|table| print!("{table}"))
        };
        match result {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("error: {e}");
                ExitCode::from(1)
            }
        }
    }
}

/// Where the GPUs come from; shared by `agent` and `discover`.
#[derive(clap::Args)]
struct BackendFlags {
    /// Which GPU backend to use; `auto` tries NVIDIA, then AMD, then fake
    /// devices if configured, and merges NVIDIA + AMD on mixed nodes.
    #[arg(long, value_enum, default_value = "auto")]
    backend: BackendChoice,
    /// Fake devices: a spec such as `4xH100-80GiB,2xMI300X-192GiB`, a YAML file
    /// (re-read while running), or a directory: its `<node name>.yaml`, else
    /// its `default.yaml` (chosen again on every read).
    #[arg(long, env = "TESSERA_FAKE_GPUS", value_name = "SPEC|FILE|DIR")]
    fake: Option<String>,
    /// NVML library to load [default: libnvidia-ml.so.1].
    #[arg(long, value_name = "PATH")]
    nvml_library: Option<PathBuf>,
    /// Where the host's sysfs is mounted (AMD discovery, AMD render nodes).
    #[arg(long, value_name = "DIR", default_value = "/sys")]
    sysfs_root: PathBuf,
    /// This node's name (from the downward API): the agent publishes on this
    /// Node, and a --fake directory gives this node its `<name>.yaml`.
    #[arg(long, env = "NODE_NAME", value_name = "NAME")]
    node_name: Option<String>,
}

impl BackendFlags {
    fn options(self) -> DetectOptions {
        DetectOptions {
            choice: self.backend,
            nvml_library: self.nvml_library.map(PathBuf::into_os_string),
            sysfs_root: self.sysfs_root,
            // An empty TESSERA_FAKE_GPUS means "no fake devices".
            fake: self.fake.filter(|s| !s.trim().is_empty()),
            node_name: self.node_name.filter(|n| !n.trim().is_empty()),
        }
    }
}

/// Health recovery and thermal limits; shared by `agent` and `discover`.
#[derive(clap::Args)]
struct HealthFlags {
    /// Seconds a device must stay fault-free before it is healthy again.
    #[arg(long, value_name = "SECONDS", default_value = "60", value_parser = clap::value_parser!(u64).range(0..=86400))]
    health_recovery: u64,
    /// Temperature at which a device counts as unhealthy (too hot).
    #[arg(long, value_name = "CELSIUS", default_value = "90", value_parser = celsius)]
    max_temperature: f64,
    /// A hot device is healthy again only below max-temperature minus this.
    #[arg(long, value_name = "CELSIUS", default_value = "5", value_parser = celsius)]
    thermal_margin: f64,
}

impl HealthFlags {
    fn policy(&self) -> HealthPolicy {
        HealthPolicy {
            recovery: std::time::Duration::from_secs(self.health_recovery),
            max_temperature_c: self.max_temperature,
            thermal_margin_c: self.thermal_margin,
        }
    }
}

/// A flag that must not be empty or blank.
fn non_empty(text: &str) -> Result<String, String> {
    if text.trim().is_empty() {
        Err("must not be empty".to_string())
    } else {
        Ok(text.to_string())
    }
}

/// `--allocation`'s values.
#[derive(Clone, Copy, clap::ValueEnum)]
enum AllocationFlag {
    Auto,
    Dra,
    DevicePlugin,
}

impl From<AllocationFlag> for tessera::AllocationMode {
    fn from(flag: AllocationFlag) -> Self {
        match flag {
            AllocationFlag::Auto => Self::Auto,
            AllocationFlag::Dra => Self::Dra,
            AllocationFlag::DevicePlugin => Self::DevicePlugin,
        }
    }
}

fn driver_name(text: &str) -> Result<String, String> {
    tessera::agent::dra::check_driver_name(text).map(|()| text.to_string())
}

fn model_cache_dir(text: &str) -> Result<ModelCacheDir, String> {
    text.parse()
}

fn resource_name(text: &str) -> Result<ResourceName, String> {
    text.parse::<ResourceName>().map_err(|e| e.why)
}

/// This machine's host name: the lease identity outside a pod.
fn host_name() -> Option<String> {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
}

fn block_on<F: std::future::Future<Output = Result<(), E>>, E: std::fmt::Display>(
    future: F,
) -> ExitCode {
    match tokio::runtime::Runtime::new() {
        Ok(rt) => match rt.block_on(future) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("error: {e}");
                ExitCode::from(1)
            }
        },
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            ExitCode::from(1)
        }
    }
}

/// A temperature flag: a finite number of degrees from 0 to 150.
fn celsius(text: &str) -> Result<f64, String> {
    match text.parse::<f64>() {
        Ok(v) if v.is_finite() && (0.0..=150.0).contains(&v) => Ok(v),
        _ => Err(format!("{text:?} is not a temperature from 0 to 150 °C")),
    }
}

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        // Help and version are not errors; every other parse problem is bad input,
        // reported like all bad input: one line, exit code 1.
        Err(e) if !e.use_stderr() => {
            let _ = e.print();
            return ExitCode::SUCCESS;
        }
        Err(e) => {
            let text = e.render().to_string();
            // An enum flag's choices are on a line of their own.
            let choices = text
                .lines()
                .find_map(|l| l.trim().strip_prefix("[possible values: "))
                .and_then(|l| l.strip_suffix(']'))
                .map(|values| format!("; expected one of: {values}"))
                .unwrap_or_default();
            match text.lines().find(|l| l.starts_with("error:")) {
                Some(line) => eprintln!("{line}{choices} (see --help)"),
                None => eprintln!(
                    "error: a subcommand is required: place, discover, agent, controller or crd (see --help)"
                ),
            }
            return ExitCode::from(1);
        }
    };
    init_logging(cli.log_format);
    match cli.command {
        Command::Crd => {
            print!("{}", tessera::api::crd_yaml());
            ExitCode::SUCCESS
        }
        Command::Agent(flags) => flags.run(),
        Command::Controller(flags) => flags.run(),
        Command::Discover(flags) => flags.run(),
        Command::Place(flags) => flags.run(),
    }
}
