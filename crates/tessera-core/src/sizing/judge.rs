//! What a plan is worth under the instance's goal. With what the instance
//! serves known (`Problem::served`), a plan is judged by the serving model:
//! `optimize: throughput` by the requests/s it serves at the latency target
//! per GPU it takes, `latency` by one stream's speed, and a plan meeting the
//! target always beats one that does not. Without it, by one stream's speed
//! alone (tokens/s per GPU, or tokens/s), as the solver predicts it.

use super::plan_reading;
use crate::placement::{Optimize, Plan, Problem, Served, SpeedGoal};
use crate::serving::{AtTarget, Capacity, LatencyTarget, Replica};

/// A plan of one size and GPU kind, judged.
#[derive(Clone, Debug)]
pub(crate) struct Judged {
    pub(crate) plan: Plan,
    pub(crate) tensor: u32,
    /// GPUs the plan takes: a memory share counts as its fraction.
    pub(crate) gpus: f64,
    /// What one replica serves; `None` without `Problem::served`, an error
    /// where the serving model has no answer (its memory cannot hold a
    /// sequence), which serves nothing.
    pub(crate) capacity: Option<Result<Capacity, String>>,
    /// `serving.requestsPerSecond`.
    demand: Option<f64>,
}

/// The latency a replica must meet: `spec.serving`'s, and no slower than
/// `parallelism.minTokensPerSecond` (a floor on every user's speed).
pub fn target(served: &Served, goal: &SpeedGoal) -> LatencyTarget {
    let mut tpot = served.serving.max_time_per_output_token_ms;
    if let Some(min) = goal.min_tokens_per_second.filter(|min| *min > 0.0) {
        tpot = tpot.min(1e3 / min);
    }
    LatencyTarget {
        max_tpot_ms: Some(tpot),
        max_ttft_ms: Some(served.serving.max_time_to_first_token_ms),
    }
}

/// What `plan` serves at the target, and the GPUs it takes.
pub fn capacity(
    served: &Served,
    goal: &SpeedGoal,
    problem: &Problem,
    plan: &Plan,
) -> Result<(Capacity, f64), String> {
    let (input, gpus) = plan_reading::read(served, problem, plan)?;
    let replica = Replica::new(&input).map_err(|refusal| refusal.to_string())?;
    Ok((replica.capacity(&target(served, goal)), gpus))
}

impl Judged {
    pub(crate) fn new(problem: &Problem, plan: Plan, tensor: u32) -> Judged {
        let whole = f64::from(tensor) * plan.stages.len() as f64;
        let (capacity, gpus) = match &problem.served {
            None => (None, whole),
            Some(served) => match capacity(served, &problem.goal, problem, &plan) {
                Ok((capacity, gpus)) => (Some(Ok(capacity)), gpus),
                Err(why) => (Some(Err(why)), whole),
            },
        };
        Judged {
            plan,
            tensor,
            gpus: gpus.max(f64::MIN_POSITIVE),
            capacity,
            demand: problem
                .served
                .as_ref()
                .and_then(|served| served.serving.requests_per_second),
        }
    }

    /// One stream's predicted tokens/s.
    pub(crate) fn speed(&self) -> f64 {
        self.plan.performance.tokens_per_second
    }

    pub(crate) fn stages(&self) -> u32 {
        self.plan.stages.len() as u32
    }

    /// The replica at the highest concurrency meeting the target.
    pub(crate) fn at_target(&self) -> Option<&AtTarget> {
        self.capacity.as_ref()?.as_ref().ok()?.at_slo.as_ref()
    }

    /// Whether the plan is judged by the serving model.
    fn served(&self) -> bool {
        self.capacity.is_some()
    }

    /// Requests/s at the target per GPU (0 where the target is missed).
    pub(crate) fn requests_per_gpu(&self) -> f64 {
        self.at_target()
            .map_or(0.0, |at| at.requests_per_second / self.gpus)
    }

    /// GPUs the demand (`serving.requestsPerSecond`) takes in replicas like
    /// this one, each taking an even share.
    fn gpus_for_demand(&self) -> Option<f64> {
        let demand = self.demand?;
        let at = self.at_target()?;
        Some((demand / at.requests_per_second).ceil() * self.gpus)
    }

    /// The fastest time per output token the plan gives anyone: at
    /// concurrency 1 (the solver's single-stream time where the serving
    /// model has no answer).
    pub(crate) fn best_tpot_ms(&self) -> f64 {
        match &self.capacity {
            Some(Ok(capacity)) => capacity
                .curve
                .first()
                .map_or(f64::INFINITY, |point| point.tpot_ms),
            _ => 1e3 / self.speed().max(f64::MIN_POSITIVE),
        }
    }

