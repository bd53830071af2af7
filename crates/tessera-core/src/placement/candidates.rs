//! What the search reads of the compiled groups beyond the groups
//! themselves: the suffix maxima its bounds need, and the best parts of runs
//! of groups (and where their nodes are) in a binary tree, so that a level can
//! pass over a run of candidates none of which can pass its bound without
//! looking at each one.

use std::cell::OnceCell;
use std::ops::{BitOr, Range};

use super::compile::{Compiled, Group};
use super::hops::Place;

/// The most runs at the bottom of the tree. Larger lists put more candidates
/// in each bottom run, which is then looked at one candidate at a time: the
/// tree stays small (under a megabyte) on clusters with tens of thousands of
/// groups.
const MOST_BOTTOM_RUNS: usize = 8192;

/// Nodes, racks and zones as sets of bits, each number modulo 64: two sets
/// without a bit in common share no node, rack or zone (a bit in common may
/// be two numbers that collide).
#[derive(Clone, Copy, Default)]
pub(crate) struct PlaceBits {
    pub nodes: u64,
    /// Racks by zone and rack number mixed: the same rack name in two zones
    /// is two racks.
    pub racks: u64,
    pub zones: u64,
}

impl PlaceBits {
    pub(crate) fn of(node: usize, place: Place) -> Self {
        let bit = |number: u64| 1u64 << (number % 64);
        Self {
            nodes: bit(node as u64),
            racks: match (place.zone, place.rack) {
                (Some(zone), Some(rack)) => bit(u64::from(zone) * 61 + u64::from(rack)),
                _ => 0,
            },
            zones: place.zone.map_or(0, |zone| bit(u64::from(zone))),
        }
    }
}

/// The `PlaceBits` of a set of nodes that changes one node at a time:
/// how many nodes of the set hold each bit.
pub(crate) struct PlaceTally {
    bits: PlaceBits,
    /// By field (nodes, racks, zones), then bit.
    holders: [[u32; 64]; 3],
}

impl PlaceTally {
    pub(crate) fn new() -> Self {
        Self {
            bits: PlaceBits::default(),
            holders: [[0; 64]; 3],
        }
    }

    pub(crate) fn bits(&self) -> PlaceBits {
        self.bits
    }

    /// Adds a node's bits (`PlaceBits::of`: at most one in each field).
    pub(crate) fn add(&mut self, node: PlaceBits) {
        for (bits, bit, holders) in self.fields(node) {
            if bit != 0 {
                holders[bit.trailing_zeros() as usize] += 1;
                *bits |= bit;
            }
        }
    }

    /// Takes back what `add` added for the same node.
    pub(crate) fn remove(&mut self, node: PlaceBits) {
        for (bits, bit, holders) in self.fields(node) {
            if bit != 0 {
                let held = &mut holders[bit.trailing_zeros() as usize];
                *held -= 1;
                if *held == 0 {
                    *bits &= !bit;
                }
            }
        }
    }

    /// Each field's bits, the node's bit in it, and the field's holders.
    fn fields(&mut self, node: PlaceBits) -> [(&mut u64, u64, &mut [u32; 64]); 3] {
        let [nodes, racks, zones] = &mut self.holders;
        [
            (&mut self.bits.nodes, node.nodes, nodes),
            (&mut self.bits.racks, node.racks, racks),
            (&mut self.bits.zones, node.zones, zones),
        ]
    }
}

impl BitOr for PlaceBits {
    type Output = PlaceBits;

    fn bitor(self, other: PlaceBits) -> PlaceBits {
        PlaceBits {
            nodes: self.nodes | other.nodes,
            racks: self.racks | other.racks,
            zones: self.zones | other.zones,
        }
    }
}

/// What a candidate group adds to the score's sums, or the best any group
/// of a run adds: the most additive score and free memory, the least
/// tensor-link cost.
#[derive(Clone, Copy)]
pub(crate) struct Parts {
    pub additive: f64,
    pub free: f64,
    pub intra_cost: f64,
}

impl Parts {
    /// Nothing to offer: what a padding entry of the tree holds.
    const NONE: Parts = Parts {
        additive: f64::NEG_INFINITY,
        free: f64::NEG_INFINITY,
        intra_cost: f64::INFINITY,
    };

