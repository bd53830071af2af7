//! An instance as users ask for it, on top of `solve`: an `auto` tensor size
//! tried size by size, and replicas placed one after another, each on the
//! devices the earlier ones left.

use std::borrow::Cow;

use super::evaluate::SpeedCeiling;
use super::plan::{Plan, Unsatisfiable};
use super::problem::{Problem, SolveOptions};

/// Largest tensor size `auto` tries (the CRD's limit for a fixed size).
const MAX_AUTO_TENSOR: u32 = 64;

/// GPUs per shard: fixed, or chosen for the highest predicted tokens/s.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TensorChoice {
    Auto,
    Fixed(u32),
}

/// One tensor size `auto` compared, and what came of it.
#[derive(Clone, Debug, PartialEq)]
pub struct Alternative {
    pub tensor: u32,
    /// Stages and predicted tokens/s of the best plan at this size, or in
    /// words why there is none ("no plan (...)") or why the size was not
    /// solved ("not solved: at most ... tokens/s ...").
    pub outcome: Result<(u32, f64), String>,
}

/// A replica's plan and how its parallelism was chosen.
#[derive(Clone, Debug, PartialEq)]
pub struct InstancePlan {
    pub plan: Plan,
    /// GPUs per shard of `plan`.
    pub tensor: u32,
    /// Every size `auto` compared, in increasing order; empty for a fixed size.
    pub alternatives: Vec<Alternative>,
}

impl InstancePlan {
    /// One sentence on the choice `auto` made, or `None` for a fixed size.
    pub fn parallelism_note(&self) -> Option<String> {
        if self.alternatives.is_empty() {
            return None;
        }
        let compared: Vec<String> = self
            .alternatives
            .iter()
            .filter(|alternative| alternative.tensor != self.tensor)
            .map(|alternative| match &alternative.outcome {
                Ok((stages, speed)) => {
                    format!("{} × {stages}: {speed:.1} tokens/s", alternative.tensor)
                }
                Err(reason) => format!("{}: {reason}", alternative.tensor),
            })
            .collect();
        let stages = self.plan.stages.len();
        let chosen = format!(
            "tensor auto chose {} GPU(s) per shard × {stages} stage(s): {:.1} tokens/s",
            self.tensor, self.plan.performance.tokens_per_second
        );
        Some(if compared.is_empty() {
            format!("{chosen} (the only size that fits)")
        } else {
            format!("{chosen}; compared tensor × stages {}", compared.join(", "))
        })
    }
}

/// The sizes `auto` tries: powers of two up to the most usable devices on
/// one node (tensor groups never span nodes). Runtimes split attention heads
/// evenly, which model sizes make powers of two.
pub fn tensor_candidates(problem: &Problem) -> Vec<u32> {
    let most_on_a_node = problem
        .nodes
        .iter()
        .map(|node| {
            node.devices
                .iter()
                .filter(|device| device.healthy && device.allocated_to.is_none())
                .count()
        })
        .max()
        .unwrap_or(0);
    let limit = u32::try_from(most_on_a_node)
        .unwrap_or(u32::MAX)
        .clamp(1, MAX_AUTO_TENSOR);
    std::iter::successors(Some(1u32), |size| size.checked_mul(2))
        .take_while(|size| *size <= limit)
        .collect()
}

/// The best plan for one replica. With `TensorChoice::Auto` the candidate
/// sizes are solved largest first (larger groups are usually faster) and the
/// plan with the highest predicted tokens/s wins; a tie goes to fewer GPUs
/// per shard. A size whose speed ceiling (every layer on the fastest free GPU)
/// is already below the best plan found is not solved: no plan of that size
/// could win.
pub fn solve_parallelism(
    problem: &Problem,
    tensor: TensorChoice,
    options: &SolveOptions,
) -> Result<InstancePlan, Unsatisfiable> {
    let sizes = match tensor {
        TensorChoice::Fixed(size) => {
            let plan = super::solve_sized(problem, size, options)?;
            return Ok(InstancePlan {
                plan,
                tensor: size,
                alternatives: Vec::new(),
            });
        }
        TensorChoice::Auto => tensor_candidates(problem),
    };
    let mut best: Option<(Plan, u32)> = None;
    let mut alternatives = Vec::with_capacity(sizes.len());
    let mut refusals = Vec::new();
    let ceilings = SpeedCeiling::new(problem);
    for size in sizes.into_iter().rev() {
        let best_speed = best
            .as_ref()
            .map_or(0.0, |(kept, _)| kept.performance.tokens_per_second);
        let ceiling = ceilings.at(size);
        // The margin keeps rounding in the speed model from skipping a size
        // that would tie.
        if ceiling * (1.0 + 1e-9) < best_speed {
            alternatives.push(Alternative {
                tensor: size,
                outcome: Err(format!(
                    "not solved: at most {ceiling:.1} tokens/s even on the fastest GPUs"
                )),
            });
            continue;
        }
        match super::solve_sized(problem, size, options) {
            Ok(plan) => {
                let speed = plan.performance.tokens_per_second;
                alternatives.push(Alternative {
                    tensor: size,
                    outcome: Ok((plan.stages.len() as u32, speed)),
                });
                // Sizes come largest first, so an equal speed moves the choice
                // to fewer GPUs per shard.
                if best.is_none() || speed >= best_speed {
                    best = Some((plan, size));
                }
            }
            Err(unsatisfiable) => {
                refusals.push(format!("tensor {size}: {}", unsatisfiable.reason));
                alternatives.push(Alternative {
                    tensor: size,
                    outcome: Err(format!("no plan ({})", unsatisfiable.reason)),
                });
            }
        }
    }
    alternatives.reverse();
    refusals.reverse();
    match best {
        Some((plan, size)) => Ok(InstancePlan {
            plan,
            tensor: size,
            alternatives,
        }),
        None => Err(Unsatisfiable {
            reason: "no tensor size gives a plan (parallelism.tensor: auto)".into(),
            details: refusals,
        }),
    }
}

