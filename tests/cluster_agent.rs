//! The node agent against a real API server (no kubelet needed).
//!
//! Runs only when `TESSERA_TEST_KUBECONFIG` names a kubeconfig; otherwise each
//! test says it was skipped and passes. The kubeconfig's user must be allowed
//! to create, get, patch and delete Nodes, and (for the agent binary's pod
//! watch; without it the agent only logs warnings) to list and watch Pods.
//!
//! Each test creates its own uniquely named Node (`tessera-test-<pid>-<random>`,
//! labelled `tessera.dev/test=true`, unschedulable and tainted so nothing lands
//! on it), publishes fake GPUs onto it, and deletes it again — also when an
//! assertion fails (a guard does it, with the Node's UID as a precondition, so
//! it can never delete a Node it did not create). A Node left behind by a
//! killed run can be found with `kubectl get nodes -l tessera.dev/test=true`.
//!
//! - `the_agent_publishes_gpu_state_onto_its_node` drives the publisher through
//!   the library;
//! - `the_agent_publishes_and_restores_its_resource_slices` (API servers that
//!   serve `resource.k8s.io/v1`; others print why it is skipped) runs the DRA
//!   driver's slice publisher over a slice an earlier driver left: the pool
//!   is written under the next generation and the left-over slice deleted;
//!   a slice deleted by someone else (as kubelet does when it starts) is
//!   written again at once. The kubeconfig's user also needs list, watch,
//!   create, patch and delete on resourceslices.
//! - `an_agent_on_auto_that_kubelet_does_not_register_deletes_its_nodes_slices`
//!   (API servers that serve `resource.k8s.io/v1`) runs the built agent with
//!   `--allocation auto` over the node's slice of an earlier DRA run: with no
//!   kubelet to register the driver it falls back to the device plugin and
//!   deletes the slice, so the node never offers its GPUs both ways.
//! - `the_agent_binary_publishes_and_stops_on_sigterm` runs the built `tessera
//!   agent` with `--node-name` and `--kubeconfig` (no kubelet: it serves its
//!   socket and keeps trying to register), injects a fault through its fake GPU
//!   file, and stops it with SIGTERM. The process is killed if the test fails
//!   (a guard), and its log is shown in the failure message.
//!
//! Run against a cluster without a cloud provider (kind, k3d, a bare API
//! server): a cloud node lifecycle controller deletes Nodes that have no
//! machine behind them, which this test reports when it happens.

#[path = "common/real_cluster.rs"]
mod real_cluster;

use std::hash::{BuildHasher, Hasher};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use k8s_openapi::api::core::v1::Node;
use k8s_openapi::api::resource::v1::ResourceSlice;
use kube::api::{Api, DeleteParams, PostParams, Preconditions};
use kube::{Client, Config};
use real_cluster::{kubeconfig_path, load_config};
use serde_json::json;
use tessera::agent::dra::slice_publisher::{SliceStats, run_slice_publisher};
use tessera::agent::publisher::{PublisherConfig, PublisherStats, run_publisher};
use tessera::agent::state::{ViewTx, channel, spawn_poller};
use tessera::api::{
    GPU_STATE_ANNOTATION, Health, LABEL_GPU_COUNT, LABEL_GPU_MEMORY_GIB, LABEL_GPU_PRODUCT,
    LABEL_GPU_VENDOR, NodeGpuState,
};
use tessera::backend::fake::FakeBackend;
use tessera::backend::health::{HealthPolicy, HealthTracker};
use tokio::time::{Instant, sleep, timeout};

const TEST_LABEL: &str = "tessera.dev/test";
/// Proves a Node is the one this run created (the name alone is only very likely unique).
const RUN_ANNOTATION: &str = "tessera.dev/test-run";
const FOREIGN_ANNOTATION: &str = "example.com/owned-by-someone-else";
/// Deliberately not JSON: a foreign value must survive untouched, whatever it is.
const FOREIGN_VALUE: &str = "{not json, and not ours";
const FOREIGN_LABEL: &str = "example.com/rack";
/// How long the published state may take to show up on the Node.
const ARRIVAL: Duration = Duration::from_secs(30);
/// Bound on every single API call.
const CALL: Duration = Duration::from_secs(20);
/// How long the agent binary may take to serve its plugin socket.
const SOCKET: Duration = Duration::from_secs(45);
/// How long the agent binary may take to exit after SIGTERM.
const STOP: Duration = Duration::from_secs(20);

const TWO_H100: &str = "gpus:\n  - {profile: H100-80GiB, count: 2}\n";
const TWO_H100_ONE_FAULTY: &str = "gpus:\n  - {profile: H100-80GiB, count: 2}\nfaults:\n  - {device: 1, unhealthy: \"Xid 79: GPU has fallen off the bus\"}\n";

