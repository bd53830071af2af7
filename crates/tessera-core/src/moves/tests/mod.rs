//! The move planner on small clusters: room made by one move, the cheapest
//! replicas chosen, what may not move left alone, refusals in words, and a
//! property: replaying any sequence it answers gives no device twice at any
//! step, and the blocked replica's devices are free after the last move.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};

use proptest::prelude::*;

use super::*;
use crate::api::NodeGpuState;

mod improve;

const GIB: u64 = 1 << 30;

/// A node of `gpus` GPUs of one product, every pair NVLink-linked.
fn node(name: &str, gpus: u32, product: &str) -> ClusterNode {
    offering(name, gpus, product, "")
}

/// [`node`], with `shares` (a NodeGpuState `shares` field, or nothing).
fn offering(name: &str, gpus: u32, product: &str, shares: &str) -> ClusterNode {
    let (tflops, bandwidth, memory) = match product {
        "L40S" => (362.0, 864.0, 48),
        // Too slow for an 8B model's 50 ms a token.
        "slow" => (20.0, 150.0, 80),
        "slow-large" => (20.0, 150.0, 192),
        "H200" => (989.0, 4800.0, 141),
        _ => (989.0, 3350.0, 80),
    };
    let devices: Vec<String> = (0..gpus)
        .map(|index| {
            format!(
                r#"{{"id":"{name}-g{index}","index":{index},"vendor":"nvidia","product":"NVIDIA {product}",
                "memoryTotalBytes":{total},"memoryFreeBytes":{total},"fp16Tflops":{tflops},
                "memoryBandwidthGbps":{bandwidth},"temperatureC":40.0,"health":"Healthy"}}"#,
                total = memory * GIB
            )
        })
        .collect();
    let mut links = Vec::new();
    for a in 0..gpus {
        for b in a + 1..gpus {
            links.push(format!(
                r#"{{"a":"{name}-g{a}","b":"{name}-g{b}","kind":"nvlink","bandwidthGbps":900.0}}"#
            ));
        }
    }
    let json = format!(
        r#"{{"version":"v1","backend":"fake","devices":[{}],"links":[{}]{shares}}}"#,
        devices.join(","),
        links.join(",")
    );
    ClusterNode {
        name: name.into(),
        labels: BTreeMap::new(),
        gpu_state: NodeGpuState::from_json(&json).expect("a valid state"),
    }
}

/// An 8B model on one GPU.
fn small() -> ModelInstanceSpec {
    spec(
        "model: {name: llama-8b, parametersBillions: 8, layers: 32, hiddenSize: 4096, kvCacheGiB: 8}\nparallelism: {tensor: 1, pipeline: 1}",
    )
}

/// A 70B model in FP8 on four GPUs of one node.
fn four_gpus() -> ModelInstanceSpec {
    spec(
        "model: {name: llama-70b, parametersBillions: 70, layers: 80, hiddenSize: 8192, dtype: fp8, kvCacheGiB: 16}\nparallelism: {tensor: 4, pipeline: 1}",
    )
}

fn spec(yaml: &str) -> ModelInstanceSpec {
    serde_saphyr::from_str(yaml).expect("a valid spec")
}

/// Replica `holder` of `spec` running on `devices` of `node`, one shard.
fn replica<'a>(
    holder: &str,
    spec: &'a ModelInstanceSpec,
    node: &str,
    devices: &[u32],
    ready: bool,
) -> RunningReplica<'a> {
    RunningReplica {
        holder: holder.into(),
        instance: instance_of(holder),
        spec,
        shards: vec![PlannedShard {
            copy: 0,
            replica: 0,
            shard: 0,
            node: node.into(),
            devices: devices.iter().map(|d| format!("{node}-g{d}")).collect(),
            layer_start: 0,
            layer_end: spec.model.layers,
            predicted_memory_gib: 0.0,
            share: None,
        }],
        ready,
        corrections: &[],
    }
}

/// The instance a holder names (`ml/small replica 0`: `ml/small`).
fn instance_of(holder: &str) -> String {
    holder
        .split_once(" replica ")
        .map_or(holder, |(instance, _)| instance)
        .to_string()
}

