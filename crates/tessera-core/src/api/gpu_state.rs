//! `NodeGpuState`: what a node agent publishes about its GPUs in the
//! `tessera.dev/gpu-state` annotation, and what the controller plans against.
//!
//! The document is versioned. Readers ignore fields they do not know (so a newer
//! agent can add telemetry without breaking an older controller) but refuse a
//! version they do not speak, because a changed meaning of a known field would be
//! silently misread otherwise.

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use serde::{Deserialize, Serialize};

use super::limits::number;
use super::partitions::{GpuPartition, MigState};

/// The only version this build writes and reads.
pub const GPU_STATE_VERSION: &str = "v1";

/// Temperatures outside these cannot come from a working sensor: nothing is
/// colder than absolute zero, and solder melts well below the upper bound.
const ABSOLUTE_ZERO_C: f64 = -273.15;
const MAX_POSSIBLE_TEMPERATURE_C: f64 = 250.0;
/// Far beyond any accelerator (the largest today are near 5 PFLOPS dense FP16,
/// 8 TB/s of memory bandwidth and 2 TB/s NVLink): a larger figure is a unit error.
const MAX_POSSIBLE_TFLOPS: f64 = 1e6;
const MAX_POSSIBLE_GBPS: f64 = 1e6;

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct NodeGpuState {
    pub version: String,
    /// Which backend produced the state (`nvml`, `rocm`, `fake`, ...).
    pub backend: String,
    #[serde(default)]
    pub devices: Vec<GpuDevice>,
    /// Links between devices of this node. A pair without an entry talks over the host.
    #[serde(default)]
    pub links: Vec<GpuLink>,
    /// RFC 3339 time the state was read.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timestamp: Option<String>,
    /// Devices kubelet has handed to pods, as the agent's allocation record
    /// has them: device ID → UID of the pod holding it, or [`NodeGpuState::UNBOUND_OWNER`] (`"unbound"`)
    /// for a device given to a pod the agent could not identify (one without
    /// a planned binding). A pod's devices leave the map once the pod has
    /// ended. Absent when nothing is allocated; added within `v1`, so older
    /// readers simply ignore it. An entry may name a device the node no
    /// longer lists (it vanished while held); readers skip such entries.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub allocated: BTreeMap<String, String>,
    /// The parts of its GPUs the node hands out besides whole GPUs. Only a
    /// DRA driver can: the device plugin API hands out whole devices by ID.
    #[serde(default, skip_serializing_if = "SharesOffered::is_none")]
    pub shares: SharesOffered,
}

/// What parts of GPUs a node's agent hands out.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SharesOffered {
    /// MIG partitions of GPUs in MIG mode, each a device of its own.
    #[serde(default)]
    pub partitions: bool,
    /// Memory shares of whole GPUs (consumable capacity).
    #[serde(default)]
    pub memory: bool,
}

