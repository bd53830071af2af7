//! The last events the controller recorded about each instance, kept in
//! memory so the cluster map shows them without asking the API server.
//! Bounded: a few per instance, and instances that are gone are dropped.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::{Mutex, PoisonError};

use k8s_openapi::jiff::Timestamp;

use super::events::EventNote;

/// Events kept per instance.
const KEPT: usize = 10;

#[derive(Clone, Debug, PartialEq)]
pub(crate) struct LoggedEvent {
    pub(crate) time: Timestamp,
    pub(crate) warning: bool,
    pub(crate) reason: &'static str,
    pub(crate) message: String,
}

#[derive(Default)]
pub(crate) struct EventLog {
    by_instance: Mutex<HashMap<String, VecDeque<LoggedEvent>>>,
}

impl EventLog {
    /// Keeps `notes` about the instance with UID `uid`, the oldest beyond
    /// [`KEPT`] dropped, and forgets instances not among the `live` UIDs.
    pub(crate) fn record<'a>(
        &self,
        uid: &str,
        notes: &[EventNote],
        now: Timestamp,
        live: impl IntoIterator<Item = &'a str>,
    ) {
        let mut log = self.lock();
        let kept = log.entry(uid.to_string()).or_default();
        for note in notes {
            if kept.len() == KEPT {
                kept.pop_front();
            }
            kept.push_back(LoggedEvent {
                time: now,
                warning: note.warning,
                reason: note.reason,
                message: note.message.clone(),
            });
        }
        let live: HashSet<&str> = live.into_iter().collect();
        log.retain(|uid, _| live.contains(uid.as_str()));
    }

    /// The events kept about the instance with UID `uid`, oldest first.
    pub(crate) fn recent(&self, uid: &str) -> Vec<LoggedEvent> {
        self.lock()
            .get(uid)
            .map(|kept| kept.iter().cloned().collect())
            .unwrap_or_default()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, VecDeque<LoggedEvent>>> {
        self.by_instance
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn note(message: &str) -> EventNote {
        EventNote {
            warning: false,
            reason: "Planned",
            message: message.into(),
        }
    }

    #[test]
    fn the_log_keeps_the_last_events_of_live_instances() {
        let log = EventLog::default();
        let now = Timestamp::UNIX_EPOCH;
        let notes: Vec<EventNote> = (0..12).map(|i| note(&format!("n{i}"))).collect();
        log.record("a", &notes, now, ["a"]);
        let kept = log.recent("a");
        assert_eq!(kept.len(), KEPT);
        assert_eq!(
            (kept[0].message.as_str(), kept[9].message.as_str()),
            ("n2", "n11")
        );

        // "a" is deleted: the next record, about another instance, forgets it.
        log.record("b", &notes[..1], now, ["b"]);
        assert!(log.recent("a").is_empty());
        assert_eq!(log.recent("b").len(), 1);
        assert!(log.recent("nobody").is_empty());
    }
}
