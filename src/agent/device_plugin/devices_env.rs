//! The answer to one container's `Allocate` request: what the container
//! needs for the devices it was given (`agent::container_devices`), in the
//! device plugin API's words.

use std::collections::HashMap;

use super::kubelet_api::v1beta1::{CdiDevice, ContainerAllocateResponse, DeviceSpec, Mount};
use crate::agent::container_devices::{DriverFilesFrom, RuntimeOptions, container_devices};
use crate::backend::DeviceInfo;
use crate::backend::container::ContainerWiring;

/// The response for one container given `devices` (in kubelet's order) by a
/// backend named `backend`. The driver's files are left to the runtime, as
/// they always were on device plugin nodes (the NVIDIA runtime's hook, or
/// the vendors' CDI devices with `cdi`): kubelet gives the answer's mounts
/// to every such container, and a hook that also acts would mount the same
/// libraries twice.
pub fn container_response(
    backend: &str,
    devices: &[&DeviceInfo],
    options: &RuntimeOptions,
) -> ContainerAllocateResponse {
    kubelet_response(container_devices(
        backend,
        devices,
        options,
        DriverFilesFrom::Runtime,
    ))
}

/// `wiring` in kubelet's words.
fn kubelet_response(wiring: ContainerWiring) -> ContainerAllocateResponse {
    let cdi_devices = wiring
        .cdi_devices
        .into_iter()
        .map(|name| CdiDevice { name })
        .collect();
    ContainerAllocateResponse {
        envs: wiring.envs.into_iter().collect(),
        mounts: wiring
            .mounts
            .into_iter()
            .map(|mount| Mount {
                container_path: mount.container_path,
                host_path: mount.host_path,
                read_only: true,
            })
            .collect(),
        devices: wiring
            .device_nodes
            .into_iter()
            .map(|node| DeviceSpec {
                container_path: node.container_path,
                host_path: node.host_path,
                permissions: node.permissions,
            })
            .collect(),
        annotations: HashMap::new(),
        cdi_devices,
    }
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use super::*;
    use crate::agent::container_devices::TESSERA_VISIBLE_DEVICES;
    use tessera_core::api::Vendor;

    #[test]
    fn the_container_wiring_reaches_kubelet_field_by_field() {
        let first = crate::backend::test_device("GPU-aaaa", 2, Vendor::Nvidia, "");
        let second = crate::backend::test_device("0x2", 1, Vendor::Amd, "");
        let devices = [&first, &second];
        let options = RuntimeOptions {
            cdi: true,
            sysfs_root: PathBuf::from("/nonexistent/sys"),
            procfs_root: PathBuf::from("/nonexistent/proc"),
            ..RuntimeOptions::default()
        };
        let wiring = container_devices("merged", &devices, &options, DriverFilesFrom::Runtime);
        let response = container_response("merged", &devices, &options);
        assert_eq!(response.envs[TESSERA_VISIBLE_DEVICES], "GPU-aaaa,0x2");
        assert_eq!(
            response.envs,
            wiring.envs.clone().into_iter().collect::<HashMap<_, _>>()
        );
        let nodes: Vec<(&str, &str, &str)> = response
            .devices
            .iter()
            .map(|spec| {
                (
                    spec.host_path.as_str(),
                    spec.container_path.as_str(),
                    spec.permissions.as_str(),
                )
            })
            .collect();
        let wired: Vec<(&str, &str, &str)> = wiring
            .device_nodes
            .iter()
            .map(|node| {
                (
                    node.host_path.as_str(),
                    node.container_path.as_str(),
                    node.permissions.as_str(),
                )
            })
            .collect();
        assert_eq!(nodes, wired);
        assert!(!nodes.is_empty());
        let cdi: Vec<&str> = response
            .cdi_devices
            .iter()
            .map(|d| d.name.as_str())
            .collect();
        assert_eq!(cdi, wiring.cdi_devices);
        // The runtime brings the driver's files on device plugin nodes.
        assert!(response.mounts.is_empty() && response.annotations.is_empty());
    }

    #[test]
    fn mounts_reach_kubelet_read_only() {
        let mut wiring = ContainerWiring::default();
        wiring.add_read_only_mount("/host/lib/libx.so.1", "/lib/libx.so.1");
        let response = kubelet_response(wiring);
        assert_eq!(
            response.mounts,
            [Mount {
                container_path: "/lib/libx.so.1".into(),
                host_path: "/host/lib/libx.so.1".into(),
                read_only: true,
            }]
        );
    }
}
