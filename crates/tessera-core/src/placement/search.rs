//! Branch-and-bound over sets of groups.
//!
//! Variables are the shards, values the candidate groups (see `compile`).
//! Shards are interchangeable until they are put in pipeline order, so every
//! unassigned shard has the same domain: MRV's "most constrained shard first" is
//! always a tie, broken by taking shards in order. Symmetry breaking makes shard
//! `i+1` take a candidate at or after shard `i`'s, so each set of groups is
//! visited once instead of `k!` times, and twin devices and nodes are taken in
//! order (see `compile`). Forward checking: a candidate whose devices are taken
//! is out of every remaining domain (`Usage::fits`), and a branch ends as soon as
//! the remaining domain cannot supply the layer capacity still missing.
//! Branch-and-bound skips a candidate when an optimistic bound on the final
//! score cannot beat the best plan so far. The first incumbent is the best of
//! three greedy plans, so a deadline or an exhausted step budget always has an
//! answer.
//!
//! A step is one candidate looked at, and most candidates fail their bound.
//! So a level finds where its candidates end by bisection, and it passes over
//! whole runs of candidates whose best parts cannot pass the bound
//! (`Search::promising`, runs in `candidates`). The steps those would have
//! taken are still counted, so the step budget stops the search where it
//! always did, and plans do not change.

use super::candidates::{Candidates, Parts, PlaceBits, PlaceTally, Run, Suffix};
use super::compile::{Compiled, Group};
use super::evaluate::memory_part;
use super::hops::{HOP_CROSS_ZONE, HOP_SAME_NODE, HOP_SAME_RACK, HOP_SAME_ZONE};
use super::leaf::Leaf;
use super::plan::Plan;
use super::problem::SolveOptions;

/// Scores closer than this count as equal, so ties keep the earlier plan.
const EPS: f64 = 1e-12;
/// How often (in steps) the deadline is looked at.
const DEADLINE_EVERY: u64 = 1024;
/// How far `Search::promising` stays on the safe side of the bar. Its bound
/// works out the hop cost along another path than a candidate's own, which
/// may round the other way by a few units in the last place; this is far
/// above that and far below any difference between scores that matters.
const ROUNDING: f64 = 1e-9;

/// Devices taken so far, per node and twin class.
struct Usage {
    tensor: u32,
    used: Vec<Vec<u32>>,
    groups_on: Vec<u32>,
    /// Eligible devices not yet taken, per node.
    free_devices: Vec<u32>,
    /// Nodes with at least one group, by index (= network order), sorted.
    /// A plan has a handful of stages, so a sorted list beats a tree.
    nodes_in_use: Vec<usize>,
    /// Where the nodes in use are.
    places_in_use: PlaceTally,
    /// Groups the nodes in use could still take.
    slots_in_use: u64,
}

impl Usage {
    fn new(compiled: &Compiled) -> Self {
        Self {
            tensor: compiled.ctx.tensor,
            used: compiled
                .nodes
                .iter()
                .map(|node| vec![0; node.classes.len()])
                .collect(),
            groups_on: vec![0; compiled.nodes.len()],
            free_devices: compiled
                .nodes
                .iter()
                .map(|node| node.classes.iter().map(|class| class.len() as u32).sum())
                .collect(),
            nodes_in_use: Vec::with_capacity(compiled.stages as usize),
            places_in_use: PlaceTally::new(),
            slots_in_use: 0,
        }
    }

    fn fits(&self, compiled: &Compiled, group: &Group) -> bool {
        let classes = &compiled.nodes[group.node].classes;
        group.counts.iter().all(|&(class, count)| {
            self.used[group.node][class] + count <= classes[class].len() as u32
        })
    }

    /// Twin nodes are used in order: a node's first group needs its twin
    /// predecessor in use already.
    fn twin_order_ok(&self, compiled: &Compiled, group: &Group) -> bool {
        self.groups_on[group.node] > 0
            || compiled.nodes[group.node]
                .twin_prev
                .is_none_or(|prev| self.groups_on[prev] > 0)
    }

