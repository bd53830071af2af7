//! Writing shard claims, as a custom scheduler must (KEP-4381): the claim is
//! created with its pod; before the pod is bound the controller writes the
//! allocation (the planned devices, the node) and the reservation (the pod)
//! into the claim's status; a claim whose plan changed, or that is reserved
//! for a pod that is not its shard's current pod, is deleted and made anew;
//! claims of shards no longer wanted go.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::ResourceClaim;
use kube::ResourceExt;
use kube::api::{Api, DeleteParams, PostParams, Preconditions};

use super::claims::{allocated_status, reserved_for};
use super::conflicts::conflict;
use super::pools::Pools;
use crate::controller::apply::{ApplyError, BeforeBind, create_together, retry};
use crate::controller::events::EventNote;
use crate::controller::lock;
use tessera_core::api::PlannedShard;

/// The claim a DRA shard should have, and its planned shard.
#[derive(Clone, Debug)]
pub(crate) struct DraShard {
    pub(crate) claim: ResourceClaim,
    pub(crate) shard: PlannedShard,
    /// The shard's pod, which uses the claim.
    pub(crate) pod_name: String,
}

/// One reconcile's view and writes of an instance's shard claims.
pub(crate) struct ShardClaims<'a> {
    api: Api<ResourceClaim>,
    driver: &'a str,
    pools: &'a Pools,
    /// Every claim of the cluster as cached: what the instance's claims are
    /// checked against before they are allocated.
    all: &'a [Arc<ResourceClaim>],
    /// The instance's claims as cached, by name.
    existing: BTreeMap<String, Arc<ResourceClaim>>,
    /// What each wanted claim should be, by claim name.
    wanted: BTreeMap<String, DraShard>,
    /// Claims as written in this reconcile (the cache shows them later).
    written: Mutex<BTreeMap<String, ResourceClaim>>,
    /// Claims deleted in this reconcile: not to be allocated now.
    deleted: BTreeSet<String>,
    /// Why a shard could not be bound, for the events.
    notes: Mutex<Vec<EventNote>>,
}

impl<'a> ShardClaims<'a> {
    pub(crate) fn new(
        api: Api<ResourceClaim>,
        driver: &'a str,
        pools: &'a Pools,
        all: &'a [Arc<ResourceClaim>],
        existing: impl IntoIterator<Item = Arc<ResourceClaim>>,
        wanted: Vec<DraShard>,
    ) -> Self {
        Self {
            api,
            driver,
            pools,
            all,
            existing: existing.into_iter().map(|c| (c.name_any(), c)).collect(),
            wanted: wanted
                .into_iter()
                .map(|w| (w.claim.name_any(), w))
                .collect(),
            written: Mutex::default(),
            deleted: BTreeSet::new(),
            notes: Mutex::default(),
        }
    }

    /// Creates the wanted claims that are missing, deletes those that are
    /// stale (see the module) and those no longer wanted. `pods`: the
    /// instance's shard pods by name, as cached.
    pub(crate) async fn sync(
        &mut self,
        pods: &BTreeMap<String, Arc<Pod>>,
    ) -> Result<(), ApplyError> {
        let mut missing = Vec::new();
        for (name, want) in &self.wanted {
            match self.existing.get(name) {
                None => missing.push((name, want)),
                Some(have) if have.metadata.deletion_timestamp.is_some() => {}
                Some(have) => {
                    let pod = pods
                        .get(&want.pod_name)
                        .filter(|p| p.metadata.deletion_timestamp.is_none());
                    if stale(have, &want.claim, pod.map(AsRef::as_ref)) {
                        delete(&self.api, have).await?;
                        self.deleted.insert(name.clone());
                    }
                }
            }
        }
        let created = create_together(
            &self.api,
            "ResourceClaim",
            missing.iter().map(|(_, want)| &want.claim),
        )
        .await?;
        for ((name, _), claim) in missing.into_iter().zip(created) {
            if let Some(claim) = claim {
                lock(&self.written).insert(name.clone(), claim);
            }
        }
        let unwanted: Vec<Arc<ResourceClaim>> = self
            .existing
            .iter()
            .filter(|(name, claim)| {
                !self.wanted.contains_key(*name) && claim.metadata.deletion_timestamp.is_none()
            })
            .map(|(_, claim)| Arc::clone(claim))
            .collect();
        for claim in unwanted {
            delete(&self.api, &claim).await?;
        }
        Ok(())
    }

    /// Why shards could not be bound.
    pub(crate) fn take_notes(&self) -> Vec<EventNote> {
        std::mem::take(&mut *lock(&self.notes))
    }

    fn note(&self, message: String) {
        lock(&self.notes).push(EventNote {
            warning: true,
            reason: "ClaimNotAllocated",
            message,
        });
    }
}

