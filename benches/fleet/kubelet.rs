//! What the simulated nodes' kubelets do with shard pods: a pod bound to a
//! fleet node gets its planned devices (the device plugin's Allocate, which
//! the agent records and publishes), and a pod being deleted is removed for
//! good once "its containers stop" (at once: there are none), freeing them.
//! Every binding is timed, so the benchmark can tell when an instance's
//! shards are all bound. With `ready` a bound pod is also marked Running and
//! Ready, as a kubelet does once its containers start: a move waits for that
//! before the old copy goes.
//!
//! With DRA the devices are those the pod's ResourceClaim is allocated, as a
//! kubelet hands the claim to the driver; a pod bound before its claim was
//! allocated, or whose claim holds other devices than its plan, is counted.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use futures::TryStreamExt;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::ResourceClaim;
use kube::api::{Api, DeleteParams, Patch, PatchParams, Preconditions};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Client, ResourceExt};
use tessera::api::{DEVICES_ANNOTATION, INSTANCE_LABEL, REPLICA_LABEL, SHARD_ANNOTATION};
use tokio::time::Instant;

use crate::agents::Fleet;

/// A shard pod bound to a fleet node.
#[derive(Clone, Debug)]
pub(crate) struct Bound {
    pub(crate) pod: String,
    pub(crate) instance: String,
    /// The replica and shard its labels name (0 where they name none).
    pub(crate) replica: u32,
    pub(crate) shard: u32,
    pub(crate) node: String,
    pub(crate) devices: Vec<String>,
    pub(crate) at: Instant,
}

#[derive(Default)]
pub(crate) struct Bindings {
    /// By pod UID, while the pod exists.
    live: Mutex<HashMap<String, Bound>>,
    /// Allocation writes: how long each took to be accepted.
    allocation_writes: Mutex<Vec<Duration>>,
    /// DRA: pods bound with their claim not allocated (or not readable).
    unallocated: std::sync::atomic::AtomicU64,
    /// DRA: pods whose claim holds other devices than their plan.
    off_plan: std::sync::atomic::AtomicU64,
}

impl Bindings {
    /// The instance's shard pods bound now.
    pub(crate) fn of_instance(&self, instance: &str) -> Vec<Bound> {
        lock(&self.live)
            .values()
            .filter(|bound| bound.instance == instance)
            .cloned()
            .collect()
    }

    /// The pods bound now, by instance and replica, in one pass.
    pub(crate) fn by_replica(&self) -> HashMap<(String, u32), Vec<Bound>> {
        let mut grouped: HashMap<(String, u32), Vec<Bound>> = HashMap::new();
        for bound in lock(&self.live).values() {
            grouped
                .entry((bound.instance.clone(), bound.replica))
                .or_default()
                .push(bound.clone());
        }
        grouped
    }

    pub(crate) fn all(&self) -> Vec<Bound> {
        lock(&self.live).values().cloned().collect()
    }

    /// One bound pod, chosen by `seed` (the same seed and pods give the same one).
    pub(crate) fn pick(&self, seed: u64) -> Option<Bound> {
        let live = lock(&self.live);
        let mut all: Vec<&Bound> = live.values().collect();
        all.sort_by(|a, b| a.pod.cmp(&b.pod));
        let chosen = all.get((seed % all.len().max(1) as u64) as usize)?;
        Some((*chosen).clone())
    }

    /// DRA: pods bound before their claim was allocated, and pods whose
    /// claim held other devices than their plan.
    pub(crate) fn claim_faults(&self) -> (u64, u64) {
        use std::sync::atomic::Ordering::Relaxed;
        (self.unallocated.load(Relaxed), self.off_plan.load(Relaxed))
    }

    pub(crate) fn take_allocation_writes(&self) -> Vec<Duration> {
        std::mem::take(&mut lock(&self.allocation_writes))
    }
}

