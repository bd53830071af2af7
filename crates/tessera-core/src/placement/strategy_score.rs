//! The strategy's score part, the sixth, named `sharing`: how well a plan shares the cluster with
//! later instances (`Strategy::Pack`) or with the instance's other replicas
//! (`Strategy::Spread`).
//!
//! The part is a value per eligible device in 0..=1 (higher is better to take);
//! a stage's value is the mean over its devices and the plan's the mean over
//! its stages. A device's value depends only on the cluster as the problem
//! describes it, never on the other stages of the same plan, so it adds up
//! group by group like compute, thermal and bandwidth, and the search's bounds
//! over those sums stay exact.
//!
//! Weighting: under `Pack` and `Spread` the plan's total is
//! `(1 - SHARING_WEIGHT) × (the five user-weighted parts) + SHARING_WEIGHT × sharing`,
//! so the user weights keep their meaning relative to each other. Under
//! `ScoreOnly` the part weighs nothing and is not computed (it reads 0).

use super::hops::hop_between_nodes;
use super::links::link_positions;
use super::problem::{DeviceShare, NodeState, Problem, Strategy};

/// Share of the total the sharing part takes under `Pack` and `Spread`. Tuned
/// with the cluster benchmark (`benches/cluster.rs`): enough that the cluster
/// keeps its large devices and whole fast-link domains, little enough that a
/// plan on a much faster device still wins over a slightly better-packed one.
pub(crate) const SHARING_WEIGHT: f64 = 0.35;

/// How a `Pack` cost is made of its three measures (they add up to one).
/// Best fit: the device with the least free memory that still holds the stage.
const PACK_FIT: f64 = 0.3;
/// Taking a device of a large node.
const PACK_NODE: f64 = 0.35;
/// Taking a device of a large NVLink/xGMI domain.
const PACK_DOMAIN: f64 = 0.35;
/// Intact nodes at least as large as a device's node that `Pack` keeps for
/// large models: while more of them are free, taking the device costs only
/// this many ÷ their number of its cost. Tuned with the cluster benchmark:
/// on a cluster with room to spare (1,000 nodes) `pack` then places as fast
/// as the score alone, and on a full one (64 nodes) it places more and
/// keeps more room for a later burst of large models than with no reserve.
const PACK_RESERVE: f64 = 4.0;
/// What a device on a node the instance's other replicas run on costs, as a
/// share of what it would cost elsewhere: pack fills those nodes first.
const PACK_REPLICA_NODE: f64 = 0.5;

/// The weight of the sharing part under a strategy.
pub(crate) fn sharing_weight(strategy: Strategy) -> f64 {
    match strategy {
        Strategy::ScoreOnly => 0.0,
        Strategy::Pack | Strategy::Spread => SHARING_WEIGHT,
    }
}

/// `values[node][device]`: the sharing value of every device (0 for devices
/// that are not eligible), or an empty list under `ScoreOnly`.
pub(crate) fn device_values(
    problem: &Problem,
    eligible: &dyn Fn(usize, usize) -> bool,
) -> Vec<Vec<f64>> {
    match problem.strategy {
        Strategy::ScoreOnly => Vec::new(),
        Strategy::Pack => pack_values(problem, eligible),
        Strategy::Spread => spread_values(problem),
    }
}

/// Devices of one node joined by NVLink/xGMI, as connected components.
struct FastDomains {
    /// Component of each device (an index into `sizes`).
    of_device: Vec<usize>,
    /// Devices in each component.
    sizes: Vec<u32>,
}

