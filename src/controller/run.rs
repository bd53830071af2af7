//! `tessera controller`: caches, leader election, the reconcile loop and the
//! HTTP endpoints, shut down in order on SIGTERM or SIGINT.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::{Node, Pod, Service};
use k8s_openapi::api::resource::v1::ResourceClaim;
use kube::api::Api;
use kube::runtime::controller::{self, Controller};
use kube::runtime::events::{Recorder, Reporter};
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Client, ResourceExt};
use kube_lease_manager::LeaseManagerBuilder;

use super::apply::{MANAGER, managed_selector};
use super::claim_changes::ClaimChanges;
use super::context::{Caches, Context};
use super::dra::{CachedSlice, DraCaches};
use super::map_server::{self, MapSource};
use super::metrics::{InstanceCache, Metrics, router};
use super::node_cache::{StateReports, cached};
use super::node_changes::NodeChanges;
use super::reconcile::{Settings, error_policy, reconcile};
use super::room_wakes::{instances_where, room_wakes, waiting_instances};
use super::synced::{ALWAYS, Cache, CacheSync};
use super::triggers::{Touch, triggers};
use crate::kubernetes::api_requests::ApiRequests;
use crate::kubernetes::client::kube_client;
use crate::kubernetes::initial_list::InitialList;
use crate::kubernetes::watch_backoff::with_backoff;
use crate::process::signal::terminated;
use tessera_core::api::ModelInstance;

pub struct ControllerConfig {
    pub kubeconfig: Option<PathBuf>,
    /// Watch only this namespace; `None` watches all.
    pub namespace: Option<String>,
    pub listen: SocketAddr,
    /// Where the cluster map is served; `None`: not served.
    pub map_listen: Option<SocketAddr>,
    /// `None` acts without a lease (a single replica).
    pub leader_election: Option<LeaderElection>,
    pub settings: Settings,
    /// How the caches' watches list first.
    pub initial_list: InitialList,
    /// Whether shards on DRA nodes get claims (`settings.dra_driver` names
    /// the driver): never (`DevicePlugin`), or where the API server serves
    /// `resource.k8s.io/v1` (`Auto`; `Dra` insists on it).
    pub allocation: crate::kubernetes::allocation_mode::AllocationMode,
}

pub struct LeaderElection {
    pub lease_name: String,
    pub lease_namespace: String,
    pub identity: String,
}

#[derive(Debug, thiserror::Error)]
pub enum ControllerError {
    #[error("cannot reach the Kubernetes API: {0}")]
    Kube(String),
    #[error("cannot serve the HTTP endpoints on {addr}: {source}")]
    Listen {
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error("leader election: {0}")]
    Lease(String),
    #[error("{0}")]
    Allocation(String),
    #[error("lost the leader lease; exiting so that a single replica acts")]
    LostLease,
}

/// The settings' DRA driver as the allocation mode and the API server say.
async fn resolve_allocation(
    mut config: ControllerConfig,
    client: &Client,
) -> Result<ControllerConfig, ControllerError> {
    use crate::kubernetes::allocation_mode::AllocationMode;
    if config.allocation == AllocationMode::DevicePlugin {
        config.settings.dra_driver = None;
        return Ok(config);
    }
    let served = crate::kubernetes::allocation_mode::serves_dra(client)
        .await
        .map_err(|e| {
            ControllerError::Kube(format!("asking whether the API server serves DRA: {e}"))
        })?;
    match (served, config.allocation) {
        (true, _) => {
            tracing::info!(driver = ?config.settings.dra_driver, "allocating the claims of shards on DRA nodes")
        }
        (false, AllocationMode::Dra) => {
            return Err(ControllerError::Allocation(
                "--allocation dra: the API server does not serve resource.k8s.io/v1 (Kubernetes 1.34+); use auto or device-plugin".into(),
            ));
        }
        (false, _) => {
            tracing::info!(
                "the API server does not serve resource.k8s.io/v1: shards use the device plugin"
            );
            config.settings.dra_driver = None;
        }
    }
    Ok(config)
}

