//! The last check before the controller writes an allocation: the API
//! server checks none of it, so a device is given beyond what it holds only
//! if every allocator checks. Every allocated claim of the driver counts,
//! whoever allocated it (kube-scheduler for users' pods, this controller for
//! other instances): a device held whole is held, and a memory share fits
//! only beside shares that leave room for it.

use std::sync::Arc;

use k8s_openapi::api::resource::v1::{DeviceRequestAllocationResult, ResourceClaim};

use super::held::shared_memory;
use super::pools::Pool;

/// Why giving `results` to the claim with UID `claim_uid` would give a
/// device beyond what it holds, beside the allocations of `claims`; `None`
/// when it would not.
pub(crate) fn conflict(
    results: &[DeviceRequestAllocationResult],
    claim_uid: &str,
    claims: &[Arc<ResourceClaim>],
    pool: &Pool,
) -> Option<String> {
    results.iter().find_map(|mine| {
        let others: Vec<(String, &DeviceRequestAllocationResult)> = claims
            .iter()
            .filter(|claim| claim.metadata.uid.as_deref() != Some(claim_uid))
            .flat_map(|claim| {
                let holder = format!(
                    "ResourceClaim {}/{}",
                    claim.metadata.namespace.as_deref().unwrap_or_default(),
                    claim.metadata.name.as_deref().unwrap_or_default()
                );
                allocated(claim)
                    .filter(|other| {
                        other.driver == mine.driver
                            && other.pool == mine.pool
                            && other.device == mine.device
                    })
                    .map(move |other| (holder.clone(), other))
            })
            .collect();
        device_conflict(mine, &others, pool)
    })
}

fn device_conflict(
    mine: &DeviceRequestAllocationResult,
    others: &[(String, &DeviceRequestAllocationResult)],
    pool: &Pool,
) -> Option<String> {
    let device = format!("{}/{}", mine.pool, mine.device);
    let whole = |result| shared_memory(result).is_none();
    let Some(asked) = shared_memory(mine) else {
        let (holder, _) = others.first()?;
        return Some(format!("device {device} is allocated to {holder}"));
    };
    if let Some((holder, _)) = others.iter().find(|(_, other)| whole(other)) {
        return Some(format!("device {device} is allocated whole to {holder}"));
    }
    let Some(&capacity) = pool.memory.get(&mine.device) else {
        return Some(format!(
            "device {device} publishes no memory capacity to share"
        ));
    };
    // An unreadable amount is taken as the whole device.
    let taken: u64 = others
        .iter()
        .map(|(_, other)| shared_memory(other).flatten().unwrap_or(capacity))
        .sum();
    let asked = asked.unwrap_or(capacity);
    (taken.saturating_add(asked) > capacity).then(|| {
        let holders: Vec<&str> = others.iter().map(|(holder, _)| holder.as_str()).collect();
        format!(
            "device {device} has {} of {} GiB left beside the shares of {}; {} GiB asked",
            gib(capacity.saturating_sub(taken)),
            gib(capacity),
            holders.join(", "),
            gib(asked)
        )
    })
}

fn gib(bytes: u64) -> String {
    format!("{:.1}", bytes as f64 / (1u64 << 30) as f64)
}

/// The results of an allocated claim.
fn allocated(claim: &ResourceClaim) -> impl Iterator<Item = &DeviceRequestAllocationResult> {
    claim
        .status
        .as_ref()
        .and_then(|status| status.allocation.as_ref())
        .and_then(|allocation| allocation.devices.as_ref())
        .and_then(|devices| devices.results.as_ref())
        .into_iter()
        .flatten()
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use k8s_openapi::api::resource::v1::{
        AllocationResult, DeviceAllocationResult, ResourceClaimStatus,
    };
    use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

    use super::*;

    const D: &str = "gpu.tessera.dev";

    fn result(device: &str, share: Option<&str>) -> DeviceRequestAllocationResult {
        DeviceRequestAllocationResult {
            request: "gpus".into(),
            driver: D.into(),
            pool: "n1".into(),
            device: device.into(),
            share_id: share.map(|_| "share".to_string()),
            consumed_capacity: share
                .map(|memory| BTreeMap::from([("memory".to_string(), Quantity(memory.into()))])),
            ..DeviceRequestAllocationResult::default()
        }
    }

    fn claim(name: &str, results: Vec<DeviceRequestAllocationResult>) -> Arc<ResourceClaim> {
        Arc::new(ResourceClaim {
            metadata: ObjectMeta {
                namespace: Some("users".into()),
                name: Some(name.into()),
                uid: Some(format!("uid-{name}")),
                ..ObjectMeta::default()
            },
            spec: Default::default(),
            status: Some(ResourceClaimStatus {
                allocation: Some(AllocationResult {
                    devices: Some(DeviceAllocationResult {
                        results: Some(results),
                        config: None,
                    }),
                    ..AllocationResult::default()
                }),
                ..ResourceClaimStatus::default()
            }),
        })
    }

    fn pool() -> Pool {
        Pool {
            memory: BTreeMap::from([("gpu-a".to_string(), 80 << 30)]),
            ..Pool::default()
        }
    }

    #[test]
    fn a_device_a_users_claim_was_allocated_is_never_written_again() {
        let users = [claim("job", vec![result("gpu-a", None)])];
        let whole = conflict(&[result("gpu-a", None)], "uid-mine", &users, &pool());
        assert_eq!(
            whole.as_deref(),
            Some("device n1/gpu-a is allocated to ResourceClaim users/job")
        );
        let share = conflict(
            &[result("gpu-a", Some("25Gi"))],
            "uid-mine",
            &users,
            &pool(),
        );
        assert!(
            share
                .unwrap()
                .contains("allocated whole to ResourceClaim users/job")
        );
        // My own claim, written before, is no conflict; another device neither.
        assert_eq!(
            conflict(&[result("gpu-a", None)], "uid-job", &users, &pool()),
            None
        );
        assert_eq!(
            conflict(&[result("gpu-b", None)], "uid-mine", &users, &pool()),
            None
        );
    }

    #[test]
    fn memory_shares_fit_while_their_sum_stays_within_the_capacity() {
        let shares = [
            claim("a", vec![result("gpu-a", Some("30Gi"))]),
            claim("b", vec![result("gpu-a", Some("25Gi"))]),
        ];
        let mine =
            |asked: &str| conflict(&[result("gpu-a", Some(asked))], "uid-m", &shares, &pool());
        assert_eq!(mine("25Gi"), None, "30 + 25 + 25 = 80");
        let refused = mine("26Gi").expect("81 GiB of 80");
        assert!(
            refused.contains("25.0 of 80.0 GiB left")
                && refused.contains("users/a, ResourceClaim users/b"),
            "{refused}"
        );
        // A whole allocation beside shares is refused.
        let whole = conflict(&[result("gpu-a", None)], "uid-m", &shares, &pool()).unwrap();
        assert!(
            whole.contains("allocated to ResourceClaim users/a"),
            "{whole}"
        );
        // A share without a published capacity cannot be judged: refused.
        let unknown = conflict(
            &[result("gpu-a", Some("1Gi"))],
            "uid-m",
            &[],
            &Pool::default(),
        );
        assert!(unknown.unwrap().contains("publishes no memory capacity"));
        // An unreadable amount counts as the whole device.
        let odd = [claim("odd", vec![result("gpu-a", Some("lots"))])];
        assert!(conflict(&[result("gpu-a", Some("1Gi"))], "uid-m", &odd, &pool()).is_some());
    }
}