impl FastDomains {
    fn new(node: &NodeState) -> Self {
        let device_count = node.devices.len();
        let mut parent: Vec<usize> = (0..device_count).collect();
        let mut components = device_count;
        for (first, second, link) in link_positions(node) {
            // A fully linked node is one domain after a handful of links.
            if components <= 1 {
                break;
            }
            if !link.kind.is_scale_up() {
                continue;
            }
            let (first_root, second_root) = (root(&mut parent, first), root(&mut parent, second));
            if first_root != second_root {
                // The lower index is the root, so components come out in device order.
                let (low, high) = (first_root.min(second_root), first_root.max(second_root));
                parent[high] = low;
                components -= 1;
            }
        }
        let mut of_device = vec![0; device_count];
        let mut component_of_root = vec![usize::MAX; device_count];
        let mut sizes = Vec::new();
        for device in 0..device_count {
            let device_root = root(&mut parent, device);
            if component_of_root[device_root] == usize::MAX {
                component_of_root[device_root] = sizes.len();
                sizes.push(0);
            }
            of_device[device] = component_of_root[device_root];
            sizes[of_device[device]] += 1;
        }
        Self { of_device, sizes }
    }
}

/// Union-find root with path halving.
fn root(parent: &mut [usize], mut item: usize) -> usize {
    while parent[item] != item {
        parent[item] = parent[parent[item]];
        item = parent[item];
    }
    item
}

/// `Pack`: take the devices whose loss costs later instances least. The value
/// is `1 - cost`, the cost a mix of three measures in 0..=1:
/// - fit: the device's free memory ÷ the most any eligible device has;
/// - node: the memory of the node's healthy GPUs ÷ the most any node has;
/// - domain: the same for the device's NVLink/xGMI domain (a device without
///   fast links is a domain of its own).
///
/// An MI300X on an 8-GPU node costs most, a single RTX 4090 least, whether
/// or not the node is in use: a small instance added to a node a large one
/// holds keeps that node from coming free whole when the large one goes, so
/// `pack` does not prefer nodes in use (the cluster benchmark kept less room
/// for large models when it did).
///
/// Room is kept only where it is short: while `n` intact nodes at least as
/// large as the device's node are free, the cost is scaled by
/// `PACK_RESERVE ÷ n` (at most 1). A cluster with dozens of free MI300X
/// nodes gives an 8B model one; a cluster with its last few keeps them.
///
/// The nodes the instance's other replicas run on are read as `spread`
/// reads them, to the opposite end: a device there costs half. Replicas of
/// one instance then lie together, so scaling it down or deleting it gives
/// back whole nodes and domains instead of a hole on each of several nodes.
/// With no other replicas nothing changes.
fn pack_values(problem: &Problem, eligible: &dyn Fn(usize, usize) -> bool) -> Vec<Vec<f64>> {
    let mut max_free: f64 = 0.0;
    for (node_index, node) in problem.nodes.iter().enumerate() {
        for (device_index, device) in node.devices.iter().enumerate() {
            if eligible(node_index, device_index) {
                max_free = max_free.max(device.memory_free_bytes as f64);
            }
        }
    }
    let sizes: Vec<NodeSize> = problem.nodes.iter().map(NodeSize::new).collect();
    let (mut max_node, mut max_domain): (f64, f64) = (0.0, 0.0);
    for size in &sizes {
        max_node = max_node.max(size.node);
        max_domain = size.domain.iter().copied().fold(max_domain, f64::max);
    }
    let mut intact: Vec<f64> = sizes
        .iter()
        .filter(|size| size.intact)
        .map(|size| size.node)
        .collect();
    intact.sort_by(f64::total_cmp);
    problem
        .nodes
        .iter()
        .zip(&sizes)
        .enumerate()
        .map(|(node_index, (node, size))| {
            let at_least_as_large =
                intact.len() - intact.partition_point(|other| *other < size.node);
            let mut scale = (PACK_RESERVE / at_least_as_large.max(1) as f64).min(1.0);
            if problem.replica_nodes.contains(&node.name) {
                scale *= PACK_REPLICA_NODE;
            }
            let node_cost = share(size.node, max_node);
            (0..node.devices.len())
                .map(|device| {
                    if !eligible(node_index, device) {
                        return 0.0;
                    }
                    let fit_cost = share(node.devices[device].memory_free_bytes as f64, max_free);
                    let domain_cost =
                        share(size.domain[size.domains.of_device[device]], max_domain);
                    1.0 - scale
                        * (PACK_FIT * fit_cost + PACK_NODE * node_cost + PACK_DOMAIN * domain_cost)
                })
                .collect()
        })
        .collect()
}

