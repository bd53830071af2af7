//! Turning a chosen set of device groups into a plan: pipeline order, layer
//! split, score and predicted speed. The search, the exhaustive reference and
//! callers checking an existing plan all go through `PreparedProblem::evaluate`, so they
//! agree on what a plan is worth.

use std::cell::OnceCell;

use super::exclusion::{Exclusion, exclusion_text};
use super::hops::{HOP_SAME_NODE, HOP_SAME_RACK, HOP_SAME_ZONE, hop_between_nodes};
use super::links::link_positions;
use super::plan::{Performance, Plan, Score, StageParts, StagePlan, StageShare, TokenTime};
use super::problem::{
    Device, DeviceShare, Interconnect, ModelShape, NodeState, Problem, Stages, Weights, share_bytes,
};
use super::share_sizing;
use super::speed::{GroupSpeed, LayerTime, layer_time, link_gbps};
use super::split::split_layers;
use super::strategy_score;

/// A stage given by names, as a caller outside the solver knows it.
#[derive(Clone, Debug, PartialEq)]
pub struct StageChoice {
    pub node: String,
    pub devices: Vec<String>,
}

/// Tensor-parallel groups all-reduce on every layer, so the slowest link of the
/// group matters far more than for pipeline hops.
pub(crate) fn tensor_link_cost(kind: Option<Interconnect>) -> f64 {
    match kind {
        Some(kind) if kind.is_scale_up() => 0.0,
        Some(_) => 0.5,
        None => 0.6,
    }
}

/// Bandwidth (bytes/s) and latency (s) of a pipeline hop by distance class.
pub(crate) fn hop_transfer(cost: f64) -> (f64, f64) {
    if cost <= HOP_SAME_NODE {
        (32e9, 10e-6)
    } else if cost <= HOP_SAME_RACK {
        (25e9, 20e-6)
    } else if cost <= HOP_SAME_ZONE {
        (12.5e9, 50e-6)
    } else {
        (5e9, 500e-6)
    }
}

/// Links of one node as a device-by-device matrix (nodes have a handful of GPUs).
pub(crate) struct NodeLinks {
    devices: usize,
    matrix: Vec<Option<(Interconnect, f64)>>,
}

impl NodeLinks {
    fn new(node: &NodeState) -> Self {
        let device_count = node.devices.len();
        let mut matrix = vec![None; device_count * device_count];
        for (first, second, link) in link_positions(node) {
            for (from, to) in [(first, second), (second, first)] {
                let slot = &mut matrix[from * device_count + to];
                // Keep the best link when a pair is listed twice (e.g. once per direction).
                let better = slot.is_none_or(|(kind, gbps): (Interconnect, f64)| {
                    link.kind < kind || (link.kind == kind && link.bandwidth_gbps > gbps)
                });
                if better {
                    *slot = Some((link.kind, link.bandwidth_gbps));
                }
            }
        }
        Self {
            devices: device_count,
            matrix,
        }
    }

    pub(crate) fn get(&self, from: usize, to: usize) -> Option<(Interconnect, f64)> {
        self.matrix[from * self.devices + to]
    }
}

/// Everything about a problem that does not depend on the choice of groups.
pub(crate) struct PreparedProblem<'p> {
    pub problem: &'p Problem,
    /// Devices per shard: the problem's, or the size `tensor: auto` is trying
    /// (so trying a size needs no copy of the problem).
    pub tensor: u32,
    /// The user weights, normalised and scaled by `1 - sharing_weight`: what
    /// each of the five parts counts for in the total.
    pub weights: Weights,
    /// What the sharing part counts for (0 under `Strategy::ScoreOnly`).
    pub sharing_weight: f64,
    /// `sharing[node][device]`: each device's sharing value; empty when the
    /// part weighs nothing.
    sharing: Vec<Vec<f64>>,
    /// Bytes one layer occupies (weights + KV cache), across a whole group.
    pub layer_bytes: f64,
    pub max_tflops: f64,
    pub max_bandwidth: f64,
    /// Built on first use: a greedy plan only needs the links of the nodes it uses.
    links: Vec<OnceCell<NodeLinks>>,
    /// `exclusions[node][device]`: `None` when the device is eligible.
    pub exclusions: Vec<Vec<Option<Exclusion>>>,
}

impl<'p> PreparedProblem<'p> {
    pub(crate) fn new(problem: &'p Problem) -> Self {
        Self::sized(problem, problem.tensor)
    }

