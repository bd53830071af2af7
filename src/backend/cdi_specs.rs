//! Which CDI devices the node's CDI specs define: the `kind` and device
//! `name`s of every `*.json` and `*.yaml` file in the spec directories the
//! container runtime reads (`/etc/cdi`, `/var/run/cdi`), as fully qualified
//! names (`nvidia.com/gpu=GPU-…`). A vendor's CDI device is handed to a
//! container only where a spec really defines it: a name no spec defines
//! makes the runtime refuse to create the container.
//!
//! Read afresh each time it is asked (a claim is prepared rarely, and a
//! vendor's tool may rewrite its spec after a driver upgrade). A spec that
//! cannot be read or parsed is skipped with a warning, never fatal.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use serde::Deserialize;

/// Larger files are not CDI specs worth reading (a vendor's spec for eight
/// GPUs with every driver library is tens of KiB).
const MAX_SPEC_BYTES: u64 = 4 << 20;

/// The fully qualified CDI device names the node's specs define.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct ListedCdiDevices {
    names: BTreeSet<String>,
}

/// The part of a CDI spec that names its devices; the edits are the
/// runtime's business.
#[derive(Deserialize)]
struct SpecNames {
    kind: String,
    #[serde(default)]
    devices: Vec<DeviceName>,
}

#[derive(Deserialize)]
struct DeviceName {
    name: String,
}

impl ListedCdiDevices {
    /// The devices defined by the specs in `dirs` (a directory that does not
    /// exist defines none).
    pub(crate) fn read(dirs: &[PathBuf]) -> Self {
        let mut listed = Self::default();
        for dir in dirs {
            let entries = match std::fs::read_dir(dir) {
                Ok(entries) => entries,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                Err(e) => {
                    tracing::warn!(dir = %dir.display(), error = %e, "cannot read the CDI spec directory; its specs are ignored");
                    continue;
                }
            };
            let mut paths: Vec<PathBuf> = entries
                .filter_map(|entry| entry.ok().map(|entry| entry.path()))
                .filter(|path| is_spec_file(path))
                .collect();
            paths.sort();
            for path in paths {
                match read_spec(&path) {
                    Ok(spec) => listed.add(&spec),
                    Err(error) => {
                        tracing::warn!(spec = %path.display(), %error, "CDI spec ignored");
                    }
                }
            }
        }
        listed
    }

    /// Whether a spec defines `qualified` (`vendor.com/class=name`).
    pub(crate) fn lists(&self, qualified: &str) -> bool {
        self.names.contains(qualified)
    }

    fn add(&mut self, spec: &SpecNames) {
        for device in &spec.devices {
            self.names.insert(format!("{}={}", spec.kind, device.name));
        }
    }

    /// Stands in for specs on disk.
    #[cfg(test)]
    pub(crate) fn of(names: &[&str]) -> Self {
        Self {
            names: names.iter().map(|name| name.to_string()).collect(),
        }
    }
}

/// The extensions the CDI library reads specs from; anything else (our own
/// `.tmp` files mid-write included) is not a spec.
fn is_spec_file(path: &Path) -> bool {
    matches!(
        path.extension().and_then(|ext| ext.to_str()),
        Some("json" | "yaml")
    ) && path.is_file()
}

fn read_spec(path: &Path) -> Result<SpecNames, String> {
    let size = std::fs::metadata(path).map_err(|e| e.to_string())?.len();
    if size > MAX_SPEC_BYTES {
        return Err(format!(
            "{size} bytes, more than the {MAX_SPEC_BYTES} a CDI spec is read up to"
        ));
    }
    let text = std::fs::read_to_string(path).map_err(|e| e.to_string())?;
    let spec: SpecNames = if path.extension().is_some_and(|ext| ext == "json") {
        serde_json::from_str(&text).map_err(|e| format!("not a CDI spec: {e}"))?
    } else {
        serde_saphyr::from_str(&text).map_err(|e| format!("not a CDI spec: {}", first_line(&e)))?
    };
    Ok(spec)
}

