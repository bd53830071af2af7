//! One replica's plan as users ask for it, on top of `placement::solve`: a
//! fixed tensor size planned as asked, or `auto` tried size by size and,
//! when the instance says what it serves and the cluster has more than one
//! kind of GPU, on each kind alone as well as on all of them. Every plan is
//! judged by the goal (`judge`); a shape whose ceiling cannot beat the plan
//! in hand is not solved.

use std::cell::OnceCell;
use std::collections::BTreeSet;

use super::ceiling::CapacityCeiling;
use super::judge::{Judged, target};
use crate::placement::evaluate::{SpeedCeiling, eligible_devices};
use crate::placement::{Optimize, Plan, Problem, SolveOptions, SpeedGoal, Stages, Unsatisfiable};
use crate::serving::Capacity;

/// Largest tensor size `auto` tries (the CRD's limit for a fixed size).
const MAX_AUTO_TENSOR: u32 = 64;
/// Stages beyond the fewest `pipeline: auto` tries by capacity: each one
/// adds KV cache and a hop, and past the first two the hops win.
const MAX_EXTRA_STAGES: u32 = 2;

/// GPUs per shard: fixed, or chosen by the goal.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TensorChoice {
    Auto,
    Fixed(u32),
}

/// One shape `auto` compared, and what came of it.
#[derive(Clone, Debug, PartialEq)]
pub struct Alternative {
    pub tensor: u32,
    /// The stage count asked of this shape, when more than the fewest that
    /// hold the model (`pipeline: auto` by capacity); `None`: the fewest.
    pub stages: Option<u32>,
    /// The one GPU kind the candidate was planned on; `None`: any.
    pub kind: Option<String>,
    /// The best plan of this shape, or in words why there is none ("no plan
    /// (...)") or why it was not solved ("not solved: at most ...").
    pub outcome: Result<Verdict, String>,
}

/// A compared plan in figures.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Verdict {
    pub stages: u32,
    /// GPUs taken (a memory share counts as its fraction).
    pub gpus: f64,
    /// One stream's predicted tokens/s.
    pub tokens_per_second: f64,
    /// Requests/s at the latency target; `None` where it is missed or
    /// nothing is known of what the instance serves.
    pub requests_per_second: Option<f64>,
}

/// A replica's plan and how its parallelism was chosen.
#[derive(Clone, Debug, PartialEq)]
pub struct InstancePlan {
    pub plan: Plan,
    /// GPUs per shard of `plan`.
    pub tensor: u32,
    /// Every shape `auto` compared, by tensor size (the one-kind ones after
    /// the any-kind one); empty for a fixed size.
    pub alternatives: Vec<Alternative>,
    /// What the size was chosen for.
    pub goal: SpeedGoal,
    /// What the replica serves at the target (`None` without
    /// `Problem::served`; an error where the serving model has no answer).
    pub capacity: Option<Result<Capacity, String>>,
    /// The one GPU kind `auto` planned it on, when comparing kinds chose one.
    pub kind: Option<String>,
    /// GPUs the plan takes (a memory share counts as its fraction).
    pub gpus: f64,
    /// Whether the tensor size was `auto` (else fixed, and only the GPU
    /// kinds were compared).
    pub auto: bool,
}

impl InstancePlan {
    fn from_judged(
        best: Judged,
        kind: Option<String>,
        alternatives: Vec<Alternative>,
        goal: SpeedGoal,
    ) -> InstancePlan {
        InstancePlan {
            plan: best.plan,
            tensor: best.tensor,
            alternatives,
            goal,
            gpus: best.gpus,
            capacity: best.capacity,
            kind,
            auto: true,
        }
    }