    /// The problem with `tensor` devices per shard instead of its own.
    pub(crate) fn sized(problem: &'p Problem, tensor_size: u32) -> Self {
        let layer_bytes = problem.model.weight_bytes_per_layer + problem.model.kv_bytes_per_layer;
        let tensor = f64::from(tensor_size.max(1));
        let need_one_layer = problem.model.overhead_bytes_per_device + layer_bytes / tensor;
        let mut exclusions: Vec<Vec<Option<Exclusion>>> = problem
            .nodes
            .iter()
            .map(|node| {
                let node_ok = node_selected(problem, node);
                node.devices
                    .iter()
                    .map(|device| exclusion(problem, node_ok, device, need_one_layer))
                    .collect()
            })
            .collect();
        share_sizing::narrow_shared_candidates(problem, tensor_size, &mut exclusions);
        let mut max_tflops: f64 = 0.0;
        let mut max_bandwidth: f64 = 0.0;
        for (node, node_exclusions) in problem.nodes.iter().zip(&exclusions) {
            for (device, excluded) in node.devices.iter().zip(node_exclusions) {
                if excluded.is_none() {
                    max_tflops = max_tflops.max(device.fp16_tflops);
                    max_bandwidth = max_bandwidth.max(device.memory_bandwidth_gbps);
                }
            }
        }
        let sharing_weight = strategy_score::sharing_weight(problem.strategy);
        let sharing = strategy_score::device_values(problem, &|node, device| {
            exclusions[node][device].is_none()
        });
        let normalized = problem.weights.normalized();
        // Scaling by exactly 1 under `ScoreOnly` keeps every score as it was.
        let user_share = 1.0 - sharing_weight;
        Self {
            problem,
            tensor: tensor_size,
            weights: Weights {
                compute: normalized.compute * user_share,
                memory: normalized.memory * user_share,
                network: normalized.network * user_share,
                thermal: normalized.thermal * user_share,
                bandwidth: normalized.bandwidth * user_share,
            },
            sharing_weight,
            sharing,
            layer_bytes,
            max_tflops,
            max_bandwidth,
            links: problem.nodes.iter().map(|_| OnceCell::new()).collect(),
            exclusions,
        }
    }

    pub(crate) fn links(&self, node: usize) -> &NodeLinks {
        self.links[node].get_or_init(|| NodeLinks::new(&self.problem.nodes[node]))
    }

    /// Network position of a node: pipelines visit nodes in this order, so stages
    /// in one rack, then one zone, are neighbours.
    pub(crate) fn position_cmp(&self, first: usize, second: usize) -> std::cmp::Ordering {
        let (first_node, second_node) = (&self.problem.nodes[first], &self.problem.nodes[second]);
        (&first_node.zone, &first_node.rack, &first_node.name, first).cmp(&(
            &second_node.zone,
            &second_node.rack,
            &second_node.name,
            second,
        ))
    }

    pub(crate) fn eligible(&self, node: usize, device: usize) -> bool {
        self.exclusions[node][device].is_none()
    }

    pub(crate) fn device(&self, node: usize, device: usize) -> &Device {
        &self.problem.nodes[node].devices[device]
    }

    /// Cost of a pipeline hop between two different nodes.
    pub(crate) fn node_distance(&self, from: usize, to: usize) -> f64 {
        let (from_node, to_node) = (&self.problem.nodes[from], &self.problem.nodes[to]);
        let same_zone = from_node.zone.is_some() && from_node.zone == to_node.zone;
        hop_between_nodes(
            same_zone,
            same_zone && from_node.rack.is_some() && from_node.rack == to_node.rack,
        )
    }

    /// Normalised compute, thermal and bandwidth parts of a device.
    pub(crate) fn device_parts(&self, device: &Device) -> (f64, f64, f64) {
        let compute = ratio(device.fp16_tflops, self.max_tflops);
        let bandwidth = ratio(device.memory_bandwidth_gbps, self.max_bandwidth);
        let limit = self.problem.max_temperature_c;
        let thermal = match scored_temperature(device) {
            Some(temperature) if limit > 0.0 => ((limit - temperature) / limit).clamp(0.0, 1.0),
            _ => 0.5,
        };
        (compute, thermal, bandwidth)
    }

    /// The sharing value of a device (see `sharing`).
    pub(crate) fn device_sharing(&self, node: usize, device: usize) -> f64 {
        self.sharing
            .get(node)
            .and_then(|values| values.get(device))
            .copied()
            .unwrap_or(0.0)
    }

    /// A stage's sharing value: the mean over its devices.
    pub(crate) fn group_sharing(&self, node: usize, devices: &[usize]) -> f64 {
        if self.sharing.is_empty() || devices.is_empty() {
            return 0.0;
        }
        devices
            .iter()
            .map(|&device| self.device_sharing(node, device))
            .sum::<f64>()
            / devices.len() as f64
    }

    /// Layers a group of devices can hold: every device carries the overhead plus
    /// its `1/tensor` share of each layer, so the tightest device decides.
    pub(crate) fn capacity(&self, min_free: f64) -> u32 {
        let per_device = self.layer_bytes / f64::from(self.tensor.max(1));
        let room = min_free - self.problem.model.overhead_bytes_per_device;
        if room < per_device || per_device <= 0.0 {
            return if room >= 0.0 && per_device <= 0.0 {
                self.problem.model.layers
            } else {
                0
            };
        }
        let layers = (room / per_device).floor();
        if layers >= f64::from(self.problem.model.layers) {
            self.problem.model.layers
        } else {
            layers as u32
        }
    }

