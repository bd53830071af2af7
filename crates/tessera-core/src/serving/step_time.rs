//! What one batch step costs: a decode step over `b` sequences, one
//! request's prefill, and what a request waits for its first token.
//!
//! A decode step over `b` sequences is the solver's single-stream step plus
//! what each further sequence adds:
//!
//! - weights are read once a step whatever `b`; the batch's matrix
//!   multiplications (2 × parameters FLOPs a token) overlap that read and
//!   take over once they need longer (`max(weights, compute)`);
//! - each further sequence reads its KV cache, at the mean context (input +
//!   half the output), after the matrix multiplications (attention kernels
//!   run on their own, so their time adds);
//! - each further token adds its activations to the two all-reduces a layer;
//! - the per-layer overhead and the all-reduce latencies stay as they are.
//!
//! The first sequence's attention is inside the single-stream figures (their
//! per-layer overhead covers attention over a short context), which is what
//! makes concurrency 1 exactly the solver's prediction.
//!
//! With `p` pipeline stages and `b ≥ p` sequences, the runtime keeps `p`
//! micro-batches of `b / p` in flight (fewer when `b < p`): a token's time is
//! the longer of one micro-batch's trip through every stage and its hops, and
//! the busiest stage working through all the micro-batches, each of which
//! reads that stage's weights again.
//!
//! Prefill is compute-bound: 2 × parameters FLOPs per prompt token plus the
//! causal attention over the prompt (2 × layers × query width × n² FLOPs), at
//! the runtime's efficiency. In the steady state, prompts are prefilled in the
//! same steps as the decodes (chunked prefill in vLLM's V1 engine and SGLang,
//! in-flight batching of context and generation in TensorRT-LLM): while a
//! request decodes, the prefills of the requests that replace the ones
//! finishing ride along and lengthen its time per token.

use super::constants::Constants;
use super::kv_cache::Attention;
use super::{ServingInput, ServingPoint};
use crate::placement::ModelShape;
use crate::placement::speed::{GroupSpeed, layer_time, link_gbps};

/// One stage's costs for all its layers, in seconds.
#[derive(Clone, Copy, Debug, PartialEq)]
struct StageCost {
    /// The solver's single-stream step of this stage: one token, one
    /// sequence.
    single: f64,
    /// Its weight read and its one-token compute (the single step overlaps
    /// them).
    weights: f64,
    compute_single: f64,
    /// The batch's matrix multiplications for each further token.
    compute_per_token: f64,
    /// Reading one further sequence's KV cache at the mean context.
    kv_read_per_sequence: f64,
    /// One further token's share of the all-reduces.
    transfer_per_token: f64,
    /// Causal attention over a prompt of `n` tokens costs this × n².
    attention_per_square_token: f64,
}

impl StageCost {
    /// A decode step over `sequences` (at least 1; a micro-batch may be a
    /// fraction on average).
    fn decode(&self, sequences: f64) -> f64 {
        let extra = (sequences - 1.0).max(0.0);
        let overlapped = self.weights.max(self.compute_single);
        let batched = self
            .weights
            .max(self.compute_single + extra * self.compute_per_token);
        self.single
            + (batched - overlapped)
            + extra * (self.kv_read_per_sequence + self.transfer_per_token)
    }

    /// A prompt of `tokens` alone on the stage.
    fn prefill_alone(&self, tokens: f64) -> f64 {
        let extra = (tokens - 1.0).max(0.0);
        let overlapped = self.weights.max(self.compute_single);
        let prompt = self.weights.max(
            self.compute_single
                + extra * self.compute_per_token
                + self.attention_per_square_token * tokens * tokens,
        );
        self.single + (prompt - overlapped) + extra * self.transfer_per_token
    }

    /// What a prompt of `tokens` adds to the steps it is chunked into: its
    /// compute, its attention and its all-reduce traffic (the weights are
    /// being read for the decode anyway).
    fn prefill_work(&self, tokens: f64) -> f64 {
        tokens * (self.compute_per_token + self.transfer_per_token)
            + self.attention_per_square_token * tokens * tokens
    }
}

