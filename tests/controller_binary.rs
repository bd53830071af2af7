//! The `tessera controller` binary against a fake API server in this process
//! (plain HTTP on loopback, `tests/common/fake_apiserver.rs`). The test plays
//! the node agents (Nodes with a GPU state), the user (ModelInstances, a
//! deleted pod) and kubelet (pods turn Ready; deletion is immediate), and
//! checks what the controller wrote: the Service, the shard pod bound to its
//! planned node and devices, status, events, re-planning after a device
//! fault, repair of a deleted pod, the HTTP endpoints; with two replicas,
//! that only the Lease holder acts, that SIGTERM hands over the Lease and
//! that a leader whose Lease was taken exits;
//! that instances reconciled at the same time get distinct devices and stay
//! put; failed admission, a vanished node, a template change and an
//! unsatisfiable instance (no pods, one event, no hot loop); an overloaded
//! server; and a device fault seen only in a slow re-list after every watch
//! expired.

#[path = "common/fake_apiserver.rs"]
mod fake_apiserver;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use fake_apiserver::{FakeApiServer, Kind, Record};
use serde_json::{Value, json};
use tessera::api::ModelInstance;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const NS: &str = "ml";
const INSTANCE: &str = "llama-7b";
const POD: &str = "llama-7b-shard-0";
const LEASE: &str = "tessera-controller";
/// How long one expected change may take.
const SETTLE: Duration = Duration::from_secs(20);

// ---------------------------------------------------------------------------
// The cluster.

struct Gpu {
    vendor: &'static str,
    product: &'static str,
    memory_gib: u64,
    tflops: f64,
    bandwidth: f64,
}

const H100: Gpu = Gpu {
    vendor: "nvidia",
    product: "NVIDIA H100 80GB HBM3",
    memory_gib: 80,
    tflops: 989.0,
    bandwidth: 3350.0,
};
const MI300X: Gpu = Gpu {
    vendor: "amd",
    product: "AMD Instinct MI300X",
    memory_gib: 192,
    tflops: 1307.0,
    bandwidth: 5300.0,
};
const RTX4090: Gpu = Gpu {
    vendor: "nvidia",
    product: "NVIDIA GeForce RTX 4090",
    memory_gib: 24,
    tflops: 165.0,
    bandwidth: 1008.0,
};

/// Node name, GPU kind, count.
const NODES: [(&str, Gpu, u32); 3] = [
    ("node-h100", H100, 4),
    ("node-mi300x", MI300X, 2),
    ("node-rtx", RTX4090, 2),
];

/// A `NodeGpuState` as an agent publishes it; devices in `unhealthy` are not.
fn gpu_state(node: &str, gpu: &Gpu, count: u32, unhealthy: &[String]) -> Value {
    let devices: Vec<Value> = (0..count)
        .map(|i| {
            let id = format!("{node}-gpu{i}");
            let mut d = json!({
                "id": id, "index": i, "vendor": gpu.vendor, "product": gpu.product,
                "memoryTotalBytes": gpu.memory_gib << 30,
                "memoryFreeBytes": (gpu.memory_gib << 30) - (1 << 30),
                "fp16Tflops": gpu.tflops, "memoryBandwidthGbps": gpu.bandwidth,
                "temperatureC": 41.0, "health": "Healthy",
            });
            if unhealthy.contains(&id) {
                d["health"] = json!("Unhealthy");
                d["healthReason"] = json!("Xid 79: GPU has fallen off the bus");
            }
            d
        })
        .collect();
    json!({"version": "v1", "backend": "fake", "devices": devices, "links": []})
}

fn add_nodes(fake: &FakeApiServer) {
    for (name, gpu, count) in &NODES {
        fake.create(
            Kind::Node,
            json!({
                "metadata": {
                    "name": name,
                    "labels": {"kubernetes.io/hostname": name},
                    "annotations": {
                        "tessera.dev/gpu-state": gpu_state(name, gpu, *count, &[]).to_string(),
                    },
                },
                "spec": {},
                "status": {"conditions": [{
                    "type": "Ready", "status": "True", "reason": "KubeletReady",
                    "lastTransitionTime": "2025-01-01T00:00:00Z",
                    "lastHeartbeatTime": "2025-01-01T00:00:00Z",
                }]},
            }),
        );
    }
}

/// A device of `node` fails: the agent publishes the new state.
fn fail_device(fake: &FakeApiServer, node: &str, device: &str) {
    let (_, gpu, count) = NODES
        .iter()
        .find(|(n, _, _)| *n == node)
        .unwrap_or_else(|| panic!("{node} is not a test node"));
    let state = gpu_state(node, gpu, *count, &[device.to_string()]);
    fake.modify(Kind::Node, "", node, |n| {
        n["metadata"]["annotations"]["tessera.dev/gpu-state"] = json!(state.to_string());
    });
}

/// The smallest example, in the test namespace.
fn add_instance(fake: &FakeApiServer) -> Value {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/llama-7b.yaml");
    let text = std::fs::read_to_string(&path).unwrap();
    let mi: ModelInstance = serde_saphyr::from_str(&text).unwrap();
    let mut value = serde_json::to_value(&mi).unwrap();
    value["metadata"]["namespace"] = json!(NS);
    fake.create(Kind::ModelInstance, value)
}

/// Kubelet started the shard's containers and they are ready.
fn mark_ready(fake: &FakeApiServer, pod: &str) {
    fake.modify(Kind::Pod, NS, pod, |p| {
        p["status"] = json!({
            "phase": "Running",
            "conditions": [
                {"type": "PodScheduled", "status": "True"},
                {"type": "Ready", "status": "True"},
            ],
        });
    });
}