    /// Worst link cost inside a tensor group (0 for a single device).
    pub(crate) fn intra_cost(&self, node: usize, devices: &[usize]) -> f64 {
        let mut worst: f64 = 0.0;
        for (i, &first) in devices.iter().enumerate() {
            for &second in &devices[i + 1..] {
                let link = self.links(node).get(first, second);
                worst = worst.max(tensor_link_cost(link.map(|(kind, _)| kind)));
            }
        }
        worst
    }

    /// Normaliser of the network part: pipeline hops plus one term per tensor group.
    pub(crate) fn network_terms(&self, stages: u32) -> f64 {
        let hops = f64::from(stages.saturating_sub(1));
        let groups = if self.tensor > 1 {
            f64::from(stages)
        } else {
            0.0
        };
        hops + groups
    }

    /// Bytes the whole plan needs across its devices.
    pub(crate) fn demand(&self, stages: u32) -> f64 {
        f64::from(self.problem.model.layers) * self.layer_bytes
            + f64::from(stages * self.tensor) * self.problem.model.overhead_bytes_per_device
    }

    /// Time one layer takes for one token on a group, by part; `contended`:
    /// with every tenant of a shared GPU decoding at once.
    fn layer_time(&self, node: usize, devices: &[usize], contended: bool) -> LayerTime {
        let mut group: Option<GroupSpeed> = None;
        for &device in devices {
            let gpu = self.device(node, device);
            let mut speed = GroupSpeed::of(gpu, self.problem.model.precision);
            if contended {
                speed = speed.split(gpu.tenants() + 1);
            }
            group = Some(group.map_or(speed, |slowest| slowest.slowest(speed)));
        }
        let Some(mut group) = group else {
            return LayerTime::default();
        };
        if devices.len() > 1 {
            let mut slowest_gbps = f64::INFINITY;
            let mut worst_kind = Some(Interconnect::NvLink);
            for (i, &first) in devices.iter().enumerate() {
                for &second in &devices[i + 1..] {
                    let link = self.links(node).get(first, second);
                    slowest_gbps = slowest_gbps.min(link_gbps(link.map(|(_, gbps)| gbps)));
                    worst_kind = worse_link(worst_kind, link.map(|(kind, _)| kind));
                }
            }
            group = group.with_link(slowest_gbps, worst_kind);
        }
        layer_time(&self.problem.model, self.tensor, &group)
    }

    /// Scores the groups as a plan. `groups` are `(node, device indices)`; their
    /// order does not matter. Fails with a sentence when the groups are not a
    /// valid plan for this problem.
    pub(crate) fn evaluate(&self, groups: &[(usize, Vec<usize>)]) -> Result<Plan, String> {
        let stage_count = self.check_groups(groups)?;
        let ordered = self.pipeline_order(groups);
        let min_free: Vec<f64> = ordered
            .iter()
            .map(|(node, devices)| self.min_free(*node, devices))
            .collect();
        let capacities: Vec<u32> = min_free.iter().map(|&free| self.capacity(free)).collect();
        let total_capacity: u64 = capacities.iter().map(|&capacity| u64::from(capacity)).sum();
        if capacities.contains(&0) || total_capacity < u64::from(self.problem.model.layers) {
            return Err(format!(
                "the stages hold {total_capacity} of {} layers",
                self.problem.model.layers
            ));
        }
        let layer_times: Vec<LayerTime> = ordered
            .iter()
            .map(|(node, devices)| self.layer_time(*node, devices, false))
            .collect();
        let layer_seconds: Vec<f64> = layer_times.iter().map(LayerTime::total).collect();
        let layers = split_layers(self.problem.model.layers, &capacities, &layer_seconds);

        let mut totals = PlanTotals::default();
        let mut stages = Vec::with_capacity(ordered.len());
        let mut transfer_ms = Vec::new();
        let mut layer_start = 0;
        for (stage_index, (node, devices)) in ordered.iter().enumerate() {
            let next_node = ordered.get(stage_index + 1).map(|(next, _)| *next);
            let stage = self.stage_plan(
                *node,
                devices,
                next_node,
                (layer_start, layers[stage_index]),
                min_free[stage_index],
                &mut totals,
            );
            if next_node.is_some() {
                let (bytes_per_s, latency) = hop_transfer(stage.parts.next_hop_cost);
                transfer_ms.push(
                    (self.problem.model.activation_bytes_per_token / bytes_per_s + latency) * 1e3,
                );
            }
            stages.push(stage);
            layer_start += layers[stage_index];
        }
        let shared = stages
            .iter()
            .any(|stage| matches!(stage.share, Some(StageShare::Memory { .. })));
        let contended = shared.then(|| {
            let times: Vec<LayerTime> = ordered
                .iter()
                .map(|(node, devices)| self.layer_time(*node, devices, true))
                .collect();
            performance(&times, &layers, transfer_ms.clone()).tokens_per_second
        });
        let mut performance = performance(&layer_times, &layers, transfer_ms);
        performance.contended_tokens_per_second = contended;
        Ok(Plan {
            stages,
            score: self.plan_score(stage_count, &totals),
            optimal: false,
            steps: 0,
            performance,
        })
    }

