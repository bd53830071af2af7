//! How soon a replica that keeps losing ranks is repaired again. A rank that
//! can never start (a gated model without access, a bad image, a wrong layer
//! count) would otherwise take its replica down and up again at once, for
//! ever, each round fetching the weights anew. Like kubelet's crash-loop
//! backoff: the first repair is made at once, the next after 10 s, doubling up
//! to 10 minutes, and a replica that has been ready for 10 minutes starts
//! afresh. The count lives in `status.restarts`, so a restarted controller
//! keeps it. Pure: `apply` asks it, the status stage writes what it answers.

use std::time::Duration;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use tessera_core::api::ReplicaRestarts;

/// The wait before the second repair in a row.
const FIRST_DELAY: Duration = Duration::from_secs(10);
/// The longest wait.
const MAX_DELAY: Duration = Duration::from_secs(600);
/// How long a replica stays ready before its count is forgotten.
const FORGET_AFTER: Duration = Duration::from_secs(600);

/// One replica's backoff as this reconcile sees it.
#[derive(Clone, Debug)]
pub(crate) struct Backoff<'a> {
    pub(crate) replica: u32,
    /// The replica's record in the status as last written.
    pub(crate) previous: Option<&'a ReplicaRestarts>,
    /// The hash of the replica's desired shard pods
    /// (`hashes::replica_pod_hash`).
    pub(crate) pod_hash: String,
    pub(crate) now: Timestamp,
}

impl Backoff<'_> {
    /// The repairs in a row that still count: none once the pods changed
    /// (a fixed template deserves a prompt start) or the replica has been
    /// ready long enough.
    fn counted(&self) -> u32 {
        self.previous
            .filter(|r| r.pod_hash == self.pod_hash && !self.forgotten(r))
            .map_or(0, |r| r.count)
    }

    fn forgotten(&self, record: &ReplicaRestarts) -> bool {
        record
            .ready_since
            .as_ref()
            .is_some_and(|since| elapsed(since.0, self.now) >= FORGET_AFTER)
    }

    /// When the next repair may be made, if not now.
    pub(crate) fn due(&self) -> Option<Timestamp> {
        let count = self.counted();
        let last = self.previous?.last_time.0;
        let due = last.checked_add(signed(delay(count)?)).ok()?;
        (due > self.now).then_some(due)
    }

    /// The status line of the replica while a repair waits until `due`: the
    /// rank that failed and why, the count, and when it is recreated. Stable
    /// while the wait lasts, so its condition and event are written once.
    pub(crate) fn waiting_message(&self, why: &str, due: Timestamp) -> String {
        let count = self.counted();
        format!(
            "replica {}: {why}; recreated {count} time{} in a row without staying ready, \
             the next recreation is not before {}",
            self.replica,
            if count == 1 { "" } else { "s" },
            due.strftime("%Y-%m-%dT%H:%M:%SZ"),
        )
    }

    /// Now as the status keeps it (whole seconds), so the record reads back
    /// as it was made.
    fn now_as_written(&self) -> Time {
        Time(Timestamp::from_second(self.now.as_second()).unwrap_or(self.now))
    }

    /// The record once a repair is made now.
    pub(crate) fn repaired(&self) -> ReplicaRestarts {
        ReplicaRestarts {
            replica: self.replica,
            count: self.counted().saturating_add(1),
            last_time: self.now_as_written(),
            pod_hash: self.pod_hash.clone(),
            ready_since: None,
        }
    }

    /// The record after a reconcile that made no repair; `all_ready` says
    /// whether every shard of the replica is ready. None once there is
    /// nothing left to count.
    pub(crate) fn kept(&self, all_ready: bool) -> Option<ReplicaRestarts> {
        let count = self.counted();
        if count == 0 {
            return None;
        }
        let previous = self.previous?;
        let ready_since = all_ready.then(|| {
            previous
                .ready_since
                .clone()
                .unwrap_or_else(|| self.now_as_written())
        });
        Some(ReplicaRestarts {
            ready_since,
            ..previous.clone()
        })
    }
}

