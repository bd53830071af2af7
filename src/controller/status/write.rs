//! The status stage as a reconcile runs it: the status computed from the
//! replicas' outcomes and shard states, and written.

use kube::api::Api;
use kube::runtime::reflector::ObjectRef;

use super::{ReplicaStatus, StatusInputs};
use crate::controller::apply::stage::Applied;
use crate::controller::context::{Context, Error, Instance};
use crate::controller::decide::stage::Decided;
use crate::controller::desired::INSTANCE_LABEL;
use k8s_openapi::jiff::Timestamp;
use tessera_core::api::{ModelInstance, ModelInstanceStatus};
use tessera_core::measure::correction::learn;

/// The status stage: computed from the replicas' outcomes and shard states,
/// and written where it changed. The status written, if it was.
pub(crate) async fn write_status(
    mi: &ModelInstance,
    ctx: &Context,
    instance: &Instance,
    decided: &Decided,
    applied: &Applied,
    now: Timestamp,
) -> Result<Option<ModelInstanceStatus>, Error> {
    let replicas: Vec<ReplicaStatus> = decided
        .replicas
        .iter()
        .zip(&applied.replicas)
        .map(|(replica, applied)| ReplicaStatus {
            replica: replica.replica,
            outcome: &replica.outcome,
            shards: &applied.states,
        })
        .collect();
    let measured = ctx.measures.of(&ObjectRef::from_obj(mi));
    let new_status = super::compute(&StatusInputs {
        previous: mi.status.as_ref(),
        generation: mi.metadata.generation,
        placement_hash: Some(instance.placement_hash.clone()),
        replicas: &replicas,
        selector: Some(format!("{INSTANCE_LABEL}={}", instance.name)),
        restarts: applied
            .replicas
            .iter()
            .filter_map(|a| a.restarts.clone())
            .collect(),
        waiting: applied
            .replicas
            .iter()
            .filter_map(|a| a.waiting.as_ref().map(|(message, _)| message.clone()))
            .collect(),
        // A measured demand is judged as measured: the headroom is the
        // plan's margin, not demand.
        demand: match &decided.demand {
            Some(followed) if followed.planned.is_some() => followed
                .state
                .as_ref()
                .and_then(|s| s.measured_requests_per_second)
                .or(followed.planned),
            _ => mi.spec.demand(),
        },
        measured_demand: decided.demand.as_ref().and_then(|d| d.state.clone()),
        demand_followed: decided.demand.as_ref().map(|d| d.condition.clone()),
        moves: decided
            .moving
            .iter()
            .map(|moving| {
                let mut record = moving.record.clone();
                if let Some(refused) = &applied.eviction_refused {
                    record.waiting = Some(refused.clone());
                }
                record
            })
            .collect(),
        cordoned: decided.cordoned.clone(),
        measured: measured.as_ref(),
        corrections: learn(
            &mi.spec.model.name,
            mi.spec
                .serving
                .as_ref()
                .map(|s| s.runtime)
                .unwrap_or_default(),
            mi.status.as_ref().map_or(&[][..], |s| &s.corrections),
            &decided.observations,
        ),
        now,
    });
    let api: Api<ModelInstance> = Api::namespaced(ctx.client.clone(), &instance.namespace);
    let written = crate::controller::apply::status(&api, mi, &new_status).await?;
    Ok(written.then_some(new_status))
}
