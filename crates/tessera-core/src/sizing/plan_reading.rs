//! A plan as the serving model reads it: each stage's GPUs as their figures,
//! the stage's worst link, the pipeline's slowest hop, the instance's model
//! and `spec.serving`; and how many GPUs the plan takes, a share of one
//! counted as its part.

use crate::api::KvCacheDtype;
use crate::placement::evaluate::worse_link;
use crate::placement::speed::link_gbps;
use crate::placement::{DeviceShare, Interconnect, Plan, Problem, Served, StagePlan, StageShare};
use crate::serving::{
    GpuFigures, GroupLink, Hop, ReplicaPlan, RuntimeConfig, ServingInput, ServingModel, Stage,
    Workload,
};

/// The serving model's input for `plan` on `problem`'s nodes, and the GPUs
/// it takes. An error says which device or node is missing.
pub(crate) fn read(
    served: &Served,
    problem: &Problem,
    plan: &Plan,
) -> Result<(ServingInput, f64), String> {
    let mut gpus = 0.0;
    let stages = plan
        .stages
        .iter()
        .map(|stage| {
            let (read, taken) = stage_of(problem, stage)?;
            gpus += taken;
            Ok(read)
        })
        .collect::<Result<Vec<_>, String>>()?;
    let on_memory_share = plan
        .stages
        .iter()
        .any(|stage| matches!(stage.share, Some(StageShare::Memory { .. })));
    let tensor = plan
        .stages
        .first()
        .map_or(1, |stage| stage.devices.len() as u32);
    let correction = product(problem, plan)
        .and_then(|product| served.correction_for(product, tensor, plan.stages.len() as u32));
    let input = ServingInput {
        plan: ReplicaPlan {
            tensor,
            stages,
            // The slowest hop of the pipeline, as the solver charges it.
            hop: Hop::of_cost(
                plan.stages
                    .iter()
                    .take(plan.stages.len().saturating_sub(1))
                    .map(|stage| stage.parts.next_hop_cost)
                    .fold(0.0, f64::max),
            ),
        },
        model: ServingModel {
            spec: served.model.clone(),
            head_dim: None,
        },
        workload: workload(served),
        runtime: RuntimeConfig {
            correction,
            ..runtime(served, on_memory_share)
        },
    };
    Ok((input, gpus))
}

/// The GPU product of `plan`'s first device: what a correction is learned
/// and looked up by.
pub(crate) fn product<'a>(problem: &'a Problem, plan: &Plan) -> Option<&'a str> {
    let stage = plan.stages.first()?;
    let id = stage.devices.first()?;
    problem
        .nodes
        .iter()
        .find(|node| node.name == stage.node)?
        .devices
        .iter()
        .find(|device| &device.id == id)
        .map(|device| device.product.as_str())
}

/// The typical request of `spec.serving`.
pub fn workload(served: &Served) -> Workload {
    Workload {
        input_tokens: f64::from(served.serving.input_tokens),
        output_tokens: f64::from(served.serving.output_tokens),
    }
}

/// The runtime as the replica runs it. A memory share is the runtime's
/// whole allowance: it is started with the share's fraction of the GPU
/// (TESSERA_GPU_MEMORY_FRACTION, vLLM's --gpu-memory-utilization), not a
/// share of the share.
pub fn runtime(served: &Served, on_memory_share: bool) -> RuntimeConfig {
    RuntimeConfig {
        kv_cache_dtype: served.model.kv_cache_dtype.unwrap_or(KvCacheDtype::Auto),
        memory_utilization: on_memory_share.then_some(1.0),
        ..RuntimeConfig::of_spec(&served.serving)
    }
}

/// A stage's tensor group: the slowest of its devices' figures (a group
/// runs at its slowest; a memory share at its part of the GPU), a memory
/// share's own size, and its worst link;
/// with the GPUs it takes (a memory share its fraction, a partition its
/// part of the GPU's compute).
fn stage_of(problem: &Problem, stage: &StagePlan) -> Result<(Stage, f64), String> {
    let node = problem
        .nodes
        .iter()
        .find(|node| node.name == stage.node)
        .ok_or_else(|| format!("node {} is not in the cluster", stage.node))?;
    let mut gpu: Option<GpuFigures> = None;
    let mut taken = 0.0;
    for id in &stage.devices {
        let device = node
            .devices
            .iter()
            .find(|device| &device.id == id)
            .ok_or_else(|| format!("device {}/{id} is not in the cluster", stage.node))?;
        // A memory share is assured its part of the GPU's compute and
        // bandwidth, what it gets when every tenant is busy (alone it runs
        // faster): its capacity is never counted twice among the tenants.
        let (memory, part) = match &stage.share {
            Some(StageShare::Memory {
                bytes, fraction, ..
            }) => (*bytes as f64, fraction.clamp(f64::MIN_POSITIVE, 1.0)),
            _ => (device.memory_total_bytes as f64, 1.0),
        };
        taken += match (&stage.share, &device.share) {
            (Some(StageShare::Memory { .. }), _) => part,
            (_, Some(DeviceShare::Partition { gpu_tflops, .. })) if *gpu_tflops > 0.0 => {
                (device.fp16_tflops / gpu_tflops).clamp(0.0, 1.0)
            }
            _ => 1.0,
        };
        let figures = GpuFigures {
            vendor: device.vendor.clone(),
            fp16_tflops: device.fp16_tflops * part,
            fp8_tflops: device.fp8_tflops.map(|rate| rate * part),
            fp4_tflops: device.fp4_tflops.map(|rate| rate * part),
            memory_bandwidth_gbps: device.memory_bandwidth_gbps * part,
            memory_bytes: memory,
        };
        gpu = Some(match gpu {
            None => figures,
            Some(slowest) => GpuFigures {
                vendor: slowest.vendor,
                fp16_tflops: slowest.fp16_tflops.min(figures.fp16_tflops),
                // A group runs a narrow format only where all its GPUs can.
                fp8_tflops: slowest
                    .fp8_tflops
                    .zip(figures.fp8_tflops)
                    .map(|(a, b)| a.min(b)),
                fp4_tflops: slowest
                    .fp4_tflops
                    .zip(figures.fp4_tflops)
                    .map(|(a, b)| a.min(b)),
                memory_bandwidth_gbps: slowest
                    .memory_bandwidth_gbps
                    .min(figures.memory_bandwidth_gbps),
                memory_bytes: slowest.memory_bytes.min(figures.memory_bytes),
            },
        });
    }
    let gpu = gpu.ok_or_else(|| format!("a stage on {} has no devices", stage.node))?;
    // The group's slowest link and worst link kind, as the solver reads
    // them (a pair without a link is the worst kind, at the unreported speed).
    let mut slowest_gbps = f64::INFINITY;
    let mut worst_kind = Some(Interconnect::NvLink);
    for (index, a) in stage.devices.iter().enumerate() {
        for b in &stage.devices[index + 1..] {
            let found = node
                .links
                .iter()
                .find(|l| (&l.a == a && &l.b == b) || (&l.a == b && &l.b == a));
            slowest_gbps = slowest_gbps.min(link_gbps(found.map(|l| l.bandwidth_gbps)));
            worst_kind = worse_link(worst_kind, found.map(|l| l.kind));
        }
    }
    let link = if stage.devices.len() > 1 {
        GroupLink {
            kind: worst_kind,
            gbps: Some(slowest_gbps),
        }
    } else {
        GroupLink::default()
    };
    Ok((Stage { gpu, link }, taken))
}
