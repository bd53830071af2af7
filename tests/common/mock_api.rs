//! A mocked API server for the controller's reconcile tests: the caches
//! filled as after a controller's start, a context over them, and every
//! request of a reconcile answered as an API server would. Included with
//! `#[path = "common/mock_api.rs"] mod mock_api;`.

// Each test binary uses only part of it.
#![allow(dead_code)]

use std::sync::Arc;
use std::time::Duration;

use http::{Method, Request, Response, StatusCode};
use k8s_openapi::api::core::v1::{Node, Pod, PodCondition, PodStatus, Service};
use kube::client::Body;
use kube::runtime::controller::Action;
use kube::runtime::events::{Recorder, Reporter};
use kube::runtime::reflector::{self, store::Writer};
use kube::runtime::watcher;
use serde_json::{Value, json};
use tessera::api::{ModelInstance, ModelInstanceStatus, Phase, PlannedShard};
use tessera::controller::decide::{Current, PlanDecision, PlanInputs, decide};
use tessera::controller::desired::shard_pods;
use tessera::controller::dra::DraCaches;
use tessera::controller::held::Held;
use tessera::controller::metrics::Metrics;
use tessera::controller::node_cache::CachedNode;
use tessera::controller::nodes::NodeInfo;
use tessera::controller::reconcile::{Caches, Context, Settings};
use tower_test::mock::{Handle, SendResponse};

pub(crate) type ApiHandle = Handle<Request<Body>, Response<Body>>;

pub(crate) const H100: &str = r#"{"id":"ID","index":I,"vendor":"nvidia","product":"NVIDIA H100 80GB HBM3","memoryTotalBytes":85899345920,"memoryFreeBytes":85000000000,"fp16Tflops":989.0,"memoryBandwidthGbps":3350.0,"temperatureC":40.0,"health":"Healthy"}"#;

/// An RTX 4090: serves fewer requests/s a GPU than an [`H100`].
pub(crate) const RTX4090: &str = r#"{"id":"ID","index":I,"vendor":"nvidia","product":"NVIDIA GeForce RTX 4090","memoryTotalBytes":25769803776,"memoryFreeBytes":25000000000,"fp16Tflops":165.0,"memoryBandwidthGbps":1008.0,"temperatureC":40.0,"health":"Healthy"}"#;

pub(crate) fn node(name: &str, gpus: usize) -> Node {
    node_of(name, gpus, H100)
}

/// A Ready node `name` whose agent publishes `gpus` devices like `device`.
pub(crate) fn node_of(name: &str, gpus: usize, device: &str) -> Node {
    let devices: Vec<String> = (0..gpus)
        .map(|i| {
            device
                .replace("ID", &format!("{name}-g{i}"))
                .replace("\"index\":I", &format!("\"index\":{i}"))
        })
        .collect();
    let state = format!(
        r#"{{"version":"v1","backend":"fake","devices":[{}],"links":[]}}"#,
        devices.join(",")
    );
    serde_json::from_value(json!({
        "metadata": {"name": name, "annotations": {"tessera.dev/gpu-state": state}},
        "status": {"conditions": [{"type": "Ready", "status": "True"}]},
    }))
    .unwrap()
}

