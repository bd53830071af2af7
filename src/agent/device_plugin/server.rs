//! The `DevicePlugin` gRPC service kubelet calls on our socket, and the server
//! that runs it. Everything is answered from the shared [`DeviceView`]:
//!
//! - `ListAndWatch` sends the device list at once, then again every time a
//!   device appears, vanishes or changes health (telemetry alone does not
//!   count). It waits on the view's `watch` channel, so a change reaches
//!   kubelet as soon as the poller publishes it.
//! - `GetPreferredAllocation` asks the [`Binder`] for the controller's plan,
//!   else picks by topology (`super::preferred`).
//! - `Allocate` refuses unknown or unhealthy devices and whatever the binder
//!   vetoes, and answers with what the vendor runtime needs
//!   ([`super::devices_env`]). The view's `allocated` map is kept by the
//!   binder when it can ([`Binder::keeps_allocated_view`]: the binding index,
//!   which knows the pods and forgets their devices when they end); otherwise
//!   (no API server, `--no-publish`) the devices handed out are recorded
//!   there under `UNBOUND` and stay until the agent restarts, since nothing
//!   tells the agent when a pod ends.
//!
//! [`DeviceView`]: crate::agent::state::DeviceView

use std::collections::BTreeSet;
use std::io;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use tokio::sync::{mpsc, watch};
use tokio_stream::wrappers::ReceiverStream;
use tonic::service::Routes;
use tonic::{Request, Response, Status};

use super::allocation_metrics::AllocationMetrics;
use super::devices_env::container_response;
use super::kubelet_api::v1beta1::device_plugin_server::{DevicePlugin, DevicePluginServer};
use super::kubelet_api::v1beta1::{
    AllocateRequest, AllocateResponse, ContainerPreferredAllocationRequest,
    ContainerPreferredAllocationResponse, Device, DevicePluginOptions, Empty, ListAndWatchResponse,
    NumaNode, PreStartContainerRequest, PreStartContainerResponse, PreferredAllocationRequest,
    PreferredAllocationResponse, TopologyInfo,
};
use super::kubelet_api::{HEALTHY, UNHEALTHY};
use super::preferred::preferred_allocation;
use crate::agent::binding::Binder;
use crate::agent::container_devices::RuntimeOptions;
use crate::agent::state::{DeviceView, ViewRx, ViewTx};
use crate::agent::unix_server::{Authority, UnixServer};
use crate::backend::{DeviceInfo, RawHealth};

/// The owner `Allocate` records in `DeviceView::allocated` when the binder
/// does not keep that map: kubelet does not say which pod it allocates for.
pub(crate) const UNBOUND: &str = tessera_core::api::NodeGpuState::UNBOUND_OWNER;

/// What we tell kubelet about ourselves.
pub(crate) fn plugin_options() -> DevicePluginOptions {
    DevicePluginOptions {
        pre_start_required: false,
        get_preferred_allocation_available: true,
    }
}

/// The `DevicePlugin` service.
#[derive(Clone)]
pub struct PluginService {
    resource_name: String,
    view: ViewRx,
    tx: ViewTx,
    binder: Arc<dyn Binder>,
    runtime: RuntimeOptions,
    metrics: AllocationMetrics,
    /// Turns true (or its sender goes away) when the server stops, ending
    /// open `ListAndWatch` streams; `None` outside a [`PluginServer`].
    stop: Option<watch::Receiver<bool>>,
    /// Counts `ListAndWatch` calls, for a runner that watches whether kubelet calls at all.
    list_and_watch_calls: Arc<AtomicU64>,
}

impl PluginService {
    pub fn new(
        resource_name: &str,
        view: ViewRx,
        tx: ViewTx,
        binder: Arc<dyn Binder>,
        runtime: RuntimeOptions,
    ) -> Self {
        Self {
            resource_name: resource_name.to_string(),
            view,
            tx,
            binder,
            runtime,
            metrics: AllocationMetrics::default(),
            stop: None,
            list_and_watch_calls: Arc::default(),
        }
    }

