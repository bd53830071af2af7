//! The agent's live view of its devices, shared by the device plugin, the
//! node state publisher and the HTTP endpoints through a `watch` channel: the
//! poller replaces the snapshot, the device plugin records allocations, and
//! every consumer sees the latest view and decides for itself what changed.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use tokio::sync::watch;

use crate::backend::health::HealthTracker;
use crate::backend::{GpuBackend, RawHealth, Snapshot, snapshot};

#[derive(Clone, Debug, PartialEq)]
pub struct DeviceView {
    /// The latest snapshot, health already through the health tracker.
    pub snapshot: Snapshot,
    /// Devices handed out to containers: device ID → pod UID.
    pub allocated: BTreeMap<String, String>,
    /// Set once the first snapshot has been read.
    pub ready: bool,
    /// The last backend error, if the latest poll failed (the snapshot is then
    /// the last good one).
    pub error: Option<String>,
}

impl DeviceView {
    pub fn empty(backend: &str) -> Self {
        Self {
            snapshot: Snapshot {
                backend: backend.to_string(),
                devices: Vec::new(),
                links: Vec::new(),
            },
            allocated: BTreeMap::new(),
            ready: false,
            error: None,
        }
    }

    /// `(device ID, healthy)` in device order: what kubelet needs to know.
    pub fn health(&self) -> Vec<(String, bool)> {
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
    mut backend: Box<dyn GpuBackend>,
    mut tracker: HealthTracker,
    interval: Duration,
    tx: ViewTx,
    stop: Arc<AtomicBool>,
) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        while !stop.load(Ordering::Relaxed) {
            let started = Instant::now();
            match snapshot(backend.as_mut()) {
                Ok(mut snap) => {
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
}
