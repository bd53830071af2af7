//! Each GPU's telemetry as Prometheus metrics, from the snapshot the agent
//! already takes (the same for every backend: NVML, AMD, fake). Names follow
//! Prometheus conventions, base units in the name: `tessera_gpu_*`. Every
//! series carries the node, the device's tessera ID, its vendor UUID (empty
//! where the vendor has none), vendor and product; and the pod holding the
//! GPU whole, with its instance, replica and shard where tessera planned it
//! (empty otherwise). A GPU handed out in parts has a series per part
//! (`share_memory_bytes`: each MIG partition, each memory share) labelled
//! with the part's holder instead.
//!
//! The families are filled again at each scrape from the view, cleared
//! first: a device that is gone leaves no series behind, so the label sets
//! kept stay bounded by the devices the node has now.
//!
//! The error counters (`ecc_errors_total{type}`, `xid_errors_total`) are
//! counts the backend keeps (the driver's since it loaded, the agent's Xids
//! since it started), so each scrape sets them to the count read: it only
//! falls when that count restarts, which is what a counter reset means.

use std::collections::HashMap;
use std::sync::atomic::AtomicU64;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use super::holders::Holder;
use super::state::DeviceView;
use crate::backend::{DeviceState, RawHealth, fake, is_fallback_id};

#[derive(Clone, Debug, Default, Hash, PartialEq, Eq, EncodeLabelSet)]
struct HolderLabels {
    namespace: String,
    pod: String,
    /// Not `instance`: Prometheus gives every series its target's `instance`.
    modelinstance: String,
    replica: String,
    shard: String,
}

impl From<&Holder> for HolderLabels {
    fn from(holder: &Holder) -> Self {
        Self {
            namespace: holder.namespace.clone(),
            pod: holder.pod.clone(),
            modelinstance: holder.instance.clone(),
            replica: holder.replica.clone(),
            shard: holder.shard.clone(),
        }
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DeviceLabels {
    node: String,
    device: String,
    uuid: String,
    vendor: String,
    product: String,
    #[prometheus(flatten)]
    holder: HolderLabels,
}

/// A part of a GPU: `device` is the GPU's, `holder` the part's.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ShareLabels {
    #[prometheus(flatten)]
    device: DeviceLabels,
    /// The partition's ID (its MIG UUID); empty for a memory share.
    share: String,
    /// The partition's profile (`3g.40gb`), or `memory` for a memory share.
    profile: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct HealthLabels {
    #[prometheus(flatten)]
    device: DeviceLabels,
    /// Why the device is unhealthy; empty while it is healthy.
    reason: String,
}

/// The `profile` label of a memory share.
const MEMORY_SHARE_PROFILE: &str = "memory";
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
    share_memory: Family<ShareLabels, Gauge<f64, AtomicU64>>,
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
            share_memory: Family::default(),
            ecc_errors: Family::default(),
            xid_errors: Family::default(),
            last_xid: Family::default(),
        };
        gpu.register(
            "healthy",
            "1 while the GPU is healthy, 0 with the reason it is not",
            metrics.healthy.clone(),
        );
        gpu.register(
            "share_memory_bytes",
            "Memory of each part of a GPU handed out in parts (MIG partition or memory share), in bytes",
            metrics.share_memory.clone(),
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
        self.share_memory.clear();
        self.ecc_errors.clear();
        self.xid_errors.clear();
        self.last_xid.clear();
        let vendor_ids = view.snapshot.backend != fake::BACKEND_NAME;
        let whole: HashMap<&str, &Holder> = view
            .holdings
            .iter()
            .filter(|h| h.memory_share_bytes.is_none())
            .map(|h| (h.device.as_str(), &h.holder))
            .collect();
        for state in &view.snapshot.devices {
            let labels = self.labels(
                state,
                vendor_ids,
                whole.get(state.info.id.as_str()).copied(),
            );
            self.update_shares(state, vendor_ids, &whole, view);
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

    /// A series for each partition of `state` (held or not) and each
    /// memory share of it held.
    fn update_shares(
        &self,
        state: &DeviceState,
        vendor_ids: bool,
        whole: &HashMap<&str, &Holder>,
        view: &DeviceView,
    ) {
        let part = |holder: Option<&Holder>, share: &str, profile: &str, bytes: u64| {
            let labels = ShareLabels {
                device: self.labels(state, vendor_ids, holder),
                share: share.to_string(),
                profile: profile.to_string(),
            };
            self.share_memory.get_or_create(&labels).set(bytes as f64);
        };
        for partition in state.info.mig.iter().flat_map(|mig| &mig.partitions) {
            let holder = whole.get(partition.id.as_str()).copied();
            part(
                holder,
                &partition.id,
                &partition.profile,
                partition.memory_total_bytes,
            );
        }
        for holding in &view.holdings {
            if let Some(bytes) = holding.memory_share_bytes
                && holding.device == state.info.id
            {
                part(Some(&holding.holder), "", MEMORY_SHARE_PROFILE, bytes);
            }
        }
    }

    fn labels(
        &self,
        state: &DeviceState,
        vendor_ids: bool,
        holder: Option<&Holder>,
    ) -> DeviceLabels {
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
            holder: holder.map(HolderLabels::from).unwrap_or_default(),
        }
    }
}

#[cfg(test)]
mod tests {
    use prometheus_client::encoding::text::encode;