    /// Groups the nodes in use could still take after a group on `node` is added.
    fn slots_after(&self, node: usize) -> u64 {
        let tensor = self.tensor;
        let left = u64::from((self.free_devices[node] - tensor) / tensor);
        if self.groups_on[node] == 0 {
            self.slots_in_use + left
        } else {
            self.slots_in_use - 1
        }
    }

    /// Takes `group`, whose node is at `places`.
    fn take(&mut self, group: &Group, places: PlaceBits) {
        self.slots_in_use = self.slots_after(group.node);
        for &(class, count) in &group.counts {
            self.used[group.node][class] += count;
        }
        self.free_devices[group.node] -= self.tensor;
        if self.groups_on[group.node] == 0 {
            let at = self.nodes_in_use.partition_point(|&node| node < group.node);
            self.nodes_in_use.insert(at, group.node);
            self.places_in_use.add(places);
        }
        self.groups_on[group.node] += 1;
    }

    fn give_back(&mut self, group: &Group, places: PlaceBits) {
        let tensor = self.tensor;
        for &(class, count) in &group.counts {
            self.used[group.node][class] -= count;
        }
        self.groups_on[group.node] -= 1;
        let left = u64::from(self.free_devices[group.node] / tensor);
        self.free_devices[group.node] += tensor;
        if self.groups_on[group.node] == 0 {
            self.slots_in_use -= left;
            if let Ok(at) = self.nodes_in_use.binary_search(&group.node) {
                self.nodes_in_use.remove(at);
            }
            self.places_in_use.remove(places);
        } else {
            self.slots_in_use += 1;
        }
    }
}

/// Concrete devices for abstract groups: the lowest-indexed unused twins.
fn materialize(compiled: &Compiled, chosen: &[usize]) -> Vec<(usize, Vec<usize>)> {
    let mut next: Vec<Vec<usize>> = compiled
        .nodes
        .iter()
        .map(|node| vec![0; node.classes.len()])
        .collect();
    chosen
        .iter()
        .map(|&gi| {
            let group = &compiled.groups[gi];
            let node = &compiled.nodes[group.node];
            let mut devices = Vec::with_capacity(compiled.ctx.tensor as usize);
            for &(class, count) in &group.counts {
                let start = next[group.node][class];
                devices.extend_from_slice(&node.classes[class][start..start + count as usize]);
                next[group.node][class] += count as usize;
            }
            (node.src, devices)
        })
        .collect()
}

struct LevelBounds {
    /// Groups still to pick after the next one.
    rest_after: u64,
    /// The least `Search::hops_after` of any node: what a new node or one in
    /// use adds is never below it (see `Search::least_hops`).
    hops: f64,
    /// The least `Search::hops_after` of a node not in use, less its
    /// distance to the nearest node in use (when some node is in use).
    new_node_hops: f64,
    /// Where the nodes in use are.
    in_use: PlaceBits,
    network: f64,
    top_additive: f64,
    top_free: f64,
    /// The same two for the groups after the next one.
    top_additive_after: f64,
    top_free_after: f64,
}

/// Sum of the `picks` largest values, each available `multiplicity` times: an
/// upper bound on what `picks` more groups can add, whatever else is taken.
struct TopSums {
    /// Values sorted high to low, with running count and sum.
    values: Vec<f64>,
    count: Vec<u64>,
    sum: Vec<f64>,
}

impl TopSums {
    fn new(mut entries: Vec<(f64, u32)>) -> Self {
        entries.sort_by(|a, b| b.0.total_cmp(&a.0));
        let (mut values, mut count, mut sum) = (Vec::new(), Vec::new(), Vec::new());
        let (mut running_count, mut running_sum) = (0u64, 0.0);
        for (value, multiplicity) in entries {
            running_count += u64::from(multiplicity);
            running_sum += value * f64::from(multiplicity);
            values.push(value);
            count.push(running_count);
            sum.push(running_sum);
        }
        Self { values, count, sum }
    }

