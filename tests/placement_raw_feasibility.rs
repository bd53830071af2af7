//! Every plan `tessera place` makes on random clusters, checked against the raw
//! telemetry of the cluster file by a feasibility check written here, apart
//! from the solver: no rounding, no shared code but the input types. Readings
//! are drawn close to the limits they are compared with (a temperature a tenth
//! of a degree under `maxTemperatureC`, free memory a few MiB over a shard's
//! need), where rounding decides wrongly.
//!
//! Two directions: a plan must be feasible on the raw numbers, and when one
//! device plainly holds the whole model (by a margin larger than the solver's
//! documented rounding of free memory) the answer must not be "unsatisfiable".

use std::collections::{BTreeMap, HashSet};
use std::path::PathBuf;

use proptest::prelude::*;
use serde_json::{Value, json};
use tessera::cli::place::{PlaceArgs, PlaceOutput, Report, run};

const GIB: f64 = 1024.0 * 1024.0 * 1024.0;
/// Free memory is planned on in 256 MiB steps, rounded down (documented).
const FREE_MEMORY_STEP: f64 = 256.0 * 1024.0 * 1024.0;

#[derive(Clone, Debug)]
struct Gpu {
    memory_gib: u32,
    /// Bytes in use, anything (not a multiple of a rounding step).
    used_bytes: u64,
    temperature: Option<f64>,
    healthy: bool,
    amd: bool,
    allocated: bool,
}

#[derive(Clone, Debug)]
struct Model {
    billions: f64,
    layers: u32,
    kv_gib: f64,
    tensor: u32,
    pipeline: Option<u32>,
    max_temperature: f64,
    vendors: Vec<&'static str>,
}

/// A reading near the limit: a little under, at, or a little over it.
fn temperature(limit: f64) -> impl Strategy<Value = Option<f64>> {
    prop_oneof![
        1 => Just(None),
        3 => (-15i32..=15).prop_map(move |tenths| Some(
            ((limit + f64::from(tenths) / 10.0) * 100.0).round() / 100.0
        )),
        1 => (200u32..900).prop_map(|t| Some(f64::from(t) / 10.0)),
    ]
}

fn gpu(limit: f64) -> impl Strategy<Value = Gpu> {
    (
        prop::sample::select(vec![24u32, 40, 80, 192]),
        0u64..(40u64 << 30),
        temperature(limit),
        prop::bool::weighted(0.9),
        prop::bool::weighted(0.3),
        prop::bool::weighted(0.15),
    )
        .prop_map(
            |(memory_gib, used, temperature, healthy, amd, allocated)| Gpu {
                memory_gib,
                used_bytes: used.min(u64::from(memory_gib) << 30),
                temperature,
                healthy,
                amd,
                allocated,
            },
        )
}

fn model() -> impl Strategy<Value = Model> {
    (
        prop::sample::select(vec![1.0, 7.0, 13.0, 34.0, 70.0]),
        8u32..64,
        prop::sample::select(vec![0.0, 2.0, 8.5]),
        1u32..3,
        prop::option::of(1u32..4),
        (600u32..900).prop_map(|t| f64::from(t) / 10.0),
        prop::sample::subsequence(vec!["nvidia", "amd"], 0..=2),
    )
        .prop_map(
            |(billions, layers, kv_gib, tensor, pipeline, max_temperature, vendors)| Model {
                billions,
                layers,
                kv_gib,
                tensor,
                pipeline,
                max_temperature,
                vendors,
            },
        )
}

fn case() -> impl Strategy<Value = (Model, Vec<Vec<Gpu>>)> {
    model().prop_flat_map(|m| {
        let limit = m.max_temperature;
        let nodes = prop::collection::vec(prop::collection::vec(gpu(limit), 1..5), 1..4);
        (Just(m), nodes)
    })
}

fn cluster_file(nodes: &[Vec<Gpu>]) -> Value {
    let nodes: Vec<Value> = nodes
        .iter()
        .enumerate()
        .map(|(n, gpus)| {
            let mut allocated = BTreeMap::new();
            let devices: Vec<Value> = gpus
                .iter()
                .enumerate()
                .map(|(i, g)| {
                    let id = format!("n{n}-g{i}");
                    if g.allocated {
                        allocated.insert(id.clone(), format!("uid-{n}-{i}"));
                    }
                    let total = u64::from(g.memory_gib) << 30;
                    let mut d = json!({
                        "id": id, "index": i, "vendor": if g.amd { "amd" } else { "nvidia" },
                        "product": format!("GPU {}G", g.memory_gib),
                        "memoryTotalBytes": total, "memoryFreeBytes": total - g.used_bytes,
                        "fp16Tflops": 100.0 + f64::from(g.memory_gib), "memoryBandwidthGbps": 2000.0,
                        "health": if g.healthy { "Healthy" } else { "Unhealthy" },
                    });
                    if let Some(t) = g.temperature {
                        d["temperatureC"] = json!(t);
                    }
                    d
                })
                .collect();
            json!({"name": format!("n{n}"), "gpuState": {
                "version": "v1", "backend": "fake", "devices": devices, "allocated": allocated,
            }})
        })
        .collect();
    json!({ "nodes": nodes })
}

fn instance_file(m: &Model) -> Value {
    let mut spec = json!({
        "model": {"name": "m", "parametersBillions": m.billions, "layers": m.layers, "kvCacheGiB": m.kv_gib},
        "parallelism": {"tensor": m.tensor, "pipeline": m.pipeline.map_or(json!("auto"), |p| json!(p.min(m.layers)))},
        "placement": {"maxTemperatureC": m.max_temperature, "vendors": m.vendors},
    });
    if m.vendors.is_empty() {
        spec["placement"]
            .as_object_mut()
            .map(|p| p.remove("vendors"));
    }
    json!({"apiVersion": "tessera.dev/v1alpha1", "kind": "ModelInstance",
           "metadata": {"name": "m"}, "spec": spec})
}

