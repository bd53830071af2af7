//! The cluster benchmark's arrivals and deletions replayed with a demand per
//! instance and judged by the cluster objective (`tessera::objective`):
//! instances whose demand is met, the demand served weighed by the work a
//! request costs, GPUs (a memory share by its part), and GPUs per unit of
//! work-weighted demand met. On the nodes as the controller reads them,
//! each handing out memory shares (`shared_nodes`), through the controller's
//! translation (`build_problem`), three ways:
//!
//! - **tessera**: the spec a tessera user writes for a demand (`tensor:
//!   auto`, `pipeline: auto`, `serving.replicasFromDemand`, the default
//!   `pack`) with `sharing: Shared`, through `sizing::solve_for_demand`:
//!   replicas sized to the demand, the GPU kind, size and share chosen for
//!   it; a replica refused for room asks the move planner, as the
//!   controller does, and its moves are made (make before break, each moved
//!   replica keeping its target and its instance's demand);
//! - **tessera on whole GPUs**: the same with `sharing: Exclusive`;
//! - **a careful user** (as for kube-scheduler): whole GPUs, replicas of
//!   the smallest size that holds the model and meets the target on GPUs
//!   first fit finds (`demands::user_replica`), added until they serve the
//!   demand, judged by tessera's own serving model.
// Only the cluster benchmark uses it.
#![allow(dead_code)]

use std::collections::{BTreeMap, HashMap};
use std::time::Instant;

use tessera::api::{ModelInstanceSpec, Moves, PlannedShard, Sharing};
use tessera::moves::{MoveAsk, MoveLimits, RunningReplica, plan_moves};
use tessera::objective::{ClusterStanding, InstanceStanding, TFLOP};
use tessera::placement::SolveOptions;
use tessera::sizing::{served_together, solve_for_demand};
use tessera::translate::{
    ClusterNode, HeldShares, build_problem, hold_shard, planned_shards, release_shard,
    tensor_choice,
};

use super::arrivals::Event;
use super::demands::{Demand, tessera_spec, user_replica};

/// Work is shown in PFLOP/s: a 70B replica serves a few hundred TFLOP/s.
const PFLOP: f64 = 1e3 * TFLOP;

#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum Placer {
    Tessera,
    TesseraWholeGpus,
    CarefulUser,
}

impl Placer {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Placer::Tessera => "tessera",
            Placer::TesseraWholeGpus => "tessera on whole GPUs",
            Placer::CarefulUser => "careful user",
        }
    }
}

/// What one placer did with the sequence, summed over its arrivals (each
/// judged as it was placed).
#[derive(Clone, Debug, Default)]
pub(crate) struct DemandOutcome {
    /// Each instance as it was placed: what the objective judges.
    pub(crate) standings: Vec<InstanceStanding>,
    /// Instances with replicas placed that fall short of their demand.
    pub(crate) short: usize,
    /// Instances with no replica placed.
    pub(crate) refused: usize,
    pub(crate) replicas: usize,
    /// Replicas moved to make room (tessera).
    pub(crate) moves: usize,
    /// GPUs taken by model class (a memory share by its part).
    pub(crate) gpus_by_class: BTreeMap<&'static str, f64>,
    /// Work the instances ask for, work served toward it (each instance at
    /// most its demand), and the demand of the instances met, in FLOP/s.
    pub(crate) work_demanded: f64,
    pub(crate) work_served: f64,
    pub(crate) work_met: f64,
    /// Wall time of each instance's placement, in milliseconds.
    pub(crate) ms: Vec<f64>,
}

impl DemandOutcome {
    /// The sequence at the objective's levels, summed over its instances.
    pub(crate) fn standing(&self) -> ClusterStanding {
        ClusterStanding::of(&self.standings)
    }

    /// GPUs per PFLOP/s of demand met: what serving a unit of demand costs.
    pub(crate) fn gpus_per_pflops_met(&self) -> f64 {
        if self.work_met > 0.0 {
            self.standing().gpus / (self.work_met / PFLOP)
        } else {
            f64::INFINITY
        }
    }

