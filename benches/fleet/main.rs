//! Fleet simulator: what tessera costs a large cluster's control plane and
//! how fast its controller reacts there, against a real API server.
//!
//! ```sh
//! TESSERA_TEST_KUBECONFIG=<kubeconfig> cargo bench --bench fleet -- --nodes 1000,5000
//! ```
//!
//! Per size N it creates N Nodes (Ready, eight simulated GPUs each, node
//! Leases renewed as kubelets do), runs N copies of the agent's real
//! publisher fed by the agent's own poll step over simulated GPUs whose
//! telemetry drifts, starts this build's `tessera controller` as a process,
//! loads the fleet with instances, and then measures:
//! - **steady state** (only telemetry drifting, `--steady-seconds`): Node
//!   writes per second (the publishers' and every writer's, from the API
//!   server's metrics) and the bytes every Node watcher receives for them,
//!   Lease renewals for comparison, API server CPU seconds per minute, the
//!   etcd database size, the controller's memory and its CPU and reconciles
//!   per Node write; over the whole run, every node's Node patches by why
//!   the agent sent them (first, change, drift, retry) and the shortest time
//!   from a node's patch to its next drift patch;
//! - **churn**: time from a ModelInstance created to all its shards bound,
//!   from an allocation to the Node write carrying it, from a device fault to
//!   the write carrying it and to the shard re-placed.
//!
//! With `--allocation dra` every node also publishes its devices as a
//! ResourceSlice through the agent's real slice publisher, the controller
//! allocates each shard's ResourceClaim, and the stand-in kubelet takes a
//! pod's devices from its claim (needs an API server serving
//! `resource.k8s.io/v1`); the reports add slice writes and claim checks.
//!
//! `--agent-transport http2` has each simulated agent multiplex over one
//! HTTP/2 connection (see `transport`), for fleets too large for one
//! process's sockets.
//!
//! Everything it creates carries a run label and is deleted at the end.
//! Without `TESSERA_TEST_KUBECONFIG` it prints why it is skipped and exits 0.

#[path = "../../tests/common/real_cluster.rs"]
mod real_cluster;
#[allow(dead_code)]
#[path = "../support/mod.rs"]
mod support;

mod agents;
mod compare;
mod gpus;
mod instance_watch;
mod kubelet;
mod measure;
mod nodes;
mod options;
mod restart;
mod transport;
mod user_pods;
mod workload;

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use futures::{StreamExt, stream};
use k8s_openapi::api::core::v1::{Namespace, Node, Pod};
use kube::Client;
use kube::api::{Api, DeleteParams, ListParams, PostParams};
use serde_json::json;
use tessera::agent::publisher::PublisherConfig;
use tessera::api::ModelInstance;
use tokio::sync::watch;
use tokio::time::Instant;

use agents::Fleet;
use kubelet::Bindings;
use options::Options;
use support::SplitMix64;
use workload::ControllerProcess;

const SEED: u64 = 0xf1ee_7000_0000_0014;

fn main() {
    if std::env::args().any(|arg| arg == "--help" || arg == "-h") {
        println!("{}", options::USAGE);
        return;
    }
    let options = match Options::from_args(std::env::args().skip(1)) {
        Ok(options) => options,
        Err(e) => {
            eprintln!("error: {e}\n{}", options::USAGE);
            std::process::exit(2);
        }
    };
    // The simulated agents' own logs, for `RUST_LOG=warn` and the like.
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_writer(std::io::stderr)
        .init();
    let Some(kubeconfig) = real_cluster::kubeconfig_path() else {
        return;
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("a tokio runtime");
    runtime.block_on(async {
        let config = real_cluster::load_config(&kubeconfig).await;
        let client = Client::try_from(config.clone()).expect("a Kubernetes client");
        real_cluster::install_crd(&client).await;
        for &count in &options.nodes {
            let agents = transport::agent_clients(
                &config,
                &client,
                count,
                options.agent_http2,
                options.nodes_per_connection,
            )
            .expect("the agents' HTTP/2 clients");
            run(&client, &agents, &kubeconfig, count, &options).await;
        }
    });
}

/// A short token naming this run's objects.
fn run_token() -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    format!("{:06x}", (nanos ^ std::process::id()) & 0xff_ffff)
}

