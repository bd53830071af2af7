//! Devices held through DRA by anything but a given instance: every claim of
//! the driver that is allocated (by kube-scheduler for users' own pods, or
//! by this controller for other instances' shards) holds its devices until
//! it is deallocated. Planning keeps away from them, and a refusal names the
//! claim.

use std::sync::Arc;

use k8s_openapi::api::resource::v1::{DeviceRequestAllocationResult, ResourceClaim};

use super::pools::Pools;
use crate::kubernetes::quantity::whole_units;
use tessera_core::api::DRA_MEMORY_CAPACITY as MEMORY_CAPACITY;

/// What one allocated claim holds of one device.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct ClaimHold {
    /// `(node, device ID)`.
    pub(crate) device: (String, String),
    /// `ResourceClaim <namespace>/<name>`.
    pub(crate) holder: String,
    /// For a memory share (a result with a share ID): the memory consumed.
    /// Unreadable consumption counts as the whole device.
    pub(crate) share: Option<u64>,
}

/// What each device of `driver` allocated to a claim that `me` (an
/// instance UID) does not own is held by. The memory shares of claims other
/// instances own are left out: their plans count them (see `held_devices`),
/// and counting both would count each share twice.
pub(crate) fn held_by_claims<'a>(
    me: &'a str,
    claims: &'a [Arc<ResourceClaim>],
    driver: &'a str,
    pools: &'a Pools,
) -> impl Iterator<Item = ClaimHold> + 'a {
    claims
        .iter()
        .filter(move |claim| {
            !claim
                .metadata
                .owner_references
                .iter()
                .flatten()
                .any(|o| o.uid == me)
        })
        .flat_map(move |claim| {
            let holder = claim_holder(claim);
            let an_instances = claim
                .metadata
                .owner_references
                .iter()
                .flatten()
                .any(|o| o.kind == "ModelInstance");
            claim
                .status
                .as_ref()
                .and_then(|s| s.allocation.as_ref())
                .and_then(|a| a.devices.as_ref())
                .and_then(|d| d.results.as_ref())
                .into_iter()
                .flatten()
                .filter(move |result| result.driver == driver)
                .filter_map(move |result| {
                    let id = pools.node(&result.pool)?.id_of(&result.device)?;
                    let share = shared_memory(result);
                    if an_instances && share.is_some() {
                        return None;
                    }
                    Some(ClaimHold {
                        device: (result.pool.clone(), id.to_string()),
                        holder: holder.clone(),
                        share: share.flatten(),
                    })
                })
        })
}

/// `ResourceClaim <namespace>/<name>`: who holds what a claim was given.
pub(crate) fn claim_holder(claim: &ResourceClaim) -> String {
    format!(
        "ResourceClaim {}/{}",
        claim.metadata.namespace.as_deref().unwrap_or_default(),
        claim.metadata.name.as_deref().unwrap_or_default()
    )
}

/// `None` for a result that holds its device whole; for a share, the
/// memory it consumed (`Some(None)` when unreadable).
pub(crate) fn shared_memory(result: &DeviceRequestAllocationResult) -> Option<Option<u64>> {
    result.share_id.as_ref()?;
    Some(
        result
            .consumed_capacity
            .as_ref()
            .and_then(|capacity| capacity.get(MEMORY_CAPACITY))
            .and_then(|quantity| whole_units(&quantity.0)),
    )
}

