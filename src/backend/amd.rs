//! AMD GPUs from sysfs, found the way AMD's own Kubernetes device plugin finds
//! them: the KFD topology (`/sys/class/kfd/kfd/topology/nodes`) says which
//! nodes are GPUs, what they compute and how they are wired; the DRM device
//! (`/sys/class/drm/card<N>/device`) gives live memory use, sensors and RAS
//! counters. Nothing is cached: every call re-reads the files, so a removed
//! device, a new error count or a hot sensor shows on the next call.
//!
//! # What is read
//!
//! KFD node `properties` (`name value` lines): a node is a GPU when
//! `simd_count` is non-zero. `vendor_id` (4098 = 0x1002), `device_id`,
//! `location_id` (PCI `bus << 8 | device << 3 | function`, with `domain`
//! apart), `drm_render_minor`, `simd_count` / `simd_per_cu` (= compute units),
//! `max_engine_clk_fcompute` (MHz), `gfx_target_version` (`90402` = gfx942:
//! major·10000 + minor·100 + stepping, the stepping printed in hex) and
//! `unique_id`. `mem_banks/<M>/properties`: `heap_type` (1 and 2 are VRAM),
//! `size_in_bytes`, `width` (bits), `mem_clk_max` (MHz). `io_links/<L>` and
//! `p2p_links/<L>` `properties`: `type` (11 = xGMI, 2 = PCIe), `node_from`,
//! `node_to`, `min_bandwidth` / `max_bandwidth` (MB/s, one direction).
//!
//! DRM device, matched to the KFD node by PCI address (`uevent`'s
//! `PCI_SLOT_NAME`, else the name of the `device` link's target), else by the
//! render node (`device/drm/renderD<minor>`): `vendor`, `mem_info_vram_total`,
//! `mem_info_vram_used`, `gpu_busy_percent`, `numa_node`, `product_name`,
//! `unique_id`, `current_link_speed` / `current_link_width`,
//! `ras/umc_err_count` and `hwmon/hwmon*/` (`temp*_input` in m°C with
//! `temp*_label`, `power1_average` or `power1_input` in µW, `freq*_input` in
//! Hz labelled `sclk` / `mclk`).
//!
//! # Decisions
//!
//! - **Id**: the 64-bit ASIC `unique_id` (KFD, else the DRM file) as `0x` and
//!   lower-case hex without padding, as `rocm-smi --showuniqueid` prints it;
//!   without one, the PCI bus id (`0000:c1:00.0`, what AMD's device plugin
//!   uses). Should two devices ever report the same unique id, both fall back
//!   to their PCI bus ids so ids stay unique.
//! - **Index**: devices ordered by PCI bus id, numbered from 0.
//! - **Partitioned GPUs** (MI300 CPX/DPX modes show several KFD nodes with the
//!   same PCI address) are reported as one device: compute units are summed,
//!   clocks and GFX target come from the first node.
//! - **Product**: `product_name` when the board has one, else [`PRODUCTS`] by
//!   PCI device id, else `AMD GPU 0x<device id>`.
//! - **FP16**: compute units × max engine clock × dense FP16 FLOPs per CU per
//!   clock for the GFX target ([`fp16_flops_per_cu_clock`]).
//! - **Memory bandwidth**: VRAM width × `mem_clk_max` × transfers per memory
//!   clock for the GFX target ([`transfers_per_memory_clock`]) / 8. For a
//!   product in [`PRODUCTS`] the datasheet figure wins when that estimate is
//!   more than 25 % off (a clock reported in another convention), and when
//!   the target's factor is unknown; otherwise the width and clock are taken
//!   as double data rate; without them, [`FALLBACK_MEMORY_BANDWIDTH_GBPS`].
//! - **Temperature**: the `edge` sensor when there is one (what the board
//!   reports as "GPU temperature", comparable with other vendors and with the
//!   default thermal limit), else `junction` (MI300 has no edge sensor; its
//!   hotspot runs 10–20 °C above edge), else `temp1_input`.
//! - **Links**: bandwidths are both directions together, like the datasheet
//!   figures (MI300X: 128 GB/s per xGMI link). xGMI pairs: link count
//!   (`max_bandwidth / min_bandwidth`, as the kernel reports one link as the
//!   minimum) × the product's per-link figure; for products not in the table,
//!   2 × `max_bandwidth`. Every other pair is PCIe at the slower of the two
//!   devices' `current_link_speed × current_link_width` (after line
//!   encoding), both directions; a GPU that lowers its link speed while idle
//!   reports less then. Without a readable speed, the KFD's figure for the
//!   link to the host; else [`FALLBACK_PCIE_GBPS`]. PCIe `p2p` is true only
//!   when the KFD lists a `p2p_links` entry between the two GPUs: the kernel
//!   creates those only for peers it checked can reach each other's VRAM
//!   over PCIe (large BAR, p2pdma distance, `CONFIG_HSA_AMD_P2P`); without
//!   one (older kernels too) p2p is false, the safe assumption.
//! - **Health**: a device whose KFD node or DRM device is gone, whose files
//!   can no longer be read, or whose `ras/umc_err_count` shows uncorrectable
//!   errors is unhealthy. RAS counts are since the driver loaded, so such a
//!   device stays unhealthy until the driver is reloaded. Raw state only; the
//!   caller applies hysteresis.
//! - **Malformed files**: a KFD property that is not a number is an error of
//!   `devices()` / `links()` naming the file and key; a DRM file that cannot
//!   be read or parsed fails `telemetry()` (the snapshot then reports the
//!   device unhealthy with the reason) or makes `health()` unhealthy. A sensor
//!   the driver says it does not support (`EOPNOTSUPP`, `ENODATA`, `EINVAL`)
//!   is simply absent.

use std::collections::{BTreeMap, HashMap};
use std::io;
use std::path::{Path, PathBuf};

use super::{BackendError, DeviceInfo, GpuBackend, Link, RawHealth, Telemetry};
use crate::api::{LinkKind, Vendor};

/// Where sysfs is mounted on a node (or in a container given the host's `/sys`).
pub const DEFAULT_SYSFS_ROOT: &str = "/sys";

/// KFD topology nodes under the sysfs root.
const KFD_NODES: &str = "class/kfd/kfd/topology/nodes";
/// DRM devices under the sysfs root.
const DRM_CLASS: &str = "class/drm";
/// PCI vendor id of AMD/ATI (4098).
const AMD_PCI_VENDOR: u64 = 0x1002;
/// KFD io_link `type` values (`HSA_IOLINKTYPE_PCIEXPRESS`, `HSA_IOLINK_TYPE_XGMI`).
const IOLINK_PCIE: u64 = 2;
const IOLINK_XGMI: u64 = 11;

