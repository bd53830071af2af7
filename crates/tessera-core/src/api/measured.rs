//! What a running replica's serving runtime reports, read from its own
//! Prometheus endpoint over a window: the measured side of the status, shown
//! beside what the serving model predicted.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// A replica's (or the instance's) runtime measured over a window.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct MeasuredServing {
    /// The span the figures cover, seconds (the first to the last scrape of
    /// the window).
    pub window_seconds: f64,
    /// Requests finished per second over the window.
    pub requests_per_second: f64,
    /// Output tokens generated per second over the window.
    pub output_tokens_per_second: f64,
    /// Requests decoding, on average over the window's scrapes.
    pub running: f64,
    /// Requests queued for a batch slot, on average over the window's scrapes.
    pub waiting: f64,
    /// Share of the KV cache in use (0 to 1), on average; unset where the
    /// runtime does not report it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_cache_usage: Option<f64>,
    /// Requests preempted per second (their KV cache dropped and recomputed);
    /// unset where the runtime does not report it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub preemptions_per_second: Option<f64>,
    /// Time per output token (between tokens of a request), ms, from the
    /// runtime's histogram; unset when no token was generated in the window.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tpot_ms: Option<Percentiles>,
    /// Time to the first token, ms, from the runtime's histogram; unset when
    /// no request started in the window.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ttft_ms: Option<Percentiles>,
}

/// The median and the 90th percentile of a latency, interpolated within the
/// runtime's histogram buckets as Prometheus's `histogram_quantile` does.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Percentiles {
    /// The median.
    pub p50: f64,
    /// The 90th percentile.
    pub p90: f64,
}

/// What the serving model's predictions for one kind of replica were found
/// off by, learned from what its runtime was measured doing: the measured
/// time per output token ÷ the predicted one at the load measured, smoothed
/// over reads and bounded. Applied to every later prediction for replicas
/// of the same key (placement, sizing, moves), and said where it is.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ServingCorrection {
    /// The model's `model.name` when it was learned.
    pub model: String,
    /// `serving.runtime` when it was learned.
    pub runtime: super::Runtime,
    /// The GPU product the replica ran on (its first shard's).
    pub product: String,
    /// GPUs per shard.
    pub tensor: u32,
    /// Pipeline stages.
    pub stages: u32,
    /// Measured ÷ predicted time per output token: above 1, slower than
    /// predicted.
    pub factor: f64,
    /// Reads it was learned from.
    pub observations: u32,
    /// When the last read it learned from was taken.
    pub last_observed: k8s_openapi::apimachinery::pkg::apis::meta::v1::Time,
}

impl ServingCorrection {
    /// Records what makes the correction unusable: a factor outside
    /// `limits::CORRECTION`, no GPUs or stages, no product.
    pub fn check(&self, field: &str, problems: &mut Vec<String>) {
        super::limits::CORRECTION.check(&format!("{field}.factor"), self.factor, problems);
        if self.tensor == 0 || self.stages == 0 {
            problems.push(format!(
                "{field}: tensor {} and stages {} must be at least 1",
                self.tensor, self.stages
            ));
        }
        if self.product.is_empty() {
            problems.push(format!("{field}.product must not be empty"));
        }
    }

    /// Whether [`ServingCorrection::check`] finds nothing.
    pub fn usable(&self) -> bool {
        let mut problems = Vec::new();
        self.check("", &mut problems);
        problems.is_empty()
    }
}

/// The demand an instance with `serving.demand: Measured` is sized for, and
/// where the scaling rule stands (`tessera_core::measure::demand`); kept in
/// the status so a restarted controller goes on where it was.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct MeasuredDemand {
    /// Requests/s the replicas are planned for: the measured demand with
    /// headroom, raised as soon as a read asks for more, lowered only after
    /// every read of a stable window asked for less.
    pub planned_requests_per_second: f64,
    /// The demand last measured, without headroom: the requests/s the
    /// replicas finished, scaled up by those queued behind the ones
    /// decoding. Unset before the first read.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub measured_requests_per_second: Option<f64>,
    /// Since when every read has asked for less than is planned; unset
    /// while not.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lower_since: Option<k8s_openapi::apimachinery::pkg::apis::meta::v1::Time>,
    /// The most any read since `lowerSince` asked for (with headroom): what
    /// the plan comes down to once the window has passed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lower_peak: Option<f64>,
    /// When the planned demand last changed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_change: Option<k8s_openapi::apimachinery::pkg::apis::meta::v1::Time>,
    /// `spec.replicas` when the measured demand began to be followed: once
    /// it is changed (kubectl scale, an HPA, an edit), it is the count and the
    /// measured demand is not followed until it is set back.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub spec_replicas: Option<u32>,
}
