//! Planned bindings: the controller binds each shard pod to this node with the
//! annotation `tessera.dev/devices` naming the devices it was planned on, and
//! this module makes kubelet hand out exactly those devices.
//!
//! [`BindingIndex`] holds what the agent knows about the pods on its node (fed
//! by [`run_pod_watch`], or directly in tests) and the allocation checkpoint,
//! and implements [`Binder`] for the device plugin:
//!
//! - **pending** bindings are pods on this node with a devices annotation that
//!   have no allocation recorded yet, are not finished (phase Succeeded or
//!   Failed), not being deleted and not yet running;
//! - [`Binder::planned_for`] answers kubelet's preferred-allocation question
//!   with the plan of the **oldest** pending pod (creation time, then
//!   `namespace/name`) that fits the request (all planned devices available,
//!   every must-include device planned, `size` devices) and whose devices are
//!   not recorded as in use;
//! - [`Binder::check_allocate`] accepts a request equal (as a set) to a
//!   pending plan and records it; refuses one that overlaps a pending plan
//!   without equalling it, naming the pod and both device sets, so the pod
//!   fails admission and the controller re-places it; accepts one that
//!   overlaps no plan (a pod without a binding) and records it under
//!   `unbound`; and refuses devices recorded for another live pod.
//!
//! Kubelet does not say which pod it is admitting, so a request is matched to
//! a plan by its devices alone. Kubelet admits pods oldest first, hence the
//! oldest-first rule. Two pending pods with plans of the same size on one
//! node could still be confused if kubelet admitted the younger one first;
//! the controller never lets that arise (it binds the next such pod to a node
//! only once this agent reports the previous one's devices allocated).
//!
//! ## The checkpoint
//!
//! A small JSON file (default [`DEFAULT_CHECKPOINT_PATH`]; written compact,
//! shown indented here):
//!
//! ```json
//! {
//!   "version": 1,
//!   "pods": {
//!     "<pod uid>": { "pod": "team-a/llama-70b-shard-1", "devices": ["GPU-a", "GPU-b"],
//!                    "time": "2025-06-01T12:00:00Z" }
//!   },
//!   "unbound": [ { "pod": "", "devices": ["GPU-c"], "time": "2025-06-01T12:01:00Z" } ]
//! }
//! ```
//!
//! It is rewritten atomically (temporary file, then rename) after every
//! change, outside the index lock, and read once at start; a missing file is
//! an empty checkpoint and an unreadable or corrupt one is logged and ignored.
//! Until the pod watch has listed the node's pods once, every recorded
//! allocation counts as live; afterwards an entry goes away when its pod is
//! gone from the node or finished. `unbound` entries cannot be tied to a pod:
//! they are dropped oldest first (once two minutes old) while they hold more
//! devices than the live pods without a binding ask for (all of them once
//! there are none), and a device handed out again without a binding leaves
//! its older entry. While recorded they keep planned pods off those devices.
//!
//! ## The device view
//!
//! Once attached with [`BindingIndex::keep_view`], the index keeps the device
//! view's `allocated` map (which the publisher puts on the Node) equal to
//! [`BindingIndex::allocated_devices`]: it is set when attached and again,
//! before the checkpoint is written, after every change of the checkpoint —
//! an allocation, or the pod watch seeing a pod end. The device plugin then
//! leaves the map alone ([`Binder::keeps_allocated_view`]).

use std::collections::{BTreeMap, HashSet};
use std::future::Future;
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, PoisonError};

use k8s_openapi::api::core::v1::{Container, Pod};
use k8s_openapi::jiff::Timestamp;
use kube::api::Api;
use kube::runtime::WatchStreamExt;
use kube::runtime::watcher::{self, Event};
use serde::{Deserialize, Serialize};
use tokio::sync::watch;
use tokio_stream::StreamExt;

use super::plugin::Binder;
use super::state::ViewTx;
use crate::api::{DEFAULT_RESOURCE_NAME, DEVICES_ANNOTATION};

/// Where the agent keeps its allocation checkpoint unless told otherwise.
pub const DEFAULT_CHECKPOINT_PATH: &str = "/var/lib/tessera/checkpoint.json";
/// The checkpoint format written and understood.
pub const CHECKPOINT_VERSION: u32 = 1;
/// An `unbound` entry this young is kept even when no pod seems to ask for
/// it: the pod may simply not have reached the watch yet.
const UNBOUND_GRACE_SECS: i64 = 120;
/// The owner [`BindingIndex::allocated_devices`] gives devices recorded under `unbound`.
pub const UNBOUND: &str = crate::api::NodeGpuState::UNBOUND_OWNER;

/// How a [`BindingIndex`] keeps its checkpoint and which resource it serves.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BindingConfig {
    /// The checkpoint file; `None` keeps allocations in memory only.
    pub checkpoint: Option<PathBuf>,
    /// The extended resource the plugin serves: pods without a binding that
    /// ask for it may hold `unbound` devices.
    pub resource_name: String,
    /// Flush the checkpoint's contents to disk before the rename on every
    /// write. Without it a write survives an agent crash, but a power loss
    /// may leave an empty or torn file (then ignored, with a warning).
    pub sync_writes: bool,
}

impl Default for BindingConfig {
    fn default() -> Self {
        Self {
            checkpoint: Some(PathBuf::from(DEFAULT_CHECKPOINT_PATH)),
            resource_name: DEFAULT_RESOURCE_NAME.to_string(),
            sync_writes: true,
        }
    }
}

