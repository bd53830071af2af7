//! Controller benchmarks on a generated 1,000-node mixed-GPU cluster (8 GPUs
//! per node, published as the node agents publish them):
//!
//! - `observe/1000_nodes_parsed`: reading every Node's GPU state annotation,
//!   which the controller's cache does once per Node update;
//!   `observe/1000_nodes_cached`: what a reconcile pays to read the parsed
//!   nodes from that cache.
//! - `dra_pools/5000_nodes_built`: which nodes offer their GPUs through DRA
//!   and each device's name, from 5,000 nodes' ResourceSlices (8 devices
//!   each); `dra_pools/5000_nodes_unchanged`: what a reconcile pays for them
//!   while no slice changed.
//! - `plan_and_build/64_stages_over_1000x8`: the plan stage (problem building
//!   plus the solver) and the build stage (64 shard pods, each requesting
//!   its devices' vendor's resource) for a 64-stage, 1.8-trillion-parameter
//!   instance.

#[allow(dead_code)]
mod support;

use std::hint::black_box;
use std::sync::Arc;

use criterion::{Criterion, SamplingMode, criterion_group, criterion_main};
use k8s_openapi::api::core::v1::Node;
use kube::runtime::{reflector, watcher};
use serde_json::json;
use tessera::api::ResourceName;
use tessera::controller::decide::{Current, PlanDecision, PlanInputs, decide};
use tessera::controller::desired::{shard_pods, shard_resource};
use tessera::controller::dra::pools::Pools;
use tessera::controller::dra::{CachedSlice, DraCaches};
use tessera::controller::held::Held;
use tessera::controller::node_cache::{CachedNode, gpu_nodes};
use tessera::controller::nodes::NodeInfo;

use support::cluster;
use support::objects::{instance_1_8t, to_node};

const SEED: u64 = 0x7e55_e7a0_5eed_0001;
const DRIVER: &str = "gpu.tessera.dev";

/// Node `n`'s slice as its agent publishes it (8 devices named `gpu-<i>`,
/// each with a UUID-like ID), read as the controller caches it.
fn slice(n: usize) -> CachedSlice {
    let node = format!("gpu-node-{n:05}");
    let devices: Vec<serde_json::Value> = (0..8)
        .map(|i| {
            json!({
                "name": format!("gpu-{i}"),
                "attributes": {"id": {"string": format!("GPU-{n:08x}-{i:04x}-4000-8000-000000000000")}},
            })
        })
        .collect();
    serde_json::from_value(json!({
        "metadata": {"name": format!("{node}-{DRIVER}-0"), "uid": format!("uid-{n}"), "resourceVersion": n.to_string()},
        "spec": {
            "driver": DRIVER,
            "nodeName": node,
            "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
            "devices": devices,
        },
    }))
    .expect("a slice the controller reads")
}

fn bench(c: &mut Criterion) {
    let nodes: Vec<Node> = cluster(1000, SEED).iter().map(to_node).collect();
    let infos: Vec<Arc<NodeInfo>> = nodes
        .iter()
        .filter_map(|n| NodeInfo::from_node(n).ok().flatten().map(Arc::new))
        .collect();
    assert_eq!(infos.len(), 1000);
    let mi = instance_1_8t();
    let held = Held::new();
    let inputs = PlanInputs::new(
        &infos,
        &held,
        k8s_openapi::jiff::Timestamp::now(),
        &tessera::controller::reconcile::Settings::default(),
    );
    let current = Current::NONE;
    let per_vendor: ResourceName = "tessera.dev/{vendor}-gpu".parse().expect("a valid name");
    match decide(&mi.spec, &[], &current, &inputs) {
        PlanDecision::Planned(p) => eprintln!(
            "REPORT controller: 64-stage plan over 1000x8, {} shards, {:.1} tokens/s predicted",
            p.plan.len(),
            p.tokens_per_second.unwrap_or(0.0)
        ),
        other => panic!("the benchmark instance must be placeable: {other:?}"),
    }

    let mut group = c.benchmark_group("controller");
    group.sampling_mode(SamplingMode::Flat);
    group.sample_size(20);
    group.bench_function("observe/1000_nodes_parsed", |b| {
        b.iter(|| {
            black_box(&nodes)
                .iter()
                .map(|n| CachedNode::from(n.clone()))
                .collect::<Vec<_>>()
        })
    });
    let cached: Vec<Arc<CachedNode>> = nodes
        .iter()
        .map(|n| Arc::new(CachedNode::from(n.clone())))
        .collect();
    group.bench_function("observe/1000_nodes_cached", |b| {
        b.iter(|| gpu_nodes(black_box(&cached)).len())
    });
    let (slices, mut writer) = reflector::store::<CachedSlice>();
    for n in 0..5000 {
        writer.apply_watcher_event(&watcher::Event::Apply(slice(n)));
    }
    let dra = DraCaches::new(slices.clone(), reflector::store().0);
    assert!(dra.pools(DRIVER).node("gpu-node-04999").is_some());
    let cached_slices = slices.state();
    group.bench_function("dra_pools/5000_nodes_built", |b| {
        b.iter(|| Pools::of(black_box(&cached_slices), DRIVER))
    });
    group.bench_function("dra_pools/5000_nodes_unchanged", |b| {
        b.iter(|| dra.pools(black_box(DRIVER)))
    });
    group.bench_function("plan_and_build/64_stages_over_1000x8", |b| {
        b.iter(|| {
            let PlanDecision::Planned(p) = decide(black_box(&mi.spec), &[], &current, &inputs)
            else {
                unreachable!("planned above")
            };
            shard_pods(&mi, &p.plan, |s| {
                shard_resource(&per_vendor, s, &infos, None)
            })
        })
    });
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