    pub(crate) fn of(group: &Group) -> Parts {
        Parts {
            additive: group.additive,
            free: group.free,
            intra_cost: group.intra_cost,
        }
    }

    fn best_of(self, other: Parts) -> Parts {
        Parts {
            additive: self.additive.max(other.additive),
            free: self.free.max(other.free),
            intra_cost: self.intra_cost.min(other.intra_cost),
        }
    }
}

/// The largest cap, additive score and free memory of a group and every
/// later one: they only fall along the list.
pub(crate) struct Suffix {
    pub cap: u32,
    pub additive: f64,
    pub free: f64,
}

/// The best parts of a run of candidates, and where their nodes are.
#[derive(Clone, Copy)]
pub(crate) struct Run {
    pub best: Parts,
    pub places: PlaceBits,
}

impl Run {
    const NONE: Run = Run {
        best: Parts::NONE,
        places: PlaceBits {
            nodes: 0,
            racks: 0,
            zones: 0,
        },
    };

    fn and(self, other: Run) -> Run {
        Run {
            best: self.best.best_of(other.best),
            places: self.places | other.places,
        }
    }
}

/// The compiled groups as the search's levels read them.
pub(crate) struct Candidates<'c> {
    groups: &'c [Group],
    /// Where each node is (`PlaceBits::of`), by index into `Compiled::nodes`.
    pub node_places: Vec<PlaceBits>,
    /// By group.
    pub suffix: Vec<Suffix>,
    /// Runs of `per_run` candidates and runs of those: entry 1 covers them
    /// all (padded to `bottom` runs), entry `i` the two halves at `2i` and
    /// `2i + 1`, and `bottom + index` one bottom run. Built on the first
    /// look: many searches end before their first level looks at anything.
    runs: OnceCell<Vec<Run>>,
    per_run: usize,
    bottom: usize,
}

impl<'c> Candidates<'c> {
    pub(crate) fn new(compiled: &'c Compiled) -> Self {
        Self::with_bottom_runs(compiled, MOST_BOTTOM_RUNS)
    }

    /// With at most `most` runs at the bottom of the tree.
    fn with_bottom_runs(compiled: &'c Compiled, most: usize) -> Self {
        let groups = compiled.groups.as_slice();
        let (mut cap, mut additive, mut free) = (0, f64::NEG_INFINITY, 0.0);
        let mut suffix: Vec<Suffix> = groups
            .iter()
            .rev()
            .map(|group| {
                cap = u32::max(cap, group.cap);
                additive = f64::max(additive, group.additive);
                free = f64::max(free, group.free);
                Suffix {
                    cap,
                    additive,
                    free,
                }
            })
            .collect();
        suffix.reverse();
        let per_run = groups.len().div_ceil(most).max(1);
        Self {
            groups,
            node_places: compiled
                .nodes
                .iter()
                .enumerate()
                .map(|(index, node)| PlaceBits::of(index, node.place))
                .collect(),
            suffix,
            runs: OnceCell::new(),
            per_run,
            bottom: groups.len().div_ceil(per_run).next_power_of_two(),
        }
    }

    /// The run of one candidate.
    fn run_of(&self, index: usize) -> Run {
        let group = &self.groups[index];
        Run {
            best: Parts::of(group),
            places: self.node_places[group.node],
        }
    }

    fn build_runs(&self) -> Vec<Run> {
        let mut runs = vec![Run::NONE; 2 * self.bottom];
        for (at, start) in (0..self.groups.len()).step_by(self.per_run).enumerate() {
            let end = (start + self.per_run).min(self.groups.len());
            runs[self.bottom + at] = (start..end)
                .map(|index| self.run_of(index))
                .fold(Run::NONE, Run::and);
        }
        for entry in (1..self.bottom).rev() {
            runs[entry] = runs[2 * entry].and(runs[2 * entry + 1]);
        }
        runs
    }

