//! What a container needs to use the devices it is given, in words no
//! runtime API owns: environment variables, device nodes and CDI device
//! names. (No vendor needs host mounts today; add them here when one does.)
//! The backend layer fills it in for each vendor's devices
//! (`vendor_wiring`), so whoever hands devices to containers never has to
//! know a vendor.

use std::collections::BTreeMap;
use std::path::Path;

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
}
