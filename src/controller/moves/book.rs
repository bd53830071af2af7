//! What the controller knows of moves besides the statuses: a move handed
//! to the instance it moves but not yet in that instance's status, the
//! replicas whose move was abandoned (left alone for a while), refusals
//! told, and how to wake an instance's reconcile from another's.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use k8s_openapi::jiff::Timestamp;
use kube::runtime::reflector::ObjectRef;
use tokio::sync::mpsc::UnboundedSender;

use crate::controller::lock;
use tessera_core::api::{ModelInstance, PlannedShard};

/// A move the planner chose, handed to the moved instance's next reconcile,
/// which writes it into its status before it starts anything.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Handed {
    pub(crate) replica: u32,
    pub(crate) from: Vec<PlannedShard>,
    pub(crate) to: Vec<PlannedShard>,
    pub(crate) reason: String,
}

#[derive(Default)]
pub(crate) struct MoveBook {
    /// By the moved instance's UID.
    handed: Mutex<HashMap<String, Handed>>,
    /// Until when a replica whose move was abandoned is not moved again, by
    /// (instance UID, replica).
    backoff: Mutex<HashMap<(String, u32), Timestamp>>,
    wake: Mutex<Option<UnboundedSender<ObjectRef<ModelInstance>>>>,
    /// The last refusal told about each instance (by UID).
    told: Mutex<HashMap<String, String>>,
    /// When continuous moves may look next; unset until the first ask.
    continuous_next: Mutex<Option<Timestamp>>,
}

impl MoveBook {
    /// Where wakes go (the controller's reconcile queue).
    pub(crate) fn wake_into(&self, sender: UnboundedSender<ObjectRef<ModelInstance>>) {
        *lock(&self.wake) = Some(sender);
    }

    pub(crate) fn wake(&self, instance: ObjectRef<ModelInstance>) {
        if let Some(sender) = lock(&self.wake).as_ref() {
            // A closed queue means the controller is stopping.
            let _ = sender.send(instance);
        }
    }

    /// Hands `handed` to the instance with UID `uid` and wakes it.
    pub(crate) fn hand(&self, uid: &str, instance: ObjectRef<ModelInstance>, handed: Handed) {
        lock(&self.handed).insert(uid.to_string(), handed);
        self.wake(instance);
    }

    /// The move handed to the instance with UID `uid`, taken.
    pub(crate) fn take(&self, uid: &str) -> Option<Handed> {
        lock(&self.handed).remove(uid)
    }

    /// Whether a move is handed to `uid` and not yet taken.
    pub(crate) fn is_handed(&self, uid: &str) -> bool {
        lock(&self.handed).contains_key(uid)
    }

    /// Moves handed and not yet taken, once those handed to instances that
    /// are gone (`live` says which are not) are forgotten.
    pub(crate) fn handed_count(&self, live: impl Fn(&str) -> bool) -> usize {
        let mut handed = lock(&self.handed);
        handed.retain(|uid, _| live(uid));
        handed.len()
    }

    /// Whether `message` differs from the last one told about `uid` (and
    /// is now the last): a refusal is told once, not at every reconcile.
    pub(crate) fn first_told(&self, uid: &str, message: &str) -> bool {
        let mut told = lock(&self.told);
        if told.get(uid).is_some_and(|last| last == message) {
            return false;
        }
        told.insert(uid.to_string(), message.to_string());
        true
    }

    /// Whether continuous moves may look now; if so, the next look is an
    /// `interval` away. The first ask only starts the clock: a controller
    /// that just started (or took over) sees the cluster a while first.
    pub(crate) fn continuous_due(&self, now: Timestamp, interval: Duration) -> bool {
        let mut next = lock(&self.continuous_next);
        let later = now.checked_add(interval).unwrap_or(now);
        match *next {
            Some(due) if due > now => false,
            Some(_) => {
                *next = Some(later);
                true
            }
            None => {
                *next = Some(later);
                false
            }
        }
    }

