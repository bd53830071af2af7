//! Nodes emptied, make before break: every replica with a shard on a node
//! that is leaving (cordoned, about to be drained) is placed on the other
//! nodes while it still runs where it is, the largest first. A replica has
//! to leave, so it may go where it serves less, but not where it would miss
//! a latency target it meets now; those of instances with
//! `placement.moves: Never` stay, and so does a replica nothing else holds.

use std::collections::BTreeSet;

use serde::Serialize;

use super::relocate::{Worth, same_shape, settle, worth_where_it_is};
use super::world::World;
use super::{Move, RunningReplica};
use crate::placement::SolveOptions;
use crate::sizing::solve_parallelism;
use crate::translate::ClusterNode;

/// What the planner is asked for a drain.
pub struct EvacuationAsk<'a> {
    pub nodes: &'a [ClusterNode],
    /// Devices held whole by pods that are not tessera's replicas.
    pub others: &'a std::collections::HashMap<(String, String), String>,
    pub running: &'a [RunningReplica<'a>],
    /// The nodes being emptied.
    pub leaving: &'a BTreeSet<String>,
    pub options: &'a SolveOptions<'a>,
}

/// The moves that take replicas off the leaving nodes, in order, and the
/// replicas that cannot leave, with why.
#[derive(Debug, Default, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Evacuation {
    pub moves: Vec<Move>,
    pub staying: Vec<Staying>,
}

/// A replica left on a leaving node.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Staying {
    pub replica: String,
    pub reason: String,
}

/// Plans the moves that empty `ask.leaving` of tessera's replicas.
pub fn plan_evacuation(ask: &EvacuationAsk<'_>) -> Evacuation {
    let mut now = World::new(ask.nodes, ask.others, ask.running, "a drain");
    let staying_on: BTreeSet<String> = ask
        .nodes
        .iter()
        .map(|node| node.name.clone())
        .filter(|name| !ask.leaving.contains(name))
        .collect();
    let mut leaving: Vec<usize> = (0..ask.running.len())
        .filter(|&index| {
            let shards = &ask.running[index].shards;
            shards.iter().any(|shard| ask.leaving.contains(&shard.node))
        })
        .collect();
    // The largest first: the hardest to place, while the most is free.
    leaving.sort_by(|a, b| {
        let gpus = |index: &usize| ask.running[*index].gpus();
        gpus(b).total_cmp(&gpus(a)).then(a.cmp(b))
    });
    let mut evacuation = Evacuation::default();
    for index in leaving {
        let replica = &ask.running[index];
        let stay = |reason: String| Staying {
            replica: replica.holder.clone(),
            reason,
        };
        if !replica.movable() {
            evacuation
                .staying
                .push(stay("its instance has placement.moves: Never".into()));
            continue;
        }
        let from = replica.shards.clone();
        let before = worth_where_it_is(&now, index);
        let (spec, tensor) = same_shape(replica.spec, &from);
        let placed = match solve_parallelism(
            &now.problem(&spec, replica.corrections, Some(&staying_on)),
            tensor,
            ask.options,
        ) {
            Ok(placed) => placed,
            Err(refusal) => {
                evacuation.staying.push(stay(format!(
                    "no devices off the leaving nodes hold it: {}",
                    refusal.reason
                )));
                continue;
            }
        };
        let after = Worth::of(placed.capacity.as_ref(), &placed.plan);
        if !after.keeps_target_of(&before) {
            evacuation.staying.push(stay(format!(
                "elsewhere it would miss its latency target: {} against {} where it is",
                after.words(),
                before.words()
            )));
            continue;
        }
        let moved = settle(&mut now, index, from, &placed.plan, (before, after));
        evacuation.moves.push(moved);
    }
    evacuation
}
