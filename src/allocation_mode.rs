//! How GPUs reach containers, for both components: the agent offers them
//! one way per node, and the controller asks for them the same way.

/// How kubelet learns which devices a container gets.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AllocationMode {
    /// DRA where the API server serves `resource.k8s.io/v1` and this node's
    /// kubelet registers the driver; otherwise the device plugin.
    Auto,
    /// The DRA driver: ResourceSlices and claims.
    Dra,
    /// The device plugin: an extended resource.
    DevicePlugin,
}

impl AllocationMode {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Auto => "auto",
            Self::Dra => "dra",
            Self::DevicePlugin => "device-plugin",
        }
    }
}
