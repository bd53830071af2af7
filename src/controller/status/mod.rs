//! The status stage: phase, conditions and the plan as users read them with
//! `kubectl get mi` and `kubectl describe mi`. Pure: built from what the
//! other stages decided and did.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use k8s_openapi::jiff::Timestamp;

mod measured;
mod merge;
pub(crate) mod write;

use std::collections::BTreeMap;

use super::apply::ShardState;
use super::measure::ReplicaMeasure;
use tessera_core::api::{
    InstanceCapacity, MeasuredDemand, ModelInstanceStatus, MoveInFlight, Phase, PlannedShard,
    ReplicaCapacity, ReplicaPrediction, ReplicaRestarts, ServingCorrection,
};
use tessera_core::translate::instance_capacity;

pub(crate) const PLACED: &str = "Placed";
pub(crate) const READY: &str = "Ready";
pub(crate) const PROGRESSING: &str = "Progressing";
/// Present while a replica's recreations are counted (`status.restarts`):
/// `True` while one waits out its backoff.
pub(crate) const REPLICA_FAILURE: &str = "ReplicaFailure";
/// Present when the instance has a demand (`serving.requestsPerSecond`):
/// whether its placed replicas serve it at the latency target.
pub(crate) const DEMAND_MET: &str = "DemandMet";
/// Present with `serving.demand: Measured`: whether the replica count
/// follows the measured demand, and where it stands.
pub(crate) const DEMAND_FOLLOWED: &str = "DemandFollowed";
/// Present while a replica has a shard on a cordoned node: `True`, reason
/// `Leaving` while a move takes it off (or waits its turn), `CannotLeave`
/// when nothing does, with why.
pub(crate) const ON_CORDONED_NODE: &str = "OnCordonedNode";

/// What the earlier stages concluded.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Outcome {
    /// The spec cannot run: `problems` say why.
    Invalid { problems: Vec<String> },
    /// No plan. `lost` is non-empty when a running plan lost shards that could
    /// not be moved; that plan is kept in `plan`.
    Unsatisfiable {
        explanation: String,
        plan: Vec<PlannedShard>,
        lost: Vec<String>,
    },
    Placed {
        plan: Vec<PlannedShard>,
        tokens_per_second: Option<f64>,
        /// Set when this reconcile moved shards: the reasons.
        replanned: Vec<String>,
        /// What the replica serves at the latency target, where the
        /// serving model has an answer (measured corrections applied).
        capacity: Option<ReplicaCapacity>,
        /// The same without the corrections: what its pods are started with
        /// (the batch they take), so a learned correction never restarts them.
        started_with: Option<ReplicaCapacity>,
    },
}

impl Outcome {
    /// The shards the outcome keeps or places (none for an invalid spec).
    pub(crate) fn plan(&self) -> &[PlannedShard] {
        match self {
            Outcome::Invalid { .. } => &[],
            Outcome::Unsatisfiable { plan, .. } | Outcome::Placed { plan, .. } => plan,
        }
    }
}

/// One replica's outcome and the states of its shards (in shard order).
pub(crate) struct ReplicaStatus<'a> {
    /// The replica's number.
    pub(crate) replica: u32,
    pub(crate) outcome: &'a Outcome,
    pub(crate) shards: &'a [ShardState],
}

pub(crate) struct StatusInputs<'a> {
    pub(crate) previous: Option<&'a ModelInstanceStatus>,
    pub(crate) generation: Option<i64>,
    pub(crate) placement_hash: Option<String>,
    /// Every wanted replica in order; one entry (for all) when the spec is invalid.
    pub(crate) replicas: &'a [ReplicaStatus<'a>],
    /// Label selector of the instance's shard pods (the scale subresource's).
    pub(crate) selector: Option<String>,
    /// The replicas' restart records (`status.restarts`).
    pub(crate) restarts: Vec<ReplicaRestarts>,
    /// The status lines of replicas waiting out their backoff.
    pub(crate) waiting: Vec<String>,
    /// The demand judged: `serving.requestsPerSecond`, or the demand
    /// measured (planned for, before the first read).
    pub(crate) demand: Option<f64>,
    /// Where a measured demand stands (`status.demand`).
    pub(crate) measured_demand: Option<MeasuredDemand>,
    /// The `DemandFollowed` condition (status, reason, message), with a
    /// measured demand.
    pub(crate) demand_followed: Option<(&'static str, &'static str, String)>,
    /// The move in flight, if any (`status.moves`).
    pub(crate) moves: Vec<MoveInFlight>,
    /// The `OnCordonedNode` condition's reason and message, when present.
    pub(crate) cordoned: Option<(&'static str, String)>,
    /// What the replicas' runtimes were last measured serving, by replica.
    pub(crate) measured: Option<&'a BTreeMap<u32, ReplicaMeasure>>,
    /// What the predictions were measured off by, learned
    /// (`status.corrections`).
    pub(crate) corrections: Vec<ServingCorrection>,
    pub(crate) now: Timestamp,
}

