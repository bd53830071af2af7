//! One reconcile of a ModelInstance: observe (from the caches) → validate →
//! plan → build → apply → status, then the Events for what was decided.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{Node, ObjectReference, Pod, Service};
use k8s_openapi::jiff::Timestamp;
use kube::api::Api;
use kube::runtime::controller::Action;
use kube::runtime::events::{Event, EventType, Recorder};
use kube::runtime::reflector::Store;
use kube::{Client, Resource, ResourceExt};

use super::apply::{self, ApplyError, Note};
use super::build::{headless_service, shard_pod_name, shard_pods, shard_resource};
use super::held::{Claims, held_devices};
use super::metrics::Metrics;
use super::node_gate::{BoundPod, NodeGate};
use super::nodes::{NodeInfo, ParsedNodes, Readiness};
use super::plan::{Current, Decision, PlanInputs, broken_shards, decide, placement_hash};
pub use super::settings::Settings;
use super::status::{self, Outcome, PLACED, StatusInputs};
use super::validate;
use crate::api::{DEVICES_ANNOTATION, ModelInstance, PlannedShard, SHARD_ANNOTATION};
use crate::placement::Unsatisfiable;

/// The caches the controller reads; the writes go through `client`.
pub struct Caches {
    pub nodes: Store<Node>,
    pub pods: Store<Pod>,
    pub services: Store<Service>,
    pub instances: Store<ModelInstance>,
}

