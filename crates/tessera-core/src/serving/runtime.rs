//! The serving runtimes and the defaults that differ between them: how much
//! of a GPU's memory each may use, how many sequences it batches at most,
//! what its KV cache is stored in and how large a prompt chunk it prefills
//! per step. Each is the runtime's own documented default, cited where it is
//! used; what share of the datasheet compute a runtime's kernels reach is
//! fitted (`constants`).

use serde::{Deserialize, Serialize};

use super::{GpuFigures, ReplicaPlan};
use crate::api::{DType, GIB, ServingSpec};
pub use crate::api::{KvCacheDtype, Runtime, RuntimeVersion};

/// How a replica's runtime is configured: its kind, and the flags a user may
/// have set instead of its defaults.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RuntimeConfig {
    pub runtime: Runtime,
    /// The runtime's release; `None`: the release the examples run
    /// ([`RuntimeConfig::DEFAULT_VLLM`] for vLLM). Sets the
    /// [`VersionRange`] whose defaults apply.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub version: Option<RuntimeVersion>,
    /// vLLM `--gpu-memory-utilization`, SGLang `--mem-fraction-static`,
    /// TensorRT-LLM `kv_cache_free_gpu_mem_fraction` (a share of what is free
    /// after the weights, not of the whole device). `None`: the runtime's
    /// default.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_utilization: Option<f64>,
    /// vLLM `--max-num-seqs`, SGLang `--max-running-requests`, TensorRT-LLM
    /// `max_batch_size`. `None`: the runtime's default.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_num_seqs: Option<u32>,
    #[serde(default)]
    pub kv_cache_dtype: KvCacheDtype,
    /// What this runtime on these GPUs was measured to take against the
    /// model (`status.corrections`): every step time × this factor. `None`:
    /// the model as fitted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub correction: Option<f64>,
}

/// How a runtime turns its memory setting into room for the KV cache.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) enum MemoryRule {
    /// A share of each device's whole memory holds everything the runtime
    /// allocates; `activations_inside` says whether the activation and
    /// runtime overhead come out of that share too (vLLM) or out of the rest
    /// (SGLang's static share is weights plus KV pool only).
    ShareOfTotal { activations_inside: bool },
    /// A share of what is free once weights and activations are loaded
    /// (TensorRT-LLM).
    ShareOfFree,
}

impl Runtime {
    pub(super) fn memory_rule(self) -> MemoryRule {
        match self {
            Runtime::Vllm | Runtime::Generic => MemoryRule::ShareOfTotal {
                activations_inside: true,
            },
            Runtime::Sglang => MemoryRule::ShareOfTotal {
                activations_inside: false,
            },
            Runtime::TensorrtLlm => MemoryRule::ShareOfFree,
        }
    }

    /// The memory share the runtime uses unless told otherwise.
    ///
    /// - vLLM: `gpu_memory_utilization` 0.9, whatever the tensor size.
    /// - SGLang: `mem_fraction_static` by tensor size, 0.88 at 1, 0.87 at 2,
    ///   0.85 at 4, 0.81 at 8, 0.79 at 16 (its server arguments' defaults;
    ///   older versions used 0.83 at 8).
    /// - TensorRT-LLM: `free_gpu_memory_fraction` 0.9 of the memory free
    ///   after weights and buffers (its KV cache documentation; its published
    ///   throughput tables were measured at 0.95).
    /// - Generic: vLLM's 0.9.
    pub(super) fn default_memory_utilization(self, tensor: u32) -> f64 {
        match self {
            Runtime::Vllm | Runtime::Generic | Runtime::TensorrtLlm => 0.9,
            Runtime::Sglang => match tensor {
                16.. => 0.79,
                8.. => 0.81,
                4.. => 0.85,
                2.. => 0.87,
                _ => 0.88,
            },
        }
    }

    /// Bytes per KV element under [`KvCacheDtype::Auto`]. TensorRT-LLM
    /// stores the KV cache in FP8 when the weights are FP8-quantized (its
    /// performance documentation: "If you specify FP8 quantization, the KV
    /// cache will automatically be set to FP8 as well"); vLLM and SGLang keep
    /// it in the activations' 16-bit type unless told `--kv-cache-dtype fp8`.
    pub fn default_kv_bytes_per_element(self, weights: DType) -> f64 {
        match (self, weights) {
            (Runtime::TensorrtLlm, DType::Fp8) => 1.0,
            _ => 2.0,
        }
    }
}

/// vLLM's V1 engine is its default from this release on.
const VLLM_V1: RuntimeVersion = RuntimeVersion::new(0, 8, 0);