pub(crate) fn compute(inputs: &StatusInputs) -> ModelInstanceStatus {
    let numbers: Vec<u32> = inputs.replicas.iter().map(|r| r.replica).collect();
    let replicas: Vec<(Verdict, ShardCounts)> = inputs
        .replicas
        .iter()
        .map(|replica| {
            let counts = ShardCounts::of(replica.shards);
            (replica_verdict(replica, &counts, inputs), counts)
        })
        .collect();
    let replica_count = replicas.len() as u32;
    let ready_replicas = replicas
        .iter()
        .filter(|(_, counts)| counts.all_ready())
        .count() as u32;
    let running_replicas = replicas
        .iter()
        .filter(|(_, counts)| counts.total > 0 && counts.bound == counts.total)
        .count() as u32;
    let ready_shards = replicas.iter().map(|(_, counts)| counts.ready).sum();
    let invalid = inputs
        .replicas
        .iter()
        .any(|replica| matches!(replica.outcome, Outcome::Invalid { .. }));
    let ready: Vec<bool> = replicas
        .iter()
        .map(|(_, counts)| counts.all_ready())
        .collect();
    let capacities: Vec<Option<&ReplicaCapacity>> = inputs
        .replicas
        .iter()
        .map(|replica| match replica.outcome {
            Outcome::Placed { capacity, .. } => capacity.as_ref(),
            _ => None,
        })
        .collect();
    let mut measured = measured::measured(inputs.measured);
    let replica_predictions = replicas
        .iter()
        .zip(&capacities)
        .zip(&numbers)
        .filter_map(|(((verdict, _), capacity), &replica)| {
            Some(ReplicaPrediction {
                replica,
                tokens_per_second: tenths(verdict.tokens_per_second?),
                capacity: capacity.cloned(),
                measured: measured.replicas.remove(&replica),
            })
        })
        .collect();
    let placed_capacities: Vec<ReplicaCapacity> =
        capacities.iter().flatten().map(|c| (*c).clone()).collect();
    let capacity = if invalid {
        None
    } else {
        instance_capacity(&placed_capacities, inputs.demand)
    };
    let verdict = merge::verdict(replicas, &numbers);
    let previous_conditions = inputs
        .previous
        .map(|status| status.conditions.as_slice())
        .unwrap_or(&[]);
    let conditions = [
        (PLACED, verdict.placed),
        (READY, verdict.ready),
        (PROGRESSING, verdict.progressing),
    ]
    .into_iter()
    .chain(replica_failure(inputs))
    .chain(demand_met(
        inputs,
        capacity.as_ref(),
        (&numbers, &capacities),
        &ready,
    ))
    .chain(
        inputs
            .cordoned
            .clone()
            .map(|(reason, message)| (ON_CORDONED_NODE, ("True", reason, message))),
    )
    .chain(measured.condition)
    .chain(
        inputs
            .demand_followed
            .clone()
            .map(|condition| (DEMAND_FOLLOWED, condition)),
    )
    .map(|(type_, (status, reason, message))| {
        condition(
            previous_conditions,
            type_,
            status,
            reason,
            message,
            inputs.generation,
            inputs.now,
        )
    })
    .collect();
    let has_plan = !verdict.plan.is_empty() || (replica_count == 0 && !invalid);
    ModelInstanceStatus {
        phase: Some(verdict.phase),
        observed_generation: inputs.generation,
        conditions,
        shards: verdict.plan.len() as u32,
        ready_shards,
        replicas: if invalid { 0 } else { running_replicas },
        ready_replicas,
        selector: inputs.selector.clone(),
        plan: verdict.plan,
        predicted_tokens_per_second: verdict.tokens_per_second.map(tenths),
        replica_predictions,
        capacity,
        message: Some(verdict.message),
        placement_hash: if invalid || !has_plan {
            None
        } else {
            inputs.placement_hash.clone()
        },
        restarts: inputs.restarts.clone(),
        moves: inputs.moves.clone(),
        measured: measured.instance,
        corrections: inputs.corrections.clone(),
        demand: inputs.measured_demand.clone(),
    }
}

