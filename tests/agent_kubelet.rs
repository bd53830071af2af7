//! The device plugin against a kubelet stand-in, over real unix sockets in a
//! temporary directory: registration, the device list and its health
//! changes, preferred allocation, allocation, kubelet restarts, a deleted
//! socket and shutdown. Every wait is bounded so a bug fails instead of hanging.

use std::future::Future;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tokio_stream::StreamExt;
use tonic::{Code, Streaming};

use tessera::agent::device_plugin::kubelet_api::v1beta1::device_plugin_client::DevicePluginClient;
use tessera::agent::device_plugin::kubelet_api::v1beta1::*;
use tessera::agent::device_plugin::registration::{
    PluginConfig, PluginError, PluginStatus, connect_unix, run_device_plugin,
};
use tessera::agent::state::{self, ViewTx};
use tessera::backend::fake::FakeBackend;
use tessera::backend::health::{HealthPolicy, HealthTracker};
use tessera::backend::{RawHealth, snapshot};

#[path = "common/kubelet.rs"]
mod kubelet;
use kubelet::FakeKubelet;

const WAIT: Duration = Duration::from_secs(5);
const SOCKET: &str = "tessera-tessera-dev-gpu.sock";

/// Awaits `f`, failing the test with `what` if it takes longer than [`WAIT`].
async fn within<T>(what: &str, f: impl Future<Output = T>) -> T {
    match tokio::time::timeout(WAIT, f).await {
        Ok(v) => v,
        Err(_) => panic!("timed out after {WAIT:?} waiting for {what}"),
    }
}

