//! A plan as the serving model reads it: each stage's GPUs as their figures,
//! the stage's worst link, the instance's model and `spec.serving`; and what
//! the replica then serves at the instance's latency target.

use crate::api::{KvCacheDtype, ModelInstanceSpec, ServingSpec};
use crate::placement::evaluate::worse_link;
use crate::placement::speed::link_gbps;
use crate::placement::{Interconnect, Plan, Problem, StagePlan, StageShare};
use crate::serving::{
    Capacity, GpuFigures, GroupLink, Hop, LatencyTarget, Replica, ReplicaPlan, RuntimeConfig,
    ServingInput, ServingModel, Stage, Workload,
};

/// What one replica placed as `plan` on `problem`'s nodes serves at the
/// instance's target (`spec.serving`, or its defaults). An error says why
/// the serving model has no answer (the plan's memory cannot hold the
/// weights and one sequence, or a device is missing from the problem).
pub fn replica_capacity(
    spec: &ModelInstanceSpec,
    problem: &Problem,
    plan: &Plan,
) -> Result<Capacity, String> {
    let serving = spec.serving.clone().unwrap_or_default();
    let input = serving_input(spec, &serving, problem, plan)?;
    let replica = Replica::new(&input).map_err(|e| e.to_string())?;
    Ok(replica.capacity(&target(&serving)))
}

/// The latency target of `spec.serving`.
fn target(serving: &ServingSpec) -> LatencyTarget {
    LatencyTarget {
        max_tpot_ms: Some(serving.max_time_per_output_token_ms),
        max_ttft_ms: Some(serving.max_time_to_first_token_ms),
    }
}

fn serving_input(
    spec: &ModelInstanceSpec,
    serving: &ServingSpec,
    problem: &Problem,
    plan: &Plan,
) -> Result<ServingInput, String> {
    let stages = plan
        .stages
        .iter()
        .map(|stage| stage_of(problem, stage))
        .collect::<Result<Vec<_>, _>>()?;
    let on_memory_share = plan
        .stages
        .iter()
        .any(|stage| matches!(stage.share, Some(StageShare::Memory { .. })));
    let tensor = plan
        .stages
        .first()
        .map_or(1, |stage| stage.devices.len() as u32);
    Ok(ServingInput {
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
            spec: spec.model.clone(),
            head_dim: None,
        },
        workload: Workload {
            input_tokens: f64::from(serving.input_tokens),
            output_tokens: f64::from(serving.output_tokens),
        },
        runtime: RuntimeConfig {
            runtime: serving.runtime,
            kv_cache_dtype: spec.model.kv_cache_dtype.unwrap_or(KvCacheDtype::Auto),
            // A memory share is the runtime's whole allowance: it is started
            // with the share's fraction of the GPU (TESSERA_GPU_MEMORY_FRACTION,
            // vLLM's --gpu-memory-utilization), not a share of the share.
            memory_utilization: on_memory_share.then_some(1.0),
            ..RuntimeConfig::default()
        },
    })
}