/// `value ÷ max` in 0..=1 (0 when nothing is worth anything).
fn share(value: f64, max: f64) -> f64 {
    if max > 0.0 {
        (value / max).clamp(0.0, 1.0)
    } else {
        0.0
    }
}

/// A node, and its fast-link domains, as room for a large model: the memory
/// of their healthy GPUs.
struct NodeSize {
    domains: FastDomains,
    node: f64,
    /// By domain (an index into `domains.sizes`).
    domain: Vec<f64>,
    /// No workload holds any of its devices, and none of its GPUs is split
    /// (partitions, memory shares).
    intact: bool,
}

impl NodeSize {
    fn new(node: &NodeState) -> Self {
        let domains = FastDomains::new(node);
        let mut total = 0.0;
        let mut domain = vec![0.0; domains.sizes.len()];
        let mut intact = true;
        for (index, device) in node.devices.iter().enumerate() {
            intact &= device.allocated_to.is_none() && !device.on_split_gpu();
            // A partition's memory is its GPU's, counted once with the GPU.
            let partition = matches!(device.share, Some(DeviceShare::Partition { .. }));
            if device.healthy && !partition {
                let memory = device.memory_total_bytes as f64;
                total += memory;
                domain[domains.of_device[index]] += memory;
            }
        }
        Self {
            domains,
            node: total,
            domain,
            intact,
        }
    }
}

/// `Spread`: the distance from the nearest node the instance's other replicas
/// run on, as the network part counts distances: the same node 0, the same
/// rack 0.4, the same zone 0.7, elsewhere (or unknown) 1. With no other
/// replicas every node is 1.
fn spread_values(problem: &Problem) -> Vec<Vec<f64>> {
    let replica_nodes: Vec<&NodeState> = problem
        .nodes
        .iter()
        .filter(|node| problem.replica_nodes.contains(&node.name))
        .collect();
    problem
        .nodes
        .iter()
        .map(|node| {
            let value = replica_nodes
                .iter()
                .map(|replica| separation(node, replica))
                .fold(1.0, f64::min);
            vec![value; node.devices.len()]
        })
        .collect()
}

/// How far apart two nodes are for spreading replicas.
fn separation(node: &NodeState, other: &NodeState) -> f64 {
    if node.name == other.name {
        return 0.0;
    }
    let same_zone = node.zone.is_some() && node.zone == other.zone;
    hop_between_nodes(
        same_zone,
        same_zone && node.rack.is_some() && node.rack == other.rack,
    )
}

#[cfg(test)]
mod tests {
    use super::super::hops::{HOP_CROSS_ZONE, HOP_SAME_RACK, HOP_SAME_ZONE};
    use super::super::problem::{Link, Stages};
    use super::super::testutil::*;
    use super::*;
    use crate::placement::Interconnect;

    fn values(problem: &Problem) -> Vec<Vec<f64>> {
        device_values(problem, &|node, device| {
            problem.nodes[node].devices[device].allocated_to.is_none()
        })
    }

    #[test]
    fn score_only_computes_nothing() {
        let problem = problem(vec![node("a", 2, H100)], 7, 1, Stages::Fixed(1));
        assert!(values(&problem).is_empty());
        assert_eq!(sharing_weight(Strategy::ScoreOnly), 0.0);
    }

