//! Sizing a shared GPU's piece to the shard. An instance that shares GPUs
//! runs one shard on one device, and the devices it is offered range from a
//! small MIG partition to a whole GPU. Under `optimize: throughput` the
//! shard goes where it breaks nothing whole and takes the smallest piece
//! that holds it with its KV cache: taking more leaves less to the
//! instances after it for no gain in tokens per GPU. These are rules rather
//! than score weights because the score's memory part favours the roomiest
//! GPU, which is the opposite. Under `optimize: latency` every piece stays a
//! candidate and the score takes the fastest.

use super::exclusion::Exclusion;
use super::problem::{Device, ModelShape, Optimize, Problem, Stages, Strategy};
use super::speed::{GroupSpeed, layer_time};

/// Pieces within this share of the smallest count as the same size: MIG
/// profiles of one name differ by a few percent between GPU models.
const SAME_SIZE: f64 = 0.05;

/// Narrows the devices a shard that may share GPUs is offered, in turn:
/// - with a minimum speed, those that reach it with every tenant of their
///   GPU decoding at once;
/// - under throughput with `pack`, those on GPUs split already (partitions,
///   GPUs with memory shares) where one holds the shard: whole GPUs stay
///   whole;
/// - under throughput, the smallest pieces that hold the shard.
///
/// Does nothing unless the problem is one shard on one device and some
/// eligible device is part of a GPU.
pub(crate) fn narrow_shared_candidates(
    problem: &Problem,
    tensor: u32,
    exclusions: &mut [Vec<Option<Exclusion>>],
) {
    if tensor != 1 || problem.stages != Stages::Fixed(1) {
        return;
    }
    let any_share = problem
        .nodes
        .iter()
        .zip(exclusions.iter())
        .flat_map(|(node, excluded)| node.devices.iter().zip(excluded.iter()))
        .any(|(device, excluded)| excluded.is_none() && device.share.is_some());
    if !any_share {
        return;
    }
    let model = &problem.model;
    let need = model.overhead_bytes_per_device
        + f64::from(model.layers) * (model.weight_bytes_per_layer + model.kv_bytes_per_layer);
    if let Some(min) = problem.goal.min_tokens_per_second {
        exclude(problem, exclusions, |device| {
            let speed = contended_speed(model, device);
            (speed < min).then_some(Exclusion::TooSlowShared { speed })
        });
    }
    if problem.goal.optimize != Optimize::Throughput {
        return;
    }
    let holds = |device: &Device| device.memory_free_bytes as f64 >= need;
    if problem.strategy == Strategy::Pack
        && eligible(problem, exclusions).any(|device| device.on_split_gpu() && holds(device))
    {
        exclude(problem, exclusions, |device| {
            (!device.on_split_gpu()).then_some(Exclusion::KeptWhole)
        });
    }
    let smallest = eligible(problem, exclusions)
        .filter(|device| holds(device))
        .map(|device| device.taken_bytes(need))
        .min_by(f64::total_cmp);
    if let Some(smallest) = smallest {
        exclude(problem, exclusions, |device| {
            let taken = device.taken_bytes(need);
            (taken > smallest * (1.0 + SAME_SIZE))
                .then_some(Exclusion::LargerThanNeeded { taken, smallest })
        });
    }
}

/// The devices no exclusion rules out yet.
fn eligible<'a>(
    problem: &'a Problem,
    exclusions: &'a [Vec<Option<Exclusion>>],
) -> impl Iterator<Item = &'a Device> {
    problem
        .nodes
        .iter()
        .zip(exclusions)
        .flat_map(|(node, excluded)| node.devices.iter().zip(excluded))
        .filter(|(_, excluded)| excluded.is_none())
        .map(|(device, _)| device)
}

/// Excludes each eligible device `why` gives a reason for.
fn exclude(
    problem: &Problem,
    exclusions: &mut [Vec<Option<Exclusion>>],
    why: impl Fn(&Device) -> Option<Exclusion>,
) {
    for (node, excluded) in problem.nodes.iter().zip(exclusions.iter_mut()) {
        for (device, exclusion) in node.devices.iter().zip(excluded.iter_mut()) {
            if exclusion.is_none() {
                *exclusion = why(device);
            }
        }
    }
}

/// Predicted tokens/s of the whole model on one device, with every tenant
/// of its GPU decoding at once.
fn contended_speed(model: &ModelShape, device: &Device) -> f64 {
    let speed = GroupSpeed::of(device, model.precision).split(device.tenants() + 1);
    let seconds = f64::from(model.layers) * layer_time(model, 1, &speed).total();
    if seconds > 0.0 { 1.0 / seconds } else { 0.0 }
}
