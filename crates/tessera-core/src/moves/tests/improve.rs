//! The improvement planner (continuous moves): a replica moved alone to
//! free devices where it serves more, or onto devices another one leaves
//! for free ones where that one still meets its target; the least gain
//! honoured, what may not move left alone, and every answer replayed with
//! no device given twice; gains weighed by the work a request costs.

use super::*;

/// A 90B model in FP8 on one GPU (an 80 GB GPU does not hold it), for
/// users who take 150 ms a token.
fn large_one_gpu() -> ModelInstanceSpec {
    spec(
        "model: {name: large-90b, parametersBillions: 90, layers: 100, hiddenSize: 8192, attentionHeads: 64, kvHeads: 8, dtype: fp8}\nparallelism: {tensor: 1, pipeline: 1}\nserving: {maxTimePerOutputTokenMs: 150}",
    )
}

fn improve<'a>(
    nodes: &'a [ClusterNode],
    running: &'a [RunningReplica<'a>],
    min_gain: f64,
) -> Option<Improvement> {
    let options: &'static SolveOptions<'static> = Box::leak(Box::default());
    let others: &'static HashMap<(String, String), String> = Box::leak(Box::default());
    let answer = plan_improvement(&ImproveAsk {
        nodes,
        others,
        running,
        min_gain,
        max_tried: 8,
        options,
    });
    if let Some(answer) = &answer {
        replay_moves(others, running, &answer.moves, &[]).expect("a sound sequence");
    }
    answer
}

#[test]
fn a_replica_missing_its_target_moves_alone_to_a_free_gpu_that_meets_it() {
    let nodes = [node("a", 1, "slow"), node("b", 1, "H100")];
    let small = small();
    let running = [replica("ml/chat replica 0", &small, "a", &[0], true)];
    let answer = improve(&nodes, &running, 0.2).expect("an improvement");
    assert_eq!(answer.moves.len(), 1);
    let moved = &answer.moves[0];
    assert_eq!(moved.to[0].node, "b");
    assert_eq!(moved.requests_per_second_before, 0.0, "slow misses 50 ms");
    assert!(moved.requests_per_second_after > 0.0);
    assert!(answer.cluster_tflops_per_gpu_after > answer.cluster_tflops_per_gpu_before);
    assert_eq!(answer.gpus_moved, 1.0);
}

#[test]
fn a_move_gaining_less_than_the_least_gain_is_not_made() {
    let nodes = [node("a", 1, "L40S"), node("b", 1, "H100")];
    let small = small();
    let running = [replica("ml/chat replica 0", &small, "a", &[0], true)];
    let answer = improve(&nodes, &running, 0.2).expect("an H100 serves more");
    let gained = answer.gain() / answer.work_tflops_before;
    assert!(gained > 0.2, "{gained}");
    assert!(improve(&nodes, &running, gained + 0.01).is_none());
}

#[test]
fn a_small_replica_makes_way_on_the_one_gpu_a_larger_one_needs() {
    // The 90B misses its target on the slow GPU; only the H200 the 8B holds
    // meets it, and the 8B still meets its own on the free H100 (it serves
    // a fifth less there). In raw requests/s the pair gains an eighth of
    // what it served; weighed by work (a 90B request costs 11.25 times an
    // 8B one) it gains several times that.
    let nodes = [
        node("a", 1, "H200"),
        node("b", 1, "H100"),
        node("c", 1, "slow-large"),
    ];
    let (small, large) = (small(), large_one_gpu());
    let running = [
        replica("ml/chat replica 0", &small, "a", &[0], true),
        replica("ml/big replica 0", &large, "c", &[0], true),
    ];
    let answer = improve(&nodes, &running, 0.1).expect("an improvement");
    let order: Vec<(&str, &str)> = answer
        .moves
        .iter()
        .map(|m| (m.replica.as_str(), m.to[0].node.as_str()))
        .collect();
    assert_eq!(
        order,
        [("ml/chat replica 0", "b"), ("ml/big replica 0", "a")]
    );
    let chat = &answer.moves[0];
    assert!(
        chat.requests_per_second_after > 0.0,
        "still meets its target"
    );
    assert!(chat.requests_per_second_after < chat.requests_per_second_before);
    let raw_before: f64 = answer
        .moves
        .iter()
        .map(|m| m.requests_per_second_before)
        .sum();
    let raw_after: f64 = answer
        .moves
        .iter()
        .map(|m| m.requests_per_second_after)
        .sum();
    assert!(
        raw_after - raw_before < 0.2 * raw_before,
        "in raw requests/s under a fifth"
    );
    let weighed = answer.gain() / answer.work_tflops_before;
    assert!(weighed > 1.0, "weighed by work: {weighed}");
    assert!(improve(&nodes, &running, weighed - 0.01).is_some());
    assert!(improve(&nodes, &running, weighed + 0.01).is_none());
}

#[test]
fn no_replica_makes_way_to_where_it_would_miss_its_target() {
    let nodes = [
        node("a", 1, "H200"),
        node("b", 1, "slow"),
        node("c", 1, "slow-large"),
    ];
    // The 8B has 1 GiB of KV cache: it serves little on the H200, less than
    // the 90B would gain there, but on the slow GPU it would serve nothing.
    let small = spec(
        "model: {name: llama-8b, parametersBillions: 8, layers: 32, hiddenSize: 4096, kvCacheGiB: 1}\nparallelism: {tensor: 1, pipeline: 1}",
    );
    let large = large_one_gpu();
    let running = [
        replica("ml/chat replica 0", &small, "a", &[0], true),
        replica("ml/big replica 0", &large, "c", &[0], true),
    ];
    assert!(improve(&nodes, &running, 0.1).is_none());
    // Where the free GPU meets its target, the same pair moves.
    let fast = [nodes[0].clone(), node("b", 1, "H100"), nodes[2].clone()];
    let answer = improve(&fast, &running, 0.1).expect("an improvement");
    assert_eq!(answer.moves.len(), 2, "{answer:?}");
    assert!(
        answer.moves[0].requests_per_second_after > 0.0,
        "{answer:?}"
    );
}

#[test]
fn replicas_that_may_not_move_stay_as_they_are() {
    let nodes = [
        node("a", 1, "H200"),
        node("b", 1, "H100"),
        node("c", 1, "slow-large"),
    ];
    let (mut small, mut large) = (small(), large_one_gpu());
    small.placement.moves = crate::api::Moves::Never;
    let running = [
        replica("ml/chat replica 0", &small, "a", &[0], true),
        replica("ml/big replica 0", &large, "c", &[0], true),
    ];
    assert!(improve(&nodes, &running, 0.1).is_none(), "the 8B stays");
    let small = self::small();
    large.placement.moves = crate::api::Moves::Never;
    let running = [
        replica("ml/chat replica 0", &small, "a", &[0], true),
        replica("ml/big replica 0", &large, "c", &[0], true),
    ];
    let answer = improve(&nodes, &running, 0.1);
    assert!(
        answer
            .as_ref()
            .is_none_or(|a| a.moves.iter().all(|m| m.replica != "ml/big replica 0")),
        "{answer:?}"
    );
}

#[test]
fn a_cluster_where_every_replica_is_as_well_placed_as_it_can_be_gets_no_moves() {
    let nodes = [node("a", 2, "H100"), node("b", 2, "H100")];
    let small = small();
    let running = [
        replica("ml/chat replica 0", &small, "a", &[0], true),
        replica("ml/chat replica 1", &small, "b", &[1], true),
    ];
    assert!(improve(&nodes, &running, 0.0).is_none());
}
