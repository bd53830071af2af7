//! Plain enumeration of every plan, for checking the search on small problems.
//! It shares only the objective (`PreparedProblem::evaluate`) and device eligibility
//! with the search: no twin classes, no bounds, no greedy.

use super::evaluate::PreparedProblem;
use super::plan::Plan;
use super::problem::{Problem, Stages};

/// The best plan by trying every set of disjoint device groups; `None` when no
/// set holds the model. Exponential: only for small problems (tests).
pub fn best_by_enumeration(problem: &Problem) -> Option<Plan> {
    let ctx = PreparedProblem::new(problem);
    let tensor = problem.tensor as usize;
    if tensor == 0 || problem.model.layers == 0 {
        return None;
    }
    let mut groups: Vec<(usize, Vec<usize>)> = Vec::new();
    for node in 0..problem.nodes.len() {
        let eligible: Vec<usize> = (0..problem.nodes[node].devices.len())
            .filter(|&device| ctx.eligible(node, device))
            .collect();
        combinations(&eligible, tensor, &mut |set| {
            groups.push((node, set.to_vec()))
        });
    }
    let counts: Vec<u32> = match problem.stages {
        Stages::Fixed(stages) => vec![stages],
        Stages::Auto => (1..=problem.model.layers).collect(),
    };
    for stages in counts {
        let mut best: Option<Plan> = None;
        let mut chosen = Vec::new();
        pick(&ctx, &groups, stages as usize, 0, &mut chosen, &mut best);
        if best.is_some() {
            return best;
        }
    }
    None
}

fn pick(
    ctx: &PreparedProblem,
    groups: &[(usize, Vec<usize>)],
    stages: usize,
    start: usize,
    chosen: &mut Vec<usize>,
    best: &mut Option<Plan>,
) {
    if chosen.len() == stages {
        let set: Vec<(usize, Vec<usize>)> = chosen.iter().map(|&i| groups[i].clone()).collect();
        if let Ok(plan) = ctx.evaluate(&set)
            && best
                .as_ref()
                .is_none_or(|current| plan.score.total > current.score.total)
        {
            *best = Some(plan);
        }
        return;
    }
    for candidate in start..groups.len() {
        let overlaps = chosen.iter().any(|&picked| {
            groups[picked].0 == groups[candidate].0
                && groups[picked]
                    .1
                    .iter()
                    .any(|device| groups[candidate].1.contains(device))
        });
        if !overlaps {
            chosen.push(candidate);
            pick(ctx, groups, stages, candidate + 1, chosen, best);
            chosen.pop();
        }
    }
}

fn combinations(items: &[usize], size: usize, emit: &mut dyn FnMut(&[usize])) {
    fn go(
        items: &[usize],
        size: usize,
        start: usize,
        current: &mut Vec<usize>,
        emit: &mut dyn FnMut(&[usize]),
    ) {
        if current.len() == size {
            emit(current);
            return;
        }
        for i in start..items.len() {
            current.push(items[i]);
            go(items, size, i + 1, current, emit);
            current.pop();
        }
    }
    go(items, size, 0, &mut Vec::with_capacity(size), emit);
}