/// What node agents do once kubelet has allocated a bound pod's devices:
/// record them as the pod's in the node's published GPU state.
fn report_allocations(fake: &FakeApiServer) {
    for pod in fake.list(Kind::Pod) {
        let (Some(node), Some(uid), Some(devices)) = (
            pod["spec"]["nodeName"].as_str(),
            pod["metadata"]["uid"].as_str(),
            pod["metadata"]["annotations"]["tessera.dev/devices"].as_str(),
        ) else {
            continue;
        };
        let Some(mut state) = fake
            .get(Kind::Node, "", node)
            .and_then(|n| {
                n["metadata"]["annotations"]["tessera.dev/gpu-state"]
                    .as_str()
                    .map(str::to_string)
            })
            .and_then(|t| serde_json::from_str::<Value>(&t).ok())
        else {
            continue;
        };
        if devices
            .split(',')
            .all(|d| state["allocated"][d] == json!(uid))
        {
            continue;
        }
        for device in devices.split(',') {
            state["allocated"][device] = json!(uid);
        }
        fake.modify(Kind::Node, "", node, |n| {
            n["metadata"]["annotations"]["tessera.dev/gpu-state"] = json!(state.to_string());
        });
    }
}

// ---------------------------------------------------------------------------
// Controller processes.

/// A scratch directory, removed when dropped.
struct Scratch(PathBuf);