/// A speed as the status shows it: to a tenth of a token per second.
fn tenths(tokens_per_second: f64) -> f64 {
    (tokens_per_second * 10.0).round() / 10.0
}

/// The `ReplicaFailure` condition, while any replica's recreations are
/// counted.
fn replica_failure(inputs: &StatusInputs) -> Option<(&'static str, ConditionText)> {
    if !inputs.waiting.is_empty() {
        return Some((
            REPLICA_FAILURE,
            ("True", "BackOff", inputs.waiting.join("; ")),
        ));
    }
    let counted: Vec<String> = inputs
        .restarts
        .iter()
        .map(|r| {
            format!(
                "replica {} recreated {} time{} in a row",
                r.replica,
                r.count,
                if r.count == 1 { "" } else { "s" }
            )
        })
        .collect();
    (!counted.is_empty()).then(|| {
        (
            REPLICA_FAILURE,
            (
                "False",
                "Recreated",
                format!("{}; counted until ready for 10 minutes", counted.join("; ")),
            ),
        )
    })
}

/// The `DemandMet` condition, when the instance has a demand: met when its
/// ready replicas serve it at the target; `ReplicasStarting` while replicas
/// placed to serve it are not all ready yet; otherwise what they serve and
/// the first reason they do not serve more.
fn demand_met(
    inputs: &StatusInputs,
    capacity: Option<&InstanceCapacity>,
    (numbers, per_replica): (&[u32], &[Option<&ReplicaCapacity>]),
    ready: &[bool],
) -> Option<(&'static str, ConditionText)> {
    let demand = inputs.demand?;
    let served = capacity.map_or(0.0, |c| c.requests_per_second);
    let replicas = per_replica.len();
    let plural = if replicas == 1 { "" } else { "s" };
    let starting = ready.iter().filter(|ready| !**ready).count();
    if served >= demand && starting > 0 {
        let ready_served: Vec<f64> = per_replica
            .iter()
            .zip(ready)
            .filter(|(_, ready)| **ready)
            .map(|(c, _)| c.map_or(0.0, |c| c.requests_per_second))
            .collect();
        let now = tessera_core::sizing::served_together(&ready_served);
        if now < demand {
            return Some((
                DEMAND_MET,
                (
                    "False",
                    "ReplicasStarting",
                    format!(
                        "{replicas} replica{plural} serve {served} requests/s at the target once {starting} more are ready (the ready ones {}); the demand is {demand}",
                        (now * 100.0).round() / 100.0
                    ),
                ),
            ));
        }
    }
    if served >= demand {
        return Some((
            DEMAND_MET,
            (
                "True",
                "DemandMet",
                format!(
                    "{replicas} replica{plural} serve {served} requests/s at the target; the demand is {demand}"
                ),
            ),
        ));
    }
    let why = numbers
        .iter()
        .zip(per_replica)
        .find_map(|(index, capacity)| match capacity {
            None => Some(format!("replica {index} has no plan or no prediction")),
            Some(c) => c
                .target_missed
                .as_ref()
                .map(|miss| format!("replica {index} misses the target: {miss}")),
        })
        .unwrap_or_else(|| {
            format!(
                "more replicas than {replicas} are not placed (at most {} for a demand, or the cluster is full)",
                tessera_core::api::limits::DEMAND_REPLICAS.max
            )
        });
    Some((
        DEMAND_MET,
        (
            "False",
            "DemandNotMet",
            format!(
                "{replicas} replica{plural} serve {served} of {demand} requests/s at the target: {why}"
            ),
        ),
    ))
}

