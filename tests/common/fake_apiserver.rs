#![allow(dead_code)]
//! A small Kubernetes API server for tests, in process, plain HTTP on
//! loopback. It speaks the parts of the API the controller and its libraries
//! use, closely enough for kube-runtime's watcher and reflector:
//!
//! - LIST (`kind`, `apiVersion`, `metadata.resourceVersion`, `items`; pages
//!   of `limit` items with a `continue` token, the version that of the first
//!   page) and WATCH (`watch=true`, from a `resourceVersion`,
//!   newline-delimited JSON events held open until `timeoutSeconds`; from a
//!   version older than the last `expire_watches`, one ERROR event with a
//!   410 `Expired` status, as after an API server restart), both with
//!   `labelSelector` (`k`, `!k`, `k=v`, `k==v`, `k!=v`), for a cluster-scoped resource, one namespace or all namespaces;
//! - GET, POST (409 `AlreadyExists`), PUT, DELETE (immediate, honouring
//!   `preconditions.uid` and `preconditions.resourceVersion`), PATCH as JSON
//!   merge patch, strategic merge patch (treated as a merge patch: the objects
//!   patched that way here have no lists to merge by key) and server-side apply
//!   (field ownership per leaf field: applying a value another manager owns
//!   is a 409 `Conflict` unless `force=true`);
//! - `metadata.resourceVersion` in a PUT or PATCH body is a precondition (409
//!   `Conflict` when stale); a write that changes nothing keeps the version
//!   and sends no event; the `status` subresource of ModelInstances (spec
//!   untouched, no generation bump) and `pods/{name}/binding` (409 when the
//!   pod is bound already).
//!
//! One global, increasing resourceVersion orders everything; the full event
//! history is kept, so a watch from any earlier version replays what it
//! missed. Each request is recorded with the bearer token it carried, so a
//! test with one token per client can tell the writers apart. A request the
//! fake does not know is answered 404 and printed, so a missing route shows
//! up as such rather than as a hang.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::{Method, StatusCode, header};
use axum::response::Response;
use serde_json::{Map, Value, json};
use tokio::sync::mpsc;

/// The resources the fake serves.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(crate) enum Kind {
    Node,
    Pod,
    Service,
    Event,
    Lease,
    ModelInstance,
}

impl Kind {
    const ALL: [Kind; 6] = [
        Kind::Node,
        Kind::Pod,
        Kind::Service,
        Kind::Event,
        Kind::Lease,
        Kind::ModelInstance,
    ];

    pub(crate) fn kind(self) -> &'static str {
        match self {
            Kind::Node => "Node",
            Kind::Pod => "Pod",
            Kind::Service => "Service",
            Kind::Event => "Event",
            Kind::Lease => "Lease",
            Kind::ModelInstance => "ModelInstance",
        }
    }

    pub(crate) fn api_version(self) -> &'static str {
        match self {
            Kind::Node | Kind::Pod | Kind::Service => "v1",
            Kind::Event => "events.k8s.io/v1",
            Kind::Lease => "coordination.k8s.io/v1",
            Kind::ModelInstance => "tessera.dev/v1alpha1",
        }
    }

    fn plural(self) -> &'static str {
        match self {
            Kind::Node => "nodes",
            Kind::Pod => "pods",
            Kind::Service => "services",
            Kind::Event => "events",
            Kind::Lease => "leases",
            Kind::ModelInstance => "modelinstances",
        }
    }

    fn namespaced(self) -> bool {
        self != Kind::Node
    }

    /// Custom resources count `metadata.generation`.
    fn has_generation(self) -> bool {
        self == Kind::ModelInstance
    }

    fn find(api_version: &str, plural: &str) -> Option<Kind> {
        Kind::ALL
            .into_iter()
            .find(|k| k.api_version() == api_version && k.plural() == plural)
    }
}

/// One request as the fake saw it.
#[derive(Clone, Debug)]
pub(crate) struct Record {
    pub(crate) method: String,
    pub(crate) path: String,
    pub(crate) query: String,
    /// The bearer token the client sent, if any.
    pub(crate) client: Option<String>,
    pub(crate) kind: Option<Kind>,
    pub(crate) status: u16,
}

impl Record {
    pub(crate) fn is_write(&self) -> bool {
        !matches!(self.method.as_str(), "GET" | "HEAD")
    }
}

type Key = (Kind, String, String);

struct Stored {
    object: Value,
    /// Leaf field path (`spec.holderIdentity`) → field manager.
    owners: BTreeMap<String, String>,
}

struct Watch {
    kind: Kind,
    namespace: Option<String>,
    selector: Selector,
    tx: mpsc::UnboundedSender<Bytes>,
}