/// A node of one GPU: the H100 with `edits` (text, replacement) made to its
/// JSON. The edits come first: the id's placeholder also occurs in the
/// product name.
pub(crate) fn one_gpu_node(name: &str, edits: &[(&str, &str)]) -> Node {
    let device = edits
        .iter()
        .fold(H100.to_string(), |device, (from, to)| {
            device.replace(from, to)
        })
        .replace("\"id\":\"ID\"", &format!("\"id\":\"{name}-g0\""))
        .replace("\"index\":I", "\"index\":0");
    let state = format!(r#"{{"version":"v1","backend":"fake","devices":[{device}],"links":[]}}"#);
    serde_json::from_value(json!({
        "metadata": {"name": name, "annotations": {"tessera.dev/gpu-state": state}},
        "status": {"conditions": [{"type": "Ready", "status": "True"}]},
    }))
    .unwrap()
}

/// `node` with the taint `dedicated=big:NoSchedule`.
pub(crate) fn dedicated(mut node: Node) -> Node {
    node.spec.get_or_insert_with(Default::default).taints =
        Some(vec![k8s_openapi::api::core::v1::Taint {
            key: "dedicated".into(),
            value: Some("big".into()),
            effect: "NoSchedule".into(),
            time_added: None,
        }]);
    node
}

/// `mi` with pods that tolerate [`dedicated`]'s taint.
pub(crate) fn tolerating_dedicated(mut mi: ModelInstance) -> ModelInstance {
    let template = mi.spec.template.as_mut().and_then(|t| t.spec.as_mut());
    template.expect("a pod spec").tolerations =
        Some(vec![k8s_openapi::api::core::v1::Toleration {
            key: Some("dedicated".into()),
            operator: Some("Equal".into()),
            value: Some("big".into()),
            effect: Some("NoSchedule".into()),
            toleration_seconds: None,
        }]);
    mi
}

/// `mi`'s pod for `shard`, bound where planned and Ready.
pub(crate) fn ready_pod(mi: &ModelInstance, shard: &PlannedShard) -> Pod {
    let mut pod = shard_pods(mi, std::slice::from_ref(shard), |_| {
        "tessera.dev/gpu".into()
    })
    .remove(0);
    pod.metadata.uid = Some(format!(
        "uid-{}",
        pod.metadata.name.as_deref().unwrap_or("")
    ));
    pod.spec.as_mut().unwrap().node_name = Some(shard.node.clone());
    pod.status = Some(running_status());
    pod
}

/// A running shard pod's status: Ready, and its serving gate True as the
/// controller holds it while the pod is wanted.
pub(crate) fn running_status() -> PodStatus {
    PodStatus {
        phase: Some("Running".into()),
        conditions: Some(
            ["Ready", "tessera.dev/serving"]
                .into_iter()
                .map(|type_| PodCondition {
                    type_: type_.into(),
                    status: "True".into(),
                    ..PodCondition::default()
                })
                .collect(),
        ),
        ..PodStatus::default()
    }
}

pub(crate) fn instance() -> ModelInstance {
    serde_json::from_value(json!({
        "apiVersion": "tessera.dev/v1alpha1",
        "kind": "ModelInstance",
        "metadata": {"name": "llama", "namespace": "ml", "uid": "uid-llama", "generation": 1},
        "spec": {
            "model": {"name": "llama", "parametersBillions": 7, "layers": 32, "kvCacheGiB": 2},
            "template": {"spec": {"containers": [{"name": "shard", "image": "busybox:1.37"}]}},
        },
    }))
    .unwrap()
}

pub(crate) fn filled<K>(objects: Vec<K>) -> (reflector::Store<K>, Writer<K>)
where
    K: kube::Resource<DynamicType = ()> + Clone + 'static,
{
    let (store, mut writer) = reflector::store();
    writer.apply_watcher_event(&watcher::Event::Init);
    for o in objects {
        writer.apply_watcher_event(&watcher::Event::InitApply(o));
    }
    writer.apply_watcher_event(&watcher::Event::InitDone);
    (store, writer)
}

pub(crate) struct World {
    pub(crate) nodes: Vec<Node>,
    pub(crate) pods: Vec<Pod>,
    pub(crate) services: Vec<Service>,
    pub(crate) instances: Vec<ModelInstance>,
}

pub(crate) fn context(world: World, client: kube::Client) -> Arc<Context> {
    context_with(world, client, None, Settings::default())
}

/// [`context`] with DRA's caches and the settings given.
pub(crate) fn context_with(
    world: World,
    client: kube::Client,
    dra: Option<DraCaches>,
    settings: Settings,
) -> Arc<Context> {
    let caches = Caches {
        nodes: filled(world.nodes.into_iter().map(CachedNode::from).collect()).0,
        pods: filled(world.pods).0,
        services: filled(world.services).0,
        instances: filled(world.instances).0,
        dra,
    };
    context_of(client, settings, caches)
}

/// A context over `caches` that have all listed, as after a controller's start.
pub(crate) fn context_of(client: kube::Client, settings: Settings, caches: Caches) -> Arc<Context> {
    let recorder = Recorder::new(
        client.clone(),
        Reporter {
            controller: "tessera-controller".into(),
            instance: None,
        },
    );
    let metrics = Metrics::default();
    metrics.mark_synced(true);
    Arc::new(Context::new(
        client,
        settings,
        caches,
        recorder,
        Arc::new(metrics),
    ))
}

pub(crate) fn respond(send: SendResponse<Response<Body>>, code: StatusCode, body: &Value) {
    send.send_response(
        Response::builder()
            .status(code)
            .header("content-type", "application/json")
            .body(Body::from(serde_json::to_vec(body).unwrap()))
            .unwrap(),
    );
}

pub(crate) fn status(code: u16, reason: &str) -> Value {
    json!({"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": code, "reason": reason, "message": reason})
}

/// One request: method, path with query, JSON body.
pub(crate) struct Call {
    pub(crate) method: Method,
    pub(crate) path: String,
    pub(crate) body: Value,
    pub(crate) send: SendResponse<Response<Body>>,
}

pub(crate) async fn next(api: &mut ApiHandle) -> Call {
    let (request, send) = tokio::time::timeout(Duration::from_secs(10), api.next_request())
        .await
        .expect("the controller made no further request")
        .expect("the client went away");
    into_call(request, send).await
}

pub(crate) async fn into_call(request: Request<Body>, send: SendResponse<Response<Body>>) -> Call {
    let method = request.method().clone();
    let path = request
        .uri()
        .path_and_query()
        .map(|p| p.to_string())
        .unwrap_or_default();
    let bytes = request.into_body().collect_bytes().await.unwrap();
    let body = if bytes.is_empty() {
        Value::Null
    } else {
        serde_json::from_slice(&bytes).unwrap()
    };
    Call {
        method,
        path,
        body,
        send,
    }
}

pub(crate) fn echo(call: Call, code: StatusCode) -> Value {
    let mut body = call.body.clone();
    if body["metadata"].is_object() && body["metadata"]["uid"].is_null() {
        body["metadata"]["uid"] = json!("uid-created");
    }
    respond(call.send, code, &body);
    call.body
}

/// Every request of one reconcile, answered as an API server would (created
/// objects echoed with a UID, deletes and patches accepted).
pub(crate) async fn serve_reconcile(
    api: &mut ApiHandle,
    run: tokio::task::JoinHandle<Result<Action, tessera::controller::reconcile::Error>>,
) -> Vec<(Method, String, Value)> {
    serve_reconcile_until(api, run).await.0
}

/// [`serve_reconcile`], with the reconcile's answer.
pub(crate) async fn serve_reconcile_until(
    api: &mut ApiHandle,
    run: tokio::task::JoinHandle<Result<Action, tessera::controller::reconcile::Error>>,
) -> (Vec<(Method, String, Value)>, Action) {
    serve_reconcile_answering(api, run, |_, _| None).await
}

/// [`serve_reconcile_until`], where `answer` gives the code and body of the
/// requests (method, path) it has its own answer for.
pub(crate) async fn serve_reconcile_answering(
    api: &mut ApiHandle,
    run: tokio::task::JoinHandle<Result<Action, tessera::controller::reconcile::Error>>,
    answer: impl Fn(&Method, &str) -> Option<(StatusCode, Value)>,
) -> (Vec<(Method, String, Value)>, Action) {
    let mut calls = Vec::new();
    tokio::pin!(run);
    loop {
        tokio::select! {
            biased;
            result = &mut run => {
                return (calls, result.unwrap().unwrap());
            }
            request = api.next_request() => {
                let Some((request, send)) = request else {
                    // The reconcile is done and its client gone.
                    continue;
                };
                let call = into_call(request, send).await;
                let (method, path, body) = (call.method.clone(), call.path.clone(), call.body.clone());
                if let Some((code, body)) = answer(&method, &path) {
                    respond(call.send, code, &body);
                } else if method == Method::DELETE {
                    respond(call.send, StatusCode::OK, &json!({"kind": "Status", "code": 200}));
                } else if path.contains("/binding") || path.contains("/eviction") {
                    respond(call.send, StatusCode::CREATED, &json!({"kind": "Status", "code": 201}));
                } else if path.contains("/pods/") && path.contains("/status?") {
                    let name = path.split("/pods/").nth(1).and_then(|p| p.split('/').next()).unwrap_or("");
                    let echoed = json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "status": body["status"]});
                    respond(call.send, StatusCode::OK, &echoed);
                } else if path.contains("/status?") {
                    let mut echoed = serde_json::to_value(instance()).unwrap();
                    echoed["status"] = body["status"].clone();
                    respond(call.send, StatusCode::OK, &echoed);
                } else {
                    let mut created = body.clone();
                    if created["metadata"].is_object() {
                        let uid = format!("uid-{}", created["metadata"]["name"].as_str().unwrap_or(""));
                        created["metadata"]["uid"] = json!(uid);
                    }
                    respond(call.send, StatusCode::CREATED, &created);
                }
                calls.push((method, path, body));
            }
        }
    }
}

