//! Replays an arrival sequence on a cluster under one placement policy and
//! measures the cluster as a whole: instances placed before the first
//! refusal and in all, what they serve at their latency target (requests/s)
//! and one stream's predicted tokens/s, the largest free NVLink/xGMI domain
//! left, and the time each placement took.
// Only the cluster benchmark uses it.
#![allow(dead_code)]

use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::Instant;

use tessera::api::{ModelInstanceSpec, PlannedShard};
use tessera::moves::{Move, MoveAsk, MoveLimits, RunningReplica, plan_moves};
use tessera::placement::{
    Device, NodeState, Plan, Problem, Selector, Served, SolveOptions, SpeedGoal, Stages, Strategy,
    Weights, evaluate,
};
use tessera::sizing::{TensorChoice, solve_replicas, take_devices, tensor_candidates};
use tessera::translate::{ClusterNode, planned_shards};

use super::arrivals::{Arrival, Event, MODEL_405B};
use super::objects::to_node;
use super::{MAX_TEMPERATURE_C, at_target, first_fit, model_shape};

#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum Policy {
    /// `support::first_fit`: nodes by name, devices by index.
    FirstFit,
    /// The solver under a strategy.
    Solver(Strategy),
}

impl Policy {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Policy::FirstFit => "first-fit",
            Policy::Solver(Strategy::ScoreOnly) => "score-only",
            Policy::Solver(Strategy::Pack) => "pack",
            Policy::Solver(Strategy::Spread) => "spread",
        }
    }
}

/// What a replay measured. An instance here is one replica: each replica is
/// a whole sharded copy of the model.
#[derive(Clone, Debug, Default)]
pub(crate) struct Outcome {
    /// Replicas placed before the first one that found no plan.
    pub(crate) before_first_refusal: usize,
    /// Replicas placed over the whole sequence (some deleted later).
    pub(crate) placed: usize,
    pub(crate) refused: usize,
    /// Replicas still running once the sequence ends.
    pub(crate) running_at_end: usize,
    /// Predicted tokens/s of the replicas running at the end, summed.
    pub(crate) tokens_per_second_at_end: f64,
    /// Predicted tokens/s summed over every placement made.
    pub(crate) tokens_per_second_placed: f64,
    /// Requests/s at the instance's latency target, summed over every
    /// placement made, and at the end; a replica that cannot meet the target
    /// serves none.
    pub(crate) requests_per_second_placed: f64,
    pub(crate) requests_per_second_at_end: f64,
    /// Placements that cannot meet their target (first-fit makes them; the
    /// solver refuses them, since every arrival states its target).
    pub(crate) missed_target: usize,
    /// GPUs held by the replicas running at the end.
    pub(crate) gpus_at_end: usize,
    /// The most free devices on one node all joined by NVLink/xGMI at the
    /// end, and that node.
    pub(crate) largest_free_domain: (usize, String),
    /// Nodes left entirely free with every pair of GPUs NVLink/xGMI-linked:
    /// where a tensor group as wide as the node can still go.
    pub(crate) whole_free_domains: usize,
    /// Pairs of replicas of one instance by how close they came: sharing a
    /// node, else a rack, else a zone, else apart.
    pub(crate) replica_pairs: [usize; 4],
    /// Wall time of each replica's placement, in milliseconds.
    pub(crate) placement_ms: Vec<f64>,
    /// Usable GPUs free when the first replica was refused, and how many the
    /// cluster has: whether the cluster was full or only fragmented.
    pub(crate) free_at_first_refusal: Option<(usize, usize)>,
    /// GPUs summed over every placement made.
    pub(crate) gpus_placed: usize,
    /// The same two sums over the replicas of `tensor: auto` instances only.
    pub(crate) auto_gpus_placed: usize,
    pub(crate) auto_tokens_per_second_placed: f64,
}