/// Resolves on SIGTERM or SIGINT; a `watch` so every part can wait for it.
fn termination() -> tokio::sync::watch::Receiver<bool> {
    let (tx, rx) = tokio::sync::watch::channel(false);
    tokio::spawn(async move {
        terminated().await;
        let _ = tx.send(true);
    });
    rx
}

async fn stopped(mut rx: tokio::sync::watch::Receiver<bool>) {
    let _ = rx.wait_for(|stop| *stop).await;
}

pub async fn run(config: ControllerConfig) -> Result<(), ControllerError> {
    let api_requests = ApiRequests::default();
    let client = kube_client(config.kubeconfig.as_deref(), &api_requests)
        .await
        .map_err(ControllerError::Kube)?;
    let config = resolve_allocation(config, &client).await?;
    let mut metrics = Metrics::default();
    api_requests.register(metrics.registry_mut());
    let metrics = Arc::new(metrics);
    let cache = Slots::default();
    let (stop_http, http_stopped) = tokio::sync::watch::channel(false);
    let mut http = vec![
        serve(
            config.listen,
            router(Arc::clone(&metrics), Arc::clone(&cache.instances)),
            http_stopped.clone(),
        )
        .await?,
    ];
    if let Some(addr) = config.map_listen {
        http.push(
            serve(
                addr,
                map_server::router(Arc::clone(&cache.map)),
                http_stopped,
            )
            .await?,
        );
    }

    let stop = termination();
    let result = match &config.leader_election {
        None => {
            metrics.is_leader.store(true, Ordering::Relaxed);
            run_controller(client, &config, &metrics, &cache, stopped(stop)).await;
            Ok(())
        }
        Some(le) => lead(client, &config, le, &metrics, &cache, stop).await,
    };
    let _ = stop_http.send(true);
    for task in http {
        let _ = task.await;
    }
    result
}

/// Where the HTTP endpoints find the controller's caches once this replica
/// leads (only the leader has any).
#[derive(Default)]
struct Slots {
    instances: InstanceCache,
    map: MapSource,
}

/// Serves `app` on `addr` until `stop` turns true.
async fn serve(
    addr: SocketAddr,
    app: axum::Router,
    stop: tokio::sync::watch::Receiver<bool>,
) -> Result<tokio::task::JoinHandle<()>, ControllerError> {
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|source| ControllerError::Listen { addr, source })?;
    Ok(tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, app)
            .with_graceful_shutdown(stopped(stop))
            .await
        {
            tracing::error!(error = %e, %addr, "HTTP endpoints stopped");
        }
    }))
}

/// Waits for the lease, runs the controller while holding it, and gives it
/// up on shutdown. Losing it ends the process: the replica restarts as a
/// standby rather than risk two acting at once.
async fn lead(
    client: Client,
    config: &ControllerConfig,
    le: &LeaderElection,
    metrics: &Arc<Metrics>,
    cache: &Slots,
    stop: tokio::sync::watch::Receiver<bool>,
) -> Result<(), ControllerError> {
    let manager = LeaseManagerBuilder::new(client.clone(), &le.lease_name)
        .with_namespace(&le.lease_namespace)
        .with_identity(&le.identity)
        .with_field_manager(format!("{MANAGER}-{}", le.identity))
        .with_duration(15)
        .with_grace(5)
        .build()
        .await
        .map_err(|e| ControllerError::Lease(e.to_string()))?;
    let (mut leading, lease_task) = manager.watch().await;
    tracing::info!(lease = %le.lease_name, namespace = %le.lease_namespace, identity = %le.identity, "waiting for the leader lease");
    let result = loop {
        if *leading.borrow_and_update() {
            break Ok(true);
        }
        tokio::select! {
            changed = leading.changed() => if changed.is_err() {
                break Err(ControllerError::Lease("the lease manager stopped".into()));
            },
            () = stopped(stop.clone()) => break Ok(false),
        }
    };
    let result = match result {
        Ok(true) => {
            tracing::info!(identity = %le.identity, "acquired the leader lease");
            metrics.is_leader.store(true, Ordering::Relaxed);
            let mut watch = leading.clone();
            let lost = async move {
                loop {
                    if watch.changed().await.is_err() || !*watch.borrow_and_update() {
                        return;
                    }
                }
            };
            let (tx, rx) = tokio::sync::oneshot::channel::<bool>();
            let shutdown = async move {
                tokio::select! {
                    () = stopped(stop) => { let _ = tx.send(false); }
                    () = lost => { let _ = tx.send(true); }
                }
            };
            run_controller(client, config, metrics, cache, shutdown).await;
            metrics.is_leader.store(false, Ordering::Relaxed);
            match rx.await {
                Ok(true) => Err(ControllerError::LostLease),
                _ => Ok(()),
            }
        }
        Ok(false) => Ok(()),
        Err(e) => Err(e),
    };
    // Closing the channel makes the manager release the lease for the standby.
    drop(leading);
    match lease_task.await {
        Ok(Ok(_)) => {}
        Ok(Err(e)) => tracing::warn!(error = %e, "could not release the leader lease"),
        Err(e) => tracing::warn!(error = %e, "lease manager task failed"),
    }
    result
}