#[tokio::test]
async fn the_agent_publishes_gpu_state_onto_its_node() {
    let Some((_, config, client)) = cluster().await else {
        return;
    };
    let nodes: Api<Node> = Api::all(client.clone());

    // Locals drop in reverse order: the publisher and the poller stop before
    // the Node is deleted, and the fake GPU file goes last.
    let run = RunId::new();
    let scratch = TempDir::new(&run, "lib");
    let fake_file = scratch.write("gpus.yaml", TWO_H100);
    let node = create_node(&nodes, &config, &run).await;
    println!("created Node {} (uid {})", node.name, node.uid);

    let (tx, rx) = channel("fake");
    let poller = Poller::start(&fake_file, tx);
    let stats = Arc::new(PublisherStats::default());
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let publisher = AbortOnDrop(tokio::spawn(run_publisher(
        client.clone(),
        PublisherConfig::new(node.name.clone()),
        rx,
        stats.clone(),
        stopped,
    )));

    // 1. The state arrives and reads back; our malformed and stale values are
    //    replaced, everything foreign is left alone.
    let progress = || Ok(publisher_progress(&stats));
    let (state, found) = wait_for(&nodes, &node, "two healthy H100s", progress, |s, n| {
        s.devices.len() == 2 && label(n, LABEL_GPU_COUNT) == Some("2")
    })
    .await;
    check_first_state(&state, &found, &run);
    assert_eq!(stats.errors(), 0, "patches failed before the state arrived");

    // 2. A device fault reaches the Node without waiting for the drift interval.
    scratch.write("gpus.yaml", TWO_H100_ONE_FAULTY);
    let (state, found) = wait_for(&nodes, &node, "device 1 unhealthy", progress, |s, _| {
        s.devices.len() == 2 && s.devices[1].health == Health::Unhealthy
    })
    .await;
    check_fault(&state, &found);

    // Orderly stop, then the Node goes (the guard would do it on failure too).
    let _ = stop.send(());
    let ended = timeout(CALL, publisher.join())
        .await
        .expect("the publisher did not stop within the bound");
    assert!(
        matches!(ended, Some(Ok(()))),
        "publisher ended with {ended:?}"
    );
    drop(poller);
    node.delete_now(&nodes).await;
    println!(
        "published {} time(s), {} failed patch(es); Node deleted",
        stats.published(),
        stats.errors()
    );
}

/// The kubeconfig to test against, its config and a client; `None` (the
/// reason printed) skips the test.
async fn cluster() -> Option<(PathBuf, Config, Client)> {
    let path = kubeconfig_path()?;
    let config = load_config(&path).await;
    let client = Client::try_from(config.clone())
        .unwrap_or_else(|e| panic!("building a client from {}: {e}", path.display()));
    Some((path, config, client))
}

/// A driver name no real agent on the test cluster uses.
const TEST_DRIVER: &str = "gpu.test.tessera.dev";

