//! The apply stage: the only part of the controller that writes. It brings
//! the shard pods and the Service to the desired state, binds pods to their
//! planned nodes (a replica's shards together), and writes the status.
//! Writes that hit a conflict, a throttle or a server error are retried a few
//! times; the rest of the error handling is the controller's backoff.

pub(crate) mod dead_node;
pub(crate) mod drain;
pub(crate) mod stage;

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use futures::future::join_all;

use k8s_openapi::api::core::v1::{Binding, ObjectReference, Pod, Service};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams, Preconditions};
use kube::{Resource, ResourceExt};
use serde_json::json;

use crate::controller::desired::INSTANCE_LABEL;
use crate::controller::events::EventNote;
use crate::controller::pod_repair::{lost_rank, replace_reason};
use crate::controller::restart_backoff::Backoff;
use tessera_core::api::{
    DEVICES_ANNOTATION, ModelInstance, ModelInstanceStatus, ReplicaRestarts, RestartPolicy,
    SHARD_ANNOTATION,
};

/// The name the controller writes under (field manager, event reporter).
pub(crate) const MANAGER: &str = "tessera-controller";

/// Where one shard is after the apply stage.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ShardState {
    /// No pod (not created yet, or the old one is going away).
    Missing,
    /// Created, not bound to its node yet.
    Created,
    /// Bound to its planned node; not ready.
    Bound,
    Ready,
}

#[derive(Debug, thiserror::Error)]
#[error("{action}: {source}")]
pub struct ApplyError {
    pub action: String,
    #[source]
    pub source: kube::Error,
}

/// Retries transient failures: HTTP 409 (except "already exists"), 429, 5xx
/// and transport errors, three attempts in all.
pub(crate) async fn retry<T, F, Fut>(action: &str, mut call: F) -> Result<T, ApplyError>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, kube::Error>>,
{
    let mut delay = Duration::from_millis(100);
    let mut attempt = 1;
    loop {
        match call().await {
            Ok(v) => return Ok(v),
            Err(e) if attempt < 3 && transient(&e) => {
                tracing::debug!(action, attempt, error = %e, "retrying");
                tokio::time::sleep(delay).await;
                delay *= 4;
                attempt += 1;
            }
            Err(source) => {
                return Err(ApplyError {
                    action: action.to_string(),
                    source,
                });
            }
        }
    }
}

fn transient(error: &kube::Error) -> bool {
    match error {
        kube::Error::Api(status) => {
            (status.code == 409 && !status.is_already_exists())
                || status.code == 429
                || status.code >= 500
        }
        kube::Error::HyperError(_) | kube::Error::Service(_) => true,
        _ => false,
    }
}

fn already_exists(error: &ApplyError) -> bool {
    matches!(&error.source, kube::Error::Api(status) if status.is_already_exists())
}

/// Creates `objects` (of `kind`, for errors) together: they do not depend
/// on each other, and each is retried as `retry` does. Gives what each create
/// made, in order: `None` for one an earlier reconcile made that the cache
/// has not shown yet. Any other failure (the first, in order) is the answer.
pub(crate) async fn create_together<'a, K>(
    api: &Api<K>,
    kind: &str,
    objects: impl IntoIterator<Item = &'a K>,
) -> Result<Vec<Option<K>>, ApplyError>
where
    K: Resource + Clone + serde::Serialize + serde::de::DeserializeOwned + std::fmt::Debug + 'a,
{
    let params = &PostParams::default();
    let created = join_all(objects.into_iter().map(|object| async move {
        let action = format!("create {kind} {}", object.name_any());
        retry(&action, || api.create(params, object)).await
    }))
    .await;
    created
        .into_iter()
        .map(|result| match result {
            Ok(object) => Ok(Some(object)),
            Err(e) if already_exists(&e) => Ok(None),
            Err(e) => Err(e),
        })
        .collect()
}

fn not_found(error: &ApplyError) -> bool {
    matches!(&error.source, kube::Error::Api(status) if status.is_not_found())
}

