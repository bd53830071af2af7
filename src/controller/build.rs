//! The build stage: from what was decided, each replica's shard pods with
//! their nodes, a move's new copy, and the claims of the shards on DRA nodes.

use k8s_openapi::api::core::v1::Pod;
use kube::ResourceExt;

use super::decide::stage::Decided;
use super::desired::{ShardGpus, pod_name_of, shard_resource, some_shard_pods};
use super::dra::apply::{DraShard, claim_of};
use super::dra::claims::{claim_name, shard_claim};
use super::observe::Observed;
use super::settings::Settings;
use super::status::Outcome;
use tessera_core::api::{ModelInstance, PlannedShard, ReplicaCapacity};

/// The desired shard pods of each replica with their nodes, those of a
/// move's new copy, and the claims of those on DRA nodes.
pub(crate) struct Desired {
    pub(crate) pods: Vec<Vec<(Pod, String)>>,
    /// The new copy of the replica being moved (empty when none is wanted).
    pub(crate) surge: Vec<(Pod, String)>,
    pub(crate) dra: Vec<DraShard>,
}

pub(crate) fn build(
    mi: &ModelInstance,
    settings: &Settings,
    observed: &Observed,
    decided: &Decided,
) -> Desired {
    let mut dra = Vec::new();
    let pods = decided
        .replicas
        .iter()
        .map(|replica| {
            let capacity = match &replica.outcome {
                Outcome::Placed { started_with, .. } => started_with.as_ref(),
                _ => None,
            };
            let runnable = |s: &PlannedShard| !replica.broken.contains_key(&s.shard);
            let plan = replica.outcome.plan();
            copy_pods(
                mi,
                settings,
                observed,
                (plan, &runnable, capacity),
                &mut dra,
            )
        })
        .collect();
    let surge = match &decided.moving {
        Some(moving) if moving.surge => {
            let capacity = decided
                .replicas
                .iter()
                .find(|replica| replica.replica == moving.record.replica)
                .and_then(|replica| match &replica.outcome {
                    Outcome::Placed { started_with, .. } => started_with.as_ref(),
                    _ => None,
                });
            let plan = moving.record.to.as_slice();
            copy_pods(
                mi,
                settings,
                observed,
                (plan, &|_| true, capacity),
                &mut dra,
            )
        }
        _ => Vec::new(),
    };
    Desired { pods, surge, dra }
}

/// One copy of a replica: its plan, which of its shards get a pod, and what
/// the replica is planned to serve.
type Copy<'a> = (
    &'a [PlannedShard],
    &'a dyn Fn(&PlannedShard) -> bool,
    Option<&'a ReplicaCapacity>,
);

/// The pods of one copy of a replica (the shards of its plan that are
/// runnable), each with its node; the claims of those on DRA nodes go to
/// `dra`.
fn copy_pods(
    mi: &ModelInstance,
    settings: &Settings,
    observed: &Observed,
    (plan, runnable, capacity): Copy,
    dra: &mut Vec<DraShard>,
) -> Vec<(Pod, String)> {
    let name = mi.name_any();
    // A shard pod keeps the way it got its GPUs while it exists: a node's
    // slices vanish for a moment when its kubelet restarts (kubelet deletes
    // them until the driver writes them again), and running shards must not
    // be replaced for that. New pods take their node's way.
    let on_dra = |shard: &PlannedShard| {
        settings.dra_driver.is_some()
            && match observed.mine.get(&pod_name_of(&name, shard)) {
                Some(pod) => claim_of(pod).is_some(),
                None => observed.pools.node(&shard.node).is_some(),
            }
    };
    let gpus = |shard: &PlannedShard| {
        let pod_name = pod_name_of(&name, shard);
        if on_dra(shard) {
            return ShardGpus::Claim(claim_name(&pod_name));
        }
        let existing = observed.mine.get(&pod_name);
        ShardGpus::Resource(shard_resource(
            &settings.resource_name,
            shard,
            &observed.nodes,
            existing.map(AsRef::as_ref),
        ))
    };
    if let Some(driver) = &settings.dra_driver {
        for shard in plan.iter().filter(|s| runnable(s) && on_dra(s)) {
            let pod_name = pod_name_of(&name, shard);
            dra.push(DraShard {
                claim: shard_claim(mi, shard, &pod_name, driver),
                shard: shard.clone(),
                pod_name,
            });
        }
    }
    some_shard_pods(
        mi,
        plan,
        runnable,
        gpus,
        settings.model_cache.as_ref(),
        capacity,
    )
    .into_iter()
    .zip(plan.iter().filter(|s| runnable(s)).map(|s| s.node.clone()))
    .collect()
}
