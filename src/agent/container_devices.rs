//! What a container given some of the node's devices needs, whichever kubelet
//! API hands them over (the device plugin's `Allocate`, a DRA driver's CDI
//! spec): the backend layer's vendor wiring (`backend::container_wiring`) and
//! always `TESSERA_VISIBLE_DEVICES` = the device IDs, comma-separated, in the
//! order given.
//!
//! The vendors' driver files (NVIDIA's libraries) come one of two ways
//! ([`DriverFilesFrom`]). The device plugin leaves them to the runtime, as
//! ever: the NVIDIA runtime's hook reads `NVIDIA_VISIBLE_DEVICES`, and with
//! `cdi` on the vendors' CDI device names are given too. A claim's CDI spec
//! brings them itself, since hardened nodes let the hook ignore the variable
//! for unprivileged containers: the vendor's CDI device where the node's CDI
//! specs define it, else the files mounted from the driver root (with `cdi`
//! on, the names as for the device plugin).

use std::path::PathBuf;

use crate::backend::cdi_specs::ListedCdiDevices;
use crate::backend::container::{ContainerWiring, DriverFiles, DriverRoot, HostRoots};
use crate::backend::{DeviceInfo, container_wiring};

pub const TESSERA_VISIBLE_DEVICES: &str = "TESSERA_VISIBLE_DEVICES";
/// For a memory share of a GPU: the GiB the container may use.
pub const TESSERA_GPU_MEMORY_GIB: &str = "TESSERA_GPU_MEMORY_GIB";
/// For a memory share of a GPU: that as a fraction of the GPU's memory.
pub const TESSERA_GPU_MEMORY_FRACTION: &str = "TESSERA_GPU_MEMORY_FRACTION";

#[derive(Clone, Debug, PartialEq)]
pub struct RuntimeOptions {
    /// Also name the devices as the vendors' CDI devices.
    pub cdi: bool,
    /// Where the host's sysfs is mounted (the backend looks up device node
    /// numbers there).
    pub sysfs_root: PathBuf,
    /// Where the host's procfs is mounted (likewise, and the NVIDIA driver's
    /// version).
    pub procfs_root: PathBuf,
    /// The host's driver root as the agent sees it: where a claim's
    /// container gets the driver's libraries from when no CDI spec of the
    /// node brings them. `None`: it gets none from tessera.
    pub driver_root: Option<PathBuf>,
    /// The same directory on the host (the mounts' host paths).
    pub host_driver_root: PathBuf,
    /// Where the node's CDI specs are, as the agent sees them (the vendors'
    /// own specs define the CDI devices a claim may name).
    pub cdi_spec_dirs: Vec<PathBuf>,
}

impl Default for RuntimeOptions {
    fn default() -> Self {
        Self {
            cdi: false,
            sysfs_root: PathBuf::from("/sys"),
            procfs_root: PathBuf::from("/proc"),
            driver_root: None,
            host_driver_root: PathBuf::from("/"),
            cdi_spec_dirs: vec![PathBuf::from("/etc/cdi"), PathBuf::from("/var/run/cdi")],
        }
    }
}

/// Who gives the container the vendors' driver files.
#[derive(Clone, Copy, Debug)]
pub(crate) enum DriverFilesFrom<'a> {
    /// The container runtime (the device plugin).
    Runtime,
    /// The answer itself (a claim's CDI spec), given the CDI devices the
    /// node's specs define now.
    Answer(&'a ListedCdiDevices),
}

/// Everything a container given `devices` (in this order) by a backend
/// named `backend` needs.
pub(crate) fn container_devices(
    backend: &str,
    devices: &[&DeviceInfo],
    options: &RuntimeOptions,
    from: DriverFilesFrom<'_>,
) -> ContainerWiring {
    let host = HostRoots {
        sysfs_root: &options.sysfs_root,
        procfs_root: &options.procfs_root,
    };
    let files = match from {
        // `cdi` says the runtime resolves the vendors' names: nothing to add.
        DriverFilesFrom::Answer(listed) if !options.cdi => Some(DriverFiles {
            listed,
            root: options.driver_root.as_deref().map(|seen_at| DriverRoot {
                seen_at,
                on_host: &options.host_driver_root,
            }),
        }),
        _ => None,
    };
    let mut wiring = container_wiring(backend, devices, host, files);
    if files.is_none() && !options.cdi {
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
            driver_root: None,
            host_driver_root: PathBuf::from("/"),
            cdi_spec_dirs: Vec::new(),
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
        let backend = container_wiring(BACKEND, &devices, host, None);
        let wiring = container_devices(BACKEND, &devices, &options, DriverFilesFrom::Runtime);
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

        assert!(wiring.mounts.is_empty());

        let with_cdi = RuntimeOptions {
            cdi: true,
            ..nowhere()
        };
        let listed = ListedCdiDevices::default();
        for from in [DriverFilesFrom::Runtime, DriverFilesFrom::Answer(&listed)] {
            let wiring = container_devices(BACKEND, &devices, &with_cdi, from);
            assert_eq!(wiring.cdi_devices, backend.cdi_devices);
            assert_eq!(wiring.cdi_devices.len(), 2);
            assert!(wiring.mounts.is_empty());
        }
    }

    #[test]
    fn an_answer_names_vendor_cdi_devices_the_node_defines_else_mounts_the_driver() {
        let tmp = tempfile::tempdir().unwrap();
        let (proc, root) = (tmp.path().join("proc"), tmp.path().join("root"));
        crate::backend::nvml::test_driver_install(&proc, &root);
        let options = RuntimeOptions {
            procfs_root: proc,
            driver_root: Some(root),
            host_driver_root: PathBuf::from("/"),
            ..nowhere()
        };
        let gpu = info("GPU-aaaa", 0, Vendor::Nvidia);

        let listed = ListedCdiDevices::of(&["nvidia.com/gpu=GPU-aaaa"]);
        let wiring =
            container_devices(BACKEND, &[&gpu], &options, DriverFilesFrom::Answer(&listed));
        assert_eq!(wiring.cdi_devices, ["nvidia.com/gpu=GPU-aaaa"]);
        assert!(wiring.mounts.is_empty());

        let none = ListedCdiDevices::default();
        let wiring = container_devices(BACKEND, &[&gpu], &options, DriverFilesFrom::Answer(&none));
        assert!(wiring.cdi_devices.is_empty());
        assert!(
            wiring
                .mounts
                .iter()
                .any(|mount| mount.container_path == "/usr/lib/x86_64-linux-gnu/libcuda.so.1"),
            "{:?}",
            wiring.mounts
        );
        assert_eq!(wiring.envs["NVIDIA_VISIBLE_DEVICES"], "GPU-aaaa");
        assert_eq!(wiring.envs[TESSERA_VISIBLE_DEVICES], "GPU-aaaa");

        // The device plugin: as ever, whatever the node has.
        let wiring = container_devices(BACKEND, &[&gpu], &options, DriverFilesFrom::Runtime);
        assert!(wiring.cdi_devices.is_empty() && wiring.mounts.is_empty());
    }

    #[test]
    fn devices_that_need_nothing_get_only_the_tessera_variable() {
        let unknown = info("x", 0, Vendor::Unknown);
        let wiring = container_devices(BACKEND, &[&unknown], &nowhere(), DriverFilesFrom::Runtime);
        assert_eq!(wiring.envs.len(), 1);
        assert_eq!(wiring.envs[TESSERA_VISIBLE_DEVICES], "x");
        assert!(wiring.device_nodes.is_empty() && wiring.cdi_devices.is_empty());
        assert!(wiring.mounts.is_empty());
    }
}