/// Makes the Service match `desired`. A Service of that name that is not
/// ours is left alone (with a warning note).
pub(crate) async fn service(
    api: &Api<Service>,
    desired: &Service,
    existing: Option<&Service>,
    owner_uid: &str,
    notes: &mut Vec<EventNote>,
) -> Result<(), ApplyError> {
    let name = desired.name_any();
    match existing {
        None => {
            let params = PostParams::default();
            match retry(&format!("create Service {name}"), || {
                api.create(&params, desired)
            })
            .await
            {
                Ok(_) => Ok(()),
                Err(e) if already_exists(&e) => Ok(()),
                Err(e) => Err(e),
            }
        }
        Some(s) if !s.owner_references().iter().any(|o| o.uid == owner_uid) => {
            notes.push(EventNote {
                warning: true,
                reason: "ServiceConflict",
                message: format!(
                    "Service {name} exists and is not owned by this instance; shards get no stable DNS names until it is removed"
                ),
            });
            Ok(())
        }
        Some(s) => {
            let want = desired.spec.as_ref();
            let have = s.spec.as_ref();
            let same = want.map(|w| (&w.selector, &w.ports, w.publish_not_ready_addresses))
                == have.map(|h| (&h.selector, &h.ports, h.publish_not_ready_addresses));
            if same {
                return Ok(());
            }
            let patch = json!({"spec": {
                "selector": want.and_then(|w| w.selector.clone()),
                "ports": want.and_then(|w| w.ports.clone()),
                "publishNotReadyAddresses": want.and_then(|w| w.publish_not_ready_addresses),
            }});
            let (params, patch) = (PatchParams::default(), Patch::Merge(&patch));
            retry(&format!("patch Service {name}"), || {
                api.patch(&name, &params, &patch)
            })
            .await
            .map(|_| ())
        }
    }
}

/// What must be true of a pod before it is bound, and may take writes to
/// make true (a DRA shard's claim allocated for it).
pub(crate) trait BeforeBind {
    /// `Ok(false)`: not now; the pod stays unbound for a later reconcile.
    fn ready(&self, pod: &Pod, node: &str)
    -> impl Future<Output = Result<bool, ApplyError>> + Send;
}

/// Nothing to do before binding (no DRA shards).
pub(crate) struct BindAtOnce;

impl BeforeBind for BindAtOnce {
    async fn ready(&self, _pod: &Pod, _node: &str) -> Result<bool, ApplyError> {
        Ok(true)
    }
}

/// How a replica that lost a rank is repaired: its restart policy, and how
/// soon after the last repair.
pub(crate) struct Repair<'a> {
    pub(crate) policy: RestartPolicy,
    pub(crate) backoff: Backoff<'a>,
}

/// What bringing one replica to its desired pods did.
#[derive(Debug)]
pub(crate) struct ReplicaApplied {
    /// Each desired shard's state afterwards, in shard order.
    pub(crate) states: Vec<ShardState>,
    /// The replica's restart record for the status (None: nothing to count).
    pub(crate) restarts: Option<ReplicaRestarts>,
    /// While a repair waits out its backoff: the status line, and when the
    /// wait ends.
    pub(crate) waiting: Option<(String, k8s_openapi::jiff::Timestamp)>,
}