#[tokio::test]
async fn the_agent_publishes_and_restores_its_resource_slices() {
    let Some((_, config, client)) = cluster().await else {
        return;
    };
    if !serves_slices(&client).await {
        return;
    }
    let nodes: Api<Node> = Api::all(client.clone());
    let slices: Api<ResourceSlice> = Api::all(client.clone());
    let run = RunId::new();
    let scratch = TempDir::new(&run, "slices");
    let fake_file = scratch.write("gpus.yaml", TWO_H100);
    let node = create_node(&nodes, &config, &run).await;
    let pool = || {
        let slices = slices.clone();
        let selector = format!("spec.nodeName={},spec.driver={TEST_DRIVER}", node.name);
        async move {
            let list = timeout(
                CALL,
                slices.list(&kube::api::ListParams::default().fields(&selector)),
            )
            .await
            .expect("listing slices answered within the bound")
            .expect("listing slices");
            list.items
                .into_iter()
                .map(|s| {
                    let devices = s.spec.devices.as_ref().map_or(0, Vec::len);
                    (
                        s.metadata.name.unwrap_or_default(),
                        s.spec.pool.generation,
                        devices,
                    )
                })
                .collect::<Vec<_>>()
        }
    };

    // An earlier driver's slice of this pool, at generation 3.
    let left_over = format!("{}-left-over", node.name);
    let slice: ResourceSlice = serde_json::from_value(json!({
        "metadata": {"name": left_over, "labels": {TEST_LABEL: "true"}},
        "spec": {
            "driver": TEST_DRIVER,
            "nodeName": node.name,
            "pool": {"name": node.name, "generation": 3, "resourceSliceCount": 1},
            "devices": [{"name": "gone"}],
        },
    }))
    .expect("a valid ResourceSlice");
    let created = timeout(CALL, slices.create(&PostParams::default(), &slice))
        .await
        .expect("creating the left-over slice answered within the bound")
        .expect("creating the left-over slice");
    // The agent finds left-over slices in the API server's watch cache, where
    // one from an earlier driver has long been: let this one get there too.
    let cached = kube::api::ListParams::default()
        .fields(&format!("metadata.name={left_over}"))
        .match_any()
        .at(&created.metadata.resource_version.unwrap_or_default());
    timeout(CALL, slices.list(&cached))
        .await
        .expect("reading the cache answered within the bound")
        .expect("reading the cache at the left-over slice's version");

    let (tx, rx) = channel("fake");
    let poller = Poller::start(&fake_file, tx.clone());
    let stats = Arc::new(SliceStats::default());
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let publisher = AbortOnDrop(tokio::spawn(run_slice_publisher(
        client.clone(),
        TEST_DRIVER.to_string(),
        node.name.clone(),
        (rx, tx),
        false,
        stats.clone(),
        async move {
            let _ = stopped.await;
        },
    )));

    // 1. The pool, one generation past the left-over slice, which is gone.
    let started = Instant::now();
    let written = loop {
        let now = pool().await;
        if now.len() == 1 && now[0].1 == 4 && now[0].2 == 2 {
            break now;
        }
        assert!(
            started.elapsed() < ARRIVAL,
            "the pool was not written as generation 4 with 2 devices, the left-over slice deleted: {now:?} (errors {})",
            stats.errors()
        );
        sleep(Duration::from_millis(200)).await;
    };

    // 2. Deleted by someone else: written again at once, under the next generation.
    timeout(CALL, slices.delete(&written[0].0, &DeleteParams::default()))
        .await
        .expect("deleting the slice answered within the bound")
        .expect("deleting the slice");
    let started = Instant::now();
    loop {
        let now = pool().await;
        if now.len() == 1 && now[0].1 == 5 && now[0].2 == 2 {
            break;
        }
        assert!(
            started.elapsed() < ARRIVAL,
            "the deleted pool was not written again as generation 5: {now:?} (restores {})",
            stats.restores()
        );
        sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(stats.restores(), 1, "one deletion, one restore");

    let _ = stop.send(());
    timeout(CALL, publisher.join())
        .await
        .expect("the slice publisher did not stop within the bound");
    drop(poller);
    // Slices stay when the agent stops; the Node owns them, but a bare API
    // server has no garbage collector, so they go by hand.
    for (name, _, _) in pool().await {
        let _ = timeout(CALL, slices.delete(&name, &DeleteParams::default())).await;
    }
    node.delete_now(&nodes).await;
}

/// One H100 in MIG mode (a 3g.40gb and a 2g.20gb partition) and one whole.
const SPLIT_AND_WHOLE_H100: &str = "gpus:\n  - {profile: H100-80GiB, mig: {partitions: [3g.40gb, 2g.20gb]}}\n  - {profile: H100-80GiB}\n";

#[tokio::test]
async fn the_api_server_keeps_partitions_counters_and_memory_shares_as_published() {
    let Some((_, config, client)) = cluster().await else {
        return;
    };
    if !serves_slices(&client).await {
        return;
    }
    let nodes: Api<Node> = Api::all(client.clone());
    let slices: Api<ResourceSlice> = Api::all(client.clone());
    let run = RunId::new();
    let scratch = TempDir::new(&run, "shares");
    let fake_file = scratch.write("gpus.yaml", SPLIT_AND_WHOLE_H100);
    let node = create_node(&nodes, &config, &run).await;
    let (tx, rx) = channel("fake");
    let poller = Poller::start(&fake_file, tx.clone());
    let stats = Arc::new(SliceStats::default());
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let publisher = AbortOnDrop(tokio::spawn(run_slice_publisher(
        client.clone(),
        TEST_DRIVER.to_string(),
        node.name.clone(),
        (rx.clone(), tx),
        true,
        stats.clone(),
        async move {
            let _ = stopped.await;
        },
    )));
    let selector = format!("spec.nodeName={},spec.driver={TEST_DRIVER}", node.name);
    let started = Instant::now();
    let written = loop {
        let list = timeout(
            CALL,
            slices.list(&kube::api::ListParams::default().fields(&selector)),
        )
        .await
        .expect("listing slices answered within the bound")
        .expect("listing slices");
        if list.items.len() == 2 {
            break list.items;
        }
        assert!(
            started.elapsed() < ARRIVAL,
            "the pool was not written as a device slice and a counter slice: {:?} (errors {})",
            list.items
                .iter()
                .map(|s| &s.metadata.name)
                .collect::<Vec<_>>(),
            stats.errors()
        );
        sleep(Duration::from_millis(200)).await;
    };
    let devices: Vec<_> = written
        .iter()
        .flat_map(|s| s.spec.devices.iter().flatten())
        .collect();
    let counter_sets: Vec<_> = written
        .iter()
        .flat_map(|s| s.spec.shared_counters.iter().flatten())
        .collect();
    assert_eq!(devices.len(), 3, "the whole GPU and two partitions");
    assert_eq!(counter_sets.len(), 1, "the split GPU's counter set");
    assert_eq!(
        counter_sets[0].counters.len(),
        9,
        "8 memory slices and the SMs"
    );
    let whole: Vec<_> = devices
        .iter()
        .filter(|d| d.consumes_counters.is_none())
        .collect();
    assert_eq!(whole.len(), 1);
    assert_eq!(
        whole[0].allow_multiple_allocations,
        Some(true),
        "kept: DRAConsumableCapacity is on"
    );
    let policy = whole[0].capacity.as_ref().expect("capacity")["memory"]
        .request_policy
        .as_ref()
        .expect("the memory's request policy kept");
    assert!(policy.valid_range.is_some());
    for partition in devices.iter().filter(|d| d.consumes_counters.is_some()) {
        let consumed = &partition.consumes_counters.as_ref().expect("consumption")[0];
        assert_eq!(consumed.counter_set, counter_sets[0].name);
    }
    // The node's GPU state says what the pool hands out.
    let started = Instant::now();
    loop {
        let shares = rx.borrow().shares;
        if shares.partitions && shares.memory {
            break;
        }
        assert!(
            started.elapsed() < ARRIVAL,
            "the view never offered partitions and memory shares: {shares:?}"
        );
        sleep(Duration::from_millis(100)).await;
    }
    let _ = stop.send(());
    timeout(CALL, publisher.join())
        .await
        .expect("the slice publisher did not stop within the bound");
    drop(poller);
    for slice in written {
        let name = slice.metadata.name.unwrap_or_default();
        let _ = timeout(CALL, slices.delete(&name, &DeleteParams::default())).await;
    }
    node.delete_now(&nodes).await;
}

/// Whether the API server serves DRA as the agent decides it; says the test
/// is skipped when not.
async fn serves_slices(client: &Client) -> bool {
    let served = tessera::kubernetes::allocation_mode::serves_dra(client)
        .await
        .unwrap_or(false);
    if !served {
        println!(
            "skipped: the API server does not serve resource.k8s.io/v1 resourceslices and resourceclaims"
        );
    }
    served
}

#[tokio::test]
async fn an_agent_on_auto_that_kubelet_does_not_register_deletes_its_nodes_slices() {
    let Some((path, config, client)) = cluster().await else {
        return;
    };
    if !serves_slices(&client).await {
        return;
    }
    let nodes: Api<Node> = Api::all(client.clone());
    let slices: Api<ResourceSlice> = Api::all(client);
    let run = RunId::new();
    let scratch = TempDir::new(&run, "auto");
    let fake_file = scratch.write("gpus.yaml", TWO_H100);
    let node = create_node(&nodes, &config, &run).await;
    // The node's slice from an earlier run that offered its GPUs through DRA.
    let earlier: ResourceSlice = serde_json::from_value(json!({
        "metadata": {"name": format!("{}-earlier", node.name), "labels": {TEST_LABEL: "true"}},
        "spec": {
            "driver": TEST_DRIVER,
            "nodeName": node.name,
            "pool": {"name": node.name, "generation": 1, "resourceSliceCount": 1},
            "devices": [{"name": "gpu-0"}],
        },
    }))
    .expect("a valid ResourceSlice");
    timeout(CALL, slices.create(&PostParams::default(), &earlier))
        .await
        .expect("creating the earlier run's slice answered within the bound")
        .expect("creating the earlier run's slice");
    let selector = format!("spec.nodeName={},spec.driver={TEST_DRIVER}", node.name);
    let listed = kube::api::ListParams::default().fields(&selector);

    // No kubelet registers the driver here: after its wait the agent offers
    // the GPUs through the device plugin, and the node must offer none
    // through DRA.
    let dirs = ["registry", "kubelet-plugins", "cdi"].map(|d| scratch.path.join(d));
    let mut agent = AgentProcess::start_with(
        &scratch,
        &node.name,
        &path,
        &fake_file,
        &[
            "--allocation".into(),
            "auto".into(),
            "--dra-driver-name".into(),
            TEST_DRIVER.into(),
            "--kubelet-registry-dir".into(),
            dirs[0].clone().into(),
            "--kubelet-plugins-dir".into(),
            dirs[1].clone().into(),
            "--cdi-dir".into(),
            dirs[2].clone().into(),
        ],
    );
    let deadline = Instant::now() + Duration::from_secs(90);
    loop {
        if let Err(why) = agent.progress() {
            panic!("waiting for the node's slices to go: {why}");
        }
        let left = timeout(CALL, slices.list(&listed))
            .await
            .expect("listing slices answered within the bound")
            .expect("listing slices");
        if left.items.is_empty() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the agent on the device plugin left the node's slices {:?}\n{}",
            left.items
                .iter()
                .map(|s| s.metadata.name.clone())
                .collect::<Vec<_>>(),
            agent.log_tail()
        );
        sleep(Duration::from_millis(500)).await;
    }
    agent.wait_for_socket(&scratch).await;
    drop(agent);
    for left in timeout(CALL, slices.list(&listed))
        .await
        .into_iter()
        .flatten()
        .flat_map(|l| l.items)
    {
        let name = left.metadata.name.unwrap_or_default();
        let _ = timeout(CALL, slices.delete(&name, &DeleteParams::default())).await;
    }
    node.delete_now(&nodes).await;
    println!(
        "kubelet did not register the driver: the agent offers the device plugin and deleted the node's slices"
    );
}

