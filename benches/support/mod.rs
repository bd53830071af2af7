//! Shared by the placement benchmarks: a deterministic cluster generator that
//! builds `placement::Problem` values directly, model shapes built the way the
//! controller builds them, a plan validity check, and a first-fit baseline.

pub(crate) mod arrivals;
pub(crate) mod demand_replay;
pub(crate) mod demands;
pub(crate) mod memory;
pub(crate) mod objects;
pub(crate) mod replay;
pub(crate) mod shared_nodes;
pub(crate) mod user_claims;

use std::collections::{BTreeMap, HashSet};

use tessera::api::telemetry::planned_free_memory;
use tessera::placement::{
    Device, Interconnect, Link, ModelShape, NodeState, Plan, Problem, Selector, SpeedGoal,
    StageChoice, Stages, Weights, evaluate,
};
use tessera::serving::AtTarget;

const GIB: f64 = 1024.0 * 1024.0 * 1024.0;
/// Devices at or above this temperature are excluded (the CRD's default limit).
pub(crate) const MAX_TEMPERATURE_C: f64 = 85.0;

/// splitmix64: tiny, fast and good enough to make clusters that look random but
/// are the same on every run.
pub(crate) struct SplitMix64(u64);

impl SplitMix64 {
    pub(crate) fn new(seed: u64) -> Self {
        Self(seed)
    }

    pub(crate) fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (multiply-shift; the bias is far below what matters here).
    pub(crate) fn below(&mut self, n: u64) -> u64 {
        ((u128::from(self.next_u64()) * u128::from(n)) >> 64) as u64
    }

    /// Uniform in `[0, 1)`.
    pub(crate) fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    pub(crate) fn chance(&mut self, p: f64) -> bool {
        self.unit() < p
    }

    /// One of `choices`, with probability proportional to its weight.
    pub(crate) fn weighted<T: Copy>(&mut self, choices: &[(T, u32)]) -> T {
        let total: u64 = choices.iter().map(|&(_, w)| u64::from(w)).sum();
        let mut r = self.below(total);
        for &(v, w) in choices {
            if r < u64::from(w) {
                return v;
            }
            r -= u64::from(w);
        }
        unreachable!("weights sum to {total}")
    }
}

/// A GPU model as a node agent would report it.
#[derive(Clone, Copy, Debug)]
pub(crate) struct GpuKind {
    pub(crate) product: &'static str,
    pub(crate) vendor: &'static str,
    pub(crate) memory_gib: u64,
    pub(crate) tflops: f64,
    /// Dense FP8 TFLOPS, where the product has FP8 tensor cores (as the
    /// agents publish it).
    pub(crate) fp8_tflops: Option<f64>,
    pub(crate) bandwidth_gbps: f64,
    /// Link between every pair of devices on a node of this kind.
    pub(crate) link: Interconnect,
    pub(crate) link_gbps: f64,
}

pub(crate) const H100: GpuKind = GpuKind {
    product: "NVIDIA H100 80GB HBM3",
    vendor: "nvidia",
    memory_gib: 80,
    tflops: 989.0,
    fp8_tflops: Some(1979.0),
    bandwidth_gbps: 3350.0,
    link: Interconnect::NvLink,
    link_gbps: 900.0,
};

pub(crate) const A100: GpuKind = GpuKind {
    product: "NVIDIA A100-SXM4-40GB",
    vendor: "nvidia",
    memory_gib: 40,
    tflops: 312.0,
    fp8_tflops: None,
    bandwidth_gbps: 1555.0,
    link: Interconnect::NvLink,
    link_gbps: 600.0,
};

pub(crate) const MI300X: GpuKind = GpuKind {
    product: "AMD Instinct MI300X",
    vendor: "amd",
    memory_gib: 192,
    tflops: 1307.0,
    fp8_tflops: Some(2615.0),
    bandwidth_gbps: 5300.0,
    link: Interconnect::Xgmi,
    link_gbps: 128.0,
};

pub(crate) const RTX4090: GpuKind = GpuKind {
    product: "NVIDIA GeForce RTX 4090",
    vendor: "nvidia",
    memory_gib: 24,
    tflops: 165.0,
    fp8_tflops: Some(330.0),
    bandwidth_gbps: 1008.0,
    link: Interconnect::Pcie,
    link_gbps: 32.0,
};