fn ask<'a>(
    nodes: &'a [ClusterNode],
    others: &'a HashMap<(String, String), String>,
    running: &'a [RunningReplica<'a>],
    blocked: &'a ModelInstanceSpec,
) -> MoveAsk<'a> {
    // A few bytes per test: the options live as long as the ask may.
    let options: &'static SolveOptions<'static> = Box::leak(Box::default());
    MoveAsk {
        nodes,
        others,
        running,
        blocked,
        blocked_name: "ml/big",
        blocked_corrections: &[],
        limits: MoveLimits::default(),
        options,
    }
}

fn devices_of(shards: &[PlannedShard]) -> Vec<(String, String)> {
    shards
        .iter()
        .flat_map(|s| s.devices.iter().map(|d| (s.node.clone(), d.clone())))
        .collect()
}

#[test]
fn one_move_frees_a_node_for_a_four_gpu_replica() {
    let nodes = [node("a", 4, "H100"), node("b", 4, "H100")];
    let (small, big) = (small(), four_gpus());
    let running = [
        replica("ml/small replica 0", &small, "a", &[1], true),
        replica("ml/small replica 1", &small, "b", &[0], true),
        replica("ml/small replica 2", &small, "b", &[1], true),
    ];
    let others = HashMap::new();
    let answer = plan_moves(&ask(&nodes, &others, &running, &big)).expect("room by one move");
    assert_eq!(answer.moves.len(), 1, "{:?}", answer.moves);
    let moved = &answer.moves[0];
    assert_eq!(moved.replica, "ml/small replica 0");
    assert_eq!(moved.to[0].node, "b");
    assert_eq!(answer.gpus_moved, 1.0);
    assert!(moved.requests_per_second_after >= moved.requests_per_second_before);
    let placed = &answer.placed.plan.stages;
    assert_eq!(placed.len(), 1);
    assert_eq!(placed[0].node, "a");
    assert_eq!(placed[0].devices.len(), 4);
}

/// A move is judged with what its instance's predictions were measured off
/// by: three times slower than predicted, it serves a third as much where it
/// is and where it goes.
#[test]
fn a_move_is_judged_with_its_instances_corrections() {
    let nodes = [node("a", 4, "H100"), node("b", 4, "H100")];
    let (small, big) = (small(), four_gpus());
    let slower = [crate::api::ServingCorrection {
        model: "llama-8b".into(),
        runtime: crate::api::Runtime::Vllm,
        product: "NVIDIA H100".into(),
        tensor: 1,
        stages: 1,
        factor: 3.0,
        observations: 5,
        last_observed: k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
            k8s_openapi::jiff::Timestamp::UNIX_EPOCH,
        ),
    }];
    let moved = |corrections: &[crate::api::ServingCorrection]| {
        let mut running = [
            replica("ml/small replica 0", &small, "a", &[1], true),
            replica("ml/small replica 1", &small, "b", &[0], true),
        ];
        running[0].corrections = corrections;
        let others = HashMap::new();
        let answer = plan_moves(&ask(&nodes, &others, &running, &big)).expect("room by one move");
        answer.moves[0].clone()
    };
    let (plain, corrected) = (moved(&[]), moved(&slower));
    assert_eq!(plain.replica, corrected.replica);
    for (p, c) in [
        (
            plain.requests_per_second_before,
            corrected.requests_per_second_before,
        ),
        (
            plain.requests_per_second_after,
            corrected.requests_per_second_after,
        ),
    ] {
        assert!(c > 0.0 && c < p * 0.6, "corrected {c}, as predicted {p}");
    }
}

