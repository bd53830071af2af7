//! Resident memory of the controller's caches at scale: 5,000 GPU nodes (8
//! GPUs each, with NVLink/xGMI link lists) and 500 ModelInstances of 4 shards
//! with their shard pods and Services, filled into the same reflector stores
//! and cut down to the same parts as `tessera controller` does (a Node to its
//! parsed GPU state). Prints the heap bytes each cache holds (counted by
//! this benchmark's allocator, so memory freed but kept by the allocator does
//! not blur them) and VmRSS before and after; run with
//! `cargo bench --bench controller_memory`.

#[allow(dead_code)]
mod support;

use k8s_openapi::api::core::v1::{ContainerImage, Node, NodeSystemInfo, Pod, Service};
use kube::runtime::reflector::{self, store::Writer};
use kube::runtime::watcher;
use tessera::api::{ModelInstanceStatus, Phase, PlannedShard};
use tessera::controller::desired::{headless_service, shard_pods};
use tessera::controller::node_cache::{CachedNode, gpu_nodes};

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

use support::cluster;
use support::memory::status_kib;
use support::objects::{instance_1_8t, to_node};

const SEED: u64 = 0x7e55_e7a0_5eed_0002;
const NODES: usize = 5000;
const INSTANCES: usize = 500;
const SHARDS: usize = 4;

/// The system allocator, counting the bytes in use.
struct Counting;

static LIVE: AtomicUsize = AtomicUsize::new(0);

// SAFETY: every call goes to the system allocator unchanged; only a counter
// is added.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LIVE.fetch_add(layout.size(), Ordering::Relaxed);
        // SAFETY: the caller's contract is passed on.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
        // SAFETY: the caller's contract is passed on.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

fn live_mib() -> f64 {
    LIVE.load(Ordering::Relaxed) as f64 / f64::from(1 << 20)
}

fn fill<K>(writer: &mut Writer<K>, objects: impl IntoIterator<Item = K>)
where
    K: kube::Resource<DynamicType = ()> + Clone + 'static,
{
    writer.apply_watcher_event(&watcher::Event::Init);
    for o in objects {
        writer.apply_watcher_event(&watcher::Event::InitApply(o));
    }
    writer.apply_watcher_event(&watcher::Event::InitDone);
}

/// A Node as a real kubelet reports it: a few dozen images, system info and
/// managed fields, all of which the controller's cache drops.
fn full_node(n: &tessera::placement::NodeState) -> Node {
    let mut node = to_node(n);
    node.metadata.managed_fields = Some(vec![Default::default(); 4]);
    let status = node.status.get_or_insert_with(Default::default);
    status.images = Some(
        (0..40)
            .map(|i| ContainerImage {
                names: Some(vec![
                    format!("registry.example.com/team/image-{i}@sha256:{:064x}", i),
                    format!("registry.example.com/team/image-{i}:v1.{i}"),
                ]),
                size_bytes: Some(1 << 30),
            })
            .collect(),
    );
    status.node_info = Some(NodeSystemInfo {
        kernel_version: "6.1.0".into(),
        os_image: "Debian GNU/Linux 12".into(),
        ..Default::default()
    });
    node
}

fn main() {
    let before = status_kib("self", "VmRSS:");
    let (nodes, mut node_writer) = reflector::store::<CachedNode>();
    let (instances, mut instance_writer) = reflector::store();
    let (pods, mut pod_writer) = reflector::store::<Pod>();
    let (services, mut service_writer) = reflector::store::<Service>();

    let generated = cluster(NODES, SEED);
    let start = live_mib();
    fill(
        &mut node_writer,
        generated.iter().map(|n| CachedNode::from(full_node(n))),
    );
    let node_mib = live_mib() - start;
    let start = live_mib();
    let mut all_instances = Vec::new();
    let mut all_pods = Vec::new();
    let mut all_services = Vec::new();
    for i in 0..INSTANCES {
        let mut mi = instance_1_8t();
        mi.metadata.name = Some(format!("model-{i:03}"));
        mi.metadata.uid = Some(format!("uid-{i:03}"));
        let plan: Vec<PlannedShard> = (0..SHARDS)
            .map(|s| {
                let node = &generated[(i * SHARDS + s) % NODES];
                PlannedShard {
                    copy: 0,
                    replica: 0,
                    shard: s as u32,
                    node: node.name.clone(),
                    devices: node.devices[..2].iter().map(|d| d.id.clone()).collect(),
                    layer_start: (s * 32) as u32,
                    layer_end: (s * 32 + 32) as u32,
                    predicted_memory_gib: 71.5,
                    share: None,
                }
            })
            .collect();
        for (mut pod, shard) in shard_pods(&mi, &plan, |_| "tessera.dev/gpu".into())
            .into_iter()
            .zip(&plan)
        {
            if let Some(spec) = pod.spec.as_mut() {
                spec.node_name = Some(shard.node.clone());
            }
            all_pods.push(pod);
        }
        all_services.push(headless_service(&mi));
        mi.status = Some(ModelInstanceStatus {
            phase: Some(Phase::Running),
            shards: SHARDS as u32,
            ready_shards: SHARDS as u32,
            plan,
            ..Default::default()
        });
        all_instances.push(mi);
    }
    fill(&mut instance_writer, all_instances);
    fill(&mut pod_writer, all_pods);
    fill(&mut service_writer, all_services);
    let other_mib = live_mib() - start;
    drop(generated);
    let gpu_nodes = gpu_nodes(&nodes.state()).len();
    let after = status_kib("self", "VmRSS:");
    let peak = status_kib("self", "VmHWM:");
    println!(
        "controller caches: {} nodes ({gpu_nodes} parsed), {} instances, {} pods, {} services",
        nodes.state().len(),
        instances.state().len(),
        pods.state().len(),
        services.state().len()
    );
    println!(
        "heap held: nodes {node_mib:.1} MiB ({:.1} KiB a node), instances, pods and services {other_mib:.1} MiB",
        node_mib * 1024.0 / NODES as f64
    );
    println!(
        "VmRSS before {:.1} MiB, after {:.1} MiB (caches {:.1} MiB); peak {:.1} MiB",
        before as f64 / 1024.0,
        after as f64 / 1024.0,
        after.saturating_sub(before) as f64 / 1024.0,
        peak as f64 / 1024.0
    );
}
