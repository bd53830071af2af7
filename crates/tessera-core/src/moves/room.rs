//! Where the blocked replica could go if replicas that may move made way,
//! and the fewest, cheapest of them that takes: first node by node, those
//! that displace the fewest GPUs first (most models that are blocked want
//! one node's NVLink/xGMI domain), then those nodes together (a pipeline
//! over nodes), then the whole cluster.

use std::collections::{BTreeSet, HashMap};

use super::world::{World, nodes_of};
use super::{MoveAsk, NoRoom};
use crate::placement::{ModelShape, Unsatisfiable};
use crate::sizing::{InstancePlan, solve_parallelism};
use crate::translate::tensor_choice;

/// A place for the blocked replica and the replicas in its way.
pub(crate) struct Candidate {
    /// The blocked replica's plan with `in_the_way` out of the way.
    pub(crate) placed: InstancePlan,
    /// The running replicas (by index) holding devices of that plan.
    pub(crate) in_the_way: BTreeSet<usize>,
    /// What moving them costs (see `RunningReplica::cost`).
    pub(crate) cost: f64,
}

impl Candidate {
    /// The nodes the blocked replica would run on, in words.
    pub(crate) fn nodes(&self) -> String {
        Vec::from_iter(nodes_of(&self.placed.plan)).join(", ")
    }
}

/// The places found, cheapest first; an error when moves cannot free any.
/// Replicas in `staying` do not move.
pub(crate) fn candidates(
    ask: &MoveAsk<'_>,
    world: &World<'_>,
    staying: &BTreeSet<usize>,
) -> Result<Vec<Candidate>, NoRoom> {
    let movable: BTreeSet<usize> = (0..ask.running.len())
        .filter(|&index| ask.running[index].movable() && !staying.contains(&index))
        .collect();
    if movable.is_empty() {
        // Asked while it fits after all (the cluster changed): no moves.
        if let Ok(candidate) = fewest_in_the_way(ask, world, &movable, None) {
            return Ok(vec![candidate]);
        }
        let running = ask.running.len();
        return Err(NoRoom {
            reason: if running == 0 {
                format!(
                    "{} has no room and no replica runs that could move",
                    ask.blocked_name
                )
            } else {
                format!(
                    "{} has no room and none of the {running} running replica(s) may move (placement.moves: Never)",
                    ask.blocked_name
                )
            },
        });
    }
    let mut found: Vec<Candidate> = Vec::new();
    let mut too_many: Option<Candidate> = None;
    let mut keep = |candidate: Candidate, found: &mut Vec<Candidate>| {
        if candidate.in_the_way.len() <= ask.limits.max_moves {
            found.push(candidate);
        } else if too_many.as_ref().is_none_or(|c| candidate.cost < c.cost) {
            too_many = Some(candidate);
        }
    };
    let on = |nodes: &BTreeSet<String>| -> BTreeSet<usize> {
        movable
            .iter()
            .copied()
            .filter(|&index| {
                let shards = &ask.running[index].shards;
                shards.iter().any(|s| nodes.contains(&s.node))
            })
            .collect()
    };
    let ranked = ranked_nodes(ask, world, &movable);
    let model = ModelShape::of(&ask.blocked.model);
    let weights = model.weight_bytes_per_layer * f64::from(model.layers);
    let holding = || ranked.iter().filter(|node| node.held > 0.0);
    // Alone, only nodes whose GPUs could hold the weights.
    let alone = holding()
        .filter(|node| node.memory >= weights)
        .take(ask.limits.max_nodes_tried);
    for node in alone {
        let scope = BTreeSet::from([node.name.to_string()]);
        if let Ok(candidate) = fewest_in_the_way(ask, world, &on(&scope), Some(&scope)) {
            keep(candidate, &mut found);
        }
        if found.len() >= ask.limits.max_candidates {
            break;
        }
    }
    // A replica spanning nodes (a pipeline): those nodes together, with the
    // nodes where nothing that may move runs (their free GPUs as they are).
    if found.is_empty() && holding().next().is_some() {
        let scope: BTreeSet<String> = ranked
            .iter()
            .filter(|node| node.held == 0.0)
            .chain(holding().take(ask.limits.max_nodes_tried))
            .map(|node| node.name.to_string())
            .collect();
        if let Ok(candidate) = fewest_in_the_way(ask, world, &on(&scope), Some(&scope)) {
            keep(candidate, &mut found);
        }
    }
    if found.is_empty() {
        match fewest_in_the_way(ask, world, &movable, None) {
            Ok(candidate) => keep(candidate, &mut found),
            Err(refusal) => {
                return Err(NoRoom {
                    reason: format!(
                        "{} does not fit even with all {} replica(s) that may move out of the way: {}",
                        ask.blocked_name,
                        movable.len(),
                        refusal.reason
                    ),
                });
            }
        }
    }
    if found.is_empty()
        && let Some(candidate) = too_many
    {
        return Err(NoRoom {
            reason: format!(
                "{} fits on {} only by moving {} replicas; at most {} are moved to make room for one",
                ask.blocked_name,
                candidate.nodes(),
                candidate.in_the_way.len(),
                ask.limits.max_moves
            ),
        });
    }
    // Stable: equal costs keep the order the nodes were tried in.
    found.sort_by(|a, b| a.cost.total_cmp(&b.cost));
    Ok(found)
}

