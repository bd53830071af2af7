//! The node's device registry: the last discovery (and probe results) kept on
//! disk, so a restarted agent keeps every device's ID — even for a device that
//! can no longer tell its UUID — and does not repeat a slow probe for devices it
//! has measured before. A corrupt or unreadable registry is ignored with a
//! warning: it is a cache, never a reason not to start. A corrupt one (or one
//! of another version) is kept at `<file>.bad` first, so the next save does
//! not destroy it.

use std::path::Path;

use serde::{Deserialize, Serialize};

use super::{DeviceInfo, Snapshot};
use crate::process::state_file::{set_aside_text, write_atomically};

/// Where the node agent keeps its registry (a hostPath in the chart).
pub const DEFAULT_PATH: &str = "/var/lib/tessera/registry.json";

const VERSION: u32 = 1;

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Registry {
    pub(crate) version: u32,
    pub(crate) devices: Vec<DeviceInfo>,
    /// The last probe results (see `cuda_probe`), as written by the prober.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) probe: Option<serde_json::Value>,
    /// IDs of the devices the probe measured.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub(crate) probed_devices: Vec<String>,
}

impl Registry {
    pub(crate) fn new(devices: Vec<DeviceInfo>) -> Self {
        Self {
            version: VERSION,
            devices,
            probe: None,
            probed_devices: Vec::new(),
        }
    }

    /// Reads the registry; any problem gives `None` and a warning.
    pub(crate) fn load(path: &Path) -> Option<Self> {
        let text = match std::fs::read_to_string(path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return None,
            Err(e) => {
                tracing::warn!(path = %path.display(), error = %e, "device registry unreadable; ignoring it");
                return None;
            }
        };
        match serde_json::from_str::<Registry>(&text) {
            Ok(r) if r.version == VERSION => Some(r),
            Ok(r) => {
                let kept = set_aside_text(path);
                tracing::warn!(path = %path.display(), version = r.version, "device registry has another version; ignoring it ({kept})");
                None
            }
            Err(e) => {
                let kept = set_aside_text(path);
                tracing::warn!(path = %path.display(), error = %e, "device registry is corrupt; ignoring it ({kept})");
                None
            }
        }
    }

    /// Writes atomically (temp file + rename) so a crash never leaves half a file.
    pub(crate) fn save(&self, path: &Path) -> std::io::Result<()> {
        let text = serde_json::to_string_pretty(self).map_err(std::io::Error::other)?;
        write_atomically(path, text.as_bytes(), false)
    }

    /// Gives devices the IDs they had before when they now report no proper
    /// ID (a backend falls back to a positional ID when a lost GPU cannot tell
    /// its UUID), so kubelet, the allocation checkpoint and the controller's
    /// plans keep naming the same device across agent restarts. A device is
    /// recognised by its PCI address, or — when it has none (NVML cannot read
    /// it from a lost GPU) and the node has as many devices as the registry —
    /// by its index. An ID another device of the node has is never given out.
    /// Returns the renames, `(fallback ID, stable ID)`.
    pub(crate) fn stabilize_ids(
        &self,
        devices: &mut [DeviceInfo],
        is_fallback_id: impl Fn(&str) -> bool,
    ) -> Vec<(String, String)> {
        let same_count = self.devices.len() == devices.len();
        let mut taken: std::collections::HashSet<String> =
            devices.iter().map(|d| d.id.clone()).collect();
        let mut renames = Vec::new();
        for device in devices.iter_mut() {
            if !is_fallback_id(&device.id) {
                continue;
            }
            let known = if device.pci_bus_id.is_empty() {
                same_count
                    .then(|| self.devices.iter().find(|k| k.index == device.index))
                    .flatten()
            } else {
                self.devices
                    .iter()
                    .find(|k| k.pci_bus_id == device.pci_bus_id)
            };
            let Some(known) = known else { continue };
            if known.id == device.id || is_fallback_id(&known.id) || taken.contains(&known.id) {
                continue;
            }
            taken.insert(known.id.clone());
            renames.push((
                std::mem::replace(&mut device.id, known.id.clone()),
                known.id.clone(),
            ));
        }
        renames
    }

    /// [`Registry::stabilize_ids`] on a snapshot: its devices and the ends of
    /// its links.
    pub(crate) fn stabilize_snapshot(
        &self,
        snap: &mut Snapshot,
        is_fallback_id: impl Fn(&str) -> bool,
    ) {
        let mut infos: Vec<DeviceInfo> = snap.devices.iter().map(|d| d.info.clone()).collect();
        let renames = self.stabilize_ids(&mut infos, is_fallback_id);
        if renames.is_empty() {
            return;
        }
        for (device, info) in snap.devices.iter_mut().zip(infos) {
            device.info = info;
        }
        let renamed = |id: &mut String| {
            if let Some((_, new)) = renames.iter().find(|(old, _)| old == id) {
                *id = new.clone();
            }
        };
        for link in &mut snap.links {
            renamed(&mut link.a);
            renamed(&mut link.b);
        }
    }

