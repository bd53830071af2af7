//! Continuous moves (`--continuous-moves`, opt-in): while nothing is
//! blocked or moving, the core's improvement planner is run on the caches
//! at most once per `--continuous-interval`, and the first move of the
//! improvement it finds is handed to the instance it moves. Only replicas of
//! instances whose every replica is Ready move, only onto nodes their pods
//! tolerate; a replica that makes way is followed by the one it makes way
//! for at the next look, without waiting for the interval.

use std::collections::BTreeSet;
use std::sync::Arc;

use k8s_openapi::jiff::Timestamp;

use super::progress::places;
use super::world::{hand, others, replicas, room_for_another, running, untolerated};
use crate::controller::context::{Context, Instance};
use crate::controller::decide::stage::Decided;
use crate::controller::decide::{deadline, options};
use crate::controller::held::{Claims, Held};
use crate::controller::nodes::{NodeInfo, Readiness};
use crate::controller::observe::Observed;
use tessera_core::api::{ModelInstance, Moves};
use tessera_core::moves::{IMPROVE_MAX_TRIED, ImproveAsk, plan_improvement};
use tessera_core::placement::SolveOptions;
use tessera_core::translate::ClusterNode;

/// Looks for a continuous move, from the reconcile of `instance`, once its
/// own plan is settled (what it decided is what its status holds).
pub(crate) fn for_cluster(
    ctx: &Context,
    (mi, instance): (&ModelInstance, &Instance),
    observed: &Observed,
    (held, claims): (&Held, &mut Claims),
    decided: &Decided,
    now: Timestamp,
) {
    let settings = &ctx.settings.moves;
    let Some(continuous) = settings.continuous.as_ref().filter(|_| settings.enabled) else {
        return;
    };
    let settled = decided.moving.is_none()
        && mi
            .status
            .as_ref()
            .is_some_and(|status| status.plan == decided.plan());
    if !settled {
        return;
    }
    let instances = ctx.caches.instances.state();
    if any_move_under_way(ctx, &instances) || !room_for_another(ctx, &instances) {
        return;
    }
    if !ctx.moves.continuous_due(now, continuous.interval) {
        return;
    }
    // Replicas on nodes that take no new pods stay (a drain moves those);
    // the rest is where moves may go.
    let open: Vec<&NodeInfo> = observed
        .nodes
        .iter()
        .map(Arc::as_ref)
        .filter(|n| !n.cordoned && matches!(n.readiness, Readiness::Ready | Readiness::Unreported))
        .collect();
    let open_names: BTreeSet<&str> = open.iter().map(|n| n.name()).collect();
    let nodes: Vec<ClusterNode> = open.iter().map(|n| n.gpus.clone()).collect();
    let mut world = running(ctx, &instances, "", now);
    for replica in &mut world {
        let all_open = replica
            .shards
            .iter()
            .all(|s| open_names.contains(s.node.as_str()));
        if !replica.ready || !all_open {
            replica.spec.placement.moves = Moves::Never;
        }
    }
    let planned = replicas(&world);
    let others = others(&world, held);
    let deadline = deadline(&mi.spec);
    let options: SolveOptions = options(&deadline, ctx.settings.max_steps);
    let Some(found) = plan_improvement(&ImproveAsk {
        nodes: &nodes,
        others: &others,
        running: &planned,
        min_gain: continuous.min_gain,
        max_tried: IMPROVE_MAX_TRIED,
        options: &options,
    }) else {
        tracing::debug!(instance = %instance.name, "continuous moves: nothing gains enough");
        return;
    };
    let Some(first) = found.moves.first() else {
        return;
    };
    let Some(victim) = world.iter().find(|r| r.holder == first.replica) else {
        return;
    };
    if let Some(node) = untolerated(&world, &open, &found.moves) {
        tracing::info!(
            replica = %first.replica,
            node,
            "continuous moves: an improvement was found but a replica's pods do not tolerate {node}; not moved"
        );
        return;
    }
    if found.moves.len() > 1 {
        // The replica it makes way for moves at the next look.
        ctx.moves.continuous_soon(now);
    }
    let gained = found.gain();
    let to = hand(
        ctx,
        (&instances, claims),
        victim,
        first,
        format!(
            "to serve more: {:.1} TFLOP/s of model work at the targets instead of {:.1} for the {} replica(s) moved (the cluster {:.2} TFLOP/s per GPU instead of {:.2})",
            found.work_tflops_after,
            found.work_tflops_before,
            found.moves.len(),
            found.cluster_tflops_per_gpu_after,
            found.cluster_tflops_per_gpu_before,
        ),
    );
    tracing::info!(
        replica = %victim.holder,
        from = %places(&victim.shards),
        to = %places(&to),
        moves = found.moves.len(),
        gained,
        "continuous moves: moving a replica where the cluster serves more"
    );
}

/// Whether a move is recorded in any status or handed and not yet taken:
/// continuous moves wait for every other move to end.
fn any_move_under_way(ctx: &Context, instances: &[Arc<ModelInstance>]) -> bool {
    let live: BTreeSet<&str> = instances
        .iter()
        .filter_map(|mi| mi.metadata.uid.as_deref())
        .collect();
    ctx.moves.handed_count(|uid| live.contains(uid)) > 0
        || instances
            .iter()
            .any(|mi| mi.status.as_ref().is_some_and(|s| !s.moves.is_empty()))
}
