//! The build stage: from what was decided, each replica's shard pods with
//! their nodes, and the claims of the shards on DRA nodes.

use k8s_openapi::api::core::v1::Pod;
use kube::ResourceExt;

use super::decide::stage::Decided;
use super::desired::{ShardGpus, shard_pod_name, shard_resource, some_shard_pods};
use super::dra::apply::{DraShard, claim_of};
use super::dra::claims::{claim_name, shard_claim};
use super::observe::Observed;
use super::settings::Settings;
use super::status::Outcome;
use tessera_core::api::{ModelInstance, PlannedShard};

/// The desired shard pods of each replica with their nodes, and the claims
/// of those on DRA nodes.
pub(crate) struct Desired {
    pub(crate) pods: Vec<Vec<(Pod, String)>>,
    pub(crate) dra: Vec<DraShard>,
}

pub(crate) fn build(
    mi: &ModelInstance,
    settings: &Settings,
    observed: &Observed,
    decided: &Decided,
) -> Desired {
    let name = mi.name_any();
    let mut dra = Vec::new();
    let pods = decided
        .replicas
        .iter()
        .map(|replica| {
            let plan = replica.outcome.plan();
            let runnable = |s: &PlannedShard| !replica.broken.contains_key(&s.shard);
            // A shard pod keeps the way it got its GPUs while it exists: a
            // node's slices vanish for a moment when its kubelet restarts
            // (kubelet deletes them until the driver writes them again),
            // and running shards must not be replaced for that. New pods
            // take their node's way.
            let on_dra = |shard: &PlannedShard| {
                let pod_name = shard_pod_name(&name, shard.replica, shard.shard);
                settings.dra_driver.is_some()
                    && match observed.mine.get(&pod_name) {
                        Some(pod) => claim_of(pod).is_some(),
                        None => observed.pools.node(&shard.node).is_some(),
                    }
            };
            let gpus = |shard: &PlannedShard| {
                let pod_name = shard_pod_name(&name, shard.replica, shard.shard);
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
                    let pod_name = shard_pod_name(&name, shard.replica, shard.shard);
                    dra.push(DraShard {
                        claim: shard_claim(mi, shard, &pod_name, driver),
                        shard: shard.clone(),
                        pod_name,
                    });
                }
            }
            let capacity = match &replica.outcome {
                Outcome::Placed { capacity, .. } => capacity.as_ref(),
                _ => None,
            };
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
        })
        .collect();
    Desired { pods, dra }
}
