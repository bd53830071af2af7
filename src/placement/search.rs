//! Branch-and-bound over sets of groups.
//!
//! Variables are the shards. Stages are interchangeable until they are put in
//! pipeline order, so the search assigns groups to shards in candidate order
//! (shard `i+1` takes a candidate at or after shard `i`'s): every set is visited
//! once instead of `k!` times. Among the unassigned shards the next one taken is
//! the one with the fewest live candidates (MRV); since all unassigned shards
//! share the same candidate suffix this is the next shard in order, and the count
//! doubles as the forward check: when fewer live candidates remain than shards,
//! the branch is dead. Forward checking also drops candidates whose devices are
//! taken and branches whose remaining capacity cannot reach the layer count.
//! Branch-and-bound prunes a candidate when an optimistic bound on the final
//! score cannot beat the best plan found; the first incumbent is the best of
//! three greedy plans, so a deadline always has an answer.

use std::collections::{BTreeMap, BTreeSet};

use super::compile::{Compiled, Group};
use super::evaluate::{HOP_SAME_NODE, memory_part};
use super::plan::{Plan, Unsatisfiable};
use super::problem::SolveOptions;

/// Scores closer than this count as equal, so ties keep the earlier plan.
const EPS: f64 = 1e-12;
/// How often (in steps) the deadline is looked at.
const DEADLINE_EVERY: u64 = 1024;

/// Devices taken so far, per node and twin class.
struct Usage {
    used: Vec<Vec<u32>>,
    groups_on: Vec<u32>,
    /// Nodes with at least one group, by index (= network order).
    nodes_in_use: BTreeSet<usize>,
}

impl Usage {
    fn new(c: &Compiled) -> Self {
        Self {
            used: c.nodes.iter().map(|n| vec![0; n.classes.len()]).collect(),
            groups_on: vec![0; c.nodes.len()],
            nodes_in_use: BTreeSet::new(),
        }
    }

    fn fits(&self, c: &Compiled, g: &Group) -> bool {
        let classes = &c.nodes[g.node].classes;
        g.counts
            .iter()
            .all(|&(cl, k)| self.used[g.node][cl] + k <= classes[cl].len() as u32)
    }

    /// Twin nodes are used in order: a node's first group needs its twin
    /// predecessor in use already.
    fn twin_order_ok(&self, c: &Compiled, g: &Group) -> bool {
        self.groups_on[g.node] > 0
            || c.nodes[g.node]
                .twin_prev
                .is_none_or(|prev| self.groups_on[prev] > 0)
    }

    fn take(&mut self, g: &Group) {
        for &(cl, k) in &g.counts {
            self.used[g.node][cl] += k;
        }
        self.groups_on[g.node] += 1;
        self.nodes_in_use.insert(g.node);
    }

    fn give_back(&mut self, g: &Group) {
        for &(cl, k) in &g.counts {
            self.used[g.node][cl] -= k;
        }
        self.groups_on[g.node] -= 1;
        if self.groups_on[g.node] == 0 {
            self.nodes_in_use.remove(&g.node);
        }
    }
}

/// Concrete devices for abstract groups: the lowest-indexed unused twins.
fn materialize(c: &Compiled, chosen: &[usize]) -> Vec<(usize, Vec<usize>)> {
    let mut next: Vec<Vec<usize>> = c.nodes.iter().map(|n| vec![0; n.classes.len()]).collect();
    chosen
        .iter()
        .map(|&gi| {
            let g = &c.groups[gi];
            let node = &c.nodes[g.node];
            let mut devices = Vec::with_capacity(c.ctx.p.tensor as usize);
            for &(cl, k) in &g.counts {
                let start = next[g.node][cl];
                devices.extend_from_slice(&node.classes[cl][start..start + k as usize]);
                next[g.node][cl] += k as usize;
            }
            (node.src, devices)
        })
        .collect()
}

fn evaluated(c: &Compiled, groups: &[(usize, Vec<usize>)]) -> Option<Plan> {
    c.ctx.evaluate(groups).ok()
}

