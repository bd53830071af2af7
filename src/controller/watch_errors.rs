//! The caches' watch errors, kept out of the controller's trigger stream.
//!
//! kube-runtime's `Controller` puts one backoff on the merged stream of all
//! its triggers, so an error from any watch paused all four caches, and the
//! pause grew with the errors of all of them: after a 10-s API server restart
//! the controller re-listed two and a half minutes later and re-placed nothing
//! meanwhile. Each watch retries on its own backoff (`watch_backoff`); here
//! its errors are logged, counted in
//! `tessera_controller_watch_errors_total{cache}`, and dropped.

use std::future::{Ready, ready};

use kube::runtime::watcher;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;

use super::synced::Cache;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CacheLabel {
    cache: &'static str,
}

#[derive(Clone, Default)]
pub(crate) struct WatchErrors(Family<CacheLabel, Counter>);

impl WatchErrors {
    pub(crate) fn register(&self, registry: &mut Registry) {
        registry.register(
            "watch_errors",
            "Errors of the caches' watches, each retried on its own backoff",
            self.0.clone(),
        );
    }

    /// For `filter_map` on a cache's trigger stream: objects pass, errors are
    /// logged and counted.
    pub(crate) fn absorb<K>(
        &self,
        cache: Cache,
    ) -> impl FnMut(Result<K, watcher::Error>) -> Ready<Option<Result<K, watcher::Error>>> + Send + 'static
    {
        let name = cache.name();
        let counter = self.0.get_or_create(&CacheLabel { cache: name }).clone();
        move |item| {
            ready(match item {
                Ok(object) => Some(Ok(object)),
                Err(error) => {
                    counter.inc();
                    tracing::warn!(cache = name, %error, "watch failed; retrying");
                    None
                }
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::StreamExt;
    use prometheus_client::encoding::text::encode;

    #[tokio::test]
    async fn errors_are_counted_per_cache_and_never_passed_on() {
        let errors = WatchErrors::default();
        let mut registry = Registry::default();
        errors.register(&mut registry);
        let items: Vec<Result<u32, watcher::Error>> = vec![
            Ok(1),
            Err(watcher::Error::NoResourceVersion),
            Ok(2),
            Err(watcher::Error::NoResourceVersion),
        ];
        let passed: Vec<u32> = futures::stream::iter(items)
            .filter_map(errors.absorb(Cache::Pods))
            .map(|item| item.unwrap_or_default())
            .collect()
            .await;
        assert_eq!(passed, vec![1, 2]);
        let mut text = String::new();
        encode(&mut text, &registry).unwrap_or_default();
        assert!(
            text.contains(r#"watch_errors_total{cache="pods"} 2"#),
            "{text}"
        );
    }
}