#[tokio::test]
async fn the_agent_binary_publishes_and_stops_on_sigterm() {
    let Some((path, config, client)) = cluster().await else {
        return;
    };
    let nodes: Api<Node> = Api::all(client);

    // Locals drop in reverse order: the agent is killed (if still running)
    // before the Node is deleted, and the scratch directory goes last.
    let run = RunId::new();
    let scratch = TempDir::new(&run, "bin");
    let fake_file = scratch.write("gpus.yaml", TWO_H100);
    let node = create_node(&nodes, &config, &run).await;
    println!("created Node {} (uid {})", node.name, node.uid);
    let mut agent = AgentProcess::start(&scratch, &node.name, &path, &fake_file);

    // 1. No kubelet here: the agent serves its socket, keeps trying to
    //    register, and publishes all the same.
    let (state, found) = wait_for(
        &nodes,
        &node,
        "two healthy H100s from the agent binary",
        || agent.progress(),
        |s, n| s.devices.len() == 2 && label(n, LABEL_GPU_COUNT) == Some("2"),
    )
    .await;
    check_first_state(&state, &found, &run);
    assert!(
        state.allocated.is_empty(),
        "nothing is allocated without a kubelet: {:?}",
        state.allocated
    );
    // The socket is served once the node's pods are listed (at most 30 s
    // later if the kubeconfig's user cannot list pods).
    let socket = agent.wait_for_socket(&scratch).await;

    // 2. A fault injected into the fake GPU file reaches the Node.
    scratch.write("gpus.yaml", TWO_H100_ONE_FAULTY);
    let (state, found) = wait_for(
        &nodes,
        &node,
        "device 1 unhealthy, published by the agent binary",
        || agent.progress(),
        |s, _| s.devices.len() == 2 && s.devices[1].health == Health::Unhealthy,
    )
    .await;
    check_fault(&state, &found);

    // 3. SIGTERM: exit 0, socket removed.
    let status = agent.terminate();
    assert_eq!(
        status.code(),
        Some(0),
        "the agent did not exit cleanly on SIGTERM ({status})\n{}",
        agent.log_tail()
    );
    assert!(
        !socket.exists(),
        "the agent left its socket {} behind",
        socket.display()
    );
    drop(agent);
    node.delete_now(&nodes).await;
    println!("the agent binary published, saw the fault, stopped on SIGTERM; Node deleted");
}

