//! The simulated node agents, all in this process: per node the simulated
//! GPUs, the agent's health tracker and device view, and the agent's real
//! publisher (`run_publisher`) writing to the node's Node object. One task
//! polls every node once per poll interval with the agent's own poll step
//! (`poll_once`), spread evenly over the interval as independent agents
//! would be. With DRA each node also runs the agent's real ResourceSlice
//! publisher (`run_slice_publisher`) over the same view.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use kube::Client;
use tessera::agent::dra::device_names::device_names;
use tessera::agent::dra::slice_publisher::{SliceStats, run_slice_publisher};
use tessera::agent::publisher::{PublisherConfig, PublisherStats, WriteCause, run_publisher};
use tessera::agent::state::{ViewTx, channel, poll_once};
use tessera::api::NodeGpuState;
use tessera::backend::health::{HealthPolicy, HealthTracker};
use tokio::sync::watch;
use tokio::time::Instant;

use crate::gpus::{KINDS, SimGpus};
use crate::support::SplitMix64;

/// Polls per interval are done in slices this far apart.
const POLL_SLICE: Duration = Duration::from_millis(10);

struct SimNode {
    name: String,
    gpus: Mutex<SimGpus>,
    tracker: Mutex<HealthTracker>,
    tx: ViewTx,
    stats: Arc<PublisherStats>,
    slice_stats: Arc<SliceStats>,
}

pub(crate) struct Fleet {
    nodes: Vec<SimNode>,
    by_name: HashMap<String, usize>,
}

impl Fleet {
    /// Node kinds drawn from the benchmark mix with `seed`.
    pub(crate) fn new(names: &[String], seed: u64) -> Self {
        let mut rng = SplitMix64::new(seed);
        let nodes: Vec<SimNode> = names
            .iter()
            .map(|name| {
                let kind = rng.weighted(&KINDS);
                let (tx, _) = channel("fake");
                SimNode {
                    name: name.clone(),
                    gpus: Mutex::new(SimGpus::new(name, kind, rng.next_u64())),
                    tracker: Mutex::new(HealthTracker::new(HealthPolicy::default())),
                    tx,
                    stats: Arc::new(PublisherStats::default()),
                    slice_stats: Arc::new(SliceStats::default()),
                }
            })
            .collect();
        let by_name = names
            .iter()
            .enumerate()
            .map(|(index, name)| (name.clone(), index))
            .collect();
        Self { nodes, by_name }
    }

    pub(crate) fn len(&self) -> usize {
        self.nodes.len()
    }

    pub(crate) fn contains(&self, node: &str) -> bool {
        self.by_name.contains_key(node)
    }

    /// GPU kind of each node, counted.
    pub(crate) fn kinds(&self) -> Vec<(&'static str, usize)> {
        let mut counts: Vec<(&'static str, usize)> = Vec::new();
        for node in &self.nodes {
            let name = lock(&node.gpus).kind().name;
            match counts.iter_mut().find(|(kind, _)| *kind == name) {
                Some(entry) => entry.1 += 1,
                None => counts.push((name, 1)),
            }
        }
        counts
    }

    /// Starts every node's publisher; they stop when `stop` turns true.
    /// Node `i` writes through `clients[i]`.
    pub(crate) fn start_publishers(
        &self,
        clients: &[Client],
        min_interval: Option<Duration>,
        stop: &watch::Receiver<bool>,
    ) {
        for (index, node) in self.nodes.iter().enumerate() {
            let mut config = PublisherConfig::new(node.name.clone());
            if let Some(interval) = min_interval {
                config.min_interval = interval;
            }
            let mut stop = stop.clone();
            tokio::spawn(run_publisher(
                clients[index].clone(),
                config,
                node.tx.subscribe(),
                Arc::clone(&node.stats),
                async move {
                    let _ = stop.wait_for(|stopped| *stopped).await;
                },
            ));
        }
    }

    /// Starts every node's ResourceSlice publisher for `driver` (clients as
    /// for `start_publishers`); they stop when `stop` turns true.
    pub(crate) fn start_slice_publishers(
        &self,
        clients: &[Client],
        driver: &str,
        stop: &watch::Receiver<bool>,
    ) {
        for (index, node) in self.nodes.iter().enumerate() {
            let mut stop = stop.clone();
            tokio::spawn(run_slice_publisher(
                clients[index].clone(),
                driver.to_string(),
                node.name.clone(),
                (node.tx.subscribe(), Arc::clone(&node.tx)),
                false,
                Arc::clone(&node.slice_stats),
                async move {
                    let _ = stop.wait_for(|stopped| *stopped).await;
                },
            ));
        }
    }

    /// The memory of the fleet's largest GPU.
    pub(crate) fn largest_gpu_bytes(&self) -> u64 {
        self.nodes
            .iter()
            .map(|node| lock(&node.gpus).kind().memory_bytes())
            .max()
            .unwrap_or(0)
    }

    /// Slices written and failed attempts, summed over the fleet, and how
    /// many nodes have published their pool.
    pub(crate) fn slices_published(&self) -> (u64, u64, usize) {
        self.nodes
            .iter()
            .fold((0, 0, 0), |(writes, errors, pools), node| {
                (
                    writes + node.slice_stats.writes(),
                    errors + node.slice_stats.errors(),
                    pools + usize::from(node.slice_stats.generation() > 0),
                )
            })
    }

    /// The device ID a node's slices publish under `name`, as a kubelet's
    /// driver reads an allocation back.
    pub(crate) fn device_id(&self, node: &str, name: &str) -> Option<String> {
        let &index = self.by_name.get(node)?;
        let view = self.nodes[index].tx.borrow();
        let ids: Vec<&str> = view
            .snapshot
            .devices
            .iter()
            .map(|device| device.info.id.as_str())
            .collect();
        device_names(ids)
            .into_iter()
            .find_map(|(id, device)| (device == name).then_some(id))
    }

    /// Drifts and polls every node once per `interval`, until dropped.
    pub(crate) async fn poll_forever(self: Arc<Self>, interval: Duration) {
        let slices = (interval.as_millis() / POLL_SLICE.as_millis()).max(1) as usize;
        let per_slice = self.nodes.len().div_ceil(slices);
        let mut tick = tokio::time::interval(POLL_SLICE);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            for slice in self.nodes.chunks(per_slice.max(1)) {
                tick.tick().await;
                for node in slice {
                    let mut gpus = lock(&node.gpus);
                    gpus.drift();
                    poll_once(&mut *gpus, &mut lock(&node.tracker), &node.tx);
                }
            }
        }
    }

