//! The node state publisher against a mocked API server (`tower_test`): the
//! exact request it sends, when it sends one and when it must not, and how it
//! retries. Real time with short intervals; every wait is bounded.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use http::{Method, Request, Response, StatusCode};
use kube::client::Body;
use serde_json::{Value, json};
use tessera::agent::publisher::{
    PublisherConfig, PublisherError, PublisherStats, WriteCause, run_publisher,
};
use tessera::agent::state::{DeviceView, ViewTx, channel};
use tessera::api::{LinkKind, NodeGpuState, Vendor};
use tessera::backend::{DeviceInfo, DeviceLink, DeviceState, RawHealth, Snapshot, Telemetry};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tokio::time::{Instant, timeout};
use tower_test::mock::{self, Handle, SendResponse};

const NODE: &str = "gpu-node-1";
const GIB: u64 = 1 << 30;
/// Longest wait for a request that must come.
const MUST_ARRIVE: Duration = Duration::from_secs(5);

type ApiHandle = Handle<Request<Body>, Response<Body>>;

fn device(id: &str, index: u32, temperature: f64, power: f64) -> DeviceState {
    DeviceState {
        info: DeviceInfo {
            id: id.into(),
            index,
            vendor: Vendor::Nvidia,
            product: "NVIDIA H100 80GB HBM3".into(),
            memory_total_bytes: 80 * GIB,
            architecture: "9.0".into(),
            compute_units: 132,
            fp16_tflops: 989.0,
            fp8_tflops: None,
            fp4_tflops: None,
            memory_bandwidth_gbps: 3350.0,
            pci_bus_id: format!("0000:{:02x}:00.0", 0x10 + index),
            numa_node: Some(0),
            mig: None,
        },
        telemetry: Telemetry {
            temperature_c: Some(temperature),
            power_w: Some(power),
            graphics_clock_mhz: Some(1410),
            memory_clock_mhz: Some(1593),
            utilization_percent: Some(0),
            memory_used_bytes: GIB / 2,
            memory_free_bytes: 80 * GIB - GIB / 2,
            ..Telemetry::default()
        },
        health: RawHealth::Healthy,
    }
}

fn ready_view() -> DeviceView {
    DeviceView {
        snapshot: Snapshot {
            backend: "fake".into(),
            devices: vec![
                device("GPU-0a", 0, 35.0, 115.0),
                device("GPU-1b", 1, 36.0, 116.5),
            ],
            links: vec![DeviceLink {
                a: "GPU-0a".into(),
                b: "GPU-1b".into(),
                kind: LinkKind::Nvlink,
                bandwidth_gbps: 900.0,
                p2p: true,
            }],
        },
        allocated: BTreeMap::new(),
        holdings: Vec::new(),
        shares: Default::default(),
        ready: true,
        error: None,
    }
}

/// What the annotation of `ready_view()` must say, timestamp aside.
fn expected_state() -> Value {
    json!({
        "version": "v1",
        "backend": "fake",
        "devices": [
            {
                "id": "GPU-0a", "index": 0, "vendor": "nvidia",
                "product": "NVIDIA H100 80GB HBM3",
                "memoryTotalBytes": 85_899_345_920u64, "memoryFreeBytes": 85_362_475_008u64,
                "fp16Tflops": 989.0, "memoryBandwidthGbps": 3350.0,
                "temperatureC": 35.0, "powerW": 115.0, "numaNode": 0, "health": "Healthy"
            },
            {
                "id": "GPU-1b", "index": 1, "vendor": "nvidia",
                "product": "NVIDIA H100 80GB HBM3",
                "memoryTotalBytes": 85_899_345_920u64, "memoryFreeBytes": 85_362_475_008u64,
                "fp16Tflops": 989.0, "memoryBandwidthGbps": 3350.0,
                "temperatureC": 36.0, "powerW": 116.5, "numaNode": 0, "health": "Healthy"
            }
        ],
        "links": [
            { "a": "GPU-0a", "b": "GPU-1b", "kind": "nvlink", "bandwidthGbps": 900.0 }
        ]
    })
}

fn config(min_interval: Duration) -> PublisherConfig {
    let mut c = PublisherConfig::new(NODE);
    c.min_interval = min_interval;
    c.retry_initial = Duration::from_millis(100);
    c.retry_max = Duration::from_millis(400);
    c
}

