//! Sharing GPUs end to end through the core: published node states (a GPU in
//! MIG mode, whole GPUs on a node that offers memory shares) and specs with
//! each `placement.sharing` become problems, plans and status entries.

use std::collections::{BTreeMap, HashMap};

use tessera_core::api::{ModelInstanceSpec, NodeGpuState, ShareKind};
use tessera_core::placement::SolveOptions;
use tessera_core::sizing::solve_replicas;
use tessera_core::translate::{
    ClusterNode, HeldShares, build_problem, hold_shard, planned_shards, tensor_choice,
};

const GIB: u64 = 1 << 30;

/// An H100 as NVML reports it; `mig` is its MIG state, if any.
fn h100(id: &str, index: u32, mig: &str) -> String {
    format!(
        r#"{{"id":"{id}","index":{index},"vendor":"nvidia","product":"NVIDIA H100 80GB HBM3",
        "memoryTotalBytes":{total},"memoryFreeBytes":{total},"fp16Tflops":989.0,
        "memoryBandwidthGbps":3350.0,"temperatureC":40.0,"health":"Healthy"{mig}}}"#,
        total = 80 * GIB
    )
}

/// H100 MIG partitions (NVIDIA's published profiles): 1g.10gb, 2g.20gb and
/// 3g.40gb on memory slices 0, 2-3 and 4-7.
const PARTITIONS: &str = r#","mig":{"enabled":true,"memorySlices":8,"multiprocessors":132,
    "partitions":[
      {"id":"MIG-1g","profile":"1g.10gb","memoryTotalBytes":10737418240,"multiprocessors":16,"placementStart":0,"placementSize":1},
      {"id":"MIG-2g","profile":"2g.20gb","memoryTotalBytes":21474836480,"multiprocessors":32,"placementStart":2,"placementSize":2},
      {"id":"MIG-3g","profile":"3g.40gb","memoryTotalBytes":42949672960,"multiprocessors":60,"placementStart":4,"placementSize":4}]}"#;

fn node(name: &str, devices: &[String], shares: &str) -> ClusterNode {
    let json = format!(
        r#"{{"version":"v1","backend":"fake","devices":[{}]{shares}}}"#,
        devices.join(",")
    );
    ClusterNode {
        name: name.into(),
        labels: BTreeMap::new(),
        gpu_state: NodeGpuState::from_json(&json).expect("a valid state"),
    }
}

/// The sample 8B model: about 24.4 GiB with its KV cache.
fn spec(sharing: &str, optimize: &str, replicas: u32) -> ModelInstanceSpec {
    serde_saphyr::from_str(&format!(
        "model: {{name: llama-8b, parametersBillions: 8, layers: 32, hiddenSize: 4096, kvCacheGiB: 8, overheadGiB: 1.5}}
replicas: {replicas}
parallelism: {{tensor: 1, pipeline: 1, optimize: {optimize}}}
placement: {{sharing: {sharing}}}"
    ))
    .expect("a valid spec")
}

fn mig_node() -> ClusterNode {
    node(
        "mig",
        &[h100("GPU-mig", 0, PARTITIONS), h100("GPU-whole", 1, "")],
        r#","shares":{"partitions":true}"#,
    )
}

fn plan(
    spec: &ModelInstanceSpec,
    nodes: &[ClusterNode],
    allocated: &HashMap<(String, String), String>,
    shares: &HeldShares,
) -> Vec<tessera_core::api::PlannedShard> {
    let problem = build_problem(spec, nodes, allocated, shares);
    solve_replicas(
        &problem,
        tensor_choice(spec),
        spec.replicas,
        "ml/test",
        &SolveOptions::default(),
    )
    .into_iter()
    .enumerate()
    .flat_map(|(replica, result)| {
        let chosen = result.unwrap_or_else(|refusal| panic!("replica {replica}: {refusal:?}"));
        planned_shards(&chosen.plan, replica as u32)
    })
    .collect()
}

#[test]
fn exclusive_never_sees_partitions_and_a_mig_gpu_is_never_whole() {
    let nodes = [mig_node()];
    let shards = plan(
        &spec("Exclusive", "throughput", 1),
        &nodes,
        &HashMap::new(),
        &HeldShares::new(),
    );
    assert_eq!(shards[0].devices, ["GPU-whole"]);
    assert_eq!(shards[0].share, None);
    let problem = build_problem(
        &spec("Exclusive", "throughput", 1),
        &nodes,
        &HashMap::new(),
        &HeldShares::new(),
    );
    assert_eq!(problem.nodes[0].devices.len(), 2, "no partition offered");
}