/// Memory bandwidth used when neither sysfs nor [`PRODUCTS`] can tell: low on
/// purpose (dual-channel DDR5 class) so the planner never favours a device it
/// cannot characterise.
pub const FALLBACK_MEMORY_BANDWIDTH_GBPS: f64 = 64.0;
/// One xGMI link, both directions, when neither the product nor the kernel
/// says: 16 lanes × 25 Gb/s each way, the kernel's own assumption for MI200.
pub const FALLBACK_XGMI_LINK_GBPS: f64 = 100.0;
/// PCIe between two GPUs when the link speed cannot be read: Gen4 x16, both directions.
pub const FALLBACK_PCIE_GBPS: f64 = 63.0;

/// Linux errno values with which amdgpu says "this sensor is not supported here".
const EINVAL: i32 = 22;
const ENODATA: i32 = 61;
const EOPNOTSUPP: i32 = 95;

/// Datasheet figures of AMD Instinct products, by PCI device id (ids from the
/// `amdgpu.ids` table shipped with libdrm). Used for the product name when the
/// board has no `product_name`, for the xGMI per-link bandwidth, and as the
/// fallback for compute and memory figures sysfs does not give.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AmdProduct {
    pub device_id: u32,
    pub name: &'static str,
    /// Dense FP16 TFLOPS of one KFD device (one GCD on MI250X).
    pub fp16_tflops: f64,
    /// Peak memory bandwidth of one KFD device, GB/s.
    pub memory_bandwidth_gbps: f64,
    /// One Infinity Fabric (xGMI) link, both directions, GB/s.
    pub xgmi_link_gbps: f64,
}

pub const PRODUCTS: &[AmdProduct] = &[
    // 304 CUs × 2100 MHz, HBM3 8192 bit × 5.2 Gb/s, 7 links of 128 GB/s.
    AmdProduct {
        device_id: 0x74a1,
        name: "AMD Instinct MI300X",
        fp16_tflops: 1307.4,
        memory_bandwidth_gbps: 5300.0,
        xgmi_link_gbps: 128.0,
    },
    // Same compute as MI300X, 256 GB HBM3E at 6 TB/s.
    AmdProduct {
        device_id: 0x74a5,
        name: "AMD Instinct MI325X",
        fp16_tflops: 1307.4,
        memory_bandwidth_gbps: 6000.0,
        xgmi_link_gbps: 128.0,
    },
    // APU: 228 CUs × 2100 MHz, 128 GB unified HBM3.
    AmdProduct {
        device_id: 0x74a0,
        name: "AMD Instinct MI300A",
        fp16_tflops: 980.6,
        memory_bandwidth_gbps: 5300.0,
        xgmi_link_gbps: 128.0,
    },
    // Each MI250X package is two GCDs, each its own KFD node: per GCD 110 CUs
    // × 1700 MHz, 64 GB HBM2e 4096 bit × 3.2 Gb/s; links 100 GB/s.
    AmdProduct {
        device_id: 0x7408,
        name: "AMD Instinct MI250X",
        fp16_tflops: 191.5,
        memory_bandwidth_gbps: 1638.4,
        xgmi_link_gbps: 100.0,
    },
    // amdgpu.ids names 0x740c "MI250X / MI250"; figures are MI250X's per GCD
    // (MI250: 104 CUs, 181 TFLOPS per GCD).
    AmdProduct {
        device_id: 0x740c,
        name: "AMD Instinct MI250X / MI250",
        fp16_tflops: 191.5,
        memory_bandwidth_gbps: 1638.4,
        xgmi_link_gbps: 100.0,
    },
    // 104 CUs × 1700 MHz, HBM2e 4096 bit × 3.2 Gb/s, bridge links 100 GB/s.
    AmdProduct {
        device_id: 0x740f,
        name: "AMD Instinct MI210",
        fp16_tflops: 181.0,
        memory_bandwidth_gbps: 1638.4,
        xgmi_link_gbps: 100.0,
    },
    // 120 CUs × 1502 MHz, HBM2 4096 bit × 2.4 Gb/s, 3 links of 92 GB/s.
    AmdProduct {
        device_id: 0x738c,
        name: "AMD Instinct MI100",
        fp16_tflops: 184.6,
        memory_bandwidth_gbps: 1228.8,
        xgmi_link_gbps: 92.0,
    },
    // 256 CUs × 2200 / 2400 MHz, HBM3E 8 TB/s, 7 links of 153.6 GB/s.
    AmdProduct {
        device_id: 0x75a0,
        name: "AMD Instinct MI350X",
        fp16_tflops: 2306.9,
        memory_bandwidth_gbps: 8000.0,
        xgmi_link_gbps: 153.6,
    },
    AmdProduct {
        device_id: 0x75a3,
        name: "AMD Instinct MI355X",
        fp16_tflops: 2516.6,
        memory_bandwidth_gbps: 8000.0,
        xgmi_link_gbps: 153.6,
    },
];

/// The datasheet entry of a PCI device id.
pub fn product(device_id: u32) -> Option<&'static AmdProduct> {
    PRODUCTS.iter().find(|p| p.device_id == device_id)
}

/// `gfx942` from KFD's `gfx_target_version` (`90402`).
pub fn gfx_target_name(version: u64) -> String {
    let (major, minor, stepping) = gfx_parts(version);
    format!("gfx{major}{minor}{stepping:x}")
}

fn gfx_parts(version: u64) -> (u64, u64, u64) {
    (version / 10000, (version / 100) % 100, version % 100)
}

/// Dense FP16/BF16 FLOPs one compute unit retires per clock, by GFX target:
///
/// | target | products | FLOPs/CU/clock | check |
/// |---|---|---|---|
/// | gfx950 | MI350X, MI355X | 4096 | 256 CUs × 2.4 GHz → 2.5 PF (MI355X) |
/// | gfx940–942 | MI300A/X, MI325X | 2048 | 304 × 2.1 GHz → 1307 TF (MI300X) |
/// | gfx90a | MI210, MI250(X) | 1024 | 104 × 1.7 GHz → 181 TF (MI210) |
/// | gfx908 | MI100 | 1024 | 120 × 1.502 GHz → 184.6 TF |
/// | gfx12xx | RDNA4 | 1024 | 64 × 2.97 GHz → 195 TF (RX 9070 XT; not checked on hardware) |
/// | gfx11xx | RDNA3 | 512 | 96 × 2.5 GHz → 123 TF (RX 7900 XTX) |
/// | others | GCN, RDNA1/2 | 256 | packed FP16 on the vector ALUs: 64 lanes × FMA × 2 |
pub fn fp16_flops_per_cu_clock(gfx_target_version: u64) -> u32 {
    match gfx_parts(gfx_target_version) {
        (9, 5, _) => 4096,
        (9, 4, _) => 2048,
        (9, 0, 10) | (9, 0, 8) => 1024,
        (12, _, _) => 1024,
        (11, _, _) => 512,
        _ => 256,
    }
}

