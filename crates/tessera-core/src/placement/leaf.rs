//! A complete set of candidate groups (a leaf of the search) made concrete
//! and scored without allocating: the search reaches hundreds of thousands
//! of leaves, and only the few that beat the best plan so far become plans.

use super::compile::Compiled;

/// One stage of a leaf: its devices are `devices[start..end]`.
struct LeafStage {
    /// Index into `Compiled::nodes`: their order is network order.
    node: usize,
    src: usize,
    start: usize,
    end: usize,
    /// The lowest device index: pipeline order within a node.
    first: usize,
}

/// Buffers reused from leaf to leaf.
pub(crate) struct Leaf {
    /// Devices handed out so far, per node and twin class; all zero between leaves.
    next: Vec<Vec<usize>>,
    devices: Vec<usize>,
    stages: Vec<LeafStage>,
}

impl Leaf {
    pub(crate) fn new(compiled: &Compiled) -> Self {
        Self {
            next: compiled
                .nodes
                .iter()
                .map(|node| vec![0; node.classes.len()])
                .collect(),
            devices: Vec::new(),
            stages: Vec::with_capacity(compiled.stages as usize),
        }
    }

    /// The total `evaluate` gives the chosen groups, made concrete as
    /// `materialize` does: the lowest-indexed unused twins, in `chosen` order.
    pub(crate) fn score(&mut self, compiled: &Compiled, chosen: &[usize]) -> f64 {
        self.devices.clear();
        self.stages.clear();
        for &gi in chosen {
            let group = &compiled.groups[gi];
            let node = &compiled.nodes[group.node];
            let start = self.devices.len();
            for &(class, count) in &group.counts {
                let taken = &mut self.next[group.node][class];
                let end = *taken + count as usize;
                self.devices
                    .extend_from_slice(&node.classes[class][*taken..end]);
                *taken = end;
            }
            let end = self.devices.len();
            self.stages.push(LeafStage {
                node: group.node,
                src: node.src,
                start,
                end,
                first: self.devices[start..end].iter().copied().min().unwrap_or(0),
            });
        }
        for &gi in chosen {
            let group = &compiled.groups[gi];
            for &(class, _) in &group.counts {
                self.next[group.node][class] = 0;
            }
        }
        // The pipeline order `evaluate` uses: network position, then first device.
        self.stages
            .sort_unstable_by_key(|stage| (stage.node, stage.first));
        let devices = &self.devices;
        compiled.ctx.score_total(
            self.stages
                .iter()
                .map(|stage| (stage.src, &devices[stage.start..stage.end])),
        )
    }
}
