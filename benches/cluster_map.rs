//! The controller's live cluster map of a generated 1,000-node mixed-GPU
//! cluster (8 GPUs a node, published as the node agents publish them) with
//! 1,000 instances holding 6,200 of its 8,000 GPUs: 700 take a whole node
//! (tensor 8), 300 two GPUs. `map/1000_nodes` is one page render from what
//! the controller caches; the page's size is printed (`REPORT`). Targets:
//! under 50 ms and under 1 MB.

#[allow(dead_code)]
mod support;

use std::hint::black_box;
use std::sync::Arc;

use criterion::{Criterion, SamplingMode, criterion_group, criterion_main};
use serde_json::json;
use tessera::api::ModelInstance;
use tessera::controller::held::Held;
use tessera::controller::map_server::cluster_map;
use tessera::controller::nodes::NodeInfo;

use support::cluster;
use support::objects::to_node;

const SEED: u64 = 0x7e55_e7a0_5eed_0001;

/// A running one-shard instance `ml/model-<k>` planned on `devices` of `node`.
fn instance(k: usize, node: &str, devices: &[String]) -> ModelInstance {
    serde_json::from_value(json!({
        "apiVersion": "tessera.dev/v1alpha1",
        "kind": "ModelInstance",
        "metadata": {"name": format!("model-{k:04}"), "namespace": "ml", "uid": format!("uid-{k}")},
        "spec": {
            "model": {"name": "meta-llama/Llama-3.1-70B", "parametersBillions": 70.6, "layers": 80},
            "parallelism": {"tensor": devices.len(), "pipeline": 1},
            "template": {"spec": {"containers": [{"name": "shard", "image": "runtime:1"}]}},
        },
        "status": {
            "phase": "Running",
            "predictedTokensPerSecond": 41.5,
            "plan": [{"shard": 0, "node": node, "devices": devices, "layerStart": 0, "layerEnd": 80,
                      "predictedMemoryGiB": 60.0}],
        },
    }))
    .expect("a valid ModelInstance")
}

fn bench(c: &mut Criterion) {
    let states = cluster(1000, SEED);
    let nodes: Vec<Arc<NodeInfo>> = states
        .iter()
        .map(to_node)
        .filter_map(|n| NodeInfo::from_node(&n).ok().flatten().map(Arc::new))
        .collect();
    assert_eq!(nodes.len(), 1000);
    let instances: Vec<Arc<ModelInstance>> = states
        .iter()
        .enumerate()
        .map(|(k, node)| {
            let ids: Vec<String> = node.devices.iter().map(|d| d.id.clone()).collect();
            let held = if k < 700 { &ids[..] } else { &ids[..2] };
            Arc::new(instance(k, &node.name, held))
        })
        .collect();
    let page = cluster_map(&nodes, &instances, Held::new());
    let gpus: usize = states.iter().map(|n| n.devices.len()).sum();
    eprintln!(
        "REPORT cluster map: 1000 nodes, {gpus} GPUs, {} instances: {:.2} MB of HTML ({} bytes)",
        instances.len(),
        page.len() as f64 / 1e6,
        page.len()
    );
    let mut group = c.benchmark_group("cluster_map");
    group.sampling_mode(SamplingMode::Flat);
    group.sample_size(20);
    group.bench_function("map/1000_nodes", |b| {
        b.iter(|| cluster_map(black_box(&nodes), black_box(&instances), Held::new()).len())
    });
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
