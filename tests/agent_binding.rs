//! Planned bindings (`tessera.dev/devices`) steering and vetoing device
//! allocation: the index on its own, the real device plugin over unix sockets
//! with a kubelet stand-in, and the pod watch against a mocked API server.
//! Every wait is bounded so a bug fails instead of hanging.

use std::collections::BTreeMap;
use std::future::Future;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use http::{Method, Request, Response, StatusCode};
use k8s_openapi::api::core::v1::Pod;
use kube::client::Body;
use serde_json::{Value, json};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tonic::Code;
use tower_test::mock;

use tessera::agent::binding::Binder;
use tessera::agent::binding::{
    BindingConfig, BindingIndex, CHECKPOINT_VERSION, PendingBinding, UNBOUND, load_checkpoint,
    run_pod_watch,
};
use tessera::agent::container_devices::RuntimeOptions;
use tessera::agent::device_plugin::kubelet_api::v1beta1::device_plugin_client::DevicePluginClient;
use tessera::agent::device_plugin::kubelet_api::v1beta1::device_plugin_server::DevicePlugin;
use tessera::agent::device_plugin::kubelet_api::v1beta1::*;
use tessera::agent::device_plugin::registration::{
    PluginConfig, PluginError, PluginStatus, connect_unix, run_device_plugin,
};
use tessera::agent::device_plugin::server::PluginService;
use tessera::agent::publisher::{PublisherConfig, PublisherStats, run_publisher};
use tessera::agent::state;
use tessera::api::NodeGpuState;
use tessera::backend::fake::FakeBackend;
use tessera::backend::snapshot;

#[path = "common/kubelet.rs"]
mod kubelet;
use kubelet::FakeKubelet;

const WAIT: Duration = Duration::from_secs(5);
const NODE: &str = "gpu-node-1";

async fn within<T>(what: &str, f: impl Future<Output = T>) -> T {
    match tokio::time::timeout(WAIT, f).await {
        Ok(v) => v,
        Err(_) => panic!("timed out after {WAIT:?} waiting for {what}"),
    }
}

/// A fresh directory for one test, removed afterwards.
struct TempDir(PathBuf);

