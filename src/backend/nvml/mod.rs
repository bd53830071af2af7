//! NVIDIA GPUs through NVML (`libnvidia-ml.so.1`, via `nvml-wrapper`).
//!
//! The library is loaded at run time, so the binary starts on nodes without
//! NVIDIA GPUs: there [`NvmlBackend::new`] returns [`BackendError::Unavailable`]
//! with the reasons it usually happens (`errors`).
//!
//! # What is read
//!
//! - **Devices**: UUID (the stable id), index, name, memory, compute capability,
//!   SM count, PCI bus id (`0000:17:00.0`), NUMA node (from sysfs), and two
//!   estimates: dense FP16 tensor TFLOPS and memory bandwidth (see `specs` for
//!   the formulas and tables).
//! - **Telemetry**: temperature, power, clocks, utilisation, memory use,
//!   corrected and uncorrected ECC errors since the driver loaded (volatile
//!   counts), and the Xid events the GPU reported since the backend
//!   registered it (every Xid, also those the application caused; see
//!   `xid`). A reading the device does not support is `None`, not an error:
//!   no ECC counts without ECC, no Xid count on a GPU not registered for Xid
//!   events.
//! - **Health**: NVML events (critical Xid errors, double-bit ECC errors; see
//!   `events` and `xid`) plus polling (volatile uncorrected ECC count, GPU
//!   lost). See [`NvmlBackend::health`].
//! - **Links**: NVLink (direct and through NVSwitch) and, for pairs without
//!   NVLink, PCIe. See `links`.
//! - **MIG**, on a GPU that has it: the mode now and after the next reset,
//!   the memory slices, the profiles offered and, in MIG mode, the MIG devices
//!   with their profile, memory, multiprocessors and placement. Read again on
//!   every listing, so a GPU repartitioned while the agent runs is seen at
//!   the next poll; what cannot be read is left out with a warning. See `mig`.
//!
//! # A GPU that cannot be read
//!
//! A GPU that has fallen off the bus still counts in `nvmlDeviceGetCount` but
//! its handle (or its readings) fail with `NVML_ERROR_GPU_IS_LOST`. Dropping it
//! from [`GpuBackend::devices`] would make it silently vanish, and kubelet would
//! never hear it went bad. So it is listed (`devices`), with:
//!
//! - the last good reading of the same index (same UUID, same figures) when
//!   the device count has not changed since — the usual case, since the agent
//!   reads devices before any fault;
//! - otherwise a placeholder: id `nvml-index-<index>` (see [`is_fallback_id`];
//!   the device registry can map it back to the UUID it had), no PCI bus id, and
//!   figures that are deliberately tiny but positive (`PLACEHOLDER_FIGURE`, 1
//!   byte of memory) so the published state stays valid while the device is
//!   reported unhealthy and is never planned on.
//!
//! [`NvmlBackend::health`] then reports it unhealthy ("GPU is lost ...").
//!
//! # Containers
//!
//! What a container given NVIDIA GPUs needs (variables, device nodes, CDI
//! names) is in `container`; the driver's libraries and firmware, for
//! containers whose runtime will not add them, in `driver_files` (the
//! version they must match from `driver_version`).
//!
//! # Unsafe code
//!
//! Only in `events` and `mig_raw`, which say why it is needed and why it is
//! sound.

mod container;
mod device_health;
mod devices;
mod driver_files;
mod driver_version;
mod errors;
mod events;
mod link_speeds;
mod links;
mod mig;
mod mig_names;
mod mig_raw;
mod pci;
mod specs;
mod xid;

use std::collections::{HashMap, HashSet};
use std::ffi::{OsStr, OsString};
use std::path::PathBuf;
use std::time::Duration;

use nvml_wrapper::enum_wrappers::device::{Clock, EccCounter, MemoryError, TemperatureSensor};
use nvml_wrapper::error::NvmlError;
use nvml_wrapper::{Device, Nvml};

use super::{BackendError, DeviceInfo, DeviceLink, GpuBackend, RawHealth, Telemetry};
pub(crate) use container::wire_container;
pub(crate) use driver_files::mount_driver_files;

/// A 580 driver install for tests elsewhere: `procfs` names the version,
/// `root` holds its libraries, links and firmware.
#[cfg(test)]
pub(crate) fn test_driver_install(procfs: &std::path::Path, root: &std::path::Path) {
    driver_files::tests::procfs(procfs);
    driver_files::tests::driver_root(root);
}
#[cfg(test)]
pub(crate) use devices::fallback_id;
pub use devices::is_fallback_id;
use errors::{device_failed, init_error, optional};
use events::{DetachedEventSet, EventFault};
use xid::XidCounts;

/// The NVML library the backend loads unless told otherwise.
pub const DEFAULT_LIBRARY: &str = "libnvidia-ml.so.1";
/// How long a fault seen as an event keeps the device unhealthy after the last
/// such event.
const DEFAULT_FAULT_HOLD: Duration = Duration::from_secs(60);
const DEFAULT_SYSFS_ROOT: &str = "/sys";

