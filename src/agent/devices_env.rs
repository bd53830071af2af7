//! What a container needs to use the devices it was given: the answer to one
//! container's `Allocate` request, per vendor runtime.
//!
//! Always: `TESSERA_VISIBLE_DEVICES` = the device IDs, comma-separated, in the
//! order kubelet asked for them.
//!
//! **NVIDIA**: `NVIDIA_VISIBLE_DEVICES` = the GPU UUIDs (the device IDs of the
//! NVML backend; a device whose UUID could not be read, `nvml-index-<i>`, is
//! named by its index, which the NVIDIA container runtime also accepts), and
//! the device nodes `/dev/nvidiactl`, `/dev/nvidia-uvm`, `/dev/nvidia-uvm-tools`
//! and `/dev/nvidia<minor>` per GPU. The minor is read from the driver
//! (`/proc/driver/nvidia/gpus/<PCI bus id>/information`, line `Device Minor:`);
//! when that is not readable it is assumed to equal the NVML index, which is
//! how the driver numbers GPUs unless a node has been reconfigured.
//!
//! **AMD**: `/dev/kfd` and the GPU's render node `/dev/dri/renderD<N>` (plus
//! `/dev/dri/card<M>` when known), with N and M read from sysfs
//! (`/sys/bus/pci/devices/<PCI bus id>/drm/`); when sysfs has no answer N is
//! assumed to be 128 + index (the DRM numbering of render nodes when every
//! card is a GPU in PCI order). `ROCR_VISIBLE_DEVICES` names the GPUs by UUID
//! (`GPU-<16 hex digits of the ASIC unique id>`, as `rocminfo` shows it)
//! rather than by index, because inside the container ROCm numbers only the
//! GPUs it can open, so host indices would point at the wrong devices. A GPU
//! without a unique id (its device ID is then a PCI bus id) has no UUID; the
//! variable is then left out and the render nodes alone decide what the
//! container sees.
//!
//! **Fake devices** (the `fake` backend) exist only on paper: they get
//! `TESSERA_VISIBLE_DEVICES` and nothing else, so containers start on nodes
//! without GPUs.
//!
//! With `cdi` on, the devices are also named for a CDI-enabled runtime:
//! `nvidia.com/gpu=<UUID>` and `amd.com/gpu=<index>`.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use super::kubelet_api::v1beta1::{CdiDevice, ContainerAllocateResponse, DeviceSpec};
use crate::api::Vendor;
use crate::backend::DeviceInfo;
use crate::backend::nvml::is_fallback_id;

/// The backend name of fake devices.
pub const FAKE_BACKEND: &str = "fake";

pub const TESSERA_VISIBLE_DEVICES: &str = "TESSERA_VISIBLE_DEVICES";
pub const NVIDIA_VISIBLE_DEVICES: &str = "NVIDIA_VISIBLE_DEVICES";
pub const ROCR_VISIBLE_DEVICES: &str = "ROCR_VISIBLE_DEVICES";

/// Device node permissions handed to containers: read and write.
const PERMISSIONS: &str = "rw";

#[derive(Clone, Debug, PartialEq)]
pub struct RuntimeOptions {
    /// Also name the devices as CDI devices.
    pub cdi: bool,
    /// Where the host's sysfs is mounted (AMD render nodes).
    pub sysfs_root: PathBuf,
    /// Where the host's procfs is mounted (NVIDIA device minors).
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
    let mut out = Response::default();
    let ids: Vec<&str> = devices.iter().map(|d| d.id.as_str()).collect();
    out.envs
        .insert(TESSERA_VISIBLE_DEVICES.to_string(), ids.join(","));
    if backend != FAKE_BACKEND {
        let nvidia: Vec<&DeviceInfo> = by_vendor(devices, Vendor::Nvidia);
        if !nvidia.is_empty() {
            nvidia_runtime(&nvidia, options, &mut out);
        }
        let amd: Vec<&DeviceInfo> = by_vendor(devices, Vendor::Amd);
        if !amd.is_empty() {
            amd_runtime(&amd, options, &mut out);
        }
    }
    ContainerAllocateResponse {
        envs: out.envs,
        mounts: Vec::new(),
        devices: out.devices,
        annotations: HashMap::new(),
        cdi_devices: out.cdi.into_iter().map(|name| CdiDevice { name }).collect(),
    }
}

#[derive(Default)]
struct Response {
    envs: HashMap<String, String>,
    devices: Vec<DeviceSpec>,
    cdi: Vec<String>,
}

impl Response {
    fn node(&mut self, path: &str) {
        if !self.devices.iter().any(|d| d.host_path == path) {
            self.devices.push(DeviceSpec {
                container_path: path.to_string(),
                host_path: path.to_string(),
                permissions: PERMISSIONS.to_string(),
            });
        }
    }
}

fn by_vendor<'a>(devices: &[&'a DeviceInfo], vendor: Vendor) -> Vec<&'a DeviceInfo> {
    devices
        .iter()
        .copied()
        .filter(|d| d.vendor == vendor)
        .collect()
}

