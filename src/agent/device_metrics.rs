//! Each GPU's telemetry as Prometheus metrics, from the snapshot the agent
//! already takes (the same for every backend: NVML, AMD, fake). Names follow
//! Prometheus conventions, base units in the name: `tessera_gpu_*`. Every
//! series carries the node, the device's tessera ID, its vendor UUID (empty
//! where the vendor has none), vendor and product.
//!
//! The families are filled again at each scrape from the view, cleared
//! first: a device that is gone leaves no series behind, so the label sets
//! kept stay bounded by the devices the node has now.

use std::sync::atomic::AtomicU64;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use super::state::DeviceView;
use crate::backend::{DeviceState, RawHealth, fake, is_fallback_id};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DeviceLabels {
    node: String,
    device: String,
    uuid: String,
    vendor: String,
    product: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct HealthLabels {
    #[prometheus(flatten)]
    device: DeviceLabels,
    /// Why the device is unhealthy; empty while it is healthy.
    reason: String,
}

type Value = Family<DeviceLabels, Gauge<f64, AtomicU64>>;

/// The per-device families, registered once.
pub(crate) struct DeviceMetrics {
    node: String,
    memory_used: Value,
    memory_total: Value,
    utilization: Value,
    temperature: Value,
    power: Value,
    sm_clock: Value,
    memory_clock: Value,
    healthy: Family<HealthLabels, Gauge>,
}

impl DeviceMetrics {
    /// Registers the families in `registry` (the agent's `tessera_gpu`
    /// registry) for the devices of `node`.
    pub(crate) fn register(registry: &mut Registry, node: &str) -> Self {
        let gpu = registry;
        let mut value = |name: &str, help: &str| {
            let family = Value::default();
            gpu.register(name, help, family.clone());
            family
        };
        let metrics = Self {
            node: node.to_string(),
            memory_used: value("memory_used_bytes", "GPU memory in use, in bytes"),
            memory_total: value("memory_total_bytes", "GPU memory, in bytes"),
            utilization: value(
                "utilization_ratio",
                "Share of the last sample period the GPU was busy (0 to 1)",
            ),
            temperature: value("temperature_celsius", "GPU temperature"),
            power: value("power_watts", "GPU power draw"),
            sm_clock: value("sm_clock_hertz", "GPU graphics (SM) clock"),
            memory_clock: value("memory_clock_hertz", "GPU memory clock"),
            healthy: Family::default(),
        };
        gpu.register(
            "healthy",
            "1 while the GPU is healthy, 0 with the reason it is not",
            metrics.healthy.clone(),
        );
        metrics
    }

    /// Sets every family from `view`: the devices it has, and no other.
    pub(crate) fn update(&self, view: &DeviceView) {
        let families = [
            &self.memory_used,
            &self.memory_total,
            &self.utilization,
            &self.temperature,
            &self.power,
            &self.sm_clock,
            &self.memory_clock,
        ];
        for family in families {
            family.clear();
        }
        self.healthy.clear();
        let vendor_ids = view.snapshot.backend != fake::BACKEND_NAME;
        for state in &view.snapshot.devices {
            let labels = self.labels(state, vendor_ids);
            let telemetry = &state.telemetry;
            let set = |family: &Value, value: f64| {
                family.get_or_create(&labels).set(value);
            };
            set(&self.memory_used, telemetry.memory_used_bytes as f64);
            set(&self.memory_total, state.info.memory_total_bytes as f64);
            let optional = [
                (
                    &self.utilization,
                    telemetry.utilization_percent.map(|p| f64::from(p) / 100.0),
                ),
                (&self.temperature, telemetry.temperature_c),
                (&self.power, telemetry.power_w),
                (
                    &self.sm_clock,
                    telemetry.graphics_clock_mhz.map(|m| f64::from(m) * 1e6),
                ),
                (
                    &self.memory_clock,
                    telemetry.memory_clock_mhz.map(|m| f64::from(m) * 1e6),
                ),
            ];
            for (family, value) in optional {
                if let Some(value) = value.filter(|v| v.is_finite()) {
                    set(family, value);
                }
            }
            let (healthy, reason) = match &state.health {
                RawHealth::Healthy => (1, String::new()),
                RawHealth::Unhealthy(why) => (0, why.clone()),
            };
            self.healthy
                .get_or_create(&HealthLabels {
                    device: labels.clone(),
                    reason,
                })
                .set(healthy);
        }
    }

    fn labels(&self, state: &DeviceState, vendor_ids: bool) -> DeviceLabels {
        let info = &state.info;
        DeviceLabels {
            node: self.node.clone(),
            device: info.id.clone(),
            uuid: if vendor_ids && !is_fallback_id(&info.id) {
                info.id.clone()
            } else {
                String::new()
            },
            vendor: info.vendor.as_str().to_string(),
            product: info.product.clone(),
        }
    }
}

#[cfg(test)]
mod tests {
    use prometheus_client::encoding::text::encode;

    use super::*;
    use crate::backend::fake::FakeBackend;
    use crate::backend::snapshot;

    fn scrape(metrics: &DeviceMetrics, registry: &Registry, view: &DeviceView) -> String {
        metrics.update(view);
        let mut out = String::new();
        encode(&mut out, registry).unwrap();
        out
    }

    fn view(spec: &str) -> DeviceView {
        let mut view = DeviceView::empty("fake");
        view.snapshot = snapshot(&mut FakeBackend::new(spec).unwrap()).unwrap();
        view.ready = true;
        view
    }

    #[test]
    fn each_device_is_a_series_in_base_units() {
        let mut registry = Registry::with_prefix("tessera_gpu");
        let metrics = DeviceMetrics::register(&mut registry, "node-1");
        let mut view = view("2xH100-80GiB");
        view.snapshot.devices[0].telemetry.utilization_percent = Some(37);
        view.snapshot.devices[0].telemetry.graphics_clock_mhz = Some(1980);
        view.snapshot.devices[1].health = RawHealth::Unhealthy("Xid 79".into());
        let text = scrape(&metrics, &registry, &view);
        let id = &view.snapshot.devices[0].info.id;
        let labels = format!(
            "node=\"node-1\",device=\"{id}\",uuid=\"\",vendor=\"nvidia\",product=\"{}\"",
            view.snapshot.devices[0].info.product
        );
        for line in [
            format!(
                "tessera_gpu_memory_total_bytes{{{labels}}} {}",
                (80u64 << 30) as f64
            ),
            format!("tessera_gpu_utilization_ratio{{{labels}}} 0.37"),
            format!("tessera_gpu_sm_clock_hertz{{{labels}}} 1980000000.0"),
            format!("tessera_gpu_healthy{{{labels},reason=\"\"}} 1"),
        ] {
            assert!(text.contains(&line), "{line} not in:\n{text}");
        }
        assert!(text.contains("reason=\"Xid 79\"} 0"), "{text}");
    }

    #[test]
    fn a_device_that_is_gone_leaves_no_series() {
        let mut registry = Registry::with_prefix("tessera_gpu");
        let metrics = DeviceMetrics::register(&mut registry, "n");
        let before = scrape(&metrics, &registry, &view("2xH100-80GiB"));
        let after = scrape(&metrics, &registry, &view("1xH100-80GiB"));
        let series = |text: &str| {
            text.lines()
                .filter(|l| l.starts_with("tessera_gpu_memory_total_bytes{"))
                .count()
        };
        assert_eq!((series(&before), series(&after)), (2, 1));
    }
}
