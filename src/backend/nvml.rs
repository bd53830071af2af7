//! NVIDIA GPUs through NVML (`libnvidia-ml.so.1`, via `nvml-wrapper`).
//!
//! The library is loaded at run time, so the binary starts on nodes without
//! NVIDIA GPUs: there [`NvmlBackend::new`] returns [`BackendError::Unavailable`]
//! with the reasons it usually happens.
//!
//! # What is read
//!
//! - **Devices**: UUID (the stable id), index, name, memory, compute capability,
//!   SM count, PCI bus id (`0000:17:00.0`), NUMA node (from sysfs), and two
//!   estimates: dense FP16 tensor TFLOPS and memory bandwidth (see
//!   [`estimate_fp16_tflops`] and [`estimate_memory_bandwidth_gbps`] for the
//!   formulas and tables).
//! - **Telemetry**: temperature, power, clocks, utilisation, memory use. A
//!   reading the device does not support is `None`, not an error.
//! - **Health**: NVML events (critical Xid errors, double-bit ECC errors) plus
//!   polling (volatile uncorrected ECC count, GPU lost). See
//!   [`NvmlBackend::health`].
//! - **Links**: NVLink (direct and through NVSwitch) and, for pairs without
//!   NVLink, PCIe. See [`NvmlBackend::links`].
//!
//! # A GPU that cannot be read
//!
//! A GPU that has fallen off the bus still counts in `nvmlDeviceGetCount` but
//! its handle (or its readings) fail with `NVML_ERROR_GPU_IS_LOST`. Dropping it
//! from [`GpuBackend::devices`] would make it silently vanish, and kubelet would
//! never hear it went bad. So it is listed, with:
//!
//! - the last good reading of the same index (same UUID, same figures) when
//!   the device count has not changed since — the usual case, since the agent
//!   reads devices before any fault;
//! - otherwise a placeholder: id `nvml-index-<index>` (see [`is_fallback_id`];
//!   the device registry can map it back to the UUID it had), no PCI bus id, and
//!   figures that are deliberately tiny but positive ([`PLACEHOLDER_FIGURE`], 1
//!   byte of memory) so the published state stays valid while the device is
//!   reported unhealthy and is never planned on.
//!
//! [`NvmlBackend::health`] then reports it unhealthy ("GPU is lost ...").
//!
//! # Unsafe code
//!
//! `nvml-wrapper`'s `EventSet<'nvml>` borrows the `Nvml` it came from, and the
//! backend must own both. The set's raw handle is therefore kept apart from its
//! wrapper (`DetachedEventSet`) and wrapped again, without ever being dropped,
//! for each use; it is freed once, in `Drop`, before `Nvml` shuts down.

use std::collections::{HashMap, HashSet};
use std::ffi::{OsStr, OsString, c_void};
use std::mem::ManuallyDrop;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use nvml_wrapper::bitmasks::event::EventTypes;
use nvml_wrapper::enum_wrappers::device::{
    Clock, EccCounter, MemoryError, P2pCapabilitiesIndex, P2pStatus, TemperatureSensor,
    TopologyLevel,
};
use nvml_wrapper::enums::event::XidError;
use nvml_wrapper::error::NvmlError;
use nvml_wrapper::{Device, EventSet, Nvml};

use super::{BackendError, DeviceInfo, GpuBackend, Link, RawHealth, Telemetry};
use crate::api::{LinkKind, Vendor};

/// The NVML library the backend loads unless told otherwise.
pub const DEFAULT_LIBRARY: &str = "libnvidia-ml.so.1";
/// How long a fault seen as an event keeps the device unhealthy after the last
/// such event.
pub const DEFAULT_FAULT_HOLD: Duration = Duration::from_secs(60);
pub const DEFAULT_SYSFS_ROOT: &str = "/sys";
/// Prefix of the id given to a GPU whose UUID cannot be read.
pub const FALLBACK_ID_PREFIX: &str = "nvml-index-";
/// Stand-in for a figure that cannot be known (an unreadable GPU, or a GPU
/// whose SM count or clocks NVML does not give): positive so the published
/// state stays valid, and small enough that nothing is planned on it.
pub const PLACEHOLDER_FIGURE: f64 = 0.001;

/// `NVML_NVLINK_MAX_LINKS` (18 since Hopper).
const NVLINK_MAX_LINKS: u32 = 18;
/// Events drained per call at most, so a storm cannot stall a poll.
const MAX_EVENTS_PER_DRAIN: usize = 1024;

const LOST: &str = "GPU is lost: it has fallen off the bus or is otherwise inaccessible \
    (NVML_ERROR_GPU_IS_LOST); it needs a reset or a reboot of the node";

const LOAD_HINTS: &str = "Usual causes: \
    (1) the NVIDIA driver is not installed on this node (expected on nodes without NVIDIA GPUs; \
    otherwise check `nvidia-smi` on the host); \
    (2) the driver libraries are not mounted into this container: run the pod with the NVIDIA \
    runtime class (`runtimeClassName: nvidia`) or with the NVIDIA container toolkit as the \
    default runtime, with NVIDIA_DRIVER_CAPABILITIES including `utility`, so that \
    libnvidia-ml.so.1 and /dev/nvidia* are injected; \
    (3) a driver/library version mismatch: the library found does not belong to the loaded \
    kernel module (typically after a driver upgrade without a reboot; `nvidia-smi` then says \
    \"Driver/library version mismatch\").";

// ---------------------------------------------------------------------------
// Facts and estimates

/// Xid codes NVIDIA's Kubernetes device plugin does not treat as device
/// faults: they are caused by the application (a bad kernel, a page fault, a
/// watchdog on a hung context), not by the GPU.
pub const APPLICATION_XIDS: [u64; 6] = [13, 31, 43, 45, 68, 109];

/// Well-known Xid codes (NVIDIA's Xid catalogue), for readable reasons.
const XID_MEANINGS: &[(u64, &str)] = &[
    (13, "graphics engine exception"),
    (31, "GPU memory page fault"),
    (43, "GPU stopped processing"),
    (45, "preemptive cleanup, due to previous errors"),
    (48, "double-bit ECC error"),
    (61, "internal micro-controller breakpoint/warning"),
    (62, "internal micro-controller halt"),
    (63, "ECC page retirement or row remapping recording event"),
    (64, "ECC page retirement or row remapping recording failure"),
    (68, "video processor exception"),
    (74, "NVLink error"),
    (79, "GPU has fallen off the bus"),
    (92, "high single-bit ECC error rate"),
    (94, "contained ECC error"),
    (95, "uncontained ECC error"),
    (109, "context switch timeout"),
    (119, "GSP RPC timeout"),
    (120, "GSP error"),
];

