//! What a careful user without tessera writes to run a ModelInstance on
//! kube-scheduler with DRA, for the comparison with tessera's placement: one
//! pod per shard, each with a ResourceClaimTemplate of
//! - `count` = the shard's GPUs (tensor size);
//! - a `matchAttribute` constraint on the driver's `scaleUpDomain`, so the
//!   GPUs share one NVLink/xGMI domain;
//! - a CEL selector on the memory capacity: what each GPU needs for its share
//!   of the weights and KV cache, plus the per-GPU overhead (tessera's own
//!   estimate, rounded up to whole GiB);
//! - the instance's product constraints as CEL selectors.
//!
//! The sizes are the instance's where it fixes them. Where it says `auto`,
//! the user picks the smallest that holds the model: a pipeline of one stage
//! where some tensor size does, and the smallest tensor size of 1, 2, 4 or 8
//! whose per-GPU share fits the largest GPU of the cluster; else the fewest
//! 8-GPU stages that do.
// Each benchmark binary uses its own part of the support module.
#![allow(dead_code)]

use k8s_openapi::api::resource::v1::{
    CELDeviceSelector, DeviceClaim, DeviceConstraint, DeviceRequest, DeviceSelector,
    ExactDeviceRequest, ResourceClaimSpec, ResourceClaimTemplate, ResourceClaimTemplateSpec,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use tessera::api::{ModelInstanceSpec, PipelineStages, TensorSize};

const GIB: u64 = 1 << 30;
/// The request's name in every template.
pub(crate) const REQUEST: &str = "gpus";
const TENSOR_SIZES: [u32; 4] = [1, 2, 4, 8];

/// One shard as the user sizes it.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct UserShard {
    pub(crate) gpus: u32,
    /// What each of its GPUs must have, in whole GiB.
    pub(crate) memory_gib: u64,
}

/// The shards of one replica; an error when no size the user could pick
/// holds the model on GPUs of `largest_gpu_bytes`.
pub(crate) fn user_shards(
    spec: &ModelInstanceSpec,
    largest_gpu_bytes: u64,
) -> Result<Vec<UserShard>, String> {
    let shape = tessera::placement::ModelShape::of(&spec.model);
    let per_gpu = |stages: u32, tensor: u32| {
        let layers = shape.layers.div_ceil(stages);
        let share = f64::from(layers) * (shape.weight_bytes_per_layer + shape.kv_bytes_per_layer)
            / f64::from(tensor);
        (share + shape.overhead_bytes_per_device).ceil() as u64
    };
    let fits = |stages: u32, tensor: u32| per_gpu(stages, tensor) <= largest_gpu_bytes;
    let tensors: Vec<u32> = match spec.parallelism.tensor {
        TensorSize::Fixed(size) => vec![size],
        TensorSize::Auto => TENSOR_SIZES.to_vec(),
    };
    let (stages, tensor) = match spec.parallelism.pipeline {
        PipelineStages::Fixed(stages) => {
            let tensor = tensors.iter().copied().find(|&t| fits(stages, t));
            (stages, tensor.unwrap_or(tensors[tensors.len() - 1]))
        }
        PipelineStages::Auto => (1..=shape.layers)
            .find_map(|stages| {
                let tensor = tensors.iter().copied().find(|&t| fits(stages, t))?;
                Some((stages, tensor))
            })
            .ok_or_else(|| {
                format!(
                    "no pipeline of {:?} GPUs per stage holds {} on GPUs of {} GiB",
                    tensors,
                    spec.model.name,
                    largest_gpu_bytes / GIB
                )
            })?,
    };
    let memory_gib = per_gpu(stages, tensor).div_ceil(GIB);
    Ok((0..stages)
        .map(|_| UserShard {
            gpus: tensor,
            memory_gib,
        })
        .collect())
}

/// The ResourceClaimTemplate `name` of one shard, for `driver`'s devices.
pub(crate) fn claim_template(
    name: &str,
    driver: &str,
    shard: &UserShard,
    spec: &ModelInstanceSpec,
) -> ResourceClaimTemplate {
    let mut selectors = vec![format!(
        "device.capacity['{driver}'].memory.compareTo(quantity('{}Gi')) >= 0",
        shard.memory_gib
    )];
    if !spec.placement.products.is_empty() {
        // tessera matches products as case-insensitive substrings; so does the user.
        let any: Vec<String> = spec
            .placement
            .products
            .iter()
            .map(|p| {
                format!(
                    "device.attributes['{driver}'].product.lowerAscii().contains('{}')",
                    p.to_lowercase().replace('\\', "\\\\").replace('\'', "\\'")
                )
            })
            .collect();
        selectors.push(any.join(" || "));
    }
    ResourceClaimTemplate {
        metadata: ObjectMeta {
            name: Some(name.to_string()),
            ..ObjectMeta::default()
        },
        spec: Some(ResourceClaimTemplateSpec {
            metadata: None,
            spec: Some(ResourceClaimSpec {
                devices: Some(DeviceClaim {
                    requests: Some(vec![DeviceRequest {
                        name: REQUEST.to_string(),
                        exactly: Some(ExactDeviceRequest {
                            device_class_name: driver.to_string(),
                            allocation_mode: Some("ExactCount".to_string()),
                            count: Some(i64::from(shard.gpus)),
                            selectors: Some(
                                selectors
                                    .into_iter()
                                    .map(|expression| DeviceSelector {
                                        cel: Some(CELDeviceSelector { expression }),
                                    })
                                    .collect(),
                            ),
                            ..ExactDeviceRequest::default()
                        }),
                        ..DeviceRequest::default()
                    }]),
                    // One GPU needs no domain: the constraint would only cost
                    // the allocator time.
                    constraints: (shard.gpus > 1).then(|| {
                        vec![DeviceConstraint {
                            requests: Some(vec![REQUEST.to_string()]),
                            match_attribute: Some(format!("{driver}/scaleUpDomain")),
                            ..DeviceConstraint::default()
                        }]
                    }),
                    ..DeviceClaim::default()
                }),
            }),
        }),
    }
}
