//! Which metric each serving runtime exports for each quantity tessera reads.
//! Where a runtime renamed one across releases, every name is listed, the
//! newest first; the first present in an exposition is read.

use crate::api::Runtime;

/// The metric names one runtime exports (counters with their `_total`
/// suffix, as they appear in the exposition).
#[derive(Debug)]
pub(crate) struct RuntimeNames {
    /// Counter: requests finished.
    pub(crate) finished: &'static [&'static str],
    /// Counter: output tokens generated.
    pub(crate) generated: &'static [&'static str],
    /// Gauge: requests decoding.
    pub(crate) running: &'static [&'static str],
    /// Gauge: requests queued.
    pub(crate) waiting: &'static [&'static str],
    /// Gauge: share of the KV cache in use, 0 to 1.
    pub(crate) kv_usage: &'static [&'static str],
    /// Counter: requests preempted.
    pub(crate) preemptions: &'static [&'static str],
    /// Histogram (seconds): time to the first token.
    pub(crate) ttft: &'static [&'static str],
    /// Histogram (seconds): time between output tokens.
    pub(crate) tpot: &'static [&'static str],
}

const VLLM: RuntimeNames = RuntimeNames {
    finished: &["vllm:request_success_total"],
    generated: &["vllm:generation_tokens_total"],
    running: &["vllm:num_requests_running"],
    waiting: &["vllm:num_requests_waiting"],
    // `gpu_cache_usage_perc` before vLLM 0.10.
    kv_usage: &["vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"],
    preemptions: &["vllm:num_preemptions_total"],
    ttft: &["vllm:time_to_first_token_seconds"],
    // `time_per_output_token_seconds` before vLLM 0.11.
    tpot: &[
        "vllm:inter_token_latency_seconds",
        "vllm:time_per_output_token_seconds",
    ],
};

const SGLANG: RuntimeNames = RuntimeNames {
    finished: &["sglang:num_requests_total"],
    generated: &["sglang:generation_tokens_total"],
    running: &["sglang:num_running_reqs"],
    waiting: &["sglang:num_queue_reqs"],
    kv_usage: &["sglang:token_usage"],
    // SGLang retracts rather than preempts, and exports no counter of it.
    preemptions: &[],
    ttft: &["sglang:time_to_first_token_seconds"],
    tpot: &[
        "sglang:inter_token_latency_seconds",
        "sglang:time_per_output_token_seconds",
    ],
};

const TENSORRT_LLM: RuntimeNames = RuntimeNames {
    finished: &["trtllm_request_success_total"],
    generated: &["trtllm_generation_tokens_total"],
    running: &["trtllm_num_requests_running"],
    waiting: &["trtllm_num_requests_waiting"],
    kv_usage: &["trtllm_kv_cache_utilization"],
    preemptions: &[],
    ttft: &["trtllm_time_to_first_token_seconds"],
    tpot: &["trtllm_time_per_output_token_seconds"],
};

/// The names to look for behind `runtime`, in order: its own, or for a
/// runtime tessera does not know every known one's (the first whose
/// counters are present wins).
pub(crate) fn names(runtime: Runtime) -> &'static [RuntimeNames] {
    match runtime {
        Runtime::Vllm => std::slice::from_ref(&VLLM),
        Runtime::Sglang => std::slice::from_ref(&SGLANG),
        Runtime::TensorrtLlm => std::slice::from_ref(&TENSORRT_LLM),
        Runtime::Generic => &[VLLM, SGLANG, TENSORRT_LLM],
    }
}
