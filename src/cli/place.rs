//! `tessera place`: plan ModelInstances on a cluster description, no cluster
//! needed. Instances are placed in the order given; each one's devices are taken
//! before the next is planned, as the controller does with running instances.

use std::collections::HashMap;
use std::path::PathBuf;
use std::time::Duration;

use serde::Serialize;

use super::InputError;
use super::input::{parse_cluster, parse_instances, read_input};
use super::place_moves::{Drain, Improve, MoveAdvice, advise, drain, improve};
use crate::process::wall_deadline::WallDeadline;
use tessera_core::api::{ModelInstance, PlannedShard, ServingSpec};
use tessera_core::moves::RunningReplica;
use tessera_core::objective::{ClusterStanding, InstanceStanding};
use tessera_core::placement::{Plan, SolveOptions, Unsatisfiable};
use tessera_core::serving::Capacity;
use tessera_core::sizing::{InstancePlan, served_together, solve_for_demand, solve_replicas};
use tessera_core::translate::{
    ClusterNode, HeldShares, build_problem, hold_shard, planned_shards, pod_holder, tensor_choice,
};

/// The sample the quick start runs: a mixed NVIDIA + AMD cluster of four nodes
/// and three model sizes, compiled in so `tessera place` works anywhere.
pub(crate) const SAMPLE_CLUSTER: (&str, &str) = (
    "examples/cluster-mixed.yaml",
    include_str!("../../examples/cluster-mixed.yaml"),
);
pub(crate) const SAMPLE_INSTANCES: [(&str, &str); 3] = [
    (
        "examples/llama-7b.yaml",
        include_str!("../../examples/llama-7b.yaml"),
    ),
    (
        "examples/llama-70b.yaml",
        include_str!("../../examples/llama-70b.yaml"),
    ),
    (
        "examples/llama-405b.yaml",
        include_str!("../../examples/llama-405b.yaml"),
    ),
];

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum PlaceOutput {
    Table,
    Json,
    Yaml,
    /// The cluster map of the plan, one self-contained HTML page.
    Html,
}

pub struct PlaceArgs {
    /// ModelInstance files (`-` for stdin); empty uses the built-in samples.
    pub instances: Vec<PathBuf>,
    /// Cluster description; `None` uses the built-in sample cluster.
    pub cluster: Option<PathBuf>,
    pub output: PlaceOutput,
    /// Overrides the solver's step budget.
    pub max_steps: Option<u64>,
    /// Nodes to plan a drain of once every instance is placed: the moves
    /// that would take tessera's replicas off them.
    pub drain: Vec<String>,
    /// With a least gain: the continuous move that would raise the work the
    /// cluster serves at the targets by more than it, once every instance is
    /// placed.
    pub improve: Option<f64>,
    /// Plan instances whose `spec.serving` target no GPUs meet anyway, and
    /// show the best plan and its curve marked as missing it, instead of
    /// refusing them.
    pub show_missed: bool,
}

#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Placement {
    pub(crate) name: String,
    /// Which replica, when the instance asks for more than one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) replica: Option<u32>,
    pub(crate) model: String,
    /// How `parallelism.tensor: auto` chose, when it did.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) parallelism: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub plan: Option<PlacedPlan>,
    /// The plan as the controller writes it into `status.plan`.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub(crate) status_plan: Vec<PlannedShard>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub unsatisfiable: Option<Unsatisfiable>,
    /// For an instance's first refused replica: the moves of replicas placed
    /// before it that would make room, or why none would.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) moves: Option<MoveAdvice>,
    /// The instance's `spec.serving`, for the capacity line.
    #[serde(skip)]
    pub(crate) serving: Option<ServingSpec>,
}

impl Placement {
    /// Planned, and meeting the instance's `spec.serving` target where it
    /// states one (a plan shown by `--show-missed` does not).
    fn placed_as_asked(&self) -> bool {
        self.plan.as_ref().is_some_and(|plan| {
            self.serving.is_none()
                || plan
                    .serving
                    .as_ref()
                    .is_none_or(|capacity| capacity.target_missed.is_none())
        })
    }
}

/// A replica's plan, and what it serves at the instance's latency target
/// (`plan.serving` in `-o json`).
#[derive(Debug, Serialize)]
pub struct PlacedPlan {
    #[serde(flatten)]
    pub plan: Plan,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub serving: Option<Capacity>,
    /// Why the serving model has no answer for the plan, when it has none.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub serving_error: Option<String>,
}

impl std::ops::Deref for PlacedPlan {
    type Target = Plan;

    fn deref(&self) -> &Plan {
        &self.plan
    }
}

/// Whether an instance's replicas serve its demand (`serving.requestsPerSecond`)
/// at the latency target.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct DemandOutcome {
    pub(crate) name: String,
    /// The demand.
    pub(crate) requests_per_second: f64,
    /// Replicas planned (as many as the demand needs when `replicas` is unset).
    pub(crate) replicas: u32,
    /// What they serve together: their count × the slowest one's requests/s.
    pub(crate) served_requests_per_second: f64,
    pub met: bool,
}

