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

/// Whether the API server serves DRA as tessera uses it: ResourceSlices and
/// ResourceClaims in `resource.k8s.io/v1` (Kubernetes 1.34+).
pub async fn serves_dra(client: &kube::Client) -> Result<bool, kube::Error> {
    match client.list_api_group_resources("resource.k8s.io/v1").await {
        Ok(list) => Ok(["resourceslices", "resourceclaims"]
            .iter()
            .all(|name| list.resources.iter().any(|r| r.name == *name))),
        Err(kube::Error::Api(e)) if e.code == 404 => Ok(false),
        Err(e) => Err(e),
    }
}
