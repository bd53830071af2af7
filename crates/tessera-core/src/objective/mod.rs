//! The cluster objective: one order on how well a cluster serves, used by
//! every decision that weighs one instance against another (room made for a
//! blocked replica, drains, continuous moves, the benchmarks). Levels, each
//! deciding only where the ones above tie:
//!
//! 1. every replica placed, each meeting its latency target;
//! 2. every instance's demand met (`serving.requestsPerSecond`); an instance
//!    without a demand is met by its replicas meeting the target;
//! 3. the fewest GPUs (a memory share by its part);
//! 4. then headroom, weighted by the work a request costs
//!    ([`work_per_request`]): requests to unlike models are never summed as
//!    equals.
//!
//! docs/placement.md ("The cluster objective") works an example through.

mod standing;
mod work;

pub use standing::{ClusterStanding, InstanceStanding, Lost};
pub use work::{TFLOP, work_per_request};
