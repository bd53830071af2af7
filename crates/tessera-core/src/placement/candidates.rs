//! The compiled groups as the search's steps read them: flat records in
//! search order, each with the suffix maxima its bounds need, and the best
//! parts of every run of them (and where the run's nodes are) in a binary
//! tree, so that a level can pass over a run of candidates none of which can
//! pass its bound without looking at each one.

use std::ops::{BitOr, Range};

use super::compile::Compiled;
use super::hops::Place;

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

    fn best_of(self, other: Parts) -> Parts {
        Parts {
            additive: self.additive.max(other.additive),
            free: self.free.max(other.free),
            intra_cost: self.intra_cost.min(other.intra_cost),
        }
    }
}

/// A candidate group as a step reads it.
pub(crate) struct Candidate {
    /// Index into `Compiled::nodes`.
    pub node: usize,
    /// The twin node that must be in use before this node's first group.
    pub twin_prev: Option<usize>,
    /// The group's entries in `Candidates::needs`.
    pub needs: Range<usize>,
    /// Layers the group can hold.
    pub cap: u32,
    pub parts: Parts,
    /// The largest `cap`, additive score and free memory of this group and
    /// every later one.
    pub suffix_cap: u32,
    pub suffix_additive: f64,
    pub suffix_free: f64,
}

/// The best parts of a run of candidates, and where their nodes are.
#[derive(Clone, Copy)]
pub(crate) struct Run {
    pub best: Parts,
    pub places: PlaceBits,
}

/// The compiled groups in search order.
pub(crate) struct Candidates {
    pub list: Vec<Candidate>,
    /// `(slot, count)`: a group takes `count` devices of the twin class at
    /// `slot` of the list of every node's classes (see `class_slots`).
    pub needs: Vec<(usize, u32)>,
    /// Runs of candidates: entry 1 covers the list padded to `leaves`,
    /// entry `i` the two halves at `2i` and `2i + 1`, and `leaves + index`
    /// one candidate.
    runs: Vec<Run>,
    leaves: usize,
}

impl Candidates {
    pub(crate) fn new(compiled: &Compiled) -> Self {
        let first_slot = class_slots(compiled);
        let mut needs = Vec::new();
        let mut list: Vec<Candidate> = compiled
            .groups
            .iter()
            .map(|group| {
                let start = needs.len();
                needs.extend(
                    group
                        .counts
                        .iter()
                        .map(|&(class, count)| (first_slot[group.node] + class, count)),
                );
                Candidate {
                    node: group.node,
                    twin_prev: compiled.nodes[group.node].twin_prev,
                    needs: start..needs.len(),
                    cap: group.cap,
                    parts: Parts {
                        additive: group.additive,
                        free: group.free,
                        intra_cost: group.intra_cost,
                    },
                    suffix_cap: 0,
                    suffix_additive: f64::NEG_INFINITY,
                    suffix_free: 0.0,
                }
            })
            .collect();
        let (mut cap, mut additive, mut free) = (0, f64::NEG_INFINITY, 0.0);
        for candidate in list.iter_mut().rev() {
            cap = u32::max(cap, candidate.cap);
            additive = f64::max(additive, candidate.parts.additive);
            free = f64::max(free, candidate.parts.free);
            candidate.suffix_cap = cap;
            candidate.suffix_additive = additive;
            candidate.suffix_free = free;
        }
        let leaves = list.len().next_power_of_two();
        let none = Run {
            best: Parts::NONE,
            places: PlaceBits::default(),
        };
        let mut runs = vec![none; 2 * leaves];
        for (index, candidate) in list.iter().enumerate() {
            runs[leaves + index] = Run {
                best: candidate.parts,
                places: PlaceBits::of(candidate.node, compiled.nodes[candidate.node].place),
            };
        }
        for entry in (1..leaves).rev() {
            let (left, right) = (runs[2 * entry], runs[2 * entry + 1]);
            runs[entry] = Run {
                best: left.best.best_of(right.best),
                places: left.places | right.places,
            };
        }
        Self {
            list,
            needs,
            runs,
            leaves,
        }
    }

    /// The first index in `within` whose candidate `promising` accepts, or
    /// `within.end`. `promising(first, run)` says whether a candidate at
    /// `first` or later, of a run no better than `run` and on its nodes,
    /// could pass; a later `first` or a lesser run must never turn its no
    /// into a yes.
    ///
    /// From the first candidate on, a rejected run is followed by the largest
    /// run that starts right after it, and an accepted run is split until one
    /// candidate is left: passing over `n` candidates takes about `log n` looks.
    pub(crate) fn first_promising(
        &self,
        within: Range<usize>,
        promising: &impl Fn(usize, &Run) -> bool,
    ) -> usize {
        if within.is_empty() {
            return within.end;
        }
        let mut entry = self.leaves + within.start;
        loop {
            // Entry `e` at depth `d` below the leaves covers `2^d` candidates
            // from `(e << d) - leaves`.
            let depth = self.leaves.trailing_zeros() - (usize::BITS - 1 - entry.leading_zeros());
            let first = (entry << depth) - self.leaves;
            if first >= within.end {
                return within.end;
            }
            if promising(first.max(within.start), &self.runs[entry]) {
                if depth == 0 {
                    return first;
                }
                entry *= 2;
                continue;
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

/// Where each node's twin classes start in one list of every node's classes.
pub(crate) fn class_slots(compiled: &Compiled) -> Vec<usize> {
    compiled
        .nodes
        .iter()
        .scan(0, |next, node| {
            let first = *next;
            *next += node.classes.len();
            Some(first)
        })
        .collect()
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
        // A device per temperature: as many groups as devices, a list whose
        // length is not a power of two.
        let nodes = (0..5)
            .map(|index| {
                let mut each = node(
                    &format!("n{index}"),
                    5,
                    if index % 2 == 0 { H100 } else { A100 },
                );
                for (device, gpu) in each.devices.iter_mut().enumerate() {
                    gpu.temperature_c = Some(30.0 + (index * 5 + device) as f64);
                }
                each
            })
            .collect();
        let problem = problem(nodes, 7, 1, Stages::Fixed(2));
        let compiled = Compiled::new(PreparedProblem::new(&problem), 2);
        let candidates = Candidates::new(&compiled);
        let count = candidates.list.len();
        assert_eq!(count, 25);
        let bars: Vec<f64> = candidates
            .list
            .iter()
            .map(|candidate| candidate.parts.additive)
            .collect();
        for bar in bars {
            // A later candidate faces a higher bar, as the rule allows.
            let passes = |first: usize, additive: f64| additive >= bar + first as f64 * 1e-4;
            let promising = |first: usize, run: &Run| passes(first, run.best.additive);
            for from in 0..=count {
                for to in from..=count {
                    let scan = (from..to)
                        .find(|&index| passes(index, candidates.list[index].parts.additive))
                        .unwrap_or(to);
                    assert_eq!(
                        candidates.first_promising(from..to, &promising),
                        scan,
                        "{from}..{to} against {bar}"
                    );
                }
            }
        }
    }
}
