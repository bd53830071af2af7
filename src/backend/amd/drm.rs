//! AMD DRM devices (`<sysfs>/class/drm/card<N>/device`): which card belongs to
//! which KFD GPU, matched by PCI address (`uevent`'s `PCI_SLOT_NAME`, else the
//! name of the `device` link's target), else by render node; and the numbers
//! of a GPU's DRM nodes, which name its files in `/dev/dri`.

use std::path::{Path, PathBuf};

use super::AMD_PCI_VENDOR;
use super::kfd::{Gpu, read_topology};
use super::sysfs_files::read_text;

/// DRM devices under the sysfs root.
const DRM_CLASS: &str = "class/drm";

/// An AMD DRM card: `<root>/class/drm/card<N>`.
#[derive(Clone, Debug)]
pub(super) struct Card {
    /// `<root>/class/drm/card<N>/device`: the PCI device's directory.
    pub(super) device: PathBuf,
    pci_bus_id: Option<String>,
}

impl Card {
    fn has_render_minor(&self, minor: u64) -> bool {
        drm_nodes_dir(&self.device)
            .join(format!("renderD{minor}"))
            .exists()
    }
}

/// The numbers of a PCI device's DRM nodes: `/dev/dri/renderD<render>` and
/// `/dev/dri/card<card>`.
#[derive(Debug, Default, PartialEq)]
pub(super) struct DrmMinors {
    pub(super) render: Option<u32>,
    pub(super) card: Option<u32>,
}

/// Where a PCI device's directory lists its DRM nodes (`renderD<N>`, `card<M>`).
fn drm_nodes_dir(pci_device: &Path) -> PathBuf {
    pci_device.join("drm")
}

/// The DRM nodes of the PCI device at `pci_bus_id`, from
/// `<sysfs>/bus/pci/devices/<id>/drm/`: the first of each kind by name;
/// none when sysfs has no answer.
pub(super) fn drm_minors(sysfs_root: &Path, pci_bus_id: &str) -> DrmMinors {
    let mut minors = DrmMinors::default();
    if pci_bus_id.is_empty() {
        return minors;
    }
    let pci_device = sysfs_root
        .join("bus/pci/devices")
        .join(pci_bus_id.to_ascii_lowercase());
    let Ok(entries) = std::fs::read_dir(drm_nodes_dir(&pci_device)) else {
        return minors;
    };
    let mut names: Vec<String> = entries
        .filter_map(Result::ok)
        .filter_map(|entry| entry.file_name().into_string().ok())
        .collect();
    names.sort();
    for name in names {
        if let Some(render) = name
            .strip_prefix("renderD")
            .and_then(|number| number.parse().ok())
        {
            minors.render.get_or_insert(render);
        } else if let Some(card) = name
            .strip_prefix("card")
            .and_then(|number| number.parse().ok())
        {
            minors.card.get_or_insert(card);
        }
    }
    minors
}

/// The directory of DRM devices under a sysfs root.
pub(super) fn drm_class_dir(sysfs_root: &Path) -> PathBuf {
    sysfs_root.join(DRM_CLASS)
}

/// AMD DRM cards (`card<N>`, not connectors like `card0-DP-1`), in card order.
pub(super) fn read_cards(sysfs_root: &Path) -> Vec<Card> {
    #[cfg(test)]
    super::sysfs_files::reads::count(super::sysfs_files::reads::Read::Cards);
    let Ok(entries) = std::fs::read_dir(drm_class_dir(sysfs_root)) else {
        return Vec::new();
    };
    let mut cards: Vec<(u64, Card)> = entries
        .filter_map(Result::ok)
        .filter_map(|entry| {
            let name = entry.file_name();
            let number: u64 = name.to_str()?.strip_prefix("card")?.parse().ok()?;
            let device = entry.path().join("device");
            let vendor = read_text(&device.join("vendor")).ok()?;
            let vendor = u64::from_str_radix(vendor.trim().trim_start_matches("0x"), 16).ok()?;
            (vendor == AMD_PCI_VENDOR).then(|| {
                let pci_bus_id = card_pci_bus_id(&device);
                (number, Card { device, pci_bus_id })
            })
        })
        .collect();
    cards.sort_by_key(|(number, _)| *number);
    cards.into_iter().map(|(_, card)| card).collect()
}

/// The card of the GPU at `pci_bus_id`: by its PCI address, else through the
/// KFD topology by one of its render nodes.
pub(super) fn card_for_pci(sysfs_root: &Path, pci_bus_id: &str) -> Option<Card> {
    let cards = read_cards(sysfs_root);
    if let Some(card) = cards
        .iter()
        .find(|card| card.pci_bus_id.as_deref() == Some(pci_bus_id))
    {
        return Some(card.clone());
    }
    let topology = read_topology(sysfs_root).ok()?;
    find_card(&cards, topology.gpu(pci_bus_id)?).cloned()
}

/// The card of a GPU: by PCI address, else by one of its render nodes.
pub(super) fn find_card<'a>(cards: &'a [Card], gpu: &Gpu) -> Option<&'a Card> {
    cards
        .iter()
        .find(|card| card.pci_bus_id.as_deref() == Some(gpu.pci_bus_id.as_str()))
        .or_else(|| {
            gpu.nodes
                .iter()
                .filter_map(|node| node.render_minor)
                .find_map(|minor| cards.iter().find(|card| card.has_render_minor(minor)))
        })
}

fn card_pci_bus_id(device: &Path) -> Option<String> {
    if let Ok(uevent) = read_text(&device.join("uevent")) {
        for line in uevent.lines() {
            if let Some(slot) = line.trim().strip_prefix("PCI_SLOT_NAME=") {
                return Some(slot.trim().to_ascii_lowercase());
            }
        }
    }
    let target = std::fs::canonicalize(device).ok()?;
    let name = target.file_name()?.to_str()?.to_ascii_lowercase();
    looks_like_pci_bus_id(&name).then_some(name)
}

fn looks_like_pci_bus_id(name: &str) -> bool {
    let bytes = name.as_bytes();
    bytes.len() == 12
        && bytes[4] == b':'
        && bytes[7] == b':'
        && bytes[10] == b'.'
        && name
            .chars()
            .enumerate()
            .all(|(position, c)| matches!(position, 4 | 7 | 10) || c.is_ascii_hexdigit())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pci_addresses() {
        assert!(looks_like_pci_bus_id("0000:c1:00.0"));
        assert!(!looks_like_pci_bus_id("card0"));
        assert!(!looks_like_pci_bus_id("0000:c1:00:0"));
    }
}
