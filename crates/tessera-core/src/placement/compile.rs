//! Preparing a problem for search: eligible devices, classes of interchangeable
//! devices and nodes, the candidate groups of each node, and the stage count.
//!
//! Symmetry: two devices of a node are *twins* when they look the same to the
//! objective (same product, memory, throughput, temperature in whole degrees)
//! and have the same link to every other eligible device of the node. Swapping twins changes no
//! score, so a group only says how many devices it takes from each twin class and
//! the search always uses the lowest-indexed unused ones. Likewise *twin nodes*
//! (same position, same classes, same links) are used in order. Both rules prune
//! only plans that have an equally scored twin still searched, so the optimum is
//! kept (the property tests check this against plain enumeration). The sharing
//! part (see `sharing`) is part of how a device looks: devices or nodes with
//! different sharing values are never twins.

use std::collections::HashMap;

use super::evaluate::{PreparedProblem, scored_temperature};
use super::hops::Place;
use super::problem::{Device, Interconnect};

pub(crate) struct CNode {
    /// Index into `Problem::nodes`.
    pub src: usize,
    /// Twin classes; each lists device indices in index order.
    pub classes: Vec<Vec<usize>>,
    /// The previous node (in `Compiled::nodes`) this node is a twin of.
    pub twin_prev: Option<usize>,
    pub place: Place,
}

/// A candidate stage: how many devices it takes from each twin class of a node.
pub(crate) struct Group {
    /// Index into `Compiled::nodes`.
    pub node: usize,
    pub counts: Vec<(usize, u32)>,
    /// Layers the group can hold.
    pub cap: u32,
    /// Weighted compute + thermal + bandwidth + sharing parts (before dividing
    /// by stage count).
    pub additive: f64,
    /// Free bytes over the group's devices.
    pub free: f64,
    /// Worst tensor link cost inside the group.
    pub intra_cost: f64,
    /// How often the group fits in its node at most.
    pub multiplicity: u32,
}

pub(crate) struct Compiled<'p> {
    pub ctx: PreparedProblem<'p>,
    /// Nodes that can hold at least one group, in network order.
    pub nodes: Vec<CNode>,
    /// Candidate groups, most promising first.
    pub groups: Vec<Group>,
    /// Stage count to plan.
    pub stages: u32,
}

impl<'p> Compiled<'p> {
    /// `stages` is the resolved stage count (see `greedy::start`).
    pub(crate) fn new(ctx: PreparedProblem<'p>, stages: u32) -> Self {
        let problem = ctx.problem;
        let tensor = ctx.tensor as usize;
        let mut order: Vec<usize> = (0..problem.nodes.len()).collect();
        order.sort_by(|&a, &b| ctx.position_cmp(a, b));

        let mut nodes = Vec::new();
        let mut previous_twin: FastMap<NodeKey, usize> =
            FastMap::with_capacity_and_hasher(problem.nodes.len(), Default::default());
        let (mut zones, mut racks) = (Names::default(), Names::default());
        for src in order {
            let mut eligible: Vec<usize> = (0..problem.nodes[src].devices.len())
                .filter(|&device| ctx.eligible(src, device))
                .collect();
            if eligible.len() < tensor {
                continue;
            }
            eligible.sort_by_key(|&device| (problem.nodes[src].devices[device].index, device));
            let classes = twin_classes(&ctx, src, &eligible);
            let twin_prev = previous_twin.insert(node_key(&ctx, src, &classes), nodes.len());
            let node_state = &problem.nodes[src];
            nodes.push(CNode {
                src,
                classes,
                twin_prev,
                place: Place {
                    zone: node_state.zone.as_deref().map(|zone| zones.number(zone)),
                    rack: node_state.rack.as_deref().map(|rack| racks.number(rack)),
                },
            });
        }

        let mut groups = Vec::new();
        for (node_index, node) in nodes.iter().enumerate() {
            let mut counts = Vec::new();
            enumerate_counts(&node.classes, 0, ctx.tensor, &mut counts, &mut |counts| {
                if let Some(group) = make_group(&ctx, node_index, node, counts) {
                    groups.push(group);
                }
            });
        }
        let max_free = groups.iter().map(|group| group.free).fold(0.0, f64::max);
        let weights = ctx.weights;
        let key = |group: &Group| {
            let free = if max_free > 0.0 {
                group.free / max_free
            } else {
                0.0
            };
            group.additive + weights.memory * free - weights.network * group.intra_cost
        };
        groups.sort_by(|a, b| {
            key(b)
                .total_cmp(&key(a))
                .then(a.node.cmp(&b.node))
                .then_with(|| a.counts.cmp(&b.counts))
        });
        Self {
            ctx,
            nodes,
            groups,
            stages,
        }
    }
}