/// One replica's verdict from its outcome and shards.
fn replica_verdict(status: &ReplicaStatus, counts: &ShardCounts, inputs: &StatusInputs) -> Verdict {
    match status.outcome {
        Outcome::Invalid { problems } => invalid(problems),
        Outcome::Unsatisfiable {
            explanation,
            plan,
            lost,
        } => unsatisfiable(explanation, plan, lost, counts, inputs.previous),
        Outcome::Placed {
            plan,
            tokens_per_second,
            replanned,
            ..
        } => {
            // Only a replica that had pods before can have been serving.
            let had_plan = inputs
                .previous
                .is_some_and(|previous| previous.plan.iter().any(|s| s.replica == status.replica));
            placed(
                plan,
                *tokens_per_second,
                replanned,
                counts,
                inputs.previous.filter(|_| had_plan),
            )
        }
    }
}

/// A condition's status, reason and message.
type ConditionText = (&'static str, &'static str, String);

/// What the status says, before the conditions get their transition times.
struct Verdict {
    phase: Phase,
    placed: ConditionText,
    ready: ConditionText,
    progressing: ConditionText,
    plan: Vec<PlannedShard>,
    tokens_per_second: Option<f64>,
    message: String,
}

/// How many shards there are and how far they got.
#[derive(Clone, Copy)]
struct ShardCounts {
    total: u32,
    ready: u32,
    /// Bound to their node, ready or not.
    bound: u32,
    missing: u32,
}

impl ShardCounts {
    fn of(shards: &[ShardState]) -> Self {
        let count = |wanted: &dyn Fn(&ShardState) -> bool| {
            shards.iter().filter(|state| wanted(state)).count() as u32
        };
        Self {
            total: shards.len() as u32,
            ready: count(&|state| *state == ShardState::Ready),
            bound: count(&|state| matches!(state, ShardState::Bound | ShardState::Ready)),
            missing: count(&|state| *state == ShardState::Missing),
        }
    }

    fn all_ready(&self) -> bool {
        self.total > 0 && self.ready == self.total
    }
}

fn invalid(problems: &[String]) -> Verdict {
    let text = format!("invalid spec: {}", problems.join("; "));
    Verdict {
        phase: Phase::Failed,
        placed: ("False", "InvalidSpec", text.clone()),
        ready: ("False", "InvalidSpec", "the spec cannot run".to_string()),
        progressing: (
            "False",
            "InvalidSpec",
            "fix the spec to continue".to_string(),
        ),
        plan: Vec::new(),
        tokens_per_second: None,
        message: text,
    }
}

/// No plan; a running plan that lost shards which could not move is kept.
fn unsatisfiable(
    explanation: &str,
    kept: &[PlannedShard],
    lost: &[String],
    counts: &ShardCounts,
    previous: Option<&ModelInstanceStatus>,
) -> Verdict {
    let text = if lost.is_empty() {
        format!("no placement: {explanation}")
    } else {
        format!(
            "lost shards could not be re-placed ({}): {explanation}",
            lost.join("; ")
        )
    };
    Verdict {
        phase: if kept.is_empty() {
            Phase::Pending
        } else {
            Phase::Degraded
        },
        placed: ("False", "Unsatisfiable", text.clone()),
        ready: ready_condition(counts.ready, counts.total.max(kept.len() as u32)),
        progressing: (
            "False",
            "Unsatisfiable",
            "waiting for the cluster to change".to_string(),
        ),
        plan: kept.to_vec(),
        tokens_per_second: previous
            .and_then(|status| status.predicted_tokens_per_second)
            .filter(|_| !kept.is_empty()),
        message: text,
    }
}

