//! The last check before the controller writes an allocation: the API
//! server checks none of it, so a device is given beyond what it holds only
//! if every allocator checks. Every allocated claim of the driver counts,
//! whoever allocated it (kube-scheduler for users' pods, this controller for
//! other instances): a device held whole is held, and a memory share fits
//! only beside shares that leave room for it.

use std::sync::Arc;

use k8s_openapi::api::resource::v1::{DeviceRequestAllocationResult, ResourceClaim};

use super::held::{claim_holder, shared_memory};
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
        // Holders are named only in a refusal: a check of a bind that fits
        // formats nothing, however many claims the cluster has.
        let in_pool: Vec<Other> = claims
            .iter()
            .filter(|claim| claim.metadata.uid.as_deref() != Some(claim_uid))
            .flat_map(|claim| {
                allocated(claim)
                    .filter(|other| other.driver == mine.driver && other.pool == mine.pool)
                    .map(move |other| (claim.as_ref(), other))
            })
            .collect();
        device_conflict(mine, &in_pool, pool).or_else(|| counter_conflict(mine, &in_pool, pool))
    })
}

/// Another claim's allocated result in the same pool.
type Other<'a> = (&'a ResourceClaim, &'a DeviceRequestAllocationResult);

/// Whether `mine` with every other allocated device of its pool would use
/// more of a counter set than it has (partitions of one GPU on the same
/// memory slices).
fn counter_conflict(
    mine: &DeviceRequestAllocationResult,
    in_pool: &[Other],
    pool: &Pool,
) -> Option<String> {
    let consumes = pool.consumes.get(&mine.device)?;
    for (set, wanted) in consumes {
        let Some(has) = pool.counters.get(set) else {
            return Some(format!(
                "device {}/{} consumes counter set {set}, which its pool does not publish",
                mine.pool, mine.device
            ));
        };
        for (counter, amount) in wanted {
            let mut holders = Vec::new();
            let mut used = 0u64;
            for (claim, other) in in_pool {
                let taken = pool
                    .consumes
                    .get(&other.device)
                    .and_then(|sets| sets.get(set))
                    .and_then(|counters| counters.get(counter))
                    .copied()
                    .unwrap_or(0);
                if taken > 0 {
                    used = used.saturating_add(taken);
                    holders.push(claim_holder(claim));
                }
            }
            let limit = has.get(counter).copied().unwrap_or(0);
            if used.saturating_add(*amount) > limit {
                return Some(format!(
                    "device {}/{} needs {counter} of counter set {set}, held by {}",
                    mine.pool,
                    mine.device,
                    if holders.is_empty() {
                        "nobody, but the set has too little".to_string()
                    } else {
                        holders.join(", ")
                    }
                ));
            }
        }
    }
    None
}

fn device_conflict(
    mine: &DeviceRequestAllocationResult,
    in_pool: &[Other],
    pool: &Pool,
) -> Option<String> {
    let others: Vec<&Other> = in_pool
        .iter()
        .filter(|(_, other)| other.device == mine.device)
        .collect();
    let device = format!("{}/{}", mine.pool, mine.device);
    let whole = |result| shared_memory(result).is_none();
    let Some(asked) = shared_memory(mine) else {
        let (claim, _) = others.first()?;
        return Some(format!(
            "device {device} is allocated to {}",
            claim_holder(claim)
        ));
    };
    if let Some((claim, _)) = others.iter().find(|(_, other)| whole(other)) {
        return Some(format!(
            "device {device} is allocated whole to {}",
            claim_holder(claim)
        ));
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
        let holders: Vec<String> = others
            .iter()
            .map(|(claim, _)| claim_holder(claim))
            .collect();
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

    #[test]
    fn partitions_on_the_same_memory_slices_are_never_both_allocated() {
        let slices = |range: std::ops::Range<u32>| -> BTreeMap<String, u64> {
            range.map(|i| (format!("memory-slice-{i}"), 1)).collect()
        };
        let mut pool = pool();
        pool.counters.insert("gpu-a".into(), slices(0..8));
        // The old layout's 4g on slices 0-3 is still allocated; the new one
        // has a 3g on slices 2-5 and a 1g on slice 7.
        for (device, range) in [("old-4g", 0..4), ("new-3g", 2..6), ("new-1g", 7..8)] {
            pool.consumes.insert(
                device.into(),
                BTreeMap::from([("gpu-a".to_string(), slices(range))]),
            );
        }
        let held = [claim("old", vec![result("old-4g", None)])];
        let overlap = conflict(&[result("new-3g", None)], "uid-m", &held, &pool).unwrap();
        assert!(
            overlap
                .contains("memory-slice-2 of counter set gpu-a, held by ResourceClaim users/old"),
            "{overlap}"
        );
        assert_eq!(
            conflict(&[result("new-1g", None)], "uid-m", &held, &pool),
            None
        );
        pool.counters.clear();
        let unpublished = conflict(&[result("new-1g", None)], "uid-m", &[], &pool).unwrap();
        assert!(unpublished.contains("does not publish"), "{unpublished}");
    }
}