impl Outcome {
    /// Predicted tokens/s per GPU over every placement made.
    pub(crate) fn tokens_per_second_per_gpu(&self) -> f64 {
        if self.gpus_placed == 0 {
            0.0
        } else {
            self.tokens_per_second_placed / self.gpus_placed as f64
        }
    }

    /// Requests/s at the target per GPU over every placement made.
    pub(crate) fn requests_per_second_per_gpu(&self) -> f64 {
        self.requests_per_second_placed / self.gpus_placed.max(1) as f64
    }

    pub(crate) fn mean_tokens_per_second(&self) -> f64 {
        if self.placed == 0 {
            0.0
        } else {
            self.tokens_per_second_placed / self.placed as f64
        }
    }

    pub(crate) fn gpus_per_placement(&self) -> f64 {
        self.gpus_placed as f64 / self.placed.max(1) as f64
    }

    /// Shares of the GPUs and of the tokens/s placed that went to `tensor:
    /// auto` instances.
    pub(crate) fn auto_shares(&self) -> (f64, f64) {
        (
            self.auto_gpus_placed as f64 / self.gpus_placed.max(1) as f64,
            self.auto_tokens_per_second_placed / self.tokens_per_second_placed.max(1e-9),
        )
    }

    pub(crate) fn mean_ms(&self) -> f64 {
        if self.placement_ms.is_empty() {
            0.0
        } else {
            self.placement_ms.iter().sum::<f64>() / self.placement_ms.len() as f64
        }
    }

    pub(crate) fn max_ms(&self) -> f64 {
        self.placement_ms.iter().copied().fold(0.0, f64::max)
    }
}

/// One running replica: its devices as `(node, device)` indices, its
/// shards as the status has them, its predicted tokens/s and what it serves
/// at its target.
#[derive(Clone)]
struct Running {
    devices: Vec<(usize, usize)>,
    shards: Vec<PlannedShard>,
    tokens_per_second: f64,
    requests_per_second: f64,
}

/// The cluster as the replay goes: who holds which device.
#[derive(Clone)]
pub(crate) struct ClusterState {
    pub(crate) nodes: Vec<NodeState>,
    node_index: HashMap<String, usize>,
    /// The running replicas of each arrival.
    held: HashMap<usize, Vec<Running>>,
    /// Each arrival's spec, for the move planner.
    specs: HashMap<usize, ModelInstanceSpec>,
}

impl ClusterState {
    pub(crate) fn new(nodes: &[NodeState]) -> Self {
        Self {
            nodes: nodes.to_vec(),
            node_index: nodes
                .iter()
                .enumerate()
                .map(|(index, node)| (node.name.clone(), index))
                .collect(),
            held: HashMap::new(),
            specs: HashMap::new(),
        }
    }

    /// The solver's problem for one replica of `arrival`, on the devices free now.
    pub(crate) fn problem(&self, arrival: &Arrival, strategy: Strategy) -> Problem {
        Problem {
            served: Some(Served::of(&arrival.spec())),
            one_device: false,
            nodes: self.nodes.clone(),
            model: model_shape(&arrival.model),
            tensor: match arrival.tensor {
                TensorChoice::Fixed(size) => size,
                TensorChoice::Auto => 1,
            },
            stages: Stages::Auto,
            weights: Weights::default(),
            max_temperature_c: MAX_TEMPERATURE_C,
            selector: Selector::default(),
            strategy,
            replica_nodes: Vec::new(),
            goal: SpeedGoal::default(),
        }
    }

