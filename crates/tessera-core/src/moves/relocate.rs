//! A candidate carried out, make before break: the devices the blocked
//! replica is to get are held for it, then each replica in its way is
//! placed elsewhere on what is free at that step (its old devices are still
//! its own) and only then leaves them. By the cluster objective (placing the
//! blocked replica comes before any replica's headroom), a replica may go
//! wherever it still meets the latency target it meets and its instance
//! still meets its demand, even where it serves less; one that meets no
//! target goes nowhere slower alone.

use std::collections::BTreeSet;

use super::room::Candidate;
use super::world::{World, nodes_of};
use super::{Move, MoveAsk, MovePlan, RunningReplica};
use crate::api::{ModelInstanceSpec, PipelineStages, PlannedShard, TensorSize};
use crate::objective::InstanceStanding;
use crate::placement::Plan;
use crate::serving::Capacity;
use crate::sizing::{TensorChoice, solve_parallelism};
use crate::translate::{judge_placed, planned_shards, tensor_choice};

/// Relative slack in comparing what a replica serves before and after a
/// move: the same devices elsewhere predict the same figures up to rounding.
const SAME_WORTH: f64 = 1e-9;

/// Why a candidate could not be carried out, and the replica in its way
/// that has nowhere as good to go (if one has).
pub(crate) struct Failure {
    pub(crate) reason: String,
    pub(crate) stuck: Option<usize>,
    /// The stuck replica has no place even on every device free before any
    /// room is held: no replica of its shape can move, for any candidate.
    pub(crate) alike: bool,
}

/// The moves that carry `candidate` out, or why one of them cannot be made.
pub(crate) fn carry_out(
    ask: &MoveAsk<'_>,
    world: &World<'_>,
    candidate: &Candidate,
) -> Result<MovePlan, Failure> {
    let names: Vec<&str> = candidate
        .in_the_way
        .iter()
        .map(|&index| ask.running[index].holder.as_str())
        .collect();
    let prefix = format!(
        "{} fits on {} by moving {} replica(s) ({})",
        ask.blocked_name,
        candidate.nodes(),
        names.len(),
        names.join(", ")
    );
    let mut now = world.clone();
    now.hold_for_blocked(&candidate.placed.plan);
    // The largest first: the hardest to place, while the most is free.
    let mut order: Vec<usize> = candidate.in_the_way.iter().copied().collect();
    order.sort_by(|a, b| {
        let gpus = |index: &usize| ask.running[*index].gpus();
        gpus(b).total_cmp(&gpus(a)).then(a.cmp(b))
    });
    // Should the room made not hold it after all, the last replica moved for
    // it stays next time.
    let last_moved = order.last().copied();
    let mut moves = Vec::new();
    // What replicas moved so far serve where they went: their instance's
    // demand is judged with it.
    let mut moved_worth: Vec<Option<Worth>> = vec![None; ask.running.len()];
    for index in order {
        let replica = &ask.running[index];
        let from = now.shards_of(index).unwrap_or_default().to_vec();
        // Judged before the room is held: the room may be its devices.
        let before = worth_where_it_is(world, index);
        let (spec, tensor) = same_shape(replica.spec, &from);
        let placed = solve_parallelism(
            &now.problem(&spec, replica.corrections, None),
            tensor,
            ask.options,
        )
        .map_err(|refusal| Failure {
            reason: format!(
                "{prefix}, but no free devices hold {}: {}",
                replica.holder, refusal.reason
            ),
            stuck: Some(index),
            // Another 405B in the way of a 405B, say: one solve on all
            // that is free tells the planner not to try its like again.
            alike: solve_parallelism(
                &world.problem(&spec, replica.corrections, None),
                tensor,
                ask.options,
            )
            .is_err(),
        })?;
        let after = Worth::of(placed.capacity.as_ref(), &placed.plan);
        let worth_of = |sibling: usize| {
            moved_worth[sibling].unwrap_or_else(|| worth_where_it_is(world, sibling))
        };
        if let Err(lost) = move_keeps(ask.running, index, (before, after), worth_of) {
            return Err(Failure {
                reason: format!("{prefix}, but {lost}"),
                stuck: Some(index),
                alike: false,
            });
        }
        moved_worth[index] = Some(after);
        moves.push(settle(&mut now, index, from, &placed.plan, (before, after)));
    }
    now.release_blocked();
    let scope = nodes_of(&candidate.placed.plan);
    let placed = solve_parallelism(
        &now.problem(ask.blocked, ask.blocked_corrections, Some(&scope)),
        tensor_choice(ask.blocked),
        ask.options,
    )
    .map_err(|refusal| Failure {
        reason: format!("{prefix}, but the room made does not hold it: {refusal}"),
        stuck: last_moved,
        alike: false,
    })?;
    Ok(MovePlan {
        gpus_moved: moves.iter().fold(0.0, |sum, m| sum + m.gpus),
        moves,
        placed,
    })
}

