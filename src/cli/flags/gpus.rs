//! The flags `agent` and `discover` share: where the GPUs come from and when
//! a device counts as healthy.

use std::path::PathBuf;

use super::values::celsius;
use crate::backend::detect::{BackendChoice, DetectOptions};
use crate::backend::health::HealthPolicy;

/// Where the GPUs come from; shared by `agent` and `discover`.
#[derive(clap::Args)]
pub(crate) struct BackendFlags {
    /// Which GPU backend to use; `auto` tries NVIDIA, then AMD, then fake
    /// devices if configured, and merges NVIDIA + AMD on mixed nodes.
    #[arg(long, value_enum, default_value = "auto")]
    backend: BackendChoice,
    /// Fake devices: a spec such as `4xH100-80GiB,2xMI300X-192GiB`, a YAML file
    /// (re-read while running), or a directory: its `<node name>.yaml`, else
    /// its `default.yaml` (chosen again on every read).
    #[arg(long, env = "TESSERA_FAKE_GPUS", value_name = "SPEC|FILE|DIR")]
    fake: Option<String>,
    /// NVML library to load [default: libnvidia-ml.so.1].
    #[arg(long, value_name = "PATH")]
    nvml_library: Option<PathBuf>,
    /// Where the host's sysfs is mounted (AMD discovery, AMD render nodes).
    #[arg(long, value_name = "DIR", default_value = "/sys")]
    sysfs_root: PathBuf,
    /// This node's name (from the downward API): the agent publishes on this
    /// Node, and a --fake directory gives this node its `<name>.yaml`.
    #[arg(long, env = "NODE_NAME", value_name = "NAME")]
    node_name: Option<String>,
}

impl BackendFlags {
    pub(crate) fn options(self) -> DetectOptions {
        DetectOptions {
            choice: self.backend,
            nvml_library: self.nvml_library.map(PathBuf::into_os_string),
            sysfs_root: self.sysfs_root,
            // An empty TESSERA_FAKE_GPUS means "no fake devices".
            fake: self.fake.filter(|s| !s.trim().is_empty()),
            node_name: self.node_name.filter(|n| !n.trim().is_empty()),
        }
    }
}

/// Health recovery and thermal limits; shared by `agent` and `discover`.
#[derive(clap::Args)]
pub(crate) struct HealthFlags {
    /// Seconds a device must stay fault-free before it is healthy again.
    #[arg(long, value_name = "SECONDS", default_value = "60", value_parser = clap::value_parser!(u64).range(0..=86400))]
    health_recovery: u64,
    /// Temperature at which a device counts as unhealthy (too hot).
    #[arg(long, value_name = "CELSIUS", default_value = "90", value_parser = celsius)]
    max_temperature: f64,
    /// A hot device is healthy again only below max-temperature minus this.
    #[arg(long, value_name = "CELSIUS", default_value = "5", value_parser = celsius)]
    thermal_margin: f64,
}

impl HealthFlags {
    pub(crate) fn policy(&self) -> HealthPolicy {
        HealthPolicy {
            recovery: std::time::Duration::from_secs(self.health_recovery),
            max_temperature_c: self.max_temperature,
            thermal_margin_c: self.thermal_margin,
        }
    }
}
