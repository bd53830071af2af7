//! A placed replica's capacity at the latency target, as the status shows
//! it, and what an instance's replicas serve together.

use std::collections::{BTreeSet, HashMap};

use super::{ClusterNode, HeldShares, build_problem, evaluate_placed};
use crate::api::{
    InstanceCapacity, ModelInstanceSpec, PlannedShard, ReplicaCapacity, ServingCorrection,
};
use crate::placement::{Plan, Problem};
use crate::serving::{Capacity, Replica};
use crate::sizing::served_together;

/// What a placed replica (its shards, in pipeline order) serves at the
/// spec's target on the nodes it runs on, with the instance's measured
/// `corrections` applied. An error says why there is no answer (a node or
/// device gone, memory short, no request fits).
pub fn placed_capacity<'a>(
    spec: &ModelInstanceSpec,
    corrections: &[ServingCorrection],
    nodes: impl IntoIterator<Item = &'a ClusterNode>,
    shards: &[&PlannedShard],
) -> Result<Capacity, String> {
    judge_placed(placed_problem(spec, corrections, nodes, shards), shards)?.1
}

/// As [`placed_capacity`], with `corrections` and as the model alone
/// predicts it (what a replica's pods are started with), the placed plan
/// evaluated once for both. Without corrections the two are the same.
pub fn placed_capacities<'a>(
    spec: &ModelInstanceSpec,
    corrections: &[ServingCorrection],
    nodes: impl IntoIterator<Item = &'a ClusterNode>,
    shards: &[&PlannedShard],
) -> Result<(Capacity, Capacity), String> {
    let problem = placed_problem(spec, corrections, nodes, shards);
    let plan = evaluate_placed(problem.clone(), shards)?;
    let served = problem
        .served
        .as_ref()
        .ok_or_else(|| "the problem says nothing of what is served".to_string())?;
    let at = |served: &crate::placement::Served| {
        crate::sizing::capacity(served, &problem.goal, &problem, &plan).map(|(c, _)| c)
    };
    let corrected = at(served)?;
    let plain = if served.corrections.is_empty() {
        corrected.clone()
    } else {
        at(&served.clone().corrected(&[]))?
    };
    Ok((corrected, plain))
}

/// A placed replica's time per output token at `concurrency` as the model
/// predicts it, uncorrected (what a measurement is compared with), and the
/// GPU product a correction of it is learned by.
pub fn predicted_tpot<'a>(
    spec: &ModelInstanceSpec,
    nodes: impl IntoIterator<Item = &'a ClusterNode>,
    shards: &[&PlannedShard],
    concurrency: u32,
) -> Result<(String, f64), String> {
    let problem = placed_problem(spec, &[], nodes, shards);
    let plan = evaluate_placed(problem.clone(), shards)?;
    let served = problem
        .served
        .as_ref()
        .ok_or_else(|| "the problem says nothing of what is served".to_string())?;
    let (input, _) = crate::sizing::read_plan(served, &problem, &plan)?;
    let product = crate::sizing::plan_product(&problem, &plan)
        .ok_or_else(|| "the plan's first device is not in the cluster".to_string())?
        .to_string();
    let replica = Replica::new(&input).map_err(|refusal| refusal.to_string())?;
    Ok((product, replica.at(concurrency).tpot_ms))
}

/// The problem of a placed replica: its own nodes only, as free as they
/// are, what it serves corrected by `corrections`.
fn placed_problem<'a>(
    spec: &ModelInstanceSpec,
    corrections: &[ServingCorrection],
    nodes: impl IntoIterator<Item = &'a ClusterNode>,
    shards: &[&PlannedShard],
) -> Problem {
    let used: BTreeSet<&str> = shards.iter().map(|shard| shard.node.as_str()).collect();
    let mut problem = build_problem(
        spec,
        nodes
            .into_iter()
            .filter(|node| used.contains(node.name.as_str())),
        &HashMap::new(),
        &HeldShares::new(),
    );
    problem.served = problem.served.map(|served| served.corrected(corrections));
    problem
}