/// Whether an Xid marks the device unhealthy (everything but [`APPLICATION_XIDS`]).
pub fn xid_is_critical(code: u64) -> bool {
    !APPLICATION_XIDS.contains(&code)
}

/// `Xid 79: GPU has fallen off the bus`, or `Xid N` for codes not in the table.
pub fn xid_reason(code: u64) -> String {
    match XID_MEANINGS.iter().find(|(c, _)| *c == code) {
        Some((_, meaning)) => format!("Xid {code}: {meaning}"),
        None => format!("Xid {code}"),
    }
}

/// Dense FP16 tensor-core FLOPs per SM per clock, by compute capability; a GPU
/// uses the last entry at or below its own capability (8.7 → 8.6, 10.3 → 10.0).
///
/// | cc   | FLOPs | check (SMs × clock × FLOPs)                           |
/// |------|-------|-------------------------------------------------------|
/// | 6.0  | 256   | P100: 56 × 1480 MHz → 21.2 TFLOPS (half2 on CUDA cores)|
/// | 6.1  | 4     | consumer Pascal: FP16 at 1/64 of FP32                 |
/// | 7.0  | 1024  | V100 SXM2: 80 × 1530 → 125                            |
/// | 7.5  | 1024  | T4: 40 × 1590 → 65                                    |
/// | 8.0  | 2048  | A100: 108 × 1410 → 312; A30: 56 × 1440 → 165          |
/// | 8.6  | 1024  | A40: 84 × 1740 → 150; A10: 72 × 1695 → 125            |
/// | 8.9  | 1024  | L4: 58 × 2040 → 121; L40S: 142 × 2520 → 366 (≈ 362)   |
/// | 9.0  | 4096  | H100 SXM: 132 × 1830 → 989                            |
/// | 10.0 | 8192  | B200: 148 × ~1860 → ~2250                             |
/// | 12.0 | 1024  | (workstation Blackwell; GeForce halved, see below)    |
///
/// Anything older than 6.0 gets 128, a rough figure: such GPUs have no fast
/// FP16 and are not a target for large models. GeForce cards from Turing (7.5)
/// on run FP16 tensor math with FP32 accumulate at half rate, so a product
/// named "GeForce" gets half (RTX 4090: 128 × 2520 × 512 → 165).
const FP16_FLOPS_PER_SM_CLOCK: &[((i32, i32), f64)] = &[
    ((0, 0), 128.0),
    ((6, 0), 256.0),
    ((6, 1), 4.0),
    ((7, 0), 1024.0),
    ((7, 5), 1024.0),
    ((8, 0), 2048.0),
    ((8, 6), 1024.0),
    ((8, 9), 1024.0),
    ((9, 0), 4096.0),
    ((10, 0), 8192.0),
    ((12, 0), 1024.0),
];

/// FP32 CUDA cores per SM, to turn `nvmlDeviceGetNumGpuCores` into SMs
/// (A100: 6912 / 64 = 108; H100 SXM: 16896 / 128 = 132). Same lookup as above.
const CUDA_CORES_PER_SM: &[((i32, i32), u32)] = &[
    ((3, 0), 192),
    ((5, 0), 128),
    ((6, 0), 64),
    ((6, 1), 128),
    ((7, 0), 64),
    ((8, 0), 64),
    ((8, 6), 128),
    ((9, 0), 128),
    ((10, 0), 128),
];

/// A product-name rule: every word of the first list is in the name, none of
/// the second (case-insensitive, words split at anything not alphanumeric).
type ProductRule = (&'static [&'static str], &'static [&'static str], u32);

/// SM counts by product, for when NVML does not tell (`nvmlDeviceGetAttributes`
/// only answers for MIG devices; `nvmlDeviceGetNumGpuCores` needs a recent
/// driver). First match wins. Data-sheet figures.
const SM_COUNT_BY_PRODUCT: &[ProductRule] = &[
    (&["H100", "PCIe"], &[], 114),
    (&["H100"], &[], 132),
    (&["H800", "PCIe"], &[], 114),
    (&["H800"], &[], 132),
    (&["H200"], &[], 132),
    (&["GH200"], &[], 132),
    (&["B200"], &[], 148),
    (&["A100"], &[], 108),
    (&["A800"], &[], 108),
    (&["A30"], &[], 56),
    (&["A10G"], &[], 80),
    (&["A10"], &[], 72),
    (&["A40"], &[], 84),
    (&["L40S"], &[], 142),
    (&["L40"], &[], 142),
    (&["L4"], &[], 58),
    (&["V100"], &[], 80),
    (&["V100S"], &[], 80),
    (&["T4"], &[], 40),
    (&["GeForce", "4090"], &["D"], 128),
    (&["GeForce", "3090", "Ti"], &[], 84),
    (&["GeForce", "3090"], &[], 82),
];

/// Products whose data-sheet tensor throughput is quoted at a lower SM clock
/// than the maximum NVML reports: H100 SXM reports 1980 MHz, but NVIDIA's 989
/// TFLOPS is 132 × 4096 × 1830 MHz; H100 PCIe (max 1755) is quoted at 1620
/// (114 SMs → 756); RTX 4090 reports ~3105 but its 165 TFLOPS is at the 2520
/// MHz boost clock. Dense tensor math does not sustain the maximum clock under
/// the power limit, so the quoted clock is the better estimate. The smaller of
/// this and NVML's maximum is used.
const TENSOR_CLOCK_MHZ_BY_PRODUCT: &[ProductRule] = &[
    (&["H100", "HBM3"], &[], 1830),
    (&["H100", "PCIe"], &[], 1620),
    (&["H200"], &["NVL"], 1830),
    (&["GH200"], &[], 1830),
    (&["GeForce", "4090"], &[], 2520),
];

fn matches_product(product: &str, all_of: &[&str], none_of: &[&str]) -> bool {
    let words: Vec<String> = product
        .split(|c: char| !c.is_ascii_alphanumeric())
        .filter(|w| !w.is_empty())
        .map(str::to_ascii_lowercase)
        .collect();
    let has = |w: &&str| words.iter().any(|x| x.eq_ignore_ascii_case(w));
    all_of.iter().all(has) && !none_of.iter().any(has)
}

fn product_rule(rules: &[ProductRule], product: &str) -> Option<u32> {
    rules
        .iter()
        .find(|(all, none, _)| matches_product(product, all, none))
        .map(|r| r.2)
}

