//! One reconcile of a ModelInstance, as a plain sequence of stages:
//! observe (the caches) → validate → decide (plan) → build → apply → status,
//! then the Events for what was decided. The stages themselves live in their
//! own modules; this file only hands each one what the earlier ones produced.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{Pod, Service};
use k8s_openapi::api::resource::v1::ResourceClaim;
use k8s_openapi::jiff::Timestamp;
use kube::api::Api;
use kube::runtime::controller::Action;
use kube::runtime::events::Recorder;
use kube::runtime::reflector::Store;
use kube::{Client, ResourceExt};

use super::apply::{self, ApplyError, BindAtOnce, Repair, ReplicaApplied, ShardState};
use super::decide::{PlanDecision, PlanInputs, Replicas, decide_replicas};
use super::desired::{
    INSTANCE_LABEL, REPLICA_LABEL, ShardGpus, headless_service, shard_pod_name, shard_resource,
    some_shard_pods,
};
use super::dra::DraCaches;
use super::dra::apply::{DraShard, ShardClaims, claim_of};
use super::dra::claims::{claim_name, shard_claim};
use super::dra::held::held_by_claims;
use super::dra::pools::Pools;
use super::event_log::EventLog;
use super::events::{self, EventNote, plan_notes, unsatisfiable_text};
use super::hashes::{placement_hash, recorded_pod_hash, replica_pod_hash};
use super::held::{Claims, Held, held_devices};
use super::lock;
use super::metrics::Metrics;
use super::node_cache::{CachedNode, gpu_nodes};
use super::node_gate::{NodeGate, may_bind};
use super::nodes::{NodeInfo, Readiness};
use super::restart_backoff::Backoff;
pub use super::settings::Settings;
use super::status::{self, Outcome, PLACED, REPLICA_FAILURE, ReplicaStatus, StatusInputs};
use super::validate;
use tessera_core::api::{
    DEVICES_ANNOTATION, InvalidSpec, ModelInstance, ModelInstanceStatus, PlannedShard,
    SHARD_ANNOTATION,
};
use tessera_core::placement::Unsatisfiable;

/// The caches the controller reads; the writes go through `client`.
pub struct Caches {
    pub nodes: Store<CachedNode>,
    pub pods: Store<Pod>,
    pub services: Store<Service>,
    pub instances: Store<ModelInstance>,
    /// `Some` when the controller allocates DRA claims.
    pub dra: Option<DraCaches>,
}

pub struct Context {
    pub client: Client,
    pub settings: Settings,
    pub caches: Caches,
    pub recorder: Recorder,
    pub metrics: Arc<Metrics>,
    /// Last unsatisfiable attempt by instance UID and replica.
    unsatisfiable: Mutex<HashMap<(String, u32), (u64, Unsatisfiable)>>,
    /// Consecutive failures by instance UID, for the backoff.
    failures: Mutex<HashMap<String, u32>>,
    /// The plan each instance was last given here. Held for the whole plan
    /// stage, so that reconciles of different instances (which run at the
    /// same time) plan one after the other, each seeing the devices the
    /// others just took although the cache shows their status a moment later.
    claims: tokio::sync::Mutex<Claims>,
    node_gate: NodeGate,
    /// The last events about each instance, for the cluster map.
    pub(crate) event_log: EventLog,
}

