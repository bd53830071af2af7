//! Fake GPUs for kind clusters, demos and tests: devices, telemetry and links
//! from a short spec (`4xH100-80GiB,2xMI300X-192GiB`) or a YAML file. Everything
//! is deterministic. A file is re-read on every call, so faults can be injected
//! and cleared while the agent runs:
//!
//! ```yaml
//! gpus:
//!   - {profile: H100-80GiB, count: 4}
//! faults:
//!   - {device: 1, unhealthy: "Xid 79: GPU has fallen off the bus"}
//!   - {device: 2, temperatureC: 96}
//!   - {device: 3, vanish: true}
//!   - {device: 0, memoryUsedGiB: 30, eccCorrected: 3, eccUncorrected: 1, xid: 79}
//! ```
//! Removing a fault line recovers the device (a device's faults go on one
//! line: only its first line counts). ECC and Xid faults only set the counts
//! telemetry reports (every profile but the GeForce one has ECC on, at zero
//! errors unless told; NVIDIA profiles count Xids, one for an `xid` fault,
//! whose code is the last Xid's): health stays as `unhealthy` says.
//!
//! A group of NVIDIA GPUs that have MIG (H100-80GiB, A100-80GiB, A100-40GiB)
//! may give their MIG mode and partitions (`mig: {partitions: [3g.40gb,
//! 2g.20gb]}`; see `fake_mig`).
//!
//! A **directory** gives each node its own file: `<dir>/<node name>.yaml` when
//! it exists, else `<dir>/default.yaml` (e.g. a ConfigMap mounted at `<dir>`
//! mapping kind node names to GPU profiles). The choice is made again on every
//! read, so a file that appears, disappears or is swapped in (kubelet updates a
//! ConfigMap volume by switching its `..data` symlink) takes effect while the
//! agent runs.

use std::path::{Path, PathBuf};

use serde::Deserialize;

use super::fake_mig::{FakeGpu, FakeMig};
use super::mig_table::{A100_40GB, A100_80GB, H100_80GB, MigTable};
use super::{BackendError, DeviceInfo, DeviceLink, GpuBackend, RawHealth, Telemetry};
use tessera_core::api::{GIB, LinkKind, Vendor};

/// Environment variable naming the fake devices: a spec or a file path.
pub(crate) const ENV_VAR: &str = "TESSERA_FAKE_GPUS";
/// The backend's name, as snapshots carry it.
pub(crate) const BACKEND_NAME: &str = "fake";

/// A GPU model the fake backend can pretend to be (datasheet numbers).
#[derive(Clone, Copy, Debug, PartialEq)]
struct Profile {
    name: &'static str,
    vendor: Vendor,
    product: &'static str,
    memory_gib: f64,
    architecture: &'static str,
    compute_units: u32,
    fp16_tflops: f64,
    /// Dense FP8 and FP4 rates, where the product's tensor cores have them.
    fp8_tflops: Option<f64>,
    fp4_tflops: Option<f64>,
    memory_bandwidth_gbps: f64,
    idle_power_w: f64,
    /// Whether it reports ECC error counts (ECC on, as the card ships).
    ecc: bool,
    /// Link between two devices of this kind in one node.
    link: LinkKind,
    link_gbps: f64,
    /// Its MIG profiles, for a GPU that has MIG.
    mig: Option<&'static MigTable>,
}

const PROFILES: &[Profile] = &[
    Profile {
        name: "H100-80GiB",
        vendor: Vendor::Nvidia,
        product: "NVIDIA H100 80GB HBM3",
        memory_gib: 80.0,
        architecture: "9.0",
        compute_units: 132,
        fp16_tflops: 989.0,
        fp8_tflops: Some(1979.0),
        fp4_tflops: None,
        memory_bandwidth_gbps: 3350.0,
        idle_power_w: 115.0,
        ecc: true,
        link: LinkKind::Nvlink,
        link_gbps: 900.0,
        mig: Some(&H100_80GB),
    },
    Profile {
        name: "A100-80GiB",
        vendor: Vendor::Nvidia,
        product: "NVIDIA A100-SXM4-80GB",
        memory_gib: 80.0,
        architecture: "8.0",
        compute_units: 108,
        fp16_tflops: 312.0,
        fp8_tflops: None,
        fp4_tflops: None,
        memory_bandwidth_gbps: 2039.0,
        idle_power_w: 60.0,
        ecc: true,
        link: LinkKind::Nvlink,
        link_gbps: 600.0,
        mig: Some(&A100_80GB),
    },
    Profile {
        name: "A100-40GiB",
        vendor: Vendor::Nvidia,
        product: "NVIDIA A100-PCIE-40GB",
        memory_gib: 40.0,
        architecture: "8.0",
        compute_units: 108,
        fp16_tflops: 312.0,
        fp8_tflops: None,
        fp4_tflops: None,
        memory_bandwidth_gbps: 1555.0,
        idle_power_w: 38.0,
        ecc: true,
        link: LinkKind::Pcie,
        link_gbps: 64.0,
        mig: Some(&A100_40GB),
    },
    Profile {
        name: "L4-24GiB",
        vendor: Vendor::Nvidia,
        product: "NVIDIA L4",
        memory_gib: 24.0,
        architecture: "8.9",
        compute_units: 58,
        fp16_tflops: 121.0,
        fp8_tflops: Some(242.0),
        fp4_tflops: None,
        memory_bandwidth_gbps: 300.0,
        idle_power_w: 16.0,
        ecc: true,
        link: LinkKind::Pcie,
        link_gbps: 64.0,
        mig: None,
    },
    Profile {
        name: "RTX4090-24GiB",
        vendor: Vendor::Nvidia,
        product: "NVIDIA GeForce RTX 4090",
        memory_gib: 24.0,
        architecture: "8.9",
        compute_units: 128,
        fp16_tflops: 165.0,
        fp8_tflops: Some(330.0),
        fp4_tflops: None,
        memory_bandwidth_gbps: 1008.0,
        idle_power_w: 22.0,
        ecc: false,
        link: LinkKind::Pcie,
        link_gbps: 64.0,
        mig: None,
    },
    Profile {
        name: "MI300X-192GiB",
        vendor: Vendor::Amd,
        product: "AMD Instinct MI300X",
        memory_gib: 192.0,
        architecture: "gfx942",
        compute_units: 304,
        fp16_tflops: 1307.0,
        fp8_tflops: Some(2615.0),
        fp4_tflops: None,
        memory_bandwidth_gbps: 5300.0,
        idle_power_w: 150.0,
        ecc: true,
        link: LinkKind::Xgmi,
        link_gbps: 128.0,
        mig: None,
    },
    Profile {
        name: "MI210-64GiB",
        vendor: Vendor::Amd,
        product: "AMD Instinct MI210",
        memory_gib: 64.0,
        architecture: "gfx90a",
        compute_units: 104,
        fp16_tflops: 181.0,
        fp8_tflops: None,
        fp4_tflops: None,
        memory_bandwidth_gbps: 1638.0,
        idle_power_w: 40.0,
        ecc: true,
        link: LinkKind::Pcie,
        link_gbps: 64.0,
        mig: None,
    },
];