    fn top(&self, picks: u64) -> f64 {
        let index = self.count.partition_point(|&count| count < picks);
        if index == self.values.len() {
            return self.sum.last().copied().unwrap_or(0.0);
        }
        let (before_count, before_sum) = if index == 0 {
            (0, 0.0)
        } else {
            (self.count[index - 1], self.sum[index - 1])
        };
        before_sum + (picks - before_count) as f64 * self.values[index]
    }
}

/// `(additive, free)` top sums for every number of picks a plan can still make.
fn top_sums(compiled: &Compiled) -> Vec<(f64, f64)> {
    let of = |part: fn(&Group) -> f64| {
        TopSums::new(
            compiled
                .groups
                .iter()
                .map(|group| (part(group), group.multiplicity))
                .collect(),
        )
    };
    let (additive, free) = (of(|group| group.additive), of(|group| group.free));
    (0..=u64::from(compiled.stages))
        .map(|picks| (additive.top(picks), free.top(picks)))
        .collect()
}

struct Search<'c, 'o> {
    compiled: &'c Compiled<'c>,
    candidates: &'c Candidates<'c>,
    opts: &'o SolveOptions<'o>,
    stages: usize,
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
    /// `top_sums`, by picks.
    tops: Vec<(f64, f64)>,
    /// Most groups any one node can take.
    max_slots: u64,
    best: Plan,
    leaf: Leaf,
    steps: u64,
    stopped: bool,
}

/// Searches from `incumbent` (a valid plan for `compiled.stages` stages).
pub(crate) fn run(compiled: &Compiled, opts: &SolveOptions, incumbent: Plan) -> Plan {
    let stages = compiled.stages;
    let tensor = compiled.ctx.tensor;
    let max_slots = compiled
        .nodes
        .iter()
        .map(|node| {
            node.classes
                .iter()
                .map(|class| class.len() as u64)
                .sum::<u64>()
                / u64::from(tensor)
        })
        .max()
        .unwrap_or(1)
        .max(1);
    let candidates = Candidates::new(compiled);
    let mut search = Search {
        compiled,
        candidates: &candidates,
        opts,
        stages: stages as usize,
        layers: u64::from(compiled.ctx.problem.model.layers),
        demand: compiled.ctx.demand(stages),
        terms: compiled.ctx.network_terms(stages),
        usage: Usage::new(compiled),
        chosen: Vec::with_capacity(stages as usize),
        cap_sum: 0,
        additive_sum: 0.0,
        free_sum: 0.0,
        intra_sum: 0.0,
        path_cost: 0.0,
        tops: top_sums(compiled),
        max_slots,
        best: incumbent,
        leaf: Leaf::new(compiled),
        steps: 0,
        stopped: false,
    };
    search.descend(0);
    let mut plan = search.best;
    plan.optimal = !search.stopped;
    plan.steps = search.steps;
    plan
}

impl Search<'_, '_> {
    fn out_of_budget(&mut self) -> bool {
        if self.steps >= self.opts.max_steps {
            self.stopped = true;
        } else {
            self.steps += 1;
            if self.steps.is_multiple_of(DEADLINE_EVERY)
                && self
                    .opts
                    .deadline
                    .is_some_and(|deadline| deadline.expired())
            {
                self.stopped = true;
            }
        }
        self.stopped
    }

    /// Change of the inter-node path cost if node `node` joins the nodes in use.
    fn path_delta(&self, node: usize) -> f64 {
        if self.usage.groups_on[node] > 0 {
            return 0.0;
        }
        let in_use = &self.usage.nodes_in_use;
        let at = in_use.partition_point(|&other| other < node);
        let before = at.checked_sub(1).map(|index| in_use[index]);
        let after = in_use.get(at).copied();
        let nodes = &self.compiled.nodes;
        let distance = |from: usize, to: usize| nodes[from].place.hop_to(nodes[to].place);
        match (before, after) {
            (Some(previous), Some(next)) => {
                distance(previous, node) + distance(node, next) - distance(previous, next)
            }
            (Some(previous), None) => distance(previous, node),
            (None, Some(next)) => distance(node, next),
            (None, None) => 0.0,
        }
    }

