//! The controller's Prometheus metrics and its HTTP endpoints: `/healthz`
//! (the process serves), `/readyz` (caches synced; a standby replica is ready
//! too, so a rollout does not wait for leadership) and `/metrics`.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;
use kube::runtime::reflector::Store;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

use super::instance_metrics::InstanceMetrics;
use super::moves::metrics::MoveMetrics;
use super::watch_errors::WatchErrors;
use tessera_core::api::{ModelInstance, Phase};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabel {
    reason: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PhaseLabel {
    phase: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StateLabel {
    state: &'static str,
}

/// Where the wanted replicas of every instance stand, counted from the
/// statuses: `ready` (every shard ready), `starting` (a pod for every shard,
/// not all ready), `planned` (a plan, not every pod yet) and `unplaced` (no
/// plan: waiting for room). They add up to the replicas wanted.
#[derive(Debug, Default, PartialEq, Eq)]
struct ReplicaStates {
    ready: i64,
    starting: i64,
    planned: i64,
    unplaced: i64,
}

impl ReplicaStates {
    fn add(&mut self, mi: &ModelInstance) {
        // A demand's replicas are the ones its last decision planned.
        let wanted = mi.spec.fixed_replicas().unwrap_or_else(|| {
            mi.status.as_ref().map_or(0, |status| {
                status
                    .plan
                    .iter()
                    .map(|shard| shard.replica)
                    .collect::<std::collections::BTreeSet<_>>()
                    .len() as u32
            })
        });
        let (planned, with_pods, ready) = match &mi.status {
            None => (0, 0, 0),
            Some(status) => {
                // A smaller count not yet decided leaves more planned than wanted.
                let planned = (status
                    .plan
                    .iter()
                    .map(|shard| shard.replica)
                    .collect::<std::collections::BTreeSet<_>>()
                    .len() as u32)
                    .min(wanted);
                let with_pods = status.replicas.min(planned);
                (planned, with_pods, status.ready_replicas.min(with_pods))
            }
        };
        self.ready += i64::from(ready);
        self.starting += i64::from(with_pods - ready);
        self.planned += i64::from(planned - with_pods);
        self.unplaced += i64::from(wanted.saturating_sub(planned));
    }

    fn by_state(&self) -> [(&'static str, i64); 4] {
        [
            ("ready", self.ready),
            ("starting", self.starting),
            ("planned", self.planned),
            ("unplaced", self.unplaced),
        ]
    }
}

pub struct Metrics {
    registry: Registry,
    pub(crate) reconciles: Counter,
    failures: Family<ReasonLabel, Counter>,
    pub(crate) reconcile_seconds: Histogram,
    pub(crate) plan_seconds: Histogram,
    instances: Family<PhaseLabel, Gauge>,
    replicas: Family<StateLabel, Gauge>,
    leader: Gauge,
    pub(crate) watch_errors: WatchErrors,
    per_instance: InstanceMetrics,
    pub(crate) moves: MoveMetrics,
    /// Set once the caches have their first full list.
    pub(crate) synced: Arc<AtomicBool>,
    pub(crate) is_leader: Arc<AtomicBool>,
}

impl Default for Metrics {
    fn default() -> Self {
        let mut registry = Registry::with_prefix("tessera_controller");
        let reconciles = Counter::default();
        registry.register(
            "reconciles",
            "Reconciles of ModelInstances",
            reconciles.clone(),
        );
        let failures = Family::<ReasonLabel, Counter>::default();
        registry.register(
            "reconcile_failures",
            "Reconciles that failed, by reason",
            failures.clone(),
        );
        // 1 ms to about 16 s.
        let reconcile_seconds = Histogram::new(exponential_buckets(0.001, 2.0, 15));
        registry.register(
            "reconcile_duration_seconds",
            "Time one reconcile took, API calls included",
            reconcile_seconds.clone(),
        );
        let plan_seconds = Histogram::new(exponential_buckets(0.0001, 2.0, 18));
        registry.register(
            "plan_duration_seconds",
            "Time the plan stage took when it ran the solver",
            plan_seconds.clone(),
        );
        let instances = Family::<PhaseLabel, Gauge>::default();
        registry.register("instances", "ModelInstances by phase", instances.clone());
        let replicas = Family::<StateLabel, Gauge>::default();
        registry.register(
            "replicas",
            "Replicas wanted by all ModelInstances, by state: ready, starting (every pod, not all ready), planned (not every pod yet), unplaced",
            replicas.clone(),
        );
        let leader = Gauge::default();
        registry.register(
            "leader",
            "1 while this replica holds the leader lease",
            leader.clone(),
        );
        let watch_errors = WatchErrors::default();
        watch_errors.register(&mut registry);
        let per_instance = InstanceMetrics::register(&mut registry);
        let moves = MoveMetrics::register(&mut registry);
        Self {
            registry,
            reconciles,
            failures,
            reconcile_seconds,
            plan_seconds,
            instances,
            replicas,
            leader,
            watch_errors,
            per_instance,
            moves,
            synced: Arc::default(),
            is_leader: Arc::default(),
        }
    }
}

impl Metrics {
    /// Says whether every cache has its first full list, as the controller's
    /// run does; for callers that fill the caches themselves.
    pub fn mark_synced(&self, synced: bool) {
        self.synced
            .store(synced, std::sync::atomic::Ordering::Relaxed);
    }

    /// For metrics kept elsewhere (the client's request counts).
    pub(crate) fn registry_mut(&mut self) -> &mut Registry {
        &mut self.registry
    }

    pub(crate) fn failure(&self, reason: &str) {
        self.failures
            .get_or_create(&ReasonLabel {
                reason: reason.to_string(),
            })
            .inc();
    }

    /// The exposition text, with the per-phase and per-state gauges counted
    /// from the cache.
    pub(crate) fn render(&self, instances: Option<&Store<ModelInstance>>) -> String {
        let mut replicas = ReplicaStates::default();
        let mut counts = std::collections::BTreeMap::new();
        for phase in [
            Phase::Pending,
            Phase::Placing,
            Phase::Bound,
            Phase::Running,
            Phase::Degraded,
            Phase::Failed,
        ] {
            counts.insert(format!("{phase:?}"), 0i64);
        }
        let cached = instances.map(Store::state).unwrap_or_default();
        self.per_instance.update(cached.iter().map(AsRef::as_ref));
        for mi in cached {
            replicas.add(&mi);
            let phase = mi
                .status
                .as_ref()
                .and_then(|s| s.phase)
                .unwrap_or(Phase::Pending);
            *counts.entry(format!("{phase:?}")).or_default() += 1;
        }
        for (phase, count) in counts {
            self.instances
                .get_or_create(&PhaseLabel { phase })
                .set(count);
        }
        for (state, count) in replicas.by_state() {
            self.replicas
                .get_or_create(&StateLabel { state })
                .set(count);
        }
        self.leader
            .set(i64::from(self.is_leader.load(Ordering::Relaxed)));
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = encode(&mut out, &self.registry);
        out
    }
}

#[derive(Clone)]
struct ControllerEndpoints {
    metrics: Arc<Metrics>,
    instances: Arc<std::sync::Mutex<Option<Store<ModelInstance>>>>,
}

/// Where the HTTP endpoints find the instance cache once the controller
/// (which only the leader runs) has one.
pub(crate) type InstanceCache = Arc<std::sync::Mutex<Option<Store<ModelInstance>>>>;

async fn healthz() -> &'static str {
    "ok\n"
}

async fn readyz(State(s): State<ControllerEndpoints>) -> impl IntoResponse {
    if s.metrics.synced.load(Ordering::Relaxed) || !s.metrics.is_leader.load(Ordering::Relaxed) {
        (StatusCode::OK, "ready\n")
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "caches not synced yet\n")
    }
}

async fn metrics_text(State(s): State<ControllerEndpoints>) -> impl IntoResponse {
    let store = super::lock(&s.instances).clone();
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        s.metrics.render(store.as_ref()),
    )
}