/// A replica's step costs for its workload.
#[derive(Clone, Debug, PartialEq)]
pub(super) struct StepModel {
    stages: Vec<StageCost>,
    /// One token's activations over a pipeline hop, and the hop's latency.
    hop_per_token: f64,
    hop_latency: f64,
    input_tokens: f64,
    output_tokens: f64,
    chunk_tokens: f64,
    /// Every step time × this (a measured correction; 1 as fitted).
    scale: f64,
}

impl StepModel {
    /// `layers`: each stage's layer count. The input is validated already.
    pub(super) fn new(input: &ServingInput, layers: &[u32], constants: &Constants) -> StepModel {
        let spec = &input.model.spec;
        let shape = ModelShape::of(spec);
        let no_activations = ModelShape {
            activation_bytes_per_token: 0.0,
            ..shape.clone()
        };
        let tensor = input.plan.tensor.max(1);
        let size = f64::from(tensor);
        let runtime = &input.runtime;
        let attention = Attention::of(&input.model);
        let query_width = attention.heads * attention.head_dim;
        let kv_per_layer =
            attention.kv_bytes_per_device_layer(tensor, runtime.kv_bytes_per_element(spec.dtype));
        let input_tokens = input.workload.input_tokens.max(1.0);
        let output_tokens = input.workload.output_tokens.max(1.0);
        let mean_context = input_tokens + output_tokens / 2.0;
        // A device's query heads over the KV heads it holds (at least one).
        let query_heads_per_kv_head =
            (attention.heads / size) / (attention.kv_heads / size).max(1.0);
        let kv_reads = super::VersionRange::of(runtime).kv_reads(query_heads_per_kv_head);
        let stages = input
            .plan
            .stages
            .iter()
            .zip(layers)
            .map(|(stage, &count)| {
                let gpu = &stage.gpu;
                let compute = gpu.tensor_rates().compute_tflops(shape.precision);
                let mut group =
                    GroupSpeed::device(&gpu.vendor, gpu.fp16_tflops, gpu.memory_bandwidth_gbps)
                        .computing_at(compute);
                if tensor > 1 {
                    group = group.with_link(link_gbps(stage.link.gbps), stage.link.kind);
                }
                let layer = layer_time(&shape, tensor, &group);
                let latency_only = layer_time(&no_activations, tensor, &group).all_reduce;
                let count = f64::from(count);
                let efficiency = constants.compute_efficiency(runtime, &gpu.vendor);
                let flops_per_second = size * compute * efficiency * 1e12;
                StageCost {
                    single: layer.total() * count,
                    weights: layer.weights * count,
                    compute_single: layer.compute * count,
                    compute_per_token: shape.flops_per_layer_token * count / flops_per_second,
                    kv_read_per_sequence: kv_reads * kv_per_layer * count * mean_context
                        / (group.weight_gbps * 1e9),
                    transfer_per_token: (layer.all_reduce - latency_only).max(0.0) * count
                        / constants.all_reduce_bandwidth_share,
                    attention_per_square_token: 2.0 * count * query_width / flops_per_second,
                }
            })
            .collect();
        StepModel {
            stages,
            hop_per_token: shape.activation_bytes_per_token / (input.plan.hop.gbps * 1e9),
            hop_latency: input.plan.hop.latency_us * 1e-6,
            input_tokens,
            output_tokens,
            chunk_tokens: runtime.prefill_chunk_tokens(super::runtime::all_large(&input.plan)),
            scale: runtime.correction.unwrap_or(1.0),
        }
    }

    /// The hops between stages for `tokens` tokens' activations.
    /// One stage has no hop, whatever its (unchecked) hop figures say.
    fn hops(&self, tokens: f64) -> f64 {
        match self.stages.len().saturating_sub(1) {
            0 => 0.0,
            hops => hops as f64 * (self.hop_latency + tokens * self.hop_per_token),
        }
    }

    /// One decode step over `sequences` (at least 1).
    fn decode_step(&self, sequences: f64) -> f64 {
        let sequences = sequences.max(1.0);
        let micro_batches = (self.stages.len() as f64).min(sequences).max(1.0);
        let each = sequences / micro_batches;
        let mut through = self.hops(each);
        let mut busiest: f64 = 0.0;
        for stage in &self.stages {
            let time = stage.decode(each);
            through += time;
            busiest = busiest.max(time);
        }
        through.max(micro_batches * busiest)
    }