impl Scratch {
    fn new(tag: &str) -> Self {
        let dir = std::env::temp_dir().join(format!(
            "tessera-controller-binary-{tag}-{}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        Self(dir)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

/// A `tessera controller` process, killed when dropped.
struct Controller {
    identity: String,
    child: Child,
    port: u16,
    log: PathBuf,
}

fn free_port() -> u16 {
    // Bind, read, release: another process could take it in between, then the
    // controller fails to listen and its log says so.
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .unwrap()
}

impl Controller {
    /// `identity` is also the bearer token, so the fake knows who wrote what.
    fn start(fake: &FakeApiServer, scratch: &Scratch, identity: &str, args: &[&str]) -> Self {
        let kubeconfig = scratch.0.join(format!("{identity}.kubeconfig"));
        std::fs::write(&kubeconfig, fake.kubeconfig(identity)).unwrap();
        let log = scratch.0.join(format!("{identity}.log"));
        let port = free_port();
        let child = Command::new(env!("CARGO_BIN_EXE_tessera"))
            .arg("controller")
            .arg("--kubeconfig")
            .arg(&kubeconfig)
            .args(["--listen", &format!("127.0.0.1:{port}")])
            .args(args)
            .env("RUST_LOG", "info")
            .env("POD_NAME", identity)
            .env_remove("POD_NAMESPACE")
            .env_remove("KUBECONFIG")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .expect("starting tessera controller");
        Self {
            identity: identity.to_string(),
            child,
            port,
            log,
        }
    }

    fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        format!(
            "--- log of controller {} (last 40 lines) ---\n{}",
            self.identity,
            lines[lines.len().saturating_sub(40)..].join("\n")
        )
    }

    /// SIGTERM, then the exit code (`None`: killed after 15 s, or a signal).
    fn terminate(&mut self) -> Option<i32> {
        let _ = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status();
        let start = Instant::now();
        while start.elapsed() < Duration::from_secs(15) {
            if let Ok(Some(status)) = self.child.try_wait() {
                return status.code();
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        None
    }

    fn exited(&mut self) -> Option<std::process::ExitStatus> {
        self.child.try_wait().ok().flatten()
    }
}

impl Drop for Controller {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
        if std::thread::panicking() {
            eprintln!("{}", self.log_tail());
        }
    }
}

/// Logs of the controllers and what the fake could not route, for failures.
fn context(fake: &FakeApiServer, controllers: &mut [&mut Controller]) -> String {
    let mut out = String::new();
    for c in controllers.iter_mut() {
        if let Some(status) = c.exited() {
            out.push_str(&format!("controller {} exited: {status}\n", c.identity));
        }
        out.push_str(&c.log_tail());
        out.push('\n');
    }
    let unknown = fake.unknown();
    if !unknown.is_empty() {
        out.push_str(&format!(
            "requests the fake had no route for: {unknown:#?}\n"
        ));
    }
    out
}

/// Polls `probe` every 100 ms until it answers; panics after `limit` with
/// its last reason and the controllers' logs.
async fn wait_for<T>(
    what: &str,
    limit: Duration,
    fake: &FakeApiServer,
    controllers: &mut [&mut Controller],
    mut probe: impl FnMut() -> Result<T, String>,
) -> T {
    let start = Instant::now();
    loop {
        let why = match probe() {
            Ok(v) => return v,
            Err(why) => why,
        };
        let gone = controllers.iter_mut().any(|c| c.exited().is_some());
        if start.elapsed() > limit || gone {
            panic!(
                "waited {:?} for {what}: {why}\n{}",
                start.elapsed(),
                context(fake, controllers)
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Waits for the one instance's shard to be planned and bound: its node,
/// devices and pod UID.
async fn first_bound(fake: &FakeApiServer, ctl: &mut Controller) -> (String, Vec<String>, String) {
    wait_for("the instance to be bound", SETTLE, fake, &mut [ctl], || {
        bound(fake, &[], &["Bound"])
    })
    .await
}

/// Waits for the shard to be bound again, off `victim`, by a pod other than
/// `old_pod` (a UID), with the instance in `phase`.
async fn moved_off(
    what: &str,
    limit: Duration,
    fake: &FakeApiServer,
    ctl: &mut Controller,
    victim: &str,
    old_pod: &str,
    phase: &str,
) -> (String, Vec<String>, String) {
    let victim = [victim.to_string()];
    wait_for(what, limit, fake, &mut [ctl], || {
        let b = bound(fake, &victim, &[phase])?;
        if b.2 == old_pod {
            return Err("the old pod is still there".into());
        }
        Ok(b)
    })
    .await
}

// ---------------------------------------------------------------------------
// Reading the fake.

fn status_of(fake: &FakeApiServer) -> Result<Value, String> {
    let mi = fake
        .get(Kind::ModelInstance, NS, INSTANCE)
        .ok_or("the instance is gone")?;
    match mi.get("status") {
        Some(s) => Ok(s.clone()),
        None => Err("no status yet".into()),
    }
}

/// The instance has one shard whose pod is bound to the planned node and
/// devices, avoiding `not_on`, and is in one of `phases` (`Bound`, or
/// `Degraded` for one that was running): (plan node, plan devices, pod uid).
fn bound(
    fake: &FakeApiServer,
    not_on: &[String],
    phases: &[&str],
) -> Result<(String, Vec<String>, String), String> {
    let status = status_of(fake)?;
    let plan = status["plan"].as_array().cloned().unwrap_or_default();
    if plan.len() != 1 {
        return Err(format!("plan {plan:?}, status {status}"));
    }
    let node = plan[0]["node"].as_str().unwrap_or_default().to_string();
    let devices: Vec<String> = plan[0]["devices"]
        .as_array()
        .map(|d| {
            d.iter()
                .filter_map(|d| d.as_str().map(str::to_string))
                .collect()
        })
        .unwrap_or_default();
    if let Some(d) = devices.iter().find(|d| not_on.contains(d)) {
        return Err(format!("still planned on {d}"));
    }
    let pod = fake
        .get(Kind::Pod, NS, POD)
        .ok_or_else(|| format!("no pod {POD}; status {status}"))?;
    let spec = &pod["spec"];
    if spec["schedulerName"] != json!("tessera") {
        return Err(format!("schedulerName {}", spec["schedulerName"]));
    }
    if spec["nodeName"] != json!(node) {
        return Err(format!("pod on {}, planned for {node}", spec["nodeName"]));
    }
    let annotations = &pod["metadata"]["annotations"];
    if annotations["tessera.dev/devices"] != json!(devices.join(",")) {
        return Err(format!(
            "pod devices {}, planned {devices:?}",
            annotations["tessera.dev/devices"]
        ));
    }
    if annotations["tessera.dev/shard"] != json!("0") {
        return Err(format!(
            "shard annotation {}",
            annotations["tessera.dev/shard"]
        ));
    }
    if !phases.iter().any(|p| status["phase"] == json!(p)) {
        return Err(format!("phase {}", status["phase"]));
    }
    let uid = pod["metadata"]["uid"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    Ok((node, devices, uid))
}

/// The per-vendor resource for the GPUs of `node` (one of `NODES`).
fn vendor_resource(node: &str) -> Vec<(String, Value)> {
    let (_, gpu, _) = NODES.iter().find(|n| n.0 == node).unwrap();
    vec![(format!("tessera.dev/{}-gpu", gpu.vendor), json!("1"))]
}

/// The limits of the shard pod's first container.
fn vendor_requested(fake: &FakeApiServer) -> Vec<(String, Value)> {
    let pod = fake.get(Kind::Pod, NS, POD).unwrap();
    let limits = &pod["spec"]["containers"][0]["resources"]["limits"];
    limits
        .as_object()
        .map(|l| l.iter().map(|(k, v)| (k.clone(), v.clone())).collect())
        .unwrap_or_default()
}

/// `(reason, reportingInstance)` of the events about the instance.
fn events(fake: &FakeApiServer) -> Vec<(String, String)> {
    fake.list(Kind::Event)
        .into_iter()
        .filter(|e| e["regarding"]["name"] == json!(INSTANCE))
        .inspect(|e| {
            assert_eq!(
                e["reportingController"],
                json!("tessera-controller"),
                "an event from another controller: {e}"
            );
        })
        .map(|e| {
            (
                e["reason"].as_str().unwrap_or_default().to_string(),
                e["reportingInstance"]
                    .as_str()
                    .unwrap_or_default()
                    .to_string(),
            )
        })
        .collect()
}

/// Waits for an event about `instance` with `reason` whose note contains
/// every one of `words` (a later event with the same reason must not just
/// count up an earlier one).
fn event_note(
    fake: &FakeApiServer,
    instance: &str,
    reason: &str,
    words: &[&str],
) -> Result<(), String> {
    let notes: Vec<String> = fake
        .list(Kind::Event)
        .into_iter()
        .filter(|e| e["regarding"]["name"] == json!(instance))
        .map(|e| {
            format!(
                "{}: {}",
                e["reason"].as_str().unwrap_or(""),
                e["note"].as_str().unwrap_or("")
            )
        })
        .collect();
    let prefix = format!("{reason}: ");
    if notes
        .iter()
        .any(|n| n.starts_with(&prefix) && words.iter().all(|w| n.contains(w)))
    {
        Ok(())
    } else {
        Err(format!(
            "no {reason} event saying {words:?} among {notes:#?}"
        ))
    }
}

fn has_event(fake: &FakeApiServer, reason: &str) -> Result<(), String> {
    let all = events(fake);
    if all.iter().any(|(r, _)| r == reason) {
        Ok(())
    } else {
        Err(format!("no {reason} event among {all:?}"))
    }
}

fn lease_holder(fake: &FakeApiServer) -> Option<String> {
    fake.get(Kind::Lease, NS, LEASE)?["spec"]["holderIdentity"]
        .as_str()
        .map(str::to_string)
}

/// The writes the controller makes in the next `quiet` (none, once settled).
async fn writes_within(fake: &FakeApiServer, quiet: Duration) -> Vec<Record> {
    let settled = fake.records().iter().filter(|r| r.is_write()).count();
    tokio::time::sleep(quiet).await;
    fake.records()
        .into_iter()
        .filter(Record::is_write)
        .skip(settled)
        .collect()
}

/// Successful pod creations.
fn pod_creations(records: &[Record]) -> Vec<&Record> {
    records
        .iter()
        .filter(|r| {
            r.kind == Some(Kind::Pod)
                && r.method == "POST"
                && r.path.ends_with("/pods")
                && r.status == 201
        })
        .collect()
}

/// GET on the controller's HTTP port: status code and body.
async fn http_get(port: u16, path: &str) -> (u16, String) {
    let mut stream = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .unwrap_or_else(|e| panic!("connecting to 127.0.0.1:{port}: {e}"));
    stream
        .write_all(format!("GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let mut text = String::new();
    tokio::time::timeout(Duration::from_secs(5), stream.read_to_string(&mut text))
        .await
        .expect("an answer within 5 s")
        .unwrap();
    let code = text
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let body = text
        .split_once("\r\n\r\n")
        .map_or("", |(_, b)| b)
        .to_string();
    (code, body)
}

fn metric(text: &str, name: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
}

/// Waits until the controller's HTTP endpoints answer.
async fn wait_http(port: u16) {
    let start = Instant::now();
    while tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .is_err()
    {
        assert!(
            start.elapsed() < SETTLE,
            "nothing listens on 127.0.0.1:{port}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

// ---------------------------------------------------------------------------
// Scenarios.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_controller_binds_replans_repairs_and_reports() {
    let fake = FakeApiServer::start().await;
    let scratch = Scratch::new("single");
    add_nodes(&fake);
    let mut ctl = Controller::start(&fake, &scratch, "solo", &["--leader-elect=false"]);
    let mi = add_instance(&fake);
    let mi_uid = mi["metadata"]["uid"].as_str().unwrap().to_string();

    // Planned, created and bound where planned.
    let (node, devices, first_uid) = first_bound(&fake, &mut ctl).await;
    println!("planned on {node} {devices:?}");
    assert!(
        node == "node-h100" || node == "node-mi300x",
        "llama-7b needs more than an RTX 4090 has, yet was planned on {node}"
    );
    let service = fake
        .get(Kind::Service, NS, INSTANCE)
        .expect("the headless Service");
    assert_eq!(service["spec"]["clusterIP"], json!("None"), "{service}");
    assert_eq!(service["spec"]["publishNotReadyAddresses"], json!(true));
    let pod = fake.get(Kind::Pod, NS, POD).unwrap();
    for owned in [&pod, &service] {
        let owners = owned["metadata"]["ownerReferences"].as_array().unwrap();
        assert!(
            owners
                .iter()
                .any(|o| o["uid"] == json!(mi_uid) && o["kind"] == json!("ModelInstance")),
            "{owners:?}"
        );
    }
    assert_eq!(
        pod["metadata"]["labels"]["tessera.dev/instance"],
        json!(INSTANCE)
    );
    for reason in ["Planned", "Bound"] {
        wait_for(
            &format!("a {reason} event"),
            SETTLE,
            &fake,
            &mut [&mut ctl],
            || has_event(&fake, reason),
        )
        .await;
    }
    assert!(events(&fake).iter().all(|(_, who)| who == "solo"));

    // Kubelet runs the shard: Running, 1 of 1 ready.
    mark_ready(&fake, POD);
    let status = wait_for("phase Running", SETTLE, &fake, &mut [&mut ctl], || {
        let s = status_of(&fake)?;
        if s["phase"] == json!("Running") && s["readyShards"] == json!(1) {
            Ok(s)
        } else {
            Err(format!("status {s}"))
        }
    })
    .await;
    assert_eq!(status["shards"], json!(1));
    assert_eq!(status["observedGeneration"], json!(1));

    // Settled: no further writes.
    let later = writes_within(&fake, Duration::from_secs(2)).await;
    assert!(
        later.is_empty(),
        "a settled instance is written to: {later:#?}\n{}",
        context(&fake, &mut [&mut ctl])
    );

    // The HTTP endpoints.
    wait_http(ctl.port).await;
    let (code, body) = http_get(ctl.port, "/healthz").await;
    assert_eq!(code, 200, "/healthz: {body}");
    let (code, body) = http_get(ctl.port, "/readyz").await;
    assert_eq!(code, 200, "/readyz: {body}");
    let (code, text) = http_get(ctl.port, "/metrics").await;
    assert_eq!(code, 200, "/metrics: {text}");
    let reconciles = metric(&text, "tessera_controller_reconciles_total")
        .unwrap_or_else(|| panic!("no reconciles_total in\n{text}"));
    assert!(reconciles >= 1.0, "{text}");
    assert_eq!(
        metric(&text, "tessera_controller_instances{phase=\"Running\"}"),
        Some(1.0),
        "{text}"
    );
    assert_eq!(
        metric(&text, "tessera_controller_instances{phase=\"Bound\"}"),
        Some(0.0),
        "{text}"
    );
    assert_eq!(
        metric(&text, "tessera_controller_leader"),
        Some(1.0),
        "{text}"
    );
    assert!(
        text.contains("tessera_controller_reconcile_duration_seconds_bucket"),
        "{text}"
    );

    // A planned device fails: the shard moves, its old pod goes, a new one is
    // bound to the new plan.
    let victim = devices[0].clone();
    fail_device(&fake, &node, &victim);
    // A running instance that lost its shard is Degraded until the new pod is ready.
    let (new_node, new_devices, second_uid) = moved_off(
        "the shard to move off the failed device",
        SETTLE,
        &fake,
        &mut ctl,
        &victim,
        &first_uid,
        "Degraded",
    )
    .await;
    println!("moved to {new_node} {new_devices:?}");
    let new_device = new_devices[0].as_str();
    wait_for(
        "events about the move",
        SETTLE,
        &fake,
        &mut [&mut ctl],
        || {
            event_note(
                &fake,
                INSTANCE,
                "Replanned",
                &[&victim, new_device, "unhealthy"],
            )?;
            event_note(&fake, INSTANCE, "Bound", &[new_device])
        },
    )
    .await;
    let records = fake.records();
    let deleted_old = records.iter().any(|r| {
        r.method == "DELETE" && r.path.ends_with(&format!("/pods/{POD}")) && r.status == 200
    });
    assert!(deleted_old, "the old pod was not deleted by the controller");
    mark_ready(&fake, POD);
    wait_for(
        "phase Running again",
        SETTLE,
        &fake,
        &mut [&mut ctl],
        || {
            let s = status_of(&fake)?;
            (s["phase"] == json!("Running"))
                .then_some(())
                .ok_or(format!("status {s}"))
        },
    )
    .await;

    // A pod deleted by hand comes back, on the same plan.
    assert!(fake.delete(Kind::Pod, NS, POD));
    let (again_node, again_devices, _) = wait_for(
        "the deleted pod to be recreated and bound",
        SETTLE,
        &fake,
        &mut [&mut ctl],
        || {
            let b = bound(&fake, &[], &["Degraded"])?;
            if b.2 == second_uid {
                return Err("the same pod".into());
            }
            Ok(b)
        },
    )
    .await;
    assert_eq!(
        (again_node, again_devices),
        (new_node, new_devices),
        "a recreated pod moved"
    );

    assert!(
        fake.unknown().is_empty(),
        "unrouted requests: {:#?}",
        fake.unknown()
    );
    let code = ctl.terminate();
    assert_eq!(code, Some(0), "SIGTERM\n{}", ctl.log_tail());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_controllers_one_acts_and_sigterm_hands_over() {
    let fake = FakeApiServer::start().await;
    let scratch = Scratch::new("pair");
    add_nodes(&fake);
    let args = [
        "--namespace",
        NS,
        "--lease-namespace",
        NS,
        "--lease-name",
        LEASE,
    ];
    let start = |id: &str| {
        let mut all = args.to_vec();
        all.extend(["--identity", id]);
        Controller::start(&fake, &scratch, id, &all)
    };
    let mut a = start("ctl-a");
    let mut b = start("ctl-b");
    let leader = wait_for(
        "a controller to hold the lease",
        SETTLE,
        &fake,
        &mut [&mut a, &mut b],
        || lease_holder(&fake).ok_or_else(|| "no holder".to_string()),
    )
    .await;
    println!("leader: {leader}");
    let (leader_ctl, standby_ctl) = if leader == "ctl-a" {
        (&mut a, &mut b)
    } else {
        (&mut b, &mut a)
    };
    let standby = standby_ctl.identity.clone();
    add_instance(&fake);
    wait_for(
        "the instance to be bound",
        SETTLE,
        &fake,
        &mut [leader_ctl, standby_ctl],
        || {
            bound(&fake, &[], &["Bound"])?;
            has_event(&fake, "Bound")
        },
    )
    .await;

    // Only the holder acted.
    let events_now = events(&fake);
    for (reason, who) in &events_now {
        assert_eq!(
            *who, leader,
            "event {reason} came from {who}, not the lease holder"
        );
    }
    let records = fake.records();
    let standby_writes: Vec<&Record> = records
        .iter()
        .filter(|r| {
            r.is_write() && r.client.as_deref() == Some(&standby) && r.kind != Some(Kind::Lease)
        })
        .collect();
    assert!(
        standby_writes.is_empty(),
        "the standby wrote: {standby_writes:#?}"
    );
    let created = pod_creations(&records);
    assert_eq!(created.len(), 1, "pod creations: {created:#?}");
    assert_eq!(created[0].client.as_deref(), Some(leader.as_str()));
    let watched_by_standby = records
        .iter()
        .any(|r| r.client.as_deref() == Some(&standby) && r.kind != Some(Kind::Lease));
    assert!(
        !watched_by_standby,
        "the standby reads the cluster before it leads"
    );

    wait_http(leader_ctl.port).await;
    wait_http(standby_ctl.port).await;
    let (_, text) = http_get(leader_ctl.port, "/metrics").await;
    assert_eq!(
        metric(&text, "tessera_controller_leader"),
        Some(1.0),
        "{text}"
    );
    let (_, text) = http_get(standby_ctl.port, "/metrics").await;
    assert_eq!(
        metric(&text, "tessera_controller_leader"),
        Some(0.0),
        "{text}"
    );
    let (code, _) = http_get(standby_ctl.port, "/readyz").await;
    assert_eq!(code, 200, "a standby is ready");

    // SIGTERM: the leader exits 0 and gives up the lease; the standby takes
    // it within a lease duration and repairs a deleted pod.
    let code = leader_ctl.terminate();
    assert_eq!(code, Some(0), "SIGTERM\n{}", leader_ctl.log_tail());
    let holder = lease_holder(&fake);
    assert_ne!(
        holder.as_deref(),
        Some(leader.as_str()),
        "the lease was not released"
    );
    let old_uid = fake.get(Kind::Pod, NS, POD).unwrap()["metadata"]["uid"].clone();
    assert!(fake.delete(Kind::Pod, NS, POD));
    wait_for(
        "the standby to take the lease",
        Duration::from_secs(25),
        &fake,
        &mut [standby_ctl],
        || match lease_holder(&fake) {
            Some(h) if h == standby => Ok(()),
            other => Err(format!("holder {other:?}")),
        },
    )
    .await;
    wait_for(
        "the new leader to recreate the pod",
        SETTLE,
        &fake,
        &mut [standby_ctl],
        || {
            let (_, _, uid) = bound(&fake, &[], &["Bound"])?;
            if json!(uid) == old_uid {
                return Err("the old pod".into());
            }
            if !events(&fake)
                .iter()
                .any(|(r, who)| r == "Bound" && *who == standby)
            {
                return Err(format!("no Bound event from {standby}"));
            }
            Ok(())
        },
    )
    .await;
    let records = fake.records();
    let created = pod_creations(&records);
    assert_eq!(created.len(), 2, "pod creations: {created:#?}");
    assert_eq!(created[1].client.as_deref(), Some(standby.as_str()));
    assert!(
        fake.unknown().is_empty(),
        "unrouted requests: {:#?}",
        fake.unknown()
    );
    let code = standby_ctl.terminate();
    assert_eq!(code, Some(0), "SIGTERM\n{}", standby_ctl.log_tail());
    assert_eq!(
        lease_holder(&fake),
        None,
        "the last leader did not release the lease"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_whose_lease_is_taken_exits_and_leaves_it() {
    let fake = FakeApiServer::start().await;
    let scratch = Scratch::new("usurped");
    add_nodes(&fake);
    let mut ctl = Controller::start(
        &fake,
        &scratch,
        "ctl-a",
        &[
            "--namespace",
            NS,
            "--lease-namespace",
            NS,
            "--lease-name",
            LEASE,
            "--identity",
            "ctl-a",
        ],
    );
    wait_for(
        "the controller to hold the lease",
        SETTLE,
        &fake,
        &mut [&mut ctl],
        || match lease_holder(&fake) {
            Some(h) if h == "ctl-a" => Ok(()),
            other => Err(format!("holder {other:?}")),
        },
    )
    .await;
    // The Lease on the server is not yet the controller knowing it leads: only
    // a leader that knew can find out it lost.
    let log = ctl.log.clone();
    wait_for(
        "the controller to know it holds the lease",
        SETTLE,
        &fake,
        &mut [&mut ctl],
        || match std::fs::read_to_string(&log) {
            Ok(text) if text.contains("acquired the leader lease") => Ok(()),
            _ => Err("not yet".to_string()),
        },
    )
    .await;

    // Another replica (a partition healed, a clock skewed) holds it now.
    let now = k8s_openapi::jiff::Timestamp::now().to_string();
    fake.modify(Kind::Lease, NS, LEASE, |lease| {
        lease["spec"]["holderIdentity"] = json!("usurper");
        lease["spec"]["acquireTime"] = json!(now);
        lease["spec"]["renewTime"] = json!(now);
        lease["spec"]["leaseDurationSeconds"] = json!(3600);
    });
    // The next renewal (within a lease duration) finds out.
    let start = Instant::now();
    let status = loop {
        if let Some(status) = ctl.exited() {
            break status;
        }
        assert!(
            start.elapsed() < Duration::from_secs(25),
            "still running with the lease held by another\n{}",
            ctl.log_tail()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(status.code(), Some(1), "{}", ctl.log_tail());
    assert!(
        ctl.log_tail().contains("lost the leader lease"),
        "{}",
        ctl.log_tail()
    );
    assert_eq!(
        lease_holder(&fake).as_deref(),
        Some("usurper"),
        "the old leader released a lease it no longer held"
    );
}

/// `examples/llama-7b.yaml` as `name`, with `change` applied.
fn add_named(fake: &FakeApiServer, name: &str, change: impl FnOnce(&mut Value)) -> Value {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/llama-7b.yaml");
    let mi: ModelInstance =
        serde_saphyr::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let mut value = serde_json::to_value(&mi).unwrap();
    value["metadata"]["namespace"] = json!(NS);
    value["metadata"]["name"] = json!(name);
    change(&mut value);
    fake.create(Kind::ModelInstance, value)
}

/// Each named instance's single planned `node/device`, once every one has a
/// plan and a pod bound to it.
fn placements(fake: &FakeApiServer, names: &[&str]) -> Result<Vec<String>, String> {
    let mut out = Vec::new();
    for name in names {
        let mi = fake
            .get(Kind::ModelInstance, NS, name)
            .ok_or(format!("no {name}"))?;
        let plan = &mi["status"]["plan"];
        let (node, device) = (&plan[0]["node"], &plan[0]["devices"][0]);
        let pod = fake
            .get(Kind::Pod, NS, &format!("{name}-shard-0"))
            .ok_or(format!("no pod of {name}; status {}", mi["status"]))?;
        if pod["spec"]["nodeName"] != *node
            || pod["metadata"]["annotations"]["tessera.dev/devices"] != *device
            || mi["status"]["phase"] != json!("Bound")
        {
            return Err(format!(
                "{name}: status {}, pod {}",
                mi["status"], pod["spec"]["nodeName"]
            ));
        }
        out.push(format!(
            "{}/{}",
            node.as_str().unwrap_or(""),
            device.as_str().unwrap_or("")
        ));
    }
    Ok(out)
}

/// Instances reconciled at the same time must not plan the same free device
/// (nor then chase each other from device to device).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn instances_created_together_get_distinct_devices() {
    let fake = FakeApiServer::start().await;
    let scratch = Scratch::new("together");
    add_nodes(&fake);
    let names = ["one", "two", "three"];
    for name in names {
        add_named(&fake, name, |_| {});
    }
    let mut ctl = Controller::start(&fake, &scratch, "solo", &["--leader-elect=false"]);
    let placed = wait_for(
        "every instance to be bound",
        SETTLE,
        &fake,
        &mut [&mut ctl],
        || {
            // The node agents report what kubelet allocated; the controller
            // binds the next pod of a node only then.
            report_allocations(&fake);
            let placed = placements(&fake, &names)?;
            // The status is written before the events are.
            for name in names {
                event_note(&fake, name, "Bound", &[])?;
            }
            Ok(placed)
        },
    )
    .await;
    let distinct: std::collections::BTreeSet<&String> = placed.iter().collect();
    assert_eq!(
        distinct.len(),
        names.len(),
        "devices planned twice: {placed:?}"
    );
    let later = writes_within(&fake, Duration::from_secs(2)).await;
    assert!(
        later.is_empty(),
        "still writing: {later:#?}\n{}",
        context(&fake, &mut [&mut ctl])
    );
    assert_eq!(
        placements(&fake, &names).unwrap(),
        placed,
        "an instance moved"
    );
    let others: Vec<String> = fake
        .list(Kind::Event)
        .iter()
        .filter_map(|e| e["reason"].as_str())
        .filter(|r| *r != "Planned" && *r != "Bound")
        .map(str::to_string)
        .collect();
    assert!(
        others.is_empty(),
        "events besides Planned and Bound: {others:?}"
    );
    assert_eq!(ctl.terminate(), Some(0), "SIGTERM\n{}", ctl.log_tail());
}

/// What else moves a shard or its pod: a failed admission, a vanished node,
/// a template change (new pod, same plan); and an instance nothing can hold
/// waits without pods and without a hot loop. Run with a per-vendor resource
/// name, so each pod must request its node's vendor's resource.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failed_admission_lost_node_template_change_and_unsatisfiable() {
    let fake = FakeApiServer::start().await;
    let scratch = Scratch::new("repairs");
    add_nodes(&fake);
    let mut ctl = Controller::start(
        &fake,
        &scratch,
        "solo",
        &[
            "--leader-elect=false",
            "--resource-name",
            "tessera.dev/{vendor}-gpu",
        ],
    );
    add_instance(&fake);
    let (first_node, devices, first) = first_bound(&fake, &mut ctl).await;

    // Kubelet refuses the pod: the shard goes elsewhere.
    fake.modify(Kind::Pod, NS, POD, |p| {
        p["status"] = json!({
            "phase": "Failed", "reason": "UnexpectedAdmissionError",
            "message": "Allocate failed due to no healthy devices present",
        });
    });
    assert_eq!(vendor_requested(&fake), vendor_resource(&first_node));
    let (node, _, second) = wait_for(
        "the shard to leave the refused device",
        SETTLE,
        &fake,
        &mut [&mut ctl],
        || {
            let b = bound(&fake, &devices, &["Bound"])?;
            (b.2 != first)
                .then_some(b)
                .ok_or("the refused pod is still there".to_string())
        },
    )
    .await;
    assert_eq!(vendor_requested(&fake), vendor_resource(&node));
    wait_for(
        "the events about it",
        SETTLE,
        &fake,
        &mut [&mut ctl],
        || {
            event_note(&fake, INSTANCE, "Replanned", &["failed admission"])?;
            event_note(&fake, INSTANCE, "ShardLost", &["UnexpectedAdmissionError"])
        },
    )
    .await;

    // The node goes away: the shard moves to another node.
    assert!(fake.delete(Kind::Node, "", &node));
    let (elsewhere, _, third) = wait_for(
        "the shard to leave the vanished node",
        SETTLE,
        &fake,
        &mut [&mut ctl],
        || {
            let b = bound(&fake, &[], &["Bound"])?;
            if b.0 == node || b.2 == second {
                return Err(format!("still on {node}"));
            }
            Ok(b)
        },
    )
    .await;
    assert_eq!(vendor_requested(&fake), vendor_resource(&elsewhere));
    wait_for(
        "a Replanned event naming the node",
        SETTLE,
        &fake,
        &mut [&mut ctl],
        || event_note(&fake, INSTANCE, "Replanned", &[&node, "gone"]),
    )
    .await;

    // A template change replaces the pod on the same plan.
    let plan_before = status_of(&fake).unwrap()["plan"].clone();
    fake.modify(Kind::ModelInstance, NS, INSTANCE, |m| {
        m["spec"]["template"]["spec"]["containers"][0]["image"] = json!("busybox:1.36");
    });
    wait_for(
        "the pod to be replaced",
        SETTLE,
        &fake,
        &mut [&mut ctl],
        || {
            let b = bound(&fake, &[], &["Bound"])?;
            let pod = fake.get(Kind::Pod, NS, POD).ok_or("no pod")?;
            let image = &pod["spec"]["containers"][0]["image"];
            if b.2 == third || *image != json!("busybox:1.36") {
                return Err(format!("image {image}"));
            }
            let status = status_of(&fake)?;
            if status["observedGeneration"] != json!(2) {
                return Err(format!(
                    "observedGeneration {}",
                    status["observedGeneration"]
                ));
            }
            Ok(())
        },
    )
    .await;
    assert_eq!(
        status_of(&fake).unwrap()["plan"],
        plan_before,
        "a template change moved the shard"
    );
    assert_eq!(bound(&fake, &[], &["Bound"]).unwrap().0, elsewhere);

    // Nothing can hold it: Pending with the reason, no pods, one event, quiet.
    add_named(&fake, "huge", |v| {
        v["spec"]["model"]["parametersBillions"] = json!(5000.0)
    });
    let message = wait_for(
        "huge to be unsatisfiable",
        SETTLE,
        &fake,
        &mut [&mut ctl],
        || {
            let mi = fake.get(Kind::ModelInstance, NS, "huge").ok_or("gone")?;
            let s = &mi["status"];
            let placed = s["conditions"]
                .as_array()
                .and_then(|c| c.iter().find(|c| c["type"] == json!("Placed")).cloned())
                .ok_or(format!("status {s}"))?;
            if s["phase"] != json!("Pending") || placed["reason"] != json!("Unsatisfiable") {
                return Err(format!("status {s}"));
            }
            // The status is written before the events are.
            event_note(&fake, "huge", "Unsatisfiable", &["GiB"])?;
            Ok(placed["message"].as_str().unwrap_or("").to_string())
        },
    )
    .await;
    assert!(message.contains("GiB"), "not actionable: {message}");
    let writes = fake.records().iter().filter(|r| r.is_write()).count();
    // A node heartbeat wakes it; the same cluster is not solved again.
    fake.modify(Kind::Node, "", "node-rtx", |n| {
        n["status"]["conditions"][0]["lastHeartbeatTime"] = json!("2025-01-01T00:05:00Z");
    });
    tokio::time::sleep(Duration::from_secs(2)).await;
    let later: Vec<Record> = fake
        .records()
        .into_iter()
        .filter(Record::is_write)
        .skip(writes)
        .collect();
    assert!(
        later.is_empty(),
        "an unsatisfiable instance is written to: {later:#?}"
    );
    assert!(
        fake.list(Kind::Pod)
            .iter()
            .all(|p| p["metadata"]["labels"]["tessera.dev/instance"] != json!("huge")),
        "an unsatisfiable instance got pods"
    );
    let warnings = fake
        .list(Kind::Event)
        .into_iter()
        .filter(|e| e["regarding"]["name"] == json!("huge"))
        .count();
    assert_eq!(warnings, 1, "one Unsatisfiable event");
    assert!(
        fake.unknown().is_empty(),
        "unrouted requests: {:#?}",
        fake.unknown()
    );
    assert_eq!(ctl.terminate(), Some(0), "SIGTERM\n{}", ctl.log_tail());
}

/// An overloaded API server (429 Too Many Requests, then 503 Service
/// Unavailable, on every request, with `Retry-After: 1`) is backed off, not
/// hammered: the client waits as the server asks (then longer, doubling),
/// and a reconcile that still fails retries 1 s doubling. Once the server
/// answers again, the instance that arrived meanwhile is placed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_overloaded_api_server_is_backed_off_and_the_work_resumes() {
    const OVERLOAD: Duration = Duration::from_secs(10);
    let fake = FakeApiServer::start().await;
    let scratch = Scratch::new("overload");
    add_nodes(&fake);
    let mut ctl = Controller::start(&fake, &scratch, "solo", &["--leader-elect=false"]);
    add_named(&fake, "warm-up", |_| {});
    wait_for(
        "the first instance to be bound",
        SETTLE,
        &fake,
        &mut [&mut ctl],
        || placements(&fake, &["warm-up"]),
    )
    .await;

    for code in [429, 503] {
        let name = format!("busy-{code}");
        let before = fake.records().len();
        fake.overload(Some(code));
        // Arrives by the open watch, which the overload does not close.
        add_named(&fake, &name, |_| {});
        tokio::time::sleep(OVERLOAD).await;
        fake.overload(None);
        let refused = fake
            .records()
            .iter()
            .skip(before)
            .filter(|r| r.status == code)
            .count();
        // About one a second per request in flight, as the server asks; a
        // retry without backoff would send hundreds.
        println!("{refused} requests answered {code} in {OVERLOAD:?}");
        assert!(
            (1..=25).contains(&refused),
            "{refused} requests answered {code} in {OVERLOAD:?}\n{}",
            context(&fake, &mut [&mut ctl])
        );
        assert!(ctl.exited().is_none(), "{}", ctl.log_tail());
        wait_for(
            &format!("{name} to be bound once the server answers again"),
            // The next retry is at most 16 s away.
            SETTLE + Duration::from_secs(16),
            &fake,
            &mut [&mut ctl],
            || {
                report_allocations(&fake);
                placements(&fake, &[name.as_str()])
            },
        )
        .await;
    }
    assert_eq!(ctl.terminate(), Some(0), "SIGTERM\n{}", ctl.log_tail());
}

/// After an API server restart every watch lists again. A device that failed
/// meanwhile arrives in the Node list, not as a watch event, and a list of a
/// large cluster takes seconds (here: one Node a page, a page a second). The
/// reconcile that fault wakes must read the re-listed Nodes, not the cache
/// from before: the shard moves off the failed device.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fault_that_arrives_in_a_slow_relist_moves_the_shard() {
    let fake = FakeApiServer::start().await;
    let scratch = Scratch::new("relist");
    add_nodes(&fake);
    // Listed after the GPU nodes, so the failed node is never on the last page.
    for name in ["zz-cpu-0", "zz-cpu-1"] {
        fake.create(
            Kind::Node,
            json!({"metadata": {"name": name, "labels": {"kubernetes.io/hostname": name}}, "spec": {}}),
        );
    }
    let mut ctl = Controller::start(&fake, &scratch, "solo", &["--leader-elect=false"]);
    add_instance(&fake);
    let (node, devices, first_uid) = first_bound(&fake, &mut ctl).await;
    println!("planned on {node} {devices:?}");

    fake.slow_pages(Some(1), Duration::from_secs(1));
    fake.expire_watches();
    let victim = devices[0].clone();
    fail_device(&fake, &node, &victim);
    let (new_node, new_devices, _) = moved_off(
        "the shard to move off the device that failed during the re-list",
        // Five pages of Nodes, a second each, before the cache has the fault.
        SETTLE + Duration::from_secs(5),
        &fake,
        &mut ctl,
        &victim,
        &first_uid,
        "Bound",
    )
    .await;
    println!("moved to {new_node} {new_devices:?}");
    let relists = fake
        .records()
        .iter()
        .filter(|r| r.query.contains("continue="))
        .count();
    assert!(
        relists >= 4,
        "the Nodes were listed in pages ({relists} continued)"
    );
    assert_eq!(ctl.terminate(), Some(0), "SIGTERM\n{}", ctl.log_tail());
}
