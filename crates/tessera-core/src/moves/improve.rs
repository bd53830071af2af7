//! Improvements, for continuous moves: nothing is blocked, but a replica
//! serves more at its target elsewhere. Either devices free now serve it
//! better (it was placed when they were taken), or devices another replica
//! holds do and that one still meets its target on free devices (an 8B on
//! an MI300X that a 70B replica on slower GPUs could use). Make before break
//! like every move: each new copy goes to devices free at its step. Only
//! headroom is at stake here (nothing is blocked), so by the cluster
//! objective it is weighed by the work a request costs, never in raw
//! requests/s across unlike models: the answer is the improvement that
//! gains the most work served at the targets, and only one that gains more
//! than the asked share of what its moved replicas served before. A replica
//! making way still meets its target and its instance its demand.

use std::collections::{BTreeSet, HashMap, HashSet};

use serde::Serialize;

use super::relocate::{Worth, move_keeps, same_shape, settle};
use super::room::fewest_in_the_way;
use super::world::{World, nodes_of};
use super::{Move, MoveAsk, MoveLimits, RunningReplica};
use crate::objective::{TFLOP, work_per_request};
use crate::placement::SolveOptions;
use crate::sizing::{InstancePlan, solve_parallelism};
use crate::translate::{ClusterNode, judge_placed, tensor_choice};

/// Replicas moved out of the way of the one that gains, at most: an
/// improvement is worth a short sequence only.
const MAX_OUT_OF_THE_WAY: usize = 2;

/// Replicas tried as the one that gains, by default: a look stays within a
/// few dozen solves (about 100 ms on 1,000 nodes).
pub const IMPROVE_MAX_TRIED: usize = 8;

/// What the planner is asked for an improvement.
pub struct ImproveAsk<'a> {
    pub nodes: &'a [ClusterNode],
    /// Devices held whole by pods that are not tessera's replicas.
    pub others: &'a std::collections::HashMap<(String, String), String>,
    pub running: &'a [RunningReplica<'a>],
    /// The least gain worth moving for: work served at the targets gained,
    /// as a fraction of what the moved replicas served before (0.2: a fifth
    /// more). A replica that served nothing at its target gains by any
    /// request it then serves.
    pub min_gain: f64,
    /// Replicas tried as the one that gains, those serving the least work
    /// per GPU first (one of those of one spec that serve alike).
    pub max_tried: usize,
    pub options: &'a SolveOptions<'a>,
}

/// Moves that raise what the cluster serves, in order.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Improvement {
    pub moves: Vec<Move>,
    pub gpus_moved: f64,
    /// Work the moved replicas serve at their targets before and after, in
    /// TFLOP/s (requests/s × the work a request costs).
    pub work_tflops_before: f64,
    pub work_tflops_after: f64,
    /// The cluster's work served at the targets per GPU its replicas hold,
    /// before and after, in TFLOP/s (moves keep every replica's shape, so
    /// the GPUs held stay the same).
    pub cluster_tflops_per_gpu_before: f64,
    pub cluster_tflops_per_gpu_after: f64,
}

impl Improvement {
    /// Work served at the targets gained, in TFLOP/s.
    pub fn gain(&self) -> f64 {
        self.work_tflops_after - self.work_tflops_before
    }
}

/// The improvement that gains the most, if one gains more than
/// `ask.min_gain`; ties go to fewer GPUs moved, then to the replica tried
/// first.
pub fn plan_improvement(ask: &ImproveAsk<'_>) -> Option<Improvement> {
    let world = World::new(ask.nodes, ask.others, ask.running, "a better placement");
    let mut worth = vec![Worth::default(); ask.running.len()];
    world.each_where_it_is(|index, shards, problem| {
        let refs: Vec<_> = shards.iter().collect();
        if let Ok((plan, capacity)) = judge_placed(problem, &refs) {
            worth[index] = Worth::of(Some(&capacity), &plan);
        }
    });
    // A request's work in TFLOP: what weighs one model's requests against
    // another's.
    let weight: Vec<f64> = ask
        .running
        .iter()
        .map(|replica| work_per_request(replica.spec) / TFLOP)
        .collect();
    let work = |moves: &[Move], after: bool| -> f64 {
        moves
            .iter()
            .map(|m| {
                let index = ask.running.iter().position(|r| r.holder == m.replica);
                let rps = if after {
                    m.requests_per_second_after
                } else {
                    m.requests_per_second_before
                };
                rps * index.map_or(0.0, |i| weight[i])
            })
            .sum()
    };
    let gpus: f64 = ask.running.iter().map(RunningReplica::gpus).sum();
    let served: f64 = (0..ask.running.len())
        .map(|index| worth[index].requests_per_second * weight[index])
        .sum();
    let per_gpu = |served: f64| if gpus > 0.0 { served / gpus } else { 0.0 };
    let mut tried: Vec<usize> = (0..ask.running.len())
        .filter(|&index| ask.running[index].movable())
        .collect();
    let per_gpu_of = |index: usize| {
        worth[index].requests_per_second * weight[index]
            / ask.running[index].gpus().max(f64::MIN_POSITIVE)
    };
    tried.sort_by(|&a, &b| per_gpu_of(a).total_cmp(&per_gpu_of(b)).then(a.cmp(&b)));
    let mut best: Option<Improvement> = None;
    let mut free_places = FreePlaces::default();
    // Replicas of one spec that serve the same where they are would move
    // alike: one of them is tried.
    let mut alike = HashSet::new();
    let distinct = tried.iter().copied().filter(|&index| {
        let spec = serde_json::to_string(ask.running[index].spec).unwrap_or_default();
        alike.insert((spec, worth[index].requests_per_second.to_bits()))
    });
    for gainer in distinct.take(ask.max_tried) {
        let ways = [
            alone(ask, &world, &mut free_places, worth[gainer], gainer),
            making_way(ask, &world, &worth, gainer),
        ];
        for moves in ways.into_iter().flatten() {
            let (before, after) = (work(&moves, false), work(&moves, true));
            if after - before <= ask.min_gain * before || after <= before {
                continue;
            }
            let gpus_moved = moves.iter().fold(0.0, |sum, m| sum + m.gpus);
            let better = best.as_ref().is_none_or(|best| {
                let gain = after - before;
                gain > best.gain() || (gain == best.gain() && gpus_moved < best.gpus_moved)
            });
            if better {
                best = Some(Improvement {
                    moves,
                    gpus_moved,
                    work_tflops_before: before,
                    work_tflops_after: after,
                    cluster_tflops_per_gpu_before: per_gpu(served),
                    cluster_tflops_per_gpu_after: per_gpu(served - before + after),
                });
            }
        }
    }
    best
}

