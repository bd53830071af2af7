//! Deciding the stage count, and saying in words why there is no plan: which
//! shard, how much memory, the best device there is, and what excluded the rest.

use super::evaluate::PreparedProblem;
use super::exclusion::{Exclusion, exclusion_text};
use super::plan::Unsatisfiable;
use super::problem::{Problem, Stages};
use crate::api::GIB;

/// What a plan too small for the model is told to try: more GPUs, unless
/// the instance runs on one GPU or a piece of one (`Problem::one_device`).
fn too_small_advice(problem: &Problem) -> &'static str {
    if problem.one_device {
        "placement.sharing Isolated or Shared runs one shard on one GPU or a piece of one, so the model must fit one device or share: use a smaller dtype, or placement.sharing: Exclusive to split it over more GPUs"
    } else {
        "Use more stages, a larger tensor size or a smaller dtype"
    }
}

fn gib(bytes: f64) -> String {
    format!("{:.1} GiB", bytes / GIB)
}

fn unsat(reason: String, details: Vec<String>) -> Unsatisfiable {
    Unsatisfiable { reason, details }
}

/// Problems no cluster could satisfy (planned with `tensor` devices per
/// shard), caught before looking at devices.
pub(crate) fn check_shape(problem: &Problem, tensor: u32) -> Result<(), Unsatisfiable> {
    let model = &problem.model;
    let numbers_ok = [
        model.weight_bytes_per_layer,
        model.kv_bytes_per_layer,
        model.overhead_bytes_per_device,
        model.activation_bytes_per_token,
        model.flops_per_layer_token,
    ]
    .iter()
    .all(|number| number.is_finite() && *number >= 0.0)
        && model.weight_bytes_per_layer > 0.0;
    if !numbers_ok || model.layers == 0 || tensor == 0 {
        return Err(unsat(
            "the model needs a positive size, at least one layer and a tensor size of at least 1"
                .into(),
            vec![],
        ));
    }
    if let Stages::Fixed(stages) = problem.stages {
        if stages == 0 {
            return Err(unsat("pipeline needs at least one stage".into(), vec![]));
        }
        if stages > model.layers {
            return Err(unsat(
                format!(
                    "pipeline={stages} stages for {} layers: every stage needs at least one layer",
                    model.layers
                ),
                vec![],
            ));
        }
    }
    Ok(())
}

/// One line per reason devices were excluded, with a few examples each.
fn exclusion_details(ctx: &PreparedProblem) -> Vec<String> {
    let problem = ctx.problem;
    let kinds = [
        "allocated",
        "not a whole GPU",
        "unhealthy",
        "too hot",
        "bad telemetry",
        "vendor",
        "product",
        "node selector",
        "too little free memory",
        "larger than needed",
        "kept whole",
        "too slow shared",
        "other GPU kind",
    ];
    let mut seen: Vec<Vec<String>> = vec![Vec::new(); kinds.len()];
    for (node, node_exclusions) in problem.nodes.iter().zip(&ctx.exclusions) {
        for (device, excluded) in node.devices.iter().zip(node_exclusions) {
            let Some(exclusion) = excluded else { continue };
            let slot = match exclusion {
                Exclusion::Allocated(_) => 0,
                Exclusion::NotWhole(_) => 1,
                Exclusion::Unhealthy(_) => 2,
                Exclusion::TooHot(_) => 3,
                Exclusion::BadTelemetry => 4,
                Exclusion::Vendor => 5,
                Exclusion::Product => 6,
                Exclusion::NodeSelector => 7,
                Exclusion::TooLittleMemory { .. } => 8,
                Exclusion::LargerThanNeeded { .. } => 9,
                Exclusion::KeptWhole => 10,
                Exclusion::TooSlowShared { .. } => 11,
                Exclusion::OtherKind => 12,
            };
            seen[slot].push(format!(
                "{}/{}: {}",
                node.name,
                device.id,
                exclusion_text(exclusion, problem)
            ));
        }
    }
    kinds
        .iter()
        .zip(seen)
        .filter(|(_, examples)| !examples.is_empty())
        .map(|(kind, examples)| {
            let more = if examples.len() > 3 {
                format!(" and {} more", examples.len() - 3)
            } else {
                String::new()
            };
            format!(
                "{} device(s) excluded ({kind}): {}{more}",
                examples.len(),
                examples[..examples.len().min(3)].join("; ")
            )
        })
        .collect()
}

fn device_total(problem: &Problem) -> usize {
    problem.nodes.iter().map(|node| node.devices.len()).sum()
}

/// The largest free device among the healthy, allowed ones (ignoring memory),
/// which is what a person compares a shard's need with.
fn largest_free_device(ctx: &PreparedProblem) -> Option<(f64, String, String)> {
    let mut best: Option<(f64, String, String)> = None;
    for (node_index, node) in ctx.problem.nodes.iter().enumerate() {
        for (device_index, device) in node.devices.iter().enumerate() {
            let usable = matches!(
                ctx.exclusions[node_index][device_index],
                None | Some(Exclusion::TooLittleMemory { .. })
            );
            let free = device.memory_free_bytes as f64;
            if usable && best.as_ref().is_none_or(|current| free > current.0) {
                best = Some((free, node.name.clone(), device.id.clone()));
            }
        }
    }
    best
}