pub(crate) const GPUS_PER_NODE: u32 = 8;
pub(crate) const ZONES: usize = 4;
pub(crate) const NODES_PER_RACK: usize = 16;

/// Share of nodes by GPU kind.
const KIND_MIX: [(GpuKind, u32); 4] = [(H100, 35), (A100, 25), (MI300X, 15), (RTX4090, 25)];
/// Share of nodes where another workload already uses part of some devices.
const PARTLY_USED_NODES: f64 = 0.2;
/// On such a node, the share of devices that are partly used.
const PARTLY_USED_DEVICES: f64 = 0.5;
/// A node's temperature level, in whole °C.
const NODE_BASE_C: [(f64, u32); 6] = [
    (34.0, 1),
    (38.0, 1),
    (42.0, 1),
    (46.0, 1),
    (52.0, 1),
    (60.0, 1),
];
/// A device's offset from its node's level: most sit at the level, a few run warmer.
const DEVICE_OFFSET_C: [(f64, u32); 4] = [(0.0, 50), (1.0, 25), (2.0, 15), (4.0, 10)];
/// Devices running too hot to use (at or above `MAX_TEMPERATURE_C`).
const TOO_HOT_DEVICES: f64 = 0.005;
const UNHEALTHY_DEVICES: f64 = 0.01;

/// `nodes` nodes of 8 GPUs each, named `node-0000`, `node-0001`, ... (name order
/// = generation order). Racks of 16 consecutive nodes; racks dealt round-robin
/// over 4 zones. The same seed always gives the same cluster.
pub(crate) fn cluster(nodes: usize, seed: u64) -> Vec<NodeState> {
    let mut rng = SplitMix64::new(seed);
    (0..nodes).map(|i| node(i, &mut rng)).collect()
}

fn node(i: usize, rng: &mut SplitMix64) -> NodeState {
    let name = format!("node-{i:04}");
    let kind = rng.weighted(&KIND_MIX);
    let rack = i / NODES_PER_RACK;
    let zone = format!("zone-{}", (b'a' + (rack % ZONES) as u8) as char);
    let rack = format!("rack-{rack:03}");
    let partly_used = rng.chance(PARTLY_USED_NODES);
    let base_c = rng.weighted(&NODE_BASE_C);
    let total = kind.memory_gib << 30;

    let devices: Vec<Device> = (0..GPUS_PER_NODE)
        .map(|index| {
            let mut free = total;
            if partly_used && rng.chance(PARTLY_USED_DEVICES) {
                // 1 GiB to 3/4 of the card, rounded down as the controller does.
                let used = (GIB + rng.unit() * (0.75 * total as f64 - GIB)) as u64;
                free = planned_free_memory(total - used);
            }
            let temperature = if rng.chance(TOO_HOT_DEVICES) {
                MAX_TEMPERATURE_C + 1.0 + rng.below(5) as f64
            } else {
                base_c + rng.weighted(&DEVICE_OFFSET_C)
            };
            let healthy = !rng.chance(UNHEALTHY_DEVICES);
            Device {
                id: format!("{name}-gpu{index}"),
                index,
                vendor: kind.vendor.into(),
                product: kind.product.into(),
                memory_total_bytes: total,
                memory_free_bytes: free,
                fp16_tflops: kind.tflops,
                fp8_tflops: kind.fp8_tflops,
                fp4_tflops: None,
                memory_bandwidth_gbps: kind.bandwidth_gbps,
                temperature_c: Some(temperature),
                healthy,
                health_reason: (!healthy).then(|| "Xid 79: GPU has fallen off the bus".into()),
                allocated_to: None,
                not_whole: None,
                share: None,
            }
        })
        .collect();

    let mut links = Vec::new();
    for a in 0..devices.len() {
        for b in a + 1..devices.len() {
            links.push(Link {
                a: devices[a].id.clone(),
                b: devices[b].id.clone(),
                kind: kind.link,
                bandwidth_gbps: kind.link_gbps,
            });
        }
    }

    let mut labels = BTreeMap::new();
    labels.insert("topology.kubernetes.io/zone".to_string(), zone.clone());
    labels.insert("tessera.dev/rack".to_string(), rack.clone());
    NodeState {
        name,
        zone: Some(zone),
        rack: Some(rack),
        labels,
        devices,
        links,
    }
}