impl BindingConfig {
    /// A checkpoint at `path`, the default resource, synced writes.
    pub fn at(path: impl Into<PathBuf>) -> Self {
        Self {
            checkpoint: Some(path.into()),
            ..Self::default()
        }
    }

    /// No checkpoint file.
    pub fn in_memory() -> Self {
        Self {
            checkpoint: None,
            ..Self::default()
        }
    }
}

/// Devices handed to one pod (or, under `unbound`, to a pod without a binding).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Allocation {
    /// `namespace/name`; empty under `unbound`.
    #[serde(default)]
    pub pod: String,
    pub devices: Vec<String>,
    /// When it was recorded (RFC 3339).
    #[serde(default)]
    pub time: String,
}

/// The checkpoint file's contents.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Checkpoint {
    pub version: u32,
    /// Pod UID → its allocation.
    #[serde(default)]
    pub pods: BTreeMap<String, Allocation>,
    /// Allocations that matched no planned binding, oldest first.
    #[serde(default)]
    pub unbound: Vec<Allocation>,
}

impl Default for Checkpoint {
    fn default() -> Self {
        Self {
            version: CHECKPOINT_VERSION,
            pods: BTreeMap::new(),
            unbound: Vec::new(),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    #[error("reading {path}: {source}")]
    Read { path: String, source: io::Error },
    #[error("{path} is not a valid checkpoint: {reason}")]
    Invalid { path: String, reason: String },
}

/// Reads a checkpoint: `Ok(None)` when the file does not exist.
pub fn load_checkpoint(path: &Path) -> Result<Option<Checkpoint>, CheckpointError> {
    let bytes = match std::fs::read(path) {
        Ok(b) => b,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(source) => {
            return Err(CheckpointError::Read {
                path: path.display().to_string(),
                source,
            });
        }
    };
    let invalid = |reason: String| CheckpointError::Invalid {
        path: path.display().to_string(),
        reason,
    };
    let mut checkpoint: Checkpoint =
        serde_json::from_slice(&bytes).map_err(|e| invalid(e.to_string()))?;
    if checkpoint.version != CHECKPOINT_VERSION {
        return Err(invalid(format!(
            "version {} (this agent understands {CHECKPOINT_VERSION})",
            checkpoint.version
        )));
    }
    checkpoint.pods.retain(|uid, a| {
        let keep = !uid.is_empty() && !a.devices.is_empty();
        if !keep {
            tracing::warn!(path = %path.display(), uid = %uid, "skipping a checkpoint entry without a pod UID or devices");
        }
        keep
    });
    checkpoint.unbound.retain(|a| !a.devices.is_empty());
    Ok(Some(checkpoint))
}

/// Writes `bytes` to `path` through a temporary file and a rename, creating
/// the directory if needed.
fn write_atomically(path: &Path, bytes: &[u8], sync: bool) -> io::Result<()> {
    let dir = path
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir)?;
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(".tmp");
    let tmp = dir.join(name);
    {
        let mut file = std::fs::File::create(&tmp)?;
        file.write_all(bytes)?;
        if sync {
            // The new contents reach the disk before the rename can, so a
            // power loss leaves the old file or the new one, never a torn one.
            // The directory is not synced: losing the rename itself only
            // brings back the previous (consistent) checkpoint.
            file.sync_data()?;
        }
    }
    std::fs::rename(&tmp, path)
}

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

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    /// Pending, or no status yet: not started.
    Waiting,
    Running,
    /// Succeeded or Failed: holds no devices.
    Finished,
    Unknown,
}

/// What the index keeps of one pod on the node.
#[derive(Clone, Debug)]
struct PodInfo {
    key: String,
    created: Option<Timestamp>,
    phase: Phase,
    deleting: bool,
    /// Planned devices in annotation order, and the same sorted without duplicates.
    plan: Option<(Vec<String>, Vec<String>)>,
    /// Devices of our resource the pod asks for.
    wants: u64,
}

impl PodInfo {
    fn live(&self) -> bool {
        self.phase != Phase::Finished
    }

    fn pending(&self) -> bool {
        self.plan.is_some() && self.phase == Phase::Waiting && !self.deleting
    }

    /// A pod without a binding that may use (or be about to use) our devices.
    fn ordinary_user(&self) -> bool {
        self.plan.is_none() && self.live() && self.wants > 0
    }

    /// Oldest first: creation time (unknown last), then `namespace/name`.
    fn age_key(&self) -> (bool, Option<Timestamp>, &str) {
        (self.created.is_none(), self.created, &self.key)
    }
}

/// The number of devices of `resource` a pod asks for: its app containers
/// together, or its largest init container if that is more.
fn devices_wanted(pod: &Pod, resource: &str) -> u64 {
    let of = |c: &Container| -> u64 {
        let Some(r) = &c.resources else { return 0 };
        let q = r
            .limits
            .as_ref()
            .and_then(|l| l.get(resource))
            .or_else(|| r.requests.as_ref().and_then(|l| l.get(resource)));
        q.and_then(|q| q.0.trim().parse::<u64>().ok()).unwrap_or(0)
    };
    let Some(spec) = &pod.spec else { return 0 };
    let apps: u64 = spec.containers.iter().map(of).sum();
    let init = spec
        .init_containers
        .iter()
        .flatten()
        .map(of)
        .max()
        .unwrap_or(0);
    apps.max(init)
}

/// Comma-separated device IDs; `None` when there are none.
fn parse_plan(value: &str) -> Option<Vec<String>> {
    let mut seen = HashSet::new();
    let plan: Vec<String> = value
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty() && seen.insert(*s))
        .map(str::to_string)
        .collect();
    (!plan.is_empty()).then_some(plan)
}

