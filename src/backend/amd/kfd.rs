//! The KFD topology (`<sysfs>/class/kfd/kfd/topology/nodes`): which nodes are
//! AMD GPUs, what they compute, their memory banks and their links, grouped
//! into physical GPUs by PCI address (a partitioned GPU has several nodes).

use std::collections::BTreeMap;
use std::io;
use std::path::{Path, PathBuf};

use super::super::BackendError;
use super::AMD_PCI_VENDOR;
use super::properties::Props;
use super::sysfs_files::{describe_io, failed};

/// KFD topology nodes under the sysfs root.
const KFD_NODES: &str = "class/kfd/kfd/topology/nodes";
/// KFD io_link `type` values (`HSA_IOLINKTYPE_PCIEXPRESS`, `HSA_IOLINK_TYPE_XGMI`).
pub(super) const IOLINK_PCIE: u64 = 2;
pub(super) const IOLINK_XGMI: u64 = 11;

/// A KFD link from one node to another.
#[derive(Clone, Debug)]
pub(super) struct RawLink {
    pub(super) kind: u64,
    pub(super) from: u64,
    pub(super) to: u64,
    pub(super) min_mbps: u64,
    pub(super) max_mbps: u64,
}

/// One KFD GPU node.
#[derive(Clone, Debug)]
pub(super) struct KfdGpu {
    node: u64,
    pci_bus_id: String,
    pub(super) device_id: u32,
    pub(super) gfx_target_version: u64,
    pub(super) compute_units: u64,
    pub(super) max_engine_clk_mhz: u64,
    pub(super) render_minor: Option<u64>,
    pub(super) unique_id: Option<u64>,
    pub(super) vram_bytes: u64,
    pub(super) vram_width_bits: u64,
    pub(super) mem_clk_max_mhz: u64,
    links: Vec<RawLink>,
}

/// One physical GPU: one KFD node, or several when partitioned.
#[derive(Clone, Debug)]
pub(super) struct Gpu {
    pub(super) pci_bus_id: String,
    pub(super) nodes: Vec<KfdGpu>,
}

impl Gpu {
    pub(super) fn first(&self) -> Option<&KfdGpu> {
        self.nodes.first()
    }

    pub(super) fn has_node(&self, node: u64) -> bool {
        self.nodes.iter().any(|kfd| kfd.node == node)
    }

    pub(super) fn links(&self) -> impl Iterator<Item = &RawLink> {
        self.nodes.iter().flat_map(|kfd| kfd.links.iter())
    }
}

/// A KFD node whose files could not be understood.
#[derive(Clone, Debug)]
pub(super) struct Broken {
    pub(super) pci_bus_id: Option<String>,
    pub(super) error: String,
}

#[derive(Debug, Default)]
pub(super) struct Topology {
    /// Ordered by PCI bus id.
    pub(super) gpus: Vec<Gpu>,
    pub(super) broken: Vec<Broken>,
}

impl Topology {
    pub(super) fn gpu(&self, pci_bus_id: &str) -> Option<&Gpu> {
        self.gpus.iter().find(|gpu| gpu.pci_bus_id == pci_bus_id)
    }

    pub(super) fn check(&self) -> Result<(), BackendError> {
        if self.broken.is_empty() {
            return Ok(());
        }
        let reasons: Vec<&str> = self
            .broken
            .iter()
            .map(|broken| broken.error.as_str())
            .collect();
        Err(failed(format!(
            "AMD GPU topology is malformed: {}",
            reasons.join("; ")
        )))
    }
}

/// The directory of KFD topology nodes under a sysfs root.
pub(super) fn kfd_nodes_dir(sysfs_root: &Path) -> PathBuf {
    sysfs_root.join(KFD_NODES)
}

