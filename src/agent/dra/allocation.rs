//! Reading a claim's allocation for this node: which of its devices the claim
//! was given, for which request. Everything kubelet's call does not prove is
//! checked here, each failure a sentence for that claim alone: the claim is
//! the one kubelet means (same UID), it is allocated, and every device of this
//! driver in it is in this node's pool, one of this node's devices, and
//! healthy. Devices of other drivers are theirs to prepare.

use k8s_openapi::api::resource::v1::ResourceClaim;

use super::device_names::pool_device_names;
use super::slice_fields::MEMORY_CAPACITY;
use crate::backend::{DeviceState, RawHealth, Snapshot};
use crate::kubernetes::quantity::whole_units;
use tessera_core::api::GpuPartition;

/// One device of this node a claim was given.
#[derive(Debug)]
pub(crate) struct AllocatedDevice<'a> {
    /// The claim's request (`request` or `request/subrequest`).
    pub(crate) request: String,
    /// Its name in this node's slices.
    pub(crate) name: String,
    /// The GPU, or the GPU the partition is of.
    pub(crate) state: &'a DeviceState,
    /// Set when the device is a MIG partition of the GPU.
    pub(crate) partition: Option<&'a GpuPartition>,
    /// Set when the claim was given a memory share of the GPU: its bytes.
    pub(crate) memory_share: Option<u64>,
    /// The allocation result's share ID, set for a memory share.
    pub(crate) share_id: Option<String>,
}

impl AllocatedDevice<'_> {
    /// tessera's ID of the device: the GPU's, or the partition's.
    pub(crate) fn id(&self) -> &str {
        self.partition
            .map_or(self.state.info.id.as_str(), |partition| {
                partition.id.as_str()
            })
    }
}

/// Who this driver is on which node.
#[derive(Clone, Debug)]
pub(crate) struct DriverOnNode {
    pub(crate) driver: String,
    /// The node's name, which is also the name of its pool.
    pub(crate) node_name: String,
}

/// The UID and name of the first pod `claim` is reserved for.
pub(crate) fn consumer_pod(claim: &ResourceClaim) -> Option<(String, String)> {
    claim
        .status
        .as_ref()?
        .reserved_for
        .as_ref()?
        .iter()
        .find(|consumer| {
            consumer.resource == "pods" && consumer.api_group.as_deref().unwrap_or("").is_empty()
        })
        .map(|consumer| (consumer.uid.clone(), consumer.name.clone()))
}

