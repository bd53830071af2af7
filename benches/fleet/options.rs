//! The simulator's flags. `cargo bench` passes `--bench` to every bench
//! binary, which is accepted and ignored.

use std::time::Duration;

pub(crate) const USAGE: &str = "flags: --nodes N[,N...] (default 1000) --steady-seconds S (default: the \
publish interval plus a tenth plus 30 s, so that every node's drift write falls inside) \
--poll-ms MS (the agent's poll interval, default 500) --publish-interval-seconds S (default: the \
agent's) --arrivals N (default 20) --faults N (default 10) --restart-api-server PIDFILE (restart \
the kube-apiserver this pid file names, on this machine, once the churn is measured) --restarts N \
(how many times, one after another; default 1) --initial-list auto|stream|list (the controller's \
--initial-list; default auto) --allocation device-plugin|dra (how shard pods get their devices: \
the agents publish ResourceSlices too and the controller allocates each shard's ResourceClaim; \
dra needs an API server serving resource.k8s.io/v1; default device-plugin) --agent-transport \
http1|http2 (http1: the agents' connections as a real agent's, kube-rs's HTTP/1.1; http2: the \
each node's agent and its Lease renewals multiplex over one HTTP/2 connection, for fleets whose HTTP/1.1 sockets would \
pass this process's open-file limit; default http1) --nodes-per-connection N (with http2: nodes sharing one connection; \
default 1) --compare PLACER[,PLACER...] (instead of the steady state and churn: replay the cluster benchmark's \
arrivals and a burst of large models under each placer in turn, tessera, tessera-no-moves (the controller with \
--moves false), tessera-continuous (with --continuous-moves true, looking every 10 s), kube-scheduler or kube-scheduler-gang, with DRA; kube-scheduler-gang needs the API server's and scheduler's gang-scheduling gates on) --events N \
(events of the replayed sequence; default 300) --seed N (the replayed sequence's seed, decimal or 0x hex; \
default the cluster benchmark's)";

/// Nodes to one HTTP/2 connection by default: one, as each kubelet has its
/// own. Shared by 20, connections stalled at 5,000 DRA nodes until the slice
/// publisher read its watch while it waited ("DRA at 1,000 and 5,000 nodes"
/// in docs/benchmarks.md); `--nodes-per-connection` shares them again.
const NODES_PER_CONNECTION: usize = 1;

/// The cluster benchmark's arrival sequence (`benches/cluster.rs`), the
/// default of `--seed`.
pub(crate) const SEQUENCE_SEED: u64 = 0xc1a5_7e55_0000_0013;

#[derive(Debug, PartialEq)]
pub(crate) struct Options {
    pub(crate) nodes: Vec<usize>,
    /// `None`: long enough for every node's drift write (see `steady_for`).
    pub(crate) steady: Option<Duration>,
    pub(crate) poll: Duration,
    pub(crate) publish_interval: Option<Duration>,
    pub(crate) arrivals: usize,
    pub(crate) faults: usize,
    pub(crate) restart_api_server: Option<std::path::PathBuf>,
    pub(crate) restarts: usize,
    /// The controller's `--initial-list`.
    pub(crate) initial_list: String,
    /// DRA: agents publish ResourceSlices, the controller allocates claims.
    pub(crate) dra: bool,
    /// The simulated agents multiplex over HTTP/2 connections.
    pub(crate) agent_http2: bool,
    /// Nodes to one HTTP/2 connection.
    pub(crate) nodes_per_connection: usize,
    /// Compare placers instead of measuring the steady state and churn.
    pub(crate) compare: Vec<Placer>,
    /// Events of the replayed sequence.
    pub(crate) events: usize,
    /// The replayed sequence's seed.
    pub(crate) seed: u64,
}