    fn hold(&mut self, arrival: &Arrival, replica: u32, plan: &Plan, requests_per_second: f64) {
        self.specs
            .entry(arrival.id)
            .or_insert_with(|| arrival.spec());
        let arrival = arrival.id;
        let holder = holder(arrival, replica);
        let mut devices = Vec::new();
        for stage in &plan.stages {
            let node_index = self.node_index[&stage.node];
            let node = &mut self.nodes[node_index];
            for (device_index, device) in node.devices.iter_mut().enumerate() {
                if stage.devices.contains(&device.id) {
                    assert!(device.allocated_to.is_none(), "{} planned twice", device.id);
                    device.allocated_to = Some(holder.clone());
                    devices.push((node_index, device_index));
                }
            }
        }
        self.held.entry(arrival).or_default().push(Running {
            devices,
            shards: planned_shards(plan, replica),
            tokens_per_second: plan.performance.tokens_per_second,
            requests_per_second,
        });
    }

    /// Replica `replica` of `arrival` moved: its new devices are taken while
    /// its old ones are still held (make before break: they must be free
    /// then), and only then are the old ones given up.
    fn settle(&mut self, arrival: usize, replica: usize, moved: &Move) {
        let holder = holder(arrival, replica as u32);
        let Some(running) = self.held.get_mut(&arrival).and_then(|r| r.get_mut(replica)) else {
            return;
        };
        let mut taken = Vec::new();
        for shard in &moved.to {
            let node_index = self.node_index[&shard.node];
            for (device_index, device) in self.nodes[node_index].devices.iter_mut().enumerate() {
                if shard.devices.contains(&device.id) {
                    assert!(
                        device.allocated_to.is_none(),
                        "{} is not free for the new copy",
                        device.id
                    );
                    device.allocated_to = Some(holder.clone());
                    taken.push((node_index, device_index));
                }
            }
        }
        for (node, device) in std::mem::replace(&mut running.devices, taken) {
            self.nodes[node].devices[device].allocated_to = None;
        }
        running.shards = moved.to.clone();
        running.requests_per_second = moved.requests_per_second_after;
    }

    fn release(&mut self, arrival: usize) {
        for replica in self.held.remove(&arrival).unwrap_or_default() {
            for (node, device) in replica.devices {
                self.nodes[node].devices[device].allocated_to = None;
            }
        }
    }

    /// Usable GPUs (healthy, not too hot) free now, and in all.
    pub(crate) fn usable_gpus(&self) -> (usize, usize) {
        let usable: Vec<&Device> = self
            .nodes
            .iter()
            .flat_map(|node| &node.devices)
            .filter(|device| usable(device))
            .collect();
        let free = usable
            .iter()
            .filter(|device| device.allocated_to.is_none())
            .count();
        (free, usable.len())
    }

    /// The most free devices on one node all joined by NVLink/xGMI (a free
    /// device on its own counts as 1), the first node with that many, and how
    /// many nodes are such a domain whole.
    pub(crate) fn free_domains(&self) -> ((usize, String), usize) {
        let mut best = (0, String::new());
        let mut whole = 0;
        for node in &self.nodes {
            let free: Vec<bool> = node
                .devices
                .iter()
                .map(|device| usable(device) && device.allocated_to.is_none())
                .collect();
            let largest = largest_clique(node, &free);
            if largest > best.0 {
                best = (largest, node.name.clone());
            }
            // A node of one device has no links to judge it by.
            if largest == node.devices.len() && largest > 1 {
                whole += 1;
            }
        }
        (best, whole)
    }
}

/// Healthy and below the temperature limit: a device some plan could use.
fn usable(device: &Device) -> bool {
    device.healthy
        && device
            .temperature_c
            .is_none_or(|temperature| temperature < MAX_TEMPERATURE_C)
}

/// The largest set of `free` devices of a node with a fast link between every
/// pair (nodes have a handful of GPUs: every subset is tried).
fn largest_clique(node: &NodeState, free: &[bool]) -> usize {
    let count = node.devices.len();
    let position = |id: &str| node.devices.iter().position(|device| device.id == id);
    let mut fast = vec![vec![false; count]; count];
    for link in &node.links {
        if link.kind.is_scale_up()
            && let (Some(first), Some(second)) = (position(&link.a), position(&link.b))
        {
            fast[first][second] = true;
            fast[second][first] = true;
        }
    }
    let mut best = 0;
    for subset in 1u32..(1 << count.min(16)) {
        let members: Vec<usize> = (0..count)
            .filter(|&device| subset & (1 << device) != 0)
            .collect();
        if members.len() <= best || !members.iter().all(|&device| free[device]) {
            continue;
        }
        let joined = members
            .iter()
            .enumerate()
            .all(|(at, &one)| members[at + 1..].iter().all(|&other| fast[one][other]));
        if joined {
            best = members.len();
        }
    }
    best
}