/// Every node's key is hashed on every solve, where SipHash's guard against
/// chosen keys buys nothing and cost a tenth of a solve on 1,000 nodes:
/// foldhash's fast hasher, fixed so runs repeat.
type FastMap<K, V> = HashMap<K, V, foldhash::fast::FixedState>;

/// Numbers names in the order they are first seen.
#[derive(Default)]
struct Names<'a>(FastMap<&'a str, u32>);

impl<'a> Names<'a> {
    fn number(&mut self, name: &'a str) -> u32 {
        let next = self.0.len() as u32;
        *self.0.entry(name).or_insert(next)
    }
}

/// The rate the problem's matrix multiplications run at on `device`.
fn compute_tflops(ctx: &PreparedProblem<'_>, device: &Device) -> f64 {
    device
        .tensor_rates()
        .compute_tflops(ctx.problem.model.precision)
}

fn same_bits(first: f64, second: f64) -> bool {
    first.to_bits() == second.to_bits()
}

fn twins(
    ctx: &PreparedProblem,
    node: usize,
    eligible: &[usize],
    first: usize,
    second: usize,
) -> bool {
    let (first_device, second_device) = (ctx.device(node, first), ctx.device(node, second));
    let same = first_device.vendor == second_device.vendor
        && first_device.product == second_device.product
        && first_device.memory_total_bytes == second_device.memory_total_bytes
        && first_device.memory_free_bytes == second_device.memory_free_bytes
        && same_bits(first_device.fp16_tflops, second_device.fp16_tflops)
        && same_bits(
            compute_tflops(ctx, first_device),
            compute_tflops(ctx, second_device),
        )
        && same_bits(
            first_device.memory_bandwidth_gbps,
            second_device.memory_bandwidth_gbps,
        )
        && scored_temperature(first_device).map(f64::to_bits)
            == scored_temperature(second_device).map(f64::to_bits)
        && same_bits(
            ctx.device_sharing(node, first),
            ctx.device_sharing(node, second),
        );
    same && eligible.iter().all(|&other| {
        other == first || other == second || {
            let first_link = ctx.links(node).get(first, other);
            let second_link = ctx.links(node).get(second, other);
            first_link.map(|(kind, gbps)| (kind, gbps.to_bits()))
                == second_link.map(|(kind, gbps)| (kind, gbps.to_bits()))
        }
    })
}

fn twin_classes(ctx: &PreparedProblem, node: usize, eligible: &[usize]) -> Vec<Vec<usize>> {
    let mut classes: Vec<Vec<usize>> = Vec::new();
    for &device in eligible {
        match classes
            .iter_mut()
            .find(|class| twins(ctx, node, eligible, class[0], device))
        {
            Some(class) => class.push(device),
            None => classes.push(vec![device]),
        }
    }
    classes
}

/// A twin class as a comparable value: size, vendor, product, and the numbers
/// the score reads (memory, throughput, bandwidth, sharing bits; temperature bits).
type ClassKey<'a> = (usize, &'a str, &'a str, [u64; 6], Option<u64>);

/// Everything that makes two nodes interchangeable.
#[derive(PartialEq, Eq, Hash)]
struct NodeKey<'a> {
    zone: Option<&'a str>,
    rack: Option<&'a str>,
    classes: Vec<ClassKey<'a>>,
    /// Link between every pair of classes (and inside each class).
    links: Vec<Option<(Interconnect, u64)>>,
}

