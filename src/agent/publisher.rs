//! The node state publisher: keeps the Node's `tessera.dev/gpu-state`
//! annotation and `tessera.dev/gpu.*` labels in step with the agent's device
//! view, so the controller plans against what the node has right now.
//!
//! When to write is decided by `needs_publish` (pure, no I/O):
//!
//! - **at once** when something the controller must react to changed: the set
//!   of devices or anything static about them, a device's health or its reason
//!   (thermal trouble shows up there through the health tracker), the links, or
//!   the allocated set (the state's `allocated` map: which device is held by
//!   which pod, so the controller never plans onto a device in use);
//! - **at most once per `min_interval`** (five minutes by default) when only
//!   telemetry drifted: temperature, power, or free memory by at least
//!   `free_memory_threshold_bytes`. Each node waits a little longer, by a
//!   share of the interval fixed by its name (`drift_after`), so agents that
//!   started together do not write in step. Every Node write goes to every
//!   Node watcher in the cluster, so drift is what a large fleet must not
//!   pay for often: the fleet benchmark measured it (docs/benchmarks.md);
//! - **not at all** when nothing that is published changed.
//!
//! The write is a JSON merge patch of the Node's metadata that names only our
//! own keys (`patch_body`), so other annotations and labels on the Node are
//! never touched, and a hand-edited (even malformed) value of our annotation is
//! simply replaced. A failed write is logged, counted and retried with a
//! doubling backoff; the retry always carries the newest view, so views keep
//! flowing while the API server is unreachable.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use k8s_openapi::api::core::v1::Node;
use kube::api::{Api, Patch, PatchParams};
use serde_json::{Map, Value, json};
use tokio::time::Instant;

use super::state::{DeviceView, ViewRx};
use crate::api::{
    GPU_STATE_ANNOTATION, GpuDevice, LABEL_GPU_COUNT, LABEL_GPU_MEMORY_GIB, LABEL_GPU_PRODUCT,
    LABEL_GPU_VENDOR, NodeGpuState,
};

/// Longest label value Kubernetes accepts.
const LABEL_VALUE_MAX: usize = 63;

/// How and where the publisher writes.
#[derive(Clone, Debug, PartialEq)]
pub struct PublisherConfig {
    /// The Node to patch (the agent's own node, usually from `NODE_NAME`).
    pub(crate) node_name: String,
    /// Telemetry-only changes are published at most this often.
    pub min_interval: Duration,
    /// Free-memory changes smaller than this (per device, against the last
    /// published value) are not drift.
    pub free_memory_threshold_bytes: u64,
    /// First wait after a failed patch; doubles on every further failure.
    pub retry_initial: Duration,
    /// Longest wait between retries.
    pub retry_max: Duration,
    /// A patch not answered within this time counts as failed (and is retried).
    pub request_timeout: Duration,
}

impl PublisherConfig {
    pub(crate) const DEFAULT_MIN_INTERVAL: Duration = Duration::from_secs(300);
    pub(crate) const DEFAULT_FREE_MEMORY_THRESHOLD_BYTES: u64 = 1 << 30;
    pub(crate) const DEFAULT_RETRY_INITIAL: Duration = Duration::from_secs(1);
    pub(crate) const DEFAULT_RETRY_MAX: Duration = Duration::from_secs(30);
    pub(crate) const DEFAULT_REQUEST_TIMEOUT: Duration = Duration::from_secs(30);

    /// The defaults: drift every 5 min at most, 1 GiB free-memory threshold,
    /// retries from 1 s doubling to 30 s, 30 s for the API server to answer.
    pub fn new(node_name: impl Into<String>) -> Self {
        Self {
            node_name: node_name.into(),
            min_interval: Self::DEFAULT_MIN_INTERVAL,
            free_memory_threshold_bytes: Self::DEFAULT_FREE_MEMORY_THRESHOLD_BYTES,
            retry_initial: Self::DEFAULT_RETRY_INITIAL,
            retry_max: Self::DEFAULT_RETRY_MAX,
            request_timeout: Self::DEFAULT_REQUEST_TIMEOUT,
        }
    }

    /// How long after the last write drift is published: `min_interval`
    /// plus up to a tenth of it, the same for a node every time and spread
    /// evenly over a fleet. `None` when that is too long to represent.
    pub(crate) fn drift_after(&self) -> Option<Duration> {
        let extra = self.min_interval.as_secs_f64() * DRIFT_SPREAD * node_share(&self.node_name);
        let extra = Duration::try_from_secs_f64(extra).ok()?;
        self.min_interval.checked_add(extra)
    }
}

/// Share of `min_interval` by which nodes spread their drift publishes.
const DRIFT_SPREAD: f64 = 0.1;

