//! The agent's HTTP endpoints: `/healthz` (the process serves), `/readyz`
//! (registered with kubelet — the device plugin or the DRA driver — and the
//! GPUs have been read) and Prometheus `/metrics`.

use std::sync::Arc;

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::encoding::text::{encode_eof, encode_registry};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use super::device_metrics::DeviceMetrics;
use super::device_plugin::AllocationMetrics;
use super::device_plugin::registration::{PluginStatus, SILENT_KUBELET};
use super::dra::{DraStatus, SliceStats};
use super::publisher::{PublisherStats, WriteCause};
use super::state::ViewRx;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct HealthLabel {
    health: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CauseLabel {
    cause: &'static str,
}

/// Everything the agent counts. Counters others own (registrations, publish
/// results) are read at scrape time.
pub(crate) struct AgentMetrics {
    registry: Registry,
    /// `tessera_gpu_*`: each device's telemetry.
    gpus: Registry,
    device_metrics: DeviceMetrics,
    devices: Family<HealthLabel, Gauge>,
    allocated: Gauge,
    registrations: Gauge,
    publishes: Gauge,
    publish_errors: Gauge,
    publish_attempts: Family<CauseLabel, Gauge>,
    slice_writes: Gauge,
    slice_errors: Gauge,
    slice_restores: Gauge,
}

/// Status kept by the device plugin and the publisher, read at scrape time.
/// `None` for a part the agent does not run.
#[derive(Clone, Default)]
pub(crate) struct Counters {
    pub(crate) plugin: Option<Arc<PluginStatus>>,
    pub(crate) publisher: Option<Arc<PublisherStats>>,
    pub(crate) dra: Option<Arc<DraStatus>>,
    pub(crate) slices: Option<Arc<SliceStats>>,
}

impl AgentMetrics {
    /// The metrics of the agent on `node` (the `node` label of its devices).
    pub(crate) fn new(allocation: &AllocationMetrics, node: &str) -> Self {
        let mut registry = Registry::with_prefix("tessera_agent");
        let mut gpus = Registry::with_prefix("tessera_gpu");
        let device_metrics = DeviceMetrics::register(&mut gpus, node);
        let devices = Family::<HealthLabel, Gauge>::default();
        registry.register("devices", "GPUs on this node by health", devices.clone());
        let allocated = Gauge::default();
        registry.register(
            "allocated_devices",
            "GPUs handed out to containers (device plugin) or prepared for claims (DRA)",
            allocated.clone(),
        );
        registry.register(
            "allocations",
            "Allocate requests answered",
            allocation.answered.clone(),
        );
        registry.register(
            "allocation_duration_seconds",
            "Time to answer an Allocate request",
            allocation.seconds.clone(),
        );
        let registrations = Gauge::default();
        registry.register(
            "kubelet_registrations",
            "Successful registrations with kubelet since start (device plugin or DRA driver)",
            registrations.clone(),
        );
        let publishes = Gauge::default();
        registry.register(
            "state_publishes",
            "Node GPU state patches written since start",
            publishes.clone(),
        );
        let publish_errors = Gauge::default();
        registry.register(
            "state_publish_errors",
            "Node GPU state patches that failed since start",
            publish_errors.clone(),
        );
        let publish_attempts = Family::<CauseLabel, Gauge>::default();
        registry.register(
            "state_publish_attempts",
            "Node GPU state patches sent since start, by why: first, change, drift (telemetry \
             alone, at most once per interval) or retry (after a failure)",
            publish_attempts.clone(),
        );
        let slice_writes = Gauge::default();
        registry.register(
            "resource_slice_writes",
            "ResourceSlices written since start (DRA)",
            slice_writes.clone(),
        );
        let slice_errors = Gauge::default();
        registry.register(
            "resource_slice_errors",
            "Failed attempts to publish the node's ResourceSlices since start (DRA)",
            slice_errors.clone(),
        );
        let slice_restores = Gauge::default();
        registry.register(
            "resource_slice_restores",
            "Times since start the node's ResourceSlices were written again because someone \
             else deleted them, as kubelet does when it starts (DRA)",
            slice_restores.clone(),
        );
        Self {
            registry,
            gpus,
            device_metrics,
            devices,
            allocated,
            registrations,
            publishes,
            publish_errors,
            publish_attempts,
            slice_writes,
            slice_errors,
            slice_restores,
        }
    }

    /// For metrics kept elsewhere (the client's request counts).
    pub(crate) fn registry_mut(&mut self) -> &mut Registry {
        &mut self.registry
    }

    /// The exposition text, with gauges brought up to date from the view.
    pub(crate) fn render(&self, view: &ViewRx, counters: &Counters) -> String {
        let current = view.borrow().clone();
        let (mut healthy, mut unhealthy) = (0, 0);
        for (_, ok) in current.health() {
            if ok {
                healthy += 1;
            } else {
                unhealthy += 1;
            }
        }
        for (label, count) in [("healthy", healthy), ("unhealthy", unhealthy)] {
            self.devices
                .get_or_create(&HealthLabel {
                    health: label.into(),
                })
                .set(count);
        }
        self.allocated.set(current.allocated.len() as i64);
        let as_gauge = |count: u64| i64::try_from(count).unwrap_or(i64::MAX);
        self.registrations.set(as_gauge(
            counters.plugin.as_ref().map_or(0, |p| p.registrations())
                + counters.dra.as_ref().map_or(0, |d| d.registrations()),
        ));
        self.slice_writes
            .set(as_gauge(counters.slices.as_ref().map_or(0, |s| s.writes())));
        self.slice_errors
            .set(as_gauge(counters.slices.as_ref().map_or(0, |s| s.errors())));
        self.slice_restores.set(as_gauge(
            counters.slices.as_ref().map_or(0, |s| s.restores()),
        ));
        self.publishes.set(as_gauge(
            counters.publisher.as_ref().map_or(0, |p| p.published()),
        ));
        self.publish_errors.set(as_gauge(
            counters.publisher.as_ref().map_or(0, |p| p.errors()),
        ));
        if let Some(publisher) = &counters.publisher {
            for cause in WriteCause::ALL {
                self.publish_attempts
                    .get_or_create(&CauseLabel {
                        cause: cause.as_str(),
                    })
                    .set(as_gauge(publisher.sent(cause)));
            }
        }
        self.device_metrics.update(&current);
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = encode_registry(&mut out, &self.registry);
        let _ = encode_registry(&mut out, &self.gpus);
        let _ = encode_eof(&mut out);
        out
    }
}

#[derive(Clone)]
struct AgentEndpoints {
    view: ViewRx,
    counters: Counters,
    metrics: Arc<AgentMetrics>,
}

async fn healthz() -> &'static str {
    "ok\n"
}

