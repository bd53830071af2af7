//! When a reconcile looks at its instance again without an event.

use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::jiff::Timestamp;

use super::apply::{ReplicaApplied, ShardState};
use super::decide::stage::Decided;
use super::nodes::{NodeInfo, Readiness};
use super::status::Outcome;

/// Periodic re-check of a settled instance, in case an event was missed.
const RESYNC: Duration = Duration::from_secs(600);
/// Re-check of an unsatisfiable instance when no cluster change prompts one.
const UNSATISFIABLE_RETRY: Duration = Duration::from_secs(300);
/// How soon a reconcile that left a shard unbound looks again (the agent's
/// report of the allocation it waits for usually wakes it sooner).
const BIND_RETRY: Duration = Duration::from_secs(1);
/// How often a move in flight is looked at without an event: a move just
/// recorded starts its new copy, a refused eviction is tried again, and a
/// surge copy's time runs out.
const MOVE_RETRY: Duration = Duration::from_secs(5);

/// How soon to look again after a reconcile that applied `applied`: soon when
/// a pod was left unbound (its node busy with another), when a replica's
/// backoff ends, else as [`next_check`] says.
pub(crate) fn after(
    decided: &Decided,
    applied: &[ReplicaApplied],
    nodes: &[Arc<NodeInfo>],
    now: Timestamp,
    grace: Duration,
) -> Duration {
    if applied
        .iter()
        .flat_map(|a| &a.states)
        .any(|state| *state == ShardState::Created)
    {
        return BIND_RETRY;
    }
    let mut next = next_check(decided, nodes, now, grace);
    if decided.moving.is_some() {
        next = next.min(MOVE_RETRY);
    }
    applied
        .iter()
        .filter_map(|a| a.waiting.as_ref())
        .filter_map(|(_, due)| Duration::try_from(due.duration_since(now)).ok())
        .map(|wait| wait + Duration::from_secs(1))
        .fold(next, Duration::min)
}

/// How soon to look again without an event: when a NotReady node's grace period
/// runs out (no event marks that moment), else a slow resync.
fn next_check(
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