/// Replays `events` on `nodes` under `policy`; returns what it measured and
/// the cluster as the sequence left it.
pub(crate) fn replay(
    nodes: &[NodeState],
    events: &[Event],
    policy: Policy,
) -> (Outcome, ClusterState) {
    let mut state = ClusterState::new(nodes);
    let mut outcome = Outcome::default();
    let mut refused_yet = false;
    for event in events {
        let arrival = match event {
            Event::Delete(id) => {
                state.release(*id);
                continue;
            }
            Event::Arrive(arrival) => arrival,
        };
        let (plans, elapsed_ms, attempts) = place(&state, arrival, policy);
        outcome
            .placement_ms
            .extend(std::iter::repeat_n(elapsed_ms / attempts as f64, attempts));
        count_replica_pairs(&state, &plans, &mut outcome.replica_pairs);
        let judged_on = state.problem(arrival, Strategy::ScoreOnly);
        for (replica, plan) in plans.iter().enumerate() {
            match plan {
                Some(plan) => {
                    let served = served_at_target(&judged_on, plan);
                    outcome.missed_target += usize::from(served.is_none());
                    let served = served.unwrap_or(0.0);
                    state.hold(arrival, replica as u32, plan, served);
                    outcome.requests_per_second_placed += served;
                    outcome.placed += 1;
                    let speed = plan.performance.tokens_per_second;
                    outcome.tokens_per_second_placed += speed;
                    let gpus: usize = plan.stages.iter().map(|stage| stage.devices.len()).sum();
                    outcome.gpus_placed += gpus;
                    if arrival.tensor == TensorChoice::Auto {
                        outcome.auto_gpus_placed += gpus;
                        outcome.auto_tokens_per_second_placed += speed;
                    }
                    if !refused_yet {
                        outcome.before_first_refusal += 1;
                    }
                }
                None => {
                    if !refused_yet {
                        outcome.free_at_first_refusal = Some(state.usable_gpus());
                    }
                    refused_yet = true;
                    outcome.refused += 1;
                }
            }
        }
    }
    for replicas in state.held.values() {
        outcome.running_at_end += replicas.len();
        outcome.gpus_at_end += replicas
            .iter()
            .map(|replica| replica.devices.len())
            .sum::<usize>();
        outcome.requests_per_second_at_end += replicas
            .iter()
            .map(|replica| replica.requests_per_second)
            .sum::<f64>();
        outcome.tokens_per_second_at_end += replicas
            .iter()
            .map(|replica| replica.tokens_per_second)
            .sum::<f64>();
    }
    (outcome.largest_free_domain, outcome.whole_free_domains) = state.free_domains();
    (outcome, state)
}

/// Requests/s `plan` serves at its instance's target; `None` where it
/// cannot meet it.
fn served_at_target(problem: &Problem, plan: &Plan) -> Option<f64> {
    at_target(problem, plan).map(|(at, _)| at.requests_per_second)
}

