//! `spec.serving`: what an instance is served with and for. The runtime, the
//! typical request and the latency every user must get decide how many
//! requests a replica serves at once (the serving model, `crate::serving`),
//! and the demand says how many replicas that takes.

// kube-derive's `KubeSchema` copies each struct into a private module of its own
// to build the schema; the lint would flag those copies, not our items.
#![allow(unreachable_pub)]

use kube::KubeSchema;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::RuntimeVersion;
use super::limits::{
    DEMAND_REPLICAS, REQUESTS_PER_SECOND, RUNNING_REQUESTS, SERVING_TOKENS,
    TIME_PER_OUTPUT_TOKEN_MS, TIME_TO_FIRST_TOKEN_MS,
};

/// The engine a replica's shards run. Its defaults (how much GPU memory it
/// takes, how many sequences it batches at most, what its KV cache is stored
/// in, how fast its kernels run) shape the predicted capacity.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "kebab-case")]
pub enum Runtime {
    /// vLLM (PagedAttention, continuous batching).
    #[default]
    Vllm,
    /// SGLang (RadixAttention, continuous batching).
    Sglang,
    /// TensorRT-LLM (compiled engines, in-flight batching).
    TensorrtLlm,
    /// Any other runtime: vLLM's memory rules and batch cap, and the lower of
    /// the calibrated compute efficiencies, so an unknown runtime is never
    /// promised more than the known ones deliver.
    Generic,
}

impl Runtime {
    /// The name `spec.serving.runtime` takes.
    pub fn as_str(self) -> &'static str {
        match self {
            Runtime::Vllm => "vllm",
            Runtime::Sglang => "sglang",
            Runtime::TensorrtLlm => "tensorrt-llm",
            Runtime::Generic => "generic",
        }
    }
}

/// What the KV cache is stored in (vLLM's `--kv-cache-dtype`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum KvCacheDtype {
    /// The runtime's default: 16-bit, or FP8 under TensorRT-LLM for FP8 weights.
    #[default]
    Auto,
    /// Two bytes per element.
    Fp16,
    /// Two bytes per element.
    Bf16,
    /// One byte per element.
    Fp8,
}

/// Where the demand an instance is sized for comes from.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum DemandSource {
    /// `requestsPerSecond` as written (none when unset).
    #[default]
    Stated,
    /// What the replicas' runtimes are measured serving, with the requests
    /// they queue: the controller sets the replica count from it, between
    /// `minReplicas` and `maxReplicas`, as long as `spec.replicas` is unset.
    Measured,
}

impl DemandSource {
    fn is_stated(&self) -> bool {
        *self == DemandSource::Stated
    }
}

