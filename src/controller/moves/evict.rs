//! The old copy's pods removed through the Eviction API, so that an
//! instance's PodDisruptionBudget counts: one the eviction would break
//! refuses it (HTTP 429), and the move waits with the old pods serving.
//! Before they go, they leave their Services.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::policy::v1::Eviction as PolicyEviction;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{DeleteOptions, ObjectMeta, Preconditions};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, PostParams};

use crate::controller::apply::ApplyError;
use crate::controller::apply::drain::{self, Leave};

/// The old copy of a moved replica, one step: it leaves its Services once
/// a dry run says its eviction would be allowed (one its disruption budget
/// keeps serves on), and is evicted once the endpoints have followed
/// ([`drain::before_eviction`]). Gives why an eviction was refused, when one
/// was, and whether the old copy is still leaving.
pub(crate) async fn leave_then_evict(
    api: &Api<Pod>,
    existing: &BTreeMap<String, Arc<Pod>>,
    names: &[String],
    timeout: Duration,
) -> Result<(Option<String>, bool), ApplyError> {
    match drain::before_eviction(existing, names, Timestamp::now(), timeout) {
        Leave::Wait => Ok((None, true)),
        Leave::Evict => Ok((evict(api, existing, names, Eviction::Real).await?, false)),
        Leave::Start => match evict(api, existing, names, Eviction::DryRun).await? {
            Some(refused) => Ok((Some(refused), false)),
            None => {
                let pods: Vec<&Pod> = names
                    .iter()
                    .filter_map(|name| existing.get(name))
                    .map(AsRef::as_ref)
                    .collect();
                drain::close_gates(api, &pods).await?;
                Ok((None, true))
            }
        },
    }
}

/// Whether an eviction is made or only asked whether it would be allowed.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Eviction {
    Real,
    DryRun,
}

/// Evicts the pods of `names` that still run (each the very object seen).
/// Gives why an eviction was refused, when one was.
async fn evict(
    api: &Api<Pod>,
    existing: &BTreeMap<String, Arc<Pod>>,
    names: &[String],
    eviction: Eviction,
) -> Result<Option<String>, ApplyError> {
    let mut refused = None;
    for name in names {
        let Some(pod) = existing.get(name) else {
            continue;
        };
        if pod.metadata.deletion_timestamp.is_some() {
            continue;
        }
        // kube's own `evict` sends its options as `delete_options`, a field
        // the API server does not know, so the UID precondition would be
        // dropped: the policy/v1 object goes as the API defines it.
        let body = PolicyEviction {
            metadata: ObjectMeta {
                name: Some(name.clone()),
                namespace: pod.metadata.namespace.clone(),
                ..ObjectMeta::default()
            },
            delete_options: Some(DeleteOptions {
                preconditions: Some(Preconditions {
                    uid: pod.metadata.uid.clone(),
                    resource_version: None,
                }),
                ..DeleteOptions::default()
            }),
        };
        let params = PostParams {
            dry_run: eviction == Eviction::DryRun,
            ..PostParams::default()
        };
        let answer: Result<serde_json::Value, kube::Error> = api
            .create_subresource("eviction", name, &params, &body)
            .await;
        match answer {
            Ok(_) if eviction == Eviction::DryRun => {}
            Ok(_) => tracing::info!(pod = %name, "evicted the old copy's pod"),
            Err(kube::Error::Api(status)) if status.code == 429 => {
                refused.get_or_insert(format!(
                    "the eviction of pod {name} was refused ({}); the old copy serves on",
                    status.message
                ));
            }
            Err(kube::Error::Api(status)) if status.code == 404 => {}
            Err(source) => {
                return Err(ApplyError {
                    action: format!("evict pod {name}"),
                    source,
                });
            }
        }
    }
    Ok(refused)
}
