//! What the measured replicas say the predictions are off by: each measured
//! replica's time per output token against the model's prediction for its
//! plan at the load measured, for the status stage to learn
//! (`tessera_core::measure::correction`). Pure.

use std::collections::BTreeMap;
use std::sync::Arc;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use tessera_core::api::{ModelInstanceSpec, PlannedShard};
use tessera_core::measure::correction::{Observation, ratio};
use tessera_core::translate::predicted_tpot;

use super::super::measure::ReplicaMeasure;
use super::super::nodes::NodeInfo;

/// One observation per measured replica whose plan (`current`, by replica)
/// was kept this reconcile and whose window says enough.
pub(crate) fn observations(
    spec: &ModelInstanceSpec,
    nodes: &[Arc<NodeInfo>],
    current: &[Vec<PlannedShard>],
    kept: &[bool],
    measured: Option<&BTreeMap<u32, ReplicaMeasure>>,
) -> Vec<Observation> {
    let Some(measured) = measured else {
        return Vec::new();
    };
    measured
        .iter()
        .filter_map(|(&replica, read)| {
            let ReplicaMeasure::Measured { measurement, at } = read else {
                return None;
            };
            let index = replica as usize;
            let shards: Vec<&PlannedShard> = current.get(index)?.iter().collect();
            if !kept.get(index).copied().unwrap_or(false) || shards.is_empty() {
                return None;
            }
            let mut product = None;
            let ratio = ratio(&measurement.serving(), |concurrency| {
                let (on, tpot) =
                    predicted_tpot(spec, nodes.iter().map(|n| &n.gpus), &shards, concurrency)
                        .ok()?;
                product = Some(on);
                Some(tpot)
            })?;
            Some(Observation {
                product: product?,
                tensor: shards[0].devices.len() as u32,
                stages: shards.len() as u32,
                ratio,
                at: Time(*at),
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::controller::measure::measured_after;
    use crate::controller::testkit::{H100, SMALL, infos, instance, node};

    fn shard(devices: &[&str]) -> PlannedShard {
        PlannedShard {
            copy: 0,
            replica: 0,
            shard: 0,
            node: "a".into(),
            devices: devices.iter().map(|d| d.to_string()).collect(),
            layer_start: 0,
            layer_end: 32,
            predicted_memory_gib: 20.0,
            share: None,
        }
    }

    #[test]
    fn a_measured_kept_replica_is_compared_with_its_prediction_at_the_load_measured() {
        let spec = instance("m", SMALL).spec;
        let nodes = infos(&[node("a", 2, H100)]);
        let current = vec![vec![shard(&["a-g0"])]];
        let measured = BTreeMap::from([(0, measured_after(20))]);
        let seen = observations(&spec, &nodes, &current, &[true], Some(&measured));
        assert_eq!(seen.len(), 1);
        let seen = &seen[0];
        assert_eq!(
            (seen.product.as_str(), seen.tensor, seen.stages),
            ("NVIDIA H100 80GB HBM3", 1, 1)
        );
        // The window's median (17.5 ms) against the prediction at 2 at once.
        let (_, predicted) =
            predicted_tpot(&spec, nodes.iter().map(|n| &n.gpus), &[&current[0][0]], 2).unwrap();
        assert!(
            (seen.ratio - 17.5 / predicted).abs() < 1e-9,
            "{seen:?} {predicted}"
        );
        assert_eq!(seen.at.0.as_second(), 1_800_000_010);

        // Re-planned this reconcile, not yet read, or no longer on its GPUs: nothing.
        assert!(observations(&spec, &nodes, &current, &[false], Some(&measured)).is_empty());
        let reading = BTreeMap::from([(0, ReplicaMeasure::Measuring)]);
        assert!(observations(&spec, &nodes, &current, &[true], Some(&reading)).is_empty());
        let gone = vec![vec![shard(&["a-g9"])]];
        assert!(observations(&spec, &nodes, &gone, &[true], Some(&measured)).is_empty());
        assert!(observations(&spec, &nodes, &current, &[true], None).is_empty());
    }
}
