//! How a watch gets its first copy of everything: one LIST (paged), or, where
//! the API server offers it, as a stream of events on the watch itself
//! (Kubernetes' WatchList, beta from 1.32). A stream is served from the API
//! server's watch cache object by object, so the server never builds one large
//! list response in memory.
//!
//! Whether a server offers it cannot be read from its version: the feature gate
//! may be off, and a server on etcd older than 3.4.31 / 3.5.13 (no
//! RequestWatchProgress) refuses every streaming watch with an error. So `auto`
//! asks: one streaming watch for an object that cannot exist. A server that
//! streams answers at once with the bookmark that ends the (empty) initial
//! list; any error, an old server that refuses the parameters, or silence
//! means a LIST.

use std::fmt::Debug;
use std::time::Duration;

use futures::StreamExt;
use kube::api::{Api, WatchEvent, WatchParams};
use kube::runtime::watcher::{self, InitialListStrategy};
use serde::de::DeserializeOwned;

/// Annotation on the bookmark that closes a streamed initial list.
const INITIAL_EVENTS_END: &str = "k8s.io/initial-events-end";
/// The name the probe watches: a field selector on it matches nothing, so the
/// answer is the closing bookmark alone.
const PROBE_NAME: &str = "tessera-initial-list-probe";
/// A server that streams sends the bookmark within milliseconds.
const PROBE_TIMEOUT: Duration = Duration::from_secs(5);

/// `--initial-list`: how every watch of the process lists first.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum InitialList {
    /// Stream where the API server offers it (asked once per watch), else list.
    #[default]
    Auto,
    /// Always stream; watches fail and retry on a server that does not offer it.
    Stream,
    /// Always one LIST, as before Kubernetes 1.32.
    List,
}

impl InitialList {
    /// The watcher configuration `config` with the initial list this choice
    /// gives for `api`'s resource; `what` names the watch in the log.
    pub async fn configure<K>(
        self,
        api: &Api<K>,
        config: watcher::Config,
        what: &str,
    ) -> watcher::Config
    where
        K: Clone + DeserializeOwned + Debug,
    {
        let stream = match self {
            InitialList::Stream => true,
            InitialList::List => false,
            InitialList::Auto => {
                let offered = offers_streaming_lists(api).await;
                tracing::info!(
                    watch = what,
                    initial_list = if offered { "stream" } else { "list" },
                    "chose how the watch lists first"
                );
                offered
            }
        };
        if stream {
            config.streaming_lists()
        } else {
            watcher::Config {
                initial_list_strategy: InitialListStrategy::ListWatch,
                ..config
            }
        }
    }
}