fn by_capability<T: Copy>(table: &[((i32, i32), T)], major: i32, minor: i32) -> Option<T> {
    table
        .iter()
        .rev()
        .find(|(cc, _)| *cc <= (major, minor))
        .map(|e| e.1)
}

/// SM count from the product table (see `SM_COUNT_BY_PRODUCT`).
pub fn sm_count_by_product(product: &str) -> Option<u32> {
    product_rule(SM_COUNT_BY_PRODUCT, product)
}

/// Dense FP16 tensor FLOPs per SM per clock for a product of this capability.
pub fn fp16_flops_per_sm_clock(product: &str, major: i32, minor: i32) -> Option<f64> {
    let per_sm = by_capability(FP16_FLOPS_PER_SM_CLOCK, major, minor)?;
    let geforce_half_rate = (major, minor) >= (7, 5) && matches_product(product, &["GeForce"], &[]);
    Some(if geforce_half_rate {
        per_sm / 2.0
    } else {
        per_sm
    })
}

/// Estimated dense FP16 TFLOPS = SMs × SM clock × FP16 tensor FLOPs per SM per
/// clock (`FP16_FLOPS_PER_SM_CLOCK`). The clock is NVML's maximum SM clock,
/// capped by the clock NVIDIA quotes tensor throughput at for the products in
/// `TENSOR_CLOCK_MHZ_BY_PRODUCT`. `None` when the SM count or a clock is
/// unknown.
pub fn estimate_fp16_tflops(
    product: &str,
    major: i32,
    minor: i32,
    sms: Option<u32>,
    max_sm_clock_mhz: Option<u32>,
) -> Option<f64> {
    let sms = sms.filter(|&s| s > 0)?;
    let quoted = product_rule(TENSOR_CLOCK_MHZ_BY_PRODUCT, product);
    let mhz = match (max_sm_clock_mhz.filter(|&c| c > 0), quoted) {
        (Some(max), Some(q)) => max.min(q),
        (Some(c), None) | (None, Some(c)) => c,
        (None, None) => return None,
    };
    let per_sm = fp16_flops_per_sm_clock(product, major, minor)?;
    Some(f64::from(sms) * f64::from(mhz) * per_sm / 1e6)
}

/// Estimated memory bandwidth in GB/s = bus width in bytes × maximum memory
/// clock × 2 (NVML's memory clock counts one transfer per edge of the double
/// data rate). H100 SXM: 5120 / 8 × 2619 MHz × 2 = 3352; A100 40 GB: 5120 / 8 ×
/// 1215 × 2 = 1555; RTX 4090: 384 / 8 × 10501 × 2 = 1008.
pub fn estimate_memory_bandwidth_gbps(
    bus_width_bits: Option<u32>,
    max_memory_clock_mhz: Option<u32>,
) -> Option<f64> {
    let bits = bus_width_bits.filter(|&b| b > 0)?;
    let mhz = max_memory_clock_mhz.filter(|&c| c > 0)?;
    Some(f64::from(bits) / 8.0 * f64::from(mhz) * 2.0 / 1000.0)
}

/// Bandwidth of one NVLink link, both directions together, by the value of
/// `nvmlDeviceGetNvLinkVersion` (an `nvmlNvlinkVersion_t`):
///
/// | value | NVLink | GPU       | GB/s per link | links × GB/s |
/// |-------|--------|-----------|---------------|--------------|
/// | 1     | 1.0    | P100      | 40            | 4 → 160      |
/// | 2, 3  | 2.0/2.2| V100      | 50            | 6 → 300      |
/// | 4, 5  | 3.0/3.1| A100      | 50            | 12 → 600     |
/// | 6     | 4.0    | H100      | 50            | 18 → 900     |
/// | 7     | 5.0    | B200      | 100           | 18 → 1800    |
///
/// Newer values get the newest known rate; an unknown version (0) 50.
pub fn nvlink_gbps_per_link(version: u32) -> f64 {
    match version {
        1 => 40.0,
        7.. => 100.0,
        _ => 50.0,
    }
}

/// PCIe bandwidth in GB/s, both directions together, like the NVLink figures
/// (so a Gen4 x16 link is 63 GB/s, what NVIDIA calls "64 GB/s"). Per lane and
/// direction: Gen1 0.25 and Gen2 0.5 (8b/10b), Gen3 0.985, Gen4 1.969, Gen5
/// 3.938 (128b/130b), Gen6 7.563 (FLIT). Newer generations get Gen6's rate.
pub fn pcie_gbps(generation: u32, width: u32) -> Option<f64> {
    let per_lane_one_way = match generation {
        0 => return None,
        1 => 0.25,
        2 => 0.5,
        3 => 0.985,
        4 => 1.969,
        5 => 3.938,
        _ => 7.563,
    };
    (width > 0).then(|| per_lane_one_way * 2.0 * f64::from(width))
}

/// `0000:17:00.0` from NVML's `00000000:17:00.0` (lower case, 4-digit domain).
pub fn normalize_pci_bus_id(raw: &str) -> String {
    let s = raw.trim().trim_end_matches('\0').to_ascii_lowercase();
    match s.matches(':').count() {
        1 => format!("0000:{s}"),
        2 => match s.split_once(':') {
            Some((domain, rest)) => match u32::from_str_radix(domain, 16) {
                Ok(d) => format!("{d:04x}:{rest}"),
                Err(_) => s,
            },
            None => s,
        },
        _ => s,
    }
}

/// The NUMA node of a PCI device from `<sysfs_root>/bus/pci/devices/<id>/numa_node`;
/// `-1` (no affinity) or an unreadable file is `None`.
pub fn read_numa_node(sysfs_root: &Path, pci_bus_id: &str) -> Option<i32> {
    if pci_bus_id.is_empty() {
        return None;
    }
    let path = sysfs_root
        .join("bus/pci/devices")
        .join(pci_bus_id)
        .join("numa_node");
    let node: i32 = std::fs::read_to_string(path).ok()?.trim().parse().ok()?;
    (node >= 0).then_some(node)
}

/// The id of a GPU whose UUID could not be read.
pub fn fallback_id(index: u32) -> String {
    format!("{FALLBACK_ID_PREFIX}{index}")
}

/// Whether an id is a positional stand-in (see the module docs).
pub fn is_fallback_id(id: &str) -> bool {
    id.starts_with(FALLBACK_ID_PREFIX)
}

// ---------------------------------------------------------------------------
// Errors

/// Errors that mean NVML itself is unusable, not one device.
fn is_library_error(e: &NvmlError) -> bool {
    matches!(
        e,
        NvmlError::Uninitialized
            | NvmlError::DriverNotLoaded
            | NvmlError::LibRmVersionMismatch
            | NvmlError::LibloadingError(_)
            | NvmlError::FailedToLoadSymbol(_)
            | NvmlError::FunctionNotFound
            | NvmlError::LibraryNotFound
    )
}