#[derive(Default)]
struct Inner {
    rv: u64,
    uids: u64,
    objects: BTreeMap<Key, Stored>,
    history: Vec<(u64, Kind, &'static str, Value)>,
    watches: Vec<Watch>,
    records: Vec<Record>,
    unknown: Vec<String>,
    /// While set, every new request is answered with this status (429 or
    /// 503, `Retry-After: 1`), as an overloaded API server does; watches
    /// already open stay open.
    overloaded: Option<u16>,
    /// Watches from an older resourceVersion are answered 410 `Expired`.
    oldest_rv: u64,
    /// Pages hold at most this many items, however many the client asked
    /// for (an API server may return fewer than `limit`).
    page_cap: Option<usize>,
    /// Every page of a list is answered this much later.
    page_delay: Duration,
}

pub(crate) struct FakeApiServer {
    inner: Arc<Mutex<Inner>>,
    addr: SocketAddr,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for FakeApiServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

fn lock(m: &Mutex<Inner>) -> MutexGuard<'_, Inner> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl FakeApiServer {
    /// Serves on an ephemeral loopback port, on the current tokio runtime.
    pub(crate) async fn start() -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("a loopback port for the fake API server");
        let addr = listener.local_addr().expect("its address");
        let inner = Arc::new(Mutex::new(Inner::default()));
        let app = Router::new()
            .fallback(handle)
            .with_state(Arc::clone(&inner));
        let task = tokio::spawn(async move {
            if let Err(e) = axum::serve(listener, app).await {
                eprintln!("fake API server stopped: {e}");
            }
        });
        Self { inner, addr, task }
    }

    pub(crate) fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// A kubeconfig for this server whose client sends `token`.
    pub(crate) fn kubeconfig(&self, token: &str) -> String {
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: fake\n  cluster:\n    server: {}\n\
             users:\n- name: {token}\n  user:\n    token: {token}\n\
             contexts:\n- name: fake\n  context:\n    cluster: fake\n    user: {token}\n\
             current-context: fake\n",
            self.url()
        )
    }

    /// Creates an object as a POST would (uid, resourceVersion, timestamps);
    /// panics if it exists.
    pub(crate) fn create(&self, kind: Kind, object: Value) -> Value {
        let mut inner = lock(&self.inner);
        let ns = object["metadata"]["namespace"].as_str().map(str::to_string);
        match inner.create(kind, ns.as_deref(), object, None) {
            Ok(v) => v,
            Err((code, reason, message)) => panic!("fake create: {code} {reason}: {message}"),
        }
    }

    pub(crate) fn get(&self, kind: Kind, ns: &str, name: &str) -> Option<Value> {
        let inner = lock(&self.inner);
        inner
            .objects
            .get(&(kind, ns.to_string(), name.to_string()))
            .map(|s| s.object.clone())
    }

    pub(crate) fn list(&self, kind: Kind) -> Vec<Value> {
        let inner = lock(&self.inner);
        inner
            .objects
            .iter()
            .filter(|(k, _)| k.0 == kind)
            .map(|(_, s)| s.object.clone())
            .collect()
    }

    /// Changes an object in place (a MODIFIED event); panics if it is missing.
    pub(crate) fn modify(&self, kind: Kind, ns: &str, name: &str, change: impl FnOnce(&mut Value)) {
        let mut inner = lock(&self.inner);
        let key = (kind, ns.to_string(), name.to_string());
        let Some(stored) = inner.objects.get(&key) else {
            panic!("fake modify: no {} {ns}/{name}", kind.kind());
        };
        let mut object = stored.object.clone();
        change(&mut object);
        inner.store(&key, object, None);
    }

    /// Deletes an object as a user would (a DELETED event); false if missing.
    pub(crate) fn delete(&self, kind: Kind, ns: &str, name: &str) -> bool {
        let mut inner = lock(&self.inner);
        inner
            .remove(&(kind, ns.to_string(), name.to_string()))
            .is_some()
    }

    /// Answers every new request with `code` (429 Too Many Requests, 503
    /// Service Unavailable) until called again with `None`.
    pub(crate) fn overload(&self, code: Option<u16>) {
        lock(&self.inner).overloaded = code;
    }

    /// Closes every open watch and stops replaying what came before, as an
    /// API server that restarted does: watches resuming from before now get
    /// 410 `Expired` and must list again.
    pub(crate) fn expire_watches(&self) {
        let mut inner = lock(&self.inner);
        inner.oldest_rv = inner.rv + 1;
        inner.watches.clear();
    }

    /// Lists made with a `limit` get pages of at most `cap` items, each
    /// answered `delay` late: a slow list of a large cluster.
    pub(crate) fn slow_pages(&self, cap: Option<usize>, delay: Duration) {
        let mut inner = lock(&self.inner);
        inner.page_cap = cap;
        inner.page_delay = delay;
    }

    pub(crate) fn records(&self) -> Vec<Record> {
        lock(&self.inner).records.clone()
    }

    /// Requests no route matched.
    pub(crate) fn unknown(&self) -> Vec<String> {
        lock(&self.inner).unknown.clone()
    }

    /// Open watch streams (closed ones are noticed on the next event).
    pub(crate) fn watches(&self) -> usize {
        lock(&self.inner).watches.len()
    }
}