/// Data transfers per pin per reported memory clock (`mem_clk_max`), by GFX
/// target, where known: HBM3 on gfx94x reports a quarter of the data rate
/// (MI300X: 1300 MHz → 5.2 Gb/s → 8192 bit → 5.3 TB/s); HBM2/HBM2e on gfx906,
/// gfx908 and gfx90a report half (MI210: 1600 MHz → 3.2 Gb/s → 4096 bit →
/// 1.64 TB/s). Other targets (GDDR, HBM3E on gfx950) are not known here.
pub fn transfers_per_memory_clock(gfx_target_version: u64) -> Option<u32> {
    match gfx_parts(gfx_target_version) {
        (9, 4, _) => Some(4),
        (9, 0, 6) | (9, 0, 8) | (9, 0, 10) => Some(2),
        _ => None,
    }
}

/// One direction of a PCIe link in GB/s from `current_link_speed`
/// (`16.0 GT/s PCIe`) and `current_link_width` (`16`): 8b/10b line encoding
/// below 8 GT/s, 128b/130b from there (also used for Gen6's FLIT mode).
pub fn pcie_gbps_one_way(speed: &str, width: &str) -> Option<f64> {
    let gts: f64 = speed.split_whitespace().next()?.parse().ok()?;
    let lanes: u32 = width.trim().parse().ok()?;
    if !(gts.is_finite() && gts > 0.0) || lanes == 0 {
        return None;
    }
    let encoding = if gts < 8.0 { 0.8 } else { 128.0 / 130.0 };
    Some(gts * f64::from(lanes) * encoding / 8.0)
}

fn round1(x: f64) -> f64 {
    (x * 10.0).round() / 10.0
}

fn failed(msg: impl Into<String>) -> BackendError {
    BackendError::Failed(msg.into())
}

fn read_text(path: &Path) -> io::Result<String> {
    std::fs::read_to_string(path)
}

/// A read error for messages. Permission errors get advice, as they mean the
/// container is set up wrong rather than that a device is sick.
fn describe_io(path: &Path, e: &io::Error) -> String {
    if e.kind() == io::ErrorKind::PermissionDenied {
        format!(
            "permission denied reading {}: the agent needs the host's /sys and access to \
             /dev/kfd and /dev/dri (KFD hides GPU properties from containers without the device)",
            path.display()
        )
    } else {
        format!("cannot read {}: {e}", path.display())
    }
}

fn is_unsupported(e: &io::Error) -> bool {
    matches!(e.raw_os_error(), Some(EINVAL | ENODATA | EOPNOTSUPP))
        || e.kind() == io::ErrorKind::Unsupported
}

fn parse_u64(path: &Path, text: &str) -> Result<u64, BackendError> {
    let t = text.trim();
    if t.is_empty() {
        return Err(failed(format!("{} is empty", path.display())));
    }
    t.parse()
        .map_err(|_| failed(format!("{}: {t:?} is not a whole number", path.display())))
}

fn parse_i64(path: &Path, text: &str) -> Result<i64, BackendError> {
    let t = text.trim();
    if t.is_empty() {
        return Err(failed(format!("{} is empty", path.display())));
    }
    t.parse()
        .map_err(|_| failed(format!("{}: {t:?} is not a number", path.display())))
}

/// A file that must be there.
fn read_u64(path: &Path) -> Result<u64, BackendError> {
    let text = read_text(path).map_err(|e| failed(describe_io(path, &e)))?;
    parse_u64(path, &text)
}

/// A sensor that may be missing or unsupported (`None`); present but
/// unreadable or not a number is an error.
fn read_opt_i64(path: &Path) -> Result<Option<i64>, BackendError> {
    match read_text(path) {
        Ok(text) => parse_i64(path, &text).map(Some),
        Err(e) if e.kind() == io::ErrorKind::NotFound || is_unsupported(&e) => Ok(None),
        Err(e) => Err(failed(describe_io(path, &e))),
    }
}

/// A KFD `properties` file: `name value` lines, values parsed when asked.
struct Props {
    path: PathBuf,
    values: HashMap<String, String>,
}

impl Props {
    /// `Ok(None)` when the file is gone (the node vanished while we looked).
    fn load(path: PathBuf) -> Result<Option<Self>, BackendError> {
        let text = match read_text(&path) {
            Ok(t) => t,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(failed(describe_io(&path, &e))),
        };
        let values = text
            .lines()
            .filter_map(|line| {
                let mut parts = line.split_whitespace();
                let key = parts.next()?;
                let value = parts.next().unwrap_or("");
                Some((key.to_string(), value.to_string()))
            })
            .collect();
        Ok(Some(Self { path, values }))
    }

    fn get(&self, key: &str) -> Result<Option<u64>, BackendError> {
        match self.values.get(key) {
            None => Ok(None),
            Some(v) => v.parse().map(Some).map_err(|_| {
                failed(format!(
                    "{}: `{key}` is {v:?}, not a whole number",
                    self.path.display()
                ))
            }),
        }
    }

    fn require(&self, key: &str) -> Result<u64, BackendError> {
        self.get(key)?.ok_or_else(|| {
            let why = if self.values.is_empty() {
                " (the file is empty)"
            } else {
                ""
            };
            failed(format!("{}: no `{key}` line{why}", self.path.display()))
        })
    }
}

/// `0000:c1:00.0` from KFD's `domain` and `location_id`.
fn pci_bus_id(domain: u64, location_id: u64) -> String {
    format!(
        "{:04x}:{:02x}:{:02x}.{:x}",
        domain,
        (location_id >> 8) & 0xff,
        (location_id >> 3) & 0x1f,
        location_id & 0x7
    )
}

fn looks_like_pci_bus_id(s: &str) -> bool {
    let b = s.as_bytes();
    b.len() == 12
        && b[4] == b':'
        && b[7] == b':'
        && b[10] == b'.'
        && s.chars()
            .enumerate()
            .all(|(i, c)| matches!(i, 4 | 7 | 10) || c.is_ascii_hexdigit())
}

/// A KFD link from one node to another.
#[derive(Clone, Debug)]
struct RawLink {
    kind: u64,
    from: u64,
    to: u64,
    min_mbps: u64,
    max_mbps: u64,
}

