//! `Allocate` with a pending planned binding, through the real device plugin
//! service (`DevicePlugin::allocate` called in-process: device validation, the
//! binding index's `check_allocate` with its checkpoint write, the container
//! response, the view update), on a busy node.
//!
//! Setup (deliberately larger than any real node, so the linear parts show):
//!
//! - 200 pods on the node: 100 pending shard pods bound with
//!   `tessera.dev/devices` naming 8 devices each, and 100 running shard pods
//!   whose allocations (8 devices each) are in the checkpoint, so every
//!   Allocate rewrites a checkpoint of ~100 entries;
//! - 1,600 synthetic devices (`GPU-bench-0000` …) in the device view, since
//!   no fake profile has that many; each pending pod's plan is its own 8;
//! - each measured call allocates one pending pod's plan (rotating through
//!   the 100). Between calls, untimed, that pod is deleted and re-added with a
//!   new UID, so there are always 100 pending bindings.
//!
//! Variants: checkpoint written with fsync (the agent's default), without
//! fsync, and `check_allocate` alone with no checkpoint file. Besides
//! criterion's figures, each variant is timed call by call for 10,000 calls
//! and summarised on a `REPORT` line (median, p99, max).

use std::hint::black_box;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{Criterion, criterion_group, criterion_main};
use k8s_openapi::api::core::v1::Pod;
use serde_json::json;
use tessera::agent::binding::Binder;
use tessera::agent::binding::{BindingConfig, BindingIndex};
use tessera::agent::container_devices::RuntimeOptions;
use tessera::agent::device_plugin::kubelet_api::v1beta1::device_plugin_server::DevicePlugin;
use tessera::agent::device_plugin::kubelet_api::v1beta1::{
    AllocateRequest, ContainerAllocateRequest,
};
use tessera::agent::device_plugin::server::PluginService;
use tessera::agent::state::channel;
use tessera::api::Vendor;
use tessera::backend::{DeviceInfo, DeviceState, RawHealth, Snapshot, Telemetry};

const PENDING: usize = 100;
const RUNNING: usize = 100;
const PER_POD: usize = 8;
const SAMPLES: usize = 10_000;

fn device_id(i: usize) -> String {
    format!("GPU-bench-{i:04}")
}

fn plan(slot: usize) -> Vec<String> {
    (slot * PER_POD..(slot + 1) * PER_POD)
        .map(device_id)
        .collect()
}

fn pod(name: &str, uid: &str, created: i64, devices: &[String], running: bool) -> Pod {
    let created = k8s_openapi::jiff::Timestamp::from_second(1_750_000_000 + created)
        .expect("a valid timestamp");
    let mut value = json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": "bench",
            "uid": uid,
            "creationTimestamp": created.to_string(),
            "annotations": {"tessera.dev/devices": devices.join(","), "tessera.dev/shard": "0"},
        },
        "spec": {
            "nodeName": "bench-node",
            "containers": [{
                "name": "main",
                "resources": {"limits": {"tessera.dev/gpu": PER_POD.to_string()}},
            }],
        },
    });
    if running {
        value["status"] = json!({"phase": "Running"});
    }
    serde_json::from_value(value).expect("a valid pod")
}

fn pending_pod(slot: usize, generation: u64) -> Pod {
    pod(
        &format!("shard-{slot:03}"),
        &format!("uid-shard-{slot:03}-{generation}"),
        slot as i64,
        &plan(slot),
        false,
    )
}

fn snapshot() -> Snapshot {
    let devices = (0..(PENDING + RUNNING) * PER_POD)
        .map(|i| DeviceState {
            info: DeviceInfo {
                id: device_id(i),
                index: i as u32,
                vendor: Vendor::Nvidia,
                product: "NVIDIA H100 80GB HBM3".into(),
                memory_total_bytes: 80 << 30,
                architecture: "9.0".into(),
                compute_units: 132,
                fp16_tflops: 989.0,
                fp8_tflops: None,
                fp4_tflops: None,
                memory_bandwidth_gbps: 3350.0,
                pci_bus_id: format!("0000:{:02x}:{:02x}.0", i / 32, i % 32),
                numa_node: Some((i / 800) as i32),
                mig: None,
            },
            telemetry: Telemetry::default(),
            health: RawHealth::Healthy,
        })
        .collect();
    Snapshot {
        backend: "fake".into(),
        devices,
        links: Vec::new(),
    }
}

struct Node {
    rt: tokio::runtime::Runtime,
    service: PluginService,
    index: Arc<BindingIndex>,
    generation: Vec<u64>,
    next: usize,
}

