//! Properties of the solver on random small clusters: plans obey every hard
//! constraint, branch-and-bound finds the same optimum as plain enumeration
//! (under every strategy, with devices other workloads hold and replicas to
//! keep away from), the same input gives the same plan, replicas are valid
//! and never share a device, and `tensor: auto` is never slower than a size it
//! could have chosen.

use std::collections::{BTreeMap, HashSet};

use proptest::prelude::*;
use tessera::placement::{
    Device, Interconnect, Link, ModelShape, NodeState, Optimize, Plan, Problem, Selector,
    SolveOptions, SpeedGoal, Stages, Strategy as PlacementStrategy, Weights, best_by_enumeration,
    solve,
};
use tessera::sizing::{
    TensorChoice, solve_parallelism, solve_replicas, take_devices, tensor_candidates,
};

const GIB: f64 = 1024.0 * 1024.0 * 1024.0;

/// (product, memory GiB, TFLOPS, GB/s)
const KINDS: [(&str, f64, f64, f64); 4] = [
    ("H100", 80.0, 989.0, 3350.0),
    ("A100", 40.0, 312.0, 1555.0),
    ("MI300X", 192.0, 1307.0, 5300.0),
    ("RTX4090", 24.0, 165.0, 1008.0),
];

#[derive(Clone, Debug)]
struct DeviceSpec {
    kind: usize,
    used_eighths: u8,
    temperature: u8,
    healthy: bool,
    /// Another workload holds the device.
    held: bool,
}

#[derive(Clone, Debug)]
struct NodeSpec {
    devices: Vec<DeviceSpec>,
    zone: u8,
    rack: u8,
    nvlink: bool,
}

fn device_spec() -> impl Strategy<Value = DeviceSpec> {
    (
        0..4usize,
        0..6u8,
        0..4u8,
        proptest::bool::weighted(0.9),
        proptest::bool::weighted(0.2),
    )
        .prop_map(
            |(kind, used_eighths, temperature, healthy, held)| DeviceSpec {
                kind,
                used_eighths,
                temperature,
                healthy,
                held,
            },
        )
}

fn node_spec() -> impl Strategy<Value = NodeSpec> {
    (
        // Nodes of one kind are the common case and exercise twin symmetry.
        prop_oneof![
            (0..4usize, 1..7usize, 0..2u8).prop_map(|(kind, n, temp)| vec![
                DeviceSpec {
                    kind,
                    used_eighths: 0,
                    temperature: temp,
                    healthy: true,
                    held: false,
                };
                n
            ]),
            proptest::collection::vec(device_spec(), 1..7),
        ],
        0..2u8,
        0..2u8,
        any::<bool>(),
    )
        .prop_map(|(devices, zone, rack, nvlink)| NodeSpec {
            devices,
            zone,
            rack,
            nvlink,
        })
}

/// How the problem shares the cluster: the strategy, and which nodes (by
/// position, wrapped around) the instance's other replicas run on.
#[derive(Clone, Debug)]
struct Sharing {
    strategy: PlacementStrategy,
    replica_nodes: Vec<usize>,
}

fn sharing() -> impl Strategy<Value = Sharing> {
    (
        prop_oneof![
            Just(PlacementStrategy::ScoreOnly),
            Just(PlacementStrategy::Pack),
            Just(PlacementStrategy::Spread)
        ],
        proptest::collection::vec(0..6usize, 0..3),
    )
        .prop_map(|(strategy, replica_nodes)| Sharing {
            strategy,
            replica_nodes,
        })
}