    /// Records Allocate counts and latency into `metrics`.
    pub(crate) fn with_metrics(mut self, metrics: AllocationMetrics) -> Self {
        self.metrics = metrics;
        self
    }

    /// Counts `ListAndWatch` calls into `calls`.
    pub(crate) fn counting_list_and_watch(mut self, calls: Arc<AtomicU64>) -> Self {
        self.list_and_watch_calls = calls;
        self
    }

    fn with_stop(mut self, stop: watch::Receiver<bool>) -> Self {
        self.stop = Some(stop);
        self
    }

    async fn preferred(&self, req: &ContainerPreferredAllocationRequest) -> Vec<String> {
        let available = &req.available_device_i_ds;
        let must = &req.must_include_device_i_ds;
        let size = usize::try_from(req.allocation_size).unwrap_or(0);
        let mut planned = self.binder.planned_for(available, must, size);
        if planned.is_none() {
            self.binder.catch_up().await;
            planned = self.binder.planned_for(available, must, size);
        }
        if let Some(plan) = planned {
            match check_plan(&plan, available, must, size) {
                Ok(()) => return plan,
                Err(why) => tracing::warn!(
                    plan = ?plan, reason = %why,
                    "planned binding does not fit kubelet's request; choosing by topology"
                ),
            }
        }
        // A copy, so the poller is not held up while the choice is computed.
        let snapshot = self.view.borrow().snapshot.clone();
        preferred_allocation(&snapshot, available, must, size)
    }
}

/// Whether a binder's answer fits the request.
fn check_plan(
    plan: &[String],
    available: &[String],
    must: &[String],
    size: usize,
) -> Result<(), String> {
    let set: BTreeSet<&String> = plan.iter().collect();
    if set.len() != plan.len() {
        return Err("it names a device twice".into());
    }
    if plan.len() != size {
        return Err(format!(
            "it has {} devices, kubelet asked for {size}",
            plan.len()
        ));
    }
    if let Some(m) = must.iter().find(|m| !set.contains(m)) {
        return Err(format!("it leaves out must-include device {m}"));
    }
    if let Some(p) = plan
        .iter()
        .find(|p| !available.contains(p) && !must.contains(p))
    {
        return Err(format!("device {p} is not available"));
    }
    Ok(())
}

/// The device list kubelet sees.
pub(crate) fn device_list(view: &DeviceView) -> ListAndWatchResponse {
    ListAndWatchResponse {
        devices: view
            .snapshot
            .devices
            .iter()
            .map(|d| Device {
                id: d.info.id.clone(),
                // A GPU in MIG mode is not a whole GPU to hand out; the
                // device plugin offers no partitions (they go through DRA).
                health: match (&d.health, d.info.not_whole()) {
                    (RawHealth::Healthy, None) => HEALTHY,
                    _ => UNHEALTHY,
                }
                .to_string(),
                topology: d.info.numa_node.filter(|n| *n >= 0).map(|n| TopologyInfo {
                    nodes: vec![NumaNode { id: i64::from(n) }],
                }),
            })
            .collect(),
    }
}

/// Checks one container's devices against the view: every ID known and healthy.
fn validate<'v>(
    view: &'v DeviceView,
    resource: &str,
    ids: &[String],
) -> Result<Vec<&'v DeviceInfo>, Status> {
    let mut unknown = Vec::new();
    let mut unhealthy = Vec::new();
    let mut found = Vec::with_capacity(ids.len());
    for id in ids {
        match view.snapshot.devices.iter().find(|d| &d.info.id == id) {
            None => unknown.push(id.as_str()),
            Some(d) => match (&d.health, d.info.not_whole()) {
                (RawHealth::Healthy, None) => found.push(&d.info),
                (RawHealth::Healthy, Some(why)) => unhealthy.push(format!("{id} ({why})")),
                (RawHealth::Unhealthy(reason), _) => unhealthy.push(format!("{id} ({reason})")),
            },
        }
    }
    if !unknown.is_empty() {
        let known: Vec<&str> = view
            .snapshot
            .devices
            .iter()
            .map(|d| d.info.id.as_str())
            .collect();
        return Err(Status::invalid_argument(format!(
            "{resource}: unknown device IDs {}; this node has {}",
            unknown.join(", "),
            if known.is_empty() {
                "no devices".to_string()
            } else {
                known.join(", ")
            }
        )));
    }
    if !unhealthy.is_empty() {
        return Err(Status::failed_precondition(format!(
            "{resource}: devices are unhealthy or not whole GPUs: {}",
            unhealthy.join("; ")
        )));
    }
    Ok(found)
}

