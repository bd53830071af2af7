//! How a binding index keeps its checkpoint and which resource it serves.

use std::path::PathBuf;

use super::checkpoint::DEFAULT_CHECKPOINT_PATH;
use tessera_core::api::DEFAULT_RESOURCE_NAME;

/// How a [`BindingIndex`](super::BindingIndex) keeps its checkpoint and
/// which resource it serves.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BindingConfig {
    /// The checkpoint file; `None` keeps allocations in memory only.
    pub checkpoint: Option<PathBuf>,
    /// The extended resource the plugin serves: pods without a binding that
    /// ask for it may hold `unbound` devices.
    pub resource_name: String,
    /// Flush the checkpoint's contents to disk before the rename on every
    /// write. Without it a write survives an agent crash, but a power loss
    /// may leave an empty or torn file (then ignored, with a warning).
    pub sync_writes: bool,
}

impl Default for BindingConfig {
    fn default() -> Self {
        Self {
            checkpoint: Some(PathBuf::from(DEFAULT_CHECKPOINT_PATH)),
            resource_name: DEFAULT_RESOURCE_NAME.to_string(),
            sync_writes: true,
        }
    }
}

impl BindingConfig {
    /// A checkpoint at `path`, the default resource, synced writes.
    pub fn at(path: impl Into<PathBuf>) -> Self {
        Self {
            checkpoint: Some(path.into()),
            ..Self::default()
        }
    }

    /// No checkpoint file.
    pub fn in_memory() -> Self {
        Self {
            checkpoint: None,
            ..Self::default()
        }
    }
}
