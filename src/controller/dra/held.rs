//! Devices held through DRA by anything but a given instance: every claim of
//! the driver that is allocated (by kube-scheduler for users' own pods, or
//! by this controller for other instances' shards) holds its devices until
//! it is deallocated. Planning keeps away from them, and a refusal names the
//! claim.

use std::sync::Arc;

use k8s_openapi::api::resource::v1::ResourceClaim;

use super::pools::Pools;

/// `((node, device ID), holder)` for each device of `driver` allocated to a
/// claim that `me` (an instance UID) does not own.
pub(crate) fn held_by_claims<'a>(
    me: &'a str,
    claims: &'a [Arc<ResourceClaim>],
    driver: &'a str,
    pools: &'a Pools,
) -> impl Iterator<Item = ((String, String), String)> + 'a {
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
            let holder = format!(
                "ResourceClaim {}/{}",
                claim.metadata.namespace.as_deref().unwrap_or_default(),
                claim.metadata.name.as_deref().unwrap_or_default()
            );
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
                    Some(((result.pool.clone(), id.to_string()), holder.clone()))
                })
        })
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
        let held: Vec<_> = held_by_claims("uid-me", &claims, d, &pools).collect();
        assert_eq!(
            held,
            [
                (
                    ("n1".to_string(), "GPU-A".to_string()),
                    "ResourceClaim ns/users".to_string()
                ),
                (
                    ("n1".to_string(), "GPU-B".to_string()),
                    "ResourceClaim ns/theirs".to_string()
                ),
            ]
        );
    }
}
