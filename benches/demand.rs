//! GPUs needed to serve a demand: a seeded mix of instances, 1B to 405B,
//! each with a request rate and its request lengths, placed on the mixed
//! 64-node cluster of the placement benchmark (every node handing out memory
//! shares) three ways, one after another until every instance is placed:
//!
//! - **tessera**: `tensor: auto`, `pipeline: auto`,
//!   `serving.replicasFromDemand` and `sharing: Shared`, through the
//!   controller's translation (`build_problem`) and
//!   `sizing::solve_for_demand` (a shard needing more than half a GPU no one
//!   shares yet takes it whole);
//! - **tessera without sharing**: the same with `Exclusive`;
//! - **a careful user**: whole GPUs; for each replica the smallest tensor
//!   size (then the fewest pipeline stages) that holds the model on free
//!   GPUs and meets the target there, first fit by node name as a scheduler
//!   without a solver places it; and replicas added until they serve the
//!   demand, judged by tessera's own serving model (the user is given
//!   tessera's knowledge of capacity, not its placement).
//!
//! Every replica is judged at the end by the serving model on the devices
//! it holds, a memory share at its part of its GPU. A `REPORT` line per way
//! gives the GPUs in use (every GPU holding anything counts whole; memory
//! shares by their part besides), the demands met, and the replicas. The
//! target: tessera takes at most 0.6× the careful user's GPUs, every demand
//! met.

#[allow(dead_code)]
mod support;

use std::collections::{BTreeSet, HashMap};

use serde_json::json;
use tessera::api::{ModelInstanceSpec, PlannedShard, ShareKind};
use tessera::placement::{Plan, SolveOptions};
use tessera::sizing::{served_together, solve_for_demand};
use tessera::translate::{
    ClusterNode, HeldShares, build_problem, hold_shard, planned_shards, tensor_choice,
};

use support::demands::{REQUEST_SHAPES, user_replica};
use support::shared_nodes::shared_cluster;
use support::{SplitMix64, cluster};

const CLUSTER_SEED: u64 = 0x7e55_e7a0_5eed_0001;
const MIX_SEED: u64 = 0xde3a_4d00_0000_0045;
const INSTANCES: usize = 60;
/// tessera's GPUs against the careful user's.
const GPU_TARGET: f64 = 0.6;

/// A model class: name, parameters (billions), layers, hidden size,
/// attention and key/value heads, dtype, and the range its demand is drawn
/// from (requests/s).
struct Class {
    name: &'static str,
    parameters: f64,
    layers: u32,
    hidden: u32,
    heads: (u32, u32),
    dtype: &'static str,
    demand: (f64, f64),
}

const CLASSES: [(Class, u32); 6] = [
    (
        Class {
            name: "1b",
            parameters: 1.24,
            layers: 16,
            hidden: 2048,
            heads: (32, 8),
            dtype: "bf16",
            demand: (0.5, 20.0),
        },
        20,
    ),
    (
        Class {
            name: "3b",
            parameters: 3.2,
            layers: 28,
            hidden: 3072,
            heads: (24, 8),
            dtype: "bf16",
            demand: (0.5, 15.0),
        },
        20,
    ),
    (
        Class {
            name: "8b",
            parameters: 8.0,
            layers: 32,
            hidden: 4096,
            heads: (32, 8),
            dtype: "bf16",
            demand: (0.5, 20.0),
        },
        30,
    ),
    (
        Class {
            name: "70b",
            parameters: 70.6,
            layers: 80,
            hidden: 8192,
            heads: (64, 8),
            dtype: "bf16",
            demand: (0.3, 6.0),
        },
        12,
    ),
    (
        Class {
            name: "70b-fp8",
            parameters: 70.6,
            layers: 80,
            hidden: 8192,
            heads: (64, 8),
            dtype: "fp8",
            demand: (0.3, 6.0),
        },
        10,
    ),
    (
        Class {
            name: "405b-fp8",
            parameters: 405.0,
            layers: 126,
            hidden: 16384,
            heads: (128, 8),
            dtype: "fp8",
            demand: (0.2, 2.0),
        },
        8,
    ),
];

