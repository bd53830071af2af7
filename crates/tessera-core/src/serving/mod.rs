//! The batched serving model: what one replica of a plan delivers when its
//! runtime decodes many sequences at once, where the solver's speed model
//! (`placement`) judges a plan by one sequence alone.
//!
//! For a replica (tensor size, pipeline stages, each stage's GPU figures and
//! tensor link), a model, the mean request lengths and a runtime, it predicts
//! at each concurrency (sequences decoded together) the decode step time, the
//! time per output token a request sees, the time to its first token and the
//! output tokens/s; how many sequences the KV cache and the runtime's batch cap
//! allow; and the highest concurrency that still meets a latency target. At
//! concurrency 1 the decode step is exactly the solver's single-stream
//! prediction. Calibrated against published batched figures
//! (tests/serving_calibration.rs; the table and every constant's source are in
//! docs/serving-model.md). Pure: no clock, no I/O.
//!
//! Its rooms keep apart what one step costs, how many sequences fit, and the
//! search over load:
//! - `step_time`: what a decode step, a prefill and a request's first token
//!   cost at a concurrency;
//! - `kv_cache`: KV bytes per token, the memory left for the cache, the
//!   largest concurrency it and the runtime's cap allow;
//! - `capacity`: the curve over concurrency, and the highest concurrency that
//!   meets a latency target;
//! - `runtime`: the runtimes and the defaults that differ between them;
//! - `constants`: the fitted constants.
//!
//! One sequence's decode through a layer is the solver's own `placement::speed`.

mod capacity;
mod constants;
mod kv_cache;
mod runtime;
mod step_time;

use serde::{Deserialize, Serialize};

use crate::api::ModelSpec;
use crate::placement::{Interconnect, TensorRates};

pub use capacity::requests_in_flight;
pub use capacity::{AtTarget, Capacity, CurvePoint, TargetMiss};
pub use constants::Constants;
pub use kv_cache::{Concurrency, Limit, kv_bytes_per_token_layer};
pub use runtime::{KvCacheDtype, Runtime, RuntimeConfig, RuntimeVersion, VersionRange};

/// One GPU as its datasheet, or the node agent, describes it: the same
/// figures the solver gets for a device.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct GpuFigures {
    /// Lower-case vendor name (`nvidia`, `amd`); sets the share of datasheet
    /// bandwidth reads reach, as in the solver.
    pub vendor: String,
    /// Dense FP16 TFLOPS.
    pub fp16_tflops: f64,
    /// Dense FP8 TFLOPS on a GPU with FP8 tensor cores (H100, H200, MI300X);
    /// `None` where FP8 weights are widened to FP16 for the matrix
    /// multiplications (A100 and older), which then run at FP16 speed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fp8_tflops: Option<f64>,
    /// Dense FP4 TFLOPS on a GPU with FP4 tensor cores (B200, MI355X).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fp4_tflops: Option<f64>,
    /// Memory bandwidth, GB/s.
    pub memory_bandwidth_gbps: f64,
    /// Memory of one device, bytes.
    pub memory_bytes: f64,
}

impl GpuFigures {
    pub fn tensor_rates(&self) -> TensorRates {
        TensorRates {
            fp16: self.fp16_tflops,
            fp8: self.fp8_tflops,
            fp4: self.fp4_tflops,
        }
    }
}

/// The worst link inside a tensor group, as the solver reads it: an
/// unreported kind or bandwidth costs what the solver charges for one.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct GroupLink {
    pub kind: Option<Interconnect>,
    pub gbps: Option<f64>,
}

/// One pipeline stage: a tensor group of identical GPUs.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Stage {
    pub gpu: GpuFigures,
    /// Ignored for a group of one.
    #[serde(default)]
    pub link: GroupLink,
}

/// What moving one token's activations from one stage to the next costs.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Hop {
    pub gbps: f64,
    pub latency_us: f64,
}

