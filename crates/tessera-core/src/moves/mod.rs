//! Moves: running replicas moved, make before break, so that a replica that
//! cannot be placed gets room. Pure and deterministic, like the solver it
//! calls: the answer is a short sequence of moves, each to devices free at
//! its step (the old copy keeps its own until the new one serves), after
//! which the blocked replica fits; or why no sequence does within the bounds.
//!
//! - `world`: the cluster at one step: who holds what, and the solver's
//!   problem for a spec on what is left;
//! - `room`: where the blocked replica could go if movable replicas made way,
//!   and the fewest, cheapest replicas that takes;
//! - `relocate`: a candidate carried out, each displaced replica placed
//!   elsewhere where it still meets its target and its instance its demand
//!   (the cluster objective, `crate::objective`);
//! - `evacuate`: nodes emptied for a drain, each replica placed off them
//!   while it still runs where it is;
//! - `improve`: for continuous moves, a replica moved where it serves more,
//!   alone or once others made way.

mod evacuate;
mod improve;
mod relocate;
mod room;
mod world;

use std::collections::{BTreeSet, HashMap};

use serde::Serialize;

use crate::api::{ModelInstanceSpec, PlannedShard, ServingCorrection};
use crate::placement::SolveOptions;
use crate::sizing::InstancePlan;
use crate::translate::ClusterNode;
use world::World;

pub use evacuate::{Evacuation, EvacuationAsk, Staying, plan_evacuation};
pub use improve::{IMPROVE_MAX_TRIED, ImproveAsk, Improvement, plan_improvement};

/// A replica tessera runs, as a move planner needs it.
#[derive(Clone, Debug)]
pub struct RunningReplica<'a> {
    /// Who holds its devices, as problems name holders (`ns/name replica 0`).
    pub holder: String,
    /// Its instance (`ns/name`): replicas of one instance are judged
    /// together against its demand.
    pub instance: String,
    /// Its instance's spec: what it needs wherever it goes, and whether it
    /// may move at all (`placement.moves`).
    pub spec: &'a ModelInstanceSpec,
    /// Its shards where they run, in pipeline order, as `status.plan` has them.
    pub shards: Vec<PlannedShard>,
    /// Whether it serves now: one not yet Ready costs half as much to move.
    pub ready: bool,
    /// What its instance's predictions were measured off by
    /// (`status.corrections`): where it goes is judged with them.
    pub corrections: &'a [ServingCorrection],
}

impl RunningReplica<'_> {
    pub(crate) fn movable(&self) -> bool {
        self.spec.placement.moves.is_allowed()
    }

    /// GPUs it holds, a memory share as its fraction of the GPU.
    pub(crate) fn gpus(&self) -> f64 {
        self.shards.iter().map(PlannedShard::gpus).sum()
    }

    /// What moving it costs: its GPUs, half for a replica not yet serving.
    pub(crate) fn cost(&self) -> f64 {
        if self.ready {
            self.gpus()
        } else {
            self.gpus() / 2.0
        }
    }
}

/// How far the planner looks. Each bound keeps one answer within a few
/// dozen solves, so it stays fast on a thousand nodes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MoveLimits {
    /// Replicas moved, at most, to make room for one replica.
    pub max_moves: usize,
    /// Nodes tried as the blocked replica's place, those that displace the
    /// fewest GPUs first.
    pub max_nodes_tried: usize,
    /// Places found for it in one round, carried out cheapest first.
    pub max_candidates: usize,
    /// Places carried out in all. A place fails when a replica in its way
    /// has nowhere as good to go; the next round keeps that replica where it
    /// is and looks again.
    pub max_attempts: usize,
}

impl Default for MoveLimits {
    fn default() -> Self {
        Self {
            max_moves: 8,
            max_nodes_tried: 16,
            max_candidates: 3,
            max_attempts: 8,
        }
    }
}

/// What the planner is asked.
pub struct MoveAsk<'a> {
    pub nodes: &'a [ClusterNode],
    /// Devices held whole by pods that are not tessera's replicas (by
    /// `(node, device)`): never moved, never planned on.
    pub others: &'a HashMap<(String, String), String>,
    /// tessera's running replicas; those of instances with `placement.moves:
    /// Never` stay where they are.
    pub running: &'a [RunningReplica<'a>],
    /// The instance whose replica cannot be placed, and its name.
    pub blocked: &'a ModelInstanceSpec,
    pub blocked_name: &'a str,
    /// The blocked instance's measured corrections.
    pub blocked_corrections: &'a [ServingCorrection],
    pub limits: MoveLimits,
    /// For every solve the planner makes.
    pub options: &'a SolveOptions<'a>,
}

/// One replica moved: where from, where to, and what it serves before and
/// after at its target.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Move {
    pub replica: String,
    pub from: Vec<PlannedShard>,
    pub to: Vec<PlannedShard>,
    /// GPUs moved (a memory share as its fraction).
    pub gpus: f64,
    pub requests_per_second_before: f64,
    pub requests_per_second_after: f64,
}

/// The moves that make room, in order, and the blocked replica's plan once
/// they are done.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct MovePlan {
    pub moves: Vec<Move>,
    pub gpus_moved: f64,
    #[serde(skip)]
    pub placed: InstancePlan,
}

/// Why no moves make room, in words the owner can act on.
#[derive(Clone, Debug, PartialEq, Serialize, thiserror::Error)]
#[error("{reason}")]
pub struct NoRoom {
    pub reason: String,
}

/// The cheapest sequence of moves found that makes room for one more
/// replica of `ask.blocked`. The places considered for it are carried out
/// cheapest first (fewest GPUs moved, replicas not yet serving counting
/// half); the first that works is the answer.
pub fn plan_moves(ask: &MoveAsk<'_>) -> Result<MovePlan, NoRoom> {
    let world = World::new(ask.nodes, ask.others, ask.running, ask.blocked_name);
    // Replicas found to have nowhere as good to go stay where they are.
    let mut staying = BTreeSet::new();
    let mut first_failure: Option<String> = None;
    // Each replica's shape, worked out at the first replica with nowhere to go.
    let mut shapes: Option<Vec<String>> = None;
    let mut attempts = 0;
    while attempts < ask.limits.max_attempts {
        let candidates = match room::candidates(ask, &world, &staying) {
            Ok(candidates) => candidates,
            // After a failed place, why the cheapest failed says more than
            // that the rest of the cluster has no room.
            Err(refusal) => return Err(first_failure.map_or(refusal, |reason| NoRoom { reason })),
        };
        let mut stuck_now = false;
        for candidate in candidates.iter().take(ask.limits.max_attempts - attempts) {
            attempts += 1;
            match relocate::carry_out(ask, &world, candidate) {
                Ok(plan) => return Ok(plan),
                Err(failure) => {
                    first_failure.get_or_insert(failure.reason);
                    let Some(stuck) = failure.stuck else {
                        continue;
                    };
                    stuck_now |= staying.insert(stuck);
                    if failure.alike {
                        let shapes = shapes.get_or_insert_with(|| {
                            ask.running.iter().map(relocate::shape_key).collect()
                        });
                        let alike =
                            (0..shapes.len()).filter(|&index| shapes[index] == shapes[stuck]);
                        staying.extend(alike);
                    }
                }
            }
        }
        if !stuck_now {
            break;
        }
    }
    Err(NoRoom {
        reason: first_failure
            .unwrap_or_else(|| format!("{} has no place that moves could free", ask.blocked_name)),
    })
}

#[cfg(test)]
mod tests;