/// Whether `api`'s server sends a watch's initial list as a stream.
pub async fn offers_streaming_lists<K>(api: &Api<K>) -> bool
where
    K: Clone + DeserializeOwned + Debug,
{
    let params = WatchParams::streaming_lists()
        .fields(&format!("metadata.name={PROBE_NAME}"))
        .timeout(PROBE_TIMEOUT.as_secs() as u32);
    let answer = async {
        let mut events = match api.watch(&params, "0").await {
            Ok(events) => events.boxed(),
            Err(e) => {
                tracing::debug!(error = %e, "the API server refused a streaming watch");
                return false;
            }
        };
        match events.next().await {
            Some(Ok(WatchEvent::Bookmark(bookmark))) => bookmark
                .metadata
                .annotations
                .get(INITIAL_EVENTS_END)
                .is_some_and(|v| v == "true"),
            Some(Ok(WatchEvent::Error(status))) => {
                tracing::debug!(error = %status, "the API server cannot stream a watch's initial list");
                false
            }
            other => {
                tracing::debug!(answer = ?other.map(|e| e.map(|_| ())), "no initial-list bookmark");
                false
            }
        }
    };
    tokio::time::timeout(PROBE_TIMEOUT, answer)
        .await
        .unwrap_or(false)
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::{Request, Response, StatusCode};
    use k8s_openapi::api::core::v1::Node;
    use kube::client::Body;
    use tower_test::mock;

    /// Asks the probe of a mocked API server whose answer to the watch is
    /// `status` with `body`; returns the probe's verdict and the query it sent.
    async fn probe(status: StatusCode, body: &'static str) -> (bool, String) {
        let (service, mut handle) = mock::pair::<Request<Body>, Response<Body>>();
        let server = tokio::spawn(async move {
            let (request, send) = handle.next_request().await.expect("the probe asks");
            let query = request.uri().query().unwrap_or_default().to_string();
            send.send_response(
                Response::builder()
                    .status(status)
                    .body(Body::from(body.as_bytes().to_vec()))
                    .unwrap(),
            );
            query
        });
        let api: Api<Node> = Api::all(kube::Client::new(service, "default"));
        let verdict = offers_streaming_lists(&api).await;
        (verdict, server.await.unwrap())
    }

    const END: &str = r#"{"type":"BOOKMARK","object":{"kind":"Node","apiVersion":"v1","metadata":{"resourceVersion":"42","annotations":{"k8s.io/initial-events-end":"true"}}}}
"#;

    #[tokio::test]
    async fn a_server_that_ends_the_initial_list_with_its_bookmark_streams() {
        let (verdict, query) = probe(StatusCode::OK, END).await;
        assert!(verdict);
        for part in [
            "watch=true",
            "sendInitialEvents=true",
            "resourceVersionMatch=NotOlderThan",
            "allowWatchBookmarks=true",
            "fieldSelector=metadata.name%3Dtessera-initial-list-probe",
        ] {
            assert!(query.contains(part), "{part} missing from {query}");
        }
    }

    #[tokio::test]
    async fn an_error_event_a_refusal_or_another_answer_means_a_list() {
        // etcd without RequestWatchProgress: the watch opens, then fails.
        let no_progress = r#"{"type":"ERROR","object":{"kind":"Status","apiVersion":"v1","metadata":{},"status":"Failure","message":"a watch stream was requested by the client but the required storage feature RequestWatchProgress is disabled","reason":"InternalError","code":500}}
"#;
        assert!(!probe(StatusCode::OK, no_progress).await.0);
        // Servers before the feature refuse the parameters outright.
        let refused = r#"{"kind":"Status","apiVersion":"v1","metadata":{},"status":"Failure","message":"resourceVersionMatch is forbidden for watch","reason":"Invalid","code":422}"#;
        assert!(!probe(StatusCode::UNPROCESSABLE_ENTITY, refused).await.0);
        // A bookmark that does not end an initial list.
        let plain = r#"{"type":"BOOKMARK","object":{"kind":"Node","apiVersion":"v1","metadata":{"resourceVersion":"42"}}}
"#;
        assert!(!probe(StatusCode::OK, plain).await.0);
        // The watch closed with nothing said.
        assert!(!probe(StatusCode::OK, "").await.0);
        assert!(!probe(StatusCode::OK, "not json\n").await.0);
    }

    #[tokio::test(start_paused = true)]
    async fn a_server_that_says_nothing_means_a_list() {
        let (service, mut handle) = mock::pair::<Request<Body>, Response<Body>>();
        // Keeps the request open and never answers.
        let _server = tokio::spawn(async move {
            let held = handle.next_request().await;
            std::future::pending::<()>().await;
            drop(held);
        });
        let api: Api<Node> = Api::all(kube::Client::new(service, "default"));
        let started = tokio::time::Instant::now();
        assert!(!offers_streaming_lists(&api).await);
        assert_eq!(started.elapsed(), PROBE_TIMEOUT);
    }

    #[tokio::test]
    async fn a_fixed_choice_asks_nothing() {
        // A mock that is never answered: asking would hang the test.
        let (service, _handle) = mock::pair::<Request<Body>, Response<Body>>();
        let api: Api<Node> = Api::all(kube::Client::new(service, "default"));
        let base = watcher::Config::default().labels("a=b");
        let streamed = InitialList::Stream
            .configure(&api, base.clone(), "test")
            .await;
        assert_eq!(
            streamed.initial_list_strategy,
            InitialListStrategy::StreamingList
        );
        assert_eq!(streamed.label_selector.as_deref(), Some("a=b"));
        let listed = InitialList::List.configure(&api, base, "test").await;
        assert_eq!(listed.initial_list_strategy, InitialListStrategy::ListWatch);
    }
}