impl Options {
    pub(crate) fn from_args(args: impl IntoIterator<Item = String>) -> Result<Self, String> {
        let mut options = Self {
            nodes: vec![1000],
            steady: None,
            poll: Duration::from_millis(500),
            publish_interval: None,
            arrivals: 20,
            faults: 10,
            restart_api_server: None,
            restarts: 1,
            initial_list: "auto".into(),
            dra: false,
            agent_http2: false,
            nodes_per_connection: NODES_PER_CONNECTION,
            compare: Vec::new(),
            events: 300,
            seed: SEQUENCE_SEED,
        };
        let mut args = args.into_iter();
        while let Some(flag) = args.next() {
            if flag == "--bench" {
                continue;
            }
            let value = args.next().ok_or_else(|| format!("{flag} needs a value"))?;
            let number = |max: u64| -> Result<u64, String> {
                match value.parse::<u64>() {
                    Ok(n) if (1..=max).contains(&n) => Ok(n),
                    _ => Err(format!(
                        "{flag} {value:?}: expected a whole number from 1 to {max}"
                    )),
                }
            };
            match flag.as_str() {
                "--nodes" => {
                    options.nodes = value
                        .split(',')
                        .map(|n| match n.trim().parse::<usize>() {
                            Ok(n) if (1..=20_000).contains(&n) => Ok(n),
                            _ => Err(format!("--nodes {value:?}: expected counts from 1 to 20000, comma-separated")),
                        })
                        .collect::<Result<_, _>>()?;
                }
                "--steady-seconds" => options.steady = Some(Duration::from_secs(number(86_400)?)),
                "--poll-ms" => options.poll = Duration::from_millis(number(60_000)?),
                "--publish-interval-seconds" => {
                    options.publish_interval = Some(Duration::from_secs(number(86_400)?));
                }
                "--arrivals" => options.arrivals = number(10_000)? as usize,
                "--faults" => options.faults = number(10_000)? as usize,
                "--restarts" => options.restarts = number(100)? as usize,
                "--initial-list" => {
                    if !["auto", "stream", "list"].contains(&value.as_str()) {
                        return Err(format!(
                            "--initial-list {value:?}: expected auto, stream or list"
                        ));
                    }
                    options.initial_list = value.clone();
                }
                "--allocation" => options.dra = either(&flag, &value, "device-plugin", "dra")?,
                "--agent-transport" => {
                    options.agent_http2 = either(&flag, &value, "http1", "http2")?;
                }
                "--nodes-per-connection" => options.nodes_per_connection = number(1_000)? as usize,
                "--compare" => {
                    options.compare = value
                        .split(',')
                        .map(|name| Placer::parse(name.trim()))
                        .collect::<Result<_, _>>()?;
                }
                "--events" => options.events = number(100_000)? as usize,
                "--seed" => {
                    let parsed = match value.strip_prefix("0x") {
                        Some(hex) => u64::from_str_radix(&hex.replace('_', ""), 16),
                        None => value.parse::<u64>(),
                    };
                    options.seed = parsed.map_err(|_| {
                        format!("--seed {value:?}: expected a whole number, decimal or 0x hex")
                    })?;
                }
                "--restart-api-server" if !value.is_empty() => {
                    options.restart_api_server = Some(value.clone().into());
                }
                _ => return Err(format!("unknown flag {flag}")),
            }
        }
        // Users' claims are allocated by kube-scheduler only with DRA.
        options.dra |= !options.compare.is_empty();
        Ok(options)
    }

    /// The steady-state window for drift published every `interval` (plus
    /// each node's share of a tenth).
    pub(crate) fn steady_for(&self, interval: Duration) -> Duration {
        self.steady
            .unwrap_or_else(|| interval.mul_f64(1.1) + Duration::from_secs(30))
    }
}

/// `false` for `no`, `true` for `yes`, else an error naming the flag.
fn either(flag: &str, value: &str, no: &str, yes: &str) -> Result<bool, String> {
    match value {
        v if v == yes => Ok(true),
        v if v == no => Ok(false),
        _ => Err(format!("{flag} {value:?}: expected {no} or {yes}")),
    }
}

/// Who places the replayed arrivals in a comparison run.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum Placer {
    Tessera,
    /// tessera's controller with moves off.
    TesseraNoMoves,
    /// tessera's controller with continuous moves on.
    TesseraContinuous,
    KubeScheduler,
    /// kube-scheduler with each replica's pods in one gang (PodGroup).
    KubeSchedulerGang,
}

impl Placer {
    pub(crate) fn parse(name: &str) -> Result<Self, String> {
        match name {
            "tessera" => Ok(Placer::Tessera),
            "tessera-no-moves" => Ok(Placer::TesseraNoMoves),
            "tessera-continuous" => Ok(Placer::TesseraContinuous),
            "kube-scheduler" => Ok(Placer::KubeScheduler),
            "kube-scheduler-gang" => Ok(Placer::KubeSchedulerGang),
            _ => Err(format!(
                "--compare {name:?}: expected tessera, tessera-no-moves, tessera-continuous, kube-scheduler or kube-scheduler-gang"
            )),
        }
    }

    pub(crate) fn name(self) -> &'static str {
        match self {
            Placer::Tessera => "tessera",
            Placer::TesseraNoMoves => "tessera-no-moves",
            Placer::TesseraContinuous => "tessera-continuous",
            Placer::KubeScheduler => "kube-scheduler",
            Placer::KubeSchedulerGang => "kube-scheduler-gang",
        }
    }
}
