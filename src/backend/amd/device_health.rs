//! An AMD GPU's raw health, read afresh from sysfs: its KFD node and DRM
//! device still there and readable, and no uncorrectable memory errors in
//! its RAS count since the driver loaded.

use std::io;
use std::path::Path;

use super::super::{DeviceInfo, RawHealth};
use super::drm::{Card, drm_class_dir, find_card, read_cards};
use super::kfd::{Topology, read_topology};
use super::sensors::uncorrectable;
use super::sysfs_files::{describe_io, is_unsupported, read_text, read_u64};

/// Unhealthy, with the reason, when anything on the way to the device's RAS
/// count is gone or unreadable, or the count shows uncorrectable errors.
pub(super) fn read_health(sysfs_root: &Path, device: &DeviceInfo) -> RawHealth {
    let topology = match read_topology(sysfs_root) {
        Ok(topology) => topology,
        Err(error) => return RawHealth::Unhealthy(error.to_string()),
    };
    health_in(sysfs_root, &topology, &read_cards(sysfs_root), device)
}

/// [`read_health`] with the topology and the cards already read (once for
/// every device of a poll).
pub(super) fn health_in(
    sysfs_root: &Path,
    topology: &Topology,
    cards: &[Card],
    device: &DeviceInfo,
) -> RawHealth {
    let pci = device.pci_bus_id.as_str();
    if let Some(broken) = topology
        .broken
        .iter()
        .find(|broken| broken.pci_bus_id.as_deref() == Some(pci))
    {
        return RawHealth::Unhealthy(format!("KFD properties unreadable: {}", broken.error));
    }
    let Some(gpu) = topology.gpu(pci) else {
        return RawHealth::Unhealthy(format!(
            "the KFD topology node of {pci} is gone (device removed, or dropped by the \
             driver after a failed reset)"
        ));
    };
    let Some(card) = find_card(cards, gpu) else {
        return RawHealth::Unhealthy(format!(
            "the DRM device of {pci} is gone: no {}/card* has that PCI address",
            drm_class_dir(sysfs_root).display()
        ));
    };
    if let Err(error) = read_u64(&card.device.join("mem_info_vram_used")) {
        return RawHealth::Unhealthy(error.to_string());
    }
    let ras = card.device.join("ras").join("umc_err_count");
    match read_text(&ras) {
        Err(error) if error.kind() == io::ErrorKind::NotFound || is_unsupported(&error) => {}
        Err(error) => return RawHealth::Unhealthy(describe_io(&ras, &error)),
        Ok(text) => match uncorrectable(&text) {
            Some(0) => {}
            Some(count) => {
                return RawHealth::Unhealthy(format!(
                    "uncorrectable memory errors: {count} (ras/umc_err_count)"
                ));
            }
            None => {
                return RawHealth::Unhealthy(format!(
                    "{}: {:?} has no `ue:` count",
                    ras.display(),
                    text.trim()
                ));
            }
        },
    }
    RawHealth::Healthy
}
