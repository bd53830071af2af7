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
    let t = problem.tensor as usize;
    if t == 0 || problem.model.layers == 0 {
        return None;
    }
    let mut groups: Vec<(usize, Vec<usize>)> = Vec::new();
    for ni in 0..problem.nodes.len() {
        let eligible: Vec<usize> = (0..problem.nodes[ni].devices.len())
            .filter(|&d| ctx.eligible(ni, d))
            .collect();
        combinations(&eligible, t, &mut |set| groups.push((ni, set.to_vec())));
    }
    let counts: Vec<u32> = match problem.stages {
        Stages::Fixed(k) => vec![k],
        Stages::Auto => (1..=problem.model.layers).collect(),
    };
    for k in counts {
        let mut best: Option<Plan> = None;
        let mut chosen = Vec::new();
        pick(&ctx, &groups, k as usize, 0, &mut chosen, &mut best);
        if best.is_some() {
            return best;
        }
    }
    None
}

fn pick(
    ctx: &PreparedProblem,
    groups: &[(usize, Vec<usize>)],
    k: usize,
    start: usize,
    chosen: &mut Vec<usize>,
    best: &mut Option<Plan>,
) {
    if chosen.len() == k {
        let set: Vec<(usize, Vec<usize>)> = chosen.iter().map(|&i| groups[i].clone()).collect();
        if let Ok(plan) = ctx.evaluate(&set)
            && best
                .as_ref()
                .is_none_or(|b| plan.score.total > b.score.total)
        {
            *best = Some(plan);
        }
        return;
    }
    for i in start..groups.len() {
        let overlaps = chosen.iter().any(|&j| {
            groups[j].0 == groups[i].0 && groups[j].1.iter().any(|d| groups[i].1.contains(d))
        });
        if !overlaps {
            chosen.push(i);
            pick(ctx, groups, k, i + 1, chosen, best);
            chosen.pop();
        }
    }
}

fn combinations(items: &[usize], k: usize, emit: &mut dyn FnMut(&[usize])) {
    fn go(
        items: &[usize],
        k: usize,
        start: usize,
        cur: &mut Vec<usize>,
        emit: &mut dyn FnMut(&[usize]),
    ) {
        if cur.len() == k {
            emit(cur);
            return;
        }
        for i in start..items.len() {
            cur.push(items[i]);
            go(items, k, i + 1, cur, emit);
            cur.pop();
        }
    }
    go(items, k, 0, &mut Vec::with_capacity(k), emit);
}
