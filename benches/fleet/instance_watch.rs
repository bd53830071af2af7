//! The run's ModelInstances as a user watching them sees them: every status
//! the controller writes, so that a move that lowers an instance's ready
//! replicas, even for one write, is caught; the moves in flight; and what an
//! instance waiting for room is told.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

use futures::TryStreamExt;
use kube::runtime::reflector::{self, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, ResourceExt};
use tessera::api::ModelInstance;
use tokio::task::JoinHandle;

/// What the status writes showed about ready replicas.
#[derive(Clone, Debug, Default)]
pub(crate) struct ReadyRecord {
    /// Writes seen while the instance had a move in flight.
    pub(crate) writes_moving: u64,
    /// Writes whose ready replicas were fewer than an earlier write of the
    /// same instance said: one line each.
    pub(crate) drops: Vec<String>,
    /// Moves seen recorded in a status (by instance and start time).
    pub(crate) moves_seen: usize,
}

#[derive(Default)]
struct Tally {
    record: ReadyRecord,
    /// By instance UID: the most ready replicas any write said.
    most_ready: HashMap<String, u32>,
    /// Moves seen, by instance UID, replica and start.
    moves: std::collections::HashSet<(String, u32, String)>,
}

pub(crate) struct InstanceWatch {
    store: Store<ModelInstance>,
    tally: Arc<Mutex<Tally>>,
    task: JoinHandle<()>,
}

impl InstanceWatch {
    /// Watches `api` until dropped; returns once the first list is in.
    pub(crate) async fn start(api: Api<ModelInstance>) -> Self {
        let (store, writer) = reflector::store();
        let tally = Arc::new(Mutex::new(Tally::default()));
        let seen = Arc::clone(&tally);
        let task = tokio::spawn(async move {
            let stream = tessera::kubernetes::watch_backoff::with_backoff(
                "model instances (benchmark)",
                reflector::reflector(writer, watcher(api, watcher::Config::default())),
            )
            .applied_objects();
            let mut stream = std::pin::pin!(stream);
            loop {
                match stream.try_next().await {
                    Ok(Some(mi)) => lock(&seen).saw(&mi),
                    Ok(None) => return,
                    Err(e) => eprintln!("model instance watch: {e}"),
                }
            }
        });
        let _ = store.wait_until_ready().await;
        Self { store, tally, task }
    }

    pub(crate) fn get(&self, name: &str) -> Option<Arc<ModelInstance>> {
        self.store
            .state()
            .into_iter()
            .find(|mi| mi.name_any() == name)
    }

    /// Instances with a move in flight now.
    pub(crate) fn moving(&self) -> usize {
        self.store
            .state()
            .iter()
            .filter(|mi| mi.status.as_ref().is_some_and(|s| !s.moves.is_empty()))
            .count()
    }

    pub(crate) fn record(&self) -> ReadyRecord {
        lock(&self.tally).record.clone()
    }
}

impl Drop for InstanceWatch {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Tally {
    fn saw(&mut self, mi: &ModelInstance) {
        // An instance being deleted loses its pods; that is no move's doing.
        if mi.metadata.deletion_timestamp.is_some() {
            return;
        }
        let Some(status) = &mi.status else {
            return;
        };
        let uid = mi.uid().unwrap_or_default();
        if !status.moves.is_empty() {
            self.record.writes_moving += 1;
        }
        for m in &status.moves {
            if self
                .moves
                .insert((uid.clone(), m.replica, m.started.clone()))
            {
                self.record.moves_seen += 1;
            }
        }
        let most = self.most_ready.entry(uid).or_default();
        if status.ready_replicas < *most {
            self.record.drops.push(format!(
                "{}: {} ready replicas after {} ({} moves in flight)",
                mi.name_any(),
                status.ready_replicas,
                most,
                status.moves.len()
            ));
        }
        *most = (*most).max(status.ready_replicas);
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}
