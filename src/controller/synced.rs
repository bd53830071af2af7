//! When every cache has had its first full list: read from the watch streams
//! themselves. `Store::wait_until_ready` is not used for this because its
//! readiness signal wakes only the last task that polled it, and the
//! controller's own runner already waits on the ModelInstance store; a second
//! waiter could miss the signal (or take it from the runner).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};

use kube::runtime::watcher;

/// The caches the controller reads.
#[derive(Clone, Copy)]
pub(crate) enum Cache {
    Nodes = 1,
    Pods = 2,
    Services = 4,
    Instances = 8,
    /// The DRA driver's ResourceSlices (with DRA only).
    Slices = 16,
    /// ResourceClaims (with DRA only).
    Claims = 32,
}

impl Cache {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Self::Nodes => "nodes",
            Self::Pods => "pods",
            Self::Services => "services",
            Self::Instances => "instances",
            Self::Slices => "resourceslices",
            Self::Claims => "resourceclaims",
        }
    }
}

/// The caches every run has.
pub(crate) const ALWAYS: [Cache; 4] =
    [Cache::Nodes, Cache::Pods, Cache::Services, Cache::Instances];

/// Sets `synced` once each cache has seen the end of its initial list.
#[derive(Clone)]
pub(crate) struct CacheSync {
    seen: Arc<AtomicU8>,
    /// The caches this run has.
    all: u8,
    synced: Arc<AtomicBool>,
}

impl CacheSync {
    pub(crate) fn new(synced: Arc<AtomicBool>, caches: &[Cache]) -> Self {
        synced.store(false, Ordering::Relaxed);
        Self {
            seen: Arc::default(),
            all: caches.iter().fold(0, |all, cache| all | *cache as u8),
            synced,
        }
    }

    /// For `inspect` on a reflected watch stream, after `reflect`: the store
    /// holds the full list when `InitDone` passes.
    pub(crate) fn observer<K>(
        &self,
        cache: Cache,
    ) -> impl FnMut(&Result<watcher::Event<K>, watcher::Error>) + Send + 'static {
        let this = self.clone();
        move |event| {
            if matches!(event, Ok(watcher::Event::InitDone)) {
                this.mark(cache);
            }
        }
    }

    fn mark(&self, cache: Cache) {
        let before = self.seen.fetch_or(cache as u8, Ordering::Relaxed);
        if before & self.all != self.all && (before | cache as u8) & self.all == self.all {
            self.synced.store(true, Ordering::Relaxed);
            tracing::info!("caches synced");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn init_done() -> Result<watcher::Event<()>, watcher::Error> {
        Ok(watcher::Event::InitDone)
    }

    #[test]
    fn synced_only_after_every_cache_listed_once() {
        let flag = Arc::new(AtomicBool::new(true));
        let sync = CacheSync::new(Arc::clone(&flag), &ALWAYS);
        assert!(!flag.load(Ordering::Relaxed), "a new run starts unsynced");
        let mut nodes = sync.observer(Cache::Nodes);
        let mut pods = sync.observer(Cache::Pods);
        let mut services = sync.observer(Cache::Services);
        let mut instances = sync.observer(Cache::Instances);
        nodes(&init_done());
        nodes(&init_done());
        pods(&Ok(watcher::Event::Init));
        pods(&init_done());
        services(&init_done());
        instances(&Ok(watcher::Event::Init));
        assert!(!flag.load(Ordering::Relaxed), "instances not listed yet");
        instances(&init_done());
        assert!(flag.load(Ordering::Relaxed));

        let with_dra = Arc::new(AtomicBool::new(false));
        let sync = CacheSync::new(
            Arc::clone(&with_dra),
            &[ALWAYS.as_slice(), &[Cache::Slices, Cache::Claims]].concat(),
        );
        for cache in ALWAYS {
            sync.observer(cache)(&init_done());
        }
        sync.observer(Cache::Slices)(&init_done());
        assert!(!with_dra.load(Ordering::Relaxed), "claims not listed yet");
        sync.observer(Cache::Claims)(&init_done());
        assert!(with_dra.load(Ordering::Relaxed));
    }
}
