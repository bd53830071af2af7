//! Moves in the controller: a running replica moved make before break so
//! that a replica that cannot be placed gets room. The instance that is
//! blocked asks the core's move planner (`propose`) and hands the first
//! move to the instance it moves (`book`); that instance's own reconciles
//! then carry it out (`progress`): the move written into its status first,
//! the new copy's pods made and bound on the planned devices, the switch
//! once every one is Ready, the old pods evicted through the Eviction API
//! (`evict`, so PodDisruptionBudgets count), or the move abandoned with the
//! old copy untouched. A replica on a cordoned node hands itself the move
//! that takes it off (`drain`). With `--continuous-moves`, a replica that
//! serves more elsewhere is handed its move while nothing is blocked
//! (`improve`). `world` is the cluster as the planners see it from the
//! caches; `metrics` counts how moves end.

pub(crate) mod book;
pub(crate) mod drain;
pub(crate) mod evict;
pub(crate) mod improve;
pub(crate) mod metrics;
pub(crate) mod progress;
pub(crate) mod propose;
mod world;

use tessera_core::api::MoveInFlight;

/// The move an instance's reconcile carries on with, as decided.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Moving {
    /// What the status records.
    pub(crate) record: MoveInFlight,
    /// The new copy's pods are wanted.
    pub(crate) surge: bool,
    /// Pods of the old copy to evict.
    pub(crate) evict: Vec<String>,
}