/// A node name's place in 0..1: FNV-1a, fixed on every platform and
/// release, then mixed (splitmix64's finaliser) so that names differing only
/// in their last characters land far apart.
fn node_share(name: &str) -> f64 {
    let hash = name.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |hash, byte| {
        (hash ^ u64::from(byte)).wrapping_mul(0x0000_0100_0000_01b3)
    });
    let mut mixed = (hash ^ (hash >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    mixed = (mixed ^ (mixed >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    (mixed ^ (mixed >> 31)) as f64 / u64::MAX as f64
}

/// Why a patch was sent.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WriteCause {
    /// The first view since the agent started.
    First,
    /// Something the controller must react to changed.
    Change,
    /// Only telemetry drifted, and the node's interval was over.
    Drift,
    /// The previous patch failed (it may still have been written).
    Retry,
}

impl WriteCause {
    pub const ALL: [WriteCause; 4] = [Self::First, Self::Change, Self::Drift, Self::Retry];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::First => "first",
            Self::Change => "change",
            Self::Drift => "drift",
            Self::Retry => "retry",
        }
    }
}

/// Counters for the agent's metrics. Shared: the publisher only adds.
#[derive(Debug)]
pub struct PublisherStats {
    /// Patches the API server accepted.
    pub(crate) published: AtomicU64,
    /// Patches that failed (each retry that fails counts again).
    pub(crate) errors: AtomicU64,
    /// Patches sent, by `WriteCause` (in `WriteCause::ALL` order).
    sent: [AtomicU64; 4],
    /// Shortest time from a patch sent to the drift patch sent next, in ms;
    /// `u64::MAX` until a drift patch is sent.
    shortest_drift_gap_ms: AtomicU64,
}

impl Default for PublisherStats {
    fn default() -> Self {
        Self {
            published: AtomicU64::default(),
            errors: AtomicU64::default(),
            sent: Default::default(),
            shortest_drift_gap_ms: AtomicU64::new(u64::MAX),
        }
    }
}

impl PublisherStats {
    pub fn published(&self) -> u64 {
        self.published.load(Ordering::Relaxed)
    }

    pub fn errors(&self) -> u64 {
        self.errors.load(Ordering::Relaxed)
    }

    /// Patches sent for `cause`, answered or not.
    pub fn sent(&self, cause: WriteCause) -> u64 {
        self.sent[cause as usize].load(Ordering::Relaxed)
    }

    /// The shortest time a drift patch followed the patch before it, as the
    /// agent sent them: what the drift interval holds to on the wire.
    pub fn shortest_drift_gap(&self) -> Option<Duration> {
        match self.shortest_drift_gap_ms.load(Ordering::Relaxed) {
            u64::MAX => None,
            ms => Some(Duration::from_millis(ms)),
        }
    }

    pub(crate) fn count_sent(&self, cause: WriteCause, since_previous: Option<Duration>) {
        self.sent[cause as usize].fetch_add(1, Ordering::Relaxed);
        if cause == WriteCause::Drift
            && let Some(gap) = since_previous
        {
            let ms = u64::try_from(gap.as_millis()).unwrap_or(u64::MAX - 1);
            self.shortest_drift_gap_ms.fetch_min(ms, Ordering::Relaxed);
        }
    }
}

/// Why the publisher stopped other than being asked to.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum PublisherError {
    #[error("the node name is empty; the publisher needs the name of the Node to patch")]
    NoNodeName,
    #[error("the device view closed (its poller stopped) while the publisher was running")]
    ViewClosed,
}

/// The view last accepted by the API server, and when it was accepted.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Published {
    pub(crate) view: DeviceView,
    pub(crate) at: Instant,
}

/// What [`needs_publish`] says to do about the current view.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Decision {
    /// Something the controller must see changed, or drift is due: write now.
    Now,
    /// Only telemetry drifted; write at this time unless something else comes first.
    At(Instant),
    /// Nothing that is published changed.
    Nothing,
}

/// Decides whether `view` must be published, given what was published last.
pub(crate) fn needs_publish(
    last: &Published,
    view: &DeviceView,
    now: Instant,
    config: &PublisherConfig,
) -> Decision {
    if changed_at_once(&last.view, view) {
        return Decision::Now;
    }
    if !drifted(&last.view, view, config.free_memory_threshold_bytes) {
        return Decision::Nothing;
    }
    match config
        .drift_after()
        .and_then(|after| last.at.checked_add(after))
    {
        Some(due) if due <= now => Decision::Now,
        Some(due) => Decision::At(due),
        // An interval too long to represent: drift alone is never published.
        None => Decision::Nothing,
    }
}

/// Changes that are published at once: anything but telemetry.
fn changed_at_once(old: &DeviceView, new: &DeviceView) -> bool {
    let (a, b) = (&old.snapshot, &new.snapshot);
    a.backend != b.backend
        || a.links != b.links
        || old.allocated != new.allocated
        || a.devices.len() != b.devices.len()
        || a.devices
            .iter()
            .zip(&b.devices)
            .any(|(x, y)| x.info != y.info || x.health != y.health)
}

/// Telemetry changes that are published, rate-limited. Assumes the device
/// lists match (otherwise [`changed_at_once`] already said so).
fn drifted(old: &DeviceView, new: &DeviceView, free_memory_threshold: u64) -> bool {
    old.snapshot
        .devices
        .iter()
        .zip(&new.snapshot.devices)
        .any(|(x, y)| {
            let (x, y) = (&x.telemetry, &y.telemetry);
            let free_delta = x.memory_free_bytes.abs_diff(y.memory_free_bytes);
            !same_reading(x.temperature_c, y.temperature_c)
                || !same_reading(x.power_w, y.power_w)
                || (free_delta > 0 && free_delta >= free_memory_threshold)
        })
}

