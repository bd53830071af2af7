//! How many replicas an instance gets: `spec.replicas`, or with
//! `serving.replicasFromDemand` as many as `serving.requestsPerSecond` needs
//! at the latency target, and what each
//! replica serves there. A Service spreads requests evenly, so `k` replicas
//! serve `k ×` the slowest one's requests/s; the count grows until they
//! meet the demand, a replica has no plan or serves nothing at the target,
//! or the count reaches `DEMAND_REPLICAS.max`, and shrinks (the newest
//! replicas first) while fewer would still meet it. Pure, like the rest of
//! the stage.

use super::replicas::{Replicas, decide_replicas};
use super::{PlanDecision, PlanInputs, ReplicaDecision};
use tessera_core::api::{PlannedShard, ReplicaCapacity, ReplicaCount};
use tessera_core::sizing::replicas_meeting;
use tessera_core::translate::{placed_capacities, replica_capacity};

/// Every replica's decision, and what each placed one serves at the target.
pub(crate) struct Counted {
    pub(crate) decisions: Vec<ReplicaDecision>,
    pub(crate) capacities: Vec<Option<Predicted>>,
}

/// What a placed replica serves at the target, with the instance's measured
/// corrections and without them (what its pods are started with).
#[derive(Clone, Debug)]
pub(crate) struct Predicted {
    pub(crate) capacity: ReplicaCapacity,
    pub(crate) started_with: ReplicaCapacity,
}

/// Decides the replicas: the fixed count, or the count the demand needs
/// within its bounds. `replicas.current` holds a slot for every replica the
/// instance may have (`ModelInstanceSpec::most_replicas`), empty for those
/// it has not.
pub(crate) fn decide_count(
    replicas: &Replicas<'_>,
    base: &PlanInputs<'_>,
    count: ReplicaCount,
) -> Counted {
    let most = replicas.current.len() as u32;
    let first = |count: u32| {
        let count = count.min(most) as usize;
        let decided = decide_replicas(
            &Replicas {
                current: &replicas.current[..count],
                ..*replicas
            },
            base,
        );
        let capacities = capacities(replicas, base, &decided);
        Counted {
            decisions: decided,
            capacities,
        }
    };
    let (demand, least) = match count {
        ReplicaCount::Fixed(count) => return first(count),
        ReplicaCount::ForDemand {
            requests_per_second,
            least,
            ..
        } => (requests_per_second, least.clamp(1, most.max(1))),
    };
    let planned_now = replicas
        .current
        .iter()
        .rposition(|plan| !plan.is_empty())
        .map_or(1, |last| last as u32 + 1);
    let mut count = planned_now.clamp(least, most.max(least));
    loop {
        let mut counted = first(count);
        let served: Vec<f64> = counted
            .capacities
            .iter()
            .map(|predicted| {
                predicted
                    .as_ref()
                    .map_or(0.0, |p| p.capacity.requests_per_second)
            })
            .collect();
        if let Some(enough) = replicas_meeting(demand, &served) {
            let enough = enough.max(least as usize);
            counted.decisions.truncate(enough);
            counted.capacities.truncate(enough);
            return counted;
        }
        // The first replica without a plan says why; those after it would
        // say the same.
        if let Some(first_unplaced) = counted
            .decisions
            .iter()
            .position(|(decision, _)| matches!(decision, PlanDecision::Unsatisfiable { .. }))
        {
            counted.decisions.truncate(first_unplaced + 1);
            counted.capacities.truncate(first_unplaced + 1);
            return counted;
        }
        let slowest = served.iter().copied().fold(f64::INFINITY, f64::min);
        if count >= most || slowest <= 0.0 || !slowest.is_finite() {
            return counted;
        }
        // Replicas like the slowest, at least one more.
        let needed = (demand / slowest).ceil().min(f64::from(most)) as u32;
        count = needed.clamp(count + 1, most);
    }
}

