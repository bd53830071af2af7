//! Translation between Kubernetes and the solver: Nodes with their published GPU
//! state plus a ModelInstance become a `placement::Problem`; a `Plan` becomes the
//! instance's status plan. Pure: callers fetch the objects.

mod capacity;
mod devices;
mod kv_floor;

pub use capacity::{
    instance_capacity, judge_placed, placed_capacities, placed_capacity, predicted_tpot,
    replica_capacity,
};

use std::collections::{BTreeMap, HashMap};

use k8s_openapi::api::core::v1::Node;

use crate::api::{
    self, GIB, GpuStateError, LinkKind, ModelInstanceSpec, NodeGpuState, PipelineStages,
    PlannedShard, RACK_LABEL, Sharing, TensorSize, ZONE_LABEL,
};
use crate::placement::{
    Interconnect, Link, ModelShape, NodeState, Optimize, Plan, Problem, Selector, Served,
    SpeedGoal, StageChoice, Stages, Strategy, Weights, evaluate,
};
use crate::sizing::TensorChoice;

/// A node as the planner needs it: name, labels and published GPU state.
#[derive(Clone, Debug, PartialEq)]
pub struct ClusterNode {
    pub name: String,
    pub labels: BTreeMap<String, String>,
    pub gpu_state: NodeGpuState,
}

impl ClusterNode {
    /// Reads a Node object. `Ok(None)` when the node publishes no GPU state (a
    /// CPU node, or one whose agent has not started yet).
    pub fn from_node(node: &Node) -> Result<Option<Self>, GpuStateError> {
        Ok(Self::from_node_listing_unknown(node)?.map(|(node, _)| node))
    }

    /// [`ClusterNode::from_node`], also returning the paths of the state's
    /// fields this build ignored (see [`NodeGpuState::from_json_listing_unknown`]).
    pub fn from_node_listing_unknown(
        node: &Node,
    ) -> Result<Option<(Self, Vec<String>)>, GpuStateError> {
        let meta = &node.metadata;
        let Some(text) = NodeGpuState::annotation_of(meta) else {
            return Ok(None);
        };
        let (gpu_state, unknown) = NodeGpuState::from_json_listing_unknown(text)?;
        let node = Self {
            name: meta.name.clone().unwrap_or_default(),
            labels: meta.labels.clone().unwrap_or_default(),
            gpu_state,
        };
        Ok(Some((node, unknown)))
    }
}

/// Who holds a device the node agent reports as handed to the pod with `uid`
/// (see `NodeGpuState::allocated`), for explanations.
pub fn pod_holder(node: &str, uid: &str) -> String {
    if uid == NodeGpuState::UNBOUND_OWNER {
        format!("a pod on {node} without a planned binding")
    } else {
        format!("a pod on {node} (uid {uid})")
    }
}

/// Memory shares held on whole GPUs, by `(node, GPU id)`: who holds each
/// and how many bytes.
pub type HeldShares = HashMap<(String, String), Vec<(String, u64)>>;

/// Records what a planned shard of `holder` holds: a memory share of its
/// GPU, or its devices (GPUs, a partition) whole.
pub fn hold_shard(
    shard: &PlannedShard,
    holder: &str,
    allocated: &mut HashMap<(String, String), String>,
    shares: &mut HeldShares,
) {
    if let Some(share) = &shard.share
        && share.kind == api::ShareKind::Memory
    {
        let bytes = u64::from(share.memory_gib.unwrap_or(0)) << 30;
        shares
            .entry((shard.node.clone(), share.gpu.clone()))
            .or_default()
            .push((holder.to_string(), bytes));
        return;
    }
    for device in &shard.devices {
        allocated.insert((shard.node.clone(), device.clone()), holder.to_string());
    }
}