// ---------------------------------------------------------------------------
// Label selectors.

#[derive(Clone, Debug, Default)]
struct Selector(Vec<Requirement>);

#[derive(Clone, Debug)]
enum Requirement {
    Exists(String),
    Absent(String),
    Equals(String, String),
    Differs(String, String),
}

impl Selector {
    fn parse(text: &str) -> Result<Self, String> {
        let mut out = Vec::new();
        for term in text.split(',').map(str::trim).filter(|t| !t.is_empty()) {
            let req = if let Some((k, v)) = term.split_once("!=") {
                Requirement::Differs(k.trim().into(), v.trim().into())
            } else if let Some((k, v)) = term.split_once("==") {
                Requirement::Equals(k.trim().into(), v.trim().into())
            } else if let Some((k, v)) = term.split_once('=') {
                Requirement::Equals(k.trim().into(), v.trim().into())
            } else if let Some(k) = term.strip_prefix('!') {
                Requirement::Absent(k.trim().into())
            } else if term.contains(' ') || term.contains('(') {
                return Err(format!("set-based selector {term:?} is not supported"));
            } else {
                Requirement::Exists(term.into())
            };
            out.push(req);
        }
        Ok(Self(out))
    }

    fn matches(&self, object: &Value) -> bool {
        let labels = &object["metadata"]["labels"];
        self.0.iter().all(|r| match r {
            Requirement::Exists(k) => labels.get(k).is_some(),
            Requirement::Absent(k) => labels.get(k).is_none(),
            Requirement::Equals(k, v) => labels.get(k).and_then(Value::as_str) == Some(v),
            Requirement::Differs(k, v) => labels.get(k).and_then(Value::as_str) != Some(v),
        })
    }
}

// ---------------------------------------------------------------------------
// The store.