/// Decides how many stages to plan, or why no count works. `caps` are the
/// layer capacities of the disjoint groups with the most room, largest first.
/// Explanations are only built on the way out: a solvable problem pays nothing.
pub(crate) fn stage_count(
    ctx: &PreparedProblem,
    caps: &[u32],
    any_node_fits_tensor: bool,
) -> Result<u32, Unsatisfiable> {
    let problem = ctx.problem;
    let model = &problem.model;
    let tensor = ctx.tensor;
    let total = device_total(problem);
    if total == 0 {
        return Err(unsat(
            "the cluster has no GPUs: no node reports any device".into(),
            vec![],
        ));
    }
    let eligible: usize = ctx
        .exclusions
        .iter()
        .flatten()
        .filter(|exclusion| exclusion.is_none())
        .count();
    if eligible == 0 {
        let details = exclusion_details(ctx);
        let reason = match largest_free_device(ctx) {
            Some((free, node, id))
                if details
                    .iter()
                    .all(|detail| detail.contains("too little free memory")) =>
            {
                format!(
                    "no GPU can hold even one layer: one layer needs {} per GPU (with tensor={tensor}), the largest free GPU has {} ({node}/{id})",
                    gib(model.overhead_bytes_per_device
                        + (model.weight_bytes_per_layer + model.kv_bytes_per_layer)
                            / f64::from(tensor)),
                    gib(free)
                )
            }
            _ => format!("none of the cluster's {total} GPUs can take a shard"),
        };
        return Err(unsat(reason, details));
    }
    if !any_node_fits_tensor {
        let (most, node) = ctx
            .problem
            .nodes
            .iter()
            .enumerate()
            .map(|(node_index, candidate)| {
                let count = ctx.exclusions[node_index]
                    .iter()
                    .filter(|exclusion| exclusion.is_none())
                    .count();
                (count, candidate.name.as_str())
            })
            .max_by(|a, b| a.0.cmp(&b.0).then(b.1.cmp(a.1)))
            .unwrap_or((0, ""));
        return Err(unsat(
            format!(
                "tensor={tensor} needs {tensor} eligible GPUs on one node; the most any node has is {most} ({node})"
            ),
            exclusion_details(ctx),
        ));
    }
    let layers = u64::from(model.layers);
    let need_bytes =
        f64::from(model.layers) * (model.weight_bytes_per_layer + model.kv_bytes_per_layer);
    let prefix = |count: usize| -> u64 { caps.iter().take(count).map(|&cap| u64::from(cap)).sum() };
    let groups_word = if tensor == 1 {
        "GPUs".to_string()
    } else {
        format!("groups of {tensor} GPUs")
    };
    match problem.stages {
        Stages::Fixed(stages) => {
            if (stages as usize) > caps.len() {
                return Err(unsat(
                    format!(
                        "pipeline={stages} × tensor={tensor} needs {stages} separate {groups_word} on one node each; the eligible GPUs make only {}",
                        caps.len()
                    ),
                    exclusion_details(ctx),
                ));
            }
            let held = prefix(stages as usize);
            if held < layers {
                let per_shard = model.layers.div_ceil(stages);
                let shard_need = model.overhead_bytes_per_device
                    + f64::from(per_shard)
                        * (model.weight_bytes_per_layer + model.kv_bytes_per_layer)
                        / f64::from(tensor);
                let largest = largest_free_device(ctx)
                    .map(|(free, node, id)| {
                        format!("; the largest free GPU has {} ({node}/{id})", gib(free))
                    })
                    .unwrap_or_default();
                let mut details = vec![format!(
                    "the model needs {} for {} layers plus {} per GPU; the {stages} largest {groups_word} hold {held} layers",
                    gib(need_bytes),
                    model.layers,
                    gib(model.overhead_bytes_per_device)
                )];
                details.extend(exclusion_details(ctx));
                return Err(unsat(
                    format!(
                        "pipeline={stages} × tensor={tensor} cannot hold the model: split evenly, each shard needs {} per GPU for {per_shard} layers{largest}. {}",
                        gib(shard_need),
                        too_small_advice(problem),
                    ),
                    details,
                ));
            }
            Ok(stages)
        }
        Stages::Auto => {
            let mut sum = 0u64;
            for (index, &cap) in caps.iter().enumerate() {
                sum += u64::from(cap);
                if sum >= layers {
                    return Ok(u32::try_from(index + 1)
                        .unwrap_or(u32::MAX)
                        .min(model.layers));
                }
            }
            let mut details = vec![format!(
                "all {} eligible {groups_word} together hold {sum} of {} layers",
                caps.len(),
                model.layers
            )];
            details.extend(exclusion_details(ctx));
            Err(unsat(
                format!(
                    "the model needs {} for {} layers plus {} per GPU; the whole cluster's eligible GPUs hold only {sum} of its {} layers",
                    gib(need_bytes),
                    model.layers,
                    gib(model.overhead_bytes_per_device),
                    model.layers
                ),
                details,
            ))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::testutil::*;
    use super::super::{SolveOptions, solve};
    use super::*;

    fn reason(problem: &Problem) -> Unsatisfiable {
        solve(problem, &SolveOptions::default()).unwrap_err()
    }

    #[test]
    fn empty_cluster() {
        let problem = problem(vec![], 7, 1, Stages::Auto);
        assert_eq!(
            reason(&problem).reason,
            "the cluster has no GPUs: no node reports any device"
        );
    }

    #[test]
    fn every_device_excluded_lists_why() {
        let mut problem = problem(vec![node("a", 3, H100)], 7, 1, Stages::Auto);
        problem.nodes[0].devices[0].healthy = false;
        problem.nodes[0].devices[0].health_reason = Some("Xid 79".into());
        problem.nodes[0].devices[1].temperature_c = Some(95.0);
        problem.selector.vendors = vec!["amd".into()];
        let unsatisfiable = reason(&problem);
        assert!(
            unsatisfiable
                .reason
                .contains("none of the cluster's 3 GPUs"),
            "{}",
            unsatisfiable.reason
        );
        let all = unsatisfiable.details.join("\n");
        assert!(all.contains("unhealthy (Xid 79)"), "{all}");
        assert!(all.contains("95 °C"), "{all}");
        assert!(all.contains("vendor not in [\"amd\"]"), "{all}");
    }

    #[test]
    fn product_and_node_selector_exclusions() {
        let mut by_product = problem(vec![node("a", 2, H100)], 7, 1, Stages::Auto);
        by_product.selector.products = vec!["MI300".into()];
        assert!(reason(&by_product).details[0].contains("product not matching"));
        let mut by_labels = problem(vec![node("a", 2, H100)], 7, 1, Stages::Auto);
        by_labels
            .selector
            .node_labels
            .insert("pool".into(), "inference".into());
        assert!(reason(&by_labels).details[0].contains("node selector"));
    }

    #[test]
    fn no_device_holds_a_layer() {
        let mut problem = problem(vec![node("a", 2, RTX4090)], 7, 1, Stages::Auto);
        problem.model.overhead_bytes_per_device = 30.0 * GIB;
        let unsatisfiable = reason(&problem);
        assert!(
            unsatisfiable
                .reason
                .starts_with("no GPU can hold even one layer"),
            "{}",
            unsatisfiable.reason
        );
        assert!(
            unsatisfiable.reason.contains("24.0 GiB (a/a-0)"),
            "{}",
            unsatisfiable.reason
        );
    }

    #[test]
    fn tensor_larger_than_any_node() {
        let problem = problem(
            vec![node("a", 4, H100), node("b", 2, H100)],
            7,
            8,
            Stages::Auto,
        );
        assert_eq!(
            reason(&problem).reason,
            "tensor=8 needs 8 eligible GPUs on one node; the most any node has is 4 (a)"
        );
    }

    #[test]
    fn too_many_stages_for_the_groups() {
        let problem = problem(vec![node("a", 4, H100)], 7, 2, Stages::Fixed(3));
        assert!(reason(&problem).reason.contains(
            "needs 3 separate groups of 2 GPUs on one node each; the eligible GPUs make only 2"
        ),);
    }

    #[test]
    fn fixed_pipeline_too_small_names_shard_need_and_largest_device() {
        // 70B bf16 over two 24 GiB cards cannot work.
        let problem = problem(vec![node("b", 2, RTX4090)], 70, 1, Stages::Fixed(2));
        let unsatisfiable = reason(&problem);
        assert!(
            unsatisfiable.reason.contains("each shard needs"),
            "{}",
            unsatisfiable.reason
        );
        assert!(
            unsatisfiable
                .reason
                .contains("the largest free GPU has 24.0 GiB (b/b-0)"),
            "{}",
            unsatisfiable.reason
        );
        assert!(
            unsatisfiable.details[0].contains("hold"),
            "{:?}",
            unsatisfiable.details
        );
    }

    #[test]
    fn model_larger_than_cluster() {
        let problem = problem(vec![node("b", 2, RTX4090)], 405, 1, Stages::Auto);
        let unsatisfiable = reason(&problem);
        assert!(
            unsatisfiable.reason.contains("hold only"),
            "{}",
            unsatisfiable.reason
        );
    }

    #[test]
    fn more_stages_than_layers() {
        let mut problem = problem(vec![node("a", 2, H100)], 7, 1, Stages::Fixed(40));
        problem.model.layers = 32;
        assert!(
            reason(&problem)
                .reason
                .contains("every stage needs at least one layer")
        );
    }
}
