//! A GPU in MIG mode as its node's ResourceSlices show it: each partition a
//! device of its own, and the GPU one counter set — a counter per memory
//! slice and one for its multiprocessors — that every partition consumes
//! its share of (partitionable devices, KEP-4815). An allocator that sums
//! consumption then never hands out two partitions on the same slices, not
//! even across a change of the GPU's layout while claims still hold the
//! old partitions.

use std::collections::BTreeMap;

use k8s_openapi::api::resource::v1::{
    Counter, CounterSet, Device, DeviceAttribute, DeviceCapacity, DeviceCounterConsumption,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;

use super::slice_fields::{MEMORY_CAPACITY, string_attribute, unhealthy_taint};
use crate::backend::{DeviceState, RawHealth};
use tessera_core::api::{DRA_ID_ATTRIBUTE, GpuPartition, MigState, SliceOwners};

/// The counter of memory slice `i` in a GPU's counter set.
pub(crate) fn memory_slice_counter(slice: u32) -> String {
    format!("memory-slice-{slice}")
}

/// The counter of a GPU's multiprocessors.
pub(crate) const MULTIPROCESSORS: &str = "multiprocessors";

/// The partitions of `state` (a GPU in MIG mode with none of its mode
/// change pending) as devices named by `names`, and the GPU's counter set.
/// `taints`: whether an unhealthy GPU's partitions carry the taint (else
/// they are left out, and so is the counter set).
pub(crate) fn partition_devices(
    state: &DeviceState,
    mig: &MigState,
    names: &BTreeMap<String, String>,
    driver: &str,
    taints: bool,
) -> Option<(Vec<Device>, CounterSet)> {
    let counter_set = names.get(&state.info.id)?.clone();
    let healthy = state.health == RawHealth::Healthy;
    if !healthy && !taints {
        return None;
    }
    let mut counters: BTreeMap<String, Counter> = (0..mig.memory_slices)
        .map(|slice| (memory_slice_counter(slice), count(1)))
        .collect();
    counters.insert(MULTIPROCESSORS.to_string(), count(mig.multiprocessors));
    let owners = SliceOwners::new(mig.memory_slices);
    let devices = mig
        .usable_partitions()
        .iter()
        .filter_map(|partition| {
            let span = owners.span(partition.placement_start, partition.placement_size)?;
            let mut consumed: BTreeMap<String, Counter> = span
                .map(|slice| (memory_slice_counter(slice), count(1)))
                .collect();
            consumed.insert(
                MULTIPROCESSORS.to_string(),
                count(partition.multiprocessors),
            );
            Some(Device {
                name: names.get(&partition.id)?.clone(),
                attributes: Some(attributes(state, partition)),
                capacity: Some(BTreeMap::from([(
                    MEMORY_CAPACITY.to_string(),
                    DeviceCapacity {
                        value: Quantity(partition.memory_total_bytes.to_string()),
                        request_policy: None,
                    },
                )])),
                consumes_counters: Some(vec![DeviceCounterConsumption {
                    counter_set: counter_set.clone(),
                    counters: consumed,
                    ..DeviceCounterConsumption::default()
                }]),
                taints: (!healthy).then(|| vec![unhealthy_taint(driver)]),
                ..Device::default()
            })
        })
        .collect();
    Some((
        devices,
        CounterSet {
            name: counter_set,
            counters,
        },
    ))
}

fn count(value: u32) -> Counter {
    Counter {
        value: Quantity(value.to_string()),
    }
}

/// What a selector reads of a partition: its own ID (the `MIG-…` UUID a
/// container is given), its GPU's, its profile; vendor, product and index are
/// its GPU's. No PCI address and no scale-up domain: partitions share their
/// GPU's address and have no peer-to-peer between them.
fn attributes(state: &DeviceState, partition: &GpuPartition) -> BTreeMap<String, DeviceAttribute> {
    let info = &state.info;
    let mut attributes = BTreeMap::new();
    for (key, value) in [
        (DRA_ID_ATTRIBUTE, partition.id.as_str()),
        ("uuid", partition.id.as_str()),
        ("parent", info.id.as_str()),
        ("profile", partition.profile.as_str()),
        ("vendor", info.vendor.as_str()),
        ("product", info.product.as_str()),
        ("architecture", info.architecture.as_str()),
    ] {
        if let Some(attribute) = string_attribute(value) {
            attributes.insert(key.to_string(), attribute);
        }
    }
    attributes.insert(
        "index".to_string(),
        DeviceAttribute {
            int: Some(i64::from(info.index)),
            ..DeviceAttribute::default()
        },
    );
    attributes
}