    /// The inter-node hop cost `upper_bound` charges when a group on `node`
    /// is added. Groups that do not fit on the nodes in use need new nodes. A
    /// new node lengthens the inter-node path by at least a same-rack hop and
    /// saves one same-node hop; more nodes than that only cost more.
    fn hops_after(&self, node: usize, rest_after: u64) -> f64 {
        let slots = self.usage.slots_after(node);
        let new_nodes = rest_after.saturating_sub(slots).div_ceil(self.max_slots);
        let new_node = self.usage.groups_on[node] == 0;
        let nodes = (self.usage.nodes_in_use.len() + usize::from(new_node)) as u64 + new_nodes;
        self.path_cost
            + self.path_delta(node)
            + new_nodes as f64 * HOP_SAME_RACK
            + HOP_SAME_NODE * (self.stages as u64).saturating_sub(nodes) as f64
    }

    /// Optimistic score of any completion after adding a group with `parts`
    /// and `hops` (see `hops_after`), bounding the groups after it by
    /// `suffix`: every part takes the best the remaining groups could offer,
    /// ignoring conflicts.
    fn upper_bound(&self, parts: &Parts, suffix: &Suffix, hops: f64, level: &LevelBounds) -> f64 {
        let weights = &self.compiled.ctx.weights;
        let rest_f = level.rest_after as f64;
        let more_additive = (rest_f * suffix.additive).min(level.top_additive_after);
        let additive = (self.additive_sum + parts.additive + more_additive) / self.stages as f64;
        let more_free = (rest_f * suffix.free).min(level.top_free_after);
        let memory =
            weights.memory * memory_part(self.demand, self.free_sum + parts.free + more_free);
        let network = if self.terms > 0.0 {
            weights.network
                * (1.0 - (hops + self.intra_sum + parts.intra_cost) / self.terms).clamp(0.0, 1.0)
        } else {
            weights.network
        };
        additive + memory + network
    }

    /// Whether some candidate at `first` or later, of a run no better than
    /// `run` and on its nodes, could pass `upper_bound` against `bar`. The
    /// same bound with the run's best parts, the suffix maxima at `first`
    /// (they only fall) and the least hop cost of the run's nodes is, in
    /// exact arithmetic, at least each candidate's own, so a run it rejects
    /// holds no candidate that passes.
    #[inline]
    fn promising(&self, first: usize, run: &Run, level: &LevelBounds, bar: f64) -> bool {
        let hops = Self::least_hops(&run.places, level);
        let suffix = &self.candidates.suffix[first];
        self.upper_bound(&run.best, suffix, hops, level) >= bar - ROUNDING
    }

    /// A lower bound on `hops_after` for any node in `places`. A node not in
    /// use lengthens the path by at least its distance to the nearest node
    /// in use: nodes are in network order, so of three nodes in a row the
    /// outer two are never farther apart than the farther inner pair.
    fn least_hops(places: &PlaceBits, level: &LevelBounds) -> f64 {
        let in_use = &level.in_use;
        if in_use.nodes == 0 || places.nodes & in_use.nodes != 0 {
            return level.hops;
        }
        let distance = if places.racks & in_use.racks != 0 {
            HOP_SAME_RACK
        } else if places.zones & in_use.zones != 0 {
            HOP_SAME_ZONE
        } else {
            HOP_CROSS_ZONE
        };
        level.hops.max(level.new_node_hops + distance)
    }

    /// `hops_after` of a node not in use, less its path delta, at its least:
    /// with the most groups any node takes, the fewest new nodes after it.
    fn new_node_hops(&self, rest_after: u64) -> f64 {
        let spare = self.usage.slots_in_use + (self.max_slots - 1);
        let new_nodes = rest_after.saturating_sub(spare).div_ceil(self.max_slots);
        let nodes = self.usage.nodes_in_use.len() as u64 + 1 + new_nodes;
        self.path_cost
            + new_nodes as f64 * HOP_SAME_RACK
            + HOP_SAME_NODE * (self.stages as u64).saturating_sub(nodes) as f64
    }