/// What the instance is served with, the typical request, the latency every
/// user must get and, optionally, the demand.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = kube::core::Rule::new("self.maxTimeToFirstTokenMs >= self.maxTimePerOutputTokenMs").message("serving.maxTimeToFirstTokenMs cannot be below maxTimePerOutputTokenMs: the first token takes at least one decode step"))]
#[x_kube(validation = kube::core::Rule::new("!has(self.replicasFromDemand) || !self.replicasFromDemand || has(self.requestsPerSecond)").message(REPLICAS_FROM_DEMAND_MESSAGE))]
#[x_kube(validation = kube::core::Rule::new(MEASURED_RULE).message(MEASURED_MESSAGE))]
#[x_kube(validation = kube::core::Rule::new("!has(self.minReplicas) || !has(self.maxReplicas) || self.minReplicas <= self.maxReplicas").message("serving.minReplicas cannot exceed serving.maxReplicas"))]
#[x_kube(validation = kube::core::Rule::new("!has(self.runtimeVersion) || self.runtimeVersion.matches('^v?[0-9]+[.][0-9]+([.][0-9]+)?([-+.a-zA-Z].*)?$')").message("serving.runtimeVersion must be a release number, major.minor or major.minor.patch (e.g. 0.10.1)"))]
pub struct ServingSpec {
    /// The engine the shards run: `vllm` (default), `sglang`, `tensorrt-llm`
    /// or `generic`.
    #[serde(default)]
    pub runtime: Runtime,
    /// The runtime's release the shards run, as its images are tagged
    /// (`0.10.1`, `v0.20.0`; a suffix such as `.post1` or `rc1` is not
    /// compared; quote a two-part one, "0.10", so YAML keeps it a string).
    /// The predicted capacity uses its release's defaults: vLLM 0.8 and
    /// later batch up to 1024 requests in steps of 8192 tokens on GPUs of
    /// 70 GiB or more other than the A100, earlier releases 256 in steps of
    /// 2048; TensorRT-LLM before 0.8 (no XQA kernel) reads a grouped-query
    /// model's KV cache once per query head. Unset: the release the examples
    /// run, vLLM 0.20 (TensorRT-LLM: a current one).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub runtime_version: Option<String>,
    /// The most requests a replica's runtime decodes at once, as it is
    /// started with (vLLM --max-num-seqs, SGLang --max-running-requests,
    /// TensorRT-LLM --max_batch_size), 1 to 65536. Unset: the release's
    /// default (see runtimeVersion).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = RUNNING_REQUESTS.min, max = RUNNING_REQUESTS.max))]
    pub max_running_requests: Option<u32>,
    /// Prompt tokens of a typical request (default 1024).
    #[serde(default = "default_input_tokens")]
    #[schemars(range(min = SERVING_TOKENS.min, max = SERVING_TOKENS.max))]
    pub input_tokens: u32,
    /// Output tokens of a typical request (default 256).
    #[serde(default = "default_output_tokens")]
    #[schemars(range(min = SERVING_TOKENS.min, max = SERVING_TOKENS.max))]
    pub output_tokens: u32,
    /// The longest time between two output tokens a user may see, in ms
    /// (default 50): a replica takes only as many requests at once as keep
    /// every one of them this fast.
    #[serde(default = "default_time_per_output_token_ms")]
    #[schemars(range(min = TIME_PER_OUTPUT_TOKEN_MS.min, max = TIME_PER_OUTPUT_TOKEN_MS.max))]
    pub max_time_per_output_token_ms: f64,
    /// The longest time to a request's first token, in ms (default 2000).
    #[serde(default = "default_time_to_first_token_ms")]
    #[schemars(range(min = TIME_TO_FIRST_TOKEN_MS.min, max = TIME_TO_FIRST_TOKEN_MS.max))]
    pub max_time_to_first_token_ms: f64,
    /// The requests per second the instance must serve, spread evenly over
    /// its replicas. Unset: no demand is judged.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = REQUESTS_PER_SECOND.min, max = REQUESTS_PER_SECOND.max))]
    pub requests_per_second: Option<f64>,
    /// Plan as many replicas as requestsPerSecond needs at the latency
    /// target (at most 64) instead of spec.replicas, which is then not read
    /// (nor what kubectl scale or an HPA write to it). Needs
    /// requestsPerSecond. Default false.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub replicas_from_demand: bool,
    /// Where the demand comes from: `Stated` (default, requestsPerSecond)
    /// or `Measured`: the requests/s the replicas are measured serving (and
    /// queueing), with headroom, sets the replica count between minReplicas
    /// and maxReplicas; scaled up at once, down only after a stable window,
    /// a replica taken out of its Services and drained before its pods go.
    /// requestsPerSecond is then the demand planned for before anything is
    /// measured. Off while spec.replicas is set (kubectl scale, an HPA): the
    /// status says so.
    #[serde(default, skip_serializing_if = "DemandSource::is_stated")]
    pub demand: DemandSource,
    /// With demand Measured: the fewest replicas, 1 to 64 (default 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = DEMAND_REPLICAS.min, max = DEMAND_REPLICAS.max))]
    pub min_replicas: Option<u32>,
    /// With demand Measured (and then required): the most replicas, 1 to 64.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = DEMAND_REPLICAS.min, max = DEMAND_REPLICAS.max))]
    pub max_replicas: Option<u32>,
}

impl Default for ServingSpec {
    fn default() -> Self {
        Self {
            runtime: Runtime::default(),
            runtime_version: None,
            max_running_requests: None,
            input_tokens: default_input_tokens(),
            output_tokens: default_output_tokens(),
            max_time_per_output_token_ms: default_time_per_output_token_ms(),
            max_time_to_first_token_ms: default_time_to_first_token_ms(),
            requests_per_second: None,
            replicas_from_demand: false,
            demand: DemandSource::Stated,
            min_replicas: None,
            max_replicas: None,
        }
    }
}