/// One KFD GPU node.
#[derive(Clone, Debug)]
struct KfdGpu {
    node: u64,
    pci_bus_id: String,
    device_id: u32,
    gfx_target_version: u64,
    compute_units: u64,
    max_engine_clk_mhz: u64,
    render_minor: Option<u64>,
    unique_id: Option<u64>,
    vram_bytes: u64,
    vram_width_bits: u64,
    mem_clk_max_mhz: u64,
    links: Vec<RawLink>,
}

/// One physical GPU: one KFD node, or several when partitioned.
#[derive(Clone, Debug)]
struct Gpu {
    pci_bus_id: String,
    nodes: Vec<KfdGpu>,
}

impl Gpu {
    fn first(&self) -> Option<&KfdGpu> {
        self.nodes.first()
    }

    fn has_node(&self, node: u64) -> bool {
        self.nodes.iter().any(|n| n.node == node)
    }

    fn links(&self) -> impl Iterator<Item = &RawLink> {
        self.nodes.iter().flat_map(|n| n.links.iter())
    }
}

/// A KFD node whose files could not be understood.
#[derive(Clone, Debug)]
struct Broken {
    pci_bus_id: Option<String>,
    error: String,
}

#[derive(Debug, Default)]
struct Topology {
    /// Ordered by PCI bus id.
    gpus: Vec<Gpu>,
    broken: Vec<Broken>,
}

impl Topology {
    fn gpu(&self, pci_bus_id: &str) -> Option<&Gpu> {
        self.gpus.iter().find(|g| g.pci_bus_id == pci_bus_id)
    }

    fn check(&self) -> Result<(), BackendError> {
        if self.broken.is_empty() {
            return Ok(());
        }
        let reasons: Vec<&str> = self.broken.iter().map(|b| b.error.as_str()).collect();
        Err(failed(format!(
            "AMD GPU topology is malformed: {}",
            reasons.join("; ")
        )))
    }
}

enum NodeRead {
    Gone,
    NotAmdGpu,
    Gpu(KfdGpu),
    Broken(Broken),
}

fn numbered_dirs(dir: &Path) -> io::Result<Vec<(u64, PathBuf)>> {
    let mut out: Vec<(u64, PathBuf)> = std::fs::read_dir(dir)?
        .filter_map(Result::ok)
        .filter_map(|e| {
            let n = e.file_name().to_str()?.parse::<u64>().ok()?;
            Some((n, e.path()))
        })
        .collect();
    out.sort();
    Ok(out)
}

/// The `properties` of every numbered subdirectory of `dir` (none if `dir` is missing).
fn child_props(dir: &Path) -> Result<Vec<Props>, BackendError> {
    let children = match numbered_dirs(dir) {
        Ok(c) => c,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(failed(describe_io(dir, &e))),
    };
    let mut out = Vec::new();
    for (_, path) in children {
        if let Some(p) = Props::load(path.join("properties"))? {
            out.push(p);
        }
    }
    Ok(out)
}

fn read_node(number: u64, dir: &Path) -> Result<NodeRead, BackendError> {
    let Some(props) = Props::load(dir.join("properties"))? else {
        return Ok(NodeRead::Gone);
    };
    // Best effort: the PCI address of a node we cannot otherwise understand.
    let pci = match (props.get("domain"), props.get("location_id")) {
        (Ok(domain), Ok(Some(loc))) => Some(pci_bus_id(domain.unwrap_or(0), loc)),
        _ => None,
    };
    match parse_gpu_node(number, dir, &props) {
        Ok(Some(gpu)) => Ok(NodeRead::Gpu(gpu)),
        Ok(None) => Ok(NodeRead::NotAmdGpu),
        Err(BackendError::Failed(error)) => Ok(NodeRead::Broken(Broken {
            pci_bus_id: pci,
            error,
        })),
        Err(e) => Err(e),
    }
}

fn parse_gpu_node(number: u64, dir: &Path, props: &Props) -> Result<Option<KfdGpu>, BackendError> {
    let simd_count = props.require("simd_count")?;
    if simd_count == 0 {
        return Ok(None); // a CPU node
    }
    if let Some(vendor) = props.get("vendor_id")?
        && vendor != AMD_PCI_VENDOR
    {
        return Ok(None);
    }
    let location_id = props.require("location_id")?;
    let domain = props.get("domain")?.unwrap_or(0);
    let simd_per_cu = props.require("simd_per_cu")?;
    if simd_per_cu == 0 {
        return Err(failed(format!(
            "{}: `simd_per_cu` is 0",
            props.path.display()
        )));
    }
    let device_id = props.require("device_id")?;
    let device_id = u32::try_from(device_id).map_err(|_| {
        failed(format!(
            "{}: `device_id` {device_id} is out of range",
            props.path.display()
        ))
    })?;

    let mut vram_bytes = 0u64;
    let mut vram_width_bits = 0u64;
    let mut mem_clk_max_mhz = 0u64;
    for bank in child_props(&dir.join("mem_banks"))? {
        // 1 and 2 are the public and private parts of the frame buffer.
        if let Some(heap) = bank.get("heap_type")?
            && heap != 1
            && heap != 2
        {
            continue;
        }
        vram_bytes = vram_bytes.saturating_add(bank.require("size_in_bytes")?);
        vram_width_bits = vram_width_bits.max(bank.get("width")?.unwrap_or(0));
        mem_clk_max_mhz = mem_clk_max_mhz.max(bank.get("mem_clk_max")?.unwrap_or(0));
    }

    let mut links = Vec::new();
    for sub in ["io_links", "p2p_links"] {
        for l in child_props(&dir.join(sub))? {
            links.push(RawLink {
                kind: l.require("type")?,
                from: l.get("node_from")?.unwrap_or(number),
                to: l.require("node_to")?,
                min_mbps: l.get("min_bandwidth")?.unwrap_or(0),
                max_mbps: l.get("max_bandwidth")?.unwrap_or(0),
            });
        }
    }

    Ok(Some(KfdGpu {
        node: number,
        pci_bus_id: pci_bus_id(domain, location_id),
        device_id,
        gfx_target_version: props.require("gfx_target_version")?,
        compute_units: simd_count / simd_per_cu,
        max_engine_clk_mhz: props.require("max_engine_clk_fcompute")?,
        render_minor: props.get("drm_render_minor")?.filter(|m| *m > 0),
        unique_id: props.get("unique_id")?.filter(|u| *u != 0),
        vram_bytes,
        vram_width_bits,
        mem_clk_max_mhz,
        links,
    }))
}

/// An AMD DRM card: `<root>/class/drm/card<N>`.
#[derive(Clone, Debug)]
struct Card {
    /// `<root>/class/drm/card<N>/device`: the PCI device's directory.
    device: PathBuf,
    pci_bus_id: Option<String>,
}