    /// One sentence on the choice `auto` made, or `None` for a fixed size.
    pub fn parallelism_note(&self) -> Option<String> {
        if self.alternatives.is_empty() {
            return None;
        }
        let stages = self.plan.stages.len() as u32;
        // The chosen plan, found on any kind or on its own kind alone.
        let is_chosen = |alternative: &Alternative| {
            alternative.tensor == self.tensor
                && (alternative.kind.is_none() || alternative.kind == self.kind)
                && alternative.outcome.as_ref().is_ok_and(|verdict| {
                    verdict.stages == stages
                        && verdict.tokens_per_second == self.plan.performance.tokens_per_second
                })
        };
        // One-kind shapes without a plan of their own are only counted: the
        // any-kind shape of their size says what the size could do.
        let unplanned_kinds = self
            .alternatives
            .iter()
            .filter(|alternative| alternative.kind.is_some() && alternative.outcome.is_err())
            .count();
        let compared: Vec<String> = self
            .alternatives
            .iter()
            .filter(|alternative| !is_chosen(alternative))
            .filter(|alternative| alternative.kind.is_none() || alternative.outcome.is_ok())
            .map(|alternative| {
                let shape = match &alternative.kind {
                    Some(kind) => format!("{} on {kind}", alternative.tensor),
                    None => alternative.tensor.to_string(),
                };
                match (&alternative.outcome, alternative.stages) {
                    (Ok(verdict), _) => {
                        format!("{shape} × {}: {}", verdict.stages, figures(verdict))
                    }
                    (Err(reason), Some(stages)) => format!("{shape} × {stages}: {reason}"),
                    (Err(reason), None) => format!("{shape}: {reason}"),
                }
            })
            .collect();
        let verdict = Verdict {
            stages,
            gpus: self.gpus,
            tokens_per_second: self.plan.performance.tokens_per_second,
            requests_per_second: self.requests_per_second(),
        };
        let on = self
            .kind
            .as_ref()
            .map(|kind| format!(" on {kind}"))
            .unwrap_or_default();
        let chosen = if self.auto {
            format!(
                "tensor auto ({}) chose {} GPU(s) per shard × {stages} stage(s){on}: {}",
                goal_text(&self.goal, self.capacity.is_some()),
                self.tensor,
                figures(&verdict)
            )
        } else {
            format!(
                "tensor {} × {stages} stage(s) ({}) chose{on}: {}",
                self.tensor,
                goal_text(&self.goal, self.capacity.is_some()),
                figures(&verdict)
            )
        };
        let mut note = if compared.is_empty() && unplanned_kinds == 0 {
            format!("{chosen} (the only size that fits)")
        } else if compared.is_empty() {
            chosen
        } else {
            format!("{chosen}; compared tensor × stages {}", compared.join(", "))
        };
        if unplanned_kinds > 0 {
            note.push_str(&format!(
                "; {unplanned_kinds} size(s) on one GPU kind alone not solved (that kind's best figures cannot beat the choice) or without a plan"
            ));
        }
        Some(note)
    }

    /// Requests/s at the target, where it is met.
    pub fn requests_per_second(&self) -> Option<f64> {
        self.capacity
            .as_ref()?
            .as_ref()
            .ok()?
            .at_slo
            .map(|at| at.requests_per_second)
    }
}

/// A verdict's figures in words.
fn figures(verdict: &Verdict) -> String {
    let gpus = verdict.gpus.max(f64::MIN_POSITIVE);
    match verdict.requests_per_second {
        Some(rps) => format!(
            "{rps:.2} requests/s at the target ({:.2} per GPU), {:.1} tokens/s alone",
            rps / gpus,
            verdict.tokens_per_second
        ),
        None => format!(
            "{:.1} tokens/s ({:.1} per GPU)",
            verdict.tokens_per_second,
            verdict.tokens_per_second / gpus
        ),
    }
}