impl TempDir {
    fn new(name: &str) -> Self {
        let dir =
            std::env::temp_dir().join(format!("tessera-binding-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        Self(dir)
    }

    fn path(&self) -> &Path {
        &self.0
    }

    fn checkpoint(&self) -> PathBuf {
        self.0.join("state/checkpoint.json")
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn s(v: &[&str]) -> Vec<String> {
    v.iter().map(|x| x.to_string()).collect()
}

/// What a pod looks like to the index.
struct PodSpec<'a> {
    ns: &'a str,
    name: &'a str,
    /// Seconds after a fixed epoch.
    created: i64,
    devices: Option<&'a str>,
    phase: Option<&'a str>,
    deleting: bool,
    /// `tessera.dev/gpu` limit of its one container.
    gpus: u32,
}

fn spec<'a>(ns: &'a str, name: &'a str, created: i64) -> PodSpec<'a> {
    PodSpec {
        ns,
        name,
        created,
        devices: None,
        phase: None,
        deleting: false,
        gpus: 0,
    }
}

impl<'a> PodSpec<'a> {
    /// A shard pod planned on `devices`, asking for as many GPUs.
    fn planned(mut self, devices: &'a str) -> Self {
        self.devices = Some(devices);
        self.gpus = devices.split(',').count() as u32;
        self
    }

    fn phase(mut self, phase: &'a str) -> Self {
        self.phase = Some(phase);
        self
    }

    fn deleting(mut self) -> Self {
        self.deleting = true;
        self
    }

    fn gpus(mut self, n: u32) -> Self {
        self.gpus = n;
        self
    }

    fn json(&self) -> Value {
        let created = 1_750_000_000 + self.created;
        let mut meta = json!({
            "name": self.name,
            "namespace": self.ns,
            "uid": uid(self.name),
            "resourceVersion": "1",
            "creationTimestamp": k8s_openapi::jiff::Timestamp::from_second(created).unwrap().to_string(),
        });
        if let Some(d) = self.devices {
            meta["annotations"] = json!({ "tessera.dev/devices": d, "tessera.dev/shard": "0" });
        }
        if self.deleting {
            meta["deletionTimestamp"] = json!("2025-06-15T12:00:00Z");
        }
        let mut container = json!({"name": "main", "image": "vllm"});
        if self.gpus > 0 {
            container["resources"] = json!({"limits": {"tessera.dev/gpu": self.gpus.to_string()}});
        }
        let mut pod = json!({
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": meta,
            "spec": {"nodeName": NODE, "schedulerName": "tessera", "containers": [container]},
        });
        if let Some(p) = self.phase {
            pod["status"] = json!({ "phase": p });
        }
        pod
    }

    fn pod(&self) -> Pod {
        serde_json::from_value(self.json()).unwrap()
    }
}

fn uid(name: &str) -> String {
    format!("uid-{name}")
}

fn index_at(path: &Path) -> BindingIndex {
    BindingIndex::open(BindingConfig::at(path))
}

fn pending_names(index: &BindingIndex) -> Vec<String> {
    index.pending().into_iter().map(|p| p.pod).collect()
}

// ---------------------------------------------------------------------------
// The index on its own.

#[test]
fn pending_bindings_come_from_bound_pods_that_have_not_started() {
    let index = BindingIndex::open(BindingConfig::in_memory());
    index.resync([
        spec("ml", "waiting", 1).planned("g0,g1").pod(),
        spec("ml", "no-status-yet", 2).planned("g2").pod(),
        spec("ml", "done", 3).planned("g3").phase("Succeeded").pod(),
        spec("ml", "failed", 4).planned("g4").phase("Failed").pod(),
        spec("ml", "going-away", 5)
            .planned("g5")
            .phase("Pending")
            .deleting()
            .pod(),
        spec("ml", "ordinary", 6).gpus(1).phase("Pending").pod(),
        spec("ml", "empty-plan", 7).planned(" , ").pod(),
        spec("ml", "running", 8)
            .planned("g6,g7")
            .phase("Running")
            .pod(),
    ]);
    assert_eq!(
        index.pending(),
        vec![
            PendingBinding {
                uid: uid("waiting"),
                pod: "ml/waiting".into(),
                devices: s(&["g0", "g1"]),
                created: Some(k8s_openapi::jiff::Timestamp::from_second(1_750_000_001).unwrap()),
            },
            PendingBinding {
                uid: uid("no-status-yet"),
                pod: "ml/no-status-yet".into(),
                devices: s(&["g2"]),
                created: Some(k8s_openapi::jiff::Timestamp::from_second(1_750_000_002).unwrap()),
            },
        ]
    );
    // A bound pod already running without a record (a lost checkpoint, or one
    // started before the agent enforced bindings) holds its planned devices.
    let checkpoint = index.checkpoint();
    assert_eq!(checkpoint.pods.len(), 1);
    assert_eq!(checkpoint.pods[&uid("running")].devices, s(&["g6", "g7"]));

    // Changes arrive one by one.
    index.apply_pod(
        &spec("ml", "waiting", 1)
            .planned("g0,g1")
            .phase("Failed")
            .pod(),
    );
    index.delete_pod(&spec("ml", "no-status-yet", 2).pod());
    index.apply_pod(&spec("ml", "late", 9).planned("g8").pod());
    assert_eq!(pending_names(&index), ["ml/late"]);
}

#[test]
fn nothing_is_planned_or_allowed_before_the_pods_are_listed() {
    let index = BindingIndex::open(BindingConfig::in_memory());
    assert!(!index.is_synced());
    index.apply_pod(&spec("ml", "a", 1).planned("g0").pod());
    assert_eq!(index.planned_for(&s(&["g0", "g1"]), &[], 1), None);
    let err = index.check_allocate(&s(&["g1"])).unwrap_err();
    assert!(err.contains("not been listed yet"), "{err}");
    index.resync([spec("ml", "a", 1).planned("g0").pod()]);
    assert!(index.is_synced());
    assert_eq!(
        index.planned_for(&s(&["g0", "g1"]), &[], 1),
        Some(s(&["g0"]))
    );
}

#[test]
fn the_oldest_fitting_pending_pod_is_preferred() {
    let index = BindingIndex::open(BindingConfig::in_memory());
    index.resync([
        spec("ml", "young", 30).planned("g4,g5").pod(),
        spec("ml", "oldest", 10).planned("g2,g3").pod(),
        spec("ml", "middle", 20).planned("g0,g1").pod(),
        // Same creation time: the name decides.
        spec("zz", "b-tie", 5).planned("g6,g7").pod(),
        spec("aa", "a-tie", 5).planned("g8,g9").pod(),
    ]);
    assert_eq!(
        pending_names(&index),
        ["aa/a-tie", "zz/b-tie", "ml/oldest", "ml/middle", "ml/young"]
    );
    let all: Vec<String> = (0..10).map(|i| format!("g{i}")).collect();
    assert_eq!(index.planned_for(&all, &[], 2), Some(s(&["g8", "g9"])));
    let without_ties: Vec<String> = (0..6).map(|i| format!("g{i}")).collect();
    assert_eq!(
        index.planned_for(&without_ties, &[], 2),
        Some(s(&["g2", "g3"]))
    );
    // The oldest's devices are not all available: the next one.
    assert_eq!(
        index.planned_for(&s(&["g0", "g1", "g2", "g4", "g5"]), &[], 2),
        Some(s(&["g0", "g1"]))
    );
}

#[test]
fn must_include_and_size_are_honoured() {
    let index = BindingIndex::open(BindingConfig::in_memory());
    index.resync([
        spec("ml", "pair-a", 1).planned("g0,g1").pod(),
        spec("ml", "pair-b", 2).planned("g3,g2").pod(),
        spec("ml", "triple", 3).planned("g4,g5,g6").pod(),
    ]);
    let all: Vec<String> = (0..8).map(|i| format!("g{i}")).collect();
    assert_eq!(index.planned_for(&all, &[], 2), Some(s(&["g0", "g1"])));
    // Must-include picks the plan that has it; the plan comes in annotation order.
    assert_eq!(
        index.planned_for(&all, &s(&["g2"]), 2),
        Some(s(&["g3", "g2"]))
    );
    assert_eq!(
        index.planned_for(&all, &[], 3),
        Some(s(&["g4", "g5", "g6"]))
    );
    // A must-include device no plan has, or a size no plan has: no plan applies.
    assert_eq!(index.planned_for(&all, &s(&["g7"]), 2), None);
    assert_eq!(index.planned_for(&all, &[], 1), None);
    assert_eq!(index.planned_for(&all, &[], 4), None);
    // Must-include devices count as offered even if kubelet lists them only there.
    assert_eq!(
        index.planned_for(&s(&["g1"]), &s(&["g0"]), 2),
        Some(s(&["g0", "g1"]))
    );
}

#[test]
fn an_exact_match_is_accepted_recorded_and_no_longer_pending() {
    let dir = TempDir::new("exact");
    let index = index_at(&dir.checkpoint());
    index.resync([
        spec("team-a", "llama-70b-shard-0", 1)
            .planned("GPU-a,GPU-b")
            .pod(),
        spec("team-a", "llama-70b-shard-1", 2)
            .planned("GPU-c,GPU-d")
            .pod(),
    ]);
    // Any order: the plan is a set.
    index.check_allocate(&s(&["GPU-b", "GPU-a"])).unwrap();
    assert_eq!(pending_names(&index), ["team-a/llama-70b-shard-1"]);

    let on_disk = load_checkpoint(&dir.checkpoint()).unwrap().unwrap();
    assert_eq!(on_disk, index.checkpoint());
    let entry = &on_disk.pods[&uid("llama-70b-shard-0")];
    assert_eq!(entry.pod, "team-a/llama-70b-shard-0");
    assert_eq!(entry.devices, s(&["GPU-a", "GPU-b"]));
    let when: k8s_openapi::jiff::Timestamp = entry.time.parse().unwrap();
    assert!(
        (k8s_openapi::jiff::Timestamp::now().as_second() - when.as_second()).abs() < 60,
        "{when}"
    );
    assert_eq!(
        index.allocated_devices().get("GPU-a").map(String::as_str),
        Some(uid("llama-70b-shard-0").as_str())
    );

    // The same devices again while the pod is still being admitted (an init
    // container, then the app container): fine, and nothing changes.
    index.check_allocate(&s(&["GPU-a", "GPU-b"])).unwrap();
    assert_eq!(index.checkpoint(), on_disk);
}

#[test]
fn a_mismatch_is_refused_naming_the_pod_and_both_sets() {
    let index = BindingIndex::open(BindingConfig::in_memory());
    index.resync([spec("team-a", "llama-70b-shard-1", 1)
        .planned("GPU-a,GPU-b")
        .pod()]);
    let err = index.check_allocate(&s(&["GPU-a", "GPU-c"])).unwrap_err();
    assert_eq!(
        err,
        "pod team-a/llama-70b-shard-1 was planned on [GPU-a, GPU-b] but kubelet chose \
         [GPU-a, GPU-c]; refusing so the controller can re-place it"
    );
    // A subset is a mismatch too.
    let err = index.check_allocate(&s(&["GPU-b"])).unwrap_err();
    assert!(err.contains("kubelet chose [GPU-b]"), "{err}");
    // Nothing recorded; the pod still waits for its plan.
    assert!(index.checkpoint().pods.is_empty());
    assert_eq!(pending_names(&index), ["team-a/llama-70b-shard-1"]);

    // Several overlapping plans: the oldest is named, the others counted.
    index.apply_pod(
        &spec("team-a", "llama-70b-shard-2", 2)
            .planned("GPU-c,GPU-d")
            .pod(),
    );
    let err = index.check_allocate(&s(&["GPU-b", "GPU-c"])).unwrap_err();
    assert!(
        err.starts_with("pod team-a/llama-70b-shard-1 was planned on [GPU-a, GPU-b]")
            && err.contains("1 more pending pod"),
        "{err}"
    );
}

#[test]
fn an_allocation_without_a_binding_is_accepted_and_recorded_as_unbound() {
    let dir = TempDir::new("unbound");
    let index = index_at(&dir.checkpoint());
    index.resync([
        spec("ml", "shard", 1).planned("g0,g1").pod(),
        spec("web", "ordinary", 2).gpus(1).phase("Pending").pod(),
    ]);
    index.check_allocate(&s(&["g5"])).unwrap();
    let on_disk = load_checkpoint(&dir.checkpoint()).unwrap().unwrap();
    assert!(on_disk.pods.is_empty());
    assert_eq!(on_disk.unbound.len(), 1);
    assert_eq!(on_disk.unbound[0].devices, s(&["g5"]));
    assert_eq!(on_disk.unbound[0].pod, "");
    assert_eq!(
        index.allocated_devices().get("g5").map(String::as_str),
        Some(UNBOUND)
    );
    // The planned pod still gets its own devices.
    assert_eq!(pending_names(&index), ["ml/shard"]);
    index.check_allocate(&s(&["g0", "g1"])).unwrap();
}

#[test]
fn devices_off_plan_are_refused_when_only_planned_pods_are_waiting() {
    // A planned pod whose devices kubelet could not offer must not end up on
    // others just because they overlap no plan.
    let index = BindingIndex::open(BindingConfig::in_memory());
    index.resync([
        spec("ml", "shard", 1).planned("g0,g1").pod(),
        spec("web", "running-job", 2).gpus(1).phase("Running").pod(),
    ]);
    let err = index.check_allocate(&s(&["g4", "g5"])).unwrap_err();
    assert!(
        err.contains("pod ml/shard was planned on [g0, g1] but kubelet chose [g4, g5]")
            && err.contains("no pod without a binding is waiting"),
        "{err}"
    );
    // A size no pending plan has: not that pod.
    index.check_allocate(&s(&["g6"])).unwrap();
}

#[test]
fn the_checkpoint_round_trips_and_is_plain_json() {
    let dir = TempDir::new("roundtrip");
    let pods = || {
        [
            spec("ml", "a", 1).planned("g0,g1").pod(),
            spec("ml", "b", 2).planned("g2").pod(),
            spec("web", "job", 3).gpus(1).phase("Pending").pod(),
        ]
    };
    let first = index_at(&dir.checkpoint());
    first.resync(pods());
    first.check_allocate(&s(&["g0", "g1"])).unwrap();
    first.check_allocate(&s(&["g2"])).unwrap();
    first.check_allocate(&s(&["g7"])).unwrap();
    let saved = first.checkpoint();

    let raw: Value = serde_json::from_slice(&std::fs::read(dir.checkpoint()).unwrap()).unwrap();
    assert_eq!(raw["version"], CHECKPOINT_VERSION);
    assert_eq!(raw["pods"][uid("a")]["pod"], "ml/a");
    assert_eq!(raw["pods"][uid("a")]["devices"], json!(["g0", "g1"]));
    assert_eq!(raw["unbound"][0]["devices"], json!(["g7"]));
    assert!(!dir.checkpoint().with_extension("json.tmp").exists());

    let second = index_at(&dir.checkpoint());
    assert_eq!(second.checkpoint(), saved);
    second.resync(pods());
    assert_eq!(second.checkpoint(), saved);
    assert!(second.pending().is_empty());
}

#[test]
fn a_restart_with_the_checkpoint_does_not_double_allocate() {
    let dir = TempDir::new("restart-index");
    let first = index_at(&dir.checkpoint());
    first.resync([spec("ml", "a", 1).planned("g0,g1").pod()]);
    first.check_allocate(&s(&["g0", "g1"])).unwrap();
    drop(first);

    let second = index_at(&dir.checkpoint());
    // `a` is running; `b` is pending with a (stale) plan on the same devices.
    second.resync([
        spec("ml", "a", 1).planned("g0,g1").phase("Running").pod(),
        spec("ml", "b", 2).planned("g1,g0").pod(),
    ]);
    assert_eq!(pending_names(&second), ["ml/b"]);
    // Its devices are in use, so b's plan is not offered...
    let all = s(&["g0", "g1", "g2", "g3"]);
    assert_eq!(second.planned_for(&all, &[], 2), None);
    // ...and handing them out again is refused, naming the holder.
    let err = second.check_allocate(&s(&["g0", "g1"])).unwrap_err();
    assert!(
        err.contains("devices [g0, g1] are already allocated to pod ml/a (uid uid-a)"),
        "{err}"
    );
    let err = second.check_allocate(&s(&["g1", "g2"])).unwrap_err();
    assert!(
        err.contains("device g1 is already allocated to pod ml/a"),
        "{err}"
    );
    assert_eq!(pending_names(&second), ["ml/b"]);

    // Once `a` is gone its record is collected and b's plan is fine.
    second.delete_pod(&spec("ml", "a", 1).pod());
    assert!(
        load_checkpoint(&dir.checkpoint())
            .unwrap()
            .unwrap()
            .pods
            .is_empty()
    );
    assert_eq!(second.planned_for(&all, &[], 2), Some(s(&["g1", "g0"])));
    second.check_allocate(&s(&["g0", "g1"])).unwrap();
}

#[test]
fn entries_of_pods_that_are_gone_are_collected_once_the_pods_are_listed() {
    let dir = TempDir::new("gc");
    let first = index_at(&dir.checkpoint());
    first.resync([
        spec("ml", "stays", 1).planned("g0").pod(),
        spec("ml", "leaves", 2).planned("g1").pod(),
        spec("ml", "finishes", 3).planned("g2").pod(),
    ]);
    for d in ["g0", "g1", "g2"] {
        first.check_allocate(&s(&[d])).unwrap();
    }
    drop(first);

    let second = index_at(&dir.checkpoint());
    assert_eq!(second.checkpoint().pods.len(), 3);
    // Not listed yet: every entry still counts.
    second.apply_pod(&spec("ml", "stays", 1).planned("g0").phase("Running").pod());
    assert_eq!(second.checkpoint().pods.len(), 3);
    second.resync([
        spec("ml", "stays", 1).planned("g0").phase("Running").pod(),
        spec("ml", "finishes", 3)
            .planned("g2")
            .phase("Succeeded")
            .pod(),
    ]);
    let on_disk = load_checkpoint(&dir.checkpoint()).unwrap().unwrap();
    assert_eq!(on_disk.pods.keys().collect::<Vec<_>>(), [&uid("stays")]);
}

#[test]
fn unbound_devices_keep_planned_pods_off_until_no_pod_can_hold_them() {
    let dir = TempDir::new("unbound-restart");
    // A checkpoint from a previous run: g3 went to a pod without a binding.
    std::fs::create_dir_all(dir.checkpoint().parent().unwrap()).unwrap();
    std::fs::write(
        dir.checkpoint(),
        json!({
            "version": 1,
            "pods": {},
            "unbound": [{"pod": "", "devices": ["g3"], "time": "2025-01-01T00:00:00Z"}]
        })
        .to_string(),
    )
    .unwrap();
    let index = index_at(&dir.checkpoint());
    index.resync([
        spec("web", "job", 1).gpus(1).phase("Running").pod(),
        spec("ml", "shard", 2).planned("g3,g4").pod(),
    ]);
    assert_eq!(index.checkpoint().unbound.len(), 1);
    assert_eq!(index.planned_for(&s(&["g3", "g4", "g5"]), &[], 2), None);
    let err = index.check_allocate(&s(&["g3", "g4"])).unwrap_err();
    assert!(
        err.contains("pod ml/shard was planned on [g3, g4]")
            && err.contains("device g3 is still recorded for a pod without a binding"),
        "{err}"
    );
    // The job ends: nothing without a binding can hold g3 any more.
    index.apply_pod(&spec("web", "job", 1).gpus(1).phase("Succeeded").pod());
    assert!(index.checkpoint().unbound.is_empty());
    assert_eq!(
        index.planned_for(&s(&["g3", "g4", "g5"]), &[], 2),
        Some(s(&["g3", "g4"]))
    );
    index.check_allocate(&s(&["g3", "g4"])).unwrap();
}

#[test]
fn a_corrupt_or_foreign_checkpoint_is_ignored() {
    for (name, content) in [
        ("garbage", "{\"version\": 1, \"pods\": {\"uid-x\": "),
        ("binary", "\u{0}\u{1}\u{2}"),
        ("future", "{\"version\": 99, \"pods\": {}}"),
        ("wrong-shape", "{\"version\": 1, \"pods\": []}"),
    ] {
        let dir = TempDir::new(&format!("corrupt-{name}"));
        std::fs::create_dir_all(dir.checkpoint().parent().unwrap()).unwrap();
        std::fs::write(dir.checkpoint(), content).unwrap();
        assert!(load_checkpoint(&dir.checkpoint()).is_err(), "{name}");
        let index = index_at(&dir.checkpoint());
        assert!(index.checkpoint().pods.is_empty(), "{name}");
        // The unreadable file is kept for a person to read before it is replaced.
        let mut aside = dir.checkpoint().into_os_string();
        aside.push(".bad");
        assert_eq!(
            std::fs::read_to_string(&aside).ok().as_deref(),
            Some(content),
            "{name}: not kept at {aside:?}"
        );
        // It works, and the next change replaces the file with a good one.
        index.resync([spec("ml", "a", 1).planned("g0").pod()]);
        index.check_allocate(&s(&["g0"])).unwrap();
        let fresh = load_checkpoint(&dir.checkpoint()).unwrap().unwrap();
        assert_eq!(fresh.pods[&uid("a")].devices, s(&["g0"]), "{name}");
    }
    // No file at all is simply an empty start.
    let dir = TempDir::new("missing");
    assert!(load_checkpoint(&dir.checkpoint()).unwrap().is_none());
    assert!(index_at(&dir.checkpoint()).checkpoint().pods.is_empty());
}

#[test]
fn concurrent_allocations_each_get_their_own_pod() {
    let dir = TempDir::new("concurrent");
    let index = Arc::new(index_at(&dir.checkpoint()));
    let pods: Vec<Pod> = (0..32)
        .map(|i| {
            spec("ml", &format!("p{i:02}"), i)
                .planned(&format!("g{},h{}", i, i))
                .pod()
        })
        .collect();
    index.resync(pods);
    let threads: Vec<_> = (0..4)
        .map(|t| {
            let index = index.clone();
            std::thread::spawn(move || {
                for i in (t..32).step_by(4) {
                    index
                        .check_allocate(&[format!("h{i}"), format!("g{i}")])
                        .unwrap();
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    assert!(index.pending().is_empty());
    // The file ends with the last state, not an older one.
    let on_disk = load_checkpoint(&dir.checkpoint()).unwrap().unwrap();
    assert_eq!(on_disk.pods.len(), 32);
    assert_eq!(on_disk, index.checkpoint());
}

// ---------------------------------------------------------------------------
// The real device plugin over unix sockets.

/// The device plugin on eight fake H100s, with `binder`.
struct Plugin {
    socket: PathBuf,
    shutdown: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<Result<(), PluginError>>>,
}

impl Plugin {
    fn start(dir: &Path, binder: Arc<BindingIndex>) -> Self {
        let mut fake = FakeBackend::new("8xH100-80GiB").unwrap();
        let snap = snapshot(&mut fake).unwrap();
        let (tx, rx) = state::channel("fake");
        tx.send_modify(|v| {
            v.snapshot = snap;
            v.ready = true;
        });
        let config = PluginConfig {
            plugin_dir: dir.to_path_buf(),
            sysfs_root: dir.join("no-sys"),
            procfs_root: dir.join("no-proc"),
            poll_interval: Duration::from_millis(100),
            binder,
            ..PluginConfig::default()
        };
        let socket = config.socket_path();
        let (shutdown, signal) = oneshot::channel::<()>();
        let task = tokio::spawn(run_device_plugin(
            config,
            Arc::new(PluginStatus::default()),
            rx,
            tx,
            async {
                let _ = signal.await;
            },
        ));
        Self {
            socket,
            shutdown: Some(shutdown),
            task: Some(task),
        }
    }

    async fn client(&self) -> DevicePluginClient<tonic::transport::Channel> {
        DevicePluginClient::new(
            within("connecting to the plugin", connect_unix(&self.socket))
                .await
                .unwrap(),
        )
    }

    async fn stop(&mut self) {
        if let Some(s) = self.shutdown.take() {
            let _ = s.send(());
        }
        if let Some(task) = self.task.take() {
            within("the plugin to stop", task).await.unwrap().unwrap();
        }
    }
}

impl Drop for Plugin {
    fn drop(&mut self) {
        if let Some(task) = self.task.take() {
            task.abort();
        }
    }
}

fn h(i: usize) -> String {
    format!("fake-h100-80gib-{i}")
}

fn preferred(available: &[String], size: i32) -> PreferredAllocationRequest {
    PreferredAllocationRequest {
        container_requests: vec![ContainerPreferredAllocationRequest {
            available_device_i_ds: available.to_vec(),
            must_include_device_i_ds: vec![],
            allocation_size: size,
        }],
    }
}

fn allocate(ids: &[String]) -> AllocateRequest {
    AllocateRequest {
        container_requests: vec![ContainerAllocateRequest {
            devices_ids: ids.to_vec(),
        }],
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_device_plugin_hands_out_planned_devices_and_refuses_others() {
    let dir = TempDir::new("plugin");
    let mut kubelet = FakeKubelet::start(dir.path());
    let index = Arc::new(index_at(&dir.checkpoint()));
    let (plan0, plan1) = (format!("{},{}", h(5), h(6)), format!("{},{}", h(0), h(1)));
    let shard0 = || spec("team-a", "llama-70b-shard-0", 1).planned(&plan0);
    let shard1 = || spec("team-a", "llama-70b-shard-1", 2).planned(&plan1);
    index.resync([shard0().pod(), shard1().pod()]);
    let mut plugin = Plugin::start(dir.path(), index.clone());
    kubelet.next_registration().await;
    let mut client = plugin.client().await;
    let all: Vec<String> = (0..8).map(h).collect();

    // Topology alone would pick the first NVLinked pair (0, 1); the oldest
    // pending pod's plan wins.
    let got = client
        .get_preferred_allocation(preferred(&all, 2))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(got.container_responses[0].device_i_ds, [h(5), h(6)]);
    let resp = client
        .allocate(allocate(&[h(6), h(5)]))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        resp.container_responses[0].envs["TESSERA_VISIBLE_DEVICES"],
        format!("{},{}", h(6), h(5))
    );
    let on_disk = load_checkpoint(&dir.checkpoint()).unwrap().unwrap();
    assert_eq!(
        on_disk.pods[&uid("llama-70b-shard-0")].devices,
        [h(5), h(6)]
    );

    // The next pod: its plan is preferred now; kubelet choosing otherwise is refused.
    let rest: Vec<String> = [0, 1, 2, 3, 4, 7].into_iter().map(h).collect();
    let got = client
        .get_preferred_allocation(preferred(&rest, 2))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(got.container_responses[0].device_i_ds, [h(0), h(1)]);
    let err = client.allocate(allocate(&[h(0), h(2)])).await.unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition, "{err:?}");
    assert_eq!(
        err.message(),
        format!(
            "tessera.dev/gpu: pod team-a/llama-70b-shard-1 was planned on [{}, {}] but kubelet \
             chose [{}, {}]; refusing so the controller can re-place it",
            h(0),
            h(1),
            h(0),
            h(2)
        )
    );
    assert_eq!(pending_names(&index), ["team-a/llama-70b-shard-1"]);

    // Restart: a new plugin and index from the same checkpoint. shard-0 runs;
    // a new pod comes with a stale plan on shard-0's devices.
    plugin.stop().await;
    drop(index);
    let index = Arc::new(index_at(&dir.checkpoint()));
    index.resync([
        shard0().phase("Running").pod(),
        shard1().pod(),
        spec("team-b", "stale", 3)
            .planned(&format!("{},{}", h(5), h(6)))
            .pod(),
    ]);
    let mut plugin = Plugin::start(dir.path(), index.clone());
    kubelet.next_registration().await;
    let mut client = plugin.client().await;
    let err = client.allocate(allocate(&[h(5), h(6)])).await.unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition, "{err:?}");
    assert!(
        err.message().contains(&format!(
            "devices [{}, {}] are already allocated to pod team-a/llama-70b-shard-0",
            h(5),
            h(6)
        )),
        "{}",
        err.message()
    );
    // shard-1 still gets exactly its plan.
    client.allocate(allocate(&[h(1), h(0)])).await.unwrap();
    let on_disk = load_checkpoint(&dir.checkpoint()).unwrap().unwrap();
    assert_eq!(on_disk.pods.len(), 2);
    assert_eq!(pending_names(&index), ["team-b/stale"]);

    plugin.stop().await;
    kubelet.stop().await;
}

// ---------------------------------------------------------------------------
// The pod watch against a mocked API server.

type ApiHandle = mock::Handle<Request<Body>, Response<Body>>;

fn json_response(value: &Value) -> Response<Body> {
    Response::builder()
        .status(StatusCode::OK)
        .header(http::header::CONTENT_TYPE, "application/json")
        .body(Body::from(serde_json::to_vec(value).unwrap()))
        .unwrap()
}

async fn next_request(api: &mut ApiHandle) -> (Request<Body>, mock::SendResponse<Response<Body>>) {
    within("a request to the API server", api.next_request())
        .await
        .expect("the client went away")
}

/// The query of a request, decoded into pairs.
fn query(request: &Request<Body>) -> Vec<(String, String)> {
    request
        .uri()
        .query()
        .unwrap_or("")
        .split('&')
        .filter(|p| !p.is_empty())
        .map(|p| {
            let (k, v) = p.split_once('=').unwrap_or((p, ""));
            (k.to_string(), v.replace("%3D", "=").replace("%2F", "/"))
        })
        .collect()
}

fn param<'a>(q: &'a [(String, String)], key: &str) -> Option<&'a str> {
    q.iter().find(|(k, _)| k == key).map(|(_, v)| v.as_str())
}

async fn eventually(what: &str, mut check: impl FnMut() -> bool) {
    within(what, async {
        while !check() {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await
}

#[tokio::test]
async fn the_pod_watch_lists_and_watches_this_nodes_pods_into_the_index() {
    let (service, mut api) = mock::pair::<Request<Body>, Response<Body>>();
    let client = kube::Client::new(service, "default");
    let index = Arc::new(BindingIndex::open(BindingConfig::in_memory()));
    let (stop, stopped) = oneshot::channel::<()>();
    let task = tokio::spawn(run_pod_watch(
        client,
        NODE.to_string(),
        index.clone(),
        async {
            let _ = stopped.await;
        },
    ));

    // The initial LIST: all namespaces, only this node's pods.
    let (request, respond) = next_request(&mut api).await;
    assert_eq!(request.method(), Method::GET);
    assert_eq!(request.uri().path(), "/api/v1/pods");
    let q = query(&request);
    assert_eq!(
        param(&q, "fieldSelector"),
        Some("spec.nodeName=gpu-node-1"),
        "{}",
        request.uri()
    );
    assert_eq!(param(&q, "watch"), None);
    assert!(!index.is_synced());
    respond.send_response(json_response(&json!({
        "apiVersion": "v1",
        "kind": "PodList",
        "metadata": {"resourceVersion": "100"},
        "items": [
            spec("team-a", "shard-1", 2).planned("GPU-c,GPU-d").json(),
            spec("team-a", "shard-0", 1).planned("GPU-a,GPU-b").json(),
            spec("web", "nginx", 3).json(),
        ],
    })));

    // Then the WATCH from the list's version, with the same selector.
    let (request, respond) = next_request(&mut api).await;
    assert_eq!(request.method(), Method::GET);
    assert_eq!(request.uri().path(), "/api/v1/pods");
    let q = query(&request);
    assert_eq!(param(&q, "watch"), Some("true"), "{}", request.uri());
    assert_eq!(param(&q, "fieldSelector"), Some("spec.nodeName=gpu-node-1"));
    assert_eq!(param(&q, "resourceVersion"), Some("100"));
    assert!(index.is_synced());
    assert_eq!(pending_names(&index), ["team-a/shard-0", "team-a/shard-1"]);
    assert_eq!(
        index.planned_for(&s(&["GPU-a", "GPU-b", "GPU-c", "GPU-d"]), &[], 2),
        Some(s(&["GPU-a", "GPU-b"]))
    );

    // Watch events: a new bound pod, and shard-0 deleted.
    let mut added = spec("team-b", "shard-9", 4).planned("GPU-e").json();
    added["metadata"]["resourceVersion"] = json!("101");
    let mut deleted = spec("team-a", "shard-0", 1).planned("GPU-a,GPU-b").json();
    deleted["metadata"]["resourceVersion"] = json!("102");
    let events = format!(
        "{}\n{}\n",
        json!({"type": "ADDED", "object": added}),
        json!({"type": "DELETED", "object": deleted})
    );
    respond.send_response(
        Response::builder()
            .status(StatusCode::OK)
            .header(http::header::CONTENT_TYPE, "application/json")
            .body(Body::from(events.into_bytes()))
            .unwrap(),
    );
    eventually("the watch events to reach the index", || {
        pending_names(&index) == ["team-a/shard-1", "team-b/shard-9"]
    })
    .await;

    let _ = stop.send(());
    within("the pod watch to stop", task).await.unwrap();
}

/// Kubelet may ask for a pod's devices before the pod watch has delivered
/// the pod (seen on a real kubelet admitting a burst of pods): a request
/// that matches no known plan is matched again after a fresh list.
#[tokio::test]
async fn a_request_for_a_pod_the_watch_has_not_delivered_lists_the_node_first() {
    let (service, mut api) = mock::pair::<Request<Body>, Response<Body>>();
    let index = Arc::new(BindingIndex::open(BindingConfig::in_memory()));
    index.catch_up_with(kube::Client::new(service, "default"), NODE);
    let older = || spec("team-a", "shard-0", 1).planned("GPU-a");
    index.resync([older().pod()]);
    let late = spec("team-a", "late-shard-0", 2).planned("GPU-c");

    // What the index expects needs no list.
    assert!(index.expects(&s(&["GPU-a"])));
    assert!(!index.expects(&s(&["GPU-c"])));

    // Kubelet admits the late pod: its plan is found by listing this node's pods.
    let catch_up = {
        let index = index.clone();
        tokio::spawn(async move { index.catch_up().await })
    };
    let (request, respond) = next_request(&mut api).await;
    assert_eq!(request.uri().path(), "/api/v1/pods");
    let q = query(&request);
    assert_eq!(param(&q, "fieldSelector"), Some("spec.nodeName=gpu-node-1"));
    assert_eq!(param(&q, "watch"), None);
    respond.send_response(json_response(&json!({
        "apiVersion": "v1",
        "kind": "PodList",
        "metadata": {"resourceVersion": "200"},
        "items": [older().phase("Running").json(), late.json()],
    })));
    within("the catch-up", catch_up).await.unwrap();
    assert_eq!(
        index.planned_for(&s(&["GPU-b", "GPU-c", "GPU-d"]), &[], 1),
        Some(s(&["GPU-c"]))
    );
    assert!(index.expects(&s(&["GPU-c"])));
    assert_eq!(index.check_allocate(&s(&["GPU-c"])), Ok(()));
    assert_eq!(index.allocated_devices()["GPU-c"], uid("late-shard-0"));
    // What the watch said of a known pod stays (it keeps that current).
    assert_eq!(pending_names(&index), ["team-a/shard-0"]);

    // A failing list leaves the index as it was and does not hold kubelet up.
    let catch_up = {
        let index = index.clone();
        tokio::spawn(async move { index.catch_up().await })
    };
    let (_, respond) = next_request(&mut api).await;
    respond.send_response(
        Response::builder()
            .status(StatusCode::INTERNAL_SERVER_ERROR)
            .body(Body::from(b"etcd down".to_vec()))
            .unwrap(),
    );
    within("the failed catch-up", catch_up).await.unwrap();
    assert_eq!(pending_names(&index), ["team-a/shard-0"]);
}

#[tokio::test]
async fn a_failing_list_is_retried_and_nothing_is_enforced_meanwhile() {
    let (service, mut api) = mock::pair::<Request<Body>, Response<Body>>();
    let client = kube::Client::new(service, "default");
    let index = Arc::new(BindingIndex::open(BindingConfig::in_memory()));
    let (stop, stopped) = oneshot::channel::<()>();
    let task = tokio::spawn(run_pod_watch(
        client,
        NODE.to_string(),
        index.clone(),
        async {
            let _ = stopped.await;
        },
    ));
    let (_, respond) = next_request(&mut api).await;
    respond.send_response(
        Response::builder()
            .status(StatusCode::FORBIDDEN)
            .header(http::header::CONTENT_TYPE, "application/json")
            .body(Body::from(
                serde_json::to_vec(&json!({
                    "kind": "Status", "apiVersion": "v1", "metadata": {},
                    "status": "Failure", "reason": "Forbidden", "code": 403,
                    "message": "pods is forbidden: User \"system:serviceaccount:tessera:agent\" cannot list resource \"pods\""
                }))
                .unwrap(),
            ))
            .unwrap(),
    );
    // Retried after a backoff; the index stays unsynced (planned_for: none).
    let (request, respond) = next_request(&mut api).await;
    assert_eq!(
        param(&query(&request), "fieldSelector"),
        Some("spec.nodeName=gpu-node-1")
    );
    assert!(!index.is_synced());
    respond.send_response(json_response(&json!({
        "apiVersion": "v1", "kind": "PodList",
        "metadata": {"resourceVersion": "7"},
        "items": [spec("team-a", "shard-0", 1).planned("GPU-a").json()],
    })));
    within("the index to sync", index.synced()).await;
    assert_eq!(pending_names(&index), ["team-a/shard-0"]);

    let _ = stop.send(());
    within("the pod watch to stop", task).await.unwrap();
}

// ---------------------------------------------------------------------------
// The allocated set, from Allocate through the view to the Node annotation.

/// One request of the agent to the mocked API server.
enum ApiCall {
    ListPods(mock::SendResponse<Response<Body>>),
    WatchPods(mock::SendResponse<Response<Body>>),
    /// The merge patch's annotation, parsed.
    PatchNode(NodeGpuState, mock::SendResponse<Response<Body>>),
}

async fn next_call(api: &mut ApiHandle) -> ApiCall {
    let (request, respond) = next_request(api).await;
    let path = request.uri().path().to_string();
    match (request.method().clone(), path.as_str()) {
        (Method::GET, "/api/v1/pods") => {
            if param(&query(&request), "watch") == Some("true") {
                ApiCall::WatchPods(respond)
            } else {
                ApiCall::ListPods(respond)
            }
        }
        (Method::PATCH, p) if p == format!("/api/v1/nodes/{NODE}") => {
            let bytes = request.into_body().collect_bytes().await.unwrap();
            let body: Value = serde_json::from_slice(&bytes).unwrap();
            let text = body["metadata"]["annotations"]["tessera.dev/gpu-state"]
                .as_str()
                .expect("the patch carries the gpu-state annotation");
            ApiCall::PatchNode(NodeGpuState::from_json(text).unwrap(), respond)
        }
        (m, p) => panic!("unexpected request {m} {p}"),
    }
}

fn node_ok() -> Response<Body> {
    json_response(&json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE}}))
}

/// Answers patches (recording their `allocated` maps) until one carries `want`;
/// pod watch requests are handed back to the caller.
async fn patched_until(
    api: &mut ApiHandle,
    watches: &mut Vec<mock::SendResponse<Response<Body>>>,
    want: &BTreeMap<String, String>,
) {
    within("a patch with the expected allocated set", async {
        loop {
            match next_call(api).await {
                ApiCall::PatchNode(state, respond) => {
                    respond.send_response(node_ok());
                    if &state.allocated == want {
                        return;
                    }
                }
                ApiCall::WatchPods(respond) => watches.push(respond),
                ApiCall::ListPods(_) => panic!("the pods were listed again"),
            }
        }
    })
    .await
}

#[tokio::test]
async fn a_pod_that_ends_leaves_the_view_and_the_published_state() {
    let (service, mut api) = mock::pair::<Request<Body>, Response<Body>>();
    let client = kube::Client::new(service, "default");
    let mut fake = FakeBackend::new("4xH100-80GiB").unwrap();
    let snap = snapshot(&mut fake).unwrap();
    let (tx, rx) = state::channel("fake");
    tx.send_modify(|v| {
        v.snapshot = snap;
        v.ready = true;
    });
    let index = Arc::new(BindingIndex::open(BindingConfig::in_memory()));
    index.keep_view(tx.clone());
    let plugin = PluginService::new(
        "tessera.dev/gpu",
        rx.clone(),
        tx.clone(),
        index.clone(),
        RuntimeOptions::default(),
    );
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let until_stopped = || {
        let mut s = stopped.clone();
        async move {
            let _ = s.wait_for(|s| *s).await;
        }
    };
    let watch = tokio::spawn(run_pod_watch(
        client.clone(),
        NODE.to_string(),
        index.clone(),
        until_stopped(),
    ));
    let publisher = tokio::spawn(run_publisher(
        client,
        PublisherConfig::new(NODE),
        rx.clone(),
        Arc::new(PublisherStats::default()),
        until_stopped(),
    ));

    let shard = || spec("team-a", "shard-0", 1).planned("fake-h100-80gib-2,fake-h100-80gib-3");
    let mut watches = Vec::new();
    // The list and the first publish come in either order.
    let mut listed = false;
    let mut first_patch = false;
    within("the pod list and the first publish", async {
        while !(listed && first_patch) {
            match next_call(&mut api).await {
                ApiCall::ListPods(respond) => {
                    respond.send_response(json_response(&json!({
                        "apiVersion": "v1", "kind": "PodList",
                        "metadata": {"resourceVersion": "10"},
                        "items": [shard().json()],
                    })));
                    listed = true;
                }
                ApiCall::WatchPods(respond) => watches.push(respond),
                ApiCall::PatchNode(state, respond) => {
                    assert!(state.allocated.is_empty(), "{:?}", state.allocated);
                    respond.send_response(node_ok());
                    first_patch = true;
                }
            }
        }
    })
    .await;
    within("the index to sync", index.synced()).await;

    // Kubelet allocates the planned devices: the view and the Node say whose they are.
    plugin
        .allocate(tonic::Request::new(allocate(&s(&[
            "fake-h100-80gib-3",
            "fake-h100-80gib-2",
        ]))))
        .await
        .unwrap();
    let held: BTreeMap<String, String> = [
        ("fake-h100-80gib-2".to_string(), uid("shard-0")),
        ("fake-h100-80gib-3".to_string(), uid("shard-0")),
    ]
    .into();
    assert_eq!(rx.borrow().allocated, held);
    patched_until(&mut api, &mut watches, &held).await;

    // The pod finishes: the watch reports it, and its devices are free again.
    let watch_request = match watches.pop() {
        Some(w) => w,
        None => {
            within("the pod watch", async {
                loop {
                    match next_call(&mut api).await {
                        ApiCall::WatchPods(respond) => return respond,
                        ApiCall::PatchNode(_, respond) => respond.send_response(node_ok()),
                        ApiCall::ListPods(_) => panic!("the pods were listed again"),
                    }
                }
            })
            .await
        }
    };
    let mut done = shard().phase("Succeeded").json();
    done["metadata"]["resourceVersion"] = json!("11");
    let events = format!("{}\n", json!({"type": "MODIFIED", "object": done}));
    watch_request.send_response(
        Response::builder()
            .status(StatusCode::OK)
            .header(http::header::CONTENT_TYPE, "application/json")
            .body(Body::from(events.into_bytes()))
            .unwrap(),
    );
    patched_until(&mut api, &mut watches, &BTreeMap::new()).await;
    assert!(rx.borrow().allocated.is_empty());
    assert!(index.allocated_devices().is_empty());

    let _ = stop.send(true);
    within("the pod watch to stop", watch).await.unwrap();
    let ended = within("the publisher to stop", publisher).await.unwrap();
    assert!(ended.is_ok(), "{ended:?}");
}
