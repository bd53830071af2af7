//! What the programs share as processes rather than as Kubernetes clients:
//! the signal that ends the long-running ones (`signal`), the files they keep
//! state in (`state_file`), the wall clock the solver is given
//! (`wall_deadline`), and the check that the chart's alerts name only metrics
//! the components export (`monitoring_names`, a test).

#[cfg(test)]
mod monitoring_names;
pub(crate) mod signal;
pub(crate) mod state_file;
pub mod wall_deadline;