type Failure = (u16, &'static str, String);

fn now() -> String {
    let t = k8s_openapi::jiff::Timestamp::now();
    k8s_openapi::jiff::Timestamp::from_second(t.as_second())
        .map(|t| t.to_string())
        .unwrap_or_else(|_| t.to_string())
}

fn name_of(object: &Value) -> Option<String> {
    object["metadata"]["name"].as_str().map(str::to_string)
}

impl Inner {
    fn next_rv(&mut self) -> u64 {
        self.rv += 1;
        self.rv
    }

    fn emit(&mut self, kind: Kind, kind_of_event: &'static str, object: Value) {
        let rv = self.rv;
        let line = watch_line(kind_of_event, &object);
        self.watches.retain(|w| {
            if w.kind != kind || !in_namespace(&object, w.namespace.as_deref()) {
                return true;
            }
            if !w.selector.matches(&object) {
                return !w.tx.is_closed();
            }
            w.tx.send(line.clone()).is_ok()
        });
        self.history.push((rv, kind, kind_of_event, object));
    }

    fn create(
        &mut self,
        kind: Kind,
        ns: Option<&str>,
        mut object: Value,
        manager: Option<&str>,
    ) -> Result<Value, Failure> {
        if !object.is_object() {
            return Err((400, "BadRequest", "the body is not an object".into()));
        }
        let Some(name) = name_of(&object) else {
            return Err((
                422,
                "Invalid",
                "metadata.name: Required value (generateName is not supported)".into(),
            ));
        };
        let ns = if kind.namespaced() {
            match ns {
                Some(ns) => ns.to_string(),
                None => return Err((400, "BadRequest", "a namespace is required".into())),
            }
        } else {
            String::new()
        };
        if let Some(body_ns) = object["metadata"]["namespace"].as_str()
            && kind.namespaced()
            && body_ns != ns
        {
            return Err((
                400,
                "BadRequest",
                "the namespace of the object does not match the namespace of the request".into(),
            ));
        }
        let key = (kind, ns.clone(), name.clone());
        if self.objects.contains_key(&key) {
            return Err((
                409,
                "AlreadyExists",
                format!("{} \"{name}\" already exists", kind.plural()),
            ));
        }
        self.uids += 1;
        let rv = self.next_rv();
        object["apiVersion"] = json!(kind.api_version());
        object["kind"] = json!(kind.kind());
        let meta = object["metadata"].as_object_mut().expect("metadata");
        if kind.namespaced() {
            meta.insert("namespace".into(), json!(ns));
        } else {
            meta.remove("namespace");
        }
        meta.insert(
            "uid".into(),
            json!(format!("00000000-0000-4000-8000-{:012x}", self.uids)),
        );
        meta.insert("resourceVersion".into(), json!(rv.to_string()));
        meta.insert("creationTimestamp".into(), json!(now()));
        meta.remove("deletionTimestamp");
        if kind.has_generation() {
            meta.insert("generation".into(), json!(1));
        }
        if kind == Kind::Pod && object["status"]["phase"].is_null() {
            object["status"] = json!({"phase": "Pending"});
        }
        let mut owners = BTreeMap::new();
        if let Some(m) = manager {
            claim(&mut owners, &object, m);
        }
        self.objects.insert(
            key,
            Stored {
                object: object.clone(),
                owners,
            },
        );
        self.emit(kind, "ADDED", object.clone());
        Ok(object)
    }

    /// Stores a changed object: a new resourceVersion and a MODIFIED event,
    /// unless nothing changed. Bumps the generation when the spec changed.
    fn store(
        &mut self,
        key: &Key,
        mut object: Value,
        owners: Option<BTreeMap<String, String>>,
    ) -> Value {
        let Some(old) = self.objects.get(key) else {
            return object;
        };
        // Identity fields are the server's.
        for field in [
            "uid",
            "resourceVersion",
            "creationTimestamp",
            "generation",
            "namespace",
            "name",
        ] {
            match old.object["metadata"].get(field) {
                Some(v) => object["metadata"][field] = v.clone(),
                None => {
                    if let Some(m) = object["metadata"].as_object_mut() {
                        m.remove(field);
                    }
                }
            }
        }
        object["apiVersion"] = old.object["apiVersion"].clone();
        object["kind"] = old.object["kind"].clone();
        if object == old.object {
            return object;
        }
        if key.0.has_generation() && object.get("spec") != old.object.get("spec") {
            let generation = old.object["metadata"]["generation"].as_i64().unwrap_or(0) + 1;
            object["metadata"]["generation"] = json!(generation);
        }
        let rv = self.next_rv();
        object["metadata"]["resourceVersion"] = json!(rv.to_string());
        let stored = self.objects.get_mut(key).expect("checked above");
        stored.object = object.clone();
        if let Some(owners) = owners {
            stored.owners = owners;
        }
        self.emit(key.0, "MODIFIED", object.clone());
        object
    }

    fn remove(&mut self, key: &Key) -> Option<Value> {
        let mut stored = self.objects.remove(key)?;
        let rv = self.next_rv();
        stored.object["metadata"]["resourceVersion"] = json!(rv.to_string());
        self.emit(key.0, "DELETED", stored.object.clone());
        Some(stored.object)
    }
}

fn in_namespace(object: &Value, ns: Option<&str>) -> bool {
    ns.is_none_or(|ns| object["metadata"]["namespace"].as_str() == Some(ns))
}

fn watch_line(type_: &str, object: &Value) -> Bytes {
    let mut text = json!({"type": type_, "object": object}).to_string();
    text.push('\n');
    Bytes::from(text)
}

/// RFC 7386 JSON merge patch.
fn merge(target: &mut Value, patch: &Value) {
    let Value::Object(p) = patch else {
        *target = patch.clone();
        return;
    };
    if !target.is_object() {
        *target = Value::Object(Map::new());
    }
    let t = target.as_object_mut().expect("an object");
    for (k, v) in p {
        if v.is_null() {
            t.remove(k);
        } else {
            merge(t.entry(k.clone()).or_insert(Value::Null), v);
        }
    }
}

/// Leaf fields of a patch body (objects are descended; lists and scalars
/// are leaves), without `apiVersion`, `kind` and `metadata`.
fn leaves(value: &Value) -> Vec<(String, Value)> {
    fn walk(prefix: &str, v: &Value, out: &mut Vec<(String, Value)>) {
        match v {
            Value::Object(m) if !m.is_empty() => {
                for (k, v) in m {
                    let path = if prefix.is_empty() {
                        k.clone()
                    } else {
                        format!("{prefix}.{k}")
                    };
                    walk(&path, v, out);
                }
            }
            other => out.push((prefix.to_string(), other.clone())),
        }
    }
    let mut out = Vec::new();
    if let Value::Object(m) = value {
        for (k, v) in m {
            if !matches!(k.as_str(), "apiVersion" | "kind" | "metadata") {
                walk(k, v, &mut out);
            }
        }
    }
    out
}

fn at<'a>(object: &'a Value, path: &str) -> Option<&'a Value> {
    path.split('.').try_fold(object, |v, k| v.get(k))
}

/// Records `manager` as the owner of every field a write set, and drops the
/// ownership of fields it removed.
fn claim(owners: &mut BTreeMap<String, String>, patch: &Value, manager: &str) {
    for (path, v) in leaves(patch) {
        let nested = format!("{path}.");
        owners.retain(|p, _| *p != path && !p.starts_with(&nested));
        if !v.is_null() {
            owners.insert(path, manager.to_string());
        }
    }
}