impl Card {
    fn has_render_minor(&self, minor: u64) -> bool {
        self.device
            .join("drm")
            .join(format!("renderD{minor}"))
            .exists()
    }
}

fn card_pci_bus_id(device: &Path) -> Option<String> {
    if let Ok(uevent) = read_text(&device.join("uevent")) {
        for line in uevent.lines() {
            if let Some(v) = line.trim().strip_prefix("PCI_SLOT_NAME=") {
                return Some(v.trim().to_ascii_lowercase());
            }
        }
    }
    let target = std::fs::canonicalize(device).ok()?;
    let name = target.file_name()?.to_str()?.to_ascii_lowercase();
    looks_like_pci_bus_id(&name).then_some(name)
}

/// The card of a GPU: by PCI address, else by one of its render nodes.
fn find_card<'a>(cards: &'a [Card], gpu: &Gpu) -> Option<&'a Card> {
    cards
        .iter()
        .find(|c| c.pci_bus_id.as_deref() == Some(gpu.pci_bus_id.as_str()))
        .or_else(|| {
            gpu.nodes
                .iter()
                .filter_map(|n| n.render_minor)
                .find_map(|m| cards.iter().find(|c| c.has_render_minor(m)))
        })
}

/// The hwmon directory of a DRM device (amdgpu registers one per device).
fn hwmon_dir(device: &Path) -> Option<PathBuf> {
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(device.join("hwmon"))
        .ok()?
        .filter_map(Result::ok)
        .filter(|e| e.file_name().to_string_lossy().starts_with("hwmon"))
        .map(|e| e.path())
        .collect();
    dirs.sort();
    dirs.into_iter().next()
}

/// The index of the hwmon channel `<prefix><i>` whose label is `label`.
fn labelled_channel(hwmon: &Path, prefix: &str, label: &str) -> Option<u32> {
    (1..=16).find(|i| {
        read_text(&hwmon.join(format!("{prefix}{i}_label")))
            .is_ok_and(|l| l.trim().eq_ignore_ascii_case(label))
    })
}

fn temperature_c(hwmon: &Path) -> Result<Option<f64>, BackendError> {
    let channel = labelled_channel(hwmon, "temp", "edge")
        .or_else(|| labelled_channel(hwmon, "temp", "junction"))
        .unwrap_or(1);
    let milli = read_opt_i64(&hwmon.join(format!("temp{channel}_input")))?;
    Ok(milli.map(|m| m as f64 / 1000.0))
}

fn power_w(hwmon: &Path) -> Result<Option<f64>, BackendError> {
    for file in ["power1_average", "power1_input"] {
        if let Some(micro) = read_opt_i64(&hwmon.join(file))? {
            return Ok(Some(micro as f64 / 1_000_000.0));
        }
    }
    Ok(None)
}

fn clock_mhz(hwmon: &Path, label: &str) -> Result<Option<u32>, BackendError> {
    let Some(channel) = labelled_channel(hwmon, "freq", label) else {
        return Ok(None);
    };
    let hz = read_opt_i64(&hwmon.join(format!("freq{channel}_input")))?;
    Ok(hz.and_then(|h| u32::try_from(h / 1_000_000).ok()))
}

/// Uncorrectable errors from a RAS `*_err_count` file (`ue: 0\nce: 0\n`).
fn uncorrectable(text: &str) -> Option<u64> {
    text.lines().find_map(|line| {
        let (key, value) = line.split_once(':')?;
        (key.trim() == "ue").then(|| value.trim().parse().ok())?
    })
}

/// AMD GPUs from sysfs. See the module documentation for what is read and how.
pub struct AmdBackend {
    root: PathBuf,
    #[cfg(feature = "rocm-smi")]
    smi: Option<super::rocm_smi::RocmSmiTelemetry>,
}

impl std::fmt::Debug for AmdBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AmdBackend")
            .field("root", &self.root)
            .finish_non_exhaustive()
    }
}

impl AmdBackend {
    /// A backend reading the sysfs tree at `sysfs_root` ([`DEFAULT_SYSFS_ROOT`]
    /// in production, a fixture in tests). `Unavailable` when that tree has no
    /// KFD topology or no AMD GPU in it; `Failed` when it has GPUs that cannot
    /// be read.
    pub fn new(sysfs_root: impl Into<PathBuf>) -> Result<Self, BackendError> {
        let backend = Self {
            root: sysfs_root.into(),
            #[cfg(feature = "rocm-smi")]
            smi: None,
        };
        let nodes = backend.kfd_nodes_dir();
        if !nodes.is_dir() {
            return Err(BackendError::Unavailable(format!(
                "no KFD topology at {}: the amdgpu driver is not loaded, or the host's /sys is \
                 not mounted into this container",
                nodes.display()
            )));
        }
        let topology = backend.topology()?;
        if topology.gpus.is_empty() {
            topology.check()?;
            return Err(BackendError::Unavailable(format!(
                "the KFD topology at {} lists no AMD GPU",
                nodes.display()
            )));
        }
        Ok(backend)
    }

    /// Fills telemetry that sysfs does not give from ROCm SMI (power,
    /// temperature, utilization). Fails if the library cannot be initialised;
    /// the caller may keep the plain backend then.
    #[cfg(feature = "rocm-smi")]
    pub fn with_rocm_smi(mut self) -> Result<Self, BackendError> {
        self.smi = Some(super::rocm_smi::RocmSmiTelemetry::init()?);
        Ok(self)
    }

    pub fn sysfs_root(&self) -> &Path {
        &self.root
    }

    fn kfd_nodes_dir(&self) -> PathBuf {
        self.root.join(KFD_NODES)
    }