/// Adds every pair of placed replicas to `pairs` by the closest their nodes
/// come (0 = a node in common, 1 = a rack, 2 = a zone, 3 = apart).
fn count_replica_pairs(state: &ClusterState, plans: &[Option<Plan>], pairs: &mut [usize; 4]) {
    let placed: Vec<&Plan> = plans.iter().flatten().collect();
    let node_of = |name: &String| &state.nodes[state.node_index[name]];
    for (index, first) in placed.iter().enumerate() {
        for second in &placed[index + 1..] {
            let mut closest = 3;
            for first_stage in &first.stages {
                for second_stage in &second.stages {
                    let (one, other) = (node_of(&first_stage.node), node_of(&second_stage.node));
                    let same_zone = one.zone.is_some() && one.zone == other.zone;
                    let distance = if one.name == other.name {
                        0
                    } else if same_zone && one.rack.is_some() && one.rack == other.rack {
                        1
                    } else if same_zone {
                        2
                    } else {
                        3
                    };
                    closest = closest.min(distance);
                }
            }
            pairs[closest] += 1;
        }
    }
}

/// What the burst found: how many fit, and why (the room the deletions left).
pub(crate) struct Room {
    pub(crate) fitted: usize,
    /// Nodes with a device held before the deletions, by how many instances
    /// held them: one, two, three or more.
    pub(crate) instances_per_node: [usize; 3],
    /// Whole nodes the deletions are expected to free: each instance goes
    /// with even odds, so a node held by `k` instances comes free whole with
    /// odds `2^-k`.
    pub(crate) expected_whole: f64,
    /// By GPU product, after the deletions: nodes free whole, and free GPUs.
    pub(crate) by_product: BTreeMap<String, (usize, usize)>,
    /// With moves: replicas moved, GPUs moved, the burst arrivals the moves
    /// placed, and each answer's wall time in milliseconds.
    pub(crate) moves_made: usize,
    pub(crate) gpus_moved: f64,
    pub(crate) fitted_by_moves: usize,
    pub(crate) planner_ms: Vec<f64>,
    /// The most that could fit with moves that keep every replica on its
    /// GPU kind: by kind, its free GPUs after the deletions ÷ the GPUs one
    /// 405B-class replica takes there within its target, summed.
    pub(crate) ceiling: usize,
}

/// Large models arriving once the sequence has filled the cluster and
/// deletions have fragmented it: every other instance still running (by
/// arrival) is deleted, then `count` 405B-class instances (8 GPUs a shard,
/// pipeline `auto`) are placed one after the other under `policy`; how many
/// fit where they meet their target. What `pack` keeps room for. With
/// `moves`, an arrival refused asks the move planner for room, and the
/// moves it answers are made (each moved replica's new devices taken before
/// its old ones are given up).
pub(crate) fn burst(mut state: ClusterState, policy: Policy, count: usize, moves: bool) -> Room {
    let (instances_per_node, expected_whole) = instances_per_node(&state);
    let mut running: Vec<usize> = state.held.keys().copied().collect();
    running.sort_unstable();
    for id in running.into_iter().step_by(2) {
        state.release(id);
    }
    let mut by_product: BTreeMap<String, (usize, usize)> = BTreeMap::new();
    for node in &state.nodes {
        let free = node
            .devices
            .iter()
            .filter(|device| usable(device) && device.allocated_to.is_none())
            .count();
        if let Some(first) = node.devices.first() {
            let entry = by_product.entry(first.product.clone()).or_default();
            entry.0 += usize::from(free == node.devices.len());
            entry.1 += free;
        }
    }
    let cluster: Vec<ClusterNode> = state
        .nodes
        .iter()
        .map(|node| {
            ClusterNode::from_node(&to_node(node))
                .expect("a valid GPU state")
                .expect("a GPU node")
        })
        .collect();
    let mut room = Room {
        fitted: 0,
        instances_per_node,
        expected_whole,
        by_product,
        moves_made: 0,
        gpus_moved: 0.0,
        fitted_by_moves: 0,
        planner_ms: Vec::new(),
        ceiling: 0,
    };
    let burst_arrival = |k: usize| Arrival {
        id: usize::MAX - k,
        class: "405B",
        model: MODEL_405B,
        tensor: TensorChoice::Fixed(8),
        replicas: 1,
    };
    room.ceiling = room
        .by_product
        .iter()
        .map(|(product, (_, free))| {
            gpus_one_takes(&state, &burst_arrival(0), product).map_or(0, |gpus| free / gpus)
        })
        .sum::<usize>()
        .min(count);
    for k in 0..count {
        let arrival = burst_arrival(k);
        let (plans, _, _) = place(&state, &arrival, policy);
        let plan = match plans.into_iter().next().flatten() {
            Some(plan) => Some(plan),
            None if moves => {
                let started = Instant::now();
                let answer = make_room(&cluster, &state, &arrival);
                room.planner_ms.push(started.elapsed().as_secs_f64() * 1e3);
                answer.map(|(made, plan)| {
                    room.fitted_by_moves += 1;
                    room.moves_made += made.len();
                    for (arrival, replica, moved) in &made {
                        room.gpus_moved += moved.gpus;
                        state.settle(*arrival, *replica, moved);
                    }
                    plan
                })
            }
            None => None,
        };
        if let Some(plan) = plan {
            let served = served_at_target(&state.problem(&arrival, Strategy::ScoreOnly), &plan);
            state.hold(&arrival, 0, &plan, served.unwrap_or(0.0));
            // A replica that cannot meet its target holds GPUs and serves nothing.
            room.fitted += usize::from(served.is_some());
        }
    }
    room
}

