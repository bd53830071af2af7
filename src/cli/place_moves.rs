//! `tessera place`'s moves, shown and never made: for a refused replica the
//! moves of replicas placed before it that would make room (make before
//! break, as `moves::plan_moves` plans them) or why none would; with
//! `--drain`, the moves that would empty those nodes and what would stay;
//! with `--improve`, the continuous move the controller would make.

use std::collections::{BTreeSet, HashMap};
use std::time::Duration;

use serde::Serialize;

use tessera_core::api::{ModelInstanceSpec, PlannedShard, ServingCorrection};
use tessera_core::moves::{
    Evacuation, EvacuationAsk, IMPROVE_MAX_TRIED, ImproveAsk, Improvement, Move, MoveAsk,
    MoveLimits, RunningReplica, plan_evacuation, plan_improvement, plan_moves,
};
use tessera_core::placement::SolveOptions;
use tessera_core::translate::{ClusterNode, planned_shards};

use crate::process::wall_deadline::WallDeadline;

/// What moving replicas placed earlier would do for a refused one.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub(crate) enum MoveAdvice {
    /// The moves, in order, and the refused replica's shards after them.
    #[serde(rename_all = "camelCase")]
    Room {
        moves: Vec<Move>,
        gpus_moved: f64,
        then: Vec<PlannedShard>,
    },
    /// Why no moves make room.
    NoRoom(String),
}