    /// The number of stages, or why the groups are not a plan: each stage has
    /// `tensor` eligible devices, none used twice, at least a layer each.
    fn check_groups(&self, groups: &[(usize, Vec<usize>)]) -> Result<u32, String> {
        let problem = self.problem;
        let stage_count = u32::try_from(groups.len()).map_err(|_| "too many stages".to_string())?;
        if stage_count == 0 {
            return Err("a plan needs at least one stage".into());
        }
        if stage_count > problem.model.layers {
            return Err(format!(
                "{stage_count} stages for {} layers: every stage needs a layer",
                problem.model.layers
            ));
        }
        let mut seen = std::collections::HashSet::new();
        for (node, devices) in groups {
            let node_name = &problem.nodes[*node].name;
            if devices.len() != self.tensor as usize {
                return Err(format!(
                    "a stage on {node_name} has {} devices; tensor is {}",
                    devices.len(),
                    self.tensor
                ));
            }
            for &device in devices {
                let id = &self.device(*node, device).id;
                if !seen.insert((*node, device)) {
                    return Err(format!("device {id} on {node_name} is used twice"));
                }
                if let Some(excluded) = &self.exclusions[*node][device] {
                    return Err(format!(
                        "device {id} on {node_name} is not eligible: {}",
                        exclusion_text(excluded, problem)
                    ));
                }
            }
        }
        Ok(stage_count)
    }

    /// The groups in pipeline order: by network position, then by first device.
    fn pipeline_order<'g>(
        &self,
        groups: &'g [(usize, Vec<usize>)],
    ) -> Vec<&'g (usize, Vec<usize>)> {
        let first = |group: &(usize, Vec<usize>)| group.1.iter().copied().min().unwrap_or(0);
        let mut ordered: Vec<&(usize, Vec<usize>)> = groups.iter().collect();
        ordered.sort_by(|a, b| self.position_cmp(a.0, b.0).then(first(a).cmp(&first(b))));
        ordered
    }

    /// The free memory of the group's tightest device.
    fn min_free(&self, node: usize, devices: &[usize]) -> f64 {
        devices
            .iter()
            .map(|&device| self.device(node, device).memory_free_bytes as f64)
            .fold(f64::INFINITY, f64::min)
    }

    /// One stage of the plan, holding `layers` = (first, count); adds its parts
    /// to `totals`. `next_node` is the next stage's node (none for the last).
    fn stage_plan(
        &self,
        node: usize,
        devices: &[usize],
        next_node: Option<usize>,
        layers: (u32, u32),
        min_free: f64,
        totals: &mut PlanTotals,
    ) -> StagePlan {
        let (layer_start, layer_count) = layers;
        let StageScore {
            compute,
            thermal,
            bandwidth,
            sharing,
            next_hop_cost,
        } = self.add_stage_score(node, devices, next_node, totals);
        let tensor = f64::from(self.tensor.max(1));
        let memory = self.problem.model.overhead_bytes_per_device
            + f64::from(layer_count) * self.layer_bytes / tensor;
        let mut sorted = devices.to_vec();
        sorted.sort_unstable();
        StagePlan {
            node: self.problem.nodes[node].name.clone(),
            devices: sorted
                .iter()
                .map(|&device| self.device(node, device).id.clone())
                .collect(),
            device_indices: sorted
                .iter()
                .map(|&device| self.device(node, device).index)
                .collect(),
            layer_start,
            layer_end: layer_start + layer_count,
            memory_per_device_bytes: memory,
            share: sorted
                .first()
                .and_then(|&device| stage_share(self.device(node, device), memory)),
            parts: StageParts {
                compute,
                memory: (1.0 - memory / min_free).clamp(0.0, 1.0),
                thermal,
                bandwidth,
                next_hop_cost,
                sharing,
            },
        }
    }

    /// One stage's score parts, added to `totals`. `evaluate` and `score_total`
    /// both add stages through here, in pipeline order, so the search's quick
    /// total is the very number the plan gets, bit for bit.
    fn add_stage_score(
        &self,
        node: usize,
        devices: &[usize],
        next_node: Option<usize>,
        totals: &mut PlanTotals,
    ) -> StageScore {
        let (mut compute, mut thermal, mut bandwidth) =
            (f64::INFINITY, f64::INFINITY, f64::INFINITY);
        for &device in devices {
            let gpu = self.device(node, device);
            let (device_compute, device_thermal, device_bandwidth) = self.device_parts(gpu);
            compute = compute.min(device_compute);
            thermal = thermal.min(device_thermal);
            bandwidth = bandwidth.min(device_bandwidth);
            totals.free_bytes += gpu.memory_free_bytes as f64;
        }
        let sharing = self.group_sharing(node, devices);
        totals.compute += compute;
        totals.thermal += thermal;
        totals.bandwidth += bandwidth;
        totals.sharing += sharing;
        totals.network_cost += self.intra_cost(node, devices);
        let next_hop_cost = match next_node {
            Some(next) if next == node => HOP_SAME_NODE,
            Some(next) => self.node_distance(node, next),
            None => 0.0,
        };
        if next_node.is_some() {
            totals.network_cost += next_hop_cost;
        }
        StageScore {
            compute,
            thermal,
            bandwidth,
            sharing,
            next_hop_cost,
        }
    }

    /// The total `evaluate` would give `stages`, which must already be a plan
    /// (as the search builds them) in pipeline order. Skips what the total does
    /// not read (the layer split, names, the predicted speed), so the search
    /// builds a whole plan only for a leaf that beats the best so far.
    pub(crate) fn score_total<'s>(
        &self,
        stages: impl ExactSizeIterator<Item = (usize, &'s [usize])> + Clone,
    ) -> f64 {
        let stage_count = stages.len() as u32;
        let mut totals = PlanTotals::default();
        let mut next_nodes = stages.clone().map(|(node, _)| node).skip(1);
        for (node, devices) in stages {
            self.add_stage_score(node, devices, next_nodes.next(), &mut totals);
        }
        self.plan_score(stage_count, &totals).total
    }

    /// The plan's score from its stages' summed parts.
    fn plan_score(&self, stage_count: u32, totals: &PlanTotals) -> Score {
        let stages = f64::from(stage_count);
        let terms = self.network_terms(stage_count);
        let network = if terms > 0.0 {
            (1.0 - totals.network_cost / terms).clamp(0.0, 1.0)
        } else {
            1.0
        };
        let memory = memory_part(self.demand(stage_count), totals.free_bytes);
        let weights = &self.weights;
        let (compute, thermal, bandwidth, sharing) = (
            totals.compute / stages,
            totals.thermal / stages,
            totals.bandwidth / stages,
            totals.sharing / stages,
        );
        Score {
            total: weights.compute * compute
                + weights.memory * memory
                + weights.network * network
                + weights.thermal * thermal
                + weights.bandwidth * bandwidth
                + self.sharing_weight * sharing,
            compute,
            memory,
            network,
            thermal,
            bandwidth,
            sharing,
        }
    }
}