/// What the first published state of two healthy fake H100s must look like,
/// with the Node's foreign keys untouched and our stale ones replaced.
fn check_first_state(state: &NodeGpuState, found: &Node, run: &RunId) {
    assert_eq!(state.backend, "fake");
    assert!(state.devices.iter().all(|d| d.health == Health::Healthy));
    let stamp = state
        .timestamp
        .as_deref()
        .expect("the state has a timestamp");
    stamp
        .parse::<k8s_openapi::jiff::Timestamp>()
        .unwrap_or_else(|e| panic!("timestamp {stamp:?} is not RFC 3339: {e}"));
    assert_eq!(label(found, LABEL_GPU_VENDOR), Some("nvidia"));
    assert_eq!(
        label(found, LABEL_GPU_PRODUCT),
        Some("NVIDIA-H100-80GB-HBM3")
    );
    assert_eq!(label(found, LABEL_GPU_MEMORY_GIB), Some("80"));
    assert_eq!(label(found, TEST_LABEL), Some("true"));
    assert_eq!(label(found, FOREIGN_LABEL), Some("r17"));
    assert_eq!(
        annotation(found, FOREIGN_ANNOTATION),
        Some(FOREIGN_VALUE),
        "a foreign annotation was changed"
    );
    assert_eq!(annotation(found, RUN_ANNOTATION), Some(run.token.as_str()));
}

/// Device 1 is unhealthy with the injected reason; nothing else moved.
fn check_fault(state: &NodeGpuState, found: &Node) {
    assert_eq!(
        state.devices[1].health_reason.as_deref(),
        Some("Xid 79: GPU has fallen off the bus")
    );
    assert_eq!(state.devices[0].health, Health::Healthy);
    assert_eq!(label(found, LABEL_GPU_COUNT), Some("2"));
    assert_eq!(annotation(found, FOREIGN_ANNOTATION), Some(FOREIGN_VALUE));
}

fn publisher_progress(stats: &PublisherStats) -> String {
    format!(
        "{} patch(es) succeeded, {} failed",
        stats.published(),
        stats.errors()
    )
}

/// A name and a token unique to this run.
struct RunId {
    token: String,
}

impl RunId {
    fn new() -> Self {
        // No RNG crate in the tree: the std hasher's random per-process keys,
        // mixed with the time, are random enough for a test object's name.
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u32(std::process::id());
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        h.write_u128(nanos);
        Self {
            token: format!("{:016x}", h.finish()),
        }
    }