impl Hop {
    /// What the solver charges a hop of this cost (a stage's
    /// `parts.nextHopCost`: same node, rack, zone or across zones).
    pub fn of_cost(next_hop_cost: f64) -> Hop {
        let (bytes_per_s, latency_s) = crate::placement::evaluate::hop_transfer(next_hop_cost);
        Hop {
            gbps: bytes_per_s / 1e9,
            latency_us: latency_s * 1e6,
        }
    }

    /// A hop between two stages on one node.
    pub fn same_node() -> Hop {
        Hop::of_cost(0.0)
    }
}

/// A replica's shape: `stages.len()` pipeline stages of `tensor` GPUs each,
/// in pipeline order. Layers are split evenly, the first stages taking one
/// more where they do not divide.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ReplicaPlan {
    pub tensor: u32,
    pub stages: Vec<Stage>,
    /// Between consecutive stages; unused with one stage.
    pub hop: Hop,
}

/// The model: the instance spec's figures, its attention and KV heads where
/// it gives them (`attentionHeads`, `kvHeads`). With heads unknown the model is taken to have 128-wide heads
/// (`hidden / 128` of them); with KV heads unknown, one KV head per attention
/// head (no grouped-query attention). Both give the most KV memory a model
/// of that size can need, so capacity is never overstated.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ServingModel {
    /// `kvCacheGiB`, when above zero, is a fixed KV reservation for the whole
    /// replica instead of whatever memory the runtime leaves.
    pub spec: ModelSpec,
    /// The width of a head, where the model's config gives one that is not
    /// hiddenSize / attentionHeads.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub head_dim: Option<u32>,
}

/// Mean request lengths. A prompt is at least one token (0 is taken as 1).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Workload {
    pub input_tokens: f64,
    pub output_tokens: f64,
}

impl Workload {
    /// A request's whole length, prompt and output: what its KV cache holds
    /// by its last token.
    pub fn sequence_tokens(&self) -> f64 {
        self.input_tokens.max(1.0) + self.output_tokens
    }
}

/// Everything a prediction depends on.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ServingInput {
    pub plan: ReplicaPlan,
    pub model: ServingModel,
    pub workload: Workload,
    #[serde(default)]
    pub runtime: RuntimeConfig,
}

/// A latency a replica must meet; `None` sets no limit.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct LatencyTarget {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_tpot_ms: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_ttft_ms: Option<f64>,
}

/// A replica at one concurrency, in the steady state where every finished
/// request is replaced by a new one.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ServingPoint {
    pub concurrency: u32,
    /// One decode step over all the sequences (at concurrency 1, the solver's
    /// single-stream token time).
    pub decode_step_ms: f64,
    /// Time between a request's output tokens: the decode step plus the
    /// prefills of the other requests that start meanwhile.
    pub tpot_ms: f64,
    /// Time to a request's first token, without queueing.
    pub ttft_ms: f64,
    /// One request's prefill on an otherwise idle replica.
    pub prefill_ms: f64,
    /// Output tokens/s of the replica, its requests' prefills included:
    /// `concurrency / (tpot + own prefill / output tokens)`.
    pub output_tokens_per_second: f64,
    /// `output_tokens_per_second / output tokens`.
    pub requests_per_second: f64,
}

/// Why there is no prediction.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum Refusal {
    #[error("{0}")]
    Invalid(String),
    #[error(
        "stage {stage}: the weights and runtime overhead need {need_gib:.1} GiB per device, the runtime may use {usable_gib:.1} GiB"
    )]
    WeightsDoNotFit {
        stage: usize,
        need_gib: f64,
        usable_gib: f64,
    },
    #[error(
        "stage {stage}: one sequence of {tokens:.0} tokens needs {sequence_gib:.3} GiB of KV cache per device, {room_gib:.3} GiB is left"
    )]
    NoSequenceFits {
        stage: usize,
        tokens: f64,
        sequence_gib: f64,
        room_gib: f64,
    },
    #[error(
        "stage {stage}: the reserved KV cache needs {reserved_gib:.1} GiB per device, {room_gib:.1} GiB is left after the weights"
    )]
    ReservationDoesNotFit {
        stage: usize,
        reserved_gib: f64,
        room_gib: f64,
    },
}