/// TensorRT-LLM's XQA kernel (grouped- and multi-query attention in the
/// generation phase) ships from this release on (its blog "New XQA-kernel
/// provides 2.4x more Llama-70B throughput within the same latency budget":
/// "will be included in the v0.8 releases").
const TENSORRT_LLM_XQA: RuntimeVersion = RuntimeVersion::new(0, 8, 0);

/// The runtimes' releases whose defaults differ.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum VersionRange {
    /// vLLM 0.8 and later: the V1 engine, whose batch defaults depend on the
    /// GPU.
    VllmV1,
    /// vLLM before 0.8: the V0 engine.
    VllmV0,
    /// SGLang, every release.
    Sglang,
    /// TensorRT-LLM 0.8 and later, and of no given release.
    TensorrtLlm,
    /// TensorRT-LLM before 0.8: its generation kernel reads a grouped-query
    /// model's KV cache once per query head.
    TensorrtLlmBeforeXqa,
    /// Any other runtime.
    Generic,
}

impl VersionRange {
    /// The range `runtime` falls in; a vLLM of no given release is taken to
    /// run [`RuntimeConfig::DEFAULT_VLLM`].
    pub fn of(runtime: &RuntimeConfig) -> VersionRange {
        match runtime.runtime {
            Runtime::Vllm if runtime.version.unwrap_or(RuntimeConfig::DEFAULT_VLLM) >= VLLM_V1 => {
                VersionRange::VllmV1
            }
            Runtime::Vllm => VersionRange::VllmV0,
            Runtime::Sglang => VersionRange::Sglang,
            Runtime::TensorrtLlm
                if runtime
                    .version
                    .is_some_and(|version| version < TENSORRT_LLM_XQA) =>
            {
                VersionRange::TensorrtLlmBeforeXqa
            }
            Runtime::TensorrtLlm => VersionRange::TensorrtLlm,
            Runtime::Generic => VersionRange::Generic,
        }
    }

    /// How a plan names the runtime it was predicted for.
    pub fn label(self) -> &'static str {
        match self {
            VersionRange::VllmV1 => "vllm >= 0.8",
            VersionRange::VllmV0 => "vllm < 0.8",
            VersionRange::Sglang => "sglang",
            VersionRange::TensorrtLlm => "tensorrt-llm >= 0.8",
            VersionRange::TensorrtLlmBeforeXqa => "tensorrt-llm < 0.8",
            VersionRange::Generic => "generic",
        }
    }

    /// The most sequences the runtime batches unless told otherwise, on
    /// GPUs that are all [`large`] or not.
    ///
    /// - vLLM 0.8 and later: `max_num_seqs` 1024 on large GPUs, 256 on the
    ///   others (`EngineArgs.get_batch_defaults`, the same for the OpenAI
    ///   server and the offline `LLM` class).
    /// - vLLM before 0.8: 256 (the V0 engine's default).
    /// - SGLang: its request pool, at least 2048 (`max_running_requests` is
    ///   half the KV tokens, capped by a pool of 2048 to 4096 requests).
    /// - TensorRT-LLM: `max_batch_size` 2048, its engine build default
    ///   (`trtllm-bench` sizes it from the KV cache and caps it at 4096).
    /// - Generic: 256, the smallest.
    pub(super) fn default_max_num_seqs(self, large: bool) -> u32 {
        match self {
            VersionRange::VllmV1 if large => 1024,
            VersionRange::VllmV1 | VersionRange::VllmV0 | VersionRange::Generic => 256,
            VersionRange::Sglang
            | VersionRange::TensorrtLlm
            | VersionRange::TensorrtLlmBeforeXqa => 2048,
        }
    }

    /// Prompt tokens prefilled per step when a prompt is chunked between
    /// decode steps (what the time to first token counts in chunks): vLLM's
    /// `max_num_batched_tokens` for its OpenAI server, 8192 on large GPUs
    /// from 0.8 and 2048 otherwise; SGLang's `chunked_prefill_size` 8192 on
    /// GPUs of 25 GB or more; TensorRT-LLM's `max_num_tokens` 8192. Generic:
    /// 2048, the smaller chunk (more steps to the first token).
    pub(super) fn prefill_chunk_tokens(self, large: bool) -> f64 {
        match self {
            VersionRange::VllmV1 if large => 8192.0,
            VersionRange::VllmV1 | VersionRange::VllmV0 | VersionRange::Generic => 2048.0,
            VersionRange::Sglang
            | VersionRange::TensorrtLlm
            | VersionRange::TensorrtLlmBeforeXqa => 8192.0,
        }
    }

    /// How many times a decode step reads each sequence's KV cache, for a
    /// model with `query_heads_per_kv_head`: once, but for TensorRT-LLM
    /// before 0.8, whose masked multi-head attention kernel loads the keys
    /// and values for every query head (the XQA kernel that replaced it
    /// loads each KV head once for its group: 1.9–2.4× the throughput of
    /// Llama-70B at 128/2048 in NVIDIA's blog).
    pub(super) fn kv_reads(self, query_heads_per_kv_head: f64) -> f64 {
        match self {
            VersionRange::TensorrtLlmBeforeXqa => query_heads_per_kv_head.max(1.0),
            _ => 1.0,
        }
    }
}