    /// The parts of `suffix_bound` that do not depend on the candidate.
    fn level_bounds(&self, rest: u64) -> LevelBounds {
        let weights = &self.compiled.ctx.weights;
        let in_use = self.usage.nodes_in_use.len() as u64;
        let new_nodes = rest
            .saturating_sub(self.usage.slots_in_use)
            .div_ceil(self.max_slots);
        // The first node of a plan costs no hop.
        let extra_hops = if in_use == 0 {
            new_nodes.saturating_sub(1)
        } else {
            new_nodes
        };
        let nodes = in_use + new_nodes;
        let hops = self.path_cost
            + extra_hops as f64 * HOP_SAME_RACK
            + HOP_SAME_NODE * (self.stages as u64).saturating_sub(nodes) as f64;
        let network = if self.terms > 0.0 {
            weights.network * (1.0 - (hops + self.intra_sum) / self.terms).clamp(0.0, 1.0)
        } else {
            weights.network
        };
        let rest_after = rest.saturating_sub(1);
        let (top_additive, top_free) = self.tops[rest as usize];
        let (top_additive_after, top_free_after) = self.tops[rest_after as usize];
        LevelBounds {
            rest_after,
            hops,
            new_node_hops: self.new_node_hops(rest_after),
            in_use: self.usage.places_in_use.bits(),
            network,
            top_additive,
            top_free,
            top_additive_after,
            top_free_after,
        }
    }

    /// Optimistic score of any completion whose next group is one `suffix`
    /// bounds.
    fn suffix_bound(&self, suffix: &Suffix, rest: u64, level: &LevelBounds) -> f64 {
        let weights = &self.compiled.ctx.weights;
        let rest_f = rest as f64;
        let additive = (self.additive_sum + (rest_f * suffix.additive).min(level.top_additive))
            / self.stages as f64;
        let free = self.free_sum + (rest_f * suffix.free).min(level.top_free);
        additive + weights.memory * memory_part(self.demand, free) + level.network
    }

    /// Where a level's candidates in `from..to` end: at the first from which
    /// the missing layers are out of reach or no completion can beat `bar`
    /// (the bounds are finite). Both only fall along the list, as the suffix
    /// maxima do, so the first such candidate is found by bisection.
    fn level_end(&self, from: usize, to: usize, rest: u64, level: &LevelBounds, bar: f64) -> usize {
        let within = &self.candidates.suffix[from..to];
        from + within.partition_point(|suffix| {
            self.cap_sum + rest * u64::from(suffix.cap) >= self.layers
                && self.suffix_bound(suffix, rest, level) > bar
        })
    }

    fn descend(&mut self, start: usize) {
        if self.chosen.len() == self.stages {
            self.leaf();
            return;
        }
        let rest = (self.stages - self.chosen.len()) as u64;
        let level = self.level_bounds(rest);
        let candidates = self.candidates;
        let mut bar = self.best.score.total + EPS;
        let count = self.compiled.groups.len();
        let mut end = self.level_end(start, count, rest, &level, bar);
        let mut gi = start;
        loop {
            // The candidates passed over would each have failed a check: they
            // cost the steps that looking at them one by one did.
            let next = candidates.first_promising(gi..end, &|first, best| {
                self.promising(first, best, &level, bar)
            });
            if self.pass_over((next - gi) as u64) {
                return;
            }
            gi = next;
            if gi == end {
                break;
            }
            if self.out_of_budget() {
                return;
            }
            if self.worth_taking(gi, &level, bar) {
                self.branch(gi);
                if self.stopped {
                    return;
                }
                // A better plan below raises the bar, which may end the level sooner.
                let raised = self.best.score.total + EPS;
                if raised > bar {
                    bar = raised;
                    end = self.level_end(gi + 1, end, rest, &level, bar);
                }
            }
            gi += 1;
        }
        // Finding that the level ends at a candidate takes a step, as looking
        // at it one by one did.
        if end < count {
            self.out_of_budget();
        }
    }