    /// One prompt on an otherwise idle replica.
    fn prefill_alone(&self) -> f64 {
        let stages: f64 = self
            .stages
            .iter()
            .map(|stage| stage.prefill_alone(self.input_tokens))
            .sum();
        stages + self.hops(self.input_tokens)
    }

    /// What one prompt adds to the steps it is chunked into; the stages
    /// prefill in a pipeline too, so the busiest stage's share counts.
    fn prefill_work(&self) -> f64 {
        self.stages
            .iter()
            .map(|stage| stage.prefill_work(self.input_tokens))
            .fold(0.0, f64::max)
    }

    /// The replica at `concurrency` sequences (at least 1).
    pub(super) fn point(&self, concurrency: u32) -> ServingPoint {
        let sequences = f64::from(concurrency.max(1));
        let step = self.scale * self.decode_step(sequences);
        let work = self.scale * self.prefill_work();
        // The other requests are replaced once per output length each, so
        // `(b - 1) / output` prefills ride along each of this request's steps.
        let tpot = step + (sequences - 1.0) / self.output_tokens * work;
        let prefill = self.scale * self.prefill_alone();
        // Without queueing: alone, the prefill; beside others, it waits half a
        // step for the one in flight and each further chunk rides one more
        // step of theirs.
        let ttft = if sequences >= 2.0 {
            let chunks = (self.input_tokens / self.chunk_tokens).ceil().max(1.0);
            prefill + (chunks - 0.5) * self.scale * self.decode_step(sequences - 1.0)
        } else {
            prefill
        };
        let per_token = tpot + work / self.output_tokens;
        let tokens_per_second = if per_token > 0.0 {
            sequences / per_token
        } else {
            0.0
        };
        ServingPoint {
            concurrency: concurrency.max(1),
            decode_step_ms: step * 1e3,
            tpot_ms: tpot * 1e3,
            ttft_ms: ttft * 1e3,
            prefill_ms: prefill * 1e3,
            output_tokens_per_second: tokens_per_second,
            requests_per_second: tokens_per_second / self.output_tokens,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::testutil::*;
    use super::super::{GpuFigures, Hop, Replica, Runtime, Stage};
    use super::*;
    use crate::api::{DType, GIB};

    fn a100() -> GpuFigures {
        GpuFigures {
            vendor: "nvidia".into(),
            fp16_tflops: 312.0,
            fp8_tflops: None,
            fp4_tflops: None,
            memory_bandwidth_gbps: 2039.0,
            memory_bytes: 80.0 * GIB,
        }
    }

    /// The solver's token time for one stage of `tensor` devices.
    fn single_stream(input: &ServingInput) -> f64 {
        let shape = ModelShape::of(&input.model.spec);
        let gpu = &input.plan.stages[0].gpu;
        let mut group = GroupSpeed::device(&gpu.vendor, gpu.fp16_tflops, gpu.memory_bandwidth_gbps);
        if input.plan.tensor > 1 {
            let link = input.plan.stages[0].link;
            group = group.with_link(link_gbps(link.gbps), link.kind);
        }
        layer_time(&shape, input.plan.tensor, &group).total() * f64::from(shape.layers)
    }

    #[test]
    fn one_sequence_decodes_at_the_solvers_single_stream_speed() {
        for tensor in [1, 2, 8] {
            for runtime in [Runtime::Vllm, Runtime::TensorrtLlm] {
                let input = input(h100(), tensor, llama("70b", DType::Fp8), runtime);
                let replica = Replica::new(&input).expect("fits");
                let point = replica.at(1);
                let want = single_stream(&input) * 1e3;
                assert!(
                    (point.decode_step_ms - want).abs() <= 1e-9 * want,
                    "TP{tensor}"
                );
                assert_eq!(
                    point.tpot_ms, point.decode_step_ms,
                    "nothing else is prefilled"
                );
            }
        }
    }

    #[test]
    fn the_decode_step_grows_with_the_batch_and_never_shrinks() {
        for (gpu, tensor, model) in [
            (h100(), 1, llama("8b", DType::Fp8)),
            (a100(), 1, llama("8b", DType::Bf16)),
            (h100(), 4, llama("70b", DType::Bf16)),
        ] {
            let mut input = input(gpu, tensor, model, Runtime::TensorrtLlm);
            input.runtime.max_num_seqs = Some(4096);
            let replica = Replica::new(&input).expect("fits");
            let mut last = replica.at(1);
            for concurrency in 2..=replica.concurrency().max {
                let point = replica.at(concurrency);
                assert!(point.decode_step_ms >= last.decode_step_ms, "{concurrency}");
                assert!(point.tpot_ms >= last.tpot_ms, "{concurrency}");
                assert!(point.ttft_ms >= last.ttft_ms, "{concurrency}");
                last = point;
            }
            // Large batches pay for more than the weights.
            assert!(last.decode_step_ms > 1.5 * replica.at(1).decode_step_ms);
        }
    }

    #[test]
    fn small_batches_cost_about_what_one_sequence_does() {
        let input = input(h100(), 1, llama("8b", DType::Bf16), Runtime::Vllm);
        let replica = Replica::new(&input).expect("fits");
        let (one, eight) = (replica.at(1), replica.at(8));
        assert!(eight.decode_step_ms < 1.2 * one.decode_step_ms);
        assert!(eight.output_tokens_per_second > 6.0 * one.output_tokens_per_second);
    }

    #[test]
    fn fp8_weights_compute_faster_only_where_the_gpu_has_fp8() {
        let on_fp8 = input(h100(), 1, llama("8b", DType::Fp8), Runtime::Vllm);
        let mut widened = on_fp8.clone();
        widened.plan.stages[0].gpu.fp8_tflops = None;
        let on_fp8 = Replica::new(&on_fp8).expect("fits");
        let widened = Replica::new(&widened).expect("fits");
        // Prefill is compute-bound: the FP8 rate shortens it.
        assert!(on_fp8.at(1).ttft_ms < 0.8 * widened.at(1).ttft_ms);
        let bf16 =
            Replica::new(&input(h100(), 1, llama("8b", DType::Bf16), Runtime::Vllm)).expect("fits");
        assert!(on_fp8.at(1).ttft_ms < bf16.at(1).ttft_ms);
    }

    #[test]
    fn prefill_is_compute_bound_and_comes_before_the_first_token() {
        let input = input(a100(), 1, llama("8b", DType::Bf16), Runtime::Vllm);
        let replica = Replica::new(&input).expect("fits");
        let alone = replica.at(1);
        // 1000 tokens × 16 GFLOP at 40% of 312 TFLOPS: about 130 ms.
        assert!(
            alone.prefill_ms > 100.0 && alone.prefill_ms < 160.0,
            "{alone:?}"
        );
        assert_eq!(alone.ttft_ms, alone.prefill_ms);
        let busy = replica.at(64);
        assert!(busy.ttft_ms > alone.ttft_ms + 0.5 * replica.at(63).decode_step_ms * 0.99);
        // Others' prefills lengthen the time per token beyond the decode step.
        assert!(busy.tpot_ms > busy.decode_step_ms);
    }

    #[test]
    fn a_pipeline_runs_micro_batches_and_pays_its_hops() {
        let mut two = input(h100(), 1, llama("70b", DType::Fp8), Runtime::Vllm);
        two.plan.stages = vec![
            Stage {
                gpu: h100(),
                link: nvlink(),
            };
            2
        ];
        let pipeline = Replica::new(&two).expect("fits on two stages");
        let mut one = two.clone();
        one.plan.stages.truncate(1);
        one.model.spec.layers = 40;
        one.model.spec.parameters_billions /= 2.0;
        let stage = Replica::new(&one).expect("half the model fits on one");
        let hop = (8192.0 * 2.0 / (Hop::same_node().gbps * 1e9) + 10e-6) * 1e3;
        // One sequence goes through both stages and the hop.
        let through = 2.0 * stage.at(1).decode_step_ms + hop;
        assert!((pipeline.at(1).decode_step_ms - through).abs() < 1e-9 * through);
        // Two sequences: one micro-batch per stage, each stage busy twice.
        let busy = pipeline.at(2).decode_step_ms;
        assert!(busy >= 2.0 * stage.at(1).decode_step_ms);
        assert!(pipeline.at(2).output_tokens_per_second > pipeline.at(1).output_tokens_per_second);
    }
}
