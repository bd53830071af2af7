//! What a container needs to use AMD GPUs:
//!
//! - `/dev/kfd` and each GPU's render node `/dev/dri/renderD<N>` (plus
//!   `/dev/dri/card<M>` when known), with N and M read from sysfs
//!   (`/sys/bus/pci/devices/<PCI bus id>/drm/`); when sysfs has no answer N
//!   is assumed to be 128 + index (the DRM numbering of render nodes when
//!   every card is a GPU in PCI order);
//! - `ROCR_VISIBLE_DEVICES` naming the GPUs by UUID (`GPU-<16 hex digits of
//!   the ASIC unique id>`, as `rocminfo` shows it) rather than by index,
//!   because inside the container ROCm numbers only the GPUs it can open, so
//!   host indices would point at the wrong devices. A GPU without a unique id
//!   (its device ID is then a PCI bus id) has no UUID; the variable is then
//!   left out and the render nodes alone decide what the container sees;
//! - CDI names `amd.com/gpu=<index>`.

use super::super::DeviceInfo;
use super::drm::drm_minors;
use crate::backend::container::{ContainerWiring, HostRoots};

const ROCR_VISIBLE_DEVICES: &str = "ROCR_VISIBLE_DEVICES";
/// The first render node number DRM gives out.
const FIRST_RENDER_MINOR: u32 = 128;

/// Adds what a container given `devices` (AMD GPUs, in kubelet's order) needs
/// to `wiring`.
pub(crate) fn wire_container(
    devices: &[&DeviceInfo],
    host: HostRoots<'_>,
    wiring: &mut ContainerWiring,
) {
    wiring.add_device_node("/dev/kfd");
    for device in devices {
        let minors = drm_minors(host.sysfs_root, &device.pci_bus_id);
        let render = minors.render.unwrap_or(FIRST_RENDER_MINOR + device.index);
        wiring.add_device_node(&format!("/dev/dri/renderD{render}"));
        if let Some(card) = minors.card {
            wiring.add_device_node(&format!("/dev/dri/card{card}"));
        }
    }
    let uuids: Option<Vec<String>> = devices.iter().map(|device| rocm_uuid(&device.id)).collect();
    if let Some(uuids) = uuids {
        wiring
            .envs
            .insert(ROCR_VISIBLE_DEVICES.to_string(), uuids.join(","));
    }
    wiring.cdi_devices.extend(
        devices
            .iter()
            .map(|device| format!("amd.com/gpu={}", device.index)),
    );
}

/// `GPU-<16 hex digits>` from a device ID that is a unique id (`0x…`).
fn rocm_uuid(id: &str) -> Option<String> {
    let hex = id.strip_prefix("0x")?;
    let value = u64::from_str_radix(hex, 16).ok()?;
    Some(format!("GPU-{value:016x}"))
}

#[cfg(test)]
mod tests {
    use std::path::{Path, PathBuf};

    use super::*;
    use tessera_core::api::Vendor;

    fn gpu(id: &str, index: u32, pci: &str) -> DeviceInfo {
        crate::backend::test_device(id, index, Vendor::Amd, pci)
    }

    fn wired(devices: &[&DeviceInfo], sysfs_root: &Path) -> ContainerWiring {
        let mut wiring = ContainerWiring::default();
        let host = HostRoots {
            sysfs_root,
            procfs_root: Path::new("/nonexistent/proc"),
        };
        wire_container(devices, host, &mut wiring);
        wiring
    }

    #[test]
    fn amd_gets_kfd_render_nodes_and_uuids() {
        let nowhere = Path::new("/nonexistent/sys");
        let first = gpu("0x1a2b3c", 0, "0000:c1:00.0");
        let second = gpu("0xfedcba9876543210", 3, "0000:c2:00.0");
        let wiring = wired(&[&first, &second], nowhere);
        assert_eq!(
            wiring.host_paths(),
            ["/dev/kfd", "/dev/dri/renderD128", "/dev/dri/renderD131"]
        );
        assert_eq!(wiring.envs.len(), 1);
        assert_eq!(
            wiring.envs[ROCR_VISIBLE_DEVICES],
            "GPU-00000000001a2b3c,GPU-fedcba9876543210"
        );
        assert_eq!(wiring.cdi_devices, ["amd.com/gpu=0", "amd.com/gpu=3"]);

        // A device without a unique id: no UUIDs at all.
        let by_address = gpu("0000:c3:00.0", 1, "0000:c3:00.0");
        let wiring = wired(&[&first, &by_address], nowhere);
        assert!(!wiring.envs.contains_key(ROCR_VISIBLE_DEVICES));
    }

    #[test]
    fn amd_nodes_come_from_sysfs_when_readable() {
        let sys: PathBuf =
            std::env::temp_dir().join(format!("tessera-amd-container-sys-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&sys);
        let drm = sys.join("bus/pci/devices/0000:c1:00.0/drm");
        for name in ["card3", "renderD131"] {
            std::fs::create_dir_all(drm.join(name)).unwrap();
        }
        let first = gpu("0x1", 0, "0000:c1:00.0");
        let wiring = wired(&[&first], &sys);
        assert_eq!(
            wiring.host_paths(),
            ["/dev/kfd", "/dev/dri/renderD131", "/dev/dri/card3"]
        );
        std::fs::remove_dir_all(&sys).unwrap();
    }
}
