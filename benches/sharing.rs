//! Sharing GPUs between many small models: a seeded run of 1.5B-, 3B- and
//! 8B-class instances (one shard on one GPU, one or two replicas) arriving
//! one after another on the mixed 64-node cluster of the placement
//! benchmark, with a quarter of its H100 and A100 nodes in MIG mode (each GPU
//! split 3g + 2g + 1g + 1g, NVIDIA's published profiles) and every node
//! handing out partitions and memory shares. The same arrivals run with
//! `placement.sharing: Exclusive` and `Shared`, through the same translation
//! the controller uses (`build_problem` from the nodes' GPU states, holds
//! recorded as the controller records them), until the first refusal.
//!
//! A `REPORT` line per mode gives the replicas placed before the first
//! refusal, the GPU memory allocated at that point (a whole GPU or partition
//! counts whole, a memory share its size) against the cluster's, the
//! predicted tokens/s per GPU in use (alone, and contended as planned) and
//! the longest placement (around `solve_replicas`). The 1,000-node cluster
//! runs the first 300 arrivals of `Shared` for the placement time alone.

#[allow(dead_code)]
mod support;

use std::collections::{BTreeSet, HashMap};
use std::time::Instant;

use serde_json::json;
use tessera::api::{ModelInstanceSpec, ShareKind};
use tessera::placement::SolveOptions;
use tessera::sizing::solve_replicas;
use tessera::translate::{
    ClusterNode, HeldShares, build_problem, hold_shard, planned_shards, tensor_choice,
};

use support::shared_nodes::shared_cluster;
use support::{SplitMix64, cluster};

const CLUSTER_SEED: u64 = 0x7e55_e7a0_5eed_0001;
const ARRIVAL_SEED: u64 = 0x5a4e_d000_0000_0034;
const GIB: u64 = 1 << 30;
/// Targets of `Shared` against `Exclusive` on the 64-node cluster.
const PLACED_TARGET: f64 = 2.0;
const MEMORY_TARGET: f64 = 0.8;