/// Memory a fresh device shows as used (driver and context reserve).
const RESERVED_BYTES: u64 = 512 << 20;

fn profile(name: &str) -> Option<&'static Profile> {
    PROFILES.iter().find(|p| p.name.eq_ignore_ascii_case(name))
}

fn mig_profile_names() -> String {
    PROFILES
        .iter()
        .filter(|p| p.mig.is_some())
        .map(|p| p.name)
        .collect::<Vec<_>>()
        .join(", ")
}

fn profile_names() -> String {
    PROFILES
        .iter()
        .map(|p| p.name)
        .collect::<Vec<_>>()
        .join(", ")
}

#[derive(Clone, Debug, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
struct FakeFile {
    gpus: Vec<GpuGroup>,
    #[serde(default)]
    faults: Vec<Fault>,
}

#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
struct GpuGroup {
    profile: String,
    #[serde(default = "one")]
    count: u32,
    #[serde(default)]
    mig: Option<FakeMig>,
}

fn one() -> u32 {
    1
}

#[derive(Clone, Debug, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct Fault {
    device: u32,
    #[serde(default)]
    unhealthy: Option<String>,
    #[serde(default)]
    temperature_c: Option<f64>,
    #[serde(default)]
    vanish: bool,
    #[serde(default, rename = "memoryUsedGiB")]
    memory_used_gib: Option<f64>,
    #[serde(default)]
    ecc_corrected: Option<u64>,
    #[serde(default)]
    ecc_uncorrected: Option<u64>,
    /// One Xid error with this code.
    #[serde(default)]
    xid: Option<u64>,
}

/// Parses `4xH100-80GiB,2xMI300X-192GiB` (count defaults to 1).
fn parse_spec(spec: &str) -> Result<FakeFile, BackendError> {
    let mut gpus = Vec::new();
    for part in spec.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let (count, name) = match part.split_once(['x', 'X']) {
            Some((digits, name))
                if !digits.is_empty() && digits.chars().all(|c| c.is_ascii_digit()) =>
            {
                let count = digits.parse::<u32>().map_err(|_| {
                    BackendError::Failed(format!(
                        "fake GPUs: {part:?} has a count that is too large"
                    ))
                })?;
                (count, name)
            }
            _ => (1, part),
        };
        gpus.push(GpuGroup {
            profile: name.to_string(),
            count,
            mig: None,
        });
    }
    let file = FakeFile {
        gpus,
        faults: Vec::new(),
    };
    check(&file, spec)?;
    Ok(file)
}