// ---------------------------------------------------------------------------
// HTTP.

struct Target {
    kind: Kind,
    namespace: Option<String>,
    name: Option<String>,
    sub: Option<String>,
}

fn parse_path(path: &str) -> Option<Target> {
    let segments: Vec<&str> = path.trim_matches('/').split('/').collect();
    let (api_version, rest) = match segments.as_slice() {
        ["api", "v1", rest @ ..] => ("v1".to_string(), rest),
        ["apis", group, version, rest @ ..] => (format!("{group}/{version}"), rest),
        _ => return None,
    };
    let (namespace, rest) = match rest {
        ["namespaces", ns, rest @ ..] if !rest.is_empty() => (Some(ns.to_string()), rest),
        _ => (None, rest),
    };
    let (plural, name, sub) = match rest {
        [plural] => (*plural, None, None),
        [plural, name] => (*plural, Some(name.to_string()), None),
        [plural, name, sub] => (*plural, Some(name.to_string()), Some(sub.to_string())),
        _ => return None,
    };
    let kind = Kind::find(&api_version, plural)?;
    if namespace.is_some() && !kind.namespaced() {
        return None;
    }
    if name.is_some() && kind.namespaced() && namespace.is_none() {
        return None;
    }
    Some(Target {
        kind,
        namespace,
        name,
        sub,
    })
}

fn decode(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = bytes
            .get(i + 1..i + 3)
            .and_then(|h| std::str::from_utf8(h).ok())
            .and_then(|h| u8::from_str_radix(h, 16).ok());
        match (bytes[i], hex) {
            (b'+', _) => out.push(b' '),
            (b'%', Some(b)) => {
                out.push(b);
                i += 2;
            }
            (b, _) => out.push(b),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn query_params(query: &str) -> BTreeMap<String, String> {
    query
        .split('&')
        .filter(|p| !p.is_empty())
        .map(|p| match p.split_once('=') {
            Some((k, v)) => (decode(k), decode(v)),
            None => (decode(p), String::new()),
        })
        .collect()
}

fn is_watch(query: &BTreeMap<String, String>) -> bool {
    matches!(query.get("watch").map(String::as_str), Some("true" | "1"))
}

fn json_response(code: u16, body: &Value) -> Response {
    Response::builder()
        .status(StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR))
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from(body.to_string()))
        .expect("a response")
}

fn status_body(code: u16, reason: &str, message: &str) -> Value {
    json!({
        "kind": "Status", "apiVersion": "v1", "metadata": {},
        "status": if code < 400 { "Success" } else { "Failure" },
        "code": code, "reason": reason, "message": message,
    })
}

fn failure((code, reason, message): Failure) -> Response {
    json_response(code, &status_body(code, reason, &message))
}

async fn handle(State(inner): State<Arc<Mutex<Inner>>>, request: Request) -> Response {
    let method = request.method().clone();
    let path = request.uri().path().to_string();
    let query = request.uri().query().unwrap_or("").to_string();
    let client = request
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::to_string);
    let content_type = request
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_string();
    let body = match axum::body::to_bytes(request.into_body(), 16 << 20).await {
        Ok(b) => b,
        Err(e) => return failure((400, "BadRequest", format!("unreadable body: {e}"))),
    };
    let target = parse_path(&path);
    let params = query_params(&query);
    let is_list = method == Method::GET
        && target
            .as_ref()
            .is_some_and(|t| t.name.is_none() && t.sub.is_none())
        && !is_watch(&params);
    let page_delay = lock(&inner).page_delay;
    if is_list && !page_delay.is_zero() {
        tokio::time::sleep(page_delay).await;
    }
    let overloaded = lock(&inner).overloaded;
    let response = match (&target, overloaded) {
        (_, Some(code)) => Some(overloaded_response(code)),
        (None, None) => None,
        (Some(t), None) => serve(&inner, &method, t, &params, &content_type, &body),
    };
    let kind = target.as_ref().map(|t| t.kind);
    let response = response.unwrap_or_else(|| {
        let what = format!("{method} {path}?{query}");
        eprintln!("fake API server: no route for {what}");
        lock(&inner).unknown.push(what.clone());
        failure((
            404,
            "NotFound",
            format!("the fake API server has no route for {what}"),
        ))
    });
    lock(&inner).records.push(Record {
        method: method.to_string(),
        path,
        query,
        client,
        kind,
        status: response.status().as_u16(),
    });
    response
}

fn overloaded_response(code: u16) -> Response {
    let (reason, message) = if code == 429 {
        (
            "TooManyRequests",
            "too many requests, please try again later",
        )
    } else {
        (
            "ServiceUnavailable",
            "the server is currently unable to handle the request",
        )
    };
    let mut response = json_response(code, &status_body(code, reason, message));
    response
        .headers_mut()
        .insert(header::RETRY_AFTER, header::HeaderValue::from_static("1"));
    response
}