    /// Whether the group at `gi` fits now and could lead past `bar`.
    fn worth_taking(&self, gi: usize, level: &LevelBounds, bar: f64) -> bool {
        let group = &self.compiled.groups[gi];
        self.usage.fits(self.compiled, group)
            && self.usage.twin_order_ok(self.compiled, group)
            && self.upper_bound(
                &Parts::of(group),
                &self.candidates.suffix[gi],
                self.hops_after(group.node, level.rest_after),
                level,
            ) > bar
    }

    /// `out_of_budget` for `count` steps at once, none of which branches:
    /// the budget stops the search at the same step, the deadline at the
    /// first look it would have had.
    fn pass_over(&mut self, count: u64) -> bool {
        let left = self.opts.max_steps.saturating_sub(self.steps);
        if count > left {
            self.steps += left;
            self.stopped = true;
            return true;
        }
        let looks = self.steps / DEADLINE_EVERY;
        self.steps += count;
        if self.steps / DEADLINE_EVERY > looks
            && self
                .opts
                .deadline
                .is_some_and(|deadline| deadline.expired())
        {
            self.steps = (looks + 1) * DEADLINE_EVERY;
            self.stopped = true;
        }
        self.stopped
    }

    /// Takes the group at `gi`, searches the completions, and gives it back.
    fn branch(&mut self, gi: usize) {
        let group = &self.compiled.groups[gi];
        let places = self.candidates.node_places[group.node];
        let delta = self.path_delta(group.node);
        self.usage.take(group, places);
        self.chosen.push(gi);
        self.cap_sum += u64::from(group.cap);
        self.additive_sum += group.additive;
        self.free_sum += group.free;
        self.intra_sum += group.intra_cost;
        self.path_cost += delta;

        self.descend(gi);

        let group = &self.compiled.groups[gi];
        self.path_cost -= delta;
        self.intra_sum -= group.intra_cost;
        self.free_sum -= group.free;
        self.additive_sum -= group.additive;
        self.cap_sum -= u64::from(group.cap);
        self.chosen.pop();
        self.usage.give_back(group, places);
    }

