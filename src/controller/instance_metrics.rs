//! One series per ModelInstance, from the instance cache at each scrape:
//! its phase, the GPUs its plan holds, its predicted speed, what it serves
//! at its latency target (and its demand), what its runtimes were measured
//! serving, and how long it took from creation to Running. The families are cleared and filled again
//! every time, so an instance that is gone leaves no series behind.

use std::collections::BTreeSet;
use std::sync::atomic::AtomicU64;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use super::status::READY;
use tessera_core::api::{MeasuredServing, ModelInstance, Phase};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct InstanceLabels {
    namespace: String,
    /// Not `instance`: Prometheus gives every target that label.
    modelinstance: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PhaseLabels {
    #[prometheus(flatten)]
    instance: InstanceLabels,
    phase: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReplicaLabels {
    #[prometheus(flatten)]
    instance: InstanceLabels,
    replica: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct QuantileLabels {
    #[prometheus(flatten)]
    instance: InstanceLabels,
    quantile: String,
}

type Value = Family<InstanceLabels, Gauge<f64, AtomicU64>>;
type Quantiles = Family<QuantileLabels, Gauge<f64, AtomicU64>>;

pub(crate) struct InstanceMetrics {
    phase: Family<PhaseLabels, Gauge>,
    gpus: Family<InstanceLabels, Gauge>,
    tokens_per_second: Value,
    replica_tokens_per_second: Family<ReplicaLabels, Gauge<f64, AtomicU64>>,
    capacity_requests_per_second: Value,
    capacity_output_tokens_per_second: Value,
    capacity_concurrency: Value,
    demand_requests_per_second: Value,
    demand_planned_requests_per_second: Value,
    replica_capacity_requests_per_second: Family<ReplicaLabels, Gauge<f64, AtomicU64>>,
    created_to_running: Value,
    measured_requests_per_second: Value,
    measured_output_tokens_per_second: Value,
    measured_time_per_output_token: Quantiles,
    measured_time_to_first_token: Quantiles,
    replica_measured_requests_per_second: Family<ReplicaLabels, Gauge<f64, AtomicU64>>,
}

impl InstanceMetrics {
    /// Registers the families (`tessera_controller_instance_*`).
    pub(crate) fn register(registry: &mut Registry) -> Self {
        let metrics = Self {
            phase: Family::default(),
            gpus: Family::default(),
            tokens_per_second: Value::default(),
            replica_tokens_per_second: Family::default(),
            capacity_requests_per_second: Value::default(),
            capacity_output_tokens_per_second: Value::default(),
            capacity_concurrency: Value::default(),
            demand_requests_per_second: Value::default(),
            demand_planned_requests_per_second: Value::default(),
            replica_capacity_requests_per_second: Family::default(),
            created_to_running: Value::default(),
            measured_requests_per_second: Value::default(),
            measured_output_tokens_per_second: Value::default(),
            measured_time_per_output_token: Quantiles::default(),
            measured_time_to_first_token: Quantiles::default(),
            replica_measured_requests_per_second: Family::default(),
        };
        registry.register(
            "instance_phase",
            "1 for the phase each ModelInstance is in",
            metrics.phase.clone(),
        );
        registry.register(
            "instance_gpus",
            "GPUs (or parts of GPUs) the instance's plan holds, all replicas",
            metrics.gpus.clone(),
        );
        registry.register(
            "instance_predicted_tokens_per_second",
            "Predicted single-stream decode tokens/s of the instance, all replicas together",
            metrics.tokens_per_second.clone(),
        );
        registry.register(
            "instance_replica_predicted_tokens_per_second",
            "Predicted single-stream decode tokens/s of each placed replica",
            metrics.replica_tokens_per_second.clone(),
        );
        registry.register(
            "instance_capacity_requests_per_second",
            "Predicted requests/s the placed replicas serve together at the latency target (replicas × the slowest one's)",
            metrics.capacity_requests_per_second.clone(),
        );
        registry.register(
            "instance_capacity_output_tokens_per_second",
            "Predicted output tokens/s at that load",
            metrics.capacity_output_tokens_per_second.clone(),
        );
        registry.register(
            "instance_capacity_concurrency",
            "Predicted requests decoded at once at that load, all replicas",
            metrics.capacity_concurrency.clone(),
        );
        registry.register(
            "instance_demand_requests_per_second",
            "The demand the instance is judged by (spec.serving.requestsPerSecond, or the demand measured with serving.demand Measured)",
            metrics.demand_requests_per_second.clone(),
        );
        registry.register(
            "instance_demand_planned_requests_per_second",
            "With serving.demand Measured: the demand the replicas are planned for (measured, with headroom)",
            metrics.demand_planned_requests_per_second.clone(),
        );
        registry.register(
            "instance_replica_capacity_requests_per_second",
            "Predicted requests/s each placed replica serves at the latency target",
            metrics.replica_capacity_requests_per_second.clone(),
        );
        registry.register(
            "instance_created_to_running_seconds",
            "From the instance's creation to its Ready condition turning true, for instances that are ready",
            metrics.created_to_running.clone(),
        );
        registry.register(
            "instance_measured_requests_per_second",
            "Requests/s the instance's runtimes served over the last measuring window (status.measured), beside instance_capacity_requests_per_second",
            metrics.measured_requests_per_second.clone(),
        );
        registry.register(
            "instance_measured_output_tokens_per_second",
            "Output tokens/s the instance's runtimes generated over the last measuring window",
            metrics.measured_output_tokens_per_second.clone(),
        );
        registry.register(
            "instance_measured_time_per_output_token_seconds",
            "Measured time between output tokens over the last window, by quantile (0.5, 0.9), from the runtimes' histograms",
            metrics.measured_time_per_output_token.clone(),
        );
        registry.register(
            "instance_measured_time_to_first_token_seconds",
            "Measured time to the first token over the last window, by quantile (0.5, 0.9)",
            metrics.measured_time_to_first_token.clone(),
        );
        registry.register(
            "instance_replica_measured_requests_per_second",
            "Requests/s each replica's runtime served over the last measuring window",
            metrics.replica_measured_requests_per_second.clone(),
        );
        metrics
    }

    /// Sets every family from `instances`, and nothing else.
    pub(crate) fn update<'a>(&self, instances: impl IntoIterator<Item = &'a ModelInstance>) {
        self.phase.clear();
        self.gpus.clear();
        self.tokens_per_second.clear();
        self.replica_tokens_per_second.clear();
        self.capacity_requests_per_second.clear();
        self.capacity_output_tokens_per_second.clear();
        self.capacity_concurrency.clear();
        self.demand_requests_per_second.clear();
        self.demand_planned_requests_per_second.clear();
        self.replica_capacity_requests_per_second.clear();
        self.created_to_running.clear();
        self.measured_requests_per_second.clear();
        self.measured_output_tokens_per_second.clear();
        self.measured_time_per_output_token.clear();
        self.measured_time_to_first_token.clear();
        self.replica_measured_requests_per_second.clear();
        for mi in instances {
            let labels = InstanceLabels {
                namespace: mi.metadata.namespace.clone().unwrap_or_default(),
                modelinstance: mi.metadata.name.clone().unwrap_or_default(),
            };
            let status = mi.status.as_ref();
            let phase = status.and_then(|s| s.phase).unwrap_or(Phase::Pending);
            self.phase
                .get_or_create(&PhaseLabels {
                    instance: labels.clone(),
                    phase: format!("{phase:?}"),
                })
                .set(1);
            let held: BTreeSet<(&str, &str)> = status
                .into_iter()
                .flat_map(|s| &s.plan)
                .flat_map(|shard| {
                    shard
                        .devices
                        .iter()
                        .map(|d| (shard.node.as_str(), d.as_str()))
                })
                .collect();
            self.gpus
                .get_or_create(&labels)
                .set(i64::try_from(held.len()).unwrap_or(i64::MAX));
            if let Some(speed) = status.and_then(|s| s.predicted_tokens_per_second) {
                self.tokens_per_second.get_or_create(&labels).set(speed);
            }
            for prediction in status.into_iter().flat_map(|s| &s.replica_predictions) {
                self.replica_tokens_per_second
                    .get_or_create(&ReplicaLabels {
                        instance: labels.clone(),
                        replica: prediction.replica.to_string(),
                    })
                    .set(prediction.tokens_per_second);
                if let Some(capacity) = &prediction.capacity {
                    self.replica_capacity_requests_per_second
                        .get_or_create(&ReplicaLabels {
                            instance: labels.clone(),
                            replica: prediction.replica.to_string(),
                        })
                        .set(capacity.requests_per_second);
                }
                if let Some(measured) = &prediction.measured {
                    self.replica_measured_requests_per_second
                        .get_or_create(&ReplicaLabels {
                            instance: labels.clone(),
                            replica: prediction.replica.to_string(),
                        })
                        .set(measured.requests_per_second);
                }
            }
            if let Some(measured) = status.and_then(|s| s.measured.as_ref()) {
                self.measured(&labels, measured);
            }
            if let Some(capacity) = status.and_then(|s| s.capacity.as_ref()) {
                self.capacity_requests_per_second
                    .get_or_create(&labels)
                    .set(capacity.requests_per_second);
                self.capacity_output_tokens_per_second
                    .get_or_create(&labels)
                    .set(capacity.output_tokens_per_second);
                self.capacity_concurrency
                    .get_or_create(&labels)
                    .set(f64::from(capacity.concurrency));
            }
            let judged = status
                .and_then(|s| s.capacity.as_ref())
                .and_then(|c| c.demand_requests_per_second);
            if let Some(demand) = judged.or(mi.spec.demand()) {
                self.demand_requests_per_second
                    .get_or_create(&labels)
                    .set(demand);
            }
            if let Some(planned) = status.and_then(|s| s.demand.as_ref()) {
                self.demand_planned_requests_per_second
                    .get_or_create(&labels)
                    .set(planned.planned_requests_per_second);
            }
            if let Some(seconds) = created_to_ready(mi) {
                self.created_to_running.get_or_create(&labels).set(seconds);
            }
        }
    }
}

impl InstanceMetrics {
    fn measured(&self, labels: &InstanceLabels, measured: &MeasuredServing) {
        self.measured_requests_per_second
            .get_or_create(labels)
            .set(measured.requests_per_second);
        self.measured_output_tokens_per_second
            .get_or_create(labels)
            .set(measured.output_tokens_per_second);
        for (family, ms) in [
            (&self.measured_time_per_output_token, measured.tpot_ms),
            (&self.measured_time_to_first_token, measured.ttft_ms),
        ] {
            let Some(ms) = ms else { continue };
            for (quantile, value) in [("0.5", ms.p50), ("0.9", ms.p90)] {
                family
                    .get_or_create(&QuantileLabels {
                        instance: labels.clone(),
                        quantile: quantile.to_string(),
                    })
                    .set(value / 1000.0);
            }
        }
    }
}

/// Seconds from creation to the Ready condition's last turn to true.
fn created_to_ready(mi: &ModelInstance) -> Option<f64> {
    let created = mi.metadata.creation_timestamp.as_ref()?;
    let ready = mi
        .status
        .as_ref()?
        .conditions
        .iter()
        .find(|c| c.type_ == READY && c.status == "True")?;
    let seconds = ready
        .last_transition_time
        .0
        .duration_since(created.0)
        .as_secs_f64();
    (seconds >= 0.0).then_some(seconds)
}

#[cfg(test)]
mod tests {
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
    use prometheus_client::encoding::text::encode;
    use tessera_core::api::{
        InstanceCapacity, ModelInstanceStatus, Percentiles, PlannedShard, ReplicaCapacity,
        ReplicaPrediction,
    };

    use super::*;
    use crate::controller::testkit::{SMALL, instance};

    fn running(name: &str) -> ModelInstance {
        let mut mi = instance(name, &format!("{SMALL}\nserving: {{requestsPerSecond: 6}}"));
        let at = |s: &str| Time(s.parse().unwrap());
        mi.metadata.creation_timestamp = Some(at("2026-11-28T10:00:00Z"));
        mi.status = Some(ModelInstanceStatus {
            phase: Some(Phase::Running),
            predicted_tokens_per_second: Some(127.5),
            replica_predictions: vec![
                ReplicaPrediction {
                    replica: 0,
                    tokens_per_second: 60.0,
                    capacity: None,
                    measured: None,
                },
                ReplicaPrediction {
                    replica: 2,
                    tokens_per_second: 67.5,
                    capacity: Some(ReplicaCapacity {
                        concurrency: 40,
                        requests_per_second: 3.5,
                        output_tokens_per_second: 896.0,
                        tpot_ms: 41.0,
                        ttft_ms: 120.0,
                        target_missed: None,
                        correction: None,
                    }),
                    measured: Some(MeasuredServing {
                        requests_per_second: 2.5,
                        ..MeasuredServing::default()
                    }),
                },
            ],
            measured: Some(MeasuredServing {
                window_seconds: 60.0,
                requests_per_second: 6.5,
                output_tokens_per_second: 1600.0,
                tpot_ms: Some(Percentiles {
                    p50: 30.0,
                    p90: 42.0,
                }),
                ..MeasuredServing::default()
            }),
            capacity: Some(InstanceCapacity {
                requests_per_second: 7.0,
                output_tokens_per_second: 1792.0,
                concurrency: 80,
                tpot_ms: 45.0,
                ttft_ms: 130.0,
                demand_requests_per_second: Some(6.0),
            }),
            plan: ["g0", "g1"]
                .iter()
                .enumerate()
                .map(|(shard, device)| PlannedShard {
                    copy: 0,
                    replica: 0,
                    shard: shard as u32,
                    node: "a".into(),
                    devices: vec![(*device).into()],
                    layer_start: 0,
                    layer_end: 16,
                    predicted_memory_gib: 10.0,
                    share: None,
                })
                .collect(),
            conditions: vec![Condition {
                type_: READY.into(),
                status: "True".into(),
                reason: "AllShardsReady".into(),
                message: String::new(),
                last_transition_time: at("2026-11-28T10:00:02.5Z"),
                observed_generation: None,
            }],
            ..Default::default()
        });
        mi
    }

    fn scrape(
        metrics: &InstanceMetrics,
        registry: &Registry,
        instances: &[ModelInstance],
    ) -> String {
        metrics.update(instances);
        let mut out = String::new();
        encode(&mut out, registry).unwrap();
        out
    }

    #[test]
    fn each_instance_is_a_series_and_a_deleted_one_leaves_none() {
        let mut registry = Registry::with_prefix("tessera_controller");
        let metrics = InstanceMetrics::register(&mut registry);
        let pending = instance("waiting", SMALL);
        let text = scrape(&metrics, &registry, &[running("llama"), pending.clone()]);
        let labels = "namespace=\"ml\",modelinstance=\"llama\"";
        for line in [
            format!("tessera_controller_instance_phase{{{labels},phase=\"Running\"}} 1"),
            format!("tessera_controller_instance_gpus{{{labels}}} 2"),
            format!("tessera_controller_instance_predicted_tokens_per_second{{{labels}}} 127.5"),
            format!("tessera_controller_instance_created_to_running_seconds{{{labels}}} 2.5"),
            format!("tessera_controller_instance_replica_predicted_tokens_per_second{{{labels},replica=\"2\"}} 67.5"),
            format!("tessera_controller_instance_capacity_requests_per_second{{{labels}}} 7.0"),
            format!("tessera_controller_instance_capacity_output_tokens_per_second{{{labels}}} 1792.0"),
            format!("tessera_controller_instance_capacity_concurrency{{{labels}}} 80.0"),
            format!("tessera_controller_instance_demand_requests_per_second{{{labels}}} 6.0"),
            format!("tessera_controller_instance_replica_capacity_requests_per_second{{{labels},replica=\"2\"}} 3.5"),
            format!("tessera_controller_instance_measured_requests_per_second{{{labels}}} 6.5"),
            format!("tessera_controller_instance_measured_output_tokens_per_second{{{labels}}} 1600.0"),
            format!("tessera_controller_instance_measured_time_per_output_token_seconds{{{labels},quantile=\"0.9\"}} 0.042"),
            format!("tessera_controller_instance_replica_measured_requests_per_second{{{labels},replica=\"2\"}} 2.5"),
            "tessera_controller_instance_phase{namespace=\"ml\",modelinstance=\"waiting\",phase=\"Pending\"} 1".to_string(),
        ] {
            assert!(text.contains(&line), "{line} not in:\n{text}");
        }
        let after = scrape(&metrics, &registry, &[pending]);
        assert!(!after.contains("modelinstance=\"llama\""), "{after}");
    }
}
