//! An instance as users ask for it, on top of `solve`: an `auto` tensor size
//! tried size by size, and replicas placed one after another, each on the
//! devices the earlier ones left.

use std::borrow::Cow;

use super::evaluate::SpeedCeiling;
use super::plan::{Plan, StageShare, Unsatisfiable};
use super::problem::{DeviceShare, Optimize, Problem, SolveOptions, SpeedGoal};

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
    /// What the size was chosen for.
    pub goal: SpeedGoal,
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
                Ok((stages, speed)) => format!(
                    "{} × {stages}: {speed:.1} tokens/s ({:.1} per GPU)",
                    alternative.tensor,
                    speed / f64::from(alternative.tensor * stages)
                ),
                Err(reason) => format!("{}: {reason}", alternative.tensor),
            })
            .collect();
        let stages = self.plan.stages.len() as u32;
        let speed = self.plan.performance.tokens_per_second;
        let chosen = format!(
            "tensor auto ({}) chose {} GPU(s) per shard × {stages} stage(s): {speed:.1} tokens/s ({:.1} per GPU)",
            goal_text(&self.goal),
            self.tensor,
            speed / f64::from(self.tensor * stages)
        );
        Some(if compared.is_empty() {
            format!("{chosen} (the only size that fits)")
        } else {
            format!("{chosen}; compared tensor × stages {}", compared.join(", "))
        })
    }
}

