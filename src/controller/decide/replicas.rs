//! The decide stage for every wanted replica of an instance. Each replica
//! is decided with the devices of the others taken (the earlier ones as just
//! decided, the later ones as they stand) and their nodes known, so replicas
//! never share a device and `spread` can keep them apart. Pure, as the rest
//! of the stage: the reconcile runs it off the async workers.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::Toleration;

use super::{Current, PlanDecision, PlanInputs, broken_shards, decide};
use tessera_core::api::{ModelInstanceSpec, PlannedShard};
use tessera_core::placement::Unsatisfiable;

/// One instance's replicas as the reconcile found them.
#[derive(Clone, Copy)]
pub struct Replicas<'a> {
    pub(crate) spec: &'a ModelInstanceSpec,
    pub(crate) tolerations: &'a [Toleration],
    /// Each replica's current shards by its number, a slot for every
    /// replica the instance may have (`ModelInstanceSpec::most_replicas`) or
    /// still has, empty for one it has not.
    pub(crate) current: &'a [Vec<PlannedShard>],
    /// The placement hash the current plan was made for.
    pub(crate) placement_hash: Option<&'a str>,
    /// Whether a replica that cannot be planned keeps the shards it still
    /// has (its plan is of this spec, and only lost shards).
    pub(crate) keep_when_unsatisfiable: bool,
    /// `(replica, shard)` of the pods that failed admission on their planned
    /// devices.
    pub(crate) failed_admission: &'a [(u32, u32)],
    /// Each replica's last unsatisfiable attempt, by its number.
    pub(crate) known_unsatisfiable: &'a [Option<(u64, Unsatisfiable)>],
}

impl Replicas<'_> {
    /// Replica `replica`'s current shards (none past the slots).
    pub(crate) fn of(&self, replica: u32) -> &[PlannedShard] {
        self.current
            .get(replica as usize)
            .map_or(&[], Vec::as_slice)
    }
}

/// A replica's decision and, when it keeps a plan it cannot repair, the
/// shards that are broken and why.
pub type ReplicaDecision = (PlanDecision, BTreeMap<u32, String>);

/// Decides the `wanted` replicas (by number) in that order. `base` gives the
/// cluster (nodes, what others hold, the time and limits); its replica
/// fields are set here.
pub fn decide_replicas(
    replicas: &Replicas<'_>,
    wanted: &[u32],
    base: &PlanInputs<'_>,
) -> Vec<ReplicaDecision> {
    let mut plans: Vec<Vec<PlannedShard>> =
        wanted.iter().map(|&r| replicas.of(r).to_vec()).collect();
    let mut decisions = Vec::with_capacity(plans.len());
    for (index, &replica) in wanted.iter().enumerate() {
        let own = replicas.of(replica);
        let others: Vec<&PlannedShard> = plans
            .iter()
            .enumerate()
            .filter(|(other, _)| *other != index)
            .flat_map(|(_, plan)| plan)
            .collect();
        let mut held = base.held.clone();
        for shard in &others {
            held.shard(
                shard,
                &format!("replica {} of this instance", shard.replica),
            );
        }
        let replica_nodes: Vec<String> = others.iter().map(|s| s.node.clone()).collect();
        let failed_here: Vec<u32> = replicas
            .failed_admission
            .iter()
            .filter(|(r, _)| *r == replica)
            .map(|(_, shard)| *shard)
            .collect();
        let inputs = PlanInputs {
            nodes: base.nodes,
            held: &held,
            now: base.now,
            node_grace: base.node_grace,
            max_steps: base.max_steps,
            known_unsatisfiable: replicas
                .known_unsatisfiable
                .get(replica as usize)
                .and_then(Option::as_ref),
            replica,
            replica_nodes: &replica_nodes,
            corrections: base.corrections,
        };
        let current = Current {
            plan: own,
            placement_hash: replicas.placement_hash,
            failed_admission: &failed_here,
        };
        let decision = decide(replicas.spec, replicas.tolerations, &current, &inputs);
        let broken = match decision {
            PlanDecision::Unsatisfiable { .. } if replicas.keep_when_unsatisfiable => {
                broken_shards(own, &failed_here, &inputs)
            }
            _ => BTreeMap::new(),
        };
        plans[index] = decided_plan(&decision, own);
        decisions.push((decision, broken));
    }
    decisions
}