/// A small model: parameters (billions), layers, hidden size, attention and
/// key/value heads, KV cache (GiB).
type Small = (&'static str, f64, u32, u32, (u32, u32), f64);
const MODELS: [(Small, u32); 3] = [
    (("1.5B", 1.5, 16, 2048, (16, 8), 2.0), 30),
    (("3B", 3.2, 28, 3072, (24, 8), 4.0), 30),
    (("8B", 8.0, 32, 4096, (32, 8), 8.0), 40),
];
const REPLICAS: [(u32, u32); 2] = [(1, 80), (2, 20)];

fn spec(model: Small, replicas: u32, sharing: &str) -> ModelInstanceSpec {
    let (name, parameters, layers, hidden, (heads, kv_heads), kv) = model;
    serde_json::from_value(json!({
        "model": {"name": name, "parametersBillions": parameters, "layers": layers,
                  "hiddenSize": hidden, "attentionHeads": heads, "kvHeads": kv_heads,
                  "kvCacheGiB": kv},
        "serving": {},
        "replicas": replicas,
        "parallelism": {"tensor": 1, "pipeline": 1},
        "placement": {"sharing": sharing},
    }))
    .expect("a valid spec")
}

#[derive(Default)]
struct Run {
    placed: u32,
    refused_at: Option<usize>,
    memory_allocated: u64,
    memory_total: u64,
    speed_alone: f64,
    speed_contended: f64,
    /// Requests/s at the default target, a memory share at its part of its
    /// GPU (what it is assured with every tenant busy).
    requests_per_second: f64,
    gpus_in_use: usize,
    max_ms: f64,
    mean_ms: f64,
}

/// Replays `arrivals` arrivals under `sharing` until the first refusal (or
/// all of them); with `measure_only` it goes on past refusals and reports
/// only the time.
fn replay(nodes: &[ClusterNode], sharing: &str, arrivals: usize, measure_only: bool) -> Run {
    let mut rng = SplitMix64::new(ARRIVAL_SEED);
    let mut allocated: HashMap<(String, String), String> = HashMap::new();
    let mut shares = HeldShares::new();
    let mut run = Run::default();
    let mut times = Vec::new();
    let options = SolveOptions::default();
    // What each held device or share takes of its GPU's memory, by (node, device).
    let mut memory_of: HashMap<(String, String), u64> = HashMap::new();
    for node in nodes {
        for gpu in &node.gpu_state.devices {
            memory_of.insert((node.name.clone(), gpu.id.clone()), gpu.memory_total_bytes);
            run.memory_total += gpu.memory_total_bytes;
            for partition in gpu.mig.iter().flat_map(|mig| &mig.partitions) {
                memory_of.insert(
                    (node.name.clone(), partition.id.clone()),
                    partition.memory_total_bytes,
                );
            }
        }
    }
    let mut gpus_in_use: BTreeSet<(String, String)> = BTreeSet::new();
    for arrival in 0..arrivals {
        let model = rng.weighted(&MODELS);
        let replicas = rng.weighted(&REPLICAS);
        let spec = spec(model, replicas, sharing);
        let problem = build_problem(&spec, nodes, &allocated, &shares);
        let started = Instant::now();
        let results = solve_replicas(
            &problem,
            tensor_choice(&spec),
            replicas,
            &format!("bench/{arrival}"),
            &options,
        );
        times.push(started.elapsed().as_secs_f64() * 1e3);
        for (replica, result) in (0..replicas).zip(results) {
            let Ok(chosen) = result else {
                run.refused_at.get_or_insert(arrival);
                continue;
            };
            if run.refused_at.is_some() && !measure_only {
                continue;
            }
            run.placed += 1;
            run.speed_alone += chosen.plan.performance.tokens_per_second;
            run.speed_contended += chosen.plan.performance.assured_tokens_per_second();
            run.requests_per_second += chosen.requests_per_second().unwrap_or(0.0);
            for shard in planned_shards(&chosen.plan, replica) {
                let holder = format!("bench/{arrival}/{replica}");
                match &shard.share {
                    Some(share) if share.kind == ShareKind::Memory => {
                        run.memory_allocated += u64::from(share.memory_gib.unwrap_or(0)) * GIB;
                        gpus_in_use.insert((shard.node.clone(), share.gpu.clone()));
                    }
                    Some(share) => {
                        run.memory_allocated += shard
                            .devices
                            .iter()
                            .map(|d| memory_of[&(shard.node.clone(), d.clone())])
                            .sum::<u64>();
                        gpus_in_use.insert((shard.node.clone(), share.gpu.clone()));
                    }
                    None => {
                        for device in &shard.devices {
                            run.memory_allocated +=
                                memory_of[&(shard.node.clone(), device.clone())];
                            gpus_in_use.insert((shard.node.clone(), device.clone()));
                        }
                    }
                }
                hold_shard(&shard, &holder, &mut allocated, &mut shares);
            }
        }
        if run.refused_at.is_some() && !measure_only {
            break;
        }
    }
    run.gpus_in_use = gpus_in_use.len();
    run.max_ms = times.iter().copied().fold(0.0, f64::max);
    run.mean_ms = times.iter().sum::<f64>() / times.len().max(1) as f64;
    run
}

fn report(scenario: &str, sharing: &str, run: &Run) -> String {
    let per_gpu = |speed: f64| speed / run.gpus_in_use.max(1) as f64;
    format!(
        "REPORT sharing/{scenario} {sharing}: {} replicas placed before the first refusal (arrival {}); GPU memory allocated {:.0} of {:.0} GiB ({:.1}%); {} GPUs in use; requests/s at the target per GPU in use {:.2}; predicted tokens/s per GPU in use {:.1} alone, {:.1} contended; placement mean {:.2} ms, max {:.2} ms",
        run.placed,
        run.refused_at.map_or("none".into(), |at| at.to_string()),
        run.memory_allocated as f64 / GIB as f64,
        run.memory_total as f64 / GIB as f64,
        100.0 * run.memory_allocated as f64 / run.memory_total.max(1) as f64,
        run.gpus_in_use,
        per_gpu(run.requests_per_second),
        per_gpu(run.speed_alone),
        per_gpu(run.speed_contended),
        run.mean_ms,
        run.max_ms
    )
}

fn main() {
    let nodes = shared_cluster(&cluster(64, CLUSTER_SEED), true);
    let exclusive = replay(&nodes, "Exclusive", 20_000, false);
    let shared = replay(&nodes, "Shared", 20_000, false);
    eprintln!("{}", report("64_nodes", "Exclusive", &exclusive));
    eprintln!("{}", report("64_nodes", "Shared", &shared));
    let placed = f64::from(shared.placed) / f64::from(exclusive.placed.max(1));
    let memory = shared.memory_allocated as f64 / shared.memory_total.max(1) as f64;
    eprintln!(
        "TARGET sharing/64_nodes: replicas before the first refusal {placed:.2}x Exclusive (target >= {PLACED_TARGET}), memory allocated {:.1}% (target >= {:.0}%), longest placement {:.2} ms (target < 5 ms)",
        100.0 * memory,
        100.0 * MEMORY_TARGET,
        shared.max_ms.max(exclusive.max_ms)
    );
    let large = shared_cluster(&cluster(1000, CLUSTER_SEED), true);
    let timed = replay(&large, "Shared", 300, true);
    eprintln!(
        "TARGET sharing/1000_nodes: {} arrivals of Shared, placement mean {:.2} ms, max {:.2} ms (target < 50 ms)",
        300, timed.mean_ms, timed.max_ms
    );
}