fn pod_key(pod: &Pod) -> String {
    format!(
        "{}/{}",
        pod.metadata.namespace.as_deref().unwrap_or("default"),
        pod.metadata.name.as_deref().unwrap_or("")
    )
}

fn pod_info(pod: &Pod, resource: &str) -> Option<(String, PodInfo)> {
    let uid = pod.metadata.uid.clone().filter(|u| !u.is_empty())?;
    let key = pod_key(pod);
    let phase = match pod.status.as_ref().and_then(|s| s.phase.as_deref()) {
        None | Some("Pending") => Phase::Waiting,
        Some("Running") => Phase::Running,
        Some("Succeeded" | "Failed") => Phase::Finished,
        Some(_) => Phase::Unknown,
    };
    let plan = pod
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(DEVICES_ANNOTATION));
    let plan = match plan.map(|p| (p, parse_plan(p))) {
        None => None,
        Some((_, Some(plan))) => {
            let mut sorted = plan.clone();
            sorted.sort();
            Some((plan, sorted))
        }
        Some((raw, None)) => {
            tracing::warn!(pod = %key, value = %raw, "ignoring a {DEVICES_ANNOTATION} annotation that names no device");
            None
        }
    };
    Some((
        uid,
        PodInfo {
            key,
            created: pod.metadata.creation_timestamp.as_ref().map(|t| t.0),
            phase,
            deleting: pod.metadata.deletion_timestamp.is_some(),
            plan,
            wants: devices_wanted(pod, resource),
        },
    ))
}

/// `[a, b]`.
fn show(devices: &[String]) -> String {
    format!("[{}]", devices.join(", "))
}

/// Whether two sorted, duplicate-free lists share an element.
fn overlaps(a: &[String], b: &[String]) -> bool {
    let (mut i, mut j) = (0, 0);
    while i < a.len() && j < b.len() {
        match a[i].cmp(&b[j]) {
            std::cmp::Ordering::Less => i += 1,
            std::cmp::Ordering::Greater => j += 1,
            std::cmp::Ordering::Equal => return true,
        }
    }
    false
}

fn sorted_set(devices: &[String]) -> Vec<String> {
    let mut v = devices.to_vec();
    v.sort();
    v.dedup();
    v
}

fn now() -> String {
    Timestamp::now().to_string()
}

/// A change to the checkpoint, logged once the lock is released.
enum Note {
    Forgot(String, String, Vec<String>),
    Adopted(String, Vec<String>),
    ForgotUnbound(Vec<String>),
    Resolved(String, Vec<String>),
    Allocated(String, Vec<String>),
    AllocatedUnbound(Vec<String>),
}

impl Note {
    fn log(&self) {
        match self {
            Note::Forgot(pod, uid, devices) => {
                tracing::info!(pod = %pod, uid = %uid, devices = ?devices, "pod is gone; forgetting its allocation")
            }
            Note::Adopted(pod, devices) => {
                tracing::info!(pod = %pod, devices = ?devices, "a running bound pod has no recorded allocation; recording its planned devices")
            }
            Note::Resolved(pod, devices) => {
                tracing::info!(pod = %pod, devices = ?devices, "devices allocated before the pod's binding was seen were this pod's; recording them for it")
            }
            Note::ForgotUnbound(devices) => {
                tracing::info!(devices = ?devices, "no pod without a binding can still hold these devices; forgetting them")
            }
            Note::Allocated(pod, devices) => {
                tracing::info!(pod = %pod, devices = ?devices, "allocating the planned devices")
            }
            Note::AllocatedUnbound(devices) => {
                tracing::info!(devices = ?devices, "allocating devices that match no planned binding")
            }
        }
    }
}

struct State {
    /// Every pod on the node the watch has reported, by UID.
    pods: BTreeMap<String, PodInfo>,
    checkpoint: Checkpoint,
    /// The pod list has been read at least once: absent pods are really gone.
    synced: bool,
    /// Bumped on every checkpoint change; the writer skips stale versions.
    generation: u64,
}

impl State {
    /// Whether the recorded pod `uid` may still hold its devices.
    fn holds(&self, uid: &str) -> bool {
        !self.synced || self.pods.get(uid).is_some_and(PodInfo::live)
    }