    use super::*;
    use crate::agent::holders::Holding;
    use crate::backend::fake::FakeBackend;
    use crate::backend::snapshot;
    use tessera_core::api::{GpuPartition, MigState};

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
            "node=\"node-1\",device=\"{id}\",uuid=\"\",vendor=\"nvidia\",product=\"{}\",{NO_HOLDER}",
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

    const NO_HOLDER: &str = "namespace=\"\",pod=\"\",modelinstance=\"\",replica=\"\",shard=\"\"";

    fn shard(pod: &str, shard: &str) -> Holder {
        Holder {
            namespace: "ml".into(),
            pod: pod.into(),
            instance: "llama".into(),
            replica: "0".into(),
            shard: shard.into(),
        }
    }

    fn holding(device: &str, memory_share_bytes: Option<u64>, holder: Holder) -> Holding {
        Holding {
            device: device.into(),
            memory_share_bytes,
            holder,
        }
    }

    #[test]
    fn a_held_device_and_each_part_name_their_holder() {
        let mut registry = Registry::with_prefix("tessera_gpu");
        let metrics = DeviceMetrics::register(&mut registry, "n");
        let mut view = view("3xA100-80GiB");
        let ids: Vec<String> = view
            .snapshot
            .devices
            .iter()
            .map(|d| d.info.id.clone())
            .collect();
        view.snapshot.devices[2].info.mig = Some(MigState {
            enabled: true,
            pending: None,
            memory_slices: 8,
            multiprocessors: 108,
            partitions: ["MIG-1", "MIG-2"]
                .iter()
                .map(|id| GpuPartition {
                    id: id.to_string(),
                    profile: "3g.40gb".into(),
                    memory_total_bytes: 40 << 30,
                    multiprocessors: 42,
                    placement_start: 0,
                    placement_size: 4,
                })
                .collect(),
            profiles: Vec::new(),
        });
        view.holdings = vec![
            holding(&ids[0], None, shard("llama-shard-0", "0")),
            holding(&ids[1], Some(24 << 30), shard("llama-shard-1", "1")),
            holding(
                &ids[1],
                Some(30 << 30),
                Holder::from_pod_key("team/notebook"),
            ),
            holding("MIG-2", None, shard("llama-shard-2", "2")),
        ];
        let text = scrape(&metrics, &registry, &view);
        let held = format!(
            "tessera_gpu_power_watts{{node=\"n\",device=\"{}\",uuid=\"\",vendor=\"nvidia\",product=\"{}\",namespace=\"ml\",pod=\"llama-shard-0\",modelinstance=\"llama\",replica=\"0\",shard=\"0\"}}",
            ids[0], view.snapshot.devices[0].info.product
        );
        assert!(text.contains(&held), "{held} not in:\n{text}");
        // A GPU in parts is held by no one whole; each part names its holder.
        let series = |needle: &str| text.lines().filter(|l| l.contains(needle)).count();
        assert_eq!(
            series(&format!(
                "power_watts{{node=\"n\",device=\"{}\",uuid=\"\",vendor=\"nvidia\",product=\"NVIDIA A100-SXM4-80GB\",{NO_HOLDER}}}",
                ids[1]
            )),
            1,
            "{text}"
        );
        for line in [
            format!(
                "device=\"{}\",uuid=\"\",vendor=\"nvidia\",product=\"NVIDIA A100-SXM4-80GB\",namespace=\"ml\",pod=\"llama-shard-1\",modelinstance=\"llama\",replica=\"0\",shard=\"1\",share=\"\",profile=\"memory\"}} {}",
                ids[1],
                (24u64 << 30) as f64
            ),
            format!(
                "pod=\"notebook\",modelinstance=\"\",replica=\"\",shard=\"\",share=\"\",profile=\"memory\"}} {}",
                (30u64 << 30) as f64
            ),
            "shard=\"2\",share=\"MIG-2\",profile=\"3g.40gb\"}".to_string(),
            format!("{NO_HOLDER},share=\"MIG-1\",profile=\"3g.40gb\"}}"),
        ] {
            assert!(text.contains(&line), "{line} not in:\n{text}");
        }
        assert_eq!(series("tessera_gpu_share_memory_bytes{"), 4, "{text}");

        // The holders gone, no series keeps their labels.
        view.holdings.clear();
        let text = scrape(&metrics, &registry, &view);
        assert!(
            !text.contains("llama") && !text.contains("notebook"),
            "{text}"
        );
    }

    /// The lines of `text` for `metric` on `device`, without the labels
    /// every series has, sorted (a family's series come in no set order).
    fn series(text: &str, metric: &str, device: &str) -> Vec<String> {
        let prefix = format!("{metric}{{node=\"n\",device=\"{device}\",");
        let mut lines: Vec<String> = text
            .lines()
            .filter_map(|line| line.strip_prefix(&prefix))
            .map(|rest| match rest.split_once("product=\"") {
                Some((_, tail)) => {
                    let tail = tail.split_once('"').map_or(rest, |(_, t)| t);
                    let holder = format!(",{NO_HOLDER}");
                    tail.strip_prefix(&holder).unwrap_or(tail).to_string()
                }
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