pub struct Context {
    pub client: Client,
    pub settings: Settings,
    pub caches: Caches,
    pub recorder: Recorder,
    pub metrics: Arc<Metrics>,
    /// Last unsatisfiable attempt by instance UID.
    unsatisfiable: Mutex<HashMap<String, (u64, Unsatisfiable)>>,
    /// Consecutive failures by instance UID, for the backoff.
    failures: Mutex<HashMap<String, u32>>,
    /// The plan each instance was last given here. Held for the whole plan
    /// stage, so that reconciles of different instances (which run at the
    /// same time) plan one after the other, each seeing the devices the
    /// others just took although the cache shows their status a moment later.
    claims: tokio::sync::Mutex<Claims>,
    parsed_nodes: ParsedNodes,
    node_gate: NodeGate,
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
            parsed_nodes: ParsedNodes::default(),
            node_gate: NodeGate::default(),
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
pub fn error_policy(mi: Arc<ModelInstance>, error: &Error, ctx: Arc<Context>) -> Action {
    ctx.metrics.failure(&error.reason());
    let n = {
        let mut failures = lock(&ctx.failures);
        let n = failures.entry(mi.uid().unwrap_or_default()).or_insert(0);
        *n = n.saturating_add(1);
        *n
    };
    let delay =
        Duration::from_secs(1u64 << n.min(9).saturating_sub(1)).min(Duration::from_secs(300));
    tracing::warn!(instance = %mi.name_any(), error = %error, retry_in = ?delay, "reconcile failed");
    Action::requeue(delay)
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

fn shard_of(pod: &Pod) -> Option<u32> {
    pod.metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(SHARD_ANNOTATION))
        .and_then(|s| s.parse().ok())
}

async fn reconcile_inner(mi: &ModelInstance, ctx: &Context) -> Result<Action, Error> {
    let uid = mi.uid().ok_or(Error::Incomplete("metadata.uid"))?;
    let namespace = mi
        .namespace()
        .ok_or(Error::Incomplete("metadata.namespace"))?;
    let name = mi.name_any();
    let now = Timestamp::now();
    let settings = &ctx.settings;

    // Observe.
    let nodes = ctx.parsed_nodes.read(&ctx.caches.nodes.state());
    let all_pods = ctx.caches.pods.state();
    let mine: BTreeMap<String, Arc<Pod>> = all_pods
        .iter()
        .filter(|p| {
            p.namespace().as_deref() == Some(namespace.as_str())
                && p.owner_references().iter().any(|o| o.uid == uid)
        })
        .map(|p| (p.name_any(), Arc::clone(p)))
        .collect();
    // Planning is serialised from here to the claim below (no await between).
    let mut claims = ctx.claims.lock().await;
    let instances = ctx.caches.instances.state();
    let live: HashSet<&str> = instances
        .iter()
        .filter_map(|i| i.metadata.uid.as_deref())
        .collect();
    claims.retain(|claimed, _| live.contains(claimed.as_str()));
    let held = held_devices(
        &uid,
        instances.iter().map(AsRef::as_ref),
        &claims,
        all_pods.iter().map(AsRef::as_ref),
        &nodes,
    );
    let previous = mi.status.as_ref();
    let hash = placement_hash(&mi.spec);

    // Validate, then plan.
    let mut notes = Vec::new();
    let mut broken = BTreeMap::new();
    let outcome = match validate::check(mi, &settings.resource_name) {
        Err(invalid) => Outcome::Invalid {
            problems: invalid.problems,
        },
        Ok(()) => {
            let current_plan: &[PlannedShard] = previous.map(|s| s.plan.as_slice()).unwrap_or(&[]);
            // Only a pod made for the current plan says something about it: an
            // old one still in the cache must not move the shard a second time.
            let failed: Vec<u32> = mine
                .values()
                .filter(|p| apply::failed_admission(p))
                .filter_map(|p| {
                    let shard = shard_of(p)?;
                    let planned = current_plan.iter().find(|s| s.shard == shard)?;
                    let devices = p.annotations().get(DEVICES_ANNOTATION)?;
                    (*devices == planned.devices.join(",")).then_some(shard)
                })
                .collect();
            let known = lock(&ctx.unsatisfiable).get(&uid).cloned();
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
            let keep = current_hash.as_deref() == Some(hash.as_str());
            // The solver may search for up to the instance's deadline: off the
            // async workers, so watches, the Lease and the endpoints keep going.
            let job = {
                let (spec, nodes, plan) = (mi.spec.clone(), nodes.clone(), current_plan.to_vec());
                let (node_grace, max_steps) = (settings.node_grace, settings.max_steps);
                move || {
                    let inputs = PlanInputs {
                        nodes: &nodes,
                        held: &held,
                        now,
                        node_grace,
                        max_steps,
                        known_unsatisfiable: known.as_ref(),
                    };
                    let current = Current {
                        plan: &plan,
                        placement_hash: current_hash.as_deref(),
                        failed_admission: &failed,
                    };
                    let decision = decide(&spec, &tolerations, &current, &inputs);
                    let broken = match decision {
                        Decision::Unsatisfiable { .. } if keep => {
                            broken_shards(&plan, &failed, &inputs)
                        }
                        _ => BTreeMap::new(),
                    };
                    (decision, broken)
                }
            };
            let planning = Instant::now();
            let (decision, broken_now) = tokio::task::spawn_blocking(job)
                .await
                .map_err(|e| Error::Planning(e.to_string()))?;
            if decision != Decision::Keep {
                ctx.metrics
                    .plan_seconds
                    .observe(planning.elapsed().as_secs_f64());
            }
            match decision {
                Decision::Keep => Outcome::Placed {
                    plan: current_plan.to_vec(),
                    tokens_per_second: previous.and_then(|s| s.predicted_tokens_per_second),
                    replanned: Vec::new(),
                },
                Decision::Planned(new) => {
                    lock(&ctx.unsatisfiable).remove(&uid);
                    notes.extend(plan_notes(
                        current_plan,
                        &new.plan,
                        &new.moved,
                        &new.reasons,
                        new.whole,
                    ));
                    Outcome::Placed {
                        plan: new.plan,
                        tokens_per_second: new.tokens_per_second,
                        replanned: new.reasons,
                    }
                }
                Decision::Unsatisfiable {
                    explanation,
                    reasons,
                    inputs: tried,
                    repeated,
                } => {
                    let text = explain(&explanation);
                    if !repeated {
                        notes.push(Note {
                            warning: true,
                            reason: "Unsatisfiable",
                            message: text.clone(),
                        });
                    }
                    lock(&ctx.unsatisfiable).insert(uid.clone(), (tried, explanation));
                    let kept = if keep {
                        current_plan.to_vec()
                    } else {
                        Vec::new()
                    };
                    broken = broken_now;
                    Outcome::Unsatisfiable {
                        explanation: text,
                        plan: kept,
                        lost: if keep { reasons } else { Vec::new() },
                    }
                }
            }
        }
    };
    if let Outcome::Invalid { problems } = &outcome {
        let text = format!("invalid spec: {}", problems.join("; "));
        let unchanged = previous
            .and_then(|s| s.conditions.iter().find(|c| c.type_ == PLACED))
            .is_some_and(|c| c.message == text);
        if !unchanged {
            notes.push(Note {
                warning: true,
                reason: "InvalidSpec",
                message: text,
            });
        }
    }

    let plan: &[PlannedShard] = match &outcome {
        Outcome::Invalid { .. } => &[],
        Outcome::Unsatisfiable { plan, .. } | Outcome::Placed { plan, .. } => plan,
    };
    claims.insert(uid.clone(), plan.to_vec());
    drop(claims);

    // Build.
    let runnable: Vec<PlannedShard> = plan
        .iter()
        .filter(|s| !broken.contains_key(&s.shard))
        .cloned()
        .collect();
    let resource = |s: &PlannedShard| {
        let existing = mine.get(&shard_pod_name(&name, s.shard));
        shard_resource(
            &settings.resource_name,
            s,
            &nodes,
            existing.map(AsRef::as_ref),
        )
    };
    let desired: Vec<(Pod, String)> = shard_pods(mi, &runnable, resource)
        .into_iter()
        .zip(runnable.iter().map(|s| s.node.clone()))
        .collect();

    // Apply.
    let pods_api: Api<Pod> = Api::namespaced(ctx.client.clone(), &namespace);
    if !plan.is_empty() {
        let services: Api<Service> = Api::namespaced(ctx.client.clone(), &namespace);
        let existing =
            ctx.caches.services.state().into_iter().find(|s| {
                s.namespace().as_deref() == Some(namespace.as_str()) && s.name_any() == name
            });
        apply::service(
            &services,
            &headless_service(mi),
            existing.as_deref(),
            &uid,
            &mut notes,
        )
        .await?;
    }
    apply::remove_extra(&pods_api, &mine, &desired).await?;
    let gate = may_bind(&ctx.node_gate, &nodes, &all_pods, Instant::now());
    let mut shards = apply::pods(&pods_api, &desired, &mine, gate, &mut notes).await?;
    // A pod left unbound (its node busy with another) is bound on a later pass.
    let deferred = shards.contains(&status::ShardState::Created);
    // Broken shards kept in a degraded plan count as missing.
    shards.extend(broken.keys().map(|_| status::ShardState::Missing));

    // Status.
    let new_status = status::compute(&StatusInputs {
        previous,
        generation: mi.metadata.generation,
        placement_hash: Some(hash),
        outcome: &outcome,
        shards: &shards,
        now,
    });
    let api: Api<ModelInstance> = Api::namespaced(ctx.client.clone(), &namespace);
    apply::status(&api, mi, &new_status).await?;

    publish(ctx, mi, &notes).await;
    if deferred {
        return Ok(Action::requeue(BIND_RETRY));
    }
    Ok(next_check(&outcome, plan, &nodes, now, settings.node_grace))
}

/// How soon a reconcile that left a shard unbound looks again (the agent's
/// report of the allocation it waits for usually wakes it sooner).
const BIND_RETRY: Duration = Duration::from_secs(1);

/// Whether a shard pod may be bound to `node` now (see [`NodeGate`]), judged
/// from what this reconcile observed.
fn may_bind<'a>(
    gate: &'a NodeGate,
    nodes: &'a [Arc<NodeInfo>],
    pods: &'a [Arc<Pod>],
    now: Instant,
) -> impl Fn(&str, &Pod) -> bool + 'a {
    move |node, pod| {
        let devices = pod
            .annotations()
            .get(DEVICES_ANNOTATION)
            .map_or(0, |d| d.split(',').filter(|id| !id.is_empty()).count());
        gate.try_enter(
            node,
            devices,
            pod.uid().as_deref().unwrap_or_default(),
            |uid| bound_pod(nodes, pods, node, uid),
            now,
        )
    }
}

