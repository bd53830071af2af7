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
//! `ras/<block>_err_count` (`ue: N` and `ce: N` lines, uncorrectable and
//! correctable errors since the driver loaded: every block's summed for
//! telemetry, `umc`'s uncorrectable for health) and `hwmon/hwmon*/`
//! (`temp*_input` in m°C with `temp*_label`, `power1_average` or
//! `power1_input` in µW, `freq*_input` in Hz labelled `sclk` / `mclk`).
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
//! - **Product**: `product_name` when the board has one, else the datasheet
//!   table (`products`) by PCI device id, else `AMD GPU 0x<device id>`.
//! - **FP16**: compute units × max engine clock × dense FP16 FLOPs per CU per
//!   clock for the GFX target (`estimates::fp16_flops_per_cu_clock`).
//! - **Memory bandwidth**: VRAM width × `mem_clk_max` × transfers per memory
//!   clock for the GFX target (`estimates::transfers_per_memory_clock`) / 8.
//!   For a product in the datasheet table the datasheet figure wins when
//!   that estimate is more than 25 % off (a clock reported in another
//!   convention), and when the target's factor is unknown; otherwise the
//!   width and clock are taken as double data rate; without them,
//!   `FALLBACK_MEMORY_BANDWIDTH_GBPS` (64 GB/s).
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
//!   link to the host; else `FALLBACK_PCIE_GBPS` (63 GB/s). PCIe `p2p` is true only
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
//!   is simply absent, and so are the ECC totals while any block's RAS count
//!   cannot be read or parsed (`ras_totals` says why).
//!
//! # Where it is read
//!
//! `kfd` (the topology, with `properties` for its files), `drm` (cards),
//! `sensors` (hwmon, RAS), `sysfs_files` (reading one file), `device_info`,
//! `telemetry`, `device_health` and `links` (one trait method each),
//! `estimates` and `products` (the figures); `container` says what a
//! container given AMD GPUs needs.

mod container;
mod device_health;
mod device_info;
mod drm;
mod estimates;
mod kfd;
mod links;
mod products;
mod properties;
mod sensors;
mod sysfs_files;
mod telemetry;

use std::collections::HashMap;
use std::path::PathBuf;

use super::{
    BackendError, DeviceInfo, DeviceLink, GpuBackend, RawHealth, Snapshot, Telemetry, device_state,
};
pub(crate) use container::wire_container;
use device_info::describe;
use drm::{Card, find_card, read_cards};
use kfd::{Topology, kfd_nodes_dir, read_topology};

/// Where sysfs is mounted on a node (or in a container given the host's `/sys`).
pub const DEFAULT_SYSFS_ROOT: &str = "/sys";

/// PCI vendor id of AMD/ATI (4098).
const AMD_PCI_VENDOR: u64 = 0x1002;

/// AMD GPUs from sysfs. See the module documentation for what is read and how.
pub struct AmdBackend {
    root: PathBuf,
    #[cfg(feature = "rocm-smi")]
    smi: Option<super::rocm_smi::RocmSmiTelemetry>,
}

impl std::fmt::Debug for AmdBackend {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter
            .debug_struct("AmdBackend")
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
        let nodes = kfd_nodes_dir(&backend.root);
        if !nodes.is_dir() {
            return Err(BackendError::Unavailable(format!(
                "no KFD topology at {}: the amdgpu driver is not loaded, or the host's /sys is \
                 not mounted into this container",
                nodes.display()
            )));
        }
        let topology = read_topology(&backend.root)?;
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
}

impl GpuBackend for AmdBackend {
    fn name(&self) -> &str {
        "amd"
    }

    fn devices(&mut self) -> Result<Vec<DeviceInfo>, BackendError> {
        let topology = read_topology(&self.root)?;
        topology.check()?;
        Ok(listed(&topology, &read_cards(&self.root)))
    }

    fn telemetry(&mut self, device: &DeviceInfo) -> Result<Telemetry, BackendError> {
        self.read_telemetry(device)
    }

    fn health(&mut self, device: &DeviceInfo) -> Result<RawHealth, BackendError> {
        Ok(device_health::read_health(&self.root, device))
    }

    fn links(&mut self, devices: &[DeviceInfo]) -> Result<Vec<DeviceLink>, BackendError> {
        links::pair_links(&self.root, devices)
    }

    /// One walk of the KFD topology and one scan of the DRM cards for the
    /// whole poll (asked device by device, every device would read both again).
    fn snapshot(&mut self) -> Result<Snapshot, BackendError> {
        let topology = read_topology(&self.root)?;
        topology.check()?;
        let cards = read_cards(&self.root);
        let infos = listed(&topology, &cards);
        let devices = infos
            .iter()
            .map(|info| {
                let card = topology
                    .gpu(&info.pci_bus_id)
                    .and_then(|gpu| find_card(&cards, gpu));
                device_state(info.clone(), self.telemetry_of(card, info), |info| {
                    Ok(device_health::health_in(
                        &self.root, &topology, &cards, info,
                    ))
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Snapshot {
            backend: self.name().to_string(),
            devices,
            links: links::links_in(&topology, &cards, &infos),
        })
    }
}

/// The devices of the topology, with their cards.
fn listed(topology: &Topology, cards: &[Card]) -> Vec<DeviceInfo> {
    // `topology.gpus` is in PCI order, which makes the indices.
    let mut listed: Vec<DeviceInfo> = Vec::with_capacity(topology.gpus.len());
    for gpu in &topology.gpus {
        let index = u32::try_from(listed.len()).unwrap_or(u32::MAX);
        if let Some(device) = describe(gpu, find_card(cards, gpu), index) {
            listed.push(device);
        }
    }
    // Unique ids must be unique; if two devices share one, use PCI addresses.
    let mut seen: HashMap<String, usize> = HashMap::new();
    for device in &listed {
        *seen.entry(device.id.clone()).or_default() += 1;
    }
    for device in &mut listed {
        if seen.get(&device.id).copied().unwrap_or(0) > 1 {
            tracing::warn!(
                id = %device.id,
                pci = %device.pci_bus_id,
                "unique id shared by several GPUs; using the PCI bus id"
            );
            device.id = device.pci_bus_id.clone();
        }
    }
    listed
}

#[cfg(test)]
mod tests {
    use super::sysfs_files::reads;
    use super::*;

    #[test]
    fn a_poll_reads_the_machine_once() {
        let root =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/amd/mi300x-8");
        let mut backend = AmdBackend::new(root).unwrap();
        reads::take();
        let snapshot = backend.snapshot().unwrap();
        let [walks, scans, files] = reads::take();
        assert_eq!(snapshot.devices.len(), 8);
        assert_eq!((walks, scans), (1, 1), "one topology walk, one card scan");

        // Asked device by device, the same answer costs a walk and two scans per device.
        let by_device = super::super::device_by_device(&mut backend).unwrap();
        let [walks_by_device, scans_by_device, files_by_device] = reads::take();
        assert_eq!(by_device, snapshot);
        assert_eq!((walks_by_device, scans_by_device), (8 + 2, 2 * 8 + 2));
        assert!(
            files * 2 < files_by_device,
            "{files} files read in one poll, {files_by_device} device by device"
        );
    }
}
