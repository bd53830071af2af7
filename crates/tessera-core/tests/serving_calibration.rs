//! The serving model against published batched figures
//! (`fixtures/published_serving.yaml`): at least 90% of the throughput figures
//! and at least 90% of the time-per-output-token figures predicted within 25%.
//! The table printed on failure (and with `--nocapture`) is the one in
//! docs/serving-model.md. Also: at concurrency 1 the serving model is the
//! solver's single-stream prediction.

use std::collections::BTreeMap;

use serde::Deserialize;
use tessera_core::api::{DType, GIB, ModelSpec};
use tessera_core::placement::{
    Device, Interconnect, Link, NodeState, Problem, Selector, SpeedGoal, StageChoice, Stages,
    Strategy, Weights, evaluate,
};
use tessera_core::serving::{
    GpuFigures, GroupLink, Hop, Replica, ReplicaPlan, Runtime, RuntimeConfig, ServingInput,
    ServingModel, ServingPoint, Stage, Workload,
};

const FIXTURE: &str = include_str!("fixtures/published_serving.yaml");
/// Figures the constants were not set on (published_held_out.yaml).
const HELD_OUT: &str = include_str!("fixtures/published_held_out.yaml");
/// The share of held-out throughput and time-per-token figures within 25%
/// when they were added, by source: a change that predicts them worse
/// fails. Below the targets (90% of all, 85% of each source):
/// docs/serving-model.md says which figures miss and why.
const HELD_OUT_FLOOR: &[(&str, f64)] =
    &[("dstack", 0.45), ("rocmvllm010", 0.57), ("trt090dli", 0.96)];
