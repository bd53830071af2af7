//! What each replica serves, measured: every `--measure-interval` the
//! controller reads each serving replica's runtime metrics (`targets`,
//! `fetch`), keeps them over a sliding `--measure-window`
//! (`tessera_core::measure`), and wakes the instance, whose status stage
//! shows them beside the prediction. It runs beside the reconciles; a
//! replica that cannot be read is a condition, never a failed reconcile.

use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;
use std::time::Duration;

use kube::runtime::reflector::ObjectRef;
use tessera_core::api::ModelInstance;
use tessera_core::measure::Measurement;

mod fetch;
mod run;
mod targets;

pub(crate) use run::measure;

/// How the controller measures (`--measure-*`).
#[derive(Clone, Debug, PartialEq)]
pub struct MeasureSettings {
    /// Between two reads of every replica (`--measure-interval`).
    pub interval: Duration,
    /// The span rates and percentiles are taken over (`--measure-window`).
    pub window: Duration,
    /// How long one read may take (`--measure-timeout`).
    pub timeout: Duration,
}

/// What is known of one replica's runtime.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum ReplicaMeasure {
    /// Measured over the window, whose last read was taken `at`.
    Measured {
        measurement: Measurement,
        at: k8s_openapi::jiff::Timestamp,
    },
    /// Read once so far: rates need a second read.
    Measuring,
    /// The last read gave nothing to measure: why.
    Failed(String),
    /// The replica's first shard names no port to read (`targets`): its
    /// runtime cannot be measured at all, why.
    NoEndpoint(String),
}

/// Every measured instance's replicas, as the last round of reads left them.
#[derive(Debug, Default)]
pub(crate) struct Measures {
    by_instance: Mutex<HashMap<ObjectRef<ModelInstance>, BTreeMap<u32, ReplicaMeasure>>>,
}

impl Measures {
    /// The replicas of `instance` read, by replica; `None` when none is.
    pub(crate) fn of(
        &self,
        instance: &ObjectRef<ModelInstance>,
    ) -> Option<BTreeMap<u32, ReplicaMeasure>> {
        super::lock(&self.by_instance).get(instance).cloned()
    }

    /// Replaces every instance's record with `next`; returns the instances
    /// whose record changed (or went), whose status then shows it.
    pub(crate) fn replace(
        &self,
        next: HashMap<ObjectRef<ModelInstance>, BTreeMap<u32, ReplicaMeasure>>,
    ) -> Vec<ObjectRef<ModelInstance>> {
        let mut held = super::lock(&self.by_instance);
        let mut changed: Vec<_> = held
            .keys()
            .filter(|k| !next.contains_key(*k))
            .cloned()
            .collect();
        changed.extend(
            next.iter()
                .filter(|(k, v)| held.get(*k) != Some(*v))
                .map(|(k, _)| k.clone()),
        );
        *held = next;
        changed
    }
}

/// A vLLM exposition with `finished` requests served, 64 tokens each, 2
/// running, and every token 20 ms apart.
#[cfg(test)]
pub(crate) fn vllm_exposition(finished: u64) -> String {
    let tokens = finished * 64;
    format!(
        "# TYPE vllm:request_success_total counter
vllm:request_success_total{{finished_reason=\"length\"}} {finished}
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total {tokens}
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running 2
# TYPE vllm:inter_token_latency_seconds histogram
vllm:inter_token_latency_seconds_bucket{{le=\"0.01\"}} 0
vllm:inter_token_latency_seconds_bucket{{le=\"0.025\"}} {tokens}
vllm:inter_token_latency_seconds_bucket{{le=\"+Inf\"}} {tokens}
vllm:inter_token_latency_seconds_sum {}
vllm:inter_token_latency_seconds_count {tokens}
",
        tokens as f64 * 0.02
    )
}

/// One replica's window after reads at 0 s and 10 s, `served` requests
/// between them.
#[cfg(test)]
pub(crate) fn measured_after(served: u64) -> ReplicaMeasure {
    use tessera_core::api::Runtime;
    use tessera_core::measure::{Scrape, Window};
    let mut window = Window::new(60.0);
    for (at, finished) in [(0.0, 0), (10.0, served)] {
        let scrape = Scrape::parse(&vllm_exposition(finished), Runtime::Vllm).unwrap();
        window.push(at, scrape);
    }
    ReplicaMeasure::Measured {
        measurement: window.measurement().unwrap(),
        at: k8s_openapi::jiff::Timestamp::from_second(1_800_000_010).unwrap(),
    }
}
