//! Constructed Nodes and ModelInstances for the controller's unit tests.

use std::sync::Arc;

use k8s_openapi::api::core::v1::{Node, NodeCondition, NodeStatus, PodSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};
use k8s_openapi::jiff::Timestamp;

use super::decide::PlanInputs;
use super::held::Held;
use super::nodes::NodeInfo;
use tessera_core::api::{
    GPU_STATE_ANNOTATION, GPU_STATE_VERSION, GpuDevice, GpuLink, Health, LinkKind, ModelInstance,
    NodeGpuState, Vendor,
};

#[derive(Clone, Copy)]
pub(crate) struct Kind {
    pub(crate) vendor: Vendor,
    pub(crate) product: &'static str,
    pub(crate) memory_gib: u64,
    pub(crate) tflops: f64,
    pub(crate) bandwidth: f64,
}

pub(crate) const H100: Kind = Kind {
    vendor: Vendor::Nvidia,
    product: "NVIDIA H100 80GB HBM3",
    memory_gib: 80,
    tflops: 989.0,
    bandwidth: 3350.0,
};
pub(crate) const MI300X: Kind = Kind {
    vendor: Vendor::Amd,
    product: "AMD Instinct MI300X",
    memory_gib: 192,
    tflops: 1307.0,
    bandwidth: 5300.0,
};
pub(crate) const RTX4090: Kind = Kind {
    vendor: Vendor::Nvidia,
    product: "NVIDIA GeForce RTX 4090",
    memory_gib: 24,
    tflops: 165.0,
    bandwidth: 1008.0,
};

pub(crate) const NOW: &str = "2026-06-01T12:00:00Z";

pub(crate) fn now() -> Timestamp {
    NOW.parse().unwrap()
}

/// The published state of `count` devices of one kind, all linked by NVLink
/// or xGMI. Device IDs are `<node>-g<i>`.
pub(crate) fn state(node: &str, count: u32, kind: Kind) -> NodeGpuState {
    let devices = (0..count)
        .map(|i| GpuDevice {
            mig: None,
            id: format!("{node}-g{i}"),
            index: i,
            vendor: kind.vendor,
            product: kind.product.into(),
            memory_total_bytes: kind.memory_gib << 30,
            memory_free_bytes: (kind.memory_gib << 30) - (512 << 20),
            fp16_tflops: kind.tflops,
            fp8_tflops: None,
            fp4_tflops: None,
            memory_bandwidth_gbps: kind.bandwidth,
            temperature_c: Some(40.0),
            power_w: None,
            numa_node: Some(0),
            health: Health::Healthy,
            health_reason: None,
        })
        .collect();
    let link = if kind.vendor == Vendor::Amd {
        LinkKind::Xgmi
    } else {
        LinkKind::Nvlink
    };
    let mut links = Vec::new();
    for a in 0..count {
        for b in a + 1..count {
            links.push(GpuLink {
                a: format!("{node}-g{a}"),
                b: format!("{node}-g{b}"),
                kind: link,
                bandwidth_gbps: 900.0,
            });
        }
    }
    let mut s = NodeGpuState::from_json(&format!(
        r#"{{"version":"{GPU_STATE_VERSION}","backend":"fake"}}"#
    ))
    .unwrap();
    s.devices = devices;
    s.links = links;
    s
}

pub(crate) fn node_with(name: &str, state: &NodeGpuState) -> Node {
    Node {
        metadata: ObjectMeta {
            name: Some(name.into()),
            annotations: Some([(GPU_STATE_ANNOTATION.to_string(), state.to_json())].into()),
            ..Default::default()
        },
        status: Some(NodeStatus {
            conditions: Some(vec![NodeCondition {
                type_: "Ready".into(),
                status: "True".into(),
                last_transition_time: Some(Time("2026-06-01T00:00:00Z".parse().unwrap())),
                ..Default::default()
            }]),
            ..Default::default()
        }),
        ..Default::default()
    }
}

pub(crate) fn node(name: &str, count: u32, kind: Kind) -> Node {
    node_with(name, &state(name, count, kind))
}

pub(crate) fn infos(nodes: &[Node]) -> Vec<Arc<NodeInfo>> {
    nodes
        .iter()
        .map(|n| Arc::new(NodeInfo::from_node(n).unwrap().unwrap()))
        .collect()
}

pub(crate) fn inputs<'a>(nodes: &'a [Arc<NodeInfo>], held: &'a Held) -> PlanInputs<'a> {
    PlanInputs::new(nodes, held, now(), &super::settings::Settings::default())
}

/// A ModelInstance `ml/<name>` (UID `uid-<name>`, generation 1) with a
/// one-container template; `spec` is the YAML of the rest of its spec.
pub(crate) fn instance(name: &str, spec: &str) -> ModelInstance {
    let template =
        "template:\n  spec:\n    containers:\n      - name: shard\n        image: busybox:1.37\n";
    let yaml = format!("{spec}\n{template}");
    let mut mi = ModelInstance::new(name, serde_saphyr::from_str(&yaml).unwrap());
    mi.metadata.namespace = Some("ml".into());
    mi.metadata.uid = Some(format!("uid-{name}"));
    mi.metadata.generation = Some(1);
    mi
}

/// The pod spec of an instance made by [`instance`], for tests that edit it.
pub(crate) fn pod_spec(mi: &mut ModelInstance) -> &mut PodSpec {
    mi.spec
        .template
        .as_mut()
        .and_then(|t| t.spec.as_mut())
        .expect("instance() always has a pod spec")
}

/// A 7B model in bf16: about 14 GB of weights, fits one GPU of 24 GiB or more.
pub(crate) const SMALL: &str =
    "model: {name: small, parametersBillions: 7, layers: 32, kvCacheGiB: 2}";