    /// One instance as placed: `class` its model class, `demand` what it asks.
    pub(crate) fn add(&mut self, class: &'static str, demand: f64, standing: InstanceStanding) {
        self.replicas += standing.per_replica.len();
        *self.gpus_by_class.entry(class).or_default() += standing.gpus;
        let work = standing.work_per_request;
        self.work_demanded += demand * work;
        self.work_served += standing.served().min(demand) * work;
        if standing.per_replica.is_empty() {
            self.refused += 1;
        } else if standing.demand_met() {
            self.work_met += demand * work;
        } else {
            self.short += 1;
        }
        self.standings.push(standing);
    }

    /// One REPORT line for `placer` (a name); moves and times where the
    /// replay placed in process.
    pub(crate) fn line(&self, scenario: &str, placer: &str) -> String {
        let by_class: Vec<String> = self
            .gpus_by_class
            .iter()
            .map(|(class, gpus)| format!("{class}:{gpus:.0}"))
            .collect();
        let standing = self.standing();
        let mut line = format!(
            "REPORT {scenario} demand {placer}: demands met={} of {} (short={} refused={}) replicas={} missing their target={} demand served={:.2} of {:.2} PFLOP/s GPUs={:.1} GPUs per PFLOP/s of demand met={:.2} GPUs by class={}",
            standing.demands_met(),
            standing.instances,
            self.short,
            self.refused,
            self.replicas,
            standing.missing_target,
            self.work_served / PFLOP,
            self.work_demanded / PFLOP,
            standing.gpus,
            self.gpus_per_pflops_met(),
            by_class.join(","),
        );
        if !self.ms.is_empty() {
            let max_ms = self.ms.iter().copied().fold(0.0, f64::max);
            let mean_ms = self.ms.iter().sum::<f64>() / self.ms.len() as f64;
            line += &format!(
                " moved={} ms per instance mean={mean_ms:.2} max={max_ms:.2}",
                self.moves
            );
        }
        line
    }
}

/// Who holds what, as the controller records it: devices held whole, memory
/// shares, and each instance's replicas (holder, shards) for the move planner.
#[derive(Default)]
struct Ledger {
    allocated: HashMap<(String, String), String>,
    shares: HeldShares,
    replicas: BTreeMap<usize, Vec<(String, Vec<PlannedShard>)>>,
    specs: BTreeMap<usize, ModelInstanceSpec>,
}

impl Ledger {
    fn hold(&mut self, id: usize, shards: Vec<PlannedShard>) {
        let replicas = self.replicas.entry(id).or_default();
        let holder = format!("bench/instance-{id} replica {}", replicas.len());
        for shard in &shards {
            hold_shard(shard, &holder, &mut self.allocated, &mut self.shares);
        }
        replicas.push((holder, shards));
    }

    fn release(&mut self, id: usize) {
        for (holder, shards) in self.replicas.remove(&id).unwrap_or_default() {
            for shard in &shards {
                release_shard(shard, &holder, &mut self.allocated, &mut self.shares);
            }
        }
    }

    /// Replica `holder` moved to `to`: its new devices must be free while its
    /// old ones are still held (make before break); then the old are given up.
    fn settle(&mut self, holder: &str, to: Vec<PlannedShard>) {
        let Some((_, shards)) = self
            .replicas
            .values_mut()
            .flatten()
            .find(|(who, _)| who == holder)
        else {
            return;
        };
        for shard in to.iter().filter(|shard| shard.share.is_none()) {
            for device in &shard.devices {
                let key = (shard.node.clone(), device.clone());
                assert!(
                    !self.allocated.contains_key(&key),
                    "{device} is not free for the new copy"
                );
            }
        }
        for shard in &std::mem::replace(shards, to.clone()) {
            release_shard(shard, holder, &mut self.allocated, &mut self.shares);
        }
        for shard in &to {
            hold_shard(shard, holder, &mut self.allocated, &mut self.shares);
        }
    }