/// The best place on free devices by the spec in its shape (as JSON): the
/// cluster is the same for every replica tried.
type FreePlaces = HashMap<String, Option<InstancePlan>>;

/// `gainer` moved to devices free now, where it serves more than where it
/// is (judged beside what the others hold, as every move is).
fn alone(
    ask: &ImproveAsk<'_>,
    world: &World<'_>,
    free_places: &mut FreePlaces,
    before: Worth,
    gainer: usize,
) -> Option<Vec<Move>> {
    let replica = &ask.running[gainer];
    let from = world.shards_of(gainer)?.to_vec();
    let (spec, tensor) = same_shape(replica.spec, &from);
    // Replicas of one instance in one shape have the same best free place
    // (instances alike but for what they were measured off by do not).
    let key = serde_json::to_string(&(&spec, replica.corrections)).ok()?;
    let placed = free_places
        .entry(key)
        .or_insert_with(|| {
            solve_parallelism(
                &world.problem(&spec, replica.corrections, None),
                tensor,
                ask.options,
            )
            .ok()
        })
        .as_ref()?;
    let after = Worth::of(placed.capacity.as_ref(), &placed.plan);
    if after.requests_per_second <= before.requests_per_second {
        return None;
    }
    let mut now = world.clone();
    Some(vec![settle(
        &mut now,
        gainer,
        from,
        &placed.plan,
        (before, after),
    )])
}

/// `gainer` moved onto devices others hold, once they moved to free
/// devices where each still meets the target it meets now and its instance
/// its demand (it may serve less there: the work gained in all is what is
/// judged).
fn making_way(
    ask: &ImproveAsk<'_>,
    world: &World<'_>,
    worth: &[Worth],
    gainer: usize,
) -> Option<Vec<Move>> {
    let replica = &ask.running[gainer];
    let from = world.shards_of(gainer)?.to_vec();
    let (spec, _) = same_shape(replica.spec, &from);
    let movable: BTreeSet<usize> = (0..ask.running.len())
        .filter(|&index| index != gainer && ask.running[index].movable())
        .collect();
    let as_blocked = MoveAsk {
        nodes: ask.nodes,
        others: ask.others,
        running: ask.running,
        blocked: &spec,
        blocked_name: &replica.holder,
        blocked_corrections: replica.corrections,
        limits: MoveLimits::default(),
        options: ask.options,
    };
    let candidate = fewest_in_the_way(&as_blocked, world, &movable, None).ok()?;
    if candidate.in_the_way.is_empty() || candidate.in_the_way.len() > MAX_OUT_OF_THE_WAY {
        return None;
    }
    let mut now = world.clone();
    now.hold_for_blocked(&candidate.placed.plan);
    let mut order: Vec<usize> = candidate.in_the_way.iter().copied().collect();
    order.sort_by(|&a, &b| {
        let gpus = |index: usize| ask.running[index].gpus();
        gpus(b).total_cmp(&gpus(a)).then(a.cmp(&b))
    });
    let mut moves = Vec::new();
    for index in order {
        let from = now.shards_of(index)?.to_vec();
        let (spec, tensor) = same_shape(ask.running[index].spec, &from);
        let placed = solve_parallelism(
            &now.problem(&spec, ask.running[index].corrections, None),
            tensor,
            ask.options,
        )
        .ok()?;
        let after = Worth::of(placed.capacity.as_ref(), &placed.plan);
        let before = worth[index];
        move_keeps(ask.running, index, (before, after), |sibling| {
            worth[sibling]
        })
        .ok()?;
        moves.push(settle(&mut now, index, from, &placed.plan, (before, after)));
    }
    now.release_blocked();
    let before = worth[gainer];
    let scope = nodes_of(&candidate.placed.plan);
    let placed = solve_parallelism(
        &now.problem(&spec, ask.running[gainer].corrections, Some(&scope)),
        tensor_choice(&spec),
        ask.options,
    )
    .ok()?;
    let after = Worth::of(placed.capacity.as_ref(), &placed.plan);
    moves.push(settle(
        &mut now,
        gainer,
        from,
        &placed.plan,
        (before, after),
    ));
    Some(moves)
}
