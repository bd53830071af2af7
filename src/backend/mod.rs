//! How a node learns what GPUs it has, their live state and how they are
//! connected. One trait, one implementation per vendor library (NVML, AMD sysfs)
//! plus a fake for clusters and tests without GPUs; `detect` picks and merges.
//! The result is a `Snapshot`, which becomes the published `NodeGpuState`.
//! Vendor knowledge stays here: what a container needs for its devices is
//! asked of `container_wiring`, and a stand-in device ID is recognised by
//! `is_fallback_id`, so callers never name a vendor.

pub mod amd;
pub(crate) mod cdi_specs;
pub(crate) mod container;
pub mod cuda_probe;
pub mod detect;
pub mod fake;
mod fake_mig;
pub mod health;
mod mig_table;
pub mod nvml;
pub mod registry;
#[cfg(feature = "rocm-smi")]
mod rocm_smi;
mod vendor_wiring;

use serde::{Deserialize, Serialize};

pub(crate) use vendor_wiring::container_wiring;

use tessera_core::api::{
    GPU_STATE_VERSION, GpuDevice, GpuLink, Health, LinkKind, MigState, NodeGpuState, Vendor,
};

/// What a backend reports about one device that does not change while it runs
/// (its MIG layout aside).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DeviceInfo {
    /// Stable identifier: the vendor UUID where one exists.
    pub id: String,
    pub index: u32,
    pub vendor: Vendor,
    pub product: String,
    pub memory_total_bytes: u64,
    /// CUDA compute capability (`9.0`) or AMD GFX target (`gfx942`).
    pub architecture: String,
    /// Streaming multiprocessors (NVIDIA) or compute units (AMD).
    pub compute_units: u32,
    /// Estimated dense FP16/BF16 throughput.
    pub fp16_tflops: f64,
    /// Dense FP8 and FP4 throughput, where the tensor cores have the format.
    /// Absent from registries written before they were read, hence the
    /// default.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fp8_tflops: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fp4_tflops: Option<f64>,
    pub memory_bandwidth_gbps: f64,
    /// PCI bus ID, `0000:17:00.0`.
    pub pci_bus_id: String,
    pub numa_node: Option<i32>,
    /// NVIDIA MIG where the GPU has it: its mode, partitions and profiles.
    /// Unlike the rest it can change while the agent runs (an administrator
    /// repartitions the GPU); every discovery reads it again. Absent from
    /// registries written before partitions were read, hence the default.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mig: Option<MigState>,
}

impl DeviceInfo {
    /// Why the device cannot be handed to a container as a whole GPU, if it
    /// cannot: in MIG mode (it serves through its partitions), or a MIG mode
    /// change pending a reset.
    pub fn not_whole(&self) -> Option<String> {
        self.mig.as_ref().and_then(MigState::why_not_whole)
    }
}

/// Live readings of one device.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Telemetry {
    pub temperature_c: Option<f64>,
    pub power_w: Option<f64>,
    pub graphics_clock_mhz: Option<u32>,
    pub memory_clock_mhz: Option<u32>,
    pub utilization_percent: Option<u32>,
    pub memory_used_bytes: u64,
    pub memory_free_bytes: u64,
    /// Memory errors ECC corrected since the driver loaded; `None` where the
    /// device has no ECC, has it off, or the count cannot be read.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ecc_corrected_errors: Option<u64>,
    /// Memory errors ECC detected but could not correct since the driver
    /// loaded; `None` as for `ecc_corrected_errors`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ecc_uncorrected_errors: Option<u64>,
    /// Xid errors reported since the backend started watching the device,
    /// whatever their cause; `None` where the vendor has no Xids or the
    /// device's events are not watched.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub xid_errors: Option<u64>,
    /// The code of the last of those Xid errors, when one was reported
    /// with a code.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_xid: Option<u64>,
}

/// What the backend says about a device's health right now, before hysteresis.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum RawHealth {
    Healthy,
    Unhealthy(String),
}

/// A connection between two devices of the node.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DeviceLink {
    pub a: String,
    pub b: String,
    pub kind: LinkKind,
    pub bandwidth_gbps: f64,
    /// Whether the two devices can access each other's memory directly.
    pub p2p: bool,
}

#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    /// The vendor library or driver interface is not there: the backend does not
    /// apply to this node (detection moves on).
    #[error("{0}")]
    Unavailable(String),
    /// The backend applies but failed.
    #[error("{0}")]
    Failed(String),
}