    #[test]
    fn pack_prefers_small_devices_nodes_and_domains_in_use_or_not() {
        let mut problem = problem(
            vec![
                node("h", 4, H100),
                node("m", 4, MI300X),
                node("r", 4, RTX4090),
                node("used", 4, H100),
            ],
            7,
            1,
            Stages::Fixed(1),
        );
        problem.strategy = Strategy::Pack;
        problem.nodes[3].devices[0].allocated_to = Some("ns/other".into());
        let values = values(&problem);
        let (h100, mi300x, rtx4090, used_h100) =
            (values[0][0], values[1][0], values[2][0], values[3][1]);
        assert!(rtx4090 > h100 && h100 > mi300x, "{values:?}");
        // The MI300X node is the largest device, node and domain there is.
        assert!((mi300x - (1.0 - PACK_FIT - PACK_NODE - PACK_DOMAIN)).abs() < 1e-12);
        // An H100: its device, node and domain at 80/192 of the largest.
        let h100_share = 80.0 / 192.0;
        assert!((h100 - (1.0 - h100_share)).abs() < 1e-12);
        // The RTX 4090s have no fast links: each is a domain of its own.
        let want = 1.0 - (PACK_FIT + PACK_NODE) * 24.0 / 192.0 - PACK_DOMAIN * 24.0 / 768.0;
        assert!((rtx4090 - want).abs() < 1e-12, "{rtx4090} vs {want}");
        // A node in use is worth what an intact one of its size is: what
        // another workload holds there comes back, the node whole with it.
        assert_eq!(used_h100, h100, "{values:?}");
        assert_eq!(values[3][0], 0.0, "a held device is not eligible");
    }

    #[test]
    fn pack_keeps_the_last_large_nodes_and_spends_plentiful_ones() {
        use super::super::{SolveOptions, solve};
        let mut problem = problem(
            vec![node("a", 4, H100), node("m0", 4, MI300X)],
            7,
            1,
            Stages::Fixed(1),
        );
        let score_only = solve(&problem, &SolveOptions::default()).unwrap();
        assert_eq!(
            score_only.stages[0].node, "m0",
            "the score alone takes the MI300X"
        );
        assert_eq!(score_only.score.sharing, 0.0);
        problem.strategy = Strategy::Pack;
        let packed = solve(&problem, &SolveOptions::default()).unwrap();
        assert_eq!(packed.stages[0].node, "a", "{packed:?}");
        assert!(packed.score.sharing > 0.0);
        assert_eq!(packed.stages[0].parts.sharing, packed.score.sharing);
        // With eight MI300X nodes intact, each costs half (a reserve of four
        // of eight); the H100 node is one of nine at least its size.
        for index in 1..8 {
            problem.nodes.push(node(&format!("m{index}"), 4, MI300X));
        }
        let values = values(&problem);
        assert!((values[1][0] - 0.5).abs() < 1e-12, "{values:?}");
        let h100_share = 80.0 / 192.0;
        assert!((values[0][0] - (1.0 - PACK_RESERVE / 9.0 * h100_share)).abs() < 1e-12);
        // With dozens free, an MI300X costs little and the score decides.
        for index in 8..40 {
            problem.nodes.push(node(&format!("m{index}"), 4, MI300X));
        }
        let plentiful = solve(&problem, &SolveOptions::default()).unwrap();
        assert!(plentiful.stages[0].node.starts_with('m'), "{plentiful:?}");
        // Once all but a few are held, the last ones are kept again.
        for held in &mut problem.nodes[2..] {
            held.devices[0].allocated_to = Some("ns/other".into());
        }
        let scarce = solve(&problem, &SolveOptions::default()).unwrap();
        assert_eq!(scarce.stages[0].node, "a", "{scarce:?}");
    }

    #[test]
    fn fast_domains_follow_nvlink_and_xgmi_only() {
        let mut pairs = node("a", 4, RTX4090);
        for (first, second, kind) in [
            (0, 1, Interconnect::NvLink),
            (1, 2, Interconnect::Pcie),
            (2, 3, Interconnect::Xgmi),
        ] {
            pairs.links.push(Link {
                a: format!("a-{first}"),
                b: format!("a-{second}"),
                kind,
                bandwidth_gbps: 100.0,
            });
        }
        let domains = FastDomains::new(&pairs);
        assert_eq!(domains.of_device, vec![0, 0, 1, 1]);
        assert_eq!(domains.sizes, vec![2, 2]);
    }