/// Whether vLLM gives a GPU its large batch defaults: 70 GiB or more, and not
/// an A100 (PR 17885 measured them slower there). vLLM tells an A100 by its
/// name; the figures here tell it by its lack of FP8, which every other GPU
/// of that size that vLLM's rule was written for has.
pub(super) fn large(gpu: &GpuFigures) -> bool {
    gpu.memory_bytes >= 70.0 * GIB && gpu.fp8_tflops.is_some()
}

/// Whether every GPU of a replica is [`large`]: one batch cap and one chunk
/// hold for the whole replica.
pub(super) fn all_large(plan: &ReplicaPlan) -> bool {
    plan.stages.iter().all(|stage| large(&stage.gpu))
}

impl RuntimeConfig {
    /// The vLLM release a replica is taken to run when none is given: the
    /// one the examples' images carry (`vllm/vllm-openai:v0.20.0`).
    pub const DEFAULT_VLLM: RuntimeVersion = RuntimeVersion::new(0, 20, 0);

    /// The runtime and release `spec.serving` names, every flag at its
    /// default. A release that does not read counts as unset: the spec's
    /// check refuses it before anything is planned.
    pub fn of_spec(serving: &ServingSpec) -> Self {
        Self {
            runtime: serving.runtime,
            version: serving.version().ok().flatten(),
            max_num_seqs: serving.max_running_requests,
            ..Self::default()
        }
    }

    /// The share of memory the runtime takes with `tensor` GPUs per shard.
    pub fn memory_utilization(&self, tensor: u32) -> f64 {
        self.memory_utilization
            .unwrap_or_else(|| self.runtime.default_memory_utilization(tensor))
    }

    /// The most sequences the runtime batches on GPUs that are all
    /// [`large`] or not.
    pub fn max_num_seqs(&self, large: bool) -> u32 {
        self.max_num_seqs
            .unwrap_or_else(|| VersionRange::of(self).default_max_num_seqs(large))
    }

    /// Prompt tokens prefilled per step on GPUs that are all [`large`] or
    /// not.
    pub(super) fn prefill_chunk_tokens(&self, large: bool) -> f64 {
        VersionRange::of(self).prefill_chunk_tokens(large)
    }