struct Harness {
    tx: ViewTx,
    api: ApiHandle,
    stats: Arc<PublisherStats>,
    stop: Option<oneshot::Sender<()>>,
    task: JoinHandle<Result<(), PublisherError>>,
}

fn start(config: PublisherConfig) -> Harness {
    let (service, api) = mock::pair::<Request<Body>, Response<Body>>();
    let client = kube::Client::new(service, "default");
    let (tx, rx) = channel("fake");
    let stats = Arc::new(PublisherStats::default());
    let (stop, stopped) = oneshot::channel::<()>();
    let task = tokio::spawn(run_publisher(client, config, rx, stats.clone(), stopped));
    Harness {
        tx,
        api,
        stats,
        stop: Some(stop),
        task,
    }
}

impl Harness {
    fn send(&self, view: DeviceView) {
        self.tx.send_replace(view);
    }

    fn modify(&self, f: impl FnOnce(&mut DeviceView)) {
        self.tx.send_modify(f);
    }

    /// The next request, which must be a merge patch of our Node.
    async fn next_patch(&mut self) -> (Value, SendResponse<Response<Body>>) {
        let (request, respond) = timeout(MUST_ARRIVE, self.api.next_request())
            .await
            .expect("no request reached the API server in time")
            .expect("the client went away");
        assert_eq!(request.method(), Method::PATCH);
        assert_eq!(request.uri().to_string(), format!("/api/v1/nodes/{NODE}?"));
        assert_eq!(
            request.headers().get(http::header::CONTENT_TYPE).unwrap(),
            "application/merge-patch+json"
        );
        let bytes = request.into_body().collect_bytes().await.unwrap();
        let body: Value = serde_json::from_slice(&bytes).unwrap();
        (body, respond)
    }

    async fn expect_silence(&mut self, window: Duration) {
        if let Ok(request) = timeout(window, self.api.next_request()).await {
            let what = request.map(|(r, _)| format!("{} {}", r.method(), r.uri()));
            panic!("expected no request for {window:?}, got {what:?}");
        }
    }

    /// Waits (bounded) until the success counter reaches `n`.
    async fn published(&self, n: u64) {
        let deadline = Instant::now() + MUST_ARRIVE;
        while self.stats.published() < n {
            assert!(
                Instant::now() < deadline,
                "published stayed at {} (want {n})",
                self.stats.published()
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    async fn publish_first(&mut self) -> Value {
        self.send(ready_view());
        let (body, respond) = self.next_patch().await;
        respond.send_response(node_ok());
        self.published(1).await;
        body
    }

    async fn shutdown(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        let result = timeout(MUST_ARRIVE, self.task)
            .await
            .expect("the publisher did not stop")
            .expect("the publisher panicked");
        assert_eq!(result, Ok(()));
    }
}

fn node_ok() -> Response<Body> {
    let node = json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE}});
    Response::builder()
        .status(StatusCode::OK)
        .header(http::header::CONTENT_TYPE, "application/json")
        .body(Body::from(serde_json::to_vec(&node).unwrap()))
        .unwrap()
}

fn server_error() -> Response<Body> {
    let status = json!({
        "kind": "Status", "apiVersion": "v1", "metadata": {},
        "status": "Failure", "message": "etcdserver: request timed out",
        "reason": "InternalError", "code": 500
    });
    Response::builder()
        .status(StatusCode::INTERNAL_SERVER_ERROR)
        .header(http::header::CONTENT_TYPE, "application/json")
        .body(Body::from(serde_json::to_vec(&status).unwrap()))
        .unwrap()
}

/// The annotation of a patch body, parsed.
fn state_in(body: &Value) -> NodeGpuState {
    let text = body["metadata"]["annotations"]["tessera.dev/gpu-state"]
        .as_str()
        .expect("the patch carries the gpu-state annotation as a string");
    NodeGpuState::from_json(text).unwrap()
}

/// The annotation of a patch body as JSON, its timestamp taken out.
fn state_without_timestamp(body: &Value) -> Value {
    let text = body["metadata"]["annotations"]["tessera.dev/gpu-state"]
        .as_str()
        .expect("the patch carries the gpu-state annotation as a string");
    let mut state: Value = serde_json::from_str(text).unwrap();
    if let Some(map) = state.as_object_mut() {
        map.remove("timestamp");
    }
    state
}