fn nvidia_runtime(devices: &[&DeviceInfo], options: &RuntimeOptions, out: &mut Response) {
    let names: Vec<String> = devices
        .iter()
        .map(|d| {
            if is_fallback_id(&d.id) {
                d.index.to_string()
            } else {
                d.id.clone()
            }
        })
        .collect();
    out.envs
        .insert(NVIDIA_VISIBLE_DEVICES.to_string(), names.join(","));
    for path in ["/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"] {
        out.node(path);
    }
    for d in devices {
        let minor = nvidia_minor(&options.procfs_root, &d.pci_bus_id).unwrap_or(d.index);
        out.node(&format!("/dev/nvidia{minor}"));
    }
    if options.cdi {
        out.cdi
            .extend(names.iter().map(|n| format!("nvidia.com/gpu={n}")));
    }
}

/// `Device Minor:` from `<procfs>/driver/nvidia/gpus/<PCI bus id>/information`.
pub fn nvidia_minor(procfs_root: &Path, pci_bus_id: &str) -> Option<u32> {
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

fn amd_runtime(devices: &[&DeviceInfo], options: &RuntimeOptions, out: &mut Response) {
    out.node("/dev/kfd");
    for d in devices {
        let nodes = drm_nodes(&options.sysfs_root, &d.pci_bus_id);
        let render = nodes.render.unwrap_or(128 + d.index);
        out.node(&format!("/dev/dri/renderD{render}"));
        if let Some(card) = nodes.card {
            out.node(&format!("/dev/dri/card{card}"));
        }
    }
    let uuids: Option<Vec<String>> = devices.iter().map(|d| amd_uuid(&d.id)).collect();
    if let Some(uuids) = uuids {
        out.envs
            .insert(ROCR_VISIBLE_DEVICES.to_string(), uuids.join(","));
    }
    if options.cdi {
        out.cdi
            .extend(devices.iter().map(|d| format!("amd.com/gpu={}", d.index)));
    }
}

/// `GPU-<16 hex digits>` from an AMD device ID that is a unique id (`0x…`).
pub fn amd_uuid(id: &str) -> Option<String> {
    let hex = id.strip_prefix("0x")?;
    let value = u64::from_str_radix(hex, 16).ok()?;
    Some(format!("GPU-{value:016x}"))
}

#[derive(Debug, Default, PartialEq)]
pub struct DrmNodes {
    pub render: Option<u32>,
    pub card: Option<u32>,
}

/// The DRM nodes of a PCI device from `<sysfs>/bus/pci/devices/<id>/drm/`
/// (entries `renderD<N>` and `card<M>`).
pub fn drm_nodes(sysfs_root: &Path, pci_bus_id: &str) -> DrmNodes {
    let mut nodes = DrmNodes::default();
    if pci_bus_id.is_empty() {
        return nodes;
    }
    let dir = sysfs_root
        .join("bus/pci/devices")
        .join(pci_bus_id.to_ascii_lowercase())
        .join("drm");
    let Ok(entries) = std::fs::read_dir(dir) else {
        return nodes;
    };
    let mut names: Vec<String> = entries
        .filter_map(|e| e.ok())
        .filter_map(|e| e.file_name().into_string().ok())
        .collect();
    names.sort();
    for name in names {
        if let Some(n) = name.strip_prefix("renderD").and_then(|n| n.parse().ok()) {
            nodes.render.get_or_insert(n);
        } else if let Some(n) = name.strip_prefix("card").and_then(|n| n.parse().ok()) {
            nodes.card.get_or_insert(n);
        }
    }
    nodes
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info(id: &str, index: u32, vendor: Vendor, pci: &str) -> DeviceInfo {
        DeviceInfo {
            id: id.to_string(),
            index,
            vendor,
            product: "test".into(),
            memory_total_bytes: 1 << 30,
            architecture: String::new(),
            compute_units: 1,
            fp16_tflops: 1.0,
            memory_bandwidth_gbps: 1.0,
            pci_bus_id: pci.to_string(),
            numa_node: None,
        }
    }

    fn nowhere() -> RuntimeOptions {
        RuntimeOptions {
            cdi: false,
            sysfs_root: PathBuf::from("/nonexistent/sys"),
            procfs_root: PathBuf::from("/nonexistent/proc"),
        }
    }

    fn paths(r: &ContainerAllocateResponse) -> Vec<&str> {
        r.devices.iter().map(|d| d.host_path.as_str()).collect()
    }

    fn temp(name: &str) -> PathBuf {
        let dir =
            std::env::temp_dir().join(format!("tessera-devices-env-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn nvidia_gets_uuids_and_device_nodes() {
        let a = info("GPU-aaaa", 2, Vendor::Nvidia, "0000:17:00.0");
        let b = info("nvml-index-5", 5, Vendor::Nvidia, "0000:18:00.0");
        let r = container_response("nvml", &[&a, &b], &nowhere());
        assert_eq!(r.envs[TESSERA_VISIBLE_DEVICES], "GPU-aaaa,nvml-index-5");
        assert_eq!(r.envs[NVIDIA_VISIBLE_DEVICES], "GPU-aaaa,5");
        assert!(!r.envs.contains_key(ROCR_VISIBLE_DEVICES));
        assert_eq!(
            paths(&r),
            [
                "/dev/nvidiactl",
                "/dev/nvidia-uvm",
                "/dev/nvidia-uvm-tools",
                "/dev/nvidia2",
                "/dev/nvidia5"
            ]
        );
        assert!(
            r.devices
                .iter()
                .all(|d| d.permissions == "rw" && d.container_path == d.host_path)
        );
        assert!(r.cdi_devices.is_empty());
    }

    #[test]
    fn nvidia_minor_comes_from_the_driver_when_readable() {
        let proc = temp("proc");
        let gpu = proc.join("driver/nvidia/gpus/0000:17:00.0");
        std::fs::create_dir_all(&gpu).unwrap();
        std::fs::write(
            gpu.join("information"),
            "Model: \t\t NVIDIA H100\nIRQ:   \t\t 42\nDevice Minor: \t 7\nBus Location: \t 0000:17:00.0\n",
        )
        .unwrap();
        let options = RuntimeOptions {
            procfs_root: proc.clone(),
            ..nowhere()
        };
        let a = info("GPU-aaaa", 0, Vendor::Nvidia, "0000:17:00.0");
        let r = container_response("nvml", &[&a], &options);
        assert_eq!(paths(&r)[3], "/dev/nvidia7");
        std::fs::remove_dir_all(&proc).unwrap();
    }

    #[test]
    fn amd_gets_kfd_render_nodes_and_uuids() {
        let a = info("0x1a2b3c", 0, Vendor::Amd, "0000:c1:00.0");
        let b = info("0xfedcba9876543210", 3, Vendor::Amd, "0000:c2:00.0");
        let r = container_response("amd", &[&a, &b], &nowhere());
        assert_eq!(
            paths(&r),
            ["/dev/kfd", "/dev/dri/renderD128", "/dev/dri/renderD131"]
        );
        assert_eq!(
            r.envs[ROCR_VISIBLE_DEVICES],
            "GPU-00000000001a2b3c,GPU-fedcba9876543210"
        );
        assert!(!r.envs.contains_key(NVIDIA_VISIBLE_DEVICES));

        // A device without a unique id: no UUIDs at all.
        let c = info("0000:c3:00.0", 1, Vendor::Amd, "0000:c3:00.0");
        let r = container_response("amd", &[&a, &c], &nowhere());
        assert!(!r.envs.contains_key(ROCR_VISIBLE_DEVICES));
    }

    #[test]
    fn amd_nodes_come_from_sysfs_when_readable() {
        let sys = temp("sys");
        let drm = sys.join("bus/pci/devices/0000:c1:00.0/drm");
        for name in ["card3", "renderD131"] {
            std::fs::create_dir_all(drm.join(name)).unwrap();
        }
        let options = RuntimeOptions {
            sysfs_root: sys.clone(),
            ..nowhere()
        };
        let a = info("0x1", 0, Vendor::Amd, "0000:c1:00.0");
        let r = container_response("amd", &[&a], &options);
        assert_eq!(
            paths(&r),
            ["/dev/kfd", "/dev/dri/renderD131", "/dev/dri/card3"]
        );
        std::fs::remove_dir_all(&sys).unwrap();
    }

    #[test]
    fn fake_devices_get_only_the_tessera_variable() {
        let a = info("fake-h100-80gib-0", 0, Vendor::Nvidia, "0000:10:00.0");
        let b = info("fake-mi300x-192gib-1", 1, Vendor::Amd, "0000:11:00.0");
        let r = container_response(FAKE_BACKEND, &[&a, &b], &nowhere());
        assert_eq!(r.envs.len(), 1);
        assert_eq!(
            r.envs[TESSERA_VISIBLE_DEVICES],
            "fake-h100-80gib-0,fake-mi300x-192gib-1"
        );
        assert!(r.devices.is_empty() && r.cdi_devices.is_empty() && r.mounts.is_empty());
    }

    #[test]
    fn cdi_names_when_enabled_and_mixed_vendors() {
        let a = info("GPU-aaaa", 0, Vendor::Nvidia, "");
        let b = info("0x2", 1, Vendor::Amd, "");
        let options = RuntimeOptions {
            cdi: true,
            ..nowhere()
        };
        let r = container_response("nvml+amd", &[&a, &b], &options);
        let cdi: Vec<&str> = r.cdi_devices.iter().map(|c| c.name.as_str()).collect();
        assert_eq!(cdi, ["nvidia.com/gpu=GPU-aaaa", "amd.com/gpu=1"]);
        assert_eq!(r.envs[NVIDIA_VISIBLE_DEVICES], "GPU-aaaa");
        assert_eq!(r.envs[ROCR_VISIBLE_DEVICES], "GPU-0000000000000002");
        assert!(paths(&r).contains(&"/dev/kfd") && paths(&r).contains(&"/dev/nvidia0"));
    }

    #[test]
    fn unknown_vendors_get_only_the_tessera_variable() {
        let a = info("x", 0, Vendor::Unknown, "");
        let r = container_response("other", &[&a], &nowhere());
        assert_eq!(r.envs.len(), 1);
        assert!(r.devices.is_empty());
    }
}
