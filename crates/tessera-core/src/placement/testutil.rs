//! Small problems for the solver's unit tests.

use super::problem::*;
use crate::api::GIB;

#[derive(Clone, Copy)]
pub(crate) struct Kind {
    pub product: &'static str,
    pub vendor: &'static str,
    pub memory_gib: f64,
    pub tflops: f64,
    pub bandwidth: f64,
    pub link: Option<Interconnect>,
}

pub(crate) const H100: Kind = Kind {
    product: "NVIDIA H100 80GB HBM3",
    vendor: "nvidia",
    memory_gib: 80.0,
    tflops: 989.0,
    bandwidth: 3350.0,
    link: Some(Interconnect::NvLink),
};
#[allow(dead_code)]
pub(crate) const A100: Kind = Kind {
    product: "NVIDIA A100-PCIE-40GB",
    vendor: "nvidia",
    memory_gib: 40.0,
    tflops: 312.0,
    bandwidth: 1555.0,
    link: Some(Interconnect::Pcie),
};
pub(crate) const MI300X: Kind = Kind {
    product: "AMD Instinct MI300X",
    vendor: "amd",
    memory_gib: 192.0,
    tflops: 1307.0,
    bandwidth: 5300.0,
    link: Some(Interconnect::Xgmi),
};
pub(crate) const RTX4090: Kind = Kind {
    product: "NVIDIA GeForce RTX 4090",
    vendor: "nvidia",
    memory_gib: 24.0,
    tflops: 165.0,
    bandwidth: 1008.0,
    link: None,
};

pub(crate) fn node(name: &str, count: u32, kind: Kind) -> NodeState {
    let devices: Vec<Device> = (0..count)
        .map(|index| Device {
            id: format!("{name}-{index}"),
            index,
            vendor: kind.vendor.into(),
            product: kind.product.into(),
            memory_total_bytes: (kind.memory_gib * GIB) as u64,
            memory_free_bytes: (kind.memory_gib * GIB) as u64,
            fp16_tflops: kind.tflops,
            fp8_tflops: None,
            fp4_tflops: None,
            memory_bandwidth_gbps: kind.bandwidth,
            temperature_c: Some(40.0),
            healthy: true,
            health_reason: None,
            allocated_to: None,
            not_whole: None,
            share: None,
        })
        .collect();
    let mut links = Vec::new();
    if let Some(link_kind) = kind.link {
        for first in 0..count {
            for second in first + 1..count {
                links.push(Link {
                    a: format!("{name}-{first}"),
                    b: format!("{name}-{second}"),
                    kind: link_kind,
                    bandwidth_gbps: 300.0,
                });
            }
        }
    }
    NodeState {
        name: name.into(),
        zone: None,
        rack: None,
        labels: Default::default(),
        devices,
        links,
    }
}

/// A bf16 decoder of `billions` parameters with a realistic layer count.
pub(crate) fn problem(
    nodes: Vec<NodeState>,
    billions: u32,
    tensor: u32,
    stages: Stages,
) -> Problem {
    let billions = f64::from(billions);
    let layers: u32 = if billions >= 300.0 {
        126
    } else if billions >= 60.0 {
        80
    } else {
        32
    };
    let params = billions * 1e9;
    let hidden = (params / (12.0 * f64::from(layers))).sqrt();
    Problem {
        served: None,
        one_device: false,
        nodes,
        model: ModelShape {
            layers,
            weight_bytes_per_layer: params * 2.0 / f64::from(layers),
            kv_bytes_per_layer: 0.0,
            overhead_bytes_per_device: GIB,
            activation_bytes_per_token: hidden * 2.0,
            flops_per_layer_token: 2.0 * params / f64::from(layers),
            precision: crate::placement::Precision::Fp16,
        },
        tensor,
        stages,
        weights: Weights::default(),
        max_temperature_c: 85.0,
        selector: Selector::default(),
        strategy: Strategy::ScoreOnly,
        replica_nodes: Vec::new(),
        goal: SpeedGoal::default(),
    }
}