    /// A fresh Node name for each attempt: `tessera-test-<pid>-<random>`.
    fn node_name(&self, attempt: u32) -> String {
        let suffix = if attempt == 0 {
            self.token[..8].to_string()
        } else {
            format!("{}{attempt}", &self.token[..7])
        };
        format!("tessera-test-{}-{suffix}", std::process::id())
    }
}

fn test_node(name: &str, run: &RunId) -> Node {
    serde_json::from_value(json!({
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "labels": {
                TEST_LABEL: "true",
                FOREIGN_LABEL: "r17",
                // Stale values of our own labels: the publisher overwrites them.
                LABEL_GPU_COUNT: "99",
                LABEL_GPU_VENDOR: "stale",
            },
            "annotations": {
                RUN_ANNOTATION: run.token,
                FOREIGN_ANNOTATION: FOREIGN_VALUE,
                // Our own annotation, hand-edited into garbage: overwritten on publish.
                GPU_STATE_ANNOTATION: "{\"version\": \"v1\", truncated",
            },
        },
        "spec": {
            "unschedulable": true,
            "taints": [{ "key": TEST_LABEL, "value": "true", "effect": "NoSchedule" }],
        },
    }))
    .unwrap_or_else(|e| panic!("the test Node is not a valid Node: {e}"))
}

/// Creates the test Node, choosing another name if one is taken (a Node that
/// exists already is never touched). Returns the guard that deletes it.
async fn create_node(nodes: &Api<Node>, config: &Config, run: &RunId) -> NodeGuard {
    for attempt in 0..5 {
        let name = run.node_name(attempt);
        let result = timeout(
            CALL,
            nodes.create(&PostParams::default(), &test_node(&name, run)),
        )
        .await;
        match result {
            Ok(Ok(created)) => {
                let uid = created
                    .metadata
                    .uid
                    .unwrap_or_else(|| panic!("the API server returned Node {name} without a uid"));
                return NodeGuard::new(config.clone(), name, uid);
            }
            Ok(Err(kube::Error::Api(status))) if status.is_already_exists() => {
                println!(
                    "a Node named {name} exists already; leaving it alone, trying another name"
                );
            }
            other => {
                // The create may have gone through before the failure (a lost
                // response): clean up only if the Node carries this run's token.
                let what = match other {
                    Ok(Err(e)) => e.to_string(),
                    _ => format!("no answer within {CALL:?}"),
                };
                if let Ok(Ok(Some(found))) = timeout(CALL, nodes.get_opt(&name)).await
                    && annotation(&found, RUN_ANNOTATION) == Some(run.token.as_str())
                    && let Some(uid) = found.metadata.uid
                {
                    drop(NodeGuard::new(config.clone(), name.clone(), uid));
                }
                panic!(
                    "creating the test Node {name} failed: {what}\n\
                     (the kubeconfig's user needs create/get/patch/delete on nodes)"
                );
            }
        }
    }
    panic!("five random Node names were all taken; something is creating tessera-test-* Nodes");
}

/// Deletes the Node it was created for when dropped (panics included), with
/// the UID as a precondition so a same-named Node created by someone else
/// after ours is never deleted.
struct NodeGuard {
    config: Config,
    name: String,
    uid: String,
    armed: bool,
}

impl NodeGuard {
    fn new(config: Config, name: String, uid: String) -> Self {
        Self {
            config,
            name,
            uid,
            armed: true,
        }
    }

    fn params(&self) -> DeleteParams {
        DeleteParams {
            preconditions: Some(Preconditions {
                uid: Some(self.uid.clone()),
                resource_version: None,
            }),
            ..DeleteParams::default()
        }
    }

    /// The normal path: delete and check that it worked.
    async fn delete_now(mut self, nodes: &Api<Node>) {
        let result = timeout(CALL, nodes.delete(&self.name, &self.params())).await;
        match result {
            Ok(Ok(_)) => self.armed = false,
            Ok(Err(kube::Error::Api(s))) if s.is_not_found() => {
                self.armed = false;
                panic!(
                    "the test Node {} was deleted by someone else during the test",
                    self.name
                );
            }
            // Still armed: the drop below tries once more.
            Ok(Err(e)) => panic!("deleting the test Node {}: {e}", self.name),
            Err(_) => panic!(
                "deleting the test Node {}: no answer within {CALL:?}",
                self.name
            ),
        }
    }
}