fn placed(
    plan: &[PlannedShard],
    tokens_per_second: Option<f64>,
    replanned: &[String],
    counts: &ShardCounts,
    previous: Option<&ModelInstanceStatus>,
) -> Verdict {
    let nodes: std::collections::BTreeSet<&str> =
        plan.iter().map(|shard| shard.node.as_str()).collect();
    let where_ = format!(
        "{} shard{} on {}",
        plan.len(),
        if plan.len() == 1 { "" } else { "s" },
        nodes.into_iter().collect::<Vec<_>>().join(", ")
    );
    let placed = if replanned.is_empty() {
        ("True", "Planned", where_.clone())
    } else {
        (
            "True",
            "Replanned",
            format!("{where_}; moved: {}", replanned.join("; ")),
        )
    };
    let was_serving = matches!(
        previous.and_then(|status| status.phase),
        Some(Phase::Running | Phase::Degraded)
    );
    let phase = if counts.all_ready() {
        Phase::Running
    } else if was_serving {
        Phase::Degraded
    } else if counts.total > 0 && counts.bound == counts.total {
        Phase::Bound
    } else {
        Phase::Placing
    };
    let progressing = progress(counts);
    let message = match phase {
        Phase::Running => format!("{where_}, all ready"),
        _ => progressing.2.clone(),
    };
    Verdict {
        phase,
        placed,
        ready: ready_condition(counts.ready, counts.total),
        progressing,
        plan: plan.to_vec(),
        tokens_per_second,
        message,
    }
}

/// How far a placed instance's shards got.
fn progress(counts: &ShardCounts) -> ConditionText {
    let ShardCounts {
        total,
        ready,
        bound,
        missing,
    } = *counts;
    if counts.all_ready() {
        ("False", "Settled", "every shard is ready".to_string())
    } else if missing > 0 {
        (
            "True",
            "CreatingShards",
            format!("{} of {total} shard pods exist", total - missing),
        )
    } else if bound < total {
        (
            "True",
            "BindingShards",
            format!("{bound} of {total} shards bound"),
        )
    } else {
        (
            "True",
            "WaitingForShards",
            format!("{ready} of {total} shards ready"),
        )
    }
}

fn ready_condition(ready: u32, total: u32) -> ConditionText {
    if total > 0 && ready == total {
        (
            "True",
            "AllShardsReady",
            format!("{ready} of {total} shards ready"),
        )
    } else {
        (
            "False",
            "ShardsNotReady",
            format!("{ready} of {total} shards ready"),
        )
    }
}