/// Polls `check` every 20 ms until it holds, for at most [`WAIT`].
async fn eventually(what: &str, mut check: impl FnMut() -> bool) {
    within(what, async {
        while !check() {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
}

/// A fresh directory for one test, removed afterwards.
struct TempDir(PathBuf);

impl TempDir {
    fn new(name: &str) -> Self {
        let dir =
            std::env::temp_dir().join(format!("tessera-kubelet-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        Self(dir)
    }

    fn path(&self) -> &Path {
        &self.0
    }

    fn socket(&self) -> PathBuf {
        self.0.join(SOCKET)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The device plugin under test, on a view fed by the real poller over a fake
/// YAML file, or driven directly.
struct Agent {
    tx: ViewTx,
    status: Arc<PluginStatus>,
    shutdown: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<Result<(), PluginError>>>,
    poller: Option<(Arc<AtomicBool>, std::thread::JoinHandle<()>)>,
    yaml: PathBuf,
}

fn config(dir: &Path) -> PluginConfig {
    PluginConfig {
        plugin_dir: dir.to_path_buf(),
        // No host device files: minors and render nodes use the documented fallbacks.
        sysfs_root: dir.join("no-sys"),
        procfs_root: dir.join("no-proc"),
        poll_interval: Duration::from_millis(100),
        ..PluginConfig::default()
    }
}

impl Agent {
    /// Fake devices from `<dir>/gpus.yaml` (`gpus` lines, no faults), read every 50 ms
    /// with a 100 ms health recovery.
    fn with_poller(dir: &Path, gpus: &str) -> Self {
        let yaml = dir.join("gpus.yaml");
        write_yaml(&yaml, gpus, "");
        let (tx, rx) = state::channel("fake");
        let backend = Box::new(FakeBackend::new(yaml.to_str().unwrap()).unwrap());
        let tracker = HealthTracker::new(HealthPolicy {
            recovery: Duration::from_millis(100),
            ..HealthPolicy::default()
        });
        let stop = Arc::new(AtomicBool::new(false));
        let poller = state::spawn_poller(
            backend,
            tracker,
            Duration::from_millis(50),
            tx.clone(),
            stop.clone(),
        );
        let mut agent = Self::start(dir, tx, rx);
        agent.poller = Some((stop, poller));
        agent.yaml = yaml;
        agent
    }

    /// A view set once from a fake spec, with the backend renamed (so the
    /// vendor runtime answers are produced as for real devices).
    fn with_snapshot(dir: &Path, spec: &str, backend: &str) -> Self {
        Self::with_snapshot_and(config(dir), spec, backend)
    }

    fn with_snapshot_and(config: PluginConfig, spec: &str, backend: &str) -> Self {
        let mut fake = FakeBackend::new(spec).unwrap();
        let mut snap = snapshot(&mut fake).unwrap();
        snap.backend = backend.to_string();
        let (tx, rx) = state::channel(backend);
        tx.send_modify(|v| {
            v.snapshot = snap;
            v.ready = true;
        });
        Self::start_with(config, tx, rx)
    }

    /// Two fake H100s, reporting a kubelet that has not called 300 ms after registering.
    fn expecting_a_call_soon(dir: &Path) -> Self {
        let config = PluginConfig {
            list_and_watch_grace: Duration::from_millis(300),
            ..config(dir)
        };
        Self::with_snapshot_and(config, "2xH100-80GiB", "fake")
    }

    fn start(dir: &Path, tx: ViewTx, rx: state::ViewRx) -> Self {
        Self::start_with(config(dir), tx, rx)
    }

    fn start_with(config: PluginConfig, tx: ViewTx, rx: state::ViewRx) -> Self {
        let status = Arc::new(PluginStatus::default());
        let (shutdown, signal) = oneshot::channel::<()>();
        let task = tokio::spawn(run_device_plugin(
            config,
            status.clone(),
            rx,
            tx.clone(),
            async {
                let _ = signal.await;
            },
        ));
        Self {
            tx,
            status,
            shutdown: Some(shutdown),
            task: Some(task),
            poller: None,
            yaml: PathBuf::new(),
        }
    }

    fn fault(&self, gpus: &str, faults: &str) {
        write_yaml(&self.yaml, gpus, faults);
    }

    async fn stop(&mut self) {
        if let Some(s) = self.shutdown.take() {
            let _ = s.send(());
        }
        if let Some(task) = self.task.take() {
            within("the plugin to shut down", task)
                .await
                .unwrap()
                .unwrap();
        }
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        if let Some((stop, handle)) = self.poller.take() {
            stop.store(true, Ordering::Relaxed);
            let _ = handle.join();
        }
        if let Some(task) = self.task.take() {
            task.abort();
        }
    }
}

/// Writes the fake device file atomically (so the poller never reads half a file).
fn write_yaml(path: &Path, gpus: &str, faults: &str) {
    let tmp = path.with_extension("tmp");
    let faults = if faults.is_empty() {
        " []\n".to_string()
    } else {
        format!("\n{faults}")
    };
    std::fs::write(&tmp, format!("gpus:\n{gpus}faults:{faults}")).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

async fn client(socket: &Path) -> DevicePluginClient<tonic::transport::Channel> {
    DevicePluginClient::new(
        within("connecting to the plugin", connect_unix(socket))
            .await
            .unwrap(),
    )
}

/// The next device list on the stream: `(id, health, NUMA nodes)`.
async fn next_list(
    stream: &mut Streaming<ListAndWatchResponse>,
) -> Vec<(String, String, Vec<i64>)> {
    let msg = within("a ListAndWatch message", stream.next())
        .await
        .unwrap()
        .unwrap();
    msg.devices
        .into_iter()
        .map(|d| {
            let numa = d
                .topology
                .map(|t| t.nodes.iter().map(|n| n.id).collect())
                .unwrap_or_default();
            (d.id, d.health, numa)
        })
        .collect()
}

fn health_of<'a>(list: &'a [(String, String, Vec<i64>)], id: &str) -> &'a str {
    &list.iter().find(|d| d.0 == id).unwrap().1
}

const H100X2_L4X4: &str =
    "  - {profile: H100-80GiB, count: 2}\n  - {profile: L4-24GiB, count: 4}\n";

/// Kubelets before 1.26 register the plugin, then send its socket path as the
/// HTTP/2 `:authority` of every call, which the plugin's server refuses: no
/// call ever arrives. The agent says so (log and `/readyz`) instead of
/// looking healthy, and takes it back once kubelet does call.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kubelet_that_registers_but_never_calls_is_reported() {
    let dir = TempDir::new("silent");
    let mut kubelet = FakeKubelet::start(dir.path());
    let mut agent = Agent::expecting_a_call_soon(dir.path());
    kubelet.next_registration().await;
    eventually("the silence to be reported", || {
        agent.status.kubelet_silent()
    })
    .await;
    assert!(agent.status.is_registered());
    assert_eq!(agent.status.list_and_watch_calls(), 0);

    let mut plugin = client(&dir.socket()).await;
    let mut stream = plugin.list_and_watch(Empty {}).await.unwrap().into_inner();
    next_list(&mut stream).await;
    eventually("the report to clear", || !agent.status.kubelet_silent()).await;
    assert_eq!(agent.status.list_and_watch_calls(), 1);
    agent.stop().await;
}

/// A kubelet that opens `ListAndWatch` while it handles the registration (as
/// v1.24 does) is not mistaken for one that never calls.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kubelet_that_calls_before_answering_the_registration_is_not_reported() {
    let dir = TempDir::new("calls-back");
    let mut kubelet = FakeKubelet::start_calling_back(dir.path());
    let mut agent = Agent::expecting_a_call_soon(dir.path());
    kubelet.next_registration().await;
    assert_eq!(agent.status.list_and_watch_calls(), 1);
    tokio::time::sleep(Duration::from_millis(900)).await;
    assert!(!agent.status.kubelet_silent());
    agent.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn registers_and_streams_device_health() {
    let dir = TempDir::new("stream");
    let mut kubelet = FakeKubelet::start(dir.path());
    let mut agent = Agent::with_poller(dir.path(), H100X2_L4X4);

    let reg = kubelet.next_registration().await;
    assert_eq!(reg.version, "v1beta1");
    assert_eq!(reg.endpoint, SOCKET);
    assert_eq!(reg.resource_name, "tessera.dev/gpu");
    let options = reg.options.unwrap();
    assert!(options.get_preferred_allocation_available);
    assert!(!options.pre_start_required);
    eventually("the registration to be counted", || {
        agent.status.registrations() == 1
    })
    .await;
    assert!(agent.status.is_registered() && agent.status.is_serving());

    let mut plugin = client(&dir.socket()).await;
    let opts = plugin
        .get_device_plugin_options(Empty {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(opts, options);
    plugin
        .pre_start_container(PreStartContainerRequest {
            devices_ids: vec!["fake-h100-80gib-0".into()],
        })
        .await
        .unwrap();

    let mut stream = plugin.list_and_watch(Empty {}).await.unwrap().into_inner();
    let list = next_list(&mut stream).await;
    let want: Vec<(String, String, Vec<i64>)> = [
        ("fake-h100-80gib-0", 0),
        ("fake-h100-80gib-1", 0),
        ("fake-l4-24gib-2", 0),
        ("fake-l4-24gib-3", 0),
        ("fake-l4-24gib-4", 1),
        ("fake-l4-24gib-5", 1),
    ]
    .iter()
    .map(|(id, numa)| (id.to_string(), "Healthy".to_string(), vec![*numa]))
    .collect();
    assert_eq!(list, want);

    // Telemetry alone (a warmer but healthy GPU) sends nothing.
    agent.fault(H100X2_L4X4, "  - {device: 0, temperatureC: 60}\n");
    let quiet = tokio::time::timeout(Duration::from_millis(400), stream.next()).await;
    assert!(quiet.is_err(), "a telemetry change was sent: {quiet:?}");

    // A fault shows as Unhealthy; the poller reads every 50 ms, so well within a second.
    let started = tokio::time::Instant::now();
    agent.fault(H100X2_L4X4, "  - {device: 1, unhealthy: \"Xid 79\"}\n");
    let list = next_list(&mut stream).await;
    assert!(
        started.elapsed() < Duration::from_secs(1),
        "took {:?}",
        started.elapsed()
    );
    assert_eq!(health_of(&list, "fake-h100-80gib-1"), "Unhealthy");
    assert_eq!(health_of(&list, "fake-h100-80gib-0"), "Healthy");

    // Cleared: healthy again after the 100 ms recovery.
    agent.fault(H100X2_L4X4, "");
    let list = next_list(&mut stream).await;
    assert!(list.iter().all(|d| d.1 == "Healthy"), "{list:?}");

    // A vanished device drops out of the list.
    agent.fault(H100X2_L4X4, "  - {device: 5, vanish: true}\n");
    let list = next_list(&mut stream).await;
    assert_eq!(list.len(), 5);
    assert!(!list.iter().any(|d| d.0 == "fake-l4-24gib-5"));

    agent.stop().await;
    kubelet.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn preferred_allocation_follows_topology() {
    let dir = TempDir::new("preferred");
    let mut kubelet = FakeKubelet::start(dir.path());
    let mut agent = Agent::with_poller(dir.path(), H100X2_L4X4);
    kubelet.next_registration().await;
    let mut plugin = client(&dir.socket()).await;

    let ask = |available: &[&str], must: &[&str], size: i32| ContainerPreferredAllocationRequest {
        available_device_i_ds: available.iter().map(|s| s.to_string()).collect(),
        must_include_device_i_ds: must.iter().map(|s| s.to_string()).collect(),
        allocation_size: size,
    };
    let (h0, h1, l2, l3, l4, l5) = (
        "fake-h100-80gib-0",
        "fake-h100-80gib-1",
        "fake-l4-24gib-2",
        "fake-l4-24gib-3",
        "fake-l4-24gib-4",
        "fake-l4-24gib-5",
    );
    let resp = plugin
        .get_preferred_allocation(PreferredAllocationRequest {
            container_requests: vec![
                // The NVLinked H100 pair, whatever order kubelet lists devices in.
                ask(&[l3, h1, l2, h0], &[], 2),
                // One device: an L4, leaving the NVLink pair whole.
                ask(&[h0, h1, l2], &[], 1),
                // Must-include honoured; its NVLink partner comes along.
                ask(&[l2, h0, h1, l3], &[h1], 2),
                // Must-include an L4 on NUMA node 1: the other L4 there.
                ask(&[l2, l3, l5, l4], &[l4], 2),
            ],
        })
        .await
        .unwrap()
        .into_inner();
    let got: Vec<Vec<String>> = resp
        .container_responses
        .into_iter()
        .map(|r| r.device_i_ds)
        .collect();
    assert_eq!(
        got,
        vec![vec![h0, h1], vec![l2], vec![h0, h1], vec![l4, l5]]
    );

    agent.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn allocate_checks_devices_and_records_them() {
    let dir = TempDir::new("allocate");
    let mut kubelet = FakeKubelet::start(dir.path());
    let mut agent = Agent::with_poller(dir.path(), H100X2_L4X4);
    kubelet.next_registration().await;
    let mut plugin = client(&dir.socket()).await;
    let alloc = |ids: &[&[&str]]| AllocateRequest {
        container_requests: ids
            .iter()
            .map(|c| ContainerAllocateRequest {
                devices_ids: c.iter().map(|s| s.to_string()).collect(),
            })
            .collect(),
    };

    let resp = plugin
        .allocate(alloc(&[
            &["fake-h100-80gib-0", "fake-h100-80gib-1"],
            &["fake-l4-24gib-3"],
        ]))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(resp.container_responses.len(), 2);
    let first = &resp.container_responses[0];
    assert_eq!(
        first.envs["TESSERA_VISIBLE_DEVICES"],
        "fake-h100-80gib-0,fake-h100-80gib-1"
    );
    // Fake devices have no device nodes or vendor variables.
    assert_eq!(first.envs.len(), 1);
    assert!(first.devices.is_empty() && first.cdi_devices.is_empty());
    assert_eq!(
        resp.container_responses[1].envs["TESSERA_VISIBLE_DEVICES"],
        "fake-l4-24gib-3"
    );
    {
        let view = agent.tx.borrow();
        let allocated: Vec<(&str, &str)> = view
            .allocated
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect();
        assert_eq!(
            allocated,
            // No binder keeps the map here: the owner is unknown.
            [
                ("fake-h100-80gib-0", "unbound"),
                ("fake-h100-80gib-1", "unbound"),
                ("fake-l4-24gib-3", "unbound")
            ]
        );
    }

    // An unknown ID is named, and nothing is recorded for the request.
    let err = plugin
        .allocate(alloc(&[
            &["fake-l4-24gib-2"],
            &["fake-h100-80gib-0", "GPU-nope"],
        ]))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument, "{err:?}");
    assert!(err.message().contains("GPU-nope"), "{}", err.message());
    assert!(!agent.tx.borrow().allocated.contains_key("fake-l4-24gib-2"));

    // An unhealthy device is refused with the reason.
    agent.fault(
        H100X2_L4X4,
        "  - {device: 2, unhealthy: \"Xid 48: double-bit ECC\"}\n",
    );
    let mut rx = agent.tx.subscribe();
    within(
        "the fault to reach the view",
        rx.wait_for(|v| {
            v.snapshot
                .devices
                .iter()
                .any(|d| d.info.id == "fake-l4-24gib-2" && d.health != RawHealth::Healthy)
        }),
    )
    .await
    .unwrap();
    let err = plugin
        .allocate(alloc(&[&["fake-l4-24gib-2"]]))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition, "{err:?}");
    assert!(
        err.message().contains("fake-l4-24gib-2") && err.message().contains("Xid 48"),
        "{}",
        err.message()
    );

    agent.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn allocate_answers_what_vendor_runtimes_expect() {
    // NVIDIA: H100 profile devices presented as if read through NVML.
    let dir = TempDir::new("nvidia");
    let mut kubelet = FakeKubelet::start(dir.path());
    let mut agent = Agent::with_snapshot(dir.path(), "4xH100-80GiB", "nvml");
    kubelet.next_registration().await;
    let mut plugin = client(&dir.socket()).await;
    let resp = plugin
        .allocate(AllocateRequest {
            container_requests: vec![ContainerAllocateRequest {
                devices_ids: vec!["fake-h100-80gib-1".into(), "fake-h100-80gib-3".into()],
            }],
        })
        .await
        .unwrap()
        .into_inner();
    let c = &resp.container_responses[0];
    assert_eq!(
        c.envs["TESSERA_VISIBLE_DEVICES"],
        "fake-h100-80gib-1,fake-h100-80gib-3"
    );
    assert_eq!(
        c.envs["NVIDIA_VISIBLE_DEVICES"],
        "fake-h100-80gib-1,fake-h100-80gib-3"
    );
    let paths: Vec<&str> = c.devices.iter().map(|d| d.host_path.as_str()).collect();
    assert_eq!(
        paths,
        [
            "/dev/nvidiactl",
            "/dev/nvidia-uvm",
            "/dev/nvidia-uvm-tools",
            "/dev/nvidia1",
            "/dev/nvidia3"
        ]
    );
    assert!(
        c.devices
            .iter()
            .all(|d| d.container_path == d.host_path && d.permissions == "rw")
    );
    assert!(c.cdi_devices.is_empty(), "CDI is off by default");
    agent.stop().await;
    kubelet.stop().await;

    // AMD: MI300X profile devices presented as if read from AMD sysfs.
    let dir = TempDir::new("amd");
    let mut kubelet = FakeKubelet::start(dir.path());
    let mut agent = Agent::with_snapshot(dir.path(), "8xMI300X-192GiB", "amd");
    kubelet.next_registration().await;
    let mut plugin = client(&dir.socket()).await;
    let resp = plugin
        .allocate(AllocateRequest {
            container_requests: vec![ContainerAllocateRequest {
                devices_ids: vec!["fake-mi300x-192gib-2".into(), "fake-mi300x-192gib-5".into()],
            }],
        })
        .await
        .unwrap()
        .into_inner();
    let c = &resp.container_responses[0];
    assert_eq!(
        c.envs["TESSERA_VISIBLE_DEVICES"],
        "fake-mi300x-192gib-2,fake-mi300x-192gib-5"
    );
    assert!(!c.envs.contains_key("NVIDIA_VISIBLE_DEVICES"));
    let paths: Vec<&str> = c.devices.iter().map(|d| d.host_path.as_str()).collect();
    assert_eq!(
        paths,
        ["/dev/kfd", "/dev/dri/renderD130", "/dev/dri/renderD133"]
    );
    agent.stop().await;
    kubelet.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn registers_again_after_kubelet_restarts() {
    let dir = TempDir::new("restart");
    // The plugin starts first and keeps trying until kubelet is there.
    let mut agent = Agent::with_poller(dir.path(), H100X2_L4X4);
    eventually("our socket", || dir.socket().exists()).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(agent.status.registrations(), 0);
    assert!(!agent.status.is_registered());

    let mut kubelet = FakeKubelet::start(dir.path());
    kubelet.next_registration().await;
    eventually("registered", || agent.status.is_registered()).await;

    // Kubelet restarts: its socket goes away and, as kubelet does on start,
    // the plugin sockets are wiped; then a new kubelet.sock appears.
    kubelet.stop().await;
    eventually("the loss of kubelet to be noticed", || {
        !agent.status.is_registered()
    })
    .await;
    std::fs::remove_file(dir.socket()).unwrap();
    let mut kubelet = FakeKubelet::start(dir.path());
    let reg = kubelet.next_registration().await;
    assert_eq!(reg.endpoint, SOCKET);
    eventually("the second registration to be counted", || {
        agent.status.registrations() >= 2
    })
    .await;

    // The new kubelet reaches the plugin on the recreated socket, with the view intact.
    let mut plugin = client(&dir.socket()).await;
    let mut stream = plugin.list_and_watch(Empty {}).await.unwrap().into_inner();
    assert_eq!(next_list(&mut stream).await.len(), 6);

    // A kubelet restart that leaves our socket alone: the new kubelet.sock alone
    // triggers a registration.
    kubelet.stop().await;
    let before = agent.status.registrations();
    // Down for a few polls, as a restarting kubelet is.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut kubelet = FakeKubelet::start(dir.path());
    kubelet.next_registration().await;
    eventually("the third registration", || {
        agent.status.registrations() > before
    })
    .await;

    agent.stop().await;
    kubelet.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deleted_socket_is_recreated_and_registered() {
    let dir = TempDir::new("deleted");
    let mut kubelet = FakeKubelet::start(dir.path());
    let mut agent = Agent::with_poller(dir.path(), H100X2_L4X4);
    kubelet.next_registration().await;

    std::fs::remove_file(dir.socket()).unwrap();
    let reg = kubelet.next_registration().await;
    assert_eq!(reg.endpoint, SOCKET);
    assert!(dir.socket().exists());
    eventually("two registrations", || agent.status.registrations() == 2).await;

    let mut plugin = client(&dir.socket()).await;
    let opts = plugin
        .get_device_plugin_options(Empty {})
        .await
        .unwrap()
        .into_inner();
    assert!(opts.get_preferred_allocation_available);

    agent.stop().await;
    kubelet.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_stops_serving_and_removes_the_socket() {
    let dir = TempDir::new("shutdown");
    let mut kubelet = FakeKubelet::start(dir.path());
    let mut agent = Agent::with_poller(dir.path(), H100X2_L4X4);
    kubelet.next_registration().await;
    assert!(dir.socket().exists());

    // An open ListAndWatch stream must not hold the shutdown up.
    let mut plugin = client(&dir.socket()).await;
    let mut stream = plugin.list_and_watch(Empty {}).await.unwrap().into_inner();
    next_list(&mut stream).await;

    agent.stop().await;
    assert!(!dir.socket().exists(), "our socket is still there");
    assert!(!agent.status.is_registered() && !agent.status.is_serving());
    // The stream ends rather than hangs.
    let end = within("the stream to end", stream.next()).await;
    assert!(!matches!(end, Some(Ok(_))), "{end:?}");
    kubelet.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nothing_is_served_before_the_first_snapshot() {
    let dir = TempDir::new("notready");
    let mut kubelet = FakeKubelet::start(dir.path());
    let (tx, rx) = state::channel("fake");
    let mut agent = Agent::start(dir.path(), tx.clone(), rx);
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!dir.socket().exists());
    assert!(kubelet.nothing_registered());

    let mut fake = FakeBackend::new("1xL4-24GiB").unwrap();
    let snap = snapshot(&mut fake).unwrap();
    tx.send_modify(|v| {
        v.snapshot = snap;
        v.ready = true;
    });
    kubelet.next_registration().await;
    agent.stop().await;
    kubelet.stop().await;
}