/// What each replica's plan (kept or new) serves at the target; `None` for
/// a replica without one, or where the serving model has no answer.
fn capacities(
    replicas: &Replicas<'_>,
    base: &PlanInputs<'_>,
    decided: &[ReplicaDecision],
) -> Vec<Option<Predicted>> {
    decided
        .iter()
        .enumerate()
        .map(|(index, (decision, _))| {
            let plan: &[PlannedShard] = match decision {
                PlanDecision::Planned(new) => &new.plan,
                PlanDecision::Keep => replicas.current.get(index)?,
                PlanDecision::Unsatisfiable { .. } => return None,
            };
            let shards: Vec<&PlannedShard> = plan.iter().collect();
            let (corrected, plain) = placed_capacities(
                replicas.spec,
                base.corrections,
                base.nodes.iter().map(|node| &node.gpus),
                &shards,
            )
            .ok()?;
            Some(Predicted {
                capacity: replica_capacity(&corrected),
                started_with: replica_capacity(&plain),
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use super::*;
    use crate::controller::held::Held;
    use crate::controller::testkit::*;

    fn count(spec: &str, nodes: &[std::sync::Arc<crate::controller::nodes::NodeInfo>]) -> Counted {
        count_for(spec, nodes, None)
    }

    /// With a measured demand planned for `measured`.
    fn count_for(
        spec: &str,
        nodes: &[std::sync::Arc<crate::controller::nodes::NodeInfo>],
        measured: Option<f64>,
    ) -> Counted {
        let spec = instance("m", spec).spec;
        let current = vec![Vec::new(); spec.most_replicas() as usize];
        let held = Held::new();
        let replicas = Replicas {
            spec: &spec,
            tolerations: &[],
            current: &current,
            placement_hash: None,
            keep_when_unsatisfiable: false,
            failed_admission: &[],
            known_unsatisfiable: &[],
        };
        decide_count(
            &replicas,
            &inputs(nodes, &held),
            spec.replica_count(measured),
        )
    }

    fn served(counted: &Counted) -> Vec<f64> {
        counted
            .capacities
            .iter()
            .map(|c| c.as_ref().map_or(0.0, |c| c.capacity.requests_per_second))
            .collect()
    }

    #[test]
    fn a_demand_gets_the_fewest_replicas_that_serve_it() {
        let nodes = infos(&[node("a", 8, H100)]);
        let one = served(&count(SMALL, &nodes));
        assert_eq!(one.len(), 1, "no demand: one replica");
        let each = one[0];
        assert!(each > 0.0, "{one:?}");
        let demand = each * 2.5;
        let counted = count(
            &format!("{SMALL}\nserving: {{requestsPerSecond: {demand}, replicasFromDemand: true}}"),
            &nodes,
        );
        assert_eq!(counted.decisions.len(), 3, "{:?}", served(&counted));
        let devices: BTreeSet<String> = counted
            .decisions
            .iter()
            .flat_map(|(decision, _)| match decision {
                PlanDecision::Planned(new) => new
                    .plan
                    .iter()
                    .flat_map(|s| s.devices.clone())
                    .collect::<Vec<_>>(),
                other => panic!("planned, not {other:?}"),
            })
            .collect();
        assert_eq!(devices.len(), 3, "three replicas on three GPUs");
        // More than the cluster holds: every GPU, and the demand is unmet.
        let counted = count(
            &format!(
                "{SMALL}\nserving: {{requestsPerSecond: {}, replicasFromDemand: true}}",
                each * 100.0
            ),
            &nodes,
        );
        let placed = counted
            .decisions
            .iter()
            .filter(|(decision, _)| matches!(decision, PlanDecision::Planned(_)))
            .count();
        assert_eq!(placed, 8, "every GPU serves part of it");
        assert_eq!(
            counted.decisions.len(),
            9,
            "and one more says why there is no more"
        );
        // A fixed count is kept whatever the demand.
        let fixed = count(
            &format!(
                "{SMALL}\nreplicas: 2\nserving: {{requestsPerSecond: {}}}",
                each * 100.0
            ),
            &nodes,
        );
        assert_eq!(fixed.decisions.len(), 2);
    }

    #[test]
    fn a_measured_demand_gets_what_it_needs_within_its_bounds() {
        let nodes = infos(&[node("a", 8, H100)]);
        let each = served(&count(SMALL, &nodes))[0];
        let spec =
            format!("{SMALL}\nserving: {{demand: Measured, minReplicas: 2, maxReplicas: 4}}");
        for (planned, wanted) in [(0.0, 2), (each * 2.5, 3), (each * 100.0, 4)] {
            let counted = count_for(&spec, &nodes, Some(planned));
            assert_eq!(counted.decisions.len(), wanted, "{planned} requests/s");
        }
    }
}