/// Reads the KFD topology. A node that vanishes while read is skipped; a
/// node whose files cannot be understood is listed in `broken`.
pub(super) fn read_topology(sysfs_root: &Path) -> Result<Topology, BackendError> {
    #[cfg(test)]
    super::sysfs_files::reads::count(super::sysfs_files::reads::Read::Topology);
    let dir = kfd_nodes_dir(sysfs_root);
    let numbers = match numbered_dirs(&dir) {
        Ok(numbers) => numbers,
        Err(error) if error.kind() == io::ErrorKind::NotFound => {
            return Err(failed(format!(
                "the KFD topology {} is gone: was the amdgpu driver unloaded?",
                dir.display()
            )));
        }
        Err(error) => return Err(failed(describe_io(&dir, &error))),
    };
    let mut by_pci: BTreeMap<String, Vec<KfdGpu>> = BTreeMap::new();
    let mut broken = Vec::new();
    for (number, path) in numbers {
        match read_node(number, &path)? {
            NodeRead::Gone | NodeRead::NotAmdGpu => {}
            NodeRead::Gpu(node) => by_pci
                .entry(node.pci_bus_id.clone())
                .or_default()
                .push(node),
            NodeRead::Broken(unreadable) => broken.push(unreadable),
        }
    }
    let gpus = by_pci
        .into_iter()
        .map(|(pci_bus_id, nodes)| Gpu { pci_bus_id, nodes })
        .collect();
    Ok(Topology { gpus, broken })
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

enum NodeRead {
    Gone,
    NotAmdGpu,
    Gpu(KfdGpu),
    Broken(Broken),
}

fn numbered_dirs(dir: &Path) -> io::Result<Vec<(u64, PathBuf)>> {
    let mut numbered: Vec<(u64, PathBuf)> = std::fs::read_dir(dir)?
        .filter_map(Result::ok)
        .filter_map(|entry| {
            let number = entry.file_name().to_str()?.parse::<u64>().ok()?;
            Some((number, entry.path()))
        })
        .collect();
    numbered.sort();
    Ok(numbered)
}

/// The `properties` of every numbered subdirectory of `dir` (none if `dir` is missing).
fn child_props(dir: &Path) -> Result<Vec<Props>, BackendError> {
    let children = match numbered_dirs(dir) {
        Ok(children) => children,
        Err(error) if error.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(error) => return Err(failed(describe_io(dir, &error))),
    };
    let mut loaded = Vec::new();
    for (_, path) in children {
        if let Some(props) = Props::load(path.join("properties"))? {
            loaded.push(props);
        }
    }
    Ok(loaded)
}

fn read_node(number: u64, dir: &Path) -> Result<NodeRead, BackendError> {
    let Some(props) = Props::load(dir.join("properties"))? else {
        return Ok(NodeRead::Gone);
    };
    // Best effort: the PCI address of a node we cannot otherwise understand.
    let pci = match (props.get("domain"), props.get("location_id")) {
        (Ok(domain), Ok(Some(location))) => Some(pci_bus_id(domain.unwrap_or(0), location)),
        _ => None,
    };
    match parse_gpu_node(number, dir, &props) {
        Ok(Some(gpu)) => Ok(NodeRead::Gpu(gpu)),
        Ok(None) => Ok(NodeRead::NotAmdGpu),
        Err(BackendError::Failed(error)) => Ok(NodeRead::Broken(Broken {
            pci_bus_id: pci,
            error,
        })),
        Err(other) => Err(other),
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
            props.path().display()
        )));
    }
    let device_id = props.require("device_id")?;
    let device_id = u32::try_from(device_id).map_err(|_| {
        failed(format!(
            "{}: `device_id` {device_id} is out of range",
            props.path().display()
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
        for link in child_props(&dir.join(sub))? {
            links.push(RawLink {
                kind: link.require("type")?,
                from: link.get("node_from")?.unwrap_or(number),
                to: link.require("node_to")?,
                min_mbps: link.get("min_bandwidth")?.unwrap_or(0),
                max_mbps: link.get("max_bandwidth")?.unwrap_or(0),
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
        render_minor: props.get("drm_render_minor")?.filter(|minor| *minor > 0),
        unique_id: props.get("unique_id")?.filter(|unique| *unique != 0),
        vram_bytes,
        vram_width_bits,
        mem_clk_max_mhz,
        links,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pci_addresses() {
        assert_eq!(pci_bus_id(0, 25344), "0000:63:00.0");
        assert_eq!(pci_bus_id(1, 0xc1 << 8 | 2 << 3 | 1), "0001:c1:02.1");
    }
}
