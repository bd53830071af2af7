//! A replica leaves a cordoned node before a drain takes it: in the
//! instance's own reconcile, the core's evacuation planner run on the
//! caches, and the move that takes this instance's first replica off the
//! cordoned nodes handed to itself. The move then runs make before break as
//! any other (`progress`); one that cannot be made is told once, with why,
//! and the `OnCordonedNode` condition says how the replicas stand.

use std::collections::BTreeSet;

use k8s_openapi::jiff::Timestamp;

use super::progress::places;
use super::world::{hand, others, replicas, room_for_another, running, untolerated};
use crate::controller::context::{Context, Instance};
use crate::controller::decide::stage::Decided;
use crate::controller::decide::{deadline, options};
use crate::controller::events::EventNote;
use crate::controller::held::{Claims, Held};
use crate::controller::observe::Observed;
use tessera_core::api::ModelInstance;
use tessera_core::moves::{EvacuationAsk, plan_evacuation};
use tessera_core::translate::ClusterNode;

/// Moves this instance's replicas off cordoned nodes, one at a time, and
/// says how that stands in `decided.cordoned` (the `OnCordonedNode`
/// condition) while any of its shards is on one.
pub(crate) fn for_cordoned(
    ctx: &Context,
    (mi, instance): (&ModelInstance, &Instance),
    observed: &Observed,
    (held, claims): (&Held, &mut Claims),
    decided: &mut Decided,
    (now, notes): (Timestamp, &mut Vec<EventNote>),
) {
    let leaving: BTreeSet<String> = observed
        .nodes
        .iter()
        .filter(|n| n.cordoned)
        .map(|n| n.name().to_string())
        .collect();
    // Both copies while a move is in flight: the old one leaves last.
    let plan = decided.plan();
    let on: BTreeSet<&str> = plan
        .iter()
        .filter(|shard| leaving.contains(&shard.node))
        .map(|shard| shard.node.as_str())
        .collect();
    if on.is_empty() {
        return;
    }
    let on = Vec::from_iter(on).join(", ");
    decided.cordoned = Some(standing(
        ctx,
        (mi, instance),
        observed,
        (held, claims),
        (decided, &leaving, &on),
        (now, notes),
    ));
}

/// How this instance's replicas on the cordoned nodes `on` stand: a move
/// that takes one off handed to itself now, or why none is.
fn standing(
    ctx: &Context,
    (mi, instance): (&ModelInstance, &Instance),
    observed: &Observed,
    (held, claims): (&Held, &mut Claims),
    (decided, leaving, on): (&Decided, &BTreeSet<String>, &str),
    (now, notes): (Timestamp, &mut Vec<EventNote>),
) -> (&'static str, String) {
    let cannot = |why: &str| {
        (
            "CannotLeave",
            format!("on cordoned node {on}: {why}; a drain evicts its pods as they are"),
        )
    };
    if !ctx.settings.moves.enabled {
        return cannot("moves are off (--moves=false)");
    }
    if !mi.spec.placement.moves.is_allowed() {
        return cannot("its instance has placement.moves: Never");
    }
    if let Some(moving) = &decided.moving {
        return (
            "Leaving",
            format!(
                "on cordoned node {on}: a move is under way ({})",
                moving.record.reason
            ),
        );
    }
    if ctx.moves.is_handed(&instance.uid) {
        return (
            "Leaving",
            format!("on cordoned node {on}: a move is about to start"),
        );
    }
    let instances = ctx.caches.instances.state();
    if !room_for_another(ctx, &instances) {
        return (
            "Leaving",
            format!(
                "on cordoned node {on}: waiting for a move to end (at most {} at once, --max-moves-in-flight)",
                ctx.settings.moves.max_in_flight
            ),
        );
    }
    // The leaving nodes stay in the world: their replicas hold devices
    // there until their new copies serve.
    let nodes: Vec<ClusterNode> = observed
        .nodes
        .iter()
        .filter(|n| !n.lost(now, ctx.settings.node_grace))
        .map(|n| n.gpus.clone())
        .collect();
    let world = running(ctx, &instances, "", now);
    let planned = replicas(&world);
    let others = others(&world, held);
    let deadline = deadline(&mi.spec);
    let options = options(&deadline, ctx.settings.max_steps);
    let evacuation = plan_evacuation(&EvacuationAsk {
        nodes: &nodes,
        others: &others,
        running: &planned,
        leaving,
        options: &options,
    });
    let mine = |holder: &str| {
        world
            .iter()
            .find(|r| r.holder == holder && r.uid == instance.uid)
    };
    if let Some((victim, chosen)) = evacuation
        .moves
        .iter()
        .find_map(|m| Some((mine(&m.replica)?, m)))
    {
        if let Some(node) = untolerated(&world, &observed.nodes, std::slice::from_ref(chosen)) {
            return cannot(&format!(
                "the move found takes it to {node}, whose taints its pods do not tolerate"
            ));
        }
        let left: Vec<&str> = victim
            .shards
            .iter()
            .filter(|s| leaving.contains(&s.node))
            .map(|s| s.node.as_str())
            .collect();
        let to = hand(
            ctx,
            (&instances, claims),
            victim,
            chosen,
            format!("to leave cordoned node {}", left.join(", ")),
        );
        let message = format!(
            "replica {} leaves cordoned node {}: moving from {} to {}",
            victim.replica,
            left.join(", "),
            places(&victim.shards),
            places(&to)
        );
        notes.push(EventNote {
            warning: false,
            reason: "LeavingNode",
            message: message.clone(),
        });
        return ("Leaving", message);
    }
    let mut staying = Vec::new();
    for stays in &evacuation.staying {
        if mine(&stays.replica).is_some() {
            let message = format!(
                "{} stays on a cordoned node: {}",
                stays.replica, stays.reason
            );
            if ctx.moves.first_told(&instance.uid, &message) {
                notes.push(EventNote {
                    warning: true,
                    reason: "CannotLeave",
                    message: message.clone(),
                });
            }
            staying.push(message);
        }
    }
    if staying.is_empty() {
        cannot("no move takes its replicas off now")
    } else {
        ("CannotLeave", staying.join("; "))
    }
}
