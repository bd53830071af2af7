//! How the controller plans; set by flags.

pub use super::measure::MeasureSettings;
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
    pub moves: MoveSettings,
    /// Reading each serving replica's runtime metrics; `None`: never
    /// (`--measure-interval=0`).
    pub measure: Option<MeasureSettings>,
    /// How replicas follow a measured demand and leave when it drops.
    pub scaling: ScalingSettings,
}

/// How instances with `serving.demand: Measured` are scaled.
#[derive(Clone, Debug, PartialEq)]
pub struct ScalingSettings {
    /// Planned beyond the measured demand, as a fraction (`--demand-headroom`).
    pub headroom: f64,
    /// How long every read must ask for less before replicas are removed
    /// (`--scale-down-window`).
    pub scale_down_window: Duration,
    /// How long a replica taken out of its Services may take to finish the
    /// requests it has before its pods go anyway (`--drain-timeout`).
    pub drain_timeout: Duration,
}

impl Default for ScalingSettings {
    fn default() -> Self {
        Self {
            headroom: 0.2,
            scale_down_window: Duration::from_secs(300),
            drain_timeout: Duration::from_secs(120),
        }
    }
}

/// When and how far the controller moves running replicas to make room.
#[derive(Clone, Debug)]
pub struct MoveSettings {
    /// Move replicas at all (`--moves`).
    pub enabled: bool,
    /// Moves in flight at once in the whole cluster (`--max-moves-in-flight`).
    pub max_in_flight: usize,
    /// How long a surge copy has to become Ready before its move is
    /// abandoned (`--move-timeout`).
    pub timeout: Duration,
    /// How long a replica whose move was abandoned is left where it is
    /// (`--move-backoff`).
    pub backoff: Duration,
    /// Moves made while nothing is blocked, where a replica serves more
    /// elsewhere (`--continuous-moves`); `None`: only to make room and to
    /// leave cordoned nodes.
    pub continuous: Option<ContinuousMoves>,
}

/// How far continuous moves go.
#[derive(Clone, Debug, PartialEq)]
pub struct ContinuousMoves {
    /// The least gain worth a move: requests/s at the target gained, as a
    /// fraction of what the moved replicas served (`--continuous-min-gain`).
    pub min_gain: f64,
    /// The cluster is looked at once in this long at most
    /// (`--continuous-interval`).
    pub interval: Duration,
}

impl Default for ContinuousMoves {
    fn default() -> Self {
        Self {
            min_gain: 0.2,
            interval: Duration::from_secs(600),
        }
    }
}

impl Default for MoveSettings {
    fn default() -> Self {
        Self {
            enabled: true,
            max_in_flight: 1,
            timeout: Duration::from_secs(600),
            backoff: Duration::from_secs(600),
            continuous: None,
        }
    }
}

impl Default for Settings {
    fn default() -> Self {
        Self {
            resource_name: ResourceName::default(),
            node_grace: Duration::from_secs(300),
            max_steps: tessera_core::placement::SolveOptions::default().max_steps,
            dra_driver: None,
            model_cache: None,
            moves: MoveSettings::default(),
            measure: Some(MeasureSettings::default()),
            scaling: ScalingSettings::default(),
        }
    }
}

impl Default for MeasureSettings {
    fn default() -> Self {
        Self {
            interval: Duration::from_secs(15),
            window: Duration::from_secs(60),
            timeout: Duration::from_secs(5),
        }
    }
}
