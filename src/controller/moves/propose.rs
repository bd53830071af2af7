//! A move proposed in the reconcile of an instance whose replica cannot be
//! placed: the core's move planner run on what the caches show, and the
//! first move of its answer handed to the instance it moves. One move at a
//! time: once it is done the blocked replica looks again, and the planner
//! answers on the cluster as it is then.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::Duration;

use k8s_openapi::api::core::v1::Toleration;
use k8s_openapi::jiff::Timestamp;
use kube::ResourceExt;
use kube::runtime::reflector::ObjectRef;

use super::book::Handed;
use super::progress::places;
use crate::controller::context::{Context, Instance};
use crate::controller::decide::stage::Decided;
use crate::controller::events::EventNote;
use crate::controller::held::{Claims, Held};
use crate::controller::observe::Observed;
use crate::controller::status::Outcome;
use crate::process::wall_deadline::WallDeadline;
use tessera_core::api::{ModelInstance, ModelInstanceSpec, Moves, PlannedShard};
use tessera_core::moves::{MoveAsk, MoveLimits, RunningReplica, plan_moves};
use tessera_core::placement::{Deadline, SolveOptions};
use tessera_core::translate::ClusterNode;

/// What came of looking for moves.
#[derive(Debug, PartialEq)]
enum Proposal {
    /// A move was handed on: what it is, in words.
    Handed(String),
    /// No moves make room: why.
    NoRoom(String),
    /// Moves are off, or as many are in flight as may be.
    NotNow,
}

/// Moves for the first replica of `decided` that has no place, told in its
/// explanation (and in an Event when one is handed on).
pub(crate) fn for_blocked(
    ctx: &Context,
    (mi, instance): (&ModelInstance, &Instance),
    observed: &Observed,
    (held, claims): (&Held, &mut Claims),
    decided: &mut Decided,
    (now, notes): (Timestamp, &mut Vec<EventNote>),
) {
    let tolerations = mi
        .spec
        .template
        .as_ref()
        .and_then(|t| t.spec.as_ref())
        .and_then(|s| s.tolerations.clone())
        .unwrap_or_default();
    let unplaced = decided
        .replicas
        .iter_mut()
        .enumerate()
        .find_map(|(index, r)| match &mut r.outcome {
            Outcome::Unsatisfiable {
                explanation, plan, ..
            } if plan.is_empty() => Some((index as u32, explanation)),
            _ => None,
        });
    let Some((replica, explanation)) = unplaced else {
        return;
    };
    let blocked = Blocked {
        mi,
        instance,
        replica,
        tolerations: &tolerations,
    };
    match propose(ctx, &blocked, observed, held, claims, now) {
        Proposal::Handed(said) => {
            explanation.push_str(&format!("; making room: {said}"));
            notes.push(EventNote {
                warning: false,
                reason: "MakingRoom",
                message: format!("replica {replica}: {said}"),
            });
        }
        Proposal::NoRoom(why) => {
            explanation.push_str(&format!("; no moves make room: {why}"));
        }
        Proposal::NotNow => {}
    }
}

/// The blocked replica and what it is asked against.
struct Blocked<'a> {
    pub(crate) mi: &'a ModelInstance,
    pub(crate) instance: &'a Instance,
    pub(crate) replica: u32,
    pub(crate) tolerations: &'a [Toleration],
}