/// A stage's tensor group: the slowest of its devices' figures (a group
/// runs at its slowest), a memory share's own size, and its worst link.
fn stage_of(problem: &Problem, stage: &StagePlan) -> Result<Stage, String> {
    let node = problem
        .nodes
        .iter()
        .find(|node| node.name == stage.node)
        .ok_or_else(|| format!("node {} is not in the cluster", stage.node))?;
    let mut gpu: Option<GpuFigures> = None;
    for id in &stage.devices {
        let device = node
            .devices
            .iter()
            .find(|device| &device.id == id)
            .ok_or_else(|| format!("device {}/{id} is not in the cluster", stage.node))?;
        let memory = match &stage.share {
            Some(StageShare::Memory { bytes, .. }) => *bytes as f64,
            _ => device.memory_total_bytes as f64,
        };
        let figures = GpuFigures {
            vendor: device.vendor.clone(),
            fp16_tflops: device.fp16_tflops,
            fp8_tflops: None,
            memory_bandwidth_gbps: device.memory_bandwidth_gbps,
            memory_bytes: memory,
        };
        gpu = Some(match gpu {
            None => figures,
            Some(slowest) => GpuFigures {
                vendor: slowest.vendor,
                fp16_tflops: slowest.fp16_tflops.min(figures.fp16_tflops),
                fp8_tflops: None,
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
    Ok(Stage { gpu, link })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::{
        GPU_STATE_VERSION, GpuDevice, GpuLink, Health, LinkKind, NodeGpuState, Vendor,
    };
    use crate::placement::{SolveOptions, solve};
    use crate::translate::{ClusterNode, HeldShares, build_problem};

    fn h100s(count: u32) -> ClusterNode {
        let devices: Vec<GpuDevice> = (0..count)
            .map(|i| GpuDevice {
                mig: None,
                id: format!("g{i}"),
                index: i,
                vendor: Vendor::Nvidia,
                product: "NVIDIA H100 80GB HBM3".into(),
                memory_total_bytes: 80 << 30,
                memory_free_bytes: 80 << 30,
                fp16_tflops: 989.0,
                memory_bandwidth_gbps: 3350.0,
                temperature_c: Some(40.0),
                power_w: None,
                numa_node: None,
                health: Health::Healthy,
                health_reason: None,
            })
            .collect();
        let mut links = Vec::new();
        for a in 0..count {
            for b in a + 1..count {
                links.push(GpuLink {
                    a: format!("g{a}"),
                    b: format!("g{b}"),
                    kind: LinkKind::Nvlink,
                    bandwidth_gbps: 900.0,
                });
            }
        }
        ClusterNode {
            name: "h100-0".into(),
            labels: Default::default(),
            gpu_state: NodeGpuState {
                version: GPU_STATE_VERSION.into(),
                backend: "fake".into(),
                devices,
                links,
                timestamp: None,
                allocated: Default::default(),
                shares: Default::default(),
            },
        }
    }

    fn capacity_of(yaml: &str, gpus: u32) -> Result<Capacity, String> {
        let spec: ModelInstanceSpec = serde_saphyr::from_str(yaml).unwrap();
        let node = h100s(gpus);
        let problem = build_problem(&spec, [&node], &Default::default(), &HeldShares::default());
        let plan = solve(&problem, &SolveOptions::default()).unwrap();
        replica_capacity(&spec, &problem, &plan)
    }

    const LLAMA_8B: &str = "model: {name: m, parametersBillions: 8.03, layers: 32, hiddenSize: 4096, attentionHeads: 32, kvHeads: 8}\n";

    #[test]
    fn a_replica_serves_many_sequences_at_its_target_and_says_how_many() {
        let capacity = capacity_of(LLAMA_8B, 1).unwrap();
        assert!(capacity.max_concurrency > 32, "{capacity:?}");
        let at = capacity.at_slo.expect("the default 50 ms target is met");
        assert!(at.concurrency > 1 && at.concurrency <= capacity.max_concurrency);
        assert!(at.tpot_ms <= 50.0 && at.ttft_ms <= 2000.0, "{at:?}");
        assert!(at.output_tokens_per_second > capacity.curve[0].output_tokens_per_second);
        // Every power of two below the largest concurrency, then that one.
        let concurrencies: Vec<u32> = capacity.curve.iter().map(|p| p.concurrency).collect();
        assert_eq!(concurrencies.last(), Some(&capacity.max_concurrency));
        for (index, c) in concurrencies[..concurrencies.len() - 1].iter().enumerate() {
            assert_eq!(*c, 1 << index);
        }
    }

    #[test]
    fn unknown_kv_heads_are_taken_at_their_most() {
        let known = capacity_of(LLAMA_8B, 1).unwrap();
        let unknown = capacity_of(
            "model: {name: m, parametersBillions: 8.03, layers: 32, hiddenSize: 4096}\n",
            1,
        )
        .unwrap();
        assert!(
            unknown.max_concurrency < known.max_concurrency,
            "{unknown:?} {known:?}"
        );
    }

    #[test]
    fn a_target_no_load_meets_says_what_the_replica_does_at_best() {
        let capacity = capacity_of(
            &format!("{LLAMA_8B}serving: {{maxTimePerOutputTokenMs: 1}}\n"),
            1,
        )
        .unwrap();
        assert_eq!(capacity.at_slo, None);
        let miss = capacity.target_missed.expect("missed");
        assert!(miss.best_tpot_ms > 1.0);
        assert!(miss.to_string().starts_with("at best"), "{miss}");
    }

    #[test]
    fn a_tensor_group_is_read_with_its_link() {
        let capacity = capacity_of(
            &format!("{LLAMA_8B}parallelism: {{tensor: 2, pipeline: 1}}\n"),
            2,
        )
        .unwrap();
        let one = capacity_of(LLAMA_8B, 1).unwrap();
        // Two GPUs hold more KV cache than one.
        assert!(
            capacity.max_concurrency >= one.max_concurrency,
            "{capacity:?}"
        );
    }
}