    /// Bytes of one KV cache element for `weights` of that dtype.
    pub fn kv_bytes_per_element(&self, weights: DType) -> f64 {
        match self.kv_cache_dtype {
            KvCacheDtype::Auto => self.runtime.default_kv_bytes_per_element(weights),
            KvCacheDtype::Fp16 | KvCacheDtype::Bf16 => 2.0,
            KvCacheDtype::Fp8 => 1.0,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runtimes_parse_by_their_names() {
        for (text, runtime) in [
            ("vllm", Runtime::Vllm),
            ("sglang", Runtime::Sglang),
            ("tensorrt-llm", Runtime::TensorrtLlm),
            ("generic", Runtime::Generic),
        ] {
            let parsed: Runtime = serde_json::from_value(serde_json::json!(text)).unwrap();
            assert_eq!(parsed, runtime);
            assert_eq!(runtime.as_str(), text);
        }
    }

    #[test]
    fn flags_override_the_defaults() {
        let default = RuntimeConfig {
            runtime: Runtime::Vllm,
            ..RuntimeConfig::default()
        };
        assert_eq!(default.memory_utilization(4), 0.9);
        assert_eq!(default.max_num_seqs(false), 256);
        assert_eq!(default.max_num_seqs(true), 1024);
        let set = RuntimeConfig {
            memory_utilization: Some(0.95),
            max_num_seqs: Some(1024),
            kv_cache_dtype: KvCacheDtype::Fp8,
            ..default
        };
        assert_eq!(set.memory_utilization(4), 0.95);
        assert_eq!(set.max_num_seqs(false), 1024);
        let fewer = RuntimeConfig {
            max_num_seqs: Some(64),
            ..default
        };
        assert_eq!(fewer.max_num_seqs(true), 64);
        assert_eq!(set.kv_bytes_per_element(DType::Bf16), 1.0);
    }

    #[test]
    fn sglang_leaves_more_room_for_activations_on_larger_groups() {
        let share = |tensor| Runtime::Sglang.default_memory_utilization(tensor);
        assert!(share(1) > share(2) && share(2) > share(4) && share(4) > share(8));
        assert!(share(8) > share(16));
    }

    #[test]
    fn only_tensorrt_llm_stores_fp8_models_kv_in_fp8_by_default() {
        assert_eq!(
            Runtime::TensorrtLlm.default_kv_bytes_per_element(DType::Fp8),
            1.0
        );
        assert_eq!(
            Runtime::TensorrtLlm.default_kv_bytes_per_element(DType::Fp16),
            2.0
        );
        assert_eq!(Runtime::Vllm.default_kv_bytes_per_element(DType::Fp8), 2.0);
    }

    #[test]
    fn the_generic_runtime_batches_no_more_than_the_known_ones() {
        for range in [
            VersionRange::VllmV1,
            VersionRange::VllmV0,
            VersionRange::Sglang,
            VersionRange::TensorrtLlm,
            VersionRange::TensorrtLlmBeforeXqa,
        ] {
            for large in [false, true] {
                assert!(
                    VersionRange::Generic.default_max_num_seqs(large)
                        <= range.default_max_num_seqs(large)
                );
                assert!(
                    VersionRange::Generic.prefill_chunk_tokens(large)
                        <= range.prefill_chunk_tokens(large)
                );
            }
        }
    }

    fn vllm(version: Option<&str>) -> RuntimeConfig {
        RuntimeConfig {
            runtime: Runtime::Vllm,
            version: version.map(|text| text.parse().expect("a version")),
            ..RuntimeConfig::default()
        }
    }

    #[test]
    fn vllm_from_0_8_and_of_no_given_release_runs_its_v1_engine() {
        for (version, range) in [
            (None, VersionRange::VllmV1),
            (Some("0.8.0"), VersionRange::VllmV1),
            (Some("v0.20.0"), VersionRange::VllmV1),
            (Some("0.7.3"), VersionRange::VllmV0),
            (Some("0.6.3.post1"), VersionRange::VllmV0),
        ] {
            assert_eq!(VersionRange::of(&vllm(version)), range, "{version:?}");
        }
        let sglang = RuntimeConfig {
            runtime: Runtime::Sglang,
            version: Some(RuntimeVersion::new(0, 9, 0)),
            ..RuntimeConfig::default()
        };
        assert_eq!(VersionRange::of(&sglang), VersionRange::Sglang);
    }

    #[test]
    fn tensorrt_llm_before_0_8_reads_grouped_kv_heads_once_per_query_head() {
        let tensorrt = |version: Option<RuntimeVersion>| RuntimeConfig {
            runtime: Runtime::TensorrtLlm,
            version,
            ..RuntimeConfig::default()
        };
        for (version, range, reads) in [
            (None, VersionRange::TensorrtLlm, 1.0),
            (
                Some(RuntimeVersion::new(0, 8, 0)),
                VersionRange::TensorrtLlm,
                1.0,
            ),
            (
                Some(RuntimeVersion::new(0, 17, 0)),
                VersionRange::TensorrtLlm,
                1.0,
            ),
            (
                Some(RuntimeVersion::new(0, 6, 1)),
                VersionRange::TensorrtLlmBeforeXqa,
                8.0,
            ),
        ] {
            let range_found = VersionRange::of(&tensorrt(version));
            assert_eq!(range_found, range, "{version:?}");
            assert_eq!(range_found.kv_reads(8.0), reads, "{version:?}");
        }
        // A model without grouped-query attention reads its cache once anyway.
        assert_eq!(VersionRange::TensorrtLlmBeforeXqa.kv_reads(1.0), 1.0);
        assert_eq!(VersionRange::of(&vllm(Some("0.6.0"))).kv_reads(8.0), 1.0);
    }

    #[test]
    fn vllm_v1_batches_more_and_in_larger_chunks_only_on_large_gpus() {
        let gpu = |memory_gib: f64, fp8: Option<f64>| GpuFigures {
            vendor: "nvidia".into(),
            fp16_tflops: 989.0,
            fp8_tflops: fp8,
            fp4_tflops: None,
            memory_bandwidth_gbps: 3350.0,
            memory_bytes: memory_gib * GIB,
        };
        let (h100, a100, l40s) = (
            gpu(79.6, Some(1979.0)),
            gpu(79.2, None),
            gpu(44.4, Some(733.0)),
        );
        assert!(large(&h100));
        assert!(!large(&a100) && !large(&l40s));
        assert_eq!(vllm(None).max_num_seqs(large(&h100)), 1024);
        assert_eq!(vllm(None).prefill_chunk_tokens(large(&h100)), 8192.0);
        assert_eq!(vllm(None).max_num_seqs(large(&a100)), 256);
        assert_eq!(vllm(None).prefill_chunk_tokens(large(&a100)), 2048.0);
        let v0 = vllm(Some("0.6.0"));
        assert_eq!(v0.max_num_seqs(large(&h100)), 256);
        assert_eq!(v0.prefill_chunk_tokens(large(&h100)), 2048.0);
    }
}
