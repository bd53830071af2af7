//! The controller: reconciles ModelInstances into placed, bound shard pods.
//!
//! A reconcile runs in stages, the pure ones apart from the API calls:
//! observe (caches) → `validate` → `plan` → `build` → `apply` → `status`.
//! `crate::translate` (shared with `tessera place`) turns Kubernetes objects into
//! the solver's problem; `nodes` and `held` read the cluster; `reconcile` ties the stages together and `run`
//! wires caches, leader election and HTTP endpoints.

pub mod apply;
pub mod build;
pub mod held;
pub mod metrics;
mod node_gate;
pub mod nodes;
pub mod plan;
pub mod reconcile;
pub mod run;
mod settings;
pub mod status;
mod synced;
pub mod validate;

#[cfg(test)]
pub(crate) mod testkit;