/// The devices of this node `claim` was allocated, in the allocation's order.
pub(crate) fn allocated_devices<'a>(
    claim: &ResourceClaim,
    uid: &str,
    on: &DriverOnNode,
    snapshot: &'a Snapshot,
) -> Result<Vec<AllocatedDevice<'a>>, String> {
    let named = format!(
        "claim {}/{}",
        claim.metadata.namespace.as_deref().unwrap_or_default(),
        claim.metadata.name.as_deref().unwrap_or_default()
    );
    let actual_uid = claim.metadata.uid.as_deref().unwrap_or_default();
    if actual_uid != uid {
        return Err(format!(
            "{named} has UID {actual_uid}, not {uid}: it was deleted and created again since kubelet read it"
        ));
    }
    let results = claim
        .status
        .as_ref()
        .and_then(|status| status.allocation.as_ref())
        .and_then(|allocation| allocation.devices.as_ref())
        .and_then(|devices| devices.results.as_deref())
        .ok_or_else(|| format!("{named} is not allocated"))?;
    let ours: Vec<_> = results.iter().filter(|r| r.driver == on.driver).collect();
    if ours.is_empty() {
        return Err(format!("{named} has no device of driver {}", on.driver));
    }

    let names = pool_device_names(snapshot);
    let mut devices = Vec::with_capacity(ours.len());
    let mut problems = Vec::new();
    for result in ours {
        let device = format!("{}/{}", result.pool, result.device);
        if result.pool != on.node_name {
            problems.push(format!(
                "device {device} is not on this node (its pool is {}, this node's is {})",
                result.pool, on.node_name
            ));
            continue;
        }
        let named = |id: &str| names.get(id) == Some(&result.device);
        let whole = snapshot.devices.iter().find(|state| named(&state.info.id));
        let partition = || {
            snapshot.devices.iter().find_map(|state| {
                let mig = state.info.mig.as_ref()?;
                let partition = mig.partitions.iter().find(|p| named(&p.id))?;
                Some((
                    state,
                    partition,
                    mig.usable_partitions().contains(partition),
                ))
            })
        };
        let (state, partition) = match (whole, partition()) {
            (Some(state), _) => (state, None),
            (None, Some((state, partition, true))) => (state, Some(partition)),
            (None, Some((state, partition, false))) => {
                problems.push(format!(
                    "device {device} ({}) is a MIG partition of {} that is not offered now: {}",
                    partition.id,
                    state.info.id,
                    state
                        .info
                        .not_whole()
                        .unwrap_or_else(|| "MIG mode is off".into())
                ));
                continue;
            }
            (None, None) => {
                problems.push(format!("device {device} is not one of this node's GPUs"));
                continue;
            }
        };
        if let RawHealth::Unhealthy(why) = &state.health {
            problems.push(format!(
                "device {device} ({}) is unhealthy: {why}",
                state.info.id
            ));
            continue;
        }
        if partition.is_none()
            && let Some(why) = state.info.not_whole()
        {
            problems.push(format!(
                "device {device} ({}) is not a whole GPU: {why}",
                state.info.id
            ));
            continue;
        }
        let memory_share = match memory_share(result, state.info.memory_total_bytes) {
            Ok(share) => share.filter(|_| partition.is_none()),
            Err(why) => {
                problems.push(format!("device {device}: {why}"));
                continue;
            }
        };
        devices.push(AllocatedDevice {
            request: result.request.clone(),
            name: result.device.clone(),
            state,
            partition,
            share_id: memory_share.and(result.share_id.clone()),
            memory_share,
        });
    }
    if problems.is_empty() {
        Ok(devices)
    } else {
        Err(format!("{named}: {}", problems.join("; ")))
    }
}