impl SharesOffered {
    fn is_none(&self) -> bool {
        *self == SharesOffered::default()
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Vendor {
    Nvidia,
    Amd,
    /// A vendor this build does not know; such devices are never planned on.
    #[serde(other)]
    Unknown,
}

impl Vendor {
    /// Every vendor tessera plans on (not `Unknown`). Resource names, the
    /// CRD's vendor rule and its validation all derive from this list, so a
    /// new vendor is one entry here plus its backend.
    pub const ALL: [Vendor; 2] = [Vendor::Nvidia, Vendor::Amd];

    pub fn as_str(self) -> &'static str {
        match self {
            Vendor::Nvidia => "nvidia",
            Vendor::Amd => "amd",
            Vendor::Unknown => "unknown",
        }
    }
}

impl std::fmt::Display for Vendor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Health {
    Healthy,
    Unhealthy,
    /// Written by a newer agent with a state this build does not know: treated as unhealthy.
    #[serde(other)]
    Unknown,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct GpuDevice {
    /// Stable identifier: the vendor UUID where one exists. Kubelet sees this ID.
    pub id: String,
    pub index: u32,
    pub vendor: Vendor,
    pub product: String,
    pub memory_total_bytes: u64,
    pub memory_free_bytes: u64,
    /// Estimated dense FP16/BF16 throughput.
    pub fp16_tflops: f64,
    /// Dense FP8 throughput, on a GPU with FP8 tensor cores (Ada, Hopper,
    /// Blackwell, MI300 and later). Without it FP8 weights are planned at the
    /// FP16 figure, and the plan says so.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fp8_tflops: Option<f64>,
    /// Dense FP4 throughput, on a GPU with FP4 tensor cores (Blackwell,
    /// MI350 and later); FP4 weights elsewhere are planned at the FP8 figure,
    /// or the FP16 one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fp4_tflops: Option<f64>,
    pub memory_bandwidth_gbps: f64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub temperature_c: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub power_w: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub numa_node: Option<i32>,
    pub health: Health,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub health_reason: Option<String>,
    /// NVIDIA MIG, on a GPU that has it: its mode and partitions. A GPU in
    /// MIG mode is planned as its partitions, never whole.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mig: Option<MigState>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LinkKind {
    Nvlink,
    Xgmi,
    Pcie,
    #[serde(other)]
    Unknown,
}

impl LinkKind {
    /// A direct GPU-to-GPU fabric: devices joined by it form one scale-up
    /// domain, where tensor groups belong.
    pub fn is_scale_up(self) -> bool {
        matches!(self, LinkKind::Nvlink | LinkKind::Xgmi)
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct GpuLink {
    /// Device IDs of both ends.
    pub a: String,
    pub b: String,
    pub kind: LinkKind,
    /// Both directions together, the way NVLink (900 GB/s on H100) and xGMI are
    /// quoted; PCIe Gen4 x16 is about 64.
    pub bandwidth_gbps: f64,
}

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum GpuStateError {
    #[error("gpu-state is not valid JSON for this schema: {0}")]
    Malformed(String),
    #[error(
        "gpu-state version {found:?} is not supported (this build reads {GPU_STATE_VERSION:?}); upgrade tessera or the node agent so both speak the same version"
    )]
    WrongVersion { found: String },
    #[error("gpu-state is invalid: {0}")]
    Invalid(String),
}

impl NodeGpuState {
    /// The owner in [`NodeGpuState::allocated`] of a device handed to a pod
    /// the agent could not identify.
    pub const UNBOUND_OWNER: &'static str = "unbound";

    /// The device a plan names by `id`: a GPU, or a GPU and its partition
    /// with that ID.
    pub fn find_device(&self, id: &str) -> Option<(&GpuDevice, Option<&GpuPartition>)> {
        self.devices.iter().find_map(|gpu| {
            if gpu.id == id {
                return Some((gpu, None));
            }
            let partition = gpu.mig.as_ref()?.partitions.iter().find(|p| p.id == id)?;
            Some((gpu, Some(partition)))
        })
    }

    /// The state's text as a Node carries it (the `tessera.dev/gpu-state`
    /// annotation), if it does.
    pub fn annotation_of(meta: &ObjectMeta) -> Option<&str> {
        meta.annotations
            .as_ref()?
            .get(super::GPU_STATE_ANNOTATION)
            .map(String::as_str)
    }

    /// Parses the annotation value, checking the version before the body so a
    /// future format gets the version error rather than a confusing field error.
    /// Fields this build does not know are ignored: a newer agent may add them.
    pub fn from_json(text: &str) -> Result<Self, GpuStateError> {
        Self::from_json_listing_unknown(text).map(|(state, _)| state)
    }

    /// [`NodeGpuState::from_json`], also returning the paths of the fields it
    /// ignored (`devices[0].temperatureCelsius`), so a strict reader can refuse
    /// them and a tolerant one can say what it skipped.
    pub fn from_json_listing_unknown(text: &str) -> Result<(Self, Vec<String>), GpuStateError> {
        #[derive(Deserialize)]
        struct VersionOnly {
            version: Option<serde_json::Value>,
        }
        let head: VersionOnly =
            serde_json::from_str(text).map_err(|e| GpuStateError::Malformed(e.to_string()))?;
        match head.version {
            Some(serde_json::Value::String(v)) if v == GPU_STATE_VERSION => {}
            Some(other) => {
                let found = match other {
                    serde_json::Value::String(s) => s,
                    v => v.to_string(),
                };
                return Err(GpuStateError::WrongVersion { found });
            }
            None => return Err(GpuStateError::Malformed("missing field `version`".into())),
        }
        let mut unknown = Vec::new();
        let mut json = serde_json::Deserializer::from_str(text);
        let state: NodeGpuState = serde_ignored::deserialize(&mut json, |path| {
            unknown.push(path.to_string());
        })
        .map_err(|e| GpuStateError::Malformed(e.to_string()))?;
        state.validate()?;
        Ok((state, unknown))
    }