/// Whether replica `index` of `running`, moved from where it is worth
/// `before` to where it is worth `after`, keeps what the cluster objective
/// puts above headroom: the latency target it meets, and its instance's
/// demand (judged with its other replicas, worth `worth_of`). One that
/// meets no target may go nowhere slower alone. The error says what it
/// would lose, in words.
pub(crate) fn move_keeps(
    running: &[RunningReplica<'_>],
    index: usize,
    (before, after): (Worth, Worth),
    worth_of: impl Fn(usize) -> Worth,
) -> Result<(), String> {
    let replica = &running[index];
    if before.requests_per_second <= 0.0 {
        return if after.tokens_per_second >= before.tokens_per_second * (1.0 - SAME_WORTH) {
            Ok(())
        } else {
            Err(format!(
                "{} meets no latency target and would be slower elsewhere: {} against {} where it is",
                replica.holder,
                after.words(),
                before.words()
            ))
        };
    }
    if after.requests_per_second <= 0.0 {
        return Err(format!(
            "{} would miss its latency target elsewhere: {} against {} where it is",
            replica.holder,
            after.words(),
            before.words()
        ));
    }
    // Serving no less, it cannot take its instance below a demand.
    let demanded = replica
        .spec
        .serving
        .as_ref()
        .is_some_and(|s| s.requests_per_second.is_some());
    if !demanded || after.requests_per_second >= before.requests_per_second {
        return Ok(());
    }
    let siblings: Vec<usize> = (0..running.len())
        .filter(|&other| other != index && running[other].instance == replica.instance)
        .collect();
    let standing = |this: Worth| {
        let mut per_replica: Vec<f64> = siblings
            .iter()
            .map(|&sibling| worth_of(sibling).requests_per_second)
            .collect();
        per_replica.push(this.requests_per_second);
        InstanceStanding::new(replica.spec, per_replica.len(), per_replica, 0.0)
    };
    standing(after).keeps(&standing(before)).map_err(|lost| {
        if replica.holder == replica.instance {
            format!(
                "{} would fall short of its demand elsewhere: {lost}",
                replica.holder
            )
        } else {
            format!(
                "moving {} would leave {} short: {lost}",
                replica.holder, replica.instance
            )
        }
    })
}

/// Replica `index` of `now` moved from `from` onto `plan`, which it was
/// worth `before` and `after`: it runs there now, and the move made says so.
pub(crate) fn settle(
    now: &mut World<'_>,
    index: usize,
    from: Vec<PlannedShard>,
    plan: &Plan,
    (before, after): (Worth, Worth),
) -> Move {
    let replica = &now.running()[index];
    let to = planned_shards(plan, from.first().map_or(0, |s| s.replica));
    let moved = Move {
        replica: replica.holder.clone(),
        from,
        to: to.clone(),
        gpus: replica.gpus(),
        requests_per_second_before: before.requests_per_second,
        requests_per_second_after: after.requests_per_second,
    };
    now.settle(index, to);
    moved
}

/// What makes replicas alike to the planner: the spec in its shape as it
/// runs (replicas of one key go wherever any of them goes).
pub(crate) fn shape_key(replica: &RunningReplica<'_>) -> String {
    serde_json::to_string(&same_shape(replica.spec, &replica.shards).0).unwrap_or_default()
}

/// The spec as it runs now: a move takes the replica elsewhere as it is
/// (its tensor size and stage count), it does not resize it.
pub(crate) fn same_shape(
    spec: &ModelInstanceSpec,
    shards: &[PlannedShard],
) -> (ModelInstanceSpec, TensorChoice) {
    let tensor = shards
        .first()
        .map_or(1, |shard| (shard.devices.len() as u32).max(1));
    let mut spec = spec.clone();
    spec.parallelism.tensor = TensorSize::Fixed(tensor);
    spec.parallelism.pipeline = PipelineStages::Fixed((shards.len() as u32).max(1));
    (spec, TensorChoice::Fixed(tensor))
}

/// What a replica is worth where it stands: requests/s at its target, then
/// (where it meets no target) one stream's tokens/s.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Worth {
    pub(crate) requests_per_second: f64,
    tokens_per_second: f64,
}

impl Worth {
    pub(crate) fn of(capacity: Option<&Result<Capacity, String>>, plan: &Plan) -> Worth {
        Worth {
            requests_per_second: capacity
                .and_then(|c| c.as_ref().ok())
                .and_then(|c| c.at_slo)
                .map_or(0.0, |at| at.requests_per_second),
            tokens_per_second: plan.performance.tokens_per_second,
        }
    }

    /// Whether it still meets a latency target `before` meets (it may serve
    /// less at it).
    pub(crate) fn keeps_target_of(&self, before: &Worth) -> bool {
        before.requests_per_second <= 0.0 || self.requests_per_second > 0.0
    }

    pub(crate) fn words(&self) -> String {
        format!(
            "{:.2} requests/s at its target ({:.1} tokens/s alone)",
            self.requests_per_second, self.tokens_per_second
        )
    }
}

/// Replica `index`'s worth on its devices now, judged as a move's target
/// is: on the cluster as the others leave it (a memory share beside the
/// tenants there). Nothing when its devices cannot be read (a node gone).
pub(crate) fn worth_where_it_is(world: &World<'_>, index: usize) -> Worth {
    let Some(shards) = world.shards_of(index) else {
        return Worth::default();
    };
    let replica = &world.running()[index];
    let scope: BTreeSet<String> = shards.iter().map(|s| s.node.clone()).collect();
    let problem = world.without(&BTreeSet::from([index])).problem(
        replica.spec,
        replica.corrections,
        Some(&scope),
    );
    let refs: Vec<&PlannedShard> = shards.iter().collect();
    match judge_placed(problem, &refs) {
        Ok((plan, capacity)) => Worth::of(Some(&capacity), &plan),
        Err(_) => Worth::default(),
    }
}
