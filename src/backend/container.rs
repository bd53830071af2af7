//! What a container needs to use the devices it is given, in words no
//! runtime API owns: environment variables, device nodes, read-only host
//! files (a vendor's user-space driver) and CDI device names. The backend
//! layer fills it in for each vendor's devices (`vendor_wiring`), so whoever
//! hands devices to containers never has to know a vendor.

use std::collections::BTreeMap;
use std::path::Path;

use super::cdi_specs::ListedCdiDevices;

/// Device node permissions handed to containers: read and write.
const READ_WRITE: &str = "rw";

/// Where the host's pseudo-filesystems are mounted for this process, so
/// device node numbers can be looked up (a container given the host's
/// `/sys` and `/proc` may see them elsewhere).
#[derive(Clone, Copy, Debug)]
pub(crate) struct HostRoots<'a> {
    pub(crate) sysfs_root: &'a Path,
    pub(crate) procfs_root: &'a Path,
}

/// Where a host's GPU driver keeps its user-space files (libraries,
/// firmware), for containers whose runtime will not add them itself.
#[derive(Clone, Copy, Debug)]
pub(crate) struct DriverRoot<'a> {
    /// The driver root as this process sees it (a host directory mounted
    /// into the agent): files are looked up under it.
    pub(crate) seen_at: &'a Path,
    /// The same directory on the host: mounts name host paths under it, as
    /// the container runtime resolves them on the host.
    pub(crate) on_host: &'a Path,
}

/// What a container must be given beyond its variables and device nodes
/// when nothing else will add the vendors' driver files (a DRA claim's CDI
/// spec on a node whose runtime ignores `NVIDIA_VISIBLE_DEVICES`).
#[derive(Clone, Copy, Debug)]
pub(crate) struct DriverFiles<'a> {
    /// The CDI devices the node's own CDI specs define: a vendor's CDI
    /// device listed there brings the driver's files itself.
    pub(crate) listed: &'a ListedCdiDevices,
    /// Where to find the files otherwise; `None`: they are not mounted.
    pub(crate) root: Option<DriverRoot<'a>>,
}

/// A host file or directory the container gets read-only at `container_path`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct ReadOnlyMount {
    pub(crate) host_path: String,
    pub(crate) container_path: String,
}

/// A device node the container gets.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct DeviceNode {
    pub(crate) host_path: String,
    pub(crate) container_path: String,
    /// cgroup device permissions (`r`, `w`, `m`).
    pub(crate) permissions: String,
}

/// Everything a container needs for its devices.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct ContainerWiring {
    pub(crate) envs: BTreeMap<String, String>,
    /// In the order they were added; each host path once.
    pub(crate) device_nodes: Vec<DeviceNode>,
    /// In the order they were added; each container path once.
    pub(crate) mounts: Vec<ReadOnlyMount>,
    /// Fully qualified CDI device names (`vendor.com/class=name`), for
    /// runtimes that resolve devices through CDI.
    pub(crate) cdi_devices: Vec<String>,
}

impl ContainerWiring {
    /// The node at `path`, at the same path inside, read-write. Several GPUs
    /// share nodes (a control device), so a path already given is not
    /// repeated.
    pub(crate) fn add_device_node(&mut self, path: &str) {
        if self.device_nodes.iter().any(|node| node.host_path == path) {
            return;
        }
        self.device_nodes.push(DeviceNode {
            host_path: path.to_string(),
            container_path: path.to_string(),
            permissions: READ_WRITE.to_string(),
        });
    }

    /// `host_path` read-only at `container_path`; a container path already
    /// given keeps its first source (two host names of one library, found
    /// in two search directories, must not be mounted over each other).
    pub(crate) fn add_read_only_mount(&mut self, host_path: &str, container_path: &str) {
        if self
            .mounts
            .iter()
            .any(|mount| mount.container_path == container_path)
        {
            return;
        }
        self.mounts.push(ReadOnlyMount {
            host_path: host_path.to_string(),
            container_path: container_path.to_string(),
        });
    }

    /// The host paths of the device nodes, in order.
    #[cfg(test)]
    pub(crate) fn host_paths(&self) -> Vec<&str> {
        self.device_nodes
            .iter()
            .map(|node| node.host_path.as_str())
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_device_node_is_given_once_read_write_at_the_same_path() {
        let mut wiring = ContainerWiring::default();
        wiring.add_device_node("/dev/a");
        wiring.add_device_node("/dev/b");
        wiring.add_device_node("/dev/a");
        let paths: Vec<&str> = wiring
            .device_nodes
            .iter()
            .map(|node| node.host_path.as_str())
            .collect();
        assert_eq!(paths, ["/dev/a", "/dev/b"]);
        assert!(
            wiring
                .device_nodes
                .iter()
                .all(|node| node.container_path == node.host_path && node.permissions == "rw")
        );
    }

    #[test]
    fn a_container_path_is_mounted_once_from_its_first_source() {
        let mut wiring = ContainerWiring::default();
        wiring.add_read_only_mount("/usr/lib/libx.so.1", "/usr/lib/libx.so.1");
        wiring.add_read_only_mount("/lib/libx.so.1", "/usr/lib/libx.so.1");
        wiring.add_read_only_mount("/usr/lib/libx.so.1", "/usr/lib/libx.so");
        assert_eq!(
            wiring.mounts,
            [
                ReadOnlyMount {
                    host_path: "/usr/lib/libx.so.1".into(),
                    container_path: "/usr/lib/libx.so.1".into()
                },
                ReadOnlyMount {
                    host_path: "/usr/lib/libx.so.1".into(),
                    container_path: "/usr/lib/libx.so".into()
                },
            ]
        );
    }
}