#[tokio::test]
async fn the_first_ready_view_is_published_as_an_exact_merge_patch() {
    let mut h = start(config(Duration::from_secs(30)));
    // Not ready yet: nothing is written.
    h.expect_silence(Duration::from_millis(300)).await;

    let before = k8s_openapi::jiff::Timestamp::now();
    h.send(ready_view());
    let (mut body, respond) = h.next_patch().await;
    respond.send_response(node_ok());
    h.published(1).await;
    assert_eq!(h.stats.errors(), 0);

    // The annotation: exactly the expected state plus a fresh RFC 3339 timestamp.
    let annotation = body["metadata"]["annotations"]["tessera.dev/gpu-state"]
        .take()
        .as_str()
        .unwrap()
        .to_string();
    let mut state: Value = serde_json::from_str(&annotation).unwrap();
    let stamp = state
        .as_object_mut()
        .unwrap()
        .remove("timestamp")
        .expect("the state has a timestamp");
    let stamp: k8s_openapi::jiff::Timestamp = stamp.as_str().unwrap().parse().unwrap();
    let after = k8s_openapi::jiff::Timestamp::now();
    assert!(
        before <= stamp && stamp <= after,
        "{stamp} not in [{before}, {after}]"
    );
    assert_eq!(state, expected_state());
    NodeGpuState::from_json(&annotation).unwrap();

    // The rest of the body: our keys and nothing else.
    assert_eq!(
        body,
        json!({
            "metadata": {
                "annotations": { "tessera.dev/gpu-state": null },
                "labels": {
                    "tessera.dev/gpu.count": "2",
                    "tessera.dev/gpu.vendor": "nvidia",
                    "tessera.dev/gpu.product": "NVIDIA-H100-80GB-HBM3",
                    "tessera.dev/gpu.memory-gib": "80"
                }
            }
        })
    );

    // Nothing changed since: nothing more is sent.
    h.expect_silence(Duration::from_millis(500)).await;
    h.shutdown().await;
}

#[tokio::test]
async fn changes_that_are_not_published_send_nothing() {
    let interval = Duration::from_millis(200);
    let mut h = start(config(interval));
    h.publish_first().await;

    // The same view again, then only fields the state does not carry, and free
    // memory by less than the 1 GiB threshold.
    h.send(ready_view());
    h.modify(|v| {
        v.error = Some("NVML: driver busy".into());
        for d in &mut v.snapshot.devices {
            d.telemetry.utilization_percent = Some(97);
            d.telemetry.graphics_clock_mhz = Some(1980);
            d.telemetry.memory_used_bytes += 10 * GIB;
        }
        v.snapshot.devices[0].telemetry.memory_free_bytes -= GIB - 1;
    });
    // Several drift intervals pass without a request.
    h.expect_silence(interval * 4).await;
    assert_eq!(h.stats.published(), 1);
    h.shutdown().await;
}

