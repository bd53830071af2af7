//! Which devices to prefer when kubelet asks (`GetPreferredAllocation`): a
//! pure, deterministic choice from the node's topology.
//!
//! Among the sets of `size` available devices that contain every
//! must-include device, the best one is, in this order:
//!
//! 1. the most pairs joined by a fast link (NVLink or xGMI), then the most
//!    fast-link bandwidth inside the set: devices that talk fast belong together;
//! 2. the fewest NUMA nodes (a device whose node is unknown counts as one
//!    "unknown" node);
//! 3. the fewest fast links cut between the set and the devices left
//!    available: a small request takes a device whose partner is already gone
//!    rather than split an intact pair, so the pair stays for a later request;
//! 4. the fewest NUMA nodes split between the set and what is left;
//! 5. the earliest devices in the node's device order.
//!
//! Small searches (up to [`EXHAUSTIVE_LIMIT`] candidate sets) try every set;
//! larger ones grow a set greedily from every possible first device and keep
//! the best. Neither depends on the order of the input lists.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet};

use crate::backend::Snapshot;

/// Above this many candidate sets the search is greedy.
pub(crate) const EXHAUSTIVE_LIMIT: u64 = 20_000;

/// The greedy search starts from at most this many first devices, spread
/// evenly over the candidates (only nodes with more devices than this are
/// affected).
const MAX_SEEDS: usize = 64;

/// The preferred `size` devices out of `available`, always including
/// `must_include` (even when kubelet did not list them as available). When
/// `must_include` alone reaches `size`, it is the answer; when fewer than
/// `size` devices exist, all of them are. IDs the snapshot does not know are
/// plain candidates with no links and no NUMA node, after the known ones.
/// The answer is in the node's device order.
pub(crate) fn preferred_allocation(
    snapshot: &Snapshot,
    available: &[String],
    must_include: &[String],
    size: usize,
) -> Vec<String> {
    let universe = Universe::new(snapshot, available, must_include);
    let must: Vec<usize> = (0..universe.ids.len())
        .filter(|&i| universe.must[i])
        .collect();
    if must.len() >= size {
        return universe.names(&must);
    }
    let candidates: Vec<usize> = (0..universe.ids.len())
        .filter(|&i| !universe.must[i])
        .collect();
    let count = size - must.len();
    if candidates.len() <= count {
        return universe.names(&(0..universe.ids.len()).collect::<Vec<_>>());
    }
    let chosen = if binomial(candidates.len() as u64, count as u64) <= EXHAUSTIVE_LIMIT {
        exhaustive(&universe, &must, &candidates, count)
    } else {
        greedy(&universe, &must, &candidates, count)
    };
    let mut chosen = chosen;
    chosen.sort_unstable();
    universe.names(&chosen)
}

/// The devices in play (available ∪ must-include), in device order, with
/// their fast-link bandwidth matrix and NUMA nodes.
struct Universe {
    ids: Vec<String>,
    must: Vec<bool>,
    /// Bandwidth of fast links between two devices (GB/s, rounded); 0 = none.
    fast: Vec<Vec<u64>>,
    /// NUMA node; `None` for unknown (one shared "unknown" bucket).
    numa: Vec<Option<i32>>,
    /// Number of fast-linked devices in play, per device.
    fast_degree: Vec<usize>,
}

