//! The cluster as the controller's move planners see it from the caches:
//! every instance's placed replicas (those that may not move now frozen),
//! what else holds devices, whether another move may start, whether a
//! move's nodes take its replica's pods, and a chosen move handed to the
//! instance it moves.

use std::borrow::Borrow;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;

use k8s_openapi::jiff::Timestamp;
use kube::ResourceExt;
use kube::runtime::reflector::ObjectRef;

use super::book::Handed;
use crate::controller::context::Context;
use crate::controller::held::{Claims, Held};
use crate::controller::nodes::{NodeInfo, tolerations_of};
use tessera_core::api::{ModelInstance, ModelInstanceSpec, Moves, PlannedShard, ServingCorrection};
use tessera_core::moves::{Move, RunningReplica};

/// Whether one more move may start: fewer in flight (recorded or handed
/// on) than `--max-moves-in-flight`.
pub(super) fn room_for_another(ctx: &Context, instances: &[Arc<ModelInstance>]) -> bool {
    let live: HashSet<&str> = instances
        .iter()
        .filter_map(|mi| mi.metadata.uid.as_deref())
        .collect();
    let in_flight = instances
        .iter()
        .filter(|mi| mi.status.as_ref().is_some_and(|s| !s.moves.is_empty()))
        .count()
        + ctx.moves.handed_count(|uid| live.contains(uid));
    in_flight < ctx.settings.moves.max_in_flight
}

/// A node some move of `moves` takes a replica of `world` to whose taints
/// that replica's pods do not tolerate (or that is not among `nodes`): the
/// core's planners see one cluster for every replica, the pods of each see
/// their own, so an answer with such a move is not taken.
pub(super) fn untolerated(
    world: &[Running],
    nodes: &[impl Borrow<NodeInfo>],
    moves: &[Move],
) -> Option<String> {
    for moved in moves {
        let Some(replica) = world.iter().find(|r| r.holder == moved.replica) else {
            return Some("a node of an instance that is gone".to_string());
        };
        let tolerations = tolerations_of(&replica.spec);
        for shard in &moved.to {
            let refused = nodes
                .iter()
                .map(Borrow::borrow)
                .find(|n| n.name() == shard.node)
                .is_none_or(|n| n.accepts(&tolerations).is_err());
            if refused {
                return Some(shard.node.clone());
            }
        }
    }
    None
}

/// The planner's view of `world`.
pub(super) fn replicas(world: &[Running]) -> Vec<RunningReplica<'_>> {
    world
        .iter()
        .map(|r| RunningReplica {
            holder: r.holder.clone(),
            instance: format!("{}/{}", r.namespace, r.name),
            spec: &r.spec,
            shards: r.shards.clone(),
            ready: r.ready,
            corrections: &r.corrections,
        })
        .collect()
}

/// What holds devices besides the replicas of `world` (pods outside
/// tessera, plans the cache does not show yet): never moved.
pub(super) fn others(world: &[Running], held: &Held) -> HashMap<(String, String), String> {
    let theirs: HashSet<(&str, &str)> = world
        .iter()
        .flat_map(|r| r.held.iter())
        .flat_map(|s| s.devices.iter().map(|d| (s.node.as_str(), d.as_str())))
        .collect();
    held.devices
        .iter()
        .filter(|((node, device), _)| !theirs.contains(&(node.as_str(), device.as_str())))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect()
}

/// Hands `chosen` (a move of `victim`) to its instance: its new copy under
/// the replica's other pod names, its devices held for the instance from
/// now on (before its reconcile writes the move into its status). Gives the
/// new copy's shards.
pub(super) fn hand(
    ctx: &Context,
    (instances, claims): (&[Arc<ModelInstance>], &mut Claims),
    victim: &Running,
    chosen: &Move,
    reason: String,
) -> Vec<PlannedShard> {
    let copy = 1 - victim.shards.first().map_or(0, |s| s.copy.min(1));
    let to: Vec<PlannedShard> = chosen
        .to
        .iter()
        .map(|shard| PlannedShard {
            replica: victim.replica,
            copy,
            ..shard.clone()
        })
        .collect();
    let claimed = claims.entry(victim.uid.clone()).or_insert_with(|| {
        instances
            .iter()
            .find(|mi| mi.metadata.uid.as_deref() == Some(victim.uid.as_str()))
            .and_then(|mi| mi.status.as_ref())
            .map(|s| s.plan.clone())
            .unwrap_or_default()
    });
    claimed.extend(to.iter().cloned());
    ctx.moves.hand(
        &victim.uid,
        ObjectRef::new(&victim.name).within(&victim.namespace),
        Handed {
            replica: victim.replica,
            from: victim.shards.clone(),
            to: to.clone(),
            reason,
        },
    );
    to
}

/// A running replica of some instance, as the planner is to see it.
pub(super) struct Running {
    pub(super) uid: String,
    pub(super) namespace: String,
    pub(super) name: String,
    pub(super) replica: u32,
    pub(super) holder: String,
    /// Its instance's spec, with `moves: Never` where it may not move now.
    pub(super) spec: ModelInstanceSpec,
    pub(super) shards: Vec<PlannedShard>,
    /// Every shard it holds devices with (both copies during a move).
    pub(super) held: Vec<PlannedShard>,
    pub(super) ready: bool,
    /// Its instance's measured corrections (`status.corrections`).
    pub(super) corrections: Vec<ServingCorrection>,
}

/// Every instance's placed replicas. Those of the instance `frozen` (the
/// blocked one, which does not move its own replicas for itself), of an
/// instance with a move in flight or handed, and those whose last move was
/// abandoned a short while ago stay where they are.
pub(super) fn running(
    ctx: &Context,
    instances: &[Arc<ModelInstance>],
    frozen: &str,
    now: Timestamp,
) -> Vec<Running> {
    let mut out = Vec::new();
    for mi in instances {
        let (Some(uid), Some(status)) = (mi.uid(), mi.status.as_ref()) else {
            continue;
        };
        if mi.metadata.deletion_timestamp.is_some() {
            continue;
        }
        let namespace = mi.namespace().unwrap_or_default();
        let name = mi.name_any();
        let busy = uid == frozen || !status.moves.is_empty() || ctx.moves.is_handed(&uid);
        let mut by_replica: BTreeMap<u32, Vec<PlannedShard>> = BTreeMap::new();
        for shard in &status.plan {
            by_replica
                .entry(shard.replica)
                .or_default()
                .push(shard.clone());
        }
        for (replica, shards) in by_replica {
            let mut spec = mi.spec.clone();
            if busy || ctx.moves.backing_off(&uid, replica, now) {
                spec.placement.moves = Moves::Never;
            }
            let held = shards
                .iter()
                .cloned()
                .chain(
                    status
                        .moves
                        .iter()
                        .filter(|m| m.replica == replica)
                        .flat_map(|m| m.held().cloned()),
                )
                .collect();
            out.push(Running {
                uid: uid.clone(),
                namespace: namespace.clone(),
                name: name.clone(),
                replica,
                holder: holder(&namespace, &name, replica),
                spec,
                shards,
                held,
                // Replicas count as one; fewer ready than placed makes
                // every replica of the instance cheap to move.
                ready: status.ready_replicas >= status.replicas && status.replicas > 0,
                corrections: status.corrections.clone(),
            });
        }
    }
    out
}

pub(super) fn holder(namespace: &str, name: &str, replica: u32) -> String {
    format!("{namespace}/{name} replica {replica}")
}
