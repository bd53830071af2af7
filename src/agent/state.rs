//! The agent's live view of its devices, shared by the device plugin, the
//! node state publisher and the HTTP endpoints through a `watch` channel: the
//! poller replaces the snapshot, the device plugin records allocations, and
//! every consumer sees the latest view and decides for itself what changed.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use tokio::sync::watch;

use super::holders::Holding;
use crate::backend::health::HealthTracker;
use crate::backend::registry::Registry;
use crate::backend::{GpuBackend, RawHealth, Snapshot, is_fallback_id, snapshot};
use tessera_core::api::SharesOffered;

#[derive(Clone, Debug, PartialEq)]
pub struct DeviceView {
    /// The latest snapshot, health already through the health tracker.
    pub snapshot: Snapshot,
    /// Devices handed out to containers: device ID → pod UID.
    pub allocated: BTreeMap<String, String>,
    /// Who holds each device, partition and memory share handed out (what
    /// the device metrics are labelled with).
    pub holdings: Vec<Holding>,
    /// Set once the first snapshot has been read.
    pub ready: bool,
    /// The last backend error, if the latest poll failed (the snapshot is then
    /// the last good one).
    pub error: Option<String>,
    /// The parts of GPUs the node hands out (through DRA only).
    pub shares: SharesOffered,
}

impl DeviceView {
    pub(crate) fn empty(backend: &str) -> Self {
        Self {
            snapshot: Snapshot {
                backend: backend.to_string(),
                devices: Vec::new(),
                links: Vec::new(),
            },
            allocated: BTreeMap::new(),
            holdings: Vec::new(),
            ready: false,
            error: None,
            shares: SharesOffered::default(),
        }
    }

    /// `(device ID, healthy)` in device order: what kubelet needs to know.
    pub(crate) fn health(&self) -> Vec<(String, bool)> {
        self.snapshot
            .devices
            .iter()
            .map(|d| (d.info.id.clone(), d.health == RawHealth::Healthy))
            .collect()
    }
}

pub type ViewTx = Arc<watch::Sender<DeviceView>>;
pub type ViewRx = watch::Receiver<DeviceView>;

pub fn channel(backend: &str) -> (ViewTx, ViewRx) {
    let (tx, rx) = watch::channel(DeviceView::empty(backend));
    (Arc::new(tx), rx)
}

/// Reads the backend every `interval` on its own thread (backend calls block)
/// until `stop` is set, publishing each snapshot through `tx`.
pub fn spawn_poller(
    backend: Box<dyn GpuBackend>,
    tracker: HealthTracker,
    interval: Duration,
    tx: ViewTx,
    stop: Arc<AtomicBool>,
) -> std::thread::JoinHandle<()> {
    spawn_poller_with_ids(backend, tracker, interval, tx, stop, None)
}

/// [`spawn_poller`], and a device that now reports only a fallback ID (a
/// lost GPU) gets the ID `registry` knew it by (see
/// `Registry::stabilize_ids`), so device IDs stay the same across agent
/// restarts for kubelet, the allocation checkpoint and the controller's plans.
pub(crate) fn spawn_poller_with_ids(
    mut backend: Box<dyn GpuBackend>,
    mut tracker: HealthTracker,
    interval: Duration,
    tx: ViewTx,
    stop: Arc<AtomicBool>,
    registry: Option<Registry>,
) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        while !stop.load(Ordering::Relaxed) {
            let started = Instant::now();
            poll_with_ids(backend.as_mut(), &mut tracker, &tx, registry.as_ref());
            let spent = started.elapsed();
            // Sleep in short steps so a stop request is seen promptly.
            let mut left = interval.saturating_sub(spent);
            while !left.is_zero() && !stop.load(Ordering::Relaxed) {
                let step = left.min(Duration::from_millis(50));
                std::thread::sleep(step);
                left -= step;
            }
        }
    })
}

/// One poll: reads the backend, passes health through `tracker`, and
/// publishes the snapshot through `tx` (a failed read keeps the last snapshot
/// and records the error). What the poller thread does every interval; a
/// process that simulates many nodes calls it itself.
pub fn poll_once(backend: &mut dyn GpuBackend, tracker: &mut HealthTracker, tx: &ViewTx) {
    poll_with_ids(backend, tracker, tx, None);
}