impl Universe {
    fn new(snapshot: &Snapshot, available: &[String], must_include: &[String]) -> Self {
        let position: BTreeMap<&str, usize> = snapshot
            .devices
            .iter()
            .enumerate()
            .map(|(i, device)| (device.info.id.as_str(), i))
            .collect();
        // Known devices first in device order, unknown ones after, by ID.
        let mut keyed: BTreeMap<(usize, &str), bool> = BTreeMap::new();
        for id in available {
            let pos = position.get(id.as_str()).copied().unwrap_or(usize::MAX);
            keyed.entry((pos, id.as_str())).or_insert(false);
        }
        for id in must_include {
            let pos = position.get(id.as_str()).copied().unwrap_or(usize::MAX);
            keyed.insert((pos, id.as_str()), true);
        }
        let ids: Vec<String> = keyed.keys().map(|(_, id)| id.to_string()).collect();
        let must: Vec<bool> = keyed.values().copied().collect();
        let local: BTreeMap<&str, usize> = ids
            .iter()
            .enumerate()
            .map(|(i, id)| (id.as_str(), i))
            .collect();
        let device_count = ids.len();
        let mut fast = vec![vec![0u64; device_count]; device_count];
        for link in &snapshot.links {
            if !link.kind.is_scale_up() || link.a == link.b {
                continue;
            }
            if let (Some(&a), Some(&b)) = (local.get(link.a.as_str()), local.get(link.b.as_str())) {
                // At least 1 so a link of unknown bandwidth still counts as a link.
                let bw = if link.bandwidth_gbps.is_finite() && link.bandwidth_gbps >= 1.0 {
                    link.bandwidth_gbps.round() as u64
                } else {
                    1
                };
                fast[a][b] = fast[a][b].saturating_add(bw);
                fast[b][a] = fast[a][b];
            }
        }
        let numa = ids
            .iter()
            .map(|id| {
                position
                    .get(id.as_str())
                    .and_then(|&p| snapshot.devices[p].info.numa_node)
            })
            .collect();
        let fast_degree = fast
            .iter()
            .map(|row| row.iter().filter(|&&bw| bw > 0).count())
            .collect();
        Self {
            ids,
            must,
            fast,
            numa,
            fast_degree,
        }
    }

    fn names(&self, set: &[usize]) -> Vec<String> {
        set.iter().map(|&i| self.ids[i].clone()).collect()
    }

    /// How good a complete set is; larger is better.
    fn score(&self, set: &[usize]) -> CandidateScore {
        let mut inside = vec![false; self.ids.len()];
        for &i in set {
            inside[i] = true;
        }
        let mut fast_pairs = 0;
        let mut fast_bw = 0u64;
        let mut cut = 0;
        for (x, &i) in set.iter().enumerate() {
            for &j in &set[x + 1..] {
                if self.fast[i][j] > 0 {
                    fast_pairs += 1;
                    fast_bw = fast_bw.saturating_add(self.fast[i][j]);
                }
            }
            cut += self.fast[i]
                .iter()
                .enumerate()
                .filter(|&(j, &bw)| bw > 0 && !inside[j])
                .count();
        }
        let taken: BTreeSet<Option<i32>> = set.iter().map(|&i| self.numa[i]).collect();
        let left: BTreeSet<Option<i32>> = (0..self.ids.len())
            .filter(|&j| !inside[j])
            .map(|j| self.numa[j])
            .collect();
        CandidateScore {
            fast_pairs,
            fast_bw,
            numa_nodes: Reverse(taken.len()),
            cut_links: Reverse(cut),
            split_numa: Reverse(taken.intersection(&left).count()),
        }
    }
}

/// Compared field by field, in declaration order; larger is better.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
struct CandidateScore {
    fast_pairs: usize,
    fast_bw: u64,
    numa_nodes: Reverse<usize>,
    cut_links: Reverse<usize>,
    split_numa: Reverse<usize>,
}

/// Every `count`-subset of the candidates in lexicographic order; the first best wins.
fn exhaustive(
    universe: &Universe,
    must: &[usize],
    candidates: &[usize],
    count: usize,
) -> Vec<usize> {
    let mut pick: Vec<usize> = (0..count).collect();
    let mut best: Option<(CandidateScore, Vec<usize>)> = None;
    let mut set = Vec::with_capacity(must.len() + count);
    loop {
        set.clear();
        set.extend_from_slice(must);
        set.extend(pick.iter().map(|&p| candidates[p]));
        let score = universe.score(&set);
        if best.as_ref().is_none_or(|(b, _)| score > *b) {
            best = Some((score, set.clone()));
        }
        // Next combination: bump the rightmost index that can still move.
        let candidate_count = candidates.len();
        let Some(i) = (0..count)
            .rev()
            .find(|&i| pick[i] < candidate_count - count + i)
        else {
            break;
        };
        pick[i] += 1;
        for j in i + 1..count {
            pick[j] = pick[j - 1] + 1;
        }
    }
    best.map(|(_, set)| set).unwrap_or_default()
}

