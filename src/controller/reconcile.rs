//! One reconcile of a ModelInstance, as a plain sequence of stages:
//! observe (the caches) → validate → decide (plan, a move carried on) →
//! moves (room looked for when a replica has none, cordoned nodes left,
//! with continuous moves a replica moved where it serves more) →
//! build → apply → status,
//! then the Events for what was decided and when to look again. The stages
//! live in their own modules (`observe`, `validate`, `decide::stage`, `build`,
//! `apply::stage`, `status::write`, `events`, `requeue`); this file only hands
//! each one what the earlier ones produced.

use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::jiff::Timestamp;
use kube::ResourceExt;
use kube::runtime::controller::Action;

use super::context::Instance;
pub use super::context::{Caches, Context, Error};
use super::decide::stage as decide;
use super::lock;
pub use super::settings::{
    ContinuousMoves, MeasureSettings, MoveSettings, ScalingSettings, Settings,
};
use super::{
    apply::stage as apply, build, events, moves, observe, requeue, status::write as status,
    validate,
};
use tessera_core::api::ModelInstance;

pub async fn reconcile(mi: Arc<ModelInstance>, ctx: Arc<Context>) -> Result<Action, Error> {
    if mi.metadata.deletion_timestamp.is_some() {
        // Owner references take the pods and the Service with it.
        return Ok(Action::await_change());
    }
    // Nothing is judged before every cache has its first list. Before the pod
    // cache has it, the instance's own shard pods are unknown and the devices
    // the agents report them holding look taken by others: a new leader
    // re-planned every running shard on a failover (seen once the debounce
    // was short enough to beat the pod list). Before the slice cache has it,
    // every running DRA shard would look changed and be replaced.
    if !ctx
        .metrics
        .synced
        .load(std::sync::atomic::Ordering::Relaxed)
    {
        return Ok(Action::requeue(Duration::from_secs(1)));
    }
    let started = Instant::now();
    ctx.metrics.reconciles.inc();
    let result = reconcile_inner(&mi, &ctx).await;
    ctx.metrics
        .reconcile_seconds
        .observe(started.elapsed().as_secs_f64());
    if result.is_ok()
        && let Some(uid) = mi.uid()
    {
        lock(&ctx.failures).remove(&uid);
    }
    result
}

/// Exponential backoff per instance: 1 s doubling to 5 minutes.
pub(crate) fn error_policy(mi: Arc<ModelInstance>, error: &Error, ctx: Arc<Context>) -> Action {
    ctx.metrics.failure(&error.reason());
    let failure_count = {
        let mut failures = lock(&ctx.failures);
        let failure_count = failures.entry(mi.uid().unwrap_or_default()).or_insert(0);
        *failure_count = failure_count.saturating_add(1);
        *failure_count
    };
    let delay = Duration::from_secs(1u64 << failure_count.min(9).saturating_sub(1))
        .min(Duration::from_secs(300));
    tracing::warn!(instance = %mi.name_any(), error = %error, retry_in = ?delay, "reconcile failed");
    Action::requeue(delay)
}

async fn reconcile_inner(read: &ModelInstance, ctx: &Context) -> Result<Action, Error> {
    let newest = ctx.written.newest(read);
    let mi = newest.as_ref();
    let instance = Instance::of(mi)?;
    let now = Timestamp::now();
    let mut notes = Vec::new();

    let observed = observe::observe(ctx, &instance);
    // Planning is serialised from here to the claim (no await in between but
    // the solver's), so each instance plans against the devices others took.
    let mut claims = ctx.claims.lock().await;
    let held = observe::held_by_others(ctx, &instance, &observed, &mut claims);
    let mut decided = match validate::check(mi, &ctx.settings) {
        Err(invalid) => decide::refuse(mi, invalid, &mut notes),
        Ok(()) => {
            decide::plan(mi, ctx, &instance, &observed, held.clone(), now, &mut notes).await?
        }
    };
    moves::propose::for_blocked(
        ctx,
        (mi, &instance),
        &observed,
        (&held, &mut claims),
        &mut decided,
        (now, &mut notes),
    );
    moves::drain::for_cordoned(
        ctx,
        (mi, &instance),
        &observed,
        (&held, &mut claims),
        &mut decided,
        (now, &mut notes),
    );
    moves::improve::for_cluster(
        ctx,
        (mi, &instance),
        &observed,
        (&held, &mut claims),
        &decided,
        now,
    );
    claims.insert(instance.uid.clone(), decided.plan());
    drop(claims);

    let desired = build::build(mi, &ctx.settings, &observed, &decided);
    let applied = apply::apply(
        mi, ctx, &instance, &observed, &desired, &decided, &mut notes,
    )
    .await;
    let written = match &applied {
        Ok(applied) => status::write_status(mi, ctx, &instance, &decided, applied, now).await,
        Err(_) => Ok(None),
    };
    if let Ok(Some(status)) = &written {
        ctx.written.wrote(mi, status.clone());
    }
    // What was done stays done when a later write fails (a pod bound, then
    // the status refused), and is told now: the retry finds nothing to do.
    events::publish(&ctx.recorder, mi, &notes).await;
    if !notes.is_empty() {
        let instances = ctx.caches.instances.state();
        let live = instances.iter().filter_map(|i| i.metadata.uid.as_deref());
        ctx.event_log.record(&instance.uid, &notes, now, live);
    }
    let applied = applied?;
    written?;

    let after = requeue::after(
        &decided,
        &applied.replicas,
        &observed.nodes,
        now,
        ctx.settings.node_grace,
    );
    // A draining replica is looked at again once its endpoints settled.
    Ok(Action::requeue(if applied.draining {
        after.min(super::apply::drain::SETTLE)
    } else {
        after
    }))
}