/// What the goal compares, in words.
fn goal_text(goal: &SpeedGoal) -> String {
    let optimize = match goal.optimize {
        Optimize::Throughput => "throughput: the most tokens/s per GPU",
        Optimize::Latency => "latency: the most tokens/s",
    };
    match goal.min_tokens_per_second {
        Some(min) => format!("the fewest GPUs reaching {min} tokens/s, then {optimize}"),
        None => optimize.to_string(),
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

/// A plan of one size, as the goal compares it.
struct Candidate {
    plan: Plan,
    tensor: u32,
}

impl Candidate {
    fn speed(&self) -> f64 {
        self.plan.performance.tokens_per_second
    }

    fn gpus(&self) -> u32 {
        self.tensor * self.plan.stages.len() as u32
    }

    fn per_gpu(&self) -> f64 {
        self.speed() / f64::from(self.gpus().max(1))
    }

    /// Whether this plan serves the goal better than `other`. Ties (equal
    /// figures) go to the faster plan, then to fewer GPUs per shard, so the
    /// choice never depends on the order sizes were solved in.
    fn beats(&self, other: &Candidate, goal: &SpeedGoal) -> bool {
        if let Some(min) = goal.min_tokens_per_second {
            let (reaches, other_reaches) = (self.speed() >= min, other.speed() >= min);
            if reaches != other_reaches {
                return reaches;
            }
            if reaches && self.gpus() != other.gpus() {
                return self.gpus() < other.gpus();
            }
        }
        let (mine, theirs) = match goal.optimize {
            Optimize::Throughput => (self.per_gpu(), other.per_gpu()),
            Optimize::Latency => (self.speed(), other.speed()),
        };
        if mine != theirs {
            return mine > theirs;
        }
        if self.speed() != other.speed() {
            return self.speed() > other.speed();
        }
        self.tensor < other.tensor
    }
}

/// Whether a ceiling is below a bar. The margin keeps rounding in the speed
/// model from skipping a size that would tie.
fn below(value: f64, bar: f64) -> bool {
    value * (1.0 + 1e-9) < bar
}

/// Why a size need not be solved: no plan of it could beat `best` (speed
/// ceilings: every layer on the fastest free GPU, all-reduces over the
/// fastest link, no hops, one stage).
fn cannot_beat(
    size: u32,
    ceiling: f64,
    best: Option<&Candidate>,
    goal: &SpeedGoal,
) -> Option<String> {
    if let Some(min) = goal.min_tokens_per_second {
        if below(ceiling, min) {
            return Some(format!(
                "not solved: at most {ceiling:.1} tokens/s even on the fastest GPUs, below the {min} asked for"
            ));
        }
        if let Some(best) = best.filter(|best| best.speed() >= min)
            && size > best.gpus()
        {
            return Some(format!(
                "not solved: takes at least {size} GPUs, and {} reach {min} tokens/s",
                best.gpus()
            ));
        }
        // Until a plan reaches the minimum, any size might be the one that does.
        return None;
    }
    let best = best?;
    match goal.optimize {
        Optimize::Latency if below(ceiling, best.speed()) => Some(format!(
            "not solved: at most {ceiling:.1} tokens/s even on the fastest GPUs"
        )),
        Optimize::Throughput if below(ceiling / f64::from(size), best.per_gpu()) => Some(format!(
            "not solved: at most {:.1} tokens/s per GPU even on the fastest GPUs",
            ceiling / f64::from(size)
        )),
        _ => None,
    }
}

/// The best plan for one replica. A fixed size is planned as asked (and
/// refused when it cannot reach `goal.min_tokens_per_second`). With
/// `TensorChoice::Auto` every candidate size is compared by the problem's
/// goal (see `Candidate::beats`): under `Optimize::Latency` the highest
/// predicted tokens/s, under `Optimize::Throughput` the most per GPU, and
/// with a minimum speed the fewest GPUs that reach it. A size whose speed
/// ceiling shows it cannot win is not solved.
pub fn solve_parallelism(
    problem: &Problem,
    tensor: TensorChoice,
    options: &SolveOptions,
) -> Result<InstancePlan, Unsatisfiable> {
    let goal = problem.goal;
    let mut sizes = match tensor {
        TensorChoice::Fixed(size) => {
            let plan = super::solve_sized(problem, size, options)?;
            if let Some(min) = goal.min_tokens_per_second
                && plan.performance.assured_tokens_per_second() < min
            {
                let contended = if plan.performance.contended_tokens_per_second.is_some() {
                    " with every tenant of its shared GPU decoding at once"
                } else {
                    ""
                };
                return Err(Unsatisfiable {
                    reason: format!(
                        "the best plan with tensor {size} ({} stage(s)) is predicted at {:.1} tokens/s{contended}, below parallelism.minTokensPerSecond {min}. Use tensor: auto, faster GPUs or a lower minimum",
                        plan.stages.len(),
                        plan.performance.assured_tokens_per_second()
                    ),
                    details: Vec::new(),
                });
            }
            return Ok(InstancePlan {
                plan,
                tensor: size,
                alternatives: Vec::new(),
                goal,
            });
        }
        TensorChoice::Auto => tensor_candidates(problem),
    };
    // Larger groups are usually faster, smaller ones use GPUs better: trying
    // the likely winner first lets its bar skip more sizes.
    if goal.optimize == Optimize::Latency && goal.min_tokens_per_second.is_none() {
        sizes.reverse();
    }
    // The sizes share the step budget, so `auto` searches no longer than a
    // fixed size does (the deadline is shared anyway).
    let per_size = SolveOptions {
        deadline: options.deadline,
        max_steps: (options.max_steps / sizes.len().max(1) as u64).max(1),
    };
    let mut best: Option<Candidate> = None;
    let mut alternatives = Vec::with_capacity(sizes.len());
    let mut refusals = Vec::new();
    let ceilings = SpeedCeiling::new(problem);
    // Under throughput alone a size's ceiling per GPU can count the fewest
    // stages the size needs, and the sizes are searched best ceiling first,
    // so the plans found early rule out the sizes that cannot win. Which
    // sizes are searched changes; the choice does not (see `Candidate::beats`).
    let per_gpu_first =
        goal.optimize == Optimize::Throughput && goal.min_tokens_per_second.is_none();
    let mut pending: Vec<(u32, u32, f64)> = sizes
        .into_iter()
        .map(|size| {
            let stages = ceilings.fewest_stages(size);
            let most = ceilings.at(size) / (f64::from(size) * f64::from(stages));
            (size, stages, most)
        })
        .collect();
    if per_gpu_first {
        pending.sort_by(|(size, _, most), (other, _, other_most)| {
            other_most.total_cmp(most).then(size.cmp(other))
        });
    }
    for (size, stages, most) in pending {
        if let Some(reason) = cannot_beat(size, ceilings.at(size), best.as_ref(), &goal) {
            alternatives.push(Alternative {
                tensor: size,
                outcome: Err(reason),
            });
            continue;
        }
        if per_gpu_first
            && best
                .as_ref()
                .is_some_and(|best| below(most, best.per_gpu()))
        {
            alternatives.push(Alternative {
                tensor: size,
                outcome: Err(format!(
                    "not solved: at most {most:.1} tokens/s per GPU over at least {stages} stage(s), even on the fastest GPUs"
                )),
            });
            continue;
        }
        match super::solve_sized(problem, size, &per_size) {
            Ok(plan) => {
                let candidate = Candidate { plan, tensor: size };
                alternatives.push(Alternative {
                    tensor: size,
                    outcome: Ok((candidate.plan.stages.len() as u32, candidate.speed())),
                });
                if best
                    .as_ref()
                    .is_none_or(|kept| candidate.beats(kept, &goal))
                {
                    best = Some(candidate);
                }
            }
            Err(unsatisfiable) => {
                refusals.push((size, format!("tensor {size}: {}", unsatisfiable.reason)));
                alternatives.push(Alternative {
                    tensor: size,
                    outcome: Err(format!("no plan ({})", unsatisfiable.reason)),
                });
            }
        }
    }
    alternatives.sort_by_key(|alternative| alternative.tensor);
    refusals.sort_by_key(|(size, _)| *size);
    let any_solvable = refusals.len() < alternatives.len();
    match (best, goal.min_tokens_per_second) {
        (Some(best), Some(min)) if best.speed() < min => {
            Err(too_slow(min, Some(&best), &alternatives))
        }
        (None, Some(min)) if any_solvable => Err(too_slow(min, None, &alternatives)),
        (Some(best), _) => Ok(InstancePlan {
            plan: best.plan,
            tensor: best.tensor,
            alternatives,
            goal,
        }),
        (None, _) => Err(Unsatisfiable {
            reason: "no tensor size gives a plan (parallelism.tensor: auto)".into(),
            details: refusals.into_iter().map(|(_, refusal)| refusal).collect(),
        }),
    }
}

/// The refusal when no size reaches the minimum speed: the fastest plan
/// found (if any size was solved) and what each size came to.
fn too_slow(min: f64, fastest: Option<&Candidate>, alternatives: &[Alternative]) -> Unsatisfiable {
    let fastest = match fastest {
        Some(best) => format!(
            "the fastest plan, tensor {} × {} stage(s), is predicted at {:.1} tokens/s",
            best.tensor,
            best.plan.stages.len(),
            best.speed()
        ),
        None => "no size could reach it even on the fastest free GPUs".to_string(),
    };
    Unsatisfiable {
        reason: format!(
            "no tensor size reaches parallelism.minTokensPerSecond {min}: {fastest}. Lower the minimum, or free or add faster GPUs"
        ),
        details: alternatives
            .iter()
            .map(|alternative| match &alternative.outcome {
                Ok((stages, speed)) => {
                    format!(
                        "tensor {} × {stages}: {speed:.1} tokens/s",
                        alternative.tensor
                    )
                }
                Err(reason) => format!("tensor {}: {reason}", alternative.tensor),
            })
            .collect(),
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
            if !stage.devices.contains(&device.id) {
                continue;
            }
            // A memory share leaves the rest of its GPU to later shares.
            match (&mut device.share, &stage.share) {
                (Some(DeviceShare::Memory { tenants }), Some(StageShare::Memory { bytes, .. })) => {
                    *tenants += 1;
                    device.memory_free_bytes = device.memory_free_bytes.saturating_sub(*bytes);
                }
                _ => device.allocated_to = Some(holder.to_string()),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::placement::Stages;
    use crate::placement::testutil::{H100, node, problem as sample};
    use crate::placement::{Optimize, SpeedGoal};

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

    fn with_goal(mut problem: Problem, optimize: Optimize, min: Option<f64>) -> Problem {
        problem.goal = SpeedGoal {
            optimize,
            min_tokens_per_second: min,
        };
        problem
    }

    /// Each size's plan solved on its own: (tensor, GPUs, tokens/s).
    fn every_size(problem: &Problem) -> Vec<(u32, u32, f64)> {
        tensor_candidates(problem)
            .into_iter()
            .filter_map(|size| {
                solve_parallelism(problem, TensorChoice::Fixed(size), &SolveOptions::default())
                    .ok()
                    .map(|fixed| {
                        let gpus = size * fixed.plan.stages.len() as u32;
                        (size, gpus, fixed.plan.performance.tokens_per_second)
                    })
            })
            .collect()
    }

    #[test]
    fn throughput_takes_the_most_tokens_per_gpu_and_says_so() {
        // An 8B model on an 8-GPU node: one GPU is the most efficient, eight
        // the fastest.
        let problem = sample(vec![node("a", 8, H100)], 8, 1, Stages::Auto);
        assert_eq!(problem.goal.optimize, Optimize::Throughput, "the default");
        let auto =
            solve_parallelism(&problem, TensorChoice::Auto, &SolveOptions::default()).unwrap();
        assert_eq!(auto.tensor, 1);
        let chosen = auto.plan.performance.tokens_per_second / f64::from(auto.tensor);
        for (size, gpus, speed) in every_size(&problem) {
            assert!(
                chosen >= speed / f64::from(gpus),
                "tensor {size} is more efficient"
            );
        }
        let note = auto.parallelism_note().unwrap();
        assert!(
            note.contains("throughput: the most tokens/s per GPU"),
            "{note}"
        );
        assert!(note.contains("per GPU)"), "{note}");
        // 70B in bf16 does not fit one H100: the sizes that hold it compete.
        let large = sample(vec![node("a", 8, H100)], 70, 1, Stages::Auto);
        let auto = solve_parallelism(&large, TensorChoice::Auto, &SolveOptions::default()).unwrap();
        let gpus = auto.tensor * auto.plan.stages.len() as u32;
        let chosen = auto.plan.performance.tokens_per_second / f64::from(gpus);
        for (size, gpus, speed) in every_size(&large) {
            assert!(
                chosen >= speed / f64::from(gpus) * (1.0 - 1e-9),
                "tensor {size}"
            );
        }
    }

    #[test]
    fn a_minimum_speed_takes_the_fewest_gpus_that_reach_it() {
        let base = sample(vec![node("a", 8, H100)], 8, 1, Stages::Auto);
        let sizes = every_size(&base);
        // Between the one-GPU and the eight-GPU speed: some size in between
        // is the cheapest that reaches it.
        let (one, eight) = (sizes[0].2, sizes[sizes.len() - 1].2);
        let min = (one + eight) / 2.0;
        for optimize in [Optimize::Throughput, Optimize::Latency] {
            let problem = with_goal(base.clone(), optimize, Some(min));
            let auto =
                solve_parallelism(&problem, TensorChoice::Auto, &SolveOptions::default()).unwrap();
            let speed = auto.plan.performance.tokens_per_second;
            let gpus = auto.tensor * auto.plan.stages.len() as u32;
            assert!(speed >= min, "{speed} reaches {min}");
            for (size, other_gpus, other_speed) in &sizes {
                assert!(
                    *other_gpus >= gpus || *other_speed < min,
                    "tensor {size} reaches {min} with {other_gpus} GPUs"
                );
            }
            assert!(auto.tensor > 1 && auto.tensor < 8, "{}", auto.tensor);
            let note = auto.parallelism_note().unwrap();
            assert!(
                note.contains(&format!("the fewest GPUs reaching {min} tokens/s")),
                "{note}"
            );
        }
    }

    #[test]
    fn a_minimum_no_size_reaches_is_refused_with_every_size_s_speed() {
        let problem = with_goal(
            sample(vec![node("a", 8, H100)], 8, 1, Stages::Auto),
            Optimize::Throughput,
            Some(100_000.0),
        );
        let refused =
            solve_parallelism(&problem, TensorChoice::Auto, &SolveOptions::default()).unwrap_err();
        assert!(
            refused.reason.contains("minTokensPerSecond 100000"),
            "{}",
            refused.reason
        );
        assert!(
            refused.reason.contains("Lower the minimum"),
            "{}",
            refused.reason
        );
        assert_eq!(refused.details.len(), tensor_candidates(&problem).len());
        // A fixed size is held to the minimum too.
        let fixed = solve_parallelism(&problem, TensorChoice::Fixed(2), &SolveOptions::default())
            .unwrap_err();
        assert!(fixed.reason.contains("tensor 2"), "{}", fixed.reason);
        assert!(
            fixed
                .reason
                .contains("below parallelism.minTokensPerSecond"),
            "{}",
            fixed.reason
        );
        // Reachable: the fixed size is kept as asked.
        let reachable = with_goal(problem, Optimize::Throughput, Some(1.0));
        let kept = solve_parallelism(&reachable, TensorChoice::Fixed(2), &SolveOptions::default())
            .unwrap();
        assert_eq!(kept.tensor, 2);
        assert!(kept.parallelism_note().is_none());
    }

    #[test]
    fn auto_is_at_least_as_fast_as_every_size_it_compared() {
        let problem = with_goal(
            sample(vec![node("a", 8, H100)], 70, 1, Stages::Auto),
            Optimize::Latency,
            None,
        );
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
        assert!(
            note.starts_with("tensor auto (latency: the most tokens/s) chose"),
            "{note}"
        );
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
        let problem = with_goal(
            sample(vec![node("a", 8, H100)], 8, 1, Stages::Auto),
            Optimize::Latency,
            None,
        );
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
