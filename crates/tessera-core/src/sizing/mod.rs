//! An instance as users ask for it, on top of the solver (`placement`) and
//! the serving model (`serving`): the tensor size and GPU kind `auto`
//! chooses, judged by what a replica serves at the latency target, and
//! replicas placed one after another. Pure, like both.
//!
//! - `choice`: one replica's shape: a fixed size, or `auto` compared shape
//!   by shape;
//! - `judge`: what a plan is worth under the goal;
//! - `ceiling`: the most a shape could serve, to skip shapes that cannot win;
//! - `plan_reading`: a plan as the serving model reads it;
//! - `replicas`: replicas one after another;
//! - `demand`: how many replicas a demand takes, and whether replicas meet it.

mod ceiling;
mod choice;
mod demand;
mod judge;
mod plan_reading;
mod replicas;

pub use choice::{
    Alternative, InstancePlan, TensorChoice, Verdict, solve_parallelism, tensor_candidates,
};
pub use demand::{replicas_meeting, served_together, solve_for_demand};
pub use judge::{capacity, target};
pub(crate) use plan_reading::{product as plan_product, read as read_plan};
pub use plan_reading::{runtime as runtime_of, workload as workload_of};
pub use replicas::{solve_replicas, take_devices};
