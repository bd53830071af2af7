//! A replica leaves a cordoned node before a drain takes it: in the
//! instance's own reconcile, the core's evacuation planner run on the
//! caches, and the move that takes this instance's first replica off the
//! cordoned nodes handed to itself. The move then runs make before break as
//! any other (`progress`); one that cannot be made is told once, with why.

use std::collections::BTreeSet;

use k8s_openapi::jiff::Timestamp;

use super::progress::places;
use super::world::{hand, others, replicas, room_for_another, running};
use crate::controller::context::{Context, Instance};
use crate::controller::decide::stage::Decided;
use crate::controller::decide::{deadline, options};
use crate::controller::events::EventNote;
use crate::controller::held::{Claims, Held};
use crate::controller::observe::Observed;
use tessera_core::api::ModelInstance;
use tessera_core::moves::{EvacuationAsk, plan_evacuation};
use tessera_core::translate::ClusterNode;

/// Moves this instance's replicas off cordoned nodes, one at a time.
pub(crate) fn for_cordoned(
    ctx: &Context,
    (mi, instance): (&ModelInstance, &Instance),
    observed: &Observed,
    (held, claims): (&Held, &mut Claims),
    decided: &Decided,
    (now, notes): (Timestamp, &mut Vec<EventNote>),
) {
    if !ctx.settings.moves.enabled
        || !mi.spec.placement.moves.is_allowed()
        || decided.moving.is_some()
        || ctx.moves.is_handed(&instance.uid)
    {
        return;
    }
    let leaving: BTreeSet<String> = observed
        .nodes
        .iter()
        .filter(|n| n.cordoned)
        .map(|n| n.name().to_string())
        .collect();
    let plan = decided.plan();
    if !plan.iter().any(|shard| leaving.contains(&shard.node)) {
        return;
    }
    let instances = ctx.caches.instances.state();
    if !room_for_another(ctx, &instances) {
        return;
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
        leaving: &leaving,
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
        notes.push(EventNote {
            warning: false,
            reason: "LeavingNode",
            message: format!(
                "replica {} leaves cordoned node {}: moving from {} to {}",
                victim.replica,
                left.join(", "),
                places(&victim.shards),
                places(&to)
            ),
        });
        return;
    }
    for staying in &evacuation.staying {
        if mine(&staying.replica).is_some() {
            let message = format!(
                "{} stays on a cordoned node: {}",
                staying.replica, staying.reason
            );
            if ctx.moves.first_told(&instance.uid, &message) {
                notes.push(EventNote {
                    warning: true,
                    reason: "CannotLeave",
                    message,
                });
            }
        }
    }
}
