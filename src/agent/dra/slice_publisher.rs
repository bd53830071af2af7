//! Publishing the node's devices as ResourceSlices for as long as the agent
//! runs. At start the node's existing slices of this driver are read (their
//! pool generation is where this run counts on from); then every time the
//! devices change as a slice shows them (a device comes or goes, its health
//! changes; telemetry is not in a slice) the whole pool is written again
//! under the next generation, and slices left over from a larger pool are
//! deleted. A failed write is retried with backoff, and so is an attempt the
//! API server has not answered within the state publisher's time limit (a
//! connection that stalls would otherwise hold the pool back for good).
//!
//! Whether the API server keeps device taints is learnt from its answer: a
//! tainted device that comes back without its taint means it does not
//! (DRADeviceTaints off), and from then on unhealthy devices are left out.
//!
//! The node's slices of this driver are watched too: kubelet deletes a
//! node's slices when it starts (and when a driver goes away), and a slice
//! deleted by anyone else must come back at once, or allocators (and the
//! controller) would take the node for one without DRA. A deleted slice, or a
//! re-list, makes the agent read its slices back, and when they are not what
//! it wrote it writes the pool again under the next generation. The watch is
//! read while the publisher waits on anything else, and its events are looked
//! at once the wait is over (see `reading`).
//!
//! On shutdown the slices stay: the devices are still there and in use, and
//! the next agent writes them again.

use std::collections::{BTreeSet, VecDeque};
use std::future::Future;
use std::pin::pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use futures::{Stream, StreamExt};
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::api::resource::v1::ResourceSlice;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams};
use kube::core::PartialObjectMeta;
use kube::runtime::watcher::{self, Event};
use kube::{Client, ResourceExt};

use super::slices::{PoolContents, PoolOptions, SliceOwner, node_slices, pool_devices};
use crate::agent::api_call::within;
use crate::agent::publisher::PublisherConfig;
use crate::agent::state::{ViewRx, ViewTx};
use tessera_core::api::SharesOffered;

/// The field manager of our slice writes.
const FIELD_MANAGER: &str = "tessera-agent";
const BACKOFF_START: Duration = Duration::from_millis(500);
const BACKOFF_MAX: Duration = Duration::from_secs(30);
/// How long one attempt (a publish, or a read back) may wait for answers.
const ANSWER_LIMIT: Duration = PublisherConfig::DEFAULT_REQUEST_TIMEOUT;

/// Counters for the agent's metrics.
#[derive(Debug, Default)]
pub struct SliceStats {
    /// Slices written (created or updated) and accepted.
    pub(crate) writes: AtomicU64,
    /// Slices deleted as left over.
    pub(crate) deletes: AtomicU64,
    /// Failed attempts to publish the pool.
    pub(crate) errors: AtomicU64,
    /// The pool generation last published.
    pub(crate) generation: AtomicU64,
    /// Times the pool was written again because its slices were deleted or
    /// changed by someone else.
    pub(crate) restores: AtomicU64,
}

impl SliceStats {
    pub fn writes(&self) -> u64 {
        self.writes.load(Ordering::Relaxed)
    }

    pub fn errors(&self) -> u64 {
        self.errors.load(Ordering::Relaxed)
    }

    pub fn generation(&self) -> u64 {
        self.generation.load(Ordering::Relaxed)
    }

    pub fn restores(&self) -> u64 {
        self.restores.load(Ordering::Relaxed)
    }
}

/// What the publisher has written.
struct Published {
    /// `None` until this run wrote the pool.
    devices: Option<PoolContents>,
    generation: i64,
    names: BTreeSet<String>,
    /// The resourceVersion of this run's last slice write or deletion: a
    /// read of the API server's cache at least this new shows it.
    written_at: Option<String>,
}