    /// Whether this plan serves the goal better than `other`. Ties go to the
    /// faster plan, then to fewer GPUs per shard, so the choice never
    /// depends on the order candidates were solved in.
    pub(crate) fn beats(&self, other: &Judged, goal: &SpeedGoal) -> bool {
        if self.served() {
            let (meets, other_meets) = (self.at_target().is_some(), other.at_target().is_some());
            if meets != other_meets {
                return meets;
            }
            if meets && goal.optimize == Optimize::Throughput {
                // With a demand, the fewest GPUs for all of it in replicas
                // like this one; then the most per GPU.
                if let Some((mine, theirs)) = self.gpus_for_demand().zip(other.gpus_for_demand())
                    && mine != theirs
                {
                    return mine < theirs;
                }
                let (mine, theirs) = (self.requests_per_gpu(), other.requests_per_gpu());
                if mine != theirs {
                    return mine > theirs;
                }
            }
        } else {
            if let Some(min) = goal.min_tokens_per_second {
                let (reaches, other_reaches) = (self.speed() >= min, other.speed() >= min);
                if reaches != other_reaches {
                    return reaches;
                }
                if reaches && self.gpus != other.gpus {
                    return self.gpus < other.gpus;
                }
            }
            if goal.optimize == Optimize::Throughput {
                let (mine, theirs) = (self.speed() / self.gpus, other.speed() / other.gpus);
                if mine != theirs {
                    return mine > theirs;
                }
            }
        }
        if self.speed() != other.speed() {
            return self.speed() > other.speed();
        }
        self.tensor < other.tensor
    }
}

#[cfg(test)]
mod tests {
    use crate::api::{
        GPU_STATE_VERSION, GpuDevice, GpuLink, Health, LinkKind, ModelInstanceSpec, NodeGpuState,
        Vendor,
    };
    use crate::placement::{Problem, SolveOptions};
    use crate::serving::Capacity;
    use crate::sizing::{InstancePlan, solve_parallelism};
    use crate::translate::{ClusterNode, HeldShares, build_problem, tensor_choice};