impl BeforeBind for ShardClaims<'_> {
    /// A pod with a claim is bound only once its claim is allocated and
    /// reserved for it; this writes both when they are not.
    async fn ready(&self, pod: &Pod, node: &str) -> Result<bool, ApplyError> {
        let Some(name) = claim_of(pod) else {
            return Ok(true);
        };
        let Some(want) = self.wanted.get(&name) else {
            return Ok(false);
        };
        if self.deleted.contains(&name) {
            return Ok(false);
        }
        let current = lock(&self.written)
            .get(&name)
            .cloned()
            .or_else(|| self.existing.get(&name).map(|c| ResourceClaim::clone(c)));
        let Some(mut claim) = current else {
            return Ok(false);
        };
        if claim.metadata.deletion_timestamp.is_some() {
            return Ok(false);
        }
        if reserved_for(&claim, pod) {
            return Ok(true);
        }
        let Some(pool) = self.pools.node(node) else {
            self.note(format!(
                "{}: node {node} publishes no ResourceSlices of driver {}; the shard stays unbound",
                pod.name_any(),
                self.driver
            ));
            return Ok(false);
        };
        let uid = claim.metadata.uid.clone().unwrap_or_default();
        let status =
            allocated_status(&want.shard, &uid, self.driver, pool, pod).and_then(|status| {
                let results = status
                    .allocation
                    .as_ref()
                    .and_then(|allocation| allocation.devices.as_ref())
                    .and_then(|devices| devices.results.as_deref())
                    .unwrap_or_default();
                match conflict(results, &uid, self.all, pool) {
                    Some(why) => Err(why),
                    None => Ok(status),
                }
            });
        match status {
            Ok(status) => claim.status = Some(status),
            Err(why) => {
                self.note(format!(
                    "{}: {why}; the shard stays unbound",
                    pod.name_any()
                ));
                return Ok(false);
            }
        }
        let params = PostParams::default();
        let written = retry(&format!("allocate ResourceClaim {name}"), || {
            self.api.replace_status(&name, &params, &claim)
        })
        .await;
        match written {
            Ok(claim) => {
                lock(&self.written).insert(name, claim);
                Ok(true)
            }
            // Changed meanwhile (kube-controller-manager, another write): next pass.
            Err(e) if matches!(&e.source, kube::Error::Api(s) if s.code == 409) => Ok(false),
            Err(e) => Err(e),
        }
    }
}

/// The claim a shard pod uses (the name of its claim entry's claim).
pub(crate) fn claim_of(pod: &Pod) -> Option<String> {
    pod.spec
        .as_ref()?
        .resource_claims
        .as_ref()?
        .iter()
        .find(|c| c.name == crate::controller::desired::CLAIM_ENTRY)?
        .resource_claim_name
        .clone()
}

/// Whether `have` must be made anew: it asks for other devices than `want`
/// (the plan changed), or it is reserved for a pod that is not the shard's
/// current pod (the pod was replaced or is gone).
fn stale(have: &ResourceClaim, want: &ResourceClaim, pod: Option<&Pod>) -> bool {
    if have.spec != want.spec {
        return true;
    }
    let reserved: Vec<&str> = have
        .status
        .as_ref()
        .and_then(|s| s.reserved_for.as_ref())
        .into_iter()
        .flatten()
        .map(|c| c.uid.as_str())
        .collect();
    let current = pod.and_then(|p| p.metadata.uid.as_deref());
    !reserved.is_empty() && !reserved.iter().all(|uid| Some(*uid) == current)
}

async fn delete(api: &Api<ResourceClaim>, claim: &ResourceClaim) -> Result<(), ApplyError> {
    let name = claim.name_any();
    let params = DeleteParams {
        preconditions: Some(Preconditions {
            uid: claim.metadata.uid.clone(),
            resource_version: None,
        }),
        ..DeleteParams::default()
    };
    match retry(&format!("delete ResourceClaim {name}"), || {
        api.delete(&name, &params)
    })
    .await
    {
        Ok(_) => Ok(()),
        Err(e) if matches!(&e.source, kube::Error::Api(s) if s.is_not_found()) => Ok(()),
        Err(e) => Err(e),
    }
}

#[cfg(test)]
mod tests {
    use k8s_openapi::api::core::v1::{PodResourceClaim, PodSpec};
    use k8s_openapi::api::resource::v1::{ResourceClaimConsumerReference, ResourceClaimStatus};

    use super::*;

    fn claim_reserved_for(uids: &[&str]) -> ResourceClaim {
        ResourceClaim {
            status: Some(ResourceClaimStatus {
                reserved_for: Some(
                    uids.iter()
                        .map(|uid| ResourceClaimConsumerReference {
                            resource: "pods".into(),
                            uid: (*uid).into(),
                            ..ResourceClaimConsumerReference::default()
                        })
                        .collect(),
                ),
                ..ResourceClaimStatus::default()
            }),
            ..ResourceClaim::default()
        }
    }

    fn pod(uid: &str) -> Pod {
        let mut pod = Pod::default();
        pod.metadata.uid = Some(uid.into());
        pod
    }

    #[test]
    fn a_claim_is_stale_when_its_spec_or_its_pod_changed() {
        let want = ResourceClaim::default();
        assert!(!stale(&claim_reserved_for(&[]), &want, None));
        assert!(!stale(
            &claim_reserved_for(&["p1"]),
            &want,
            Some(&pod("p1"))
        ));
        assert!(stale(&claim_reserved_for(&["p0"]), &want, Some(&pod("p1"))));
        assert!(stale(&claim_reserved_for(&["p0"]), &want, None));
        let mut other = claim_reserved_for(&[]);
        other.spec = Some(Default::default());
        assert!(stale(&other, &want, None));
    }

    #[test]
    fn a_pods_claim_is_its_gpus_entry() {
        let mut pod = pod("p");
        assert_eq!(claim_of(&pod), None);
        pod.spec = Some(PodSpec {
            resource_claims: Some(vec![
                PodResourceClaim {
                    name: "other".into(),
                    resource_claim_name: Some("x".into()),
                    ..PodResourceClaim::default()
                },
                PodResourceClaim {
                    name: "gpus".into(),
                    resource_claim_name: Some("llama-shard-0-gpus".into()),
                    ..PodResourceClaim::default()
                },
            ]),
            ..PodSpec::default()
        });
        assert_eq!(claim_of(&pod).as_deref(), Some("llama-shard-0-gpus"));
    }
}
