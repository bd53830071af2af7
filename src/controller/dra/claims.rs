//! The ResourceClaim of a shard pod on a DRA node, and the allocation the
//! controller writes into it. The claim asks for exactly the planned devices:
//! a CEL selector on tessera's device ID attribute pins them, so no allocator
//! can satisfy it with anything but the plan. It is owned by its instance and
//! carries the delete-protection finalizer kube-scheduler puts on its own
//! claims, so kube-controller-manager clears the reservation and the
//! allocation once the pod is gone.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{NodeSelector, NodeSelectorRequirement, NodeSelectorTerm, Pod};
use k8s_openapi::api::resource::v1::{
    AllocationResult, CELDeviceSelector, CapacityRequirements, DeviceAllocationResult, DeviceClaim,
    DeviceRequest, DeviceRequestAllocationResult, DeviceSelector, ExactDeviceRequest,
    ResourceClaim, ResourceClaimConsumerReference, ResourceClaimSpec, ResourceClaimStatus,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::{Resource, ResourceExt};

use super::pools::Pool;
use tessera_core::api::{
    DRA_ID_ATTRIBUTE, DRA_MEMORY_CAPACITY as MEMORY_CAPACITY, ModelInstance, PlannedShard,
    ShareKind,
};

/// The name of the claim's one request, and of the pod's claim entry.
pub(crate) const REQUEST: &str = "gpus";
/// Makes kube-controller-manager deallocate the claim when its pod goes.
pub(crate) const DELETE_PROTECTION: &str = "resource.kubernetes.io/delete-protection";

/// `<pod>-gpus`.
pub(crate) fn claim_name(pod_name: &str) -> String {
    format!("{pod_name}-{REQUEST}")
}

/// The claim of the shard whose pod is `pod_name`.
pub(crate) fn shard_claim(
    mi: &ModelInstance,
    shard: &PlannedShard,
    pod_name: &str,
    driver: &str,
) -> ResourceClaim {
    let count = i64::try_from(shard.devices.len()).unwrap_or(i64::MAX);
    ResourceClaim {
        metadata: ObjectMeta {
            name: Some(claim_name(pod_name)),
            namespace: mi.namespace(),
            labels: Some(crate::controller::desired::shard_labels(
                &mi.name_any(),
                shard,
            )),
            owner_references: mi.controller_owner_ref(&()).map(|o| vec![o]),
            finalizers: Some(vec![DELETE_PROTECTION.to_string()]),
            ..ObjectMeta::default()
        },
        spec: Some(ResourceClaimSpec {
            devices: Some(DeviceClaim {
                requests: Some(vec![DeviceRequest {
                    name: REQUEST.to_string(),
                    exactly: Some(ExactDeviceRequest {
                        device_class_name: driver.to_string(),
                        allocation_mode: Some("ExactCount".to_string()),
                        count: Some(count),
                        selectors: Some(vec![DeviceSelector {
                            cel: Some(CELDeviceSelector {
                                expression: pinned(driver, &shard.devices),
                            }),
                        }]),
                        capacity: memory_share(shard).map(|memory| CapacityRequirements {
                            requests: Some(BTreeMap::from([(MEMORY_CAPACITY.to_string(), memory)])),
                        }),
                        ..ExactDeviceRequest::default()
                    }),
                    ..DeviceRequest::default()
                }]),
                ..DeviceClaim::default()
            }),
        }),
        status: None,
    }
}

/// The memory a shard given a memory share asks for, in whole GiB.
pub(crate) fn memory_share(shard: &PlannedShard) -> Option<Quantity> {
    let share = shard.share.as_ref()?;
    let gib = share
        .memory_gib
        .filter(|_| share.kind == ShareKind::Memory)?;
    Some(Quantity(format!("{gib}Gi")))
}

/// `device.attributes["<driver>"].id in ["a", "b"]`.
fn pinned(driver: &str, ids: &[String]) -> String {
    let quoted: Vec<String> = ids.iter().map(|id| cel_string(id)).collect();
    format!(
        "device.attributes[{}].{DRA_ID_ATTRIBUTE} in [{}]",
        cel_string(driver),
        quoted.join(", ")
    )
}

fn cel_string(text: &str) -> String {
    let mut out = String::with_capacity(text.len() + 2);
    out.push('"');
    for c in text.chars() {
        match c {
            '"' | '\\' => {
                out.push('\\');
                out.push(c);
            }
            c if c.is_control() => out.push_str(&format!("\\u{:04x}", u32::from(c))),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// What the controller writes into the claim before it binds `pod`: the
/// planned devices by their names in the node's pool, the node, and the pod
/// as the claim's consumer. A memory share's result carries a share ID (the
/// claim's UID: unique among the allocations of one device, since a shard's
/// claim has one result per device, and the same when a write is retried)
/// and the memory it consumes. `None` (with why) when the pool does not list a
/// planned device: it is not offered through DRA (yet), so it is not
/// allocated.
pub(crate) fn allocated_status(
    shard: &PlannedShard,
    claim_uid: &str,
    driver: &str,
    pool: &Pool,
    pod: &Pod,
) -> Result<ResourceClaimStatus, String> {
    let share = memory_share(shard);
    let mut results = Vec::with_capacity(shard.devices.len());
    for id in &shard.devices {
        let Some(name) = pool.names.get(id) else {
            return Err(format!(
                "device {id} is not in node {}'s ResourceSlices of driver {driver}",
                shard.node
            ));
        };
        results.push(DeviceRequestAllocationResult {
            request: REQUEST.to_string(),
            driver: driver.to_string(),
            pool: shard.node.clone(),
            device: name.clone(),
            share_id: share.as_ref().map(|_| claim_uid.to_string()),
            consumed_capacity: share
                .as_ref()
                .map(|memory| BTreeMap::from([(MEMORY_CAPACITY.to_string(), memory.clone())])),
            ..DeviceRequestAllocationResult::default()
        });
    }
    Ok(ResourceClaimStatus {
        allocation: Some(AllocationResult {
            devices: Some(DeviceAllocationResult {
                results: Some(results),
                config: None,
            }),
            node_selector: Some(NodeSelector {
                node_selector_terms: vec![NodeSelectorTerm {
                    match_fields: Some(vec![NodeSelectorRequirement {
                        key: "metadata.name".to_string(),
                        operator: "In".to_string(),
                        values: Some(vec![shard.node.clone()]),
                    }]),
                    match_expressions: None,
                }],
            }),
            allocation_timestamp: None,
        }),
        reserved_for: Some(vec![ResourceClaimConsumerReference {
            api_group: None,
            resource: "pods".to_string(),
            name: pod.name_any(),
            uid: pod.metadata.uid.clone().unwrap_or_default(),
        }]),
        devices: None,
    })
}

/// Whether `claim` is allocated and reserved for `pod`.
pub(crate) fn reserved_for(claim: &ResourceClaim, pod: &Pod) -> bool {
    let status = claim.status.as_ref();
    status.is_some_and(|s| s.allocation.is_some())
        && status
            .and_then(|s| s.reserved_for.as_ref())
            .is_some_and(|consumers| {
                consumers
                    .iter()
                    .any(|c| Some(&c.uid) == pod.metadata.uid.as_ref())
            })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::controller::testkit::instance;

    fn shard(devices: &[&str]) -> PlannedShard {
        PlannedShard {
            copy: 0,
            replica: 0,
            shard: 0,
            node: "node-1".into(),
            devices: devices.iter().map(|d| (*d).to_string()).collect(),
            layer_start: 0,
            layer_end: 10,
            predicted_memory_gib: 10.0,
            share: None,
        }
    }

    #[test]
    fn a_shard_claim_pins_exactly_the_planned_devices() {
        let mi = instance("llama", crate::controller::testkit::SMALL);
        let claim = shard_claim(
            &mi,
            &shard(&["GPU-a", "we\"ird\\id"]),
            "llama-shard-0",
            "gpu.tessera.dev",
        );
        assert_eq!(claim.metadata.name.as_deref(), Some("llama-shard-0-gpus"));
        assert_eq!(claim.metadata.namespace.as_deref(), Some("ml"));
        // What the agent labels the devices' metrics with.
        let labels = claim.metadata.labels.as_ref().unwrap();
        assert_eq!(labels[tessera_core::api::INSTANCE_LABEL], "llama");
        assert_eq!(labels[tessera_core::api::SHARD_ANNOTATION], "0");
        assert!(!labels.contains_key(tessera_core::api::REPLICA_LABEL));
        let mut later = shard(&["GPU-a"]);
        (later.replica, later.shard) = (2, 1);
        let labels = shard_claim(&mi, &later, "llama-r2-shard-1", "gpu.tessera.dev")
            .metadata
            .labels
            .unwrap();
        assert_eq!(
            (
                labels[tessera_core::api::REPLICA_LABEL].as_str(),
                labels[tessera_core::api::SHARD_ANNOTATION].as_str()
            ),
            ("2", "1")
        );
        assert_eq!(
            claim.metadata.finalizers.as_deref(),
            Some(&[DELETE_PROTECTION.to_string()][..])
        );
        assert_eq!(
            claim.metadata.owner_references.as_ref().unwrap()[0].kind,
            "ModelInstance"
        );
        let request = &claim
            .spec
            .as_ref()
            .unwrap()
            .devices
            .as_ref()
            .unwrap()
            .requests
            .as_ref()
            .unwrap()[0];
        assert_eq!(request.name, "gpus");
        let exactly = request.exactly.as_ref().unwrap();
        assert_eq!(exactly.device_class_name, "gpu.tessera.dev");
        assert_eq!(
            (exactly.allocation_mode.as_deref(), exactly.count),
            (Some("ExactCount"), Some(2))
        );
        let expression = &exactly.selectors.as_ref().unwrap()[0]
            .cel
            .as_ref()
            .unwrap()
            .expression;
        assert_eq!(
            expression,
            r#"device.attributes["gpu.tessera.dev"].id in ["GPU-a", "we\"ird\\id"]"#
        );
    }

    #[test]
    fn the_allocation_names_the_pool_devices_the_node_and_the_pod() {
        let pool = Pool {
            generation: 1,
            names: BTreeMap::from([
                ("GPU-a".into(), "gpu-a".into()),
                ("GPU-b".into(), "gpu-b".into()),
            ]),
            ..Pool::default()
        };
        let mut pod = Pod::default();
        pod.metadata.name = Some("llama-shard-0".into());
        pod.metadata.uid = Some("pod-uid".into());
        let status = allocated_status(
            &shard(&["GPU-b", "GPU-a"]),
            "claim-uid",
            "gpu.tessera.dev",
            &pool,
            &pod,
        )
        .unwrap();
        let allocation = status.allocation.as_ref().unwrap();
        let results = allocation
            .devices
            .as_ref()
            .unwrap()
            .results
            .as_ref()
            .unwrap();
        assert!(
            results
                .iter()
                .all(|r| r.share_id.is_none() && r.consumed_capacity.is_none())
        );
        let named: Vec<(&str, &str, &str)> = results
            .iter()
            .map(|r| (r.pool.as_str(), r.device.as_str(), r.request.as_str()))
            .collect();
        assert_eq!(
            named,
            [("node-1", "gpu-b", "gpus"), ("node-1", "gpu-a", "gpus")]
        );
        let term = &allocation
            .node_selector
            .as_ref()
            .unwrap()
            .node_selector_terms[0];
        assert_eq!(
            term.match_fields.as_ref().unwrap()[0].values.as_deref(),
            Some(&["node-1".to_string()][..])
        );
        let consumer = &status.reserved_for.as_ref().unwrap()[0];
        assert_eq!(
            (consumer.resource.as_str(), consumer.uid.as_str()),
            ("pods", "pod-uid")
        );

        let claim = ResourceClaim {
            status: Some(status),
            ..ResourceClaim::default()
        };
        assert!(reserved_for(&claim, &pod));
        pod.metadata.uid = Some("another".into());
        assert!(!reserved_for(&claim, &pod));

        let err = allocated_status(
            &shard(&["GPU-z"]),
            "claim-uid",
            "gpu.tessera.dev",
            &pool,
            &pod,
        )
        .unwrap_err();
        assert_eq!(
            err,
            "device GPU-z is not in node node-1's ResourceSlices of driver gpu.tessera.dev"
        );
    }

    #[test]
    fn a_memory_share_asks_for_its_memory_and_is_allocated_with_a_share_id() {
        use tessera_core::api::{ShardShare, ShareKind};
        let mut shared = shard(&["GPU-a"]);
        shared.share = Some(ShardShare {
            kind: ShareKind::Memory,
            gpu: "GPU-a".into(),
            profile: None,
            memory_gib: Some(25),
            memory_fraction: Some(0.312),
            tenants: 1,
            contended_tokens_per_second: Some(70.0),
        });
        let mi = instance("llama", crate::controller::testkit::SMALL);
        let claim = shard_claim(&mi, &shared, "llama-shard-0", "gpu.tessera.dev");
        let exactly = claim
            .spec
            .as_ref()
            .unwrap()
            .devices
            .as_ref()
            .unwrap()
            .requests
            .as_ref()
            .unwrap()[0]
            .exactly
            .clone()
            .unwrap();
        assert_eq!(
            exactly.capacity.unwrap().requests.unwrap()["memory"],
            Quantity("25Gi".into())
        );
        let pool = Pool {
            names: BTreeMap::from([("GPU-a".into(), "gpu-a".into())]),
            ..Pool::default()
        };
        let status = allocated_status(
            &shared,
            "claim-uid",
            "gpu.tessera.dev",
            &pool,
            &Pod::default(),
        )
        .unwrap();
        let result = &status.allocation.unwrap().devices.unwrap().results.unwrap()[0];
        assert_eq!(result.share_id.as_deref(), Some("claim-uid"));
        assert_eq!(
            result.consumed_capacity.as_ref().unwrap()["memory"],
            Quantity("25Gi".into())
        );
        // A partition is a device of its own: no capacity, no share.
        shared.share = Some(ShardShare {
            kind: ShareKind::Partition,
            profile: Some("3g.40gb".into()),
            memory_gib: None,
            memory_fraction: None,
            tenants: 0,
            contended_tokens_per_second: None,
            ..shared.share.clone().unwrap()
        });
        assert_eq!(memory_share(&shared), None);
    }
}