/// A measured demand needs its bounds, and bounds need a measured demand;
/// replicasFromDemand is for a stated one.
const MEASURED_RULE: &str = "has(self.demand) && self.demand == 'Measured' ? has(self.maxReplicas) && (!has(self.replicasFromDemand) || !self.replicasFromDemand) : !has(self.minReplicas) && !has(self.maxReplicas)";
const MEASURED_MESSAGE: &str = "serving.demand: Measured needs serving.maxReplicas (and takes minReplicas, default 1; replicasFromDemand is for a stated demand), and minReplicas and maxReplicas bound a Measured demand only";

/// Why `replicasFromDemand` without a demand is refused.
const REPLICAS_FROM_DEMAND_MESSAGE: &str =
    "serving.replicasFromDemand needs serving.requestsPerSecond: the demand sets the replica count";

impl ServingSpec {
    /// `runtimeVersion` read; `None` where unset.
    pub fn version(&self) -> Result<Option<RuntimeVersion>, super::InvalidRuntimeVersion> {
        self.runtime_version.as_deref().map(str::parse).transpose()
    }

    /// Records every field outside its limits, and a first-token target
    /// below the per-token one, under `serving.`.
    pub(crate) fn check(&self, problems: &mut Vec<String>) {
        if let Err(error) = self.version() {
            problems.push(format!("serving.runtimeVersion: {error}"));
        }
        if self.replicas_from_demand
            && self.requests_per_second.is_none()
            && self.demand == DemandSource::Stated
        {
            problems.push(REPLICAS_FROM_DEMAND_MESSAGE.to_string());
        }
        self.check_measured(problems);
        if let Some(running) = self.max_running_requests {
            RUNNING_REQUESTS.check("serving.maxRunningRequests", running, problems);
        }
        SERVING_TOKENS.check("serving.inputTokens", self.input_tokens, problems);
        SERVING_TOKENS.check("serving.outputTokens", self.output_tokens, problems);
        let before = problems.len();
        TIME_PER_OUTPUT_TOKEN_MS.check(
            "serving.maxTimePerOutputTokenMs",
            self.max_time_per_output_token_ms,
            problems,
        );
        TIME_TO_FIRST_TOKEN_MS.check(
            "serving.maxTimeToFirstTokenMs",
            self.max_time_to_first_token_ms,
            problems,
        );
        if problems.len() == before
            && self.max_time_to_first_token_ms < self.max_time_per_output_token_ms
        {
            problems.push(format!(
                "serving.maxTimeToFirstTokenMs: {} is below maxTimePerOutputTokenMs {}; the first token takes at least one decode step",
                self.max_time_to_first_token_ms, self.max_time_per_output_token_ms
            ));
        }
        if let Some(rate) = self.requests_per_second {
            REQUESTS_PER_SECOND.check("serving.requestsPerSecond", rate, problems);
        }
    }
}

impl ServingSpec {
    /// With a measured demand, the fewest and the most replicas.
    pub fn measured_bounds(&self) -> Option<(u32, u32)> {
        (self.demand == DemandSource::Measured).then(|| {
            let most = self.max_replicas.unwrap_or(DEMAND_REPLICAS.max);
            (self.min_replicas.unwrap_or(1).min(most), most)
        })
    }

    fn check_measured(&self, problems: &mut Vec<String>) {
        let measured = self.demand == DemandSource::Measured;
        let bounds = self.min_replicas.is_some() || self.max_replicas.is_some();
        if (measured && (self.max_replicas.is_none() || self.replicas_from_demand))
            || (!measured && bounds)
        {
            problems.push(MEASURED_MESSAGE.to_string());
        }
        for (field, value) in [
            ("serving.minReplicas", self.min_replicas),
            ("serving.maxReplicas", self.max_replicas),
        ] {
            if let Some(value) = value {
                DEMAND_REPLICAS.check(field, value, problems);
            }
        }
        if let (Some(least), Some(most)) = (self.min_replicas, self.max_replicas)
            && least > most
        {
            problems.push(format!(
                "serving.minReplicas {least} cannot exceed serving.maxReplicas {most}"
            ));
        }
    }
}

fn default_input_tokens() -> u32 {
    1024
}

fn default_output_tokens() -> u32 {
    256
}

fn default_time_per_output_token_ms() -> f64 {
    50.0
}

fn default_time_to_first_token_ms() -> f64 {
    2000.0
}
