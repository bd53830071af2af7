//! How many sequences fit: the KV bytes a token takes on each device, the
//! memory a runtime leaves for the cache once the weights are in, and the
//! largest concurrency that memory and the runtime's batch cap allow.
//!
//! A sequence is charged its whole length (input + output tokens): a
//! runtime that admits a request it cannot finish has to preempt it later,
//! and TensorRT-LLM's default scheduler reserves the whole length up front.

use serde::Serialize;

use super::runtime::MemoryRule;
use super::{Refusal, RuntimeConfig, ServingInput, ServingModel};
use crate::api::GIB;

/// What bounds a replica's concurrency.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub enum Limit {
    /// The KV cache holds no more sequences of the workload's length.
    KvCache,
    /// The runtime batches no more (its `max_num_seqs` or equivalent).
    Runtime,
}

/// How many sequences a replica can decode together.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Concurrency {
    /// The smaller of the two limits below: at least 1.
    pub max: u32,
    /// Sequences of the workload's length the KV cache holds.
    pub kv_limit: u32,
    /// The runtime's batch cap.
    pub runtime_cap: u32,
    pub limited_by: Limit,
    /// KV bytes one token takes across the whole replica, heads replicated
    /// for a tensor group larger than the model's KV heads counted.
    pub kv_bytes_per_token: f64,
    /// KV bytes one sequence (input + output tokens) takes.
    pub kv_bytes_per_sequence: f64,
    /// Memory of the replica left for the KV cache (or reserved for it).
    pub kv_cache_bytes: f64,
}

/// Attention heads as the KV cache and the prefill's attention see them.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) struct Attention {
    pub(super) heads: f64,
    pub(super) kv_heads: f64,
    pub(super) head_dim: f64,
}

impl Attention {
    /// The model's heads; unknown ones conservatively (see [`ServingModel`]):
    /// 128-wide heads filling the hidden size, one KV head per head.
    pub(super) fn of(model: &ServingModel) -> Attention {
        let hidden = model.spec.effective_hidden_size();
        let head_dim = match (model.head_dim, model.spec.attention_heads) {
            (Some(dim), _) => f64::from(dim),
            (None, Some(heads)) => hidden / f64::from(heads),
            (None, None) => 128.0,
        };
        let heads = model
            .spec
            .attention_heads
            .map_or_else(|| (hidden / head_dim).round().max(1.0), f64::from);
        let kv_heads = model.spec.kv_heads.map_or(heads, f64::from);
        Attention {
            heads,
            kv_heads,
            head_dim,
        }
    }

    /// KV heads each device of a group of `tensor` holds: the heads are
    /// split across the group, and when the group is larger than the
    /// model's KV heads each device still holds one (the heads are
    /// replicated; vLLM and TensorRT-LLM both do this).
    pub(super) fn kv_heads_per_device(&self, tensor: u32) -> f64 {
        (self.kv_heads / f64::from(tensor.max(1))).ceil().max(1.0)
    }

    /// KV bytes one token takes in one layer on one device of the group:
    /// a key and a value vector per KV head.
    pub(super) fn kv_bytes_per_device_layer(&self, tensor: u32, bytes_per_element: f64) -> f64 {
        2.0 * self.kv_heads_per_device(tensor) * self.head_dim * bytes_per_element
    }
}

/// KV bytes one token takes in one layer when one device holds all its KV
/// heads, stored as the runtime stores it.
pub fn kv_bytes_per_token_layer(model: &ServingModel, runtime: &RuntimeConfig) -> f64 {
    Attention::of(model)
        .kv_bytes_per_device_layer(1, runtime.kv_bytes_per_element(model.spec.dtype))
}

impl ServingModel {
    /// KV bytes one token takes across a tensor group of `tensor` holding all
    /// layers: `2 × layers × KV heads × head dim × bytes per element`, with
    /// replicated heads counted once per device that holds them.
    pub fn kv_bytes_per_token(&self, tensor: u32, bytes_per_element: f64) -> f64 {
        Attention::of(self).kv_bytes_per_device_layer(tensor, bytes_per_element)
            * f64::from(tensor.max(1))
            * f64::from(self.spec.layers)
    }
}