#[derive(Debug, Serialize)]
pub struct Report {
    pub(crate) cluster: String,
    pub placements: Vec<Placement>,
    /// Each instance with a demand, and whether it is met.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub demands: Vec<DemandOutcome>,
    /// The instances as planned, at the cluster objective's levels.
    pub(crate) objective: ClusterStanding,
    /// With `--drain`: the moves that would empty those nodes, and what stays.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) drain: Option<Drain>,
    /// With `--improve`: the continuous move the controller would make.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) improve: Option<Improve>,
    /// The cluster planned on, for the map.
    #[serde(skip)]
    pub(crate) nodes: Vec<ClusterNode>,
}

impl Report {
    /// Every replica placed, every demand met and every replica on a
    /// drained node with somewhere to go.
    pub fn all_placed(&self) -> bool {
        self.placements.iter().all(Placement::placed_as_asked)
            && self.demands.iter().all(|d| d.met)
            && self
                .drain
                .as_ref()
                .is_none_or(|d| d.evacuation.staying.is_empty())
    }
}

/// Reads the inputs and plans every instance.
pub fn run(args: &PlaceArgs) -> Result<Report, InputError> {
    let (cluster_origin, nodes) = match &args.cluster {
        Some(path) => {
            let origin = path.display().to_string();
            let nodes = parse_cluster(&read_input(path)?, &origin)?;
            (origin, nodes)
        }
        None => (
            SAMPLE_CLUSTER.0.to_string(),
            parse_cluster(SAMPLE_CLUSTER.1, SAMPLE_CLUSTER.0)?,
        ),
    };
    let mut instances = Vec::new();
    if args.instances.is_empty() {
        for (origin, text) in SAMPLE_INSTANCES {
            instances.extend(parse_instances(text, origin)?);
        }
    } else {
        for path in &args.instances {
            instances.extend(parse_instances(
                &read_input(path)?,
                &path.display().to_string(),
            )?);
        }
    }
    let mut names = std::collections::BTreeSet::new();
    for mi in &instances {
        let key = (mi.metadata.namespace.clone(), mi.metadata.name.clone());
        if !names.insert(key) {
            return Err(InputError(format!(
                "ModelInstance {} is given twice",
                mi.metadata.name.clone().unwrap_or_default()
            )));
        }
    }
    for node in &args.drain {
        if !nodes.iter().any(|n| &n.name == node) {
            return Err(InputError(format!(
                "--drain {node:?}: {cluster_origin} has no node of that name"
            )));
        }
    }
    let placed = place_all(&instances, &nodes, args.max_steps, args.show_missed);
    let drain = (!args.drain.is_empty()).then(|| {
        drain(
            &nodes,
            &placed.outside,
            &placed.running,
            &args.drain,
            args.max_steps,
        )
    });
    let improve = args.improve.map(|min_gain| {
        improve(
            &nodes,
            &placed.outside,
            &placed.running,
            min_gain,
            args.max_steps,
        )
    });
    Ok(Report {
        cluster: cluster_origin,
        placements: placed.placements,
        demands: placed.demands,
        objective: ClusterStanding::of(&placed.standings),
        drain,
        improve,
        nodes,
    })
}

/// Every instance planned in order, and what that leaves running.
struct Placed<'a> {
    placements: Vec<Placement>,
    demands: Vec<DemandOutcome>,
    /// Each instance as planned, as the cluster objective judges it.
    standings: Vec<InstanceStanding>,
    /// The replicas placed, as the move planner reads them.
    running: Vec<RunningReplica<'a>>,
    /// Devices pods outside tessera hold.
    outside: HashMap<(String, String), String>,
}

