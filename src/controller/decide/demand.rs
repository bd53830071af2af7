//! Which replicas an instance gets: `spec.replicas` of them, or with a
//! demand as many as it needs at the latency target, and what each replica
//! serves there. A Service spreads requests evenly, so `k` replicas serve
//! `k ×` the slowest one's requests/s; the count grows until they meet the
//! demand, a replica has no plan or serves nothing at the target, or the
//! count reaches its most, and shrinks (the costliest per request first)
//! while fewer would still meet it. Replicas keep their numbers; a new one
//! takes the lowest free number. Pure, like the rest of the stage.

use super::replicas::{Replicas, decide_replicas};
use super::{PlanDecision, PlanInputs, ReplicaDecision};
use tessera_core::api::{PlannedShard, ReplicaCapacity, ReplicaCount};
use tessera_core::sizing::{replicas_meeting, served_together};
use tessera_core::translate::{placed_capacities, replica_capacity};

/// The wanted replicas by number, each one's decision, and what each
/// placed one serves at the target, in the order they were decided.
pub(crate) struct Counted {
    pub(crate) replicas: Vec<u32>,
    pub(crate) decisions: Vec<ReplicaDecision>,
    pub(crate) capacities: Vec<Option<Predicted>>,
}

impl Counted {
    fn len(&self) -> usize {
        self.replicas.len()
    }

    fn served(&self) -> Vec<f64> {
        self.capacities
            .iter()
            .map(|predicted| {
                predicted
                    .as_ref()
                    .map_or(0.0, |p| p.capacity.requests_per_second)
            })
            .collect()
    }

    fn truncate(&mut self, count: usize) {
        self.replicas.truncate(count);
        self.decisions.truncate(count);
        self.capacities.truncate(count);
    }

    fn remove(&mut self, index: usize) {
        self.replicas.remove(index);
        self.decisions.remove(index);
        self.capacities.remove(index);
    }

    /// Positions from the replica to remove first to the last: one without
    /// a plan, then the most GPUs per request/s at the target (the cluster
    /// objective's fewest GPUs; in steps of 1%), then the most GPUs,
    /// then the highest number.
    fn costliest_first(&self, replicas: &Replicas<'_>) -> Vec<usize> {
        let served = self.served();
        let key = |index: usize| {
            let plan: &[PlannedShard] = match &self.decisions[index].0 {
                PlanDecision::Planned(new) => &new.plan,
                PlanDecision::Keep => replicas.of(self.replicas[index]),
                PlanDecision::Unsatisfiable { .. } => &[],
            };
            let gpus: f64 = plan.iter().map(PlannedShard::gpus).sum();
            let per_request = gpus / served[index];
            // Steps of 1%, so figures a rounding apart do not decide.
            let step = if per_request.is_finite() && per_request > 0.0 {
                (per_request.ln() / COST_STEP.ln_1p()).round() as i64
            } else {
                i64::MAX
            };
            (plan.is_empty(), step, gpus, self.replicas[index])
        };
        let keys: Vec<_> = (0..self.len()).map(key).collect();
        let mut order: Vec<usize> = (0..self.len()).collect();
        order.sort_by(|&a, &b| {
            let (a, b) = (&keys[a], &keys[b]);
            b.0.cmp(&a.0)
                .then(b.1.cmp(&a.1))
                .then(b.2.total_cmp(&a.2))
                .then(b.3.cmp(&a.3))
        });
        order
    }
}

/// Costs per request closer than this share are taken as equal.
const COST_STEP: f64 = 0.01;

/// What a placed replica serves at the target, with the instance's measured
/// corrections and without them (what its pods are started with).
#[derive(Clone, Debug)]
pub(crate) struct Predicted {
    pub(crate) capacity: ReplicaCapacity,
    pub(crate) started_with: ReplicaCapacity,
}