/// Undoes [`hold_shard`]: what `holder`'s shard held is free again.
pub fn release_shard(
    shard: &PlannedShard,
    holder: &str,
    allocated: &mut HashMap<(String, String), String>,
    shares: &mut HeldShares,
) {
    if let Some(share) = &shard.share
        && share.kind == api::ShareKind::Memory
    {
        let key = (shard.node.clone(), share.gpu.clone());
        if let Some(held) = shares.get_mut(&key)
            && let Some(at) = held.iter().position(|(who, _)| who == holder)
        {
            held.remove(at);
        }
        return;
    }
    for device in &shard.devices {
        let key = (shard.node.clone(), device.clone());
        if allocated.get(&key).is_some_and(|who| who == holder) {
            allocated.remove(&key);
        }
    }
}

/// Builds the solver's problem. `allocated` maps `(node, device id)` to the
/// workload holding that device (or partition) whole; those devices are not
/// free. `shares` are the memory shares others hold: what they leave is
/// offered to a `Shared` instance, and a GPU with shares is held for the rest.
pub fn build_problem<'a>(
    spec: &ModelInstanceSpec,
    nodes: impl IntoIterator<Item = &'a ClusterNode>,
    allocated: &HashMap<(String, String), String>,
    shares: &HeldShares,
) -> Problem {
    let sharing = spec.placement.sharing;
    let mut states: Vec<NodeState> = nodes
        .into_iter()
        .map(|n| node_state(n, sharing, allocated, shares))
        .collect();
    states.sort_by(|a, b| a.name.cmp(&b.name));

    let placement = &spec.placement;
    Problem {
        nodes: states,
        model: ModelShape {
            kv_bytes_per_layer: kv_floor::per_layer(spec),
            ..ModelShape::of(&spec.model)
        },
        // `auto` is solved size by size (see `sizing::solve_parallelism`);
        // the problem starts at one GPU per shard.
        tensor: spec.parallelism.tensor.fixed().unwrap_or(1),
        // A sharing instance runs one shard on one GPU or piece of one, so
        // its `auto` is one stage.
        stages: match spec.parallelism.pipeline {
            PipelineStages::Auto if !sharing.is_exclusive() => Stages::Fixed(1),
            PipelineStages::Auto => Stages::Auto,
            PipelineStages::Fixed(n) => Stages::Fixed(n),
        },
        weights: Weights {
            compute: placement.weights.compute,
            memory: placement.weights.memory,
            network: placement.weights.network,
            thermal: placement.weights.thermal,
            bandwidth: placement.weights.bandwidth,
        },
        max_temperature_c: placement.max_temperature_c,
        selector: Selector {
            vendors: placement.vendors.clone(),
            products: placement.products.clone(),
            node_labels: placement.node_selector.clone(),
            kind: None,
        },
        strategy: match placement.strategy {
            api::Strategy::Pack => Strategy::Pack,
            api::Strategy::Spread => Strategy::Spread,
        },
        replica_nodes: Vec::new(),
        goal: SpeedGoal {
            optimize: match spec.parallelism.optimize {
                api::Optimize::Throughput => Optimize::Throughput,
                api::Optimize::Latency => Optimize::Latency,
            },
            min_tokens_per_second: spec.parallelism.min_tokens_per_second,
        },
        served: Some(Served::of(spec)),
        one_device: !sharing.is_exclusive(),
    }
}

fn node_state(
    node: &ClusterNode,
    sharing: Sharing,
    allocated: &HashMap<(String, String), String>,
    shares: &HeldShares,
) -> NodeState {
    let devices = devices::planned_devices(node, sharing, allocated, shares);
    let links = node
        .gpu_state
        .links
        .iter()
        .filter_map(|link| {
            let kind = interconnect(link.kind)?;
            Some(Link {
                a: link.a.clone(),
                b: link.b.clone(),
                kind,
                bandwidth_gbps: link.bandwidth_gbps,
            })
        })
        .collect();
    NodeState {
        name: node.name.clone(),
        zone: node.labels.get(ZONE_LABEL).cloned(),
        rack: node.labels.get(RACK_LABEL).cloned(),
        labels: node.labels.clone(),
        devices,
        links,
    }
}