/// What the observed nodes and pods say about a pod bound to `node`.
fn bound_pod(nodes: &[Arc<NodeInfo>], pods: &[Arc<Pod>], node: &str, uid: &str) -> BoundPod {
    let allocated = nodes.iter().any(|n| {
        n.name() == node
            && n.gpus
                .gpu_state
                .allocated
                .values()
                .any(|owner| owner == uid)
    });
    if allocated {
        return BoundPod::Admitted;
    }
    let Some(pod) = pods.iter().find(|p| p.uid().as_deref() == Some(uid)) else {
        return BoundPod::Unseen;
    };
    let phase = pod.status.as_ref().and_then(|s| s.phase.as_deref());
    if pod.metadata.deletion_timestamp.is_some()
        || matches!(phase, Some("Running" | "Succeeded" | "Failed"))
    {
        BoundPod::Admitted
    } else {
        BoundPod::Waiting
    }
}

/// The solver's reason and what excluded the rest, short enough for a condition.
fn explain(u: &Unsatisfiable) -> String {
    let mut text = u.reason.clone();
    for d in &u.details {
        if text.len() + d.len() > 900 {
            text.push_str("; …");
            break;
        }
        text.push_str("; ");
        text.push_str(d);
    }
    text
}

fn show(s: &PlannedShard) -> String {
    format!("node {} [{}]", s.node, s.devices.join(","))
}