/// Publishes `view`'s devices as the pool of `node_name` until `shutdown`.
pub async fn run_slice_publisher(
    client: Client,
    driver: String,
    node_name: String,
    (mut view, tx): (ViewRx, ViewTx),
    memory_shares: bool,
    stats: Arc<SliceStats>,
    shutdown: impl Future<Output = ()>,
) {
    tokio::pin!(shutdown);
    let slices: Api<ResourceSlice> = Api::all(client.clone());
    let slice_names: Api<PartialObjectMeta<ResourceSlice>> = Api::all(client.clone());
    let nodes: Api<Node> = Api::all(client);
    // Names are all it needs to see go: the metadata alone is watched.
    let mut watched = pin!(crate::kubernetes::watch_backoff::with_backoff(
        "this node's ResourceSlices",
        watcher::watcher(
            slice_names,
            // From the API server's watch cache, as informers list: a list
            // that must be the latest goes to etcd on servers that cannot
            // serve it from the cache, and scans every node's slices there.
            watcher::Config::default()
                .fields(&pool_selector(&node_name, &driver))
                .any_semantic(),
        ),
    ));
    let mut backoff = BACKOFF_START;
    let mut options = PoolOptions {
        taints: true,
        memory_shares,
    };
    let mut published: Option<Published> = None;
    let mut owner: Option<SliceOwner> = None;
    // What the watch brought while the publisher waited on something else.
    let mut seen = VecDeque::new();
    loop {
        let ready = view.borrow_and_update().ready;
        if ready {
            let attempt = publish_once(
                &slices,
                &nodes,
                &driver,
                &node_name,
                &view,
                &mut owner,
                &mut published,
                &mut options,
                &stats,
            );
            // Given up half-way, an attempt leaves what was last published
            // as it was: the next one writes the same generation again.
            match reading(&mut watched, &mut seen, within(ANSWER_LIMIT, attempt)).await {
                Ok(()) => {
                    backoff = BACKOFF_START;
                    offer(&tx, options);
                }
                Err(e) => {
                    stats.errors.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(error = %e, retry_in = ?backoff, "publishing the node's ResourceSlices failed");
                    tokio::select! {
                        _ = reading(&mut watched, &mut seen, tokio::time::sleep(backoff)) => {}
                        _ = &mut shutdown => return,
                    }
                    backoff = (backoff * 2).min(BACKOFF_MAX);
                    continue;
                }
            }
        }
        let mut lost = false;
        while let Some(event) = seen.pop_front() {
            if let Ok(event) = event
                && let Some(last) = published.as_mut()
                && may_be_lost(last, &event)
                && let Some(now) = reading(
                    &mut watched,
                    &mut seen,
                    gone(&slices, &driver, &node_name, last),
                )
                .await
            {
                tracing::warn!(
                    generation = last.generation,
                    "the node's ResourceSlices were deleted or changed by someone else (kubelet deletes them when it starts): writing them again"
                );
                stats.restores.fetch_add(1, Ordering::Relaxed);
                // Written again from scratch, counting on from the
                // newest generation either side has seen.
                *last = Published {
                    devices: None,
                    generation: last.generation.max(now.generation),
                    names: now.names,
                    written_at: None,
                };
                lost = true;
            }
        }
        if lost {
            continue;
        }
        tokio::select! {
            changed = view.changed() => if changed.is_err() { return },
            event = watched.next() => match event {
                Some(event) => seen.push_back(event),
                None => return,
            },
            _ = &mut shutdown => return,
        }
    }
}

/// Waits for `work` while reading `watched` into `seen`. A watch left unread
/// holds up more than its own events: over HTTP/2 hyper opens one connection
/// to a host at a time and every other request waits for it, so when the
/// watch's list is the request opening it, nothing gets through until the
/// watch is read again. Simulated agents stalled so by the hundred.
async fn reading<S, T>(
    watched: &mut S,
    seen: &mut VecDeque<S::Item>,
    work: impl Future<Output = T>,
) -> T
where
    S: Stream + Unpin,
{
    let mut work = pin!(work);
    loop {
        tokio::select! {
            done = &mut work => return done,
            Some(event) = watched.next() => seen.push_back(event),
        }
    }
}

/// Whether `event` may show the written pool gone: one of its slices
/// deleted, or a (re-)list done (a watch that was away may have missed a
/// deletion). Events can be older than the last write (our own deletion of
/// a name written again since), so [`gone`] has the last word.
fn may_be_lost(last: &Published, event: &Event<PartialObjectMeta<ResourceSlice>>) -> bool {
    if last.devices.is_none() {
        return false;
    }
    match event {
        Event::Delete(slice) => last.names.contains(&slice.name_any()),
        Event::InitDone => true,
        // Our own writes, seen late (what they changed was written anyway),
        // and a list under way.
        Event::Apply(_) | Event::Init | Event::InitApply(_) => false,
    }
}

