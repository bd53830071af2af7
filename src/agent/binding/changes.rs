//! The changes the binding rules make to the checkpoint, collected under the
//! index lock and logged once it is released.

/// One change to the checkpoint.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum CheckpointChange {
    /// The pod ended or left the node; its devices are free again.
    Forgot {
        pod: String,
        uid: String,
        devices: Vec<String>,
    },
    /// A running bound pod had no entry (e.g. after a lost checkpoint).
    Adopted { pod: String, devices: Vec<String> },
    /// An `unbound` entry that no pod without a binding can still hold.
    ForgotUnbound { devices: Vec<String> },
    /// An `unbound` entry turned out to be this pod's.
    Resolved { pod: String, devices: Vec<String> },
    /// Kubelet handed out a pod's planned devices.
    Allocated { pod: String, devices: Vec<String> },
    /// Kubelet handed out devices no plan names.
    AllocatedUnbound { devices: Vec<String> },
}

impl CheckpointChange {
    pub(super) fn log(&self) {
        match self {
            Self::Forgot { pod, uid, devices } => {
                tracing::info!(pod = %pod, uid = %uid, devices = ?devices, "pod is gone; forgetting its allocation")
            }
            Self::Adopted { pod, devices } => {
                tracing::info!(pod = %pod, devices = ?devices, "a running bound pod has no recorded allocation; recording its planned devices")
            }
            Self::Resolved { pod, devices } => {
                tracing::info!(pod = %pod, devices = ?devices, "devices allocated before the pod's binding was seen were this pod's; recording them for it")
            }
            Self::ForgotUnbound { devices } => {
                tracing::info!(devices = ?devices, "no pod without a binding can still hold these devices; forgetting them")
            }
            Self::Allocated { pod, devices } => {
                tracing::info!(pod = %pod, devices = ?devices, "allocating the planned devices")
            }
            Self::AllocatedUnbound { devices } => {
                tracing::info!(devices = ?devices, "allocating devices that match no planned binding")
            }
        }
    }
}
