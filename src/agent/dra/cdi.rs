//! CDI specs for prepared claims: one file per claim in the CDI directory the
//! container runtime reads (`/var/run/cdi`), holding one CDI device per
//! request of the claim with what a container needs for that request's
//! devices (environment variables, device nodes and read-only mounts, from
//! the backend layer).
//! Kubelet passes the CDI device IDs to the runtime, which applies the edits
//! when it creates the container.
//!
//! A file is written under a temporary name and renamed into place, so the
//! runtime never reads half a spec.

use std::io::ErrorKind;
use std::path::PathBuf;

use serde::Serialize;

use crate::backend::container::ContainerWiring;
use crate::process::state_file::write_atomically;

/// The CDI spec version: the oldest that takes everything written here (a
/// kind whose vendor has dots, like `gpu.tessera.dev`, needs 0.5.0: the CDI
/// library in containerd 1.7 refuses the spec as 0.3.0), so older runtimes
/// read it too.
const CDI_VERSION: &str = "0.5.0";
/// The CDI device class of a claim's devices (`<driver>/claim`).
const CLASS: &str = "claim";
/// A host file given read-only: a bind mount the container cannot write
/// through, run set-uid programs from or open device files through.
const READ_ONLY_BIND: [&str; 4] = ["ro", "nosuid", "nodev", "bind"];

/// The CDI directory and the driver whose specs live in it.
#[derive(Clone, Debug)]
pub(crate) struct CdiDir {
    pub(crate) dir: PathBuf,
    pub(crate) driver: String,
}