/// The node's slices as the API server holds them now (read from its watch
/// cache once it shows our last write or deletion: a cache behind it would
/// read that write as lost, or a deleted slice as still there), when they
/// are not exactly the pool last written. A failed read says nothing is
/// lost: the watch goes on, and a real loss shows again.
async fn gone(
    slices: &Api<ResourceSlice>,
    driver: &str,
    node_name: &str,
    last: &Published,
) -> Option<Published> {
    let mut params = pool_list(node_name, driver).match_any();
    if let Some(version) = &last.written_at {
        params.resource_version = Some(version.clone());
    }
    match within(ANSWER_LIMIT, existing(slices, &params)).await {
        Ok(now) => (now.names != last.names || now.generation != last.generation).then_some(now),
        Err(e) => {
            tracing::warn!(error = %e, "could not read the node's ResourceSlices back");
            None
        }
    }
}

/// The field selector of one node's slices of one driver.
fn pool_selector(node_name: &str, driver: &str) -> String {
    format!("spec.nodeName={node_name},spec.driver={driver}")
}

/// A list of one node's slices of one driver, the latest.
fn pool_list(node_name: &str, driver: &str) -> ListParams {
    ListParams::default().fields(&pool_selector(node_name, driver))
}

#[allow(clippy::too_many_arguments)]
async fn publish_once(
    slices: &Api<ResourceSlice>,
    nodes: &Api<Node>,
    driver: &str,
    node_name: &str,
    view: &ViewRx,
    owner: &mut Option<SliceOwner>,
    published: &mut Option<Published>,
    options: &mut PoolOptions,
    stats: &SliceStats,
) -> Result<(), kube::Error> {
    let owner = match owner {
        Some(owner) => owner,
        None => {
            let node = nodes.get(node_name).await?;
            owner.insert(SliceOwner {
                driver: driver.to_string(),
                node_name: node_name.to_string(),
                node_uid: node.metadata.uid.unwrap_or_default(),
            })
        }
    };
    if published.is_none() {
        // A cache behind an earlier run's last write gives an older
        // generation: the same names are written again, over it.
        let cached = pool_list(node_name, driver).match_any();
        *published = Some(existing(slices, &cached).await?);
    }
    let Some(last) = published.as_mut() else {
        return Ok(());
    };
    loop {
        let devices = pool_devices(&view.borrow().snapshot, driver, *options);
        if last.devices.as_ref() == Some(&devices) {
            return Ok(());
        }
        let generation = last.generation + 1;
        let wanted = node_slices(owner, &devices, generation);
        let mut kept_taints = true;
        let mut kept_shares = true;
        let mut written_at = None;
        let params = PatchParams::apply(FIELD_MANAGER).force();
        for slice in &wanted {
            let name = slice.metadata.name.clone().unwrap_or_default();
            let written = slices.patch(&name, &params, &Patch::Apply(slice)).await?;
            stats.writes.fetch_add(1, Ordering::Relaxed);
            kept_taints &= taints_kept(slice, &written);
            kept_shares &= shares_kept(slice, &written);
            written_at = written.metadata.resource_version;
        }
        let names: BTreeSet<String> = wanted
            .iter()
            .filter_map(|s| s.metadata.name.clone())
            .collect();
        for stale in last.names.difference(&names) {
            match slices.delete(stale, &DeleteParams::default()).await {
                Ok(deleted) => {
                    stats.deletes.fetch_add(1, Ordering::Relaxed);
                    // A read back must show the deletion too, or the
                    // stale slice still in a cache reads as the pool
                    // changed by someone else.
                    if let Some(version) = deleted.left().and_then(|s| s.metadata.resource_version)
                    {
                        written_at = Some(version);
                    }
                }
                Err(kube::Error::Api(e)) if e.code == 404 => {}
                Err(e) => return Err(e),
            }
        }
        *last = Published {
            devices: Some(devices),
            generation,
            names,
            written_at,
        };
        stats.generation.store(
            u64::try_from(generation).unwrap_or_default(),
            Ordering::Relaxed,
        );
        tracing::info!(
            generation,
            slices = wanted.len(),
            "published the node's ResourceSlices"
        );
        if kept_taints && kept_shares {
            return Ok(());
        }
        if !kept_taints {
            tracing::warn!(
                "the API server dropped the device taints (DRADeviceTaints is off): unhealthy devices are left out of the slices instead"
            );
            options.taints = false;
        }
        if !kept_shares {
            tracing::warn!(
                "the API server dropped allowMultipleAllocations (DRAConsumableCapacity is off): whole GPUs are offered whole only, without memory shares"
            );
            options.memory_shares = false;
        }
    }
}

