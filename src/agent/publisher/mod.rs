//! The node state publisher: keeps the Node's `tessera.dev/gpu-state`
//! annotation and `tessera.dev/gpu.*` labels in step with the agent's device
//! view, so the controller plans against what the node has right now.
//!
//! When to write is decided by `policy::needs_publish` (pure, no I/O):
//!
//! - **at once** when something the controller must react to changed: the set
//!   of devices or anything static about them, a device's health or its reason
//!   (thermal trouble shows up there through the health tracker), the links, or
//!   the allocated set (the state's `allocated` map: which device is held by
//!   which pod, so the controller never plans onto a device in use);
//! - **at most once per `min_interval`** (five minutes by default) when only
//!   telemetry drifted: temperature, power, or free memory by at least
//!   `free_memory_threshold_bytes`. Each node waits a little longer, by a
//!   share of the interval fixed by its name (`drift_after`), so agents that
//!   started together do not write in step. Every Node write goes to every
//!   Node watcher in the cluster, so drift is what a large fleet must not
//!   pay for often: the fleet benchmark measured it (docs/benchmarks.md);
//! - **not at all** when nothing that is published changed.
//!
//! The write is a JSON merge patch of the Node's metadata that names only our
//! own keys (`patch::patch_body`), so other annotations and labels on the Node are
//! never touched, and a hand-edited (even malformed) value of our annotation is
//! simply replaced. A failed write is logged, counted and retried with a
//! doubling backoff; the retry always carries the newest view, so views keep
//! flowing while the API server is unreachable.
//!
//! Files: `policy` (when to write), `patch` (what is written, and the write),
//! `run` (the loop: waiting, writing, retrying, counting).

use std::time::Duration;

mod patch;
mod policy;
mod run;
#[cfg(test)]
mod test_views;

pub use run::{PublisherStats, WriteCause, run_publisher};

/// How and where the publisher writes.
#[derive(Clone, Debug, PartialEq)]
pub struct PublisherConfig {
    /// The Node to patch (the agent's own node, usually from `NODE_NAME`).
    pub(crate) node_name: String,
    /// Telemetry-only changes are published at most this often.
    pub min_interval: Duration,
    /// Free-memory changes smaller than this (per device, against the last
    /// published value) are not drift.
    pub free_memory_threshold_bytes: u64,
    /// First wait after a failed patch; doubles on every further failure.
    pub retry_initial: Duration,
    /// Longest wait between retries.
    pub retry_max: Duration,
    /// A patch not answered within this time counts as failed (and is retried).
    pub request_timeout: Duration,
}

impl PublisherConfig {
    pub(crate) const DEFAULT_MIN_INTERVAL: Duration = Duration::from_secs(300);
    pub(crate) const DEFAULT_FREE_MEMORY_THRESHOLD_BYTES: u64 = 1 << 30;
    pub(crate) const DEFAULT_RETRY_INITIAL: Duration = Duration::from_secs(1);
    pub(crate) const DEFAULT_RETRY_MAX: Duration = Duration::from_secs(30);
    pub(crate) const DEFAULT_REQUEST_TIMEOUT: Duration = Duration::from_secs(30);

    /// The defaults: drift every 5 min at most, 1 GiB free-memory threshold,
    /// retries from 1 s doubling to 30 s, 30 s for the API server to answer.
    pub fn new(node_name: impl Into<String>) -> Self {
        Self {
            node_name: node_name.into(),
            min_interval: Self::DEFAULT_MIN_INTERVAL,
            free_memory_threshold_bytes: Self::DEFAULT_FREE_MEMORY_THRESHOLD_BYTES,
            retry_initial: Self::DEFAULT_RETRY_INITIAL,
            retry_max: Self::DEFAULT_RETRY_MAX,
            request_timeout: Self::DEFAULT_REQUEST_TIMEOUT,
        }
    }
}

/// Why the publisher stopped other than being asked to.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum PublisherError {
    #[error("the node name is empty; the publisher needs the name of the Node to patch")]
    NoNodeName,
    #[error("the device view closed (its poller stopped) while the publisher was running")]
    ViewClosed,
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    #[test]
    fn defaults() {
        let c = PublisherConfig::new("node-a");
        assert_eq!(c.min_interval, Duration::from_secs(300));
        assert_eq!(c.free_memory_threshold_bytes, GIB);
        assert_eq!(c.retry_initial, Duration::from_secs(1));
        assert_eq!(c.retry_max, Duration::from_secs(30));
        assert_eq!(c.request_timeout, Duration::from_secs(30));
    }
}
