//! Which backend says what a container needs for which devices: each vendor's
//! devices go to that vendor's backend (NVIDIA first, then AMD, each in the
//! order asked for), so a node with both gets both. Devices of the fake
//! backend exist only on paper and need nothing, so containers start on
//! nodes without GPUs; devices of a vendor no backend knows need nothing
//! either.
//!
//! Where the wiring must bring the vendors' driver files itself
//! ([`DriverFiles`]), a vendor's CDI devices are named only when the node's
//! CDI specs define every one of them (the vendor's spec then brings its
//! files); otherwise they are left out, and a vendor whose user-space driver
//! comes from the host (NVIDIA) has its files mounted instead.

use super::container::{ContainerWiring, DriverFiles, DriverRoot, HostRoots};
use super::{DeviceInfo, amd, fake, nvml};
use tessera_core::api::Vendor;

/// Adds what a container given one vendor's devices needs.
type WireContainer = fn(&[&DeviceInfo], HostRoots<'_>, &mut ContainerWiring);
/// Adds the vendor's user-space driver files from the host as mounts.
type MountDriverFiles = fn(HostRoots<'_>, DriverRoot<'_>, &mut ContainerWiring);

/// The vendors whose devices a container can use, in the order they are
/// wired, with how their host driver files are mounted (AMD's user space,
/// ROCm, comes with the image: the host gives only device nodes).
const VENDORS: [(Vendor, WireContainer, Option<MountDriverFiles>); 2] = [
    (
        Vendor::Nvidia,
        nvml::wire_container,
        Some(nvml::mount_driver_files),
    ),
    (Vendor::Amd, amd::wire_container, None),
];

/// What a container given `devices` (in the order asked for) needs, when a
/// backend named `backend` (a snapshot's `backend`) found them. `files`:
/// whether the wiring must bring the driver files itself (`None`: the
/// runtime adds them, and every vendor CDI name is given as before).
pub(crate) fn container_wiring(
    backend: &str,
    devices: &[&DeviceInfo],
    host: HostRoots<'_>,
    files: Option<DriverFiles<'_>>,
) -> ContainerWiring {
    let mut wiring = ContainerWiring::default();
    if backend == fake::BACKEND_NAME {
        return wiring;
    }
    for (vendor, wire_container, mount_driver_files) in VENDORS {
        let of_vendor: Vec<&DeviceInfo> = devices
            .iter()
            .copied()
            .filter(|device| device.vendor == vendor)
            .collect();
        if of_vendor.is_empty() {
            continue;
        }
        let named_before = wiring.cdi_devices.len();
        wire_container(&of_vendor, host, &mut wiring);
        let Some(files) = files else {
            continue;
        };
        let names = &wiring.cdi_devices[named_before..];
        if names.iter().all(|name| files.listed.lists(name)) {
            tracing::debug!(
                ?names,
                "the node's CDI specs define the devices: the vendor's CDI devices bring the driver files"
            );
            continue;
        }
        let unlisted: Vec<String> = names
            .iter()
            .filter(|name| !files.listed.lists(name))
            .cloned()
            .collect();
        wiring.cdi_devices.truncate(named_before);
        match (mount_driver_files, files.root) {
            (Some(mount), Some(root)) => {
                tracing::debug!(
                    ?unlisted,
                    "no CDI spec of the node defines these devices: mounting the driver files"
                );
                mount(host, root, &mut wiring);
            }
            (Some(_), None) => {
                tracing::info!(
                    ?unlisted,
                    "no CDI spec of the node defines these devices and no driver root is set (--driver-root): the container gets no driver libraries from tessera"
                );
            }
            (None, _) => {}
        }
    }
    wiring
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;
    use crate::backend::cdi_specs::ListedCdiDevices;

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
        let listed = ListedCdiDevices::default();
        for files in [None, Some(no_root(&listed))] {
            let wiring = container_wiring(fake::BACKEND_NAME, &[&nvidia, &amd], nowhere(), files);
            assert_eq!(wiring, ContainerWiring::default());
        }
    }

    #[test]
    fn unknown_vendors_need_nothing() {
        let unknown = device("x", 0, Vendor::Unknown);
        let wiring = container_wiring("other", &[&unknown], nowhere(), None);
        assert_eq!(wiring, ContainerWiring::default());
    }

    fn no_root(listed: &ListedCdiDevices) -> DriverFiles<'_> {
        DriverFiles { listed, root: None }
    }

    #[test]
    fn vendor_cdi_names_are_kept_only_where_the_node_defines_all_of_them() {
        let nvidia = device("GPU-aaaa", 0, Vendor::Nvidia);
        let lost = device("GPU-bbbb", 1, Vendor::Nvidia);
        let amd = device("0x2", 1, Vendor::Amd);
        let listed = ListedCdiDevices::of(&["nvidia.com/gpu=GPU-aaaa", "amd.com/gpu=1"]);
        let wiring = container_wiring(
            "nvml+amd",
            &[&nvidia, &amd],
            nowhere(),
            Some(no_root(&listed)),
        );
        assert_eq!(
            wiring.cdi_devices,
            ["nvidia.com/gpu=GPU-aaaa", "amd.com/gpu=1"]
        );
        assert!(wiring.mounts.is_empty());

        // One GPU the node's spec does not define: none of the vendor's names
        // (the runtime would refuse it), the other vendor's kept.
        let wiring = container_wiring(
            "nvml+amd",
            &[&nvidia, &lost, &amd],
            nowhere(),
            Some(no_root(&listed)),
        );
        assert_eq!(wiring.cdi_devices, ["amd.com/gpu=1"]);
        assert_eq!(wiring.envs["NVIDIA_VISIBLE_DEVICES"], "GPU-aaaa,GPU-bbbb");

        // Without DriverFiles every name is given, as before.
        let wiring = container_wiring("nvml", &[&lost], nowhere(), None);
        assert_eq!(wiring.cdi_devices, ["nvidia.com/gpu=GPU-bbbb"]);
    }

    #[test]
    fn mixed_vendors_get_both_nvidia_first() {
        let amd = device("0x2", 1, Vendor::Amd);
        let nvidia = device("GPU-aaaa", 0, Vendor::Nvidia);
        let wiring = container_wiring("nvml+amd", &[&amd, &nvidia], nowhere(), None);
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