#[test]
fn the_cheapest_replicas_move_first_and_one_not_serving_costs_half() {
    let nodes = [
        node("a", 4, "H100"),
        node("b", 4, "H100"),
        node("c", 4, "H100"),
    ];
    let (small, big) = (small(), four_gpus());
    // a: one 2-GPU-worth of replicas in the way; b: one replica; c: full.
    let running = [
        replica("ml/small replica 0", &small, "a", &[0], true),
        replica("ml/small replica 1", &small, "a", &[1], true),
        replica("ml/small replica 2", &small, "b", &[2], true),
        replica("ml/small replica 3", &small, "c", &[0], true),
        replica("ml/small replica 4", &small, "c", &[1], true),
    ];
    let others: HashMap<(String, String), String> = [("c", 2), ("c", 3)]
        .into_iter()
        .map(|(n, d)| ((n.to_string(), format!("{n}-g{d}")), "a pod".to_string()))
        .collect();
    let answer = plan_moves(&ask(&nodes, &others, &running, &big)).expect("room");
    assert_eq!(answer.moves.len(), 1);
    assert_eq!(
        answer.moves[0].replica, "ml/small replica 2",
        "b takes one move"
    );
    assert_eq!(answer.placed.plan.stages[0].node, "b");

    // Two on a not yet serving cost 1 together, as much as the one on b;
    // with the one on b serving and one on a gone, a costs 0.5.
    let running = [
        replica("ml/small replica 0", &small, "a", &[0], false),
        replica("ml/small replica 2", &small, "b", &[2], true),
        replica("ml/small replica 3", &small, "c", &[0], true),
    ];
    let answer = plan_moves(&ask(&nodes, &others, &running, &big)).expect("room");
    assert_eq!(answer.moves[0].replica, "ml/small replica 0");
    assert_eq!(answer.placed.plan.stages[0].node, "a");
}

#[test]
fn replicas_that_may_not_move_and_pods_outside_tessera_stay() {
    let nodes = [node("a", 4, "H100"), node("b", 4, "H100")];
    let big = four_gpus();
    let mut fixed = small();
    fixed.placement.moves = crate::api::Moves::Never;
    let running = [
        replica("ml/fixed replica 0", &fixed, "a", &[1], true),
        replica("ml/fixed replica 1", &fixed, "b", &[2], true),
    ];
    let others = HashMap::new();
    let refusal = plan_moves(&ask(&nodes, &others, &running, &big)).unwrap_err();
    assert!(
        refusal
            .reason
            .contains("none of the 2 running replica(s) may move"),
        "{refusal}"
    );
    // A pod outside tessera on b: moving the one movable replica off a is
    // the only way.
    let movable = small();
    let running = [
        replica("ml/small replica 0", &movable, "a", &[1], true),
        replica("ml/fixed replica 0", &fixed, "b", &[2], true),
    ];
    let others: HashMap<(String, String), String> =
        [(("b".to_string(), "b-g3".to_string()), "a pod".to_string())].into();
    let answer = plan_moves(&ask(&nodes, &others, &running, &big)).expect("room on a");
    assert_eq!(answer.moves.len(), 1);
    assert_eq!(answer.moves[0].replica, "ml/small replica 0");
    let to = devices_of(&answer.moves[0].to);
    assert!(
        to.iter()
            .all(|(n, d)| n == "b" && d != "b-g3" && d != "b-g2"),
        "{to:?}"
    );
}

#[test]
fn a_replica_in_the_way_goes_where_it_serves_less_if_it_still_meets_its_target() {
    // The only free GPU elsewhere is an L40S: slower than the H100 the
    // replica in the way runs on, but fast enough for its 50 ms.
    let nodes = [node("a", 4, "H100"), node("b", 1, "L40S")];
    let (small, big) = (small(), four_gpus());
    let running = [replica("ml/small replica 0", &small, "a", &[0], true)];
    let others = HashMap::new();
    let answer = plan_moves(&ask(&nodes, &others, &running, &big)).expect("room");
    let moved = &answer.moves[0];
    assert_eq!(moved.to[0].node, "b");
    assert!(moved.requests_per_second_after > 0.0, "{moved:?}");
    assert!(moved.requests_per_second_after < moved.requests_per_second_before);
    replay_checks(&others, &running, &answer).expect("a sound sequence");
}

#[test]
fn no_replica_goes_where_it_would_miss_its_target() {
    let nodes = [node("a", 4, "H100"), node("b", 1, "slow")];
    let (small, big) = (small(), four_gpus());
    let running = [replica("ml/small replica 0", &small, "a", &[0], true)];
    let others = HashMap::new();
    let refusal = plan_moves(&ask(&nodes, &others, &running, &big)).unwrap_err();
    assert!(
        refusal
            .reason
            .contains("ml/small replica 0 would miss its latency target elsewhere"),
        "{refusal}"
    );
    // An H100 free on another node takes it.
    let nodes = [
        node("a", 4, "H100"),
        node("b", 1, "slow"),
        node("c", 1, "H100"),
    ];
    let answer = plan_moves(&ask(&nodes, &others, &running, &big)).expect("room");
    assert_eq!(answer.moves[0].to[0].node, "c");
}