/// Runs until dropped; with `dra` devices come from the pods' claims.
pub(crate) async fn run(
    client: Client,
    namespace: String,
    fleet: Arc<Fleet>,
    bindings: Arc<Bindings>,
    dra: bool,
    ready: bool,
) {
    let claims: Api<ResourceClaim> = Api::namespaced(client.clone(), &namespace);
    let pods: Api<Pod> = Api::namespaced(client, &namespace);
    // Retried as the agent's and controller's watches are.
    let stream = tessera::kubernetes::watch_backoff::with_backoff(
        "pods (simulated kubelet)",
        watcher(pods.clone(), watcher::Config::default()),
    )
    .touched_objects();
    let mut stream = std::pin::pin!(stream);
    // Pod UID → (node, being deleted). Kept for the whole run: a run sees a
    // few thousand pods at most.
    let mut known: HashMap<String, (String, bool)> = HashMap::new();
    loop {
        let pod = match stream.try_next().await {
            Ok(Some(pod)) => pod,
            Ok(None) => return,
            Err(e) => {
                eprintln!("pod watch: {e}");
                continue;
            }
        };
        let uid = pod.uid().unwrap_or_default();
        let Some(node) = pod.spec.as_ref().and_then(|spec| spec.node_name.clone()) else {
            continue;
        };
        if !fleet.contains(&node) {
            continue;
        }
        if pod.metadata.deletion_timestamp.is_some() {
            if known.get(&uid).is_some_and(|(_, deleting)| *deleting) {
                continue;
            }
            known.insert(uid.clone(), (node.clone(), true));
            lock(&bindings.live).remove(&uid);
            fleet.release(&node, &uid);
            let pods = pods.clone();
            let name = pod.name_any();
            tokio::spawn(async move {
                let params = DeleteParams {
                    grace_period_seconds: Some(0),
                    preconditions: Some(Preconditions {
                        uid: Some(uid),
                        resource_version: None,
                    }),
                    ..DeleteParams::default()
                };
                let _ = pods.delete(&name, &params).await;
            });
            continue;
        }
        if known.contains_key(&uid) {
            continue;
        }
        known.insert(uid.clone(), (node.clone(), false));
        let seen = Instant::now();
        let planned: Vec<String> = pod
            .annotations()
            .get(DEVICES_ANNOTATION)
            .map(|list| list.split(',').map(str::to_string).collect())
            .unwrap_or_default();
        let devices = if dra {
            let allocated = claimed_devices(&claims, &pod, &fleet, &node).await;
            let counter = match &allocated {
                None => Some(&bindings.unallocated),
                // A user's pod (kube-scheduler's) has no plan to be off.
                Some(devices) if !planned.is_empty() && sorted(devices) != sorted(&planned) => {
                    Some(&bindings.off_plan)
                }
                Some(_) => None,
            };
            if let Some(counter) = counter {
                counter.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
            allocated.unwrap_or_default()
        } else {
            planned
        };
        let labels = pod.labels();
        let instance = labels.get(INSTANCE_LABEL).cloned().unwrap_or_default();
        let number = |label: &str| labels.get(label).and_then(|v| v.parse().ok()).unwrap_or(0);
        lock(&bindings.live).insert(
            uid.clone(),
            Bound {
                pod: pod.name_any(),
                instance,
                replica: number(REPLICA_LABEL),
                shard: number(SHARD_ANNOTATION),
                node: node.clone(),
                devices: devices.clone(),
                at: seen,
            },
        );
        if ready {
            let (pods, name) = (pods.clone(), pod.name_any());
            tokio::spawn(async move { mark_ready(&pods, &name).await });
        }
        if let Some(wait) = fleet.allocate(&node, &devices, &uid) {
            let (fleet, bindings) = (Arc::clone(&fleet), Arc::clone(&bindings));
            tokio::spawn(async move {
                if let Some(took) = fleet.published_after(&wait, Duration::from_secs(60)).await {
                    lock(&bindings.allocation_writes).push(took);
                }
            });
        }
    }
}

/// The pod's status as its kubelet writes it once the containers run and
/// pass their readiness checks (there are none to run here).
async fn mark_ready(pods: &Api<Pod>, name: &str) {
    let now = k8s_openapi::jiff::Timestamp::now().to_string();
    let status = serde_json::json!({"status": {
        "phase": "Running",
        "conditions": [
            {"type": "Initialized", "status": "True", "lastTransitionTime": now},
            {"type": "ContainersReady", "status": "True", "lastTransitionTime": now},
            {"type": "Ready", "status": "True", "lastTransitionTime": now},
        ],
    }});
    if let Err(e) = pods
        .patch_status(name, &PatchParams::default(), &Patch::Merge(&status))
        .await
    {
        // A pod deleted meanwhile has no status to write.
        if !matches!(&e, kube::Error::Api(s) if s.code == 404) {
            eprintln!("marking pod {name} Ready: {e}");
        }
    }
}

/// The device IDs the pod's (first) claim is allocated on `node`; `None`
/// when it names no claim or the claim is not allocated. A claim made from a
/// template is named in the pod's status.
async fn claimed_devices(
    claims: &Api<ResourceClaim>,
    pod: &Pod,
    fleet: &Fleet,
    node: &str,
) -> Option<Vec<String>> {
    let named = pod
        .spec
        .as_ref()?
        .resource_claims
        .as_ref()?
        .first()?
        .resource_claim_name
        .clone();
    let from_template = || {
        pod.status
            .as_ref()?
            .resource_claim_statuses
            .as_ref()?
            .first()?
            .resource_claim_name
            .clone()
    };
    let name = named.or_else(from_template)?;
    let claim = claims.get(&name).await.ok()?;
    let results = claim.status?.allocation?.devices?.results;
    Some(
        results
            .iter()
            .flatten()
            .filter_map(|result| fleet.device_id(node, &result.device))
            .collect(),
    )
}

fn sorted(devices: &[String]) -> Vec<&str> {
    let mut sorted: Vec<&str> = devices.iter().map(String::as_str).collect();
    sorted.sort_unstable();
    sorted
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}
