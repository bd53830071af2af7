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
    let p = ctx.problem;
    let t = p.tensor as usize;
    let w = ctx.weights;

    // Eligible devices of all nodes in one list, a node's devices contiguous.
    let mut by_free: Vec<usize> = Vec::new();
    let mut spans: Vec<(usize, usize, usize)> = Vec::new();
    let mut max_free: f64 = 0.0;
    for (ni, n) in p.nodes.iter().enumerate() {
        let start = by_free.len();
        for d in 0..n.devices.len() {
            if ctx.eligible(ni, d) {
                by_free.push(d);
                max_free = max_free.max(n.devices[d].memory_free_bytes as f64);
            }
        }
        if by_free.len() - start >= t {
            spans.push((ni, start, by_free.len()));
        } else {
            by_free.truncate(start);
        }
    }
    // What a device is worth on its own: every score part but the network.
    let value = |ni: usize, d: usize| {
        let dev = ctx.device(ni, d);
        let (c, th, b) = ctx.device_parts(dev);
        w.compute * c
            + w.thermal * th
            + w.bandwidth * b
            + w.memory * dev.memory_free_bytes as f64 / max_free.max(1.0)
    };
    let values: Vec<f64> = spans
        .iter()
        .flat_map(|&(ni, a, b)| by_free[a..b].iter().map(move |&d| (ni, d)))
        .map(|(ni, d)| value(ni, d))
        .collect();
    let mut by_value: Vec<(f64, usize)> = values
        .iter()
        .copied()
        .zip(by_free.iter().copied())
        .collect();

    let mut by_capacity = Vec::new();
    let mut valued = Vec::new();
    for &(ni, a, b) in &spans {
        // A group's room is set by its tightest device, so runs of devices
        // sorted by free memory are the groups with the most room.
        by_free[a..b].sort_unstable_by_key(|&d| {
            let dev = ctx.device(ni, d);
            (Reverse(dev.memory_free_bytes), dev.index)
        });
        by_value[a..b].sort_unstable_by(|x, y| y.0.total_cmp(&x.0).then(x.1.cmp(&y.1)));
        for at in (a..b - (b - a) % t).step_by(t) {
            let room = ctx.device(ni, by_free[at + t - 1]).memory_free_bytes as f64;
            let cap = ctx.capacity(room);
            if cap > 0 {
                by_capacity.push(Chunk {
                    node: ni,
                    at,
                    cap,
                    value: 0.0,
                });
            }
            let group = &by_value[at..at + t];
            let room = group
                .iter()
                .map(|&(_, d)| ctx.device(ni, d).memory_free_bytes as f64)
                .fold(f64::INFINITY, f64::min);
            let cap = ctx.capacity(room);
            if cap > 0 {
                let v = group.iter().map(|&(v, _)| v).sum::<f64>() / t as f64;
                valued.push(Chunk {
                    node: ni,
                    at,
                    cap,
                    value: v,
                });
            }
        }
    }
    by_capacity.sort_unstable_by_key(|c| (Reverse(c.cap), c.node, c.at));
    let caps: Vec<u32> = by_capacity.iter().map(|c| c.cap).collect();
    let k = explain::stage_count(ctx, &caps, !spans.is_empty())? as usize;

    let from_free = |chunks: &[&Chunk]| -> Vec<(usize, Vec<usize>)> {
        chunks
            .iter()
            .map(|c| (c.node, by_free[c.at..c.at + t].to_vec()))
            .collect()
    };
    let from_value = |chunks: &[&Chunk]| -> Vec<(usize, Vec<usize>)> {
        chunks
            .iter()
            .map(|c| {
                (
                    c.node,
                    by_value[c.at..c.at + t].iter().map(|&(_, d)| d).collect(),
                )
            })
            .collect()
    };
    let mut candidates = vec![from_free(&by_capacity.iter().take(k).collect::<Vec<_>>())];

    // The most valuable groups, nodes packed: all of a node's groups (best
    // first) before the next node, nodes ranked by their best group.
    let mut node_best: Vec<(f64, usize, usize)> = Vec::new();
    for (i, c) in valued.iter().enumerate() {
        match node_best.last_mut() {
            Some((best, node, _)) if *node == c.node => *best = best.max(c.value),
            _ => node_best.push((c.value, c.node, i)),
        }
    }
    node_best.sort_unstable_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
    let mut packed: Vec<&Chunk> = Vec::with_capacity(k);
    'nodes: for &(_, node, first) in &node_best {
        for c in valued[first..].iter().take_while(|c| c.node == node) {
            if packed.len() == k {
                break 'nodes;
            }
            packed.push(c);
        }
    }
    if packed.len() == k {
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
    if ranked.len() > k {
        ranked.select_nth_unstable_by(k, order);
        ranked.truncate(k);
    }
    ranked.sort_unstable_by(order);
    if ranked.len() == k {
        candidates.push(from_value(&ranked));
    }

    let mut best: Option<Plan> = None;
    for groups in &candidates {
        if let Ok(plan) = ctx.evaluate(groups)
            && best
                .as_ref()
                .is_none_or(|b| plan.score.total > b.score.total)
        {
            best = Some(plan);
        }
    }
    match best {
        Some(plan) => Ok(Start {
            stages: k as u32,
            plan,
        }),
        // `stage_count` proved the largest groups hold the model, so this is a bug.
        None => Err(Unsatisfiable {
            reason: "internal error: the largest groups did not form a plan".into(),
            details: vec![],
        }),
    }
}
