//! The apply stage as a reconcile runs it: the Service, then each replica's
//! pods and bindings (and their claims on DRA nodes), through the writes in
//! this module's parent.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

use k8s_openapi::api::core::v1::{Pod, Service};
use k8s_openapi::jiff::Timestamp;
use kube::ResourceExt;
use kube::api::Api;
use kube::runtime::reflector::ObjectRef;

use super::{BindAtOnce, Repair, ReplicaApplied, ShardState};
use crate::controller::build::Desired;
use crate::controller::context::{Context, Error, Instance};
use crate::controller::decide::stage::Decided;
use crate::controller::desired::{headless_service, replica_of};
use crate::controller::dra::apply::{ShardClaims, claim_of};
use crate::controller::events::EventNote;
use crate::controller::hashes::{recorded_pod_hash, replica_pod_hash};
use crate::controller::moves::evict;
use crate::controller::node_gate::may_bind;
use crate::controller::observe::Observed;
use crate::controller::restart_backoff::Backoff;
use crate::controller::status::{Outcome, REPLICA_FAILURE};
use tessera_core::api::ModelInstance;

/// The apply stage: the Service, the pods, their bindings; pods of replicas
/// no longer wanted go. Returns each replica's shard states; broken shards of
/// a degraded plan count as missing. Each replica is bound all or nothing on
/// its own, so one replica short of a pod holds no other back.
pub(crate) async fn apply(
    mi: &ModelInstance,
    ctx: &Context,
    instance: &Instance,
    observed: &Observed,
    desired: &Desired,
    decided: &Decided,
    notes: &mut Vec<EventNote>,
) -> Result<Applied, Error> {
    let namespace = instance.namespace.as_str();
    if decided
        .replicas
        .iter()
        .any(|replica| !replica.outcome.plan().is_empty())
    {
        let services: Api<Service> = Api::namespaced(ctx.client.clone(), namespace);
        let existing =
            ctx.caches.services.state().into_iter().find(|s| {
                s.namespace().as_deref() == Some(namespace) && s.name_any() == instance.name
            });
        super::service(
            &services,
            &headless_service(mi),
            existing.as_deref(),
            &instance.uid,
            notes,
        )
        .await?;
    }
    let pods_api: Api<Pod> = Api::namespaced(ctx.client.clone(), namespace);
    let every_desired: Vec<(Pod, String)> = desired
        .pods
        .iter()
        .flatten()
        .chain(&desired.surge)
        .cloned()
        .collect();
    // A moved replica's old copy goes through the Eviction API, the rest
    // of what is no longer wanted is deleted.
    let evict = decided
        .moving
        .as_ref()
        .map(|m| m.evict.as_slice())
        .unwrap_or_default();
    super::dead_node::release(
        &pods_api,
        &observed.mine,
        &observed.nodes,
        ctx.settings.node_grace,
        notes,
    )
    .await?;
    // Replicas a smaller count removed drain first.
    let leaving = leaving_replicas(decided, &observed.mine, &every_desired, evict);
    let draining = super::drain::drain(
        &pods_api,
        &leaving,
        ctx.measures.of(&ObjectRef::from_obj(mi)).as_ref(),
        ctx.settings.scaling.drain_timeout,
        notes,
    )
    .await?;
    let kept: Vec<String> = evict.iter().chain(&draining).cloned().collect();
    super::remove_extra(&pods_api, &observed.mine, &every_desired, &kept).await?;
    let (eviction_refused, settling) = evict::leave_then_evict(
        &pods_api,
        &observed.mine,
        evict,
        ctx.settings.scaling.drain_timeout,
    )
    .await?;
    let gate = may_bind(
        &ctx.node_gate,
        &observed.nodes,
        &observed.pods,
        Instant::now(),
    );
    // The bind gate guards the device plugin's guess; a claim names its pod.
    let gate = |node: &str, pod: &Pod| claim_of(pod).is_some() || gate(node, pod);
    let shard_claims = match &ctx.settings.dra_driver {
        Some(driver) if ctx.caches.dra.is_some() => {
            let mine = observed.claims.iter().filter(|c| {
                c.namespace().as_deref() == Some(namespace)
                    && c.owner_references().iter().any(|o| o.uid == instance.uid)
            });
            let mut claims = ShardClaims::new(
                Api::namespaced(ctx.client.clone(), namespace),
                driver,
                &observed.pools,
                &observed.claims,
                mine.cloned(),
                desired.dra.clone(),
            );
            claims.sync(&observed.mine).await?;
            Some(claims)
        }
        _ => None,
    };
    let mut states = Vec::with_capacity(desired.pods.len());
    let now = Timestamp::now();
    if let Some(moving) = decided
        .moving
        .as_ref()
        .filter(|_| !desired.surge.is_empty())
    {
        let repair = Repair {
            policy: mi.spec.restart_policy,
            backoff: Backoff {
                replica: moving.record.replica,
                previous: None,
                pod_hash: String::new(),
                now,
            },
        };
        let surge = (desired.surge.as_slice(), &repair);
        match &shard_claims {
            Some(claims) => {
                super::pods(&pods_api, surge, &observed.mine, &gate, claims, notes).await?
            }
            None => {
                super::pods(&pods_api, surge, &observed.mine, &gate, &BindAtOnce, notes).await?
            }
        };
    }
    for (replica_desired, replica) in desired.pods.iter().zip(&decided.replicas) {
        let repair = Repair {
            policy: mi.spec.restart_policy,
            backoff: backoff(mi, replica.replica, replica_desired, now),
        };
        let replica_desired = (replica_desired.as_slice(), &repair);
        let mut applied = match &shard_claims {
            Some(claims) => {
                super::pods(
                    &pods_api,
                    replica_desired,
                    &observed.mine,
                    &gate,
                    claims,
                    notes,
                )
                .await?
            }
            None => {
                super::pods(
                    &pods_api,
                    replica_desired,
                    &observed.mine,
                    &gate,
                    &BindAtOnce,
                    notes,
                )
                .await?
            }
        };
        applied
            .states
            .extend(replica.broken.keys().map(|_| ShardState::Missing));
        states.push(applied);
    }
    if let Some(claims) = &shard_claims {
        notes.extend(claims.take_notes());
    }
    notes.extend(backoff_notes(mi, &states));
    Ok(Applied {
        replicas: states,
        eviction_refused,
        draining: !draining.is_empty() || settling,
    })
}

