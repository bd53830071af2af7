//! [`BindingIndex`]: the ledger of the node's pods and their allocations
//! behind a lock, fed pod by pod (by the pod watch, or directly in tests)
//! and asked by the device plugin as its [`Binder`]. After every change it
//! logs what changed, updates the device view and writes the checkpoint,
//! all outside the lock.

use std::collections::BTreeMap;
use std::future::Future;
use std::path::Path;
use std::pin::Pin;
use std::sync::{Mutex, MutexGuard, OnceLock, PoisonError};

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::jiff::Timestamp;
use tokio::sync::watch;

use super::Binder;
use super::catch_up::NodePods;
use super::changes::CheckpointChange;
use super::checkpoint::{Checkpoint, CheckpointError, CheckpointWriter, load_checkpoint};
use super::config::BindingConfig;
use super::ledger::Ledger;
use super::pods::{PodInfo, pod_info, pod_key};
use super::view::AllocatedView;
use crate::agent::state::ViewTx;
use crate::process::state_file::set_aside_text;

/// A planned binding still waiting for its devices.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PendingBinding {
    pub uid: String,
    /// `namespace/name`.
    pub pod: String,
    /// The planned devices, in the annotation's order.
    pub devices: Vec<String>,
    pub created: Option<Timestamp>,
}

/// The pods on this node with planned devices, and the allocation checkpoint;
/// the device plugin's [`Binder`]. See the module documentation.
pub struct BindingIndex {
    ledger: Mutex<Ledger>,
    resource_name: String,
    /// `None` keeps allocations in memory only.
    writer: Option<CheckpointWriter>,
    synced: watch::Sender<bool>,
    view: AllocatedView,
    /// Where a request the index cannot match looks for pods the watch has
    /// not delivered yet; unset in tests without an API server.
    node_pods: OnceLock<NodePods>,
}

impl std::fmt::Debug for BindingIndex {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter
            .debug_struct("BindingIndex")
            .field("resource_name", &self.resource_name)
            .field("checkpoint", &self.checkpoint_path())
            .field("synced", &self.is_synced())
            .finish_non_exhaustive()
    }
}

impl BindingIndex {
    /// An index with the checkpoint read from `config.checkpoint` (missing:
    /// empty; unreadable: a warning, then empty; corrupt: kept at `.bad`, a
    /// warning naming it, then empty).
    pub fn open(config: BindingConfig) -> Self {
        let checkpoint = config
            .checkpoint
            .as_deref()
            .map(initial_checkpoint)
            .unwrap_or_default();
        Self {
            ledger: Mutex::new(Ledger::new(checkpoint)),
            resource_name: config.resource_name,
            writer: config
                .checkpoint
                .map(|path| CheckpointWriter::new(path, config.sync_writes)),
            synced: watch::channel(false).0,
            view: AllocatedView::default(),
            node_pods: OnceLock::new(),
        }
    }

    /// From now on a kubelet request that matches no known plan is matched
    /// again after listing the pods on `node_name` (see `catch_up`).
    pub fn catch_up_with(&self, client: kube::Client, node_name: &str) {
        if self
            .node_pods
            .set(NodePods::new(client, node_name))
            .is_err()
        {
            tracing::warn!(
                "the binding index already lists pods to catch up; ignoring another source"
            );
        }
    }

    /// Takes in the pods of a fresh list that the index has not heard of;
    /// what it knows already stays (the watch keeps it current).
    pub(crate) fn learn(&self, pods: &[Pod]) {
        let mut ledger = self.lock();
        let mut learned = Vec::new();
        for pod in pods {
            if let Some((uid, info)) = pod_info(pod, &self.resource_name)
                && !ledger.pods.contains_key(&uid)
            {
                learned.push(info.key.clone());
                ledger.pods.insert(uid, info);
            }
        }
        if learned.is_empty() {
            return;
        }
        tracing::info!(pods = ?learned, "kubelet asked before the pod watch delivered these pods; learned them from a fresh list");
        self.tidy_and_save(ledger);
    }