/// Memory of one device a runtime leaves for the KV cache, or `None` when the
/// weights and overhead do not fit (with what they need and what it may use).
fn room(
    rule: MemoryRule,
    share: f64,
    memory: f64,
    weights: f64,
    overhead: f64,
) -> Result<f64, (f64, f64)> {
    let (room, usable) = match rule {
        MemoryRule::ShareOfTotal { activations_inside } => {
            let overhead = if activations_inside { overhead } else { 0.0 };
            (memory * share - weights - overhead, memory * share)
        }
        MemoryRule::ShareOfFree => ((memory - weights - overhead) * share, memory),
    };
    if room > 0.0 {
        Ok(room)
    } else {
        Err((weights + overhead, usable))
    }
}

/// The replica's concurrency limits; `layers` are the stages' layer counts.
pub(super) fn concurrency(input: &ServingInput, layers: &[u32]) -> Result<Concurrency, Refusal> {
    let spec = &input.model.spec;
    let tensor = input.plan.tensor.max(1);
    let group = f64::from(tensor);
    let runtime = &input.runtime;
    let rule = runtime.runtime.memory_rule();
    let share = runtime.memory_utilization(tensor);
    let per_layer = Attention::of(&input.model)
        .kv_bytes_per_device_layer(tensor, runtime.kv_bytes_per_element(spec.dtype));
    let sequence_tokens = input.workload.sequence_tokens();
    let weights_per_layer = spec.weight_bytes_per_layer();
    let overhead = spec.overhead_gib * GIB;
    let reserved = spec.reserved_kv_gib().unwrap_or(0.0) * GIB;
    let all_layers = f64::from(spec.layers.max(1));

    let mut sequences = f64::INFINITY;
    let mut cache_bytes = 0.0;
    let mut token_bytes = 0.0;
    for (stage, (plan, &count)) in input.plan.stages.iter().zip(layers).enumerate() {
        let count = f64::from(count);
        let weights = weights_per_layer * count / group;
        let room = room(rule, share, plan.gpu.memory_bytes, weights, overhead).map_err(
            |(need, usable)| Refusal::WeightsDoNotFit {
                stage,
                need_gib: need / GIB,
                usable_gib: usable / GIB,
            },
        )?;
        let cache = if reserved > 0.0 {
            let mine = reserved * count / all_layers / group;
            if mine > room {
                return Err(Refusal::ReservationDoesNotFit {
                    stage,
                    reserved_gib: mine / GIB,
                    room_gib: room / GIB,
                });
            }
            mine
        } else {
            room
        };
        let sequence = per_layer * count * sequence_tokens;
        if cache < sequence {
            return Err(Refusal::NoSequenceFits {
                stage,
                tokens: sequence_tokens,
                sequence_gib: sequence / GIB,
                room_gib: cache / GIB,
            });
        }
        sequences = sequences.min(cache / sequence);
        cache_bytes += cache * group;
        token_bytes += per_layer * count * group;
    }
    // At least one sequence fits (checked above); the float is finite.
    let kv_limit = if sequences >= f64::from(u32::MAX) {
        u32::MAX
    } else {
        sequences.floor().max(1.0) as u32
    };
    let runtime_cap = runtime
        .max_num_seqs(super::runtime::all_large(&input.plan))
        .max(1);
    let (max, limited_by) = if kv_limit <= runtime_cap {
        (kv_limit, Limit::KvCache)
    } else {
        (runtime_cap, Limit::Runtime)
    };
    Ok(Concurrency {
        max,
        kv_limit,
        runtime_cap,
        limited_by,
        kv_bytes_per_token: token_bytes,
        kv_bytes_per_sequence: token_bytes * sequence_tokens,
        kv_cache_bytes: cache_bytes,
    })
}