#[tonic::async_trait]
impl DevicePlugin for PluginService {
    async fn get_device_plugin_options(
        &self,
        _: Request<Empty>,
    ) -> Result<Response<DevicePluginOptions>, Status> {
        Ok(Response::new(plugin_options()))
    }

    type ListAndWatchStream = ReceiverStream<Result<ListAndWatchResponse, Status>>;

    async fn list_and_watch(
        &self,
        _: Request<Empty>,
    ) -> Result<Response<Self::ListAndWatchStream>, Status> {
        self.list_and_watch_calls.fetch_add(1, Ordering::Relaxed);
        let (out, stream) = mpsc::channel(4);
        let mut view = self.view.clone();
        let mut stop = self.stop.clone();
        tokio::spawn(async move {
            let mut sent: Option<Vec<(String, bool)>> = None;
            loop {
                let (health, list) = {
                    let current = view.borrow_and_update();
                    (current.health(), device_list(&current))
                };
                if sent.as_ref() != Some(&health) {
                    tracing::debug!(devices = ?health, "sending the device list to kubelet");
                    tokio::select! {
                        result = out.send(Ok(list)) => if result.is_err() { return },
                        _ = stopped(&mut stop) => return,
                    }
                    sent = Some(health);
                }
                tokio::select! {
                    result = view.changed() => if result.is_err() { return },
                    _ = out.closed() => return,
                    _ = stopped(&mut stop) => return,
                }
            }
        });
        Ok(Response::new(ReceiverStream::new(stream)))
    }

    async fn get_preferred_allocation(
        &self,
        request: Request<PreferredAllocationRequest>,
    ) -> Result<Response<PreferredAllocationResponse>, Status> {
        let mut container_responses = Vec::new();
        for container in &request.get_ref().container_requests {
            container_responses.push(ContainerPreferredAllocationResponse {
                device_i_ds: self.preferred(container).await,
            });
        }
        Ok(Response::new(PreferredAllocationResponse {
            container_responses,
        }))
    }

    async fn allocate(
        &self,
        request: Request<AllocateRequest>,
    ) -> Result<Response<AllocateResponse>, Status> {
        let started = std::time::Instant::now();
        let requests = &request.get_ref().container_requests;
        // Copied out so the view is not locked while the binder and the
        // host's device files are consulted.
        let (backend, checked) = {
            let view = self.view.borrow();
            let mut checked: Vec<Vec<DeviceInfo>> = Vec::with_capacity(requests.len());
            for request in requests {
                let devices = validate(&view, &self.resource_name, &request.devices_ids)?;
                checked.push(devices.into_iter().cloned().collect());
            }
            (view.snapshot.backend.clone(), checked)
        };
        let mut responses = Vec::with_capacity(requests.len());
        for (request, devices) in requests.iter().zip(&checked) {
            if !self.binder.expects(&request.devices_ids) {
                self.binder.catch_up().await;
            }
            self.binder
                .check_allocate(&request.devices_ids)
                .map_err(|why| {
                    Status::failed_precondition(format!("{}: {why}", self.resource_name))
                })?;
            let devices: Vec<&DeviceInfo> = devices.iter().collect();
            responses.push(container_response(&backend, &devices, &self.runtime));
        }
        let ids: Vec<&String> = requests.iter().flat_map(|r| &r.devices_ids).collect();
        tracing::info!(devices = ?ids, "allocated");
        if !self.binder.keeps_allocated_view() {
            self.tx.send_if_modified(|view| {
                let mut changed = false;
                for id in ids {
                    let old = view.allocated.insert(id.clone(), UNBOUND.to_string());
                    changed |= old.as_deref() != Some(UNBOUND);
                }
                changed
            });
        }
        self.metrics.answered.inc();
        self.metrics
            .seconds
            .observe(started.elapsed().as_secs_f64());
        Ok(Response::new(AllocateResponse {
            container_responses: responses,
        }))
    }

