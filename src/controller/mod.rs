//! The controller: reconciles ModelInstances into placed, bound shard pods.
//!
//! A reconcile runs in stages, the pure ones apart from the API calls:
//! `observe` (with `node_cache`, `nodes`, `held`) → `validate` → `decide` (its
//! `stage` runs the pure decision) → `build` (with `desired`) → `apply` (its
//! `stage`, with `node_gate`, and `dra` for shards on DRA nodes) → `status`
//! (its `write`), then `events` and `requeue`. Each stage is handed the
//! `context`; `reconcile` calls them in that order and nothing else does; `moves`
//! carries out moves that make room, make before break; `hashes` holds every hash they compare;
//! `written` keeps each status a reconcile wrote until the cache shows it;
//! `tessera_core::translate` (shared with `tessera place`) turns Kubernetes objects
//! into the solver's problem; `run` wires caches (`synced`, `triggers`, `room_wakes`), leader election
//! and the HTTP endpoints.

pub(crate) mod apply;
mod build;
mod cached_resource;
mod claim_changes;
pub mod context;
pub mod decide;
pub mod desired;
pub mod dra;
mod event_log;
mod events;
pub mod hashes;
pub mod held;
mod instance_metrics;
pub mod map_server;
pub(crate) mod measure;
pub mod metrics;
pub mod model_cache;
mod moves;
pub mod node_cache;
mod node_changes;
mod node_gate;
pub mod nodes;
pub(crate) mod observe;
mod pod_repair;
pub mod reconcile;
mod requeue;
mod restart_backoff;
mod room_wakes;
pub mod run;
mod runtime_env;
mod settings;
pub(crate) mod status;
mod synced;
mod triggers;
pub mod validate;
mod watch_errors;
mod written;

#[cfg(test)]
pub(crate) mod testkit;

/// `mutex`'s guard, poisoned or not: what the controller's locks guard
/// (objects written, notes, derived caches) is only ever replaced whole, so a
/// reconcile that panicked holding one leaves nothing the next cannot use.
pub(crate) fn lock<T>(mutex: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}
