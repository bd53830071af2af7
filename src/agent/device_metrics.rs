//! Each GPU's telemetry as Prometheus metrics, from the snapshot the agent
//! already takes (the same for every backend: NVML, AMD, fake). Names follow
//! Prometheus conventions, base units in the name: `tessera_gpu_*`. Every
//! series carries the node, the device's tessera ID, its vendor UUID (empty
//! where the vendor has none), vendor and product.
//!
//! The families are filled again at each scrape from the view, cleared
//! first: a device that is gone leaves no series behind, so the label sets
//! kept stay bounded by the devices the node has now.
//!
//! The error counters (`ecc_errors_total{type}`, `xid_errors_total`) are
//! counts the backend keeps (the driver's since it loaded, the agent's Xids
//! since it started), so each scrape sets them to the count read: it only
//! falls when that count restarts, which is what a counter reset means.

use std::sync::atomic::AtomicU64;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
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

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct EccLabels {
    #[prometheus(flatten)]
    device: DeviceLabels,
    /// `corrected` or `uncorrected`.
    r#type: &'static str,
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
    ecc_errors: Family<EccLabels, Counter>,
    xid_errors: Family<DeviceLabels, Counter>,
    last_xid: Family<DeviceLabels, Gauge>,
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
            ecc_errors: Family::default(),
            xid_errors: Family::default(),
            last_xid: Family::default(),
        };
        gpu.register(
            "healthy",
            "1 while the GPU is healthy, 0 with the reason it is not",
            metrics.healthy.clone(),
        );
        // Counters: the encoder adds `_total` to the sample names.
        gpu.register(
            "ecc_errors",
            "GPU memory errors ECC corrected or could not correct, since the driver loaded",
            metrics.ecc_errors.clone(),
        );
        gpu.register(
            "xid_errors",
            "Xid errors the GPU reported since the agent started (NVIDIA)",
            metrics.xid_errors.clone(),
        );
        gpu.register(
            "last_xid",
            "Code of the last Xid error the GPU reported since the agent started (NVIDIA)",
            metrics.last_xid.clone(),
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
        self.ecc_errors.clear();
        self.xid_errors.clear();
        self.last_xid.clear();
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
            let ecc = [
                ("corrected", telemetry.ecc_corrected_errors),
                ("uncorrected", telemetry.ecc_uncorrected_errors),
            ];
            for (kind, count) in ecc {
                if let Some(count) = count {
                    let labels = EccLabels {
                        device: labels.clone(),
                        r#type: kind,
                    };
                    self.ecc_errors.get_or_create(&labels).inc_by(count);
                }
            }
            if let Some(count) = telemetry.xid_errors {
                self.xid_errors.get_or_create(&labels).inc_by(count);
            }
            if let Some(code) = telemetry.last_xid.and_then(|code| i64::try_from(code).ok()) {
                self.last_xid.get_or_create(&labels).set(code);
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

    /// The lines of `text` for `metric` on `device`, without the labels
    /// every series has, sorted (a family's series come in no set order).
    fn series(text: &str, metric: &str, device: &str) -> Vec<String> {
        let prefix = format!("{metric}{{node=\"n\",device=\"{device}\",");
        let mut lines: Vec<String> = text
            .lines()
            .filter_map(|line| line.strip_prefix(&prefix))
            .map(|rest| match rest.split_once("product=\"") {
                Some((_, tail)) => tail.split_once('"').map_or(rest, |(_, t)| t).to_string(),
                None => rest.to_string(),
            })
            .collect();
        lines.sort();
        lines
    }

    #[test]
    fn error_counts_are_counters_only_where_the_device_reports_them() {
        let mut registry = Registry::with_prefix("tessera_gpu");
        let metrics = DeviceMetrics::register(&mut registry, "n");
        let mut view = view("1xH100-80GiB,1xRTX4090-24GiB,1xMI300X-192GiB");
        let h100 = &mut view.snapshot.devices[0].telemetry;
        h100.ecc_corrected_errors = Some(12);
        h100.ecc_uncorrected_errors = Some(1);
        h100.xid_errors = Some(3);
        h100.last_xid = Some(79);
        let text = scrape(&metrics, &registry, &view);
        for line in [
            "# TYPE tessera_gpu_ecc_errors counter",
            "# TYPE tessera_gpu_xid_errors counter",
            "# TYPE tessera_gpu_last_xid gauge",
        ] {
            assert!(text.contains(line), "{line} not in:\n{text}");
        }
        let ids: Vec<String> = view
            .snapshot
            .devices
            .iter()
            .map(|d| d.info.id.clone())
            .collect();
        let id = |i: usize| ids[i].clone();
        assert_eq!(
            series(&text, "tessera_gpu_ecc_errors_total", &id(0)),
            [",type=\"corrected\"} 12", ",type=\"uncorrected\"} 1"]
        );
        assert_eq!(
            series(&text, "tessera_gpu_xid_errors_total", &id(0)),
            ["} 3"]
        );
        assert_eq!(series(&text, "tessera_gpu_last_xid", &id(0)), ["} 79"]);

        // The GeForce card has no ECC, but its Xids are watched (at zero).
        assert!(
            series(&text, "tessera_gpu_ecc_errors_total", &id(1)).is_empty(),
            "{text}"
        );
        assert_eq!(
            series(&text, "tessera_gpu_xid_errors_total", &id(1)),
            ["} 0"]
        );
        assert!(
            series(&text, "tessera_gpu_last_xid", &id(1)).is_empty(),
            "no Xid yet"
        );

        // AMD: ECC from RAS, no Xids.
        assert_eq!(
            series(&text, "tessera_gpu_ecc_errors_total", &id(2)),
            [",type=\"corrected\"} 0", ",type=\"uncorrected\"} 0"]
        );
        assert!(series(&text, "tessera_gpu_xid_errors_total", &id(2)).is_empty());

        // The next scrape carries the new counts, and only those.
        view.snapshot.devices[0].telemetry.xid_errors = Some(4);
        view.snapshot.devices[0].telemetry.ecc_corrected_errors = None;
        let text = scrape(&metrics, &registry, &view);
        assert_eq!(
            series(&text, "tessera_gpu_xid_errors_total", &id(0)),
            ["} 4"]
        );
        assert_eq!(
            series(&text, "tessera_gpu_ecc_errors_total", &id(0)),
            [",type=\"uncorrected\"} 1"]
        );
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