/// What the goal compares, in words.
fn goal_text(goal: &SpeedGoal, served: bool) -> String {
    let optimize = match (goal.optimize, served) {
        (Optimize::Throughput, true) => "throughput: the most requests/s at the target per GPU",
        (Optimize::Throughput, false) => "throughput: the most tokens/s per GPU",
        (Optimize::Latency, _) => "latency: the most tokens/s",
    };
    match goal.min_tokens_per_second {
        Some(min) if !served => format!("the fewest GPUs reaching {min} tokens/s, then {optimize}"),
        Some(min) => format!("every user at {min} tokens/s or more, then {optimize}"),
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

/// `problem` on GPUs of `kind` alone: the nodes with one, and the selector
/// excluding the other devices there.
fn restricted_to(problem: &Problem, kind: &str) -> Problem {
    let mut selector = problem.selector.clone();
    selector.kind = Some(kind.to_string());
    Problem {
        nodes: problem
            .nodes
            .iter()
            .filter(|node| node.devices.iter().any(|device| device.product == kind))
            .cloned()
            .collect(),
        model: problem.model.clone(),
        tensor: problem.tensor,
        stages: problem.stages,
        weights: problem.weights,
        max_temperature_c: problem.max_temperature_c,
        selector,
        strategy: problem.strategy,
        replica_nodes: problem.replica_nodes.clone(),
        goal: problem.goal,
        served: problem.served.clone(),
        one_device: problem.one_device,
    }
}

/// The GPU kinds (products) a plan of the problem may use, when the
/// instance says what it serves, shares no GPU and there is more than one:
/// each is then compared alone besides all together.
fn kinds(problem: &Problem) -> Vec<String> {
    if problem.served.is_none() || problem.selector.kind.is_some() {
        return Vec::new();
    }
    let eligible: Vec<&crate::placement::Device> = eligible_devices(problem).collect();
    // A sharing shard takes the smallest piece that holds it, split GPUs
    // first (`share_sizing`); its kinds are not compared.
    if eligible.iter().any(|device| device.share.is_some()) {
        return Vec::new();
    }
    let kinds: BTreeSet<&str> = eligible
        .iter()
        .map(|device| device.product.as_str())
        .collect();
    if kinds.len() < 2 {
        return Vec::new();
    }
    kinds.into_iter().map(str::to_string).collect()
}

/// Whether a ceiling is below a bar. The margin keeps rounding in the speed
/// model from skipping a size that would tie.
fn below(value: f64, bar: f64) -> bool {
    value * (1.0 + 1e-9) < bar
}

/// Why a size need not be solved: no plan of it could beat `best`. One
/// stream's speed is bounded by `SpeedCeiling` (every layer on the fastest
/// free GPU, all-reduces over the fastest link, no hops, one stage); the
/// requests/s at the target per GPU by `CapacityCeiling`.
fn cannot_beat(
    problem: &Problem,
    size: u32,
    speed_ceiling: f64,
    capacity_ceiling: Option<f64>,
    best: Option<&Judged>,
    goal: &SpeedGoal,
) -> Option<String> {
    if problem.served.is_none()
        && let Some(min) = goal.min_tokens_per_second
    {
        if below(speed_ceiling, min) {
            return Some(format!(
                "not solved: at most {speed_ceiling:.1} tokens/s even on the fastest GPUs, below the {min} asked for"
            ));
        }
        if let Some(best) = best.filter(|best| best.speed() >= min)
            && f64::from(size) > best.gpus
        {
            return Some(format!(
                "not solved: takes at least {size} GPUs, and {} reach {min} tokens/s",
                best.gpus
            ));
        }
        // Until a plan reaches the minimum, any size might be the one that does.
        return None;
    }
    let best = best?;
    let meets = best.at_target().is_some();
    // Where nothing met the target yet, the fastest plan is the best (and
    // what a refusal quotes): a shape that cannot meet it either and cannot
    // be faster changes nothing.
    if !meets && capacity_ceiling == Some(0.0) && below(speed_ceiling, best.speed()) {
        return Some(
            "not solved: misses the target even on the best GPUs, and is no faster than the best"
                .to_string(),
        );
    }
    match (goal.optimize, capacity_ceiling) {
        (Optimize::Latency, _) if below(speed_ceiling, best.speed()) => Some(format!(
            "not solved: at most {speed_ceiling:.1} tokens/s even on the fastest GPUs"
        )),
        (Optimize::Throughput, Some(ceiling))
            if meets && below(ceiling, best.requests_per_gpu()) =>
        {
            Some(if ceiling > 0.0 {
                format!(
                    "not solved: at most {ceiling:.2} requests/s at the target per GPU even on the best GPUs"
                )
            } else {
                "not solved: misses the target even on the best GPUs".to_string()
            })
        }
        (Optimize::Throughput, None)
            if below(speed_ceiling / f64::from(size), best.speed() / best.gpus) =>
        {
            Some(format!(
                "not solved: at most {:.1} tokens/s per GPU even on the fastest GPUs",
                speed_ceiling / f64::from(size)
            ))
        }
        _ => None,
    }
}

/// One shape to solve: a tensor size, on one GPU kind or any.
struct Shape {
    tensor: u32,
    kind: Option<String>,
    /// The fewest stages a plan of it can have, or the count asked of it.
    stages: u32,
    /// `stages` when it is asked of the plan: more than the fewest.
    asked_stages: Option<u32>,
    /// The most tokens/s (and requests/s at the target per GPU) its plans
    /// could reach.
    speed_ceiling: f64,
    capacity_ceiling: Option<f64>,
}

/// The best plan for one replica. A fixed size is planned as asked (and
/// refused when it cannot reach `goal.min_tokens_per_second`). With
/// `TensorChoice::Auto` every candidate shape is compared by the goal (see
/// `Judged::beats`).
pub fn solve_parallelism(
    problem: &Problem,
    tensor: TensorChoice,
    options: &SolveOptions,
) -> Result<InstancePlan, Unsatisfiable> {
    let goal = problem.goal;
    let kinds = kinds(problem);
    // A fixed size on one kind of GPU is planned as asked; on several, the
    // kinds are compared at that size.
    let (sizes, auto) = match tensor {
        TensorChoice::Fixed(size) if kinds.is_empty() => {
            return solve_fixed(problem, size, options);
        }
        TensorChoice::Fixed(size) => (vec![size], false),
        TensorChoice::Auto => (tensor_candidates(problem), true),
    };
    // One problem per kind, restricted to it, made when a shape on it is
    // solved: only the nodes with a GPU of that kind, so the solve prepares
    // and searches those alone.
    let restricted: Vec<OnceCell<Problem>> = kinds.iter().map(|_| OnceCell::new()).collect();
    let on_kind = |kind: &str| -> &Problem {
        let index = kinds.iter().position(|k| k == kind).unwrap_or(0);
        restricted[index].get_or_init(|| restricted_to(problem, kind))
    };
    // The speed ceiling reads every free device: the whole cluster's for
    // any kind, that kind's alone for one.
    let speeds = SpeedCeiling::new(problem);
    let stages_by_capacity = problem.stages == Stages::Auto
        && problem.served.is_some()
        && goal.optimize == Optimize::Throughput;
    let layers = problem.model.layers;
    let mut shapes: Vec<Shape> = Vec::new();
    for kind in std::iter::once(None).chain(kinds.iter().map(Some)) {
        let of_kind = kind.map(|kind| SpeedCeiling::of_kind(problem, Some(kind)));
        let speeds = of_kind.as_ref().unwrap_or(&speeds);
        let capacities = problem.served.as_ref().map(|served| {
            (
                served,
                CapacityCeiling::new(problem, kind.map(String::as_str)),
            )
        });
        let ceiling_at = |size: u32, stages: u32| {
            capacities
                .as_ref()
                .map(|(served, ceiling)| ceiling.requests_per_gpu(served, problem, size, stages))
        };
        for &size in &sizes {
            let fewest = speeds.fewest_stages(size);
            let shape = |stages: u32, capacity_ceiling: Option<f64>| Shape {
                tensor: size,
                kind: kind.cloned(),
                stages,
                asked_stages: (stages > fewest).then_some(stages),
                speed_ceiling: speeds.at(size),
                capacity_ceiling,
            };
            let fewest_ceiling = ceiling_at(size, fewest);
            shapes.push(shape(fewest, fewest_ceiling));
            // More stages hold more KV cache (a larger batch) and pay a hop
            // each: tried while the ceiling still climbs, and only where the
            // fewest stages could meet the target. Spreading a replica that
            // cannot over more stages serves it, but on many GPUs: on the
            // cluster benchmark's 64-node sequence that took 89 more GPUs
            // and served 8% less in all (docs/benchmarks.md).
            // (A memory share's ceiling is infinite, so it never climbs.)
            let Some(mut bar) =
                fewest_ceiling.filter(|ceiling| stages_by_capacity && *ceiling > 0.0)
            else {
                continue;
            };
            for stages in (fewest + 1..=fewest + MAX_EXTRA_STAGES).take_while(|s| *s <= layers) {
                let ceiling = ceiling_at(size, stages).unwrap_or(0.0);
                if !below(bar, ceiling) {
                    break;
                }
                shapes.push(shape(stages, Some(ceiling)));
                bar = ceiling;
            }
        }
    }
    // The likely winner first lets its bar skip more shapes: the best
    // ceiling per GPU under throughput, the largest group under latency.
    match (
        goal.optimize,
        goal.min_tokens_per_second,
        problem.served.is_some(),
    ) {
        (Optimize::Throughput, _, true) => shapes.sort_by(|a, b| {
            let (a_most, b_most) = (
                a.capacity_ceiling.unwrap_or(0.0),
                b.capacity_ceiling.unwrap_or(0.0),
            );
            // A size on any kind before the same size on one kind alone
            // (its ceiling is never lower), so the one-kind shape can be
            // skipped when the any-kind plan is on that kind already.
            b_most
                .total_cmp(&a_most)
                .then(a.tensor.cmp(&b.tensor))
                .then(a.kind.is_some().cmp(&b.kind.is_some()))
        }),
        (Optimize::Throughput, None, false) => shapes.sort_by(|a, b| {
            let per_gpu = |shape: &Shape| {
                shape.speed_ceiling / (f64::from(shape.tensor) * f64::from(shape.stages))
            };
            per_gpu(b)
                .total_cmp(&per_gpu(a))
                .then(a.tensor.cmp(&b.tensor))
        }),
        (Optimize::Latency, None, _) => shapes.reverse(),
        _ => {}
    }
    // The shapes share the step budget, so `auto` searches no longer than a
    // fixed size does (the deadline is shared anyway).
    let per_shape = SolveOptions {
        deadline: options.deadline,
        max_steps: (options.max_steps / sizes.len().max(1) as u64).max(1),
    };
    let mut best: Option<(Judged, Option<String>)> = None;
    let mut alternatives = Vec::with_capacity(shapes.len());
    let mut refusals = Vec::new();
    let per_gpu_first =
        goal.optimize == Optimize::Throughput && goal.min_tokens_per_second.is_none();
    // The GPU kind of each shape's any-kind plan, where it has one kind.
    let mut any_kind_on: Vec<(u32, Option<u32>, Option<String>)> = Vec::new();
    for shape in shapes {
        let asked_stages = shape.asked_stages;
        let skip = cannot_beat(
            problem,
            shape.tensor,
            shape.speed_ceiling,
            shape.capacity_ceiling,
            best.as_ref().map(|(judged, _)| judged),
            &goal,
        )
        .or_else(|| {
            let most = shape.speed_ceiling / (f64::from(shape.tensor) * f64::from(shape.stages));
            (per_gpu_first
                && problem.served.is_none()
                && best
                    .as_ref()
                    .is_some_and(|(best, _)| below(most, best.speed() / best.gpus)))
            .then(|| {
                format!(
                    "not solved: at most {most:.1} tokens/s per GPU over at least {} stage(s), even on the fastest GPUs",
                    shape.stages
                )
            })
        })
        .or_else(|| {
            let kind = shape.kind.as_ref()?;
            any_kind_on
                .iter()
                .any(|(size, stages, on)| {
                    (*size, *stages) == (shape.tensor, asked_stages) && on.as_ref() == Some(kind)
                })
                .then(|| "not solved: the plan on any kind is on this kind already".to_string())
        });
        if let Some(reason) = skip {
            alternatives.push(Alternative {
                tensor: shape.tensor,
                stages: asked_stages,
                kind: shape.kind,
                outcome: Err(reason),
            });
            continue;
        }
        let on = match &shape.kind {
            Some(kind) => on_kind(kind),
            None => problem,
        };
        let staged;
        let on = match asked_stages {
            Some(stages) => {
                staged = Problem {
                    stages: Stages::Fixed(stages),
                    ..on.clone()
                };
                &staged
            }
            None => on,
        };
        match crate::placement::solve_sized(on, shape.tensor, &per_shape) {
            Ok(plan) => {
                if shape.kind.is_none() {
                    any_kind_on.push((shape.tensor, asked_stages, kind_of_plan(problem, &plan)));
                }
                let judged = Judged::new(on, plan, shape.tensor);
                alternatives.push(Alternative {
                    tensor: shape.tensor,
                    stages: asked_stages,
                    kind: shape.kind.clone(),
                    outcome: Ok(Verdict {
                        stages: judged.stages(),
                        gpus: judged.gpus,
                        tokens_per_second: judged.speed(),
                        requests_per_second: judged.at_target().map(|at| at.requests_per_second),
                    }),
                });
                if best
                    .as_ref()
                    .is_none_or(|(kept, _)| judged.beats(kept, &goal))
                {
                    best = Some((judged, shape.kind));
                }
            }
            Err(unsatisfiable) => {
                if shape.kind.is_none() && asked_stages.is_none() {
                    refusals.push((
                        shape.tensor,
                        format!("tensor {}: {}", shape.tensor, unsatisfiable.reason),
                    ));
                    if !auto {
                        // A fixed size's own refusal, as without kinds.
                        return Err(unsatisfiable);
                    }
                }
                alternatives.push(Alternative {
                    tensor: shape.tensor,
                    stages: asked_stages,
                    kind: shape.kind,
                    outcome: Err(format!("no plan ({})", unsatisfiable.reason)),
                });
            }
        }
    }
    alternatives.sort_by(|a, b| {
        (a.tensor, a.stages)
            .cmp(&(b.tensor, b.stages))
            .then(a.kind.cmp(&b.kind))
    });
    refusals.sort_by_key(|(size, _)| *size);
    let any_solvable = alternatives.iter().any(|alternative| {
        !alternative
            .outcome
            .as_ref()
            .is_err_and(|why| why.starts_with("no plan"))
    });
    match (best, goal.min_tokens_per_second) {
        (Some((best, _)), _) if misses_required_target(problem, &best) => {
            Err(target_missed(problem, &best, &alternatives))
        }
        (Some((best, _)), Some(min)) if problem.served.is_none() && best.speed() < min => {
            Err(too_slow(min, Some(&best), &alternatives))
        }
        (None, Some(min)) if any_solvable => Err(too_slow(min, None, &alternatives)),
        (Some((best, _)), _) => {
            let kind = kind_of_plan(problem, &best.plan).filter(|_| !kinds.is_empty());
            let mut chosen = InstancePlan::from_judged(best, kind, alternatives, goal);
            chosen.auto = auto;
            Ok(chosen)
        }
        (None, _) => Err(Unsatisfiable {
            reason: "no tensor size gives a plan (parallelism.tensor: auto)".into(),
            details: refusals.into_iter().map(|(_, refusal)| refusal).collect(),
        }),
    }
}

/// A fixed size, planned as asked and held to the goal's minimum and,
/// where it is required, the latency target.
fn solve_fixed(
    problem: &Problem,
    size: u32,
    options: &SolveOptions,
) -> Result<InstancePlan, Unsatisfiable> {
    let goal = problem.goal;
    let plan = crate::placement::solve_sized(problem, size, options)?;
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
    let judged = Judged::new(problem, plan, size);
    if misses_required_target(problem, &judged) {
        return Err(target_missed(problem, &judged, &[]));
    }
    let mut chosen = InstancePlan::from_judged(judged, None, Vec::new(), goal);
    chosen.auto = false;
    Ok(chosen)
}

/// The one GPU kind all of a plan's devices are of, if they are.
fn kind_of_plan(problem: &Problem, plan: &Plan) -> Option<String> {
    let mut products = plan.stages.iter().flat_map(|stage| {
        let node = problem.nodes.iter().find(|node| node.name == stage.node);
        stage.devices.iter().map(move |id| {
            node.and_then(|node| node.devices.iter().find(|device| &device.id == id))
                .map(|device| device.product.as_str())
        })
    });
    let first = products.next()??;
    products
        .all(|product| product == Some(first))
        .then(|| first.to_string())
}

/// Whether the best plan misses a target the instance requires.
fn misses_required_target(problem: &Problem, best: &Judged) -> bool {
    let required = problem.served.as_ref().is_some_and(|served| {
        served.target_required || problem.goal.min_tokens_per_second.is_some()
    });
    required && best.at_target().is_none()
}

/// The refusal when no plan meets the required target: the best there is,
/// and what would do.
fn target_missed(problem: &Problem, best: &Judged, alternatives: &[Alternative]) -> Unsatisfiable {
    let best_tpot = best.best_tpot_ms();
    let wanted = problem
        .served
        .as_ref()
        .map(|served| target(served, &problem.goal))
        .unwrap_or_default();
    let reason = match &best.capacity {
        Some(Err(why)) => format!(
            "no plan serves a request of the typical length: {why}. Lower serving.inputTokens or outputTokens, set a smaller model.kvCacheGiB, or use GPUs with more memory"
        ),
        _ => {
            let ttft = best
                .capacity
                .as_ref()
                .and_then(|capacity| capacity.as_ref().ok())
                .and_then(|capacity| capacity.curve.first())
                .map_or(0.0, |point| point.ttft_ms);
            let up = |ms: f64| (ms * 10.0).ceil() / 10.0;
            let tpot = wanted.max_tpot_ms.unwrap_or_default();
            let by_minimum = problem.goal.min_tokens_per_second.filter(|_| {
                problem
                    .served
                    .as_ref()
                    .is_some_and(|served| tpot < served.serving.max_time_per_output_token_ms)
            });
            let (asked, allow_tpot) = match by_minimum {
                Some(min) => (
                    format!("parallelism.minTokensPerSecond {min} ({tpot} ms per token)"),
                    format!(
                        "lower parallelism.minTokensPerSecond to {:.1}",
                        (1e3 / best_tpot * 10.0).floor() / 10.0
                    ),
                ),
                None => (
                    format!("serving.maxTimePerOutputTokenMs {tpot}"),
                    format!(
                        "allow {} ms per token (serving.maxTimePerOutputTokenMs)",
                        up(best_tpot)
                    ),
                ),
            };
            // Only the targets missed are named; where neither is (the
            // replica misses them only under load), both are.
            let tpot_missed = best_tpot > tpot;
            let ttft_missed = wanted.max_ttft_ms.filter(|max| ttft > *max);
            let (mut missed, mut allow) = (Vec::new(), Vec::new());
            if tpot_missed || ttft_missed.is_none() {
                missed.push(asked);
                allow.push(allow_tpot);
            }
            if let Some(max) = ttft_missed.or(wanted.max_ttft_ms.filter(|_| !tpot_missed)) {
                missed.push(format!("serving.maxTimeToFirstTokenMs {max}"));
                allow.push(format!(
                    "{} ms to the first token (serving.maxTimeToFirstTokenMs)",
                    up(ttft)
                ));
            }
            let elsewhere = faster_kinds(problem);
            let or_use = if elsewhere.is_empty() {
                "faster GPUs".to_string()
            } else {
                elsewhere.join(" or ")
            };
            format!(
                "at best {best_tpot:.1} ms per token ({ttft:.0} ms to the first token) on these GPUs, against {}: {}, or use {or_use}",
                missed.join(" and "),
                allow.join(" and "),
            )
        }
    };
    Unsatisfiable {
        reason,
        details: alternatives
            .iter()
            .filter_map(|alternative| {
                let on = alternative
                    .kind
                    .as_ref()
                    .map(|kind| format!(" on {kind}"))
                    .unwrap_or_default();
                match &alternative.outcome {
                    Ok(verdict) => Some(format!(
                        "tensor {}{on} × {}: {:.1} ms per token alone",
                        alternative.tensor,
                        verdict.stages,
                        1e3 / verdict.tokens_per_second.max(f64::MIN_POSITIVE)
                    )),
                    Err(reason) if alternative.kind.is_none() => {
                        Some(format!("tensor {}: {reason}", alternative.tensor))
                    }
                    Err(_) => None,
                }
            })
            .collect(),
    }
}

/// GPU kinds in the cluster outside the plan's reach (held, or not chosen
/// by the selector) whose best figures would meet the target.
fn faster_kinds(problem: &Problem) -> Vec<String> {
    let Some(served) = &problem.served else {
        return Vec::new();
    };
    let mut open = problem.clone();
    open.selector = Default::default();
    let mut found = BTreeSet::new();
    for node in &mut open.nodes {
        for device in &mut node.devices {
            device.allocated_to = None;
        }
    }
    let reachable: BTreeSet<String> = eligible_devices(problem)
        .map(|device| device.product.clone())
        .collect();
    let all: BTreeSet<String> = eligible_devices(&open)
        .map(|device| device.product.clone())
        .collect();
    let speeds = SpeedCeiling::new(&open);
    for kind in all.difference(&reachable) {
        let ceiling = CapacityCeiling::new(&open, Some(kind));
        let meets = tensor_candidates(&open).into_iter().any(|size| {
            ceiling.requests_per_gpu(served, &open, size, speeds.fewest_stages(size)) > 0.0
        });
        if meets {
            found.insert(kind.clone());
        }
    }
    found.into_iter().collect()
}

/// The refusal when no size reaches the minimum speed: the fastest plan
/// found (if any size was solved) and what each size came to.
fn too_slow(min: f64, fastest: Option<&Judged>, alternatives: &[Alternative]) -> Unsatisfiable {
    let fastest = match fastest {
        Some(best) => format!(
            "the fastest plan, tensor {} × {} stage(s), is predicted at {:.1} tokens/s",
            best.tensor,
            best.stages(),
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
                Ok(verdict) => format!(
                    "tensor {} × {}: {:.1} tokens/s",
                    alternative.tensor, verdict.stages, verdict.tokens_per_second
                ),
                Err(reason) => format!("tensor {}: {reason}", alternative.tensor),
            })
            .collect(),
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