/// A placed replica's shards evaluated on `problem`'s nodes (as free as the
/// caller built them), and what that plan serves at the target. The outer
/// error says the shards cannot hold the model there; the inner one that
/// the serving model has no answer for the plan.
pub fn judge_placed(
    problem: Problem,
    shards: &[&PlannedShard],
) -> Result<(Plan, Result<Capacity, String>), String> {
    let plan = evaluate_placed(problem.clone(), shards)?;
    let capacity = problem
        .served
        .as_ref()
        .ok_or_else(|| "the problem says nothing of what is served".to_string())
        .and_then(|served| crate::sizing::capacity(served, &problem.goal, &problem, &plan))
        .map(|(capacity, _)| capacity);
    Ok((plan, capacity))
}

/// A replica's capacity as the status shows it: the load at the target, or
/// the best it does when not even one request meets it.
pub fn replica_capacity(capacity: &Capacity) -> ReplicaCapacity {
    match (&capacity.at_slo, &capacity.target_missed) {
        (Some(at), _) => ReplicaCapacity {
            concurrency: at.concurrency,
            requests_per_second: hundredths(at.requests_per_second),
            output_tokens_per_second: hundredths(at.output_tokens_per_second),
            tpot_ms: hundredths(at.tpot_ms),
            ttft_ms: hundredths(at.ttft_ms),
            target_missed: None,
            correction: capacity.correction,
        },
        (None, miss) => ReplicaCapacity {
            concurrency: 0,
            requests_per_second: 0.0,
            output_tokens_per_second: 0.0,
            tpot_ms: hundredths(miss.map_or(0.0, |miss| miss.best_tpot_ms)),
            ttft_ms: hundredths(miss.map_or(0.0, |miss| miss.best_ttft_ms)),
            target_missed: Some(
                miss.map_or_else(|| "no prediction".to_string(), |miss| miss.to_string()),
            ),
            correction: capacity.correction,
        },
    }
}

/// What replicas serve together when a Service spreads requests evenly: the
/// slowest one's load on every replica. `None` without replicas.
pub fn instance_capacity(
    replicas: &[ReplicaCapacity],
    demand: Option<f64>,
) -> Option<InstanceCapacity> {
    let slowest = replicas
        .iter()
        .min_by(|a, b| a.requests_per_second.total_cmp(&b.requests_per_second))?;
    let per_replica: Vec<f64> = replicas.iter().map(|r| r.requests_per_second).collect();
    let requests_per_second = served_together(&per_replica);
    // Each replica at the slowest one's request rate: tokens follow the rate.
    let tokens_per_request = if slowest.requests_per_second > 0.0 {
        slowest.output_tokens_per_second / slowest.requests_per_second
    } else {
        0.0
    };
    Some(InstanceCapacity {
        requests_per_second: hundredths(requests_per_second),
        output_tokens_per_second: hundredths(requests_per_second * tokens_per_request),
        concurrency: replicas.len() as u32 * slowest.concurrency,
        tpot_ms: replicas.iter().map(|r| r.tpot_ms).fold(0.0, f64::max),
        ttft_ms: replicas.iter().map(|r| r.ttft_ms).fold(0.0, f64::max),
        demand_requests_per_second: demand,
    })
}

/// A figure as the status shows it: to a hundredth.
fn hundredths(value: f64) -> f64 {
    (value * 100.0).round() / 100.0
}

#[cfg(test)]
mod tests {
    use super::*;

    fn replica(rps: f64, concurrency: u32, tpot: f64) -> ReplicaCapacity {
        ReplicaCapacity {
            concurrency,
            requests_per_second: rps,
            output_tokens_per_second: rps * 256.0,
            tpot_ms: tpot,
            ttft_ms: 100.0,
            target_missed: None,
            correction: None,
        }
    }

    #[test]
    fn replicas_together_serve_their_count_times_the_slowest() {
        assert_eq!(instance_capacity(&[], Some(1.0)), None);
        let together = instance_capacity(
            &[replica(4.0, 100, 40.0), replica(3.0, 80, 45.0)],
            Some(5.0),
        )
        .expect("two replicas");
        assert_eq!(together.requests_per_second, 6.0);
        assert_eq!(together.output_tokens_per_second, 6.0 * 256.0);
        assert_eq!(together.concurrency, 160);
        assert_eq!(together.tpot_ms, 45.0);
        assert_eq!(together.demand_requests_per_second, Some(5.0));
    }
}