/// How long an instance's reconcile waits for more triggers, restarted by
/// each. It gathers the burst of events an instance's own writes cause, and a
/// new instance waits it out before it is planned. The storms that once kept
/// restarting it (thousands of Nodes changing) no longer reach every instance:
/// a Node wakes the instances planned on it, and those waiting for room at
/// most once a second (`node_changes`, `room_wakes`). So it is kept short: at
/// 500 ms it was a fifth of a DRA instance's apply → Running on one node, and
/// at 100 ms tessera's median created → bound at 1,000 nodes was slower than
/// kube-scheduler's; at 25 ms it is well below, with less controller CPU over
/// the same sequence (docs/benchmarks.md, "tessera and kube-scheduler").
const RECONCILE_DEBOUNCE: std::time::Duration = std::time::Duration::from_millis(25);

/// The least time between two wakes of the instances waiting for room.
const ROOM_WAKE_PAUSE: std::time::Duration = std::time::Duration::from_secs(1);

/// Instances planned on `name`: a change of that Node or its slices may
/// touch their shards.
fn instances_on_node(
    instances: &Store<ModelInstance>,
    name: &str,
) -> Vec<ObjectRef<ModelInstance>> {
    instances_where(instances, |status| {
        status.plan.iter().any(|s| s.node == name)
    })
}