    /// Reads the KFD topology. A node that vanishes while read is skipped; a
    /// node whose files cannot be understood is listed in `broken`.
    fn topology(&self) -> Result<Topology, BackendError> {
        let dir = self.kfd_nodes_dir();
        let numbers = match numbered_dirs(&dir) {
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                return Err(failed(format!(
                    "the KFD topology {} is gone: was the amdgpu driver unloaded?",
                    dir.display()
                )));
            }
            Err(e) => return Err(failed(describe_io(&dir, &e))),
        };
        let mut by_pci: BTreeMap<String, Vec<KfdGpu>> = BTreeMap::new();
        let mut broken = Vec::new();
        for (number, path) in numbers {
            match read_node(number, &path)? {
                NodeRead::Gone | NodeRead::NotAmdGpu => {}
                NodeRead::Gpu(g) => by_pci.entry(g.pci_bus_id.clone()).or_default().push(g),
                NodeRead::Broken(b) => broken.push(b),
            }
        }
        let gpus = by_pci
            .into_iter()
            .map(|(pci_bus_id, nodes)| Gpu { pci_bus_id, nodes })
            .collect();
        Ok(Topology { gpus, broken })
    }

    /// AMD DRM cards (`card<N>`, not connectors like `card0-DP-1`).
    fn cards(&self) -> Vec<Card> {
        let Ok(entries) = std::fs::read_dir(self.root.join(DRM_CLASS)) else {
            return Vec::new();
        };
        let mut cards: Vec<(u64, Card)> = entries
            .filter_map(Result::ok)
            .filter_map(|e| {
                let name = e.file_name();
                let n: u64 = name.to_str()?.strip_prefix("card")?.parse().ok()?;
                let device = e.path().join("device");
                let vendor = read_text(&device.join("vendor")).ok()?;
                let vendor =
                    u64::from_str_radix(vendor.trim().trim_start_matches("0x"), 16).ok()?;
                (vendor == AMD_PCI_VENDOR).then(|| {
                    let pci_bus_id = card_pci_bus_id(&device);
                    (n, Card { device, pci_bus_id })
                })
            })
            .collect();
        cards.sort_by_key(|(n, _)| *n);
        cards.into_iter().map(|(_, c)| c).collect()
    }

    fn card_for_pci(&self, pci_bus_id: &str) -> Option<Card> {
        let cards = self.cards();
        if let Some(c) = cards
            .iter()
            .find(|c| c.pci_bus_id.as_deref() == Some(pci_bus_id))
        {
            return Some(c.clone());
        }
        let topology = self.topology().ok()?;
        find_card(&cards, topology.gpu(pci_bus_id)?).cloned()
    }

    fn describe(&self, gpu: &Gpu, card: Option<&Card>, index: u32) -> Option<DeviceInfo> {
        let first = gpu.first()?;
        let table = product(first.device_id);
        let device = card.map(|c| c.device.as_path());

        let product_name = device
            .and_then(|d| read_text(&d.join("product_name")).ok())
            .map(|s| s.trim().to_string())
            .filter(|s| !s.is_empty())
            .or_else(|| table.map(|p| p.name.to_string()))
            .unwrap_or_else(|| format!("AMD GPU {:#06x}", first.device_id));

        let kfd_vram: u64 = gpu.nodes.iter().map(|n| n.vram_bytes).sum();
        let drm_vram = device.and_then(|d| {
            let path = d.join("mem_info_vram_total");
            match read_opt_i64(&path) {
                Ok(Some(v)) if v > 0 => u64::try_from(v).ok(),
                Ok(_) => None,
                Err(e) => {
                    tracing::warn!(error = %e, "using the KFD memory size instead");
                    None
                }
            }
        });
        let memory_total_bytes = drm_vram.unwrap_or(kfd_vram);

        let compute_units: u64 = gpu.nodes.iter().map(|n| n.compute_units).sum();
        let compute_units = u32::try_from(compute_units).unwrap_or(u32::MAX);
        let gfx = first.gfx_target_version;
        let fp16_tflops = match f64::from(compute_units)
            * first.max_engine_clk_mhz as f64
            * f64::from(fp16_flops_per_cu_clock(gfx))
            / 1e6
        {
            t if t > 0.0 => round1(t),
            _ => table.map_or(0.0, |p| p.fp16_tflops),
        };
        let memory_bandwidth_gbps = memory_bandwidth(gpu, table);

        let numa_node = device.and_then(|d| {
            let path = d.join("numa_node");
            let text = read_text(&path).ok()?;
            match parse_i64(&path, &text) {
                Ok(n) if n >= 0 => i32::try_from(n).ok(),
                Ok(_) => None,
                Err(e) => {
                    tracing::warn!(error = %e, "NUMA node unknown");
                    None
                }
            }
        });

        let unique_id = first.unique_id.or_else(|| {
            let text = read_text(&device?.join("unique_id")).ok()?;
            u64::from_str_radix(text.trim().trim_start_matches("0x"), 16)
                .ok()
                .filter(|u| *u != 0)
        });

        Some(DeviceInfo {
            id: unique_id.map_or_else(|| gpu.pci_bus_id.clone(), |u| format!("{u:#x}")),
            index,
            vendor: Vendor::Amd,
            product: product_name,
            memory_total_bytes,
            architecture: gfx_target_name(gfx),
            compute_units,
            fp16_tflops,
            memory_bandwidth_gbps,
            pci_bus_id: gpu.pci_bus_id.clone(),
            numa_node,
        })
    }

    /// Both directions of the GPU's PCIe link, GB/s.
    fn pcie_gbps(&self, gpu: &Gpu, card: Option<&Card>) -> f64 {
        if let Some(card) = card
            && let (Ok(speed), Ok(width)) = (
                read_text(&card.device.join("current_link_speed")),
                read_text(&card.device.join("current_link_width")),
            )
            && let Some(one_way) = pcie_gbps_one_way(&speed, &width)
        {
            return round1(2.0 * one_way);
        }
        // The KFD's own figure for the link to the host, if any.
        gpu.links()
            .filter(|l| l.kind == IOLINK_PCIE && l.max_mbps > 0)
            .map(|l| l.max_mbps)
            .max()
            .map_or(FALLBACK_PCIE_GBPS, |mbps| {
                round1(2.0 * mbps as f64 / 1000.0)
            })
    }
}

fn memory_bandwidth(gpu: &Gpu, table: Option<&AmdProduct>) -> f64 {
    let Some(first) = gpu.first() else {
        return FALLBACK_MEMORY_BANDWIDTH_GBPS;
    };
    // Partitions may each see part of the memory; the datasheet knows the whole.
    if gpu.nodes.len() > 1
        && let Some(p) = table
    {
        return p.memory_bandwidth_gbps;
    }
    let width = gpu
        .nodes
        .iter()
        .map(|n| n.vram_width_bits)
        .max()
        .unwrap_or(0);
    let clock = gpu
        .nodes
        .iter()
        .map(|n| n.mem_clk_max_mhz)
        .max()
        .unwrap_or(0);
    let from_sysfs =
        |transfers: u32| round1(width as f64 * clock as f64 * f64::from(transfers) / 8.0 / 1000.0);
    if width > 0 && clock > 0 {
        let estimate = transfers_per_memory_clock(first.gfx_target_version).map(from_sysfs);
        return match (estimate, table) {
            (Some(e), Some(p)) if (e / p.memory_bandwidth_gbps - 1.0).abs() > 0.25 => {
                tracing::debug!(
                    estimate = e,
                    datasheet = p.memory_bandwidth_gbps,
                    "memory bandwidth from sysfs is off the datasheet; using the datasheet"
                );
                p.memory_bandwidth_gbps
            }
            (Some(e), _) => e,
            (None, Some(p)) => p.memory_bandwidth_gbps,
            (None, None) => from_sysfs(2),
        };
    }
    table.map_or(FALLBACK_MEMORY_BANDWIDTH_GBPS, |p| p.memory_bandwidth_gbps)
}

