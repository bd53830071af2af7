//! What a container needs to use NVIDIA GPUs:
//!
//! - `NVIDIA_VISIBLE_DEVICES` = the GPU UUIDs (the device IDs of this
//!   backend; a device whose UUID could not be read, `nvml-index-<i>`, is
//!   named by its index, which the NVIDIA container runtime also accepts);
//! - the device nodes `/dev/nvidiactl`, `/dev/nvidia-uvm`,
//!   `/dev/nvidia-uvm-tools` and `/dev/nvidia<minor>` per GPU. The minor is
//!   read from the driver (`/proc/driver/nvidia/gpus/<PCI bus id>/information`,
//!   line `Device Minor:`); when that is not readable it is assumed to equal
//!   the NVML index, which is how the driver numbers GPUs unless a node has
//!   been reconfigured;
//! - CDI names `nvidia.com/gpu=<UUID>` (the same names as the variable).

use std::path::Path;

use super::super::DeviceInfo;
use super::devices::is_fallback_id;
use crate::backend::container::{ContainerWiring, HostRoots};

const NVIDIA_VISIBLE_DEVICES: &str = "NVIDIA_VISIBLE_DEVICES";
/// Nodes every container with an NVIDIA GPU needs, whichever GPUs it has.
const SHARED_NODES: [&str; 3] = ["/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"];

/// Adds what a container given `devices` (NVIDIA GPUs, in kubelet's order)
/// needs to `wiring`.
pub(crate) fn wire_container(
    devices: &[&DeviceInfo],
    host: HostRoots<'_>,
    wiring: &mut ContainerWiring,
) {
    let names: Vec<String> = devices.iter().map(|device| runtime_name(device)).collect();
    wiring
        .envs
        .insert(NVIDIA_VISIBLE_DEVICES.to_string(), names.join(","));
    for path in SHARED_NODES {
        wiring.add_device_node(path);
    }
    for device in devices {
        let minor = device_minor(host.procfs_root, &device.pci_bus_id).unwrap_or(device.index);
        wiring.add_device_node(&format!("/dev/nvidia{minor}"));
    }
    wiring
        .cdi_devices
        .extend(names.iter().map(|name| format!("nvidia.com/gpu={name}")));
}

/// How the NVIDIA container runtime names a GPU: its UUID, or its index when
/// the UUID could not be read.
fn runtime_name(device: &DeviceInfo) -> String {
    if is_fallback_id(&device.id) {
        device.index.to_string()
    } else {
        device.id.clone()
    }
}