fn node_key<'a>(ctx: &'a PreparedProblem, node: usize, classes: &[Vec<usize>]) -> NodeKey<'a> {
    let node_state = &ctx.problem.nodes[node];
    let link = |from: usize, to: usize| {
        ctx.links(node)
            .get(from, to)
            .map(|(kind, gbps)| (kind, gbps.to_bits()))
    };
    let mut links = Vec::new();
    for (i, class) in classes.iter().enumerate() {
        for other in &classes[i..] {
            links.push(if std::ptr::eq(class, other) {
                class.get(1).and_then(|&twin| link(class[0], twin))
            } else {
                link(class[0], other[0])
            });
        }
    }
    NodeKey {
        zone: node_state.zone.as_deref(),
        rack: node_state.rack.as_deref(),
        classes: classes
            .iter()
            .map(|class| {
                let device = ctx.device(node, class[0]);
                (
                    class.len(),
                    device.vendor.as_str(),
                    device.product.as_str(),
                    [
                        device.memory_total_bytes,
                        device.memory_free_bytes,
                        device.fp16_tflops.to_bits(),
                        compute_tflops(ctx, device).to_bits(),
                        device.memory_bandwidth_gbps.to_bits(),
                        ctx.device_sharing(node, class[0]).to_bits(),
                    ],
                    scored_temperature(device).map(f64::to_bits),
                )
            })
            .collect(),
        links,
    }
}

/// How many devices a group takes from each twin class: `(class, count)`.
type Counts = [(usize, u32)];

fn enumerate_counts(
    classes: &[Vec<usize>],
    class: usize,
    left: u32,
    counts: &mut Vec<(usize, u32)>,
    emit: &mut dyn FnMut(&Counts),
) {
    if left == 0 {
        emit(counts);
        return;
    }
    if class == classes.len() {
        return;
    }
    let most = left.min(classes[class].len() as u32);
    for take in (0..=most).rev() {
        if take > 0 {
            counts.push((class, take));
        }
        enumerate_counts(classes, class + 1, left - take, counts, emit);
        if take > 0 {
            counts.pop();
        }
    }
}

fn make_group(
    ctx: &PreparedProblem,
    node_index: usize,
    node: &CNode,
    counts: &[(usize, u32)],
) -> Option<Group> {
    let devices: Vec<usize> = counts
        .iter()
        .flat_map(|&(class, count)| node.classes[class][..count as usize].iter().copied())
        .collect();
    let (mut compute, mut thermal, mut bandwidth) = (f64::INFINITY, f64::INFINITY, f64::INFINITY);
    let mut free = 0.0;
    let mut min_free = f64::INFINITY;
    for &device in &devices {
        let gpu = ctx.device(node.src, device);
        let (device_compute, device_thermal, device_bandwidth) = ctx.device_parts(gpu);
        compute = compute.min(device_compute);
        thermal = thermal.min(device_thermal);
        bandwidth = bandwidth.min(device_bandwidth);
        free += gpu.memory_free_bytes as f64;
        min_free = min_free.min(gpu.memory_free_bytes as f64);
    }
    let cap = ctx.capacity(min_free);
    if cap == 0 {
        return None;
    }
    let weights = &ctx.weights;
    Some(Group {
        node: node_index,
        counts: counts.to_vec(),
        cap,
        additive: weights.compute * compute
            + weights.thermal * thermal
            + weights.bandwidth * bandwidth
            + ctx.sharing_weight * ctx.group_sharing(node.src, &devices),
        free,
        intra_cost: ctx.intra_cost(node.src, &devices),
        multiplicity: counts
            .iter()
            .map(|&(class, count)| node.classes[class].len() as u32 / count)
            .min()
            .unwrap_or(0),
    })
}

#[cfg(test)]
mod tests {
    use super::super::problem::{Link, Problem, Stages};
    use super::super::testutil::*;
    use super::*;