/// Tells the node's GPU state what the published pool hands out besides
/// whole GPUs: partitions of any GPU in MIG mode, memory shares where
/// offered and kept.
fn offer(tx: &ViewTx, options: PoolOptions) {
    let shares = SharesOffered {
        partitions: true,
        memory: options.memory_shares,
    };
    tx.send_if_modified(|view| {
        let changed = view.shares != shares;
        view.shares = shares;
        changed
    });
}

/// The node's slices of this driver as `params` reads them: their
/// generation (the newest) and names; this run has written none of them yet.
async fn existing(
    slices: &Api<ResourceSlice>,
    params: &ListParams,
) -> Result<Published, kube::Error> {
    let list = slices.list(params).await?;
    Ok(Published {
        devices: None,
        written_at: None,
        generation: list
            .items
            .iter()
            .map(|s| s.spec.pool.generation)
            .max()
            .unwrap_or(0),
        names: list
            .items
            .iter()
            .filter_map(|s| s.metadata.name.clone())
            .collect(),
    })
}

/// Whether every device written as shareable came back so.
fn shares_kept(sent: &ResourceSlice, written: &ResourceSlice) -> bool {
    kept(sent, written, |d| {
        usize::from(d.allow_multiple_allocations == Some(true))
    })
}

/// Whether every taint written came back.
fn taints_kept(sent: &ResourceSlice, written: &ResourceSlice) -> bool {
    kept(sent, written, |d| d.taints.as_ref().map_or(0, Vec::len))
}

/// Whether `written` has at least as much of what `count` counts per device
/// as `sent`: a field the API server does not keep comes back without it.
fn kept(
    sent: &ResourceSlice,
    written: &ResourceSlice,
    count: impl Fn(&k8s_openapi::api::resource::v1::Device) -> usize,
) -> bool {
    let total =
        |slice: &ResourceSlice| -> usize { slice.spec.devices.iter().flatten().map(&count).sum() };
    total(written) >= total(sent)
}

/// Deletes the node's slices of this driver (the node's GPUs are offered
/// through the device plugin instead, and must not be offered twice).
pub(crate) async fn delete_node_slices(
    client: Client,
    driver: &str,
    node_name: &str,
) -> Result<usize, kube::Error> {
    let slices: Api<ResourceSlice> = Api::all(client);
    // The latest: a slice the cache has not shown yet would go on offering
    // the GPUs both ways.
    let found = existing(&slices, &pool_list(node_name, driver)).await?;
    for name in &found.names {
        match slices.delete(name, &DeleteParams::default()).await {
            Ok(_) => {}
            Err(kube::Error::Api(e)) if e.code == 404 => {}
            Err(e) => return Err(e),
        }
    }
    Ok(found.names.len())
}

#[cfg(test)]
mod tests {
    use http::{Method, Request, Response};
    use kube::client::Body;
    use serde_json::json;
    use tokio::time::Instant;
    use tower_test::mock;

    use super::*;
    use crate::agent::state::channel;

    const NODE: &str = "gpu-node-1";

    type ApiServer = mock::Handle<Request<Body>, Response<Body>>;

    /// A publisher of a ready view against a mocked API server, its counters,
    /// and the server's side.
    fn publishing() -> (tokio::task::JoinHandle<()>, Arc<SliceStats>, ApiServer) {
        let (service, api) = mock::pair::<Request<Body>, Response<Body>>();
        let (tx, rx) = channel("fake");
        tx.send_modify(|view| view.ready = true);
        let stats = Arc::new(SliceStats::default());
        let publisher = tokio::spawn(run_slice_publisher(
            Client::new(service, "default"),
            "gpu.tessera.dev".into(),
            NODE.into(),
            (rx, tx.clone()),
            false,
            Arc::clone(&stats),
            std::future::pending(),
        ));
        (publisher, stats, api)
    }

    #[tokio::test(start_paused = true)]
    async fn an_attempt_left_unanswered_is_given_up_and_made_again() {
        let (publisher, stats, mut api) = publishing();
        // Nothing is ever answered: the watch's list waits, and so does
        // each attempt's first read, the Node.
        let mut unanswered = Vec::new();
        let mut node_reads = Vec::new();
        while node_reads.len() < 2 {
            let next = tokio::time::timeout(Duration::from_secs(300), api.next_request());
            let (request, respond) = next
                .await
                .expect("no second attempt")
                .expect("the client went away");
            if request.method() == Method::GET
                && request.uri().path() == format!("/api/v1/nodes/{NODE}")
            {
                node_reads.push(Instant::now());
            }
            unanswered.push(respond);
        }
        // The state publisher's limit, then the first backoff.
        let limit = PublisherConfig::DEFAULT_REQUEST_TIMEOUT;
        let between = node_reads[1] - node_reads[0];
        assert!(
            (limit..limit + BACKOFF_START * 2).contains(&between),
            "the second attempt came {between:?} after the first"
        );
        assert_eq!(stats.errors(), 1);
        publisher.abort();
    }