    /// (product, GiB, FP16 TFLOPS, GB/s, NVLink)
    type Kind = (&'static str, u64, f64, f64, bool);
    const H100: Kind = ("NVIDIA H100 80GB HBM3", 80, 989.0, 3350.0, true);
    const L40S: Kind = ("NVIDIA L40S", 48, 362.0, 864.0, false);

    fn gpus(name: &str, count: u32, kind: Kind) -> ClusterNode {
        gpus_offering(name, count, kind, false)
    }

    fn gpus_offering(name: &str, count: u32, kind: Kind, memory_shares: bool) -> ClusterNode {
        let (product, gib, tflops, bandwidth, nvlink) = kind;
        let devices: Vec<GpuDevice> = (0..count)
            .map(|i| GpuDevice {
                mig: None,
                id: format!("{name}-{i}"),
                index: i,
                vendor: Vendor::Nvidia,
                product: product.into(),
                memory_total_bytes: gib << 30,
                memory_free_bytes: gib << 30,
                fp16_tflops: tflops,
                fp8_tflops: None,
                fp4_tflops: None,
                memory_bandwidth_gbps: bandwidth,
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
                    a: format!("{name}-{a}"),
                    b: format!("{name}-{b}"),
                    kind: if nvlink {
                        LinkKind::Nvlink
                    } else {
                        LinkKind::Pcie
                    },
                    bandwidth_gbps: if nvlink { 900.0 } else { 64.0 },
                });
            }
        }
        ClusterNode {
            name: name.into(),
            labels: Default::default(),
            gpu_state: NodeGpuState {
                version: GPU_STATE_VERSION.into(),
                backend: "fake".into(),
                devices,
                links,
                timestamp: None,
                allocated: Default::default(),
                shares: crate::api::SharesOffered {
                    memory: memory_shares,
                    ..Default::default()
                },
            },
        }
    }

    fn problem(yaml: &str, nodes: &[ClusterNode]) -> (ModelInstanceSpec, Problem) {
        let spec: ModelInstanceSpec = serde_saphyr::from_str(yaml).expect("a valid spec");
        let problem = build_problem(&spec, nodes, &Default::default(), &HeldShares::default());
        (spec, problem)
    }

    fn plan(yaml: &str, nodes: &[ClusterNode]) -> InstancePlan {
        let (spec, problem) = problem(yaml, nodes);
        solve_parallelism(&problem, tensor_choice(&spec), &SolveOptions::default()).expect("a plan")
    }

    fn capacity_of(plan: &InstancePlan) -> &Capacity {
        plan.capacity
            .as_ref()
            .expect("judged by the serving model")
            .as_ref()
            .expect("a prediction")
    }

    const LLAMA_8B: &str = "model: {name: m, parametersBillions: 8.03, layers: 32, hiddenSize: 4096, attentionHeads: 32, kvHeads: 8}\n";
    const LLAMA_70B_FP8: &str = "model: {name: m, parametersBillions: 70.6, layers: 80, hiddenSize: 8192, attentionHeads: 64, kvHeads: 8, dtype: fp8}\n";

    #[test]
    fn a_replica_serves_many_sequences_at_its_target_and_says_how_many() {
        let chosen = plan(
            &format!("{LLAMA_8B}parallelism: {{tensor: 1}}\n"),
            &[gpus("a", 1, H100)],
        );
        let capacity = capacity_of(&chosen);
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
        // Unknown KV heads are taken at their most: fewer sequences fit.
        let unknown = plan(
            "model: {name: m, parametersBillions: 8.03, layers: 32, hiddenSize: 4096}\nparallelism: {tensor: 1}\n",
            &[gpus("a", 1, H100)],
        );
        assert!(capacity_of(&unknown).max_concurrency < capacity.max_concurrency);
        // A reserved KV cache is the cache, not what the GPU leaves.
        let reserved = plan(
            "model: {name: m, parametersBillions: 8.03, layers: 32, hiddenSize: 4096, attentionHeads: 32, kvHeads: 8, kvCacheGiB: 2}\nparallelism: {tensor: 1}\n",
            &[gpus("a", 1, H100)],
        );
        assert!(capacity_of(&reserved).max_concurrency < capacity.max_concurrency / 10);
    }

    #[test]
    fn throughput_takes_more_h100s_for_a_70b_in_fp8_than_the_one_that_holds_it() {
        let node = gpus("a", 8, H100);
        let one = plan(
            &format!("{LLAMA_70B_FP8}parallelism: {{tensor: 1}}\n"),
            std::slice::from_ref(&node),
        );
        assert_eq!(one.plan.stages.len(), 1, "one H100 holds the weights");
        let auto = plan(
            &format!("{LLAMA_70B_FP8}parallelism: {{tensor: auto}}\n"),
            std::slice::from_ref(&node),
        );
        assert!(auto.tensor >= 2, "{:?}", auto.parallelism_note());
        assert_eq!(auto.plan.stages.len(), 1);
        let per_gpu =
            |chosen: &InstancePlan| chosen.requests_per_second().unwrap_or(0.0) / chosen.gpus;
        assert!(
            per_gpu(&auto) > 1.3 * per_gpu(&one),
            "{} vs {}",
            per_gpu(&auto),
            per_gpu(&one)
        );
        let note = auto.parallelism_note().expect("auto explains itself");
        assert!(
            note.starts_with(
                "tensor auto (throughput: the most requests/s at the target per GPU) chose"
            ),
            "{note}"
        );
        assert!(note.contains("requests/s at the target"), "{note}");
        // Latency takes the fastest single stream: the largest group.
        let latency = plan(
            &format!("{LLAMA_70B_FP8}parallelism: {{tensor: auto, optimize: latency}}\n"),
            std::slice::from_ref(&node),
        );
        assert_eq!(latency.tensor, 8);
    }

    #[test]
    fn the_gpu_kind_that_serves_more_per_gpu_wins() {
        let nodes = [gpus("h100", 2, H100), gpus("l40s", 8, L40S)];
        let auto = plan(
            &format!("{LLAMA_8B}parallelism: {{tensor: auto}}\n"),
            &nodes,
        );
        assert!(
            auto.plan.stages.iter().all(|s| s.node == "h100"),
            "{:?}",
            auto.plan.stages
        );
        assert_eq!(auto.kind.as_deref(), Some(H100.0));
        let note = auto.parallelism_note().expect("auto explains itself");
        assert!(note.contains("on one GPU kind alone not solved"), "{note}");
        assert!(
            !note.contains("compared tensor × stages 1 ×"),
            "the choice is not listed again: {note}"
        );
        // Restricted to the slower kind, the plan says what it serves there.
        let l40s = plan(
            &format!("{LLAMA_8B}parallelism: {{tensor: auto}}\nplacement: {{products: [L40S]}}\n"),
            &nodes,
        );
        assert!(l40s.plan.stages.iter().all(|s| s.node == "l40s"));
        assert!(l40s.requests_per_second() < auto.requests_per_second());
        // A fixed size compares the kinds too, and says it kept the size.
        let fixed = plan(&format!("{LLAMA_8B}parallelism: {{tensor: 1}}\n"), &nodes);
        assert!(fixed.plan.stages.iter().all(|s| s.node == "h100"));
        assert!(!fixed.auto);
        let note = fixed.parallelism_note().expect("the kinds compared");
        assert!(
            note.starts_with("tensor 1 × 1 stage(s) (throughput"),
            "{note}"
        );
        assert!(note.contains(&format!("chose on {}", H100.0)), "{note}");
    }

    #[test]
    fn a_target_no_plan_meets_is_refused_when_asked_for_and_said_otherwise() {
        let nodes = [gpus("l40s", 2, L40S), gpus("held", 1, H100)];
        let mut allocated = std::collections::HashMap::new();
        allocated.insert(
            ("held".to_string(), "held-0".to_string()),
            "ns/other".to_string(),
        );
        let yaml = format!(
            "{LLAMA_8B}serving: {{maxTimePerOutputTokenMs: 8, maxTimeToFirstTokenMs: 2000}}\n"
        );
        let spec: ModelInstanceSpec = serde_saphyr::from_str(&yaml).expect("a valid spec");
        let problem = build_problem(&spec, &nodes, &allocated, &HeldShares::default());
        let refused = solve_parallelism(&problem, tensor_choice(&spec), &SolveOptions::default())
            .expect_err("8 ms per token is out of an L40S's reach");
        assert!(refused.reason.starts_with("at best "), "{}", refused.reason);
        assert!(refused.reason.contains("allow "), "{}", refused.reason);
        assert!(
            refused.reason.contains(H100.0),
            "the held H100 would do: {}",
            refused.reason
        );
        // Without spec.serving the default target is judged, not required:
        // the best plan is placed and said to miss it.
        let mut judged_only = problem.clone();
        if let Some(served) = judged_only.served.as_mut() {
            served.target_required = false;
        }
        let placed =
            solve_parallelism(&judged_only, tensor_choice(&spec), &SolveOptions::default())
                .expect("placed");
        let miss = capacity_of(&placed)
            .target_missed
            .expect("the target is missed");
        assert!(miss.best_tpot_ms > 8.0, "{miss}");
    }

    #[test]
    fn a_memory_share_is_sized_to_the_demand() {
        let node = gpus_offering("a", 1, H100, true);
        let share_gib = |serving: &str| {
            let chosen = plan(
                &format!("{LLAMA_8B}placement: {{sharing: Shared}}\n{serving}"),
                std::slice::from_ref(&node),
            );
            match &chosen.plan.stages[0].share {
                Some(crate::placement::StageShare::Memory { bytes, .. }) => *bytes >> 30,
                other => panic!("a memory share, not {other:?}"),
            }
        };
        let without = share_gib("");
        let small = share_gib("serving: {requestsPerSecond: 1}\n");
        let large = share_gib("serving: {requestsPerSecond: 8}\n");
        assert!(small < large, "{small} GiB for 1 request/s, {large} for 8");
        assert!(without > 15 && without < 40, "{without} GiB");
    }

    #[test]
    fn pipeline_auto_takes_more_stages_where_they_serve_more_per_gpu() {
        // One H100 a node: one holds a 70B in FP8 with little KV cache; two
        // over the network hold a batch that serves more per GPU.
        let single: Vec<ClusterNode> = (0..4).map(|n| gpus(&format!("n{n}"), 1, H100)).collect();
        let auto = plan(
            &format!("{LLAMA_70B_FP8}parallelism: {{tensor: auto}}\n"),
            &single,
        );
        assert_eq!(auto.plan.stages.len(), 2);
        let note = auto.parallelism_note().expect("a note");
        assert!(note.contains("1 GPU(s) per shard × 2 stage(s)"), "{note}");
        let one = plan(
            &format!("{LLAMA_70B_FP8}parallelism: {{tensor: auto, pipeline: 1}}\n"),
            &single,
        );
        assert_eq!(one.plan.stages.len(), 1);
        let per_gpu =
            |chosen: &InstancePlan| chosen.requests_per_second().unwrap_or(0.0) / chosen.gpus;
        assert!(per_gpu(&auto) > per_gpu(&one));
        // Where the fewest stages cannot meet the target, more are not
        // tried: the replica is not spread thinner to be served.
        let l40s: Vec<ClusterNode> = (0..4).map(|n| gpus(&format!("n{n}"), 1, L40S)).collect();
        let fewest = plan(
            &format!("{LLAMA_70B_FP8}parallelism: {{tensor: auto}}\n"),
            &l40s,
        );
        assert_eq!(fewest.plan.stages.len(), 2);
        assert!(fewest.requests_per_second().is_none());
    }
}