/// One instance of the mix.
struct Instance {
    name: String,
    class: &'static Class,
    request: (u32, u32),
    demand: f64,
}

fn mix() -> Vec<Instance> {
    let mut rng = SplitMix64::new(MIX_SEED);
    let classes: Vec<(usize, u32)> = CLASSES
        .iter()
        .enumerate()
        .map(|(index, (_, weight))| (index, *weight))
        .collect();
    (0..INSTANCES)
        .map(|at| {
            let class = &CLASSES[rng.weighted(&classes)].0;
            let request = rng.weighted(&REQUEST_SHAPES);
            let (low, high) = class.demand;
            // Log-uniform: a few busy instances and many quiet ones.
            let demand = (low.ln() + rng.unit() * (high.ln() - low.ln())).exp();
            Instance {
                name: format!("d{at:02}-{}", class.name),
                class,
                request,
                demand: (demand * 100.0).round() / 100.0,
            }
        })
        .collect()
}

#[derive(Clone, Copy, PartialEq)]
enum Way {
    Tessera,
    TesseraExclusive,
    CarefulUser,
}

impl Way {
    fn name(self) -> &'static str {
        match self {
            Way::Tessera => "tessera",
            Way::TesseraExclusive => "tessera without sharing",
            Way::CarefulUser => "careful user",
        }
    }
}

fn spec(instance: &Instance, way: Way) -> ModelInstanceSpec {
    let class = instance.class;
    let sharing = match way {
        Way::Tessera => "Shared",
        Way::TesseraExclusive | Way::CarefulUser => "Exclusive",
    };
    serde_json::from_value(json!({
        "model": {"name": class.name, "parametersBillions": class.parameters,
                  "layers": class.layers, "hiddenSize": class.hidden, "dtype": class.dtype,
                  "attentionHeads": class.heads.0, "kvHeads": class.heads.1},
        "parallelism": {"tensor": "auto", "pipeline": "auto"},
        "placement": {"sharing": sharing},
        "serving": {"inputTokens": instance.request.0, "outputTokens": instance.request.1,
                    "requestsPerSecond": instance.demand, "replicasFromDemand": true},
    }))
    .expect("a valid spec")
}

/// The devices and shares held so far, as the controller records them.
#[derive(Default)]
struct Held {
    allocated: HashMap<(String, String), String>,
    shares: HeldShares,
}

impl Held {
    fn hold(&mut self, shards: &[PlannedShard], owner: &str) {
        for shard in shards {
            let holder = format!("{owner}/{}", shard.replica);
            hold_shard(shard, &holder, &mut self.allocated, &mut self.shares);
        }
    }
}

/// What one way took.
#[derive(Default)]
struct Outcome {
    met: usize,
    unmet: Vec<String>,
    replicas: usize,
    /// GPUs holding anything (a shared GPU counts whole), and the GPUs the
    /// replicas take with a memory share at its part.
    gpus: BTreeSet<(String, String)>,
    parts: f64,
    requests_per_second: f64,
    demand: f64,
}

impl Outcome {
    fn record(&mut self, plan: &Plan, replica: u32, gpus: f64) -> Vec<PlannedShard> {
        let shards = planned_shards(plan, replica);
        for shard in &shards {
            // A partition is named by its own id, its GPU by the share; a
            // memory share by its GPU's id.
            let partition = shard
                .share
                .as_ref()
                .filter(|share| share.kind == ShareKind::Partition);
            match partition {
                Some(share) => {
                    self.gpus.insert((shard.node.clone(), share.gpu.clone()));
                }
                None => {
                    for device in &shard.devices {
                        self.gpus.insert((shard.node.clone(), device.clone()));
                    }
                }
            }
        }
        self.parts += gpus;
        self.replicas += 1;
        shards
    }
}