/// Errors that mean the device itself is gone or broken.
fn is_device_failure(e: &NvmlError) -> bool {
    matches!(
        e,
        NvmlError::GpuLost | NvmlError::ResetRequired | NvmlError::NotFound
    )
}

/// What a per-device error means for the device, in words.
fn describe_device_error(e: &NvmlError) -> String {
    match e {
        NvmlError::GpuLost => LOST.to_string(),
        NvmlError::NotFound => "the GPU is no longer present".to_string(),
        NvmlError::ResetRequired => {
            "the GPU needs a reset before it can be used again (NVML_ERROR_RESET_REQUIRED)"
                .to_string()
        }
        other => format!("NVML cannot query the GPU: {other}"),
    }
}

fn library_failed(what: &str, e: &NvmlError) -> BackendError {
    BackendError::Failed(format!("NVML failed while {what}: {e}"))
}

fn device_failed(info: &DeviceInfo, e: &NvmlError) -> BackendError {
    if is_library_error(e) {
        return library_failed(&format!("reading GPU {} ({})", info.index, info.id), e);
    }
    BackendError::Failed(format!(
        "GPU {} ({}): {}",
        info.index,
        info.id,
        describe_device_error(e)
    ))
}

fn init_error(library: &OsStr, e: NvmlError) -> BackendError {
    let lib = library.to_string_lossy();
    match e {
        NvmlError::LibloadingError(_)
        | NvmlError::FailedToLoadSymbol(_)
        | NvmlError::LibraryNotFound
        | NvmlError::FunctionNotFound => BackendError::Unavailable(format!(
            "NVML is not available: cannot load {lib} ({e}). {LOAD_HINTS}"
        )),
        NvmlError::DriverNotLoaded => BackendError::Unavailable(format!(
            "NVML is not available: {lib} loaded, but the NVIDIA kernel driver is not running \
             ({e}). {LOAD_HINTS}"
        )),
        NvmlError::LibRmVersionMismatch => BackendError::Failed(format!(
            "NVML cannot start: driver/library version mismatch: {lib} does not belong to the \
             loaded NVIDIA kernel module ({e}). This usually follows a driver upgrade without a \
             reboot: reboot the node or reload the nvidia kernel modules. In a container, the \
             driver libraries must come from the host (the NVIDIA runtime, \
             `runtimeClassName: nvidia`), not from the image."
        )),
        NvmlError::NoPermission => BackendError::Failed(format!(
            "NVML cannot start: no permission to talk to the NVIDIA driver ({e}). The container \
             cannot open /dev/nvidia*: run the pod with the NVIDIA runtime class \
             (`runtimeClassName: nvidia`) or the NVIDIA container toolkit."
        )),
        other => BackendError::Failed(format!(
            "NVML failed to initialise from {lib}: {other}. {LOAD_HINTS}"
        )),
    }
}

/// `Ok(Some)` for a value, `Ok(None)` for a reading the device or driver does
/// not give, `Err` when the device or library has failed.
fn optional<T>(r: Result<T, NvmlError>) -> Result<Option<T>, NvmlError> {
    match r {
        Ok(v) => Ok(Some(v)),
        Err(e) if is_device_failure(&e) || matches!(e, NvmlError::Uninitialized) => Err(e),
        Err(_) => Ok(None),
    }
}

// ---------------------------------------------------------------------------
// The backend

/// An NVML event set's raw handle, apart from the `EventSet<'nvml>` wrapper that
/// would borrow the backend's own `Nvml`. Created from a live set that was then
/// forgotten; freed only by `NvmlBackend::drop`.
struct DetachedEventSet(*mut c_void);

// SAFETY: `nvml-wrapper` makes `EventSet` `Send`; the handle is only used
// through `&mut NvmlBackend` or `&NvmlBackend` inside one call, never shared.
unsafe impl Send for DetachedEventSet {}

#[derive(Clone, Debug)]
struct Fault {
    reason: String,
    seen: Instant,
}

/// One event, copied out of NVML's event data.
struct Observed {
    handle: usize,
    uuid: Option<String>,
    types: EventTypes,
    xid: Option<XidError>,
}

/// What a GPU's NVLinks reach.
#[derive(Default)]
struct NvLinkView {
    /// Links straight to another listed GPU, by its position in the list.
    direct: HashMap<usize, u32>,
    /// Links to NVSwitch chips, and the switches' bus ids.
    switch_links: u32,
    switches: HashSet<String>,
    /// The slowest active link's bandwidth.
    per_link_gbps: Option<f64>,
}