async fn readyz(State(endpoints): State<AgentEndpoints>) -> impl IntoResponse {
    let current = endpoints.view.borrow().clone();
    if !current.ready {
        return (
            StatusCode::SERVICE_UNAVAILABLE,
            "GPUs not read yet\n".to_string(),
        );
    }
    if endpoints
        .counters
        .plugin
        .as_ref()
        .is_some_and(|p| !p.is_registered())
    {
        return (
            StatusCode::SERVICE_UNAVAILABLE,
            "not registered with kubelet yet\n".to_string(),
        );
    }
    if endpoints
        .counters
        .plugin
        .as_ref()
        .is_some_and(|p| p.kubelet_silent())
    {
        return (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("{SILENT_KUBELET}\n"),
        );
    }
    if let Some(dra) = &endpoints.counters.dra
        && dra.registered() != Some(true)
    {
        let why = match dra.refusal() {
            Some(error) => format!("kubelet refused the DRA driver: {error}\n"),
            None => "DRA driver not registered with kubelet yet\n".to_string(),
        };
        return (StatusCode::SERVICE_UNAVAILABLE, why);
    }
    (StatusCode::OK, "ready\n".to_string())
}

async fn metrics_text(State(s): State<AgentEndpoints>) -> impl IntoResponse {
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        s.metrics.render(&s.view, &s.counters),
    )
}

pub(crate) fn router(view: ViewRx, counters: Counters, metrics: Arc<AgentMetrics>) -> Router {
    Router::new()
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics_text))
        .with_state(AgentEndpoints {
            view,
            counters,
            metrics,
        })
}

