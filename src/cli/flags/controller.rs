//! `tessera controller`'s flags and the controller configuration they make.

use std::path::PathBuf;
use std::process::ExitCode;

use super::exit::block_on;
use super::values::{
    AllocationFlag, driver_name, fraction, host_name, model_cache_dir, non_empty, resource_name,
};
use crate::api::ResourceName;
use crate::controller::model_cache::ModelCacheDir;
use crate::controller::reconcile::{
    ContinuousMoves, MeasureSettings, MoveSettings, ScalingSettings, Settings,
};
use crate::controller::run::{ControllerConfig, LeaderElection, run};
use crate::kubernetes::initial_list::InitialList;

#[derive(clap::Args)]
pub struct ControllerFlags {
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
    #[arg(long, value_name = "NAME", default_value = crate::api::DEFAULT_RESOURCE_NAME, value_parser = resource_name)]
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
    #[arg(long, value_name = "HOW", value_enum, default_value_t = InitialList::Auto)]
    initial_list: InitialList,
    /// How shards get their devices: `device-plugin` (the extended resource),
    /// `dra` (a ResourceClaim the controller allocates, on nodes whose agent
    /// publishes ResourceSlices of the driver; needs resource.k8s.io/v1), or
    /// `auto`: `dra` where the API server serves resource.k8s.io/v1.
    #[arg(long, value_name = "MODE", value_enum, default_value_t = AllocationFlag::DevicePlugin)]
    allocation: AllocationFlag,
    /// The DRA driver of the node agents (the same value as theirs).
    #[arg(long, value_name = "NAME", default_value = crate::agent::dra::DEFAULT_DRIVER_NAME, value_parser = driver_name)]
    dra_driver_name: String,
    /// Host directory for model weights that outlive a pod: a shard pod whose
    /// template mounts the volume `tessera-model-cache` without defining it
    /// gets `<DIR>/<namespace>` of its node (created if missing). Unset: such
    /// templates are refused.
    #[arg(long, value_name = "DIR", value_parser = model_cache_dir)]
    model_cache_dir: Option<ModelCacheDir>,
    /// Move running replicas, make before break (the new copy Ready before
    /// the old one is evicted), when that makes room for a replica that
    /// cannot be placed. Instances with `placement.moves: Never` are never
    /// moved either way.
    #[arg(long, value_name = "BOOL", default_value = "true", action = clap::ArgAction::Set)]
    moves: bool,
    /// Moves in flight at once in the whole cluster (one per instance at most).
    #[arg(long, value_name = "N", default_value = "1", value_parser = clap::value_parser!(u64).range(1..=64))]
    max_moves_in_flight: u64,
    /// Seconds a move's new copy has to become Ready; past them the move is
    /// abandoned and the new copy removed, the old one untouched.
    #[arg(long, value_name = "SECONDS", default_value = "600", value_parser = clap::value_parser!(u64).range(10..=86400))]
    move_timeout: u64,
    /// Seconds a replica whose move was abandoned is not moved again.
    #[arg(long, value_name = "SECONDS", default_value = "600", value_parser = clap::value_parser!(u64).range(0..=86400))]
    move_backoff: u64,
    /// Also move replicas while nothing is blocked, where the cluster serves
    /// more work at the targets (devices free now, or devices a replica
    /// leaves for free ones where it still meets its target and its
    /// instance its demand): opt-in, one move at a time, at most one started
    /// per --continuous-interval. (Room for a blocked replica is made
    /// without it.)
    #[arg(long, value_name = "BOOL", default_value = "false", action = clap::ArgAction::Set)]
    continuous_moves: bool,
    /// The least gain a continuous move is made for: work served at the
    /// targets (requests/s × the work a request costs) gained, as a fraction
    /// of what the moved replicas serve now (0.2: a fifth more).
    #[arg(long, value_name = "FRACTION", default_value = "0.2", value_parser = fraction)]
    continuous_min_gain: f64,
    /// Seconds between looks for continuous moves: the cluster is judged at
    /// most once in this long (the replica a move made way for follows at the
    /// next look, without waiting).
    #[arg(long, value_name = "SECONDS", default_value = "600", value_parser = clap::value_parser!(u64).range(10..=86400))]
    continuous_interval: u64,
    /// Seconds between two reads of every serving replica's runtime metrics
    /// (its first shard's container port named `metrics`, else `http`,
    /// path /metrics; vLLM, SGLang and TensorRT-LLM names), shown in the
    /// status beside the prediction; 0: never read.
    #[arg(long, value_name = "SECONDS", default_value = "15", value_parser = clap::value_parser!(u64).range(0..=3600))]
    measure_interval: u64,
    /// Seconds of reads that rates and latency percentiles are taken over
    /// (at least twice --measure-interval).
    #[arg(long, value_name = "SECONDS", default_value = "60", value_parser = clap::value_parser!(u64).range(1..=86400))]
    measure_window: u64,
    /// Seconds one read of a replica's metrics may take.
    #[arg(long, value_name = "SECONDS", default_value = "5", value_parser = clap::value_parser!(u64).range(1..=60))]
    measure_timeout: u64,
    /// Instances with `serving.demand: Measured` plan for the measured
    /// demand plus this fraction of it (0.2: a fifth more), so a rise is
    /// served while the next replica starts.
    #[arg(long, value_name = "FRACTION", default_value = "0.2", value_parser = fraction)]
    demand_headroom: f64,
    /// Seconds every read must ask for less than is planned before replicas
    /// of a measured demand are removed (added at the first read that asks
    /// for more).
    #[arg(long, value_name = "SECONDS", default_value = "300", value_parser = clap::value_parser!(u64).range(0..=86400))]
    scale_down_window: u64,
    /// Seconds a replica removed by a measured demand, already out of its
    /// Services, may take to finish its requests before its pods go anyway.
    #[arg(long, value_name = "SECONDS", default_value = "120", value_parser = clap::value_parser!(u64).range(0..=3600))]
    drain_timeout: u64,
}

impl ControllerFlags {
    pub fn run(self) -> ExitCode {
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
            moves,
            max_moves_in_flight,
            move_timeout,
            move_backoff,
            continuous_moves,
            continuous_min_gain,
            continuous_interval,
            measure_interval,
            measure_window,
            measure_timeout,
            demand_headroom,
            scale_down_window,
            drain_timeout,
        } = self;
        if measure_interval > 0 && measure_window < 2 * measure_interval {
            eprintln!(
                "error: --measure-window ({measure_window} s) must be at least twice --measure-interval ({measure_interval} s): a rate needs two reads in the window"
            );
            return ExitCode::from(1);
        }
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
                moves: MoveSettings {
                    enabled: moves,
                    max_in_flight: max_moves_in_flight as usize,
                    timeout: std::time::Duration::from_secs(move_timeout),
                    backoff: std::time::Duration::from_secs(move_backoff),
                    continuous: continuous_moves.then(|| ContinuousMoves {
                        min_gain: continuous_min_gain,
                        interval: std::time::Duration::from_secs(continuous_interval),
                    }),
                },
                measure: (measure_interval > 0).then(|| MeasureSettings {
                    interval: std::time::Duration::from_secs(measure_interval),
                    window: std::time::Duration::from_secs(measure_window),
                    timeout: std::time::Duration::from_secs(measure_timeout),
                }),
                scaling: ScalingSettings {
                    headroom: demand_headroom,
                    scale_down_window: std::time::Duration::from_secs(scale_down_window),
                    drain_timeout: std::time::Duration::from_secs(drain_timeout),
                },
            },
            initial_list,
            allocation: allocation.into(),
        }))
    }
}