fn same_reading(a: Option<f64>, b: Option<f64>) -> bool {
    match (a, b) {
        (Some(a), Some(b)) => a == b || (a.is_nan() && b.is_nan()),
        (None, None) => true,
        _ => false,
    }
}

/// The merge patch for the Node: our annotation and our labels, nothing else.
///
/// With no devices only the count (`0`) is written; the vendor, product and
/// memory labels keep their last values.
pub(crate) fn patch_body(state: &NodeGpuState) -> Value {
    let mut labels = Map::new();
    labels.insert(
        LABEL_GPU_COUNT.to_string(),
        Value::String(state.devices.len().to_string()),
    );
    if let Some(vendor) = vendor_label(&state.devices) {
        labels.insert(LABEL_GPU_VENDOR.to_string(), Value::String(vendor));
    }
    if let Some((product, memory_gib)) = common_product(&state.devices) {
        labels.insert(
            LABEL_GPU_PRODUCT.to_string(),
            Value::String(label_value(product)),
        );
        labels.insert(
            LABEL_GPU_MEMORY_GIB.to_string(),
            Value::String(memory_gib.to_string()),
        );
    }
    let mut annotations = Map::new();
    annotations.insert(
        GPU_STATE_ANNOTATION.to_string(),
        Value::String(state.to_json()),
    );
    json!({ "metadata": { "annotations": annotations, "labels": labels } })
}

/// `nvidia`, `amd` (or `unknown`) when all devices agree, `mixed` otherwise.
fn vendor_label(devices: &[GpuDevice]) -> Option<String> {
    let first = devices.first()?.vendor;
    if devices.iter().all(|d| d.vendor == first) {
        Some(first.as_str().to_string())
    } else {
        Some("mixed".to_string())
    }
}

/// The product most devices have (ties go to the one seen first) and the
/// smallest total memory among its devices, in whole GiB.
fn common_product(devices: &[GpuDevice]) -> Option<(&str, u64)> {
    // (product, count, smallest total memory), in order of first appearance.
    let mut seen: Vec<(&str, usize, u64)> = Vec::new();
    for device in devices {
        match seen
            .iter_mut()
            .find(|(product, _, _)| *product == device.product)
        {
            Some(entry) => {
                entry.1 += 1;
                entry.2 = entry.2.min(device.memory_total_bytes);
            }
            None => seen.push((&device.product, 1, device.memory_total_bytes)),
        }
    }
    let mut best: Option<(&str, usize, u64)> = None;
    for entry in seen {
        if best.is_none_or(|b| entry.1 > b.1) {
            best = Some(entry);
        }
    }
    best.map(|(product, _, bytes)| (product, bytes >> 30))
}

/// A label-safe form of a free-text name: every run of characters outside
/// `[A-Za-z0-9._-]` becomes one `-`, at most 63 characters, starting and ending
/// alphanumeric; `unknown` if nothing usable is left.
pub(crate) fn label_value(text: &str) -> String {
    let mut out = String::with_capacity(text.len().min(LABEL_VALUE_MAX));
    let mut replaced = false;
    for character in text.chars() {
        if character.is_ascii_alphanumeric() || matches!(character, '.' | '_' | '-') {
            out.push(character);
            replaced = false;
        } else if !replaced {
            out.push('-');
            replaced = true;
        }
    }
    // Only ASCII is left, so byte positions are character positions.
    out.truncate(LABEL_VALUE_MAX);
    let trimmed = out.trim_matches(|c: char| !c.is_ascii_alphanumeric());
    if trimmed.is_empty() {
        "unknown".to_string()
    } else {
        trimmed.to_string()
    }
}

/// The state as it is published now: the view's snapshot and allocated set,
/// stamped with the current time (RFC 3339).
pub(crate) fn state_of(view: &DeviceView) -> NodeGpuState {
    let timestamp = k8s_openapi::jiff::Timestamp::now().to_string();
    let mut state = view.snapshot.to_gpu_state(Some(timestamp));
    state.allocated = view.allocated.clone();
    state
}