/// Asks the planner about replica `replica` of `spec` (named `name`, its
/// predictions measured off by `corrections`) on the cluster `running` and
/// `outside` hold.
pub(crate) fn advise(
    nodes: &[ClusterNode],
    outside: &HashMap<(String, String), String>,
    running: &[RunningReplica<'_>],
    (spec, corrections): (&ModelInstanceSpec, &[ServingCorrection]),
    (name, replica): (&str, u32),
    max_steps: Option<u64>,
) -> MoveAdvice {
    let answer = solving(max_steps, |options| {
        plan_moves(&MoveAsk {
            nodes,
            others: outside,
            running,
            blocked: spec,
            blocked_name: name,
            blocked_corrections: corrections,
            limits: MoveLimits::default(),
            options,
        })
    });
    match answer {
        Ok(plan) => MoveAdvice::Room {
            then: planned_shards(&plan.placed.plan, replica),
            gpus_moved: plan.gpus_moved,
            moves: plan.moves,
        },
        Err(no_room) => MoveAdvice::NoRoom(no_room.reason),
    }
}

impl MoveAdvice {
    /// The advice as the table prints it under the refusal.
    pub(crate) fn lines(&self, name: &str) -> Vec<String> {
        match self {
            MoveAdvice::NoRoom(reason) => vec![format!("no moves make room: {reason}")],
            MoveAdvice::Room {
                moves,
                gpus_moved,
                then,
            } => {
                let mut lines = vec![format!(
                    "moves that would make room ({} GPU(s) moved, each new copy serving before the old one goes; shown, not made):",
                    gpus_moved
                )];
                for (step, moved) in moves.iter().enumerate() {
                    lines.push(format!("  {}. {}", step + 1, move_words(moved)));
                }
                lines.push(format!("  then {name}: {}", devices(then)));
                lines
            }
        }
    }
}

/// Shards as `node device,device`, stage after stage.
fn devices(shards: &[PlannedShard]) -> String {
    shards
        .iter()
        .map(|shard| format!("{} {}", shard.node, shard.devices.join(",")))
        .collect::<Vec<_>>()
        .join(" | ")
}

/// The solver's deadline for all the solves of one answer together (a
/// move plan or a drain): its own, whatever the placements before it spent.
const MOVES_DEADLINE: Duration = Duration::from_secs(10);

/// `answer` given solve options with that deadline and `max_steps`.
fn solving<R>(max_steps: Option<u64>, answer: impl FnOnce(&SolveOptions<'_>) -> R) -> R {
    let deadline = WallDeadline::after(MOVES_DEADLINE);
    let mut options = SolveOptions {
        deadline: Some(&deadline),
        ..SolveOptions::default()
    };
    if let Some(steps) = max_steps {
        options.max_steps = steps;
    }
    answer(&options)
}

/// The moves that would empty `nodes`, and what would stay on them.
#[derive(Debug, Serialize)]
pub(crate) struct Drain {
    pub(crate) nodes: Vec<String>,
    #[serde(flatten)]
    pub(crate) evacuation: Evacuation,
}

/// Plans the drain of `leaving` on the cluster `running` and `outside` hold.
pub(crate) fn drain(
    nodes: &[ClusterNode],
    outside: &HashMap<(String, String), String>,
    running: &[RunningReplica<'_>],
    leaving: &[String],
    max_steps: Option<u64>,
) -> Drain {
    let leaving_set: BTreeSet<String> = leaving.iter().cloned().collect();
    let evacuation = solving(max_steps, |options| {
        plan_evacuation(&EvacuationAsk {
            nodes,
            others: outside,
            running,
            leaving: &leaving_set,
            options,
        })
    });
    Drain {
        nodes: leaving_set.into_iter().collect(),
        evacuation,
    }
}

impl Drain {
    /// The drain as the table prints it.
    pub(crate) fn lines(&self) -> Vec<String> {
        let Evacuation { moves, staying } = &self.evacuation;
        let mut lines = vec![format!(
            "drain {}: {} replica(s) would move, each new copy serving before the old one goes, {} would stay (shown, not made):",
            self.nodes.join(", "),
            moves.len(),
            staying.len()
        )];
        for (step, moved) in moves.iter().enumerate() {
            lines.push(format!("  {}. {}", step + 1, move_words(moved)));
        }
        for stays in staying {
            lines.push(format!("  stays: {}: {}", stays.replica, stays.reason));
        }
        lines
    }
}

/// What continuous moves would do on the cluster as placed.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct Improve {
    pub(crate) min_gain: f64,
    /// The improvement found, or none that gains that much.
    pub(crate) found: Option<Improvement>,
}

/// Looks for the improvement the controller's continuous moves would make.
pub(crate) fn improve(
    nodes: &[ClusterNode],
    outside: &HashMap<(String, String), String>,
    running: &[RunningReplica<'_>],
    min_gain: f64,
    max_steps: Option<u64>,
) -> Improve {
    let found = solving(max_steps, |options| {
        plan_improvement(&ImproveAsk {
            nodes,
            others: outside,
            running,
            min_gain,
            max_tried: IMPROVE_MAX_TRIED,
            options,
        })
    });
    Improve { min_gain, found }
}

impl Improve {
    /// The improvement as the table prints it.
    pub(crate) fn lines(&self) -> Vec<String> {
        let Some(found) = &self.found else {
            return vec![format!(
                "improve: no move gains more than {:.0}% of what its replicas serve (shown, not made)",
                self.min_gain * 100.0
            )];
        };
        let mut lines = vec![format!(
            "improve: {} move(s), {:.1} -> {:.1} TFLOP/s of model work at the targets for the replicas moved, the cluster {:.2} -> {:.2} TFLOP/s per GPU (each new copy serving before the old one goes; shown, not made):",
            found.moves.len(),
            found.work_tflops_before,
            found.work_tflops_after,
            found.cluster_tflops_per_gpu_before,
            found.cluster_tflops_per_gpu_after
        )];
        for (step, moved) in found.moves.iter().enumerate() {
            lines.push(format!("  {}. {}", step + 1, move_words(moved)));
        }
        lines
    }
}

/// One move as the table prints it.
fn move_words(moved: &Move) -> String {
    format!(
        "{}: {} -> {} ({:.2} -> {:.2} requests/s at its target)",
        moved.replica,
        devices(&moved.from),
        devices(&moved.to),
        moved.requests_per_second_before,
        moved.requests_per_second_after
    )
}