/// A node, the GPUs movable replicas hold on it and all its GPUs' memory.
struct RankedNode<'a> {
    name: &'a str,
    held: f64,
    memory: f64,
}

/// Every node, those where movable replicas hold the fewest GPUs first (by
/// name among equals).
fn ranked_nodes<'a>(
    ask: &MoveAsk<'a>,
    world: &World<'a>,
    movable: &BTreeSet<usize>,
) -> Vec<RankedNode<'a>> {
    let mut held: HashMap<&str, f64> = HashMap::new();
    for &index in movable {
        for shard in &ask.running[index].shards {
            *held.entry(shard.node.as_str()).or_default() += shard.devices.len().max(1) as f64;
        }
    }
    let mut nodes: Vec<RankedNode<'a>> = world
        .nodes()
        .iter()
        .map(|node| RankedNode {
            name: node.name.as_str(),
            held: held.get(node.name.as_str()).copied().unwrap_or(0.0),
            memory: node
                .gpu_state
                .devices
                .iter()
                .map(|device| device.memory_total_bytes as f64)
                .sum(),
        })
        .collect();
    nodes.sort_by(|a, b| a.held.total_cmp(&b.held).then(a.name.cmp(b.name)));
    nodes
}

/// The blocked replica's plan with the replicas in `out` out of the way,
/// then narrowed: each replica in its way, the costliest first, stays where
/// it is if the replica still fits without its devices.
pub(crate) fn fewest_in_the_way(
    ask: &MoveAsk<'_>,
    world: &World<'_>,
    out: &BTreeSet<usize>,
    scope: Option<&BTreeSet<String>>,
) -> Result<Candidate, Unsatisfiable> {
    let tensor = tensor_choice(ask.blocked);
    let solve = |out: &BTreeSet<usize>, scope: Option<&BTreeSet<String>>| {
        solve_parallelism(
            &world
                .without(out)
                .problem(ask.blocked, ask.blocked_corrections, scope),
            tensor,
            ask.options,
        )
    };
    let mut placed = solve(out, scope)?;
    let mut in_the_way = world.holders_of(&placed.plan, out);
    // Over the whole cluster, narrowed on the nodes the plan took: a solve
    // there is a small one.
    let taken = scope.cloned().unwrap_or_else(|| nodes_of(&placed.plan));
    let cost = |index: &usize| ask.running[*index].cost();
    let mut costliest_first: Vec<usize> = in_the_way.iter().copied().collect();
    costliest_first.sort_by(|a, b| cost(b).total_cmp(&cost(a)).then(a.cmp(b)));
    for index in costliest_first {
        if !in_the_way.contains(&index) {
            continue;
        }
        let mut fewer = in_the_way.clone();
        fewer.remove(&index);
        if let Ok(narrower) = solve(&fewer, Some(&taken)) {
            in_the_way = world.holders_of(&narrower.plan, &fewer);
            placed = narrower;
        }
    }
    Ok(Candidate {
        cost: in_the_way.iter().map(cost).fold(0.0, |sum, c| sum + c),
        placed,
        in_the_way,
    })
}