    async fn pre_start_container(
        &self,
        _: Request<PreStartContainerRequest>,
    ) -> Result<Response<PreStartContainerResponse>, Status> {
        Ok(Response::new(PreStartContainerResponse {}))
    }
}

/// Resolves once the server is stopping; never without a server.
async fn stopped(stop: &mut Option<watch::Receiver<bool>>) {
    match stop {
        Some(rx) => {
            let _ = rx.wait_for(|s| *s).await;
        }
        None => std::future::pending().await,
    }
}

/// A `DevicePlugin` server on a unix socket.
pub struct PluginServer(UnixServer);

impl PluginServer {
    /// Binds `path` (replacing a stale file) and serves `service` on it.
    pub async fn start(path: &Path, service: PluginService) -> io::Result<Self> {
        let (stop, stop_rx) = watch::channel(false);
        let service = service.with_stop(stop_rx);
        let routes = Routes::new(DevicePluginServer::new(service));
        UnixServer::start("device plugin", path, Authority::Valid, routes, stop).map(Self)
    }

    /// Whether our socket file is still there (not removed or replaced) and
    /// the server still runs.
    pub(crate) fn is_intact(&self) -> bool {
        self.0.is_intact()
    }

    /// Stops serving (ending open streams) and removes the socket file if it
    /// is still the one we bound.
    pub async fn stop(self) {
        self.0.stop().await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::agent::binding::NoBinder;
    use crate::agent::device_plugin::kubelet_api::v1beta1::ContainerAllocateRequest;
    use crate::agent::state::channel;

    fn s(list: &[&str]) -> Vec<String> {
        list.iter().map(|x| x.to_string()).collect()
    }

    /// Plans `fake-h100-80gib-2,3` for two-device requests; vetoes device 0.
    struct TestBinder;

    impl Binder for TestBinder {
        fn planned_for(&self, _: &[String], _: &[String], size: usize) -> Option<Vec<String>> {
            match size {
                2 => Some(s(&["fake-h100-80gib-2", "fake-h100-80gib-3"])),
                // A plan that does not fit: ignored.
                3 => Some(s(&["fake-h100-80gib-9"])),
                _ => None,
            }
        }

        fn check_allocate(&self, requested: &[String]) -> Result<(), String> {
            if requested.iter().any(|r| r == "fake-h100-80gib-0") {
                Err("fake-h100-80gib-0 is planned for another pod".into())
            } else {
                Ok(())
            }
        }
    }

    fn service(binder: Arc<dyn Binder>) -> (PluginService, ViewTx) {
        let mut fake = crate::backend::fake::FakeBackend::new("4xH100-80GiB").unwrap();
        let snap = crate::backend::snapshot(&mut fake).unwrap();
        let (tx, rx) = channel("fake");
        tx.send_modify(|v| {
            v.snapshot = snap;
            v.ready = true;
        });
        let svc = PluginService::new(
            "tessera.dev/gpu",
            rx,
            tx.clone(),
            binder,
            RuntimeOptions::default(),
        );
        (svc, tx)
    }

    fn ask(size: i32) -> ContainerPreferredAllocationRequest {
        ContainerPreferredAllocationRequest {
            available_device_i_ds: (0..4).map(|i| format!("fake-h100-80gib-{i}")).collect(),
            must_include_device_i_ds: vec![],
            allocation_size: size,
        }
    }

    #[tokio::test]
    async fn the_binder_steers_preferences_and_vetoes_allocations() {
        let (svc, tx) = service(Arc::new(TestBinder));
        let resp = svc
            .get_preferred_allocation(Request::new(PreferredAllocationRequest {
                container_requests: vec![ask(2), ask(3), ask(1)],
            }))
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
            vec![
                s(&["fake-h100-80gib-2", "fake-h100-80gib-3"]),
                s(&[
                    "fake-h100-80gib-0",
                    "fake-h100-80gib-1",
                    "fake-h100-80gib-2"
                ]),
                s(&["fake-h100-80gib-0"]),
            ]
        );

        let alloc = |ids: &[&str]| {
            Request::new(AllocateRequest {
                container_requests: vec![ContainerAllocateRequest {
                    devices_ids: s(ids),
                }],
            })
        };
        let err = svc
            .allocate(alloc(&["fake-h100-80gib-0"]))
            .await
            .unwrap_err();
        assert_eq!(err.code(), tonic::Code::FailedPrecondition);
        assert!(err.message().contains("planned for another pod"), "{err:?}");
        assert!(
            tx.borrow().allocated.is_empty(),
            "a vetoed allocation is not recorded"
        );

        svc.allocate(alloc(&["fake-h100-80gib-2"])).await.unwrap();
        assert_eq!(
            tx.borrow()
                .allocated
                .get("fake-h100-80gib-2")
                .map(String::as_str),
            Some(UNBOUND)
        );
        // Handed out again: nothing changes, so nobody is woken.
        let mut rx = tx.subscribe();
        rx.mark_unchanged();
        svc.allocate(alloc(&["fake-h100-80gib-2"])).await.unwrap();
        assert!(!rx.has_changed().unwrap());
    }