impl Node {
    fn new(checkpoint: Option<PathBuf>, sync_writes: bool) -> Self {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("tokio runtime");
        if let Some(path) = &checkpoint {
            let _ = std::fs::remove_file(path);
        }
        let index = Arc::new(BindingIndex::open(BindingConfig {
            checkpoint,
            sync_writes,
            ..BindingConfig::default()
        }));
        let mut pods: Vec<Pod> = (0..PENDING).map(|slot| pending_pod(slot, 0)).collect();
        // Running pods are recorded by the index on the first list (as after a
        // lost checkpoint), so the checkpoint holds their 100 allocations.
        pods.extend((0..RUNNING).map(|k| {
            pod(
                &format!("running-{k:03}"),
                &format!("uid-running-{k:03}"),
                -1000 + k as i64,
                &plan(PENDING + k),
                true,
            )
        }));
        index.resync(pods);
        assert_eq!(index.pending().len(), PENDING);
        assert_eq!(index.checkpoint().pods.len(), RUNNING);

        let (tx, rx) = channel("fake");
        tx.send_modify(|v| {
            v.snapshot = snapshot();
            v.ready = true;
        });
        let service = PluginService::new(
            "tessera.dev/gpu",
            rx,
            tx,
            index.clone(),
            RuntimeOptions::default(),
        );
        Self {
            rt,
            service,
            index,
            generation: vec![0; PENDING],
            next: 0,
        }
    }

    /// The next pending pod's slot and its Allocate request.
    fn prepare(&mut self) -> (usize, AllocateRequest) {
        let slot = self.next;
        self.next = (self.next + 1) % PENDING;
        // Kubelet lists the devices in its own order, not the annotation's.
        let mut ids = plan(slot);
        ids.reverse();
        let request = AllocateRequest {
            container_requests: vec![ContainerAllocateRequest { devices_ids: ids }],
        };
        (slot, request)
    }

    /// Untimed: the allocated pod goes away and comes back with a new UID.
    fn reset(&mut self, slot: usize) {
        let old = pending_pod(slot, self.generation[slot]);
        self.index.delete_pod(&old);
        self.generation[slot] += 1;
        self.index
            .apply_pod(&pending_pod(slot, self.generation[slot]));
    }

    /// One `Allocate` through the service, timed.
    fn allocate_once(&mut self) -> Duration {
        let (slot, request) = self.prepare();
        let service = &self.service;
        let took = self.rt.block_on(async {
            let request = tonic::Request::new(request);
            let started = Instant::now();
            let response = service.allocate(request).await;
            let took = started.elapsed();
            let response = response.expect("the planned devices are allocated");
            black_box(response);
            took
        });
        self.reset(slot);
        took
    }

    /// One `check_allocate` alone, timed.
    fn check_once(&mut self) -> Duration {
        let (slot, request) = self.prepare();
        let ids = &request.container_requests[0].devices_ids;
        let started = Instant::now();
        let verdict = self.index.check_allocate(ids);
        let took = started.elapsed();
        verdict.expect("the planned devices are accepted");
        self.reset(slot);
        took
    }
}

fn report(name: &str, mut samples: Vec<Duration>) {
    samples.sort();
    let n = samples.len();
    let at = |q: f64| samples[((q * n as f64).ceil() as usize).clamp(1, n) - 1];
    let mean = samples.iter().sum::<Duration>() / n as u32;
    println!(
        "REPORT {name}: n={n} median={:.1}us p99={:.1}us max={:.1}us mean={:.1}us (target p99 < 1000us)",
        at(0.50).as_secs_f64() * 1e6,
        at(0.99).as_secs_f64() * 1e6,
        samples[n - 1].as_secs_f64() * 1e6,
        mean.as_secs_f64() * 1e6,
    );
}

fn checkpoint_path(dir: &Path, name: &str) -> PathBuf {
    dir.join(format!("{name}.json"))
}

fn allocation(c: &mut Criterion) {
    let dir = std::env::temp_dir().join(format!("tessera-bench-alloc-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("temp dir");
    println!(
        "REPORT setup: {PENDING} pending bound pods + {RUNNING} running recorded pods, {PER_POD} devices each, {} synthetic devices, checkpoint in {}",
        (PENDING + RUNNING) * PER_POD,
        dir.display()
    );

    let variants: [(&str, Option<PathBuf>, bool); 3] = [
        (
            "allocate/grpc_service/checkpoint_fsync",
            Some(checkpoint_path(&dir, "fsync")),
            true,
        ),
        (
            "allocate/grpc_service/checkpoint_no_fsync",
            Some(checkpoint_path(&dir, "nofsync")),
            false,
        ),
        ("allocate/check_allocate_only/in_memory", None, false),
    ];
    // `cargo bench --bench allocation -- <filter>`: only the matching variants.
    let filter: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with('-'))
        .collect();
    for (name, checkpoint, sync) in variants {
        if !filter.is_empty() && !filter.iter().any(|f| name.contains(f.as_str())) {
            continue;
        }
        let check_only = checkpoint.is_none();
        let mut node = Node::new(checkpoint, sync);
        let once = |node: &mut Node| {
            if check_only {
                node.check_once()
            } else {
                node.allocate_once()
            }
        };
        for _ in 0..200 {
            once(&mut node);
        }
        let samples: Vec<Duration> = (0..SAMPLES).map(|_| once(&mut node)).collect();
        report(name, samples);

        let mut group = c.benchmark_group("allocation");
        group.sample_size(30);
        group.measurement_time(Duration::from_secs(5));
        group.bench_function(name, |b| {
            b.iter_custom(|iters| (0..iters).map(|_| once(&mut node)).sum())
        });
        group.finish();
    }
    let _ = std::fs::remove_dir_all(&dir);
}

criterion_group!(benches, allocation);
criterion_main!(benches);
