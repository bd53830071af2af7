//! The chart's alerts and dashboard name only metrics the agent and the
//! controller export: every `tessera_*` name in `charts/tessera/files/` is
//! matched against what both components' `/metrics` declare.

use std::collections::BTreeSet;

use crate::agent::device_plugin::AllocationMetrics;
use crate::agent::http::{AgentMetrics, Counters};
use crate::agent::state::channel;
use crate::backend::fake::FakeBackend;
use crate::backend::snapshot;
use crate::controller::metrics::Metrics;
use crate::controller::testkit::{SMALL, instance};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kube::runtime::{reflector, watcher};
use tessera_core::api::{ModelInstance, ModelInstanceStatus, Phase, ReplicaPrediction};

/// An instance that is Running, with a predicted speed and a Ready condition.
fn running_instance() -> ModelInstance {
    let mut mi = instance("llama", SMALL);
    mi.metadata.creation_timestamp = Some(Time("2026-11-28T10:00:00Z".parse().unwrap()));
    mi.status = Some(ModelInstanceStatus {
        phase: Some(Phase::Running),
        predicted_tokens_per_second: Some(100.0),
        replica_predictions: vec![ReplicaPrediction {
            replica: 0,
            tokens_per_second: 100.0,
            capacity: None,
            measured: None,
        }],
        conditions: vec![Condition {
            type_: "Ready".into(),
            status: "True".into(),
            reason: "AllShardsReady".into(),
            message: String::new(),
            last_transition_time: Time("2026-11-28T10:00:05Z".parse().unwrap()),
            observed_generation: None,
        }],
        ..Default::default()
    });
    mi
}

/// Read at test time, not compiled in: the chart is not in the image's build context.
const FILES: [&str; 2] = [
    "charts/tessera/files/alerts.yaml",
    "charts/tessera/files/dashboard.json",
];

/// The sample names an exposition declares (`# TYPE` lines): a counter's
/// with `_total`, a histogram's `_bucket`, `_sum` and `_count`.
fn exported(text: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    for line in text.lines() {
        let Some(rest) = line.strip_prefix("# TYPE ") else {
            continue;
        };
        let mut parts = rest.split_whitespace();
        let (Some(name), Some(kind)) = (parts.next(), parts.next()) else {
            continue;
        };
        let suffixes: &[&str] = match kind {
            "counter" => &["_total"],
            "histogram" => &["_bucket", "_sum", "_count"],
            _ => &[""],
        };
        names.extend(suffixes.iter().map(|suffix| format!("{name}{suffix}")));
    }
    names
}

/// Every `tessera_…` name in `text`.
fn referenced(text: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    let mut rest = text;
    while let Some(at) = rest.find("tessera_") {
        let tail = &rest[at..];
        let end = tail
            .find(|c: char| !(c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_'))
            .unwrap_or(tail.len());
        names.insert(tail[..end].to_string());
        rest = &tail[end..];
    }
    names
}

#[test]
fn the_alerts_and_the_dashboard_name_only_exported_metrics() {
    // A family shows its name once it has a series: a node with a GPU that
    // reports everything, and a cluster with a running instance.
    let (tx, view) = channel("fake");
    tx.send_modify(|view| {
        view.snapshot = snapshot(&mut FakeBackend::new("1xH100-80GiB").unwrap()).unwrap();
        let telemetry = &mut view.snapshot.devices[0].telemetry;
        telemetry.temperature_c = Some(40.0);
        telemetry.power_w = Some(300.0);
        telemetry.utilization_percent = Some(50);
        telemetry.graphics_clock_mhz = Some(1980);
        telemetry.memory_clock_mhz = Some(2619);
        view.ready = true;
    });
    let agent = AgentMetrics::new(&AllocationMetrics::default(), "node-1")
        .render(&view, &Counters::default());
    let (store, mut writer) = reflector::store::<ModelInstance>();
    writer.apply_watcher_event(&watcher::Event::Apply(running_instance()));
    let controller = Metrics::default().render(Some(&store));
    let known: BTreeSet<String> = exported(&agent)
        .into_iter()
        .chain(exported(&controller))
        .collect();
    assert!(
        known.contains("tessera_gpu_temperature_celsius"),
        "{known:?}"
    );
    for path in FILES {
        let text = std::fs::read_to_string(format!("{}/{path}", env!("CARGO_MANIFEST_DIR")))
            .unwrap_or_else(|e| panic!("{path}: {e}"));
        let names = referenced(&text);
        assert!(!names.is_empty(), "{path} names no tessera metric");
        let unknown: Vec<&String> = names.difference(&known).collect();
        assert!(
            unknown.is_empty(),
            "{path} names metrics nobody exports: {unknown:?}"
        );
    }
}

#[test]
fn a_name_nobody_exports_is_caught() {
    let known = exported(
        "# TYPE tessera_gpu_power_watts gauge\n# TYPE tessera_controller_reconciles counter\n",
    );
    let names =
        referenced("rate(tessera_controller_reconciles_total[5m]) + tessera_gpu_powr_watts");
    let unknown: Vec<&String> = names.difference(&known).collect();
    assert_eq!(unknown, [&"tessera_gpu_powr_watts".to_string()]);
}
