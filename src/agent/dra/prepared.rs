//! The claims this driver prepared, kept in a file beside its socket so they
//! survive an agent restart: kubelet does not prepare a claim twice for a
//! running pod, so after a restart this record is what says which devices
//! are in use, and what a repeated `NodePrepareResources` gets answered.
//!
//! The file is rewritten whole (through a temporary file and a rename) after
//! every change. An unreadable file is moved aside and the record starts
//! empty: the CDI specs stay, unprepare still removes them by claim UID, and
//! a repeated prepare reads the claim again.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::agent::holders::{Holder, Holding};
use crate::process::state_file::{set_aside_text, write_atomically};

/// The file format's version; a file of another version is moved aside.
const VERSION: u32 = 1;

/// One device prepared for a claim, as kubelet was told.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct PreparedDevice {
    pub(crate) request_names: Vec<String>,
    pub(crate) pool: String,
    /// The device's name in the slice.
    pub(crate) device: String,
    /// tessera's device ID (a MIG partition's own).
    pub(crate) id: String,
    pub(crate) cdi_ids: Vec<String>,
    /// Set for a memory share of the device: its bytes. A share holds no
    /// device whole, so it is not among the devices in use.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) memory_share_bytes: Option<u64>,
    /// The allocation result's share ID for a device given to several
    /// claims at once (a memory share): kubelet records it, and its
    /// PodResources API names it, so each tenant is told apart.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) share_id: Option<String>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct PreparedClaim {
    pub(crate) namespace: String,
    pub(crate) name: String,
    /// The UID of the pod the claim was reserved for when it was prepared
    /// (its first pod consumer), if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) pod_uid: Option<String>,
    /// That pod and the shard it runs, from the claim's labels (empty for a
    /// claim prepared by an agent that did not record it).
    #[serde(default)]
    pub(crate) holder: Holder,
    pub(crate) devices: Vec<PreparedDevice>,
}

#[derive(Serialize, Deserialize)]
struct File {
    version: u32,
    /// By claim UID.
    claims: BTreeMap<String, PreparedClaim>,
}

/// The record, and where it is kept (`None`: only in memory).
#[derive(Debug, Default)]
pub(crate) struct PreparedClaims {
    path: Option<PathBuf>,
    claims: BTreeMap<String, PreparedClaim>,
}

impl PreparedClaims {
    /// Reads the record at `path`; a missing file is an empty record.
    pub(crate) fn open(path: PathBuf) -> Self {
        let claims = match std::fs::read(&path) {
            Ok(bytes) => match serde_json::from_slice::<File>(&bytes) {
                Ok(file) if file.version == VERSION => file.claims,
                Ok(file) => set_aside(&path, &format!("version {} is not {VERSION}", file.version)),
                Err(e) => set_aside(&path, &e.to_string()),
            },
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => BTreeMap::new(),
            Err(e) => set_aside(&path, &e.to_string()),
        };
        Self {
            path: Some(path),
            claims,
        }
    }

    pub(crate) fn get(&self, uid: &str) -> Option<&PreparedClaim> {
        self.claims.get(uid)
    }

    /// Every recorded claim, by UID.
    pub(crate) fn claims(&self) -> impl Iterator<Item = (&str, &PreparedClaim)> {
        self.claims.iter().map(|(uid, claim)| (uid.as_str(), claim))
    }

    /// Records a prepared claim and saves the record.
    pub(crate) fn insert(&mut self, uid: &str, claim: PreparedClaim) -> std::io::Result<()> {
        let before = self.claims.insert(uid.to_string(), claim);
        self.save().inspect_err(|_| {
            // Not saved: not prepared, so memory and file agree.
            match &before {
                Some(old) => self.claims.insert(uid.to_string(), old.clone()),
                None => self.claims.remove(uid),
            };
        })
    }

    /// Forgets a claim and saves the record; an unknown claim is fine.
    pub(crate) fn remove(&mut self, uid: &str) -> std::io::Result<()> {
        if self.claims.remove(uid).is_none() {
            return Ok(());
        }
        self.save()
    }