impl Drop for NodeGuard {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        // Drop cannot await, and the test's runtime may be unwinding: delete
        // from a thread with its own runtime and client, and wait for it.
        let config = self.config.clone();
        let name = self.name.clone();
        let params = self.params();
        let outcome = std::thread::spawn(move || -> Result<&'static str, String> {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .map_err(|e| e.to_string())?;
            rt.block_on(async {
                let client = Client::try_from(config).map_err(|e| e.to_string())?;
                let nodes: Api<Node> = Api::all(client);
                match timeout(CALL, nodes.delete(&name, &params)).await {
                    Ok(Ok(_)) => Ok("deleted"),
                    Ok(Err(kube::Error::Api(s))) if s.is_not_found() => Ok("already gone"),
                    // The UID precondition failed: the name now belongs to another Node.
                    Ok(Err(kube::Error::Api(s))) if s.is_conflict() => {
                        Ok("gone; a different Node with that name exists and was left alone")
                    }
                    Ok(Err(e)) => Err(e.to_string()),
                    Err(_) => Err(format!("no answer within {CALL:?}")),
                }
            })
        })
        .join();
        match outcome {
            Ok(Ok(what)) => eprintln!("test Node {}: {what}", self.name),
            Ok(Err(e)) => eprintln!(
                "could not delete the test Node {} (uid {}): {e}; remove it with \
                 `kubectl delete node {}`",
                self.name, self.uid, self.name
            ),
            Err(_) => eprintln!(
                "deleting the test Node {} panicked; remove it with `kubectl delete node {}`",
                self.name, self.name
            ),
        }
    }
}

/// Polls our Node until its published state satisfies `done`; panics with what
/// it last saw after `ARRIVAL`. `progress` says how the publishing side is
/// doing (for the failure message), or why waiting longer is pointless.
async fn wait_for(
    nodes: &Api<Node>,
    node: &NodeGuard,
    what: &str,
    mut progress: impl FnMut() -> Result<String, String>,
    done: impl Fn(&NodeGpuState, &Node) -> bool,
) -> (NodeGpuState, Node) {
    let deadline = Instant::now() + ARRIVAL;
    loop {
        if let Err(why) = progress() {
            panic!("while waiting for {what} on Node {}: {why}", node.name);
        }
        let last_seen = match timeout(CALL, nodes.get_opt(&node.name)).await {
            Ok(Ok(Some(found))) => {
                if found.metadata.uid.as_deref() != Some(node.uid.as_str()) {
                    panic!(
                        "the test Node {} was deleted and replaced by someone else \
                         (a cloud node lifecycle controller does this; use a cluster \
                         without a cloud provider)",
                        node.name
                    );
                }
                match annotation(&found, GPU_STATE_ANNOTATION).map(NodeGpuState::from_json) {
                    Some(Ok(state)) if done(&state, &found) => return (state, found),
                    Some(Ok(state)) => format!("{state:?}, labels {:?}", found.metadata.labels),
                    // The test seeds a malformed one; the publisher must replace it.
                    Some(Err(e)) => format!("an annotation that does not parse: {e}"),
                    None => "no gpu-state annotation".into(),
                }
            }
            Ok(Ok(None)) => panic!(
                "the test Node {} disappeared while waiting for {what} (a cloud node \
                 lifecycle controller deletes Nodes without a machine; use a cluster \
                 without a cloud provider, e.g. kind)",
                node.name
            ),
            Ok(Err(e)) => format!("reading the Node failed: {e}"),
            Err(_) => format!("reading the Node took longer than {CALL:?}"),
        };
        if Instant::now() >= deadline {
            let status = progress().unwrap_or_else(|why| why);
            panic!(
                "waited {ARRIVAL:?} for {what} on Node {}; last seen: {last_seen}\n{status}",
                node.name,
            );
        }
        sleep(Duration::from_millis(250)).await;
    }
}

fn label<'a>(node: &'a Node, key: &str) -> Option<&'a str> {
    node.metadata.labels.as_ref()?.get(key).map(String::as_str)
}

fn annotation<'a>(node: &'a Node, key: &str) -> Option<&'a str> {
    node.metadata
        .annotations
        .as_ref()?
        .get(key)
        .map(String::as_str)
}

/// The fake backend's poller; stopped and joined when dropped.
struct Poller {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Poller {
    fn start(fake_file: &Path, tx: ViewTx) -> Self {
        let spec = fake_file.to_str().expect("temp paths are UTF-8 here");
        let backend = FakeBackend::new(spec).unwrap_or_else(|e| panic!("fake backend: {e}"));
        let stop = Arc::new(AtomicBool::new(false));
        let thread = spawn_poller(
            Box::new(backend),
            HealthTracker::new(HealthPolicy::default()),
            Duration::from_millis(200),
            tx,
            stop.clone(),
        );
        Self {
            stop,
            thread: Some(thread),
        }
    }
}

impl Drop for Poller {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// A scratch directory for this run (fake GPU file, plugin dir, registry,
/// checkpoint, agent log); removed when dropped.
struct TempDir {
    path: PathBuf,
}

impl TempDir {
    fn new(run: &RunId, what: &str) -> Self {
        let path = std::env::temp_dir().join(format!("tessera-cluster-agent-{what}-{}", run.token));
        std::fs::create_dir_all(&path)
            .unwrap_or_else(|e| panic!("creating {}: {e}", path.display()));
        Self { path }
    }

