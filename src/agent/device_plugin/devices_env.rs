//! What a container needs to use the devices it was given: the answer to one
//! container's `Allocate` request.
//!
//! Always: `TESSERA_VISIBLE_DEVICES` = the device IDs, comma-separated, in the
//! order kubelet asked for them. Everything else (the vendor runtime's
//! variables, device nodes, CDI device names) is what the backend layer says
//! those devices need (`backend::container_wiring`), put into kubelet's
//! message; CDI names only with `cdi` on.

use std::collections::HashMap;
use std::path::PathBuf;

use super::kubelet_api::v1beta1::{CdiDevice, ContainerAllocateResponse, DeviceSpec};
use crate::backend::container::{ContainerWiring, HostRoots};
use crate::backend::{DeviceInfo, container_wiring};

pub const TESSERA_VISIBLE_DEVICES: &str = "TESSERA_VISIBLE_DEVICES";

#[derive(Clone, Debug, PartialEq)]
pub struct RuntimeOptions {
    /// Also name the devices as CDI devices.
    pub cdi: bool,
    /// Where the host's sysfs is mounted (the backend looks up device node
    /// numbers there).
    pub sysfs_root: PathBuf,
    /// Where the host's procfs is mounted (likewise).
    pub procfs_root: PathBuf,
}

impl Default for RuntimeOptions {
    fn default() -> Self {
        Self {
            cdi: false,
            sysfs_root: PathBuf::from("/sys"),
            procfs_root: PathBuf::from("/proc"),
        }
    }
}

/// The response for one container given `devices` (in kubelet's order) by a
/// backend named `backend`.
pub fn container_response(
    backend: &str,
    devices: &[&DeviceInfo],
    options: &RuntimeOptions,
) -> ContainerAllocateResponse {
    let ids: Vec<&str> = devices.iter().map(|device| device.id.as_str()).collect();
    let wiring = container_wiring(backend, devices, host_roots(options));
    let mut response = kubelet_response(wiring, options.cdi);
    response
        .envs
        .insert(TESSERA_VISIBLE_DEVICES.to_string(), ids.join(","));
    response
}

fn host_roots(options: &RuntimeOptions) -> HostRoots<'_> {
    HostRoots {
        sysfs_root: &options.sysfs_root,
        procfs_root: &options.procfs_root,
    }
}

/// `wiring` in kubelet's words.
fn kubelet_response(wiring: ContainerWiring, cdi: bool) -> ContainerAllocateResponse {
    let cdi_devices = if cdi {
        wiring
            .cdi_devices
            .into_iter()
            .map(|name| CdiDevice { name })
            .collect()
    } else {
        Vec::new()
    };
    ContainerAllocateResponse {
        envs: wiring.envs.into_iter().collect(),
        mounts: Vec::new(),
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
    use super::*;
    use tessera_core::api::Vendor;

    fn info(id: &str, index: u32, vendor: Vendor) -> DeviceInfo {
        crate::backend::test_device(id, index, vendor, "")
    }

    /// Any backend that found real devices.
    const BACKEND: &str = "merged";

    fn nowhere() -> RuntimeOptions {
        RuntimeOptions {
            cdi: false,
            sysfs_root: PathBuf::from("/nonexistent/sys"),
            procfs_root: PathBuf::from("/nonexistent/proc"),
        }
    }

    #[test]
    fn the_backend_wiring_reaches_kubelet_with_the_tessera_variable() {
        let first = info("GPU-aaaa", 2, Vendor::Nvidia);
        let second = info("0x2", 1, Vendor::Amd);
        let devices = [&first, &second];
        let options = nowhere();
        let wiring = container_wiring(BACKEND, &devices, host_roots(&options));
        let response = container_response(BACKEND, &devices, &options);

        assert_eq!(response.envs[TESSERA_VISIBLE_DEVICES], "GPU-aaaa,0x2");
        assert_eq!(response.envs.len(), wiring.envs.len() + 1);
        assert!(
            wiring
                .envs
                .iter()
                .all(|(name, value)| response.envs.get(name) == Some(value))
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
        assert!(response.mounts.is_empty() && response.annotations.is_empty());
        assert!(response.cdi_devices.is_empty(), "CDI is off by default");
    }

    #[test]
    fn cdi_names_only_when_enabled() {
        let first = info("GPU-aaaa", 0, Vendor::Nvidia);
        let second = info("0x2", 1, Vendor::Amd);
        let devices = [&first, &second];
        let options = RuntimeOptions {
            cdi: true,
            ..nowhere()
        };
        let wiring = container_wiring(BACKEND, &devices, host_roots(&options));
        let response = container_response(BACKEND, &devices, &options);
        let cdi: Vec<&str> = response
            .cdi_devices
            .iter()
            .map(|device| device.name.as_str())
            .collect();
        assert_eq!(cdi, wiring.cdi_devices);
        assert_eq!(cdi.len(), 2);
    }

    #[test]
    fn devices_that_need_nothing_get_only_the_tessera_variable() {
        let unknown = info("x", 0, Vendor::Unknown);
        let response = container_response(BACKEND, &[&unknown], &nowhere());
        assert_eq!(response.envs.len(), 1);
        assert_eq!(response.envs[TESSERA_VISIBLE_DEVICES], "x");
        assert!(response.devices.is_empty() && response.cdi_devices.is_empty());
    }
}