/// One stage's own score parts.
struct StageScore {
    compute: f64,
    thermal: f64,
    bandwidth: f64,
    sharing: f64,
    next_hop_cost: f64,
}

/// The stages' parts, summed in pipeline order.
#[derive(Default)]
struct PlanTotals {
    compute: f64,
    thermal: f64,
    bandwidth: f64,
    sharing: f64,
    /// Free memory of every planned device.
    free_bytes: f64,
    /// Tensor-group link costs plus pipeline hop costs.
    network_cost: f64,
}

/// The worse of two links for an all-reduce: no link is worst, then PCIe,
/// then xGMI, then NVLink.
pub(crate) fn worse_link(
    first: Option<Interconnect>,
    second: Option<Interconnect>,
) -> Option<Interconnect> {
    match (first, second) {
        (Some(first), Some(second)) => Some(first.max(second)),
        _ => None,
    }
}

/// The most tokens/s any plan of a problem could be predicted, by tensor
/// size: every layer on the fastest, best-fed free GPU there is, all-reduces
/// over the fastest link with the least latency, no hops between stages.
/// Lets `tensor: auto` skip sizes that cannot beat a plan it has.
pub(crate) struct SpeedCeiling<'p> {
    model: &'p ModelShape,
    stages: Stages,
    /// The best device figures any free device has (possibly from different devices).
    best: Option<GroupSpeed>,
    link_gbps: f64,
    /// The most free memory any free device has.
    most_free: f64,
}

impl<'p> SpeedCeiling<'p> {
    pub(crate) fn new(problem: &'p Problem) -> Self {
        Self::of_kind(problem, None)
    }

    /// The ceiling on GPUs of one `kind` (a product) alone, or on any.
    pub(crate) fn of_kind(problem: &'p Problem, kind: Option<&str>) -> Self {
        let mut best: Option<GroupSpeed> = None;
        let mut fastest_link = link_gbps(None);
        let mut most_free: f64 = 0.0;
        for node in &problem.nodes {
            let mut any = false;
            for device in &node.devices {
                if device.healthy
                    && device.allocated_to.is_none()
                    && kind.is_none_or(|kind| device.product == kind)
                {
                    any = true;
                    most_free = most_free.max(device.memory_free_bytes as f64);
                    let speed = GroupSpeed::of(device, problem.model.precision);
                    best = Some(best.map_or(speed, |best| best.fastest(speed)));
                }
            }
            if any || kind.is_none() {
                for link in &node.links {
                    fastest_link = fastest_link.max(link_gbps(Some(link.bandwidth_gbps)));
                }
            }
        }
        Self {
            model: &problem.model,
            stages: problem.stages,
            best,
            link_gbps: fastest_link,
            most_free,
        }
    }