fn propose(
    ctx: &Context,
    blocked: &Blocked,
    observed: &Observed,
    held: &Held,
    claims: &mut Claims,
    now: Timestamp,
) -> Proposal {
    let settings = &ctx.settings.moves;
    if !settings.enabled {
        return Proposal::NotNow;
    }
    let instances = ctx.caches.instances.state();
    let in_flight = instances
        .iter()
        .filter(|mi| mi.status.as_ref().is_some_and(|s| !s.moves.is_empty()))
        .count()
        + ctx.moves.handed_count();
    if in_flight >= settings.max_in_flight {
        return Proposal::NotNow;
    }
    let nodes: Vec<ClusterNode> = observed
        .nodes
        .iter()
        .filter(|n| n.accepts(blocked.tolerations).is_ok() && !n.lost(now, ctx.settings.node_grace))
        .map(|n| n.gpus.clone())
        .collect();
    let world = running(ctx, &instances, &blocked.instance.uid, now);
    let replicas: Vec<RunningReplica> = world
        .iter()
        .map(|r| RunningReplica {
            holder: r.holder.clone(),
            spec: &r.spec,
            shards: r.shards.clone(),
            ready: r.ready,
        })
        .collect();
    // Whatever else holds a device (pods outside tessera, plans the cache
    // does not show yet) is never moved.
    let theirs: HashSet<(&str, &str)> = world
        .iter()
        .flat_map(|r| r.held.iter())
        .flat_map(|s| s.devices.iter().map(|d| (s.node.as_str(), d.as_str())))
        .collect();
    let others: HashMap<(String, String), String> = held
        .devices
        .iter()
        .filter(|((node, device), _)| !theirs.contains(&(node.as_str(), device.as_str())))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    let blocked_name = holder(
        &blocked.instance.namespace,
        &blocked.instance.name,
        blocked.replica,
    );
    let deadline = WallDeadline::after(Duration::from_millis(u64::from(
        blocked.mi.spec.placement.deadline_ms,
    )));
    let options = SolveOptions {
        deadline: Some(&deadline as &dyn Deadline),
        max_steps: ctx.settings.max_steps,
    };
    let answer = plan_moves(&MoveAsk {
        nodes: &nodes,
        others: &others,
        running: &replicas,
        blocked: &blocked.mi.spec,
        blocked_name: &blocked_name,
        limits: MoveLimits::default(),
        options: &options,
    });
    let plan = match answer {
        Ok(plan) => plan,
        Err(no_room) => return Proposal::NoRoom(no_room.reason),
    };
    let Some(first) = plan.moves.first() else {
        return Proposal::NotNow;
    };
    let Some(victim) = world.iter().find(|r| r.holder == first.replica) else {
        return Proposal::NotNow;
    };
    let copy = 1 - victim.shards.first().map_or(0, |s| s.copy.min(1));
    let to: Vec<PlannedShard> = first
        .to
        .iter()
        .map(|shard| PlannedShard {
            replica: victim.replica,
            copy,
            ..shard.clone()
        })
        .collect();
    let said = format!(
        "moving {} from {} to {} ({} of {} moves, {} GPUs in all)",
        victim.holder,
        places(&victim.shards),
        places(&to),
        1,
        plan.moves.len(),
        plan.gpus_moved
    );
    // Held for the moved instance from now on, before its reconcile writes
    // the move into its status.
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
            to,
            reason: format!("to make room for {blocked_name}"),
            for_instance: Some(
                ObjectRef::new(&blocked.instance.name).within(&blocked.instance.namespace),
            ),
        },
    );
    Proposal::Handed(said)
}

/// A running replica of some instance, as the planner is to see it.
struct Running {
    uid: String,
    namespace: String,
    name: String,
    replica: u32,
    holder: String,
    /// Its instance's spec, with `moves: Never` where it may not move now.
    spec: ModelInstanceSpec,
    shards: Vec<PlannedShard>,
    /// Every shard it holds devices with (both copies during a move).
    held: Vec<PlannedShard>,
    ready: bool,
}

/// Every instance's placed replicas. Those of the blocked instance itself,
/// of an instance with a move in flight or handed, and those whose last
/// move was abandoned a short while ago stay where they are.
fn running(
    ctx: &Context,
    instances: &[std::sync::Arc<ModelInstance>],
    blocked_uid: &str,
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
        let busy = uid == blocked_uid || !status.moves.is_empty() || ctx.moves.is_handed(&uid);
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
            });
        }
    }
    out
}

fn holder(namespace: &str, name: &str, replica: u32) -> String {
    format!("{namespace}/{name} replica {replica}")
}
