//! A move proposed in the reconcile of an instance whose replica cannot be
//! placed: the core's move planner run on what the caches show, and the
//! first move of its answer handed to the instance it moves. One move at a
//! time: once it is done the blocked replica looks again, and the planner
//! answers on the cluster as it is then.

use k8s_openapi::api::core::v1::Toleration;
use k8s_openapi::jiff::Timestamp;

use super::progress::places;
use super::world::{hand, holder, others, replicas, room_for_another, running, untolerated};
use crate::controller::context::{Context, Instance};
use crate::controller::decide::stage::Decided;
use crate::controller::decide::{deadline, options};
use crate::controller::events::EventNote;
use crate::controller::held::{Claims, Held};
use crate::controller::nodes::tolerations_of;
use crate::controller::observe::Observed;
use crate::controller::status::Outcome;
use tessera_core::api::ModelInstance;
use tessera_core::moves::{MoveAsk, MoveLimits, plan_moves};
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
    let tolerations = tolerations_of(&mi.spec);
    let unplaced = decided
        .replicas
        .iter_mut()
        .find_map(|r| match &mut r.outcome {
            Outcome::Unsatisfiable {
                explanation, plan, ..
            } if plan.is_empty() => Some((r.replica, explanation)),
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
    if !room_for_another(ctx, &instances) {
        return Proposal::NotNow;
    }
    let nodes: Vec<ClusterNode> = observed
        .nodes
        .iter()
        .filter(|n| n.accepts(blocked.tolerations).is_ok() && !n.lost(now, ctx.settings.node_grace))
        .map(|n| n.gpus.clone())
        .collect();
    let world = running(ctx, &instances, &blocked.instance.uid, now);
    let replicas = replicas(&world);
    let others = others(&world, held);
    let blocked_name = holder(
        &blocked.instance.namespace,
        &blocked.instance.name,
        blocked.replica,
    );
    let deadline = deadline(&blocked.mi.spec);
    let options = options(&deadline, ctx.settings.max_steps);
    let answer = plan_moves(&MoveAsk {
        nodes: &nodes,
        others: &others,
        running: &replicas,
        blocked: &blocked.mi.spec,
        blocked_name: &blocked_name,
        blocked_corrections: blocked
            .mi
            .status
            .as_ref()
            .map_or(&[][..], |s| &s.corrections),
        limits: MoveLimits::default(),
        options: &options,
    });
    let plan = match answer {
        Ok(plan) => plan,
        Err(no_room) => return Proposal::NoRoom(no_room.reason),
    };
    if let Some(node) = untolerated(&world, &observed.nodes, &plan.moves) {
        return Proposal::NoRoom(format!(
            "the moves found take a replica to {node}, whose taints its pods do not tolerate"
        ));
    }
    let Some(first) = plan.moves.first() else {
        return Proposal::NotNow;
    };
    let Some(victim) = world.iter().find(|r| r.holder == first.replica) else {
        return Proposal::NotNow;
    };
    let to = hand(
        ctx,
        (&instances, claims),
        victim,
        first,
        format!("to make room for {blocked_name}"),
    );
    Proposal::Handed(format!(
        "moving {} from {} to {} (1 of {} moves, {} GPUs in all)",
        victim.holder,
        places(&victim.shards),
        places(&to),
        plan.moves.len(),
        plan.gpus_moved
    ))
}