/// The largest relative error a figure may have to count as met.
const TOLERANCE: f64 = 0.25;
/// The share of each kind of figure that must be met.
const REQUIRED: f64 = 0.90;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Fixture {
    gpus: BTreeMap<String, Gpu>,
    models: BTreeMap<String, Shape>,
    figures: Vec<Figure>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct Gpu {
    vendor: String,
    #[allow(dead_code)]
    product: String,
    #[serde(rename = "memoryGiB")]
    memory_gib: f64,
    fp16_tflops: f64,
    #[serde(default)]
    fp8_tflops: Option<f64>,
    memory_bandwidth_gbps: f64,
    link: String,
    link_gbps: f64,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct Shape {
    parameters_billions: f64,
    layers: u32,
    hidden_size: u32,
    attention_heads: u32,
    kv_heads: u32,
}

#[derive(Clone, Copy, Deserialize, PartialEq)]
#[serde(rename_all = "lowercase")]
enum Load {
    Offline,
    Static,
    Rate,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct Published {
    output_tokens_per_second: Option<f64>,
    tpot_ms: Option<f64>,
    ttft_ms: Option<f64>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct Figure {
    id: String,
    #[allow(dead_code)]
    source: String,
    runtime: Runtime,
    #[allow(dead_code)]
    version: String,
    gpu: String,
    tensor: u32,
    pipeline: u32,
    model: String,
    dtype: DType,
    input_tokens: f64,
    output_tokens: f64,
    load: Load,
    #[serde(default)]
    concurrency: Option<u32>,
    #[serde(default)]
    requests_per_second: Option<f64>,
    published: Published,
    #[serde(default)]
    memory_utilization: Option<f64>,
    #[serde(default)]
    max_num_seqs: Option<u32>,
    #[allow(dead_code)]
    note: String,
}

fn fixture() -> Fixture {
    serde_saphyr::from_str(FIXTURE).expect("the committed fixture parses")
}

fn held_out() -> Fixture {
    serde_saphyr::from_str(HELD_OUT).expect("the committed held-out fixture parses")
}

fn interconnect(kind: &str) -> Interconnect {
    match kind {
        "nvlink" => Interconnect::NvLink,
        "xgmi" => Interconnect::Xgmi,
        "pcie" => Interconnect::Pcie,
        other => panic!("unknown link kind {other}"),
    }
}

fn model(name: &str, shape: &Shape, dtype: DType) -> ServingModel {
    ServingModel {
        spec: ModelSpec {
            name: name.into(),
            parameters_billions: shape.parameters_billions,
            layers: shape.layers,
            dtype,
            hidden_size: Some(shape.hidden_size),
            attention_heads: Some(shape.attention_heads),
            kv_heads: Some(shape.kv_heads),
            kv_cache_dtype: None,
            kv_cache_gib: None,
            overhead_gib: 1.5,
        },
        head_dim: None,
    }
}

/// The serving input for a figure, from the data the solver would have.
fn serving_input(fixture: &Fixture, figure: &Figure) -> ServingInput {
    let gpu = fixture
        .gpus
        .get(&figure.gpu)
        .unwrap_or_else(|| panic!("{}: unknown GPU {}", figure.id, figure.gpu));
    let shape = fixture
        .models
        .get(&figure.model)
        .unwrap_or_else(|| panic!("{}: unknown model {}", figure.id, figure.model));
    let stage = Stage {
        gpu: GpuFigures {
            vendor: gpu.vendor.clone(),
            fp16_tflops: gpu.fp16_tflops,
            fp8_tflops: gpu.fp8_tflops,
            fp4_tflops: None,
            memory_bandwidth_gbps: gpu.memory_bandwidth_gbps,
            memory_bytes: gpu.memory_gib * GIB,
        },
        link: GroupLink {
            kind: Some(interconnect(&gpu.link)),
            gbps: Some(gpu.link_gbps),
        },
    };
    ServingInput {
        plan: ReplicaPlan {
            tensor: figure.tensor,
            stages: vec![stage; figure.pipeline as usize],
            hop: Hop::same_node(),
        },
        model: model(&figure.model, shape, figure.dtype),
        workload: Workload {
            input_tokens: figure.input_tokens,
            output_tokens: figure.output_tokens,
        },
        runtime: RuntimeConfig {
            runtime: figure.runtime,
            memory_utilization: figure.memory_utilization,
            max_num_seqs: figure.max_num_seqs,
            ..RuntimeConfig::default()
        },
    }
}

/// The concurrency Little's law gives at `rate` requests/s: each request
/// stays its time to first token and its output tokens' steps. `None` when
/// the replica cannot keep up (the load would exceed its largest concurrency).
fn littles_law(replica: &Replica, rate: f64, output_tokens: f64) -> Option<ServingPoint> {
    let max = replica.concurrency().max;
    let mut concurrency = 1;
    for _ in 0..100 {
        let point = replica.at(concurrency);
        let seconds = (point.ttft_ms + (output_tokens - 1.0).max(0.0) * point.tpot_ms) / 1e3;
        let next = (rate * seconds).round().max(1.0);
        if next > f64::from(max) {
            return None;
        }
        let next = next as u32;
        if next == concurrency {
            return Some(point);
        }
        concurrency = next;
    }
    Some(replica.at(concurrency))
}

/// One compared figure.
struct Row {
    id: String,
    kind: &'static str,
    concurrency: u32,
    published: f64,
    predicted: f64,
}

impl Row {
    fn error(&self) -> f64 {
        self.predicted / self.published - 1.0
    }
}

/// Every figure's prediction, and the figures left out with why.
fn compare(fixture: &Fixture) -> (Vec<Row>, Vec<String>) {
    let mut rows = Vec::new();
    let mut skipped = Vec::new();
    for figure in &fixture.figures {
        let input = serving_input(fixture, figure);
        let replica = Replica::new(&input)
            .unwrap_or_else(|refusal| panic!("{}: no prediction: {refusal}", figure.id));
        let max = replica.concurrency().max;
        let point = match figure.load {
            Load::Offline => replica.at(max),
            Load::Static => {
                let batch = figure
                    .concurrency
                    .unwrap_or_else(|| panic!("{}: a static batch needs its size", figure.id));
                // A batch the KV cache cannot hold runs as many as it can.
                replica.at(batch.min(max))
            }
            Load::Rate => {
                let rate = figure
                    .requests_per_second
                    .unwrap_or_else(|| panic!("{}: a rate row needs its rate", figure.id));
                match littles_law(&replica, rate, figure.output_tokens) {
                    Some(point) => point,
                    None => {
                        skipped.push(format!("{}: saturated at {rate} requests/s", figure.id));
                        continue;
                    }
                }
            }
        };
        let mut push = |kind, published: Option<f64>, predicted| {
            if let Some(published) = published {
                rows.push(Row {
                    id: figure.id.clone(),
                    kind,
                    concurrency: point.concurrency,
                    published,
                    predicted,
                });
            }
        };
        push(
            "tokens/s",
            figure.published.output_tokens_per_second,
            point.output_tokens_per_second,
        );
        // Under static batching nothing else is prefilled between the steps.
        let tpot = match figure.load {
            Load::Static => point.decode_step_ms,
            Load::Offline | Load::Rate => point.tpot_ms,
        };
        push("TPOT ms", figure.published.tpot_ms, tpot);
        push("TTFT ms", figure.published.ttft_ms, point.ttft_ms);
    }
    (rows, skipped)
}

#[test]
fn nine_in_ten_published_throughput_and_tpot_figures_are_predicted_within_25_percent() {
    let fixture = fixture();
    let (rows, skipped) = compare(&fixture);
    let mut table = String::from("figure | kind | concurrency | published | predicted | error\n");
    for row in &rows {
        let error = row.error();
        table += &format!(
            "{} | {} | {} | {:.1} | {:.1} | {:+.1}%{}\n",
            row.id,
            row.kind,
            row.concurrency,
            row.published,
            row.predicted,
            error * 100.0,
            if error.abs() > TOLERANCE {
                " (miss)"
            } else {
                ""
            }
        );
    }
    for line in &skipped {
        table += &format!("skipped: {line}\n");
    }
    let mut failures = Vec::new();
    for kind in ["tokens/s", "TPOT ms"] {
        let of_kind: Vec<&Row> = rows.iter().filter(|row| row.kind == kind).collect();
        let met = of_kind
            .iter()
            .filter(|row| row.error().abs() <= TOLERANCE)
            .count();
        let share = met as f64 / of_kind.len().max(1) as f64;
        table += &format!(
            "{kind}: {met} of {} within {:.0}% ({:.1}%)\n",
            of_kind.len(),
            TOLERANCE * 100.0,
            share * 100.0
        );
        if share < REQUIRED {
            failures.push(format!("{kind}: {met} of {} within 25%", of_kind.len()));
        }
    }
    let ttft = rows.iter().filter(|row| row.kind == "TTFT ms").count();
    table += &format!("TTFT ms: {ttft} figures, shown, not held to the tolerance\n");
    println!("{table}");
    let count = |kind| rows.iter().filter(|row| row.kind == kind).count();
    assert!(
        count("tokens/s") >= 100,
        "the fixture has its throughput figures"
    );
    assert!(count("TPOT ms") >= 25, "the fixture has its TPOT figures");
    assert!(failures.is_empty(), "{failures:?}\n{table}");
}

#[test]
fn the_fixture_covers_the_runtimes_gpus_tensor_sizes_and_loads() {
    let fixture = fixture();
    assert_eq!(
        fixture.figures.len(),
        114,
        "every published row is in the fixture"
    );
    for runtime in [
        Runtime::TensorrtLlm,
        Runtime::Vllm,
        Runtime::Sglang,
        Runtime::Generic,
    ] {
        assert!(fixture.figures.iter().any(|f| f.runtime == runtime));
    }
    for gpu in ["H100-SXM-80GB", "H200-SXM-141GB", "A100-SXM4-80GB"] {
        assert!(fixture.figures.iter().any(|f| f.gpu == gpu), "{gpu}");
    }
    for tensor in [1, 2, 4, 8] {
        assert!(
            fixture.figures.iter().any(|f| f.tensor == tensor),
            "TP{tensor}"
        );
    }
    for load in [Load::Offline, Load::Static, Load::Rate] {
        assert!(fixture.figures.iter().any(|f| f.load == load));
    }
}

/// The KV cache is what separates one H100 from one H200 or two H100s for
/// Llama-3.1-70B in FP8 at 128/2048, as the published figures show (912,
/// 4,166 and 6,170 tokens/s).
#[test]
fn memory_for_the_kv_cache_decides_70b_fp8_on_one_h100() {
    let fixture = fixture();
    let find = |id: &str| {
        fixture
            .figures
            .iter()
            .find(|figure| figure.id == id)
            .unwrap_or_else(|| panic!("{id} is in the fixture"))
    };
    let replica = |id| Replica::new(&serving_input(&fixture, find(id))).expect("fits");
    let h100 = replica("trtllm017-70b-h100-tp1-128-2048");
    let h200 = replica("trtllm017-70b-h200-tp1-128-2048");
    let two = replica("trtllm017-70b-h100-tp2-128-2048");
    let (one, more, pair) = (
        h100.concurrency().max,
        h200.concurrency().max,
        two.concurrency().max,
    );
    assert!(more > 4 * one && pair > 4 * one, "{one} {more} {pair}");
    let tokens = |replica: &Replica| {
        replica
            .at(replica.concurrency().max)
            .output_tokens_per_second
    };
    assert!(tokens(&h200) > 3.0 * tokens(&h100));
    // Per GPU, two H100s beat one: the smallest count that holds the weights
    // is not the one with the most tokens per GPU.
    assert!(tokens(&two) / 2.0 > tokens(&h100));
}

/// One node of `stages × tensor` GPUs, fully linked within each group, as
/// the solver would see it, and the solver's tokens/s for the plan.
fn solver_tokens_per_second(input: &ServingInput) -> f64 {
    let tensor = input.plan.tensor as usize;
    let stages = input.plan.stages.len();
    let gpu = &input.plan.stages[0].gpu;
    let link = input.plan.stages[0].link;
    let ids: Vec<String> = (0..tensor * stages).map(|i| format!("gpu-{i}")).collect();
    let devices = ids
        .iter()
        .enumerate()
        .map(|(index, id)| Device {
            id: id.clone(),
            index: index as u32,
            vendor: gpu.vendor.clone(),
            product: "test GPU".into(),
            memory_total_bytes: gpu.memory_bytes as u64,
            memory_free_bytes: gpu.memory_bytes as u64,
            fp16_tflops: gpu.fp16_tflops,
            fp8_tflops: gpu.fp8_tflops,
            fp4_tflops: gpu.fp4_tflops,
            memory_bandwidth_gbps: gpu.memory_bandwidth_gbps,
            temperature_c: Some(40.0),
            healthy: true,
            health_reason: None,
            allocated_to: None,
            not_whole: None,
            share: None,
        })
        .collect();
    let mut links = Vec::new();
    for group in ids.chunks(tensor) {
        for (i, a) in group.iter().enumerate() {
            for b in &group[i + 1..] {
                links.push(Link {
                    a: a.clone(),
                    b: b.clone(),
                    kind: link.kind.expect("a test link has a kind"),
                    bandwidth_gbps: link.gbps.expect("a test link has a bandwidth"),
                });
            }
        }
    }
    let problem = Problem {
        served: None,
        one_device: false,
        nodes: vec![NodeState {
            name: "node".into(),
            zone: None,
            rack: None,
            labels: BTreeMap::new(),
            devices,
            links,
        }],
        model: tessera_core::placement::ModelShape::of(&input.model.spec),
        tensor: input.plan.tensor,
        stages: Stages::Fixed(stages as u32),
        weights: Weights::default(),
        max_temperature_c: 85.0,
        selector: Selector::default(),
        strategy: Strategy::Pack,
        replica_nodes: Vec::new(),
        goal: SpeedGoal::default(),
    };
    let choices: Vec<StageChoice> = ids
        .chunks(tensor)
        .map(|group| StageChoice {
            node: "node".into(),
            devices: group.to_vec(),
        })
        .collect();
    evaluate(&problem, &choices)
        .unwrap_or_else(|reason| panic!("no plan: {reason}"))
        .performance
        .tokens_per_second
}

#[test]
fn at_concurrency_one_the_serving_model_is_the_solvers_single_stream_prediction() {
    let fixture = fixture();
    let mut checked = 0;
    for id in [
        "trtllm017-8b-h100-tp1-128-128",
        "trtllm017-8b-a100-tp1-1000-1000",
        "trtllm017-70b-h200-tp2-128-2048",
        "trtllm017-70b-a100-tp4-2048-2048",
        "trtllm017-405b-h200-tp8-128-128",
        "sglang-bench-v5",
        "lmdeploy-70b-tp4-128-2048-b1",
    ] {
        let figure = fixture
            .figures
            .iter()
            .find(|figure| figure.id == id)
            .unwrap_or_else(|| panic!("{id} is in the fixture"));
        let input = serving_input(&fixture, figure);
        let replica = Replica::new(&input).expect("fits");
        let serving = 1e3 / replica.at(1).decode_step_ms;
        let solver = solver_tokens_per_second(&input);
        assert!(
            (serving / solver - 1.0).abs() < 1e-9,
            "{id}: serving {serving} vs solver {solver} tokens/s"
        );
        checked += 1;
    }
    // A two-stage pipeline on one node: both stages and the same-node hop.
    let figure = &fixture.figures[0];
    let mut input = serving_input(&fixture, figure);
    input.model.spec.dtype = DType::Bf16;
    input.plan.tensor = 2;
    input.plan.stages = vec![input.plan.stages[0].clone(); 2];
    let replica = Replica::new(&input).expect("fits");
    let serving = 1e3 / replica.at(1).decode_step_ms;
    let solver = solver_tokens_per_second(&input);
    assert!(
        (serving / solver - 1.0).abs() < 1e-9,
        "pipeline: serving {serving} vs solver {solver} tokens/s"
    );
    assert!(checked + 1 >= 8);
}

/// The share of `rows` of `kind` within the tolerance, and how many there are.
fn within(rows: &[&Row], kind: &str) -> (usize, usize) {
    let of_kind: Vec<&&Row> = rows.iter().filter(|row| row.kind == kind).collect();
    let met = of_kind
        .iter()
        .filter(|row| row.error().abs() <= TOLERANCE)
        .count();
    (met, of_kind.len())
}

#[test]
fn held_out_figures_stay_where_they_stand_by_source() {
    let fixture = held_out();
    let (rows, skipped) = compare(&fixture);
    assert!(skipped.is_empty(), "{skipped:?}");
    let mut table = String::from("figure | kind | concurrency | published | predicted | error\n");
    for row in &rows {
        table += &format!(
            "{} | {} | {} | {:.1} | {:.1} | {:+.1}%\n",
            row.id,
            row.kind,
            row.concurrency,
            row.published,
            row.predicted,
            row.error() * 100.0
        );
    }
    let mut failures = Vec::new();
    for (source, floor) in HELD_OUT_FLOOR {
        let of_source: Vec<&Row> = rows
            .iter()
            .filter(|row| row.id.split('-').next() == Some(*source))
            .collect();
        let (tput, tput_all) = within(&of_source, "tokens/s");
        let (tpot, tpot_all) = within(&of_source, "TPOT ms");
        let share = (tput + tpot) as f64 / (tput_all + tpot_all).max(1) as f64;
        table += &format!(
            "{source}: tokens/s {tput} of {tput_all}, TPOT {tpot} of {tpot_all} within 25% ({:.1}%)\n",
            share * 100.0
        );
        if share + 1e-9 < *floor {
            failures.push(format!(
                "{source}: {:.1}% < {:.1}%",
                share * 100.0,
                floor * 100.0
            ));
        }
    }
    println!("{table}");
    assert_eq!(rows.iter().filter(|row| row.kind != "TTFT ms").count(), 102);
    assert!(failures.is_empty(), "{failures:?}\n{table}");
}
