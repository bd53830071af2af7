//! Demands for the cluster benchmark's arrivals, and the careful user who
//! serves them without tessera: a request rate and request lengths per
//! arrival, drawn from a stream of their own so the sequence of arrivals and
//! deletions stays the one the other measures replay; each arrival's spec as
//! a tessera user writes it for a demand; and the replica a careful user
//! writes for kube-scheduler.
// Each benchmark uses part of it.
#![allow(dead_code)]

use std::collections::BTreeMap;

use serde_json::json;
use tessera::api::ModelInstanceSpec;
use tessera::placement::{Plan, Problem, Stages, evaluate};
use tessera::translate::{ClusterNode, HeldShares, build_problem};

use super::arrivals::{Arrival, Event};
use super::{SplitMix64, at_target, first_fit};

/// Typical requests, tokens in and out, with their weights.
pub(crate) const REQUEST_SHAPES: [((u32, u32), u32); 4] = [
    ((1024, 256), 40),
    ((512, 128), 25),
    ((2048, 256), 20),
    ((256, 1024), 15),
];

/// The range a class's demand is drawn from (requests/s), log-uniform: a
/// few busy instances and many quiet ones.
fn demand_range(class: &str) -> (f64, f64) {
    match class {
        "8B" => (0.5, 20.0),
        "70B" => (0.3, 6.0),
        _ => (0.2, 2.0),
    }
}

/// What an instance asks to serve.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Demand {
    pub(crate) requests_per_second: f64,
    pub(crate) input_tokens: u32,
    pub(crate) output_tokens: u32,
}

/// A demand for every arrival of `events`, by arrival id; the same seed
/// always gives the same demands.
pub(crate) fn demands(events: &[Event], seed: u64) -> BTreeMap<usize, Demand> {
    let mut rng = SplitMix64::new(seed ^ 0xde3a_4d5e_ed00_0061);
    let mut out = BTreeMap::new();
    for event in events {
        let Event::Arrive(arrival) = event else {
            continue;
        };
        let (input_tokens, output_tokens) = rng.weighted(&REQUEST_SHAPES);
        let (low, high) = demand_range(arrival.class);
        let rate = (low.ln() + rng.unit() * (high.ln() - low.ln())).exp();
        out.insert(
            arrival.id,
            Demand {
                requests_per_second: (rate * 100.0).round() / 100.0,
                input_tokens,
                output_tokens,
            },
        );
    }
    out
}

/// `arrival` as a tessera user writes it for `demand`: `tensor: auto`,
/// `pipeline: auto`, `serving.replicasFromDemand` at the default target.
pub(crate) fn tessera_spec(arrival: &Arrival, demand: &Demand) -> ModelInstanceSpec {
    let mut spec = arrival.spec_json();
    spec["parallelism"] = json!({"tensor": "auto", "pipeline": "auto"});
    spec["serving"] = json!({
        "inputTokens": demand.input_tokens,
        "outputTokens": demand.output_tokens,
        "requestsPerSecond": demand.requests_per_second,
        "replicasFromDemand": true,
    });
    spec.as_object_mut().map(|spec| spec.remove("replicas"));
    serde_json::from_value(spec).expect("a valid ModelInstance spec")
}

/// Nodes of one GPU product enough for the longest pipeline tried: with
/// every GPU free, first fit never looks further.
const NODES_PER_PRODUCT: usize = 16;

/// `spec` as the careful user sizes it for kube-scheduler, which places
/// where it likes among the GPUs a claim allows: on `nodes` with every GPU
/// free, the smallest tensor size, then the fewest stages, whose replica
/// meets the target on some GPU product; every product it meets it on
/// (the claim's product selector); and replicas enough for the demand
/// where one serves least. `None` where no size meets the target.
pub(crate) fn user_sizing(
    spec: &ModelInstanceSpec,
    nodes: &[ClusterNode],
) -> Option<ModelInstanceSpec> {
    let mut by_product: BTreeMap<&str, Vec<&ClusterNode>> = BTreeMap::new();
    for node in nodes {
        if let Some(device) = node.gpu_state.devices.first() {
            let of = by_product.entry(device.product.as_str()).or_default();
            if of.len() < NODES_PER_PRODUCT {
                of.push(node);
            }
        }
    }
    let problems: Vec<(&str, Problem)> = by_product
        .iter()
        .map(|(product, nodes)| {
            let problem = build_problem(
                spec,
                nodes.iter().copied(),
                &Default::default(),
                &HeldShares::new(),
            );
            (*product, problem)
        })
        .collect();
    let layers = problems.first()?.1.model.layers;
    user_shapes(layers).find_map(|(tensor, stages)| {
        let served: Vec<(&str, f64)> = problems
            .iter()
            .filter_map(|(product, problem)| {
                let (_, rps, _) = first_fit_at_target(problem, tensor, stages)?;
                Some((*product, rps))
            })
            .collect();
        if served.is_empty() {
            return None;
        }
        let least = served
            .iter()
            .map(|(_, rps)| *rps)
            .fold(f64::INFINITY, f64::min);
        let demand = spec.demand().unwrap_or(0.0);
        let replicas = ((demand / least).ceil() as u32).clamp(1, spec.most_replicas());
        let mut sized = serde_json::to_value(spec).ok()?;
        sized["parallelism"] = json!({"tensor": tensor, "pipeline": stages});
        sized["replicas"] = json!(replicas);
        sized["serving"]["replicasFromDemand"] = json!(false);
        sized["placement"]["products"] = json!(served.iter().map(|(p, _)| *p).collect::<Vec<_>>());
        serde_json::from_value(sized).ok()
    })
}

/// The careful user's replica on `problem`: the smallest tensor size, then
/// the fewest stages, that first fit (nodes by name, as a scheduler without
/// a solver) finds free whole GPUs for and that meets the target there;
/// with what it serves at the target and the GPUs it takes. The user is
/// given tessera's serving model, not its placement.
pub(crate) fn user_replica(problem: &Problem) -> Option<(Plan, f64, f64)> {
    user_shapes(problem.model.layers)
        .find_map(|(tensor, stages)| first_fit_at_target(problem, tensor, stages))
}

/// The sizes the careful user tries, in order: the smallest tensor size,
/// then the fewest stages.
fn user_shapes(layers: u32) -> impl Iterator<Item = (u32, u32)> {
    [1, 2, 4, 8]
        .into_iter()
        .flat_map(move |tensor| (1..=layers.min(16)).map(move |stages| (tensor, stages)))
}

/// `problem` at `tensor` × `stages` on the GPUs first fit finds, where it
/// meets the target there: its plan, requests/s at the target and GPUs.
fn first_fit_at_target(problem: &Problem, tensor: u32, stages: u32) -> Option<(Plan, f64, f64)> {
    let mut sized = problem.clone();
    sized.tensor = tensor;
    sized.stages = Stages::Fixed(stages);
    let plan = evaluate(&sized, &first_fit(&sized)?).ok()?;
    let (at, gpus) = at_target(&sized, &plan)?;
    Some((plan, at.requests_per_second, gpus))
}
