//! The publisher's loop: waits for views, writes when the policy says so,
//! retries failed writes with backoff, and counts what it sent.

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use k8s_openapi::api::core::v1::Node;
use kube::api::Api;
use tokio::time::Instant;

use super::patch::{PatchFuture, start_patch};
use super::policy::{Decision, Published, changed_at_once, needs_publish};
use super::{PublisherConfig, PublisherError};
use crate::agent::state::ViewRx;

/// Why a patch was sent.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WriteCause {
    /// The first view since the agent started.
    First,
    /// Something the controller must react to changed.
    Change,
    /// Only telemetry drifted, and the node's interval was over.
    Drift,
    /// The previous patch failed (it may still have been written).
    Retry,
}

impl WriteCause {
    pub const ALL: [WriteCause; 4] = [Self::First, Self::Change, Self::Drift, Self::Retry];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::First => "first",
            Self::Change => "change",
            Self::Drift => "drift",
            Self::Retry => "retry",
        }
    }
}

/// Counters for the agent's metrics. Shared: the publisher only adds.
#[derive(Debug)]
pub struct PublisherStats {
    /// Patches the API server accepted.
    pub(crate) published: AtomicU64,
    /// Patches that failed (each retry that fails counts again).
    pub(crate) errors: AtomicU64,
    /// Patches sent, by `WriteCause` (in `WriteCause::ALL` order).
    sent: [AtomicU64; 4],
    /// Shortest time from a patch sent to the drift patch sent next, in ms;
    /// `u64::MAX` until a drift patch is sent.
    shortest_drift_gap_ms: AtomicU64,
}

impl Default for PublisherStats {
    fn default() -> Self {
        Self {
            published: AtomicU64::default(),
            errors: AtomicU64::default(),
            sent: Default::default(),
            shortest_drift_gap_ms: AtomicU64::new(u64::MAX),
        }
    }
}

impl PublisherStats {
    pub fn published(&self) -> u64 {
        self.published.load(Ordering::Relaxed)
    }

    pub fn errors(&self) -> u64 {
        self.errors.load(Ordering::Relaxed)
    }

    /// Patches sent for `cause`, answered or not.
    pub fn sent(&self, cause: WriteCause) -> u64 {
        self.sent[cause as usize].load(Ordering::Relaxed)
    }

    /// The shortest time a drift patch followed the patch before it, as the
    /// agent sent them: what the drift interval holds to on the wire.
    pub fn shortest_drift_gap(&self) -> Option<Duration> {
        match self.shortest_drift_gap_ms.load(Ordering::Relaxed) {
            u64::MAX => None,
            ms => Some(Duration::from_millis(ms)),
        }
    }

    pub(crate) fn count_sent(&self, cause: WriteCause, since_previous: Option<Duration>) {
        self.sent[cause as usize].fetch_add(1, Ordering::Relaxed);
        if cause == WriteCause::Drift
            && let Some(gap) = since_previous
        {
            let ms = u64::try_from(gap.as_millis()).unwrap_or(u64::MAX - 1);
            self.shortest_drift_gap_ms.fetch_min(ms, Ordering::Relaxed);
        }
    }
}