    /// From now on keeps `view`'s `allocated` map equal to
    /// [`Self::allocated_devices`]: sets it at once, then after every change
    /// of the checkpoint. Only the first view attached is kept.
    pub fn keep_view(&self, view: ViewTx) {
        if !self.view.attach(view) {
            tracing::warn!("the binding index already keeps a device view; ignoring another");
            return;
        }
        let (generation, allocated) = {
            let ledger = self.lock();
            (ledger.generation, ledger.handed_out())
        };
        self.view.show(generation, allocated);
    }

    fn lock(&self) -> MutexGuard<'_, Ledger> {
        self.ledger.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Releases the lock and, if `changes` says the checkpoint changed, logs
    /// the changes, updates the view and writes the checkpoint (taken before
    /// the release).
    fn save(&self, mut ledger: MutexGuard<'_, Ledger>, changes: &[CheckpointChange]) {
        if changes.is_empty() {
            return;
        }
        ledger.generation += 1;
        let generation = ledger.generation;
        let encoded = self
            .writer
            .as_ref()
            .map(|_| serde_json::to_vec(&ledger.checkpoint));
        let allocated = self.view.is_attached().then(|| ledger.handed_out());
        drop(ledger);
        for change in changes {
            change.log();
        }
        if let Some(allocated) = allocated {
            self.view.show(generation, allocated);
        }
        let (Some(writer), Some(encoded)) = (&self.writer, encoded) else {
            return;
        };
        match encoded {
            Ok(bytes) => writer.write(generation, &bytes),
            Err(error) => {
                tracing::warn!(error = %error, "cannot encode the allocation checkpoint")
            }
        }
    }

    /// Tidies the ledger after a change of what is known about the pods, and
    /// saves what that changed.
    fn tidy_and_save(&self, mut ledger: MutexGuard<'_, Ledger>) {
        let mut changes = Vec::new();
        ledger.tidy(&mut changes);
        self.save(ledger, &changes);
    }

    /// A pod on this node was added or changed.
    pub fn apply_pod(&self, pod: &Pod) {
        let Some((uid, info)) = pod_info(pod, &self.resource_name) else {
            tracing::debug!(pod = %pod_key(pod), "ignoring a pod without a UID");
            return;
        };
        let mut ledger = self.lock();
        ledger.pods.insert(uid, info);
        self.tidy_and_save(ledger);
    }

    /// Applies the rules no pod event triggers: an `unbound` hold past its
    /// grace that no pod without a binding explains is dropped.
    pub(crate) fn tidy(&self) {
        self.tidy_and_save(self.lock());
    }

    /// A pod left this node (deleted).
    pub fn delete_pod(&self, pod: &Pod) {
        let Some(uid) = pod.metadata.uid.as_deref() else {
            return;
        };
        let mut ledger = self.lock();
        ledger.pods.remove(uid);
        self.tidy_and_save(ledger);
    }

    /// The complete list of pods on this node (the watch's initial list, or a
    /// relist): replaces what was known, and from now on absent pods are gone.
    pub fn resync(&self, pods: impl IntoIterator<Item = Pod>) {
        let pods: BTreeMap<String, PodInfo> = pods
            .into_iter()
            .filter_map(|pod| pod_info(&pod, &self.resource_name))
            .collect();
        let mut ledger = self.lock();
        ledger.pods = pods;
        ledger.synced = true;
        let mut changes = Vec::new();
        ledger.tidy(&mut changes);
        let pending = ledger.pending().count();
        let total = ledger.pods.len();
        self.save(ledger, &changes);
        tracing::info!(
            pods = total,
            pending,
            "pods on this node listed; planned bindings are enforced"
        );
        self.synced.send_replace(true);
    }