/// Grows a set one device at a time from the must-include devices (or, with
/// none, from each candidate in turn, up to [`MAX_SEEDS`]), always adding the device with the most
/// fast links into the set, then on a NUMA node already used, then with the
/// fewest fast links to devices left behind; keeps the best grown set.
fn greedy(universe: &Universe, must: &[usize], candidates: &[usize], count: usize) -> Vec<usize> {
    let seeds: Vec<Option<usize>> = if must.is_empty() {
        let step = candidates.len().div_ceil(MAX_SEEDS).max(1);
        candidates.iter().step_by(step).map(|&c| Some(c)).collect()
    } else {
        vec![None]
    };
    let mut best: Option<(CandidateScore, Vec<usize>)> = None;
    for seed in seeds {
        let set = grow(universe, must, candidates, count, seed);
        let score = universe.score(&set);
        if best.as_ref().is_none_or(|(b, _)| score > *b) {
            best = Some((score, set));
        }
    }
    best.map(|(_, set)| set).unwrap_or_default()
}

fn grow(
    universe: &Universe,
    must: &[usize],
    candidates: &[usize],
    count: usize,
    seed: Option<usize>,
) -> Vec<usize> {
    let mut growing = Growing::new(universe, must.len() + count);
    for &m in must {
        growing.add(m);
    }
    let mut left = count;
    if let Some(s) = seed {
        growing.add(s);
        left -= 1;
    }
    for _ in 0..left {
        let next = candidates
            .iter()
            .copied()
            .filter(|&c| !growing.inside[c])
            .max_by_key(|&c| {
                (
                    growing.links_in[c],
                    growing.bw_in[c],
                    growing.numa_used.is_empty() || growing.numa_used.contains(&universe.numa[c]),
                    // Fast links to devices that would stay outside.
                    Reverse(universe.fast_degree[c] - growing.links_in[c]),
                    Reverse(c),
                )
            });
        match next {
            Some(c) => growing.add(c),
            None => break,
        }
    }
    growing.set
}

/// A set being grown, with what each device would bring to it.
struct Growing<'a> {
    universe: &'a Universe,
    set: Vec<usize>,
    inside: Vec<bool>,
    /// Per device: fast links into the set, and their bandwidth.
    links_in: Vec<usize>,
    bw_in: Vec<u64>,
    numa_used: BTreeSet<Option<i32>>,
}

impl<'a> Growing<'a> {
    fn new(universe: &'a Universe, capacity: usize) -> Self {
        let device_count = universe.ids.len();
        Self {
            universe,
            set: Vec::with_capacity(capacity),
            inside: vec![false; device_count],
            links_in: vec![0; device_count],
            bw_in: vec![0; device_count],
            numa_used: BTreeSet::new(),
        }
    }

    fn add(&mut self, device: usize) {
        self.set.push(device);
        self.inside[device] = true;
        self.numa_used.insert(self.universe.numa[device]);
        for (j, &bw) in self.universe.fast[device].iter().enumerate() {
            if bw > 0 {
                self.links_in[j] += 1;
                self.bw_in[j] = self.bw_in[j].saturating_add(bw);
            }
        }
    }
}