fn check(file: &FakeFile, origin: &str) -> Result<(), BackendError> {
    if file.gpus.is_empty() {
        return Err(BackendError::Failed(format!(
            "fake GPUs {origin:?}: no GPUs given (e.g. \"4xH100-80GiB\")"
        )));
    }
    let mut total: u64 = 0;
    let mut profiles: Vec<&Profile> = Vec::new();
    for (index, group) in file.gpus.iter().enumerate() {
        let Some(known) = profile(&group.profile) else {
            return Err(BackendError::Failed(format!(
                "fake GPUs {origin:?}: unknown profile {:?}; known profiles: {}",
                group.profile,
                profile_names()
            )));
        };
        if let Some(mig) = &group.mig {
            let field = format!("gpus[{index}].mig");
            let Some(table) = known.mig else {
                return Err(BackendError::Failed(format!(
                    "fake GPUs {origin:?}: {field}: {} has no MIG; the profiles with MIG: {}",
                    known.name,
                    mig_profile_names()
                )));
            };
            mig.layout(table, &field)
                .map_err(|why| BackendError::Failed(format!("fake GPUs {origin:?}: {why}")))?;
        }
        if group.count == 0 {
            return Err(BackendError::Failed(format!(
                "fake GPUs {origin:?}: count for {} must be at least 1",
                group.profile
            )));
        }
        total += u64::from(group.count);
        if total <= 256 {
            profiles.extend(std::iter::repeat_n(known, group.count as usize));
        }
    }
    if total > 256 {
        return Err(BackendError::Failed(format!(
            "fake GPUs {origin:?}: {total} devices on one node is more than 256"
        )));
    }
    for fault in &file.faults {
        if u64::from(fault.device) >= total {
            return Err(BackendError::Failed(format!(
                "fake GPUs {origin:?}: a fault names device {} but there are {total}",
                fault.device
            )));
        }
        if let Some(temperature) = fault.temperature_c
            && !temperature.is_finite()
        {
            return Err(BackendError::Failed(format!(
                "fake GPUs {origin:?}: temperature of device {} is not a number",
                fault.device
            )));
        }
        if let Some(memory_used_gib) = fault.memory_used_gib
            && !(memory_used_gib.is_finite() && memory_used_gib >= 0.0)
        {
            return Err(BackendError::Failed(format!(
                "fake GPUs {origin:?}: memoryUsedGiB of device {} must be zero or more",
                fault.device
            )));
        }
        // Checked above: the device is one of `profiles`.
        let Some(known) = profiles.get(fault.device as usize) else {
            continue;
        };
        if (fault.ecc_corrected.is_some() || fault.ecc_uncorrected.is_some()) && !known.ecc {
            return Err(BackendError::Failed(format!(
                "fake GPUs {origin:?}: device {} ({}) has no ECC to count errors with",
                fault.device, known.name
            )));
        }
        if fault.xid.is_some() && known.vendor != Vendor::Nvidia {
            return Err(BackendError::Failed(format!(
                "fake GPUs {origin:?}: device {} ({}) cannot report an Xid: Xid errors are NVIDIA's",
                fault.device, known.name
            )));
        }
    }
    Ok(())
}

enum Source {
    Spec(FakeFile),
    File(PathBuf),
    /// A directory of per-node files, and the node's name (if known).
    Dir {
        dir: PathBuf,
        node: Option<String>,
        /// The file read last, to log when another one is chosen.
        chosen: PathBuf,
    },
}

/// The file of a directory source: `<dir>/<node>.yaml` if it exists, else
/// `<dir>/default.yaml`. A node name that could step outside the directory
/// (a `/`, or a leading `.`) is never used; real node names cannot have them.
fn resolve_in_dir(dir: &Path, node: Option<&str>) -> Result<PathBuf, BackendError> {
    let node = node.map(str::trim).filter(|n| !n.is_empty());
    let usable = node.filter(|n| !n.contains(['/', '\\']) && !n.starts_with('.'));
    let per_node = usable.map(|n| dir.join(format!("{n}.yaml")));
    if let Some(path) = &per_node
        && path.exists()
    {
        return Ok(path.clone());
    }
    let default = dir.join("default.yaml");
    if default.exists() {
        return Ok(default);
    }
    let why = match (node, &per_node) {
        (Some(_), Some(path)) => format!(
            "neither {} nor {} exists",
            path.display(),
            default.display()
        ),
        (Some(n), None) => format!(
            "the node name {n:?} cannot name a file, and {} does not exist",
            default.display()
        ),
        (None, _) => format!(
            "no node name is known (set NODE_NAME, or --node-name for the agent), so \
             {} is needed, and it does not exist",
            default.display()
        ),
    };
    Err(BackendError::Failed(format!(
        "fake GPUs {} is a directory of per-node files{}: {why}",
        dir.display(),
        node.map_or(String::new(), |n| format!(" (this node: {n})"))
    )))
}

pub struct FakeBackend {
    source: Source,
    /// The last good description, kept when a file edit is malformed mid-way.
    current: FakeFile,
}

impl FakeBackend {
    /// From a spec (`4xH100-80GiB`) or, if it names an existing file or ends in
    /// `.yaml`/`.yml`, from that file. A directory needs `default.yaml`
    /// (there is no node name here; see `FakeBackend::for_node`).
    pub fn new(spec_or_path: &str) -> Result<Self, BackendError> {
        Self::for_node(spec_or_path, None)
    }

    /// As [`FakeBackend::new`], and an existing directory is read as per-node
    /// files: `<dir>/<node>.yaml`, else `<dir>/default.yaml`.
    pub(crate) fn for_node(spec_or_path: &str, node: Option<&str>) -> Result<Self, BackendError> {
        let as_dir = Path::new(spec_or_path);
        if as_dir.is_dir() {
            let dir = as_dir.to_path_buf();
            let chosen = resolve_in_dir(&dir, node)?;
            let current = read_file(&chosen)?;
            tracing::info!(file = %chosen.display(), "fake GPUs from a per-node directory");
            return Ok(Self {
                source: Source::Dir {
                    dir,
                    node: node.map(str::to_string),
                    chosen,
                },
                current,
            });
        }
        let looks_like_file = spec_or_path.ends_with(".yaml")
            || spec_or_path.ends_with(".yml")
            || spec_or_path.contains('/')
            || Path::new(spec_or_path).is_file();
        if looks_like_file {
            let path = PathBuf::from(spec_or_path);
            let current = read_file(&path)?;
            Ok(Self {
                source: Source::File(path),
                current,
            })
        } else {
            let current = parse_spec(spec_or_path)?;
            Ok(Self {
                source: Source::Spec(current.clone()),
                current,
            })
        }
    }

