//! The published figures and the serving input each one describes.

use std::collections::BTreeMap;

use serde::Deserialize;
use tessera_core::api::{DType, GIB, ModelSpec};
use tessera_core::placement::Interconnect;
use tessera_core::serving::{
    GpuFigures, GroupLink, Hop, KvCacheDtype, ReplicaPlan, Runtime, RuntimeConfig, RuntimeVersion,
    ServingInput, ServingModel, Stage, Workload,
};

/// The figures the model was first set on.
const FIRST: &str = include_str!("../fixtures/published_serving.yaml");
/// Figures from three more sources, read later.
const SECOND: &str = include_str!("../fixtures/published_serving_2.yaml");

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct Fixture {
    pub(crate) gpus: BTreeMap<String, Gpu>,
    pub(crate) models: BTreeMap<String, Shape>,
    pub(crate) figures: Vec<Figure>,
}

#[derive(Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub(crate) struct Gpu {
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

#[derive(Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub(crate) struct Shape {
    parameters_billions: f64,
    layers: u32,
    hidden_size: u32,
    attention_heads: u32,
    kv_heads: u32,
    /// The checkpoint's size where it is not parameters × dtype's bytes.
    #[serde(default, rename = "weightsGiB")]
    weights_gib: Option<f64>,
}

#[derive(Clone, Copy, Debug, Deserialize, PartialEq)]
#[serde(rename_all = "lowercase")]
pub(crate) enum Load {
    Offline,
    Static,
    Rate,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub(crate) struct Published {
    pub(crate) output_tokens_per_second: Option<f64>,
    pub(crate) tpot_ms: Option<f64>,
    pub(crate) ttft_ms: Option<f64>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub(crate) struct Figure {
    pub(crate) id: String,
    #[allow(dead_code)]
    pub(crate) source: String,
    pub(crate) runtime: Runtime,
    /// The runtime and its release, `vllm 0.6.3.post2`.
    pub(crate) version: String,
    pub(crate) gpu: String,
    pub(crate) tensor: u32,
    pub(crate) pipeline: u32,
    pub(crate) model: String,
    pub(crate) dtype: DType,
    pub(crate) input_tokens: f64,
    pub(crate) output_tokens: f64,
    pub(crate) load: Load,
    #[serde(default)]
    pub(crate) concurrency: Option<u32>,
    #[serde(default)]
    pub(crate) requests_per_second: Option<f64>,
    pub(crate) published: Published,
    #[serde(default)]
    pub(crate) memory_utilization: Option<f64>,
    #[serde(default)]
    pub(crate) max_num_seqs: Option<u32>,
    #[serde(default)]
    pub(crate) kv_cache_dtype: Option<KvCacheDtype>,
    #[allow(dead_code)]
    pub(crate) note: String,
}

impl Figure {
    /// The release in `version`, the word after the runtime's name.
    pub(crate) fn release(&self) -> RuntimeVersion {
        self.version
            .split_whitespace()
            .nth(1)
            .and_then(|release| release.parse().ok())
            .unwrap_or_else(|| panic!("{}: no release in {:?}", self.id, self.version))
    }

    /// The publication a figure comes from: its id up to the first dash. One
    /// source is one set of runs (a runtime's version, a harness, a method of
    /// reading), held out as a whole.
    pub(crate) fn source(&self) -> &str {
        self.id.split('-').next().unwrap_or(&self.id)
    }
}

pub(crate) fn first() -> Fixture {
    serde_saphyr::from_str(FIRST).expect("the committed fixture parses")
}

pub(crate) fn second() -> Fixture {
    serde_saphyr::from_str(SECOND).expect("the committed second fixture parses")
}

/// Both files as one: a GPU or model both name must be described alike.
pub(crate) fn all() -> Fixture {
    let mut all = first();
    let second = second();
    for (name, gpu) in second.gpus {
        if let Some(known) = all.gpus.get(&name) {
            assert_eq!(known, &gpu, "{name} differs between the fixtures");
        }
        all.gpus.insert(name, gpu);
    }
    for (name, shape) in second.models {
        if let Some(known) = all.models.get(&name) {
            assert_eq!(known, &shape, "{name} differs between the fixtures");
        }
        all.models.insert(name, shape);
    }
    all.figures.extend(second.figures);
    all
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
            weights_gib: shape.weights_gib,
        },
        head_dim: None,
    }
}

/// The serving input for a figure, from the data the solver would have.
pub(crate) fn serving_input(fixture: &Fixture, figure: &Figure) -> ServingInput {
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
            version: Some(figure.release()),
            memory_utilization: figure.memory_utilization,
            max_num_seqs: figure.max_num_seqs,
            kv_cache_dtype: figure.kv_cache_dtype.unwrap_or_default(),
            correction: None,
        },
    }
}