    /// The cached probe results when they cover exactly these devices.
    pub(crate) fn probe_for(&self, devices: &[DeviceInfo]) -> Option<&serde_json::Value> {
        let mut want: Vec<&str> = devices.iter().map(|d| d.id.as_str()).collect();
        let mut have: Vec<&str> = self.probed_devices.iter().map(String::as_str).collect();
        want.sort_unstable();
        have.sort_unstable();
        (want == have).then_some(self.probe.as_ref()).flatten()
    }
}

#[cfg(test)]
mod tests {
    use super::super::{GpuBackend, fake::FakeBackend};
    use super::*;
    use std::path::PathBuf;

    fn dir(name: &str) -> PathBuf {
        let d =
            std::env::temp_dir().join(format!("tessera-registry-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        d
    }

    fn devices() -> Vec<DeviceInfo> {
        FakeBackend::new("2xH100-80GiB").unwrap().devices().unwrap()
    }

    #[test]
    fn round_trip_and_probe_cache() {
        let d = dir("rt");
        let path = d.join("sub/registry.json");
        let mut r = Registry::new(devices());
        r.probe = Some(serde_json::json!({"p2p": true}));
        r.probed_devices = r.devices.iter().map(|d| d.id.clone()).collect();
        r.save(&path).unwrap();
        let back = Registry::load(&path).unwrap();
        assert_eq!(back, r);
        assert!(back.probe_for(&devices()).is_some());
        assert!(
            back.probe_for(&devices()[..1]).is_none(),
            "different devices: probe again"
        );
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn corrupt_or_foreign_registries_are_ignored() {
        let d = dir("bad");
        std::fs::create_dir_all(&d).unwrap();
        for (i, text) in ["{", "[]", "{\"version\": 9, \"devices\": []}", ""]
            .iter()
            .enumerate()
        {
            let p = d.join(format!("r{i}.json"));
            std::fs::write(&p, text).unwrap();
            assert_eq!(Registry::load(&p), None, "{text}");
        }
        // Each one unreadable as a registry was kept aside, as it was.
        for (i, text) in ["{", "[]", "{\"version\": 9, \"devices\": []}", ""]
            .iter()
            .enumerate()
        {
            let aside = d.join(format!("r{i}.json.bad"));
            assert_eq!(std::fs::read_to_string(&aside).unwrap(), *text);
            assert!(!d.join(format!("r{i}.json")).exists());
        }
        assert_eq!(Registry::load(&d.join("missing.json")), None);
        // A directory where the file should be: unreadable, still not fatal.
        assert_eq!(Registry::load(&d), None);
        std::fs::remove_dir_all(&d).unwrap();
    }

    fn fallback(id: &str) -> bool {
        id.starts_with("index-")
    }

    #[test]
    fn lost_devices_keep_their_ids() {
        let r = Registry::new(devices());
        let mut now = devices();
        now[1].id = "index-1".into();
        let renames = r.stabilize_ids(&mut now, fallback);
        assert_eq!(now[1].id, r.devices[1].id);
        assert_eq!(renames, [("index-1".to_string(), r.devices[1].id.clone())]);
    }

    #[test]
    fn a_device_without_a_pci_address_is_matched_by_index_only_when_the_count_agrees() {
        let r = Registry::new(devices());
        let mut now = devices();
        now[1].id = "index-1".into();
        now[1].pci_bus_id.clear();
        r.stabilize_ids(&mut now, fallback);
        assert_eq!(now[1].id, r.devices[1].id);

        // One device fewer: positions may have moved, so nothing is guessed.
        let mut fewer = devices()[1..].to_vec();
        fewer[0].index = 0;
        fewer[0].id = "index-0".into();
        fewer[0].pci_bus_id.clear();
        assert!(r.stabilize_ids(&mut fewer, fallback).is_empty());
        assert_eq!(fewer[0].id, "index-0");
    }

    #[test]
    fn an_id_already_on_the_node_is_never_given_twice() {
        let r = Registry::new(devices());
        let mut now = devices();
        // Device 1 reports device 0's old PCI address (e.g. moved slots) while
        // device 0 still has its UUID.
        now[1].id = "index-1".into();
        now[1].pci_bus_id = r.devices[0].pci_bus_id.clone();
        assert!(r.stabilize_ids(&mut now, fallback).is_empty());
        assert_eq!(now[1].id, "index-1");
        // A registry that itself recorded a fallback ID teaches nothing.
        let mut old = devices();
        old[1].id = "index-1".into();
        let r = Registry::new(old);
        let mut now = devices();
        now[1].id = "index-1".into();
        assert!(r.stabilize_ids(&mut now, fallback).is_empty());
    }

    #[test]
    fn a_snapshot_gets_stable_ids_on_devices_and_links() {
        let r = Registry::new(devices());
        let mut fake = FakeBackend::new("2xH100-80GiB").unwrap();
        let mut snap = super::super::snapshot(&mut fake).unwrap();
        let stable = snap.devices[1].info.id.clone();
        snap.devices[1].info.id = "index-1".into();
        for l in &mut snap.links {
            if l.b == stable {
                l.b = "index-1".into();
            }
        }
        r.stabilize_snapshot(&mut snap, fallback);
        assert_eq!(snap.devices[1].info.id, stable);
        assert!(
            snap.links
                .iter()
                .all(|l| l.a != "index-1" && l.b != "index-1")
        );
        snap.to_gpu_state(None).validate().unwrap();
    }
}