/// The GPU memory a result with a share ID was given (its consumed
/// `memory` capacity); `None` for a result without one, which holds the
/// whole device.
fn memory_share(
    result: &k8s_openapi::api::resource::v1::DeviceRequestAllocationResult,
    total: u64,
) -> Result<Option<u64>, String> {
    if result.share_id.is_none() {
        return Ok(None);
    }
    let consumed = result
        .consumed_capacity
        .as_ref()
        .and_then(|capacity| capacity.get(MEMORY_CAPACITY));
    let Some(consumed) = consumed else {
        // A share with no memory consumed asked for the policy's default:
        // the whole memory.
        return Ok(Some(total));
    };
    match whole_units(&consumed.0) {
        Some(bytes) if bytes > 0 && bytes <= total => Ok(Some(bytes)),
        _ => Err(format!(
            "consumed memory {:?} is not a quantity from 1 byte to the GPU's {total}",
            consumed.0
        )),
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use k8s_openapi::api::resource::v1::{
        AllocationResult, DeviceAllocationResult, DeviceRequestAllocationResult,
        ResourceClaimConsumerReference, ResourceClaimStatus,
    };
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

    use super::*;
    use crate::backend::fake::FakeBackend;
    use crate::backend::snapshot;

    pub(crate) fn on() -> DriverOnNode {
        DriverOnNode {
            driver: "gpu.tessera.dev".into(),
            node_name: "node-1".into(),
        }
    }

    /// A claim `ns/c` with UID `uid` allocated `(driver, pool, device)`s for request `gpus`.
    pub(crate) fn claim(uid: &str, results: &[(&str, &str, &str)]) -> ResourceClaim {
        ResourceClaim {
            metadata: ObjectMeta {
                namespace: Some("ns".into()),
                name: Some("c".into()),
                uid: Some(uid.into()),
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
                reserved_for: Some(vec![ResourceClaimConsumerReference {
                    resource: "pods".into(),
                    name: "p".into(),
                    uid: format!("pod-{uid}"),
                    api_group: None,
                }]),
                ..ResourceClaimStatus::default()
            }),
        }
    }

    /// `claim` with its first result made a memory share consuming `memory`.
    pub(crate) fn as_share(mut claim: ResourceClaim, memory: &str) -> ResourceClaim {
        let results = claim
            .status
            .as_mut()
            .and_then(|status| status.allocation.as_mut())
            .and_then(|allocation| allocation.devices.as_mut())
            .and_then(|devices| devices.results.as_mut());
        if let Some(result) = results.and_then(|results| results.first_mut()) {
            result.share_id = Some("0b8a1e52-3c4d-4e5f-8a9b-0c1d2e3f4a5b".into());
            result.consumed_capacity = Some(std::collections::BTreeMap::from([(
                "memory".to_string(),
                k8s_openapi::apimachinery::pkg::api::resource::Quantity(memory.into()),
            )]));
        }
        claim
    }

    fn node() -> Snapshot {
        snapshot(&mut FakeBackend::new("4xH100-80GiB").unwrap()).unwrap()
    }

    fn name(snap: &Snapshot, i: usize) -> String {
        pool_device_names(snap)[&snap.devices[i].info.id].clone()
    }

    #[test]
    fn the_devices_of_this_driver_on_this_node_in_order() {
        let snap = node();
        let (d2, d0) = (name(&snap, 2), name(&snap, 0));
        let claim = claim(
            "u",
            &[
                ("gpu.tessera.dev", "node-1", &d2),
                ("other.dev", "x", "y"),
                ("gpu.tessera.dev", "node-1", &d0),
            ],
        );
        let devices = allocated_devices(&claim, "u", &on(), &snap).unwrap();
        let ids: Vec<&str> = devices.iter().map(|d| d.state.info.id.as_str()).collect();
        assert_eq!(
            ids,
            [
                snap.devices[2].info.id.as_str(),
                snap.devices[0].info.id.as_str()
            ]
        );
        assert_eq!(devices[0].request, "gpus");
        assert_eq!(devices[0].name, d2);
    }

    #[test]
    fn a_gpu_in_mig_mode_is_not_prepared_whole() {
        let mut snap = node();
        snap.devices[0].info.mig = Some(crate::backend::test_mig(true, None));
        let d0 = name(&snap, 0);
        let claim = claim("u", &[("gpu.tessera.dev", "node-1", &d0)]);
        let err = allocated_devices(&claim, "u", &on(), &snap).unwrap_err();
        assert!(err.contains("is not a whole GPU: in MIG mode"), "{err}");
    }

    #[test]
    fn each_bad_allocation_is_one_sentence_for_its_claim() {
        let mut snap = node();
        snap.devices[1].health = RawHealth::Unhealthy("XID 79".into());
        let (d0, d1) = (name(&snap, 0), name(&snap, 1));
        let err = |claim: &ResourceClaim, uid: &str| {
            allocated_devices(claim, uid, &on(), &snap).unwrap_err()
        };

        let replaced = err(&claim("new", &[("gpu.tessera.dev", "node-1", &d0)]), "old");
        assert!(
            replaced.contains("claim ns/c has UID new, not old"),
            "{replaced}"
        );

        let mut unallocated = claim("u", &[]);
        unallocated.status = None;
        assert_eq!(err(&unallocated, "u"), "claim ns/c is not allocated");

        let others = err(&claim("u", &[("other.dev", "node-1", &d0)]), "u");
        assert_eq!(others, "claim ns/c has no device of driver gpu.tessera.dev");

        let bad = err(
            &claim(
                "u",
                &[
                    ("gpu.tessera.dev", "node-2", &d0),
                    ("gpu.tessera.dev", "node-1", "gpu-nope"),
                    ("gpu.tessera.dev", "node-1", &d1),
                    ("gpu.tessera.dev", "node-1", &d0),
                ],
            ),
            "u",
        );
        assert!(bad.starts_with("claim ns/c: "), "{bad}");
        assert!(
            bad.contains(&format!(
                "device node-2/{d0} is not on this node (its pool is node-2, this node's is node-1)"
            )),
            "{bad}"
        );
        assert!(
            bad.contains("device node-1/gpu-nope is not one of this node's GPUs"),
            "{bad}"
        );
        assert!(
            bad.contains(&format!(
                "device node-1/{d1} ({}) is unhealthy: XID 79",
                snap.devices[1].info.id
            )),
            "{bad}"
        );
    }
}
