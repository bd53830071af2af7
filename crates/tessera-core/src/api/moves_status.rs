//! A move in flight as the status records it: the controller starts a
//! replica's new copy only after this is written, so a controller that
//! restarts mid-move finds what it was doing and either carries it on or
//! abandons it, never leaving a replica on two sets of devices or on none.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::PlannedShard;

/// One replica being moved, make before break.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct MoveInFlight {
    /// The replica moved (0 for the first).
    #[serde(default)]
    pub replica: u32,
    /// `Surging`: the new copy's pods are being made, bound and readied on
    /// `to` while the replica keeps serving from `from`. `Draining`: the new
    /// copy serves; the old pods are being evicted (a PodDisruptionBudget
    /// may hold them a while).
    pub phase: MovePhase,
    /// Where the replica ran when the move started, shard by shard.
    pub from: Vec<PlannedShard>,
    /// Where it goes, shard by shard; held for it from the start.
    pub to: Vec<PlannedShard>,
    /// When the move started (RFC 3339). A surge copy not Ready within the
    /// controller's `--move-timeout` of it is abandoned.
    pub started: String,
    /// Why it moves: the replica it makes room for, or the node it leaves.
    pub reason: String,
    /// What the move waits for now, when it waits (an eviction a
    /// PodDisruptionBudget refuses, pods not yet Ready).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub waiting: Option<String>,
}

/// Where a move stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum MovePhase {
    Surging,
    Draining,
}

impl MoveInFlight {
    /// The shards whose devices the replica holds now: both copies while
    /// the move is in flight.
    pub fn held(&self) -> impl Iterator<Item = &PlannedShard> {
        self.from.iter().chain(&self.to)
    }
}
