//! The speed model against published single-stream decode figures
//! (`fixtures/published_decode.yaml`): every predicted tokens/s within 25% of
//! the published one, and every source's TP1 -> TP8 speed-up within 25% of
//! the published speed-up. The table printed on failure (and with
//! `--nocapture`) is the one in docs/benchmarks.md.

use std::collections::BTreeMap;

use serde::Deserialize;
use tessera_core::api::{GIB, ModelSpec};
use tessera_core::placement::{
    Device, Interconnect, Link, ModelShape, NodeState, Problem, Selector, SpeedGoal, StageChoice,
    Stages, Strategy, Weights, evaluate,
};

const FIXTURE: &str = include_str!("fixtures/published_decode.yaml");
/// The largest relative error a figure or a speed-up may have.
const TOLERANCE: f64 = 0.25;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Fixture {
    gpus: BTreeMap<String, Gpu>,
    figures: Vec<Figure>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct Gpu {
    vendor: String,
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
#[serde(deny_unknown_fields)]
struct Figure {
    id: String,
    source: String,
    model: ModelSpec,
    gpu: String,
    tensor: u32,
    published: f64,
    #[allow(dead_code)]
    conversion: String,
}

/// One source's figures of one model on one GPU: (source, model, GPU), whose
/// figures by tensor size are `(published, predicted)`.
type Series = (String, String, String);

fn fixture() -> Fixture {
    serde_saphyr::from_str(FIXTURE).expect("the committed fixture parses")
}

/// One node of `figure.tensor` GPUs, fully linked, and the figure's model on
/// all of them as one stage.
fn predict(figure: &Figure, gpu: &Gpu) -> f64 {
    let kind = match gpu.link.as_str() {
        "nvlink" => Interconnect::NvLink,
        "xgmi" => Interconnect::Xgmi,
        "pcie" => Interconnect::Pcie,
        other => panic!("{}: unknown link kind {other}", figure.id),
    };
    let ids: Vec<String> = (0..figure.tensor).map(|i| format!("gpu-{i}")).collect();
    let devices = ids
        .iter()
        .enumerate()
        .map(|(index, id)| Device {
            id: id.clone(),
            index: index as u32,
            vendor: gpu.vendor.clone(),
            product: gpu.product.clone(),
            memory_total_bytes: (gpu.memory_gib * GIB) as u64,
            memory_free_bytes: (gpu.memory_gib * GIB) as u64,
            fp16_tflops: gpu.fp16_tflops,
            fp8_tflops: gpu.fp8_tflops,
            fp4_tflops: None,
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
    for (i, a) in ids.iter().enumerate() {
        for b in &ids[i + 1..] {
            links.push(Link {
                a: a.clone(),
                b: b.clone(),
                kind,
                bandwidth_gbps: gpu.link_gbps,
            });
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
        model: ModelShape::of(&figure.model),
        tensor: figure.tensor,
        stages: Stages::Fixed(1),
        weights: Weights::default(),
        max_temperature_c: 85.0,
        selector: Selector::default(),
        strategy: Strategy::Pack,
        replica_nodes: Vec::new(),
        goal: SpeedGoal::default(),
    };
    let plan = evaluate(
        &problem,
        &[StageChoice {
            node: "node".into(),
            devices: ids,
        }],
    )
    .unwrap_or_else(|reason| panic!("{}: no plan: {reason}", figure.id));
    plan.performance.tokens_per_second
}

#[test]
fn every_published_figure_and_speed_up_is_predicted_within_25_percent() {
    let fixture = fixture();
    assert!(fixture.figures.len() >= 15, "at least 15 figures");
    let mut table = String::from("figure | GPU | TP | published | predicted | error\n");
    let mut failures = Vec::new();
    // (source, model, gpu) -> tensor -> (published, predicted)
    let mut series: BTreeMap<Series, BTreeMap<u32, (f64, f64)>> = BTreeMap::new();
    for figure in &fixture.figures {
        let gpu = fixture
            .gpus
            .get(&figure.gpu)
            .unwrap_or_else(|| panic!("{}: unknown GPU {}", figure.id, figure.gpu));
        let predicted = predict(figure, gpu);
        let error = predicted / figure.published - 1.0;
        table += &format!(
            "{} | {} | {} | {:.1} | {:.1} | {:+.1}%\n",
            figure.id,
            figure.gpu,
            figure.tensor,
            figure.published,
            predicted,
            error * 100.0
        );
        if error.abs() > TOLERANCE {
            failures.push(format!("{}: {:+.1}%", figure.id, error * 100.0));
        }
        series
            .entry((
                figure.source.clone(),
                figure.model.name.clone(),
                figure.gpu.clone(),
            ))
            .or_default()
            .insert(figure.tensor, (figure.published, predicted));
    }
    let mut speed_ups = 0;
    for ((source, model, gpu), by_tensor) in &series {
        if let (Some(one), Some(eight)) = (by_tensor.get(&1), by_tensor.get(&8)) {
            speed_ups += 1;
            let published = eight.0 / one.0;
            let predicted = eight.1 / one.1;
            let error = predicted / published - 1.0;
            table += &format!(
                "speed-up TP1->TP8 {source} {model} {gpu}: published x{published:.2}, predicted x{predicted:.2}, {:+.1}%\n",
                error * 100.0
            );
            if error.abs() > TOLERANCE {
                failures.push(format!(
                    "speed-up {source} {model} {gpu}: {:+.1}%",
                    error * 100.0
                ));
            }
        }
    }
    println!("{table}");
    assert!(speed_ups >= 2, "the fixture has TP1 -> TP8 series");
    assert!(failures.is_empty(), "{failures:?}\n{table}");
}

#[test]
fn the_fixture_covers_h100_a100_mi300x_and_a_pcie_card_at_several_tensor_sizes() {
    let fixture = fixture();
    for gpu in ["H100-SXM", "A100-SXM-80GB", "MI300X"] {
        assert!(
            fixture.figures.iter().any(|figure| figure.gpu == gpu),
            "no figure on {gpu}"
        );
    }
    assert!(fixture.figures.iter().any(|figure| {
        fixture
            .gpus
            .get(&figure.gpu)
            .is_some_and(|gpu| gpu.link == "pcie")
    }));
    let h100_sizes: std::collections::BTreeSet<u32> = fixture
        .figures
        .iter()
        .filter(|figure| figure.source == "nemo-llama2" && figure.gpu == "H100-SXM")
        .map(|figure| figure.tensor)
        .collect();
    assert_eq!(h100_sizes.into_iter().collect::<Vec<_>>(), vec![1, 2, 4, 8]);
}

/// The check is not vacuous: the speed model before calibration (a
/// bandwidth roofline at 60% of datasheet bandwidth plus 5 µs per all-reduce)
/// would fail it, as the issue that asked for it measured (H100 TP1 -> TP8
/// predicted x5.78 against x1.58 published).
#[test]
fn a_roofline_without_fixed_costs_would_fail_the_speed_up_check() {
    let fixture = fixture();
    let roofline = |figure: &Figure| {
        let gpu = &fixture.gpus[&figure.gpu];
        let shape = ModelShape::of(&figure.model);
        let tensor = f64::from(figure.tensor);
        let mut layer =
            shape.weight_bytes_per_layer / (tensor * gpu.memory_bandwidth_gbps * 1e9 * 0.6);
        if figure.tensor > 1 {
            layer += 2.0 * 5e-6;
        }
        1.0 / (f64::from(shape.layers) * layer)
    };
    let find = |id: &str| {
        fixture
            .figures
            .iter()
            .find(|figure| figure.id == id)
            .unwrap_or_else(|| panic!("{id} is in the fixture"))
    };
    let (one, eight) = (find("nemo-7b-h100-tp1"), find("nemo-7b-h100-tp8"));
    let predicted = roofline(eight) / roofline(one);
    let published = eight.published / one.published;
    assert!(
        predicted / published - 1.0 > TOLERANCE,
        "x{predicted:.2} vs x{published:.2}"
    );
}