pub struct NvmlBackend {
    nvml: Nvml,
    events: Option<DetachedEventSet>,
    /// Raw device handle (as an address: an identity only) → id, for the devices
    /// registered in the event set.
    event_devices: HashMap<usize, String>,
    faults: HashMap<String, Fault>,
    fault_hold: Duration,
    sysfs_root: PathBuf,
    /// The last good reading of each index, with the device count at the time.
    known: HashMap<u32, DeviceInfo>,
    known_count: Option<u32>,
    /// Indices unreadable at the last `devices()`, to warn once per episode.
    unreadable: HashSet<u32>,
    /// Products already warned about for lack of an estimate.
    unestimated: HashSet<String>,
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
            .map_err(|e| init_error(&library, e))?;
        let mut backend = Self {
            nvml,
            events: None,
            event_devices: HashMap::new(),
            faults: HashMap::new(),
            fault_hold: DEFAULT_FAULT_HOLD,
            sysfs_root: PathBuf::from(DEFAULT_SYSFS_ROOT),
            known: HashMap::new(),
            known_count: None,
            unreadable: HashSet::new(),
            unestimated: HashSet::new(),
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
    /// last such event; default [`DEFAULT_FAULT_HOLD`].
    pub fn with_fault_hold(mut self, hold: Duration) -> Self {
        self.fault_hold = hold;
        self
    }

    /// Ids of the devices that receive events; the others are only polled.
    pub fn event_registered_devices(&self) -> Vec<String> {
        let mut ids: Vec<String> = self.event_devices.values().cloned().collect();
        ids.sort();
        ids
    }

    fn register_events(&mut self) {
        let wanted = EventTypes::CRITICAL_XID_ERROR | EventTypes::DOUBLE_BIT_ECC_ERROR;
        let count = match self.nvml.device_count() {
            Ok(c) => c,
            Err(e) => {
                tracing::warn!(error = %e, "cannot count GPUs to register NVML events; health is polled only");
                return;
            }
        };
        let mut candidates = Vec::new();
        for index in 0..count {
            let Ok(device) = self.nvml.device_by_index(index) else {
                continue;
            };
            let mask = match device.supported_event_types() {
                Ok(supported) => supported & wanted,
                Err(e) => {
                    tracing::info!(index, error = %e, "GPU does not support NVML events; its health is polled only");
                    continue;
                }
            };
            if mask.is_empty() {
                tracing::info!(
                    index,
                    "GPU supports neither Xid nor ECC events; its health is polled only"
                );
                continue;
            }
            if let Ok(id) = device.uuid() {
                candidates.push((index, id, mask));
            }
        }
        // A failed registration frees the whole set (nvml-wrapper), so start
        // over without the device that failed.
        while !candidates.is_empty() {
            match build_event_set(&self.nvml, &candidates) {
                Ok((set, devices)) => {
                    // SAFETY: only used as an identity and to rebuild a wrapper
                    // that is never dropped; the set is forgotten right after.
                    let raw = unsafe { set.handle() };
                    std::mem::forget(set);
                    self.events = Some(DetachedEventSet(raw.cast::<c_void>()));
                    self.event_devices = devices;
                    return;
                }
                Err((None, e)) => {
                    tracing::warn!(error = %e, "cannot create an NVML event set; health is polled only");
                    return;
                }
                Err((Some(k), e)) => {
                    let (index, _, _) = candidates.remove(k);
                    tracing::info!(index, error = %e, "cannot register GPU for NVML events; its health is polled only");
                }
            }
        }
    }

    fn with_event_set<R>(&self, f: impl FnOnce(&EventSet<'_>) -> R) -> Option<R> {
        let detached = self.events.as_ref()?;
        // SAFETY: the handle is a live set created by `self.nvml` (see
        // `DetachedEventSet`); `ManuallyDrop` keeps this temporary wrapper from
        // freeing it.
        let set = ManuallyDrop::new(unsafe { EventSet::new(detached.0.cast(), &self.nvml) });
        Some(f(&set))
    }

    /// Takes every pending event (zero timeout) and records faults.
    fn drain_events(&mut self) {
        let observed = self
            .with_event_set(|set| {
                let mut out = Vec::new();
                for _ in 0..MAX_EVENTS_PER_DRAIN {
                    match set.wait(0) {
                        Ok(data) => {
                            // SAFETY: the handle is compared as an address only.
                            let handle = unsafe { data.device.handle() }.addr();
                            out.push(Observed {
                                handle,
                                uuid: data.device.uuid().ok(),
                                types: data.event_type,
                                xid: data.event_data,
                            });
                        }
                        Err(NvmlError::Timeout) => break,
                        Err(e) => {
                            tracing::debug!(error = %e, "NVML event wait failed; polling covers lost GPUs");
                            break;
                        }
                    }
                }
                out
            })
            .unwrap_or_default();
        let now = Instant::now();
        for ev in observed {
            let Some(reason) = event_reason(&ev) else {
                tracing::debug!(xid = ?ev.xid, "application-level Xid ignored");
                continue;
            };
            let ids: Vec<String> = match self.event_devices.get(&ev.handle).cloned().or(ev.uuid) {
                Some(id) => vec![id],
                // An event NVML cannot attribute concerns every GPU.
                None => self.event_devices.values().cloned().collect(),
            };
            for id in ids {
                tracing::warn!(device = %id, %reason, "GPU fault reported by NVML");
                self.faults.insert(
                    id,
                    Fault {
                        reason: reason.clone(),
                        seen: now,
                    },
                );
            }
        }
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

    fn read_device(&self, index: u32) -> Result<DeviceInfo, NvmlError> {
        let d = self.nvml.device_by_index(index)?;
        let id = d.uuid()?;
        let product = d.name()?;
        let memory_total_bytes = d.memory_info()?.total;
        let cc = d.cuda_compute_capability()?;
        let sms = sm_count(&d, &product, cc.major, cc.minor)?;
        let max_sm = optional(d.max_clock_info(Clock::SM))?;
        let max_mem = optional(d.max_clock_info(Clock::Memory))?;
        let bus_width = optional(d.memory_bus_width())?;
        let pci_bus_id = normalize_pci_bus_id(&d.pci_info()?.bus_id);
        let numa_node = read_numa_node(&self.sysfs_root, &pci_bus_id);
        let fp16_tflops = estimate_fp16_tflops(&product, cc.major, cc.minor, sms, max_sm);
        let memory_bandwidth_gbps = estimate_memory_bandwidth_gbps(bus_width, max_mem);
        Ok(DeviceInfo {
            id,
            index,
            vendor: Vendor::Nvidia,
            product,
            memory_total_bytes,
            architecture: format!("{}.{}", cc.major, cc.minor),
            compute_units: sms.unwrap_or(0),
            fp16_tflops: fp16_tflops.unwrap_or(PLACEHOLDER_FIGURE),
            memory_bandwidth_gbps: memory_bandwidth_gbps.unwrap_or(PLACEHOLDER_FIGURE),
            pci_bus_id,
            numa_node,
        })
    }

    fn scan_nvlinks(
        &self,
        d: &Device<'_>,
        position_by_bus: &HashMap<&str, usize>,
        gpu_buses: &HashSet<String>,
    ) -> NvLinkView {
        let mut view = NvLinkView::default();
        for link in 0..NVLINK_MAX_LINKS {
            let l = d.link_wrapper_for(link);
            match l.is_active() {
                Ok(true) => {}
                Ok(false) => continue,
                // No NVLink on this GPU at all.
                Err(NvmlError::NotSupported) if link == 0 => break,
                // Past the GPU's last link.
                Err(NvmlError::InvalidArg) => break,
                Err(_) => continue,
            }
            let gbps = nvlink_gbps_per_link(l.version().unwrap_or(0));
            view.per_link_gbps = Some(view.per_link_gbps.map_or(gbps, |g| g.min(gbps)));
            // A far end NVML cannot name is taken to be a switch (an unnamed
            // one, shared by every GPU with such links).
            let bus = l
                .remote_pci_info()
                .map(|remote| normalize_pci_bus_id(&remote.bus_id))
                .unwrap_or_default();
            if let Some(&p) = position_by_bus.get(bus.as_str()) {
                *view.direct.entry(p).or_default() += 1;
            } else if !gpu_buses.contains(&bus) {
                // Neither a listed GPU nor any GPU of the node: an NVSwitch.
                view.switch_links += 1;
                view.switches.insert(bus);
            }
        }
        view
    }

    /// P2P over PCIe as NVML reports it (read capability); if NVML cannot say,
    /// assumed only below a common PCIe switch (topology levels internal,
    /// single and multiple switch), never across a host bridge or CPU.
    fn pcie_p2p(&self, a: &Device<'_>, b: &Device<'_>) -> bool {
        match a.p2p_status(b, P2pCapabilitiesIndex::Read) {
            Ok(status) => status == P2pStatus::Ok,
            Err(e) => {
                tracing::debug!(error = %e, "NVML P2P status unavailable; judging from the PCIe topology");
                matches!(
                    self.nvml.topology_common_ancestor(a, b),
                    Ok(TopologyLevel::Internal | TopologyLevel::Single | TopologyLevel::Multiple)
                )
            }
        }
    }
}

impl Drop for NvmlBackend {
    fn drop(&mut self) {
        if let Some(detached) = self.events.take() {
            // SAFETY: the live set created by `self.nvml`; this is the only
            // place it is freed, and `nvml` is still initialised.
            let set = unsafe { EventSet::new(detached.0.cast(), &self.nvml) };
            if let Err(e) = set.release_events() {
                tracing::debug!(error = %e, "freeing the NVML event set failed");
            }
        }
    }
}

/// A GPU to register for events: index, id and the events it supports.
type Candidate = (u32, String, EventTypes);
/// A set with its devices (handle address → id).
type RegisteredSet<'n> = (EventSet<'n>, HashMap<usize, String>);
/// The candidate that failed (`None`: creating the set failed) and why.
type RegistrationFailure = (Option<usize>, NvmlError);

/// An event set with every candidate registered, or the failing candidate
/// (`None`: the set could not be created) and the error.
fn build_event_set<'n>(
    nvml: &'n Nvml,
    candidates: &[Candidate],
) -> Result<RegisteredSet<'n>, RegistrationFailure> {
    let mut set = nvml.create_event_set().map_err(|e| (None, e))?;
    let mut devices = HashMap::new();
    for (k, (index, id, mask)) in candidates.iter().enumerate() {
        let device = nvml.device_by_index(*index).map_err(|e| (Some(k), e))?;
        // SAFETY: compared as an address only.
        let handle = unsafe { device.handle() }.addr();
        set = device
            .register_events(*mask, set)
            .map_err(|e| (Some(k), e.error))?;
        devices.insert(handle, id.clone());
    }
    Ok((set, devices))
}

