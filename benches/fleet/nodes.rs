//! The simulated nodes' Kubernetes side: their Node objects (created Ready,
//! labelled and tainted for this run only), the node Leases a kubelet
//! renews, so the node lifecycle controller keeps them Ready as it would
//! real ones, and a kubelet's answer to finding its Node not Ready. Lease renewals are what a real fleet's kubelets write anyway;
//! they are measured apart from tessera's own Node writes.

use std::time::{Duration, Instant};

use futures::{StreamExt, stream};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Client, ResourceExt};
use serde_json::json;

pub(crate) const RUN_LABEL: &str = "fleet.tessera.dev/run";
pub(crate) const TAINT_KEY: &str = "fleet.tessera.dev/simulated";
const LEASE_NAMESPACE: &str = "kube-node-lease";
/// The lifecycle controller marks a node Unknown 40 s after its last renewal;
/// kubelets renew every 10 s. 20 s halves the background writes and stays
/// well inside the grace period.
pub(crate) const LEASE_RENEW: Duration = Duration::from_secs(20);
/// Requests in flight while creating or deleting thousands of objects.
const PARALLEL: usize = 16;

pub(crate) fn node_name(run: &str, index: usize) -> String {
    format!("fleet-{run}-{index:05}")
}

/// Creates the Nodes Ready, with their Leases. Returns the names.
pub(crate) async fn create(client: &Client, run: &str, count: usize) -> Vec<String> {
    let names: Vec<String> = (0..count).map(|index| node_name(run, index)).collect();
    let nodes: Api<Node> = Api::all(client.clone());
    let leases: Api<Lease> = Api::namespaced(client.clone(), LEASE_NAMESPACE);
    stream::iter(names.iter().enumerate())
        .for_each_concurrent(PARALLEL, |(index, name)| {
            let (nodes, leases) = (nodes.clone(), leases.clone());
            async move {
                let zone = format!("zone-{}", (b'a' + (index / 16 % 4) as u8) as char);
                let node: Node = serde_json::from_value(json!({
                    "metadata": {"name": name, "labels": {
                        RUN_LABEL: run,
                        "topology.kubernetes.io/zone": zone,
                        "topology.tessera.dev/rack": format!("rack-{:03}", index / 16),
                    }},
                    "spec": {"taints": [{"key": TAINT_KEY, "value": "true", "effect": "NoSchedule"}]},
                }))
                .expect("a valid Node");
                if let Err(e) = nodes.create(&PostParams::default(), &node).await {
                    panic!("creating Node {name}: {e}");
                }
                if let Err(e) = mark_ready(&nodes, name).await {
                    panic!("marking Node {name} Ready: {e}");
                }
                let lease: Lease = serde_json::from_value(json!({
                    "metadata": {"name": name, "labels": {RUN_LABEL: run}},
                    "spec": {"holderIdentity": name, "leaseDurationSeconds": 40, "renewTime": micro_now()},
                }))
                .expect("a valid Lease");
                if let Err(e) = leases.create(&PostParams::default(), &lease).await {
                    panic!("creating the Lease of {name}: {e}");
                }
            }
        })
        .await;
    names
}

/// Posts the Node's status Ready, as its kubelet would, with the CPU, memory
/// and pod room of a GPU server, so kube-scheduler's resource filters pass
/// (pods of the comparison ask for none).
async fn mark_ready(nodes: &Api<Node>, name: &str) -> Result<Node, kube::Error> {
    let now = Timestamp::now().to_string();
    let room = json!({"cpu": "128", "memory": "1Ti", "pods": "110"});
    let status = json!({"status": {
        "capacity": room, "allocatable": room,
        "conditions": [{
            "type": "Ready", "status": "True", "reason": "KubeletReady",
            "message": "simulated by the tessera fleet benchmark",
            "lastHeartbeatTime": now, "lastTransitionTime": now,
        }],
    }});
    nodes
        .patch_status(name, &PatchParams::default(), &Patch::Strategic(&status))
        .await
}

/// `renewTime` is a MicroTime, serialised with microseconds.
fn micro_now() -> serde_json::Value {
    serde_json::to_value(MicroTime(Timestamp::now())).unwrap_or_default()
}