    /// Polls one node now (a fault then shows without waiting for its turn).
    fn poll_now(&self, index: usize) {
        let node = &self.nodes[index];
        poll_once(&mut *lock(&node.gpus), &mut lock(&node.tracker), &node.tx);
    }

    /// Whether `state` (a Node's published annotation) says what the node's
    /// agent knows now: the same allocations and the same health per device.
    pub(crate) fn published_matches(&self, node: &str, state: &NodeGpuState) -> bool {
        let Some(&index) = self.by_name.get(node) else {
            return false;
        };
        let view = self.nodes[index].tx.borrow().clone();
        let now = view.snapshot.to_gpu_state(None);
        let health = |devices: &[tessera::api::GpuDevice]| -> Vec<(String, String)> {
            devices
                .iter()
                .map(|d| (d.id.clone(), format!("{:?}", d.health)))
                .collect()
        };
        state.allocated == view.allocated && health(&state.devices) == health(&now.devices)
    }

    /// Patches the API server accepted, summed over the fleet, and failures.
    pub(crate) fn published(&self) -> (u64, u64) {
        self.nodes.iter().fold((0, 0), |(ok, failed), node| {
            (ok + node.stats.published(), failed + node.stats.errors())
        })
    }

    /// Patches sent by cause (in `WriteCause::ALL` order), summed over the
    /// fleet; the shortest time a drift patch followed its node's previous
    /// patch, as sent; how many nodes sent one sooner than `interval`.
    pub(crate) fn sent(&self, interval: Duration) -> ([u64; 4], Option<Duration>, usize) {
        let mut sent = [0; 4];
        let (mut shortest, mut early) = (None::<Duration>, 0);
        for node in &self.nodes {
            for (total, cause) in sent.iter_mut().zip(WriteCause::ALL) {
                *total += node.stats.sent(cause);
            }
            if let Some(gap) = node.stats.shortest_drift_gap() {
                shortest = Some(shortest.map_or(gap, |s| s.min(gap)));
                early += usize::from(gap < interval);
            }
        }
        (sent, shortest, early)
    }

    fn published_by(&self, index: usize) -> u64 {
        self.nodes[index].stats.published()
    }

    /// What a device plugin records on Allocate: the devices held by the pod,
    /// and the model loaded into their memory. Returns a waiter for the write
    /// that carries it.
    pub(crate) fn allocate(
        &self,
        node: &str,
        devices: &[String],
        pod_uid: &str,
    ) -> Option<PublishWait> {
        let &index = self.by_name.get(node)?;
        let before = self.published_by(index);
        let sim = &self.nodes[index];
        {
            let mut gpus = lock(&sim.gpus);
            for device in devices {
                gpus.load(device, 0.6);
            }
        }
        sim.tx.send_modify(|view| {
            for device in devices {
                view.allocated.insert(device.clone(), pod_uid.to_string());
            }
        });
        Some(PublishWait {
            index,
            before,
            since: Instant::now(),
        })
    }

    /// The pod is gone: its devices are free and unloaded.
    pub(crate) fn release(&self, node: &str, pod_uid: &str) {
        let Some(&index) = self.by_name.get(node) else {
            return;
        };
        let sim = &self.nodes[index];
        let mut freed = Vec::new();
        sim.tx.send_if_modified(|view| {
            let before = view.allocated.len();
            view.allocated.retain(|device, uid| {
                let keep = uid != pod_uid;
                if !keep {
                    freed.push(device.clone());
                }
                keep
            });
            view.allocated.len() != before
        });
        let mut gpus = lock(&sim.gpus);
        for device in freed {
            gpus.load(&device, 0.0);
        }
    }

    /// Sets or clears a device fault and polls the node at once, as the
    /// backend's event stream would report an Xid. Returns a waiter for the
    /// write that carries it.
    pub(crate) fn fault(
        &self,
        node: &str,
        device: &str,
        fault: Option<String>,
    ) -> Option<PublishWait> {
        let &index = self.by_name.get(node)?;
        let before = self.published_by(index);
        let since = Instant::now();
        lock(&self.nodes[index].gpus).set_fault(device, fault);
        self.poll_now(index);
        Some(PublishWait {
            index,
            before,
            since,
        })
    }

    /// How long after `wait.since` the node's next write was accepted
    /// (`None` after `limit`).
    pub(crate) async fn published_after(
        &self,
        wait: &PublishWait,
        limit: Duration,
    ) -> Option<Duration> {
        loop {
            if self.published_by(wait.index) > wait.before {
                return Some(wait.since.elapsed());
            }
            if wait.since.elapsed() > limit {
                return None;
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    }
}

/// A change made to one node's view, waiting for the write that carries it.
pub(crate) struct PublishWait {
    index: usize,
    before: u64,
    since: Instant,
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}
