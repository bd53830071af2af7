//! Serving a demand: a Service spreads requests evenly over an instance's
//! replicas, so `k` replicas serve `k ×` the slowest one's requests/s at the
//! target, and a demand takes as many replicas as that needs.

use super::choice::{InstancePlan, TensorChoice, solve_parallelism};
use super::replicas::take_devices;
use crate::placement::{Problem, SolveOptions, Unsatisfiable};

/// Requests/s replicas serve together at the target: their count × the
/// slowest one's (0 without replicas).
pub fn served_together(per_replica: &[f64]) -> f64 {
    // A replica without a figure serves nothing at the target.
    let slowest = per_replica
        .iter()
        .map(|rps| if rps.is_finite() { rps.max(0.0) } else { 0.0 })
        .fold(f64::INFINITY, f64::min);
    if per_replica.is_empty() {
        return 0.0;
    }
    per_replica.len() as f64 * slowest
}

/// The fewest of the first replicas that serve `demand` together, or `None`
/// when not even all of them do.
pub fn replicas_meeting(demand: f64, per_replica: &[f64]) -> Option<usize> {
    (1..=per_replica.len()).find(|&count| served_together(&per_replica[..count]) >= demand)
}

/// Replicas placed one after another, as `solve_replicas` does, until they
/// serve `demand` requests/s together at the target, at most `most` of them.
/// It stops early when a replica has no plan (the last entry says why) or
/// serves nothing at the target (more like it would not help).
pub fn solve_for_demand(
    problem: &Problem,
    tensor: TensorChoice,
    demand: f64,
    most: u32,
    owner: &str,
    options: &SolveOptions,
) -> Vec<Result<InstancePlan, Unsatisfiable>> {
    let mut remaining = problem.clone();
    let mut results = Vec::new();
    let mut served = Vec::new();
    for replica in 0..most {
        let result = solve_parallelism(&remaining, tensor, options);
        let Ok(placed) = &result else {
            results.push(result);
            break;
        };
        let rps = placed.requests_per_second().unwrap_or(0.0);
        served.push(rps);
        take_devices(
            &mut remaining,
            &placed.plan,
            &format!("{owner} replica {replica}"),
        );
        results.push(result);
        if rps <= 0.0 || replicas_meeting(demand, &served).is_some() {
            break;
        }
    }
    results
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replicas_serve_their_count_times_the_slowest() {
        assert_eq!(served_together(&[]), 0.0);
        assert_eq!(served_together(&[4.0, 2.0, 3.0]), 6.0);
        assert_eq!(replicas_meeting(4.0, &[4.0, 2.0, 3.0]), Some(1));
        // The second replica drags the pair down to 4; three serve 6.
        assert_eq!(replicas_meeting(5.0, &[4.0, 2.0, 3.0]), Some(3));
        assert_eq!(replicas_meeting(7.0, &[4.0, 2.0, 3.0]), None);
        assert_eq!(served_together(&[4.0, f64::NAN]), 0.0);
    }
}