fn place_all<'a>(
    instances: &'a [ModelInstance],
    nodes: &[ClusterNode],
    max_steps: Option<u64>,
    show_missed: bool,
) -> Placed<'a> {
    // Devices the node agents report as handed to pods are taken, as for the controller.
    let mut allocated: HashMap<(String, String), String> = nodes
        .iter()
        .flat_map(|n| {
            n.gpu_state
                .allocated
                .iter()
                .map(|(device, uid)| ((n.name.clone(), device.clone()), pod_holder(&n.name, uid)))
        })
        .collect();
    // What no move touches: pods outside tessera.
    let outside = allocated.clone();
    let mut running: Vec<RunningReplica<'_>> = Vec::new();
    let mut shares = HeldShares::new();
    let mut out = Vec::new();
    let mut demands = Vec::new();
    let mut standings = Vec::new();
    for mi in instances {
        let name = match &mi.metadata.namespace {
            Some(ns) => format!("{ns}/{}", mi.metadata.name.clone().unwrap_or_default()),
            None => mi.metadata.name.clone().unwrap_or_default(),
        };
        let mut problem = build_problem(&mi.spec, nodes, &allocated, &shares);
        // An instance exported from a cluster carries what its predictions
        // were measured off by.
        let corrections = mi.status.as_ref().map_or(&[][..], |s| &s.corrections);
        problem.served = problem.served.map(|served| served.corrected(corrections));
        if show_missed && let Some(served) = problem.served.as_mut() {
            served.target_required = false;
        }
        let deadline = WallDeadline::after(Duration::from_millis(u64::from(
            mi.spec.placement.deadline_ms,
        )));
        let mut opts = SolveOptions {
            deadline: Some(&deadline),
            ..SolveOptions::default()
        };
        if let Some(steps) = max_steps {
            opts.max_steps = steps;
        }
        let tensor = tensor_choice(&mi.spec);
        let results = match (mi.spec.fixed_replicas(), mi.spec.demand()) {
            (Some(replicas), _) => solve_replicas(&problem, tensor, replicas, &name, &opts),
            (None, demand) => solve_for_demand(
                &problem,
                tensor,
                demand.unwrap_or_default(),
                mi.spec.most_replicas(),
                &name,
                &opts,
            ),
        };
        let placed: Vec<&InstancePlan> = results.iter().flatten().collect();
        standings.push(InstanceStanding::new(
            &mi.spec,
            results.len(),
            placed
                .iter()
                .map(|p| p.requests_per_second().unwrap_or(0.0))
                .collect(),
            placed.iter().map(|p| p.gpus).sum(),
        ));
        if let Some(demand) = mi.spec.demand() {
            let served: Vec<f64> = results
                .iter()
                .map(|result| {
                    result
                        .as_ref()
                        .ok()
                        .and_then(|placed| placed.requests_per_second())
                        .unwrap_or(0.0)
                })
                .collect();
            demands.push(DemandOutcome {
                name: name.clone(),
                requests_per_second: demand,
                replicas: served.len() as u32,
                served_requests_per_second: served_together(&served),
                met: served_together(&served) >= demand,
            });
        }
        let replicas = results.len() as u32;
        let mut advised = false;
        for (replica, result) in (0..replicas).zip(results) {
            tracing::info!(instance = %name, replica, placed = result.is_ok(), "planned");
            let holder = if replicas > 1 {
                format!("{name} replica {replica}")
            } else {
                name.clone()
            };
            let placement = match result {
                Ok(chosen) => {
                    let status_plan = planned_shards(&chosen.plan, replica);
                    for shard in &status_plan {
                        hold_shard(shard, &holder, &mut allocated, &mut shares);
                    }
                    running.push(RunningReplica {
                        holder: holder.clone(),
                        instance: name.clone(),
                        spec: &mi.spec,
                        shards: status_plan.clone(),
                        ready: true,
                        corrections,
                    });
                    Placement {
                        name: name.clone(),
                        replica: (replicas > 1).then_some(replica),
                        model: mi.spec.model.name.clone(),
                        parallelism: chosen.parallelism_note(),
                        status_plan,
                        plan: Some({
                            let (serving, serving_error) = match chosen.capacity {
                                Some(Ok(capacity)) => (Some(capacity), None),
                                Some(Err(why)) => (None, Some(why)),
                                None => (None, None),
                            };
                            PlacedPlan {
                                plan: chosen.plan,
                                serving,
                                serving_error,
                            }
                        }),
                        unsatisfiable: None,
                        moves: None,
                        serving: mi.spec.serving.clone(),
                    }
                }
                Err(unsatisfiable) => Placement {
                    name: name.clone(),
                    replica: (replicas > 1).then_some(replica),
                    model: mi.spec.model.name.clone(),
                    parallelism: None,
                    plan: None,
                    status_plan: Vec::new(),
                    unsatisfiable: Some(unsatisfiable),
                    // Later replicas face the same cluster: one answer.
                    moves: (!std::mem::replace(&mut advised, true)).then(|| {
                        advise(
                            nodes,
                            &outside,
                            &running,
                            (&mi.spec, corrections),
                            (&holder, replica),
                            max_steps,
                        )
                    }),
                    serving: mi.spec.serving.clone(),
                },
            };
            out.push(placement);
        }
    }
    Placed {
        placements: out,
        demands,
        standings,
        running,
        outside,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_built_in_sample_places_every_instance_on_distinct_devices() {
        let report = run(&PlaceArgs {
            show_missed: false,
            instances: vec![],
            cluster: None,
            output: PlaceOutput::Table,
            max_steps: Some(20_000),
            drain: Vec::new(),
            improve: None,
        })
        .unwrap();
        assert_eq!(report.placements.len(), 3);
        assert!(report.all_placed(), "{}", report.render(PlaceOutput::Table));
        let mut seen = std::collections::HashSet::new();
        for p in &report.placements {
            for s in &p.plan.as_ref().unwrap().stages {
                for d in &s.devices {
                    assert!(
                        seen.insert((s.node.clone(), d.clone())),
                        "{d} planned twice"
                    );
                }
            }
        }
    }
}
