//! The most a plan of one shape could serve: every stage on the best
//! figures the candidate's devices have (compute, bandwidth and memory,
//! possibly from different GPUs), all-reduces over the fastest link, the
//! cheapest hop. The serving model's capacity grows with each of those, so
//! no real plan of that shape serves more; `tensor: auto` skips the shapes
//! whose ceiling cannot beat a plan it has.

use std::collections::BTreeMap;

use super::judge::target;
use super::plan_reading::{runtime, workload};
use crate::placement::evaluate::eligible_devices;
use crate::placement::speed::link_gbps;
use crate::placement::{DeviceShare, Interconnect, Problem, Served};
use crate::serving::{
    GpuFigures, GroupLink, Hop, Replica, ReplicaPlan, RuntimeConfig, ServingInput, ServingModel,
    Stage,
};

/// The best figures of the candidate's devices, by vendor (the share of
/// datasheet bandwidth reads reach differs by vendor).
pub(crate) struct CapacityCeiling {
    best: BTreeMap<String, GpuFigures>,
    link_gbps: f64,
    on_memory_share: bool,
}

/// The higher of two narrow-format rates, where either GPU has one.
fn highest(a: Option<f64>, b: Option<f64>) -> Option<f64> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a.max(b)),
        (a, b) => a.or(b),
    }
}

impl CapacityCeiling {
    /// The ceiling of the problem's eligible devices, of one `kind` (product)
    /// alone when given.
    pub(crate) fn new(problem: &Problem, kind: Option<&str>) -> CapacityCeiling {
        let mut best: BTreeMap<String, GpuFigures> = BTreeMap::new();
        let mut on_memory_share = false;
        for device in eligible_devices(problem)
            .filter(|device| kind.is_none_or(|kind| device.product == kind))
        {
            on_memory_share |= matches!(device.share, Some(DeviceShare::Memory { .. }));
            let figures = best.entry(device.vendor.clone()).or_insert(GpuFigures {
                vendor: device.vendor.clone(),
                fp16_tflops: 0.0,
                fp8_tflops: None,
                fp4_tflops: None,
                memory_bandwidth_gbps: 0.0,
                memory_bytes: 0.0,
            });
            figures.fp16_tflops = figures.fp16_tflops.max(device.fp16_tflops);
            figures.fp8_tflops = highest(figures.fp8_tflops, device.fp8_tflops);
            figures.fp4_tflops = highest(figures.fp4_tflops, device.fp4_tflops);
            figures.memory_bandwidth_gbps = figures
                .memory_bandwidth_gbps
                .max(device.memory_bandwidth_gbps);
            let memory = match device.share {
                Some(DeviceShare::Memory { .. }) => device.memory_free_bytes,
                _ => device.memory_total_bytes,
            };
            figures.memory_bytes = figures.memory_bytes.max(memory as f64);
        }
        let link_gbps = problem
            .nodes
            .iter()
            .flat_map(|node| &node.links)
            .map(|link| link_gbps(Some(link.bandwidth_gbps)))
            .fold(link_gbps(None), f64::max);
        CapacityCeiling {
            best,
            link_gbps,
            on_memory_share,
        }
    }

    /// The most requests/s at the target per GPU a plan of `stages` stages
    /// of `tensor` GPUs could serve; 0 when not even the best figures meet
    /// the target or hold the model. A memory share's is not bounded (its
    /// size is the plan's), so its ceiling is infinite.
    pub(crate) fn requests_per_gpu(
        &self,
        served: &Served,
        problem: &Problem,
        tensor: u32,
        stages: u32,
    ) -> f64 {
        if self.on_memory_share {
            return f64::INFINITY;
        }
        let gpus = f64::from(tensor) * f64::from(stages);
        // Still a ceiling under the corrections: a GPU measured faster than
        // modelled could serve that much more.
        let fastest = served
            .corrections
            .iter()
            .map(|c| c.factor)
            .fold(1.0, f64::min);
        self.best
            .values()
            .filter_map(|gpu| {
                let input = ServingInput {
                    plan: ReplicaPlan {
                        tensor,
                        stages: vec![
                            Stage {
                                gpu: gpu.clone(),
                                link: GroupLink {
                                    kind: Some(Interconnect::NvLink),
                                    gbps: Some(self.link_gbps),
                                },
                            };
                            stages as usize
                        ],
                        hop: Hop::same_node(),
                    },
                    model: ServingModel {
                        spec: served.model.clone(),
                        head_dim: None,
                    },
                    workload: workload(served),
                    runtime: RuntimeConfig {
                        correction: (fastest < 1.0).then_some(fastest),
                        ..runtime(served, false)
                    },
                };
                let replica = Replica::new(&input).ok()?;
                let at = replica.at_target(&target(served, &problem.goal)).ok()?;
                Some(at.requests_per_second / gpus)
            })
            .fold(0.0, f64::max)
    }
}