    /// Re-reads a file source. A file that is briefly missing or half-written
    /// keeps the last good state (with a warning) instead of dropping devices.
    fn refresh(&mut self) {
        match &mut self.source {
            Source::Spec(f) => self.current = f.clone(),
            Source::File(path) => match read_file(path) {
                Ok(f) => self.current = f,
                Err(e) => {
                    tracing::warn!(error = %e, "fake GPU file unreadable; keeping the last state")
                }
            },
            Source::Dir { dir, node, chosen } => {
                match resolve_in_dir(dir, node.as_deref()).and_then(|p| Ok((read_file(&p)?, p))) {
                    Ok((f, path)) => {
                        if path != *chosen {
                            tracing::info!(file = %path.display(), "fake GPUs now from another file");
                            *chosen = path;
                        }
                        self.current = f;
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "fake GPU file unreadable; keeping the last state")
                    }
                }
            }
        }
    }

    /// Every GPU: its position, profile, and group (with the group's index).
    fn expanded(&self) -> Vec<(u32, &'static Profile, (usize, &GpuGroup))> {
        let mut expanded = Vec::new();
        for (index, group) in self.current.gpus.iter().enumerate() {
            if let Some(known_profile) = profile(&group.profile) {
                for _ in 0..group.count {
                    expanded.push((expanded.len() as u32, known_profile, (index, group)));
                }
            }
        }
        expanded
    }

    fn fault(&self, index: u32) -> Option<&Fault> {
        self.current.faults.iter().find(|f| f.device == index)
    }

    /// The original position of a device (its fault key) from its id.
    fn position(id: &str) -> Option<u32> {
        id.rsplit('-').next()?.parse().ok()
    }
}

fn read_file(path: &Path) -> Result<FakeFile, BackendError> {
    let origin = path.display().to_string();
    let text = std::fs::read_to_string(path)
        .map_err(|e| BackendError::Failed(format!("fake GPUs {origin}: {e}")))?;
    let file: FakeFile = serde_saphyr::from_str(&text).map_err(|e| {
        BackendError::Failed(format!("fake GPUs {origin}: {}", yaml_error(&text, &e)))
    })?;
    check(&file, &origin)?;
    Ok(file)
}

fn device_id(profile: &Profile, position: u32) -> String {
    format!("fake-{}-{position}", profile.name.to_ascii_lowercase())
}