/// Decides the replicas: the fixed count, or the count the demand needs
/// within its bounds. `replicas.current` holds a slot for every replica the
/// instance may have or has, empty for those it has not. The replicas that
/// have a plan stay; a new one takes the lowest free number; fewer remove
/// the costliest per request first.
pub(crate) fn decide_count(
    replicas: &Replicas<'_>,
    base: &PlanInputs<'_>,
    count: ReplicaCount,
) -> Counted {
    let most = replicas.spec.most_replicas();
    let slots = replicas.current.len() as u32;
    let planned: Vec<u32> = (0..slots).filter(|&r| !replicas.of(r).is_empty()).collect();
    // The planned replicas, then new ones on the lowest free numbers.
    let numbers = |count: u32| -> Vec<u32> {
        let new = (0..)
            .filter(|r| !planned.contains(r))
            .take((count as usize).saturating_sub(planned.len()));
        planned.iter().copied().chain(new).collect()
    };
    // A replica's cost is its own, so one order serves every removal.
    let fewer = |counted: &mut Counted, count: u32| {
        let excess = counted.len().saturating_sub(count as usize);
        let mut out: Vec<usize> = counted.costliest_first(replicas)[..excess].to_vec();
        out.sort_unstable_by(|a, b| b.cmp(a));
        for index in out {
            counted.remove(index);
        }
    };
    let first = |wanted: Vec<u32>| {
        let decisions = decide_replicas(replicas, &wanted, base);
        let capacities = capacities(replicas, base, &wanted, &decisions);
        Counted {
            replicas: wanted,
            decisions,
            capacities,
        }
    };
    let (demand, least) = match count {
        ReplicaCount::Fixed(count) => {
            let count = count.min(most);
            let mut counted = first(numbers(count));
            fewer(&mut counted, count);
            return counted;
        }
        ReplicaCount::ForDemand {
            requests_per_second,
            least,
            ..
        } => (requests_per_second, least.clamp(1, most.max(1))),
    };
    let mut counted = first(numbers((planned.len() as u32).max(least)));
    // A lower `maxReplicas` than there are.
    fewer(&mut counted, most);
    // Fewer, the costliest per request first, while the rest still meet it.
    while counted.len() > least as usize {
        let served = counted.served();
        let removable = counted.costliest_first(replicas).into_iter().find(|&out| {
            let rest: Vec<f64> = (0..served.len())
                .filter(|&i| i != out)
                .map(|i| served[i])
                .collect();
            served_together(&rest) >= demand
        });
        let Some(out) = removable else { break };
        counted.remove(out);
    }
    let kept = counted.len();
    loop {
        let served = counted.served();
        if served_together(&served) >= demand {
            return counted;
        }
        // Fewer of the replicas added here may do; the ones kept above stay.
        if let Some(enough) = replicas_meeting(demand, &served)
            && enough > kept
        {
            counted.truncate(enough);
            return counted;
        }
        // The first new replica without a plan says why; those after it
        // would say the same.
        if let Some(first_unplaced) = (kept..counted.len())
            .find(|&i| matches!(counted.decisions[i].0, PlanDecision::Unsatisfiable { .. }))
        {
            counted.truncate(first_unplaced + 1);
            return counted;
        }
        let slowest = served.into_iter().fold(f64::INFINITY, f64::min);
        let count = counted.len() as u32;
        if count >= most || slowest <= 0.0 || !slowest.is_finite() {
            return counted;
        }
        // Replicas like the slowest, at least one more.
        let needed = (demand / slowest).ceil().min(f64::from(most)) as u32;
        counted = first(numbers(needed.clamp(count + 1, most)));
    }
}