    /// The next look may come as soon as no move is under way: an
    /// improvement of two moves is not held up between them.
    pub(crate) fn continuous_soon(&self, now: Timestamp) {
        *lock(&self.continuous_next) = Some(now);
    }

    pub(crate) fn back_off(&self, uid: &str, replica: u32, until: Timestamp) {
        lock(&self.backoff).insert((uid.to_string(), replica), until);
    }

    /// Whether the replica's last move was abandoned less than the backoff ago.
    pub(crate) fn backing_off(&self, uid: &str, replica: u32, now: Timestamp) -> bool {
        let mut backoff = lock(&self.backoff);
        backoff.retain(|_, until| *until > now);
        backoff.contains_key(&(uid.to_string(), replica))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn handed(replica: u32) -> Handed {
        Handed {
            replica,
            from: Vec::new(),
            to: Vec::new(),
            reason: "room".into(),
        }
    }

    #[tokio::test]
    async fn a_handed_move_is_taken_once_and_wakes_its_instance() {
        let book = MoveBook::default();
        let (sender, mut woken) = tokio::sync::mpsc::unbounded_channel();
        book.wake_into(sender);
        book.hand("uid-a", ObjectRef::new("a").within("ns"), handed(1));
        assert!(book.is_handed("uid-a"));
        assert_eq!(book.handed_count(|_| true), 1);
        assert_eq!(woken.recv().await.map(|r| r.name), Some("a".to_string()));
        assert_eq!(book.take("uid-a"), Some(handed(1)));
        assert_eq!(book.take("uid-a"), None);
        assert_eq!(book.handed_count(|_| true), 0);
    }

    #[test]
    fn a_move_handed_to_an_instance_that_is_gone_is_forgotten() {
        let book = MoveBook::default();
        book.hand("uid-a", ObjectRef::new("a").within("ns"), handed(0));
        book.hand("uid-b", ObjectRef::new("b").within("ns"), handed(0));
        assert_eq!(book.handed_count(|uid| uid == "uid-b"), 1);
        assert!(!book.is_handed("uid-a"));
    }

    #[test]
    fn a_refusal_is_told_once() {
        let book = MoveBook::default();
        assert!(book.first_told("uid-a", "stays"));
        assert!(!book.first_told("uid-a", "stays"));
        assert!(book.first_told("uid-a", "stays for another reason"));
        assert!(book.first_told("uid-b", "stays"));
    }

    #[test]
    fn continuous_moves_look_once_an_interval_after_a_first_wait() {
        let book = MoveBook::default();
        let at = |text: &str| -> Timestamp { text.parse().unwrap() };
        let interval = Duration::from_secs(600);
        assert!(!book.continuous_due(at("2026-06-01T12:00:00Z"), interval));
        assert!(!book.continuous_due(at("2026-06-01T12:09:59Z"), interval));
        assert!(book.continuous_due(at("2026-06-01T12:10:00Z"), interval));
        assert!(!book.continuous_due(at("2026-06-01T12:15:00Z"), interval));
        book.continuous_soon(at("2026-06-01T12:15:00Z"));
        assert!(book.continuous_due(at("2026-06-01T12:15:01Z"), interval));
        assert!(!book.continuous_due(at("2026-06-01T12:15:02Z"), interval));
        assert!(book.continuous_due(at("2026-06-01T12:25:01Z"), interval));
    }

    #[test]
    fn a_backoff_ends() {
        let book = MoveBook::default();
        let now: Timestamp = "2026-06-01T12:00:00Z".parse().unwrap();
        let later: Timestamp = "2026-06-01T12:10:00Z".parse().unwrap();
        book.back_off("uid-a", 0, later);
        assert!(book.backing_off("uid-a", 0, now));
        assert!(!book.backing_off("uid-a", 1, now));
        assert!(!book.backing_off("uid-a", 0, later));
    }
}