#[cfg(test)]
mod tests {
    use super::super::testutil::*;
    use super::super::{Replica, Runtime};
    use super::*;
    use crate::api::DType;

    #[test]
    fn llama_3_1_8b_takes_128_kib_per_token_in_16_bits() {
        let model = llama("8b", DType::Bf16);
        assert_eq!(model.kv_bytes_per_token(1, 2.0), 128.0 * 1024.0);
        // Eight KV heads split over a group of 8: the same bytes in all.
        assert_eq!(model.kv_bytes_per_token(8, 2.0), 128.0 * 1024.0);
        assert_eq!(model.kv_bytes_per_token(1, 1.0), 64.0 * 1024.0);
    }

    #[test]
    fn a_group_larger_than_the_kv_heads_replicates_them() {
        let model = llama("8b", DType::Bf16);
        let attention = Attention::of(&model);
        assert_eq!(attention.kv_heads_per_device(4), 2.0);
        assert_eq!(attention.kv_heads_per_device(8), 1.0);
        assert_eq!(attention.kv_heads_per_device(16), 1.0);
        // Sixteen devices each hold one of the eight heads: twice the bytes.
        assert_eq!(model.kv_bytes_per_token(16, 2.0), 2.0 * 128.0 * 1024.0);
    }

    #[test]
    fn unknown_heads_are_taken_as_no_grouped_query_attention() {
        let mut model = llama("8b", DType::Bf16);
        model.spec.attention_heads = None;
        model.spec.kv_heads = None;
        let attention = Attention::of(&model);
        assert_eq!(attention.head_dim, 128.0);
        assert_eq!(attention.heads, 32.0);
        assert_eq!(attention.kv_heads, 32.0);
        // Four times Llama-3.1-8B's real cache: never more sequences than it has.
        assert_eq!(model.kv_bytes_per_token(1, 2.0), 512.0 * 1024.0);
    }

    #[test]
    fn weights_filling_the_memory_leave_room_for_few_sequences() {
        let model = || llama("70b", DType::Fp8);
        let on = |gpu, tensor| {
            let mut input = input(gpu, tensor, model(), Runtime::Vllm);
            input.workload.input_tokens = 128.0;
            input.workload.output_tokens = 2048.0;
            input.runtime.max_num_seqs = Some(4096);
            Replica::new(&input).expect("it fits").concurrency().max
        };
        let (h100, h200, two_h100) = (on(h100(), 1), on(h200(), 1), on(h100(), 2));
        assert!(h100 >= 1, "{h100}");
        assert!(h200 > 4 * h100, "one H200 {h200} vs one H100 {h100}");
        assert!(two_h100 > 4 * h100, "two H100s {two_h100} vs one {h100}");
    }

    #[test]
    fn a_checkpoint_larger_than_its_dtype_leaves_less_cache_and_reads_more() {
        // A 70B FP8 checkpoint that keeps attention in BF16 (as Meta's 405B
        // FP8 does): some 77 GiB, not the 65.8 of its parameters in FP8.
        let on_two = |weights_gib| {
            let mut model = llama("70b", DType::Fp8);
            model.spec.weights_gib = weights_gib;
            let mut input = input(h100(), 2, model, Runtime::Vllm);
            input.workload.input_tokens = 128.0;
            input.workload.output_tokens = 2048.0;
            Replica::new(&input).expect("it fits")
        };
        let (as_dtype, as_stored) = (on_two(None), on_two(Some(77.0)));
        let (cache, stored_cache) = (
            as_dtype.concurrency().kv_cache_bytes,
            as_stored.concurrency().kv_cache_bytes,
        );
        // The cache loses what the weights gained.
        let gained = 77.0 * GIB - 70.6e9;
        assert!(
            ((cache - stored_cache) - gained).abs() < 0.02 * gained,
            "{cache} {stored_cache} {gained}"
        );
        assert!(as_stored.concurrency().max < as_dtype.concurrency().max);
        // A decode step of one sequence reads the larger weights.
        let step = |replica: &Replica| replica.at(1).tpot_ms;
        let ratio = step(&as_stored) / step(&as_dtype);
        assert!(ratio > 1.05 && ratio < 77.0 * GIB / 70.6e9, "{ratio}");
    }