fn event_reason(ev: &Observed) -> Option<String> {
    if ev.types.contains(EventTypes::CRITICAL_XID_ERROR) {
        return match &ev.xid {
            Some(XidError::Value(code)) if !xid_is_critical(*code) => None,
            Some(XidError::Value(code)) => Some(xid_reason(*code)),
            Some(XidError::Unknown) | None => Some("Xid (code unknown)".to_string()),
        };
    }
    if ev.types.contains(EventTypes::DOUBLE_BIT_ECC_ERROR) {
        return Some("double-bit (uncorrectable) ECC error".to_string());
    }
    None
}

/// SMs: NVML attributes (MIG devices), else CUDA cores / cores per SM, else the
/// product table.
fn sm_count(
    d: &Device<'_>,
    product: &str,
    major: i32,
    minor: i32,
) -> Result<Option<u32>, NvmlError> {
    if let Some(a) = optional(d.attributes())?
        && a.multiprocessor_count > 0
    {
        return Ok(Some(a.multiprocessor_count));
    }
    if let Some(cores) = optional(d.num_cores())?
        && let Some(per_sm) = by_capability(CUDA_CORES_PER_SM, major, minor)
        && cores > 0
        && cores % per_sm == 0
    {
        return Ok(Some(cores / per_sm));
    }
    Ok(sm_count_by_product(product))
}

/// PCIe bandwidth of a GPU's link. The generation is the maximum the GPU and
/// slot allow: the current one drops while the GPU idles (nvidia-smi: "these
/// may be reduced when the GPU is not in use"), which says nothing about the
/// bandwidth it will get. Current values are the fallback.
fn pcie_link_gbps(d: &Device<'_>) -> Option<f64> {
    let generation = d
        .max_pcie_link_gen()
        .or_else(|_| d.current_pcie_link_gen())
        .ok()?;
    let width = d
        .max_pcie_link_width()
        .or_else(|_| d.current_pcie_link_width())
        .ok()?;
    pcie_gbps(generation, width)
}

fn placeholder(index: u32) -> DeviceInfo {
    DeviceInfo {
        id: fallback_id(index),
        index,
        vendor: Vendor::Nvidia,
        product: "NVIDIA GPU (unreadable)".to_string(),
        memory_total_bytes: 1,
        architecture: "unknown".to_string(),
        compute_units: 0,
        fp16_tflops: PLACEHOLDER_FIGURE,
        memory_bandwidth_gbps: PLACEHOLDER_FIGURE,
        pci_bus_id: String::new(),
        numa_node: None,
    }
}

impl GpuBackend for NvmlBackend {
    fn name(&self) -> &str {
        "nvml"
    }

    /// Every GPU NVML counts, in index order; unreadable ones as described in
    /// the module docs.
    fn devices(&mut self) -> Result<Vec<DeviceInfo>, BackendError> {
        let count = self
            .nvml
            .device_count()
            .map_err(|e| library_failed("counting the GPUs", &e))?;
        let readings: Vec<Result<DeviceInfo, NvmlError>> =
            (0..count).map(|i| self.read_device(i)).collect();
        let readable: HashSet<String> = readings
            .iter()
            .filter_map(|r| r.as_ref().ok().map(|d| d.id.clone()))
            .collect();
        let trust_cache = self.known_count == Some(count);
        let mut known = HashMap::new();
        let mut unreadable = HashSet::new();
        let mut out = Vec::with_capacity(readings.len());
        for (index, reading) in (0..count).zip(readings) {
            let info = match reading {
                Ok(info) => info,
                Err(e) if is_library_error(&e) => {
                    return Err(library_failed(&format!("reading GPU {index}"), &e));
                }
                Err(e) => {
                    let cached = self
                        .known
                        .get(&index)
                        .filter(|c| trust_cache && !readable.contains(&c.id))
                        .cloned();
                    if !self.unreadable.contains(&index) {
                        tracing::warn!(
                            index, error = %e, known = cached.is_some(),
                            "GPU cannot be read; listing it so it is reported unhealthy"
                        );
                    }
                    unreadable.insert(index);
                    cached.unwrap_or_else(|| placeholder(index))
                }
            };
            if !is_fallback_id(&info.id) {
                let unestimated = info.fp16_tflops == PLACEHOLDER_FIGURE
                    || info.memory_bandwidth_gbps == PLACEHOLDER_FIGURE;
                if unestimated && self.unestimated.insert(info.product.clone()) {
                    tracing::warn!(
                        index, product = %info.product, sms = info.compute_units,
                        "NVML does not give what the throughput or bandwidth estimate needs \
                         (SM count, clocks, bus width); using a placeholder. Add the product \
                         to the tables in backend/nvml.rs"
                    );
                }
                known.insert(index, info.clone());
            }
            out.push(info);
        }
        self.known = known;
        self.known_count = Some(count);
        self.unreadable = unreadable;
        Ok(out)
    }