    /// The fewest stages any plan with `tensor` GPUs per shard can have: a
    /// fixed count, or as many as the layers need when every group holds as
    /// many as the roomiest free GPU would. At least 1.
    pub(crate) fn fewest_stages(&self, tensor: u32) -> u32 {
        let layers = self.model.layers.max(1);
        if let Stages::Fixed(stages) = self.stages {
            return stages.max(1);
        }
        let per_device = (self.model.weight_bytes_per_layer + self.model.kv_bytes_per_layer)
            / f64::from(tensor.max(1));
        let room = self.most_free - self.model.overhead_bytes_per_device;
        if per_device <= 0.0 || room <= 0.0 {
            return 1;
        }
        let per_group = (room / per_device).floor();
        if per_group.is_nan() || per_group < 1.0 || per_group >= f64::from(layers) {
            return 1;
        }
        layers.div_ceil(per_group as u32)
    }

    /// The ceiling with `tensor` GPUs per shard (infinite when nothing is known).
    pub(crate) fn at(&self, tensor: u32) -> f64 {
        let Some(best) = self.best else {
            return f64::INFINITY;
        };
        // NVLink has the least all-reduce latency; one device ignores the link.
        let group = best.with_link(self.link_gbps, Some(Interconnect::NvLink));
        let seconds = f64::from(self.model.layers) * layer_time(self.model, tensor, &group).total();
        if seconds > 0.0 && seconds.is_finite() {
            1.0 / seconds
        } else {
            f64::INFINITY
        }
    }
}

/// Predicted speed: a token passes every stage and every hop in turn.
fn performance(layer_times: &[LayerTime], layers: &[u32], transfer_ms: Vec<f64>) -> Performance {
    let mut token_time = TokenTime {
        hops_ms: transfer_ms.iter().fold(0.0, |sum, ms| sum + ms),
        ..TokenTime::default()
    };
    let mut stage_ms = Vec::with_capacity(layers.len());
    for (time, &count) in layer_times.iter().zip(layers) {
        let count_ms = f64::from(count) * 1e3;
        if time.weights >= time.compute {
            token_time.weights_ms += time.weights * count_ms;
        } else {
            token_time.compute_ms += time.compute * count_ms;
        }
        token_time.layer_overhead_ms += time.overhead * count_ms;
        token_time.all_reduce_ms += time.all_reduce * count_ms;
        stage_ms.push(time.total() * count_ms);
    }
    let token_ms: f64 = stage_ms.iter().sum::<f64>() + token_time.hops_ms;
    Performance {
        tokens_per_second: if token_ms > 0.0 { 1e3 / token_ms } else { 0.0 },
        contended_tokens_per_second: None,
        stage_ms,
        transfer_ms,
        token_time,
        widened: Vec::new(),
    }
}

/// What part of a GPU a stage on `device` gets, needing `memory` bytes.
fn stage_share(device: &Device, memory: f64) -> Option<StageShare> {
    match device.share.as_ref()? {
        DeviceShare::Partition { gpu, profile, .. } => Some(StageShare::Partition {
            gpu: gpu.clone(),
            profile: profile.clone(),
        }),
        DeviceShare::Memory { .. } if device.taken_whole(memory) => None,
        DeviceShare::Memory { tenants } => {
            let bytes = share_bytes(memory);
            Some(StageShare::Memory {
                bytes,
                fraction: bytes as f64 / (device.memory_total_bytes.max(1)) as f64,
                tenants: *tenants,
            })
        }
    }
}

/// Share of the planned devices' free memory left once the model is loaded.
pub(crate) fn memory_part(demand: f64, free: f64) -> f64 {
    if free <= 0.0 {
        0.0
    } else {
        (1.0 - demand / free).clamp(0.0, 1.0)
    }
}

fn ratio(value: f64, max: f64) -> f64 {
    if max > 0.0 {
        (value / max).clamp(0.0, 1.0)
    } else {
        0.0
    }
}

/// The temperature the objective reads (`api::telemetry`): whole degrees, so
/// drift of a fraction of a degree neither changes a plan's score nor splits
/// twin devices. The temperature limit is a hard constraint and compares the
/// raw reading (`exclusion`): a device at 84.6 °C is below an 85 °C limit.
pub(crate) fn scored_temperature(device: &Device) -> Option<f64> {
    device
        .temperature_c
        .map(crate::api::telemetry::scored_temperature)
}

/// The devices any plan of the problem may take (however large its layers):
/// free, healthy, cool enough, and chosen by the selector.
pub(crate) fn eligible_devices(problem: &Problem) -> impl Iterator<Item = &Device> {
    problem.nodes.iter().flat_map(move |node| {
        let node_ok = node_selected(problem, node);
        node.devices
            .iter()
            .filter(move |device| exclusion(problem, node_ok, device, 0.0).is_none())
    })
}

fn node_selected(problem: &Problem, node: &NodeState) -> bool {
    problem
        .selector
        .node_labels
        .iter()
        .all(|(key, value)| node.labels.get(key) == Some(value))
}