/// One vendor's view of the node's GPUs.
pub trait GpuBackend: Send {
    /// `nvml`, `amd`, `fake` (`nvml+amd` when merged).
    fn name(&self) -> &str;
    /// The devices present now. A device that disappeared is simply absent.
    fn devices(&mut self) -> Result<Vec<DeviceInfo>, BackendError>;
    fn telemetry(&mut self, device: &DeviceInfo) -> Result<Telemetry, BackendError>;
    /// Current health, including faults reported by events since the last call.
    fn health(&mut self, device: &DeviceInfo) -> Result<RawHealth, BackendError>;
    fn links(&mut self, devices: &[DeviceInfo]) -> Result<Vec<DeviceLink>, BackendError>;

    /// Everything at one moment: what one poll reads. The default asks the
    /// methods above device by device; a backend whose devices share reads
    /// of the machine (AMD's sysfs topology) reads it once here instead.
    fn snapshot(&mut self) -> Result<Snapshot, BackendError> {
        device_by_device(self)
    }
}

/// Whether a device ID is a positional stand-in a backend gave a device that
/// could not tell its own (today only NVML does, for a lost GPU), which the
/// device registry may map back to the ID the device had.
pub(crate) fn is_fallback_id(id: &str) -> bool {
    nvml::is_fallback_id(id)
}

/// One device with everything read about it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DeviceState {
    pub info: DeviceInfo,
    pub telemetry: Telemetry,
    pub health: RawHealth,
}

/// Everything a backend knows about the node at one moment.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Snapshot {
    pub backend: String,
    pub devices: Vec<DeviceState>,
    pub links: Vec<DeviceLink>,
}

/// Reads a full snapshot ([`GpuBackend::snapshot`]).
pub fn snapshot(backend: &mut dyn GpuBackend) -> Result<Snapshot, BackendError> {
    backend.snapshot()
}

fn device_by_device<B: GpuBackend + ?Sized>(backend: &mut B) -> Result<Snapshot, BackendError> {
    let infos = backend.devices()?;
    let mut devices = Vec::with_capacity(infos.len());
    for info in infos {
        let telemetry = backend.telemetry(&info);
        let state = device_state(info, telemetry, |info| backend.health(info))?;
        devices.push(state);
    }
    let infos: Vec<DeviceInfo> = devices.iter().map(|d| d.info.clone()).collect();
    let links = backend.links(&infos)?;
    Ok(Snapshot {
        backend: backend.name().to_string(),
        devices,
        links,
    })
}

/// One device of a snapshot. A device whose telemetry cannot be read is
/// reported unhealthy with the reason rather than dropped, so it never
/// silently vanishes; its health is read only when its telemetry was.
pub(crate) fn device_state(
    info: DeviceInfo,
    telemetry: Result<Telemetry, BackendError>,
    health: impl FnOnce(&DeviceInfo) -> Result<RawHealth, BackendError>,
) -> Result<DeviceState, BackendError> {
    let (telemetry, health) = match telemetry {
        Ok(telemetry) => (telemetry, health(&info)?),
        Err(e) => (
            Telemetry {
                memory_free_bytes: 0,
                ..Telemetry::default()
            },
            RawHealth::Unhealthy(format!("telemetry unreadable: {e}")),
        ),
    };
    Ok(DeviceState {
        info,
        telemetry,
        health,
    })
}

impl Snapshot {
    /// The state the agent publishes; `timestamp` is RFC 3339.
    pub fn to_gpu_state(&self, timestamp: Option<String>) -> NodeGpuState {
        NodeGpuState {
            version: GPU_STATE_VERSION.to_string(),
            backend: self.backend.clone(),
            devices: self
                .devices
                .iter()
                .map(|d| GpuDevice {
                    mig: d.info.mig.clone(),
                    id: d.info.id.clone(),
                    index: d.info.index,
                    vendor: d.info.vendor,
                    product: d.info.product.clone(),
                    memory_total_bytes: d.info.memory_total_bytes,
                    memory_free_bytes: d.telemetry.memory_free_bytes.min(d.info.memory_total_bytes),
                    fp16_tflops: d.info.fp16_tflops,
                    fp8_tflops: d.info.fp8_tflops,
                    fp4_tflops: d.info.fp4_tflops,
                    memory_bandwidth_gbps: d.info.memory_bandwidth_gbps,
                    temperature_c: d.telemetry.temperature_c,
                    power_w: d.telemetry.power_w,
                    numa_node: d.info.numa_node,
                    health: match d.health {
                        RawHealth::Healthy => Health::Healthy,
                        RawHealth::Unhealthy(_) => Health::Unhealthy,
                    },
                    health_reason: match &d.health {
                        RawHealth::Healthy => None,
                        RawHealth::Unhealthy(r) => Some(r.clone()),
                    },
                })
                .collect(),
            links: self
                .links
                .iter()
                .map(|l| GpuLink {
                    a: l.a.clone(),
                    b: l.b.clone(),
                    kind: l.kind,
                    bandwidth_gbps: l.bandwidth_gbps,
                })
                .collect(),
            timestamp,
            // The backend knows nothing of pods; the agent fills this in.
            allocated: std::collections::BTreeMap::new(),
            shares: Default::default(),
        }
    }
}