#[test]
fn no_replica_goes_where_its_instance_would_fall_short_of_its_demand() {
    let nodes = [node("a", 4, "H100"), node("b", 1, "L40S")];
    let big = four_gpus();
    let with_demand = |rps: f64| {
        let mut spec = small();
        spec.serving = Some(crate::api::ServingSpec {
            requests_per_second: Some(rps),
            ..Default::default()
        });
        spec
    };
    let others = HashMap::new();
    let serves = |spec: &ModelInstanceSpec| {
        let running = [replica("ml/small replica 0", spec, "a", &[0], true)];
        plan_moves(&ask(&nodes, &others, &running, &big)).map(|answer| answer.moves[0].clone())
    };
    // What it serves on the L40S, then a demand just above and just below.
    let on_l40s = serves(&with_demand(0.1)).expect("a low demand is still met");
    let after = on_l40s.requests_per_second_after;
    assert!(after < on_l40s.requests_per_second_before);
    let refusal = serves(&with_demand(after * 1.05)).unwrap_err();
    assert!(
        refusal
            .reason
            .contains("moving ml/small replica 0 would leave ml/small short")
            && refusal.reason.contains("below its demand"),
        "{refusal}"
    );
    assert!(serves(&with_demand(after * 0.95)).is_ok());
}

#[test]
fn refusals_say_what_no_move_can_change() {
    let (small, big) = (small(), four_gpus());
    let others = HashMap::new();
    // No node has four GPUs: moving changes nothing.
    let nodes = [node("a", 2, "H100"), node("b", 2, "H100")];
    let running = [replica("ml/small replica 0", &small, "a", &[0], true)];
    let refusal = plan_moves(&ask(&nodes, &others, &running, &big)).unwrap_err();
    assert!(
        refusal.reason.starts_with(
            "ml/big does not fit even with all 1 replica(s) that may move out of the way: "
        ),
        "{refusal}"
    );
    // Room on a, but the replica in its way has nowhere to go.
    let nodes = [node("a", 4, "H100")];
    let refusal = plan_moves(&ask(&nodes, &others, &running, &big)).unwrap_err();
    assert!(
        refusal.reason.starts_with(
            "ml/big fits on a by moving 1 replica(s) (ml/small replica 0), but no free devices hold ml/small replica 0: "
        ),
        "{refusal}"
    );
    // Nothing runs at all; with four GPUs free it fits without a move.
    let answer = plan_moves(&ask(&nodes, &others, &[], &big)).expect("room as it is");
    assert!(answer.moves.is_empty());
    assert_eq!(answer.gpus_moved.to_string(), "0");
    let nodes = [node("a", 2, "H100"), node("b", 2, "H100")];
    let refusal = plan_moves(&ask(&nodes, &others, &[], &big)).unwrap_err();
    assert!(
        refusal.reason.contains("no replica runs that could move"),
        "{refusal}"
    );
}