    /// Replaces `name`'s content in one step, so a reader never sees half a
    /// file; returns its path.
    fn write(&self, name: &str, text: &str) -> PathBuf {
        let path = self.path.join(name);
        let tmp = self.path.join(format!("{name}.tmp"));
        std::fs::write(&tmp, text).unwrap_or_else(|e| panic!("writing {}: {e}", tmp.display()));
        std::fs::rename(&tmp, &path)
            .unwrap_or_else(|e| panic!("renaming to {}: {e}", path.display()));
        path
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.path);
    }
}

/// `tessera agent` as a child process, killed and reaped when dropped (a
/// failed assertion included) so no agent outlives the test.
struct AgentProcess {
    child: Child,
    log: PathBuf,
    exited: Option<ExitStatus>,
}

impl AgentProcess {
    fn start(scratch: &TempDir, node: &str, kubeconfig: &Path, fake_file: &Path) -> Self {
        Self::start_with(scratch, node, kubeconfig, fake_file, &[])
    }

    /// `start` with more flags.
    fn start_with(
        scratch: &TempDir,
        node: &str,
        kubeconfig: &Path,
        fake_file: &Path,
        flags: &[std::ffi::OsString],
    ) -> Self {
        let plugins = scratch.path.join("plugins");
        std::fs::create_dir_all(&plugins)
            .unwrap_or_else(|e| panic!("creating {}: {e}", plugins.display()));
        let log = scratch.path.join("agent.log");
        let log_file = std::fs::File::create(&log)
            .unwrap_or_else(|e| panic!("creating {}: {e}", log.display()));
        let child = Command::new(env!("CARGO_BIN_EXE_tessera"))
            .arg("agent")
            .args(["--node-name", node])
            .arg("--kubeconfig")
            .arg(kubeconfig)
            .args(["--backend", "fake", "--fake"])
            .arg(fake_file)
            .arg("--plugin-dir")
            .arg(&plugins)
            .arg("--registry")
            .arg(scratch.path.join("registry.json"))
            .arg("--checkpoint")
            .arg(scratch.path.join("checkpoint.json"))
            // Port 0: the system picks a free loopback port; nothing here needs it.
            .args(["--listen", "127.0.0.1:0", "--poll-interval-ms", "200"])
            .args(flags)
            .env_remove("NODE_NAME")
            .env_remove("TESSERA_FAKE_GPUS")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::from(log_file))
            .spawn()
            .unwrap_or_else(|e| panic!("starting the tessera binary: {e}"));
        println!("started tessera agent (pid {})", child.id());
        Self {
            child,
            log,
            exited: None,
        }
    }

    /// Waits for the device plugin's socket in `scratch` (the agent serves it
    /// with no kubelet too) and returns its path.
    async fn wait_for_socket(&mut self, scratch: &TempDir) -> PathBuf {
        let socket = scratch.path.join("plugins/tessera-tessera-dev-gpu.sock");
        let deadline = Instant::now() + SOCKET;
        while !socket.exists() {
            if let Err(why) = self.progress() {
                panic!("waiting for the plugin socket: {why}");
            }
            assert!(
                Instant::now() < deadline,
                "the agent did not serve {} within {SOCKET:?} while kubelet is absent\n{}",
                socket.display(),
                self.log_tail()
            );
            sleep(Duration::from_millis(100)).await;
        }
        socket
    }

    /// The last lines of the agent's log.
    fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        let tail = lines[lines.len().saturating_sub(30)..].join("\n");
        format!("agent log ({}), last lines:\n{tail}", self.log.display())
    }

    /// For [`wait_for`]: the log so far, or an error once the agent has exited.
    fn progress(&mut self) -> Result<String, String> {
        match self.child.try_wait() {
            Ok(None) => Ok(self.log_tail()),
            Ok(Some(status)) => {
                self.exited = Some(status);
                Err(format!(
                    "the agent exited early ({status})\n{}",
                    self.log_tail()
                ))
            }
            Err(e) => Err(format!("cannot check on the agent: {e}")),
        }
    }

    /// Sends SIGTERM and waits (bounded) for the exit status.
    fn terminate(&mut self) -> ExitStatus {
        let pid = self.child.id().to_string();
        let sent = Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .unwrap_or_else(|e| panic!("running kill: {e}"));
        assert!(sent.success(), "kill -TERM {pid} failed: {sent}");
        let deadline = std::time::Instant::now() + STOP;
        loop {
            match self.child.try_wait() {
                Ok(Some(status)) => {
                    self.exited = Some(status);
                    return status;
                }
                Ok(None) if std::time::Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(50))
                }
                Ok(None) => panic!(
                    "the agent did not stop within {STOP:?} of SIGTERM\n{}",
                    self.log_tail()
                ),
                Err(e) => panic!("cannot wait for the agent: {e}"),
            }
        }
    }
}

impl Drop for AgentProcess {
    fn drop(&mut self) {
        if self.exited.is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// Aborts the task when dropped, so a failed test does not leave it patching.
struct AbortOnDrop<T>(tokio::task::JoinHandle<T>);

impl<T> AbortOnDrop<T> {
    async fn join(mut self) -> Option<T> {
        (&mut self.0).await.ok()
    }
}

impl<T> Drop for AbortOnDrop<T> {
    fn drop(&mut self) {
        self.0.abort();
    }
}
