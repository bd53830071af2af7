//! `tessera place -o html`: the cluster map of a plan, on one page with
//! every instance's details, as the live controller draws it.

use std::collections::{BTreeMap, HashMap};

use super::place::Report;
use crate::cluster_map::{ClusterView, MapInstance, MapNode, cluster_page};
use tessera_core::translate::pod_holder;

pub(super) fn html(report: &Report) -> String {
    let mut nodes: Vec<MapNode<'_>> = report
        .nodes
        .iter()
        .map(|node| MapNode {
            node,
            excluded: None,
        })
        .collect();
    nodes.sort_by(|a, b| a.node.name.cmp(&b.node.name));
    // Devices the cluster file says agents handed to pods: held outside the plans,
    // named as place's refusals name them.
    let others: HashMap<(String, String), String> = report
        .nodes
        .iter()
        .flat_map(|n| {
            n.gpu_state
                .allocated
                .iter()
                .map(|(device, uid)| ((n.name.clone(), device.clone()), pod_holder(&n.name, uid)))
        })
        .collect();
    // Replicas of one instance are consecutive placements; keep first-seen order.
    let mut order: Vec<&str> = Vec::new();
    let mut by_name: BTreeMap<&str, MapInstance> = BTreeMap::new();
    for placement in &report.placements {
        let instance = by_name.entry(placement.name.as_str()).or_insert_with(|| {
            order.push(placement.name.as_str());
            MapInstance {
                namespace: String::new(),
                name: placement.name.clone(),
                model: placement.model.clone(),
                phase: String::new(),
                message: None,
                predicted_tokens_per_second: None,
                plan: Vec::new(),
                moves: Vec::new(),
                predictions: Vec::new(),
                curves: Vec::new(),
                measured: BTreeMap::new(),
                target_tpot_ms: placement
                    .serving
                    .clone()
                    .unwrap_or_default()
                    .max_time_per_output_token_ms,
                conditions: Vec::new(),
                events: Vec::new(),
            }
        });
        let replica = placement.replica.unwrap_or(0);
        instance.plan.extend(placement.status_plan.iter().cloned());
        match (&placement.plan, &placement.unsatisfiable) {
            (Some(plan), _) => {
                *instance.predicted_tokens_per_second.get_or_insert(0.0) +=
                    plan.performance.tokens_per_second;
                instance.predictions.push((replica, Ok(plan.plan.clone())));
                if let Some(curve) = match (&plan.serving, &plan.serving_error) {
                    (Some(capacity), _) => Some(Ok(capacity.clone())),
                    (None, Some(why)) => Some(Err(why.clone())),
                    (None, None) => None,
                } {
                    instance.curves.push((replica, curve));
                }
            }
            (None, Some(unsatisfiable)) => {
                instance.message = Some(unsatisfiable.reason.clone());
                instance
                    .predictions
                    .push((replica, Err(unsatisfiable.reason.clone())));
            }
            (None, None) => {}
        }
    }
    let instances = order
        .into_iter()
        .filter_map(|name| by_name.remove(name))
        .map(|mut instance| {
            let placed = instance
                .predictions
                .iter()
                .filter(|(_, p)| p.is_ok())
                .count();
            instance.phase = match (placed, instance.predictions.len()) {
                (0, _) => "Unsatisfiable".to_string(),
                (p, n) if p == n => "Planned".to_string(),
                (p, n) => format!("{p} of {n} replicas planned"),
            };
            instance
        })
        .collect();
    cluster_page(&ClusterView {
        title: report.cluster.clone(),
        nodes,
        instances,
        others,
        instance_pages: false,
    })
}