/// `None` when the request is not one the fake knows.
fn serve(
    inner: &Arc<Mutex<Inner>>,
    method: &Method,
    t: &Target,
    query: &BTreeMap<String, String>,
    content_type: &str,
    body: &[u8],
) -> Option<Response> {
    let parsed = || -> Result<Value, Failure> {
        serde_json::from_slice(body)
            .map_err(|e| (400, "BadRequest", format!("the body is not JSON: {e}")))
    };
    let manager = query.get("fieldManager").map(String::as_str);
    let ns = t.namespace.clone().unwrap_or_default();
    match (method, &t.name, t.sub.as_deref()) {
        (&Method::GET, None, None) => {
            let selector =
                match Selector::parse(query.get("labelSelector").map_or("", String::as_str)) {
                    Ok(s) => s,
                    Err(e) => return Some(failure((400, "BadRequest", e))),
                };
            if let Some(fields) = query.get("fieldSelector").filter(|f| !f.is_empty()) {
                return Some(failure((
                    400,
                    "BadRequest",
                    format!("field selectors ({fields}) are not supported by the fake"),
                )));
            }
            if is_watch(query) {
                Some(watch(inner, t, selector, query))
            } else {
                Some(list(inner, t, &selector, query))
            }
        }
        (&Method::POST, None, None) => {
            let object = match parsed() {
                Ok(v) => v,
                Err(f) => return Some(failure(f)),
            };
            let mut inner = lock(inner);
            Some(
                match inner.create(t.kind, t.namespace.as_deref(), object, manager) {
                    Ok(v) => json_response(201, &v),
                    Err(f) => failure(f),
                },
            )
        }
        (&Method::GET, Some(name), None) => {
            let inner = lock(inner);
            Some(match inner.objects.get(&(t.kind, ns, name.clone())) {
                Some(s) => json_response(200, &s.object),
                None => failure(not_found(t.kind, name)),
            })
        }
        (&Method::DELETE, Some(name), None) => {
            let options = if body.is_empty() {
                Value::Null
            } else {
                match parsed() {
                    Ok(v) => v,
                    Err(f) => return Some(failure(f)),
                }
            };
            let mut inner = lock(inner);
            let key = (t.kind, ns, name.clone());
            let Some(stored) = inner.objects.get(&key) else {
                return Some(failure(not_found(t.kind, name)));
            };
            for field in ["uid", "resourceVersion"] {
                let want = &options["preconditions"][field];
                let have = &stored.object["metadata"][field];
                if !want.is_null() && want != have {
                    return Some(failure((
                        409,
                        "Conflict",
                        format!(
                            "Operation cannot be fulfilled on {} \"{name}\": Precondition failed: {field} in precondition: {want}, {field} in object meta: {have}",
                            t.kind.plural()
                        ),
                    )));
                }
            }
            let gone = inner.remove(&key).expect("checked above");
            Some(json_response(200, &gone))
        }
        (&Method::PUT, Some(name), None) => {
            let object = match parsed() {
                Ok(v) => v,
                Err(f) => return Some(failure(f)),
            };
            let mut inner = lock(inner);
            let key = (t.kind, ns, name.clone());
            if let Err(f) = precondition(&inner, &key, &object) {
                return Some(failure(f));
            }
            let mut owners = inner.objects[&key].owners.clone();
            if let Some(m) = manager {
                claim(&mut owners, &object, m);
            }
            Some(json_response(200, &inner.store(&key, object, Some(owners))))
        }
        (&Method::PATCH, Some(name), sub @ (None | Some("status"))) => {
            if sub == Some("status") && !matches!(t.kind, Kind::ModelInstance | Kind::Pod) {
                return None;
            }
            let patch = match parsed() {
                Ok(v) => v,
                Err(f) => return Some(failure(f)),
            };
            let force = query.get("force").is_some_and(|f| f == "true");
            let mut inner = lock(inner);
            Some(
                match patch_object(
                    &mut inner,
                    t.kind,
                    &ns,
                    name,
                    sub.is_some(),
                    content_type,
                    &patch,
                    manager,
                    force,
                ) {
                    Ok(v) => json_response(200, &v),
                    Err(f) => failure(f),
                },
            )
        }
        (&Method::POST, Some(name), Some("binding")) if t.kind == Kind::Pod => {
            let binding = match parsed() {
                Ok(v) => v,
                Err(f) => return Some(failure(f)),
            };
            let Some(node) = binding["target"]["name"].as_str().map(str::to_string) else {
                return Some(failure((
                    422,
                    "Invalid",
                    "target.name: Required value".into(),
                )));
            };
            let mut inner = lock(inner);
            let key = (Kind::Pod, ns, name.clone());
            let Some(stored) = inner.objects.get(&key) else {
                return Some(failure(not_found(Kind::Pod, name)));
            };
            if let Some(bound) = stored.object["spec"]["nodeName"].as_str() {
                return Some(failure((
                    409,
                    "Conflict",
                    format!(
                        "Operation cannot be fulfilled on pods/binding \"{name}\": pod {name} is already assigned to node \"{bound}\""
                    ),
                )));
            }
            let mut pod = stored.object.clone();
            pod["spec"]["nodeName"] = json!(node);
            inner.store(&key, pod, None);
            Some(json_response(201, &status_body(201, "", "")))
        }
        _ => None,
    }
}