/// What each replica's plan (kept or new) serves at the target; `None` for
/// a replica without one, or where the serving model has no answer.
fn capacities(
    replicas: &Replicas<'_>,
    base: &PlanInputs<'_>,
    wanted: &[u32],
    decided: &[ReplicaDecision],
) -> Vec<Option<Predicted>> {
    wanted
        .iter()
        .zip(decided)
        .map(|(&replica, (decision, _))| {
            let plan: &[PlannedShard] = match decision {
                PlanDecision::Planned(new) => &new.plan,
                PlanDecision::Keep => replicas.of(replica),
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

    /// Decides `spec` with `current` as the replicas' plans (a slot each).
    fn count_with(
        spec: &str,
        nodes: &[std::sync::Arc<crate::controller::nodes::NodeInfo>],
        current: &[Vec<PlannedShard>],
        measured: Option<f64>,
    ) -> Counted {
        let spec = instance("m", spec).spec;
        let mut slots = current.to_vec();
        let most = spec.most_replicas() as usize;
        slots.resize(slots.len().max(most), Vec::new());
        let held = Held::new();
        let hash = crate::controller::hashes::placement_hash(&spec);
        let replicas = Replicas {
            spec: &spec,
            tolerations: &[],
            current: &slots,
            placement_hash: Some(&hash),
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

    fn plan_of(decision: &ReplicaDecision) -> &[PlannedShard] {
        match &decision.0 {
            PlanDecision::Planned(new) => &new.plan,
            other => panic!("expected a new plan, got {other:?}"),
        }
    }

    /// Replica 0 on the RTX 4090 (a GPU serving fewer requests/s), replica
    /// 1 on the H100: the costlier per request is not the highest number.
    fn slow_first(
        nodes: &[std::sync::Arc<crate::controller::nodes::NodeInfo>],
    ) -> Vec<Vec<PlannedShard>> {
        let both = count_with(&format!("{SMALL}\nreplicas: 2"), nodes, &[], None);
        let mut plans: Vec<Vec<PlannedShard>> =
            both.decisions.iter().map(|d| plan_of(d).to_vec()).collect();
        plans.sort_by_key(|plan| plan[0].node != "slow");
        for (replica, plan) in (0..).zip(&mut plans) {
            for shard in plan.iter_mut() {
                shard.replica = replica;
            }
        }
        assert_eq!(plans[0][0].node, "slow");
        assert_eq!(plans[1][0].node, "fast");
        plans
    }

    #[test]
    fn fewer_replicas_remove_the_costliest_per_request_and_more_take_the_lowest_free_number() {
        let nodes = infos(&[node("slow", 1, RTX4090), node("fast", 1, H100)]);
        let current = slow_first(&nodes);
        let one = count_with(&format!("{SMALL}\nreplicas: 1"), &nodes, &current, None);
        assert_eq!(one.replicas, [1], "the replica on the RTX 4090 goes");
        assert_eq!(one.decisions[0].0, PlanDecision::Keep);

        // Back to two: replica 1 stays as it is, a new replica 0 takes the
        // GPU left.
        let kept = vec![Vec::new(), current[1].clone()];
        let two = count_with(&format!("{SMALL}\nreplicas: 2"), &nodes, &kept, None);
        assert_eq!(two.replicas, [1, 0]);
        assert_eq!(two.decisions[0].0, PlanDecision::Keep);
        let new = plan_of(&two.decisions[1]);
        assert!(
            new.iter().all(|s| s.replica == 0 && s.node == "slow"),
            "{new:?}"
        );

        // Equal GPUs serving equally: the highest number goes.
        let nodes = infos(&[node("slow", 1, H100), node("fast", 1, H100)]);
        let current = slow_first(&nodes);
        let one = count_with(&format!("{SMALL}\nreplicas: 1"), &nodes, &current, None);
        assert_eq!(one.replicas, [0]);
    }

    #[test]
    fn a_smaller_measured_demand_removes_the_costliest_per_request_first() {
        let nodes = infos(&[node("slow", 1, RTX4090), node("fast", 1, H100)]);
        let current = slow_first(&nodes);
        let spec =
            format!("{SMALL}\nserving: {{demand: Measured, minReplicas: 1, maxReplicas: 2}}");
        let fast = count_with(&spec, &nodes, &current, Some(0.0)).served();
        let one = count_with(&spec, &nodes, &current, Some(0.0));
        assert_eq!(one.replicas, [1], "{fast:?}");
        // A demand the H100 alone does not serve keeps both.
        let each = count_with(&spec, &nodes, &current, Some(1e6)).served();
        let both = count_with(&spec, &nodes, &current, Some(each[1] * 1.5));
        assert_eq!(both.replicas, [0, 1], "{each:?}");
    }

    /// The replicas of `counted` as the next reconcile finds them: a slot
    /// per number, its plan (kept or new) in it.
    fn as_current(counted: &Counted, before: &[Vec<PlannedShard>]) -> Vec<Vec<PlannedShard>> {
        let mut slots = vec![Vec::new(); 8];
        for (replica, decision) in counted.replicas.iter().zip(&counted.decisions) {
            slots[*replica as usize] = match &decision.0 {
                PlanDecision::Planned(new) => new.plan.clone(),
                PlanDecision::Keep => before[*replica as usize].clone(),
                PlanDecision::Unsatisfiable { .. } => Vec::new(),
            };
        }
        slots
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(24))]
        /// Any count after any other: the replicas that stay keep their
        /// plans and numbers, new ones take the lowest free numbers, and
        /// none that goes serves a request on fewer GPUs than one that stays.
        #[test]
        fn replicas_keep_their_numbers_and_the_costliest_go(
            counts in proptest::collection::vec(1u32..=4, 2..5)
        ) {
            let nodes = infos(&[
                node("slow-a", 1, RTX4090),
                node("fast-a", 1, H100),
                node("slow-b", 1, RTX4090),
                node("fast-b", 1, H100),
            ]);
            let mut current: Vec<Vec<PlannedShard>> = vec![Vec::new(); 8];
            for count in counts {
                let before: BTreeSet<u32> = (0..8u32)
                    .filter(|r| !current[*r as usize].is_empty())
                    .collect();
                let counted =
                    count_with(&format!("{SMALL}\nreplicas: {count}"), &nodes, &current, None);
                let after: BTreeSet<u32> = counted.replicas.iter().copied().collect();
                proptest::prop_assert_eq!(after.len(), counted.replicas.len(), "unique numbers");
                proptest::prop_assert_eq!(after.len(), count as usize);
                for (replica, decision) in counted.replicas.iter().zip(&counted.decisions) {
                    if before.contains(replica) {
                        proptest::prop_assert_eq!(&decision.0, &PlanDecision::Keep);
                    }
                }
                let added: Vec<u32> = after.difference(&before).copied().collect();
                let free: Vec<u32> = (0..8u32)
                    .filter(|r| !before.contains(r))
                    .take(added.len())
                    .collect();
                proptest::prop_assert_eq!(added, free, "the lowest free numbers");
                let cost = |replica: u32| {
                    let index = counted.replicas.iter().position(|r| *r == replica);
                    let plan = &current[replica as usize];
                    let served = match index {
                        Some(i) => counted.served()[i],
                        None => plan_served(&nodes, plan),
                    };
                    plan.iter().map(PlannedShard::gpus).sum::<f64>() / served
                };
                for gone in before.difference(&after) {
                    for stays in after.intersection(&before) {
                        proptest::prop_assert!(
                            cost(*gone) >= cost(*stays) * (1.0 - 2.0 * COST_STEP),
                            "replica {} went, {} stayed", gone, stays
                        );
                    }
                }
                current = as_current(&counted, &current);
            }
        }
    }

    /// Requests/s one replica's plan serves at SMALL's target.
    fn plan_served(
        nodes: &[std::sync::Arc<crate::controller::nodes::NodeInfo>],
        plan: &[PlannedShard],
    ) -> f64 {
        let alone = count_with(
            &format!("{SMALL}\nreplicas: 1"),
            nodes,
            &[plan.to_vec()],
            None,
        );
        alone.served()[0]
    }

    fn count(spec: &str, nodes: &[std::sync::Arc<crate::controller::nodes::NodeInfo>]) -> Counted {
        count_for(spec, nodes, None)
    }

    /// With a measured demand planned for `measured`.
    fn count_for(
        spec: &str,
        nodes: &[std::sync::Arc<crate::controller::nodes::NodeInfo>],
        measured: Option<f64>,
    ) -> Counted {
        count_with(spec, nodes, &[], measured)
    }

    #[test]
    fn a_demand_gets_the_fewest_replicas_that_serve_it() {
        let nodes = infos(&[node("a", 8, H100)]);
        let one = count(SMALL, &nodes).served();
        assert_eq!(one.len(), 1, "no demand: one replica");
        let each = one[0];
        assert!(each > 0.0, "{one:?}");
        let demand = each * 2.5;
        let counted = count(
            &format!("{SMALL}\nserving: {{requestsPerSecond: {demand}, replicasFromDemand: true}}"),
            &nodes,
        );
        assert_eq!(counted.decisions.len(), 3, "{:?}", counted.served());
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
        let each = count(SMALL, &nodes).served()[0];
        let spec =
            format!("{SMALL}\nserving: {{demand: Measured, minReplicas: 2, maxReplicas: 4}}");
        for (planned, wanted) in [(0.0, 2), (each * 2.5, 3), (each * 100.0, 4)] {
            let counted = count_for(&spec, &nodes, Some(planned));
            assert_eq!(counted.decisions.len(), wanted, "{planned} requests/s");
        }
    }
}
