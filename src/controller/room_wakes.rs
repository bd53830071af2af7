//! Waking the instances that wait for room, at most once per pause, and
//! which instances those are.
//!
//! Any Node or slice change may make room, so each one wakes every waiting
//! instance. Handed to the reconcile queue one by one, a storm of them (5,000
//! Nodes losing their `not-ready` taints, a few a second) would hold those
//! instances back for as long as it lasts: the queue's debounce restarts with
//! each trigger. So the changes are gathered: the first is handed on at
//! once, and all that come during the pause after it together at its end.

use std::sync::Arc;
use std::time::Duration;

use futures::{Stream, stream};
use kube::runtime::reflector::{ObjectRef, Store};
use tokio::sync::Notify;
use tokio::time::Instant;

use super::status::PLACED;
use tessera_core::api::{ModelInstance, ModelInstanceStatus};

/// Where a change that may have made room is noted.
#[derive(Clone)]
pub(crate) struct RoomChanges(Arc<Notify>);

impl RoomChanges {
    pub(crate) fn note(&self) {
        // One stored permit stands for any number of changes.
        self.0.notify_one();
    }
}

/// A noter and the stream of wakes it feeds: one item per burst of noted
/// changes, never two within `pause`, none lost.
pub(crate) fn room_wakes(pause: Duration) -> (RoomChanges, impl Stream<Item = ()> + Send) {
    let notify = Arc::new(Notify::new());
    let last: Option<Instant> = None;
    let wakes = stream::unfold(
        (Arc::clone(&notify), last),
        move |(notify, last)| async move {
            if let Some(last) = last {
                tokio::time::sleep_until(last + pause).await;
            }
            notify.notified().await;
            Some(((), (notify, Some(Instant::now()))))
        },
    );
    (RoomChanges(notify), wakes)
}

/// Instances waiting for room: any Node or slice change may make it (woken
/// through `room_wakes`). A new instance, with no status yet, is woken by its
/// own creation.
pub(crate) fn waiting_instances(instances: &Store<ModelInstance>) -> Vec<ObjectRef<ModelInstance>> {
    instances_where(instances, |status| {
        !status
            .conditions
            .iter()
            .any(|c| c.type_ == PLACED && c.status == "True")
    })
}

pub(crate) fn instances_where(
    instances: &Store<ModelInstance>,
    wanted: impl Fn(&ModelInstanceStatus) -> bool,
) -> Vec<ObjectRef<ModelInstance>> {
    instances
        .state()
        .iter()
        .filter(|mi| mi.status.as_ref().is_some_and(&wanted))
        .map(|mi| ObjectRef::from_obj(mi.as_ref()))
        .collect()
}

#[cfg(test)]
mod tests {
    use futures::StreamExt;
    use tokio::time::advance;

    use super::*;

    const PAUSE: Duration = Duration::from_secs(1);

    #[tokio::test(start_paused = true)]
    async fn the_first_change_wakes_at_once_and_a_burst_once_after_the_pause() {
        let (changes, wakes) = room_wakes(PAUSE);
        let mut wakes = Box::pin(wakes);
        let start = Instant::now();
        changes.note();
        wakes.next().await;
        assert_eq!(start.elapsed(), Duration::ZERO);
        // A storm: a change every 90 ms for 2.7 s.
        let storm = tokio::spawn({
            let changes = changes.clone();
            async move {
                for _ in 0..30 {
                    tokio::time::sleep(Duration::from_millis(90)).await;
                    changes.note();
                }
            }
        });
        let mut woke_at = Vec::new();
        for _ in 0..3 {
            wakes.next().await;
            woke_at.push(start.elapsed());
        }
        // Once per pause while it lasts, never held back until it ends.
        assert_eq!(
            woke_at,
            [1, 2, 3].map(Duration::from_secs),
            "woken at {woke_at:?}"
        );
        storm.await.unwrap();
        // The third wake carried the storm's last changes.
        let quiet = tokio::time::timeout(Duration::from_secs(60), wakes.next()).await;
        assert!(quiet.is_err(), "woken with no change");
    }

    #[tokio::test(start_paused = true)]
    async fn a_change_after_a_quiet_spell_wakes_at_once() {
        let (changes, wakes) = room_wakes(PAUSE);
        let mut wakes = Box::pin(wakes);
        changes.note();
        wakes.next().await;
        advance(Duration::from_secs(5)).await;
        let start = Instant::now();
        changes.note();
        wakes.next().await;
        assert_eq!(start.elapsed(), Duration::ZERO);
    }
}