/// Both directions of an xGMI connection between two GPUs, GB/s.
fn xgmi_gbps(link: &RawLink, table: Option<&AmdProduct>) -> f64 {
    let links = if link.min_mbps > 0 && link.max_mbps >= link.min_mbps {
        (link.max_mbps as f64 / link.min_mbps as f64)
            .round()
            .max(1.0)
    } else {
        1.0
    };
    match table {
        Some(p) => round1(links * p.xgmi_link_gbps),
        None if link.max_mbps > 0 => round1(2.0 * link.max_mbps as f64 / 1000.0),
        None => links * FALLBACK_XGMI_LINK_GBPS,
    }
}

impl GpuBackend for AmdBackend {
    fn name(&self) -> &str {
        "amd"
    }

    fn devices(&mut self) -> Result<Vec<DeviceInfo>, BackendError> {
        let topology = self.topology()?;
        topology.check()?;
        let cards = self.cards();
        // `topology.gpus` is in PCI order, which makes the indices.
        let mut out: Vec<DeviceInfo> = Vec::with_capacity(topology.gpus.len());
        for gpu in &topology.gpus {
            let index = u32::try_from(out.len()).unwrap_or(u32::MAX);
            if let Some(d) = self.describe(gpu, find_card(&cards, gpu), index) {
                out.push(d);
            }
        }
        // Unique ids must be unique; if two devices share one, use PCI addresses.
        let mut seen: HashMap<String, usize> = HashMap::new();
        for d in &out {
            *seen.entry(d.id.clone()).or_default() += 1;
        }
        for d in &mut out {
            if seen.get(&d.id).copied().unwrap_or(0) > 1 {
                tracing::warn!(
                    id = %d.id,
                    pci = %d.pci_bus_id,
                    "unique id shared by several GPUs; using the PCI bus id"
                );
                d.id = d.pci_bus_id.clone();
            }
        }
        Ok(out)
    }

    fn telemetry(&mut self, device: &DeviceInfo) -> Result<Telemetry, BackendError> {
        let card = self.card_for_pci(&device.pci_bus_id).ok_or_else(|| {
            failed(format!(
                "the DRM device of {} ({}) is gone",
                device.id, device.pci_bus_id
            ))
        })?;
        let dev = &card.device;
        let used = read_u64(&dev.join("mem_info_vram_used"))?;
        let total = match read_opt_i64(&dev.join("mem_info_vram_total"))? {
            Some(t) if t > 0 => t as u64,
            _ => device.memory_total_bytes,
        };
        let utilization_percent = read_opt_i64(&dev.join("gpu_busy_percent"))?
            .and_then(|p| u32::try_from(p.clamp(0, 100)).ok());
        let mut telemetry = Telemetry {
            temperature_c: None,
            power_w: None,
            graphics_clock_mhz: None,
            memory_clock_mhz: None,
            utilization_percent,
            memory_used_bytes: used,
            memory_free_bytes: total.saturating_sub(used),
        };
        if let Some(hwmon) = hwmon_dir(dev) {
            telemetry.temperature_c = temperature_c(&hwmon)?;
            telemetry.power_w = power_w(&hwmon)?;
            telemetry.graphics_clock_mhz = clock_mhz(&hwmon, "sclk")?;
            telemetry.memory_clock_mhz = clock_mhz(&hwmon, "mclk")?;
        }
        #[cfg(feature = "rocm-smi")]
        if let Some(smi) = &self.smi
            && let Some(r) = smi.read(&device.pci_bus_id)
        {
            telemetry.temperature_c = telemetry.temperature_c.or(r.temperature_c);
            telemetry.power_w = telemetry.power_w.or(r.power_w);
            telemetry.utilization_percent = telemetry.utilization_percent.or(r.utilization_percent);
        }
        Ok(telemetry)
    }

    fn health(&mut self, device: &DeviceInfo) -> Result<RawHealth, BackendError> {
        let pci = device.pci_bus_id.as_str();
        let topology = match self.topology() {
            Ok(t) => t,
            Err(e) => return Ok(RawHealth::Unhealthy(e.to_string())),
        };
        if let Some(b) = topology
            .broken
            .iter()
            .find(|b| b.pci_bus_id.as_deref() == Some(pci))
        {
            return Ok(RawHealth::Unhealthy(format!(
                "KFD properties unreadable: {}",
                b.error
            )));
        }
        let Some(gpu) = topology.gpu(pci) else {
            return Ok(RawHealth::Unhealthy(format!(
                "the KFD topology node of {pci} is gone (device removed, or dropped by the \
                 driver after a failed reset)"
            )));
        };
        let cards = self.cards();
        let Some(card) = find_card(&cards, gpu) else {
            return Ok(RawHealth::Unhealthy(format!(
                "the DRM device of {pci} is gone: no {}/card* has that PCI address",
                self.root.join(DRM_CLASS).display()
            )));
        };
        if let Err(e) = read_u64(&card.device.join("mem_info_vram_used")) {
            return Ok(RawHealth::Unhealthy(e.to_string()));
        }
        let ras = card.device.join("ras").join("umc_err_count");
        match read_text(&ras) {
            Err(e) if e.kind() == io::ErrorKind::NotFound || is_unsupported(&e) => {}
            Err(e) => return Ok(RawHealth::Unhealthy(describe_io(&ras, &e))),
            Ok(text) => match uncorrectable(&text) {
                Some(0) => {}
                Some(n) => {
                    return Ok(RawHealth::Unhealthy(format!(
                        "uncorrectable memory errors: {n} (ras/umc_err_count)"
                    )));
                }
                None => {
                    return Ok(RawHealth::Unhealthy(format!(
                        "{}: {:?} has no `ue:` count",
                        ras.display(),
                        text.trim()
                    )));
                }
            },
        }
        Ok(RawHealth::Healthy)
    }

