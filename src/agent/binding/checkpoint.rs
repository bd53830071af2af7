//! The allocation checkpoint file: its format ([`Checkpoint`],
//! [`Allocation`]), reading it back at start ([`load_checkpoint`]) and
//! writing it atomically, newest contents last ([`CheckpointWriter`]).

use std::collections::BTreeMap;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, PoisonError};

use k8s_openapi::jiff::Timestamp;
use serde::{Deserialize, Serialize};

use crate::process::state_file::write_atomically;

/// Where the agent keeps its allocation checkpoint unless told otherwise.
pub const DEFAULT_CHECKPOINT_PATH: &str = "/var/lib/tessera/checkpoint.json";
/// The checkpoint format written and understood.
pub const CHECKPOINT_VERSION: u32 = 1;

/// Devices handed to one pod (or, under `unbound`, to a pod without a binding).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Allocation {
    /// `namespace/name`; empty under `unbound`.
    #[serde(default)]
    pub pod: String,
    pub devices: Vec<String>,
    /// When it was recorded (RFC 3339).
    #[serde(default)]
    pub time: String,
}

impl Allocation {
    /// `devices` handed to `pod` (empty: a pod without a binding) now.
    pub(super) fn recorded_now(pod: String, devices: Vec<String>) -> Self {
        Self {
            pod,
            devices,
            time: Timestamp::now().to_string(),
        }
    }

    /// When it was recorded; `None` when the time is missing or unreadable.
    pub(super) fn recorded_at(&self) -> Option<Timestamp> {
        self.time.parse().ok()
    }
}

/// The checkpoint file's contents.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Checkpoint {
    pub(crate) version: u32,
    /// Pod UID → its allocation.
    #[serde(default)]
    pub pods: BTreeMap<String, Allocation>,
    /// Allocations that matched no planned binding, oldest first.
    #[serde(default)]
    pub unbound: Vec<Allocation>,
}

impl Default for Checkpoint {
    fn default() -> Self {
        Self {
            version: CHECKPOINT_VERSION,
            pods: BTreeMap::new(),
            unbound: Vec::new(),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    #[error("reading {path}: {source}")]
    Read { path: String, source: io::Error },
    #[error("{path} is not a valid checkpoint: {reason}")]
    Invalid { path: String, reason: String },
}

/// Reads a checkpoint: `Ok(None)` when the file does not exist.
pub fn load_checkpoint(path: &Path) -> Result<Option<Checkpoint>, CheckpointError> {
    let Some(bytes) = read_if_present(path)? else {
        return Ok(None);
    };
    let mut checkpoint = decode(path, &bytes)?;
    drop_incomplete_entries(path, &mut checkpoint);
    Ok(Some(checkpoint))
}

fn read_if_present(path: &Path) -> Result<Option<Vec<u8>>, CheckpointError> {
    match std::fs::read(path) {
        Ok(bytes) => Ok(Some(bytes)),
        Err(error) if error.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(source) => Err(CheckpointError::Read {
            path: path.display().to_string(),
            source,
        }),
    }
}

/// Parses a checkpoint of the version this agent writes.
fn decode(path: &Path, bytes: &[u8]) -> Result<Checkpoint, CheckpointError> {
    let invalid = |reason: String| CheckpointError::Invalid {
        path: path.display().to_string(),
        reason,
    };
    let checkpoint: Checkpoint =
        serde_json::from_slice(bytes).map_err(|error| invalid(error.to_string()))?;
    if checkpoint.version != CHECKPOINT_VERSION {
        return Err(invalid(format!(
            "version {} (this agent understands {CHECKPOINT_VERSION})",
            checkpoint.version
        )));
    }
    Ok(checkpoint)
}

/// An entry without a pod UID or devices holds nothing the rules could
/// enforce; a hand-edited file may still have one.
fn drop_incomplete_entries(path: &Path, checkpoint: &mut Checkpoint) {
    checkpoint.pods.retain(|uid, allocation| {
        let complete = !uid.is_empty() && !allocation.devices.is_empty();
        if !complete {
            tracing::warn!(path = %path.display(), uid = %uid, "skipping a checkpoint entry without a pod UID or devices");
        }
        complete
    });
    checkpoint
        .unbound
        .retain(|allocation| !allocation.devices.is_empty());
}

/// Writes successive versions (generations) of the checkpoint to its file.
/// Writers race once the index lock is released, so an older generation
/// arriving after a newer one is dropped rather than written over it.
#[derive(Debug)]
pub(super) struct CheckpointWriter {
    path: PathBuf,
    sync_writes: bool,
    /// The generation last written.
    written: Mutex<u64>,
}

impl CheckpointWriter {
    pub(super) fn new(path: PathBuf, sync_writes: bool) -> Self {
        Self {
            path,
            sync_writes,
            written: Mutex::new(0),
        }
    }

    pub(super) fn path(&self) -> &Path {
        &self.path
    }

    /// Writes `bytes`, checkpoint `generation`, unless a newer one is on disk
    /// already; a failure is logged (the next change writes again).
    pub(super) fn write(&self, generation: u64, bytes: &[u8]) {
        let mut written = self.written.lock().unwrap_or_else(PoisonError::into_inner);
        if *written >= generation {
            return;
        }
        match write_atomically(&self.path, bytes, self.sync_writes) {
            Ok(()) => *written = generation,
            Err(error) => {
                tracing::warn!(path = %self.path.display(), error = %error, "cannot write the allocation checkpoint")
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn test_dir(name: &str) -> PathBuf {
        let dir =
            std::env::temp_dir().join(format!("tessera-binding-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        dir
    }

    #[test]
    fn atomic_write_creates_the_directory_and_leaves_no_temp_file() {
        let dir = test_dir("unit");
        let path = dir.join("sub/checkpoint.json");
        write_atomically(&path, b"{}", true).unwrap();
        write_atomically(&path, b"{\"a\":1}", false).unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"{\"a\":1}");
        assert!(!dir.join("sub/checkpoint.json.tmp").exists());
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn an_older_generation_is_not_written_over_a_newer_one() {
        let dir = test_dir("writer");
        let writer = CheckpointWriter::new(dir.join("checkpoint.json"), false);
        writer.write(2, b"second");
        writer.write(1, b"first");
        assert_eq!(std::fs::read(writer.path()).unwrap(), b"second");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
