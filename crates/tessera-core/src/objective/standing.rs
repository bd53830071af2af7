//! An instance and a cluster judged by the objective's levels.

use std::cmp::Ordering;

use serde::Serialize;

use super::work::{TFLOP, work_per_request};
use crate::api::ModelInstanceSpec;
use crate::sizing::served_together;

/// Relative slack in comparing figures the same devices predict alike up
/// to rounding (a demand met, GPUs, work).
const SAME: f64 = 1e-9;

/// One instance as its replicas serve: requests/s at the latency target of
/// each replica placed (0 for one that misses it), what it asks for, and
/// what a request costs.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct InstanceStanding {
    /// Replicas it asks for, placed or not.
    pub wanted: usize,
    /// Each placed replica's requests/s at the target.
    pub per_replica: Vec<f64>,
    /// `serving.requestsPerSecond`.
    pub demand: Option<f64>,
    /// FLOPs of a typical request ([`work_per_request`]).
    pub work_per_request: f64,
    /// GPUs its replicas hold (a memory share by its part).
    pub gpus: f64,
}

/// What a change would take from an instance at the objective's first two
/// levels.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum Lost {
    #[error("a replica would miss its latency target")]
    Target,
    #[error(
        "it would serve {after:.2} requests/s at the target, below its demand of {demand:.2} (it serves {before:.2})"
    )]
    Demand {
        demand: f64,
        before: f64,
        after: f64,
    },
}

impl InstanceStanding {
    pub fn new(spec: &ModelInstanceSpec, wanted: usize, per_replica: Vec<f64>, gpus: f64) -> Self {
        Self {
            wanted,
            per_replica,
            demand: spec.serving.as_ref().and_then(|s| s.requests_per_second),
            work_per_request: work_per_request(spec),
            gpus,
        }
    }

    /// Replicas asked for and not placed.
    pub fn unplaced(&self) -> usize {
        self.wanted.saturating_sub(self.per_replica.len())
    }

    /// Placed replicas that meet no latency target.
    pub fn missing_target(&self) -> usize {
        self.per_replica.iter().filter(|rps| !meets(**rps)).count()
    }

    /// Requests/s its replicas serve together at the target (a Service
    /// spreads requests evenly: their count × the slowest one's).
    pub fn served(&self) -> f64 {
        served_together(&self.per_replica)
    }

    /// Its demand met; without one, every replica placed and meeting the
    /// target.
    pub fn demand_met(&self) -> bool {
        match self.demand {
            Some(demand) => self.served() >= demand * (1.0 - SAME),
            None => self.unplaced() == 0 && self.missing_target() == 0,
        }
    }

    /// Work served at the target, in FLOP/s.
    pub fn work_served(&self) -> f64 {
        self.served() * self.work_per_request
    }

    /// Whether `self`, the instance after a change, keeps what `before` had
    /// at the first two levels: no replica newly missing its target, and a
    /// demand met before still met (one not met before served no less).
    pub fn keeps(&self, before: &InstanceStanding) -> Result<(), Lost> {
        if self.missing_target() > before.missing_target() {
            return Err(Lost::Target);
        }
        let Some(demand) = self.demand else {
            return Ok(());
        };
        let (served_before, served_after) = (before.served(), self.served());
        let kept = if before.demand_met() {
            self.demand_met()
        } else {
            served_after >= served_before * (1.0 - SAME)
        };
        if kept {
            Ok(())
        } else {
            Err(Lost::Demand {
                demand,
                before: served_before,
                after: served_after,
            })
        }
    }
}

fn meets(requests_per_second: f64) -> bool {
    requests_per_second.is_finite() && requests_per_second > 0.0
}

/// A cluster at the objective's levels, summed over its instances.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ClusterStanding {
    pub instances: usize,
    /// Replicas asked for and not placed.
    pub unplaced: usize,
    /// Placed replicas that meet no latency target.
    pub missing_target: usize,
    /// Instances whose demand is not met.
    pub demands_unmet: usize,
    pub gpus: f64,
    /// Work served at the targets, in FLOP/s: the headroom, weighted.
    pub work_served: f64,
}

impl ClusterStanding {
    pub fn of<'a>(instances: impl IntoIterator<Item = &'a InstanceStanding>) -> Self {
        instances
            .into_iter()
            .fold(Self::default(), |sum, instance| Self {
                instances: sum.instances + 1,
                unplaced: sum.unplaced + instance.unplaced(),
                missing_target: sum.missing_target + instance.missing_target(),
                demands_unmet: sum.demands_unmet + usize::from(!instance.demand_met()),
                gpus: sum.gpus + instance.gpus,
                work_served: sum.work_served + instance.work_served(),
            })
    }

    /// The objective's order: `Greater` when `self` serves the cluster
    /// better than `other`, each level deciding only where those above tie.
    pub fn compare(&self, other: &ClusterStanding) -> Ordering {
        // Fewer is better for the first four: reversed.
        (other.unplaced + other.missing_target)
            .cmp(&(self.unplaced + self.missing_target))
            .then(other.demands_unmet.cmp(&self.demands_unmet))
            .then(fewer(self.gpus, other.gpus))
            .then(more(self.work_served, other.work_served))
    }

    /// Instances whose demand is met.
    pub fn demands_met(&self) -> usize {
        self.instances - self.demands_unmet
    }

    /// The standing in words, work in TFLOP/s.
    pub fn words(&self) -> String {
        format!(
            "{} of {} instance(s) served as asked (demand met, or the target where none is stated), {} replica(s) unplaced, {} missing their target, {:.2} GPUs, {:.1} TFLOP/s of model work served at the targets",
            self.demands_met(),
            self.instances,
            self.unplaced,
            self.missing_target,
            self.gpus,
            self.work_served / TFLOP
        )
    }
}

/// `Greater` when `mine` is fewer, beyond rounding.
fn fewer(mine: f64, theirs: f64) -> Ordering {
    more(theirs, mine)
}

/// `Greater` when `mine` is more, beyond rounding.
fn more(mine: f64, theirs: f64) -> Ordering {
    let slack = SAME * mine.abs().max(theirs.abs());
    if mine > theirs + slack {
        Ordering::Greater
    } else if theirs > mine + slack {
        Ordering::Less
    } else {
        Ordering::Equal
    }
}

#[cfg(test)]
mod tests;
