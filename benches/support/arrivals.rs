//! The cluster benchmark's workload: a seeded sequence of ModelInstance
//! arrivals and deletions. 8B-, 70B- and 405B-class models with their real
//! layer counts and KV caches, fixed and `auto` tensor sizes, pipeline `auto`,
//! one to three replicas, and deletions of earlier instances that free their
//! devices. The same seed always gives the same sequence.
// Only the cluster benchmark uses it.
#![allow(dead_code)]

use serde_json::{Value, json};
use tessera::api::ModelInstanceSpec;
use tessera::sizing::TensorChoice;

use super::{ModelSpec, SplitMix64};

/// Llama 3.1 8B in bf16 with an 8 GiB KV cache: one H100, A100 or MI300X,
/// or two RTX 4090s.
pub(crate) const MODEL_8B: ModelSpec = ModelSpec {
    parameters: 8.0e9,
    layers: 32,
    hidden: 4096,
    attention_heads: 32,
    kv_heads: 8,
    kv_cache_gib: 8.0,
    overhead_gib: 1.5,
};

/// Llama 3.1 70B in bf16 with a 20 GiB KV cache (about 152 GiB).
pub(crate) const MODEL_70B: ModelSpec = ModelSpec {
    parameters: 70.6e9,
    layers: 80,
    hidden: 8192,
    attention_heads: 64,
    kv_heads: 8,
    kv_cache_gib: 20.0,
    overhead_gib: 2.0,
};

/// Llama 3.1 405B in bf16 with a 40 GiB KV cache (about 795 GiB).
pub(crate) const MODEL_405B: ModelSpec = ModelSpec {
    parameters: 405e9,
    layers: 126,
    hidden: 16384,
    attention_heads: 128,
    kv_heads: 8,
    kv_cache_gib: 40.0,
    overhead_gib: 2.0,
};

/// A ModelInstance as it arrives.
#[derive(Clone, Debug)]
pub(crate) struct Arrival {
    /// Position among the arrivals, from 0; deletions name it.
    pub(crate) id: usize,
    pub(crate) class: &'static str,
    pub(crate) model: ModelSpec,
    pub(crate) tensor: TensorChoice,
    pub(crate) replicas: u32,
}

#[derive(Clone, Debug)]
pub(crate) enum Event {
    Arrive(Arrival),
    /// The arrival with this id is deleted (nothing happens when it was
    /// never placed).
    Delete(usize),
}

impl Arrival {
    /// The ModelInstance spec an ML engineer writes for it: the model's
    /// shape, its tensor size, `pipeline: auto`, its replicas and
    /// `serving: {}`: the default request (1,024 tokens in, 256 out) at the
    /// default target (50 ms per output token, 2 s to the first), stated, so
    /// a replica that cannot meet it is not placed.
    pub(crate) fn spec_json(&self) -> Value {
        let model = self.model;
        let tensor = match self.tensor {
            TensorChoice::Fixed(size) => json!(size),
            TensorChoice::Auto => json!("auto"),
        };
        json!({
            "model": {"name": format!("bench/{}", self.class), "parametersBillions": model.parameters / 1e9,
                      "layers": model.layers, "dtype": "bf16", "hiddenSize": model.hidden,
                      "attentionHeads": model.attention_heads, "kvHeads": model.kv_heads,
                      "kvCacheGiB": model.kv_cache_gib, "overheadGiB": model.overhead_gib},
            "parallelism": {"tensor": tensor, "pipeline": "auto"},
            "replicas": self.replicas,
            "serving": {},
        })
    }

    pub(crate) fn spec(&self) -> ModelInstanceSpec {
        serde_json::from_value(self.spec_json()).expect("a valid ModelInstance spec")
    }
}

/// Share of events that delete an earlier instance.
const DELETIONS: f64 = 0.25;
const CLASSES: [(usize, u32); 3] = [(0, 62), (1, 33), (2, 5)];
const MODELS: [(&str, ModelSpec); 3] = [("8B", MODEL_8B), ("70B", MODEL_70B), ("405B", MODEL_405B)];
/// Tensor sizes by model class; `None` is `auto`.
const TENSOR_8B: [(Option<u32>, u32); 3] = [(Some(1), 65), (Some(2), 20), (None, 15)];
const TENSOR_70B: [(Option<u32>, u32); 5] = [
    (Some(1), 20),
    (Some(2), 35),
    (Some(4), 25),
    (Some(8), 10),
    (None, 10),
];
const TENSOR_405B: [(Option<u32>, u32); 3] = [(Some(4), 25), (Some(8), 55), (None, 20)];
const REPLICAS: [(u32, u32); 3] = [(1, 80), (2, 15), (3, 5)];

/// `events` events from `seed`.
pub(crate) fn sequence(events: usize, seed: u64) -> Vec<Event> {
    let mut rng = SplitMix64::new(seed);
    let mut out = Vec::with_capacity(events);
    let mut live: Vec<usize> = Vec::new();
    let mut arrivals = 0;
    for _ in 0..events {
        if !live.is_empty() && rng.chance(DELETIONS) {
            let index = rng.below(live.len() as u64) as usize;
            out.push(Event::Delete(live.swap_remove(index)));
            continue;
        }
        let class = rng.weighted(&CLASSES);
        let tensor = match class {
            0 => rng.weighted(&TENSOR_8B),
            1 => rng.weighted(&TENSOR_70B),
            _ => rng.weighted(&TENSOR_405B),
        };
        let (name, model) = MODELS[class];
        out.push(Event::Arrive(Arrival {
            id: arrivals,
            class: name,
            model,
            tensor: tensor.map_or(TensorChoice::Auto, TensorChoice::Fixed),
            replicas: rng.weighted(&REPLICAS),
        }));
        live.push(arrivals);
        arrivals += 1;
    }
    out
}

/// One line on the sequence for the bench log.
pub(crate) fn describe(events: &[Event]) -> String {
    let (mut by_class, mut auto, mut replicas, mut deletions) = ([0usize; 3], 0, 0, 0);
    for event in events {
        match event {
            Event::Arrive(arrival) => {
                let class = MODELS
                    .iter()
                    .position(|(name, _)| *name == arrival.class)
                    .unwrap_or(0);
                by_class[class] += 1;
                auto += usize::from(arrival.tensor == TensorChoice::Auto);
                replicas += arrival.replicas as usize;
            }
            Event::Delete(_) => deletions += 1,
        }
    }
    format!(
        "{} events: {} instances ({} 8B, {} 70B, {} 405B; {auto} with tensor auto) asking for {replicas} replicas, {deletions} deletions",
        events.len(),
        by_class.iter().sum::<usize>(),
        by_class[0],
        by_class[1],
        by_class[2],
    )
}