/// Publishes the node's GPU state on the Node `config.node_name` until
/// `shutdown` completes (then `Ok`).
///
/// Waits for the first ready view, publishes it, then publishes changes as
/// `needs_publish` decides. Successes and failures are counted in `stats`;
/// a failed patch is retried with backoff and never ends the publisher. It
/// ends with an error only if the node name is empty or the view's sender goes
/// away (the poller is gone, so there is nothing left to publish).
pub async fn run_publisher<S: Future>(
    client: kube::Client,
    config: PublisherConfig,
    mut view: ViewRx,
    stats: Arc<PublisherStats>,
    shutdown: S,
) -> Result<(), PublisherError> {
    if config.node_name.trim().is_empty() {
        return Err(PublisherError::NoNodeName);
    }
    let nodes: Api<Node> = Api::all(client);
    tokio::pin!(shutdown);

    tokio::select! {
        biased;
        _ = &mut shutdown => return Ok(()),
        ready = async { view.wait_for(|v| v.ready).await.map(|_| ()) } => {
            if ready.is_err() {
                return Err(PublisherError::ViewClosed);
            }
        }
    }

    let mut last: Option<Published> = None;
    let mut in_flight: Option<PatchFuture> = None;
    let mut retry_at: Option<Instant> = None;
    let first_backoff = config.retry_initial.min(config.retry_max);
    let mut backoff = first_backoff;
    let mut failures: u32 = 0;
    let mut last_sent: Option<Instant> = None;

    loop {
        let mut wake = None;
        // While a patch is on its way, newer views only wake the loop
        // (`changed()` marks them seen); the newest is looked at once it is answered.
        if in_flight.is_none() {
            let current = view.borrow_and_update().clone();
            let now = Instant::now();
            let decision = match &last {
                None => Decision::Now,
                Some(last) => needs_publish(last, &current, now, &config),
            };
            let due = match decision {
                Decision::Now => Some(now),
                Decision::At(t) => Some(t),
                Decision::Nothing => None,
            };
            // After a failure nothing is written before the backoff is over.
            let due = due.map(|d| retry_at.map_or(d, |r| d.max(r)));
            match due {
                Some(due) if due <= now => {
                    let cause = match &last {
                        _ if failures > 0 => WriteCause::Retry,
                        None => WriteCause::First,
                        Some(last) if changed_at_once(&last.view, &current) => WriteCause::Change,
                        Some(_) => WriteCause::Drift,
                    };
                    stats.count_sent(cause, last_sent.map(|at| now.saturating_duration_since(at)));
                    last_sent = Some(now);
                    in_flight = Some(start_patch(nodes.clone(), &config, current));
                }
                other => wake = other,
            }
        }

        tokio::select! {
            biased;
            _ = &mut shutdown => return Ok(()),
            (sent, result) = poll_some(in_flight.as_mut()) => {
                in_flight = None;
                match result {
                    Ok(()) => {
                        stats.published.fetch_add(1, Ordering::Relaxed);
                        if last.is_none() || failures > 0 {
                            tracing::info!(
                                node = %config.node_name,
                                devices = sent.snapshot.devices.len(),
                                "published the node's GPU state"
                            );
                        } else {
                            tracing::debug!(
                                node = %config.node_name,
                                devices = sent.snapshot.devices.len(),
                                "published the node's GPU state"
                            );
                        }
                        last = Some(Published { view: sent, at: Instant::now() });
                        retry_at = None;
                        backoff = first_backoff;
                        failures = 0;
                    }
                    Err(e) => {
                        stats.errors.fetch_add(1, Ordering::Relaxed);
                        failures = failures.saturating_add(1);
                        tracing::warn!(
                            node = %config.node_name,
                            error = %e,
                            failures,
                            retry_in_ms = u64::try_from(backoff.as_millis()).unwrap_or(u64::MAX),
                            "publishing the node's GPU state failed; will retry"
                        );
                        retry_at = Instant::now().checked_add(backoff);
                        backoff = backoff.saturating_mul(2).min(config.retry_max);
                    }
                }
            }
            _ = sleep_until_some(wake) => {}
            changed = view.changed() => {
                if changed.is_err() {
                    return Err(PublisherError::ViewClosed);
                }
            }
        }
    }
}

async fn poll_some<F: Future + Unpin>(f: Option<&mut F>) -> F::Output {
    match f {
        Some(f) => f.await,
        None => std::future::pending().await,
    }
}

async fn sleep_until_some(deadline: Option<Instant>) {
    match deadline {
        Some(t) => tokio::time::sleep_until(t).await,
        None => std::future::pending().await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn an_empty_node_name_is_refused() {
        let (service, _handle) = tower_test::mock::pair::<
            http::Request<kube::client::Body>,
            http::Response<kube::client::Body>,
        >();
        let client = kube::Client::new(service, "default");
        let (_tx, rx) = crate::agent::state::channel("fake");
        let result = run_publisher(
            client,
            PublisherConfig::new(" "),
            rx,
            Arc::default(),
            std::future::pending::<()>(),
        )
        .await;
        assert_eq!(result, Err(PublisherError::NoNodeName));
    }
}