/// Bytes one device of a stage needs with `layers` layers: overhead plus its
/// share of the stage's weights and KV cache (1.5 GiB overhead, bf16).
fn need(m: &Model, layers: u32) -> f64 {
    let per_layer = (m.billions * 1e9 * 2.0 + kv_bytes(m)) / f64::from(m.layers);
    1.5 * GIB + f64::from(layers) * per_layer / f64::from(m.tensor)
}

/// The KV cache a plan holds room for: `kvCacheGiB`, or with 0 (nothing
/// reserved) one request of the default 1,024 + 256 tokens, at the
/// documented estimate for a model without its heads given: one bf16 key
/// and value of the hidden size per token and layer, the hidden size that
/// of a standard decoder block (12·h² parameters per layer).
fn kv_bytes(m: &Model) -> f64 {
    if m.kv_gib > 0.0 {
        return m.kv_gib * GIB;
    }
    let layers = f64::from(m.layers);
    let hidden = (m.billions * 1e9 / (12.0 * layers)).sqrt();
    2.0 * hidden * 2.0 * 1280.0 * layers
}

/// Why a device may not carry a shard at all, judged on raw readings.
fn unusable(m: &Model, g: &Gpu) -> Option<String> {
    if g.allocated {
        return Some("allocated to a pod".into());
    }
    if !g.healthy {
        return Some("unhealthy".into());
    }
    if let Some(t) = g.temperature
        && t >= m.max_temperature
    {
        return Some(format!("{t} °C is not below {}", m.max_temperature));
    }
    let vendor = if g.amd { "amd" } else { "nvidia" };
    if !m.vendors.is_empty() && !m.vendors.contains(&vendor) {
        return Some(format!("vendor {vendor} not allowed"));
    }
    None
}

fn free(g: &Gpu) -> f64 {
    ((u64::from(g.memory_gib) << 30) - g.used_bytes) as f64
}

fn check_plan(m: &Model, nodes: &[Vec<Gpu>], report: &Report) -> Result<(), String> {
    let placement = &report.placements[0];
    let Some(plan) = &placement.plan else {
        // Refused: fine unless one usable device plainly holds the whole model.
        if m.tensor == 1 && m.pipeline.unwrap_or(1) == 1 {
            for (n, gpus) in nodes.iter().enumerate() {
                for (i, g) in gpus.iter().enumerate() {
                    if unusable(m, g).is_none() && free(g) - FREE_MEMORY_STEP >= need(m, m.layers) {
                        return Err(format!(
                            "unsatisfiable, but n{n}-g{i} holds the whole model: {:?}",
                            placement.unsatisfiable
                        ));
                    }
                }
            }
        }
        return Ok(());
    };
    if let Some(p) = m.pipeline {
        let want = p.min(m.layers) as usize;
        if plan.stages.len() != want {
            return Err(format!("{} stages, {want} asked", plan.stages.len()));
        }
    }
    let mut next_layer = 0;
    let mut used = HashSet::new();
    for s in &plan.stages {
        if s.layer_start != next_layer || s.layer_end <= s.layer_start {
            return Err(format!(
                "stage layers {}..{} after {next_layer}",
                s.layer_start, s.layer_end
            ));
        }
        next_layer = s.layer_end;
        if s.devices.len() != m.tensor as usize {
            return Err(format!(
                "{} devices for tensor {}",
                s.devices.len(),
                m.tensor
            ));
        }
        let n: usize = s.node[1..]
            .parse()
            .map_err(|_| format!("node {}", s.node))?;
        for id in &s.devices {
            if !used.insert(id.clone()) {
                return Err(format!("{id} used twice"));
            }
            let i: usize = id
                .rsplit("-g")
                .next()
                .and_then(|i| i.parse().ok())
                .ok_or(format!("device {id}"))?;
            if !id.starts_with(&format!("n{n}-")) {
                return Err(format!("{id} is not on {}", s.node));
            }
            let g = &nodes[n][i];
            if let Some(why) = unusable(m, g) {
                return Err(format!("{id} planned although {why}"));
            }
            let need = need(m, s.layers());
            if need > free(g) * (1.0 + 1e-12) {
                return Err(format!(
                    "{id} has {} bytes free, its {} layers need {need}",
                    free(g),
                    s.layers()
                ));
            }
        }
    }
    if next_layer != m.layers {
        return Err(format!(
            "the stages end at layer {next_layer} of {}",
            m.layers
        ));
    }
    Ok(())
}

fn scratch() -> PathBuf {
    let dir = std::env::temp_dir().join(format!("tessera-raw-feasibility-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("scratch dir");
    dir
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn every_plan_is_feasible_on_the_raw_telemetry((m, nodes) in case()) {
        let dir = scratch();
        let cluster = dir.join("cluster.yaml");
        let instance = dir.join("instance.yaml");
        std::fs::write(&cluster, cluster_file(&nodes).to_string()).expect("write");
        std::fs::write(&instance, instance_file(&m).to_string()).expect("write");
        let report = run(&PlaceArgs {
            instances: vec![instance],
            cluster: Some(cluster),
            output: PlaceOutput::Json,
            max_steps: Some(20_000),
            drain: Vec::new(),
            improve: None,
            show_missed: false,
        })
        .map_err(|e| TestCaseError::fail(format!("refused as bad input: {e}")))?;
        let _ = std::fs::remove_dir_all(&dir);
        if let Err(why) = check_plan(&m, &nodes, &report) {
            return Err(TestCaseError::fail(format!("{why}\n{}", report.render(PlaceOutput::Table))));
        }
    }
}
