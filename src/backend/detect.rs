//! Choosing the backend(s) of a node. `auto` tries NVIDIA, then AMD, then the
//! fake backend if one is configured; a node with both NVIDIA and AMD GPUs gets
//! both, merged into one list. An explicit choice uses that backend or fails
//! with its reason.

use std::collections::HashMap;
use std::ffi::OsString;
use std::path::PathBuf;

use super::amd::{AmdBackend, DEFAULT_SYSFS_ROOT};
use super::fake::FakeBackend;
use super::nvml::NvmlBackend;
use super::{BackendError, DeviceInfo, DeviceLink, GpuBackend, RawHealth, Snapshot, Telemetry};

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum BackendChoice {
    Auto,
    Nvidia,
    Amd,
    Fake,
}

#[derive(Clone, Debug)]
pub struct DetectOptions {
    pub choice: BackendChoice,
    /// NVML library to load instead of `libnvidia-ml.so.1`.
    pub nvml_library: Option<OsString>,
    /// Root of the sysfs tree the AMD backend reads.
    pub sysfs_root: PathBuf,
    /// Fake devices: a spec like `4xH100-80GiB`, a YAML file path, or a
    /// directory of per-node files (see [`super::fake`]).
    pub fake: Option<String>,
    /// This node's name: picks `<name>.yaml` when `fake` is a directory.
    pub node_name: Option<String>,
}

impl Default for DetectOptions {
    fn default() -> Self {
        Self {
            choice: BackendChoice::Auto,
            nvml_library: None,
            sysfs_root: PathBuf::from(DEFAULT_SYSFS_ROOT),
            fake: None,
            node_name: None,
        }
    }
}

fn nvidia(options: &DetectOptions) -> Result<Box<dyn GpuBackend>, BackendError> {
    Ok(Box::new(NvmlBackend::new(options.nvml_library.as_deref())?))
}

fn amd(options: &DetectOptions) -> Result<Box<dyn GpuBackend>, BackendError> {
    let backend = AmdBackend::new(options.sysfs_root.clone())?;
    // ROCm SMI only adds telemetry sysfs lacks; without it the sysfs view stands.
    #[cfg(feature = "rocm-smi")]
    let backend = {
        let root = options.sysfs_root.clone();
        backend.with_rocm_smi().or_else(|e| {
            tracing::warn!(error = %e, "ROCm SMI unavailable; using sysfs telemetry only");
            AmdBackend::new(root)
        })?
    };
    Ok(Box::new(backend))
}

fn fake(options: &DetectOptions) -> Result<Box<dyn GpuBackend>, BackendError> {
    match &options.fake {
        Some(spec) => Ok(Box::new(FakeBackend::for_node(
            spec,
            options.node_name.as_deref(),
        )?)),
        None => Err(BackendError::Unavailable(format!(
            "no fake devices configured (set {} or --fake, e.g. \"4xH100-80GiB\")",
            super::fake::ENV_VAR
        ))),
    }
}

/// The backend for the node: one vendor's, or several merged.
pub fn detect(options: &DetectOptions) -> Result<Box<dyn GpuBackend>, BackendError> {
    match options.choice {
        BackendChoice::Nvidia => nvidia(options),
        BackendChoice::Amd => amd(options),
        BackendChoice::Fake => fake(options),
        BackendChoice::Auto => {
            let mut found: Vec<Box<dyn GpuBackend>> = Vec::new();
            let mut skipped = Vec::new();
            for (name, make) in [("nvidia", nvidia as fn(&DetectOptions) -> _), ("amd", amd)] {
                match make(options).and_then(|mut backend| match backend.devices() {
                    Ok(devices) if devices.is_empty() => Err(BackendError::Unavailable(format!(
                        "{name}: the library loaded but reports no devices"
                    ))),
                    Ok(_) => Ok(backend),
                    Err(e) => Err(e),
                }) {
                    Ok(backend) => found.push(backend),
                    // A vendor library that is there but broken is worth a warning;
                    // one that is simply absent is the normal case on other nodes.
                    Err(BackendError::Failed(e)) => {
                        tracing::warn!(backend = name, error = %e, "backend failed");
                        skipped.push(format!("{name}: {e}"));
                    }
                    Err(BackendError::Unavailable(e)) => skipped.push(format!("{name}: {e}")),
                }
            }
            if found.is_empty() && options.fake.is_some() {
                return fake(options);
            }
            match found.len() {
                0 => Err(BackendError::Unavailable(format!(
                    "no GPU backend applies to this node. {}",
                    skipped.join(" | ")
                ))),
                1 => Ok(found.remove(0)),
                _ => Ok(Box::new(Merged::new(found))),
            }
        }
    }
}