impl Context {
    pub fn new(
        client: Client,
        settings: Settings,
        caches: Caches,
        recorder: Recorder,
        metrics: Arc<Metrics>,
    ) -> Self {
        Self {
            client,
            settings,
            caches,
            recorder,
            metrics,
            unsatisfiable: Mutex::default(),
            failures: Mutex::default(),
            claims: tokio::sync::Mutex::default(),
            node_gate: NodeGate::default(),
            event_log: EventLog::default(),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Apply(#[from] ApplyError),
    #[error("the ModelInstance has no {0}")]
    Incomplete(&'static str),
    #[error("planning failed: {0}")]
    Planning(String),
}

impl Error {
    /// The `reason` label of the failure metric: the API's reason where there is one.
    pub fn reason(&self) -> String {
        match self {
            Error::Apply(e) => match &e.source {
                kube::Error::Api(s) if !s.reason.is_empty() => s.reason.clone(),
                kube::Error::Api(s) => format!("HTTP{}", s.code),
                _ => "Transport".to_string(),
            },
            Error::Incomplete(_) => "IncompleteObject".to_string(),
            Error::Planning(_) => "PlanningFailed".to_string(),
        }
    }
}

/// Periodic re-check of a settled instance, in case an event was missed.
const RESYNC: Duration = Duration::from_secs(600);
/// Re-check of an unsatisfiable instance when no cluster change prompts one.
const UNSATISFIABLE_RETRY: Duration = Duration::from_secs(300);

pub async fn reconcile(mi: Arc<ModelInstance>, ctx: Arc<Context>) -> Result<Action, Error> {
    if mi.metadata.deletion_timestamp.is_some() {
        // Owner references take the pods and the Service with it.
        return Ok(Action::await_change());
    }
    // Nothing is judged before every cache has its first list. Before the pod
    // cache has it, the instance's own shard pods are unknown and the devices
    // the agents report them holding look taken by others: a new leader
    // re-planned every running shard on a failover (seen once the debounce
    // was short enough to beat the pod list). Before the slice cache has it,
    // every running DRA shard would look changed and be replaced.
    if !ctx
        .metrics
        .synced
        .load(std::sync::atomic::Ordering::Relaxed)
    {
        return Ok(Action::requeue(Duration::from_secs(1)));
    }
    let started = Instant::now();
    ctx.metrics.reconciles.inc();
    let result = reconcile_inner(&mi, &ctx).await;
    ctx.metrics
        .reconcile_seconds
        .observe(started.elapsed().as_secs_f64());
    if result.is_ok()
        && let Some(uid) = mi.uid()
    {
        lock(&ctx.failures).remove(&uid);
    }
    result
}

/// Exponential backoff per instance: 1 s doubling to 5 minutes.
pub(crate) fn error_policy(mi: Arc<ModelInstance>, error: &Error, ctx: Arc<Context>) -> Action {
    ctx.metrics.failure(&error.reason());
    let failure_count = {
        let mut failures = lock(&ctx.failures);
        let failure_count = failures.entry(mi.uid().unwrap_or_default()).or_insert(0);
        *failure_count = failure_count.saturating_add(1);
        *failure_count
    };
    let delay = Duration::from_secs(1u64 << failure_count.min(9).saturating_sub(1))
        .min(Duration::from_secs(300));
    tracing::warn!(instance = %mi.name_any(), error = %error, retry_in = ?delay, "reconcile failed");
    Action::requeue(delay)
}

/// How soon a reconcile that left a shard unbound looks again (the agent's
/// report of the allocation it waits for usually wakes it sooner).
const BIND_RETRY: Duration = Duration::from_secs(1);

async fn reconcile_inner(mi: &ModelInstance, ctx: &Context) -> Result<Action, Error> {
    let instance = Instance::of(mi)?;
    let now = Timestamp::now();
    let mut notes = Vec::new();

    let observed = observe(ctx, &instance);
    // Planning is serialised from here to the claim (no await in between but
    // the solver's), so each instance plans against the devices others took.
    let mut claims = ctx.claims.lock().await;
    let held = held_by_others(ctx, &instance, &observed, &mut claims);
    let decided = match validate::check(mi, &ctx.settings) {
        Err(invalid) => refuse(mi, invalid, &mut notes),
        Ok(()) => plan(mi, ctx, &instance, &observed, held, now, &mut notes).await?,
    };
    claims.insert(instance.uid.clone(), decided.plan());
    drop(claims);

    let desired = build(mi, &ctx.settings, &observed, &decided);
    let applied = apply(
        mi, ctx, &instance, &observed, &desired, &decided, &mut notes,
    )
    .await;
    if let Ok(applied) = &applied {
        notes.extend(backoff_notes(mi, applied));
    }
    let written = match &applied {
        Ok(applied) => write_status(mi, ctx, &instance, &decided, applied, now).await,
        Err(_) => Ok(()),
    };
    // What was done stays done when a later write fails (a pod bound, then
    // the status refused), and is told now: the retry finds nothing to do.
    events::publish(&ctx.recorder, mi, &notes).await;
    if !notes.is_empty() {
        let instances = ctx.caches.instances.state();
        let live = instances.iter().filter_map(|i| i.metadata.uid.as_deref());
        ctx.event_log.record(&instance.uid, &notes, now, live);
    }
    let applied = applied?;
    written?;

    // A pod left unbound (its node busy with another) is bound on a later pass.
    if applied
        .iter()
        .flat_map(|a| &a.states)
        .any(|state| *state == ShardState::Created)
    {
        return Ok(Action::requeue(BIND_RETRY));
    }
    let next = next_check(&decided, &observed.nodes, now, ctx.settings.node_grace);
    // A replica backing off is looked at again when its wait ends.
    let backoff_ends = applied
        .iter()
        .filter_map(|a| a.waiting.as_ref())
        .filter_map(|(_, due)| Duration::try_from(due.duration_since(now)).ok())
        .map(|wait| wait + Duration::from_secs(1));
    Ok(Action::requeue(backoff_ends.fold(next, Duration::min)))
}

/// One event as a replica starts waiting out its backoff: one whose line is
/// already in the status was told before.
fn backoff_notes(mi: &ModelInstance, applied: &[ReplicaApplied]) -> Vec<EventNote> {
    let told = mi
        .status
        .as_ref()
        .and_then(|s| s.conditions.iter().find(|c| c.type_ == REPLICA_FAILURE))
        .map(|c| c.message.as_str())
        .unwrap_or_default();
    applied
        .iter()
        .filter_map(|a| a.waiting.as_ref())
        .filter(|(message, _)| !told.contains(message.as_str()))
        .map(|(message, _)| EventNote {
            warning: true,
            reason: "BackOff",
            message: message.clone(),
        })
        .collect()
}

/// The instance's identity, which every write needs, and the hash of the spec
/// parts its plan depends on.
struct Instance {
    uid: String,
    namespace: String,
    name: String,
    placement_hash: String,
}

impl Instance {
    fn of(mi: &ModelInstance) -> Result<Self, Error> {
        Ok(Self {
            uid: mi.uid().ok_or(Error::Incomplete("metadata.uid"))?,
            namespace: mi
                .namespace()
                .ok_or(Error::Incomplete("metadata.namespace"))?,
            name: mi.name_any(),
            placement_hash: placement_hash(&mi.spec),
        })
    }
}

/// What the caches showed when this reconcile (or a map page) started.
pub(crate) struct Observed {
    pub(crate) nodes: Vec<Arc<NodeInfo>>,
    pods: Vec<Arc<Pod>>,
    /// This instance's shard pods by name (none for the map).
    mine: BTreeMap<String, Arc<Pod>>,
    /// The DRA nodes' pools (empty without DRA).
    pools: Arc<Pools>,
    /// Every cached ResourceClaim (none without DRA).
    claims: Vec<Arc<ResourceClaim>>,
}

fn observe(ctx: &Context, instance: &Instance) -> Observed {
    let mut observed = observe_cluster(ctx);
    observed.mine = observed
        .pods
        .iter()
        .filter(|p| {
            p.namespace().as_deref() == Some(instance.namespace.as_str())
                && p.owner_references().iter().any(|o| o.uid == instance.uid)
        })
        .map(|p| (p.name_any(), Arc::clone(p)))
        .collect();
    observed
}

/// The caches' nodes, pods and claims.
pub(crate) fn observe_cluster(ctx: &Context) -> Observed {
    let (pools, claims) = match (&ctx.caches.dra, &ctx.settings.dra_driver) {
        (Some(dra), Some(driver)) => (dra.pools(driver), dra.claims.state()),
        _ => (Arc::default(), Vec::new()),
    };
    Observed {
        nodes: gpu_nodes(&ctx.caches.nodes.state()),
        pods: ctx.caches.pods.state(),
        mine: BTreeMap::new(),
        pools,
        claims,
    }
}

/// The devices other instances hold or have just claimed. Claims of deleted
/// instances are dropped on the way.
fn held_by_others(
    ctx: &Context,
    instance: &Instance,
    observed: &Observed,
    claims: &mut Claims,
) -> Held {
    let instances = ctx.caches.instances.state();
    let live: HashSet<&str> = instances
        .iter()
        .filter_map(|i| i.metadata.uid.as_deref())
        .collect();
    claims.retain(|claimed, _| live.contains(claimed.as_str()));
    held_except(ctx, &instance.uid, &instances, claims, observed)
}

/// The devices held by anything but the instance with UID `me` (pass an
/// empty UID for everything held): instances' plans, pods and claims.
pub(crate) fn held_except(
    ctx: &Context,
    me: &str,
    instances: &[Arc<ModelInstance>],
    claims: &Claims,
    observed: &Observed,
) -> Held {
    let mut held = held_devices(
        me,
        instances.iter().map(AsRef::as_ref),
        claims,
        observed.pods.iter().map(AsRef::as_ref),
        &observed.nodes,
    );
    if let Some(driver) = &ctx.settings.dra_driver {
        for hold in held_by_claims(me, &observed.claims, driver, &observed.pools) {
            match hold.share {
                Some(bytes) => held
                    .shares
                    .entry(hold.device)
                    .or_default()
                    .push((hold.holder, bytes)),
                None => {
                    held.devices.entry(hold.device).or_insert(hold.holder);
                }
            }
        }
    }
    held
}

/// What validate and decide settled on: one entry per wanted replica, in
/// replica order (a single entry for all of them when the spec is invalid).
struct Decided {
    replicas: Vec<ReplicaDecided>,
}

/// One replica's outcome.
struct ReplicaDecided {
    outcome: Outcome,
    /// Shards of a degraded plan that lost their devices, with why: kept in
    /// the plan, but no pod is made for them.
    broken: BTreeMap<u32, String>,
}

impl Decided {
    /// Every replica's plan, replica by replica.
    fn plan(&self) -> Vec<PlannedShard> {
        self.replicas
            .iter()
            .flat_map(|replica| replica.outcome.plan().iter().cloned())
            .collect()
    }
}

/// An invalid spec: no plan, and an Event when the reason is new.
fn refuse(mi: &ModelInstance, invalid: InvalidSpec, notes: &mut Vec<EventNote>) -> Decided {
    let text = format!("invalid spec: {}", invalid.problems.join("; "));
    let unchanged = mi
        .status
        .as_ref()
        .and_then(|s| s.conditions.iter().find(|c| c.type_ == PLACED))
        .is_some_and(|c| c.message == text);
    if !unchanged {
        notes.push(EventNote {
            warning: true,
            reason: "InvalidSpec",
            message: text,
        });
    }
    Decided {
        replicas: vec![ReplicaDecided {
            outcome: Outcome::Invalid {
                problems: invalid.problems,
            },
            broken: BTreeMap::new(),
        }],
    }
}

/// The decide stage for every replica (`decide_replicas`), run off the async
/// workers because the solver may search up to the instance's deadline.
async fn plan(
    mi: &ModelInstance,
    ctx: &Context,
    instance: &Instance,
    observed: &Observed,
    held: Held,
    now: Timestamp,
    notes: &mut Vec<EventNote>,
) -> Result<Decided, Error> {
    let previous = mi.status.as_ref();
    let wanted = mi.spec.replicas;
    let current_plan: Vec<PlannedShard> = previous.map(|s| s.plan.clone()).unwrap_or_default();
    let failed = failed_admissions(&observed.mine, &current_plan);
    let known: Vec<Option<(u64, Unsatisfiable)>> = {
        let mut cache = lock(&ctx.unsatisfiable);
        // Replicas scaled away leave nothing behind.
        cache.retain(|(uid, replica), _| uid != &instance.uid || *replica < wanted);
        (0..wanted)
            .map(|replica| cache.get(&(instance.uid.clone(), replica)).cloned())
            .collect()
    };
    let tolerations = mi
        .spec
        .template
        .as_ref()
        .and_then(|t| t.spec.as_ref())
        .and_then(|s| s.tolerations.clone())
        .unwrap_or_default();
    let current_hash = previous.and_then(|s| s.placement_hash.clone());
    // When nothing fits, a running plan of the same spec that only lost
    // shards keeps the rest.
    let keep = current_hash.as_deref() == Some(instance.placement_hash.as_str());
    // Each wanted replica's current shards, split once.
    let by_replica: Vec<Vec<PlannedShard>> = (0..wanted)
        .map(|replica| replica_plan(&current_plan, replica))
        .collect();
    let job = {
        let (spec, nodes, by_replica) =
            (mi.spec.clone(), observed.nodes.clone(), by_replica.clone());
        let (node_grace, max_steps) = (ctx.settings.node_grace, ctx.settings.max_steps);
        move || {
            let replicas = Replicas {
                spec: &spec,
                tolerations: &tolerations,
                current: &by_replica,
                placement_hash: current_hash.as_deref(),
                keep_when_unsatisfiable: keep,
                failed_admission: &failed,
                known_unsatisfiable: &known,
            };
            let base = PlanInputs {
                nodes: &nodes,
                held: &held,
                now,
                node_grace,
                max_steps,
                known_unsatisfiable: None,
                replica: 0,
                replica_nodes: &[],
            };
            decide_replicas(&replicas, &base)
        }
    };
    let planning = Instant::now();
    let decisions = tokio::task::spawn_blocking(job)
        .await
        .map_err(|e| Error::Planning(e.to_string()))?;
    if decisions
        .iter()
        .any(|(decision, _)| *decision != PlanDecision::Keep)
    {
        ctx.metrics
            .plan_seconds
            .observe(planning.elapsed().as_secs_f64());
    }
    let replicas = decisions
        .into_iter()
        .enumerate()
        .map(|(index, (decision, broken))| {
            let replica = index as u32;
            let mut replica_notes = Vec::new();
            let decided = replica_decided(
                ctx,
                (instance, replica),
                previous,
                by_replica[index].clone(),
                (decision, broken),
                keep,
                &mut replica_notes,
            );
            if wanted > 1 {
                for note in &mut replica_notes {
                    note.message = format!("replica {replica}: {}", note.message);
                }
            }
            notes.extend(replica_notes);
            decided
        })
        .collect();
    Ok(Decided { replicas })
}

/// The shards of `replica` in a plan of all replicas.
fn replica_plan(plan: &[PlannedShard], replica: u32) -> Vec<PlannedShard> {
    plan.iter()
        .filter(|shard| shard.replica == replica)
        .cloned()
        .collect()
}

/// One replica's decision as an outcome, with its Events and the
/// unsatisfiable cache brought up to date.
fn replica_decided(
    ctx: &Context,
    (instance, replica): (&Instance, u32),
    previous: Option<&ModelInstanceStatus>,
    current_plan: Vec<PlannedShard>,
    (decision, broken): (PlanDecision, BTreeMap<u32, String>),
    keep: bool,
    notes: &mut Vec<EventNote>,
) -> ReplicaDecided {
    let key = (instance.uid.clone(), replica);
    match decision {
        PlanDecision::Keep => ReplicaDecided {
            outcome: Outcome::Placed {
                // Kept plans keep their prediction; one replica's share of the total.
                tokens_per_second: previous
                    .and_then(|s| s.predicted_tokens_per_second)
                    .map(|total| total / f64::from(replica_count(previous).max(1))),
                plan: current_plan,
                replanned: Vec::new(),
            },
            broken: BTreeMap::new(),
        },
        PlanDecision::Planned(new) => {
            lock(&ctx.unsatisfiable).remove(&key);
            notes.extend(plan_notes(
                &current_plan,
                &new.plan,
                &new.moved,
                &new.reasons,
                new.whole,
            ));
            if let Some(parallelism) = new.parallelism {
                notes.push(EventNote {
                    warning: false,
                    reason: "ParallelismChosen",
                    message: parallelism,
                });
            }
            ReplicaDecided {
                outcome: Outcome::Placed {
                    plan: new.plan,
                    tokens_per_second: new.tokens_per_second,
                    replanned: new.reasons,
                },
                broken: BTreeMap::new(),
            }
        }
        PlanDecision::Unsatisfiable {
            explanation,
            reasons,
            inputs: tried,
            repeated,
        } => {
            let text = unsatisfiable_text(&explanation);
            if !repeated {
                notes.push(EventNote {
                    warning: true,
                    reason: "Unsatisfiable",
                    message: text.clone(),
                });
            }
            lock(&ctx.unsatisfiable).insert(key, (tried, explanation));
            ReplicaDecided {
                outcome: Outcome::Unsatisfiable {
                    explanation: text,
                    plan: if keep { current_plan } else { Vec::new() },
                    lost: if keep { reasons } else { Vec::new() },
                },
                broken: if keep { broken } else { BTreeMap::new() },
            }
        }
    }
}

/// How many replicas the previous status planned.
fn replica_count(previous: Option<&ModelInstanceStatus>) -> u32 {
    previous
        .map(|status| {
            status
                .plan
                .iter()
                .map(|shard| shard.replica)
                .collect::<HashSet<u32>>()
                .len() as u32
        })
        .unwrap_or(0)
}

/// Shards whose pod failed admission on its planned devices, as (replica,
/// shard). Only a pod made for the current plan says something about it: an
/// old one still in the cache must not move the shard a second time.
fn failed_admissions(
    mine: &BTreeMap<String, Arc<Pod>>,
    current_plan: &[PlannedShard],
) -> Vec<(u32, u32)> {
    mine.values()
        .filter(|p| apply::failed_admission(p))
        .filter_map(|p| {
            let (replica, shard) = (replica_of(p), shard_of(p)?);
            let planned = current_plan
                .iter()
                .find(|s| s.replica == replica && s.shard == shard)?;
            let devices = p.annotations().get(DEVICES_ANNOTATION)?;
            (*devices == planned.devices.join(",")).then_some((replica, shard))
        })
        .collect()
}

fn shard_of(pod: &Pod) -> Option<u32> {
    pod.metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(SHARD_ANNOTATION))
        .and_then(|s| s.parse().ok())
}

/// The replica a shard pod belongs to (the first one's carry no label).
fn replica_of(pod: &Pod) -> u32 {
    pod.labels()
        .get(REPLICA_LABEL)
        .and_then(|r| r.parse().ok())
        .unwrap_or(0)
}

/// The build stage: each replica's shard pods, each with its node.
/// The desired shard pods of each replica with their nodes, and the claims
/// of those on DRA nodes.
struct Desired {
    pods: Vec<Vec<(Pod, String)>>,
    dra: Vec<DraShard>,
}

fn build(
    mi: &ModelInstance,
    settings: &Settings,
    observed: &Observed,
    decided: &Decided,
) -> Desired {
    let name = mi.name_any();
    let mut dra = Vec::new();
    let pods = decided
        .replicas
        .iter()
        .map(|replica| {
            let plan = replica.outcome.plan();
            let runnable = |s: &PlannedShard| !replica.broken.contains_key(&s.shard);
            // A shard pod keeps the way it got its GPUs while it exists: a
            // node's slices vanish for a moment when its kubelet restarts
            // (kubelet deletes them until the driver writes them again),
            // and running shards must not be replaced for that. New pods
            // take their node's way.
            let on_dra = |shard: &PlannedShard| {
                let pod_name = shard_pod_name(&name, shard.replica, shard.shard);
                settings.dra_driver.is_some()
                    && match observed.mine.get(&pod_name) {
                        Some(pod) => claim_of(pod).is_some(),
                        None => observed.pools.node(&shard.node).is_some(),
                    }
            };
            let gpus = |shard: &PlannedShard| {
                let pod_name = shard_pod_name(&name, shard.replica, shard.shard);
                if on_dra(shard) {
                    return ShardGpus::Claim(claim_name(&pod_name));
                }
                let existing = observed.mine.get(&pod_name);
                ShardGpus::Resource(shard_resource(
                    &settings.resource_name,
                    shard,
                    &observed.nodes,
                    existing.map(AsRef::as_ref),
                ))
            };
            if let Some(driver) = &settings.dra_driver {
                for shard in plan.iter().filter(|s| runnable(s) && on_dra(s)) {
                    let pod_name = shard_pod_name(&name, shard.replica, shard.shard);
                    dra.push(DraShard {
                        claim: shard_claim(mi, shard, &pod_name, driver),
                        shard: shard.clone(),
                        pod_name,
                    });
                }
            }
            some_shard_pods(mi, plan, runnable, gpus, settings.model_cache.as_ref())
                .into_iter()
                .zip(plan.iter().filter(|s| runnable(s)).map(|s| s.node.clone()))
                .collect()
        })
        .collect();
    Desired { pods, dra }
}

/// The apply stage: the Service, the pods, their bindings; pods of replicas
/// no longer wanted go. Returns each replica's shard states; broken shards of
/// a degraded plan count as missing. Each replica is bound all or nothing on
/// its own, so one replica short of a pod holds no other back.
async fn apply(
    mi: &ModelInstance,
    ctx: &Context,
    instance: &Instance,
    observed: &Observed,
    desired: &Desired,
    decided: &Decided,
    notes: &mut Vec<EventNote>,
) -> Result<Vec<ReplicaApplied>, Error> {
    let namespace = instance.namespace.as_str();
    if decided
        .replicas
        .iter()
        .any(|replica| !replica.outcome.plan().is_empty())
    {
        let services: Api<Service> = Api::namespaced(ctx.client.clone(), namespace);
        let existing =
            ctx.caches.services.state().into_iter().find(|s| {
                s.namespace().as_deref() == Some(namespace) && s.name_any() == instance.name
            });
        apply::service(
            &services,
            &headless_service(mi),
            existing.as_deref(),
            &instance.uid,
            notes,
        )
        .await?;
    }
    let pods_api: Api<Pod> = Api::namespaced(ctx.client.clone(), namespace);
    let every_desired: Vec<(Pod, String)> = desired.pods.iter().flatten().cloned().collect();
    apply::remove_extra(&pods_api, &observed.mine, &every_desired).await?;
    let gate = may_bind(
        &ctx.node_gate,
        &observed.nodes,
        &observed.pods,
        Instant::now(),
    );
    // The bind gate guards the device plugin's guess; a claim names its pod.
    let gate = |node: &str, pod: &Pod| claim_of(pod).is_some() || gate(node, pod);
    let shard_claims = match &ctx.settings.dra_driver {
        Some(driver) if ctx.caches.dra.is_some() => {
            let mine = observed.claims.iter().filter(|c| {
                c.namespace().as_deref() == Some(namespace)
                    && c.owner_references().iter().any(|o| o.uid == instance.uid)
            });
            let mut claims = ShardClaims::new(
                Api::namespaced(ctx.client.clone(), namespace),
                driver,
                &observed.pools,
                &observed.claims,
                mine.cloned(),
                desired.dra.clone(),
            );
            claims.sync(&observed.mine).await?;
            Some(claims)
        }
        _ => None,
    };
    let mut states = Vec::with_capacity(desired.pods.len());
    let now = Timestamp::now();
    for (index, (replica_desired, replica)) in
        desired.pods.iter().zip(&decided.replicas).enumerate()
    {
        let repair = Repair {
            policy: mi.spec.restart_policy,
            backoff: backoff(mi, index as u32, replica_desired, now),
        };
        let replica_desired = (replica_desired.as_slice(), &repair);
        let mut applied = match &shard_claims {
            Some(claims) => {
                apply::pods(
                    &pods_api,
                    replica_desired,
                    &observed.mine,
                    &gate,
                    claims,
                    notes,
                )
                .await?
            }
            None => {
                apply::pods(
                    &pods_api,
                    replica_desired,
                    &observed.mine,
                    &gate,
                    &BindAtOnce,
                    notes,
                )
                .await?
            }
        };
        applied
            .states
            .extend(replica.broken.keys().map(|_| ShardState::Missing));
        states.push(applied);
    }
    if let Some(claims) = &shard_claims {
        notes.extend(claims.take_notes());
    }
    Ok(states)
}

/// A replica's restart backoff, from its record in the status and the
/// hashes of its desired pods.
fn backoff<'a>(
    mi: &'a ModelInstance,
    replica: u32,
    desired: &[(Pod, String)],
    now: Timestamp,
) -> Backoff<'a> {
    Backoff {
        replica,
        previous: mi
            .status
            .as_ref()
            .and_then(|s| s.restarts.iter().find(|r| r.replica == replica)),
        pod_hash: replica_pod_hash(
            desired
                .iter()
                .map(|(pod, _)| recorded_pod_hash(pod).unwrap_or_default()),
        ),
        now,
    }
}

/// The status stage: computed from the replicas' outcomes and shard states.
async fn write_status(
    mi: &ModelInstance,
    ctx: &Context,
    instance: &Instance,
    decided: &Decided,
    applied: &[ReplicaApplied],
    now: Timestamp,
) -> Result<(), Error> {
    let replicas: Vec<ReplicaStatus> = decided
        .replicas
        .iter()
        .zip(applied)
        .map(|(replica, applied)| ReplicaStatus {
            outcome: &replica.outcome,
            shards: &applied.states,
        })
        .collect();
    let new_status = status::compute(&StatusInputs {
        previous: mi.status.as_ref(),
        generation: mi.metadata.generation,
        placement_hash: Some(instance.placement_hash.clone()),
        replicas: &replicas,
        selector: Some(format!("{INSTANCE_LABEL}={}", instance.name)),
        restarts: applied.iter().filter_map(|a| a.restarts.clone()).collect(),
        waiting: applied
            .iter()
            .filter_map(|a| a.waiting.as_ref().map(|(message, _)| message.clone()))
            .collect(),
        now,
    });
    let api: Api<ModelInstance> = Api::namespaced(ctx.client.clone(), &instance.namespace);
    apply::status(&api, mi, &new_status).await?;
    Ok(())
}

/// How soon to look again without an event: when a NotReady node's grace period
/// runs out (no event marks that moment), else a slow resync.
fn next_check(
    decided: &Decided,
    nodes: &[Arc<NodeInfo>],
    now: Timestamp,
    grace: Duration,
) -> Duration {
    let unsatisfiable = decided
        .replicas
        .iter()
        .any(|replica| matches!(replica.outcome, Outcome::Unsatisfiable { .. }));
    let mut next = if unsatisfiable {
        UNSATISFIABLE_RETRY
    } else {
        RESYNC
    };
    let plan = decided.plan();
    for node in nodes
        .iter()
        .filter(|node| plan.iter().any(|s| s.node == node.name()))
    {
        if let Readiness::NotReady { since: Some(since) } = &node.readiness
            && let Ok(elapsed) = Duration::try_from(now.duration_since(*since))
            && elapsed <= grace
        {
            next = next.min(grace - elapsed + Duration::from_secs(1));
        }
    }
    next
}
