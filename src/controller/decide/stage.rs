//! The decide stage as a reconcile runs it: the pure decision for every
//! replica (`decide_replicas`) off the async workers, each outcome with its
//! Events, and the cache of unsatisfiable attempts brought up to date; or the
//! refusal of an invalid spec.

use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;
use std::time::Instant;

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::jiff::Timestamp;
use kube::ResourceExt;
use kube::runtime::reflector::ObjectRef;

use super::demand::Predicted;
use super::measured_demand::{Followed, follow};
use super::{Counted, PlanDecision, PlanInputs, Replicas, decide_count};
use crate::controller::apply;
use crate::controller::context::{Context, Error, Instance};
use crate::controller::desired::replica_of;
use crate::controller::events::{EventNote, plan_notes, unsatisfiable_text};
use crate::controller::held::Held;
use crate::controller::lock;
use crate::controller::moves::Moving;
use crate::controller::moves::progress::{self, MoveInputs};
use crate::controller::nodes::tolerations_of;
use crate::controller::observe::Observed;
use crate::controller::room_wakes::waiting_instances;
use crate::controller::status::{Outcome, PLACED};
use tessera_core::api::{
    DEVICES_ANNOTATION, InvalidSpec, ModelInstance, ModelInstanceStatus, PlannedShard,
    ReplicaCount, SHARD_ANNOTATION, limits,
};
use tessera_core::measure::correction::Observation;
use tessera_core::placement::Unsatisfiable;

/// What validate and decide settled on: one entry per wanted replica, by
/// its number (a single entry for all of them when the spec is invalid).
pub(crate) struct Decided {
    pub(crate) replicas: Vec<ReplicaDecided>,
    /// A replica being moved, when one is.
    pub(crate) moving: Option<Moving>,
    /// Set by the moves stage while a replica has a shard on a cordoned
    /// node: the `OnCordonedNode` condition's reason and message.
    pub(crate) cordoned: Option<(&'static str, String)>,
    /// What the measured replicas say the predictions are off by.
    pub(crate) observations: Vec<Observation>,
    /// Where a measured demand stands (`serving.demand: Measured`).
    pub(crate) demand: Option<Followed>,
}

/// One replica's outcome.
pub(crate) struct ReplicaDecided {
    /// Its number: its pods' names and labels carry it.
    pub(crate) replica: u32,
    pub(crate) outcome: Outcome,
    /// Shards of a degraded plan that lost their devices, with why: kept in
    /// the plan, but no pod is made for them.
    pub(crate) broken: BTreeMap<u32, String>,
}

impl Decided {
    /// Every replica's plan, replica by replica, and both copies of a
    /// replica being moved: every device the instance holds.
    pub(crate) fn plan(&self) -> Vec<PlannedShard> {
        self.replicas
            .iter()
            .flat_map(|replica| replica.outcome.plan().iter().cloned())
            .chain(self.moving.iter().flat_map(|m| m.record.held().cloned()))
            .collect()
    }
}

/// An invalid spec: no plan, and an Event when the reason is new.
pub(crate) fn refuse(
    mi: &ModelInstance,
    invalid: InvalidSpec,
    notes: &mut Vec<EventNote>,
) -> Decided {
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
            replica: 0,
            outcome: Outcome::Invalid {
                problems: invalid.problems,
            },
            broken: BTreeMap::new(),
        }],
        moving: None,
        cordoned: None,
        observations: Vec::new(),
        demand: None,
    }
}