fn build(
    nodes: &[NodeSpec],
    billions: f64,
    tensor: u32,
    stages: Stages,
    weights: Weights,
    sharing: &Sharing,
) -> Problem {
    let layers = 24u32;
    let params = billions * 1e9;
    let mut out = Vec::new();
    let mut total = 0;
    for (ni, spec) in nodes.iter().enumerate() {
        let name = format!("n{ni}");
        let mut devices = Vec::new();
        for (di, d) in spec.devices.iter().enumerate() {
            if total == 14 {
                break;
            }
            total += 1;
            let (product, gib, tflops, bw) = KINDS[d.kind];
            let bytes = (gib * GIB) as u64;
            devices.push(Device {
                id: format!("{name}-{di}"),
                index: di as u32,
                vendor: if product == "MI300X" { "amd" } else { "nvidia" }.into(),
                product: product.into(),
                memory_total_bytes: bytes,
                memory_free_bytes: bytes - bytes / 8 * u64::from(d.used_eighths),
                fp16_tflops: tflops,
                fp8_tflops: None,
                fp4_tflops: None,
                memory_bandwidth_gbps: bw,
                temperature_c: Some([40.0, 55.0, 70.0, 90.0][d.temperature as usize]),
                healthy: d.healthy,
                health_reason: (!d.healthy).then(|| "Xid 79".to_string()),
                allocated_to: d.held.then(|| "other/instance".to_string()),
                not_whole: None,
                share: None,
            });
        }
        let mut links = Vec::new();
        for a in 0..devices.len() {
            for b in a + 1..devices.len() {
                // NVLink nodes pair even devices with the next odd one; the rest is PCIe.
                let fast = spec.nvlink && a % 2 == 0 && b == a + 1;
                links.push(Link {
                    a: devices[a].id.clone(),
                    b: devices[b].id.clone(),
                    kind: if fast {
                        Interconnect::NvLink
                    } else {
                        Interconnect::Pcie
                    },
                    bandwidth_gbps: if fast { 600.0 } else { 32.0 },
                });
            }
        }
        out.push(NodeState {
            name,
            zone: Some(format!("z{}", spec.zone)),
            rack: Some(format!("r{}", spec.rack)),
            labels: BTreeMap::new(),
            devices,
            links,
        });
    }
    Problem {
        served: None,
        one_device: false,
        nodes: out,
        model: ModelShape {
            layers,
            weight_bytes_per_layer: params * 2.0 / f64::from(layers),
            kv_bytes_per_layer: 0.1 * GIB,
            overhead_bytes_per_device: GIB,
            activation_bytes_per_token: 8192.0,
            flops_per_layer_token: 2.0 * params / f64::from(layers),
            precision: tessera::placement::Precision::Fp16,
        },
        tensor,
        stages,
        weights,
        max_temperature_c: 85.0,
        selector: Selector::default(),
        strategy: sharing.strategy,
        replica_nodes: sharing
            .replica_nodes
            .iter()
            .map(|position| format!("n{}", position % nodes.len().max(1)))
            .collect(),
        goal: SpeedGoal::default(),
    }
}

fn problem_strategy() -> impl Strategy<Value = Problem> {
    (
        proptest::collection::vec(node_spec(), 1..6),
        prop_oneof![Just(7.0), Just(13.0), Just(34.0), Just(70.0), Just(180.0)],
        prop_oneof![3 => Just(1u32), 1 => Just(2u32)],
        prop_oneof![Just(Stages::Auto), (1..=6u32).prop_map(Stages::Fixed)],
        sharing(),
        prop_oneof![
            3 => Just(Weights::default()),
            1 => (0.0..1.0f64, 0.0..1.0f64, 0.0..1.0f64, 0.0..1.0f64, 0.0..1.0f64).prop_map(
                |(compute, memory, network, thermal, bandwidth)| Weights {
                    compute,
                    memory,
                    network,
                    thermal,
                    bandwidth
                }
            ),
        ],
    )
        .prop_map(|(nodes, billions, tensor, stages, sharing, weights)| {
            build(&nodes, billions, tensor, stages, weights, &sharing)
        })
}