fn exclusion(
    problem: &Problem,
    node_ok: bool,
    device: &Device,
    need_one_layer: f64,
) -> Option<Exclusion> {
    if let Some(holder) = &device.allocated_to {
        return Some(Exclusion::Allocated(holder.clone()));
    }
    if let Some(why) = &device.not_whole {
        return Some(Exclusion::NotWhole(why.clone()));
    }
    if !device.healthy {
        return Some(Exclusion::Unhealthy(device.health_reason.clone()));
    }
    let narrow_ok = [device.fp8_tflops, device.fp4_tflops]
        .into_iter()
        .flatten()
        .all(|rate| rate.is_finite() && rate > 0.0);
    if !(device.fp16_tflops.is_finite()
        && device.fp16_tflops > 0.0
        && narrow_ok
        && device.memory_bandwidth_gbps.is_finite()
        && device.memory_bandwidth_gbps > 0.0)
    {
        return Some(Exclusion::BadTelemetry);
    }
    if let Some(temperature) = device.temperature_c
        && (!temperature.is_finite() || temperature >= problem.max_temperature_c)
    {
        return Some(Exclusion::TooHot(temperature));
    }
    if !problem.selector.vendors.is_empty() && !problem.selector.vendors.contains(&device.vendor) {
        return Some(Exclusion::Vendor);
    }
    if !problem.selector.products.is_empty() {
        let product = device.product.to_lowercase();
        if !problem
            .selector
            .products
            .iter()
            .any(|wanted| product.contains(&wanted.to_lowercase()))
        {
            return Some(Exclusion::Product);
        }
    }
    if let Some(kind) = &problem.selector.kind
        && kind != &device.product
    {
        return Some(Exclusion::OtherKind);
    }
    if !node_ok {
        return Some(Exclusion::NodeSelector);
    }
    let free = device.memory_free_bytes as f64;
    if free < need_one_layer {
        return Some(Exclusion::TooLittleMemory {
            free,
            need: need_one_layer,
        });
    }
    None
}

/// Scores a plan given by names. Used to check that an existing plan is still
/// valid and to compare plans from elsewhere (e.g. a baseline) on our objective.
pub fn evaluate(problem: &Problem, stages: &[StageChoice]) -> Result<Plan, String> {
    let ctx = PreparedProblem::new(problem);
    let mut groups = Vec::with_capacity(stages.len());
    for stage in stages {
        let node = problem
            .nodes
            .iter()
            .position(|candidate| candidate.name == stage.node)
            .ok_or_else(|| format!("node {} is not in the problem", stage.node))?;
        let devs = stage
            .devices
            .iter()
            .map(|id| {
                problem.nodes[node]
                    .devices
                    .iter()
                    .position(|device| device.id == *id)
                    .ok_or_else(|| format!("device {id} is not on node {}", stage.node))
            })
            .collect::<Result<Vec<_>, _>>()?;
        groups.push((node, devs));
    }
    let mut plan = ctx.evaluate(&groups)?;
    plan.performance.widened = super::widened::widened(problem, &plan);
    Ok(plan)
}

#[cfg(test)]
mod tests {
    use super::super::problem::{Link, Stages};
    use super::super::testutil::*;
    use super::*;
    use crate::api::GIB;

    fn choice(node: &str, devices: &[usize]) -> StageChoice {
        StageChoice {
            node: node.into(),
            devices: devices
                .iter()
                .map(|device| format!("{node}-{device}"))
                .collect(),
        }
    }

    #[test]
    fn compute_and_bandwidth_are_relative_to_the_best_eligible_device() {
        let problem = problem(
            vec![node("h", 1, H100), node("m", 1, MI300X)],
            7,
            1,
            Stages::Fixed(1),
        );
        let on_h100 = evaluate(&problem, &[choice("h", &[0])]).unwrap();
        let on_mi300x = evaluate(&problem, &[choice("m", &[0])]).unwrap();
        assert_eq!(on_mi300x.score.compute, 1.0);
        assert_eq!(on_mi300x.score.bandwidth, 1.0);
        assert!((on_h100.score.compute - 989.0 / 1307.0).abs() < 1e-12);
        assert!((on_h100.score.bandwidth - 3350.0 / 5300.0).abs() < 1e-12);
    }

    #[test]
    fn memory_part_is_the_share_left_free() {
        let problem = problem(vec![node("h", 1, H100)], 7, 1, Stages::Fixed(1));
        let plan = evaluate(&problem, &[choice("h", &[0])]).unwrap();
        let demand = 7e9 * 2.0 + GIB;
        let want = 1.0 - demand / (80.0 * GIB);
        assert!((plan.score.memory - want).abs() < 1e-9);
        assert!((plan.stages[0].memory_per_device_bytes - demand).abs() < 1.0);
    }

