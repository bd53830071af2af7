//! Which backend says what a container needs for which devices: each vendor's
//! devices go to that vendor's backend (NVIDIA first, then AMD, each in the
//! order asked for), so a node with both gets both. Devices of the fake
//! backend exist only on paper and need nothing, so containers start on
//! nodes without GPUs; devices of a vendor no backend knows need nothing
//! either.

use super::container::{ContainerWiring, HostRoots};
use super::{DeviceInfo, amd, fake, nvml};
use tessera_core::api::Vendor;

/// Adds what a container given one vendor's devices needs.
type WireContainer = fn(&[&DeviceInfo], HostRoots<'_>, &mut ContainerWiring);

/// The vendors whose devices a container can use, in the order they are wired.
const VENDORS: [(Vendor, WireContainer); 2] = [
    (Vendor::Nvidia, nvml::wire_container),
    (Vendor::Amd, amd::wire_container),
];

/// What a container given `devices` (in the order asked for) needs, when a
/// backend named `backend` (a snapshot's `backend`) found them.
pub(crate) fn container_wiring(
    backend: &str,
    devices: &[&DeviceInfo],
    host: HostRoots<'_>,
) -> ContainerWiring {
    let mut wiring = ContainerWiring::default();
    if backend == fake::BACKEND_NAME {
        return wiring;
    }
    for (vendor, wire_container) in VENDORS {
        let of_vendor: Vec<&DeviceInfo> = devices
            .iter()
            .copied()
            .filter(|device| device.vendor == vendor)
            .collect();
        if !of_vendor.is_empty() {
            wire_container(&of_vendor, host, &mut wiring);
        }
    }
    wiring
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;

    fn device(id: &str, index: u32, vendor: Vendor) -> DeviceInfo {
        crate::backend::test_device(id, index, vendor, "")
    }

    fn nowhere() -> HostRoots<'static> {
        HostRoots {
            sysfs_root: Path::new("/nonexistent/sys"),
            procfs_root: Path::new("/nonexistent/proc"),
        }
    }

    #[test]
    fn fake_devices_need_nothing() {
        let nvidia = device("fake-h100-80gib-0", 0, Vendor::Nvidia);
        let amd = device("fake-mi300x-192gib-1", 1, Vendor::Amd);
        let wiring = container_wiring(fake::BACKEND_NAME, &[&nvidia, &amd], nowhere());
        assert_eq!(wiring, ContainerWiring::default());
    }

    #[test]
    fn unknown_vendors_need_nothing() {
        let unknown = device("x", 0, Vendor::Unknown);
        let wiring = container_wiring("other", &[&unknown], nowhere());
        assert_eq!(wiring, ContainerWiring::default());
    }

    #[test]
    fn mixed_vendors_get_both_nvidia_first() {
        let amd = device("0x2", 1, Vendor::Amd);
        let nvidia = device("GPU-aaaa", 0, Vendor::Nvidia);
        let wiring = container_wiring("nvml+amd", &[&amd, &nvidia], nowhere());
        assert_eq!(
            wiring.cdi_devices,
            ["nvidia.com/gpu=GPU-aaaa", "amd.com/gpu=1"]
        );
        assert_eq!(wiring.envs["NVIDIA_VISIBLE_DEVICES"], "GPU-aaaa");
        assert_eq!(wiring.envs["ROCR_VISIBLE_DEVICES"], "GPU-0000000000000002");
        let paths: Vec<&str> = wiring
            .device_nodes
            .iter()
            .map(|node| node.host_path.as_str())
            .collect();
        assert_eq!(
            paths,
            [
                "/dev/nvidiactl",
                "/dev/nvidia-uvm",
                "/dev/nvidia-uvm-tools",
                "/dev/nvidia0",
                "/dev/kfd",
                "/dev/dri/renderD129"
            ]
        );
    }
}