    fn telemetry(&mut self, info: &DeviceInfo) -> Result<Telemetry, BackendError> {
        let d = self.handle(info).map_err(|e| device_failed(info, &e))?;
        let read = |r| optional(r).map_err(|e| device_failed(info, &e));
        let temperature_c = read(d.temperature(TemperatureSensor::Gpu))?.map(f64::from);
        let power_w = read(d.power_usage())?.map(|mw| f64::from(mw) / 1000.0);
        let graphics_clock_mhz = read(d.clock_info(Clock::Graphics))?;
        let memory_clock_mhz = read(d.clock_info(Clock::Memory))?;
        let utilization_percent = optional(d.utilization_rates())
            .map_err(|e| device_failed(info, &e))?
            .map(|u| u.gpu);
        let memory = optional(d.memory_info()).map_err(|e| device_failed(info, &e))?;
        Ok(Telemetry {
            temperature_c,
            power_w,
            graphics_clock_mhz,
            memory_clock_mhz,
            utilization_percent,
            memory_used_bytes: memory.as_ref().map_or(0, |m| m.used),
            memory_free_bytes: memory.as_ref().map_or(0, |m| m.free),
        })
    }

    /// Raw health: unhealthy while an event-reported fault (a critical Xid or a
    /// double-bit ECC error) is younger than the fault hold, or when polling
    /// finds uncorrected ECC errors since the driver loaded, or the GPU lost or
    /// gone. All reasons found are joined with `; `. Pending events are drained
    /// first (zero timeout).
    fn health(&mut self, info: &DeviceInfo) -> Result<RawHealth, BackendError> {
        self.drain_events();
        let mut reasons = Vec::new();
        let now = Instant::now();
        if let Some(f) = self.faults.get(&info.id) {
            if now.saturating_duration_since(f.seen) < self.fault_hold {
                reasons.push(f.reason.clone());
            } else {
                self.faults.remove(&info.id);
            }
        }
        match self.handle(info) {
            Err(e) if is_library_error(&e) => return Err(device_failed(info, &e)),
            Err(e) => reasons.push(describe_device_error(&e)),
            Ok(d) => match d.total_ecc_errors(MemoryError::Uncorrected, EccCounter::Volatile) {
                Ok(0) => {}
                Ok(n) => reasons.push(format!(
                    "{n} uncorrectable (double-bit) ECC error(s) since the driver loaded; the GPU needs a reset"
                )),
                Err(e) if is_library_error(&e) => return Err(device_failed(info, &e)),
                Err(e) if is_device_failure(&e) => reasons.push(describe_device_error(&e)),
                // No ECC (or no permission): check the GPU answers at all.
                Err(_) => match d.temperature(TemperatureSensor::Gpu) {
                    Err(e) if is_device_failure(&e) => reasons.push(describe_device_error(&e)),
                    _ => {}
                },
            },
        }
        Ok(if reasons.is_empty() {
            RawHealth::Healthy
        } else {
            RawHealth::Unhealthy(reasons.join("; "))
        })
    }

    /// One link per pair of readable devices (`a` before `b` by index):
    ///
    /// - **NVLink** when the pair shares links: direct links to each other,
    ///   plus, when both reach a common NVSwitch, the smaller of their switch
    ///   link counts (through the switches a GPU can use all its links to talk
    ///   to any one peer). Bandwidth = links × per-link bandwidth of the slower
    ///   GPU ([`nvlink_gbps_per_link`]); an 8×H100 HGX gives 18 × 50 = 900 GB/s
    ///   for every pair. P2P is true.
    /// - Otherwise **PCIe**: bandwidth of the slower end's link ([`pcie_gbps`]),
    ///   P2P as NVML's P2P status (read) reports.
    ///
    /// A remote end whose PCI bus id is no GPU of the node (or that NVML cannot
    /// name) is taken to be an NVSwitch. (`nvml-wrapper` 0.13's
    /// `remote_device_type` always answers "unknown", so it cannot be asked.)
    /// An NVLink to a CPU (IBM POWER9 NPUs) would be misread as a switch link.
    fn links(&mut self, devices: &[DeviceInfo]) -> Result<Vec<Link>, BackendError> {
        let mut devs: Vec<&DeviceInfo> = devices.iter().collect();
        devs.sort_by_key(|d| d.index);
        let count = self
            .nvml
            .device_count()
            .map_err(|e| library_failed("counting the GPUs", &e))?;
        let mut gpu_buses: HashSet<String> = (0..count)
            .filter_map(|i| self.nvml.device_by_index(i).ok()?.pci_info().ok())
            .map(|p| normalize_pci_bus_id(&p.bus_id))
            .collect();
        gpu_buses.extend(
            devs.iter()
                .filter(|d| !d.pci_bus_id.is_empty())
                .map(|d| d.pci_bus_id.clone()),
        );
        let position_by_bus: HashMap<&str, usize> = devs
            .iter()
            .enumerate()
            .filter(|(_, d)| !d.pci_bus_id.is_empty())
            .map(|(i, d)| (d.pci_bus_id.as_str(), i))
            .collect();
        let handles: Vec<Option<Device<'_>>> = devs.iter().map(|d| self.handle(d).ok()).collect();
        let nvlinks: Vec<NvLinkView> = handles
            .iter()
            .map(|h| {
                h.as_ref()
                    .map(|d| self.scan_nvlinks(d, &position_by_bus, &gpu_buses))
                    .unwrap_or_default()
            })
            .collect();
        let pcie: Vec<Option<f64>> = handles
            .iter()
            .map(|h| h.as_ref().and_then(pcie_link_gbps))
            .collect();

        let mut links = Vec::new();
        for i in 0..devs.len() {
            for j in i + 1..devs.len() {
                let (Some(a), Some(b)) = (&handles[i], &handles[j]) else {
                    continue;
                };
                if devs[i].id == devs[j].id {
                    continue;
                }
                let (va, vb) = (&nvlinks[i], &nvlinks[j]);
                let direct = va
                    .direct
                    .get(&j)
                    .copied()
                    .unwrap_or(0)
                    .max(vb.direct.get(&i).copied().unwrap_or(0));
                let switched = if va.switches.is_disjoint(&vb.switches) {
                    0
                } else {
                    va.switch_links.min(vb.switch_links)
                };
                let (kind, bandwidth_gbps, p2p) = if direct + switched > 0 {
                    let per_link = match (va.per_link_gbps, vb.per_link_gbps) {
                        (Some(x), Some(y)) => x.min(y),
                        (Some(x), None) | (None, Some(x)) => x,
                        (None, None) => nvlink_gbps_per_link(0),
                    };
                    (
                        LinkKind::Nvlink,
                        f64::from(direct + switched) * per_link,
                        true,
                    )
                } else {
                    let bw = match (pcie[i], pcie[j]) {
                        (Some(x), Some(y)) => x.min(y),
                        (Some(x), None) | (None, Some(x)) => x,
                        (None, None) => 0.0,
                    };
                    (LinkKind::Pcie, bw, self.pcie_p2p(a, b))
                };
                links.push(Link {
                    a: devs[i].id.clone(),
                    b: devs[j].id.clone(),
                    kind,
                    bandwidth_gbps,
                    p2p,
                });
            }
        }
        Ok(links)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: f64, b: f64, tolerance: f64) -> bool {
        (a - b).abs() <= tolerance
    }

