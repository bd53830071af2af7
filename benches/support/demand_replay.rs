//! The cluster benchmark's arrivals and deletions replayed with a demand per
//! instance, by tessera and by a careful user, and judged by the cluster
//! objective (`tessera::objective`): instances whose demand is met, the
//! demand served weighed by the work a request costs, GPUs, and GPUs per
//! unit of work-weighted demand met.
//!
//! - **tessera**: the spec a tessera user writes for a demand (`tensor:
//!   auto`, `pipeline: auto`, `serving.replicasFromDemand`), under `pack`,
//!   through `sizing::solve_for_demand`: replicas sized to the demand, the
//!   GPU kind and size chosen for it; a replica refused for room asks the
//!   move planner, as the controller does, and its moves are made (make
//!   before break, each moved replica keeping its target and its instance's
//!   demand);
//! - **a careful user** (as for kube-scheduler): replicas of the smallest
//!   size that holds the model and meets the target on GPUs first fit finds
//!   (`demands::user_replica`), added until they serve the demand, judged by
//!   tessera's own serving model.
// Only the cluster benchmark uses it.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::time::Instant;

use tessera::objective::{InstanceStanding, TFLOP};
use tessera::placement::{NodeState, Served, SolveOptions, Strategy};
use tessera::sizing::{TensorChoice, served_together, solve_for_demand};

use super::arrivals::Event;
use super::demands::{Demand, tessera_spec, user_replica};
use super::replay::{ClusterState, make_room};

/// Work is shown in PFLOP/s: a 70B replica serves a few hundred TFLOP/s.
const PFLOP: f64 = 1e3 * TFLOP;

#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum Placer {
    Tessera,
    CarefulUser,
}

impl Placer {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Placer::Tessera => "tessera",
            Placer::CarefulUser => "careful user",
        }
    }
}

/// What one placer did with the sequence, summed over its arrivals (each
/// judged as it was placed).
#[derive(Clone, Debug, Default)]
pub(crate) struct DemandOutcome {
    pub(crate) instances: usize,
    /// Instances whose demand its replicas serve.
    pub(crate) met: usize,
    /// Instances with replicas placed that fall short of their demand.
    pub(crate) short: usize,
    /// Instances with no replica placed.
    pub(crate) refused: usize,
    pub(crate) replicas: usize,
    /// Replicas moved to make room (tessera).
    pub(crate) moves: usize,
    /// Replicas placed that meet no latency target.
    pub(crate) missed_target: usize,
    /// GPUs taken by every replica placed, and by model class.
    pub(crate) gpus: f64,
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
    /// GPUs per PFLOP/s of demand met: what serving a unit of demand costs.
    pub(crate) fn gpus_per_pflops_met(&self) -> f64 {
        if self.work_met > 0.0 {
            self.gpus / (self.work_met / PFLOP)
        } else {
            f64::INFINITY
        }
    }

    pub(crate) fn line(&self, scenario: &str, placer: Placer) -> String {
        let max_ms = self.ms.iter().copied().fold(0.0, f64::max);
        let mean_ms = self.ms.iter().sum::<f64>() / self.ms.len().max(1) as f64;
        format!(
            "REPORT cluster/{scenario} demand {}: demands met={} of {} (short={} refused={}) replicas={} moved={} missing their target={} demand served={:.2} of {:.2} PFLOP/s GPUs={:.0} GPUs per PFLOP/s of demand met={:.2} GPUs by class={} ms per instance mean={mean_ms:.2} max={max_ms:.2}",
            placer.name(),
            self.met,
            self.instances,
            self.short,
            self.refused,
            self.replicas,
            self.moves,
            self.missed_target,
            self.work_served / PFLOP,
            self.work_demanded / PFLOP,
            self.gpus,
            self.gpus_per_pflops_met(),
            self.gpus_by_class
                .iter()
                .map(|(class, gpus)| format!("{class}:{gpus:.0}"))
                .collect::<Vec<_>>()
                .join(","),
        )
    }
}

/// Replays `events` on `nodes`, every arrival asking for its demand in
/// `demands`, under `placer`.
pub(crate) fn replay_demands(
    nodes: &[NodeState],
    events: &[Event],
    demands: &BTreeMap<usize, Demand>,
    placer: Placer,
) -> DemandOutcome {
    let mut state = ClusterState::new(nodes);
    let cluster = state.cluster_nodes();
    let mut outcome = DemandOutcome::default();
    let options = SolveOptions::default();
    for event in events {
        let arrival = match event {
            Event::Delete(id) => {
                state.release(*id);
                continue;
            }
            Event::Arrive(arrival) => arrival,
        };
        let Some(demand) = demands.get(&arrival.id) else {
            continue;
        };
        let spec = tessera_spec(arrival, demand);
        state.set_spec(arrival.id, spec.clone());
        let most = spec.most_replicas();
        let problem = |state: &ClusterState| {
            let mut problem = state.problem(arrival, Strategy::Pack);
            problem.served = Some(Served::of(&spec));
            problem
        };
        let mut served = Vec::new();
        let mut gpus = 0.0;
        let started = Instant::now();
        match placer {
            Placer::Tessera => {
                let owner = format!("bench/instance-{}", arrival.id);
                let results = solve_for_demand(
                    &problem(&state),
                    TensorChoice::Auto,
                    demand.requests_per_second,
                    most,
                    &owner,
                    &options,
                );
                let refused = results.last().is_some_and(Result::is_err);
                for placed in results.into_iter().flatten() {
                    let rps = placed.requests_per_second().unwrap_or(0.0);
                    state.hold(arrival, served.len() as u32, &placed.plan, rps);
                    served.push(rps);
                    gpus += placed.gpus;
                }
                while refused
                    && served_together(&served) < demand.requests_per_second
                    && served.len() < most as usize
                {
                    let Some((made, placed)) = make_room(&cluster, &state, &spec, &owner) else {
                        break;
                    };
                    state.settle_all(&made);
                    outcome.moves += made.len();
                    let rps = placed.requests_per_second().unwrap_or(0.0);
                    state.hold(arrival, served.len() as u32, &placed.plan, rps);
                    served.push(rps);
                    gpus += placed.gpus;
                }
            }
            Placer::CarefulUser => {
                while served_together(&served) < demand.requests_per_second
                    && served.len() < most as usize
                {
                    let Some((plan, rps, taken)) = user_replica(&problem(&state)) else {
                        break;
                    };
                    state.hold(arrival, served.len() as u32, &plan, rps);
                    served.push(rps);
                    gpus += taken;
                }
            }
        }
        outcome.ms.push(started.elapsed().as_secs_f64() * 1e3);
        let standing = InstanceStanding::new(&spec, served.len().max(1), served, gpus);
        outcome.instances += 1;
        outcome.replicas += standing.per_replica.len();
        outcome.missed_target += standing.missing_target();
        outcome.gpus += gpus;
        *outcome.gpus_by_class.entry(arrival.class).or_default() += gpus;
        let work = standing.work_per_request;
        outcome.work_demanded += demand.requests_per_second * work;
        outcome.work_served += standing.served().min(demand.requests_per_second) * work;
        if standing.per_replica.is_empty() {
            outcome.refused += 1;
        } else if standing.demand_met() {
            outcome.met += 1;
            outcome.work_met += demand.requests_per_second * work;
        } else {
            outcome.short += 1;
        }
    }
    outcome
}
