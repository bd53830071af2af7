//! The serving model against published batched figures from seven sources
//! (`fixtures/published_serving*.yaml`). Its constants are fitted
//! (`fit`), and judged on figures they were not fitted to: each source is held
//! out in turn, the constants fitted on the others, and the held-out source's
//! throughput and time-per-token figures compared (leave one source out).
//! Targets: 90% of all figures within 25%, and 85% of each held-out source's.
//! The tables printed on failure (and with `--nocapture`) are the ones in
//! docs/benchmarks.md. Also: at concurrency 1 the serving model is the
//! solver's single-stream prediction.

mod fit;
mod fixture;
mod predict;

use std::collections::BTreeMap;

use tessera_core::api::DType;
use tessera_core::placement::{
    Device, Link, NodeState, Problem, Selector, SpeedGoal, StageChoice, Stages, Strategy, Weights,
    evaluate,
};
use tessera_core::serving::{Constants, Replica, Runtime, ServingInput};

use fixture::{Load, serving_input};
use predict::{Row, compare, share, table};

/// Where the held-out shares stand, by source, and overall: a change that
/// predicts any of them worse fails. docs/serving-model.md says which
/// figures miss the targets and why.
const HELD_OUT_FLOOR: &[(&str, f64)] = &[
    ("dstack", 0.636),
    ("lmdeploy", 1.0),
    ("rocmvllm010", 0.928),
    ("sglang", 1.0),
    ("trt090dli", 0.969),
    ("trtllm017", 0.973),
    ("trtllm061", 1.0),
];
/// Where the share of all figures, each predicted without its source,
/// stands (the target is 90%).
const HELD_OUT_OVERALL_FLOOR: f64 = 0.944;
/// Where the share of all figures within 25% with the committed constants
/// stands.
const FITTED_FLOOR: f64 = 0.957;

fn sources(fixture: &fixture::Fixture) -> Vec<String> {
    let mut sources: Vec<String> = fixture
        .figures
        .iter()
        .map(|figure| figure.source().to_string())
        .collect();
    sources.sort();
    sources.dedup();
    sources
}

fn percent(met: usize, of: usize) -> f64 {
    met as f64 / of.max(1) as f64 * 100.0
}

#[test]
fn every_source_held_out_in_turn() {
    let fixture = fixture::all();
    let sources = sources(&fixture);
    let mut rows: Vec<Row> = Vec::new();
    let mut summary = String::from("held out | constants fitted on the others | within 25%\n");
    let mut failures = Vec::new();
    for held in &sources {
        let others: Vec<&str> = sources
            .iter()
            .map(String::as_str)
            .filter(|source| source != held)
            .collect();
        let constants = fit::fit(&fixture, &others);
        let held_rows = compare(&fixture, &constants, Some(&[held.as_str()]));
        let (met, of) = share(&held_rows);
        summary += &format!(
            "{held} | compiled {:.2}, pytorch {:.2}, other vendors {:.2}, all-reduce {:.2} | {met} of {of} ({:.1}%)\n",
            constants.compiled_efficiency,
            constants.pytorch_efficiency,
            constants.other_vendor_compute_share,
            constants.all_reduce_bandwidth_share,
            percent(met, of)
        );
        let floor = HELD_OUT_FLOOR
            .iter()
            .find(|(source, _)| source == held)
            .map(|(_, floor)| *floor)
            .unwrap_or_else(|| panic!("{held} has a floor"));
        if percent(met, of) + 1e-9 < floor * 100.0 {
            failures.push(format!(
                "{held}: {:.1}% < {:.1}%",
                percent(met, of),
                floor * 100.0
            ));
        }
        rows.extend(held_rows);
    }
    let (met, of) = share(&rows);
    summary += &format!(
        "all, each predicted without its source | {met} of {of} ({:.1}%)\n",
        percent(met, of)
    );
    if percent(met, of) + 1e-9 < HELD_OUT_OVERALL_FLOOR * 100.0 {
        failures.push(format!("overall: {:.1}%", percent(met, of)));
    }
    println!("{}\n{summary}", table(&rows));
    assert!(of >= 200, "both fixtures' figures are judged: {of}");
    assert!(failures.is_empty(), "{failures:?}\n{summary}");
}

#[test]
fn with_the_committed_constants_most_figures_are_within_25_percent() {
    let fixture = fixture::all();
    let rows = compare(&fixture, &Constants::FITTED, None);
    let mut summary = String::new();
    for source in sources(&fixture) {
        let of_source: Vec<Row> = rows
            .iter()
            .filter(|row| row.source == source)
            .cloned()
            .collect();
        let (met, of) = share(&of_source);
        summary += &format!("{source}: {met} of {of} ({:.1}%)\n", percent(met, of));
    }
    let (met, of) = share(&rows);
    summary += &format!("all: {met} of {of} ({:.1}%)\n", percent(met, of));
    println!("{}\n{summary}", table(&rows));
    assert!(percent(met, of) + 1e-9 >= FITTED_FLOOR * 100.0, "{summary}");
}

/// The committed constants are what the fit on every source gives, so
/// anyone can reproduce them.
#[test]
fn the_committed_constants_are_the_fit_on_every_source() {
    let fixture = fixture::all();
    let all = sources(&fixture);
    let all: Vec<&str> = all.iter().map(String::as_str).collect();
    let fitted = fit::fit(&fixture, &all);
    assert_eq!(fitted, Constants::FITTED);
}

#[test]
fn the_fixture_covers_the_runtimes_gpus_tensor_sizes_and_loads() {
    let fixture = fixture::first();
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
    let fixture = fixture::first();
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
    let fixture = fixture::first();
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