/// A condition that keeps its transition time while its status stays the same.
fn condition(
    previous: &[Condition],
    type_: &str,
    status: &str,
    reason: &str,
    message: String,
    generation: Option<i64>,
    now: Timestamp,
) -> Condition {
    let since = previous
        .iter()
        .find(|c| c.type_ == type_ && c.status == status)
        .map(|c| c.last_transition_time.clone())
        .unwrap_or(Time(now));
    Condition {
        type_: type_.to_string(),
        status: status.to_string(),
        reason: reason.to_string(),
        message,
        observed_generation: generation,
        last_transition_time: since,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::controller::testkit::now;

    fn shard(i: u32) -> PlannedShard {
        PlannedShard {
            copy: 0,
            replica: 0,
            shard: i,
            node: format!("n{i}"),
            devices: vec![format!("n{i}-g0")],
            layer_start: i * 10,
            layer_end: i * 10 + 10,
            predicted_memory_gib: 20.0,
            share: None,
        }
    }

    fn placed() -> Outcome {
        Outcome::Placed {
            plan: vec![shard(0), shard(1)],
            tokens_per_second: Some(41.26),
            replanned: vec![],
            capacity: None,
            started_with: None,
        }
    }

    fn compute_with(
        previous: Option<&ModelInstanceStatus>,
        outcome: &Outcome,
        shards: &[ShardState],
    ) -> ModelInstanceStatus {
        compute(&StatusInputs {
            previous,
            generation: Some(3),
            placement_hash: Some("h".into()),
            replicas: &[ReplicaStatus {
                replica: 0,
                outcome,
                shards,
            }],
            selector: None,
            restarts: Vec::new(),
            waiting: Vec::new(),
            demand: None,
            moves: Vec::new(),
            cordoned: None,
            measured: None,
            corrections: Vec::new(),
            measured_demand: None,
            demand_followed: None,
            now: now(),
        })
    }

    fn cond<'a>(s: &'a ModelInstanceStatus, t: &str) -> &'a Condition {
        s.conditions.iter().find(|c| c.type_ == t).unwrap()
    }

    #[test]
    fn phases_follow_the_shards() {
        use ShardState::*;
        let cases = [
            (vec![Missing, Created], Phase::Placing, "CreatingShards"),
            (vec![Created, Created], Phase::Placing, "BindingShards"),
            (vec![Bound, Ready], Phase::Bound, "WaitingForShards"),
            (vec![Ready, Ready], Phase::Running, "Settled"),
        ];
        for (shards, phase, progressing) in cases {
            let s = compute_with(None, &placed(), &shards);
            assert_eq!(s.phase, Some(phase), "{shards:?}");
            assert_eq!(cond(&s, PROGRESSING).reason, progressing);
            assert_eq!(s.observed_generation, Some(3));
            assert_eq!(s.shards, 2);
            assert_eq!(s.plan.len(), 2);
            assert_eq!(s.predicted_tokens_per_second, Some(41.3));
            assert_eq!(s.placement_hash.as_deref(), Some("h"));
            assert_eq!(cond(&s, PLACED).status, "True");
        }
        let running = compute_with(None, &placed(), &[Ready, Ready]);
        assert_eq!(cond(&running, READY).status, "True");
        assert_eq!(running.ready_shards, 2);
        // A running instance that loses a shard is Degraded until it is back.
        let s = compute_with(Some(&running), &placed(), &[Ready, Missing]);
        assert_eq!(s.phase, Some(Phase::Degraded));
        assert_eq!(cond(&s, READY).message, "1 of 2 shards ready");
    }

    #[test]
    fn unsatisfiable_is_pending_with_the_reason() {
        let outcome = Outcome::Unsatisfiable {
            explanation: "shard 0 needs 120.0 GiB; the largest free device is 80.0 GiB".into(),
            plan: vec![],
            lost: vec![],
        };
        let s = compute_with(None, &outcome, &[]);
        assert_eq!(s.phase, Some(Phase::Pending));
        let placed = cond(&s, PLACED);
        assert_eq!(
            (placed.status.as_str(), placed.reason.as_str()),
            ("False", "Unsatisfiable")
        );
        assert!(placed.message.contains("largest free device"));
        assert!(s.plan.is_empty());
        assert_eq!(s.placement_hash, None, "no plan was made for this spec");
        // Lost shards that cannot move: the rest stays, Degraded.
        let lost = Outcome::Unsatisfiable {
            explanation: "no room".into(),
            plan: vec![shard(0), shard(1)],
            lost: vec!["shard 1: node n1 is gone".into()],
        };
        let s = compute_with(None, &lost, &[ShardState::Ready, ShardState::Missing]);
        assert_eq!(s.phase, Some(Phase::Degraded));
        assert!(
            cond(&s, PLACED)
                .message
                .contains("shard 1: node n1 is gone")
        );
        assert_eq!(s.plan.len(), 2);
    }

    #[test]
    fn invalid_specs_fail_with_every_problem() {
        let outcome = Outcome::Invalid {
            problems: vec!["template: missing".into(), "model.layers: zero".into()],
        };
        let s = compute_with(None, &outcome, &[]);
        assert_eq!(s.phase, Some(Phase::Failed));
        let c = cond(&s, PLACED);
        assert_eq!(c.reason, "InvalidSpec");
        assert!(c.message.contains("template: missing; model.layers: zero"));
    }

    #[test]
    fn transition_times_stay_while_the_status_stays() {
        let first = compute_with(None, &placed(), &[ShardState::Ready, ShardState::Ready]);
        let outcome = placed();
        let later = |shards: &[ShardState]| {
            compute(&StatusInputs {
                previous: Some(&first),
                generation: Some(3),
                placement_hash: Some("h".into()),
                replicas: &[ReplicaStatus {
                    replica: 0,
                    outcome: &outcome,
                    shards,
                }],
                selector: None,
                restarts: Vec::new(),
                waiting: Vec::new(),
                demand: None,
                moves: Vec::new(),
                cordoned: None,
                measured: None,
                corrections: Vec::new(),
                measured_demand: None,
                demand_followed: None,
                now: "2026-06-01T13:00:00Z".parse().unwrap(),
            })
        };
        assert_eq!(
            later(&[ShardState::Ready, ShardState::Ready]),
            first,
            "a settled instance's status does not change"
        );
        let s = later(&[ShardState::Ready, ShardState::Bound]);
        assert_eq!(
            cond(&s, PLACED).last_transition_time,
            cond(&first, PLACED).last_transition_time
        );
        assert_ne!(
            cond(&s, READY).last_transition_time,
            cond(&first, READY).last_transition_time
        );
    }

    fn replica_shard(replica: u32, i: u32) -> PlannedShard {
        PlannedShard {
            replica,
            ..shard(i)
        }
    }

    fn replicas_status(
        previous: Option<&ModelInstanceStatus>,
        replicas: &[(Outcome, Vec<ShardState>)],
    ) -> ModelInstanceStatus {
        let statuses: Vec<ReplicaStatus> = replicas
            .iter()
            .zip(0..)
            .map(|((outcome, shards), replica)| ReplicaStatus {
                replica,
                outcome,
                shards,
            })
            .collect();
        compute(&StatusInputs {
            previous,
            generation: Some(4),
            placement_hash: Some("h".into()),
            replicas: &statuses,
            selector: Some("tessera.dev/instance=m".into()),
            restarts: Vec::new(),
            waiting: Vec::new(),
            demand: None,
            moves: Vec::new(),
            cordoned: None,
            measured: None,
            corrections: Vec::new(),
            measured_demand: None,
            demand_followed: None,
            now: now(),
        })
    }

    fn placed_replica(replica: u32) -> Outcome {
        Outcome::Placed {
            plan: vec![replica_shard(replica, 0)],
            tokens_per_second: Some(10.0),
            replanned: vec![],
            capacity: None,
            started_with: None,
        }
    }

    #[test]
    fn replicas_count_how_many_of_how_many_got_how_far() {
        use ShardState::*;
        let all_ready = replicas_status(
            None,
            &[
                (placed_replica(0), vec![Ready]),
                (placed_replica(1), vec![Ready]),
                (placed_replica(2), vec![Ready]),
            ],
        );
        assert_eq!(all_ready.phase, Some(Phase::Running));
        assert_eq!((all_ready.replicas, all_ready.ready_replicas), (3, 3));
        assert_eq!((all_ready.shards, all_ready.ready_shards), (3, 3));
        assert_eq!(all_ready.plan.len(), 3);
        assert_eq!(
            all_ready.predicted_tokens_per_second,
            Some(30.0),
            "replicas add up"
        );
        assert_eq!(
            all_ready
                .replica_predictions
                .iter()
                .map(|p| (p.replica, p.tokens_per_second))
                .collect::<Vec<_>>(),
            [(0, 10.0), (1, 10.0), (2, 10.0)]
        );
        assert_eq!(
            all_ready.selector.as_deref(),
            Some("tessera.dev/instance=m")
        );
        assert_eq!(cond(&all_ready, READY).reason, "AllReplicasReady");
        assert_eq!(
            cond(&all_ready, PLACED).message,
            "3 replicas placed: 3 shards on 1 node"
        );

        // A replica that cannot be placed leaves the others running.
        let partial = replicas_status(
            Some(&all_ready),
            &[
                (placed_replica(0), vec![Ready]),
                (placed_replica(1), vec![Ready]),
                (
                    Outcome::Unsatisfiable {
                        explanation: "no free GPU".into(),
                        plan: vec![],
                        lost: vec![],
                    },
                    vec![],
                ),
            ],
        );
        assert_eq!(partial.phase, Some(Phase::Degraded));
        assert_eq!((partial.replicas, partial.ready_replicas), (2, 2));
        let placed = cond(&partial, PLACED);
        assert_eq!(
            (placed.status.as_str(), placed.reason.as_str()),
            ("False", "Unsatisfiable")
        );
        assert_eq!(
            placed.message,
            "2 of 3 replicas placed; replica 2: no placement: no free GPU"
        );
        assert_eq!(
            partial.message.as_deref(),
            Some("2 of 3 replicas running; replica 2: no placement: no free GPU")
        );
        assert_eq!(
            cond(&partial, READY).message,
            "2 of 3 replicas ready (2 of 2 shards)"
        );
        assert_eq!(partial.placement_hash.as_deref(), Some("h"));

        // Still starting: the least advanced replica sets the phase.
        let starting = replicas_status(
            None,
            &[
                (placed_replica(0), vec![Bound]),
                (placed_replica(1), vec![Created]),
            ],
        );
        assert_eq!(starting.phase, Some(Phase::Placing));
        assert_eq!(
            cond(&starting, PROGRESSING).message,
            "replica 0: 0 of 1 shards ready"
        );
        assert_eq!(starting.replicas, 1, "one replica has every shard bound");
    }

    #[test]
    fn zero_replicas_is_settled_with_nothing_planned() {
        let s = replicas_status(None, &[]);
        assert_eq!(s.phase, Some(Phase::Pending));
        assert_eq!((s.replicas, s.ready_replicas, s.shards), (0, 0, 0));
        assert_eq!(cond(&s, PLACED).reason, "ScaledToZero");
        assert_eq!(s.message.as_deref(), Some("scaled to zero replicas"));
        assert_eq!(s.placement_hash.as_deref(), Some("h"));
    }

    #[test]
    fn a_demand_is_said_met_or_not_with_what_the_replicas_serve() {
        let capacity = |rps: f64| ReplicaCapacity {
            concurrency: 50,
            requests_per_second: rps,
            output_tokens_per_second: rps * 256.0,
            tpot_ms: 40.0,
            ttft_ms: 200.0,
            target_missed: None,
            correction: None,
        };
        let outcome = |rps: f64| Outcome::Placed {
            plan: vec![shard(0)],
            tokens_per_second: Some(40.0),
            replanned: vec![],
            capacity: Some(capacity(rps)),
            started_with: None,
        };
        let (first, second) = (outcome(4.0), outcome(3.0));
        let shards = [ShardState::Ready];
        let status_with = |demand: Option<f64>, second_shards: &[ShardState]| {
            compute(&StatusInputs {
                previous: None,
                generation: Some(1),
                placement_hash: Some("h".into()),
                replicas: &[
                    ReplicaStatus {
                        replica: 0,
                        outcome: &first,
                        shards: &shards,
                    },
                    ReplicaStatus {
                        replica: 1,
                        outcome: &second,
                        shards: second_shards,
                    },
                ],
                selector: None,
                restarts: Vec::new(),
                waiting: Vec::new(),
                demand,
                moves: Vec::new(),
                cordoned: None,
                measured: None,
                corrections: Vec::new(),
                measured_demand: demand.map(|rps| MeasuredDemand {
                    planned_requests_per_second: rps * 1.2,
                    measured_requests_per_second: Some(rps),
                    lower_since: None,
                    lower_peak: None,
                    last_change: None,
                    spec_replicas: None,
                }),
                demand_followed: demand.map(|_| ("True", "Following", "measured".to_string())),
                now: now(),
            })
        };
        let status_for = |demand: Option<f64>| status_with(demand, &shards);
        let met = status_for(Some(5.0));
        assert_eq!(cond(&met, DEMAND_FOLLOWED).reason, "Following");
        assert_eq!(
            met.demand.as_ref().map(|d| d.planned_requests_per_second),
            Some(6.0)
        );
        // Placed to serve it, but one is still starting: not met yet.
        let starting = status_with(Some(5.0), &[ShardState::Created]);
        let condition = cond(&starting, DEMAND_MET);
        assert_eq!(
            (condition.status.as_str(), condition.reason.as_str()),
            ("False", "ReplicasStarting"),
            "{}",
            condition.message
        );
        let together = met.capacity.as_ref().expect("a capacity");
        assert_eq!(together.requests_per_second, 6.0, "two × the slowest");
        assert_eq!(together.demand_requests_per_second, Some(5.0));
        assert_eq!(met.replica_predictions[1].capacity, Some(capacity(3.0)));
        let condition = cond(&met, DEMAND_MET);
        assert_eq!(
            (condition.status.as_str(), condition.reason.as_str()),
            ("True", "DemandMet")
        );
        let unmet = status_for(Some(8.0));
        let condition = cond(&unmet, DEMAND_MET);
        assert_eq!(condition.status, "False");
        assert!(
            condition
                .message
                .starts_with("2 replicas serve 6 of 8 requests/s at the target"),
            "{}",
            condition.message
        );
        let without = status_for(None);
        assert!(without.conditions.iter().all(|c| c.type_ != DEMAND_MET));
        assert!(
            without.capacity.is_some(),
            "capacity is said without a demand too"
        );
    }
}