/// A replica ready to be asked about any concurrency.
#[derive(Clone, Debug)]
pub struct Replica {
    steps: step_time::StepModel,
    concurrency: Concurrency,
    correction: Option<f64>,
}

impl Replica {
    /// Checks the input and prepares the prediction; refuses zero, negative
    /// or non-finite figures, and a plan whose memory cannot hold the model
    /// and one sequence.
    pub fn new(input: &ServingInput) -> Result<Replica, Refusal> {
        Replica::with_constants(input, &Constants::FITTED)
    }

    /// As [`Replica::new`], with constants other than the fitted ones (the
    /// calibration fits them).
    pub fn with_constants(input: &ServingInput, constants: &Constants) -> Result<Replica, Refusal> {
        validate(input)?;
        constants.validate().map_err(Refusal::Invalid)?;
        let layers = split_layers(input.model.spec.layers, input.plan.stages.len());
        let concurrency = kv_cache::concurrency(input, &layers)?;
        let steps = step_time::StepModel::new(input, &layers, constants);
        Ok(Replica {
            steps,
            concurrency,
            correction: input.runtime.correction,
        })
    }

    /// How many sequences the replica can decode together, and why not more.
    pub fn concurrency(&self) -> &Concurrency {
        &self.concurrency
    }

    /// The replica at `concurrency` sequences (0 is taken as 1). Beyond
    /// [`Concurrency::max`] the KV cache could not hold them; the figures
    /// are what the step would cost if it could.
    pub fn at(&self, concurrency: u32) -> ServingPoint {
        self.steps.point(concurrency.max(1))
    }

    /// Every power of two up to the largest concurrency, and that one.
    pub fn curve(&self) -> Vec<CurvePoint> {
        capacity::curve(&self.steps, self.concurrency.max)
    }

    /// The highest concurrency meeting `target`, or the best latency there is
    /// when not even one sequence meets it.
    pub fn at_target(&self, target: &LatencyTarget) -> Result<ServingPoint, TargetMiss> {
        capacity::highest_meeting(&self.steps, self.concurrency.max, target)
    }

    /// Everything `tessera place` and the status say of the replica at `target`.
    pub fn capacity(&self, target: &LatencyTarget) -> Capacity {
        let (at_slo, target_missed) = match self.at_target(target) {
            Ok(point) => (Some(point.into()), None),
            Err(miss) => (None, Some(miss)),
        };
        Capacity {
            max_concurrency: self.concurrency.max,
            limited_by: self.concurrency.limited_by,
            curve: self.curve(),
            at_slo,
            target_missed,
            correction: self.correction,
        }
    }
}

/// Layers of each stage: an even split, the first stages taking the remainder.
fn split_layers(layers: u32, stages: usize) -> Vec<u32> {
    let stages = u32::try_from(stages.max(1)).unwrap_or(u32::MAX);
    let (base, extra) = (layers / stages, layers % stages);
    (0..stages)
        .map(|index| base + u32::from(index < extra))
        .collect()
}

fn positive(value: f64) -> bool {
    value.is_finite() && value > 0.0
}