/// Brings one replica's shard pods to `desired` (shard order) and binds
/// them. `may_bind(node, pod)` says whether a pod may be bound now, and
/// `before_bind` gets it ready; one that may not or is not stays unbound
/// (`Created`) for a later reconcile. Under `RecreateReplica` a replica that
/// lost a started rank has all of its pods deleted first. A repair after a
/// loss (not a planned change) waits while the replica backs off: the failed
/// pods stay for `kubectl logs` until then.
pub(crate) async fn pods(
    api: &Api<Pod>,
    (desired, repair): (&[(Pod, String)], &Repair<'_>),
    existing: &BTreeMap<String, Arc<Pod>>,
    may_bind: impl Fn(&str, &Pod) -> bool,
    before_bind: &impl BeforeBind,
    notes: &mut Vec<EventNote>,
) -> Result<ReplicaApplied, ApplyError> {
    let backoff = &repair.backoff;
    let due = backoff.due();
    if repair.policy == RestartPolicy::RecreateReplica
        && let Some(why) = lost_rank(desired, existing)
    {
        if let Some(due) = due {
            return Ok(ReplicaApplied {
                states: hold_states(desired, existing),
                restarts: backoff.kept(false),
                waiting: Some((backoff.waiting_message(&why, due), due)),
            });
        }
        let states = recreate_replica(api, desired, existing, why, notes).await?;
        return Ok(ReplicaApplied {
            states,
            restarts: Some(backoff.repaired()),
            waiting: None,
        });
    }
    let mut states = Vec::with_capacity(desired.len());
    let mut unbound = Vec::new();
    let mut missing = Vec::new();
    let mut repaired = false;
    let mut waiting = None;
    for (want, node) in desired {
        let name = want.name_any();
        let Some(have) = existing.get(&name) else {
            missing.push((states.len(), want, node));
            states.push(ShardState::Created);
            continue;
        };
        if have.metadata.deletion_timestamp.is_some() {
            states.push(ShardState::Missing);
            continue;
        }
        if let Some((why, lost)) = replace_reason(have, want, node) {
            let why = format!("{name}: {why}");
            if lost && let Some(due) = due {
                waiting.get_or_insert_with(|| (backoff.waiting_message(&why, due), due));
                states.push(ShardState::Missing);
                continue;
            }
            delete(api, have).await?;
            repaired |= lost;
            notes.push(EventNote {
                warning: lost,
                reason: if lost { "ShardLost" } else { "ShardReplaced" },
                message: format!("{why}; recreating it"),
            });
            states.push(ShardState::Missing);
            continue;
        }
        restore_annotations(api, have, want).await?;
        drain::open_gate(api, have).await?;
        let state = state_of(have);
        if state == ShardState::Created {
            unbound.push((states.len(), Pod::clone(have), node));
        }
        states.push(state);
    }
    let restarts = if repaired {
        Some(backoff.repaired())
    } else {
        backoff.kept(!states.is_empty() && states.iter().all(|s| *s == ShardState::Ready))
    };
    let applied = |states| ReplicaApplied {
        states,
        restarts,
        waiting,
    };
    // A replica's pods are created together, so they start together; one an
    // earlier reconcile created is bound once the cache shows it.
    let created = create_together(api, "pod", missing.iter().map(|(_, want, _)| *want)).await?;
    for ((index, _, node), created) in missing.into_iter().zip(created) {
        if let Some(created) = created {
            unbound.push((index, created, node));
        }
    }
    unbound.sort_by_key(|(index, _, _)| *index);
    // All or nothing: no shard is bound (and holds devices) until every shard
    // has its pod.
    if states.contains(&ShardState::Missing) {
        return Ok(applied(states));
    }
    let candidates: Vec<_> = unbound
        .into_iter()
        .filter(|(_, pod, node)| may_bind(node, pod))
        .collect();
    let readiness = join_all(
        candidates
            .iter()
            .map(|(_, pod, node)| before_bind.ready(pod, node)),
    )
    .await;
    let mut to_bind = Vec::with_capacity(candidates.len());
    for (candidate, ready) in candidates.into_iter().zip(readiness) {
        if ready? {
            to_bind.push(candidate);
        }
    }
    let bound = join_all(to_bind.iter().map(|(_, pod, node)| bind(api, pod, node))).await;
    let mut first_error = None;
    for ((index, pod, node), result) in to_bind.into_iter().zip(bound) {
        if let Err(e) = result {
            first_error.get_or_insert(e);
            continue;
        }
        notes.push(EventNote {
            warning: false,
            reason: "Bound",
            message: format!(
                "bound {} to node {node} (devices {})",
                pod.name_any(),
                annotation(&pod, DEVICES_ANNOTATION).unwrap_or_default()
            ),
        });
        states[index] = ShardState::Bound;
    }
    match first_error {
        Some(e) => Err(e),
        None => Ok(applied(states)),
    }
}

/// The states of a replica whose repair waits: its pods as they are, the
/// lost ones missing.
fn hold_states(
    desired: &[(Pod, String)],
    existing: &BTreeMap<String, Arc<Pod>>,
) -> Vec<ShardState> {
    desired
        .iter()
        .map(|(want, node)| match existing.get(&want.name_any()) {
            Some(have)
                if have.metadata.deletion_timestamp.is_none()
                    && replace_reason(have, want, node).is_none() =>
            {
                state_of(have)
            }
            _ => ShardState::Missing,
        })
        .collect()
}

/// The state of an existing pod that stays.
fn state_of(have: &Pod) -> ShardState {
    match have.spec.as_ref().and_then(|s| s.node_name.as_ref()) {
        None => ShardState::Created,
        Some(_) if ready(have) => ShardState::Ready,
        Some(_) => ShardState::Bound,
    }
}

/// Deletes every pod of the replica still there; the next reconciles create
/// them again once the old ones are gone, and bind them all together.
async fn recreate_replica(
    api: &Api<Pod>,
    desired: &[(Pod, String)],
    existing: &BTreeMap<String, Arc<Pod>>,
    why: String,
    notes: &mut Vec<EventNote>,
) -> Result<Vec<ShardState>, ApplyError> {
    for (want, _) in desired {
        if let Some(have) = existing.get(&want.name_any())
            && have.metadata.deletion_timestamp.is_none()
        {
            delete(api, have).await?;
        }
    }
    notes.push(EventNote {
        warning: true,
        reason: "ReplicaRecreated",
        message: format!(
            "{why}; recreating all {} shard pods of the replica (restartPolicy RecreateReplica)",
            desired.len()
        ),
    });
    Ok(vec![ShardState::Missing; desired.len()])
}

/// A shard pod whose containers never started because kubelet refused it
/// (device allocation failed, resources short).
pub(crate) fn failed_admission(pod: &Pod) -> bool {
    let status = pod.status.as_ref();
    status.and_then(|s| s.phase.as_deref()) == Some("Failed")
        && status
            .and_then(|s| s.reason.as_deref())
            .is_some_and(|r| r == "UnexpectedAdmissionError" || r.starts_with("OutOf"))
}

/// Whether `pod`'s Ready condition is True.
pub(crate) fn ready(pod: &Pod) -> bool {
    pod.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|c| c.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

fn annotation<'a>(pod: &'a Pod, key: &str) -> Option<&'a str> {
    pod.metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(key))
        .map(String::as_str)
}