    fn json(value: serde_json::Value) -> Response<Body> {
        Response::new(Body::from(value.to_string().into_bytes()))
    }

    /// The pool read back after the watch's first list must be read at the
    /// deletion of the left-over slice, not at the last write before it: a
    /// cache between the two still lists the left-over slice, and the pool
    /// would be taken as changed by someone else and written again (as the
    /// real 1.36 API server did, now and then).
    #[tokio::test]
    async fn the_read_back_is_at_least_as_new_as_the_left_over_deletion() {
        let (publisher, stats, mut api) = publishing();
        let left_over = json!({
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
            "metadata": {"name": "left-over", "resourceVersion": "5"},
            "spec": {"driver": "gpu.tessera.dev", "nodeName": NODE,
                     "pool": {"name": NODE, "generation": 3, "resourceSliceCount": 1}},
        });
        let mut held = Vec::new();
        let read_back = loop {
            let next = tokio::time::timeout(Duration::from_secs(10), api.next_request());
            let (request, respond) = next
                .await
                .expect("no read back after the watch's first list")
                .expect("the client went away");
            let query = request.uri().query().unwrap_or_default().to_string();
            let metadata_only = request
                .headers()
                .get(http::header::ACCEPT)
                .is_some_and(|a| {
                    a.to_str()
                        .unwrap_or_default()
                        .contains("PartialObjectMetadata")
                });
            match (request.method().clone(), request.uri().path()) {
                (Method::GET, path) if path.starts_with("/api/v1/nodes/") => respond.send_response(
                    json(json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE, "uid": "u-1"}})),
                ),
                (Method::GET, _) if query.contains("watch=true") => held.push(respond),
                (Method::GET, _) if metadata_only => respond.send_response(json(json!({
                    "apiVersion": "meta.k8s.io/v1", "kind": "PartialObjectMetadataList",
                    "metadata": {"resourceVersion": "9"}, "items": [],
                }))),
                (Method::GET, _) if stats.writes() == 0 => respond.send_response(json(json!({
                    "apiVersion": "resource.k8s.io/v1", "kind": "ResourceSliceList",
                    "metadata": {"resourceVersion": "9"}, "items": [left_over.clone()],
                }))),
                (Method::GET, _) => break query,
                (Method::PATCH, _) => {
                    let bytes = request.into_body().collect_bytes().await.unwrap();
                    let mut slice: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
                    slice["metadata"]["resourceVersion"] = json!("10");
                    respond.send_response(json(slice));
                }
                (Method::DELETE, path) => {
                    assert!(path.ends_with("/left-over"), "deleted {path}");
                    let mut gone = left_over.clone();
                    gone["metadata"]["resourceVersion"] = json!("11");
                    respond.send_response(json(gone));
                }
                (method, path) => panic!("unexpected {method} {path}"),
            }
        };
        assert!(
            read_back.contains("resourceVersion=11&"),
            "the read back was not at the deletion: {read_back}"
        );
        assert_eq!((stats.generation(), stats.restores()), (4, 0));
        publisher.abort();
    }

    #[tokio::test(start_paused = true)]
    async fn the_watch_is_read_while_an_attempt_waits() {
        let (publisher, _, mut api) = publishing();
        // The attempt's first read, the Node, is never answered; the watch's
        // list must still be sent, long before the attempt is given up.
        let mut asked = Vec::new();
        let mut unanswered = Vec::new();
        while asked.len() < 2 {
            let next = tokio::time::timeout(ANSWER_LIMIT / 2, api.next_request());
            let (request, respond) = next
                .await
                .expect("only one request while the attempt waits")
                .expect("the client went away");
            asked.push(format!("{} {}", request.method(), request.uri().path()));
            unanswered.push(respond);
        }
        asked.sort();
        assert_eq!(
            asked,
            [
                format!("GET /api/v1/nodes/{NODE}"),
                "GET /apis/resource.k8s.io/v1/resourceslices".to_string(),
            ]
        );
        publisher.abort();
    }
}