/// A device with made-up figures, for tests of code that reads only its
/// identity, vendor and PCI address.
#[cfg(test)]
pub(crate) fn test_device(id: &str, index: u32, vendor: Vendor, pci_bus_id: &str) -> DeviceInfo {
    DeviceInfo {
        id: id.to_string(),
        index,
        vendor,
        product: "test".into(),
        memory_total_bytes: 1 << 30,
        architecture: String::new(),
        compute_units: 1,
        fp16_tflops: 1.0,
        fp8_tflops: None,
        fp4_tflops: None,
        memory_bandwidth_gbps: 1.0,
        pci_bus_id: pci_bus_id.to_string(),
        numa_node: None,
        mig: None,
    }
}

/// A MIG mode with no partitions, for tests: `enabled` now, `pending` after
/// a reset.
#[cfg(test)]
pub(crate) fn test_mig(enabled: bool, pending: Option<bool>) -> MigState {
    MigState {
        enabled,
        pending,
        memory_slices: 8,
        multiprocessors: 132,
        partitions: Vec::new(),
        profiles: Vec::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tessera_core::api::GpuPartition;

    #[test]
    fn the_mig_state_reaches_the_published_state() {
        let mut info = test_device("GPU-1", 0, Vendor::Nvidia, "0000:17:00.0");
        info.mig = Some(MigState {
            enabled: true,
            pending: None,
            memory_slices: 8,
            multiprocessors: 1,
            partitions: vec![GpuPartition {
                id: "MIG-1".into(),
                profile: "7g.1gb".into(),
                memory_total_bytes: 1 << 30,
                multiprocessors: 1,
                placement_start: 0,
                placement_size: 8,
            }],
            profiles: Vec::new(),
        });
        let snapshot = Snapshot {
            backend: "test".into(),
            devices: vec![DeviceState {
                info: info.clone(),
                telemetry: Telemetry::default(),
                health: RawHealth::Healthy,
            }],
            links: Vec::new(),
        };
        let state = snapshot.to_gpu_state(None);
        state.validate().unwrap();
        assert_eq!(state.devices[0].mig, info.mig);
    }

    #[test]
    fn telemetry_without_error_counts_still_reads_and_omits_them() {
        let old = serde_json::json!({
            "temperatureC": 40.0, "powerW": null, "graphicsClockMhz": null,
            "memoryClockMhz": null, "utilizationPercent": 0,
            "memoryUsedBytes": 1, "memoryFreeBytes": 2
        });
        let telemetry: Telemetry = serde_json::from_value(old.clone()).unwrap();
        assert_eq!(telemetry.ecc_corrected_errors, None);
        assert_eq!(telemetry.xid_errors, None);
        assert_eq!(serde_json::to_value(&telemetry).unwrap(), old);

        let counted = Telemetry {
            ecc_corrected_errors: Some(3),
            ecc_uncorrected_errors: Some(0),
            xid_errors: Some(2),
            last_xid: Some(79),
            ..telemetry
        };
        let json = serde_json::to_value(&counted).unwrap();
        for key in [
            "eccCorrectedErrors",
            "eccUncorrectedErrors",
            "xidErrors",
            "lastXid",
        ] {
            assert!(json.get(key).is_some(), "{key} in {json}");
        }
        assert_eq!(serde_json::from_value::<Telemetry>(json).unwrap(), counted);
    }

    #[test]
    fn a_registry_entry_without_mig_still_reads() {
        let json = serde_json::to_value(test_device("GPU-1", 0, Vendor::Nvidia, "")).unwrap();
        assert!(json.get("mig").is_none(), "{json}");
        let info: DeviceInfo = serde_json::from_value(json).unwrap();
        assert_eq!(info.mig, None);
    }
}
