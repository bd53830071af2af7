//! How the node's NVIDIA GPUs are connected: one link per pair of readable
//! devices (`a` before `b` by index).
//!
//! - **NVLink** when the pair shares links: direct links to each other,
//!   plus, when both reach a common NVSwitch, the smaller of their switch
//!   link counts (through the switches a GPU can use all its links to talk
//!   to any one peer). Bandwidth = links × per-link bandwidth of the slower
//!   GPU (`nvlink_gbps_per_link`); an 8×H100 HGX gives 18 × 50 = 900 GB/s
//!   for every pair. P2P is true.
//! - Otherwise **PCIe**: bandwidth of the slower end's link (`pcie_gbps`),
//!   P2P as NVML's P2P status (read) reports.
//!
//! A remote end whose PCI bus id is no GPU of the node (or that NVML cannot
//! name) is taken to be an NVSwitch. (`nvml-wrapper` 0.13's
//! `remote_device_type` always answers "unknown", so it cannot be asked.)
//! An NVLink to a CPU (IBM POWER9 NPUs) would be misread as a switch link.

use std::collections::{HashMap, HashSet};

use nvml_wrapper::Device;
use nvml_wrapper::enum_wrappers::device::{P2pCapabilitiesIndex, P2pStatus, TopologyLevel};
use nvml_wrapper::error::NvmlError;

use super::super::{BackendError, DeviceInfo, DeviceLink};
use super::NvmlBackend;
use super::errors::library_failed;
use super::link_speeds::{nvlink_gbps_per_link, pcie_gbps};
use super::pci::normalize_pci_bus_id;
use tessera_core::api::LinkKind;

/// `NVML_NVLINK_MAX_LINKS` (18 since Hopper).
const NVLINK_MAX_LINKS: u32 = 18;

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

impl NvmlBackend {
    /// The links between `devices`, by the rules in this module's docs.
    pub(super) fn pair_links(
        &self,
        devices: &[DeviceInfo],
    ) -> Result<Vec<DeviceLink>, BackendError> {
        let mut listed: Vec<&DeviceInfo> = devices.iter().collect();
        listed.sort_by_key(|device| device.index);
        let count = self
            .nvml
            .device_count()
            .map_err(|error| library_failed("counting the GPUs", &error))?;
        let mut gpu_buses: HashSet<String> = (0..count)
            .filter_map(|index| self.nvml.device_by_index(index).ok()?.pci_info().ok())
            .map(|pci| normalize_pci_bus_id(&pci.bus_id))
            .collect();
        gpu_buses.extend(
            listed
                .iter()
                .filter(|device| !device.pci_bus_id.is_empty())
                .map(|device| device.pci_bus_id.clone()),
        );
        let position_by_bus: HashMap<&str, usize> = listed
            .iter()
            .enumerate()
            .filter(|(_, device)| !device.pci_bus_id.is_empty())
            .map(|(position, device)| (device.pci_bus_id.as_str(), position))
            .collect();
        let handles: Vec<Option<Device<'_>>> = listed
            .iter()
            .map(|device| self.handle(device).ok())
            .collect();
        let nvlinks: Vec<NvLinkView> = handles
            .iter()
            .map(|handle| {
                handle
                    .as_ref()
                    .map(|device| self.scan_nvlinks(device, &position_by_bus, &gpu_buses))
                    .unwrap_or_default()
            })
            .collect();
        let pcie: Vec<Option<f64>> = handles
            .iter()
            .map(|handle| handle.as_ref().and_then(pcie_link_gbps))
            .collect();

        let mut links = Vec::new();
        for first in 0..listed.len() {
            for second in first + 1..listed.len() {
                let (Some(first_handle), Some(second_handle)) = (&handles[first], &handles[second])
                else {
                    continue;
                };
                if listed[first].id == listed[second].id {
                    continue;
                }
                let (first_view, second_view) = (&nvlinks[first], &nvlinks[second]);
                let direct = first_view
                    .direct
                    .get(&second)
                    .copied()
                    .unwrap_or(0)
                    .max(second_view.direct.get(&first).copied().unwrap_or(0));
                let switched = if first_view.switches.is_disjoint(&second_view.switches) {
                    0
                } else {
                    first_view.switch_links.min(second_view.switch_links)
                };
                let (kind, bandwidth_gbps, p2p) = if direct + switched > 0 {
                    let per_link = slower(first_view.per_link_gbps, second_view.per_link_gbps)
                        .unwrap_or_else(|| nvlink_gbps_per_link(0));
                    (
                        LinkKind::Nvlink,
                        f64::from(direct + switched) * per_link,
                        true,
                    )
                } else {
                    (
                        LinkKind::Pcie,
                        slower(pcie[first], pcie[second]).unwrap_or(0.0),
                        self.pcie_p2p(first_handle, second_handle),
                    )
                };
                links.push(DeviceLink {
                    a: listed[first].id.clone(),
                    b: listed[second].id.clone(),
                    kind,
                    bandwidth_gbps,
                    p2p,
                });
            }
        }
        Ok(links)
    }