/// serde-saphyr's errors quote the offending text over several lines; a
/// log line takes the first.
fn first_line(error: &impl std::fmt::Display) -> String {
    let text = error.to_string();
    let line = text.lines().next().unwrap_or("malformed YAML");
    line.strip_prefix("error: ").unwrap_or(line).to_string()
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A spec shaped as `nvidia-ctk cdi generate` writes it (devices named by
    /// index and UUID, plus `all`; common edits with hooks and mounts), cut
    /// down to one of each.
    pub(crate) fn toolkit_spec(uuid: &str) -> String {
        format!(
            r#"---
cdiVersion: 0.5.0
kind: nvidia.com/gpu
devices:
    - name: "0"
      containerEdits:
        deviceNodes:
            - path: /dev/nvidia0
    - name: {uuid}
      containerEdits:
        deviceNodes:
            - path: /dev/nvidia0
    - name: all
      containerEdits:
        deviceNodes:
            - path: /dev/nvidia0
containerEdits:
    env:
        - NVIDIA_VISIBLE_DEVICES=void
    hooks:
        - hookName: createContainer
          path: /usr/bin/nvidia-cdi-hook
          args:
            - nvidia-cdi-hook
            - update-ldcache
            - --folder
            - /usr/lib/x86_64-linux-gnu
          env:
            - NVIDIA_CTK_DEBUG=false
    mounts:
        - hostPath: /usr/lib/x86_64-linux-gnu/libcuda.so.580.95.05
          containerPath: /usr/lib/x86_64-linux-gnu/libcuda.so.580.95.05
          options: [ro, nosuid, nodev, bind]
"#
        )
    }

    #[test]
    fn yaml_and_json_specs_in_every_directory_are_read() {
        let tmp = tempfile::tempdir().unwrap();
        let etc = tmp.path().join("etc-cdi");
        let run = tmp.path().join("run-cdi");
        std::fs::create_dir_all(&etc).unwrap();
        std::fs::create_dir_all(&run).unwrap();
        std::fs::write(etc.join("nvidia.yaml"), toolkit_spec("GPU-aaaa")).unwrap();
        std::fs::write(
            run.join("amd.json"),
            r#"{"cdiVersion":"0.6.0","kind":"amd.com/gpu","devices":[{"name":"1","containerEdits":{}}]}"#,
        )
        .unwrap();
        // Not specs: the CDI library reads neither.
        std::fs::write(run.join("other.yml"), toolkit_spec("GPU-bbbb")).unwrap();
        std::fs::write(run.join("x.json.tmp"), "{").unwrap();
        let listed = ListedCdiDevices::read(&[etc, run, tmp.path().join("missing")]);
        for name in [
            "nvidia.com/gpu=0",
            "nvidia.com/gpu=GPU-aaaa",
            "nvidia.com/gpu=all",
            "amd.com/gpu=1",
        ] {
            assert!(listed.lists(name), "{name}");
        }
        assert!(!listed.lists("nvidia.com/gpu=GPU-bbbb"));
        assert_eq!(listed.names.len(), 4);
    }

    #[test]
    fn a_malformed_or_oversized_spec_is_skipped_and_the_others_still_count() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().to_path_buf();
        std::fs::write(dir.join("broken.yaml"), "kind: [nvidia.com/gpu\ndevices: {").unwrap();
        std::fs::write(dir.join("nokind.json"), r#"{"devices":[{"name":"0"}]}"#).unwrap();
        std::fs::write(dir.join("binary.json"), [0xff, 0xfe, 0x00]).unwrap();
        let huge = std::fs::File::create(dir.join("huge.yaml")).unwrap();
        huge.set_len(MAX_SPEC_BYTES + 1).unwrap();
        std::fs::write(dir.join("nvidia.yaml"), toolkit_spec("GPU-aaaa")).unwrap();
        let listed = ListedCdiDevices::read(std::slice::from_ref(&dir));
        assert!(listed.lists("nvidia.com/gpu=GPU-aaaa"));
        assert_eq!(listed.names.len(), 3);
        assert!(read_spec(&dir.join("broken.yaml")).is_err());
        assert!(
            read_spec(&dir.join("huge.yaml"))
                .err()
                .is_some_and(|e| e.contains("more than"))
        );
    }

    #[test]
    fn a_directory_that_cannot_be_read_lists_nothing() {
        let tmp = tempfile::tempdir().unwrap();
        let file = tmp.path().join("not-a-dir");
        std::fs::write(&file, "").unwrap();
        assert_eq!(ListedCdiDevices::read(&[file]), ListedCdiDevices::default());
    }
}
