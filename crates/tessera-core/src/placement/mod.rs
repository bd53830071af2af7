//! The placement solver: `Problem -> Result<Plan, Unsatisfiable>`.
//!
//! Pure and deterministic: no Kubernetes types, no async, no clock except the
//! deadline the caller injects. The same problem with the same step budget always
//! gives the same plan.
//!
//! The search works on *groups*: `tensor` eligible devices on one node that can
//! hold at least one layer. A plan is a set of `k` disjoint groups (one per
//! pipeline stage); stages are put in pipeline order afterwards (by network
//! position), so the order in which the search picks groups carries no meaning
//! and the search only enumerates sets. See `search` for the algorithm.

mod candidates;
mod compile;
pub(crate) mod evaluate;
mod exclusion;
mod exhaustive;
pub(crate) mod explain;
mod greedy;
mod hops;
mod leaf;
mod links;
mod plan;
mod precision;
mod problem;
mod search;
mod share_sizing;
pub(crate) mod speed;
mod split;
mod strategy_score;
mod widened;

pub use evaluate::{StageChoice, evaluate};
pub use exhaustive::best_by_enumeration;
pub use plan::{
    Performance, Plan, Score, StageParts, StagePlan, StageShare, TokenTime, Unsatisfiable,
};
pub use precision::{Precision, TensorRates};
pub use problem::{
    Deadline, Device, DeviceShare, Interconnect, Link, ModelShape, NodeState, Optimize, Problem,
    Selector, Served, SolveOptions, SpeedGoal, Stages, Strategy, Weights,
};

/// Finds the best plan within the options' budget.
pub fn solve(problem: &Problem, options: &SolveOptions) -> Result<Plan, Unsatisfiable> {
    solve_sized(problem, problem.tensor, options)
}

/// `solve` with `tensor` devices per shard instead of the problem's own.
pub(crate) fn solve_sized(
    problem: &Problem,
    tensor: u32,
    options: &SolveOptions,
) -> Result<Plan, Unsatisfiable> {
    explain::check_shape(problem, tensor)?;
    let ctx = evaluate::PreparedProblem::sized(problem, tensor);
    let start = greedy::start(&ctx)?;
    let compiled = compile::Compiled::new(ctx, start.stages);
    Ok(said_widened(
        problem,
        search::run(&compiled, options, start.plan),
    ))
}

/// The plan with the formats its weights were widened to, where they were
/// (worked out once per answer, not per candidate).
fn said_widened(problem: &Problem, mut plan: Plan) -> Plan {
    plan.performance.widened = widened::widened(problem, &plan);
    plan
}

/// The greedy answer alone: what `solve` starts from, and what it returns when
/// the deadline hits before the search has found anything better.
pub fn solve_greedy(problem: &Problem) -> Result<Plan, Unsatisfiable> {
    explain::check_shape(problem, problem.tensor)?;
    let ctx = evaluate::PreparedProblem::new(problem);
    Ok(said_widened(problem, greedy::start(&ctx)?.plan))
}

#[cfg(test)]
pub(crate) mod testutil;