    fn scan_nvlinks(
        &self,
        device: &Device<'_>,
        position_by_bus: &HashMap<&str, usize>,
        gpu_buses: &HashSet<String>,
    ) -> NvLinkView {
        let mut view = NvLinkView::default();
        for link in 0..NVLINK_MAX_LINKS {
            let nvlink = device.link_wrapper_for(link);
            match nvlink.is_active() {
                Ok(true) => {}
                Ok(false) => continue,
                // No NVLink on this GPU at all.
                Err(NvmlError::NotSupported) if link == 0 => break,
                // Past the GPU's last link.
                Err(NvmlError::InvalidArg) => break,
                Err(_) => continue,
            }
            let gbps = nvlink_gbps_per_link(nvlink.version().unwrap_or(0));
            view.per_link_gbps = Some(view.per_link_gbps.map_or(gbps, |slowest| slowest.min(gbps)));
            // A far end NVML cannot name is taken to be a switch (an unnamed
            // one, shared by every GPU with such links).
            let bus = nvlink
                .remote_pci_info()
                .map(|remote| normalize_pci_bus_id(&remote.bus_id))
                .unwrap_or_default();
            if let Some(&position) = position_by_bus.get(bus.as_str()) {
                *view.direct.entry(position).or_default() += 1;
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
    fn pcie_p2p(&self, first: &Device<'_>, second: &Device<'_>) -> bool {
        match first.p2p_status(second, P2pCapabilitiesIndex::Read) {
            Ok(status) => status == P2pStatus::Ok,
            Err(error) => {
                tracing::debug!(%error, "NVML P2P status unavailable; judging from the PCIe topology");
                matches!(
                    self.nvml.topology_common_ancestor(first, second),
                    Ok(TopologyLevel::Internal | TopologyLevel::Single | TopologyLevel::Multiple)
                )
            }
        }
    }
}

/// The smaller of two figures, either one when the other is unknown.
fn slower(first: Option<f64>, second: Option<f64>) -> Option<f64> {
    match (first, second) {
        (Some(first), Some(second)) => Some(first.min(second)),
        (Some(only), None) | (None, Some(only)) => Some(only),
        (None, None) => None,
    }
}

/// PCIe bandwidth of a GPU's link. The generation is the maximum the GPU and
/// slot allow: the current one drops while the GPU idles (nvidia-smi: "these
/// may be reduced when the GPU is not in use"), which says nothing about the
/// bandwidth it will get. Current values are the fallback.
fn pcie_link_gbps(device: &Device<'_>) -> Option<f64> {
    let generation = device
        .max_pcie_link_gen()
        .or_else(|_| device.current_pcie_link_gen())
        .ok()?;
    let width = device
        .max_pcie_link_width()
        .or_else(|_| device.current_pcie_link_width())
        .ok()?;
    pcie_gbps(generation, width)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_slower_known_figure_wins() {
        assert_eq!(slower(Some(50.0), Some(40.0)), Some(40.0));
        assert_eq!(slower(None, Some(40.0)), Some(40.0));
        assert_eq!(slower(Some(50.0), None), Some(50.0));
        assert_eq!(slower(None, None), None);
    }
}