/// Groups in candidate order, repeating a group while its devices last.
fn fill_in_order(c: &Compiled, order: impl Iterator<Item = usize>) -> Vec<usize> {
    let k = c.stages as usize;
    let mut usage = Usage::new(c);
    let mut chosen = Vec::with_capacity(k);
    for gi in order {
        while chosen.len() < k && usage.fits(c, &c.groups[gi]) {
            usage.take(&c.groups[gi]);
            chosen.push(gi);
        }
        if chosen.len() == k {
            break;
        }
    }
    chosen
}

/// The best of three quick plans: the most promising groups; the most promising
/// groups packed node by node (few network hops); the largest groups (always
/// holds the model when anything does).
pub(crate) fn greedy(c: &Compiled) -> Result<Plan, Unsatisfiable> {
    let mut candidates = Vec::new();
    let by_value = fill_in_order(c, 0..c.groups.len());
    if by_value.len() == c.stages as usize {
        candidates.push(materialize(c, &by_value));
    }
    // Nodes ranked by their best group; all of a node's groups before the next node.
    let mut node_rank: BTreeMap<usize, usize> = BTreeMap::new();
    for (gi, g) in c.groups.iter().enumerate() {
        node_rank.entry(g.node).or_insert(gi);
    }
    let mut packed: Vec<usize> = (0..c.groups.len()).collect();
    packed.sort_by_key(|&gi| (node_rank[&c.groups[gi].node], gi));
    let by_node = fill_in_order(c, packed.into_iter());
    if by_node.len() == c.stages as usize {
        candidates.push(materialize(c, &by_node));
    }
    candidates.push(c.capacity_plan.clone());

    let mut best: Option<Plan> = None;
    for groups in &candidates {
        if let Some(plan) = evaluated(c, groups)
            && best
                .as_ref()
                .is_none_or(|b| plan.score.total > b.score.total + EPS)
        {
            best = Some(plan);
        }
    }
    best.ok_or_else(|| Unsatisfiable {
        // `stage_count` proved the capacity plan holds the model, so this is a bug.
        reason: "internal error: the capacity plan did not evaluate".into(),
        details: vec![],
    })
}

struct Search<'c, 'o> {
    c: &'c Compiled<'c>,
    opts: &'o SolveOptions<'o>,
    k: usize,
    layers: u64,
    demand: f64,
    terms: f64,
    usage: Usage,
    chosen: Vec<usize>,
    cap_sum: u64,
    additive_sum: f64,
    free_sum: f64,
    intra_sum: f64,
    /// Cost of the hops between the distinct nodes in use, in network order.
    path_cost: f64,
    suffix_max_additive: Vec<f64>,
    suffix_max_free: Vec<f64>,
    suffix_max_cap: Vec<u32>,
    best: Plan,
    steps: u64,
    stopped: bool,
}

pub(crate) fn run(c: &Compiled, opts: &SolveOptions) -> Result<Plan, Unsatisfiable> {
    let incumbent = greedy(c)?;
    let n = c.groups.len();
    let mut suffix_max_additive = vec![f64::NEG_INFINITY; n + 1];
    let mut suffix_max_free = vec![0.0; n + 1];
    let mut suffix_max_cap = vec![0u32; n + 1];
    for i in (0..n).rev() {
        let g = &c.groups[i];
        suffix_max_additive[i] = suffix_max_additive[i + 1].max(g.additive);
        suffix_max_free[i] = f64::max(suffix_max_free[i + 1], g.free);
        suffix_max_cap[i] = suffix_max_cap[i + 1].max(g.cap);
    }
    let k = c.stages;
    let mut s = Search {
        c,
        opts,
        k: k as usize,
        layers: u64::from(c.ctx.p.model.layers),
        demand: c.ctx.demand(k),
        terms: c.ctx.network_terms(k),
        usage: Usage::new(c),
        chosen: Vec::with_capacity(k as usize),
        cap_sum: 0,
        additive_sum: 0.0,
        free_sum: 0.0,
        intra_sum: 0.0,
        path_cost: 0.0,
        suffix_max_additive,
        suffix_max_free,
        suffix_max_cap,
        best: incumbent,
        steps: 0,
        stopped: false,
    };
    s.descend(0);
    let mut plan = s.best;
    plan.optimal = !s.stopped;
    plan.steps = s.steps;
    Ok(plan)
}