#[cfg(test)]
mod tests {
    use k8s_openapi::api::resource::v1::{
        AllocationResult, DeviceAllocationResult, DeviceRequestAllocationResult,
        ResourceClaimStatus,
    };
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};

    use super::*;
    use crate::controller::dra::pools::tests::slice;

    fn claim(
        name: &str,
        owner: Option<&str>,
        results: &[(&str, &str, &str)],
    ) -> Arc<ResourceClaim> {
        Arc::new(ResourceClaim {
            metadata: ObjectMeta {
                namespace: Some("ns".into()),
                name: Some(name.into()),
                owner_references: owner.map(|uid| {
                    vec![OwnerReference {
                        uid: uid.into(),
                        ..OwnerReference::default()
                    }]
                }),
                ..ObjectMeta::default()
            },
            spec: Default::default(),
            status: Some(ResourceClaimStatus {
                allocation: Some(AllocationResult {
                    devices: Some(DeviceAllocationResult {
                        results: Some(
                            results
                                .iter()
                                .map(|(driver, pool, device)| DeviceRequestAllocationResult {
                                    request: "gpus".into(),
                                    driver: (*driver).into(),
                                    pool: (*pool).into(),
                                    device: (*device).into(),
                                    ..DeviceRequestAllocationResult::default()
                                })
                                .collect(),
                        ),
                        config: None,
                    }),
                    ..AllocationResult::default()
                }),
                ..ResourceClaimStatus::default()
            }),
        })
    }

    #[test]
    fn allocated_claims_of_others_hold_their_devices_by_id() {
        let d = "gpu.tessera.dev";
        let pools = Pools::of(
            &[slice(d, "n1", 1, &[("GPU-A", "gpu-a"), ("GPU-B", "gpu-b")])],
            d,
        );
        let mut unallocated = (*claim("pending", None, &[])).clone();
        unallocated.status = None;
        let claims = vec![
            claim(
                "users",
                None,
                &[(d, "n1", "gpu-a"), ("other.dev", "n1", "gpu-b")],
            ),
            claim("mine", Some("uid-me"), &[(d, "n1", "gpu-b")]),
            claim("theirs", Some("uid-other"), &[(d, "n1", "gpu-b")]),
            claim("unknown-device", None, &[(d, "n1", "gpu-z")]),
            Arc::new(unallocated),
        ];
        let held: Vec<_> = held_by_claims("uid-me", &claims, d, &pools)
            .map(|hold| (hold.device, hold.holder, hold.share))
            .collect();
        assert_eq!(
            held,
            [
                (
                    ("n1".to_string(), "GPU-A".to_string()),
                    "ResourceClaim ns/users".to_string(),
                    None
                ),
                (
                    ("n1".to_string(), "GPU-B".to_string()),
                    "ResourceClaim ns/theirs".to_string(),
                    None
                ),
            ]
        );
    }

    #[test]
    fn a_users_memory_share_is_held_as_a_share_an_instances_through_its_plan() {
        use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
        let d = "gpu.tessera.dev";
        let pools = Pools::of(&[slice(d, "n1", 1, &[("GPU-A", "gpu-a")])], d);
        let shared = |name: &str, owner_kind: Option<&str>, consumed: &str| {
            let mut claim = (*claim(name, None, &[(d, "n1", "gpu-a")])).clone();
            claim.metadata.owner_references = owner_kind.map(|kind| {
                vec![OwnerReference {
                    kind: kind.into(),
                    uid: format!("uid-{name}"),
                    ..OwnerReference::default()
                }]
            });
            let result = &mut claim
                .status
                .as_mut()
                .and_then(|s| s.allocation.as_mut())
                .and_then(|a| a.devices.as_mut())
                .and_then(|d| d.results.as_mut())
                .unwrap()[0];
            result.share_id = Some(format!("share-{name}"));
            result.consumed_capacity =
                Some([("memory".to_string(), Quantity(consumed.into()))].into());
            Arc::new(claim)
        };
        let claims = vec![
            shared("users", None, "10Gi"),
            shared("jobs", Some("Job"), "nonsense"),
            shared("instances", Some("ModelInstance"), "25Gi"),
        ];
        let held: Vec<_> = held_by_claims("uid-me", &claims, d, &pools)
            .map(|hold| (hold.holder, hold.share))
            .collect();
        assert_eq!(
            held,
            [
                ("ResourceClaim ns/users".to_string(), Some(10 << 30)),
                ("ResourceClaim ns/jobs".to_string(), None),
            ]
        );
    }
}
