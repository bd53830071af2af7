//! The move planner (`moves::plan_moves`) on the placement benchmark's
//! generated clusters, 64 and 1,000 nodes of 8 GPUs: every node runs one to
//! three 8B replicas of one GPU each (of instances that may move), so no
//! node is free whole, and a 405B-class replica (8 GPUs a shard, pipeline
//! `auto`) asks for room. Criterion times one answer; a `REPORT` line per
//! cluster gives the moves, the GPUs moved and where the replica then runs.
//! Target: one answer < 50 ms at 1,000 nodes. The improvement planner of
//! continuous moves (`moves::plan_improvement`) on the same clusters: one
//! look, every replica judged where it is and the eight serving least per
//! GPU tried elsewhere; its `REPORT` line gives what it would move.

#[allow(dead_code)]
mod support;

use std::collections::HashMap;
use std::hint::black_box;

use criterion::{Criterion, criterion_group, criterion_main};
use tessera::api::{ModelInstanceSpec, PlannedShard};
use tessera::moves::{
    IMPROVE_MAX_TRIED, ImproveAsk, MoveAsk, MoveLimits, RunningReplica, plan_improvement,
    plan_moves,
};
use tessera::placement::SolveOptions;
use tessera::sizing::TensorChoice;
use tessera::translate::ClusterNode;

use support::arrivals::{Arrival, MODEL_8B, MODEL_405B};
use support::objects::to_node;
use support::{MAX_TEMPERATURE_C, cluster};

const SEED: u64 = 0x7e55_e7a0_5eed_0001;
/// An 8B replica's share of a GPU it may run on, at least.
const SMALL_NEEDS_BYTES: u64 = 26 << 30;

fn spec(class: &'static str, model: support::ModelSpec, tensor: u32) -> ModelInstanceSpec {
    Arrival {
        id: 0,
        class,
        model,
        tensor: TensorChoice::Fixed(tensor),
        replicas: 1,
    }
    .spec()
}

/// The cluster as the controller reads it, and one to three 8B replicas on
/// every node, on its first GPUs that can hold one.
fn fragmented(
    nodes: usize,
    small: &ModelInstanceSpec,
) -> (Vec<ClusterNode>, Vec<RunningReplica<'_>>) {
    let states = cluster(nodes, SEED);
    let mut running = Vec::new();
    for (index, state) in states.iter().enumerate() {
        let usable = state.devices.iter().filter(|device| {
            device.healthy
                && device.temperature_c.is_none_or(|t| t < MAX_TEMPERATURE_C)
                && device.memory_free_bytes >= SMALL_NEEDS_BYTES
        });
        for device in usable.take(1 + index % 3) {
            running.push(RunningReplica {
                holder: format!("bench/chat-{} replica 0", device.id),
                instance: format!("bench/chat-{}", device.id),
                spec: small,
                shards: vec![PlannedShard {
                    copy: 0,
                    replica: 0,
                    shard: 0,
                    node: state.name.clone(),
                    devices: vec![device.id.clone()],
                    layer_start: 0,
                    layer_end: small.model.layers,
                    predicted_memory_gib: 0.0,
                    share: None,
                }],
                ready: true,
                corrections: &[],
            });
        }
    }
    let nodes = states
        .iter()
        .map(|state| {
            ClusterNode::from_node(&to_node(state))
                .expect("a valid GPU state")
                .expect("a GPU node")
        })
        .collect();
    (nodes, running)
}

fn moves_benches(c: &mut Criterion) {
    let small = spec("8B", MODEL_8B, 1);
    let big = spec("405B", MODEL_405B, 8);
    let others = HashMap::new();
    let options = SolveOptions::default();
    let mut group = c.benchmark_group("moves");
    group.sample_size(10);
    for nodes in [64, 1000] {
        let (cluster, running) = fragmented(nodes, &small);
        let ask = MoveAsk {
            nodes: &cluster,
            others: &others,
            running: &running,
            blocked: &big,
            blocked_name: "bench/405b",
            blocked_corrections: &[],
            limits: MoveLimits::default(),
            options: &options,
        };
        match plan_moves(&ask) {
            Ok(plan) => {
                let then: Vec<String> = plan
                    .placed
                    .plan
                    .stages
                    .iter()
                    .map(|stage| format!("{} x{}", stage.node, stage.devices.len()))
                    .collect();
                let moved: Vec<String> = plan
                    .moves
                    .iter()
                    .map(|m| format!("{} -> {}", m.from[0].node, m.to[0].node))
                    .collect();
                eprintln!(
                    "REPORT moves/405b_over_{nodes}x8 ({} 8B replicas running): {} move(s) ({}), {} GPU(s) moved, then on {}",
                    running.len(),
                    plan.moves.len(),
                    moved.join(", "),
                    plan.gpus_moved,
                    then.join(" + ")
                );
            }
            Err(no_room) => eprintln!("REPORT moves/405b_over_{nodes}x8: no room: {no_room}"),
        }
        group.bench_function(format!("405b_over_{nodes}x8"), |b| {
            b.iter(|| plan_moves(black_box(&ask)))
        });
        let improve = ImproveAsk {
            nodes: &cluster,
            others: &others,
            running: &running,
            min_gain: 0.2,
            max_tried: IMPROVE_MAX_TRIED,
            options: &options,
        };
        match plan_improvement(&improve) {
            Some(found) => {
                let moved: Vec<String> = found
                    .moves
                    .iter()
                    .map(|m| {
                        format!(
                            "{} -> {} ({:.2} -> {:.2} requests/s)",
                            m.from[0].node,
                            m.to[0].node,
                            m.requests_per_second_before,
                            m.requests_per_second_after
                        )
                    })
                    .collect();
                eprintln!(
                    "REPORT moves/improve_{nodes}x8: {} move(s) ({}); the cluster {:.2} -> {:.2} TFLOP/s of model work per GPU",
                    found.moves.len(),
                    moved.join(", "),
                    found.cluster_tflops_per_gpu_before,
                    found.cluster_tflops_per_gpu_after
                );
            }
            None => eprintln!("REPORT moves/improve_{nodes}x8: nothing gains a fifth"),
        }
        group.bench_function(format!("improve_{nodes}x8"), |b| {
            b.iter(|| plan_improvement(black_box(&improve)))
        });
    }
    group.finish();
}

criterion_group!(benches, moves_benches);
criterion_main!(benches);