/// The plan a decision leaves a replica with (`current` when it keeps it).
fn decided_plan(decision: &PlanDecision, current: &[PlannedShard]) -> Vec<PlannedShard> {
    match decision {
        PlanDecision::Keep | PlanDecision::Unsatisfiable { .. } => current.to_vec(),
        PlanDecision::Planned(new) => new.plan.clone(),
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use super::*;
    use crate::controller::held::Held;
    use crate::controller::testkit::*;

    struct Case {
        spec: ModelInstanceSpec,
        current: Vec<Vec<PlannedShard>>,
        placement_hash: Option<String>,
        keep: bool,
    }

    impl Case {
        fn new(spec: &str, replicas: usize) -> Self {
            Self {
                spec: instance("m", spec).spec,
                current: vec![Vec::new(); replicas],
                placement_hash: None,
                keep: false,
            }
        }

        fn run(
            &self,
            nodes: &[std::sync::Arc<crate::controller::nodes::NodeInfo>],
        ) -> Vec<ReplicaDecision> {
            let held = Held::new();
            let replicas = Replicas {
                spec: &self.spec,
                tolerations: &[],
                current: &self.current,
                placement_hash: self.placement_hash.as_deref(),
                keep_when_unsatisfiable: self.keep,
                failed_admission: &[],
                known_unsatisfiable: &[],
            };
            let wanted: Vec<u32> = (0..self.current.len() as u32).collect();
            decide_replicas(&replicas, &wanted, &inputs(nodes, &held))
        }
    }

    fn devices(decision: &ReplicaDecision) -> BTreeSet<(String, String)> {
        match &decision.0 {
            PlanDecision::Planned(new) => new
                .plan
                .iter()
                .flat_map(|s| s.devices.iter().map(|d| (s.node.clone(), d.clone())))
                .collect(),
            other => panic!("expected a plan, got {other:?}"),
        }
    }

    #[test]
    fn replicas_never_share_a_device() {
        let nodes = infos(&[node("a", 3, H100)]);
        let decisions = Case::new(SMALL, 3).run(&nodes);
        assert_eq!(decisions.len(), 3);
        let all: Vec<_> = decisions.iter().map(devices).collect();
        let union: BTreeSet<_> = all.iter().flatten().cloned().collect();
        assert_eq!(
            union.len(),
            3,
            "three replicas on three distinct GPUs: {all:?}"
        );
    }

    #[test]
    fn a_new_replica_plans_around_the_plans_that_stay() {
        let nodes = infos(&[node("a", 2, H100)]);
        let first = Case::new(SMALL, 1).run(&nodes);
        let PlanDecision::Planned(kept) = &first[0].0 else {
            panic!("the first replica is planned")
        };
        let mut case = Case::new(SMALL, 2);
        case.current[0] = kept.plan.clone();
        case.placement_hash = Some(crate::controller::hashes::placement_hash(&case.spec));
        let decisions = case.run(&nodes);
        assert_eq!(decisions[0].0, PlanDecision::Keep);
        let taken: BTreeSet<_> = kept.plan[0].devices.iter().cloned().collect();
        let second = devices(&decisions[1]);
        assert!(
            second.iter().all(|(_, d)| !taken.contains(d)),
            "{second:?} overlaps {taken:?}"
        );
    }

    #[test]
    fn spread_keeps_replicas_on_different_nodes() {
        let nodes = infos(&[node("a", 2, H100), node("b", 2, H100)]);
        let decisions =
            Case::new(&format!("{SMALL}\nplacement: {{strategy: spread}}"), 2).run(&nodes);
        let on: Vec<BTreeSet<String>> = decisions
            .iter()
            .map(|d| devices(d).into_iter().map(|(node, _)| node).collect())
            .collect();
        assert!(on[0].is_disjoint(&on[1]), "{on:?}");
    }

    #[test]
    fn an_unsatisfiable_replica_names_its_broken_shards_only_when_it_keeps_them() {
        let nodes = infos(&[node("a", 1, RTX4090)]);
        let big = "model: {name: big, parametersBillions: 70, layers: 80}";
        let mut case = Case::new(big, 1);
        case.current[0] = vec![PlannedShard {
            copy: 0,
            replica: 0,
            shard: 0,
            node: "gone".into(),
            devices: vec!["g0".into()],
            layer_start: 0,
            layer_end: 80,
            predicted_memory_gib: 150.0,
            share: None,
        }];
        case.placement_hash = Some(crate::controller::hashes::placement_hash(&case.spec));
        let dropped = case.run(&nodes);
        assert!(matches!(dropped[0].0, PlanDecision::Unsatisfiable { .. }));
        assert!(dropped[0].1.is_empty());

        case.keep = true;
        let kept = case.run(&nodes);
        assert!(matches!(kept[0].0, PlanDecision::Unsatisfiable { .. }));
        let why = kept[0].1.get(&0).expect("shard 0 is broken");
        assert!(why.contains("node gone is gone"), "{why}");
    }
}