/// `agents`: the clients the simulated agents write and watch through.
async fn run(
    client: &Client,
    agents: &[Client],
    kubeconfig: &Path,
    count: usize,
    options: &Options,
) {
    let run = run_token();
    let scenario = format!(
        "fleet/{count}_nodes{}",
        if options.dra { "_dra" } else { "" }
    );
    let namespace = format!("fleet-{run}");
    let namespaces: Api<Namespace> = Api::all(client.clone());
    let ns: Namespace = serde_json::from_value(json!({"metadata": {"name": namespace}}))
        .expect("a valid Namespace");
    namespaces
        .create(&PostParams::default(), &ns)
        .await
        .unwrap_or_else(|e| panic!("creating namespace {namespace}: {e}"));

    let started = Instant::now();
    let names = nodes::create(client, &run, count).await;
    let fleet = Arc::new(Fleet::new(&names, SEED));
    eprintln!(
        "{scenario}: {count} Nodes and Leases created in {:.0} s ({})",
        started.elapsed().as_secs_f64(),
        fleet
            .kinds()
            .iter()
            .map(|(kind, n)| format!("{n} {kind}"))
            .collect::<Vec<_>>()
            .join(", ")
    );
    let (stop, stopped) = watch::channel(false);
    fleet.start_publishers(agents, options.publish_interval, &stopped);
    if options.dra {
        fleet.start_slice_publishers(agents, tessera::agent::dra::DEFAULT_DRIVER_NAME, &stopped);
    }
    let poller = tokio::spawn(Arc::clone(&fleet).poll_forever(options.poll));
    // Kubelets renew their Leases over their own connections, as agents write.
    let leases = tokio::spawn(nodes::renew_leases(agents.to_vec(), names.clone()));
    let statuses = tokio::spawn(nodes::keep_ready(client.clone(), run.clone()));
    let started = Instant::now();
    while fleet.published().0 < count as u64 && started.elapsed() < Duration::from_secs(600) {
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    eprintln!(
        "{scenario}: every node published its state in {:.0} s ({} writes, {} failed)",
        started.elapsed().as_secs_f64(),
        fleet.published().0,
        fleet.published().1
    );

    if options.dra {
        let started = Instant::now();
        while fleet.slices_published().2 < count && started.elapsed() < Duration::from_secs(600) {
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        let (writes, errors, pools) = fleet.slices_published();
        eprintln!(
            "{scenario}: {pools} of {count} nodes published their ResourceSlices in {:.0} s ({writes} writes, {errors} failed)",
            started.elapsed().as_secs_f64(),
        );
    }

    match nodes::wait_untainted(client, &run, Duration::from_secs(600)).await {
        Some(took) => eprintln!(
            "{scenario}: the node lifecycle controller lifted the new Nodes' not-ready taints in {:.0} s",
            took.as_secs_f64()
        ),
        None => eprintln!("{scenario}: some Nodes are still tainted not-ready after 600 s"),
    }

    let bindings = Arc::new(Bindings::default());
    let kubelets = tokio::spawn(kubelet::run(
        client.clone(),
        namespace.clone(),
        Arc::clone(&fleet),
        Arc::clone(&bindings),
        options.dra,
        !options.compare.is_empty(),
    ));
    if !options.compare.is_empty() {
        let bench = compare::Bench {
            client,
            kubeconfig,
            namespace: &namespace,
            run: &run,
            driver: tessera::agent::dra::DEFAULT_DRIVER_NAME,
            fleet: &fleet,
            bindings: &bindings,
            initial_list: &options.initial_list,
            events: options.events,
            seed: options.seed,
            nodes: count,
        };
        for &placer in &options.compare {
            compare::run(&bench, placer).await;
        }
    } else {
        churn(
            client, kubeconfig, count, options, &scenario, &run, &namespace, &names, &fleet,
            &bindings,
        )
        .await;
    }
    let _ = stop.send(true);
    for task in [poller, leases, statuses, kubelets] {
        task.abort();
    }
    let _ = namespaces
        .delete(&namespace, &DeleteParams::default())
        .await;
    nodes::delete(client, &names).await;
}

/// The steady state, the churn and the API server restarts, measured with
/// this build's controller placing instances.
#[allow(clippy::too_many_arguments)]
async fn churn(
    client: &Client,
    kubeconfig: &Path,
    count: usize,
    options: &Options,
    scenario: &str,
    run: &str,
    namespace: &str,
    names: &[String],
    fleet: &Arc<Fleet>,
    bindings: &Arc<Bindings>,
) {
    let scenario = scenario.to_string();
    let log = std::env::temp_dir().join(format!("tessera-fleet-{run}-controller.log"));
    let api_before = measure::api_server(client).await;
    let peak = ApiServerPeak::watch(client.clone());
    let started = Instant::now();
    let mut controller = ControllerProcess::start(
        kubeconfig,
        namespace,
        &options.initial_list,
        options.dra,
        // The churn's stand-in kubelets do not mark pods Ready, which a move
        // waits for; the comparison measures moves.
        &["--moves", "false"],
        log,
    );
    assert!(
        controller.ready(Duration::from_secs(300)).await,
        "the controller did not become ready; its log: {}",
        controller.log.display()
    );
    let ready_after = started.elapsed();
    let api_peak = peak.stop().await;
    let start_controller = measure::controller(controller.pid(), controller.port);
    println!(
        "REPORT {scenario} controller start (--initial-list {}): caches synced {:.2} s after the start; controller RSS {:.0} MiB (peak {:.0}); API server RSS {:.0} MiB before, peak {:.0} MiB while the controller listed",
        options.initial_list,
        ready_after.as_secs_f64(),
        start_controller.rss_bytes as f64 / (1 << 20) as f64,
        start_controller.peak_rss_bytes as f64 / (1 << 20) as f64,
        api_before.rss_bytes / (1 << 20) as f64,
        api_peak / (1 << 20) as f64,
    );
    let instances: Api<ModelInstance> = Api::namespaced(client.clone(), namespace);
    let mut rng = SplitMix64::new(SEED ^ count as u64);
    let weights = workload::class_weights();

    // Load: one instance per 20 nodes, placed a few at a time.
    let load = (count / 20).max(1);
    let started = Instant::now();
    let mis: Vec<ModelInstance> = (0..load)
        .map(|serial| workload::instance("load", serial, rng.weighted(&weights), namespace, run))
        .collect();
    let placed: Vec<Option<Duration>> = stream::iter(&mis)
        .map(|mi| workload::create_and_wait(&instances, mi, bindings, Duration::from_secs(120)))
        .buffer_unordered(4)
        .collect()
        .await;
    eprintln!(
        "{scenario}: {} of {load} load instances bound in {:.0} s",
        placed.iter().flatten().count(),
        started.elapsed().as_secs_f64()
    );
    bindings.take_allocation_writes();

    // Steady state: only telemetry drifts.
    let interval = options
        .publish_interval
        .unwrap_or(PublisherConfig::new("default").min_interval);
    let before = Sample::take(client, fleet, &controller).await;
    tokio::time::sleep(options.steady_for(interval)).await;
    let after = Sample::take(client, fleet, &controller).await;
    let node_bytes = node_size(client, &names[0]).await;
    print_steady(
        &scenario,
        count,
        &before,
        &after,
        node_bytes,
        interval,
        options.poll,
    );

    // Churn: instances arrive (one at a time, so each is timed alone) and
    // older ones leave; devices fail.
    let mut create_to_bound = Vec::new();
    for serial in 0..options.arrivals {
        let mi = workload::instance("arrival", serial, rng.weighted(&weights), namespace, run);
        if let Some(took) =
            workload::create_and_wait(&instances, &mi, bindings, Duration::from_secs(60)).await
        {
            create_to_bound.push(took);
        }
        if let Some(old) = mis.get(serial) {
            workload::delete(&instances, &old.metadata.name.clone().unwrap_or_default()).await;
        }
    }
    let allocation_writes = bindings.take_allocation_writes();
    let (mut fault_writes, mut replaced) = (Vec::new(), Vec::new());
    for _ in 0..options.faults {
        let Some(victim) = bindings.pick(rng.next_u64()) else {
            break;
        };
        let Some(device) = victim.devices.first().cloned() else {
            continue;
        };
        let Some(wait) = fleet.fault(
            &victim.node,
            &device,
            Some("Xid 79: GPU has fallen off the bus".into()),
        ) else {
            continue;
        };
        let started = Instant::now();
        if let Some(took) = fleet.published_after(&wait, Duration::from_secs(30)).await {
            fault_writes.push(took);
        }
        if let Some(took) = workload::all_bound(
            &instances,
            &victim.instance,
            bindings,
            started,
            Duration::from_secs(90),
            std::slice::from_ref(&device),
        )
        .await
        {
            replaced.push(took);
        }
        fleet.fault(&victim.node, &device, None);
    }
    let controller_end = measure::controller(controller.pid(), controller.port);
    let (unallocated, off_plan) = bindings.claim_faults();
    println!(
        "REPORT {scenario} churn: create to all shards bound {} ({} of {}); allocation to its Node write {}; device fault to its Node write {}; fault to shard re-placed {} ({} of {}); controller peak RSS {:.0} MiB; ResourceSlice writes over the run {}; pods bound with their claim unallocated {unallocated}, claims off their plan {off_plan}",
        summary(&create_to_bound),
        create_to_bound.len(),
        options.arrivals,
        summary(&allocation_writes),
        summary(&fault_writes),
        summary(&replaced),
        replaced.len(),
        options.faults,
        controller_end.peak_rss_bytes as f64 / (1 << 20) as f64,
        fleet.slices_published().0,
    );

    // Timed where the patches are sent: a Node watcher in this loaded process
    // reads events late, and after a re-list cannot tell when a write came.
    let ([first, change, drift, retry], shortest, early) = fleet.sent(interval);
    println!(
        "REPORT {scenario} Node patches as the agents sent them until the churn ended: first {first}, change {change}, drift {drift}, retry {retry}; shortest time from a node's patch to its next drift patch {}; nodes that sent drift sooner than the {} s interval: {early}",
        shortest.map_or("none".to_string(), |gap| format!(
            "{:.1} s",
            gap.as_secs_f64()
        )),
        interval.as_secs(),
    );

    if let Some(pidfile) = &options.restart_api_server {
        for _ in 0..options.restarts {
            restart_api_server(
                client,
                run,
                fleet,
                bindings,
                &instances,
                &mut controller,
                pidfile,
                &scenario,
                &mut rng,
            )
            .await;
        }
    }

    // Clean up: instances first (the controller deletes their pods and the
    // simulated kubelets finish them), then everything else of the run.
    for mi in instances
        .list(&ListParams::default())
        .await
        .map(|l| l.items)
        .unwrap_or_default()
    {
        workload::delete(&instances, &mi.metadata.name.unwrap_or_default()).await;
    }
    let pods: Api<Pod> = Api::namespaced(client.clone(), namespace);
    let started = Instant::now();
    while started.elapsed() < Duration::from_secs(60)
        && pods
            .list(&ListParams::default())
            .await
            .is_ok_and(|l| !l.items.is_empty())
    {
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    drop(controller);
}

/// The API server goes away for a while and comes back; meanwhile a device
/// of a bound shard fails. Measures the recovery and checks that nothing
/// was lost (every Node's annotation says what its agent knows, the failed
/// shard is re-placed) and nothing duplicated (no device held by two pods,
/// no instance with more pods than planned shards).
#[allow(clippy::too_many_arguments)]
async fn restart_api_server(
    client: &Client,
    run: &str,
    fleet: &Fleet,
    bindings: &Bindings,
    instances: &Api<ModelInstance>,
    controller: &mut ControllerProcess,
    pidfile: &Path,
    scenario: &str,
    rng: &mut SplitMix64,
) {
    const DOWN: Duration = Duration::from_secs(10);
    let Some(victim) = bindings.pick(rng.next_u64()) else {
        eprintln!("{scenario}: no bound shard to fail during the restart");
        return;
    };
    let Some(device) = victim.devices.first().cloned() else {
        return;
    };
    let failures_before = fleet.published().1;
    let pidfile = pidfile.to_path_buf();
    let outage = Instant::now();
    let stopped = match tokio::task::spawn_blocking(move || restart::stop(&pidfile)).await {
        Ok(Ok(stopped)) => stopped,
        Ok(Err(e)) => panic!("stopping the API server: {e}"),
        Err(e) => panic!("stopping the API server: {e}"),
    };
    fleet.fault(
        &victim.node,
        &device,
        Some("Xid 48: double bit ECC error".into()),
    );
    tokio::time::sleep(DOWN).await;
    if let Err(e) = stopped.start() {
        panic!("starting the API server again: {e}");
    }
    let mut back = None;
    while outage.elapsed() < Duration::from_secs(180) {
        let ready = http::Request::get("/readyz").body(Vec::new()).ok();
        if let Some(request) = ready
            && client
                .request_text(request)
                .await
                .is_ok_and(|text| text.trim() == "ok")
        {
            back = Some(outage.elapsed());
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let replaced = workload::all_bound(
        instances,
        &victim.instance,
        bindings,
        outage,
        Duration::from_secs(300),
        std::slice::from_ref(&device),
    );
    let (replaced, (converged, stale)) =
        tokio::join!(replaced, converged(client, run, fleet, outage));
    let failed_writes = fleet.published().1 - failures_before;
    let mut held = std::collections::HashMap::new();
    let mut shared = 0;
    for bound in bindings.all() {
        for device in bound.devices {
            if held.insert(device, bound.pod.clone()).is_some() {
                shared += 1;
            }
        }
    }
    let mut extra_pods = 0;
    for mi in instances
        .list(&ListParams::default())
        .await
        .map(|l| l.items)
        .unwrap_or_default()
    {
        let name = mi.metadata.name.clone().unwrap_or_default();
        let planned = mi.status.map_or(0, |status| status.plan.len());
        extra_pods += bindings.of_instance(&name).len().saturating_sub(planned);
    }
    let seconds = |at: Option<Duration>| {
        at.map_or("never".to_string(), |d| format!("{:.1} s", d.as_secs_f64()))
    };
    println!(
        "REPORT {scenario} API server restart (killed, started again {} s later, a device failed meanwhile): API server ready {} after the kill; failed shard re-placed after {}; every Node's annotation as its agent knows it after {} ({stale} not); failed publisher writes {failed_writes} ({:.1} per node); devices held by two pods {shared}; pods beyond the planned shards {extra_pods}; controller {}",
        DOWN.as_secs(),
        seconds(back),
        seconds(replaced),
        seconds(converged),
        failed_writes as f64 / fleet.len().max(1) as f64,
        if controller.running() {
            "still running"
        } else {
            "EXITED"
        },
    );
}

/// How long after `since` every Node's annotation said what its agent knows,
/// and how many did not when the wait ended.
async fn converged(
    client: &Client,
    run: &str,
    fleet: &Fleet,
    since: Instant,
) -> (Option<Duration>, usize) {
    let nodes: Api<Node> = Api::all(client.clone());
    let selector = ListParams::default().labels(&format!("{}={run}", nodes::RUN_LABEL));
    let mut stale = usize::MAX;
    while since.elapsed() < Duration::from_secs(300) {
        if let Ok(list) = nodes.list(&selector).await {
            stale = list
                .items
                .iter()
                .filter(|node| {
                    let name = node.metadata.name.clone().unwrap_or_default();
                    let state = tessera::api::NodeGpuState::annotation_of(&node.metadata)
                        .and_then(|text| tessera::api::NodeGpuState::from_json(text).ok());
                    !state.is_some_and(|state| fleet.published_matches(&name, &state))
                })
                .count();
            if stale == 0 {
                return (Some(since.elapsed()), 0);
            }
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    (None, stale)
}

/// The figures taken at the start and end of the steady-state window.
struct Sample {
    at: Instant,
    api: measure::ApiServer,
    controller: measure::Controller,
    published: u64,
    slice_writes: u64,
}

impl Sample {
    async fn take(client: &Client, fleet: &Fleet, controller: &ControllerProcess) -> Self {
        Self {
            at: Instant::now(),
            api: measure::api_server(client).await,
            controller: measure::controller(controller.pid(), controller.port),
            published: fleet.published().0,
            slice_writes: fleet.slices_published().0,
        }
    }
}

fn print_steady(
    scenario: &str,
    count: usize,
    before: &Sample,
    after: &Sample,
    node_bytes: usize,
    interval: Duration,
    poll: Duration,
) {
    let seconds = after.at.duration_since(before.at).as_secs_f64().max(1e-9);
    let published = (after.published - before.published) as f64;
    let node_writes = after.api.node_writes - before.api.node_writes;
    let per_node_per_5_min = published / count as f64 * 300.0 / seconds;
    let controller_cpu = after.controller.cpu_seconds - before.controller.cpu_seconds;
    let reconciles = after.controller.reconciles - before.controller.reconciles;
    println!(
        "REPORT {scenario} steady ({seconds:.0} s, publish interval {} s, poll {} ms): tessera Node writes/s={:.2} ({per_node_per_5_min:.2} per node per 5 min) ResourceSlice writes={} all Node writes/s={:.2} bytes/s to each Node watcher={:.0} (Node {node_bytes} B) Lease renewals/s={:.2} API server CPU s/min={:.2} API server RSS MiB={:.0} etcd MiB={:.1} controller RSS MiB={:.0} controller CPU s/min={:.2} controller CPU ms per Node write={:.2} reconciles per Node write={:.3}",
        interval.as_secs(),
        poll.as_millis(),
        published / seconds,
        after.slice_writes - before.slice_writes,
        node_writes / seconds,
        published / seconds * node_bytes as f64,
        (after.api.lease_writes - before.api.lease_writes) / seconds,
        (after.api.cpu_seconds - before.api.cpu_seconds) * 60.0 / seconds,
        after.api.rss_bytes / (1 << 20) as f64,
        after.api.etcd_bytes / (1 << 20) as f64,
        after.controller.rss_bytes as f64 / (1 << 20) as f64,
        controller_cpu * 60.0 / seconds,
        controller_cpu * 1e3 / node_writes.max(1.0),
        reconciles / node_writes.max(1.0),
    );
}

/// The API server's largest resident memory, read off its /metrics every
/// 250 ms while it runs (its peak is transient: a large list is built and
/// sent, then freed).
struct ApiServerPeak {
    stop: watch::Sender<bool>,
    task: tokio::task::JoinHandle<f64>,
}

impl ApiServerPeak {
    fn watch(client: Client) -> Self {
        let (stop, mut stopped) = watch::channel(false);
        let task = tokio::spawn(async move {
            let mut peak: f64 = 0.0;
            loop {
                peak = peak.max(measure::api_server(&client).await.rss_bytes);
                tokio::select! {
                    _ = stopped.changed() => return peak,
                    () = tokio::time::sleep(Duration::from_millis(250)) => {}
                }
            }
        });
        Self { stop, task }
    }

    async fn stop(self) -> f64 {
        let _ = self.stop.send(true);
        self.task.await.unwrap_or(0.0)
    }
}

/// A Node as every watcher receives it, in bytes of JSON.
async fn node_size(client: &Client, name: &str) -> usize {
    let nodes: Api<Node> = Api::all(client.clone());
    nodes
        .get(name)
        .await
        .ok()
        .and_then(|node| serde_json::to_vec(&node).ok())
        .map_or(0, |bytes| bytes.len())
}

/// "median 1.2 s, p95 …, max …" in milliseconds.
fn summary(times: &[Duration]) -> String {
    if times.is_empty() {
        return "none measured".into();
    }
    let mut ms: Vec<f64> = times.iter().map(|t| t.as_secs_f64() * 1e3).collect();
    ms.sort_by(f64::total_cmp);
    let at = |q: f64| ms[((ms.len() - 1) as f64 * q).round() as usize];
    format!(
        "median {:.0} ms, p95 {:.0} ms, max {:.0} ms",
        at(0.5),
        at(0.95),
        at(1.0)
    )
}