    /// Drops entries of pods that are gone or finished, records running bound
    /// pods that have no entry (e.g. after a lost checkpoint) and trims
    /// `unbound` to what pods without a binding ask for. Every change to the
    /// checkpoint is added to `notes`.
    fn tidy(&mut self, notes: &mut Vec<Note>) {
        if !self.synced {
            return;
        }
        let pods = &self.pods;
        self.checkpoint.pods.retain(|uid, a| {
            let keep = pods.get(uid).is_some_and(PodInfo::live);
            if !keep {
                notes.push(Note::Forgot(
                    a.pod.clone(),
                    uid.clone(),
                    std::mem::take(&mut a.devices),
                ));
            }
            keep
        });
        // Kubelet may admit a bound pod before the watch shows its binding: its
        // Allocate then matched no plan and went under `unbound`. Once the pod
        // shows up, an `unbound` allocation of exactly its planned devices,
        // made after the pod was created, was that pod's.
        for (uid, info) in pods {
            let Some((_, sorted)) = &info.plan else {
                continue;
            };
            if !info.live() || self.checkpoint.pods.contains_key(uid) {
                continue;
            }
            let made_after_pod = |a: &Allocation| match (info.created, a.time.parse::<Timestamp>())
            {
                (Some(created), Ok(at)) => at >= created,
                _ => false,
            };
            let Some(i) = self
                .checkpoint
                .unbound
                .iter()
                .position(|a| sorted_set(&a.devices) == *sorted && made_after_pod(a))
            else {
                continue;
            };
            let mut allocation = self.checkpoint.unbound.remove(i);
            notes.push(Note::Resolved(info.key.clone(), allocation.devices.clone()));
            allocation.pod = info.key.clone();
            self.checkpoint.pods.insert(uid.clone(), allocation);
        }
        for (uid, info) in pods {
            if info.phase == Phase::Running
                && !self.checkpoint.pods.contains_key(uid)
                && let Some((plan, _)) = &info.plan
            {
                notes.push(Note::Adopted(info.key.clone(), plan.clone()));
                self.checkpoint.pods.insert(
                    uid.clone(),
                    Allocation {
                        pod: info.key.clone(),
                        devices: plan.clone(),
                        time: now(),
                    },
                );
            }
        }
        let wanted: u64 = pods
            .values()
            .filter(|p| p.ordinary_user())
            .map(|p| p.wants)
            .sum();
        let mut held: u64 = self
            .checkpoint
            .unbound
            .iter()
            .map(|a| a.devices.len() as u64)
            .sum();
        let now = Timestamp::now().as_second();
        let settled = |a: &Allocation| {
            a.time
                .parse::<Timestamp>()
                .map_or(true, |t| now - t.as_second() >= UNBOUND_GRACE_SECS)
        };
        while held > wanted && self.checkpoint.unbound.first().is_some_and(settled) {
            let gone = self.checkpoint.unbound.remove(0);
            held -= gone.devices.len() as u64;
            notes.push(Note::ForgotUnbound(gone.devices));
        }
    }

    /// Device ID → pod UID (or [`UNBOUND`]) for every recorded allocation.
    fn allocated_map(&self) -> BTreeMap<String, String> {
        let mut out = BTreeMap::new();
        for a in &self.checkpoint.unbound {
            for d in &a.devices {
                out.insert(d.clone(), UNBOUND.to_string());
            }
        }
        for (uid, a) in &self.checkpoint.pods {
            for d in &a.devices {
                out.insert(d.clone(), uid.clone());
            }
        }
        out
    }

    /// Devices recorded as in use.
    fn in_use(&self) -> HashSet<&str> {
        let mut used: HashSet<&str> = HashSet::new();
        for (uid, a) in &self.checkpoint.pods {
            if self.holds(uid) {
                used.extend(a.devices.iter().map(String::as_str));
            }
        }
        for a in &self.checkpoint.unbound {
            used.extend(a.devices.iter().map(String::as_str));
        }
        used
    }

    fn pending(&self) -> impl Iterator<Item = (&String, &PodInfo)> {
        self.pods
            .iter()
            .filter(|(uid, p)| p.pending() && !self.checkpoint.pods.contains_key(*uid))
    }

