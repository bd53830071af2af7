//! The pod watch that feeds a binding index from the API server: the pods
//! bound to this node, listed and then followed change by change.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use kube::api::Api;
use kube::runtime::watcher::{self, Event};
use tokio::time::{Interval, MissedTickBehavior};
use tokio_stream::{Stream, StreamExt};

use super::catch_up::node_field_selector;
use super::index::BindingIndex;
use super::tidy::UNBOUND_GRACE_SECS;

/// Feeds `index` from the API server: watches the pods on `node_name`
/// (field selector `spec.nodeName=<node>`), hands every complete list to
/// [`BindingIndex::resync`] and every later change to
/// [`BindingIndex::apply_pod`] / [`BindingIndex::delete_pod`], until
/// `shutdown` resolves. Errors are logged and the watch is retried with
/// backoff; it never gives up on its own.
pub async fn run_pod_watch(
    client: kube::Client,
    node_name: String,
    index: Arc<BindingIndex>,
    shutdown: impl Future<Output = ()>,
) {
    let events = pods_on_node(client, &node_name);
    tokio::pin!(events);
    tokio::pin!(shutdown);
    let mut tidy_timer = tidy_timer();
    let mut feed = IndexFeed {
        index,
        node_name,
        listing: None,
    };
    loop {
        let event = tokio::select! {
            event = events.next() => event,
            _ = tidy_timer.tick() => {
                feed.index.tidy();
                continue;
            }
            _ = &mut shutdown => break,
        };
        match event {
            None => {
                tracing::warn!("the pod watch ended");
                break;
            }
            Some(Err(error)) => {
                tracing::warn!(node = %feed.node_name, error = %error, "watching the pods on this node failed; retrying");
            }
            Some(Ok(event)) => feed.apply(event),
        }
    }
    tracing::info!("pod watch stopped");
}

/// The watch events of the pods bound to `node_name`, retried with backoff.
fn pods_on_node(
    client: kube::Client,
    node_name: &str,
) -> impl Stream<Item = Result<Event<Pod>, watcher::Error>> + use<> {
    let pods: Api<Pod> = Api::all(client);
    let config = watcher::Config::default().fields(&node_field_selector(node_name));
    crate::kubernetes::watch_backoff::with_backoff(
        "pods on this node",
        watcher::watcher(pods, config),
    )
}

/// Holds that only time ends (an `unbound` hold past its grace) must end
/// also when no pod event comes.
fn tidy_timer() -> Interval {
    let mut timer =
        tokio::time::interval(Duration::from_secs(UNBOUND_GRACE_SECS.unsigned_abs() / 4));
    timer.set_missed_tick_behavior(MissedTickBehavior::Delay);
    timer
}

/// Turns watch events into index updates.
struct IndexFeed {
    index: Arc<BindingIndex>,
    node_name: String,
    /// The list being read, between `Init` and `InitDone`.
    listing: Option<Vec<Pod>>,
}

impl IndexFeed {
    fn apply(&mut self, event: Event<Pod>) {
        match event {
            Event::Init => self.listing = Some(Vec::new()),
            Event::InitApply(pod) => {
                if self.on_node(&pod) {
                    self.listing.get_or_insert_with(Vec::new).push(pod);
                }
            }
            Event::InitDone => self.index.resync(self.listing.take().unwrap_or_default()),
            // A pod moved off the node (or never on it) is gone for this index.
            Event::Apply(pod) if self.on_node(&pod) => self.index.apply_pod(&pod),
            Event::Apply(pod) | Event::Delete(pod) => self.index.delete_pod(&pod),
        }
    }

    fn on_node(&self, pod: &Pod) -> bool {
        pod.spec.as_ref().and_then(|spec| spec.node_name.as_deref())
            == Some(self.node_name.as_str())
    }
}
