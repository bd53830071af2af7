//! A node's published GPUs as the devices the solver may plan an instance
//! on: whole GPUs always, and for an instance that shares GPUs the MIG
//! partitions and memory shares its node hands out. Whatever part of a GPU
//! becomes a device, its memory, compute and bandwidth are worked out here
//! once, so the solver and everything after it read devices alone.

use std::collections::HashMap;

use super::{ClusterNode, HeldShares};
use crate::api::telemetry::planned_free_memory;
use crate::api::{
    GpuDevice, GpuPartition, Health, MigState, ShardShare, ShareKind, Sharing, Vendor,
};
use crate::placement::{Device, DeviceShare, Performance, StagePlan, StageShare};

/// The devices of `node` an instance with `sharing` may be planned on.
pub(super) fn planned_devices(
    node: &ClusterNode,
    sharing: Sharing,
    allocated: &HashMap<(String, String), String>,
    shares: &HeldShares,
) -> Vec<Device> {
    let offers = node.gpu_state.shares;
    let mut devices = Vec::with_capacity(node.gpu_state.devices.len());
    for gpu in &node.gpu_state.devices {
        let key = (node.name.clone(), gpu.id.clone());
        let held_shares = shares.get(&key).map_or(&[][..], Vec::as_slice);
        let mut device = whole(gpu);
        device.allocated_to = allocated.get(&key).cloned();
        let shareable = gpu.mig.as_ref().is_none_or(MigState::whole);
        if sharing == Sharing::Shared && offers.memory && shareable {
            let held: u64 = held_shares.iter().map(|(_, bytes)| bytes).sum();
            let left = gpu.memory_total_bytes.saturating_sub(held);
            device.memory_free_bytes = device.memory_free_bytes.min(planned_free_memory(left));
            device.share = Some(DeviceShare::Memory {
                tenants: u32::try_from(held_shares.len()).unwrap_or(u32::MAX),
            });
        } else if device.allocated_to.is_none() && !held_shares.is_empty() {
            let holders: Vec<&str> = held_shares.iter().map(|(who, _)| who.as_str()).collect();
            device.allocated_to = Some(format!("memory shares of {}", holders.join(", ")));
        }
        devices.push(device);
        if sharing != Sharing::Exclusive
            && offers.partitions
            && let Some(mig) = &gpu.mig
        {
            for partition in mig.usable_partitions() {
                let mut device = partition_device(gpu, mig, partition);
                device.allocated_to = allocated
                    .get(&(node.name.clone(), partition.id.clone()))
                    .cloned();
                devices.push(device);
            }
        }
    }
    devices
}

/// A GPU as a whole device.
fn whole(gpu: &GpuDevice) -> Device {
    Device {
        id: gpu.id.clone(),
        index: gpu.index,
        vendor: gpu.vendor.as_str().to_string(),
        product: gpu.product.clone(),
        memory_total_bytes: gpu.memory_total_bytes,
        memory_free_bytes: planned_free_memory(gpu.memory_free_bytes),
        fp16_tflops: gpu.fp16_tflops,
        fp8_tflops: gpu.fp8_tflops,
        fp4_tflops: gpu.fp4_tflops,
        memory_bandwidth_gbps: gpu.memory_bandwidth_gbps,
        temperature_c: gpu.temperature_c,
        // A vendor this build does not know has no runtime we can hand out.
        healthy: gpu.health == Health::Healthy && gpu.vendor != Vendor::Unknown,
        health_reason: match (gpu.health, gpu.vendor) {
            (_, Vendor::Unknown) => Some("vendor unknown to this tessera build".into()),
            (Health::Unknown, _) => Some("health state unknown to this tessera build".into()),
            _ => gpu.health_reason.clone(),
        },
        allocated_to: None,
        not_whole: gpu.mig.as_ref().and_then(MigState::why_not_whole),
        share: None,
    }
}

/// A MIG partition as a device of its own: its memory, its multiprocessors'
/// share of the GPU's compute and its memory slices' share of the GPU's
/// bandwidth; health and temperature are the GPU's.
fn partition_device(gpu: &GpuDevice, mig: &MigState, partition: &GpuPartition) -> Device {
    let compute = f64::from(partition.multiprocessors) / f64::from(mig.multiprocessors.max(1));
    let bandwidth = f64::from(partition.placement_size) / f64::from(mig.memory_slices.max(1));
    Device {
        id: partition.id.clone(),
        product: format!("{} MIG {}", gpu.product, partition.profile),
        memory_total_bytes: partition.memory_total_bytes,
        memory_free_bytes: planned_free_memory(partition.memory_total_bytes),
        fp16_tflops: gpu.fp16_tflops * compute,
        fp8_tflops: gpu.fp8_tflops.map(|rate| rate * compute),
        fp4_tflops: gpu.fp4_tflops.map(|rate| rate * compute),
        memory_bandwidth_gbps: gpu.memory_bandwidth_gbps * bandwidth,
        not_whole: None,
        share: Some(DeviceShare::Partition {
            gpu: gpu.id.clone(),
            profile: partition.profile.clone(),
            gpu_tflops: gpu.fp16_tflops,
        }),
        ..whole(gpu)
    }
}

/// The part of a GPU a planned stage was given, as the status records it.
pub(super) fn shard_share(stage: &StagePlan, performance: &Performance) -> Option<ShardShare> {
    let gpu_of_stage = || stage.devices.first().cloned().unwrap_or_default();
    let contended = performance
        .contended_tokens_per_second
        .map(|speed| (speed * 10.0).round() / 10.0);
    Some(match stage.share.as_ref()? {
        StageShare::Partition { gpu, profile } => ShardShare {
            kind: ShareKind::Partition,
            gpu: gpu.clone(),
            profile: Some(profile.clone()),
            memory_gib: None,
            memory_fraction: None,
            tenants: 0,
            contended_tokens_per_second: None,
        },
        StageShare::Memory {
            bytes,
            fraction,
            tenants,
        } => ShardShare {
            kind: ShareKind::Memory,
            gpu: gpu_of_stage(),
            profile: None,
            memory_gib: u32::try_from(bytes >> 30).ok(),
            memory_fraction: Some((fraction * 1000.0).round() / 1000.0),
            tenants: *tenants,
            contended_tokens_per_second: contended,
        },
    })
}