#[test]
fn isolated_takes_the_smallest_partition_that_holds_the_shard() {
    let nodes = [mig_node()];
    let shards = plan(
        &spec("Isolated", "throughput", 1),
        &nodes,
        &HashMap::new(),
        &HeldShares::new(),
    );
    assert_eq!(shards[0].devices, ["MIG-3g"], "2g.20gb cannot hold 24 GiB");
    let share = shards[0].share.as_ref().expect("a partition");
    assert_eq!(share.kind, ShareKind::Partition);
    assert_eq!(share.gpu, "GPU-mig");
    assert_eq!(share.profile.as_deref(), Some("3g.40gb"));
    // Latency takes the fastest device: the whole GPU beats the partition.
    let fastest = plan(
        &spec("Isolated", "latency", 1),
        &nodes,
        &HashMap::new(),
        &HeldShares::new(),
    );
    assert_eq!(fastest[0].devices, ["GPU-whole"]);
}

#[test]
fn a_partition_is_planned_at_its_share_of_the_gpu() {
    let nodes = [mig_node()];
    let problem = build_problem(
        &spec("Isolated", "throughput", 1),
        &nodes,
        &HashMap::new(),
        &HeldShares::new(),
    );
    let partition = problem.nodes[0]
        .devices
        .iter()
        .find(|device| device.id == "MIG-3g")
        .expect("offered");
    assert_eq!(partition.memory_total_bytes, 40 * GIB);
    assert!((partition.memory_bandwidth_gbps - 3350.0 / 2.0).abs() < 1e-9);
    assert!((partition.fp16_tflops - 989.0 * 60.0 / 132.0).abs() < 1e-9);
    assert!(
        partition.product.contains("H100"),
        "product selectors still match"
    );
}

#[test]
fn partitions_are_offered_only_where_the_node_hands_them_out() {
    let quiet = node("mig", &[h100("GPU-mig", 0, PARTITIONS)], "");
    let problem = build_problem(
        &spec("Isolated", "throughput", 1),
        &[quiet],
        &HashMap::new(),
        &HeldShares::new(),
    );
    assert_eq!(problem.nodes[0].devices.len(), 1);
    let problem = tessera_core::placement::solve(&problem, &SolveOptions::default());
    let refusal = problem.expect_err("nothing to plan on");
    assert!(
        refusal.details.join(" ").contains("in MIG mode"),
        "{refusal:?}"
    );
}

fn shared_node() -> ClusterNode {
    node(
        "shared",
        &[h100("GPU-a", 0, ""), h100("GPU-b", 1, "")],
        r#","shares":{"memory":true}"#,
    )
}

#[test]
fn shared_replicas_fill_one_gpu_by_memory_and_say_what_contention_costs() {
    let nodes = [shared_node()];
    let shards = plan(
        &spec("Shared", "throughput", 3),
        &nodes,
        &HashMap::new(),
        &HeldShares::new(),
    );
    assert_eq!(shards.len(), 3);
    for (tenants, shard) in shards.iter().enumerate() {
        let share = shard.share.as_ref().expect("a memory share");
        assert_eq!(share.kind, ShareKind::Memory);
        assert_eq!(share.memory_gib, Some(25), "24.4 GiB rounded up");
        assert_eq!(share.tenants, tenants as u32);
        assert_eq!(shard.devices, std::slice::from_ref(&share.gpu));
    }
    // Pack fills the split GPU before breaking the other.
    assert!(
        shards
            .iter()
            .all(|shard| shard.devices == shards[0].devices)
    );
    let alone = plan(
        &spec("Shared", "throughput", 1),
        &nodes,
        &HashMap::new(),
        &HeldShares::new(),
    );
    let contended = |shard: &tessera_core::api::PlannedShard| {
        shard
            .share
            .as_ref()
            .and_then(|share| share.contended_tokens_per_second)
            .expect("a contended figure")
    };
    assert!(
        contended(&shards[2]) < contended(&shards[1])
            && contended(&shards[1]) < contended(&alone[0]),
        "more tenants, less each"
    );
}