    #[tokio::test]
    async fn without_a_binder_topology_decides() {
        let (svc, _tx) = service(Arc::new(NoBinder));
        let resp = svc
            .get_preferred_allocation(Request::new(PreferredAllocationRequest {
                container_requests: vec![ask(2)],
            }))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(
            resp.container_responses[0].device_i_ds,
            s(&["fake-h100-80gib-0", "fake-h100-80gib-1"])
        );
        let opts = svc
            .get_device_plugin_options(Request::new(Empty {}))
            .await
            .unwrap()
            .into_inner();
        assert!(opts.get_preferred_allocation_available && !opts.pre_start_required);
    }

    #[test]
    fn plans_that_do_not_fit_are_refused() {
        let available = s(&["a", "b", "c"]);
        let must = s(&["a"]);
        assert!(check_plan(&s(&["a", "b"]), &available, &must, 2).is_ok());
        for (plan, why) in [
            (s(&["a"]), "has 1 devices"),
            (s(&["b", "c"]), "must-include device a"),
            (s(&["a", "z"]), "device z is not available"),
            (s(&["a", "a"]), "twice"),
        ] {
            let err = check_plan(&plan, &available, &must, 2).unwrap_err();
            assert!(err.contains(why), "{plan:?}: {err}");
        }
    }

    /// A GPU in MIG mode (or about to change it) is listed unhealthy and
    /// never allocated whole: the device plugin offers no partitions.
    #[tokio::test]
    async fn a_gpu_in_mig_mode_is_not_offered_whole() {
        use crate::backend::test_mig;
        let (svc, tx) = service(Arc::new(NoBinder));
        tx.send_modify(|v| {
            v.snapshot.devices[1].info.mig = Some(test_mig(true, None));
            v.snapshot.devices[2].info.mig = Some(test_mig(false, Some(true)));
        });
        let list = device_list(&tx.borrow());
        let health: Vec<&str> = list.devices.iter().map(|d| d.health.as_str()).collect();
        assert_eq!(health, [HEALTHY, UNHEALTHY, UNHEALTHY, HEALTHY]);
        let err = svc
            .allocate(Request::new(AllocateRequest {
                container_requests: vec![ContainerAllocateRequest {
                    devices_ids: s(&["fake-h100-80gib-1"]),
                }],
            }))
            .await
            .unwrap_err();
        assert_eq!(err.code(), tonic::Code::FailedPrecondition);
        assert!(err.message().contains("in MIG mode"), "{err:?}");
    }
}
