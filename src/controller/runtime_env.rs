//! What a serving runtime needs to start a replica's ranks as they were
//! planned, beyond each shard's own environment: where rank 0 listens, how
//! many stages there are, the layer split tessera planned in the form vLLM
//! reads it, and what the capacity was planned with (how many requests at
//! once keep the latency target, how long a request is, how much of each
//! GPU's memory the runtime takes). Pure; `desired` adds it to every shard
//! pod.

use tessera_core::api::{ModelInstanceSpec, PlannedShard, ReplicaCapacity};
use tessera_core::placement::Served;
use tessera_core::sizing::{runtime_of, workload_of};

/// The port rank 0 listens on for the others (`TESSERA_MASTER_PORT`): vLLM's
/// own default for `--master-port`. Every shard is a pod with its own IP, so
/// one fixed port never collides.
pub(crate) const MASTER_PORT: u16 = 29501;

/// The variables this module sets. They are left out of a pod's hash
/// (`hashes::pod_hash`): shard pods made before they existed stay as they
/// are, and their values follow from what the hash covers (the instance, the
/// replica, its shard count) but for the other shards' layer counts, whose
/// change changes those shards' pods, and the planned capacity: a change of
/// `spec.serving` alone that keeps the plan keeps running pods with the
/// values they started with, until they are next made.
pub(crate) const NAMES: [&str; 7] = [
    "TESSERA_MASTER_ADDR",
    "TESSERA_MASTER_PORT",
    "TESSERA_PIPELINE_PARALLEL",
    "VLLM_PP_LAYER_PARTITION",
    "TESSERA_MAX_NUM_SEQS",
    "TESSERA_MAX_MODEL_LEN",
    "TESSERA_GPU_MEMORY_FRACTION",
];

/// What the replica's capacity was planned with.
pub(crate) struct Planned<'a> {
    pub(crate) spec: &'a ModelInstanceSpec,
    /// The replica's capacity at the target, where there is a prediction.
    pub(crate) capacity: Option<&'a ReplicaCapacity>,
}

