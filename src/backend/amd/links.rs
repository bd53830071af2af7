//! How the node's AMD GPUs are connected: xGMI where the KFD lists an xGMI
//! link between two GPUs, else PCIe at the slower end's link speed, with P2P
//! only where the KFD lists a `p2p_links` entry (see "Links" in the backend's
//! docs for the figures and why).

use std::path::Path;

use super::super::{BackendError, DeviceInfo, DeviceLink};
use super::drm::{Card, find_card, read_cards};
use super::estimates::{FALLBACK_PCIE_GBPS, pcie_gbps_one_way, round1, xgmi_gbps};
use super::kfd::{Gpu, IOLINK_PCIE, IOLINK_XGMI, RawLink, Topology, read_topology};
use super::products::product;
use super::sysfs_files::read_text;
use tessera_core::api::LinkKind;

/// One link per pair of `devices` still in the topology, `a` before `b` by index.
pub(super) fn pair_links(
    sysfs_root: &Path,
    devices: &[DeviceInfo],
) -> Result<Vec<DeviceLink>, BackendError> {
    let topology = read_topology(sysfs_root)?;
    topology.check()?;
    Ok(links_in(&topology, &read_cards(sysfs_root), devices))
}

/// [`pair_links`] with the topology (checked) and the cards already read.
pub(super) fn links_in(
    topology: &Topology,
    cards: &[Card],
    devices: &[DeviceInfo],
) -> Vec<DeviceLink> {
    let mut present: Vec<(&DeviceInfo, &Gpu, f64)> = devices
        .iter()
        .filter_map(|device| {
            let gpu = topology.gpu(&device.pci_bus_id)?;
            let pcie = pcie_gbps(gpu, find_card(cards, gpu));
            Some((device, gpu, pcie))
        })
        .collect();
    present.sort_by_key(|(device, _, _)| device.index);

    let mut links = Vec::new();
    for (position, (first, first_gpu, first_pcie)) in present.iter().enumerate() {
        for (second, second_gpu, second_pcie) in &present[position + 1..] {
            let between: Vec<&RawLink> =
                first_gpu
                    .links()
                    .filter(|link| first_gpu.has_node(link.from) && second_gpu.has_node(link.to))
                    .chain(second_gpu.links().filter(|link| {
                        second_gpu.has_node(link.from) && first_gpu.has_node(link.to)
                    }))
                    .collect();
            let table = first_gpu
                .first()
                .and_then(|node| product(node.device_id))
                .or_else(|| second_gpu.first().and_then(|node| product(node.device_id)));
            let xgmi = between
                .iter()
                .filter(|link| link.kind == IOLINK_XGMI)
                .map(|link| xgmi_gbps(link, table))
                .fold(None, |best: Option<f64>, gbps| {
                    Some(best.map_or(gbps, |best| best.max(gbps)))
                });
            let link = match xgmi {
                Some(gbps) => DeviceLink {
                    a: first.id.clone(),
                    b: second.id.clone(),
                    kind: LinkKind::Xgmi,
                    bandwidth_gbps: gbps,
                    p2p: true,
                },
                None => DeviceLink {
                    a: first.id.clone(),
                    b: second.id.clone(),
                    kind: LinkKind::Pcie,
                    bandwidth_gbps: first_pcie.min(*second_pcie),
                    p2p: between.iter().any(|link| link.kind == IOLINK_PCIE),
                },
            };
            links.push(link);
        }
    }
    links
}

/// Both directions of the GPU's PCIe link, GB/s.
fn pcie_gbps(gpu: &Gpu, card: Option<&Card>) -> f64 {
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
        .filter(|link| link.kind == IOLINK_PCIE && link.max_mbps > 0)
        .map(|link| link.max_mbps)
        .max()
        .map_or(FALLBACK_PCIE_GBPS, |mbps| {
            round1(2.0 * mbps as f64 / 1000.0)
        })
}