/// `Device Minor:` from `<procfs>/driver/nvidia/gpus/<PCI bus id>/information`.
fn device_minor(procfs_root: &Path, pci_bus_id: &str) -> Option<u32> {
    if pci_bus_id.is_empty() {
        return None;
    }
    let path = procfs_root
        .join("driver/nvidia/gpus")
        .join(pci_bus_id.to_ascii_lowercase())
        .join("information");
    let text = std::fs::read_to_string(path).ok()?;
    text.lines().find_map(|line| {
        let (key, value) = line.split_once(':')?;
        (key.trim() == "Device Minor")
            .then(|| value.trim().parse().ok())
            .flatten()
    })
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use super::super::devices::fallback_id;
    use super::*;
    use tessera_core::api::Vendor;

    fn gpu(id: &str, index: u32, pci: &str) -> DeviceInfo {
        crate::backend::test_device(id, index, Vendor::Nvidia, pci)
    }

    fn wired(devices: &[&DeviceInfo], procfs_root: &Path) -> ContainerWiring {
        let mut wiring = ContainerWiring::default();
        let host = HostRoots {
            sysfs_root: Path::new("/nonexistent/sys"),
            procfs_root,
        };
        wire_container(devices, host, &mut wiring);
        wiring
    }

    #[test]
    fn nvidia_gets_uuids_and_device_nodes() {
        let first = gpu("GPU-aaaa", 2, "0000:17:00.0");
        let lost = gpu(&fallback_id(5), 5, "0000:18:00.0");
        let wiring = wired(&[&first, &lost], Path::new("/nonexistent/proc"));
        assert_eq!(wiring.envs.len(), 1);
        assert_eq!(wiring.envs[NVIDIA_VISIBLE_DEVICES], "GPU-aaaa,5");
        assert_eq!(
            wiring.host_paths(),
            [
                "/dev/nvidiactl",
                "/dev/nvidia-uvm",
                "/dev/nvidia-uvm-tools",
                "/dev/nvidia2",
                "/dev/nvidia5"
            ]
        );
        assert_eq!(
            wiring.cdi_devices,
            ["nvidia.com/gpu=GPU-aaaa", "nvidia.com/gpu=5"]
        );
    }

    #[test]
    fn nvidia_minor_comes_from_the_driver_when_readable() {
        let proc: PathBuf = std::env::temp_dir().join(format!(
            "tessera-nvml-container-proc-{}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&proc);
        let driver = proc.join("driver/nvidia/gpus/0000:17:00.0");
        std::fs::create_dir_all(&driver).unwrap();
        std::fs::write(
            driver.join("information"),
            "Model: \t\t NVIDIA H100\nIRQ:   \t\t 42\nDevice Minor: \t 7\nBus Location: \t 0000:17:00.0\n",
        )
        .unwrap();
        let first = gpu("GPU-aaaa", 0, "0000:17:00.0");
        let wiring = wired(&[&first], &proc);
        assert_eq!(wiring.host_paths()[3], "/dev/nvidia7");
        std::fs::remove_dir_all(&proc).unwrap();
    }

    /// On a node with the NVIDIA driver:
    /// `cargo test --lib real_gpus_get_device_nodes_that_exist -- --ignored`.
    /// A container handed a device node the host lacks does not start.
    #[test]
    #[ignore = "needs an NVIDIA GPU and driver"]
    fn real_gpus_get_device_nodes_that_exist() {
        use std::os::unix::fs::FileTypeExt;

        use crate::backend::GpuBackend;

        let mut backend = super::super::NvmlBackend::new(None).expect("the NVIDIA driver");
        let devices = backend.devices().expect("NVML lists the GPUs");
        assert!(!devices.is_empty(), "NVML lists no GPU");
        for device in &devices {
            let minor = device_minor(Path::new("/proc"), &device.pci_bus_id);
            println!("{} {} minor {minor:?}", device.id, device.pci_bus_id);
            assert!(minor.is_some(), "the driver gives no minor for {device:?}");
        }
        let all: Vec<&DeviceInfo> = devices.iter().collect();
        let wiring = wired(&all, Path::new("/proc"));
        println!("{wiring:?}");
        let missing: Vec<&str> = wiring
            .host_paths()
            .into_iter()
            .filter(|path| !std::fs::metadata(path).is_ok_and(|m| m.file_type().is_char_device()))
            .collect();
        assert!(
            missing.is_empty(),
            "not character devices on this host: {missing:?}"
        );
    }

    /// On a node with the NVIDIA driver and the toolkit's CDI spec
    /// (`nvidia-ctk cdi generate --output=/var/run/cdi/nvidia.yaml`; another
    /// directory in `TESSERA_CDI_SPEC_DIRS`, `:`-separated):
    /// `cargo test --lib real_gpus_are_defined_by_the_toolkit_spec -- --ignored`.
    /// The names a claim's answer gives must be the ones the spec defines.
    #[test]
    #[ignore = "needs an NVIDIA GPU, driver and the toolkit's CDI spec"]
    fn real_gpus_are_defined_by_the_toolkit_spec() {
        use crate::backend::GpuBackend;
        use crate::backend::cdi_specs::ListedCdiDevices;

        let dirs: Vec<PathBuf> = std::env::var("TESSERA_CDI_SPEC_DIRS")
            .unwrap_or_else(|_| "/etc/cdi:/var/run/cdi".into())
            .split(':')
            .map(PathBuf::from)
            .collect();
        let listed = ListedCdiDevices::read(&dirs);
        let mut backend = super::super::NvmlBackend::new(None).expect("the NVIDIA driver");
        let devices = backend.devices().expect("NVML lists the GPUs");
        assert!(!devices.is_empty(), "NVML lists no GPU");
        let all: Vec<&DeviceInfo> = devices.iter().collect();
        let wiring = wired(&all, Path::new("/proc"));
        println!("{:?} in {dirs:?}", wiring.cdi_devices);
        for name in &wiring.cdi_devices {
            assert!(listed.lists(name), "no CDI spec in {dirs:?} defines {name}");
        }
    }
}