#[test]
fn a_memory_share_moves_to_a_gpu_where_it_is_as_alone() {
    // A 30B model needs a whole H100 on the `big` pool; the only one there
    // holds a memory share of a sharing 8B replica, which a free H100
    // elsewhere takes as alone as it was.
    let memory = r#","shares":{"memory":true}"#;
    let mut pooled = offering("a", 1, "H100", memory);
    pooled.labels.insert("pool".into(), "big".into());
    let nodes = [pooled, offering("b", 1, "H100", memory)];
    let shared = spec(
        "model: {name: llama-8b, parametersBillions: 8, layers: 32, hiddenSize: 4096, kvCacheGiB: 8}\nparallelism: {tensor: 1, pipeline: 1}\nplacement: {sharing: Shared}",
    );
    let big = spec(
        "model: {name: m-30b, parametersBillions: 30, layers: 60, hiddenSize: 6656, kvCacheGiB: 8}\nparallelism: {tensor: 1, pipeline: 1}\nplacement: {nodeSelector: {pool: big}}",
    );
    let mut tenant = replica("ml/shared replica 0", &shared, "a", &[0], true);
    tenant.shards[0].share = Some(crate::api::ShardShare {
        kind: crate::api::ShareKind::Memory,
        gpu: "a-g0".into(),
        profile: None,
        memory_gib: Some(25),
        memory_fraction: Some(25.0 / 80.0),
        tenants: 0,
        contended_tokens_per_second: None,
    });
    let running = [tenant];
    let others = HashMap::new();
    let answer = plan_moves(&ask(&nodes, &others, &running, &big)).expect("room on a");
    assert_eq!(answer.moves.len(), 1, "{:?}", answer.moves);
    let moved = &answer.moves[0];
    assert_eq!(moved.gpus, 25.0 / 80.0, "a share moves its part of a GPU");
    let share = moved.to[0].share.as_ref().expect("a share again");
    assert_eq!(
        (share.kind, share.gpu.as_str()),
        (crate::api::ShareKind::Memory, "b-g0")
    );
    assert!(moved.requests_per_second_after >= moved.requests_per_second_before);
    assert_eq!(answer.placed.plan.stages[0].devices, ["a-g0"]);
    assert!(
        answer.placed.plan.stages[0].share.is_none(),
        "the GPU whole"
    );
}

#[test]
fn a_pipeline_over_nodes_gets_two_nodes_freed_together() {
    // 70B in 16 bits on pairs of GPUs: two stages, each a whole 2-GPU node.
    let big = spec(
        "model: {name: llama-70b, parametersBillions: 70, layers: 80, hiddenSize: 8192, kvCacheGiB: 16}\nparallelism: {tensor: 2, pipeline: 2}",
    );
    let small = small();
    let nodes = [
        node("a", 2, "H100"),
        node("b", 2, "H100"),
        node("c", 2, "H100"),
    ];
    let running = [
        replica("ml/small replica 0", &small, "a", &[0], true),
        replica("ml/small replica 1", &small, "b", &[0], true),
    ];
    let others = HashMap::new();
    let answer = plan_moves(&ask(&nodes, &others, &running, &big)).expect("room over two nodes");
    assert_eq!(answer.moves.len(), 1, "{:?}", answer.moves);
    let stages = &answer.placed.plan.stages;
    assert_eq!(stages.len(), 2);
    let moved_to = &answer.moves[0].to[0].node;
    assert!(
        stages.iter().all(|s| &s.node != moved_to),
        "{moved_to} is not freed"
    );
    assert_eq!(replay_checks(&others, &running, &answer), Ok(()));
}

#[test]
fn more_moves_than_the_limit_are_refused_with_the_count() {
    let nodes = [node("a", 4, "H100"), node("b", 4, "H100")];
    let (small, big) = (small(), four_gpus());
    let running = [
        replica("ml/small replica 0", &small, "a", &[0], true),
        replica("ml/small replica 1", &small, "a", &[1], true),
        replica("ml/small replica 2", &small, "b", &[0], true),
        replica("ml/small replica 3", &small, "b", &[1], true),
    ];
    let others = HashMap::new();
    let mut asked = ask(&nodes, &others, &running, &big);
    asked.limits.max_moves = 1;
    let refusal = plan_moves(&asked).unwrap_err();
    assert!(
        refusal
            .reason
            .contains("only by moving 2 replicas; at most 1"),
        "{refusal}"
    );
    asked.limits.max_moves = 2;
    let answer = plan_moves(&asked).expect("two moves");
    assert_eq!(answer.moves.len(), 2);
    assert_eq!(answer.gpus_moved, 2.0);
}

