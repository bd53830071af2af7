//! Replicas placed one after another, each on the devices the earlier ones
//! left.

use std::borrow::Cow;

use super::choice::{InstancePlan, TensorChoice, solve_parallelism};
use crate::placement::{DeviceShare, Plan, Problem, SolveOptions, StageShare, Unsatisfiable};

/// Plans `replicas` copies one after another: each replica's devices are
/// taken (held by `owner`) before the next is planned, and its nodes are
/// what `Strategy::Spread` keeps the next away from. Once a replica has no
/// plan the later ones have none either (they face the same cluster), so
/// they get the same answer without another search.
pub fn solve_replicas(
    problem: &Problem,
    tensor: TensorChoice,
    replicas: u32,
    owner: &str,
    options: &SolveOptions,
) -> Vec<Result<InstancePlan, Unsatisfiable>> {
    // Copied only when a later replica needs the devices marked.
    let mut remaining = Cow::Borrowed(problem);
    let mut results: Vec<Result<InstancePlan, Unsatisfiable>> = Vec::new();
    for replica in 0..replicas {
        if let Some(Err(refusal)) = results.last() {
            let refusal = refusal.clone();
            results.push(Err(refusal));
            continue;
        }
        let result = solve_parallelism(&remaining, tensor, options);
        if let Ok(placed) = &result
            && replica + 1 < replicas
        {
            take_devices(
                remaining.to_mut(),
                &placed.plan,
                &format!("{owner} replica {replica}"),
            );
        }
        results.push(result);
    }
    results
}

/// Marks the plan's devices held by `holder` and records its nodes as a
/// replica's.
pub fn take_devices(problem: &mut Problem, plan: &Plan, holder: &str) {
    for stage in &plan.stages {
        problem.replica_nodes.push(stage.node.clone());
        let Some(node) = problem
            .nodes
            .iter_mut()
            .find(|node| node.name == stage.node)
        else {
            continue;
        };
        for device in &mut node.devices {
            if !stage.devices.contains(&device.id) {
                continue;
            }
            // A memory share leaves the rest of its GPU to later shares.
            match (&mut device.share, &stage.share) {
                (Some(DeviceShare::Memory { tenants }), Some(StageShare::Memory { bytes, .. })) => {
                    *tenants += 1;
                    device.memory_free_bytes = device.memory_free_bytes.saturating_sub(*bytes);
                }
                _ => device.allocated_to = Some(holder.to_string()),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::placement::Stages;
    use crate::placement::testutil::{H100, node, problem as sample};

    #[test]
    fn replicas_never_share_a_device_and_stop_where_the_cluster_ends() {
        let problem = sample(vec![node("a", 4, H100)], 8, 1, Stages::Fixed(1));
        let results = solve_replicas(
            &problem,
            TensorChoice::Fixed(2),
            3,
            "ns/m",
            &SolveOptions::default(),
        );
        let placed: Vec<&InstancePlan> = results.iter().filter_map(|r| r.as_ref().ok()).collect();
        assert_eq!(placed.len(), 2);
        let mut devices: Vec<&String> = placed
            .iter()
            .flat_map(|p| p.plan.stages.iter().flat_map(|s| &s.devices))
            .collect();
        devices.sort();
        devices.dedup();
        assert_eq!(devices.len(), 4, "four distinct devices");
        assert!(results[2].is_err());
    }
}