    #[test]
    fn the_runtime_cap_or_the_cache_bounds_the_concurrency() {
        let mut small = input(h100(), 1, llama("8b", DType::Bf16), Runtime::Vllm);
        small.workload.input_tokens = 100.0;
        small.workload.output_tokens = 100.0;
        let capped = Replica::new(&small).expect("fits");
        // vLLM's V1 engine on an H100: 1024 sequences; its V0 engine 256.
        assert_eq!(capped.concurrency().max, 1024);
        assert_eq!(capped.concurrency().limited_by, Limit::Runtime);
        let mut v0 = small.clone();
        v0.runtime.version = Some(crate::api::RuntimeVersion::new(0, 6, 0));
        assert_eq!(Replica::new(&v0).expect("fits").concurrency().max, 256);
        let mut long = small.clone();
        long.workload.input_tokens = 20000.0;
        long.workload.output_tokens = 2000.0;
        let cache = *Replica::new(&long).expect("fits").concurrency();
        assert_eq!(cache.limited_by, Limit::KvCache);
        assert!(cache.max < 256 && cache.max == cache.kv_limit);
        assert!(cache.kv_cache_bytes >= f64::from(cache.max) * cache.kv_bytes_per_sequence);
    }

    #[test]
    fn a_fixed_reservation_replaces_what_is_left_and_must_fit() {
        let mut reserved = input(h100(), 1, llama("8b", DType::Bf16), Runtime::Vllm);
        reserved.model.spec.kv_cache_gib = Some(10.0);
        let concurrency = *Replica::new(&reserved).expect("fits").concurrency();
        assert_eq!(concurrency.kv_cache_bytes, 10.0 * GIB);
        // 10 GiB of 128 KiB tokens, 2000 tokens a sequence.
        assert_eq!(concurrency.kv_limit, 40);
        reserved.model.spec.kv_cache_gib = Some(70.0);
        let refusal = Replica::new(&reserved).expect_err("70 GiB beside 15 GiB of weights");
        assert!(
            matches!(refusal, Refusal::ReservationDoesNotFit { .. }),
            "{refusal}"
        );
    }

    #[test]
    fn a_sequence_longer_than_the_cache_is_refused() {
        let mut input = input(h100(), 1, llama("70b", DType::Fp8), Runtime::Vllm);
        input.workload.input_tokens = 1e6;
        let refusal = Replica::new(&input).expect_err("a million tokens");
        assert!(
            matches!(refusal, Refusal::NoSequenceFits { .. }),
            "{refusal}"
        );
    }

    #[test]
    fn runtimes_leave_the_cache_what_their_rules_say() {
        let memory = 80.0 * GIB;
        let (weights, overhead) = (16.0 * GIB, 2.0 * GIB);
        let vllm = room(
            MemoryRule::ShareOfTotal {
                activations_inside: true,
            },
            0.9,
            memory,
            weights,
            overhead,
        );
        let sglang = room(
            MemoryRule::ShareOfTotal {
                activations_inside: false,
            },
            0.9,
            memory,
            weights,
            overhead,
        );
        let trt = room(MemoryRule::ShareOfFree, 0.9, memory, weights, overhead);
        assert_eq!(vllm, Ok(72.0 * GIB - 18.0 * GIB));
        assert_eq!(sglang, Ok(72.0 * GIB - 16.0 * GIB));
        assert_eq!(trt, Ok(62.0 * GIB * 0.9));
        assert!(room(MemoryRule::ShareOfFree, 0.9, memory, memory, 0.0).is_err());
    }
}