#[test]
fn replicas_alike_one_that_has_nowhere_to_go_are_not_tried_again() {
    // Three 70B replicas, not yet Ready (the cheapest to move), each fill a
    // node of four; the blocked 70B is just like them, so none has anywhere
    // to go. Node z's four 8B replicas do: one free H100 each on c0..c3.
    // One place a round and three in all: trying each 70B in turn would
    // spend them all; after the first, its like stay and z is tried.
    let mut nodes = vec![
        node("x0", 4, "H100"),
        node("x1", 4, "H100"),
        node("x2", 4, "H100"),
    ];
    nodes.push(node("z", 4, "H100"));
    nodes.extend((0..4).map(|i| node(&format!("c{i}"), 1, "H100")));
    let (small, big) = (small(), four_gpus());
    let mut running: Vec<RunningReplica<'_>> = (0..3)
        .map(|i| {
            replica(
                &format!("ml/other replica {i}"),
                &big,
                &format!("x{i}"),
                &[0, 1, 2, 3],
                false,
            )
        })
        .collect();
    running
        .extend((0..4).map(|i| replica(&format!("ml/small replica {i}"), &small, "z", &[i], true)));
    let others = HashMap::new();
    let mut asked = ask(&nodes, &others, &running, &big);
    asked.limits.max_candidates = 1;
    asked.limits.max_attempts = 3;
    let answer = plan_moves(&asked).expect("room on z");
    assert_eq!(answer.moves.len(), 4, "{:?}", answer.moves);
    assert!(
        answer
            .moves
            .iter()
            .all(|m| m.replica.starts_with("ml/small"))
    );
    assert_eq!(answer.placed.plan.stages[0].node, "z");
    replay_checks(&others, &running, &answer).expect("a sound sequence");
}