fn not_found(kind: Kind, name: &str) -> Failure {
    (
        404,
        "NotFound",
        format!("{} \"{name}\" not found", kind.plural()),
    )
}

/// `metadata.resourceVersion` in a body must be the current one.
fn precondition(inner: &Inner, key: &Key, body: &Value) -> Result<(), Failure> {
    let Some(stored) = inner.objects.get(key) else {
        return Err(not_found(key.0, &key.2));
    };
    match body["metadata"]["resourceVersion"].as_str() {
        Some(rv)
            if !rv.is_empty()
                && Some(rv) != stored.object["metadata"]["resourceVersion"].as_str() =>
        {
            Err((
                409,
                "Conflict",
                format!(
                    "Operation cannot be fulfilled on {} \"{}\": the object has been modified; please apply your changes to the latest version and try again",
                    key.0.plural(),
                    key.2
                ),
            ))
        }
        _ => Ok(()),
    }
}

#[allow(clippy::too_many_arguments)]
fn patch_object(
    inner: &mut Inner,
    kind: Kind,
    ns: &str,
    name: &str,
    status_only: bool,
    content_type: &str,
    patch: &Value,
    manager: Option<&str>,
    force: bool,
) -> Result<Value, Failure> {
    let key = (kind, ns.to_string(), name.to_string());
    let media = content_type.split(';').next().unwrap_or("").trim();
    let apply = match media {
        "application/apply-patch+yaml" => true,
        "application/merge-patch+json" | "application/strategic-merge-patch+json" => false,
        other => {
            return Err((
                415,
                "UnsupportedMediaType",
                format!("the fake does not support patches of type {other:?}"),
            ));
        }
    };
    if apply && manager.is_none() {
        return Err((
            400,
            "BadRequest",
            "PatchOptions.meta.k8s.io \"\" is invalid: fieldManager: Required value: is required for apply patch".into(),
        ));
    }
    if !inner.objects.contains_key(&key) {
        if apply && !status_only {
            // Server-side apply creates what does not exist.
            let mut object = patch.clone();
            object["metadata"]["name"] = json!(name);
            return inner.create(kind, kind.namespaced().then_some(ns), object, manager);
        }
        return Err(not_found(kind, name));
    }
    precondition(inner, &key, patch)?;
    let stored = &inner.objects[&key];
    let mut object = stored.object.clone();
    let mut owners = stored.owners.clone();
    if status_only {
        // The status subresource: only `.status` changes.
        if apply {
            object["status"] = patch.get("status").cloned().unwrap_or(Value::Null);
        } else if let Some(s) = patch.get("status") {
            let mut s = s.clone();
            // A strategic merge patch merges a pod's conditions by type.
            if content_type.contains("strategic-merge-patch")
                && let Some(Value::Array(new)) =
                    s.as_object_mut().and_then(|s| s.remove("conditions"))
            {
                let conditions = object["status"]["conditions"]
                    .as_array()
                    .cloned()
                    .unwrap_or_default();
                let mut merged: Vec<Value> = conditions
                    .into_iter()
                    .filter(|c| !new.iter().any(|n| n["type"] == c["type"]))
                    .collect();
                merged.extend(new);
                object["status"]["conditions"] = Value::Array(merged);
            }
            merge(&mut object["status"], &s);
        }
        if object["status"].is_null()
            && let Some(m) = object.as_object_mut()
        {
            m.remove("status");
        }
    } else {
        let manager = manager.unwrap_or("unknown");
        if apply && !force {
            let conflicts: Vec<String> = leaves(patch)
                .into_iter()
                .filter(|(path, value)| {
                    owners.get(path).is_some_and(|owner| owner != manager)
                        && at(&object, path) != Some(value)
                })
                .map(|(path, _)| format!(".{path} (owned by {:?})", owners[&path]))
                .collect();
            if !conflicts.is_empty() {
                return Err((
                    409,
                    "Conflict",
                    format!(
                        "Apply failed with {} conflicts: {}",
                        conflicts.len(),
                        conflicts.join(", ")
                    ),
                ));
            }
        }
        let mut body = patch.clone();
        if let Some(m) = body.as_object_mut() {
            m.remove("apiVersion");
            m.remove("kind");
            if let Some(meta) = m.get_mut("metadata").and_then(Value::as_object_mut) {
                meta.remove("resourceVersion");
            }
        }
        merge(&mut object, &body);
        claim(&mut owners, patch, manager);
    }
    Ok(inner.store(&key, object, Some(owners)))
}