    /// The verdict on `requested`, and the checkpoint change it made.
    fn check(&mut self, requested: &[String]) -> Result<Option<Note>, String> {
        if !self.synced {
            return Err(format!(
                "the pods on this node have not been listed yet, so planned bindings cannot be checked; refusing {} for now",
                show(requested)
            ));
        }
        let want = sorted_set(requested);

        // Devices recorded for a pod that still holds them.
        let mut conflict = None;
        for (uid, a) in &self.checkpoint.pods {
            if a.devices.iter().any(|d| want.binary_search(d).is_ok()) && self.holds(uid) {
                conflict = Some((uid, a, sorted_set(&a.devices) == want));
                break;
            }
        }
        let pending: Vec<(&String, &PodInfo, &[String], &[String])> = self
            .pending()
            .filter_map(|(uid, p)| {
                let (plan, sorted) = p.plan.as_ref()?;
                overlaps(sorted, &want).then_some((uid, p, plan.as_slice(), sorted.as_slice()))
            })
            .collect();
        if let Some((uid, a, same)) = conflict {
            // Kubelet asking again for the very devices of a pod it is still
            // admitting (an init container, then the app container) is fine.
            let readmitting = same
                && pending.is_empty()
                && self
                    .pods
                    .get(uid)
                    .is_some_and(|p| p.phase == Phase::Waiting);
            if readmitting {
                return Ok(None);
            }
            let held: Vec<String> = a
                .devices
                .iter()
                .filter(|d| want.binary_search(d).is_ok())
                .cloned()
                .collect();
            let since = if a.time.is_empty() {
                String::new()
            } else {
                format!(" since {}", a.time)
            };
            return Err(format!(
                "{} already allocated to pod {} (uid {uid}){since}; refusing to hand out {} twice",
                if held.len() == 1 {
                    format!("device {} is", held[0])
                } else {
                    format!("devices {} are", show(&held))
                },
                a.pod,
                show(requested)
            ));
        }

        if !pending.is_empty() {
            let exact = pending
                .iter()
                .filter(|(_, _, _, sorted)| *sorted == want.as_slice())
                .min_by(|a, b| a.1.age_key().cmp(&b.1.age_key()));
            if let Some((uid, pod, plan, sorted)) = exact {
                let busy: Vec<&String> = self
                    .checkpoint
                    .unbound
                    .iter()
                    .flat_map(|a| &a.devices)
                    .filter(|d| sorted.binary_search(d).is_ok())
                    .collect();
                if !busy.is_empty() {
                    return Err(format!(
                        "pod {} was planned on {} but {} still recorded for a pod without a binding; refusing so the controller can re-place it",
                        pod.key,
                        show(plan),
                        if busy.len() == 1 {
                            format!("device {} is", busy[0])
                        } else {
                            format!(
                                "devices {} are",
                                show(&busy.into_iter().cloned().collect::<Vec<_>>())
                            )
                        }
                    ));
                }
                let (uid, key, plan) = ((*uid).clone(), pod.key.clone(), plan.to_vec());
                let note = Note::Allocated(key.clone(), plan.clone());
                self.checkpoint.pods.insert(
                    uid,
                    Allocation {
                        pod: key,
                        devices: plan,
                        time: now(),
                    },
                );
                return Ok(Some(note));
            }
            let oldest = pending
                .iter()
                .min_by(|a, b| a.1.age_key().cmp(&b.1.age_key()));
            if let Some((_, pod, plan, _)) = oldest {
                let others = match pending.len() - 1 {
                    0 => String::new(),
                    1 => " (1 more pending pod is planned on some of them)".to_string(),
                    n => format!(" ({n} more pending pods are planned on some of them)"),
                };
                return Err(format!(
                    "pod {} was planned on {} but kubelet chose {}{others}; refusing so the controller can re-place it",
                    pod.key,
                    show(plan),
                    show(requested)
                ));
            }
        }

        // Overlaps no plan. Were only planned pods waiting for this many
        // devices, it must be one of them getting devices it was not planned on.
        let ordinary_waiting = self
            .pods
            .values()
            .any(|p| p.ordinary_user() && p.phase == Phase::Waiting && !p.deleting);
        if !ordinary_waiting
            && let Some((_, pod)) = self
                .pending()
                .filter(|(_, p)| {
                    p.plan
                        .as_ref()
                        .is_some_and(|(_, sorted)| sorted.len() == want.len())
                })
                .min_by(|a, b| a.1.age_key().cmp(&b.1.age_key()))
            && let Some((plan, _)) = &pod.plan
        {
            return Err(format!(
                "pod {} was planned on {} but kubelet chose {}, and no pod without a binding is waiting for devices on this node; refusing so the controller can re-place it",
                pod.key,
                show(plan),
                show(requested)
            ));
        }
        // A device handed out again without a binding: its older entry is stale.
        for a in &mut self.checkpoint.unbound {
            a.devices.retain(|d| want.binary_search(d).is_err());
        }
        self.checkpoint.unbound.retain(|a| !a.devices.is_empty());
        self.checkpoint.unbound.push(Allocation {
            pod: String::new(),
            devices: requested.to_vec(),
            time: now(),
        });
        Ok(Some(Note::AllocatedUnbound(requested.to_vec())))
    }
}

/// The pods on this node with planned devices, and the allocation checkpoint;
/// the device plugin's [`Binder`]. See the module documentation.
pub struct BindingIndex {
    state: Mutex<State>,
    resource_name: String,
    path: Option<PathBuf>,
    sync_writes: bool,
    /// The checkpoint generation last written.
    written: Mutex<u64>,
    synced: watch::Sender<bool>,
    /// The device view whose `allocated` map this index keeps.
    view: OnceLock<ViewTx>,
    /// The checkpoint generation last put into the view.
    view_generation: Mutex<u64>,
}

impl std::fmt::Debug for BindingIndex {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BindingIndex")
            .field("resource_name", &self.resource_name)
            .field("checkpoint", &self.path)
            .field("synced", &self.is_synced())
            .finish_non_exhaustive()
    }
}

impl BindingIndex {
    /// An index with the checkpoint read from `config.checkpoint` (missing:
    /// empty; unreadable or corrupt: a warning, then empty).
    pub fn open(config: BindingConfig) -> Self {
        let checkpoint = match &config.checkpoint {
            None => Checkpoint::default(),
            Some(path) => match load_checkpoint(path) {
                Ok(Some(c)) => {
                    tracing::info!(path = %path.display(), pods = c.pods.len(), unbound = c.unbound.len(), "allocation checkpoint loaded");
                    c
                }
                Ok(None) => {
                    tracing::info!(path = %path.display(), "no allocation checkpoint yet; starting empty");
                    Checkpoint::default()
                }
                Err(e) => {
                    tracing::warn!(error = %e, "ignoring the allocation checkpoint; starting empty");
                    Checkpoint::default()
                }
            },
        };
        Self {
            state: Mutex::new(State {
                pods: BTreeMap::new(),
                checkpoint,
                synced: false,
                generation: 0,
            }),
            resource_name: config.resource_name,
            path: config.checkpoint,
            sync_writes: config.sync_writes,
            written: Mutex::new(0),
            synced: watch::channel(false).0,
            view: OnceLock::new(),
            view_generation: Mutex::new(0),
        }
    }

    /// From now on keeps `view`'s `allocated` map equal to
    /// [`Self::allocated_devices`]: sets it at once, then after every change
    /// of the checkpoint. Only the first view attached is kept.
    pub fn keep_view(&self, view: ViewTx) {
        if self.view.set(view).is_err() {
            tracing::warn!("the binding index already keeps a device view; ignoring another");
            return;
        }
        let (generation, allocated) = {
            let state = self.lock();
            (state.generation, state.allocated_map())
        };
        self.update_view(generation, allocated);
    }