    fn leaf(&mut self) {
        if self.cap_sum < self.layers {
            return;
        }
        let quick = self.leaf.score(self.compiled, &self.chosen);
        if quick <= self.best.score.total + EPS {
            return;
        }
        let groups = materialize(self.compiled, &self.chosen);
        if let Ok(plan) = self.compiled.ctx.evaluate(&groups) {
            debug_assert_eq!(plan.score.total.to_bits(), quick.to_bits());
            if plan.score.total > self.best.score.total + EPS {
                self.best = plan;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::problem::{Deadline, Stages, Weights};
    use super::super::testutil::*;
    use super::super::{SolveOptions, solve};
    use crate::api::GIB;

    fn best(problem: &super::super::Problem) -> super::super::Plan {
        solve(problem, &SolveOptions::default()).unwrap()
    }

    #[test]
    fn auto_takes_the_fewest_stages() {
        let problem = problem(vec![node("r", 8, RTX4090)], 70, 1, Stages::Auto);
        // 80 layers of 1.63 GiB; a 24 GiB card keeps 1 GiB overhead and holds 14.
        assert_eq!(best(&problem).stages.len(), 6);
    }

    #[test]
    fn the_score_prefers_faster_cooler_devices() {
        let mut problem = problem(
            vec![node("r", 2, RTX4090), node("h", 2, H100)],
            7,
            1,
            Stages::Fixed(1),
        );
        assert_eq!(best(&problem).stages[0].node, "h");
        problem.nodes[1].devices[0].temperature_c = Some(80.0);
        let plan = best(&problem);
        assert_eq!(plan.stages[0].devices, vec!["h-1".to_string()]);
        assert!(plan.optimal);
    }

    #[test]
    fn weights_steer_the_choice() {
        let mut problem = problem(
            vec![node("r", 1, RTX4090), node("h", 1, H100)],
            7,
            1,
            Stages::Fixed(1),
        );
        problem.nodes[1].devices[0].temperature_c = Some(84.0);
        problem.weights = Weights {
            compute: 0.0,
            memory: 0.0,
            network: 0.0,
            thermal: 1.0,
            bandwidth: 0.0,
        };
        assert_eq!(best(&problem).stages[0].node, "r");
    }

    #[test]
    fn hot_unhealthy_and_filtered_devices_are_never_used() {
        let mut problem = problem(vec![node("h", 4, H100)], 7, 1, Stages::Fixed(1));
        problem.nodes[0].devices[0].healthy = false;
        problem.nodes[0].devices[1].temperature_c = Some(85.0);
        problem.nodes[0].devices[2].product = "NVIDIA H200".into();
        problem.selector.products = vec!["h100".into()];
        assert_eq!(best(&problem).stages[0].devices, vec!["h-3".to_string()]);
    }

    #[test]
    fn the_temperature_limit_compares_raw_readings() {
        // (reading, limit, usable): rounding either side would flip each case.
        for (temperature, limit, usable) in [
            (84.6, 85.0, true),
            (84.4, 84.4, false),
            (75.3, 75.3, false),
            (85.2, 85.4, true),
            (85.0, 85.0, false),
        ] {
            let mut problem = problem(vec![node("h", 1, H100)], 7, 1, Stages::Fixed(1));
            problem.nodes[0].devices[0].temperature_c = Some(temperature);
            problem.max_temperature_c = limit;
            let got = solve(&problem, &SolveOptions::default());
            assert_eq!(
                got.is_ok(),
                usable,
                "{temperature} °C against {limit}: {got:?}"
            );
            if let Err(unsatisfiable) = got {
                let said = unsatisfiable.details.join("\n");
                assert!(
                    said.contains(&format!(
                        "at {temperature} °C, not below the {limit} °C limit"
                    )),
                    "{said}"
                );
            }
        }
    }

    #[test]
    fn the_canonical_problem_keeps_what_the_solver_decides_on() {
        let mut problem = problem(vec![node("h", 3, H100)], 7, 1, Stages::Fixed(1));
        problem.max_temperature_c = 85.0;
        let at = |problem: &mut super::super::Problem, temperatures: [f64; 3]| {
            for (device, temperature) in problem.nodes[0].devices.iter_mut().zip(temperatures) {
                device.temperature_c = Some(temperature);
            }
            problem.canonical()
        };
        let before = at(&mut problem, [40.2, 84.6, 85.2]);
        assert_eq!(
            before,
            at(&mut problem, [39.8, 84.7, 86.0]),
            "drift the solver does not see"
        );
        assert_ne!(
            before,
            at(&mut problem, [40.2, 85.1, 85.2]),
            "a device crossed the limit"
        );
        assert_ne!(
            before,
            at(&mut problem, [41.2, 84.6, 85.2]),
            "a scored degree changed"
        );
        assert!(!before.nodes[0].devices[2].healthy);
        assert_eq!(
            solve(&problem.canonical(), &SolveOptions::default()).map(|plan| plan.stages),
            solve(&problem, &SolveOptions::default()).map(|plan| plan.stages)
        );
    }

    #[test]
    fn tensor_groups_stay_on_one_node_and_prefer_nvlink() {
        let mut linked = node("a", 4, RTX4090);
        linked.links.push(super::super::problem::Link {
            a: "a-2".into(),
            b: "a-3".into(),
            kind: super::super::problem::Interconnect::NvLink,
            bandwidth_gbps: 100.0,
        });
        let problem = problem(vec![linked, node("b", 1, RTX4090)], 7, 2, Stages::Fixed(1));
        let plan = best(&problem);
        assert_eq!(plan.stages[0].node, "a");
        assert_eq!(
            plan.stages[0].devices,
            vec!["a-2".to_string(), "a-3".to_string()]
        );
    }

    #[test]
    fn stages_pack_onto_one_node_before_crossing_the_network() {
        let problem = problem(
            vec![node("a", 4, H100), node("b", 4, H100)],
            70,
            1,
            Stages::Fixed(3),
        );
        let plan = best(&problem);
        assert!(
            plan.stages
                .iter()
                .all(|stage| stage.node == plan.stages[0].node)
        );
    }

    #[test]
    fn memory_is_respected_on_every_device() {
        let mut problem = problem(
            vec![node("m", 2, MI300X), node("r", 4, RTX4090)],
            70,
            1,
            Stages::Fixed(3),
        );
        problem.nodes[0].devices[0].memory_free_bytes = (100.0 * GIB) as u64;
        let plan = best(&problem);
        for stage in &plan.stages {
            let stage_node = problem
                .nodes
                .iter()
                .find(|candidate| candidate.name == stage.node)
                .unwrap();
            for id in &stage.devices {
                let device = stage_node
                    .devices
                    .iter()
                    .find(|candidate| &candidate.id == id)
                    .unwrap();
                assert!(stage.memory_per_device_bytes <= device.memory_free_bytes as f64);
            }
        }
    }

    #[test]
    fn the_step_budget_stops_the_search_at_that_step() {
        // Nodes that differ (kind, temperatures, rack, a held device), so
        // few twins fold away and the search takes thousands of steps.
        let nodes = (0..8)
            .map(|index| {
                let kind = if index % 3 == 0 { A100 } else { H100 };
                let mut each = node(&format!("n{index}"), 8, kind);
                each.zone = Some(format!("z{}", index % 2));
                each.rack = Some(format!("r{}", index % 3));
                for (device, gpu) in each.devices.iter_mut().enumerate() {
                    gpu.temperature_c = Some(30.0 + ((index * 7 + device * 3) % 40) as f64);
                }
                if index % 4 == 1 {
                    each.devices[0].allocated_to = Some("ns/other".into());
                }
                each
            })
            .collect();
        let problem = problem(nodes, 405, 2, Stages::Fixed(6));
        let full = best(&problem);
        assert!(full.optimal && full.steps > 1000, "{} steps", full.steps);
        let mut last = f64::NEG_INFINITY;
        for budget in (1..full.steps).step_by((full.steps / 41) as usize) {
            let options = SolveOptions {
                deadline: None,
                max_steps: budget,
            };
            let plan = solve(&problem, &options).unwrap();
            assert_eq!((plan.steps, plan.optimal), (budget, false));
            assert!(plan.score.total >= last, "a larger budget never finds less");
            last = plan.score.total;
        }
        let options = SolveOptions {
            deadline: None,
            max_steps: full.steps,
        };
        assert_eq!(solve(&problem, &options).unwrap(), full);
    }

    struct Expired;
    impl Deadline for Expired {
        fn expired(&self) -> bool {
            true
        }
    }

    #[test]
    fn an_expired_deadline_returns_the_greedy_plan_marked_not_optimal() {
        let nodes = (0..40)
            .map(|i| node(&format!("n{i:02}"), 8, H100))
            .collect();
        let mut problem = problem(nodes, 405, 1, Stages::Fixed(12));
        for (i, cluster_node) in problem.nodes.iter_mut().enumerate() {
            cluster_node.devices[0].temperature_c = Some(30.0 + i as f64);
        }
        let plan = solve(
            &problem,
            &SolveOptions {
                deadline: Some(&Expired),
                max_steps: u64::MAX,
            },
        )
        .unwrap();
        assert!(!plan.optimal);
        assert!(plan.steps <= super::DEADLINE_EVERY);
        assert_eq!(plan.stages.len(), 12);
        let greedy = super::super::solve_greedy(&problem).unwrap();
        assert!(plan.score.total >= greedy.score.total);
    }
}