/// One CDI device of a claim: its name (unique within the driver's kind)
/// and what it gives a container.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct CdiDevice {
    pub(crate) name: String,
    pub(crate) wiring: ContainerWiring,
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct Spec<'a> {
    cdi_version: &'a str,
    kind: String,
    devices: Vec<SpecDevice>,
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct SpecDevice {
    name: String,
    container_edits: ContainerEdits,
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct ContainerEdits {
    #[serde(skip_serializing_if = "Vec::is_empty")]
    env: Vec<String>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    device_nodes: Vec<DeviceNode>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    mounts: Vec<Mount>,
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct Mount {
    host_path: String,
    container_path: String,
    options: [&'static str; 4],
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct DeviceNode {
    path: String,
    host_path: String,
    permissions: String,
}

impl CdiDir {
    /// `<driver>/claim`.
    fn kind(&self) -> String {
        format!("{}/{CLASS}", self.driver)
    }

    /// The fully qualified ID kubelet hands the runtime for `device`.
    pub(crate) fn qualified_id(&self, device: &str) -> String {
        format!("{}={device}", self.kind())
    }

    /// `<dir>/<driver>-claim_<claim uid>.json`.
    pub(crate) fn spec_path(&self, claim_uid: &str) -> PathBuf {
        self.dir
            .join(format!("{}-{CLASS}_{claim_uid}.json", self.driver))
    }

    /// Writes (or rewrites) the claim's spec.
    pub(crate) fn write(&self, claim_uid: &str, devices: &[CdiDevice]) -> std::io::Result<()> {
        let spec = Spec {
            cdi_version: CDI_VERSION,
            kind: self.kind(),
            devices: devices.iter().map(spec_device).collect(),
        };
        let bytes = serde_json::to_vec_pretty(&spec).map_err(std::io::Error::other)?;
        std::fs::create_dir_all(&self.dir)?;
        let path = self.spec_path(claim_uid);
        write_atomically(&path, &bytes, true)
    }

    /// Removes the claim's spec; a spec already gone is fine.
    pub(crate) fn remove(&self, claim_uid: &str) -> std::io::Result<()> {
        match std::fs::remove_file(self.spec_path(claim_uid)) {
            Err(e) if e.kind() != ErrorKind::NotFound => Err(e),
            _ => Ok(()),
        }
    }

    /// Whether the claim's spec is there.
    pub(crate) fn exists(&self, claim_uid: &str) -> bool {
        self.spec_path(claim_uid).is_file()
    }
}

fn spec_device(device: &CdiDevice) -> SpecDevice {
    let env = device
        .wiring
        .envs
        .iter()
        .map(|(key, value)| format!("{key}={value}"))
        .collect();
    let device_nodes = device
        .wiring
        .device_nodes
        .iter()
        .map(|node| DeviceNode {
            path: node.container_path.clone(),
            host_path: node.host_path.clone(),
            permissions: node.permissions.clone(),
        })
        .collect();
    let mounts = device
        .wiring
        .mounts
        .iter()
        .map(|mount| Mount {
            host_path: mount.host_path.clone(),
            container_path: mount.container_path.clone(),
            options: READ_ONLY_BIND,
        })
        .collect();
    SpecDevice {
        name: device.name.clone(),
        container_edits: ContainerEdits {
            env,
            device_nodes,
            mounts,
        },
    }
}

/// The CDI device name for a claim's request: `<claim uid>-<request>`, the
/// request name's `/` (a subrequest) as `-`, as CDI names allow.
pub(crate) fn device_name(claim_uid: &str, request: &str) -> String {
    let request: String = request
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || "_.-".contains(c) {
                c
            } else {
                '-'
            }
        })
        .collect();
    format!("{claim_uid}-{request}")
}

/// The env of `wiring`, for tests reading a spec back.
#[cfg(test)]
pub(crate) fn read_env(
    path: &std::path::Path,
) -> std::collections::BTreeMap<String, std::collections::BTreeMap<String, String>> {
    let text = std::fs::read_to_string(path).unwrap();
    let spec: serde_json::Value = serde_json::from_str(&text).unwrap();
    let mut out = std::collections::BTreeMap::new();
    for device in spec["devices"].as_array().unwrap() {
        let env = device["containerEdits"]["env"]
            .as_array()
            .map(|env| {
                env.iter()
                    .filter_map(|e| e.as_str()?.split_once('='))
                    .map(|(k, v)| (k.to_string(), v.to_string()))
                    .collect()
            })
            .unwrap_or_default();
        out.insert(device["name"].as_str().unwrap().to_string(), env);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dir() -> (tempfile::TempDir, CdiDir) {
        let tmp = tempfile::tempdir().unwrap();
        let cdi = CdiDir {
            dir: tmp.path().join("cdi"),
            driver: "gpu.tessera.dev".into(),
        };
        (tmp, cdi)
    }

    #[test]
    fn a_claim_spec_names_its_kind_devices_env_and_nodes() {
        let (_tmp, cdi) = dir();
        let mut wiring = ContainerWiring::default();
        wiring
            .envs
            .insert("TESSERA_VISIBLE_DEVICES".into(), "a,b".into());
        wiring.add_device_node("/dev/nvidia0");
        wiring.add_read_only_mount(
            "/run/nvidia/driver/usr/lib/x86_64-linux-gnu/libcuda.so.580.95.05",
            "/usr/lib/x86_64-linux-gnu/libcuda.so.1",
        );
        let name = device_name("uid-1", "gpus");
        cdi.write(
            "uid-1",
            &[CdiDevice {
                name: name.clone(),
                wiring,
            }],
        )
        .unwrap();
        let path = cdi.spec_path("uid-1");
        assert!(path.ends_with("gpu.tessera.dev-claim_uid-1.json"));
        let spec: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        assert_eq!(spec["cdiVersion"], "0.5.0");
        assert_eq!(spec["kind"], "gpu.tessera.dev/claim");
        assert_eq!(spec["devices"][0]["name"], "uid-1-gpus");
        assert_eq!(
            spec["devices"][0]["containerEdits"]["env"][0],
            "TESSERA_VISIBLE_DEVICES=a,b"
        );
        let node = &spec["devices"][0]["containerEdits"]["deviceNodes"][0];
        assert_eq!(
            (node["path"].as_str(), node["hostPath"].as_str()),
            (Some("/dev/nvidia0"), Some("/dev/nvidia0"))
        );
        assert_eq!(
            spec["devices"][0]["containerEdits"]["mounts"],
            serde_json::json!([{
                "hostPath": "/run/nvidia/driver/usr/lib/x86_64-linux-gnu/libcuda.so.580.95.05",
                "containerPath": "/usr/lib/x86_64-linux-gnu/libcuda.so.1",
                "options": ["ro", "nosuid", "nodev", "bind"]
            }])
        );
        assert_eq!(cdi.qualified_id(&name), "gpu.tessera.dev/claim=uid-1-gpus");
        // No temporary file is left for the runtime to trip over.
        let names: Vec<_> = std::fs::read_dir(&cdi.dir)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names.len(), 1, "{names:?}");
    }

    #[test]
    fn edits_a_device_lacks_are_left_out() {
        let (_tmp, cdi) = dir();
        cdi.write(
            "u",
            &[CdiDevice {
                name: "u-gpus".into(),
                wiring: ContainerWiring::default(),
            }],
        )
        .unwrap();
        let spec: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(cdi.spec_path("u")).unwrap()).unwrap();
        assert_eq!(spec["devices"][0]["containerEdits"], serde_json::json!({}));
    }

    #[test]
    fn removing_is_idempotent() {
        let (_tmp, cdi) = dir();
        cdi.write("u", &[]).unwrap();
        assert!(cdi.exists("u"));
        cdi.remove("u").unwrap();
        cdi.remove("u").unwrap();
        assert!(!cdi.exists("u"));
    }

    #[test]
    fn subrequest_names_become_cdi_names() {
        assert_eq!(device_name("u", "gpus/large"), "u-gpus-large");
    }
}