#[tokio::test]
async fn telemetry_drift_waits_for_the_interval() {
    let interval = Duration::from_millis(400);
    let mut h = start(config(interval));
    h.send(ready_view());
    let (_, respond) = h.next_patch().await;
    // The publisher takes its publish time after this response, so the next
    // drift patch cannot arrive before `answered + interval`.
    let answered = Instant::now();
    respond.send_response(node_ok());
    h.published(1).await;

    for step in 1..=5 {
        h.modify(|v| {
            v.snapshot.devices[0].telemetry.temperature_c = Some(35.0 + f64::from(step));
            v.snapshot.devices[1].telemetry.power_w = Some(116.5 + f64::from(step) * 10.0);
        });
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let (body, respond) = h.next_patch().await;
    let waited = answered.elapsed();
    let answered = Instant::now();
    respond.send_response(node_ok());
    assert!(
        waited >= interval,
        "a telemetry-only patch came {waited:?} after the last one (min interval {interval:?})"
    );
    // One patch for the whole burst, carrying the latest readings.
    let state = state_in(&body);
    assert_eq!(state.devices[0].temperature_c, Some(40.0));
    assert_eq!(state.devices[1].power_w, Some(166.5));
    h.published(2).await;

    // Free memory beyond the threshold is drift too.
    h.modify(|v| v.snapshot.devices[1].telemetry.memory_free_bytes -= 4 * GIB);
    let (body, respond) = h.next_patch().await;
    assert!(answered.elapsed() >= interval);
    respond.send_response(node_ok());
    assert_eq!(
        state_in(&body).devices[1].memory_free_bytes,
        80 * GIB - GIB / 2 - 4 * GIB
    );
    h.published(3).await;

    h.expect_silence(interval + Duration::from_millis(300))
        .await;
    assert_eq!(h.stats.sent(WriteCause::First), 1);
    assert_eq!(h.stats.sent(WriteCause::Drift), 2);
    assert_eq!(h.stats.sent(WriteCause::Change), 0);
    let gap = h.stats.shortest_drift_gap();
    assert!(
        gap.is_some_and(|gap| gap >= interval),
        "shortest drift gap as sent: {gap:?}"
    );
    h.shutdown().await;
}

#[tokio::test]
async fn a_health_change_is_published_at_once() {
    // A drift interval far longer than the test: only an immediate patch can arrive.
    let mut h = start(config(Duration::from_secs(60)));
    h.publish_first().await;

    h.modify(|v| v.snapshot.devices[1].telemetry.temperature_c = Some(61.0));
    h.expect_silence(Duration::from_millis(300)).await;
    h.modify(|v| {
        v.snapshot.devices[1].health =
            RawHealth::Unhealthy("Xid 79: GPU has fallen off the bus".into())
    });
    let (body, respond) = h.next_patch().await;
    respond.send_response(node_ok());
    let state = state_in(&body);
    assert_eq!(state.devices[1].health, tessera::api::Health::Unhealthy);
    assert_eq!(
        state.devices[1].health_reason.as_deref(),
        Some("Xid 79: GPU has fallen off the bus")
    );
    // The pending drift went out with it.
    assert_eq!(state.devices[1].temperature_c, Some(61.0));
    assert_eq!(body["metadata"]["labels"]["tessera.dev/gpu.count"], "2");
    h.published(2).await;

    // A changed reason (thermal trouble shows up here) is immediate as well.
    h.modify(|v| v.snapshot.devices[1].health = RawHealth::Unhealthy("too hot: 95 °C".into()));
    let (body, respond) = h.next_patch().await;
    respond.send_response(node_ok());
    assert_eq!(
        state_in(&body).devices[1].health_reason.as_deref(),
        Some("too hot: 95 °C")
    );
    h.published(3).await;
    h.expect_silence(Duration::from_millis(300)).await;
    h.shutdown().await;
}

#[tokio::test]
async fn an_allocation_change_is_published_at_once() {
    let mut h = start(config(Duration::from_secs(60)));
    h.publish_first().await;

    h.modify(|v| {
        v.allocated.insert("GPU-0a".into(), "pod-uid-1".into());
        v.allocated.insert("GPU-1b".into(), "unbound".into());
    });
    let (body, respond) = h.next_patch().await;
    respond.send_response(node_ok());
    let mut want = expected_state();
    want["allocated"] = json!({ "GPU-0a": "pod-uid-1", "GPU-1b": "unbound" });
    assert_eq!(state_without_timestamp(&body), want);
    h.published(2).await;

    // The pod ended: its device leaves the published set.
    h.modify(|v| {
        v.allocated.remove("GPU-0a");
    });
    let (body, respond) = h.next_patch().await;
    respond.send_response(node_ok());
    want["allocated"] = json!({ "GPU-1b": "unbound" });
    assert_eq!(state_without_timestamp(&body), want);
    h.published(3).await;

    // Nothing allocated: the field is left out, as before anything was.
    h.modify(|v| v.allocated.clear());
    let (body, respond) = h.next_patch().await;
    respond.send_response(node_ok());
    assert_eq!(state_without_timestamp(&body), expected_state());
    h.published(4).await;
    h.expect_silence(Duration::from_millis(300)).await;
    h.shutdown().await;
}

#[tokio::test]
async fn all_devices_gone_publishes_an_empty_list_and_count_zero() {
    let mut h = start(config(Duration::from_secs(60)));
    h.publish_first().await;

    h.modify(|v| {
        v.snapshot.devices.clear();
        v.snapshot.links.clear();
    });
    let (body, respond) = h.next_patch().await;
    respond.send_response(node_ok());
    assert!(state_in(&body).devices.is_empty());
    // Only the count: the other labels stay as they were.
    assert_eq!(
        body["metadata"]["labels"],
        json!({ "tessera.dev/gpu.count": "0" })
    );
    h.published(2).await;
    h.shutdown().await;
}

#[tokio::test]
async fn a_failed_patch_is_counted_and_retried_with_backoff_carrying_the_newest_view() {
    let mut h = start(config(Duration::from_secs(60)));
    h.send(ready_view());
    let (_, respond) = h.next_patch().await;
    // A newer view arrives while the first patch is still on its way.
    h.modify(|v| v.snapshot.devices[0].health = RawHealth::Unhealthy("Xid 48".into()));
    let failed = Instant::now();
    respond.send_response(server_error());

    // First retry after the initial backoff (100 ms), with the newest view.
    let (body, respond) = h.next_patch().await;
    let waited = failed.elapsed();
    assert!(
        waited >= Duration::from_millis(100),
        "retried after {waited:?}"
    );
    assert_eq!(h.stats.errors(), 1);
    assert_eq!(h.stats.published(), 0);
    assert_eq!(
        state_in(&body).devices[0].health_reason.as_deref(),
        Some("Xid 48")
    );
    // This time the connection fails outright.
    let failed = Instant::now();
    respond.send_error(std::io::Error::new(
        std::io::ErrorKind::ConnectionRefused,
        "connection refused",
    ));

    // The backoff doubled.
    let (_, respond) = h.next_patch().await;
    let waited = failed.elapsed();
    assert!(
        waited >= Duration::from_millis(200),
        "retried after {waited:?}"
    );
    assert_eq!(h.stats.errors(), 2);
    respond.send_response(node_ok());
    h.published(1).await;
    assert_eq!(h.stats.errors(), 2);

    // Success resets the backoff: the next failure waits the initial 100 ms again.
    h.modify(|v| {
        v.allocated.insert("GPU-1b".into(), "pod-uid-2".into());
    });
    let (_, respond) = h.next_patch().await;
    let failed = Instant::now();
    respond.send_response(server_error());
    let (_, respond) = h.next_patch().await;
    let waited = failed.elapsed();
    assert!(
        waited >= Duration::from_millis(100) && waited < Duration::from_millis(2000),
        "retried after {waited:?}"
    );
    respond.send_response(node_ok());
    h.published(2).await;
    assert_eq!(h.stats.errors(), 3);
    h.expect_silence(Duration::from_millis(300)).await;
    let sent = WriteCause::ALL.map(|cause| h.stats.sent(cause));
    // first (failed), retry (failed), retry; the allocation (failed), retry.
    assert_eq!(sent, [1, 1, 0, 3], "first, change, drift, retry");
    assert_eq!(h.stats.shortest_drift_gap(), None);
    h.shutdown().await;
}

#[tokio::test]
async fn an_unanswered_patch_times_out_and_is_retried() {
    let mut c = config(Duration::from_secs(60));
    c.request_timeout = Duration::from_millis(300);
    let mut h = start(c);
    h.send(ready_view());
    let sent = Instant::now();
    // Held, never answered: the API server hangs.
    let (_, _hanging) = h.next_patch().await;
    // Views keep coming meanwhile; the retry carries the newest.
    h.modify(|v| v.snapshot.devices[1].health = RawHealth::Unhealthy("Xid 94".into()));
    let (body, respond) = h.next_patch().await;
    let waited = sent.elapsed();
    // The timeout, then the first backoff step.
    assert!(
        waited >= Duration::from_millis(400),
        "retried after {waited:?}"
    );
    assert_eq!(h.stats.errors(), 1);
    assert_eq!(
        state_in(&body).devices[1].health_reason.as_deref(),
        Some("Xid 94")
    );
    respond.send_response(node_ok());
    h.published(1).await;
    h.expect_silence(Duration::from_millis(300)).await;
    h.shutdown().await;
}

#[tokio::test]
async fn shutdown_stops_the_publisher_before_and_during_a_patch() {
    // Before the first ready view.
    let h = start(config(Duration::from_secs(60)));
    h.shutdown().await;

    // With a patch in flight that the API server never answers.
    let mut h = start(config(Duration::from_secs(60)));
    h.send(ready_view());
    let (_body, _respond) = h.next_patch().await;
    h.shutdown().await;
}

#[tokio::test]
async fn a_closed_view_ends_the_publisher_with_an_error() {
    let Harness {
        tx,
        api: _api,
        stop: _stop,
        task,
        ..
    } = start(config(Duration::from_secs(60)));
    drop(tx);
    let result = timeout(MUST_ARRIVE, task).await.unwrap().unwrap();
    assert_eq!(result, Err(PublisherError::ViewClosed));
}