fn poll_with_ids(
    backend: &mut dyn GpuBackend,
    tracker: &mut HealthTracker,
    tx: &ViewTx,
    registry: Option<&Registry>,
) {
    match snapshot(backend) {
        Ok(mut snap) => {
            if let Some(r) = registry {
                r.stabilize_snapshot(&mut snap, is_fallback_id);
            }
            tracker.apply(&mut snap, Instant::now());
            tx.send_modify(|v| {
                v.snapshot = snap;
                v.ready = true;
                v.error = None;
            });
        }
        Err(e) => {
            tracing::warn!(error = %e, "reading the GPUs failed; keeping the last state");
            tx.send_modify(|v| v.error = Some(e.to_string()));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::fake::FakeBackend;
    use crate::backend::health::HealthPolicy;

    #[test]
    fn the_poller_publishes_snapshots_and_stops() {
        let (tx, mut rx) = channel("fake");
        let stop = Arc::new(AtomicBool::new(false));
        let backend = Box::new(FakeBackend::new("2xL4-24GiB").unwrap());
        let handle = spawn_poller(
            backend,
            HealthTracker::new(HealthPolicy::default()),
            Duration::from_millis(10),
            tx,
            stop.clone(),
        );
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .unwrap();
        rt.block_on(async {
            tokio::time::timeout(Duration::from_secs(5), rx.wait_for(|v| v.ready))
                .await
                .unwrap()
                .unwrap();
        });
        let view = rx.borrow().clone();
        assert_eq!(view.health().len(), 2);
        assert!(view.health().iter().all(|(_, ok)| *ok));
        stop.store(true, Ordering::Relaxed);
        handle.join().unwrap();
    }

    /// A backend whose second device can no longer tell its UUID.
    struct LostUuid(FakeBackend);

    impl GpuBackend for LostUuid {
        fn name(&self) -> &str {
            "lost"
        }

        fn devices(
            &mut self,
        ) -> Result<Vec<crate::backend::DeviceInfo>, crate::backend::BackendError> {
            let mut devices = self.0.devices()?;
            devices[1].id = crate::backend::nvml::fallback_id(1);
            devices[1].pci_bus_id.clear();
            Ok(devices)
        }

        fn telemetry(
            &mut self,
            _: &crate::backend::DeviceInfo,
        ) -> Result<crate::backend::Telemetry, crate::backend::BackendError> {
            Ok(crate::backend::Telemetry {
                memory_free_bytes: 1 << 30,
                ..Default::default()
            })
        }

        fn health(
            &mut self,
            d: &crate::backend::DeviceInfo,
        ) -> Result<RawHealth, crate::backend::BackendError> {
            Ok(if is_fallback_id(&d.id) {
                RawHealth::Unhealthy("GPU is lost".into())
            } else {
                RawHealth::Healthy
            })
        }

        fn links(
            &mut self,
            devices: &[crate::backend::DeviceInfo],
        ) -> Result<Vec<crate::backend::DeviceLink>, crate::backend::BackendError> {
            self.0.links(devices)
        }
    }

    #[test]
    fn a_lost_gpu_keeps_the_id_the_registry_knew() {
        let mut fake = FakeBackend::new("2xH100-80GiB").unwrap();
        let known = fake.devices().unwrap();
        let registry = Registry::new(known.clone());
        let (tx, mut rx) = channel("lost");
        let stop = Arc::new(AtomicBool::new(false));
        let handle = spawn_poller_with_ids(
            Box::new(LostUuid(fake)),
            HealthTracker::new(HealthPolicy::default()),
            Duration::from_millis(10),
            tx,
            stop.clone(),
            Some(registry),
        );
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .unwrap();
        rt.block_on(async {
            tokio::time::timeout(Duration::from_secs(5), rx.wait_for(|v| v.ready))
                .await
                .unwrap()
                .unwrap();
        });
        stop.store(true, Ordering::Relaxed);
        handle.join().unwrap();
        let view = rx.borrow().clone();
        // The same ID as before, reported unhealthy: kubelet and the
        // controller see the device they know go bad, not a new one.
        assert_eq!(
            view.health(),
            [(known[0].id.clone(), true), (known[1].id.clone(), false)]
        );
        let state = view.snapshot.to_gpu_state(None);
        state.validate().unwrap();
        assert!(
            state.links.iter().all(|l| !is_fallback_id(&l.b)),
            "{:?}",
            state.links
        );
    }
}