async fn run_controller(
    client: Client,
    config: &ControllerConfig,
    metrics: &Arc<Metrics>,
    cache: &Slots,
    shutdown: impl std::future::Future<Output = ()> + Send + Sync + 'static,
) {
    let (instances_api, pods_api, services_api): (Api<ModelInstance>, Api<Pod>, Api<Service>) =
        match &config.namespace {
            Some(ns) => (
                Api::namespaced(client.clone(), ns),
                Api::namespaced(client.clone(), ns),
                Api::namespaced(client.clone(), ns),
            ),
            None => (
                Api::all(client.clone()),
                Api::all(client.clone()),
                Api::all(client.clone()),
            ),
        };
    // Every cache's resource is served from the same watch cache: one answer
    // (asked with Nodes, which the controller always watches cluster-wide)
    // holds for all four.
    let nodes_api = Api::<Node>::all(client.clone());
    let first = config
        .initial_list
        .configure(&nodes_api, watcher::Config::default(), "all caches")
        .await;
    let managed = first.clone().labels(&managed_selector());
    let dra_driver = config.settings.dra_driver.clone();
    let mut caches_wanted = ALWAYS.to_vec();
    if dra_driver.is_some() {
        caches_wanted.extend([Cache::Slices, Cache::Claims]);
    }
    let sync = CacheSync::new(Arc::clone(&metrics.synced), &caches_wanted);

    let errors = &metrics.watch_errors;

    let (nodes, node_writer) = reflector::store();
    let node_events = with_backoff("nodes", watcher(nodes_api, first.clone()))
        .map_ok(cached)
        .reflect(node_writer)
        .inspect(sync.observer(Cache::Nodes));
    let node_stream = triggers(node_events, nodes.clone(), {
        let mut reports = StateReports::default();
        let mut changes = NodeChanges::default();
        move |node, touch| {
            if touch == Touch::Applied {
                reports.observe(node);
            }
            changes.wakes(node, touch, std::time::Instant::now())
        }
    })
    .filter_map(errors.absorb(Cache::Nodes));
    let (pods, pod_writer) = reflector::store();
    let pod_events = with_backoff("pods", watcher(pods_api, managed.clone()))
        .modify(|p: &mut Pod| p.managed_fields_mut().clear())
        .reflect(pod_writer)
        .inspect(sync.observer(Cache::Pods));
    let pod_stream =
        triggers(pod_events, pods.clone(), |_, _| true).filter_map(errors.absorb(Cache::Pods));
    let (services, service_writer) = reflector::store();
    let service_events = with_backoff("services", watcher(services_api, managed))
        .modify(|s: &mut Service| s.managed_fields_mut().clear())
        .reflect(service_writer)
        .inspect(sync.observer(Cache::Services));
    let service_stream = triggers(service_events, services.clone(), |_, _| true)
        .filter_map(errors.absorb(Cache::Services));
    let (instances, instance_writer) = reflector::store();
    let instance_events = with_backoff("instances", watcher(instances_api, first.clone()))
        .reflect(instance_writer)
        .inspect(sync.observer(Cache::Instances));
    // A deleted instance's pods and Service go with it (owner references).
    let instance_stream = triggers(instance_events, instances.clone(), |_, touch| {
        touch == Touch::Applied
    })
    .filter_map(errors.absorb(Cache::Instances));

    // DRA: the driver's slices (which nodes are DRA nodes, device names) and
    // the claims (ours are owned by instances; others' hold devices).
    let mut dra = None;
    let mut slice_stream = None;
    let mut claim_stream = None;
    if let Some(driver) = &dra_driver {
        let (slices, slice_writer) = reflector::store();
        let slices_config = first.clone().fields(&format!("spec.driver={driver}"));
        let slice_events = with_backoff(
            "resourceslices",
            watcher(Api::<CachedSlice>::all(client.clone()), slices_config),
        )
        .reflect(slice_writer)
        .inspect(sync.observer(Cache::Slices));
        slice_stream = Some(
            triggers(slice_events, slices.clone(), |_, _| true)
                .filter_map(errors.absorb(Cache::Slices)),
        );
        let claims_api: Api<ResourceClaim> = match &config.namespace {
            Some(ns) => Api::namespaced(client.clone(), ns),
            None => Api::all(client.clone()),
        };
        let (claims, claim_writer) = reflector::store();
        let claim_events = with_backoff("resourceclaims", watcher(claims_api, first.clone()))
            .modify(|c: &mut ResourceClaim| c.managed_fields_mut().clear())
            .reflect(claim_writer)
            .inspect(sync.observer(Cache::Claims));
        let mut changes = ClaimChanges::default();
        claim_stream = Some(
            triggers(claim_events, claims.clone(), move |claim, touch| {
                changes.wakes(claim, touch)
            })
            .filter_map(errors.absorb(Cache::Claims)),
        );
        dra = Some(DraCaches::new(slices, claims));
    }

    let controller = Controller::for_stream(instance_stream, instances.clone())
        .with_config(controller::Config::default().debounce(RECONCILE_DEBOUNCE));
    *super::lock(&cache.instances) = Some(instances.clone());
    let mapper_store = instances.clone();
    let slice_mapper_store = instances.clone();
    let waiting_store = instances.clone();
    let reporter = Reporter {
        controller: MANAGER.to_string(),
        instance: std::env::var("POD_NAME").ok(),
    };
    let caches = Caches {
        nodes,
        pods,
        services,
        instances,
        dra,
    };
    let ctx = Arc::new(Context::new(
        client.clone(),
        config.settings.clone(),
        caches,
        Recorder::new(client, reporter),
        Arc::clone(metrics),
    ));
    *super::lock(&cache.map) = Some(Arc::clone(&ctx));
    // A move handed from one instance's reconcile to another's wakes it.
    let (move_wakes, moved) = tokio::sync::mpsc::unbounded_channel();
    ctx.moves.wake_into(move_wakes);
    let (room_changes, wakes) = room_wakes(ROOM_WAKE_PAUSE);
    let wakes = wakes.flat_map(move |()| futures::stream::iter(waiting_instances(&waiting_store)));
    let wakes = futures::stream::select(
        wakes,
        tokio_stream::wrappers::UnboundedReceiverStream::new(moved),
    );
    // Each measured instance whose runtime's figures changed.
    let (measure_wakes, measured) = tokio::sync::mpsc::unbounded_channel();
    let measuring = config.settings.measure.clone().map(|settings| {
        tokio::spawn(super::measure::measure(
            settings,
            ctx.caches.pods.clone(),
            ctx.caches.instances.clone(),
            Arc::clone(&ctx.measures),
            measure_wakes,
        ))
    });
    let wakes = futures::stream::select(
        wakes,
        tokio_stream::wrappers::UnboundedReceiverStream::new(measured),
    );
    let node_room = room_changes.clone();
    let mut controller = controller
        .owns_stream(pod_stream)
        .owns_stream(service_stream)
        .watches_stream(node_stream, move |node| {
            node_room.note();
            instances_on_node(&mapper_store, &node.name_any())
        })
        .reconcile_on(wakes);
    if let Some(claims) = claim_stream {
        controller = controller.owns_stream(claims);
    }
    if let Some(slices) = slice_stream {
        // A node's slices appearing, changing or going changes how its shards
        // get their devices, as a Node change does.
        controller = controller.watches_stream(slices, move |slice: CachedSlice| {
            room_changes.note();
            instances_on_node(
                &slice_mapper_store,
                slice.spec.node_name.as_deref().unwrap_or_default(),
            )
        });
    }
    controller
        .graceful_shutdown_on(shutdown)
        .run(reconcile, error_policy, ctx)
        .for_each(|result| async move {
            if let Err(e) = result {
                match e {
                    controller::Error::ReconcilerFailed(..) => {}
                    // An instance deleted while its pods' events were queued.
                    controller::Error::ObjectNotFound(obj) => {
                        tracing::debug!(object = %obj, "gone before its reconcile");
                    }
                    other => tracing::warn!(error = %other, "controller"),
                }
            }
        })
        .await;
    if let Some(measuring) = measuring {
        measuring.abort();
    }
    metrics.synced.store(false, Ordering::Relaxed);
}

