//! How every watch of the agent and the controller retries.
//!
//! Failures wait out kube-runtime's default backoff (client-go's: 0.8 s
//! doubling to 30 s, jittered). An expired watch (410 Gone: the API server no
//! longer holds the resource version the watch resumed from, as after the API
//! server restarts) is different: the watcher has already gone back to a
//! fresh list, which is the protocol working, so it lists at once instead of
//! waiting out a backoff that grew while the server was away. A measured
//! 10-s restart otherwise left a cache stale for up to a minute more. A second
//! expiry within `EXPIRY_GRACE` of the first does wait, so a server that
//! expires every watch cannot make us list in a loop.

use std::time::{Duration, Instant};

use futures::{Stream, StreamExt};
use kube::runtime::{WatchStreamExt, watcher};

/// Expiries closer together than this wait for the backoff.
const EXPIRY_GRACE: Duration = Duration::from_secs(30);

/// `watch` retried with backoff; `what` names it in the log.
pub fn with_backoff<K, S>(
    what: &'static str,
    watch: S,
) -> impl Stream<Item = Result<watcher::Event<K>, watcher::Error>> + Send
where
    K: Send,
    S: Stream<Item = Result<watcher::Event<K>, watcher::Error>> + Send,
{
    let mut expiries = Expiries::default();
    watch
        .filter(move |item| {
            let relist_now = expiries.relists_at_once(item, Instant::now());
            if relist_now {
                tracing::info!(watch = what, "the watch expired; listing again");
            }
            std::future::ready(!relist_now)
        })
        .default_backoff()
}

/// When the last expiry let through without backoff was.
#[derive(Default)]
struct Expiries {
    last: Option<Instant>,
}

impl Expiries {
    /// Whether `item` is an expiry to relist after at once (and so to keep
    /// from the backoff).
    fn relists_at_once<T>(&mut self, item: &Result<T, watcher::Error>, now: Instant) -> bool {
        let Err(watcher::Error::WatchError(status)) = item else {
            return false;
        };
        if status.code != 410 {
            return false;
        }
        let recent = self
            .last
            .is_some_and(|last| now.saturating_duration_since(last) < EXPIRY_GRACE);
        if recent {
            return false;
        }
        self.last = Some(now);
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::stream;
    use kube::core::Status;

    fn status(code: u16) -> Result<watcher::Event<()>, watcher::Error> {
        let status = Status::failure("too old resource version: 1 (2)", "Expired").with_code(code);
        Err(watcher::Error::WatchError(status.boxed()))
    }

    #[test]
    fn an_expiry_relists_at_once_but_not_twice_within_the_grace() {
        let mut expiries = Expiries::default();
        let start = Instant::now();
        assert!(expiries.relists_at_once(&status(410), start));
        let soon = start + EXPIRY_GRACE - Duration::from_secs(1);
        assert!(!expiries.relists_at_once(&status(410), soon));
        let later = start + EXPIRY_GRACE + Duration::from_secs(1);
        assert!(expiries.relists_at_once(&status(410), later));
    }

    #[test]
    fn failures_and_events_are_not_expiries() {
        let mut expiries = Expiries::default();
        let now = Instant::now();
        assert!(!expiries.relists_at_once(&status(500), now));
        assert!(!expiries.relists_at_once(&status(403), now));
        assert!(!expiries.relists_at_once(&Ok(watcher::Event::<()>::InitDone), now));
        assert!(!expiries.relists_at_once::<()>(&Err(watcher::Error::NoResourceVersion), now));
        assert!(expiries.relists_at_once(&status(410), now));
    }

    /// An expiry does not start the backoff: what follows it arrives without
    /// delay, while a failure delays what follows it.
    #[tokio::test(start_paused = true)]
    async fn an_expiry_is_not_backed_off_and_a_failure_is() {
        let items = vec![status(410), Ok(watcher::Event::InitDone)];
        let started = tokio::time::Instant::now();
        let seen: Vec<_> = with_backoff("test", stream::iter(items)).collect().await;
        assert_eq!(seen.len(), 1, "the expiry is consumed");
        assert!(matches!(seen[0], Ok(watcher::Event::InitDone)));
        assert_eq!(started.elapsed(), Duration::ZERO);

        let items = vec![status(500), Ok(watcher::Event::InitDone)];
        let started = tokio::time::Instant::now();
        let seen: Vec<_> = with_backoff("test", stream::iter(items)).collect().await;
        assert_eq!(seen.len(), 2, "a failure is passed on");
        assert!(started.elapsed() >= Duration::from_millis(100));
    }
}