    /// One more replica of `spec` by moves, as the controller asks: the
    /// moves made and the replica's shards and figures, or `None`.
    fn make_room(
        &mut self,
        nodes: &[ClusterNode],
        (id, spec): (usize, &ModelInstanceSpec),
        name: &str,
    ) -> Option<(usize, Vec<PlannedShard>, f64, f64)> {
        // The blocked instance's own replicas stay where they are for it.
        let mut frozen = spec.clone();
        frozen.placement.moves = Moves::Never;
        let running: Vec<RunningReplica<'_>> = self
            .replicas
            .iter()
            .flat_map(|(other, replicas)| {
                replicas
                    .iter()
                    .map(move |(holder, shards)| (other, holder, shards))
            })
            .map(|(other, holder, shards)| RunningReplica {
                holder: holder.clone(),
                instance: format!("bench/instance-{other}"),
                spec: if *other == id {
                    &frozen
                } else {
                    &self.specs[other]
                },
                shards: shards.clone(),
                ready: true,
                corrections: &[],
            })
            .collect();
        let others = HashMap::new();
        let options = SolveOptions::default();
        let answer = plan_moves(&MoveAsk {
            nodes,
            others: &others,
            running: &running,
            blocked: spec,
            blocked_name: name,
            blocked_corrections: &[],
            limits: MoveLimits::default(),
            options: &options,
        })
        .ok()?;
        let moves: Vec<(String, Vec<PlannedShard>)> = answer
            .moves
            .iter()
            .map(|moved| (moved.replica.clone(), moved.to.clone()))
            .collect();
        drop(running);
        for (holder, to) in moves.iter().cloned() {
            self.settle(&holder, to);
        }
        let placed = answer.placed;
        Some((
            moves.len(),
            planned_shards(&placed.plan, 0),
            placed.requests_per_second().unwrap_or(0.0),
            placed.gpus,
        ))
    }
}

/// Replays `events` on `nodes`, every arrival asking for its demand in
/// `demands`, under `placer`.
pub(crate) fn replay_demands(
    nodes: &[ClusterNode],
    events: &[Event],
    demands: &BTreeMap<usize, Demand>,
    placer: Placer,
) -> DemandOutcome {
    let mut ledger = Ledger::default();
    let mut outcome = DemandOutcome::default();
    let options = SolveOptions::default();
    for event in events {
        let arrival = match event {
            Event::Delete(id) => {
                ledger.release(*id);
                continue;
            }
            Event::Arrive(arrival) => arrival,
        };
        let Some(demand) = demands.get(&arrival.id) else {
            continue;
        };
        let mut spec = tessera_spec(arrival, demand);
        if placer == Placer::Tessera {
            spec.placement.sharing = Sharing::Shared;
        }
        ledger.specs.insert(arrival.id, spec.clone());
        let most = spec.most_replicas() as usize;
        let owner = format!("bench/instance-{}", arrival.id);
        let mut served = Vec::new();
        let mut gpus = 0.0;
        let started = Instant::now();
        if placer == Placer::CarefulUser {
            while served_together(&served) < demand.requests_per_second && served.len() < most {
                let problem = build_problem(&spec, nodes, &ledger.allocated, &ledger.shares);
                let Some((plan, rps, taken)) = user_replica(&problem) else {
                    break;
                };
                ledger.hold(arrival.id, planned_shards(&plan, served.len() as u32));
                served.push(rps);
                gpus += taken;
            }
        } else {
            let problem = build_problem(&spec, nodes, &ledger.allocated, &ledger.shares);
            let results = solve_for_demand(
                &problem,
                tensor_choice(&spec),
                demand.requests_per_second,
                most as u32,
                &owner,
                &options,
            );
            let refused = results.last().is_some_and(Result::is_err);
            for placed in results.into_iter().flatten() {
                ledger.hold(
                    arrival.id,
                    planned_shards(&placed.plan, served.len() as u32),
                );
                served.push(placed.requests_per_second().unwrap_or(0.0));
                gpus += placed.gpus;
            }
            while refused
                && served_together(&served) < demand.requests_per_second
                && served.len() < most
            {
                let Some((moved, shards, rps, taken)) =
                    ledger.make_room(nodes, (arrival.id, &spec), &owner)
                else {
                    break;
                };
                outcome.moves += moved;
                ledger.hold(arrival.id, shards);
                served.push(rps);
                gpus += taken;
            }
        }
        outcome.ms.push(started.elapsed().as_secs_f64() * 1e3);
        let standing = InstanceStanding::new(&spec, served.len().max(1), served, gpus);
        outcome.add(arrival.class, demand.requests_per_second, standing);
    }
    outcome
}
