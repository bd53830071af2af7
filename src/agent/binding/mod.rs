//! Planned bindings: the controller binds each shard pod to this node with the
//! annotation `tessera.dev/devices` naming the devices it was planned on, and
//! this module makes kubelet hand out exactly those devices.
//!
//! [`BindingIndex`] holds what the agent knows about the pods on its node (fed
//! by [`run_pod_watch`], or directly in tests) and the allocation checkpoint,
//! and implements [`Binder`], the question a kubelet-facing plugin asks of
//! it:
//!
//! - **pending** bindings are pods on this node with a devices annotation that
//!   have no allocation recorded yet, are not finished (phase Succeeded or
//!   Failed), not being deleted and not yet running;
//! - `Binder::planned_for` answers kubelet's preferred-allocation question
//!   with the plan of the **oldest** pending pod (creation time, then
//!   `namespace/name`) that fits the request (all planned devices available,
//!   every must-include device planned, `size` devices) and whose devices are
//!   not recorded as in use;
//! - `Binder::check_allocate` accepts a request equal (as a set) to a
//!   pending plan and records it; refuses one that overlaps a pending plan
//!   without equalling it, naming the pod and both device sets, so the pod
//!   fails admission and the controller re-places it; accepts one that
//!   overlaps no plan (a pod without a binding) and records it under
//!   `unbound`; and refuses devices recorded for another live pod.
//!
//! Kubelet does not say which pod it is admitting, so a request is matched to
//! a plan by its devices alone. Kubelet may also ask before the pod watch has
//! delivered the pod it admits; a request that matches no known plan is
//! matched again after a fresh list of the node's pods (`catch_up`). Kubelet admits pods oldest first, hence the
//! oldest-first rule. Two pending pods with plans of the same size on one
//! node could still be confused if kubelet admitted the younger one first;
//! the controller never lets that arise (it binds the next such pod to a node
//! only once this agent reports the previous one's devices allocated).
//!
//! ## The checkpoint
//!
//! A small JSON file (default `/var/lib/tessera/checkpoint.json`; written compact,
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
//! an empty checkpoint, an unreadable one is logged and ignored, and a corrupt
//! one is kept at `<file>.bad` (the warning names it) and ignored.
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
//! leaves the map alone (`Binder::keeps_allocated_view`).
//!
//! ## Files
//!
//! - `binder`: the [`Binder`] trait, and [`NoBinder`] for an agent without plans;
//! - `checkpoint`: the checkpoint's format, reading and atomic writing;
//! - `pods`: what the index keeps of a Pod object;
//! - `device_set`: device lists as the rules compare them;
//! - `ledger`: the pods and allocations the index keeps behind its lock;
//! - `rules`: the preferred plan and the verdict on an allocation;
//! - `tidy`: keeping the checkpoint in step with the pods;
//! - `changes`: the checkpoint changes, logged after the lock;
//! - `view`: the device view's `allocated` map;
//! - `config`, `index`: the index, its locking and its [`BindingConfig`];
//! - `watch`: the pod watch feeding the index.

mod binder;
mod catch_up;
mod changes;
mod checkpoint;
mod config;
mod device_set;
mod index;
mod ledger;
mod pods;
mod rules;
#[cfg(test)]
mod test_pods;
mod tidy;
mod view;
mod watch;

pub use binder::{Binder, NoBinder};
pub use checkpoint::{
    Allocation, CHECKPOINT_VERSION, Checkpoint, CheckpointError, DEFAULT_CHECKPOINT_PATH,
    load_checkpoint,
};
pub use config::BindingConfig;
pub use index::{BindingIndex, PendingBinding};
pub use ledger::UNBOUND;
pub use watch::run_pod_watch;