/// Renews every Lease once per `LEASE_RENEW`, spread evenly over it, until dropped.
pub(crate) async fn renew_leases(clients: Vec<Client>, names: Vec<String>) {
    let leases: Vec<Api<Lease>> = clients
        .into_iter()
        .map(|client| Api::namespaced(client, LEASE_NAMESPACE))
        .collect();
    let gap = LEASE_RENEW / names.len().max(1) as u32;
    let mut tick = tokio::time::interval(gap);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        for (index, name) in names.iter().enumerate() {
            tick.tick().await;
            let leases = leases[index].clone();
            let name = name.clone();
            tokio::spawn(async move {
                // As a kubelet does: a failed renewal is retried soon (0.2 s
                // doubling to 7 s) rather than at the next period, so a short
                // API server outage does not let the Lease lapse.
                let started = Instant::now();
                let mut wait = Duration::from_millis(200);
                loop {
                    let patch = json!({"spec": {"renewTime": micro_now()}});
                    let Err(e) = leases
                        .patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
                        .await
                    else {
                        break;
                    };
                    if started.elapsed() + wait > LEASE_RENEW {
                        eprintln!("renewing the Lease of {name}: {e}");
                        break;
                    }
                    tokio::time::sleep(wait).await;
                    wait = (wait * 2).min(Duration::from_secs(7));
                }
            });
        }
    }
}

/// Waits until no Node of the run carries the `not-ready` taint a new Node
/// gets at creation (the node lifecycle controller lifts it once it sees the
/// Node Ready, a few thousand Nodes taking it a while). Returns how long.
pub(crate) async fn wait_untainted(
    client: &Client,
    run: &str,
    limit: Duration,
) -> Option<Duration> {
    let nodes: Api<Node> = Api::all(client.clone());
    let selector = kube::api::ListParams::default().labels(&format!("{RUN_LABEL}={run}"));
    let started = tokio::time::Instant::now();
    while started.elapsed() < limit {
        let tainted = nodes.list(&selector).await.ok().map(|list| {
            list.items
                .iter()
                .filter(|node| {
                    node.spec
                        .as_ref()
                        .and_then(|spec| spec.taints.as_ref())
                        .is_some_and(|taints| {
                            taints
                                .iter()
                                .any(|t| t.key.starts_with("node.kubernetes.io/"))
                        })
                })
                .count()
        });
        if tainted == Some(0) {
            return Some(started.elapsed());
        }
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
    None
}

/// Deletes the run's Nodes and Leases.
pub(crate) async fn delete(client: &Client, names: &[String]) {
    let nodes: Api<Node> = Api::all(client.clone());
    let leases: Api<Lease> = Api::namespaced(client.clone(), LEASE_NAMESPACE);
    stream::iter(names)
        .for_each_concurrent(PARALLEL, |name| {
            let (nodes, leases) = (nodes.clone(), leases.clone());
            async move {
                let _ = nodes.delete(name, &DeleteParams::default()).await;
                let _ = leases.delete(name, &DeleteParams::default()).await;
            }
        })
        .await;
}

/// What a kubelet does when it finds its Node not Ready (the node lifecycle
/// controller marks it Unknown when renewals stop, e.g. while the API server
/// is down): it posts its status again. Watches the run's Nodes and marks any
/// that is not Ready Ready again, until dropped.
pub(crate) async fn keep_ready(client: Client, run: String) {
    let nodes: Api<Node> = Api::all(client);
    let config = watcher::Config::default().labels(&format!("{RUN_LABEL}={run}"));
    let stream = watcher(nodes.clone(), config)
        .default_backoff()
        .touched_objects();
    let mut stream = std::pin::pin!(stream);
    while let Some(event) = stream.next().await {
        let Ok(node) = event else {
            continue;
        };
        let ready = node
            .status
            .as_ref()
            .and_then(|status| status.conditions.as_ref())
            .is_some_and(|conditions| {
                conditions
                    .iter()
                    .any(|c| c.type_ == "Ready" && c.status == "True")
            });
        if ready {
            continue;
        }
        let name = node.name_any();
        if let Err(e) = mark_ready(&nodes, &name).await {
            eprintln!("marking Node {name} Ready again: {e}");
        }
    }
}