/// The solver's tensor size choice for the spec's `parallelism.tensor`.
pub fn tensor_choice(spec: &ModelInstanceSpec) -> TensorChoice {
    match spec.parallelism.tensor {
        TensorSize::Auto => TensorChoice::Auto,
        TensorSize::Fixed(size) => TensorChoice::Fixed(size),
    }
}

/// Replica `replica`'s plan as it is written into `status.plan`.
pub fn planned_shards(plan: &Plan, replica: u32) -> Vec<PlannedShard> {
    plan.stages
        .iter()
        .enumerate()
        .map(|(index, stage)| PlannedShard {
            copy: 0,
            replica,
            shard: index as u32,
            node: stage.node.clone(),
            devices: stage.devices.clone(),
            layer_start: stage.layer_start,
            layer_end: stage.layer_end,
            predicted_memory_gib: (stage.memory_per_device_bytes / GIB * 100.0).round() / 100.0,
            share: devices::shard_share(stage, &plan.performance),
        })
        .collect()
}

/// The speed model's judgement of one replica placed already (by tessera or
/// anyone else): its `shards`, in pipeline order, evaluated on `problem`'s
/// nodes with the tensor size they have. An error says why they cannot hold
/// the model (a device missing or excluded, memory short).
pub fn evaluate_placed(mut problem: Problem, shards: &[&PlannedShard]) -> Result<Plan, String> {
    problem.tensor = shards.first().map_or(1, |s| s.devices.len() as u32);
    let choices: Vec<StageChoice> = shards
        .iter()
        .map(|s| StageChoice {
            node: s.node.clone(),
            devices: s.devices.clone(),
        })
        .collect();
    evaluate(&problem, &choices)
}