/// A model spec as a `ModelInstance` gives it (bf16 weights).
#[derive(Clone, Copy, Debug)]
pub(crate) struct ModelSpec {
    pub(crate) parameters: f64,
    pub(crate) layers: u32,
    pub(crate) hidden: u32,
    /// Query and key/value heads: what the serving model sizes the KV cache
    /// of a token by.
    pub(crate) attention_heads: u32,
    pub(crate) kv_heads: u32,
    pub(crate) kv_cache_gib: f64,
    pub(crate) overhead_gib: f64,
}

/// The solver's view of a model, computed as `controller::build_problem` does.
pub(crate) fn model_shape(m: &ModelSpec) -> ModelShape {
    let layers = f64::from(m.layers);
    let bytes_per_parameter = 2.0; // bf16
    ModelShape {
        layers: m.layers,
        weight_bytes_per_layer: m.parameters * bytes_per_parameter / layers,
        kv_bytes_per_layer: m.kv_cache_gib * GIB / layers,
        overhead_bytes_per_device: m.overhead_gib * GIB,
        activation_bytes_per_token: f64::from(m.hidden) * 2.0,
        flops_per_layer_token: 2.0 * m.parameters / layers,
        precision: tessera::placement::Precision::Fp16,
    }
}

pub(crate) fn problem(
    nodes: Vec<NodeState>,
    model: &ModelSpec,
    tensor: u32,
    stages: u32,
) -> Problem {
    Problem {
        served: None,
        one_device: false,
        nodes,
        model: model_shape(model),
        tensor,
        stages: Stages::Fixed(stages),
        weights: Weights::default(),
        max_temperature_c: MAX_TEMPERATURE_C,
        selector: Selector::default(),
        strategy: tessera::placement::Strategy::ScoreOnly,
        replica_nodes: Vec::new(),
        goal: SpeedGoal::default(),
    }
}

/// What `plan` serves at its instance's latency target (`Problem::served`),
/// and the GPUs it takes (a memory share at its part); `None` where it
/// cannot meet the target.
pub(crate) fn at_target(problem: &Problem, plan: &Plan) -> Option<(AtTarget, f64)> {
    let served = problem.served.as_ref()?;
    let (capacity, gpus) = tessera::sizing::capacity(served, &problem.goal, problem, plan).ok()?;
    Some((capacity.at_slo?, gpus))
}

/// One line describing a generated cluster, for the bench log.
pub(crate) fn describe(nodes: &[NodeState]) -> String {
    let mut by_kind: BTreeMap<&str, usize> = BTreeMap::new();
    let (mut devices, mut unhealthy, mut hot, mut partly) = (0, 0, 0, 0);
    for n in nodes {
        *by_kind.entry(n.devices[0].product.as_str()).or_default() += 1;
        for d in &n.devices {
            devices += 1;
            unhealthy += usize::from(!d.healthy);
            hot += usize::from(d.temperature_c.is_some_and(|t| t >= MAX_TEMPERATURE_C));
            partly += usize::from(d.memory_free_bytes < d.memory_total_bytes);
        }
    }
    let kinds: Vec<String> = by_kind.iter().map(|(k, n)| format!("{n}x {k}")).collect();
    format!(
        "{} nodes / {devices} GPUs ({}); {partly} partly used, {unhealthy} unhealthy, {hot} too hot",
        nodes.len(),
        kinds.join(", ")
    )
}