/// The GPUs one replica of `arrival` takes on the nodes of `product`, all
/// free, where it meets its target; `None` where it cannot.
fn gpus_one_takes(state: &ClusterState, arrival: &Arrival, product: &str) -> Option<usize> {
    let mut problem = state.problem(arrival, Strategy::ScoreOnly);
    problem
        .nodes
        .retain(|node| node.devices.first().is_some_and(|d| d.product == product));
    for device in problem.nodes.iter_mut().flat_map(|node| &mut node.devices) {
        device.allocated_to = None;
    }
    let placed = solve_replicas(
        &problem,
        arrival.tensor,
        1,
        "bench/ceiling",
        &SolveOptions::default(),
    );
    let plan = placed.into_iter().next()?.ok()?.plan;
    served_at_target(&problem, &plan)?;
    Some(plan.stages.iter().map(|stage| stage.devices.len()).sum())
}

/// A move the planner answered, with the arrival and replica it moves.
type MadeMove = (usize, usize, Move);

/// The move planner's answer for `arrival` on the cluster as `state` holds
/// it: the moves, each with the arrival and replica it moves, and the
/// arrival's plan after them; `None` when it finds none.
fn make_room(
    cluster: &[ClusterNode],
    state: &ClusterState,
    arrival: &Arrival,
) -> Option<(Vec<MadeMove>, Plan)> {
    let mut ids: Vec<usize> = state.held.keys().copied().collect();
    ids.sort_unstable();
    let mut who = Vec::new();
    let mut running = Vec::new();
    for id in ids {
        for (replica, held) in state.held[&id].iter().enumerate() {
            who.push((id, replica));
            running.push(RunningReplica {
                holder: holder(id, replica as u32),
                instance: format!("bench/instance-{id}"),
                spec: &state.specs[&id],
                shards: held.shards.clone(),
                ready: true,
                corrections: &[],
            });
        }
    }
    let spec = arrival.spec();
    let others = HashMap::new();
    let options = SolveOptions::default();
    let ask = MoveAsk {
        nodes: cluster,
        others: &others,
        running: &running,
        blocked: &spec,
        blocked_name: "bench/burst",
        blocked_corrections: &[],
        limits: MoveLimits::default(),
        options: &options,
    };
    let answer = plan_moves(&ask).ok()?;
    let made = answer
        .moves
        .into_iter()
        .map(|moved| {
            let at = running
                .iter()
                .position(|r| r.holder == moved.replica)
                .expect("a move names a running replica");
            (who[at].0, who[at].1, moved)
        })
        .collect();
    Some((made, answer.placed.plan))
}