    /// Puts the allocated set of checkpoint `generation` into the view,
    /// unless a newer one is there already (two changes racing to the view).
    fn update_view(&self, generation: u64, allocated: BTreeMap<String, String>) {
        let Some(view) = self.view.get() else {
            return;
        };
        let mut shown = self
            .view_generation
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if *shown > generation {
            return;
        }
        *shown = generation;
        view.send_if_modified(|v| {
            if v.allocated == allocated {
                false
            } else {
                v.allocated = allocated;
                true
            }
        });
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Releases the lock and, if `notes` says the checkpoint changed, logs the
    /// changes and writes the checkpoint (serialised before the release).
    fn save(&self, mut state: MutexGuard<'_, State>, notes: &[Note]) {
        if notes.is_empty() {
            return;
        }
        state.generation += 1;
        let generation = state.generation;
        let bytes = self
            .path
            .as_ref()
            .map(|_| serde_json::to_vec(&state.checkpoint));
        let allocated = self.view.get().map(|_| state.allocated_map());
        drop(state);
        for note in notes {
            note.log();
        }
        if let Some(allocated) = allocated {
            self.update_view(generation, allocated);
        }
        let (Some(path), Some(bytes)) = (&self.path, bytes) else {
            return;
        };
        let bytes = match bytes {
            Ok(b) => b,
            Err(e) => {
                tracing::warn!(error = %e, "cannot encode the allocation checkpoint");
                return;
            }
        };
        let mut written = self.written.lock().unwrap_or_else(PoisonError::into_inner);
        if *written >= generation {
            return; // a newer state is already on disk
        }
        match write_atomically(path, &bytes, self.sync_writes) {
            Ok(()) => *written = generation,
            Err(e) => {
                tracing::warn!(path = %path.display(), error = %e, "cannot write the allocation checkpoint")
            }
        }
    }

    /// A pod on this node was added or changed.
    pub fn apply_pod(&self, pod: &Pod) {
        let Some((uid, info)) = pod_info(pod, &self.resource_name) else {
            tracing::debug!(pod = %pod_key(pod), "ignoring a pod without a UID");
            return;
        };
        let mut state = self.lock();
        state.pods.insert(uid, info);
        let mut notes = Vec::new();
        state.tidy(&mut notes);
        self.save(state, &notes);
    }

    /// Applies the rules no pod event triggers: an `unbound` hold past its
    /// grace that no pod without a binding explains is dropped.
    pub fn tidy(&self) {
        let mut state = self.lock();
        let mut notes = Vec::new();
        state.tidy(&mut notes);
        self.save(state, &notes);
    }

    /// A pod left this node (deleted).
    pub fn delete_pod(&self, pod: &Pod) {
        let Some(uid) = pod.metadata.uid.as_deref() else {
            return;
        };
        let mut state = self.lock();
        state.pods.remove(uid);
        let mut notes = Vec::new();
        state.tidy(&mut notes);
        self.save(state, &notes);
    }

    /// The complete list of pods on this node (the watch's initial list, or a
    /// relist): replaces what was known, and from now on absent pods are gone.
    pub fn resync(&self, pods: impl IntoIterator<Item = Pod>) {
        let pods: BTreeMap<String, PodInfo> = pods
            .into_iter()
            .filter_map(|p| pod_info(&p, &self.resource_name))
            .collect();
        let mut state = self.lock();
        state.pods = pods;
        state.synced = true;
        let mut notes = Vec::new();
        state.tidy(&mut notes);
        let pending = state.pending().count();
        let total = state.pods.len();
        self.save(state, &notes);
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
        let mut rx = self.synced.subscribe();
        let _ = rx.wait_for(|s| *s).await;
    }

    /// Pending bindings, oldest first.
    pub fn pending(&self) -> Vec<PendingBinding> {
        let state = self.lock();
        let mut out: Vec<(&PodInfo, PendingBinding)> = state
            .pending()
            .filter_map(|(uid, p)| {
                let (plan, _) = p.plan.as_ref()?;
                Some((
                    p,
                    PendingBinding {
                        uid: uid.clone(),
                        pod: p.key.clone(),
                        devices: plan.clone(),
                        created: p.created,
                    },
                ))
            })
            .collect();
        out.sort_by(|a, b| a.0.age_key().cmp(&b.0.age_key()));
        out.into_iter().map(|(_, b)| b).collect()
    }

    /// The checkpoint as it is in memory.
    pub fn checkpoint(&self) -> Checkpoint {
        self.lock().checkpoint.clone()
    }

    pub fn checkpoint_path(&self) -> Option<&Path> {
        self.path.as_deref()
    }

    /// Device ID → pod UID (or [`UNBOUND`]) for every recorded allocation:
    /// what [`Self::keep_view`] puts into the device view.
    pub fn allocated_devices(&self) -> BTreeMap<String, String> {
        self.lock().allocated_map()
    }
}

impl Binder for BindingIndex {
    fn keeps_allocated_view(&self) -> bool {
        self.view.get().is_some()
    }

    fn planned_for(
        &self,
        available: &[String],
        must_include: &[String],
        size: usize,
    ) -> Option<Vec<String>> {
        let state = self.lock();
        if !state.synced {
            return None;
        }
        let offered: HashSet<&str> = available
            .iter()
            .chain(must_include)
            .map(String::as_str)
            .collect();
        let mut fitting: Vec<&PodInfo> = state
            .pending()
            .map(|(_, pod)| pod)
            .filter(|pod| {
                pod.plan.as_ref().is_some_and(|(plan, sorted)| {
                    plan.len() == size
                        && plan.iter().all(|d| offered.contains(d.as_str()))
                        && must_include.iter().all(|m| sorted.binary_search(m).is_ok())
                })
            })
            .collect();
        if fitting.is_empty() {
            return None;
        }
        fitting.sort_by(|a, b| a.age_key().cmp(&b.age_key()));
        // Devices recorded as in use are not offered, even if kubelet lists them.
        let used = state.in_use();
        let plan = fitting.iter().find_map(|pod| {
            let (plan, _) = pod.plan.as_ref()?;
            (!plan.iter().any(|d| used.contains(d.as_str())))
                .then(|| (pod.key.clone(), plan.clone()))
        });
        let candidates = fitting.len();
        drop(state);
        let (pod, plan) = plan?;
        if candidates > 1 {
            tracing::debug!(pod = %pod, candidates, "several pending bindings fit; preferring the oldest");
        }
        Some(plan)
    }

