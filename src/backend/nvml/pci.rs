//! Where a GPU sits on the PCI bus: NVML's bus ids in the form the rest of
//! the node uses (`0000:17:00.0`, as sysfs spells them), and the NUMA node
//! sysfs gives the device.

use std::path::Path;

/// `0000:17:00.0` from NVML's `00000000:17:00.0` (lower case, 4-digit domain).
pub(super) fn normalize_pci_bus_id(raw: &str) -> String {
    let bus_id = raw.trim().trim_end_matches('\0').to_ascii_lowercase();
    match bus_id.matches(':').count() {
        1 => format!("0000:{bus_id}"),
        2 => match bus_id.split_once(':') {
            Some((domain, rest)) => match u32::from_str_radix(domain, 16) {
                Ok(domain) => format!("{domain:04x}:{rest}"),
                Err(_) => bus_id,
            },
            None => bus_id,
        },
        _ => bus_id,
    }
}

/// The NUMA node of a PCI device from `<sysfs_root>/bus/pci/devices/<id>/numa_node`;
/// `-1` (no affinity) or an unreadable file is `None`.
pub(super) fn read_numa_node(sysfs_root: &Path, pci_bus_id: &str) -> Option<i32> {
    if pci_bus_id.is_empty() {
        return None;
    }
    let path = sysfs_root
        .join("bus/pci/devices")
        .join(pci_bus_id)
        .join("numa_node");
    let node: i32 = std::fs::read_to_string(path).ok()?.trim().parse().ok()?;
    (node >= 0).then_some(node)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bus_ids_are_normalized() {
        assert_eq!(normalize_pci_bus_id("00000000:2A:00.0"), "0000:2a:00.0");
        assert_eq!(normalize_pci_bus_id("0000:17:00.0"), "0000:17:00.0");
        assert_eq!(normalize_pci_bus_id("17:00.0"), "0000:17:00.0");
    }

    #[test]
    fn numa_from_sysfs() {
        let root = std::env::temp_dir().join(format!("tessera-nvml-numa-{}", std::process::id()));
        for (bus, node) in [("0000:17:00.0", "1\n"), ("0000:18:00.0", "-1\n")] {
            let dir = root.join("bus/pci/devices").join(bus);
            std::fs::create_dir_all(&dir).unwrap();
            std::fs::write(dir.join("numa_node"), node).unwrap();
        }
        assert_eq!(read_numa_node(&root, "0000:17:00.0"), Some(1));
        assert_eq!(read_numa_node(&root, "0000:18:00.0"), None);
        assert_eq!(read_numa_node(&root, "0000:19:00.0"), None);
        std::fs::remove_dir_all(&root).unwrap();
    }
}