    pub fn to_json(&self) -> String {
        // Serializing plain structs of strings and numbers cannot fail.
        serde_json::to_string(self).unwrap_or_default()
    }

    /// Rejects states whose numbers cannot describe a real device, so the solver
    /// never has to reason about them.
    pub fn validate(&self) -> Result<(), GpuStateError> {
        let mut ids = std::collections::BTreeSet::new();
        let mut indices = BTreeMap::new();
        for device in &self.devices {
            if device.id.trim().is_empty() {
                return Err(GpuStateError::Invalid(format!(
                    "device {} has an empty id",
                    device.index
                )));
            }
            if !ids.insert(device.id.as_str()) {
                return Err(GpuStateError::Invalid(format!(
                    "device id {} appears twice",
                    device.id
                )));
            }
            if device.memory_total_bytes == 0 {
                return Err(GpuStateError::Invalid(format!(
                    "device {} reports zero total memory",
                    device.id
                )));
            }
            if device.memory_free_bytes > device.memory_total_bytes {
                return Err(GpuStateError::Invalid(format!(
                    "device {} reports more free memory ({}) than total ({})",
                    device.id, device.memory_free_bytes, device.memory_total_bytes
                )));
            }
            let low_precision = [
                ("fp8Tflops", device.fp8_tflops),
                ("fp4Tflops", device.fp4_tflops),
            ]
            .into_iter()
            .filter_map(|(what, v)| Some((what, v?, MAX_POSSIBLE_TFLOPS)));
            for (what, v, max) in [
                ("fp16Tflops", device.fp16_tflops, MAX_POSSIBLE_TFLOPS),
                (
                    "memoryBandwidthGbps",
                    device.memory_bandwidth_gbps,
                    MAX_POSSIBLE_GBPS,
                ),
            ]
            .into_iter()
            .chain(low_precision)
            {
                if !(v.is_finite() && v > 0.0 && v <= max) {
                    return Err(GpuStateError::Invalid(format!(
                        "device {} has {what} {}; it must be a positive number of at most {}",
                        device.id,
                        number(v),
                        number(max)
                    )));
                }
            }
            if let Some(t) = device.temperature_c
                && !(t.is_finite() && t > ABSOLUTE_ZERO_C && t <= MAX_POSSIBLE_TEMPERATURE_C)
            {
                return Err(GpuStateError::Invalid(format!(
                    "device {} has temperatureC {}; a GPU reads above {ABSOLUTE_ZERO_C} °C (absolute zero) and at most {MAX_POSSIBLE_TEMPERATURE_C} °C",
                    device.id,
                    number(t)
                )));
            }
            if let Some(w) = device.power_w
                && !(w.is_finite() && w >= 0.0)
            {
                return Err(GpuStateError::Invalid(format!(
                    "device {} has powerW {w}; it must be zero or more",
                    device.id
                )));
            }
            if let Some(n) = device.numa_node
                && n < -1
            {
                return Err(GpuStateError::Invalid(format!(
                    "device {} has numaNode {n}; it must be a node number, or -1 for none",
                    device.id
                )));
            }
            if let Some(mig) = &device.mig {
                if let Some(problem) = mig.problem(&device.id, device.memory_total_bytes) {
                    return Err(GpuStateError::Invalid(problem));
                }
                for partition in &mig.partitions {
                    if !ids.insert(partition.id.as_str()) {
                        return Err(GpuStateError::Invalid(format!(
                            "device id {} appears twice",
                            partition.id
                        )));
                    }
                }
            }
            if let Some(other) = indices.insert(device.index, device.id.as_str()) {
                return Err(GpuStateError::Invalid(format!(
                    "devices {other} and {} both have index {}",
                    device.id, device.index
                )));
            }
        }
        for link in &self.links {
            for end in [&link.a, &link.b] {
                if !ids.contains(end.as_str()) {
                    return Err(GpuStateError::Invalid(format!(
                        "link {}-{} names unknown device {end}",
                        link.a, link.b
                    )));
                }
            }
            if link.a == link.b {
                return Err(GpuStateError::Invalid(format!(
                    "link from {} to itself",
                    link.a
                )));
            }
            if !(link.bandwidth_gbps.is_finite()
                && link.bandwidth_gbps >= 0.0
                && link.bandwidth_gbps <= MAX_POSSIBLE_GBPS)
            {
                return Err(GpuStateError::Invalid(format!(
                    "link {}-{} has bandwidthGbps {}; it must be 0 to {}",
                    link.a,
                    link.b,
                    number(link.bandwidth_gbps),
                    number(MAX_POSSIBLE_GBPS)
                )));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> NodeGpuState {
        NodeGpuState {
            version: GPU_STATE_VERSION.into(),
            backend: "fake".into(),
            devices: vec![GpuDevice {
                mig: None,
                id: "GPU-a".into(),
                index: 0,
                vendor: Vendor::Nvidia,
                product: "NVIDIA H100 80GB HBM3".into(),
                memory_total_bytes: 80 << 30,
                memory_free_bytes: 79 << 30,
                fp16_tflops: 989.0,
                fp8_tflops: None,
                fp4_tflops: None,
                memory_bandwidth_gbps: 3350.0,
                temperature_c: Some(40.0),
                power_w: None,
                numa_node: Some(0),
                health: Health::Healthy,
                health_reason: None,
            }],
            links: vec![],
            timestamp: None,
            allocated: BTreeMap::new(),
            shares: Default::default(),
        }
    }

    #[test]
    fn every_known_vendor_reads_back_from_its_name() {
        for vendor in Vendor::ALL {
            let read: Vendor = serde_json::from_value(serde_json::json!(vendor.as_str())).unwrap();
            assert_eq!(read, vendor);
        }
        assert!(!Vendor::ALL.contains(&Vendor::Unknown));
    }

    #[test]
    fn only_gpu_to_gpu_fabrics_are_scale_up_domains() {
        assert!(LinkKind::Nvlink.is_scale_up());
        assert!(LinkKind::Xgmi.is_scale_up());
        assert!(!LinkKind::Pcie.is_scale_up());
        assert!(!LinkKind::Unknown.is_scale_up());
    }

    #[test]
    fn round_trips() {
        let s = sample();
        assert_eq!(NodeGpuState::from_json(&s.to_json()).unwrap(), s);
    }

    #[test]
    fn unknown_fields_and_values_are_tolerated() {
        let mut v: serde_json::Value = serde_json::from_str(&sample().to_json()).unwrap();
        v["futureField"] = serde_json::json!({"x": 1});
        v["devices"][0]["eccErrors"] = serde_json::json!(3);
        v["devices"][0]["vendor"] = serde_json::json!("intel");
        v["devices"][0]["health"] = serde_json::json!("Degraded");
        let s = NodeGpuState::from_json(&v.to_string()).unwrap();
        assert_eq!(s.devices[0].vendor, Vendor::Unknown);
        assert_eq!(s.devices[0].health, Health::Unknown);
    }

    #[test]
    fn unknown_fields_are_listed_by_path() {
        let mut v: serde_json::Value = serde_json::from_str(&sample().to_json()).unwrap();
        v["devices"][0]["temperatureCelsius"] = serde_json::json!(95);
        v["futureField"] = serde_json::json!(1);
        let (state, unknown) = NodeGpuState::from_json_listing_unknown(&v.to_string()).unwrap();
        assert_eq!(state, sample());
        assert_eq!(unknown, vec!["devices.0.temperatureCelsius", "futureField"]);
        let (_, none) = NodeGpuState::from_json_listing_unknown(&sample().to_json()).unwrap();
        assert!(none.is_empty());
    }

    #[test]
    fn possible_telemetry_at_its_bounds_is_accepted() {
        for t in [-273.0, 0.0, 84.6, 250.0] {
            let mut s = sample();
            s.devices[0].temperature_c = Some(t);
            s.devices[0].power_w = Some(0.0);
            s.devices[0].numa_node = Some(-1);
            assert!(NodeGpuState::from_json(&s.to_json()).is_ok(), "{t}");
        }
    }

    #[test]
    fn the_allocated_map_is_optional_and_round_trips() {
        let mut s = sample();
        let text = s.to_json();
        assert!(!text.contains("allocated"), "empty: omitted: {text}");
        // A state written before the field existed reads as "nothing allocated".
        assert!(NodeGpuState::from_json(&text).unwrap().allocated.is_empty());
        s.allocated.insert("GPU-a".into(), "9d1c-uid".into());
        s.allocated
            .insert("GPU-gone".into(), NodeGpuState::UNBOUND_OWNER.into());
        let v: serde_json::Value = serde_json::from_str(&s.to_json()).unwrap();
        assert_eq!(
            v["allocated"],
            serde_json::json!({"GPU-a": "9d1c-uid", "GPU-gone": "unbound"})
        );
        assert_eq!(NodeGpuState::from_json(&s.to_json()).unwrap(), s);
    }

    #[test]
    fn a_malformed_allocated_map_is_malformed() {
        for bad in [r#"["GPU-a"]"#, r#"{"GPU-a": 3}"#, r#""GPU-a""#] {
            let mut v: serde_json::Value = serde_json::from_str(&sample().to_json()).unwrap();
            v["allocated"] = serde_json::from_str(bad).unwrap();
            assert!(
                matches!(
                    NodeGpuState::from_json(&v.to_string()),
                    Err(GpuStateError::Malformed(_))
                ),
                "{bad}"
            );
        }
    }

    #[test]
    fn wrong_version_is_named() {
        let text = sample().to_json().replace("\"v1\"", "\"v9\"");
        let err = NodeGpuState::from_json(&text).unwrap_err();
        assert_eq!(err, GpuStateError::WrongVersion { found: "v9".into() });
        assert!(err.to_string().contains("\"v9\" is not supported"));
        let err = NodeGpuState::from_json(r#"{"version": 2}"#).unwrap_err();
        assert_eq!(err, GpuStateError::WrongVersion { found: "2".into() });
    }

    #[test]
    fn malformed_is_an_error() {
        for text in ["", "{", "[]", r#"{"backend":"x"}"#, r#"{"version":"v1"}"#] {
            assert!(
                matches!(
                    NodeGpuState::from_json(text),
                    Err(GpuStateError::Malformed(_))
                ),
                "{text}"
            );
        }
    }

    #[test]
    fn impossible_numbers_are_refused() {
        type Mutation = fn(&mut NodeGpuState);
        let cases: Vec<(Mutation, &str)> = vec![
            (|s| s.devices[0].memory_total_bytes = 0, "zero total"),
            (
                |s| s.devices[0].memory_free_bytes = 81 << 30,
                "more free memory",
            ),
            (|s| s.devices[0].fp16_tflops = -1.0, "fp16Tflops"),
            (|s| s.devices[0].fp8_tflops = Some(0.0), "fp8Tflops 0"),
            (
                |s| s.devices[0].fp4_tflops = Some(-3.0),
                "fp4Tflops -3; it must be a positive number",
            ),
            (|s| s.devices[0].id = " ".into(), "empty id"),
            (|s| s.devices.push(s.devices[0].clone()), "appears twice"),
            (
                |s| {
                    let mut twin = s.devices[0].clone();
                    twin.id = "GPU-b".into();
                    s.devices.push(twin);
                },
                "devices GPU-a and GPU-b both have index 0",
            ),
            (
                |s| s.devices[0].temperature_c = Some(-300.0),
                "temperatureC -300",
            ),
            (
                |s| s.devices[0].temperature_c = Some(-273.15),
                "absolute zero",
            ),
            (
                |s| s.devices[0].temperature_c = Some(1e9),
                "temperatureC 1e9; a GPU reads above",
            ),
            (|s| s.devices[0].power_w = Some(-5.0), "powerW -5"),
            (
                |s| s.devices[0].fp16_tflops = 1e300,
                "fp16Tflops 1e300; it must be a positive number of at most 1000000",
            ),
            (|s| s.devices[0].numa_node = Some(-2), "numaNode -2"),
            (
                |s| {
                    s.links.push(GpuLink {
                        a: "GPU-a".into(),
                        b: "GPU-z".into(),
                        kind: LinkKind::Nvlink,
                        bandwidth_gbps: 1.0,
                    })
                },
                "unknown device GPU-z",
            ),
        ];
        for (mutate, want) in cases {
            let mut s = sample();
            mutate(&mut s);
            let err = NodeGpuState::from_json(&s.to_json()).unwrap_err();
            assert!(err.to_string().contains(want), "{err} lacks {want}");
        }
    }
}
