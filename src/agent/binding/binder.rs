//! The seam between the planned bindings and a kubelet-facing plugin: what
//! a plugin asks when kubelet admits a pod, whatever API kubelet speaks.

use std::future::Future;
use std::pin::Pin;

/// The seam through which the controller's planned bindings (pod annotation
/// `tessera.dev/devices`) steer device choice. Kubelet does not tell a device
/// plugin which pod it is serving, so a binder recognises the pod by the
/// request itself (e.g. a pending pod on this node whose planned devices are
/// all available and include the must-include ones).
pub trait Binder: Send + Sync {
    /// The devices planned for the pod being admitted, when one is recognised:
    /// exactly `size` IDs out of `available`, including every `must_include`.
    /// An answer that breaks those rules is ignored (with a warning) and the
    /// topology choice is used. `None`: no plan applies.
    fn planned_for(
        &self,
        available: &[String],
        must_include: &[String],
        size: usize,
    ) -> Option<Vec<String>>;

    /// Whether kubelet may hand out `requested` (one container's devices):
    /// `Err(reason)` vetoes an allocation that contradicts a planned binding,
    /// and kubelet fails the container with the reason.
    fn check_allocate(&self, requested: &[String]) -> Result<(), String>;

    /// Whether `requested` is a request the binder has a plan or an
    /// allocation for. When it is not, [`Binder::catch_up`] runs before
    /// [`Binder::check_allocate`].
    fn expects(&self, _requested: &[String]) -> bool {
        true
    }

    /// Brings the binder up to date with the pods kubelet may be admitting
    /// (its source of pods can lag behind kubelet's); called when a request
    /// matches nothing the binder knows.
    fn catch_up(&self) -> Pin<Box<dyn Future<Output = ()> + Send + '_>> {
        Box::pin(std::future::ready(()))
    }

    /// Whether the binder keeps the device view's `allocated` map itself (it
    /// knows which pod holds what, and when pods end). When it does not,
    /// `Allocate` records what it hands out under `UNBOUND`.
    fn keeps_allocated_view(&self) -> bool {
        false
    }
}

/// No plans: topology decides and every allocation of healthy devices is fine.
#[derive(Clone, Copy, Debug, Default)]
pub struct NoBinder;

impl Binder for NoBinder {
    fn planned_for(&self, _: &[String], _: &[String], _: usize) -> Option<Vec<String>> {
        None
    }

    fn check_allocate(&self, _: &[String]) -> Result<(), String> {
        Ok(())
    }
}
