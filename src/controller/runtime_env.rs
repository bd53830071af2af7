//! What a multi-node serving runtime needs to start a replica's ranks, beyond
//! each shard's own environment: where rank 0 listens, how many stages there
//! are, and the layer split tessera planned in the form vLLM reads it. Pure;
//! `desired` adds it to every shard pod.

use tessera_core::api::PlannedShard;

/// The port rank 0 listens on for the others (`TESSERA_MASTER_PORT`): vLLM's
/// own default for `--master-port`. Every shard is a pod with its own IP, so
/// one fixed port never collides.
pub(crate) const MASTER_PORT: u16 = 29501;

/// The variables this module sets. They are left out of a pod's hash
/// (`hashes::pod_hash`): shard pods made before they existed stay as they
/// are, and their values follow from what the hash covers (the instance, the
/// replica, its shard count) but for the other shards' layer counts, whose
/// change changes those shards' pods.
pub(crate) const NAMES: [&str; 4] = [
    "TESSERA_MASTER_ADDR",
    "TESSERA_MASTER_PORT",
    "TESSERA_PIPELINE_PARALLEL",
    "VLLM_PP_LAYER_PARTITION",
];

/// The runtime environment of every pod of a replica whose shards are
/// `plan` and whose shard 0 is reached at `master_address`.
///
/// `VLLM_PP_LAYER_PARTITION` is set only when every stage has the same
/// number of GPUs: vLLM runs one tensor size on all ranks, so a replica whose
/// stages differ cannot be started by it, and the missing variable lets a
/// start script say so instead of vLLM failing on a mismatch.
pub(crate) fn runtime_env(
    plan: &[PlannedShard],
    master_address: String,
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
    env
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stage(shard: u32, gpus: usize, layers: (u32, u32)) -> PlannedShard {
        PlannedShard {
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
        let env = runtime_env(&plan, "m-shard-0.m.ml.svc".into());
        assert_eq!(
            env,
            [
                ("TESSERA_MASTER_ADDR", "m-shard-0.m.ml.svc".to_string()),
                ("TESSERA_MASTER_PORT", "29501".to_string()),
                ("TESSERA_PIPELINE_PARALLEL", "2".to_string()),
                ("VLLM_PP_LAYER_PARTITION", "44,36".to_string()),
            ]
        );
        let names: Vec<&str> = env.iter().map(|(name, _)| *name).collect();
        assert_eq!(names, NAMES);
    }

    #[test]
    fn stages_of_different_tensor_sizes_get_no_partition() {
        let plan = [stage(0, 4, (0, 50)), stage(1, 2, (50, 80))];
        let env = runtime_env(&plan, "a".into());
        assert!(
            env.iter()
                .all(|(name, _)| *name != "VLLM_PP_LAYER_PARTITION"),
            "{env:?}"
        );
        assert!(env.contains(&("TESSERA_PIPELINE_PARALLEL", "2".to_string())));
    }

    #[test]
    fn one_stage_is_a_partition_of_one() {
        let env = runtime_env(&[stage(0, 8, (0, 80))], "a".into());
        assert!(env.contains(&("VLLM_PP_LAYER_PARTITION", "80".to_string())));
        assert!(env.contains(&("TESSERA_PIPELINE_PARALLEL", "1".to_string())));
    }
}