fn place(nodes: &[ClusterNode], instances: &[Instance], way: Way) -> Outcome {
    let mut held = Held::default();
    let mut outcome = Outcome::default();
    let options = SolveOptions::default();
    for instance in instances {
        let spec = spec(instance, way);
        let owner = format!("bench/{}", instance.name);
        let mut served = Vec::new();
        match way {
            Way::Tessera | Way::TesseraExclusive => {
                let problem = build_problem(&spec, nodes, &held.allocated, &held.shares);
                let results = solve_for_demand(
                    &problem,
                    tensor_choice(&spec),
                    instance.demand,
                    spec.most_replicas(),
                    &owner,
                    &options,
                );
                for chosen in results.into_iter().flatten() {
                    let replica = served.len();
                    served.push(chosen.requests_per_second().unwrap_or(0.0));
                    held.hold(
                        &outcome.record(&chosen.plan, replica as u32, chosen.gpus),
                        &owner,
                    );
                }
            }
            Way::CarefulUser => {
                while served_together(&served) < instance.demand
                    && served.len() < spec.most_replicas() as usize
                {
                    let problem = build_problem(&spec, nodes, &held.allocated, &held.shares);
                    let Some((plan, rps, gpus)) = user_replica(&problem) else {
                        break;
                    };
                    let replica = served.len();
                    served.push(rps);
                    held.hold(&outcome.record(&plan, replica as u32, gpus), &owner);
                }
            }
        }
        let together = served_together(&served);
        outcome.requests_per_second += together.min(instance.demand);
        outcome.demand += instance.demand;
        if together >= instance.demand {
            outcome.met += 1;
        } else {
            outcome.unmet.push(format!(
                "{} ({:.2} of {:.2} requests/s)",
                instance.name, together, instance.demand
            ));
        }
    }
    outcome
}

fn report(way: Way, outcome: &Outcome) -> String {
    format!(
        "REPORT demand/64_nodes {}: {} GPUs in use ({:.1} with memory shares at their part), {} replicas; demands met {} of {INSTANCES} ({:.1} of {:.1} requests/s served){}",
        way.name(),
        outcome.gpus.len(),
        outcome.parts,
        outcome.replicas,
        outcome.met,
        outcome.requests_per_second,
        outcome.demand,
        if outcome.unmet.is_empty() {
            String::new()
        } else {
            format!("; unmet: {}", outcome.unmet.join(", "))
        }
    )
}

fn describe(instances: &[Instance]) -> String {
    let mut by_class: Vec<(&str, usize, f64)> = Vec::new();
    for instance in instances {
        match by_class
            .iter_mut()
            .find(|(name, ..)| *name == instance.class.name)
        {
            Some(entry) => {
                entry.1 += 1;
                entry.2 += instance.demand;
            }
            None => by_class.push((instance.class.name, 1, instance.demand)),
        }
    }
    let classes: Vec<String> = by_class
        .iter()
        .map(|(name, count, demand)| format!("{count} {name} ({demand:.1} requests/s)"))
        .collect();
    format!("{} instances: {}", instances.len(), classes.join(", "))
}

fn main() {
    let nodes = shared_cluster(&cluster(64, CLUSTER_SEED), false);
    let instances = mix();
    eprintln!(
        "MIX demand/64_nodes seed {MIX_SEED:#x}: {}",
        describe(&instances)
    );
    let ways = [Way::Tessera, Way::TesseraExclusive, Way::CarefulUser];
    let outcomes: Vec<Outcome> = ways
        .iter()
        .map(|&way| place(&nodes, &instances, way))
        .collect();
    for (way, outcome) in ways.iter().zip(&outcomes) {
        eprintln!("{}", report(*way, outcome));
    }
    let user = outcomes[2].gpus.len().max(1) as f64;
    let ratio = |outcome: &Outcome| outcome.gpus.len() as f64 / user;
    let every = outcomes[0].met == INSTANCES;
    eprintln!(
        "TARGET demand/64_nodes: tessera takes {:.2}x the careful user's GPUs (target <= {GPU_TARGET}: {}), without sharing {:.2}x; every demand met: {}",
        ratio(&outcomes[0]),
        if ratio(&outcomes[0]) <= GPU_TARGET && every {
            "met"
        } else {
            "MISSED"
        },
        ratio(&outcomes[1]),
        if every { "yes" } else { "no" },
    );
}
