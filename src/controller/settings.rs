//! How the controller plans; set by flags.

use std::time::Duration;

use super::model_cache::ModelCacheDir;
use tessera_core::api::ResourceName;

#[derive(Clone, Debug)]
pub struct Settings {
    pub resource_name: ResourceName,
    /// How long a NotReady node keeps its shards before they are re-placed.
    pub node_grace: Duration,
    /// Solver step budget per plan.
    pub max_steps: u64,
    /// The DRA driver whose claims the controller allocates for shards on
    /// nodes that publish its ResourceSlices; `None`: never (device plugin
    /// only, `--allocation device-plugin`).
    pub dra_driver: Option<String>,
    /// The host directory of the node-local model cache
    /// (`--model-cache-dir`); `None` refuses templates that mount it.
    pub model_cache: Option<ModelCacheDir>,
}

impl Default for Settings {
    fn default() -> Self {
        Self {
            resource_name: ResourceName::default(),
            node_grace: Duration::from_secs(300),
            max_steps: tessera_core::placement::SolveOptions::default().max_steps,
            dra_driver: None,
            model_cache: None,
        }
    }
}