#[cfg(test)]
mod tests {
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
    use tessera_core::api::{ModelInstanceStatus, PlannedShard};

    use crate::controller::status::PLACED;

    use super::super::testkit::{SMALL, instance};
    use super::*;

    fn placed(placed: bool, node: &str) -> ModelInstanceStatus {
        let condition: Condition = serde_json::from_value(serde_json::json!({
            "type": PLACED,
            "status": if placed { "True" } else { "False" },
            "reason": "Test",
            "message": "",
            "lastTransitionTime": "2026-06-01T12:00:00Z",
        }))
        .unwrap();
        let shard = PlannedShard {
            copy: 0,
            replica: 0,
            shard: 0,
            node: node.to_string(),
            devices: vec![format!("{node}-g0")],
            layer_start: 0,
            layer_end: 32,
            predicted_memory_gib: 16.0,
            share: None,
        };
        ModelInstanceStatus {
            conditions: vec![condition],
            plan: if placed { vec![shard] } else { vec![] },
            ..Default::default()
        }
    }

    #[test]
    fn a_node_change_wakes_instances_planned_on_it_and_room_wakes_waiting_ones_not_new_ones() {
        let new = instance("new", SMALL);
        let mut waiting = instance("waiting", SMALL);
        waiting.status = Some(placed(false, ""));
        let mut on_a = instance("on-a", SMALL);
        on_a.status = Some(placed(true, "a"));
        let (store, mut writer) = reflector::store();
        writer.apply_watcher_event(&watcher::Event::Init);
        for mi in [new, waiting, on_a] {
            writer.apply_watcher_event(&watcher::Event::InitApply(mi));
        }
        writer.apply_watcher_event(&watcher::Event::InitDone);
        let names = |refs: Vec<ObjectRef<ModelInstance>>| -> Vec<String> {
            refs.into_iter().map(|r| r.name).collect()
        };
        assert_eq!(names(instances_on_node(&store, "a")), ["on-a"]);
        assert!(instances_on_node(&store, "b").is_empty());
        assert_eq!(names(waiting_instances(&store)), ["waiting"]);
    }
}