    fn links(&mut self, devices: &[DeviceInfo]) -> Result<Vec<Link>, BackendError> {
        let topology = self.topology()?;
        topology.check()?;
        let cards = self.cards();
        let mut present: Vec<(&DeviceInfo, &Gpu, f64)> = devices
            .iter()
            .filter_map(|d| {
                let gpu = topology.gpu(&d.pci_bus_id)?;
                let pcie = self.pcie_gbps(gpu, find_card(&cards, gpu));
                Some((d, gpu, pcie))
            })
            .collect();
        present.sort_by_key(|(d, _, _)| d.index);

        let mut links = Vec::new();
        for (i, (da, ga, pcie_a)) in present.iter().enumerate() {
            for (db, gb, pcie_b) in &present[i + 1..] {
                let between: Vec<&RawLink> = ga
                    .links()
                    .filter(|l| ga.has_node(l.from) && gb.has_node(l.to))
                    .chain(
                        gb.links()
                            .filter(|l| gb.has_node(l.from) && ga.has_node(l.to)),
                    )
                    .collect();
                let table = ga
                    .first()
                    .and_then(|n| product(n.device_id))
                    .or_else(|| gb.first().and_then(|n| product(n.device_id)));
                let xgmi = between
                    .iter()
                    .filter(|l| l.kind == IOLINK_XGMI)
                    .map(|l| xgmi_gbps(l, table))
                    .fold(None, |best: Option<f64>, g| {
                        Some(best.map_or(g, |b| b.max(g)))
                    });
                let link = match xgmi {
                    Some(gbps) => Link {
                        a: da.id.clone(),
                        b: db.id.clone(),
                        kind: LinkKind::Xgmi,
                        bandwidth_gbps: gbps,
                        p2p: true,
                    },
                    None => Link {
                        a: da.id.clone(),
                        b: db.id.clone(),
                        kind: LinkKind::Pcie,
                        bandwidth_gbps: pcie_a.min(*pcie_b),
                        p2p: between.iter().any(|l| l.kind == IOLINK_PCIE),
                    },
                };
                links.push(link);
            }
        }
        Ok(links)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gfx_names() {
        assert_eq!(gfx_target_name(90402), "gfx942");
        assert_eq!(gfx_target_name(90010), "gfx90a");
        assert_eq!(gfx_target_name(90008), "gfx908");
        assert_eq!(gfx_target_name(110000), "gfx1100");
        assert_eq!(gfx_target_name(100300), "gfx1030");
        assert_eq!(gfx_target_name(90500), "gfx950");
    }

    #[test]
    fn datasheet_checks() {
        let tf =
            |cus: f64, mhz: f64, gfx| cus * mhz * f64::from(fp16_flops_per_cu_clock(gfx)) / 1e6;
        assert!((tf(304.0, 2100.0, 90402) - 1307.4).abs() < 0.1, "MI300X");
        assert!((tf(104.0, 1700.0, 90010) - 181.0).abs() < 0.1, "MI210");
        assert!((tf(120.0, 1502.0, 90008) - 184.6).abs() < 0.1, "MI100");
        assert!((tf(256.0, 2400.0, 90500) - 2516.6).abs() < 0.1, "MI355X");
        let bw = |bits: f64, mhz: f64, gfx| {
            bits * mhz * f64::from(transfers_per_memory_clock(gfx).unwrap()) / 8.0 / 1000.0
        };
        assert!((bw(8192.0, 1300.0, 90402) - 5324.8).abs() < 0.1, "MI300X");
        assert!((bw(4096.0, 1600.0, 90010) - 1638.4).abs() < 0.1, "MI210");
        assert!((bw(4096.0, 1200.0, 90008) - 1228.8).abs() < 0.1, "MI100");
    }

    #[test]
    fn pci_addresses() {
        assert_eq!(pci_bus_id(0, 25344), "0000:63:00.0");
        assert_eq!(pci_bus_id(1, 0xc1 << 8 | 2 << 3 | 1), "0001:c1:02.1");
        assert!(looks_like_pci_bus_id("0000:c1:00.0"));
        assert!(!looks_like_pci_bus_id("card0"));
        assert!(!looks_like_pci_bus_id("0000:c1:00:0"));
    }

    #[test]
    fn pcie_speeds() {
        let g4 = pcie_gbps_one_way("16.0 GT/s PCIe\n", "16\n").unwrap();
        assert!((g4 - 31.5).abs() < 0.1, "{g4}");
        let g5 = pcie_gbps_one_way("32.0 GT/s PCIe", "16").unwrap();
        assert!((g5 - 63.0).abs() < 0.1, "{g5}");
        let g1 = pcie_gbps_one_way("2.5 GT/s", "1").unwrap();
        assert!((g1 - 0.25).abs() < 1e-9, "{g1}");
        assert_eq!(pcie_gbps_one_way("Unknown", "16"), None);
        assert_eq!(pcie_gbps_one_way("16.0 GT/s PCIe", "x"), None);
        assert_eq!(pcie_gbps_one_way("16.0 GT/s PCIe", "0"), None);
        assert_eq!(pcie_gbps_one_way("", ""), None);
    }

    #[test]
    fn ras_counts() {
        assert_eq!(uncorrectable("ue: 0\nce: 12\n"), Some(0));
        assert_eq!(uncorrectable("ue: 3\nce: 0\n"), Some(3));
        assert_eq!(uncorrectable("ce: 1\n"), None);
        assert_eq!(uncorrectable("ue: lots\n"), None);
        assert_eq!(uncorrectable(""), None);
    }

    #[test]
    fn xgmi_link_counts() {
        let link = |min, max| RawLink {
            kind: IOLINK_XGMI,
            from: 1,
            to: 2,
            min_mbps: min,
            max_mbps: max,
        };
        let mi300x = product(0x74a1);
        assert_eq!(xgmi_gbps(&link(64000, 64000), mi300x), 128.0);
        assert_eq!(
            xgmi_gbps(&link(50000, 50000), mi300x),
            128.0,
            "older kernels"
        );
        let mi250x = product(0x7408);
        assert_eq!(
            xgmi_gbps(&link(50000, 200000), mi250x),
            400.0,
            "4 links in a package"
        );
        assert_eq!(
            xgmi_gbps(&link(0, 0), product(0x738c)),
            92.0,
            "MI100 reports no bandwidth"
        );
        assert_eq!(xgmi_gbps(&link(50000, 50000), None), 100.0);
        assert_eq!(xgmi_gbps(&link(0, 0), None), FALLBACK_XGMI_LINK_GBPS);
    }

    #[test]
    fn product_ids() {
        assert_eq!(product(0x74a1).unwrap().name, "AMD Instinct MI300X");
        assert_eq!(product(0x740f).unwrap().name, "AMD Instinct MI210");
        assert_eq!(product(0x738c).unwrap().name, "AMD Instinct MI100");
        assert!(product(0x740c).unwrap().name.contains("MI250X"));
        assert!(product(0x1234).is_none());
    }
}