    #[test]
    fn spread_keeps_away_from_replica_nodes_by_distance() {
        let mut problem = problem(
            vec![
                node("a", 1, H100),
                node("b", 1, H100),
                node("c", 1, H100),
                node("d", 1, H100),
            ],
            7,
            1,
            Stages::Fixed(1),
        );
        for (node_index, zone, rack) in [(0, "z1", "r1"), (1, "z1", "r1"), (2, "z1", "r2")] {
            problem.nodes[node_index].zone = Some(zone.into());
            problem.nodes[node_index].rack = Some(rack.into());
        }
        problem.strategy = Strategy::Spread;
        assert!(values(&problem).iter().all(|node| node == &vec![1.0]));
        problem.replica_nodes = vec!["a".into(), "gone".into()];
        let by_node: Vec<f64> = values(&problem).iter().map(|node| node[0]).collect();
        assert_eq!(
            by_node,
            vec![0.0, HOP_SAME_RACK, HOP_SAME_ZONE, HOP_CROSS_ZONE]
        );
    }

    #[test]
    fn pack_fills_the_nodes_of_the_instance_s_other_replicas_first() {
        use super::super::{SolveOptions, solve};
        // Two identical nodes, each partly held by another workload.
        let mut problem = problem(
            vec![node("a", 4, H100), node("b", 4, H100)],
            7,
            1,
            Stages::Fixed(1),
        );
        for cluster_node in &mut problem.nodes {
            cluster_node.devices[0].allocated_to = Some("ns/other".into());
        }
        problem.strategy = Strategy::Pack;
        let alone = values(&problem);
        assert_eq!(alone[0], alone[1], "no replicas: the nodes look the same");
        let solved = |problem: &Problem| {
            solve(problem, &SolveOptions::default()).unwrap().stages[0]
                .node
                .clone()
        };
        assert_eq!(solved(&problem), "a");
        // Another replica of the instance runs on b.
        problem.nodes[1].devices[1].allocated_to = Some("ns/m replica 0".into());
        problem.replica_nodes = vec!["b".into()];
        let with_replica = values(&problem);
        let (on_a, on_b) = (with_replica[0][2], with_replica[1][2]);
        assert!(
            (1.0 - on_b - PACK_REPLICA_NODE * (1.0 - on_a)).abs() < 1e-12,
            "half the cost: {on_a} vs {on_b}"
        );
        assert_eq!(solved(&problem), "b");
        // Spread reads the same nodes to keep away from them.
        problem.strategy = Strategy::Spread;
        assert_eq!(solved(&problem), "a");
    }

    #[test]
    fn spread_puts_the_next_replica_in_another_zone() {
        use super::super::SolveOptions;
        use crate::sizing::{TensorChoice, solve_replicas};
        let mut problem = problem(
            vec![node("a", 2, H100), node("b", 2, H100), node("c", 2, H100)],
            7,
            1,
            Stages::Fixed(1),
        );
        for (node_index, zone) in [(0, "z1"), (1, "z1"), (2, "z2")] {
            problem.nodes[node_index].zone = Some(zone.into());
        }
        problem.strategy = Strategy::Spread;
        let placed = solve_replicas(
            &problem,
            TensorChoice::Fixed(1),
            3,
            "ns/m",
            &SolveOptions::default(),
        );
        let nodes: Vec<String> = placed
            .iter()
            .map(|replica| replica.as_ref().unwrap().plan.stages[0].node.clone())
            .collect();
        // Across zones first, then another node of the first zone.
        assert_eq!(nodes, vec!["a", "c", "b"]);
    }
}