    #[test]
    fn thermal_part_falls_with_temperature_and_unknown_is_neutral() {
        let mut problem = problem(vec![node("h", 3, H100)], 7, 1, Stages::Fixed(1));
        problem.nodes[0].devices[1].temperature_c = Some(80.0);
        problem.nodes[0].devices[2].temperature_c = None;
        let thermal = |device| {
            evaluate(&problem, &[choice("h", &[device])])
                .unwrap()
                .score
                .thermal
        };
        assert!((thermal(0) - 45.0 / 85.0).abs() < 1e-12);
        assert!((thermal(1) - 5.0 / 85.0).abs() < 1e-12);
        assert_eq!(thermal(2), 0.5);
    }

    #[test]
    fn network_part_charges_hops_by_distance_and_tensor_links_by_kind() {
        let mut racks = problem(
            vec![
                node("a", 2, H100),
                node("b", 2, H100),
                node("c", 2, H100),
                node("d", 2, H100),
            ],
            7,
            1,
            Stages::Fixed(2),
        );
        for (node_index, zone, rack) in [
            (0, "z1", "r1"),
            (1, "z1", "r1"),
            (2, "z1", "r2"),
            (3, "z2", "r3"),
        ] {
            racks.nodes[node_index].zone = Some(zone.into());
            racks.nodes[node_index].rack = Some(rack.into());
        }
        let net = |first: StageChoice, second: StageChoice| {
            evaluate(&racks, &[first, second]).unwrap().score.network
        };
        assert!((net(choice("a", &[0]), choice("a", &[1])) - (1.0 - HOP_SAME_NODE)).abs() < 1e-12);
        assert!((net(choice("a", &[0]), choice("b", &[0])) - (1.0 - HOP_SAME_RACK)).abs() < 1e-12);
        assert!((net(choice("a", &[0]), choice("c", &[0])) - (1.0 - HOP_SAME_ZONE)).abs() < 1e-12);
        assert!(net(choice("a", &[0]), choice("d", &[0])).abs() < 1e-12);

        // Tensor groups: NVLink is free, PCIe costs, no link costs most.
        let mut links = problem(vec![node("x", 4, RTX4090)], 7, 2, Stages::Fixed(1));
        for (first, second, kind) in [(0, 1, Interconnect::NvLink), (2, 3, Interconnect::Pcie)] {
            links.nodes[0].links.push(Link {
                a: format!("x-{first}"),
                b: format!("x-{second}"),
                kind,
                bandwidth_gbps: 100.0,
            });
        }
        let net = |devices: &[usize]| {
            evaluate(&links, &[choice("x", devices)])
                .unwrap()
                .score
                .network
        };
        assert_eq!(net(&[0, 1]), 1.0);
        assert_eq!(net(&[2, 3]), 0.5);
        assert!((net(&[0, 2]) - 0.4).abs() < 1e-12);
    }

    #[test]
    fn heterogeneous_stages_get_unequal_ranges() {
        let problem = problem(
            vec![node("h", 1, H100), node("r", 1, RTX4090)],
            13,
            1,
            Stages::Fixed(2),
        );
        let plan = evaluate(&problem, &[choice("h", &[0]), choice("r", &[0])]).unwrap();
        let layers: Vec<u32> = plan.stages.iter().map(|s| s.layers()).collect();
        assert_eq!(layers.iter().sum::<u32>(), 32);
        assert!(layers[0] > 2 * layers[1], "{layers:?}");
        for stage in &plan.stages {
            let free = if stage.node == "h" { 80.0 } else { 24.0 } * GIB;
            assert!(stage.memory_per_device_bytes <= free);
        }
        assert!(plan.performance.tokens_per_second > 0.0);
        assert_eq!(plan.performance.stage_ms.len(), 2);
        assert_eq!(plan.performance.transfer_ms.len(), 1);
    }

    #[test]
    fn invalid_plans_are_refused_with_a_reason() {
        let mut problem = problem(
            vec![node("h", 2, H100), node("r", 2, RTX4090)],
            70,
            1,
            Stages::Fixed(1),
        );
        problem.nodes[0].devices[1].healthy = false;
        let err = |choices: &[StageChoice]| evaluate(&problem, choices).unwrap_err();
        assert!(err(&[choice("h", &[0]), choice("h", &[0])]).contains("used twice"));
        assert!(err(&[choice("h", &[1])]).contains("not eligible: unhealthy"));
        assert!(err(&[choice("r", &[0])]).contains("hold"));
        assert!(err(&[choice("h", &[0, 1])]).contains("tensor is 1"));
        assert!(err(&[choice("zz", &[0])]).contains("node zz"));
        assert!(err(&[]).contains("at least one stage"));
    }

    #[test]
    fn allocated_devices_are_not_eligible() {
        let mut problem = problem(vec![node("h", 1, H100)], 7, 1, Stages::Fixed(1));
        problem.nodes[0].devices[0].allocated_to = Some("ns/other".into());
        assert!(
            evaluate(&problem, &[choice("h", &[0])])
                .unwrap_err()
                .contains("allocated to ns/other")
        );
    }
}
