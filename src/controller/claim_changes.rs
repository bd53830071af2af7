//! Which ResourceClaim updates wake their instance. On a real 1.36 node a
//! shard claim whose pod had failed (and stayed, for `kubectl logs`) had its
//! reservation for that pod taken out and put back about every 50 ms by
//! kube-controller-manager, each write a 409 for the next. Each woke the
//! instance, and the reconcile queue's debounce restarts with every trigger,
//! so no reconcile ran until the pods were gone: a crash-looping replica was
//! recreated up to a minute late, its restart backoff overrun. So a claim
//! wakes only when what the controller acts on changes: its spec, its
//! allocation and device status, its owners, or its deletion. Its
//! reservations do not: the controller writes them itself as it binds a
//! shard, and a pod's failure or deletion reaches it through the pod. The
//! cache itself sees every update either way.

use std::collections::HashMap;
use std::hash::{Hash, Hasher};

use k8s_openapi::api::resource::v1::{ResourceClaim, ResourceClaimStatus};
use kube::ResourceExt;

use super::triggers::Touch;

#[derive(Default)]
pub(crate) struct ClaimChanges {
    /// A fingerprint of what the controller reads of each claim as last
    /// seen, by namespace and name.
    seen: HashMap<(String, String), u64>,
}

impl ClaimChanges {
    /// Whether this touch of `claim` should wake its instance.
    pub(crate) fn wakes(&mut self, claim: &ResourceClaim, touch: Touch) -> bool {
        let key = (claim.namespace().unwrap_or_default(), claim.name_any());
        if touch == Touch::Deleted {
            self.seen.remove(&key);
            return true;
        }
        let fingerprint = fingerprint(claim);
        self.seen.insert(key, fingerprint) != Some(fingerprint)
    }
}

/// The parts the controller acts on, through their JSON form (the API
/// types have no `Hash`).
fn fingerprint(claim: &ResourceClaim) -> u64 {
    let status = claim.status.as_ref().map(|status| ResourceClaimStatus {
        reserved_for: None,
        ..status.clone()
    });
    let read = (
        &claim.spec,
        &status,
        &claim.metadata.owner_references,
        &claim.metadata.deletion_timestamp,
    );
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    serde_json::to_string(&read)
        .unwrap_or_default()
        .hash(&mut hasher);
    hasher.finish()
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn claim(reserved_for: Option<&str>, device: &str, resource_version: &str) -> ResourceClaim {
        let reserved: Vec<_> = reserved_for
            .iter()
            .map(|pod| json!({"resource": "pods", "name": pod, "uid": pod}))
            .collect();
        serde_json::from_value(json!({
            "metadata": {
                "name": "llama-shard-0-gpus", "namespace": "ml",
                "resourceVersion": resource_version,
                "managedFields": [{"manager": "other", "operation": "Update",
                    "time": format!("2026-11-27T21:50:{resource_version}Z")}],
            },
            "spec": {"devices": {"requests": [{"name": "gpus", "exactly": {
                "deviceClassName": "gpu.tessera.dev", "count": 1}}]}},
            "status": {
                "allocation": {"devices": {"results": [{"request": "gpus",
                    "driver": "gpu.tessera.dev", "pool": "node-1", "device": device}]}},
                "reservedFor": reserved,
            },
        }))
        .unwrap()
    }

    #[test]
    fn writes_that_change_nothing_the_controller_acts_on_wake_nothing() {
        let mut changes = ClaimChanges::default();
        assert!(
            changes.wakes(&claim(Some("p1"), "gpu-0", "10"), Touch::Applied),
            "a new claim"
        );
        // The reservation of a failed pod taken out and put back, again and again.
        for (version, reserved) in [("11", None), ("12", Some("p1")), ("13", None)] {
            assert!(
                !changes.wakes(&claim(reserved, "gpu-0", version), Touch::Applied),
                "only the reservation, version and managed fields changed"
            );
        }
        assert!(
            changes.wakes(&claim(None, "gpu-1", "14"), Touch::Applied),
            "allocated another device"
        );
        let mut deleting = claim(None, "gpu-1", "15");
        deleting.metadata.deletion_timestamp =
            Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
                k8s_openapi::jiff::Timestamp::UNIX_EPOCH,
            ));
        assert!(changes.wakes(&deleting, Touch::Applied), "being deleted");
        assert!(changes.wakes(&deleting, Touch::Deleted), "gone");
        assert!(
            changes.wakes(&claim(None, "gpu-1", "16"), Touch::Applied),
            "made anew under the same name"
        );
    }
}
