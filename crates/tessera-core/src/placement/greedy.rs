//! The quick answer: the stage count, and the best of three greedy plans. It
//! touches every device once and sorts a little, so it stays cheap on thousands
//! of GPUs; the search starts from it, and a deadline falls back to it.

use std::cmp::Reverse;

use super::evaluate::PreparedProblem;
use super::explain;
use super::plan::{Plan, Unsatisfiable};

/// `tensor` devices of one node: `order[at..at + tensor]` of the list it was cut from.
struct Chunk {
    node: usize,
    at: usize,
    cap: u32,
    value: f64,
}

pub(crate) struct Start {
    /// Stage count to plan (`auto` resolved).
    pub stages: u32,
    pub plan: Plan,
}

pub(crate) fn start(ctx: &PreparedProblem) -> Result<Start, Unsatisfiable> {
    let problem = ctx.problem;
    let tensor = ctx.tensor as usize;
    let weights = ctx.weights;

    // Eligible devices of all nodes in one list, a node's devices contiguous.
    let mut by_free: Vec<usize> = Vec::new();
    let mut spans: Vec<(usize, usize, usize)> = Vec::new();
    let mut max_free: f64 = 0.0;
    for (node_index, node) in problem.nodes.iter().enumerate() {
        let start = by_free.len();
        for device in 0..node.devices.len() {
            if ctx.eligible(node_index, device) {
                by_free.push(device);
                max_free = max_free.max(node.devices[device].memory_free_bytes as f64);
            }
        }
        if by_free.len() - start >= tensor {
            spans.push((node_index, start, by_free.len()));
        } else {
            by_free.truncate(start);
        }
    }
    // What a device is worth on its own: every score part but the network.
    let value = |node_index: usize, device: usize| {
        let gpu = ctx.device(node_index, device);
        let (compute, thermal, bandwidth) = ctx.device_parts(gpu);
        weights.compute * compute
            + weights.thermal * thermal
            + weights.bandwidth * bandwidth
            + weights.memory * gpu.memory_free_bytes as f64 / max_free.max(1.0)
            + ctx.sharing_weight * ctx.device_sharing(node_index, device)
    };
    let values: Vec<f64> = spans
        .iter()
        .flat_map(|&(node_index, span_start, span_end)| {
            by_free[span_start..span_end]
                .iter()
                .map(move |&device| (node_index, device))
        })
        .map(|(node_index, device)| value(node_index, device))
        .collect();
    let mut by_value: Vec<(f64, usize)> = values
        .iter()
        .copied()
        .zip(by_free.iter().copied())
        .collect();

    let mut by_capacity = Vec::new();
    let mut valued = Vec::new();
    for &(node_index, span_start, span_end) in &spans {
        // A group's room is set by its tightest device, so runs of devices
        // sorted by free memory are the groups with the most room.
        by_free[span_start..span_end].sort_unstable_by_key(|&device| {
            let gpu = ctx.device(node_index, device);
            (Reverse(gpu.memory_free_bytes), gpu.index)
        });
        by_value[span_start..span_end]
            .sort_unstable_by(|x, y| y.0.total_cmp(&x.0).then(x.1.cmp(&y.1)));
        let whole_groups_end = span_end - (span_end - span_start) % tensor;
        for at in (span_start..whole_groups_end).step_by(tensor) {
            let room = ctx
                .device(node_index, by_free[at + tensor - 1])
                .memory_free_bytes as f64;
            let cap = ctx.capacity(room);
            if cap > 0 {
                by_capacity.push(Chunk {
                    node: node_index,
                    at,
                    cap,
                    value: 0.0,
                });
            }
            let group = &by_value[at..at + tensor];
            let room = group
                .iter()
                .map(|&(_, device)| ctx.device(node_index, device).memory_free_bytes as f64)
                .fold(f64::INFINITY, f64::min);
            let cap = ctx.capacity(room);
            if cap > 0 {
                let mean_value = group
                    .iter()
                    .map(|&(device_value, _)| device_value)
                    .sum::<f64>()
                    / tensor as f64;
                valued.push(Chunk {
                    node: node_index,
                    at,
                    cap,
                    value: mean_value,
                });
            }
        }
    }
    by_capacity.sort_unstable_by_key(|chunk| (Reverse(chunk.cap), chunk.node, chunk.at));
    let caps: Vec<u32> = by_capacity.iter().map(|chunk| chunk.cap).collect();
    let stages = explain::stage_count(ctx, &caps, !spans.is_empty())? as usize;

    let from_free = |chunks: &[&Chunk]| -> Vec<(usize, Vec<usize>)> {
        chunks
            .iter()
            .map(|chunk| (chunk.node, by_free[chunk.at..chunk.at + tensor].to_vec()))
            .collect()
    };
    let from_value = |chunks: &[&Chunk]| -> Vec<(usize, Vec<usize>)> {
        chunks
            .iter()
            .map(|chunk| {
                (
                    chunk.node,
                    by_value[chunk.at..chunk.at + tensor]
                        .iter()
                        .map(|&(_, device)| device)
                        .collect(),
                )
            })
            .collect()
    };
    let mut candidates = vec![from_free(
        &by_capacity.iter().take(stages).collect::<Vec<_>>(),
    )];

    // The most valuable groups, nodes packed: all of a node's groups (best
    // first) before the next node, nodes ranked by their best group.
    let mut node_best: Vec<(f64, usize, usize)> = Vec::new();
    for (index, chunk) in valued.iter().enumerate() {
        match node_best.last_mut() {
            Some((best, node, _)) if *node == chunk.node => *best = best.max(chunk.value),
            _ => node_best.push((chunk.value, chunk.node, index)),
        }
    }
    node_best.sort_unstable_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
    let mut packed: Vec<&Chunk> = Vec::with_capacity(stages);
    'nodes: for &(_, node, first) in &node_best {
        for chunk in valued[first..]
            .iter()
            .take_while(|chunk| chunk.node == node)
        {
            if packed.len() == stages {
                break 'nodes;
            }
            packed.push(chunk);
        }
    }
    if packed.len() == stages {
        candidates.push(from_value(&packed));
    }

    // The most valuable groups wherever they are.
    let mut ranked: Vec<&Chunk> = valued.iter().collect();
    let order = |a: &&Chunk, b: &&Chunk| {
        b.value
            .total_cmp(&a.value)
            .then(a.node.cmp(&b.node))
            .then(a.at.cmp(&b.at))
    };
    if ranked.len() > stages {
        ranked.select_nth_unstable_by(stages, order);
        ranked.truncate(stages);
    }
    ranked.sort_unstable_by(order);
    if ranked.len() == stages {
        candidates.push(from_value(&ranked));
    }

    let mut best: Option<Plan> = None;
    for groups in &candidates {
        if let Ok(plan) = ctx.evaluate(groups)
            && best
                .as_ref()
                .is_none_or(|current| plan.score.total > current.score.total)
        {
            best = Some(plan);
        }
    }
    match best {
        Some(plan) => Ok(Start {
            stages: stages as u32,
            plan,
        }),
        // `stage_count` proved the largest groups hold the model, so this is a bug.
        None => Err(Unsatisfiable {
            reason: "internal error: the largest groups did not form a plan".into(),
            details: vec![],
        }),
    }
}