    fn check_allocate(&self, requested: &[String]) -> Result<(), String> {
        let mut state = self.lock();
        match state.check(requested) {
            Ok(note) => {
                self.save(state, note.as_slice());
                Ok(())
            }
            Err(why) => {
                drop(state);
                tracing::warn!(devices = ?requested, reason = %why, "refusing an allocation");
                Err(why)
            }
        }
    }
}

/// The field selector for the pods bound to `node_name`.
pub fn node_field_selector(node_name: &str) -> String {
    format!("spec.nodeName={node_name}")
}

/// Feeds `index` from the API server: watches the pods on `node_name`
/// (field selector `spec.nodeName=<node>`), hands every complete list to
/// [`BindingIndex::resync`] and every later change to
/// [`BindingIndex::apply_pod`] / [`BindingIndex::delete_pod`], until
/// `shutdown` resolves. Errors are logged and the watch is retried with
/// backoff; it never gives up on its own.
pub async fn run_pod_watch(
    client: kube::Client,
    node_name: String,
    index: Arc<BindingIndex>,
    shutdown: impl Future<Output = ()>,
) {
    let pods: Api<Pod> = Api::all(client);
    let config = watcher::Config::default().fields(&node_field_selector(&node_name));
    let stream = watcher::watcher(pods, config).default_backoff();
    tokio::pin!(stream);
    tokio::pin!(shutdown);
    let on_node =
        |p: &Pod| p.spec.as_ref().and_then(|s| s.node_name.as_deref()) == Some(node_name.as_str());
    // The list being read, between `Init` and `InitDone`.
    let mut listing: Option<Vec<Pod>> = None;
    // Holds that only time ends (an `unbound` hold past its grace) must end
    // also when no pod event comes.
    let mut tidy = tokio::time::interval(std::time::Duration::from_secs(
        UNBOUND_GRACE_SECS.unsigned_abs() / 4,
    ));
    tidy.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        let event = tokio::select! {
            e = stream.next() => e,
            _ = tidy.tick() => {
                index.tidy();
                continue;
            }
            _ = &mut shutdown => break,
        };
        match event {
            None => {
                tracing::warn!("the pod watch ended");
                break;
            }
            Some(Err(e)) => {
                tracing::warn!(node = %node_name, error = %e, "watching the pods on this node failed; retrying");
            }
            Some(Ok(Event::Init)) => listing = Some(Vec::new()),
            Some(Ok(Event::InitApply(pod))) => {
                if on_node(&pod) {
                    listing.get_or_insert_with(Vec::new).push(pod);
                }
            }
            Some(Ok(Event::InitDone)) => index.resync(listing.take().unwrap_or_default()),
            Some(Ok(Event::Apply(pod))) => {
                if on_node(&pod) {
                    index.apply_pod(&pod);
                } else {
                    index.delete_pod(&pod);
                }
            }
            Some(Ok(Event::Delete(pod))) => index.delete_pod(&pod),
        }
    }
    tracing::info!("pod watch stopped");
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(v: &[&str]) -> Vec<String> {
        v.iter().map(|x| x.to_string()).collect()
    }

    #[test]
    fn plans_parse_and_overlap() {
        assert_eq!(parse_plan(" a, b,,a ,c"), Some(s(&["a", "b", "c"])));
        assert_eq!(parse_plan(" , "), None);
        assert!(overlaps(&s(&["a", "c"]), &s(&["b", "c"])));
        assert!(!overlaps(&s(&["a", "c"]), &s(&["b", "d"])));
        assert!(!overlaps(&[], &s(&["a"])));
    }

    fn pod(uid: &str, phase: &str, devices: &str) -> Pod {
        serde_json::from_value(serde_json::json!({
            "metadata": {
                "name": format!("pod-{uid}"),
                "namespace": "ns",
                "uid": uid,
                "annotations": { DEVICES_ANNOTATION: devices },
            },
            "spec": { "nodeName": "n1", "containers": [] },
            "status": { "phase": phase },
        }))
        .unwrap()
    }

    fn owners(view: &crate::agent::state::ViewRx) -> Vec<(String, String)> {
        view.borrow()
            .allocated
            .iter()
            .map(|(d, o)| (d.clone(), o.clone()))
            .collect()
    }

    fn pairs(v: &[(&str, &str)]) -> Vec<(String, String)> {
        v.iter()
            .map(|(a, b)| (a.to_string(), b.to_string()))
            .collect()
    }