pub struct NvmlBackend {
    nvml: Nvml,
    events: Option<DetachedEventSet>,
    /// Raw device handle (as an address: an identity only) → id, for the devices
    /// registered in the event set.
    event_devices: HashMap<usize, String>,
    faults: HashMap<String, EventFault>,
    /// Xid events per GPU registered for them, since registration.
    xids: XidCounts,
    fault_hold: Duration,
    sysfs_root: PathBuf,
    /// The last good reading of each index, with the device count at the time.
    known: HashMap<u32, DeviceInfo>,
    known_count: Option<u32>,
    /// Indices unreadable at the last `devices()`, to warn once per episode.
    unreadable: HashSet<u32>,
    /// Products already warned about for lack of an estimate.
    unestimated: HashSet<String>,
    /// What of the GPUs' MIG state could not be read at the last listing,
    /// to warn once per episode.
    mig_warnings: HashSet<String>,
}

impl NvmlBackend {
    /// Loads NVML from `lib_path` (default [`DEFAULT_LIBRARY`]) and registers
    /// every device that supports it for critical Xid and double-bit ECC events.
    pub fn new(lib_path: Option<&OsStr>) -> Result<Self, BackendError> {
        let library: OsString = lib_path
            .unwrap_or(OsStr::new(DEFAULT_LIBRARY))
            .to_os_string();
        let nvml = Nvml::builder()
            .lib_path(&library)
            .init()
            .map_err(|error| init_error(&library, error))?;
        let mut backend = Self {
            nvml,
            events: None,
            event_devices: HashMap::new(),
            faults: HashMap::new(),
            xids: XidCounts::default(),
            fault_hold: DEFAULT_FAULT_HOLD,
            sysfs_root: PathBuf::from(DEFAULT_SYSFS_ROOT),
            known: HashMap::new(),
            known_count: None,
            unreadable: HashSet::new(),
            unestimated: HashSet::new(),
            mig_warnings: HashSet::new(),
        };
        backend.register_events();
        Ok(backend)
    }

    /// Where sysfs is mounted (for NUMA nodes); default `/sys`.
    pub fn with_sysfs_root(mut self, root: impl Into<PathBuf>) -> Self {
        self.sysfs_root = root.into();
        self
    }

    /// How long an event-reported fault keeps the device unhealthy after the
    /// last such event; default 60 s.
    pub fn with_fault_hold(mut self, hold: Duration) -> Self {
        self.fault_hold = hold;
        self
    }

    /// The device handle for a listed device: by UUID, or by index for a
    /// device listed under a fallback id.
    fn handle(&self, info: &DeviceInfo) -> Result<Device<'_>, NvmlError> {
        if is_fallback_id(&info.id) {
            self.nvml.device_by_index(info.index)
        } else {
            self.nvml.device_by_uuid(info.id.as_str())
        }
    }
}

impl GpuBackend for NvmlBackend {
    fn name(&self) -> &str {
        "nvml"
    }

    /// Every GPU NVML counts, in index order; unreadable ones as described in
    /// the module docs.
    fn devices(&mut self) -> Result<Vec<DeviceInfo>, BackendError> {
        self.list_devices()
    }

    fn telemetry(&mut self, info: &DeviceInfo) -> Result<Telemetry, BackendError> {
        // Events pending now are counted in this reading, not the next one.
        self.drain_events();
        let xids = self.xids.of(&info.id);
        let device = self
            .handle(info)
            .map_err(|error| device_failed(info, &error))?;
        let read = |reading| optional(reading).map_err(|error| device_failed(info, &error));
        let temperature_c = read(device.temperature(TemperatureSensor::Gpu))?.map(f64::from);
        let power_w = read(device.power_usage())?.map(|milliwatts| f64::from(milliwatts) / 1000.0);
        let graphics_clock_mhz = read(device.clock_info(Clock::Graphics))?;
        let memory_clock_mhz = read(device.clock_info(Clock::Memory))?;
        let utilization_percent = optional(device.utilization_rates())
            .map_err(|error| device_failed(info, &error))?
            .map(|utilization| utilization.gpu);
        let memory = optional(device.memory_info()).map_err(|error| device_failed(info, &error))?;
        // Volatile: since the driver loaded, like AMD's RAS counts, so both
        // vendors' counters reset at the same event.
        let ecc_count = |error_type| {
            optional(device.total_ecc_errors(error_type, EccCounter::Volatile))
                .map_err(|error| device_failed(info, &error))
        };
        let ecc_corrected_errors = ecc_count(MemoryError::Corrected)?;
        let ecc_uncorrected_errors = ecc_count(MemoryError::Uncorrected)?;
        Ok(Telemetry {
            temperature_c,
            power_w,
            graphics_clock_mhz,
            memory_clock_mhz,
            utilization_percent,
            memory_used_bytes: memory.as_ref().map_or(0, |memory| memory.used),
            memory_free_bytes: memory.as_ref().map_or(0, |memory| memory.free),
            ecc_corrected_errors,
            ecc_uncorrected_errors,
            xid_errors: xids.map(|count| count.total),
            last_xid: xids.and_then(|count| count.last),
        })
    }

    /// Faults events reported while they are recent, and what polling finds
    /// now; see `device_health`.
    fn health(&mut self, info: &DeviceInfo) -> Result<RawHealth, BackendError> {
        self.read_health(info)
    }

    /// One link per pair of readable devices: NVLink where they share links,
    /// else PCIe; the rules are in `links`.
    fn links(&mut self, devices: &[DeviceInfo]) -> Result<Vec<DeviceLink>, BackendError> {
        self.pair_links(devices)
    }
}
