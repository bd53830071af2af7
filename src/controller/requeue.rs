//! When a reconcile looks at its instance again without an event.

use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::jiff::Timestamp;

use super::decide::stage::Decided;
use super::nodes::{NodeInfo, Readiness};
use super::status::Outcome;

/// Periodic re-check of a settled instance, in case an event was missed.
const RESYNC: Duration = Duration::from_secs(600);
/// Re-check of an unsatisfiable instance when no cluster change prompts one.
const UNSATISFIABLE_RETRY: Duration = Duration::from_secs(300);
/// How soon a reconcile that left a shard unbound looks again (the agent's
/// report of the allocation it waits for usually wakes it sooner).
pub(crate) const BIND_RETRY: Duration = Duration::from_secs(1);

/// How soon to look again without an event: when a NotReady node's grace period
/// runs out (no event marks that moment), else a slow resync.
pub(crate) fn next_check(
    decided: &Decided,
    nodes: &[Arc<NodeInfo>],
    now: Timestamp,
    grace: Duration,
) -> Duration {
    let unsatisfiable = decided
        .replicas
        .iter()
        .any(|replica| matches!(replica.outcome, Outcome::Unsatisfiable { .. }));
    let mut next = if unsatisfiable {
        UNSATISFIABLE_RETRY
    } else {
        RESYNC
    };
    let plan = decided.plan();
    for node in nodes
        .iter()
        .filter(|node| plan.iter().any(|s| s.node == node.name()))
    {
        if let Readiness::NotReady { since: Some(since) } = &node.readiness
            && let Ok(elapsed) = Duration::try_from(now.duration_since(*since))
            && elapsed <= grace
        {
            next = next.min(grace - elapsed + Duration::from_secs(1));
        }
    }
    next
}