/// Replays `answer` on the cluster `running` and `others` describe: at
/// every step each device has at most one holder, a move's new devices are
/// free when it starts (its old ones still held), and the blocked
/// replica's devices are free after the last move.
fn replay_checks(
    others: &HashMap<(String, String), String>,
    running: &[RunningReplica<'_>],
    answer: &MovePlan,
) -> Result<(), String> {
    let room = super::world::devices_of(&answer.placed.plan);
    replay_moves(others, running, &answer.moves, &room)
}

/// Replays `moves` as [`replay_checks`] does; `room` must be free at the end.
fn replay_moves(
    others: &HashMap<(String, String), String>,
    running: &[RunningReplica<'_>],
    moves: &[Move],
    room: &[(String, String)],
) -> Result<(), String> {
    let mut held: HashMap<(String, String), String> = others.clone();
    for replica in running {
        for device in devices_of(&replica.shards) {
            if let Some(first) = held.insert(device.clone(), replica.holder.clone()) {
                return Err(format!("{device:?} held by {first} and {}", replica.holder));
            }
        }
    }
    let mut moved = HashSet::new();
    for step in moves {
        if !moved.insert(step.replica.clone()) {
            return Err(format!("{} moved twice", step.replica));
        }
        let from = devices_of(&step.from);
        if !from.iter().all(|d| held.get(d) == Some(&step.replica)) {
            return Err(format!(
                "{} moved from devices it does not hold",
                step.replica
            ));
        }
        for device in devices_of(&step.to) {
            if let Some(holder) = held.get(&device) {
                return Err(format!(
                    "{} moved onto {device:?} held by {holder}",
                    step.replica
                ));
            }
        }
        for device in devices_of(&step.to) {
            held.insert(device, step.replica.clone());
        }
        let to: HashSet<_> = devices_of(&step.to).into_iter().collect();
        for device in from.into_iter().filter(|d| !to.contains(d)) {
            held.remove(&device);
        }
    }
    for device in room {
        if let Some(holder) = held.get(device) {
            return Err(format!("{device:?} still held by {holder}"));
        }
    }
    Ok(())
}

/// The evacuation of node `b`, no pods outside tessera.
fn drain_b(nodes: &[ClusterNode], running: &[RunningReplica<'_>]) -> Evacuation {
    plan_evacuation(&EvacuationAsk {
        nodes,
        others: &HashMap::new(),
        running,
        leaving: &BTreeSet::from(["b".to_string()]),
        options: &SolveOptions::default(),
    })
}

#[test]
fn a_drain_moves_what_may_move_off_the_node_and_says_why_the_rest_stays() {
    let nodes = [node("a", 4, "H100"), node("b", 4, "H100")];
    let (small, big) = (small(), four_gpus());
    let mut fixed = small.clone();
    fixed.placement.moves = crate::api::Moves::Never;
    let running = [
        replica("ml/small replica 0", &small, "b", &[0], true),
        replica("ml/fixed replica 0", &fixed, "b", &[1], true),
        replica("ml/big replica 0", &big, "a", &[0, 1, 2, 3], true),
        replica("ml/small replica 1", &small, "b", &[2], true),
    ];
    let evacuation = drain_b(&nodes, &running);
    // a is full: the small replicas have nowhere to go, the fixed one may not.
    let reasons: Vec<(&str, &str)> = evacuation
        .staying
        .iter()
        .map(|s| (s.replica.as_str(), s.reason.as_str()))
        .collect();
    assert!(evacuation.moves.is_empty(), "{:?}", evacuation.moves);
    assert_eq!(reasons.len(), 3, "{reasons:?}");
    assert!(reasons.contains(&(
        "ml/fixed replica 0",
        "its instance has placement.moves: Never"
    )));
    assert!(
        reasons.iter().any(|(who, why)| *who == "ml/small replica 0"
            && why.starts_with("no devices off the leaving nodes hold it: ")),
        "{reasons:?}"
    );

    // With room on c both small replicas leave, one move each, and replay
    // without a device given twice; nothing of theirs is left on b.
    let nodes = [
        node("a", 4, "H100"),
        node("b", 4, "H100"),
        node("c", 2, "H100"),
    ];
    let evacuation = drain_b(&nodes, &running);
    assert_eq!(evacuation.moves.len(), 2, "{:?}", evacuation.moves);
    assert!(evacuation.moves.iter().all(|m| m.to[0].node == "c"));
    assert_eq!(evacuation.staying.len(), 1, "only the fixed one stays");
    let freed = [
        ("b".to_string(), "b-g0".to_string()),
        ("b".to_string(), "b-g2".to_string()),
    ];
    assert_eq!(
        replay_moves(&HashMap::new(), &running, &evacuation.moves, &freed),
        Ok(())
    );
}

#[test]
fn a_drain_never_takes_a_replica_where_it_would_miss_its_target() {
    // The only GPU off b is one an 8B model cannot decode on within 50 ms a
    // token: the replica stays, and says why.
    let nodes = [node("b", 1, "H100"), node("slow", 1, "slow")];
    let small = small();
    let running = [replica("ml/small replica 0", &small, "b", &[0], true)];
    let evacuation = drain_b(&nodes, &running);
    assert!(evacuation.moves.is_empty(), "{:?}", evacuation.moves);
    assert_eq!(evacuation.staying.len(), 1);
    assert!(
        evacuation.staying[0]
            .reason
            .starts_with("elsewhere it would miss its latency target: 0.00 requests/s"),
        "{:?}",
        evacuation.staying
    );
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    /// Small replicas scattered first-fit over 4-GPU nodes, with a few
    /// devices outside tessera: whatever sequence the planner answers
    /// replays without a device given twice, and ends with room.
    #[test]
    fn sequences_never_give_a_device_twice_and_end_with_room(
        node_count in 2usize..4,
        taken in proptest::collection::vec((0usize..4, 0u32..4, 0u8..4), 1..10),
    ) {
        let nodes: Vec<ClusterNode> =
            (0..node_count).map(|i| node(&format!("n{i}"), 4, "H100")).collect();
        let (small, big) = (small(), four_gpus());
        let mut used = HashSet::new();
        let mut others = HashMap::new();
        let mut replicas = Vec::new();
        for (index, (node_at, device, what)) in taken.into_iter().enumerate() {
            let name = format!("n{}", node_at % node_count);
            if !used.insert((name.clone(), device)) {
                continue;
            }
            if what == 0 {
                others.insert((name.clone(), format!("{name}-g{device}")), "a pod".to_string());
            } else {
                replicas.push(replica(&format!("ml/small replica {index}"), &small, &name, &[device], what != 1));
            }
        }
        // Room exists where a node has no pod outside tessera and its
        // replicas fit on the GPUs free elsewhere (all alike: no move is worse).
        let room_exists = nodes.iter().any(|n| {
            let outside = others.keys().filter(|(at, _)| *at == n.name).count();
            let on_node = replicas.iter().filter(|r| r.shards[0].node == n.name).count();
            let free_elsewhere = nodes.iter().filter(|m| m.name != n.name).map(|m| {
                let held = others.keys().filter(|(at, _)| *at == m.name).count()
                    + replicas.iter().filter(|r| r.shards[0].node == m.name).count();
                4 - held
            }).sum::<usize>();
            outside == 0 && on_node <= free_elsewhere
        });
        let asked = ask(&nodes, &others, &replicas, &big);
        match plan_moves(&asked) {
            Ok(answer) => {
                prop_assert!(answer.moves.len() <= asked.limits.max_moves);
                prop_assert_eq!(replay_checks(&others, &replicas, &answer), Ok(()));
                prop_assert_eq!(answer.placed.plan.stages[0].devices.len(), 4);
            }
            Err(refusal) => prop_assert!(!room_exists, "room exists, yet: {}", refusal),
        }
    }
}

/// What one replica of `spec` serves at its target alone on a GPU of
/// `product` (0 where it misses the target).
fn alone_on(spec: &ModelInstanceSpec, product: &str) -> f64 {
    let nodes = [node("alone", 1, product)];
    let problem = crate::translate::build_problem(
        spec,
        nodes.iter(),
        &HashMap::new(),
        &crate::translate::HeldShares::new(),
    );
    crate::sizing::solve_parallelism(
        &problem,
        crate::translate::tensor_choice(spec),
        &SolveOptions::default(),
    )
    .ok()
    .and_then(|placed| placed.requests_per_second())
    .unwrap_or(0.0)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 32, ..ProptestConfig::default() })]

    /// The 8B's replicas (one instance, with or without a demand) hold GPUs
    /// of node a, whose four H100s the blocked 70B needs; one-GPU nodes of
    /// mixed kinds are free. By the objective, room is made exactly when
    /// each replica on a has a free GPU where it still meets its target and
    /// the instance still meets its demand (or serves no less, short of
    /// it), whatever it served before; and no move answered takes a
    /// replica below its target or its instance below its demand.
    #[test]
    fn room_is_made_whenever_moves_keep_every_target_and_demand(
        on_a in proptest::collection::btree_set(0u32..4, 1..4),
        kinds in proptest::collection::vec(0usize..3, 0..5),
        demand in proptest::option::of(1.0f64..120.0),
    ) {
        const KINDS: [&str; 3] = ["H100", "L40S", "slow"];
        let mut small = small();
        small.serving = demand.map(|rps| crate::api::ServingSpec {
            requests_per_second: Some(rps),
            ..Default::default()
        });
        let big = four_gpus();
        let mut nodes = vec![node("a", 4, "H100")];
        nodes.extend(kinds.iter().enumerate().map(|(i, &kind)| node(&format!("b{i}"), 1, KINDS[kind])));
        let running: Vec<RunningReplica<'_>> = on_a
            .iter()
            .enumerate()
            .map(|(i, &device)| replica(&format!("ml/small replica {i}"), &small, "a", &[device], true))
            .collect();
        let others = HashMap::new();
        // The free GPUs where a replica meets its target, the best first:
        // the planner places each moved replica where it serves the most.
        let mut meeting: Vec<f64> = kinds
            .iter()
            .map(|&kind| alone_on(&small, KINDS[kind]))
            .filter(|rps| *rps > 0.0)
            .collect();
        meeting.sort_by(|a, b| b.total_cmp(a));
        let count = running.len();
        let on_h100 = alone_on(&small, "H100");
        let served_before = count as f64 * on_h100;
        let room_exists = meeting.len() >= count && {
            let served_after = count as f64 * meeting[count - 1];
            match demand {
                None => true,
                Some(demand) if served_before >= demand => served_after >= demand * (1.0 - 1e-9),
                Some(_) => served_after >= served_before * (1.0 - 1e-9),
            }
        };
        match plan_moves(&ask(&nodes, &others, &running, &big)) {
            Ok(answer) => {
                prop_assert!(room_exists, "room made where none should be: {:?}", answer.moves);
                prop_assert_eq!(replay_checks(&others, &running, &answer), Ok(()));
                let mut after: Vec<f64> = answer.moves.iter().map(|m| m.requests_per_second_after).collect();
                prop_assert!(after.iter().all(|rps| *rps > 0.0), "{:?}", answer.moves);
                after.resize(count, on_h100);
                if let Some(demand) = demand.filter(|demand| served_before >= *demand) {
                    prop_assert!(crate::sizing::served_together(&after) >= demand * (1.0 - 1e-9));
                }
            }
            Err(refusal) => prop_assert!(!room_exists, "room exists, yet: {}", refusal),
        }
    }
}