fn validate(input: &ServingInput) -> Result<(), Refusal> {
    let invalid = |what: String| Err(Refusal::Invalid(what));
    let plan = &input.plan;
    if plan.tensor == 0 {
        return invalid("the tensor size must be at least 1".into());
    }
    if plan.stages.is_empty() {
        return invalid("a replica needs at least one stage".into());
    }
    if let Some(factor) = input.runtime.correction {
        let mut problems = Vec::new();
        crate::api::limits::CORRECTION.check("the correction", factor, &mut problems);
        if let Some(problem) = problems.pop() {
            return invalid(problem);
        }
    }
    let spec = &input.model.spec;
    if spec.layers == 0 {
        return invalid("the model must have at least one layer".into());
    }
    if plan.stages.len() > spec.layers as usize {
        return invalid(format!(
            "{} stages for {} layers: every stage needs a layer",
            plan.stages.len(),
            spec.layers
        ));
    }
    for (index, stage) in plan.stages.iter().enumerate() {
        let gpu = &stage.gpu;
        for (name, value) in [
            ("fp16Tflops", gpu.fp16_tflops),
            ("memoryBandwidthGbps", gpu.memory_bandwidth_gbps),
            ("memoryBytes", gpu.memory_bytes),
        ] {
            if !positive(value) {
                return invalid(format!(
                    "stage {index}: {name} must be above 0, not {value}"
                ));
            }
        }
        for (name, rate) in [("fp8Tflops", gpu.fp8_tflops), ("fp4Tflops", gpu.fp4_tflops)] {
            if let Some(rate) = rate
                && !positive(rate)
            {
                return invalid(format!("stage {index}: {name} must be above 0, not {rate}"));
            }
        }
    }
    if plan.stages.len() > 1
        && (!positive(plan.hop.gbps)
            || !plan.hop.latency_us.is_finite()
            || plan.hop.latency_us < 0.0)
    {
        return invalid(
            "the pipeline hop needs a bandwidth above 0 and a latency of 0 or more".into(),
        );
    }
    if !positive(spec.parameters_billions) {
        return invalid(format!(
            "parametersBillions must be above 0, not {}",
            spec.parameters_billions
        ));
    }
    if let Some(gib) = spec.weights_gib
        && !positive(gib)
    {
        return invalid(format!("weightsGiB must be above 0, not {gib}"));
    }
    if spec.hidden_size == Some(0) {
        return invalid("hiddenSize must be above 0".into());
    }
    for (name, value) in [
        ("overheadGiB", spec.overhead_gib),
        ("kvCacheGiB", spec.kv_cache_gib.unwrap_or(0.0)),
    ] {
        if !value.is_finite() || value < 0.0 {
            return invalid(format!("{name} must be 0 or more, not {value}"));
        }
    }
    let model = &input.model;
    for (name, value) in [
        ("attentionHeads", model.spec.attention_heads),
        ("kvHeads", model.spec.kv_heads),
        ("headDim", model.head_dim),
    ] {
        if value == Some(0) {
            return invalid(format!("{name} must be above 0"));
        }
    }
    let workload = &input.workload;
    if !workload.input_tokens.is_finite() || workload.input_tokens < 0.0 {
        return invalid(format!(
            "inputTokens must be 0 or more, not {}",
            workload.input_tokens
        ));
    }
    if !workload.output_tokens.is_finite() || workload.output_tokens < 1.0 {
        return invalid(format!(
            "outputTokens must be at least 1, not {}",
            workload.output_tokens
        ));
    }
    let runtime = &input.runtime;
    if let Some(share) = runtime.memory_utilization
        && !(positive(share) && share <= 1.0)
    {
        return invalid(format!("memoryUtilization must be in (0, 1], not {share}"));
    }
    if runtime.max_num_seqs == Some(0) {
        return invalid("maxNumSeqs must be at least 1".into());
    }
    Ok(())
}

#[cfg(test)]
pub(crate) mod testutil {
    //! Inputs the module's tests share.
    use super::*;
    use crate::api::{DType, GIB};

    pub(crate) fn h100() -> GpuFigures {
        GpuFigures {
            vendor: "nvidia".into(),
            fp16_tflops: 989.0,
            fp8_tflops: Some(1979.0),
            fp4_tflops: None,
            memory_bandwidth_gbps: 3350.0,
            memory_bytes: 80.0 * GIB,
        }
    }