pub(crate) fn written_status(calls: &[(Method, String, Value)]) -> ModelInstanceStatus {
    let (_, _, body) = calls
        .iter()
        .rev()
        .find(|(_, path, _)| path.contains("/modelinstances/") && path.contains("/status?"))
        .expect("a status write");
    serde_json::from_value(body["status"].clone()).unwrap()
}

pub(crate) fn created_pods(calls: &[(Method, String, Value)]) -> Vec<Value> {
    calls
        .iter()
        .filter(|(method, path, _)| {
            *method == Method::POST && path == "/api/v1/namespaces/ml/pods?"
        })
        .map(|(_, _, body)| body.clone())
        .collect()
}

/// The status of `mi` running on `plan`.
pub(crate) fn running(
    mi: &ModelInstance,
    plan: Vec<tessera::api::PlannedShard>,
) -> ModelInstanceStatus {
    ModelInstanceStatus {
        phase: Some(Phase::Running),
        plan,
        placement_hash: Some(tessera::controller::hashes::placement_hash(&mi.spec)),
        ..Default::default()
    }
}

/// The plan the controller's decision gives `mi` on empty `nodes`.
pub(crate) fn plan_on(mi: &ModelInstance, nodes: &[Node]) -> tessera::controller::decide::NewPlan {
    let infos: Vec<Arc<NodeInfo>> = nodes
        .iter()
        .map(|n| Arc::new(NodeInfo::from_node(n).unwrap().unwrap()))
        .collect();
    let held = Held::new();
    let inputs = PlanInputs::new(
        &infos,
        &held,
        k8s_openapi::jiff::Timestamp::now(),
        &Settings::default(),
    );
    let PlanDecision::Planned(new) = decide(&mi.spec, &[], &Current::NONE, &inputs) else {
        panic!("no plan")
    };
    new
}

pub(crate) fn deleted(calls: &[(Method, String, Value)]) -> Vec<String> {
    calls
        .iter()
        .filter(|(method, _, _)| *method == Method::DELETE)
        .map(|(_, path, _)| path.clone())
        .collect()
}

/// Events written, as (reason, type, note).
pub(crate) fn events_of(calls: &[(Method, String, Value)]) -> Vec<(String, String, String)> {
    calls
        .iter()
        .filter(|(_, path, _)| path.contains("/events"))
        .map(|(_, _, body)| {
            let text = |key: &str| body[key].as_str().unwrap_or_default().to_string();
            (text("reason"), text("type"), text("note"))
        })
        .collect()
}