fn check_hard_constraints(p: &Problem, plan: &Plan) -> Result<(), TestCaseError> {
    let mut used = HashSet::new();
    let mut next_layer = 0;
    if let Stages::Fixed(k) = p.stages {
        prop_assert_eq!(plan.stages.len(), k as usize);
    }
    for s in &plan.stages {
        let node = p.nodes.iter().find(|n| n.name == s.node);
        prop_assert!(node.is_some(), "unknown node {}", s.node);
        let node = node.unwrap();
        prop_assert_eq!(s.devices.len(), p.tensor as usize, "tensor group size");
        prop_assert_eq!(s.layer_start, next_layer, "layers are contiguous");
        prop_assert!(s.layer_end > s.layer_start, "every stage has a layer");
        next_layer = s.layer_end;
        for id in &s.devices {
            prop_assert!(
                used.insert((s.node.clone(), id.clone())),
                "{} used twice",
                id
            );
            let d = node.devices.iter().find(|d| &d.id == id);
            prop_assert!(d.is_some(), "device {} is on the stage's node", id);
            let d = d.unwrap();
            prop_assert!(d.healthy, "{} is unhealthy", id);
            prop_assert!(
                d.allocated_to.is_none(),
                "{} is held by {:?}",
                id,
                d.allocated_to
            );
            prop_assert!(d.temperature_c.unwrap_or(0.0) < p.max_temperature_c);
            prop_assert!(
                s.memory_per_device_bytes <= d.memory_free_bytes as f64 + 1.0,
                "{} needs {} but has {}",
                id,
                s.memory_per_device_bytes,
                d.memory_free_bytes
            );
        }
    }
    prop_assert_eq!(next_layer, p.model.layers, "all layers placed");
    Ok(())
}