/// Events for a new plan: the whole plan, or each move.
fn plan_notes(
    old: &[PlannedShard],
    new: &[PlannedShard],
    moved: &[u32],
    reasons: &[String],
    whole: bool,
) -> Vec<Note> {
    if whole {
        let shards: Vec<String> = new
            .iter()
            .map(|s| {
                format!(
                    "shard {} layers {}-{} on {}",
                    s.shard,
                    s.layer_start,
                    s.layer_end,
                    show(s)
                )
            })
            .collect();
        let (reason, why) = if old.is_empty() {
            ("Planned", String::new())
        } else {
            ("Replanned", format!(" because {}", reasons.join("; ")))
        };
        return vec![Note {
            warning: false,
            reason,
            message: format!("planned {} shards{why}: {}", new.len(), shards.join("; ")),
        }];
    }
    moved
        .iter()
        .filter_map(|&i| {
            let from = old.iter().find(|s| s.shard == i)?;
            let to = new.iter().find(|s| s.shard == i)?;
            let why = reasons
                .iter()
                .find(|r| r.starts_with(&format!("shard {i}:")))
                .map(|r| r.split_once(": ").map_or(r.as_str(), |(_, w)| w))
                .unwrap_or("its devices were lost");
            Some(Note {
                warning: false,
                reason: "Replanned",
                message: format!("shard {i} moved from {} to {}: {why}", show(from), show(to)),
            })
        })
        .collect()
}

/// What the events are about: the instance at the version the reconcile
/// read, as client-go refers to objects. The recorder folds events with the
/// same reason about the same reference into one series that keeps the first
/// note; without the version a second move of a shard (or the binding of its
/// new pod) would only count up the first event and its message be lost.
fn regarding(mi: &ModelInstance) -> ObjectReference {
    let mut reference = mi.object_ref(&());
    reference.resource_version = mi.resource_version();
    reference
}

async fn publish(ctx: &Context, mi: &ModelInstance, notes: &[Note]) {
    let reference = regarding(mi);
    for n in notes {
        let event = Event {
            type_: if n.warning {
                EventType::Warning
            } else {
                EventType::Normal
            },
            reason: n.reason.to_string(),
            note: Some(n.message.chars().take(1000).collect()),
            action: n.reason.to_string(),
            secondary: None,
        };
        if let Err(e) = ctx.recorder.publish(&event, &reference).await {
            tracing::warn!(instance = %mi.name_any(), error = %e, reason = n.reason, "cannot record event");
        }
        tracing::info!(instance = %mi.name_any(), reason = n.reason, "{}", n.message);
    }
}

/// When to look again without an event: when a NotReady node's grace period
/// runs out (no event marks that moment), else a slow resync.
fn next_check(
    outcome: &Outcome,
    plan: &[PlannedShard],
    nodes: &[Arc<NodeInfo>],
    now: Timestamp,
    grace: Duration,
) -> Action {
    let mut next = match outcome {
        Outcome::Unsatisfiable { .. } => UNSATISFIABLE_RETRY,
        _ => RESYNC,
    };
    for n in nodes
        .iter()
        .filter(|n| plan.iter().any(|s| s.node == n.name()))
    {
        if let Readiness::NotReady { since: Some(t) } = &n.readiness
            && let Ok(elapsed) = Duration::try_from(now.duration_since(*t))
            && elapsed <= grace
        {
            next = next.min(grace - elapsed + Duration::from_secs(1));
        }
    }
    Action::requeue(next)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::controller::testkit::{SMALL, instance};

    #[test]
    fn events_refer_to_the_version_they_are_about() {
        let mut mi = instance("llama", SMALL);
        mi.metadata.resource_version = Some("41".into());
        let before = regarding(&mi);
        mi.metadata.resource_version = Some("42".into());
        let after = regarding(&mi);
        assert_eq!(before.resource_version.as_deref(), Some("41"));
        assert_eq!(before.uid.as_deref(), Some("uid-llama"));
        assert_eq!(before.name, after.name);
        // Different references: the recorder starts a new event, not a series.
        assert_ne!(before, after);
    }
}