    #[test]
    fn fp16_estimates_match_data_sheets() {
        // Product, compute capability, SMs, NVML max SM clock, data-sheet TFLOPS.
        type Case = (&'static str, (i32, i32), u32, u32, f64);
        let cases: &[Case] = &[
            ("NVIDIA H100 80GB HBM3", (9, 0), 132, 1980, 989.4),
            ("NVIDIA H100 PCIe", (9, 0), 114, 1755, 756.0),
            ("NVIDIA A100-SXM4-80GB", (8, 0), 108, 1410, 312.0),
            ("NVIDIA A100-PCIE-40GB", (8, 0), 108, 1410, 312.0),
            ("NVIDIA GeForce RTX 4090", (8, 9), 128, 3105, 165.2),
            ("NVIDIA L4", (8, 9), 58, 2040, 121.0),
            ("Tesla V100-SXM2-32GB", (7, 0), 80, 1530, 125.0),
            ("Tesla T4", (7, 5), 40, 1590, 65.0),
            ("NVIDIA A40", (8, 6), 84, 1740, 149.7),
        ];
        for &(product, (major, minor), sms, clock, want) in cases {
            let got = estimate_fp16_tflops(product, major, minor, Some(sms), Some(clock)).unwrap();
            assert!(close(got, want, want * 0.01), "{product}: {got} vs {want}");
        }
        assert_eq!(estimate_fp16_tflops("x", 9, 0, None, Some(1980)), None);
        assert_eq!(estimate_fp16_tflops("x", 9, 0, Some(132), None), None);
    }

    #[test]
    fn bandwidth_estimates_match_data_sheets() {
        let h100 = estimate_memory_bandwidth_gbps(Some(5120), Some(2619)).unwrap();
        assert!(close(h100, 3352.3, 0.1), "{h100}");
        let a100 = estimate_memory_bandwidth_gbps(Some(5120), Some(1215)).unwrap();
        assert!(close(a100, 1555.2, 0.1), "{a100}");
        let rtx = estimate_memory_bandwidth_gbps(Some(384), Some(10501)).unwrap();
        assert!(close(rtx, 1008.1, 0.1), "{rtx}");
        assert_eq!(estimate_memory_bandwidth_gbps(Some(0), Some(1)), None);
    }

    #[test]
    fn link_tables() {
        assert_eq!(18.0 * nvlink_gbps_per_link(6), 900.0);
        assert_eq!(12.0 * nvlink_gbps_per_link(4), 600.0);
        assert_eq!(18.0 * nvlink_gbps_per_link(7), 1800.0);
        assert!(close(pcie_gbps(4, 16).unwrap(), 63.0, 0.01));
        assert!(close(pcie_gbps(5, 16).unwrap(), 126.0, 0.1));
        assert_eq!(pcie_gbps(0, 16), None);
        assert_eq!(pcie_gbps(4, 0), None);
    }

    #[test]
    fn products_and_ids() {
        assert_eq!(sm_count_by_product("NVIDIA A100-PCIE-40GB"), Some(108));
        assert_eq!(sm_count_by_product("NVIDIA A10"), Some(72));
        assert_eq!(sm_count_by_product("NVIDIA A10G"), Some(80));
        assert_eq!(sm_count_by_product("NVIDIA H100 PCIe"), Some(114));
        assert_eq!(sm_count_by_product("NVIDIA H100 80GB HBM3"), Some(132));
        assert_eq!(sm_count_by_product("NVIDIA L40S"), Some(142));
        assert_eq!(sm_count_by_product("NVIDIA T400"), None);
        assert_eq!(normalize_pci_bus_id("00000000:2A:00.0"), "0000:2a:00.0");
        assert_eq!(normalize_pci_bus_id("0000:17:00.0"), "0000:17:00.0");
        assert_eq!(normalize_pci_bus_id("17:00.0"), "0000:17:00.0");
        assert!(is_fallback_id(&fallback_id(3)));
        assert!(!is_fallback_id("GPU-1234"));
    }

    #[test]
    fn xids() {
        assert_eq!(xid_reason(79), "Xid 79: GPU has fallen off the bus");
        assert_eq!(xid_reason(4242), "Xid 4242");
        for code in APPLICATION_XIDS {
            assert!(!xid_is_critical(code));
        }
        assert!(xid_is_critical(79) && xid_is_critical(48));
    }

    #[test]
    fn numa_from_sysfs() {
        let root = std::env::temp_dir().join(format!("tessera-nvml-numa-{}", std::process::id()));
        for (bus, node) in [("0000:17:00.0", "1\n"), ("0000:18:00.0", "-1\n")] {
            let dir = root.join("bus/pci/devices").join(bus);
            std::fs::create_dir_all(&dir).unwrap();
            std::fs::write(dir.join("numa_node"), node).unwrap();
        }
        assert_eq!(read_numa_node(&root, "0000:17:00.0"), Some(1));
        assert_eq!(read_numa_node(&root, "0000:18:00.0"), None);
        assert_eq!(read_numa_node(&root, "0000:19:00.0"), None);
        std::fs::remove_dir_all(&root).unwrap();
    }
}