proptest! {
    // 256 cases by default; PROPTEST_CASES=5000 for a deeper run.
    #[test]
    fn search_matches_enumeration_and_obeys_constraints(p in problem_strategy()) {
        let solved = solve(&p, &SolveOptions::default());
        let reference = best_by_enumeration(&p);
        match (&solved, &reference) {
            (Ok(plan), Some(best)) => {
                check_hard_constraints(&p, plan)?;
                prop_assert!(plan.optimal, "the search finished within its budget");
                prop_assert!(
                    (plan.score.total - best.score.total).abs() < 1e-9,
                    "search {} vs enumeration {}", plan.score.total, best.score.total
                );
                prop_assert_eq!(plan.stages.len(), best.stages.len());
            }
            (Err(_), None) => {}
            (Ok(plan), None) => prop_assert!(false, "search found a plan enumeration did not: {:?}", plan),
            (Err(u), Some(_)) => prop_assert!(false, "search says unsatisfiable ({}) but a plan exists", u),
        }
    }

    #[test]
    fn same_input_same_plan(p in problem_strategy()) {
        let a = solve(&p, &SolveOptions::default());
        let b = solve(&p, &SolveOptions::default());
        prop_assert_eq!(a, b);
    }

    #[test]
    fn a_tiny_step_budget_still_answers_with_a_valid_plan(p in problem_strategy()) {
        let opts = SolveOptions { deadline: None, max_steps: 1 };
        if let Ok(plan) = solve(&p, &opts) {
            check_hard_constraints(&p, &plan)?;
        }
    }

    #[test]
    fn replicas_are_valid_plans_that_never_share_a_device(
        p in problem_strategy(),
        tensor in tensor_choice(),
        replicas in 1..4u32,
    ) {
        let results = solve_replicas(&p, tensor, replicas, "ns/m", &SolveOptions::default());
        prop_assert_eq!(results.len(), replicas as usize);
        // Each replica is checked against the cluster the earlier ones left.
        let mut remaining = p.clone();
        let mut refused = false;
        let mut used = HashSet::new();
        for (replica, result) in results.iter().enumerate() {
            match result {
                Ok(placed) => {
                    prop_assert!(!refused, "a replica placed after a refusal");
                    if let TensorChoice::Fixed(size) = tensor {
                        prop_assert_eq!(placed.tensor, size);
                    }
                    let mut sized = remaining.clone();
                    sized.tensor = placed.tensor;
                    check_hard_constraints(&sized, &placed.plan)?;
                    for stage in &placed.plan.stages {
                        for id in &stage.devices {
                            prop_assert!(
                                used.insert((stage.node.clone(), id.clone())),
                                "{} is shared by two replicas", id
                            );
                        }
                    }
                    take_devices(&mut remaining, &placed.plan, &format!("ns/m replica {replica}"));
                }
                Err(_) => refused = true,
            }
        }
    }

    #[test]
    fn auto_is_never_slower_than_a_size_it_could_have_chosen(p in problem_strategy()) {
        // The step budget, not a deadline, bounds every solve: deterministic.
        let opts = SolveOptions { deadline: None, max_steps: 50_000 };
        let mut p = p;
        p.goal.optimize = Optimize::Latency;
        let auto = solve_parallelism(&p, TensorChoice::Auto, &opts);
        for size in tensor_candidates(&p) {
            let fixed = solve_parallelism(&p, TensorChoice::Fixed(size), &opts);
            match (&auto, &fixed) {
                (Ok(auto), Ok(fixed)) => prop_assert!(
                    auto.plan.performance.tokens_per_second
                        >= fixed.plan.performance.tokens_per_second,
                    "auto chose tensor {} at {} tokens/s; tensor {} gives {}",
                    auto.tensor,
                    auto.plan.performance.tokens_per_second,
                    size,
                    fixed.plan.performance.tokens_per_second
                ),
                (Err(_), Ok(_)) => prop_assert!(false, "auto found no plan; tensor {} has one", size),
                _ => {}
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    /// Under `throughput` auto gets at least the tokens/s per GPU of every size
    /// it could have chosen; with a minimum speed it reaches it with no more
    /// GPUs than any size that does, and is refused only when none does.
    #[test]
    fn auto_serves_its_goal_at_least_as_well_as_every_size(
        p in problem_strategy(),
        minimum in prop_oneof![Just(None), (1.0..400.0f64).prop_map(Some)],
    ) {
        let opts = SolveOptions { deadline: None, max_steps: 50_000 };
        let mut p = p;
        p.goal = SpeedGoal { optimize: Optimize::Throughput, min_tokens_per_second: minimum };
        let auto = solve_parallelism(&p, TensorChoice::Auto, &opts);
        let mut unconstrained = p.clone();
        unconstrained.goal.min_tokens_per_second = None;
        for size in tensor_candidates(&p) {
            let Ok(fixed) = solve_parallelism(&unconstrained, TensorChoice::Fixed(size), &opts) else {
                continue;
            };
            let speed = fixed.plan.performance.tokens_per_second;
            let gpus = size * fixed.plan.stages.len() as u32;
            match (&auto, minimum) {
                (Ok(auto), None) => {
                    let auto_gpus = auto.tensor * auto.plan.stages.len() as u32;
                    let per_gpu = auto.plan.performance.tokens_per_second / f64::from(auto_gpus);
                    prop_assert!(
                        per_gpu >= speed / f64::from(gpus),
                        "auto: tensor {} at {} per GPU; tensor {} gives {}",
                        auto.tensor, per_gpu, size, speed / f64::from(gpus)
                    );
                }
                (Ok(auto), Some(min)) => {
                    let auto_gpus = auto.tensor * auto.plan.stages.len() as u32;
                    prop_assert!(auto.plan.performance.tokens_per_second >= min);
                    prop_assert!(
                        speed < min || gpus >= auto_gpus,
                        "tensor {} reaches {} with {} GPUs; auto took {}", size, min, gpus, auto_gpus
                    );
                }
                (Err(refused), Some(min)) => prop_assert!(
                    speed < min,
                    "refused ({}) though tensor {} reaches {} at {}", refused.reason, size, min, speed
                ),
                (Err(_), None) => prop_assert!(false, "auto found no plan; tensor {} has one", size),
            }
        }
    }
}

fn tensor_choice() -> impl Strategy<Value = TensorChoice> {
    prop_oneof![
        Just(TensorChoice::Auto),
        (1..=4u32).prop_map(TensorChoice::Fixed),
    ]
}