#[test]
fn memory_shares_held_by_others_leave_the_rest_and_hold_the_gpu_for_whole_plans() {
    let nodes = [shared_node()];
    let mut allocated = HashMap::new();
    let mut shares = HeldShares::new();
    for shard in plan(
        &spec("Shared", "throughput", 3),
        &nodes,
        &allocated,
        &shares,
    ) {
        hold_shard(&shard, "ml/first", &mut allocated, &mut shares);
    }
    assert!(allocated.is_empty(), "shares hold no GPU whole");
    // A fourth 25 GiB share no longer fits beside three on an 80 GiB GPU.
    let fourth = plan(
        &spec("Shared", "throughput", 1),
        &nodes,
        &allocated,
        &shares,
    );
    let taken = &shares[&("shared".to_string(), "GPU-a".to_string())];
    assert_eq!(taken.len(), 3);
    assert_eq!(fourth[0].devices, ["GPU-b"]);
    // An exclusive instance sees the shared GPU as held.
    let problem = build_problem(
        &spec("Exclusive", "throughput", 1),
        &nodes,
        &allocated,
        &shares,
    );
    let held = problem.nodes[0].devices[0].allocated_to.as_deref();
    assert_eq!(held, Some("memory shares of ml/first, ml/first, ml/first"));
}

#[test]
fn the_minimum_speed_is_judged_with_the_gpu_shared() {
    let nodes = [shared_node()];
    let mut allocated = HashMap::new();
    let mut shares = HeldShares::new();
    for shard in plan(
        &spec("Shared", "throughput", 2),
        &nodes,
        &allocated,
        &shares,
    ) {
        hold_shard(&shard, "ml/first", &mut allocated, &mut shares);
    }
    let alone = plan(
        &spec("Shared", "throughput", 1),
        &nodes,
        &HashMap::new(),
        &HeldShares::new(),
    );
    let alone_speed = alone[0]
        .share
        .as_ref()
        .and_then(|s| s.contended_tokens_per_second)
        .expect("figure");
    // A share is assured its part of the GPU (every tenant busy), not the
    // whole: a floor it would only reach alone is refused, and says so.
    let mut wants = spec("Shared", "throughput", 1);
    wants.parallelism.min_tokens_per_second = Some(alone_speed * 0.6);
    let problem = build_problem(&wants, &nodes, &allocated, &shares);
    let refused = solve_replicas(
        &problem,
        tensor_choice(&wants),
        1,
        "ml/fast",
        &SolveOptions::default(),
    )
    .remove(0)
    .expect_err("no share is assured that speed");
    assert!(
        refused.reason.contains("parallelism.minTokensPerSecond"),
        "{}",
        refused.reason
    );
    // A floor within its part is met beside the tenants already there.
    wants.parallelism.min_tokens_per_second = Some(alone_speed * 0.3);
    let placed = plan(&wants, &nodes, &allocated, &shares);
    assert!(placed[0].share.is_some());
}

/// A 20B model in 16 bits: about 42.8 GiB with its KV cache, more than half
/// an 80 GiB GPU.
fn large_spec() -> ModelInstanceSpec {
    serde_saphyr::from_str(
        "model: {name: m-20b, parametersBillions: 20, layers: 40, hiddenSize: 6144, kvCacheGiB: 4, overheadGiB: 1.5}
parallelism: {tensor: 1, pipeline: 1}
placement: {sharing: Shared}",
    )
    .expect("a valid spec")
}

#[test]
fn a_share_of_more_than_half_an_unshared_gpu_takes_it_whole() {
    let nodes = [shared_node()];
    let mut allocated = HashMap::new();
    let mut shares = HeldShares::new();
    let alone = plan(&large_spec(), &nodes, &allocated, &shares);
    assert_eq!(alone.len(), 1);
    assert!(alone[0].share.is_none(), "{:?}", alone[0].share);
    hold_shard(&alone[0], "ml/large", &mut allocated, &mut shares);
    assert_eq!(
        allocated.get(&("shared".to_string(), alone[0].devices[0].clone())),
        Some(&"ml/large".to_string()),
        "the GPU is held whole"
    );
    // Beside a tenant, the rest of a split GPU is a share of any size: it
    // breaks nothing whole.
    let mut allocated = HashMap::new();
    let mut shares = HeldShares::new();
    let small = plan(
        &spec("Shared", "throughput", 1),
        &nodes,
        &allocated,
        &shares,
    );
    hold_shard(&small[0], "ml/small", &mut allocated, &mut shares);
    let beside = plan(&large_spec(), &nodes, &allocated, &shares);
    let share = beside[0].share.as_ref().expect("a memory share");
    assert_eq!(share.memory_gib, Some(43), "42.8 GiB rounded up");
    assert_eq!(beside[0].devices, small[0].devices);
}