/// Hand edits of the device or shard annotation are put back.
async fn restore_annotations(api: &Api<Pod>, have: &Pod, want: &Pod) -> Result<(), ApplyError> {
    let mut fix = serde_json::Map::new();
    for key in [DEVICES_ANNOTATION, SHARD_ANNOTATION] {
        let wanted = annotation(want, key);
        if annotation(have, key) != wanted {
            fix.insert(key.to_string(), json!(wanted));
        }
    }
    if fix.is_empty() {
        return Ok(());
    }
    let name = have.name_any();
    let patch = json!({"metadata": {"annotations": fix}});
    let (params, patch) = (PatchParams::default(), Patch::Merge(&patch));
    retry(&format!("restore annotations of pod {name}"), || {
        api.patch(&name, &params, &patch)
    })
    .await
    .map(|_| ())
}

/// Deletes a pod, but only the very object seen (UID precondition).
pub(crate) async fn delete(api: &Api<Pod>, pod: &Pod) -> Result<(), ApplyError> {
    delete_within(api, pod, None).await.map(|_| ())
}

/// [`delete`] with a grace period of its own (0: at once); whether the pod
/// was still there to delete.
pub(crate) async fn delete_within(
    api: &Api<Pod>,
    pod: &Pod,
    grace_seconds: Option<u32>,
) -> Result<bool, ApplyError> {
    let name = pod.name_any();
    let params = DeleteParams {
        grace_period_seconds: grace_seconds,
        preconditions: Some(Preconditions {
            uid: pod.metadata.uid.clone(),
            resource_version: None,
        }),
        ..DeleteParams::default()
    };
    match retry(&format!("delete pod {name}"), || api.delete(&name, &params)).await {
        Ok(_) => Ok(true),
        Err(e) if not_found(&e) => Ok(false),
        Err(e) => Err(e),
    }
}

async fn bind(api: &Api<Pod>, pod: &Pod, node: &str) -> Result<(), ApplyError> {
    let name = pod.name_any();
    let binding = Binding {
        metadata: ObjectMeta {
            name: Some(name.clone()),
            namespace: pod.namespace(),
            uid: None,
            ..ObjectMeta::default()
        },
        target: ObjectReference {
            api_version: Some("v1".to_string()),
            kind: Some("Node".to_string()),
            name: Some(node.to_string()),
            ..ObjectReference::default()
        },
    };
    let params = PostParams::default();
    let result: Result<serde_json::Value, _> = retry(&format!("bind pod {name} to {node}"), || {
        api.create_subresource("binding", &name, &params, &binding)
    })
    .await;
    match result {
        Ok(_) => Ok(()),
        // Already bound by an earlier attempt whose answer was lost: the cache
        // shows where, and a pod bound elsewhere is replaced next time.
        Err(e) if matches!(&e.source, kube::Error::Api(s) if s.code == 409) => Ok(()),
        Err(e) => Err(e),
    }
}

/// Writes the status with server-side apply if it differs from the current one.
pub(crate) async fn status(
    api: &Api<ModelInstance>,
    mi: &ModelInstance,
    status: &ModelInstanceStatus,
) -> Result<bool, ApplyError> {
    if mi.status.as_ref() == Some(status) {
        return Ok(false);
    }
    let name = mi.name_any();
    let patch = json!({
        "apiVersion": ModelInstance::api_version(&()),
        "kind": ModelInstance::kind(&()),
        "status": status,
    });
    let (params, patch) = (PatchParams::apply(MANAGER).force(), Patch::Apply(&patch));
    retry(&format!("update status of {name}"), || {
        api.patch_status(&name, &params, &patch)
    })
    .await?;
    Ok(true)
}

/// Pods labelled as shards of this instance that its plan no longer has,
/// but for those to be evicted instead (`evicted`).
pub(crate) async fn remove_extra(
    api: &Api<Pod>,
    existing: &BTreeMap<String, Arc<Pod>>,
    desired: &[(Pod, String)],
    evicted: &[String],
) -> Result<(), ApplyError> {
    for (name, pod) in existing {
        let wanted = desired
            .iter()
            .any(|(p, _)| p.metadata.name.as_deref() == Some(name))
            || evicted.contains(name);
        if !wanted && pod.metadata.deletion_timestamp.is_none() {
            delete(api, pod).await?;
        }
    }
    Ok(())
}

/// Label selector for every shard pod and Service the controller manages.
pub(crate) fn managed_selector() -> String {
    INSTANCE_LABEL.to_string()
}