impl Search<'_, '_> {
    fn out_of_budget(&mut self) -> bool {
        self.steps += 1;
        if self.steps > self.opts.max_steps {
            self.stopped = true;
        } else if self.steps.is_multiple_of(DEADLINE_EVERY)
            && self.opts.deadline.is_some_and(|d| d.expired())
        {
            self.stopped = true;
        }
        self.stopped
    }

    /// Change of the inter-node path cost if node `ni` joins the nodes in use.
    fn path_delta(&self, ni: usize) -> f64 {
        if self.usage.groups_on[ni] > 0 {
            return 0.0;
        }
        let before = self.usage.nodes_in_use.range(..ni).next_back().copied();
        let after = self.usage.nodes_in_use.range(ni + 1..).next().copied();
        let d = |a: usize, b: usize| {
            self.c
                .ctx
                .node_distance(self.c.nodes[a].src, self.c.nodes[b].src)
        };
        match (before, after) {
            (Some(b), Some(a)) => d(b, ni) + d(ni, a) - d(b, a),
            (Some(b), None) => d(b, ni),
            (None, Some(a)) => d(ni, a),
            (None, None) => 0.0,
        }
    }

    /// Optimistic score of any completion after adding candidate `gi`.
    fn upper_bound(&self, gi: usize, path_delta: f64, new_node: bool) -> f64 {
        let c = self.c;
        let w = &c.ctx.w;
        let g = &c.groups[gi];
        let rest = (self.k - self.chosen.len() - 1) as f64;
        let additive =
            (self.additive_sum + g.additive + rest * self.suffix_max_additive[gi]) / self.k as f64;
        let memory = w.memory
            * memory_part(
                self.demand,
                self.free_sum + g.free + rest * self.suffix_max_free[gi],
            );
        // More nodes only lengthen the inter-node path, and each costs more than
        // the same-node hop it replaces, so today's nodes bound the hop cost.
        let nodes = self.usage.nodes_in_use.len() + usize::from(new_node);
        let hops = self.path_cost + path_delta + HOP_SAME_NODE * (self.k - nodes) as f64;
        let network = if self.terms > 0.0 {
            w.network * (1.0 - (hops + self.intra_sum + g.intra_cost) / self.terms).clamp(0.0, 1.0)
        } else {
            w.network
        };
        additive + memory + network
    }

    fn descend(&mut self, start: usize) {
        if self.chosen.len() == self.k {
            self.leaf();
            return;
        }
        let rest = (self.k - self.chosen.len()) as u64;
        for gi in start..self.c.groups.len() {
            if self.out_of_budget() {
                return;
            }
            // Forward check: capacity still reachable from here on?
            if self.cap_sum + rest * u64::from(self.suffix_max_cap[gi]) < self.layers {
                return;
            }
            let g = &self.c.groups[gi];
            if !self.usage.fits(self.c, g) || !self.usage.twin_order_ok(self.c, g) {
                continue;
            }
            let new_node = self.usage.groups_on[g.node] == 0;
            let delta = self.path_delta(g.node);
            if self.upper_bound(gi, delta, new_node) <= self.best.score.total + EPS {
                continue;
            }
            self.usage.take(g);
            self.chosen.push(gi);
            self.cap_sum += u64::from(g.cap);
            self.additive_sum += g.additive;
            self.free_sum += g.free;
            self.intra_sum += g.intra_cost;
            self.path_cost += delta;

            self.descend(gi);

            let g = &self.c.groups[gi];
            self.path_cost -= delta;
            self.intra_sum -= g.intra_cost;
            self.free_sum -= g.free;
            self.additive_sum -= g.additive;
            self.cap_sum -= u64::from(g.cap);
            self.chosen.pop();
            self.usage.give_back(g);
            if self.stopped {
                return;
            }
        }
    }

    fn leaf(&mut self) {
        if self.cap_sum < self.layers {
            return;
        }
        let groups = materialize(self.c, &self.chosen);
        if let Some(plan) = evaluated(self.c, &groups)
            && plan.score.total > self.best.score.total + EPS
        {
            self.best = plan;
        }
    }
}