    /// tessera device ID → the UID of the pod whose claim holds it, as the
    /// device plugin reports its allocations (`NodeGpuState::allocated`), or
    /// [`NodeGpuState::UNBOUND_OWNER`] for a claim reserved for no pod.
    ///
    /// [`NodeGpuState::UNBOUND_OWNER`]: tessera_core::api::NodeGpuState::UNBOUND_OWNER
    pub(crate) fn devices_in_use(&self) -> BTreeMap<String, String> {
        self.claims
            .values()
            .flat_map(|claim| {
                let owner = claim
                    .pod_uid
                    .clone()
                    .unwrap_or_else(|| tessera_core::api::NodeGpuState::UNBOUND_OWNER.to_string());
                claim
                    .devices
                    .iter()
                    .filter(|d| d.memory_share_bytes.is_none())
                    .map(move |d| (d.id.clone(), owner.clone()))
            })
            .collect()
    }

    /// Who holds each device, partition and memory share prepared.
    pub(crate) fn holdings(&self) -> Vec<Holding> {
        self.claims
            .values()
            .flat_map(|claim| {
                claim.devices.iter().map(|device| Holding {
                    device: device.id.clone(),
                    memory_share_bytes: device.memory_share_bytes,
                    holder: claim.holder.clone(),
                })
            })
            .collect()
    }

    fn save(&self) -> std::io::Result<()> {
        let Some(path) = &self.path else {
            return Ok(());
        };
        let file = File {
            version: VERSION,
            claims: self.claims.clone(),
        };
        let bytes = serde_json::to_vec_pretty(&file).map_err(std::io::Error::other)?;
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir)?;
        }
        write_atomically(path, &bytes, true)
    }
}

/// Moves an unreadable record to `<path>.bad` (kept for a person to read)
/// and starts empty.
fn set_aside(path: &Path, why: &str) -> BTreeMap<String, PreparedClaim> {
    let kept = set_aside_text(path);
    tracing::warn!(
        path = %path.display(),
        error = why,
        "the record of prepared claims is unreadable ({kept}); starting with none (CDI specs are kept; kubelet's next prepare reads each claim again)"
    );
    BTreeMap::new()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn claim(id: &str) -> PreparedClaim {
        PreparedClaim {
            namespace: "ns".into(),
            name: "c".into(),
            pod_uid: (id == "GPU-A").then(|| "pod-a".into()),
            holder: Holder::from_labels("ns", "a", None),
            devices: vec![PreparedDevice {
                request_names: vec!["gpus".into()],
                pool: "node-1".into(),
                device: id.to_lowercase(),
                id: id.into(),
                cdi_ids: vec![format!("gpu.tessera.dev/claim={id}")],
                memory_share_bytes: None,
                share_id: None,
            }],
        }
    }

    #[test]
    fn prepared_claims_survive_a_restart_and_leave_when_unprepared() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("plugin").join("prepared.json");
        let mut record = PreparedClaims::open(path.clone());
        record.insert("u1", claim("GPU-A")).unwrap();
        record.insert("u2", claim("GPU-B")).unwrap();

        let mut again = PreparedClaims::open(path.clone());
        assert_eq!(again.get("u1"), Some(&claim("GPU-A")));
        assert_eq!(
            again.devices_in_use(),
            BTreeMap::from([
                ("GPU-A".into(), "pod-a".into()),
                ("GPU-B".into(), "unbound".into())
            ])
        );
        again.remove("u1").unwrap();
        again.remove("u1").unwrap();
        assert_eq!(PreparedClaims::open(path).get("u1"), None);
    }

    #[test]
    fn an_unreadable_record_is_set_aside_and_starts_empty() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("prepared.json");
        for bad in [
            "{not json",
            r#"{"version": 9, "claims": {}}"#,
            r#"{"version": 1, "claims": {"u": {"namespace": 3}}}"#,
        ] {
            std::fs::write(&path, bad).unwrap();
            let record = PreparedClaims::open(path.clone());
            assert!(record.devices_in_use().is_empty(), "{bad}");
            assert_eq!(
                std::fs::read_to_string(dir.path().join("prepared.json.bad")).unwrap(),
                bad
            );
            assert!(!path.exists());
        }
    }

    #[test]
    fn a_record_that_cannot_be_saved_keeps_memory_and_file_in_agreement() {
        let dir = tempfile::tempdir().unwrap();
        // A directory where the file should be: writing it fails.
        let path = dir.path().join("prepared.json");
        std::fs::create_dir_all(path.with_extension("json.tmp")).unwrap();
        let mut record = PreparedClaims::open(path);
        assert!(record.insert("u1", claim("GPU-A")).is_err());
        assert_eq!(record.get("u1"), None);
    }
}