/// The name a replica's devices are held under.
fn holder(arrival: usize, replica: u32) -> String {
    format!("bench/instance-{arrival} replica {replica}")
}

/// Nodes in use by how many instances hold them (one, two, three or more),
/// and the whole nodes deleting each instance with even odds frees on average.
fn instances_per_node(state: &ClusterState) -> ([usize; 3], f64) {
    let mut holders: Vec<HashSet<usize>> = vec![HashSet::new(); state.nodes.len()];
    for (arrival, replicas) in &state.held {
        for (node, _) in replicas.iter().flat_map(|replica| &replica.devices) {
            holders[*node].insert(*arrival);
        }
    }
    let mut counts = [0; 3];
    let mut expected = 0.0;
    for held_by in holders.iter().map(HashSet::len).filter(|n| *n > 0) {
        counts[held_by.min(3) - 1] += 1;
        expected += 0.5f64.powi(i32::try_from(held_by).unwrap_or(i32::MAX));
    }
    (counts, expected)
}

/// Plans every replica of `arrival` (`None` where there is no plan), the
/// wall time it took in milliseconds, and how many replicas were actually
/// planned (a refusal ends the search for the rest).
pub(crate) fn place(
    state: &ClusterState,
    arrival: &Arrival,
    policy: Policy,
) -> (Vec<Option<Plan>>, f64, usize) {
    match policy {
        Policy::Solver(strategy) => {
            let problem = state.problem(arrival, strategy);
            let owner = format!("bench/instance-{}", arrival.id);
            let started = Instant::now();
            let results = solve_replicas(
                &problem,
                arrival.tensor,
                arrival.replicas,
                &owner,
                &SolveOptions::default(),
            );
            let elapsed_ms = started.elapsed().as_secs_f64() * 1e3;
            let plans: Vec<Option<Plan>> = results
                .into_iter()
                .map(|result| result.ok().map(|placed| placed.plan))
                .collect();
            let attempts = plans.iter().filter(|plan| plan.is_some()).count()
                + usize::from(plans.iter().any(Option::is_none));
            (plans, elapsed_ms, attempts)
        }
        Policy::FirstFit => {
            let mut problem = state.problem(arrival, Strategy::ScoreOnly);
            let started = Instant::now();
            let mut plans = Vec::new();
            for _ in 0..arrival.replicas {
                let plan = first_fit_any(&problem, arrival.tensor);
                if let Some(plan) = &plan {
                    take_devices(&mut problem, plan, "first-fit");
                }
                let refused = plan.is_none();
                plans.push(plan);
                if refused {
                    break;
                }
            }
            let elapsed_ms = started.elapsed().as_secs_f64() * 1e3;
            let attempts = plans.len();
            plans.resize(arrival.replicas as usize, None);
            (plans, elapsed_ms, attempts)
        }
    }
}

/// First fit with `auto` resolved as a scheduler without a solver would: the
/// largest tensor size `auto` would try first (what it usually picks), then
/// smaller ones; for each, the fewest stages first-fit can fill.
fn first_fit_any(problem: &Problem, tensor: TensorChoice) -> Option<Plan> {
    let sizes = match tensor {
        TensorChoice::Fixed(size) => vec![size],
        TensorChoice::Auto => tensor_candidates(problem).into_iter().rev().collect(),
    };
    let free_devices = problem
        .nodes
        .iter()
        .flat_map(|node| &node.devices)
        .filter(|device| device.allocated_to.is_none() && device.healthy)
        .count() as u32;
    let mut sized = problem.clone();
    for size in sizes {
        sized.tensor = size;
        for stages in 1..=problem.model.layers.min(free_devices / size) {
            sized.stages = Stages::Fixed(stages);
            if let Some(choice) = first_fit(&sized)
                && let Ok(plan) = evaluate(&sized, &choice)
            {
                return Some(plan);
            }
        }
    }
    None
}