/// The wait before a repair that follows `count` repairs in a row: none for
/// the first.
fn delay(count: u32) -> Option<Duration> {
    let doublings = count.checked_sub(1)?;
    // 10 s × 2^6 is past the cap already.
    Some((FIRST_DELAY * 2u32.pow(doublings.min(6))).min(MAX_DELAY))
}

fn elapsed(since: Timestamp, now: Timestamp) -> Duration {
    Duration::try_from(now.duration_since(since)).unwrap_or_default()
}

fn signed(duration: Duration) -> SignedDuration {
    SignedDuration::try_from(duration).unwrap_or(SignedDuration::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(seconds: i64) -> Timestamp {
        Timestamp::from_second(1_800_000_000 + seconds).unwrap()
    }

    fn record(count: u32, last: i64, ready_since: Option<i64>) -> ReplicaRestarts {
        ReplicaRestarts {
            replica: 0,
            count,
            last_time: Time(at(last)),
            pod_hash: "h".into(),
            ready_since: ready_since.map(|s| Time(at(s))),
        }
    }

    fn backoff(previous: Option<&ReplicaRestarts>, now: i64) -> Backoff<'_> {
        Backoff {
            replica: 0,
            previous,
            pod_hash: "h".into(),
            now: at(now),
        }
    }

    #[test]
    fn waits_double_from_ten_seconds_up_to_ten_minutes() {
        let waits: Vec<u64> = (0..10)
            .map(|count| delay(count).map_or(0, |d| d.as_secs()))
            .collect();
        assert_eq!(waits, [0, 10, 20, 40, 80, 160, 320, 600, 600, 600]);
        assert_eq!(delay(u32::MAX), Some(MAX_DELAY));
    }

    #[test]
    fn the_first_repair_is_at_once_and_the_next_waits() {
        let first = backoff(None, 0);
        assert_eq!(first.due(), None);
        let made = first.repaired();
        assert_eq!((made.count, made.last_time.0), (1, at(0)));
        assert_eq!(backoff(Some(&made), 5).due(), Some(at(10)));
        assert_eq!(backoff(Some(&made), 10).due(), None);
        let three = record(3, 100, None);
        let third = backoff(Some(&three), 120);
        assert_eq!(third.due(), Some(at(140)));
        assert_eq!(third.repaired().count, 4);
    }

    #[test]
    fn a_replica_ready_for_ten_minutes_starts_afresh() {
        let failing = record(5, 0, None);
        // Ready now: the moment is noted, the count stays.
        let kept = backoff(Some(&failing), 200).kept(true).unwrap();
        assert_eq!(kept.ready_since, Some(Time(at(200))));
        assert_eq!(kept.count, 5);
        // Not ready again before ten minutes: the moment is dropped.
        let lost = backoff(Some(&kept), 300).kept(false).unwrap();
        assert_eq!((lost.count, lost.ready_since), (5, None));
        // Ten minutes ready: forgotten, and a repair now is the first again.
        assert_eq!(backoff(Some(&kept), 800).kept(true), None);
        assert_eq!(backoff(Some(&kept), 800).due(), None);
        assert_eq!(backoff(Some(&kept), 800).repaired().count, 1);
    }

    #[test]
    fn new_pods_start_afresh() {
        let failing = record(4, 0, None);
        let changed = Backoff {
            pod_hash: "other".into(),
            ..backoff(Some(&failing), 1)
        };
        assert_eq!(changed.due(), None);
        assert_eq!(changed.kept(false), None);
        assert_eq!(changed.repaired().count, 1);
    }

    #[test]
    fn the_waiting_message_names_rank_count_and_time() {
        let failing = record(2, 20, None);
        let replica = Backoff {
            replica: 1,
            ..backoff(Some(&failing), 25)
        };
        let message = replica.waiting_message("m-r1-shard-1: pod failed (Error)", at(30));
        assert_eq!(
            message,
            "replica 1: m-r1-shard-1: pod failed (Error); recreated 2 times in a row without \
             staying ready, the next recreation is not before 2027-01-15T08:00:30Z"
        );
    }
}