pub(crate) fn router(metrics: Arc<Metrics>, instances: InstanceCache) -> Router {
    Router::new()
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics_text))
        .with_state(ControllerEndpoints { metrics, instances })
}

#[cfg(test)]
mod tests {
    use kube::runtime::{reflector, watcher};
    use tessera_core::api::{ModelInstanceStatus, PlannedShard};

    use super::*;
    use crate::controller::testkit::{SMALL, instance};

    fn shard(replica: u32) -> PlannedShard {
        PlannedShard {
            copy: 0,
            replica,
            shard: 0,
            node: "a".into(),
            devices: vec![format!("g{replica}")],
            layer_start: 0,
            layer_end: 32,
            predicted_memory_gib: 16.0,
            share: None,
        }
    }

    /// Wants `wanted` replicas; `planned` of them have a plan, `with_pods`
    /// every pod, `ready` every shard ready.
    fn with(wanted: u32, planned: u32, with_pods: u32, ready: u32) -> ModelInstance {
        let mut mi = instance(&format!("m{wanted}{planned}{with_pods}{ready}"), SMALL);
        mi.spec.replicas = wanted;
        mi.status = Some(ModelInstanceStatus {
            plan: (0..planned).map(shard).collect(),
            replicas: with_pods,
            ready_replicas: ready,
            ..Default::default()
        });
        mi
    }

    #[test]
    fn every_wanted_replica_is_counted_once_by_where_it_stands() {
        let mut states = ReplicaStates::default();
        states.add(&with(4, 3, 2, 1));
        let mut new = instance("new", SMALL);
        new.spec.replicas = 2;
        states.add(&new);
        // Scaled down: the plan still names a replica no longer wanted.
        states.add(&with(1, 2, 2, 2));
        assert_eq!(
            states,
            ReplicaStates {
                ready: 2,
                starting: 1,
                planned: 1,
                unplaced: 3
            }
        );
    }

    #[test]
    fn the_gauge_is_exposed_by_state() {
        let (store, mut writer) = reflector::store();
        writer.apply_watcher_event(&watcher::Event::Init);
        writer.apply_watcher_event(&watcher::Event::InitApply(with(3, 2, 1, 1)));
        writer.apply_watcher_event(&watcher::Event::InitDone);
        let text = Metrics::default().render(Some(&store));
        for line in [
            "tessera_controller_replicas{state=\"ready\"} 1",
            "tessera_controller_replicas{state=\"starting\"} 0",
            "tessera_controller_replicas{state=\"planned\"} 1",
            "tessera_controller_replicas{state=\"unplaced\"} 1",
        ] {
            assert!(text.lines().any(|l| l == line), "{line} not in:\n{text}");
        }
    }
}