    fn compile(problem: &Problem) -> Compiled<'_> {
        Compiled::new(PreparedProblem::new(problem), 1)
    }

    #[test]
    fn identical_devices_form_one_class_and_links_split_classes() {
        let mut problem = problem(vec![node("a", 4, RTX4090)], 8, 1, Stages::Fixed(1));
        let compiled = compile(&problem);
        assert_eq!(compiled.nodes[0].classes, vec![vec![0, 1, 2, 3]]);
        // One class, tensor 1: a single candidate group.
        assert_eq!(compiled.groups.len(), 1);

        // NVLink between 0-1 only: 0 and 1 are twins, 2 and 3 are twins.
        problem.nodes[0].links.push(Link {
            a: "a-0".into(),
            b: "a-1".into(),
            kind: Interconnect::NvLink,
            bandwidth_gbps: 600.0,
        });
        problem.nodes[0].links.push(Link {
            a: "a-2".into(),
            b: "a-3".into(),
            kind: Interconnect::NvLink,
            bandwidth_gbps: 600.0,
        });
        problem.tensor = 2;
        let compiled = compile(&problem);
        assert_eq!(compiled.nodes[0].classes, vec![vec![0, 1], vec![2, 3]]);
        // {2 of A}, {1 A + 1 B}, {2 of B}; the NVLink pairs rank first.
        assert_eq!(compiled.groups.len(), 3);
        assert_eq!(compiled.groups[0].intra_cost, 0.0);
        assert_eq!(compiled.groups[2].intra_cost, 0.6);
    }

    #[test]
    fn a_different_temperature_breaks_twins() {
        let mut problem = problem(vec![node("a", 3, H100)], 8, 1, Stages::Fixed(1));
        problem.nodes[0].devices[1].temperature_c = Some(70.0);
        let compiled = compile(&problem);
        assert_eq!(compiled.nodes[0].classes, vec![vec![0, 2], vec![1]]);
    }

    #[test]
    fn identical_nodes_are_twins_in_order() {
        let problem = problem(
            vec![
                node("a", 2, H100),
                node("b", 2, H100),
                node("c", 2, RTX4090),
            ],
            8,
            1,
            Stages::Fixed(1),
        );
        let compiled = compile(&problem);
        assert_eq!(compiled.nodes[0].twin_prev, None);
        assert_eq!(compiled.nodes[1].twin_prev, Some(0));
        assert_eq!(compiled.nodes[2].twin_prev, None);
    }

    #[test]
    fn different_sharing_values_are_never_twins() {
        use super::super::problem::Strategy;
        // Spread: of two identical nodes, one runs another replica.
        let mut spread = problem(
            vec![node("a", 2, H100), node("b", 2, H100)],
            8,
            1,
            Stages::Fixed(1),
        );
        spread.strategy = Strategy::Spread;
        assert_eq!(compile(&spread).nodes[1].twin_prev, Some(0));
        spread.replica_nodes = vec!["a".into()];
        assert_eq!(compile(&spread).nodes[1].twin_prev, None);

        // Pack: devices 0 and 2 look alike, but 0's NVLink partner is held
        // (its domain is already broken) while 2's is only unhealthy.
        let mut pack = problem(vec![node("x", 4, RTX4090)], 8, 1, Stages::Fixed(1));
        for (first, second) in [(0, 1), (2, 3)] {
            pack.nodes[0].links.push(Link {
                a: format!("x-{first}"),
                b: format!("x-{second}"),
                kind: Interconnect::NvLink,
                bandwidth_gbps: 600.0,
            });
        }
        pack.nodes[0].devices[1].allocated_to = Some("ns/other".into());
        pack.nodes[0].devices[3].healthy = false;
        assert_eq!(compile(&pack).nodes[0].classes, vec![vec![0, 2]]);
        pack.strategy = Strategy::Pack;
        assert_eq!(compile(&pack).nodes[0].classes, vec![vec![0], vec![2]]);
    }
}