/// `total` choose `chosen`, saturating at `u64::MAX`.
fn binomial(total: u64, chosen: u64) -> u64 {
    if chosen > total {
        return 0;
    }
    let chosen = chosen.min(total - chosen);
    let mut result: u128 = 1;
    for i in 0..chosen {
        result = result * u128::from(total - i) / u128::from(i + 1);
        if result > u128::from(u64::MAX) {
            return u64::MAX;
        }
    }
    result as u64
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::{DeviceInfo, DeviceLink, DeviceState, RawHealth, Telemetry};
    use tessera_core::api::LinkKind;
    use tessera_core::api::Vendor;

    fn device(id: &str, index: u32, numa: Option<i32>) -> DeviceState {
        DeviceState {
            info: DeviceInfo {
                id: id.to_string(),
                index,
                vendor: Vendor::Nvidia,
                product: "test".into(),
                memory_total_bytes: 1 << 30,
                architecture: "9.0".into(),
                compute_units: 1,
                fp16_tflops: 1.0,
                fp8_tflops: None,
                fp4_tflops: None,
                memory_bandwidth_gbps: 1.0,
                pci_bus_id: format!("0000:{index:02x}:00.0"),
                numa_node: numa,
                mig: None,
            },
            telemetry: Telemetry::default(),
            health: RawHealth::Healthy,
        }
    }

    fn link(a: usize, b: usize, kind: LinkKind, gbps: f64) -> DeviceLink {
        DeviceLink {
            a: format!("g{a}"),
            b: format!("g{b}"),
            kind,
            bandwidth_gbps: gbps,
            p2p: true,
        }
    }

    /// `numa[i]` is device `g<i>`'s node; `links` are fast (NVLink) pairs;
    /// every other pair is joined over PCIe.
    fn node(numa: &[Option<i32>], fast: &[(usize, usize)]) -> Snapshot {
        let n = numa.len();
        let mut links = Vec::new();
        for a in 0..n {
            for b in a + 1..n {
                if fast.contains(&(a, b)) {
                    links.push(link(a, b, LinkKind::Nvlink, 600.0));
                } else {
                    links.push(link(a, b, LinkKind::Pcie, 64.0));
                }
            }
        }
        Snapshot {
            backend: "test".into(),
            devices: numa
                .iter()
                .enumerate()
                .map(|(i, &m)| device(&format!("g{i}"), i as u32, m))
                .collect(),
            links,
        }
    }

    fn ids(list: &[usize]) -> Vec<String> {
        list.iter().map(|i| format!("g{i}")).collect()
    }

    fn pick(s: &Snapshot, available: &[usize], must: &[usize], size: usize) -> Vec<String> {
        preferred_allocation(s, &ids(available), &ids(must), size)
    }

    /// Four PCIe cards on one NUMA node with NVLink bridges 0–1 and 2–3.
    fn bridged() -> Snapshot {
        node(&[Some(0); 4], &[(0, 1), (2, 3)])
    }

    #[test]
    fn a_pair_request_gets_a_linked_pair() {
        let s = bridged();
        assert_eq!(pick(&s, &[0, 1, 2, 3], &[], 2), ids(&[0, 1]));
        assert_eq!(pick(&s, &[0, 2, 3], &[], 2), ids(&[2, 3]));
        assert_eq!(pick(&s, &[1, 2, 3], &[], 2), ids(&[2, 3]));
    }

    #[test]
    fn a_single_device_does_not_split_an_intact_pair() {
        let s = bridged();
        assert_eq!(pick(&s, &[0, 1, 2], &[], 1), ids(&[2]));
        assert_eq!(pick(&s, &[1, 2, 3], &[], 1), ids(&[1]));
        // Both pairs intact: the first device (nothing better to choose).
        assert_eq!(pick(&s, &[0, 1, 2, 3], &[], 1), ids(&[0]));
    }

    #[test]
    fn three_devices_keep_a_pair_whole() {
        let s = bridged();
        assert_eq!(pick(&s, &[0, 1, 2, 3], &[], 3), ids(&[0, 1, 2]));
        assert_eq!(pick(&s, &[0, 2, 3], &[], 3), ids(&[0, 2, 3]));
    }

    #[test]
    fn must_include_is_honoured_and_drives_the_rest() {
        let s = bridged();
        assert_eq!(pick(&s, &[0, 1, 2, 3], &[2], 2), ids(&[2, 3]));
        assert_eq!(pick(&s, &[0, 1, 2, 3], &[3], 1), ids(&[3]));
        assert_eq!(pick(&s, &[0, 1, 2, 3], &[1, 3], 2), ids(&[1, 3]));
        // More must-include devices than asked for: all of them, nothing else.
        assert_eq!(pick(&s, &[0, 1, 2, 3], &[0, 2, 3], 2), ids(&[0, 2, 3]));
        // A must-include device kubelet did not list as available is still included.
        assert_eq!(pick(&s, &[0, 1], &[3], 2), ids(&[0, 3]));
    }

    #[test]
    fn same_numa_node_is_preferred_without_fast_links() {
        let s = node(&[Some(0), Some(0), Some(1), Some(1)], &[]);
        assert_eq!(pick(&s, &[0, 2, 3], &[], 2), ids(&[2, 3]));
        assert_eq!(pick(&s, &[1, 2, 3], &[], 2), ids(&[2, 3]));
        // One device: take the lone one, leave the node-mates together.
        assert_eq!(pick(&s, &[0, 2, 3], &[], 1), ids(&[0]));
        assert_eq!(pick(&s, &[0, 1, 3], &[], 1), ids(&[3]));
    }

    #[test]
    fn fast_links_beat_numa() {
        // 1–2 are NVLinked across NUMA nodes; 0 and 1 share a node over PCIe.
        let s = node(&[Some(0), Some(0), Some(1)], &[(1, 2)]);
        assert_eq!(pick(&s, &[0, 1, 2], &[], 2), ids(&[1, 2]));
    }

    #[test]
    fn a_full_mesh_fills_numa_nodes_in_order() {
        let numa: Vec<Option<i32>> = (0..8).map(|i| Some(i32::from(i >= 4))).collect();
        let all: Vec<(usize, usize)> = (0..8)
            .flat_map(|a| (a + 1..8).map(move |b| (a, b)))
            .collect();
        let s = node(&numa, &all);
        assert_eq!(
            pick(&s, &[0, 1, 2, 3, 4, 5, 6, 7], &[], 4),
            ids(&[0, 1, 2, 3])
        );
        assert_eq!(pick(&s, &[1, 2, 3, 4, 5, 6, 7], &[], 4), ids(&[4, 5, 6, 7]));
        assert_eq!(pick(&s, &[1, 2, 3, 4, 5, 6, 7], &[], 2), ids(&[1, 2]));
    }

    #[test]
    fn the_answer_does_not_depend_on_input_order_or_duplicates() {
        let s = bridged();
        let a = pick(&s, &[0, 1, 2, 3], &[], 2);
        let b = preferred_allocation(&s, &ids(&[3, 2, 1, 0, 2]), &[], 2);
        assert_eq!(a, b);
    }

    #[test]
    fn too_few_devices_returns_all_and_zero_returns_none() {
        let s = bridged();
        assert_eq!(pick(&s, &[2, 0], &[], 3), ids(&[0, 2]));
        assert!(pick(&s, &[0, 1], &[], 0).is_empty());
        assert_eq!(pick(&s, &[], &[], 1), Vec::<String>::new());
    }

    #[test]
    fn unknown_ids_are_plain_candidates_after_known_ones() {
        let s = bridged();
        let got = preferred_allocation(&s, &["zz".into(), "g1".into()], &[], 1);
        assert_eq!(got, vec!["g1".to_string()]);
        let got = preferred_allocation(&s, &["zz".into(), "g1".into()], &[], 2);
        assert_eq!(got, vec!["g1".to_string(), "zz".to_string()]);
    }

    #[test]
    fn large_nodes_use_the_greedy_search_and_still_keep_pairs() {
        // 40 devices in NVLinked pairs (2i, 2i+1), 20 per NUMA node.
        let n = 40;
        let numa: Vec<Option<i32>> = (0..n).map(|i| Some(i32::from(i >= 20))).collect();
        let pairs: Vec<(usize, usize)> = (0..n / 2).map(|p| (2 * p, 2 * p + 1)).collect();
        let s = node(&numa, &pairs);
        let available: Vec<usize> = (1..n).collect(); // g0 is taken: g1 is a lone device
        assert!(binomial(39, 12) > EXHAUSTIVE_LIMIT);
        let got = pick(&s, &available, &[], 12);
        let pos: Vec<usize> = got.iter().map(|g| g[1..].parse().unwrap()).collect();
        // Six whole pairs on one NUMA node, and not the lone g1.
        assert_eq!(pos.len(), 12);
        assert!(!pos.contains(&1), "{pos:?}");
        for p in &pos {
            assert!(pos.contains(&(p ^ 1)), "{p} without its partner: {pos:?}");
        }
        assert!(pos.iter().all(|&p| (p >= 20) == (pos[0] >= 20)), "{pos:?}");
        // Deterministic.
        assert_eq!(pick(&s, &available, &[], 12), got);
        // With a must-include device, its partner comes along.
        let got = pick(&s, &available, &[31], 12);
        assert!(got.contains(&"g31".to_string()) && got.contains(&"g30".to_string()));
    }

    #[test]
    fn xgmi_counts_as_fast_and_pcie_does_not() {
        let mut s = node(&[Some(0); 3], &[]);
        s.links.push(link(1, 2, LinkKind::Xgmi, 128.0));
        assert_eq!(pick(&s, &[0, 1, 2], &[], 2), ids(&[1, 2]));
    }

    #[test]
    fn binomial_is_right_and_saturates() {
        assert_eq!(binomial(4, 2), 6);
        assert_eq!(binomial(10, 0), 1);
        assert_eq!(binomial(3, 5), 0);
        assert_eq!(binomial(256, 128), u64::MAX);
    }
}
