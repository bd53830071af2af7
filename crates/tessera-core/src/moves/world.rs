//! The cluster at one step of a move sequence: where each running replica is,
//! which devices are held for the blocked replica, and the solver's problem
//! for a spec on what that leaves.

use std::collections::{BTreeSet, HashMap};

use super::RunningReplica;
use crate::api::{ModelInstanceSpec, PlannedShard, ServingCorrection};
use crate::placement::{Plan, Problem};
use crate::translate::{ClusterNode, HeldShares, build_problem, hold_shard, release_shard};

#[derive(Clone)]
pub(crate) struct World<'a> {
    nodes: &'a [ClusterNode],
    others: &'a HashMap<(String, String), String>,
    running: &'a [RunningReplica<'a>],
    /// Where each running replica is (by its index in `running`); `None`
    /// while a what-if has it out of the way.
    at: Vec<Option<Vec<PlannedShard>>>,
    /// Devices held for the blocked replica, and in whose name.
    held_for_blocked: Vec<(String, String)>,
    blocked_holder: String,
}

impl<'a> World<'a> {
    pub(crate) fn new(
        nodes: &'a [ClusterNode],
        others: &'a HashMap<(String, String), String>,
        running: &'a [RunningReplica<'a>],
        blocked_name: &str,
    ) -> Self {
        Self {
            nodes,
            others,
            running,
            at: running.iter().map(|r| Some(r.shards.clone())).collect(),
            held_for_blocked: Vec::new(),
            blocked_holder: format!("room made for {blocked_name}"),
        }
    }

    pub(crate) fn nodes(&self) -> &'a [ClusterNode] {
        self.nodes
    }

    pub(crate) fn running(&self) -> &'a [RunningReplica<'a>] {
        self.running
    }

    /// Running replica `index`'s shards now (`None` while out of the way).
    pub(crate) fn shards_of(&self, index: usize) -> Option<&[PlannedShard]> {
        self.at[index].as_deref()
    }

    /// The same cluster with `out` out of the way: a what-if.
    pub(crate) fn without(&self, out: &BTreeSet<usize>) -> World<'a> {
        let mut world = self.clone();
        for &index in out {
            world.at[index] = None;
        }
        world
    }

    /// Replica `index` now runs on `shards` (its old devices are free).
    pub(crate) fn settle(&mut self, index: usize, shards: Vec<PlannedShard>) {
        self.at[index] = Some(shards);
    }

    /// Holds `plan`'s devices for the blocked replica, so no replica moved
    /// out of its way lands on them.
    pub(crate) fn hold_for_blocked(&mut self, plan: &Plan) {
        self.held_for_blocked = devices_of(plan);
    }

    pub(crate) fn release_blocked(&mut self) {
        self.held_for_blocked.clear();
    }

    /// The solver's problem for `spec` on what is free at this step, its
    /// predictions corrected by `corrections` (its instance's measured
    /// ones); on the nodes in `scope` alone when given.
    pub(crate) fn problem(
        &self,
        spec: &ModelInstanceSpec,
        corrections: &[ServingCorrection],
        scope: Option<&BTreeSet<String>>,
    ) -> Problem {
        let (allocated, shares) = self.holdings();
        corrected(
            build_problem(
                spec,
                self.nodes
                    .iter()
                    .filter(|node| scope.is_none_or(|scope| scope.contains(&node.name))),
                &allocated,
                &shares,
            ),
            corrections,
        )
    }

    /// Each placed replica's problem where it stands, beside what the others
    /// hold (as `without` that replica, on its own nodes): the holdings are
    /// built once, not once a replica, so judging every replica of a large
    /// cluster stays a linear walk.
    pub(crate) fn each_where_it_is(&self, mut visit: impl FnMut(usize, &[PlannedShard], Problem)) {
        let (mut allocated, mut shares) = self.holdings();
        let by_name: HashMap<&str, &ClusterNode> = self
            .nodes
            .iter()
            .map(|node| (node.name.as_str(), node))
            .collect();
        for (index, (replica, at)) in self.running.iter().zip(&self.at).enumerate() {
            let Some(shards) = at else {
                continue;
            };
            for shard in shards {
                release_shard(shard, &replica.holder, &mut allocated, &mut shares);
            }
            let scope: BTreeSet<&str> = shards.iter().map(|s| s.node.as_str()).collect();
            let problem = corrected(
                build_problem(
                    replica.spec,
                    scope.iter().filter_map(|name| by_name.get(name).copied()),
                    &allocated,
                    &shares,
                ),
                replica.corrections,
            );
            visit(index, shards, problem);
            for shard in shards {
                hold_shard(shard, &replica.holder, &mut allocated, &mut shares);
            }
        }
    }

    /// Who holds what at this step: pods outside tessera, the running
    /// replicas where they are, the room held for the blocked replica.
    fn holdings(&self) -> (HashMap<(String, String), String>, HeldShares) {
        let mut allocated = self.others.clone();
        let mut shares = HeldShares::new();
        for (replica, at) in self.running.iter().zip(&self.at) {
            for shard in at.iter().flatten() {
                hold_shard(shard, &replica.holder, &mut allocated, &mut shares);
            }
        }
        for key in &self.held_for_blocked {
            allocated.insert(key.clone(), self.blocked_holder.clone());
        }
        (allocated, shares)
    }

    /// The running replicas (by index) holding any device `plan` uses, whole
    /// or as a share of it, among `among`.
    pub(crate) fn holders_of(&self, plan: &Plan, among: &BTreeSet<usize>) -> BTreeSet<usize> {
        let mut holders = BTreeSet::new();
        for stage in &plan.stages {
            for &index in among {
                let Some(shards) = &self.at[index] else {
                    continue;
                };
                let holds = shards.iter().any(|shard| {
                    shard.node == stage.node
                        && stage.devices.iter().any(|device| {
                            shard.devices.contains(device)
                                || shard.share.as_ref().is_some_and(|s| &s.gpu == device)
                        })
                });
                if holds {
                    holders.insert(index);
                }
            }
        }
        holders
    }
}

/// The nodes a plan runs on.
pub(crate) fn nodes_of(plan: &Plan) -> BTreeSet<String> {
    plan.stages.iter().map(|stage| stage.node.clone()).collect()
}

/// A plan's devices as `(node, device)`.
pub(crate) fn devices_of(plan: &Plan) -> Vec<(String, String)> {
    plan.stages
        .iter()
        .flat_map(|stage| {
            stage
                .devices
                .iter()
                .map(|d| (stage.node.clone(), d.clone()))
        })
        .collect()
}

/// `problem` judged with an instance's measured corrections.
fn corrected(mut problem: Problem, corrections: &[ServingCorrection]) -> Problem {
    problem.served = problem.served.map(|served| served.corrected(corrections));
    problem
}