    /// Whether the pods on this node have been listed at least once.
    pub fn is_synced(&self) -> bool {
        self.lock().synced
    }

    /// Resolves once the pods on this node have been listed.
    pub async fn synced(&self) {
        let mut listed = self.synced.subscribe();
        let _ = listed.wait_for(|synced| *synced).await;
    }

    /// Pending bindings, oldest first.
    pub fn pending(&self) -> Vec<PendingBinding> {
        let ledger = self.lock();
        let mut pending: Vec<_> = ledger.pending().collect();
        pending.sort_by(|left, right| left.pod.age_key().cmp(&right.pod.age_key()));
        pending
            .into_iter()
            .map(|pending| PendingBinding {
                uid: pending.uid.to_string(),
                pod: pending.pod.key.clone(),
                devices: pending.plan.devices.clone(),
                created: pending.pod.created,
            })
            .collect()
    }

    /// The checkpoint as it is in memory.
    pub fn checkpoint(&self) -> Checkpoint {
        self.lock().checkpoint.clone()
    }

    pub(crate) fn checkpoint_path(&self) -> Option<&Path> {
        self.writer.as_ref().map(CheckpointWriter::path)
    }

    /// Device ID → pod UID (or [`UNBOUND`](super::UNBOUND)) for every
    /// recorded allocation: what [`Self::keep_view`] puts into the device view.
    pub fn allocated_devices(&self) -> BTreeMap<String, String> {
        self.lock().allocated_map()
    }
}

/// The checkpoint at `path` as the index starts from it: a missing,
/// unreadable or corrupt file gives an empty one (a corrupt one kept aside).
fn initial_checkpoint(path: &Path) -> Checkpoint {
    match load_checkpoint(path) {
        Ok(Some(checkpoint)) => {
            tracing::info!(path = %path.display(), pods = checkpoint.pods.len(), unbound = checkpoint.unbound.len(), "allocation checkpoint loaded");
            checkpoint
        }
        Ok(None) => {
            tracing::info!(path = %path.display(), "no allocation checkpoint yet; starting empty");
            Checkpoint::default()
        }
        Err(error @ CheckpointError::Invalid { .. }) => {
            let kept = set_aside_text(path);
            tracing::warn!(error = %error, "ignoring the allocation checkpoint ({kept}); starting empty");
            Checkpoint::default()
        }
        Err(error) => {
            tracing::warn!(error = %error, "ignoring the allocation checkpoint; starting empty");
            Checkpoint::default()
        }
    }
}

impl Binder for BindingIndex {
    fn keeps_allocated_view(&self) -> bool {
        self.view.is_attached()
    }

    fn planned_for(
        &self,
        available: &[String],
        must_include: &[String],
        size: usize,
    ) -> Option<Vec<String>> {
        let preference = self.lock().preferred_plan(available, must_include, size)?;
        if preference.candidates > 1 {
            tracing::debug!(pod = %preference.pod, candidates = preference.candidates, "several pending bindings fit; preferring the oldest");
        }
        Some(preference.devices)
    }

    fn expects(&self, requested: &[String]) -> bool {
        self.lock().expects(requested)
    }

    fn catch_up(&self) -> Pin<Box<dyn Future<Output = ()> + Send + '_>> {
        Box::pin(async move {
            if let Some(node_pods) = self.node_pods.get()
                && let Some(pods) = node_pods.list().await
            {
                self.learn(&pods);
            }
        })
    }

    fn check_allocate(&self, requested: &[String]) -> Result<(), String> {
        let mut ledger = self.lock();
        match ledger.check(requested) {
            Ok(change) => {
                self.save(ledger, change.as_slice());
                Ok(())
            }
            Err(refusal) => {
                drop(ledger);
                tracing::warn!(devices = ?requested, reason = %refusal, "refusing an allocation");
                // Kubelet shows this text as the reason the container failed.
                Err(refusal.to_string())
            }
        }
    }
}