/// The pods of replicas no longer wanted, by replica: those a smaller count
/// removed, to drain. None for an invalid spec (its pods go at once),
/// nor pods wanted, evicted or already going.
fn leaving_replicas(
    decided: &Decided,
    mine: &BTreeMap<String, Arc<Pod>>,
    desired: &[(Pod, String)],
    evicted: &[String],
) -> BTreeMap<u32, Vec<Arc<Pod>>> {
    let mut leaving: BTreeMap<u32, Vec<Arc<Pod>>> = BTreeMap::new();
    if decided
        .replicas
        .iter()
        .any(|r| matches!(r.outcome, Outcome::Invalid { .. }))
    {
        return leaving;
    }
    let wanted: Vec<u32> = decided.replicas.iter().map(|r| r.replica).collect();
    for (name, pod) in mine {
        let Some(replica) = replica_of(pod).filter(|r| !wanted.contains(r)) else {
            continue;
        };
        if pod.metadata.deletion_timestamp.is_some()
            || evicted.contains(name)
            || desired
                .iter()
                .any(|(p, _)| p.metadata.name.as_deref() == Some(name))
        {
            continue;
        }
        leaving.entry(replica).or_default().push(pod.clone());
    }
    leaving
}

/// What the apply stage did: each replica's shard states, why an eviction
/// of a moved replica's old pods was refused, if one was, and whether a
/// removed replica (or a moved one's old copy) is still draining.
pub(crate) struct Applied {
    pub(crate) replicas: Vec<ReplicaApplied>,
    pub(crate) eviction_refused: Option<String>,
    pub(crate) draining: bool,
}

/// A replica's restart backoff, from its record in the status and the
/// hashes of its desired pods.
fn backoff<'a>(
    mi: &'a ModelInstance,
    replica: u32,
    desired: &[(Pod, String)],
    now: Timestamp,
) -> Backoff<'a> {
    Backoff {
        replica,
        previous: mi
            .status
            .as_ref()
            .and_then(|s| s.restarts.iter().find(|r| r.replica == replica)),
        pod_hash: replica_pod_hash(
            desired
                .iter()
                .map(|(pod, _)| recorded_pod_hash(pod).unwrap_or_default()),
        ),
        now,
    }
}

/// One event as a replica starts waiting out its backoff: one whose line is
/// already in the status was told before.
fn backoff_notes(mi: &ModelInstance, applied: &[ReplicaApplied]) -> Vec<EventNote> {
    let told = mi
        .status
        .as_ref()
        .and_then(|s| s.conditions.iter().find(|c| c.type_ == REPLICA_FAILURE))
        .map(|c| c.message.as_str())
        .unwrap_or_default();
    applied
        .iter()
        .filter_map(|a| a.waiting.as_ref())
        .filter(|(message, _)| !told.contains(message.as_str()))
        .map(|(message, _)| EventNote {
            warning: true,
            reason: "BackOff",
            message: message.clone(),
        })
        .collect()
}
