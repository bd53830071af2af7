//! What the cluster map shows: the nodes with their GPUs, the instances with
//! their plans, and who else holds devices. The live controller fills it from
//! its caches, `tessera place` from a plan; nothing here talks to Kubernetes.

use std::collections::{BTreeMap, HashMap};

use tessera_core::api::{GpuDevice, Health, MeasuredServing, MoveInFlight, PlannedShard};
use tessera_core::placement::Plan;
use tessera_core::serving::Capacity;
use tessera_core::translate::ClusterNode;

/// A device at or above this temperature is marked too hot (the chart's
/// alert fires at the same default).
pub(crate) const HOT_CELSIUS: f64 = 85.0;

pub(crate) struct MapNode<'a> {
    pub(crate) node: &'a ClusterNode,
    /// Why tessera places nothing new on the node now (cordoned, not
    /// ready, a taint), if so.
    pub(crate) excluded: Option<String>,
}

pub(crate) struct MapCondition {
    pub(crate) type_: String,
    pub(crate) status: String,
    pub(crate) reason: String,
    pub(crate) message: String,
}

pub(crate) struct MapEvent {
    pub(crate) time: String,
    pub(crate) warning: bool,
    pub(crate) reason: String,
    pub(crate) message: String,
}

/// A replica's plan as the speed model judges it on the devices planned:
/// its score parts and where a token's time goes.
pub(crate) type Prediction = Result<Plan, String>;

/// What a replica serves at each concurrency and at the target, or why the
/// serving model has no answer.
pub(crate) type Curve = Result<Capacity, String>;

pub(crate) struct MapInstance {
    pub(crate) namespace: String,
    pub(crate) name: String,
    pub(crate) model: String,
    pub(crate) phase: String,
    pub(crate) message: Option<String>,
    pub(crate) predicted_tokens_per_second: Option<f64>,
    pub(crate) plan: Vec<PlannedShard>,
    /// Replicas being moved (`status.moves`).
    pub(crate) moves: Vec<MoveInFlight>,
    /// By replica; empty where not worked out (the cluster page).
    pub(crate) predictions: Vec<(u32, Prediction)>,
    /// By replica, as the predictions.
    pub(crate) curves: Vec<(u32, Curve)>,
    /// What each replica's runtime was measured doing, by replica
    /// (`status.replicaPredictions[].measured`), drawn on its curve.
    pub(crate) measured: BTreeMap<u32, MeasuredServing>,
    /// `serving.maxTimePerOutputTokenMs`, marked on the curves.
    pub(crate) target_tpot_ms: f64,
    pub(crate) conditions: Vec<MapCondition>,
    /// Newest last.
    pub(crate) events: Vec<MapEvent>,
}

impl MapInstance {
    /// `namespace/name`, or the name alone without a namespace.
    pub(crate) fn key(&self) -> String {
        if self.namespace.is_empty() {
            self.name.clone()
        } else {
            format!("{}/{}", self.namespace, self.name)
        }
    }
}

/// Everything one page of the map is drawn from.
pub(crate) struct ClusterView<'a> {
    /// What the map is of: the cluster file, or "live".
    pub(crate) title: String,
    /// Sorted by name.
    pub(crate) nodes: Vec<MapNode<'a>>,
    pub(crate) instances: Vec<MapInstance>,
    /// Devices held outside tessera's plans, `(node, device)` → the holder
    /// (a user's pod or claim).
    pub(crate) others: HashMap<(String, String), String>,
    /// Whether instance names link to their own pages (the live map); the
    /// offline map has every instance on its one page instead.
    pub(crate) instance_pages: bool,
}

/// One shard holding (part of) a device.
pub(crate) struct Hold<'v> {
    /// The instance's position in [`ClusterView::instances`]: its colour.
    pub(crate) colour: usize,
    pub(crate) instance: &'v MapInstance,
    pub(crate) shard: &'v PlannedShard,
}

impl ClusterView<'_> {
    /// Who holds each `(node, device)` by the instances' plans (a memory
    /// shared GPU has several).
    pub(crate) fn holds(&self) -> HashMap<(&str, &str), Vec<Hold<'_>>> {
        let mut holds: HashMap<(&str, &str), Vec<Hold<'_>>> = HashMap::new();
        for (colour, instance) in self.instances.iter().enumerate() {
            for shard in &instance.plan {
                for device in &shard.devices {
                    holds
                        .entry((shard.node.as_str(), device.as_str()))
                        .or_default()
                        .push(Hold {
                            colour,
                            instance,
                            shard,
                        });
                }
            }
        }
        holds
    }

    pub(crate) fn gpu_count(&self) -> usize {
        self.nodes
            .iter()
            .map(|n| n.node.gpu_state.devices.len())
            .sum()
    }
}

/// Why a device needs a look, if it does: unhealthy (with the agent's
/// reason) or too hot.
pub(crate) fn unhealthy(gpu: &GpuDevice) -> Option<String> {
    match gpu.health {
        Health::Healthy => None,
        _ => Some(
            gpu.health_reason
                .clone()
                .unwrap_or_else(|| "unhealthy".to_string()),
        ),
    }
}

pub(crate) fn too_hot(gpu: &GpuDevice) -> Option<f64> {
    gpu.temperature_c.filter(|t| *t >= HOT_CELSIUS)
}

/// A stable, distinct colour for the instance at `index` (golden-angle hues).
pub(crate) fn colour(index: usize) -> String {
    let hue = (index as f64 * 137.508) % 360.0;
    format!("hsl({hue:.0} 60% 78%)")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn neighbouring_instances_get_distinct_colours() {
        let colours: std::collections::HashSet<String> = (0..50).map(colour).collect();
        assert_eq!(colours.len(), 50);
        assert_eq!(colour(0), "hsl(0 60% 78%)");
    }
}