/// Plans `replicas` copies one after another: each replica's devices are
/// taken (held by `owner`) before the next is planned, and its nodes are
/// what `Strategy::Spread` keeps the next away from. Once a replica has no
/// plan the later ones have none either (they face the same cluster), so
/// they get the same answer without another search.
pub fn solve_replicas(
    problem: &Problem,
    tensor: TensorChoice,
    replicas: u32,
    owner: &str,
    options: &SolveOptions,
) -> Vec<Result<InstancePlan, Unsatisfiable>> {
    // Copied only when a later replica needs the devices marked.
    let mut remaining = Cow::Borrowed(problem);
    let mut results: Vec<Result<InstancePlan, Unsatisfiable>> = Vec::new();
    for replica in 0..replicas {
        if let Some(Err(refusal)) = results.last() {
            let refusal = refusal.clone();
            results.push(Err(refusal));
            continue;
        }
        let result = solve_parallelism(&remaining, tensor, options);
        if let Ok(placed) = &result
            && replica + 1 < replicas
        {
            take_devices(
                remaining.to_mut(),
                &placed.plan,
                &format!("{owner} replica {replica}"),
            );
        }
        results.push(result);
    }
    results
}

/// Marks the plan's devices held by `holder` and records its nodes as a
/// replica's.
pub fn take_devices(problem: &mut Problem, plan: &Plan, holder: &str) {
    for stage in &plan.stages {
        problem.replica_nodes.push(stage.node.clone());
        let Some(node) = problem
            .nodes
            .iter_mut()
            .find(|node| node.name == stage.node)
        else {
            continue;
        };
        for device in &mut node.devices {
            if stage.devices.contains(&device.id) {
                device.allocated_to = Some(holder.to_string());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::placement::Stages;
    use crate::placement::testutil::{H100, node, problem as sample};

    #[test]
    fn auto_tries_powers_of_two_up_to_the_largest_node() {
        let problem = sample(
            vec![node("a", 8, H100), node("b", 3, H100)],
            8,
            1,
            Stages::Auto,
        );
        assert_eq!(tensor_candidates(&problem), vec![1, 2, 4, 8]);
        let small = sample(vec![node("a", 3, H100)], 8, 1, Stages::Auto);
        assert_eq!(tensor_candidates(&small), vec![1, 2]);
    }

    #[test]
    fn auto_is_at_least_as_fast_as_every_size_it_compared() {
        let problem = sample(vec![node("a", 8, H100)], 70, 1, Stages::Auto);
        let options = SolveOptions::default();
        let auto = solve_parallelism(&problem, TensorChoice::Auto, &options).unwrap();
        assert_eq!(auto.plan.stages[0].devices.len() as u32, auto.tensor);
        for size in tensor_candidates(&problem) {
            if let Ok(fixed) = solve_parallelism(&problem, TensorChoice::Fixed(size), &options) {
                assert!(
                    auto.plan.performance.tokens_per_second
                        >= fixed.plan.performance.tokens_per_second,
                    "tensor {size} is faster"
                );
            }
        }
        let note = auto.parallelism_note().unwrap();
        assert!(note.starts_with("tensor auto chose"), "{note}");
        assert!(note.contains("compared tensor × stages"), "{note}");
    }

    #[test]
    fn replicas_never_share_a_device_and_stop_where_the_cluster_ends() {
        let problem = sample(vec![node("a", 4, H100)], 8, 1, Stages::Fixed(1));
        let results = solve_replicas(
            &problem,
            TensorChoice::Fixed(2),
            3,
            "ns/m",
            &SolveOptions::default(),
        );
        let placed: Vec<&InstancePlan> = results.iter().filter_map(|r| r.as_ref().ok()).collect();
        assert_eq!(placed.len(), 2);
        let mut devices: Vec<&String> = placed
            .iter()
            .flat_map(|p| p.plan.stages.iter().flat_map(|s| &s.devices))
            .collect();
        devices.sort();
        devices.dedup();
        assert_eq!(devices.len(), 4, "four distinct devices");
        assert!(results[2].is_err());
    }

    #[test]
    fn auto_skips_sizes_that_cannot_beat_the_plan_it_has() {
        // One 8-GPU node: tensor 8 is fastest, and tensor 1's ceiling (every
        // layer on one H100) is far below it.
        let problem = sample(vec![node("a", 8, H100)], 8, 1, Stages::Auto);
        let auto =
            solve_parallelism(&problem, TensorChoice::Auto, &SolveOptions::default()).unwrap();
        assert_eq!(auto.tensor, 8);
        let tensors: Vec<u32> = auto.alternatives.iter().map(|a| a.tensor).collect();
        assert_eq!(tensors, vec![1, 2, 4, 8], "every size, in increasing order");
        let skipped = &auto.alternatives[0];
        assert!(
            skipped
                .outcome
                .as_ref()
                .is_err_and(|reason| reason.starts_with("not solved: at most")),
            "{skipped:?}"
        );
        let fixed =
            solve_parallelism(&problem, TensorChoice::Fixed(1), &SolveOptions::default()).unwrap();
        assert!(
            fixed.plan.performance.tokens_per_second
                <= SpeedCeiling::new(&problem).at(1) * (1.0 + 1e-9)
        );
        assert!(auto.parallelism_note().unwrap().contains("1: not solved"));
    }
}