/// Panics unless `plan` is a valid plan for `p` with `stages` stages: every
/// stage's devices exist on its node, are eligible and distinct, the stages
/// cover all layers in order, and each device's predicted memory fits its free
/// memory.
pub(crate) fn assert_valid(p: &Problem, plan: &Plan, stages: usize) {
    assert_eq!(plan.stages.len(), stages, "stage count");
    let mut seen = HashSet::new();
    let mut next_layer = 0;
    for (i, s) in plan.stages.iter().enumerate() {
        let node = p
            .nodes
            .iter()
            .find(|n| n.name == s.node)
            .unwrap_or_else(|| panic!("stage {i}: node {} does not exist", s.node));
        assert_eq!(s.devices.len(), p.tensor as usize, "stage {i}: tensor size");
        assert_eq!(
            s.device_indices.len(),
            s.devices.len(),
            "stage {i}: indices"
        );
        for (id, &index) in s.devices.iter().zip(&s.device_indices) {
            let d = node
                .devices
                .iter()
                .find(|d| d.id == *id)
                .unwrap_or_else(|| panic!("stage {i}: device {id} is not on {}", s.node));
            assert_eq!(d.index, index, "stage {i}: index of {id}");
            assert!(
                seen.insert((s.node.as_str(), id.as_str())),
                "stage {i}: {}/{id} is used twice",
                s.node
            );
            assert!(eligible(p, d), "stage {i}: {}/{id} is not eligible", s.node);
            assert!(
                s.memory_per_device_bytes <= d.memory_free_bytes as f64,
                "stage {i}: {}/{id} needs {} bytes, has {} free",
                s.node,
                s.memory_per_device_bytes,
                d.memory_free_bytes
            );
        }
        assert_eq!(
            s.layer_start, next_layer,
            "stage {i}: layers not contiguous"
        );
        assert!(s.layer_end > s.layer_start, "stage {i}: no layers");
        next_layer = s.layer_end;
    }
    assert_eq!(next_layer, p.model.layers, "layers not all covered");
}

/// Healthy and below the temperature limit: what the first-fit baseline looks at.
fn eligible(p: &Problem, d: &Device) -> bool {
    d.healthy && d.allocated_to.is_none() && d.temperature_c.is_none_or(|t| t < p.max_temperature_c)
}

/// The baseline a scheduler without a solver would use: nodes in name order,
/// devices in index order; the first `tensor` eligible devices of a node that
/// can each hold an even share of the model (layers/stages rounded up, split
/// across the tensor group, plus the per-device overhead) form a stage, until
/// there are enough stages. `None` when the cluster runs out first.
pub(crate) fn first_fit(p: &Problem) -> Option<Vec<StageChoice>> {
    let Stages::Fixed(k) = p.stages else {
        panic!("the baseline needs a fixed stage count");
    };
    let m = &p.model;
    let per_stage = m.layers.div_ceil(k);
    let need = m.overhead_bytes_per_device
        + f64::from(per_stage) * (m.weight_bytes_per_layer + m.kv_bytes_per_layer)
            / f64::from(p.tensor);

    let mut nodes: Vec<&NodeState> = p.nodes.iter().collect();
    nodes.sort_by(|a, b| a.name.cmp(&b.name));
    let mut stages = Vec::with_capacity(k as usize);
    for n in nodes {
        let mut devices: Vec<&Device> = n.devices.iter().collect();
        devices.sort_by_key(|d| d.index);
        let mut group = Vec::with_capacity(p.tensor as usize);
        for d in devices {
            if eligible(p, d) && d.memory_free_bytes as f64 >= need {
                group.push(d.id.clone());
                if group.len() == p.tensor as usize {
                    stages.push(StageChoice {
                        node: n.name.clone(),
                        devices: std::mem::take(&mut group),
                    });
                    if stages.len() == k as usize {
                        return Some(stages);
                    }
                }
            }
        }
    }
    None
}

/// The `REPORT` line comparing our plan with the first-fit baseline on the
/// solver's own objective.
pub(crate) fn report(scenario: &str, p: &Problem, ours: &Plan) -> String {
    let baseline = match first_fit(p) {
        None => "first-fit finds no plan".to_string(),
        Some(stages) => match evaluate(p, &stages) {
            Ok(plan) => format!(
                "first-fit objective={:.6} tokens/s={:.3}",
                plan.score.total, plan.performance.tokens_per_second
            ),
            Err(e) => format!("first-fit plan is invalid: {e}"),
        },
    };
    format!(
        "REPORT {scenario}: ours objective={:.6} tokens/s={:.3} optimal={} steps={} | {baseline}",
        ours.score.total, ours.performance.tokens_per_second, ours.optimal, ours.steps
    )
}