/// Serves the endpoints on `listener` until `shutdown` resolves.
pub(crate) async fn serve(
    listener: tokio::net::TcpListener,
    app: Router,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    if let Ok(addr) = listener.local_addr() {
        tracing::info!(%addr, "serving /healthz, /readyz and /metrics");
    }
    axum::serve(listener, app)
        .with_graceful_shutdown(shutdown)
        .await
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::agent::state::channel;
    use crate::backend::fake::FakeBackend;
    use crate::backend::snapshot;
    use axum::body::Body;
    use axum::http::Request;
    use tower::ServiceExt;

    async fn get(app: &Router, path: &str) -> (StatusCode, String) {
        let res = app
            .clone()
            .oneshot(Request::get(path).body(Body::empty()).unwrap())
            .await
            .unwrap();
        let status = res.status();
        let body = axum::body::to_bytes(res.into_body(), 1 << 20)
            .await
            .unwrap();
        (status, String::from_utf8(body.to_vec()).unwrap())
    }

    #[tokio::test]
    async fn readiness_follows_the_view_and_registration() {
        let (tx, rx) = channel("fake");
        let plugin = Arc::new(PluginStatus::default());
        let counters = Counters {
            plugin: Some(plugin.clone()),
            ..Counters::default()
        };
        let app = router(
            rx,
            counters,
            Arc::new(AgentMetrics::new(&AllocationMetrics::default(), "node-1")),
        );
        assert_eq!(get(&app, "/healthz").await.0, StatusCode::OK);
        let (status, body) = get(&app, "/readyz").await;
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
        assert!(body.contains("not read"));

        let mut backend = FakeBackend::new("2xH100-80GiB").unwrap();
        let snap = snapshot(&mut backend).unwrap();
        tx.send_modify(|v| {
            v.snapshot = snap;
            v.ready = true;
        });
        let (status, body) = get(&app, "/readyz").await;
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
        assert!(body.contains("kubelet"));
        plugin.record_registration();
        assert_eq!(get(&app, "/readyz").await.0, StatusCode::OK);
    }

    #[tokio::test]
    async fn metrics_count_devices_allocations_and_publishes() {
        let (tx, rx) = channel("fake");
        let publisher = Arc::new(PublisherStats::default());
        let counters = Counters {
            publisher: Some(publisher.clone()),
            ..Counters::default()
        };
        let allocation = AllocationMetrics::default();
        let app = router(
            rx,
            counters,
            Arc::new(AgentMetrics::new(&allocation, "node-1")),
        );
        let mut backend = FakeBackend::new("3xL4-24GiB").unwrap();
        let mut snap = snapshot(&mut backend).unwrap();
        snap.devices[2].health = crate::backend::RawHealth::Unhealthy("Xid 79".into());
        tx.send_modify(|v| {
            v.snapshot = snap;
            v.ready = true;
            v.allocated.insert("fake-l4-24gib-0".into(), "uid".into());
        });
        allocation.answered.inc();
        allocation.seconds.observe(0.0002);
        publisher
            .errors
            .fetch_add(2, std::sync::atomic::Ordering::Relaxed);
        publisher.count_sent(WriteCause::First, None);
        publisher.count_sent(WriteCause::Retry, Some(std::time::Duration::from_secs(1)));
        let (status, text) = get(&app, "/metrics").await;
        assert_eq!(status, StatusCode::OK);
        for line in [
            "tessera_agent_devices{health=\"healthy\"} 2",
            "tessera_agent_devices{health=\"unhealthy\"} 1",
            "tessera_agent_allocated_devices 1",
            "tessera_agent_allocations_total 1",
            "tessera_agent_allocation_duration_seconds_count 1",
            "tessera_agent_state_publish_errors 2",
            "tessera_agent_state_publish_attempts{cause=\"first\"} 1",
            "tessera_agent_state_publish_attempts{cause=\"retry\"} 1",
            "tessera_agent_state_publish_attempts{cause=\"drift\"} 0",
            "tessera_agent_kubelet_registrations 0",
        ] {
            assert!(text.contains(line), "missing {line:?} in\n{text}");
        }
    }
}
