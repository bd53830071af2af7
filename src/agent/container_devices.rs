//! What a container given some of the node's devices needs, whichever kubelet
//! API hands them over (the device plugin's `Allocate`, a DRA driver's CDI
//! spec): the backend layer's vendor wiring (`backend::container_wiring`) and
//! always `TESSERA_VISIBLE_DEVICES` = the device IDs, comma-separated, in the
//! order given. The vendors' own CDI device names only with `cdi` on.

use std::path::PathBuf;

use crate::backend::container::{ContainerWiring, HostRoots};
use crate::backend::{DeviceInfo, container_wiring};

pub const TESSERA_VISIBLE_DEVICES: &str = "TESSERA_VISIBLE_DEVICES";

#[derive(Clone, Debug, PartialEq)]
pub struct RuntimeOptions {
    /// Also name the devices as the vendors' CDI devices.
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

/// Everything a container given `devices` (in this order) by a backend
/// named `backend` needs.
pub(crate) fn container_devices(
    backend: &str,
    devices: &[&DeviceInfo],
    options: &RuntimeOptions,
) -> ContainerWiring {
    let host = HostRoots {
        sysfs_root: &options.sysfs_root,
        procfs_root: &options.procfs_root,
    };
    let mut wiring = container_wiring(backend, devices, host);
    if !options.cdi {
        wiring.cdi_devices.clear();
    }
    let ids: Vec<&str> = devices.iter().map(|device| device.id.as_str()).collect();
    wiring
        .envs
        .insert(TESSERA_VISIBLE_DEVICES.to_string(), ids.join(","));
    wiring
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

    pub(crate) fn nowhere() -> RuntimeOptions {
        RuntimeOptions {
            cdi: false,
            sysfs_root: PathBuf::from("/nonexistent/sys"),
            procfs_root: PathBuf::from("/nonexistent/proc"),
        }
    }

    #[test]
    fn the_backend_wiring_with_the_tessera_variable() {
        let first = info("GPU-aaaa", 2, Vendor::Nvidia);
        let second = info("0x2", 1, Vendor::Amd);
        let devices = [&first, &second];
        let options = nowhere();
        let host = HostRoots {
            sysfs_root: &options.sysfs_root,
            procfs_root: &options.procfs_root,
        };
        let backend = container_wiring(BACKEND, &devices, host);
        let wiring = container_devices(BACKEND, &devices, &options);
        assert_eq!(wiring.envs[TESSERA_VISIBLE_DEVICES], "GPU-aaaa,0x2");
        assert_eq!(wiring.envs.len(), backend.envs.len() + 1);
        assert!(
            backend
                .envs
                .iter()
                .all(|(k, v)| wiring.envs.get(k) == Some(v))
        );
        assert_eq!(wiring.device_nodes, backend.device_nodes);
        assert!(!wiring.device_nodes.is_empty());
        assert!(wiring.cdi_devices.is_empty(), "CDI is off by default");

        let with_cdi = container_devices(
            BACKEND,
            &devices,
            &RuntimeOptions {
                cdi: true,
                ..nowhere()
            },
        );
        assert_eq!(with_cdi.cdi_devices, backend.cdi_devices);
        assert_eq!(with_cdi.cdi_devices.len(), 2);
    }

    #[test]
    fn devices_that_need_nothing_get_only_the_tessera_variable() {
        let unknown = info("x", 0, Vendor::Unknown);
        let wiring = container_devices(BACKEND, &[&unknown], &nowhere());
        assert_eq!(wiring.envs.len(), 1);
        assert_eq!(wiring.envs[TESSERA_VISIBLE_DEVICES], "x");
        assert!(wiring.device_nodes.is_empty() && wiring.cdi_devices.is_empty());
    }
}
