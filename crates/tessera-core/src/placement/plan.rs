//! What the solver answers: a plan (or the reason there is none).

use serde::{Deserialize, Serialize};

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Plan {
    /// Stages in pipeline order; shard `i` is `stages[i]`.
    pub stages: Vec<StagePlan>,
    pub score: Score,
    /// True when the search finished: no plan for this problem scores higher.
    /// False when the step budget or the deadline stopped it first.
    pub optimal: bool,
    /// Search steps spent (candidate groups tried).
    pub steps: u64,
    pub performance: Performance,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct StagePlan {
    pub node: String,
    pub devices: Vec<String>,
    pub device_indices: Vec<u32>,
    /// Layers `layer_start..layer_end` run on this stage.
    pub layer_start: u32,
    pub layer_end: u32,
    /// Predicted memory on each device of the stage.
    pub memory_per_device_bytes: f64,
    pub parts: StageParts,
    /// Set when the stage was given part of a GPU (one device).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub share: Option<StageShare>,
}

/// The part of a GPU a stage was given.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum StageShare {
    /// MIG partition `profile` of GPU `gpu`.
    Partition { gpu: String, profile: String },
    /// `bytes` of GPU memory (whole GiB), `fraction` of the GPU's, beside
    /// `tenants` shares other shards hold.
    Memory {
        bytes: u64,
        fraction: f64,
        tenants: u32,
    },
}

impl StagePlan {
    pub fn layers(&self) -> u32 {
        self.layer_end - self.layer_start
    }
}

/// One stage's share of the score parts, each in 0..=1 (higher is better).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct StageParts {
    pub compute: f64,
    /// Free memory left on the tightest device of the stage, as a fraction.
    pub memory: f64,
    pub thermal: f64,
    pub bandwidth: f64,
    /// Cost of the hop to the next stage (0 = same node over NVLink/xGMI, 1 = across zones).
    pub next_hop_cost: f64,
    /// How well the stage's devices share the cluster under the strategy:
    /// the mean of its devices' values (0 under the score-only baseline).
    pub sharing: f64,
}

/// The objective. Every part is in 0..=1; `total` is their weighted sum: the
/// five user weights normalised to add up to `1 - w` and `sharing` weighted `w`,
/// a fixed share under `Strategy::Pack` and `Strategy::Spread` (see the
/// placement docs) and 0 under the score-only baseline.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Score {
    pub total: f64,
    pub compute: f64,
    pub memory: f64,
    pub network: f64,
    pub thermal: f64,
    pub bandwidth: f64,
    /// How well the plan shares the cluster: under `Pack` it leaves large
    /// devices, whole nodes and whole NVLink/xGMI domains free; under
    /// `Spread` it keeps away from the instance's other replicas.
    pub sharing: f64,
}

/// Predicted single-stream decode speed of a plan.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Performance {
    pub tokens_per_second: f64,
    /// For a plan on memory shares: the speed with every tenant of each
    /// shared GPU decoding at once (compute and bandwidth split between
    /// them). What `minTokensPerSecond` is judged on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub contended_tokens_per_second: Option<f64>,
    /// Time each stage spends on one token, in milliseconds.
    pub stage_ms: Vec<f64>,
    /// Time each hop to the next stage spends on one token's activations.
    pub transfer_ms: Vec<f64>,
    /// Where a token's time goes, summed over the stages and hops.
    pub token_time: TokenTime,
    /// FP8 or FP4 weights on a GPU product without a rate for that format:
    /// the format they run in there instead, once per product.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub widened: Vec<String>,
}

/// The parts of one token's time through the whole plan, in milliseconds;
/// they add up to `1000 / tokens_per_second`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct TokenTime {
    /// Reading the weights, in the layers where that is slower than the compute.
    pub weights_ms: f64,
    /// Computing, in the layers where that is slower than reading the weights.
    pub compute_ms: f64,
    /// What every layer pays whatever the tensor size: kernel launches, small
    /// kernels, synchronisation.
    pub layer_overhead_ms: f64,
    /// Tensor groups' all-reduces (two per layer).
    pub all_reduce_ms: f64,
    /// Activations handed from one stage to the next.
    pub hops_ms: f64,
}

impl Performance {
    /// The speed a plan can count on: contended where GPUs are shared.
    pub fn assured_tokens_per_second(&self) -> f64 {
        self.contended_tokens_per_second
            .unwrap_or(self.tokens_per_second)
    }
}

impl TokenTime {
    pub fn total_ms(&self) -> f64 {
        self.weights_ms
            + self.compute_ms
            + self.layer_overhead_ms
            + self.all_reduce_ms
            + self.hops_ms
    }
}

/// No plan exists. `reason` is one sentence a person can act on; `details` list
/// what excluded the rest.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, thiserror::Error)]
#[error("{reason}")]
pub struct Unsatisfiable {
    pub reason: String,
    pub details: Vec<String>,
}