    /// The first index in `within` whose candidate `promising` accepts, or
    /// `within.end`. `promising(first, run)` says whether a candidate at
    /// `first` or later, of a run no better than `run` and on its nodes,
    /// could pass; a later `first` or a lesser run must never turn its no
    /// into a yes.
    ///
    /// From the first candidate on, a rejected run is followed by the largest
    /// run that starts right after it, and an accepted run is split down to
    /// a bottom run, whose candidates are looked at one by one: passing over
    /// `n` candidates takes about `log n` looks.
    pub(crate) fn first_promising(
        &self,
        within: Range<usize>,
        promising: &impl Fn(usize, &Run) -> bool,
    ) -> usize {
        if within.is_empty() {
            return within.end;
        }
        let runs = self.runs.get_or_init(|| self.build_runs());
        let mut entry = self.bottom + within.start / self.per_run;
        loop {
            // Entry `e` at depth `d` above the bottom covers `2^d` bottom
            // runs from `(e << d) - bottom`.
            let depth = self.bottom.trailing_zeros() - (usize::BITS - 1 - entry.leading_zeros());
            let start = ((entry << depth) - self.bottom) * self.per_run;
            let first = start.max(within.start);
            if first >= within.end {
                return within.end;
            }
            if promising(first, &runs[entry]) {
                if depth > 0 {
                    entry *= 2;
                    continue;
                }
                if self.per_run == 1 {
                    return first;
                }
                let end = (start + self.per_run).min(within.end);
                if let Some(found) =
                    (first..end).find(|&index| promising(index, &self.run_of(index)))
                {
                    return found;
                }
            }
            // The run after this one: climb while this is a right half.
            while entry % 2 == 1 {
                if entry == 1 {
                    return within.end;
                }
                entry /= 2;
            }
            entry += 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::compile::Compiled;
    use super::super::evaluate::PreparedProblem;
    use super::super::problem::Stages;
    use super::super::testutil::*;
    use super::*;

    #[test]
    fn a_tally_keeps_a_bit_while_any_node_holds_it() {
        let place = |zone, rack| Place {
            zone: Some(zone),
            rack: Some(rack),
        };
        // Nodes 1 and 65 share a node bit, and both sit in zone 0, rack 2.
        let (first, second) = (
            PlaceBits::of(1, place(0, 2)),
            PlaceBits::of(65, place(0, 2)),
        );
        let other = PlaceBits::of(2, place(1, 3));
        let mut tally = PlaceTally::new();
        for node in [first, second, other] {
            tally.add(node);
        }
        tally.remove(first);
        let bits = tally.bits();
        assert_eq!(bits.nodes, second.nodes | other.nodes);
        assert_eq!(bits.racks, second.racks | other.racks);
        tally.remove(second);
        let bits = tally.bits();
        assert_eq!(
            (bits.nodes, bits.racks, bits.zones),
            (other.nodes, other.racks, other.zones)
        );
        tally.remove(other);
        let bits = tally.bits();
        assert_eq!((bits.nodes, bits.racks, bits.zones), (0, 0, 0));
    }

    #[test]
    fn first_promising_finds_what_a_scan_finds() {
        // A device per temperature: as many groups as devices, in a tree of
        // several levels, with one candidate or several in each bottom run
        // (the last one cut short).
        let nodes = (0..9)
            .map(|index| {
                let kind = if index % 2 == 0 { H100 } else { A100 };
                let mut each = node(&format!("n{index}"), 7, kind);
                for (device, gpu) in each.devices.iter_mut().enumerate() {
                    gpu.temperature_c = Some(20.0 + (index * 7 + device) as f64);
                }
                each
            })
            .collect();
        let problem = problem(nodes, 7, 1, Stages::Fixed(2));
        let compiled = Compiled::new(PreparedProblem::new(&problem), 2);
        assert_eq!(compiled.groups.len(), 63);
        for most in [64, 8, 5, 1] {
            let candidates = Candidates::with_bottom_runs(&compiled, most);
            assert_first_promising_scans(&compiled, &candidates);
        }
    }

    fn assert_first_promising_scans(compiled: &Compiled, candidates: &Candidates) {
        let count = compiled.groups.len();
        for bar in compiled.groups.iter().map(|group| group.additive) {
            // A later candidate faces a higher bar, as the rule allows.
            let passes = |first: usize, additive: f64| additive >= bar + first as f64 * 1e-4;
            let promising = |first: usize, run: &Run| passes(first, run.best.additive);
            for from in 0..=count {
                for to in from..=count {
                    let scan = (from..to)
                        .find(|&index| passes(index, compiled.groups[index].additive))
                        .unwrap_or(to);
                    assert_eq!(
                        candidates.first_promising(from..to, &promising),
                        scan,
                        "{from}..{to} against {bar}, {} a run",
                        candidates.per_run
                    );
                }
            }
        }
    }
}