    pub(crate) fn h200() -> GpuFigures {
        GpuFigures {
            memory_bandwidth_gbps: 4800.0,
            memory_bytes: 141.0 * GIB,
            ..h100()
        }
    }

    pub(crate) fn nvlink() -> GroupLink {
        GroupLink {
            kind: Some(Interconnect::NvLink),
            gbps: Some(900.0),
        }
    }

    pub(crate) fn llama(name: &str, dtype: DType) -> ServingModel {
        let (parameters, layers, hidden, heads, kv_heads) = match name {
            "8b" => (8.03, 32, 4096, 32, 8),
            "70b" => (70.6, 80, 8192, 64, 8),
            other => panic!("no test model {other}"),
        };
        ServingModel {
            spec: ModelSpec {
                name: format!("Llama-3.1-{name}"),
                parameters_billions: parameters,
                layers,
                dtype,
                hidden_size: Some(hidden),
                attention_heads: Some(heads),
                kv_heads: Some(kv_heads),
                kv_cache_dtype: None,
                kv_cache_gib: None,
                overhead_gib: 1.5,
                weights_gib: None,
            },
            head_dim: None,
        }
    }

    /// One stage of `tensor` GPUs, 1000 tokens in and out, under `runtime`.
    pub(crate) fn input(
        gpu: GpuFigures,
        tensor: u32,
        model: ServingModel,
        runtime: Runtime,
    ) -> ServingInput {
        ServingInput {
            plan: ReplicaPlan {
                tensor,
                stages: vec![Stage {
                    gpu,
                    link: nvlink(),
                }],
                hop: Hop::same_node(),
            },
            model,
            workload: Workload {
                input_tokens: 1000.0,
                output_tokens: 1000.0,
            },
            runtime: RuntimeConfig {
                runtime,
                ..RuntimeConfig::default()
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::testutil::*;
    use super::*;
    use crate::api::DType;

    #[test]
    fn layers_split_evenly_with_the_remainder_first() {
        assert_eq!(split_layers(80, 1), vec![80]);
        assert_eq!(split_layers(80, 3), vec![27, 27, 26]);
        assert_eq!(split_layers(126, 4), vec![32, 32, 31, 31]);
    }

    #[test]
    fn zero_and_nan_inputs_are_refused_not_panicked_on() {
        let good = input(h100(), 1, llama("8b", DType::Bf16), Runtime::Vllm);
        assert!(Replica::new(&good).is_ok());
        let mut cases: Vec<ServingInput> = Vec::new();
        let mut case = |change: &dyn Fn(&mut ServingInput)| {
            let mut input = good.clone();
            change(&mut input);
            cases.push(input);
        };
        case(&|input| input.plan.tensor = 0);
        case(&|input| input.plan.stages.clear());
        case(&|input| input.plan.stages[0].gpu.fp16_tflops = 0.0);
        case(&|input| input.plan.stages[0].gpu.fp16_tflops = f64::NAN);
        case(&|input| input.plan.stages[0].gpu.fp8_tflops = Some(f64::NAN));
        case(&|input| input.plan.stages[0].gpu.fp4_tflops = Some(-1.0));
        case(&|input| input.plan.stages[0].gpu.memory_bandwidth_gbps = -1.0);
        case(&|input| input.plan.stages[0].gpu.memory_bytes = f64::INFINITY);
        case(&|input| input.model.spec.parameters_billions = f64::NAN);
        case(&|input| input.model.spec.layers = 0);
        case(&|input| input.model.spec.hidden_size = Some(0));
        case(&|input| input.model.spec.overhead_gib = f64::NAN);
        case(&|input| input.model.spec.weights_gib = Some(0.0));
        case(&|input| input.model.spec.weights_gib = Some(f64::INFINITY));
        case(&|input| input.model.spec.kv_heads = Some(0));
        case(&|input| input.workload.output_tokens = 0.0);
        case(&|input| input.workload.input_tokens = f64::NAN);
        case(&|input| input.runtime.memory_utilization = Some(0.0));
        case(&|input| input.runtime.memory_utilization = Some(1.5));
        case(&|input| input.runtime.max_num_seqs = Some(0));
        case(&|input| input.runtime.correction = Some(0.0));
        case(&|input| input.runtime.correction = Some(f64::NAN));
        case(&|input| input.runtime.correction = Some(5000.0));
        case(&|input| {
            input.plan.stages.push(input.plan.stages[0].clone());
            input.plan.hop.gbps = f64::NAN;
        });
        for (index, input) in cases.iter().enumerate() {
            let refusal = Replica::new(input).expect_err(&format!("case {index} is refused"));
            assert!(
                matches!(refusal, Refusal::Invalid(_)),
                "case {index}: {refusal}"
            );
        }
    }

    #[test]
    fn a_measured_correction_scales_every_step_and_says_so() {
        let input = input(h100(), 1, llama("8b", DType::Bf16), Runtime::Vllm);
        let plain = Replica::new(&input).expect("a prediction");
        let mut slower = input.clone();
        slower.runtime.correction = Some(4.0);
        let corrected = Replica::new(&slower).expect("a prediction");
        for concurrency in [1, 8, 64] {
            let (a, b) = (plain.at(concurrency), corrected.at(concurrency));
            assert!((b.tpot_ms / a.tpot_ms - 4.0).abs() < 1e-9, "{a:?} {b:?}");
            assert!((b.ttft_ms / a.ttft_ms - 4.0).abs() < 1e-9);
            assert!((a.output_tokens_per_second / b.output_tokens_per_second - 4.0).abs() < 1e-9);
        }
        let target = LatencyTarget {
            max_tpot_ms: Some(50.0),
            max_ttft_ms: Some(2000.0),
        };
        let (a, b) = (plain.capacity(&target), corrected.capacity(&target));
        assert_eq!((a.correction, b.correction), (None, Some(4.0)));
        let (a, b) = (a.at_slo.expect("meets"), b.at_slo.expect("meets"));
        assert!(
            b.concurrency < a.concurrency,
            "4× slower steps: fewer at once meet 50 ms"
        );
    }

    #[test]
    fn an_empty_prompt_is_one_token_nan_links_are_unreported_and_one_stage_has_no_hop() {
        let mut input = input(h100(), 2, llama("8b", DType::Bf16), Runtime::Vllm);
        input.workload.input_tokens = 0.0;
        input.plan.stages[0].link = GroupLink {
            kind: None,
            gbps: Some(f64::NAN),
        };
        let replica = Replica::new(&input).expect("a prediction");
        for point in replica.curve() {
            assert!(point.tpot_ms.is_finite() && point.tpot_ms > 0.0);
            assert!(point.output_tokens_per_second.is_finite());
        }
        // One stage has no hop: its figures are not read.
        let mut no_hop = input.clone();
        no_hop.plan.hop = Hop {
            gbps: f64::NAN,
            latency_us: f64::NAN,
        };
        let no_hop = Replica::new(&no_hop).expect("a prediction");
        assert_eq!(no_hop.at(4), replica.at(4));
        let mut one_token = input.clone();
        one_token.workload.input_tokens = 1.0;
        let one = Replica::new(&one_token).expect("a prediction");
        assert_eq!(replica.at(4), one.at(4));
    }

    #[test]
    fn a_model_too_large_for_its_gpus_is_refused_with_the_numbers() {
        let input = input(h100(), 1, llama("70b", DType::Bf16), Runtime::Vllm);
        let refusal = Replica::new(&input).expect_err("140 GB of weights on 80 GB");
        assert!(
            matches!(refusal, Refusal::WeightsDoNotFit { stage: 0, .. }),
            "{refusal}"
        );
        assert!(refusal.to_string().contains("GiB"), "{refusal}");
    }
}