/// Why one patch failed.
#[derive(Debug, thiserror::Error)]
enum PatchError {
    #[error(transparent)]
    Api(#[from] kube::Error),
    #[error("the API server did not answer within {0:?}")]
    Timeout(Duration),
}

type PatchFuture = Pin<Box<dyn Future<Output = (DeviceView, Result<(), PatchError>)> + Send>>;

/// Publishes the node's GPU state on the Node `config.node_name` until
/// `shutdown` completes (then `Ok`).
///
/// Waits for the first ready view, publishes it, then publishes changes as
/// `needs_publish` decides. Successes and failures are counted in `stats`;
/// a failed patch is retried with backoff and never ends the publisher. It
/// ends with an error only if the node name is empty or the view's sender goes
/// away (the poller is gone, so there is nothing left to publish).
pub async fn run_publisher<S: Future>(
    client: kube::Client,
    config: PublisherConfig,
    mut view: ViewRx,
    stats: Arc<PublisherStats>,
    shutdown: S,
) -> Result<(), PublisherError> {
    if config.node_name.trim().is_empty() {
        return Err(PublisherError::NoNodeName);
    }
    let nodes: Api<Node> = Api::all(client);
    tokio::pin!(shutdown);

    tokio::select! {
        biased;
        _ = &mut shutdown => return Ok(()),
        ready = async { view.wait_for(|v| v.ready).await.map(|_| ()) } => {
            if ready.is_err() {
                return Err(PublisherError::ViewClosed);
            }
        }
    }

    let mut last: Option<Published> = None;
    let mut in_flight: Option<PatchFuture> = None;
    let mut retry_at: Option<Instant> = None;
    let first_backoff = config.retry_initial.min(config.retry_max);
    let mut backoff = first_backoff;
    let mut failures: u32 = 0;
    let mut last_sent: Option<Instant> = None;

    loop {
        let mut wake = None;
        // While a patch is on its way, newer views only wake the loop
        // (`changed()` marks them seen); the newest is looked at once it is answered.
        if in_flight.is_none() {
            let current = view.borrow_and_update().clone();
            let now = Instant::now();
            let decision = match &last {
                None => Decision::Now,
                Some(last) => needs_publish(last, &current, now, &config),
            };
            let due = match decision {
                Decision::Now => Some(now),
                Decision::At(t) => Some(t),
                Decision::Nothing => None,
            };
            // After a failure nothing is written before the backoff is over.
            let due = due.map(|d| retry_at.map_or(d, |r| d.max(r)));
            match due {
                Some(due) if due <= now => {
                    let cause = match &last {
                        _ if failures > 0 => WriteCause::Retry,
                        None => WriteCause::First,
                        Some(last) if changed_at_once(&last.view, &current) => WriteCause::Change,
                        Some(_) => WriteCause::Drift,
                    };
                    stats.count_sent(cause, last_sent.map(|at| now.saturating_duration_since(at)));
                    last_sent = Some(now);
                    in_flight = Some(start_patch(nodes.clone(), &config, current));
                }
                other => wake = other,
            }
        }

        tokio::select! {
            biased;
            _ = &mut shutdown => return Ok(()),
            (sent, result) = poll_some(in_flight.as_mut()) => {
                in_flight = None;
                match result {
                    Ok(()) => {
                        stats.published.fetch_add(1, Ordering::Relaxed);
                        if last.is_none() || failures > 0 {
                            tracing::info!(
                                node = %config.node_name,
                                devices = sent.snapshot.devices.len(),
                                "published the node's GPU state"
                            );
                        } else {
                            tracing::debug!(
                                node = %config.node_name,
                                devices = sent.snapshot.devices.len(),
                                "published the node's GPU state"
                            );
                        }
                        last = Some(Published { view: sent, at: Instant::now() });
                        retry_at = None;
                        backoff = first_backoff;
                        failures = 0;
                    }
                    Err(e) => {
                        stats.errors.fetch_add(1, Ordering::Relaxed);
                        failures = failures.saturating_add(1);
                        tracing::warn!(
                            node = %config.node_name,
                            error = %e,
                            failures,
                            retry_in_ms = u64::try_from(backoff.as_millis()).unwrap_or(u64::MAX),
                            "publishing the node's GPU state failed; will retry"
                        );
                        retry_at = Instant::now().checked_add(backoff);
                        backoff = backoff.saturating_mul(2).min(config.retry_max);
                    }
                }
            }
            _ = sleep_until_some(wake) => {}
            changed = view.changed() => {
                if changed.is_err() {
                    return Err(PublisherError::ViewClosed);
                }
            }
        }
    }
}

fn start_patch(nodes: Api<Node>, config: &PublisherConfig, view: DeviceView) -> PatchFuture {
    let name = config.node_name.clone();
    let limit = config.request_timeout;
    Box::pin(async move {
        let body = patch_body(&state_of(&view));
        let (params, patch) = (PatchParams::default(), Patch::Merge(&body));
        let patch = nodes.patch(&name, &params, &patch);
        let result = match tokio::time::timeout(limit, patch).await {
            Ok(Ok(_)) => Ok(()),
            Ok(Err(e)) => Err(PatchError::Api(e)),
            Err(_) => Err(PatchError::Timeout(limit)),
        };
        (view, result)
    })
}

async fn poll_some<F: Future + Unpin>(f: Option<&mut F>) -> F::Output {
    match f {
        Some(f) => f.await,
        None => std::future::pending().await,
    }
}

async fn sleep_until_some(deadline: Option<Instant>) {
    match deadline {
        Some(t) => tokio::time::sleep_until(t).await,
        None => std::future::pending().await,
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;
    use crate::api::{GPU_STATE_VERSION, Health, Vendor};
    use crate::backend::{DeviceInfo, DeviceState, RawHealth, Snapshot, Telemetry};

    const GIB: u64 = 1 << 30;

    fn device(id: &str, index: u32, vendor: Vendor, product: &str, gib: u64) -> DeviceState {
        DeviceState {
            info: DeviceInfo {
                id: id.into(),
                index,
                vendor,
                product: product.into(),
                memory_total_bytes: gib * GIB,
                architecture: "9.0".into(),
                compute_units: 132,
                fp16_tflops: 989.0,
                memory_bandwidth_gbps: 3350.0,
                pci_bus_id: format!("0000:{:02x}:00.0", 0x10 + index),
                numa_node: Some(0),
            },
            telemetry: Telemetry {
                temperature_c: Some(40.0),
                power_w: Some(100.0),
                graphics_clock_mhz: Some(1410),
                memory_clock_mhz: Some(1593),
                utilization_percent: Some(0),
                memory_used_bytes: GIB,
                memory_free_bytes: (gib - 1) * GIB,
            },
            health: RawHealth::Healthy,
        }
    }

    fn view() -> DeviceView {
        DeviceView {
            snapshot: Snapshot {
                backend: "fake".into(),
                devices: vec![
                    device("GPU-a", 0, Vendor::Nvidia, "NVIDIA H100 80GB HBM3", 80),
                    device("GPU-b", 1, Vendor::Nvidia, "NVIDIA H100 80GB HBM3", 80),
                ],
                links: vec![],
            },
            allocated: BTreeMap::new(),
            ready: true,
            error: None,
        }
    }

    fn config() -> PublisherConfig {
        PublisherConfig::new("node-a")
    }

    fn published(at: Instant) -> Published {
        Published { view: view(), at }
    }

    #[test]
    fn defaults() {
        let c = config();
        assert_eq!(c.min_interval, Duration::from_secs(300));
        assert_eq!(c.free_memory_threshold_bytes, GIB);
        assert_eq!(c.retry_initial, Duration::from_secs(1));
        assert_eq!(c.retry_max, Duration::from_secs(30));
        assert_eq!(c.request_timeout, Duration::from_secs(30));
    }

    #[test]
    fn nothing_changed_means_nothing_to_do() {
        let t0 = Instant::now();
        let last = published(t0);
        let later = t0 + Duration::from_secs(3600);
        assert_eq!(
            needs_publish(&last, &view(), later, &config()),
            Decision::Nothing
        );
    }

    #[test]
    fn unpublished_fields_do_not_count() {
        let t0 = Instant::now();
        let last = published(t0);
        let mut v = view();
        v.error = Some("poll failed".into());
        for d in &mut v.snapshot.devices {
            d.telemetry.utilization_percent = Some(99);
            d.telemetry.graphics_clock_mhz = Some(1980);
            d.telemetry.memory_clock_mhz = Some(2619);
            d.telemetry.memory_used_bytes += 5 * GIB;
        }
        // Free memory moved, but by less than the threshold.
        v.snapshot.devices[0].telemetry.memory_free_bytes -= GIB - 1;
        let later = t0 + Duration::from_secs(3600);
        assert_eq!(
            needs_publish(&last, &v, later, &config()),
            Decision::Nothing
        );
    }

    #[test]
    fn structural_changes_are_published_at_once() {
        type Mutation = fn(&mut DeviceView);
        let cases: Vec<(&str, Mutation)> = vec![
            ("device gone", |v| {
                v.snapshot.devices.pop();
            }),
            ("all devices gone", |v| v.snapshot.devices.clear()),
            ("device added", |v| {
                v.snapshot.devices.push(device(
                    "GPU-c",
                    2,
                    Vendor::Nvidia,
                    "NVIDIA H100 80GB HBM3",
                    80,
                ))
            }),
            ("device replaced", |v| {
                v.snapshot.devices[1].info.id = "GPU-z".into()
            }),
            ("unhealthy", |v| {
                v.snapshot.devices[0].health = RawHealth::Unhealthy("Xid 79".into())
            }),
            ("allocated", |v| {
                v.allocated.insert("GPU-a".into(), "pod-uid-1".into());
            }),
            ("links", |v| {
                v.snapshot.links.push(crate::backend::DeviceLink {
                    a: "GPU-a".into(),
                    b: "GPU-b".into(),
                    kind: crate::api::LinkKind::Nvlink,
                    bandwidth_gbps: 900.0,
                    p2p: true,
                })
            }),
            ("backend", |v| v.snapshot.backend = "nvml".into()),
        ];
        let t0 = Instant::now();
        let last = published(t0);
        for (what, mutate) in cases {
            let mut v = view();
            mutate(&mut v);
            // Right after the last publish: no rate limit applies.
            assert_eq!(
                needs_publish(&last, &v, t0, &config()),
                Decision::Now,
                "{what}"
            );
        }
    }

    #[test]
    fn a_changed_health_reason_is_published_at_once() {
        let t0 = Instant::now();
        let mut last = published(t0);
        last.view.snapshot.devices[0].health = RawHealth::Unhealthy("too hot: 91 °C".into());
        let mut v = last.view.clone();
        v.snapshot.devices[0].health = RawHealth::Unhealthy("Xid 48".into());
        assert_eq!(needs_publish(&last, &v, t0, &config()), Decision::Now);
        // Recovered.
        assert_eq!(needs_publish(&last, &view(), t0, &config()), Decision::Now);
    }

    #[test]
    fn allocation_changes_are_published_at_once() {
        let t0 = Instant::now();
        let mut last = published(t0);
        last.view.allocated.insert("GPU-a".into(), "pod-1".into());
        let mut v = last.view.clone();
        v.allocated.insert("GPU-a".into(), "pod-2".into());
        assert_eq!(needs_publish(&last, &v, t0, &config()), Decision::Now);
        v.allocated.clear();
        assert_eq!(needs_publish(&last, &v, t0, &config()), Decision::Now);
    }

    #[test]
    fn telemetry_drift_is_rate_limited() {
        type Mutation = fn(&mut DeviceView);
        let cases: Vec<(&str, Mutation)> = vec![
            ("temperature", |v| {
                v.snapshot.devices[1].telemetry.temperature_c = Some(41.0)
            }),
            ("temperature gone", |v| {
                v.snapshot.devices[1].telemetry.temperature_c = None
            }),
            ("power", |v| {
                v.snapshot.devices[0].telemetry.power_w = Some(350.0)
            }),
            ("free memory down by the threshold", |v| {
                v.snapshot.devices[0].telemetry.memory_free_bytes -= GIB
            }),
            ("free memory up by more than the threshold", |v| {
                v.snapshot.devices[0].telemetry.memory_free_bytes =
                    v.snapshot.devices[0].info.memory_total_bytes
            }),
        ];
        let t0 = Instant::now();
        let last = published(t0);
        let c = config();
        for (what, mutate) in cases {
            let mut v = view();
            mutate(&mut v);
            let due = t0 + c.drift_after().unwrap();
            assert_eq!(
                needs_publish(&last, &v, t0 + Duration::from_secs(1), &c),
                Decision::At(due),
                "{what}"
            );
            assert_eq!(needs_publish(&last, &v, due, &c), Decision::Now, "{what}");
            assert_eq!(
                needs_publish(&last, &v, due + Duration::from_secs(5), &c),
                Decision::Now,
                "{what}"
            );
        }
    }

    #[test]
    fn free_memory_drift_is_measured_against_the_last_publish() {
        // Many small steps add up: the comparison is with what was published,
        // not with the previous view.
        let t0 = Instant::now();
        let last = published(t0);
        let late = t0 + Duration::from_secs(600);
        let mut v = view();
        v.snapshot.devices[0].telemetry.memory_free_bytes -= GIB / 2;
        assert_eq!(needs_publish(&last, &v, late, &config()), Decision::Nothing);
        v.snapshot.devices[0].telemetry.memory_free_bytes -= GIB / 2;
        assert_eq!(needs_publish(&last, &v, late, &config()), Decision::Now);
    }

    #[test]
    fn zero_threshold_counts_any_free_memory_change() {
        let t0 = Instant::now();
        let last = published(t0);
        let mut c = config();
        c.free_memory_threshold_bytes = 0;
        let late = t0 + Duration::from_secs(600);
        assert_eq!(needs_publish(&last, &view(), late, &c), Decision::Nothing);
        let mut v = view();
        v.snapshot.devices[0].telemetry.memory_free_bytes -= 1;
        assert_eq!(needs_publish(&last, &v, late, &c), Decision::Now);
    }

    #[test]
    fn a_health_change_overrides_pending_drift() {
        let t0 = Instant::now();
        let last = published(t0);
        let mut v = view();
        v.snapshot.devices[0].telemetry.temperature_c = Some(60.0);
        v.snapshot.devices[1].health = RawHealth::Unhealthy("Xid 79".into());
        assert_eq!(needs_publish(&last, &v, t0, &config()), Decision::Now);
    }

    #[test]
    fn nan_readings_do_not_drift_forever() {
        let t0 = Instant::now();
        let mut last = published(t0);
        last.view.snapshot.devices[0].telemetry.power_w = Some(f64::NAN);
        let v = last.view.clone();
        let late = t0 + Duration::from_secs(60);
        assert_eq!(needs_publish(&last, &v, late, &config()), Decision::Nothing);
    }

    #[test]
    fn drift_waits_a_share_of_the_interval_fixed_per_node() {
        let mut c = config();
        let after: Vec<Duration> = (0..1000)
            .map(|n| {
                c.node_name = format!("gpu-node-{n:04}");
                c.drift_after().unwrap()
            })
            .collect();
        let (least, most) = (after.iter().min().unwrap(), after.iter().max().unwrap());
        assert!(*least >= c.min_interval && *most <= c.min_interval.mul_f64(1.1));
        // Spread over the whole tenth, not bunched.
        assert!(
            *most - *least > c.min_interval.mul_f64(0.09),
            "{least:?}..{most:?}"
        );
        let early = after
            .iter()
            .filter(|a| **a < c.min_interval.mul_f64(1.05))
            .count();
        assert!(
            (400..600).contains(&early),
            "{early} of 1000 in the first half"
        );
        c.node_name = "gpu-node-0007".into();
        assert_eq!(c.drift_after(), Some(after[7]), "the same every time");
    }

    #[test]
    fn an_endless_interval_never_publishes_drift() {
        let t0 = Instant::now();
        let last = published(t0);
        let mut c = config();
        c.min_interval = Duration::MAX;
        let mut v = view();
        v.snapshot.devices[0].telemetry.temperature_c = Some(70.0);
        assert_eq!(needs_publish(&last, &v, t0, &c), Decision::Nothing);
    }

    fn gpu(id: &str, vendor: Vendor, product: &str, memory_total_bytes: u64) -> GpuDevice {
        GpuDevice {
            id: id.into(),
            index: 0,
            vendor,
            product: product.into(),
            memory_total_bytes,
            memory_free_bytes: memory_total_bytes,
            fp16_tflops: 100.0,
            memory_bandwidth_gbps: 1000.0,
            temperature_c: None,
            power_w: None,
            numa_node: None,
            health: Health::Healthy,
            health_reason: None,
        }
    }

    fn state(devices: Vec<GpuDevice>) -> NodeGpuState {
        NodeGpuState {
            version: GPU_STATE_VERSION.into(),
            backend: "fake".into(),
            devices,
            links: vec![],
            timestamp: Some("2025-01-02T03:04:05Z".into()),
            allocated: Default::default(),
        }
    }

    #[test]
    fn patch_body_exact_output() {
        let mut a = gpu(
            "GPU-a",
            Vendor::Nvidia,
            "NVIDIA H100 80GB HBM3",
            85_520_809_984,
        );
        a.index = 0;
        a.temperature_c = Some(41.0);
        a.power_w = Some(120.5);
        a.numa_node = Some(0);
        let mut b = gpu(
            "GPU-b",
            Vendor::Nvidia,
            "NVIDIA H100 80GB HBM3",
            85_520_809_984,
        );
        b.index = 1;
        b.memory_free_bytes = 1 << 30;
        b.health = Health::Unhealthy;
        b.health_reason = Some("Xid 79".into());
        let s = state(vec![a, b]);
        let annotation = r#"{"version":"v1","backend":"fake","devices":[{"id":"GPU-a","index":0,"vendor":"nvidia","product":"NVIDIA H100 80GB HBM3","memoryTotalBytes":85520809984,"memoryFreeBytes":85520809984,"fp16Tflops":100.0,"memoryBandwidthGbps":1000.0,"temperatureC":41.0,"powerW":120.5,"numaNode":0,"health":"Healthy"},{"id":"GPU-b","index":1,"vendor":"nvidia","product":"NVIDIA H100 80GB HBM3","memoryTotalBytes":85520809984,"memoryFreeBytes":1073741824,"fp16Tflops":100.0,"memoryBandwidthGbps":1000.0,"health":"Unhealthy","healthReason":"Xid 79"}],"links":[],"timestamp":"2025-01-02T03:04:05Z"}"#;
        let want = json!({
            "metadata": {
                "annotations": { "tessera.dev/gpu-state": annotation },
                "labels": {
                    "tessera.dev/gpu.count": "2",
                    "tessera.dev/gpu.vendor": "nvidia",
                    "tessera.dev/gpu.product": "NVIDIA-H100-80GB-HBM3",
                    // 81559 MiB is 79.6 GiB: rounded down.
                    "tessera.dev/gpu.memory-gib": "79",
                }
            }
        });
        let body = patch_body(&s);
        assert_eq!(body, want);
        // The annotation reads back as the same state.
        let text = body["metadata"]["annotations"]["tessera.dev/gpu-state"]
            .as_str()
            .unwrap();
        assert_eq!(NodeGpuState::from_json(text).unwrap(), s);
    }

    #[test]
    fn patch_body_names_only_our_keys() {
        let s = state(vec![gpu(
            "a",
            Vendor::Amd,
            "AMD Instinct MI300X",
            192 << 30,
        )]);
        let body = patch_body(&s);
        let top: Vec<&String> = body.as_object().unwrap().keys().collect();
        assert_eq!(top, ["metadata"]);
        let meta: Vec<&String> = body["metadata"].as_object().unwrap().keys().collect();
        assert_eq!(meta, ["annotations", "labels"]);
        let annotations: Vec<&String> = body["metadata"]["annotations"]
            .as_object()
            .unwrap()
            .keys()
            .collect();
        assert_eq!(annotations, [GPU_STATE_ANNOTATION]);
        let mut labels: Vec<&str> = body["metadata"]["labels"]
            .as_object()
            .unwrap()
            .keys()
            .map(String::as_str)
            .collect();
        labels.sort();
        let mut want = vec![
            LABEL_GPU_COUNT,
            LABEL_GPU_VENDOR,
            LABEL_GPU_PRODUCT,
            LABEL_GPU_MEMORY_GIB,
        ];
        want.sort();
        assert_eq!(labels, want);
        // No nulls: a merge patch null would delete someone's key.
        let values: Vec<&Value> = body["metadata"]["labels"]
            .as_object()
            .unwrap()
            .values()
            .chain(
                body["metadata"]["annotations"]
                    .as_object()
                    .unwrap()
                    .values(),
            )
            .collect();
        assert!(values.iter().all(|v| v.is_string()), "{body}");
    }

    #[test]
    fn patch_body_with_no_devices_sets_only_the_count() {
        let body = patch_body(&state(vec![]));
        assert_eq!(
            body,
            json!({
                "metadata": {
                    "annotations": {
                        "tessera.dev/gpu-state": r#"{"version":"v1","backend":"fake","devices":[],"links":[],"timestamp":"2025-01-02T03:04:05Z"}"#
                    },
                    "labels": { "tessera.dev/gpu.count": "0" }
                }
            })
        );
    }

    #[test]
    fn mixed_vendors_and_the_most_common_product() {
        let s = state(vec![
            gpu("n0", Vendor::Nvidia, "NVIDIA L4", 24 << 30),
            gpu("a0", Vendor::Amd, "AMD Instinct MI300X", 192 << 30),
            gpu("a1", Vendor::Amd, "AMD Instinct MI300X", 191 << 30),
        ]);
        let labels = &patch_body(&s)["metadata"]["labels"];
        assert_eq!(
            labels,
            &json!({
                "tessera.dev/gpu.count": "3",
                "tessera.dev/gpu.vendor": "mixed",
                "tessera.dev/gpu.product": "AMD-Instinct-MI300X",
                // The smallest of that product's devices.
                "tessera.dev/gpu.memory-gib": "191",
            })
        );
    }

    #[test]
    fn a_tie_goes_to_the_first_product_seen() {
        let s = state(vec![
            gpu("a", Vendor::Amd, "AMD Instinct MI210", 64 << 30),
            gpu("b", Vendor::Amd, "AMD Instinct MI300X", 192 << 30),
        ]);
        let labels = &patch_body(&s)["metadata"]["labels"];
        assert_eq!(labels["tessera.dev/gpu.vendor"], "amd");
        assert_eq!(labels["tessera.dev/gpu.product"], "AMD-Instinct-MI210");
        assert_eq!(labels["tessera.dev/gpu.memory-gib"], "64");
    }

    #[test]
    fn unknown_vendors_are_named_so() {
        let s = state(vec![gpu("x", Vendor::Unknown, "Some GPU", 8 << 30)]);
        let labels = &patch_body(&s)["metadata"]["labels"];
        assert_eq!(labels["tessera.dev/gpu.vendor"], "unknown");
    }

    #[test]
    fn label_values_are_sanitised() {
        let long = "A".repeat(70);
        let long_with_tail = format!("{}--xyz", "B".repeat(62));
        let cases = [
            ("NVIDIA H100 80GB HBM3", "NVIDIA-H100-80GB-HBM3"),
            ("NVIDIA A100-SXM4-80GB", "NVIDIA-A100-SXM4-80GB"),
            ("AMD Instinct MI300X (rev. 2)", "AMD-Instinct-MI300X-rev.-2"),
            ("  Radeon™ Pro W7900  ", "Radeon-Pro-W7900"),
            ("GeForce RTX 4090/24G", "GeForce-RTX-4090-24G"),
            ("_.-weird-._", "weird"),
            ("a/b\\c:d=e,f", "a-b-c-d-e-f"),
            ("Ünïcödé GPU", "n-c-d-GPU"),
            ("", "unknown"),
            ("???", "unknown"),
            ("日本語", "unknown"),
            (long.as_str(), &long[..63]),
            // Cut at 63, then the trailing separators go.
            (long_with_tail.as_str(), &long_with_tail[..62]),
        ];
        for (input, want) in cases {
            let got = label_value(input);
            assert_eq!(got, want, "{input:?}");
            assert!(is_label_value(&got), "{got:?}");
        }
    }

    /// The Kubernetes rule for label values, written out independently.
    fn is_label_value(v: &str) -> bool {
        let bytes = v.as_bytes();
        bytes.len() <= 63
            && bytes
                .iter()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
            && bytes.first().is_none_or(u8::is_ascii_alphanumeric)
            && bytes.last().is_none_or(u8::is_ascii_alphanumeric)
    }

    #[test]
    fn the_published_state_carries_an_rfc3339_timestamp() {
        let s = state_of(&view());
        let ts = s.timestamp.clone().unwrap();
        assert!(ts.parse::<k8s_openapi::jiff::Timestamp>().is_ok(), "{ts}");
        assert_eq!(s.devices.len(), 2);
        assert_eq!(s.version, GPU_STATE_VERSION);
        assert!(s.allocated.is_empty());
    }

    #[test]
    fn the_published_state_carries_the_allocated_set() {
        let mut v = view();
        v.allocated.insert("GPU-a".into(), "pod-uid-1".into());
        v.allocated.insert("GPU-b".into(), "unbound".into());
        let s = state_of(&v);
        assert_eq!(s.allocated, v.allocated);
        let body = patch_body(&s);
        let text = body["metadata"]["annotations"][GPU_STATE_ANNOTATION]
            .as_str()
            .unwrap();
        assert!(
            text.ends_with(r#","allocated":{"GPU-a":"pod-uid-1","GPU-b":"unbound"}}"#),
            "{text}"
        );
        assert_eq!(
            NodeGpuState::from_json(text).unwrap().allocated,
            v.allocated
        );
    }

    #[tokio::test]
    async fn an_empty_node_name_is_refused() {
        let (service, _handle) = tower_test::mock::pair::<
            http::Request<kube::client::Body>,
            http::Response<kube::client::Body>,
        >();
        let client = kube::Client::new(service, "default");
        let (_tx, rx) = crate::agent::state::channel("fake");
        let result = run_publisher(
            client,
            PublisherConfig::new(" "),
            rx,
            Arc::default(),
            std::future::pending::<()>(),
        )
        .await;
        assert_eq!(result, Err(PublisherError::NoNodeName));
    }
}
