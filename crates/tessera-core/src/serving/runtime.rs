//! The serving runtimes and the few constants that differ between them: how
//! much of a GPU's memory each may use, how many sequences it batches at
//! most, what its KV cache is stored in, how large a prompt chunk it
//! prefills per step, and what share of the datasheet compute its kernels
//! reach.
//!
//! Defaults are the runtimes' own documented defaults (each cited where it
//! is used); the compute efficiency is the one calibrated number per runtime
//! (docs/serving-model.md, "Constants").

use serde::{Deserialize, Serialize};

use crate::api::DType;
pub use crate::api::{KvCacheDtype, Runtime};

/// How a replica's runtime is configured: its kind, and the flags a user may
/// have set instead of its defaults.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RuntimeConfig {
    pub runtime: Runtime,
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
    /// Share of the datasheet compute (FP16, or FP8 as
    /// `placement::precision::NARROW_PEAK_SHARE` says) that batched GEMMs, prefill
    /// included, reach under this runtime. Calibrated:
    ///
    /// - TensorRT-LLM 0.72: its 0.17 offline figures of Llama-3.1-8B in FP16
    ///   on A100 (compute-bound at 128/128: 6,627 tokens/s is 68% of peak in
    ///   GEMM FLOPs alone) land within 9% with it.
    /// - vLLM and SGLang 0.40: their ShareGPT offline figures (vLLM 0.6.0,
    ///   SGLang 0.3.0; 8B on A100, 70B on 4 H100) reach 28-45% of peak in GEMM
    ///   FLOPs; PyTorch model code with separate norm, rotary and activation
    ///   kernels, and CPU scheduling between steps, reach less than an engine
    ///   compiled with fused kernels. 0.40 puts both runtimes' four offline
    ///   figures within 19%.
    /// - Generic: the lower figure, 0.40.
    pub(super) fn compute_efficiency(self) -> f64 {
        match self {
            Runtime::TensorrtLlm => 0.72,
            Runtime::Vllm | Runtime::Sglang | Runtime::Generic => 0.40,
        }
    }

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

    /// The most sequences the runtime batches unless told otherwise.
    ///
    /// - vLLM: `max_num_seqs` 256 (the engine's default for the OpenAI
    ///   server and the offline `LLM` class; recent versions raise it to 1024
    ///   on GPUs of 70 GiB or more other than A100, which a caller passes as
    ///   `max_num_seqs`).
    /// - SGLang: its request pool, at least 2048 (`max_running_requests` is
    ///   half the KV tokens, capped by a pool of 2048 to 4096 requests).
    /// - TensorRT-LLM: `max_batch_size` 2048, its engine build default
    ///   (`trtllm-bench` sizes it from the KV cache and caps it at 4096).
    /// - Generic: vLLM's 256.
    pub(super) fn default_max_num_seqs(self) -> u32 {
        match self {
            Runtime::Vllm | Runtime::Generic => 256,
            Runtime::Sglang | Runtime::TensorrtLlm => 2048,
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

    /// Prompt tokens prefilled per step when a prompt is chunked between
    /// decode steps (what the time to first token counts in chunks):
    /// vLLM's `max_num_batched_tokens` 2048 for its OpenAI server on GPUs
    /// under 70 GiB (8192 above), SGLang's `chunked_prefill_size` 8192 on
    /// GPUs of 25 GB or more, TensorRT-LLM's `max_num_tokens` 8192. Generic:
    /// 2048, the smaller chunk (more steps to the first token).
    pub(super) fn prefill_chunk_tokens(self) -> f64 {
        match self {
            Runtime::Vllm | Runtime::Generic => 2048.0,
            Runtime::Sglang | Runtime::TensorrtLlm => 8192.0,
        }
    }
}

impl RuntimeConfig {
    /// The share of memory the runtime takes with `tensor` GPUs per shard.
    pub fn memory_utilization(&self, tensor: u32) -> f64 {
        self.memory_utilization
            .unwrap_or_else(|| self.runtime.default_memory_utilization(tensor))
    }

    /// The most sequences the runtime batches.
    pub fn max_num_seqs(&self) -> u32 {
        self.max_num_seqs
            .unwrap_or_else(|| self.runtime.default_max_num_seqs())
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
        assert_eq!(default.max_num_seqs(), 256);
        let set = RuntimeConfig {
            memory_utilization: Some(0.95),
            max_num_seqs: Some(1024),
            kv_cache_dtype: KvCacheDtype::Fp8,
            ..default
        };
        assert_eq!(set.memory_utilization(4), 0.95);
        assert_eq!(set.max_num_seqs(), 1024);
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
    fn the_generic_runtime_is_promised_no_more_than_the_known_ones() {
        for runtime in [Runtime::Vllm, Runtime::Sglang, Runtime::TensorrtLlm] {
            assert!(Runtime::Generic.compute_efficiency() <= runtime.compute_efficiency());
            assert!(Runtime::Generic.default_max_num_seqs() <= runtime.default_max_num_seqs());
        }
    }
}