impl GpuBackend for FakeBackend {
    fn name(&self) -> &'static str {
        BACKEND_NAME
    }

    fn devices(&mut self) -> Result<Vec<DeviceInfo>, BackendError> {
        self.refresh();
        let mut devices = Vec::new();
        for (position, profile, (group_index, group)) in self.expanded() {
            if self.fault(position).is_some_and(|f| f.vanish) {
                continue;
            }
            // Index is the position among present devices, as a driver numbers them.
            let index = devices.len() as u32;
            let id = device_id(profile, position);
            // The layout was checked when the file was read.
            let mig = group
                .mig
                .as_ref()
                .zip(profile.mig)
                .and_then(|(mig, table)| {
                    let gpu = FakeGpu {
                        id: &id,
                        multiprocessors: profile.compute_units,
                    };
                    mig.state(table, &gpu, &format!("gpus[{group_index}].mig"))
                        .ok()
                });
            devices.push(DeviceInfo {
                id,
                index,
                vendor: profile.vendor,
                product: profile.product.to_string(),
                memory_total_bytes: (profile.memory_gib * GIB) as u64,
                architecture: profile.architecture.to_string(),
                compute_units: profile.compute_units,
                fp16_tflops: profile.fp16_tflops,
                fp8_tflops: profile.fp8_tflops,
                fp4_tflops: profile.fp4_tflops,
                memory_bandwidth_gbps: profile.memory_bandwidth_gbps,
                pci_bus_id: format!("0000:{:02x}:00.0", 0x10 + position),
                numa_node: Some(i32::from(position >= 4)),
                mig,
            });
        }
        Ok(devices)
    }

    fn telemetry(&mut self, device: &DeviceInfo) -> Result<Telemetry, BackendError> {
        let position = Self::position(&device.id)
            .ok_or_else(|| BackendError::Failed(format!("{} is not a fake device", device.id)))?;
        let fault = self.fault(position);
        let known = profile_of(device);
        let idle_power = known.map_or(50.0, |p| p.idle_power_w);
        let ecc = known.is_some_and(|p| p.ecc);
        let xids = known.is_some_and(|p| p.vendor == Vendor::Nvidia);
        let ecc_count = |injected: Option<u64>| injected.or(ecc.then_some(0));
        let xid = fault.and_then(|f| f.xid);
        let used = match fault.and_then(|f| f.memory_used_gib) {
            Some(gib) => ((gib * GIB) as u64).min(device.memory_total_bytes),
            None => RESERVED_BYTES.min(device.memory_total_bytes),
        };
        Ok(Telemetry {
            temperature_c: Some(
                fault
                    .and_then(|f| f.temperature_c)
                    .unwrap_or(34.0 + f64::from(position % 8)),
            ),
            power_w: Some(idle_power),
            graphics_clock_mhz: Some(1410),
            memory_clock_mhz: Some(1593),
            utilization_percent: Some(0),
            memory_used_bytes: used,
            memory_free_bytes: device.memory_total_bytes - used,
            ecc_corrected_errors: ecc_count(fault.and_then(|f| f.ecc_corrected)),
            ecc_uncorrected_errors: ecc_count(fault.and_then(|f| f.ecc_uncorrected)),
            xid_errors: xids.then_some(u64::from(xid.is_some())),
            last_xid: xid,
        })
    }

    fn health(&mut self, device: &DeviceInfo) -> Result<RawHealth, BackendError> {
        let reason = Self::position(&device.id)
            .and_then(|p| self.fault(p))
            .and_then(|f| f.unhealthy.clone());
        Ok(match reason {
            Some(text) => RawHealth::Unhealthy(text),
            None => RawHealth::Healthy,
        })
    }

    fn links(&mut self, devices: &[DeviceInfo]) -> Result<Vec<DeviceLink>, BackendError> {
        let mut links = Vec::new();
        for (index, first) in devices.iter().enumerate() {
            for second in &devices[index + 1..] {
                let (first_profile, second_profile) = (profile_of(first), profile_of(second));
                // Fast links only join devices of the same kind; anything else meets over PCIe.
                let (kind, gbps) = match (first_profile, second_profile) {
                    (Some(first_known), Some(second_known))
                        if first_known.name == second_known.name =>
                    {
                        (first_known.link, first_known.link_gbps)
                    }
                    _ => (LinkKind::Pcie, 64.0),
                };
                links.push(DeviceLink {
                    a: first.id.clone(),
                    b: second.id.clone(),
                    kind,
                    bandwidth_gbps: gbps,
                    p2p: true,
                });
            }
        }
        Ok(links)
    }
}

fn profile_of(device: &DeviceInfo) -> Option<&'static Profile> {
    PROFILES.iter().find(|p| {
        device
            .id
            .starts_with(&format!("fake-{}-", p.name.to_ascii_lowercase()))
    })
}

/// A YAML parser error in one line, after the field it is about where that
/// can be found: the parser says where in the text, not which field.
fn yaml_error(text: &str, error: &serde_saphyr::Error) -> String {
    let line = yaml_error_line(error);
    let field = serde_saphyr::from_str::<serde_json::Value>(text)
        .ok()
        .and_then(|value| serde_path_to_error::deserialize::<_, FakeFile>(value).err())
        .map(|error| error.path().to_string())
        .filter(|path| !path.is_empty() && path != ".");
    match field {
        Some(field) => format!("{field}: {line}"),
        None => line,
    }
}

/// The first line of a YAML parser error, without its own `error:` prefix, for
/// one-line messages that already say where the YAML came from.
fn yaml_error_line(error: &impl std::fmt::Display) -> String {
    let text = error.to_string();
    let line = text.lines().next().unwrap_or("malformed YAML");
    line.strip_prefix("error: ").unwrap_or(line).to_string()
}

#[cfg(test)]
mod tests {
    use super::super::snapshot;
    use super::*;

    #[test]
    fn spec_makes_deterministic_devices_and_links() {
        let mut b = FakeBackend::new("2xH100-80GiB, 1xmi300x-192gib").unwrap();
        let s = snapshot(&mut b).unwrap();
        assert_eq!(s.devices.len(), 3);
        assert_eq!(s.devices[0].info.id, "fake-h100-80gib-0");
        assert_eq!(s.devices[2].info.vendor, Vendor::Amd);
        assert_eq!(s.links.len(), 3);
        assert_eq!(s.links[0].kind, LinkKind::Nvlink);
        assert_eq!(
            s.links[1].kind,
            LinkKind::Pcie,
            "H100 to MI300X goes over PCIe"
        );
        assert_eq!(snapshot(&mut b).unwrap(), s, "same input, same state");
        s.to_gpu_state(None).validate().unwrap();
    }

    #[test]
    fn bad_specs_are_clear_errors() {
        for (spec, want) in [
            (
                "4xB300-288GiB",
                "unknown profile \"B300-288GiB\"; known profiles: H100-80GiB",
            ),
            ("0xH100-80GiB", "at least 1"),
            ("", "no GPUs given"),
            ("99999999999xH100-80GiB", "too large"),
            ("300xL4-24GiB", "more than 256"),
        ] {
            let err = FakeBackend::new(spec).err().unwrap().to_string();
            assert!(err.contains(want), "{spec}: {err}");
        }
    }

