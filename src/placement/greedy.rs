//! The quick answer: the stage count, and the best of three greedy plans. It
//! touches every device once and sorts a little, so it stays cheap on thousands
//! of GPUs; the search starts from it, and a deadline falls back to it.

use std::cmp::Reverse;

use super::evaluate::Context;
use super::explain;
use super::plan::{Plan, Unsatisfiable};

/// `tensor` devices of one node.
struct Chunk {
    node: usize,
    devices: Vec<usize>,
    cap: u32,
    value: f64,
}

pub(crate) struct Start {
    /// Stage count to plan (`auto` resolved).
    pub stages: u32,
    pub plan: Plan,
}

pub(crate) fn start(ctx: &Context) -> Result<Start, Unsatisfiable> {
    let p = ctx.p;
    let t = p.tensor as usize;
    let mut max_free: f64 = 0.0;
    let mut eligible: Vec<Vec<usize>> = Vec::with_capacity(p.nodes.len());
    for (ni, n) in p.nodes.iter().enumerate() {
        let devs: Vec<usize> = (0..n.devices.len())
            .filter(|&d| ctx.eligible(ni, d))
            .collect();
        for &d in &devs {
            max_free = max_free.max(n.devices[d].memory_free_bytes as f64);
        }
        eligible.push(devs);
    }
    let w = ctx.w;
    // What a device is worth on its own: every score part but the network.
    let value = |ni: usize, d: usize| {
        let dev = ctx.device(ni, d);
        let (c, th, b) = ctx.device_parts(dev);
        w.compute * c
            + w.thermal * th
            + w.bandwidth * b
            + w.memory * dev.memory_free_bytes as f64 / max_free.max(1.0)
    };
    let min_free = |ni: usize, devs: &[usize]| {
        devs.iter()
            .map(|&d| ctx.device(ni, d).memory_free_bytes as f64)
            .fold(f64::INFINITY, f64::min)
    };

    let mut by_capacity = Vec::new();
    let mut by_value = Vec::new();
    let mut any_node_fits_tensor = false;
    for (ni, devs) in eligible.iter_mut().enumerate() {
        if devs.len() < t {
            continue;
        }
        any_node_fits_tensor = true;
        // A group's room is set by its tightest device, so runs of devices
        // sorted by free memory are the groups with the most room.
        devs.sort_by_key(|&d| {
            let dev = ctx.device(ni, d);
            (Reverse(dev.memory_free_bytes), dev.index)
        });
        for chunk in devs.chunks_exact(t) {
            let cap = ctx.capacity(min_free(ni, chunk));
            if cap > 0 {
                by_capacity.push(Chunk {
                    node: ni,
                    devices: chunk.to_vec(),
                    cap,
                    value: 0.0,
                });
            }
        }
        devs.sort_by(|&a, &b| value(ni, b).total_cmp(&value(ni, a)).then(a.cmp(&b)));
        for chunk in devs.chunks_exact(t) {
            let cap = ctx.capacity(min_free(ni, chunk));
            if cap > 0 {
                let v = chunk.iter().map(|&d| value(ni, d)).sum::<f64>() / t as f64;
                by_value.push(Chunk {
                    node: ni,
                    devices: chunk.to_vec(),
                    cap,
                    value: v,
                });
            }
        }
    }
    by_capacity.sort_by_key(|c| (Reverse(c.cap), c.node, c.devices[0]));
    let caps: Vec<u32> = by_capacity.iter().map(|c| c.cap).collect();
    let k = explain::stage_count(ctx, &caps, any_node_fits_tensor)? as usize;

    let as_groups = |chunks: &[&Chunk]| -> Vec<(usize, Vec<usize>)> {
        chunks.iter().map(|c| (c.node, c.devices.clone())).collect()
    };
    let mut candidates = vec![as_groups(&by_capacity.iter().take(k).collect::<Vec<_>>())];

    // The most valuable groups, nodes packed: all of a node's groups (best
    // first) before the next node, nodes ranked by their best group.
    let mut node_best: Vec<(f64, usize)> = Vec::new();
    for c in &by_value {
        match node_best.last_mut() {
            Some((best, node)) if *node == c.node => *best = best.max(c.value),
            _ => node_best.push((c.value, c.node)),
        }
    }
    node_best.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
    let mut start_of = vec![usize::MAX; p.nodes.len()];
    for (i, c) in by_value.iter().enumerate().rev() {
        start_of[c.node] = i;
    }
    let mut packed: Vec<&Chunk> = Vec::with_capacity(k);
    'nodes: for &(_, node) in &node_best {
        for c in by_value[start_of[node]..]
            .iter()
            .take_while(|c| c.node == node)
        {
            if packed.len() == k {
                break 'nodes;
            }
            packed.push(c);
        }
    }
    if packed.len() == k {
        candidates.push(as_groups(&packed));
    }

    // The most valuable groups wherever they are.
    let mut ranked: Vec<&Chunk> = by_value.iter().collect();
    let order = |a: &&Chunk, b: &&Chunk| {
        b.value
            .total_cmp(&a.value)
            .then(a.node.cmp(&b.node))
            .then(a.devices[0].cmp(&b.devices[0]))
    };
    if ranked.len() > k {
        ranked.select_nth_unstable_by(k, order);
        ranked.truncate(k);
    }
    ranked.sort_by(order);
    if ranked.len() == k {
        candidates.push(as_groups(&ranked));
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