    #[test]
    fn the_view_follows_the_checkpoint() {
        let index = BindingIndex::open(BindingConfig::in_memory());
        let (tx, mut rx) = crate::agent::state::channel("fake");
        let mut a = pod("uid-a", "Pending", "g0,g1");
        index.resync([a.clone()]);
        assert!(!index.keeps_allocated_view());
        index.keep_view(tx.clone());
        assert!(index.keeps_allocated_view());
        assert!(owners(&rx).is_empty());

        rx.mark_unchanged();
        index.check_allocate(&s(&["g1", "g0"])).unwrap();
        assert!(rx.has_changed().unwrap());
        assert_eq!(owners(&rx), pairs(&[("g0", "uid-a"), ("g1", "uid-a")]));
        // A device no plan names goes to a pod the agent cannot identify.
        index.check_allocate(&s(&["g5"])).unwrap();
        assert_eq!(
            owners(&rx),
            pairs(&[("g0", "uid-a"), ("g1", "uid-a"), ("g5", UNBOUND)])
        );
        assert_eq!(rx.borrow().allocated, index.allocated_devices());

        // A pod update that changes nothing recorded does not touch the view.
        a.status.as_mut().unwrap().phase = Some("Running".into());
        rx.mark_unchanged();
        index.apply_pod(&a);
        assert!(!rx.has_changed().unwrap());

        // The pod ends: its devices leave the view.
        a.status.as_mut().unwrap().phase = Some("Succeeded".into());
        index.apply_pod(&a);
        assert_eq!(owners(&rx), pairs(&[("g5", UNBOUND)]));
        assert_eq!(rx.borrow().allocated, index.allocated_devices());

        // Only the first view is kept.
        let (other, other_rx) = crate::agent::state::channel("fake");
        index.keep_view(other);
        assert!(owners(&other_rx).is_empty());
    }

    #[test]
    fn an_allocation_made_before_the_binding_was_seen_is_resolved_to_the_pod() {
        let index = BindingIndex::open(BindingConfig::in_memory());
        index.resync([]);
        // Kubelet admits the shard before the watch has shown it.
        index.check_allocate(&s(&["g5", "g4"])).unwrap();
        assert_eq!(
            index.allocated_devices(),
            [("g4", UNBOUND), ("g5", UNBOUND)]
                .map(|(d, o)| (d.to_string(), o.to_string()))
                .into()
        );
        let mut shard = pod("uid-s", "Pending", "g4,g5");
        shard.metadata.creation_timestamp =
            Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
                "2026-01-01T00:00:00Z".parse().unwrap(),
            ));
        // A pod whose plan is only part of the allocation is not it.
        let mut partial = pod("uid-p", "Pending", "g4");
        partial.metadata.creation_timestamp = shard.metadata.creation_timestamp.clone();
        index.apply_pod(&partial);
        assert_eq!(index.allocated_devices()["g4"], UNBOUND);
        index.delete_pod(&partial);

        index.apply_pod(&shard);
        let owners = index.allocated_devices();
        assert_eq!(owners["g4"], "uid-s");
        assert_eq!(owners["g5"], "uid-s");
        assert!(index.checkpoint().unbound.is_empty());
        // The shard's next container is admitted on the same devices; no one else is.
        index.check_allocate(&s(&["g4", "g5"])).unwrap();
        let refused = index.check_allocate(&s(&["g4"])).unwrap_err();
        assert!(
            refused.contains("already allocated to pod ns/pod-uid-s"),
            "{refused}"
        );
    }

    #[test]
    fn an_unbound_allocation_older_than_the_pod_is_not_the_pods() {
        let index = BindingIndex::open(BindingConfig::in_memory());
        index.resync([]);
        index.check_allocate(&s(&["g4"])).unwrap();
        let mut later = pod("uid-l", "Pending", "g4");
        later.metadata.creation_timestamp =
            Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
                Timestamp::now() + k8s_openapi::jiff::SignedDuration::from_secs(60),
            ));
        index.apply_pod(&later);
        assert_eq!(index.allocated_devices()["g4"], UNBOUND);
    }

    #[test]
    fn the_view_is_seeded_from_the_checkpoint_and_tidied_by_the_first_list() {
        let dir = std::env::temp_dir().join(format!("tessera-binding-view-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let path = dir.join("checkpoint.json");
        let mut pods = BTreeMap::new();
        for (uid, devices) in [("uid-live", "g0"), ("uid-gone", "g1")] {
            pods.insert(
                uid.to_string(),
                Allocation {
                    pod: format!("ns/pod-{uid}"),
                    devices: s(&[devices]),
                    time: "2025-01-01T00:00:00Z".into(),
                },
            );
        }
        let checkpoint = Checkpoint {
            pods,
            ..Checkpoint::default()
        };
        write_atomically(&path, &serde_json::to_vec(&checkpoint).unwrap(), false).unwrap();

        let index = BindingIndex::open(BindingConfig::at(&path));
        let (tx, rx) = crate::agent::state::channel("fake");
        index.keep_view(tx);
        // Before the pods are listed every recorded allocation counts.
        assert_eq!(
            owners(&rx),
            pairs(&[("g0", "uid-live"), ("g1", "uid-gone")])
        );
        index.resync([pod("uid-live", "Running", "g0")]);
        assert_eq!(owners(&rx), pairs(&[("g0", "uid-live")]));
        // The pod is deleted.
        index.delete_pod(&pod("uid-live", "Running", "g0"));
        assert!(owners(&rx).is_empty());
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn atomic_write_creates_the_directory_and_leaves_no_temp_file() {
        let dir = std::env::temp_dir().join(format!("tessera-binding-unit-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let path = dir.join("sub/checkpoint.json");
        write_atomically(&path, b"{}", true).unwrap();
        write_atomically(&path, b"{\"a\":1}", false).unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"{\"a\":1}");
        assert!(!dir.join("sub/checkpoint.json.tmp").exists());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