/// Several backends as one: devices of the first come first, indices are
/// renumbered, and devices of different backends meet over PCIe (no entry).
struct Merged {
    name: String,
    backends: Vec<Box<dyn GpuBackend>>,
    /// Merged device ID → (backend, the device as that backend knows it).
    owner: HashMap<String, (usize, DeviceInfo)>,
}

impl Merged {
    fn new(backends: Vec<Box<dyn GpuBackend>>) -> Self {
        let name = backends
            .iter()
            .map(|b| b.name())
            .collect::<Vec<_>>()
            .join("+");
        Self {
            name,
            backends,
            owner: HashMap::new(),
        }
    }

    /// Records which backend owns `device` (as that backend numbers it) and
    /// returns it numbered on after the `merged_so_far` devices listed before.
    fn adopt(
        &mut self,
        backend_index: usize,
        device: DeviceInfo,
        merged_so_far: usize,
    ) -> DeviceInfo {
        let mut merged = device.clone();
        merged.index = merged_so_far as u32;
        self.owner
            .insert(device.id.clone(), (backend_index, device));
        merged
    }

    fn owned(&self, device: &DeviceInfo) -> Result<(usize, DeviceInfo), BackendError> {
        self.owner.get(&device.id).cloned().ok_or_else(|| {
            BackendError::Failed(format!("device {} is not known to any backend", device.id))
        })
    }
}

impl GpuBackend for Merged {
    fn name(&self) -> &str {
        &self.name
    }

    fn devices(&mut self) -> Result<Vec<DeviceInfo>, BackendError> {
        let mut merged_devices = Vec::new();
        self.owner.clear();
        for backend_index in 0..self.backends.len() {
            for device in self.backends[backend_index].devices()? {
                let merged = self.adopt(backend_index, device, merged_devices.len());
                merged_devices.push(merged);
            }
        }
        Ok(merged_devices)
    }

    fn telemetry(&mut self, device: &DeviceInfo) -> Result<Telemetry, BackendError> {
        let (backend_index, own) = self.owned(device)?;
        self.backends[backend_index].telemetry(&own)
    }

    fn health(&mut self, device: &DeviceInfo) -> Result<RawHealth, BackendError> {
        let (backend_index, own) = self.owned(device)?;
        self.backends[backend_index].health(&own)
    }

    fn links(&mut self, devices: &[DeviceInfo]) -> Result<Vec<DeviceLink>, BackendError> {
        let mut links = Vec::new();
        for (backend_index, backend) in self.backends.iter_mut().enumerate() {
            let own: Vec<DeviceInfo> = devices
                .iter()
                .filter_map(|device| {
                    self.owner
                        .get(&device.id)
                        .filter(|(owner, _)| *owner == backend_index)
                        .map(|(_, own_device)| own_device.clone())
                })
                .collect();
            if !own.is_empty() {
                links.extend(backend.links(&own)?);
            }
        }
        Ok(links)
    }

    /// Each backend reads its own snapshot (in one go, where it can); the
    /// devices are numbered on across them.
    fn snapshot(&mut self) -> Result<Snapshot, BackendError> {
        self.owner.clear();
        let (mut devices, mut links) = (Vec::new(), Vec::new());
        for backend_index in 0..self.backends.len() {
            let own = self.backends[backend_index].snapshot()?;
            for mut state in own.devices {
                state.info = self.adopt(backend_index, state.info, devices.len());
                devices.push(state);
            }
            links.extend(own.links);
        }
        Ok(Snapshot {
            backend: self.name.clone(),
            devices,
            links,
        })
    }
}