/// The solver's name for a link kind; `None` for a kind this build does not know.
fn interconnect(kind: LinkKind) -> Option<Interconnect> {
    match kind {
        LinkKind::Nvlink => Some(Interconnect::NvLink),
        LinkKind::Xgmi => Some(Interconnect::Xgmi),
        LinkKind::Pcie => Some(Interconnect::Pcie),
        LinkKind::Unknown => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::{Health, Vendor};

    #[test]
    fn the_solver_sees_the_same_scale_up_domains_as_the_agent_reports() {
        for kind in [LinkKind::Nvlink, LinkKind::Xgmi, LinkKind::Pcie] {
            let solver = interconnect(kind).expect("a known kind");
            assert_eq!(solver.is_scale_up(), kind.is_scale_up(), "{kind:?}");
        }
        assert_eq!(interconnect(LinkKind::Unknown), None);
    }
    use crate::api::{GPU_STATE_ANNOTATION, GPU_STATE_VERSION, GpuDevice, GpuLink};
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

    fn state() -> NodeGpuState {
        let dev = |i: u32, vendor: Vendor, health: Health| GpuDevice {
            mig: None,
            id: format!("g{i}"),
            index: i,
            vendor,
            product: "X".into(),
            memory_total_bytes: 80 << 30,
            memory_free_bytes: (79 << 30) + 12345,
            fp16_tflops: 100.0,
            fp8_tflops: None,
            fp4_tflops: None,
            memory_bandwidth_gbps: 1000.0,
            temperature_c: Some(41.4),
            power_w: None,
            numa_node: None,
            health,
            health_reason: None,
        };
        NodeGpuState {
            version: GPU_STATE_VERSION.into(),
            backend: "fake".into(),
            devices: vec![
                dev(0, Vendor::Nvidia, Health::Healthy),
                dev(1, Vendor::Unknown, Health::Healthy),
                dev(2, Vendor::Amd, Health::Unknown),
            ],
            links: vec![
                GpuLink {
                    a: "g0".into(),
                    b: "g2".into(),
                    kind: LinkKind::Nvlink,
                    bandwidth_gbps: 900.0,
                },
                GpuLink {
                    a: "g0".into(),
                    b: "g1".into(),
                    kind: LinkKind::Unknown,
                    bandwidth_gbps: 1.0,
                },
            ],
            timestamp: None,
            allocated: Default::default(),
            shares: Default::default(),
        }
    }

    fn spec() -> ModelInstanceSpec {
        serde_saphyr::from_str(
            "model: {name: m, parametersBillions: 7, layers: 32, kvCacheGiB: 4}\nplacement: {vendors: [nvidia]}",
        )
        .unwrap()
    }

    #[test]
    fn reads_nodes_with_and_without_state() {
        let mut node = Node {
            metadata: ObjectMeta {
                name: Some("a".into()),
                ..Default::default()
            },
            ..Default::default()
        };
        assert_eq!(ClusterNode::from_node(&node), Ok(None));
        node.metadata.annotations = Some(
            [(GPU_STATE_ANNOTATION.to_string(), state().to_json())]
                .into_iter()
                .collect(),
        );
        let c = ClusterNode::from_node(&node).unwrap().unwrap();
        assert_eq!(c.name, "a");
        assert_eq!(c.gpu_state.devices.len(), 3);
        node.metadata.annotations = Some(
            [(GPU_STATE_ANNOTATION.to_string(), "{not json".to_string())]
                .into_iter()
                .collect(),
        );
        assert!(ClusterNode::from_node(&node).is_err());
    }

    #[test]
    fn problem_carries_spec_and_telemetry() {
        let mut labels = BTreeMap::new();
        labels.insert(ZONE_LABEL.to_string(), "z1".to_string());
        let nodes = vec![ClusterNode {
            name: "a".into(),
            labels,
            gpu_state: state(),
        }];
        let mut allocated = HashMap::new();
        allocated.insert(("a".to_string(), "g0".to_string()), "ns/other".to_string());
        let p = build_problem(&spec(), &nodes, &allocated, &HeldShares::new());
        assert_eq!(p.nodes[0].zone.as_deref(), Some("z1"));
        assert_eq!(p.nodes[0].rack, None);
        let d = &p.nodes[0].devices;
        assert_eq!(d[0].memory_free_bytes, 79 << 30);
        assert_eq!(d[0].temperature_c, Some(41.4), "raw: the limit compares it");
        assert_eq!(d[0].allocated_to.as_deref(), Some("ns/other"));
        assert!(!d[1].healthy, "unknown vendor is never planned on");
        assert!(!d[2].healthy, "unknown health is never planned on");
        assert_eq!(p.nodes[0].links.len(), 1, "unknown link kinds are dropped");
        assert_eq!(p.model.kv_bytes_per_layer, 4.0 * GIB / 32.0);
        assert_eq!(p.selector.vendors, vec!["nvidia".to_string()]);
        assert_eq!(p.stages, Stages::Auto);
    }

    /// A model too large for one GPU is told to split over more GPUs, but a
    /// sharing instance, which cannot, is told what it can do instead.
    #[test]
    fn a_refusal_advises_only_what_the_sharing_mode_allows() {
        let nodes = vec![ClusterNode {
            name: "a".into(),
            labels: BTreeMap::new(),
            gpu_state: state(),
        }];
        let refusal = |sharing: &str| {
            let spec: ModelInstanceSpec = serde_saphyr::from_str(&format!(
                "model: {{name: m, parametersBillions: 70, layers: 80, kvCacheGiB: 4}}\nparallelism: {{pipeline: 1}}\nplacement: {{vendors: [nvidia], sharing: {sharing}}}"
            ))
            .unwrap();
            let problem = build_problem(&spec, &nodes, &HashMap::new(), &HeldShares::new());
            assert_eq!(problem.one_device, sharing != "Exclusive", "{sharing}");
            crate::placement::solve(&problem, &Default::default())
                .expect_err("140 GB of weights on one 79 GiB GPU")
                .reason
        };
        let exclusive = refusal("Exclusive");
        assert!(
            exclusive.ends_with("Use more stages, a larger tensor size or a smaller dtype"),
            "{exclusive}"
        );
        for sharing in ["Isolated", "Shared"] {
            let one = refusal(sharing);
            assert!(!one.contains("more stages"), "{sharing}: {one}");
            assert!(
                one.contains("placement.sharing: Exclusive to split it over more GPUs"),
                "{sharing}: {one}"
            );
        }
    }

    #[test]
    fn a_placement_made_elsewhere_is_judged_by_the_speed_model() {
        let nodes = vec![ClusterNode {
            name: "a".into(),
            labels: BTreeMap::new(),
            gpu_state: state(),
        }];
        let problem = || build_problem(&spec(), &nodes, &HashMap::new(), &HeldShares::new());
        let shard = |devices: &[&str]| PlannedShard {
            copy: 0,
            replica: 0,
            shard: 0,
            node: "a".into(),
            devices: devices.iter().map(|d| d.to_string()).collect(),
            layer_start: 0,
            layer_end: 32,
            predicted_memory_gib: 0.0,
            share: None,
        };
        let placed = shard(&["g0"]);
        let plan = evaluate_placed(problem(), &[&placed]).unwrap();
        assert!(plan.performance.tokens_per_second > 0.0);
        assert_eq!(plan.stages[0].devices, ["g0"]);
        // An unknown vendor's device is never a place for the shard.
        let elsewhere = shard(&["g1"]);
        assert!(evaluate_placed(problem(), &[&elsewhere]).is_err());
    }

    #[test]
    fn a_gpu_in_mig_mode_or_changing_it_is_never_planned_whole() {
        use crate::api::{GpuPartition, MigState};
        let mig = |enabled: bool, pending: Option<bool>| MigState {
            enabled,
            pending,
            memory_slices: 8,
            multiprocessors: 132,
            partitions: vec![GpuPartition {
                id: "MIG-a".into(),
                profile: "7g.80gb".into(),
                memory_total_bytes: 79 << 30,
                multiprocessors: 132,
                placement_start: 0,
                placement_size: 8,
            }],
            profiles: Vec::new(),
        };
        let planned = |mig: MigState| {
            let mut state = state();
            state.devices[0].mig = Some(mig);
            let node = ClusterNode {
                name: "a".into(),
                labels: BTreeMap::new(),
                gpu_state: state,
            };
            let problem = build_problem(&spec(), [&node], &HashMap::new(), &HeldShares::new());
            problem.nodes[0].devices[0].not_whole.clone()
        };
        assert_eq!(
            planned(mig(true, None)).as_deref(),
            Some("in MIG mode: offered as its 1 partition")
        );
        assert_eq!(
            planned(mig(false, Some(true))).as_deref(),
            Some("MIG mode change to on pending a GPU reset")
        );
        assert_eq!(
            planned(mig(true, Some(false))).as_deref(),
            Some("MIG mode change to off pending a GPU reset")
        );
        let off = MigState {
            partitions: Vec::new(),
            ..mig(false, None)
        };
        assert_eq!(planned(off), None, "MIG off: a whole GPU");

        // A refusal says why the GPU took no part.
        let mut state = state();
        state.devices[0].mig = Some(mig(true, None));
        let node = ClusterNode {
            name: "a".into(),
            labels: BTreeMap::new(),
            gpu_state: state,
        };
        let problem = build_problem(&spec(), [&node], &HashMap::new(), &HeldShares::new());
        let refusal = crate::placement::solve(&problem, &Default::default()).unwrap_err();
        let details = refusal.details.join("\n");
        assert!(
            details.contains("not a whole GPU") && details.contains("a/g0: in MIG mode"),
            "{details}"
        );
    }
}