/// The runtime environment of every pod of a replica whose shards are
/// `plan` and whose shard 0 is reached at `master_address`.
///
/// `VLLM_PP_LAYER_PARTITION` is set only when every stage has the same
/// number of GPUs: vLLM runs one tensor size on all ranks, so a replica whose
/// stages differ cannot be started by it, and the missing variable lets a
/// start script say so instead of vLLM failing on a mismatch.
///
/// `TESSERA_MAX_NUM_SEQS` is the most requests at once that keep the
/// latency target (vLLM's `--max-num-seqs`): more would make every user's
/// tokens slower than planned. It is unset when not even one request meets
/// the target. `TESSERA_MAX_MODEL_LEN` is the request length the KV cache
/// was sized for (`inputTokens + outputTokens`). `TESSERA_GPU_MEMORY_FRACTION`
/// is the share of a whole GPU's memory the runtime was planned to take (its
/// default, vLLM's 0.9); on a memory share the DRA driver sets it to the
/// share's fraction instead, so it is left out here.
pub(crate) fn runtime_env(
    plan: &[PlannedShard],
    master_address: String,
    planned: &Planned,
) -> Vec<(&'static str, String)> {
    let mut stages: Vec<&PlannedShard> = plan.iter().collect();
    stages.sort_by_key(|s| s.shard);
    let mut env = vec![
        (NAMES[0], master_address),
        (NAMES[1], MASTER_PORT.to_string()),
        (NAMES[2], stages.len().to_string()),
    ];
    let tensor = stages.first().map(|s| s.devices.len());
    if stages.iter().all(|s| Some(s.devices.len()) == tensor) {
        let layers: Vec<String> = stages
            .iter()
            .map(|s| s.layer_end.saturating_sub(s.layer_start).to_string())
            .collect();
        env.push((NAMES[3], layers.join(",")));
    }
    if let Some(capacity) = planned.capacity.filter(|c| c.concurrency > 0) {
        env.push((NAMES[4], capacity.concurrency.to_string()));
    }
    let served = Served::of(planned.spec);
    env.push((NAMES[5], workload_of(&served).sequence_tokens().to_string()));
    if stages.iter().all(|s| s.share.is_none()) {
        let runtime = runtime_of(&served, false);
        let tensor = tensor.unwrap_or(1) as u32;
        env.push((NAMES[6], format!("{}", runtime.memory_utilization(tensor))));
    }
    env
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec() -> ModelInstanceSpec {
        serde_saphyr::from_str("model: {name: m, parametersBillions: 70, layers: 80}\nserving: {inputTokens: 2000, outputTokens: 500}\n")
            .unwrap()
    }

    fn planned<'a>(
        spec: &'a ModelInstanceSpec,
        capacity: Option<&'a ReplicaCapacity>,
    ) -> Planned<'a> {
        Planned { spec, capacity }
    }

    fn stage(shard: u32, gpus: usize, layers: (u32, u32)) -> PlannedShard {
        PlannedShard {
            copy: 0,
            replica: 0,
            shard,
            node: format!("n{shard}"),
            devices: (0..gpus).map(|g| format!("n{shard}-g{g}")).collect(),
            layer_start: layers.0,
            layer_end: layers.1,
            predicted_memory_gib: 10.0,
            share: None,
        }
    }

    #[test]
    fn the_split_is_listed_in_stage_order() {
        // Given out of order: the partition follows the shard index.
        let plan = [stage(1, 2, (44, 80)), stage(0, 2, (0, 44))];
        let spec = spec();
        let capacity = ReplicaCapacity {
            concurrency: 96,
            requests_per_second: 3.0,
            output_tokens_per_second: 1500.0,
            tpot_ms: 48.0,
            ttft_ms: 900.0,
            target_missed: None,
            correction: None,
        };
        let env = runtime_env(
            &plan,
            "m-shard-0.m.ml.svc".into(),
            &planned(&spec, Some(&capacity)),
        );
        assert_eq!(
            env,
            [
                ("TESSERA_MASTER_ADDR", "m-shard-0.m.ml.svc".to_string()),
                ("TESSERA_MASTER_PORT", "29501".to_string()),
                ("TESSERA_PIPELINE_PARALLEL", "2".to_string()),
                ("VLLM_PP_LAYER_PARTITION", "44,36".to_string()),
                ("TESSERA_MAX_NUM_SEQS", "96".to_string()),
                ("TESSERA_MAX_MODEL_LEN", "2500".to_string()),
                ("TESSERA_GPU_MEMORY_FRACTION", "0.9".to_string()),
            ]
        );
        let names: Vec<&str> = env.iter().map(|(name, _)| *name).collect();
        assert_eq!(names, NAMES);
    }

    #[test]
    fn stages_of_different_tensor_sizes_get_no_partition() {
        let plan = [stage(0, 4, (0, 50)), stage(1, 2, (50, 80))];
        let spec = spec();
        let env = runtime_env(&plan, "a".into(), &planned(&spec, None));
        assert!(
            env.iter()
                .all(|(name, _)| *name != "VLLM_PP_LAYER_PARTITION"),
            "{env:?}"
        );
        assert!(env.contains(&("TESSERA_PIPELINE_PARALLEL", "2".to_string())));
    }

    #[test]
    fn one_stage_is_a_partition_of_one() {
        let spec = spec();
        let env = runtime_env(&[stage(0, 8, (0, 80))], "a".into(), &planned(&spec, None));
        assert!(env.contains(&("VLLM_PP_LAYER_PARTITION", "80".to_string())));
        assert!(env.contains(&("TESSERA_PIPELINE_PARALLEL", "1".to_string())));
    }

    #[test]
    fn a_target_no_load_meets_sets_no_batch_and_a_share_no_fraction() {
        let spec = spec();
        let missed = ReplicaCapacity {
            concurrency: 0,
            requests_per_second: 0.0,
            output_tokens_per_second: 0.0,
            tpot_ms: 80.0,
            ttft_ms: 900.0,
            target_missed: Some("at best 80 ms per token".into()),
            correction: None,
        };
        let mut shared = stage(0, 1, (0, 80));
        shared.share = Some(tessera_core::api::ShardShare {
            kind: tessera_core::api::ShareKind::Memory,
            gpu: "g".into(),
            profile: None,
            memory_gib: Some(40),
            memory_fraction: Some(0.5),
            tenants: 0,
            contended_tokens_per_second: None,
        });
        let env = runtime_env(&[shared], "a".into(), &planned(&spec, Some(&missed)));
        let names: Vec<&str> = env.iter().map(|(name, _)| *name).collect();
        assert!(!names.contains(&"TESSERA_MAX_NUM_SEQS"), "{env:?}");
        assert!(!names.contains(&"TESSERA_GPU_MEMORY_FRACTION"), "{env:?}");
        assert!(names.contains(&"TESSERA_MAX_MODEL_LEN"));
    }
}