fn list(
    inner: &Arc<Mutex<Inner>>,
    t: &Target,
    selector: &Selector,
    query: &BTreeMap<String, String>,
) -> Response {
    let inner = lock(inner);
    let limit = match query.get("limit").filter(|l| !l.is_empty()) {
        None => None,
        Some(text) => match text.parse::<usize>() {
            Ok(limit) if limit > 0 => Some(limit.min(inner.page_cap.unwrap_or(usize::MAX))),
            Ok(_) => None,
            Err(_) => return failure((400, "BadRequest", format!("bad limit {text:?}"))),
        },
    };
    // `offset/version`: where the next page starts, and the first page's version.
    let (offset, rv) = match query.get("continue").filter(|c| !c.is_empty()) {
        None => (0, inner.rv),
        Some(token) => match token
            .split_once('/')
            .and_then(|(o, v)| Some((o.parse().ok()?, v.parse().ok()?)))
        {
            Some(start) => start,
            None => return failure((400, "BadRequest", format!("bad continue {token:?}"))),
        },
    };
    let matching = inner.objects.iter().filter(|(k, s)| {
        k.0 == t.kind
            && in_namespace(&s.object, t.namespace.as_deref())
            && selector.matches(&s.object)
    });
    let mut items: Vec<Value> = matching
        .skip(offset)
        .take(limit.map_or(usize::MAX, |l| l.saturating_add(1)))
        .map(|(_, s)| s.object.clone())
        .collect();
    let mut metadata = json!({"resourceVersion": rv.to_string()});
    if let Some(limit) = limit
        && items.len() > limit
    {
        items.truncate(limit);
        metadata["continue"] = json!(format!("{}/{rv}", offset + limit));
    }
    json_response(
        200,
        &json!({
            "kind": format!("{}List", t.kind.kind()),
            "apiVersion": t.kind.api_version(),
            "metadata": metadata,
            "items": items,
        }),
    )
}

fn watch(
    inner: &Arc<Mutex<Inner>>,
    t: &Target,
    selector: Selector,
    query: &BTreeMap<String, String>,
) -> Response {
    let from = query
        .get("resourceVersion")
        .map(String::as_str)
        .unwrap_or("");
    let timeout = query
        .get("timeoutSeconds")
        .and_then(|s| s.parse().ok())
        .unwrap_or(1800u64);
    let (tx, rx) = mpsc::unbounded_channel();
    {
        let mut inner = lock(inner);
        match from {
            // "Any": the current state as ADDED events, then changes.
            "" | "0" => {
                for (k, s) in &inner.objects {
                    if k.0 == t.kind
                        && in_namespace(&s.object, t.namespace.as_deref())
                        && selector.matches(&s.object)
                    {
                        let _ = tx.send(watch_line("ADDED", &s.object));
                    }
                }
            }
            rv => {
                let Ok(rv) = rv.parse::<u64>() else {
                    return failure((400, "BadRequest", format!("bad resourceVersion {rv:?}")));
                };
                if rv < inner.oldest_rv {
                    let status = status_body(
                        410,
                        "Expired",
                        &format!("too old resource version: {rv} ({})", inner.oldest_rv),
                    );
                    return Response::builder()
                        .status(StatusCode::OK)
                        .header(header::CONTENT_TYPE, "application/json")
                        .body(Body::from(watch_line("ERROR", &status)))
                        .expect("a response");
                }
                if rv > inner.rv {
                    return failure((
                        504,
                        "Timeout",
                        format!("Too large resource version: {rv}, current: {}", inner.rv),
                    ));
                }
                for (at, kind, type_, object) in &inner.history {
                    if *at > rv
                        && *kind == t.kind
                        && in_namespace(object, t.namespace.as_deref())
                        && selector.matches(object)
                    {
                        let _ = tx.send(watch_line(type_, object));
                    }
                }
            }
        }
        inner.watches.push(Watch {
            kind: t.kind,
            namespace: t.namespace.clone(),
            selector,
            tx,
        });
    }
    let deadline = tokio::time::Instant::now() + Duration::from_secs(timeout);
    let stream = futures::stream::unfold(rx, move |mut rx| async move {
        tokio::select! {
            line = rx.recv() => line.map(|l| (Ok::<_, std::convert::Infallible>(l), rx)),
            () = tokio::time::sleep_until(deadline) => None,
        }
    });
    Response::builder()
        .status(StatusCode::OK)
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from_stream(stream))
        .expect("a response")
}