    #[test]
    fn faults_in_a_file_apply_and_clear_while_running() {
        let dir = std::env::temp_dir().join(format!("tessera-fake-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("gpus.yaml");
        let write = |faults: &str| {
            std::fs::write(
                &path,
                format!("gpus:\n  - {{profile: H100-80GiB, count: 4}}\nfaults:\n{faults}"),
            )
            .unwrap()
        };
        write(
            "  - {device: 1, unhealthy: \"Xid 79\"}\n  - {device: 2, temperatureC: 97}\n  - {device: 3, vanish: true}\n  - {device: 0, memoryUsedGiB: 30}\n",
        );
        let mut b = FakeBackend::new(path.to_str().unwrap()).unwrap();
        let s = snapshot(&mut b).unwrap();
        assert_eq!(s.devices.len(), 3, "device 3 vanished");
        assert_eq!(s.devices[1].health, RawHealth::Unhealthy("Xid 79".into()));
        assert_eq!(s.devices[2].telemetry.temperature_c, Some(97.0));
        assert_eq!(s.devices[0].telemetry.memory_used_bytes, 30 << 30);

        // A half-written file keeps the last good state.
        std::fs::write(&path, "gpus: [").unwrap();
        assert_eq!(snapshot(&mut b).unwrap().devices.len(), 3);

        write("  []\n");
        let s = snapshot(&mut b).unwrap();
        assert_eq!(s.devices.len(), 4, "device 3 is back");
        assert!(s.devices.iter().all(|d| d.health == RawHealth::Healthy));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn ecc_and_xid_faults_set_the_counts_telemetry_reports() {
        let dir = fresh_dir("counts");
        let path = dir.join("gpus.yaml");
        std::fs::write(
            &path,
            "gpus: [{profile: H100-80GiB, count: 2}, {profile: RTX4090-24GiB}, {profile: MI300X-192GiB}]\n\
             faults:\n\
             \x20 - {device: 0, eccCorrected: 3, eccUncorrected: 1, xid: 79}\n\
             \x20 - {device: 3, eccUncorrected: 2}\n",
        )
        .unwrap();
        let mut b = FakeBackend::new(path.to_str().unwrap()).unwrap();
        let s = snapshot(&mut b).unwrap();
        let counts = |i: usize| {
            let t = &s.devices[i].telemetry;
            (
                t.ecc_corrected_errors,
                t.ecc_uncorrected_errors,
                t.xid_errors,
                t.last_xid,
            )
        };
        assert_eq!(counts(0), (Some(3), Some(1), Some(1), Some(79)));
        assert_eq!(
            counts(1),
            (Some(0), Some(0), Some(0), None),
            "ECC on, nothing yet"
        );
        assert_eq!(counts(2), (None, None, Some(0), None), "GeForce: no ECC");
        assert_eq!(counts(3), (Some(0), Some(2), None, None), "AMD: no Xids");
        assert_eq!(
            s.devices[0].health,
            RawHealth::Healthy,
            "counts alone leave health alone"
        );
        std::fs::write(&path, "gpus: [{profile: H100-80GiB, count: 2}]").unwrap();
        let s = snapshot(&mut b).unwrap();
        assert_eq!(
            s.devices[0].telemetry.xid_errors,
            Some(0),
            "the line removed"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn mig_partitions_and_pending_changes_from_a_file() {
        let dir = fresh_dir("mig");
        let path = dir.join("gpus.yaml");
        std::fs::write(
            &path,
            "gpus:\n\
             \x20 - {profile: H100-80GiB, count: 2, mig: {partitions: [3g.40gb, 2g.20gb, 1g.10gb]}}\n\
             \x20 - {profile: A100-80GiB, mig: {pending: true}}\n\
             \x20 - {profile: A100-40GiB, mig: {partitions: [\"3g.20gb@4\", 1g.5gb+me], pending: true}}\n\
             \x20 - {profile: H100-80GiB}\n",
        )
        .unwrap();
        let mut b = FakeBackend::new(path.to_str().unwrap()).unwrap();
        let s = snapshot(&mut b).unwrap();
        let mig = |i: usize| s.devices[i].info.mig.as_ref();
        let h100 = mig(1).unwrap();
        assert!(h100.enabled && h100.pending.is_none());
        let ids: Vec<&str> = h100.partitions.iter().map(|p| p.id.as_str()).collect();
        assert_eq!(
            ids,
            [
                "MIG-fake-h100-80gib-1-0-3g.40gb",
                "MIG-fake-h100-80gib-1-4-2g.20gb",
                "MIG-fake-h100-80gib-1-6-1g.10gb",
            ]
        );
        assert_eq!(h100.multiprocessors, 132);
        assert_eq!(h100.partitions[0].multiprocessors, 60);
        assert_eq!(h100.partitions[1].placement_size, 2);
        let a100 = mig(2).unwrap();
        assert_eq!((a100.enabled, a100.pending), (false, Some(true)));
        assert!(a100.partitions.is_empty());
        assert_eq!(a100.profiles.len(), 7);
        let small = mig(3).unwrap();
        assert_eq!((small.enabled, small.pending), (true, Some(false)));
        let layout: Vec<(&str, u32)> = small
            .partitions
            .iter()
            .map(|p| (p.profile.as_str(), p.placement_start))
            .collect();
        assert_eq!(layout, [("1g.5gb+me", 0), ("3g.20gb", 4)]);
        assert_eq!(mig(4), None, "no mig: given, none published");
        let state = s.to_gpu_state(None);
        state.validate().unwrap();
        assert_eq!(snapshot(&mut b).unwrap(), s, "the same IDs at every read");

        // Repartitioned while running: the next read has it.
        std::fs::write(
            &path,
            "gpus: [{profile: H100-80GiB, mig: {partitions: [7g.80gb]}}]",
        )
        .unwrap();
        let s = snapshot(&mut b).unwrap();
        let partitions = &s.devices[0].info.mig.as_ref().unwrap().partitions;
        assert_eq!(partitions.len(), 1);
        assert_eq!(partitions[0].id, "MIG-fake-h100-80gib-0-0-7g.80gb");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    fn fresh_dir(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("tessera-fake-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    fn count(b: &mut FakeBackend) -> usize {
        snapshot(b).unwrap().devices.len()
    }

    #[test]
    fn a_directory_gives_each_node_its_file_chosen_again_on_every_read() {
        let dir = fresh_dir("dir");
        let spec = dir.to_str().unwrap();
        std::fs::write(dir.join("default.yaml"), "gpus: [{profile: L4-24GiB}]").unwrap();
        std::fs::write(
            dir.join("kind-worker.yaml"),
            "gpus: [{profile: H100-80GiB, count: 2}]",
        )
        .unwrap();
        let mut worker = FakeBackend::for_node(spec, Some("kind-worker")).unwrap();
        assert_eq!(count(&mut worker), 2);
        let mut other = FakeBackend::for_node(spec, Some("kind-worker2")).unwrap();
        assert_eq!(count(&mut other), 1, "no file of its own: default.yaml");
        let mut nameless = FakeBackend::new(spec).unwrap();
        assert_eq!(count(&mut nameless), 1);

        // A file for the node appears: it is used from the next read on.
        std::fs::write(
            dir.join("kind-worker2.yaml"),
            "gpus: [{profile: MI300X-192GiB, count: 3}]",
        )
        .unwrap();
        assert_eq!(count(&mut other), 3);
        // A fault injected in the node's file.
        std::fs::write(
            dir.join("kind-worker2.yaml"),
            "gpus: [{profile: MI300X-192GiB, count: 3}]\nfaults: [{device: 0, unhealthy: Xid 79}]",
        )
        .unwrap();
        let s = snapshot(&mut other).unwrap();
        assert_eq!(s.devices[0].health, RawHealth::Unhealthy("Xid 79".into()));
        // Gone again: back to the default.
        std::fs::remove_file(dir.join("kind-worker2.yaml")).unwrap();
        assert_eq!(count(&mut other), 1);
        // Both gone: the last good state stays.
        std::fs::remove_file(dir.join("default.yaml")).unwrap();
        assert_eq!(count(&mut other), 1);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[cfg(unix)]
    #[test]
    fn a_configmap_style_symlink_swap_is_followed() {
        use std::os::unix::fs::symlink;
        let dir = fresh_dir("configmap");
        let version = |name: &str, text: &str| {
            std::fs::create_dir_all(dir.join(name)).unwrap();
            std::fs::write(dir.join(name).join("node-a.yaml"), text).unwrap();
        };
        version("..v1", "gpus: [{profile: L4-24GiB, count: 2}]");
        symlink("..v1", dir.join("..data")).unwrap();
        symlink("..data/node-a.yaml", dir.join("node-a.yaml")).unwrap();
        let mut b = FakeBackend::for_node(dir.to_str().unwrap(), Some("node-a")).unwrap();
        assert_eq!(count(&mut b), 2);
        // Kubelet's update: a new version directory, then `..data` switched in one rename.
        version("..v2", "gpus: [{profile: L4-24GiB, count: 4}]");
        symlink("..v2", dir.join("..data_tmp")).unwrap();
        std::fs::rename(dir.join("..data_tmp"), dir.join("..data")).unwrap();
        std::fs::remove_dir_all(dir.join("..v1")).unwrap();
        assert_eq!(count(&mut b), 4);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_directory_without_a_usable_file_is_a_clear_error() {
        let dir = fresh_dir("dir-bad");
        let spec = dir.to_str().unwrap();
        let err = FakeBackend::for_node(spec, Some("kind-worker"))
            .err()
            .unwrap()
            .to_string();
        for want in [
            dir.join("kind-worker.yaml").display().to_string(),
            dir.join("default.yaml").display().to_string(),
            "this node: kind-worker".to_string(),
        ] {
            assert!(err.contains(&want), "{err} lacks {want}");
        }
        let err = FakeBackend::new(spec).err().unwrap().to_string();
        assert!(err.contains("no node name is known"), "{err}");
        assert!(err.contains("default.yaml"), "{err}");
        // A node name that would leave the directory is never used as a path.
        std::fs::create_dir_all(dir.join("sub")).unwrap();
        std::fs::write(dir.join("sub/x.yaml"), "gpus: [{profile: L4-24GiB}]").unwrap();
        let err = FakeBackend::for_node(spec, Some("sub/x"))
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains("cannot name a file"), "{err}");

        // Bad YAML and unreadable files are named.
        std::fs::write(dir.join("default.yaml"), "gpus: [").unwrap();
        let err = FakeBackend::for_node(spec, Some("kind-worker"))
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains("default.yaml"), "{err}");
        std::fs::write(dir.join("kind-worker.yaml"), [0xff, 0xfe, 0x00]).unwrap();
        let err = FakeBackend::for_node(spec, Some("kind-worker"))
            .err()
            .unwrap()
            .to_string();
        assert!(
            err.contains("kind-worker.yaml") && err.contains("UTF-8"),
            "{err}"
        );
        std::fs::remove_file(dir.join("kind-worker.yaml")).unwrap();
        std::fs::create_dir(dir.join("kind-worker.yaml")).unwrap();
        let err = FakeBackend::for_node(spec, Some("kind-worker"))
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains("kind-worker.yaml"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn malformed_files_are_clear_errors() {
        let dir = std::env::temp_dir().join(format!("tessera-fake-bad-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        for (i, (text, want)) in [
            ("gpus: [", "malformed"),
            ("gpus: []", "no GPUs given"),
            (
                "gpus: [{profile: H100-80GiB}]\nfaults: [{device: 4, vanish: true}]",
                "names device 4 but there are 1",
            ),
            ("gpus: [{profile: H100-80GiB, colour: red}]", "colour"),
            (
                "gpus: [{profile: H100-80GiB}]\nfaults: [{device: 0, memoryUsedGiB: -1}]",
                "zero or more",
            ),
            (
                "gpus: [{profile: H100-80GiB}]\nfaults: [{device: 0, eccCorrected: -1}]",
                "faults[0].eccCorrected",
            ),
            (
                "gpus: [{profile: H100-80GiB}]\nfaults: [{device: 0, eccUncorrected: lots}]",
                "faults[0].eccUncorrected",
            ),
            (
                "gpus: [{profile: H100-80GiB}]\nfaults: [{device: 0, xid: 79.5}]",
                "faults[0].xid",
            ),
            (
                "gpus: [{profile: H100-80GiB}]\nfaults: [{device: 0, xid: [79, 48]}]",
                "faults[0].xid",
            ),
            (
                "gpus: [{profile: H100-80GiB}]\nfaults: [{device: 0, eccCorected: 1}]",
                "eccCorected",
            ),
            (
                "gpus: [{profile: L4-24GiB}, {profile: MI300X-192GiB}]\nfaults: [{device: 1, xid: 79}]",
                "device 1 (MI300X-192GiB) cannot report an Xid: Xid errors are NVIDIA's",
            ),
            (
                "gpus: [{profile: L4-24GiB}, {profile: RTX4090-24GiB}]\nfaults: [{device: 1, eccCorrected: 1}]",
                "device 1 (RTX4090-24GiB) has no ECC to count errors with",
            ),
            (
                "gpus: [{profile: RTX4090-24GiB}, {profile: MI210-64GiB}]\nfaults: [{device: 0, xid: 13}, {device: 1, eccUncorrected: 0}]",
                "",
            ),
            (
                "gpus: [{profile: L4-24GiB}, {profile: MI300X-192GiB, mig: {partitions: [3g.40gb]}}]",
                "gpus[1].mig: MI300X-192GiB has no MIG; the profiles with MIG: H100-80GiB",
            ),
            (
                "gpus: [{profile: H100-80GiB, mig: {partitions: [3g.40gb, 3g.20gb]}}]",
                "gpus[0].mig.partitions[1]: unknown MIG profile \"3g.20gb\"; this GPU's profiles: 1g.10gb",
            ),
            (
                "gpus: [{profile: A100-40GiB, mig: {partitions: [3g.20gb]}}]\nfaults: []",
                "",
            ),
            (
                "gpus: [{profile: H100-80GiB, mig: {partitions: [\"4g.40gb@0\", \"2g.20gb@2\"]}}]",
                "gpus[0].mig.partitions[1]: 2g.20gb@2 overlaps 4g.40gb@0 on memory slice 2",
            ),
            (
                "gpus: [{profile: H100-80GiB, mig: {partitions: [\"2g.20gb@6\"]}}]",
                "gpus[0].mig.partitions[0]: 2g.20gb cannot start at memory slice 6; it starts at 0, 2 or 4",
            ),
            (
                "gpus: [{profile: H100-80GiB, mig: {pending: soon}}]",
                "gpus[0].mig.pending",
            ),
            (
                "gpus: [{profile: H100-80GiB, mig: {partitions: 3g.40gb}}]",
                "gpus[0].mig.partitions",
            ),
            (
                "gpus: [{profile: H100-80GiB, mig: {layout: [3g.40gb]}}]",
                "gpus[0].mig.layout: line 1 column 36: unknown field `layout`",
            ),
        ]
        .into_iter()
        .enumerate()
        {
            let path = dir.join(format!("f{i}.yaml"));
            std::fs::write(&path, text).unwrap();
            if want.is_empty() {
                FakeBackend::new(path.to_str().unwrap()).unwrap();
                continue;
            }
            let err = FakeBackend::new(path.to_str().unwrap())
                .err()
                .unwrap()
                .to_string();
            assert!(
                err.contains(want) || (want == "malformed" && err.contains(path.to_str().unwrap())),
                "{text}: {err}"
            );
            assert!(err.contains(path.to_str().unwrap()), "the file is named: {err}");
        }
        let err = FakeBackend::new("/nonexistent/gpus.yaml")
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains("/nonexistent/gpus.yaml"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