/// The decide stage for every replica (`decide_replicas`), run off the async
/// workers because the solver may search up to the instance's deadline.
pub(crate) async fn plan(
    mi: &ModelInstance,
    ctx: &Context,
    instance: &Instance,
    observed: &Observed,
    held: Held,
    now: Timestamp,
    notes: &mut Vec<EventNote>,
) -> Result<Decided, Error> {
    let previous = mi.status.as_ref();
    let measured = ctx.measures.of(&ObjectRef::from_obj(mi));
    let demand = follow(
        mi,
        measured.as_ref(),
        ctx.settings.measure.is_some(),
        now,
        &ctx.settings.scaling,
    );
    let count = match &demand {
        Some(followed) if followed.by_hand => ReplicaCount::Fixed(mi.spec.replicas),
        followed => mi
            .spec
            .replica_count(followed.as_ref().and_then(|d| d.planned)),
    };
    let current_plan: Vec<PlannedShard> = previous.map(|s| s.plan.clone()).unwrap_or_default();
    // Slots for every replica the instance may have or has (a smaller count
    // chooses which go); the decision says how many it gets (the fixed
    // count, or what the demand needs).
    let slots = current_plan
        .iter()
        .map(|shard| shard.replica)
        // A number no count reaches (a status edited by hand) is no slot.
        .filter(|replica| *replica < limits::REPLICAS.max)
        .map(|replica| replica + 1)
        .fold(mi.spec.most_replicas(), u32::max);
    let failed = failed_admissions(&observed.mine, &current_plan);
    let known: Vec<Option<(u64, Unsatisfiable)>> = {
        let cache = lock(&ctx.unsatisfiable);
        (0..slots)
            .map(|replica| cache.get(&(instance.uid.clone(), replica)).cloned())
            .collect()
    };
    let tolerations = tolerations_of(&mi.spec);
    let current_hash = previous.and_then(|s| s.placement_hash.clone());
    // When nothing fits, a running plan of the same spec that only lost
    // shards keeps the rest.
    let keep = current_hash.as_deref() == Some(instance.placement_hash.as_str());
    // Each wanted replica's current shards, split once.
    let by_replica: Vec<Vec<PlannedShard>> = (0..slots)
        .map(|replica| replica_plan(&current_plan, replica))
        .collect();
    let held_by_others = held.clone();
    let job = {
        let (spec, nodes, by_replica) =
            (mi.spec.clone(), observed.nodes.clone(), by_replica.clone());
        let corrections = previous.map(|s| s.corrections.clone()).unwrap_or_default();
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
                corrections: &corrections,
            };
            decide_count(&replicas, &base, count)
        }
    };
    let planning = Instant::now();
    let Counted {
        replicas: numbers,
        decisions,
        capacities,
    } = tokio::task::spawn_blocking(job)
        .await
        .map_err(|e| Error::Planning(e.to_string()))?;
    // Replicas scaled away leave nothing behind.
    lock(&ctx.unsatisfiable)
        .retain(|(uid, replica), _| uid != &instance.uid || numbers.contains(replica));
    let wanted = decisions.len();
    // By replica number: whether a wanted replica keeps its plan.
    let mut kept = vec![false; by_replica.len()];
    for (replica, (decision, _)) in numbers.iter().zip(&decisions) {
        if let Some(slot) = kept.get_mut(*replica as usize) {
            *slot = *decision == PlanDecision::Keep;
        }
    }
    if decisions
        .iter()
        .any(|(decision, _)| *decision != PlanDecision::Keep)
    {
        ctx.metrics
            .plan_seconds
            .observe(planning.elapsed().as_secs_f64());
    }
    let mut replicas: Vec<ReplicaDecided> = numbers
        .into_iter()
        .zip(decisions.into_iter().zip(capacities))
        .map(|(replica, ((decision, broken), capacity))| {
            let mut replica_notes = Vec::new();
            let decided = replica_decided(
                ctx,
                (instance, replica),
                previous,
                by_replica
                    .get(replica as usize)
                    .cloned()
                    .unwrap_or_default(),
                (decision, broken, capacity),
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
    // A new replica may take a number below those that stay.
    replicas.sort_by_key(|r| r.replica);
    let moving = move_step(
        ctx,
        (mi, instance),
        observed,
        (&held_by_others, &by_replica, &kept),
        &mut replicas,
        (now, notes),
    );
    // A replica being moved runs two copies; which one was read is not known.
    let observations = if moving.is_none() {
        super::corrections::observations(
            &mi.spec,
            &observed.nodes,
            &by_replica,
            &kept,
            measured.as_ref(),
        )
    } else {
        Vec::new()
    };
    Ok(Decided {
        replicas,
        moving,
        cordoned: None,
        observations,
        demand,
    })
}

/// The move in flight carried one step on (see `moves::progress`): the
/// moved replica's plan switched once its new copy serves, the end of a
/// move counted and told.
fn move_step(
    ctx: &Context,
    (mi, instance): (&ModelInstance, &Instance),
    observed: &Observed,
    (held, by_replica, kept): (&Held, &[Vec<PlannedShard>], &[bool]),
    replicas: &mut [ReplicaDecided],
    (now, notes): (Timestamp, &mut Vec<EventNote>),
) -> Option<Moving> {
    let tolerations = tolerations_of(&mi.spec);
    let refused_node = |node: &str| match observed.nodes.iter().find(|n| n.name() == node) {
        None => Some(format!("node {node} publishes no GPU state")),
        Some(n) => n.accepts(&tolerations).err(),
    };
    let handed = ctx.moves.take(&instance.uid);
    let step = progress::step(MoveInputs {
        instance: &instance.name,
        recorded: mi.status.as_ref().and_then(|s| s.moves.first()),
        handed,
        current: by_replica,
        kept: &|replica| kept.get(replica as usize).copied().unwrap_or(false),
        pods: &observed.mine,
        held,
        refused_node: &refused_node,
        now,
        timeout: ctx.settings.moves.timeout,
    });
    if let Some((replica, to)) = step.switched
        && let Some(ReplicaDecided {
            outcome: Outcome::Placed { plan, .. },
            ..
        }) = replicas.iter_mut().find(|r| r.replica == replica)
    {
        *plan = to;
    }
    notes.extend(step.note);
    if let Some((outcome, gpu_seconds)) = step.ended {
        ctx.metrics.moves.ended(outcome, gpu_seconds);
        // What the move freed (or gave back) may be the room an instance
        // waits for; a restarted controller does not know which one.
        for waiting in waiting_instances(&ctx.caches.instances) {
            ctx.moves.wake(waiting);
        }
    }
    if let Some(replica) = step.back_off {
        let until = now
            .checked_add(ctx.settings.moves.backoff)
            .unwrap_or(Timestamp::MAX);
        ctx.moves.back_off(&instance.uid, replica, until);
    }
    step.record.map(|record| Moving {
        record,
        surge: step.surge,
        evict: step.evict,
    })
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
    (decision, broken, predicted): (PlanDecision, BTreeMap<u32, String>, Option<Predicted>),
    keep: bool,
    notes: &mut Vec<EventNote>,
) -> ReplicaDecided {
    let key = (instance.uid.clone(), replica);
    let (capacity, started_with) = match predicted {
        Some(p) => (Some(p.capacity), Some(p.started_with)),
        None => (None, None),
    };
    match decision {
        PlanDecision::Keep => ReplicaDecided {
            replica,
            outcome: Outcome::Placed {
                // Kept plans keep their prediction; one replica's share of the total.
                tokens_per_second: previous
                    .and_then(|s| s.predicted_tokens_per_second)
                    .map(|total| total / f64::from(replica_count(previous).max(1))),
                plan: current_plan,
                replanned: Vec::new(),
                capacity,
                started_with,
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
            if !new.widened.is_empty() {
                notes.push(EventNote {
                    warning: false,
                    reason: "PrecisionWidened",
                    message: new.widened.join("; "),
                });
            }
            ReplicaDecided {
                replica,
                outcome: Outcome::Placed {
                    plan: new.plan,
                    tokens_per_second: new.tokens_per_second,
                    replanned: new.reasons,
                    capacity,
                    started_with,
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
                replica,
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
            let (replica, shard) = (replica_of(p)?, shard_of(p)?);
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
