//! The controller's reconcile against a mocked API server: the exact writes
//! for a new instance (Service, shard pod, binding, status, events), retries
//! of conflicts and server errors, and no writes at all for a settled one.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use http::{Method, Request, Response, StatusCode};
use k8s_openapi::api::core::v1::{Node, Pod, PodStatus, Service};
use k8s_openapi::api::resource::v1::ResourceClaim;
use kube::client::Body;
use kube::runtime::controller::Action;
use kube::runtime::watcher;
use serde_json::{Value, json};
use tessera::api::{ModelInstance, ModelInstanceStatus, Phase};
use tessera::controller::desired::{ShardGpus, headless_service, shard_pods, shard_pods_with};
use tessera::controller::dra::{CachedSlice, DraCaches};
use tessera::controller::node_cache::CachedNode;
use tessera::controller::reconcile::{Caches, Context, Settings, reconcile};
use tower_test::mock::{self, SendResponse};

#[path = "common/mock_api.rs"]
mod mock_api;
use mock_api::*;

/// [`instance`] as two pipeline stages of one GPU each.
fn two_stages() -> ModelInstance {
    let mut spec = serde_json::to_value(instance()).unwrap();
    spec["spec"]["parallelism"] = json!({"tensor": 1, "pipeline": 2});
    serde_json::from_value(spec).unwrap()
}

/// Node `a` with two GPUs and `mi`, nothing else yet.
fn fresh_world(mi: &ModelInstance) -> World {
    World {
        nodes: vec![node("a", 2)],
        pods: vec![],
        services: vec![],
        instances: vec![mi.clone()],
    }
}

#[tokio::test]
async fn a_new_instance_gets_service_pod_binding_status_and_events() {
    let (service, mut api) = mock::pair::<Request<Body>, Response<Body>>();
    let client = kube::Client::new(service, "default");
    let mi = instance();
    let ctx = context(fresh_world(&mi), client);
    let run = tokio::spawn(reconcile(Arc::new(mi), ctx));

    let c = next(&mut api).await;
    assert_eq!(
        (&c.method, c.path.as_str()),
        (&Method::POST, "/api/v1/namespaces/ml/services?")
    );
    let svc = echo(c, StatusCode::CREATED);
    assert_eq!(svc["spec"]["clusterIP"], "None");
    assert_eq!(svc["metadata"]["ownerReferences"][0]["uid"], "uid-llama");

    // The first attempt to create the pod meets a server error; it is retried.
    let c = next(&mut api).await;
    assert_eq!(
        (&c.method, c.path.as_str()),
        (&Method::POST, "/api/v1/namespaces/ml/pods?")
    );
    respond(
        c.send,
        StatusCode::INTERNAL_SERVER_ERROR,
        &status(500, "InternalError"),
    );
    let c = next(&mut api).await;
    assert_eq!(
        (&c.method, c.path.as_str()),
        (&Method::POST, "/api/v1/namespaces/ml/pods?")
    );
    let pod = echo(c, StatusCode::CREATED);
    assert_eq!(pod["metadata"]["name"], "llama-shard-0");
    assert_eq!(pod["spec"]["schedulerName"], "tessera");
    let devices = pod["metadata"]["annotations"]["tessera.dev/devices"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(devices.starts_with("a-g"), "{devices}");
    assert_eq!(
        pod["spec"]["containers"][0]["resources"]["limits"]["tessera.dev/gpu"],
        "1"
    );

    let c = next(&mut api).await;
    assert_eq!(
        (&c.method, c.path.as_str()),
        (
            &Method::POST,
            "/api/v1/namespaces/ml/pods/llama-shard-0/binding?"
        )
    );
    assert_eq!(
        c.body["target"],
        json!({"apiVersion": "v1", "kind": "Node", "name": "a"})
    );
    assert_eq!(c.body["metadata"]["name"], "llama-shard-0");
    respond(
        c.send,
        StatusCode::CREATED,
        &json!({"kind": "Status", "apiVersion": "v1", "status": "Success", "code": 201}),
    );

    // A conflict on the status write is retried too.
    let c = next(&mut api).await;
    assert_eq!(c.method, Method::PATCH);
    assert!(
        c.path
            .starts_with("/apis/tessera.dev/v1alpha1/namespaces/ml/modelinstances/llama/status?"),
        "{}",
        c.path
    );
    assert!(
        c.path.contains("fieldManager=tessera-controller") && c.path.contains("force=true"),
        "{}",
        c.path
    );
    respond(c.send, StatusCode::CONFLICT, &status(409, "Conflict"));
    let c = next(&mut api).await;
    assert_eq!(c.method, Method::PATCH);
    let written: ModelInstanceStatus = serde_json::from_value(c.body["status"].clone()).unwrap();
    assert_eq!(c.body["kind"], "ModelInstance");
    let mut echoed = serde_json::to_value(instance()).unwrap();
    echoed["status"] = c.body["status"].clone();
    respond(c.send, StatusCode::OK, &echoed);
    assert_eq!(written.phase, Some(Phase::Bound));
    assert_eq!(written.plan.len(), 1);
    assert_eq!(written.plan[0].node, "a");
    assert_eq!(written.plan[0].devices.join(","), devices);
    assert_eq!(written.observed_generation, Some(1));
    let placed = written
        .conditions
        .iter()
        .find(|c| c.type_ == "Placed")
        .unwrap();
    assert_eq!(
        (placed.status.as_str(), placed.reason.as_str()),
        ("True", "Planned")
    );

    let mut reasons = Vec::new();
    for _ in 0..2 {
        let c = next(&mut api).await;
        assert_eq!(c.method, Method::POST);
        assert!(
            c.path
                .starts_with("/apis/events.k8s.io/v1/namespaces/ml/events"),
            "{}",
            c.path
        );
        assert_eq!(c.body["regarding"]["name"], "llama");
        reasons.push(c.body["reason"].as_str().unwrap().to_string());
        echo(c, StatusCode::CREATED);
    }
    assert_eq!(reasons, ["Planned", "Bound"]);
    run.await.unwrap().unwrap();
}

#[tokio::test]
async fn a_bind_is_told_in_events_even_when_the_status_write_after_it_fails() {
    let (service, mut api) = mock::pair::<Request<Body>, Response<Body>>();
    let mi = instance();
    let world = alone(&mi, vec![node("a", 2)], vec![]);
    let ctx = context(world, kube::Client::new(service, "default"));
    let run = tokio::spawn(reconcile(Arc::new(mi), ctx));
    for path in [
        "/api/v1/namespaces/ml/pods?",
        "/api/v1/namespaces/ml/pods/llama-shard-0/binding?",
    ] {
        let c = next(&mut api).await;
        assert_eq!((&c.method, c.path.as_str()), (&Method::POST, path));
        echo(c, StatusCode::CREATED);
    }
    // The API server refuses the status (an API server before 1.24.10 can
    // fail a CEL rule so under concurrent writes); the pod is bound anyway.
    let c = next(&mut api).await;
    assert!(
        c.path.contains("/modelinstances/llama/status?"),
        "{}",
        c.path
    );
    respond(
        c.send,
        StatusCode::UNPROCESSABLE_ENTITY,
        &status(422, "Invalid"),
    );
    let mut reasons = Vec::new();
    for _ in 0..2 {
        let c = next(&mut api).await;
        assert!(
            c.path
                .starts_with("/apis/events.k8s.io/v1/namespaces/ml/events"),
            "{}",
            c.path
        );
        reasons.push(c.body["reason"].as_str().unwrap().to_string());
        echo(c, StatusCode::CREATED);
    }
    assert_eq!(reasons, ["Planned", "Bound"]);
    assert!(
        run.await.unwrap().is_err(),
        "the failed status write fails the reconcile (it is tried again)"
    );
}

#[tokio::test]
async fn a_settled_instance_makes_no_writes() {
    let (service, mut api) = mock::pair::<Request<Body>, Response<Body>>();
    let client = kube::Client::new(service, "default");
    // The plan the controller makes, and the pod it builds from it, running.
    let (mut mi, nodes, mut pod) = settled();
    mi.status = None;
    pod.status = Some(running_status());
    let svc = headless_service(&mi);

    // First pass: only the status is missing.
    let world = || World {
        nodes: nodes.clone(),
        pods: vec![pod.clone()],
        services: vec![svc.clone()],
        instances: vec![],
    };
    let run = tokio::spawn(reconcile(
        Arc::new(mi.clone()),
        context(world(), client.clone()),
    ));
    let c = next(&mut api).await;
    assert_eq!(c.method, Method::PATCH);
    let written: ModelInstanceStatus = serde_json::from_value(c.body["status"].clone()).unwrap();
    respond(c.send, StatusCode::OK, &serde_json::to_value(&mi).unwrap());
    let c = next(&mut api).await;
    assert_eq!(c.body["reason"], "Planned");
    echo(c, StatusCode::CREATED);
    run.await.unwrap().unwrap();
    assert_eq!(written.phase, Some(Phase::Running));
    assert_eq!(written.ready_shards, 1);

    // Second pass over the written status: nothing to do.
    mi.status = Some(written);
    let ctx = context(world(), client);
    tokio::select! {
        result = reconcile(Arc::new(mi), ctx) => { result.unwrap(); }
        call = api.next_request() => panic!("a settled instance must not write: {:?}", call.map(|(r, _)| r.uri().clone())),
    }
}

#[tokio::test]
async fn an_invalid_instance_gets_a_condition_and_no_pods() {
    let (service, mut api) = mock::pair::<Request<Body>, Response<Body>>();
    let client = kube::Client::new(service, "default");
    let mut mi = instance();
    mi.spec.template = None;
    let ctx = context(
        World {
            nodes: vec![node("a", 2)],
            pods: vec![],
            services: vec![],
            instances: vec![],
        },
        client,
    );
    let run = tokio::spawn(reconcile(Arc::new(mi), ctx));
    let c = next(&mut api).await;
    assert_eq!(c.method, Method::PATCH, "{}", c.path);
    let written: ModelInstanceStatus = serde_json::from_value(c.body["status"].clone()).unwrap();
    respond(
        c.send,
        StatusCode::OK,
        &serde_json::to_value(instance()).unwrap(),
    );
    assert_eq!(written.phase, Some(Phase::Failed));
    let placed = written
        .conditions
        .iter()
        .find(|c| c.type_ == "Placed")
        .unwrap();
    assert_eq!(placed.reason, "InvalidSpec");
    assert!(
        placed.message.contains("pod template"),
        "{}",
        placed.message
    );
    let c = next(&mut api).await;
    assert_eq!(c.body["reason"], "InvalidSpec");
    assert_eq!(c.body["type"], "Warning");
    echo(c, StatusCode::CREATED);
    run.await.unwrap().unwrap();
}

/// A running, settled instance with one shard pod, for edits by hand.
fn settled() -> (ModelInstance, Vec<Node>, Pod) {
    let mi = instance();
    let nodes = vec![node("a", 2)];
    let new = plan_on(&mi, &nodes);
    let mut pod = shard_pods(&mi, &new.plan, |_| "tessera.dev/gpu".into()).remove(0);
    pod.metadata.uid = Some("uid-pod".into());
    pod.spec.as_mut().unwrap().node_name = Some("a".into());
    let mut mi = mi;
    mi.status = Some(running(&mi, new.plan));
    (mi, nodes, pod)
}

#[tokio::test]
async fn a_hand_edited_device_annotation_is_put_back() {
    let (service, mut api) = mock::pair::<Request<Body>, Response<Body>>();
    let client = kube::Client::new(service, "default");
    let (mi, nodes, mut pod) = settled();
    let planned = pod.metadata.annotations.as_ref().unwrap()["tessera.dev/devices"].clone();
    pod.metadata
        .annotations
        .as_mut()
        .unwrap()
        .insert("tessera.dev/devices".into(), "a-g0,a-g1".into());
    let ctx = context(
        World {
            nodes,
            pods: vec![pod],
            services: vec![headless_service(&mi)],
            instances: vec![],
        },
        client,
    );
    let run = tokio::spawn(reconcile(Arc::new(mi), ctx));
    let c = next(&mut api).await;
    assert_eq!(
        (&c.method, c.path.as_str()),
        (&Method::PATCH, "/api/v1/namespaces/ml/pods/llama-shard-0?")
    );
    assert_eq!(
        c.body,
        json!({"metadata": {"annotations": {"tessera.dev/devices": planned}}})
    );
    echo(c, StatusCode::OK);
    // Its serving gate opened: the pod is wanted.
    let c = next(&mut api).await;
    assert_eq!(
        (&c.method, c.path.as_str()),
        (
            &Method::PATCH,
            "/api/v1/namespaces/ml/pods/llama-shard-0/status?"
        )
    );
    assert_eq!(
        (
            &c.body["status"]["conditions"][0]["type"],
            &c.body["status"]["conditions"][0]["status"]
        ),
        (&json!("tessera.dev/serving"), &json!("True"))
    );
    respond(
        c.send,
        StatusCode::OK,
        &json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "llama-shard-0"}}),
    );
    // Then the status (the shard is bound but not ready), and nothing else.
    let c = next(&mut api).await;
    assert_eq!(c.method, Method::PATCH);
    assert!(c.path.contains("/status?"));
    respond(
        c.send,
        StatusCode::OK,
        &serde_json::to_value(instance()).unwrap(),
    );
    run.await.unwrap().unwrap();
}

#[tokio::test]
async fn an_evicted_shard_is_deleted_and_recreated_on_its_plan() {
    let (service, mut api) = mock::pair::<Request<Body>, Response<Body>>();
    let client = kube::Client::new(service, "default");
    let (mi, nodes, mut pod) = settled();
    pod.status = Some(PodStatus {
        phase: Some("Failed".into()),
        reason: Some("Evicted".into()),
        message: Some("The node was low on resource: memory.".into()),
        ..Default::default()
    });
    let svc = headless_service(&mi);
    let world = |pods: Vec<Pod>| World {
        nodes: nodes.clone(),
        pods,
        services: vec![svc.clone()],
        instances: vec![],
    };
    let run = tokio::spawn(reconcile(
        Arc::new(mi.clone()),
        context(world(vec![pod]), client.clone()),
    ));
    let c = next(&mut api).await;
    assert_eq!(
        (&c.method, c.path.as_str()),
        (&Method::DELETE, "/api/v1/namespaces/ml/pods/llama-shard-0?")
    );
    assert_eq!(
        c.body["preconditions"]["uid"], "uid-pod",
        "only the pod that was seen is deleted"
    );
    respond(
        c.send,
        StatusCode::OK,
        &json!({"kind": "Status", "apiVersion": "v1", "status": "Success"}),
    );
    let c = next(&mut api).await;
    let written: ModelInstanceStatus = serde_json::from_value(c.body["status"].clone()).unwrap();
    respond(
        c.send,
        StatusCode::OK,
        &serde_json::to_value(instance()).unwrap(),
    );
    assert_eq!(written.phase, Some(Phase::Degraded));
    let c = next(&mut api).await;
    assert_eq!(
        (c.body["reason"].as_str(), c.body["type"].as_str()),
        (Some("ShardLost"), Some("Warning"))
    );
    assert!(c.body["note"].as_str().unwrap().contains("Evicted"));
    echo(c, StatusCode::CREATED);
    run.await.unwrap().unwrap();

    // Once the pod is gone from the cache, it is created again and bound to the same node.
    let mut mi = mi;
    mi.status = Some(written);
    let run = tokio::spawn(reconcile(Arc::new(mi), context(world(vec![]), client)));
    let c = next(&mut api).await;
    assert_eq!(
        (&c.method, c.path.as_str()),
        (&Method::POST, "/api/v1/namespaces/ml/pods?")
    );
    echo(c, StatusCode::CREATED);
    let c = next(&mut api).await;
    assert_eq!(c.body["target"]["name"], "a");
    respond(
        c.send,
        StatusCode::CREATED,
        &json!({"kind": "Status", "apiVersion": "v1", "status": "Success", "code": 201}),
    );
    let c = next(&mut api).await;
    assert!(c.path.contains("/status?"));
    respond(
        c.send,
        StatusCode::OK,
        &serde_json::to_value(instance()).unwrap(),
    );
    let c = next(&mut api).await;
    assert_eq!(c.body["reason"], "Bound");
    echo(c, StatusCode::CREATED);
    run.await.unwrap().unwrap();
}

/// A node NotReady past the grace period has no kubelet to confirm a
/// deletion: its shard pod, once being deleted, is deleted again with a
/// grace period of 0 so that its re-placed shard can be created.
#[tokio::test]
async fn a_pod_stranded_on_a_lost_node_is_deleted_at_once() {
    let (service, mut api) = mock::pair::<Request<Body>, Response<Body>>();
    let client = kube::Client::new(service, "default");
    let (mi, mut nodes, mut pod) = settled();
    let mut lost = serde_json::to_value(&nodes[0]).unwrap();
    lost["status"]["conditions"] = json!([{"type": "Ready", "status": "False",
        "lastTransitionTime": "2020-01-01T00:00:00Z"}]);
    nodes[0] = serde_json::from_value(lost).unwrap();
    nodes.push(node("b", 2));
    pod.metadata.deletion_timestamp = Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
        k8s_openapi::jiff::Timestamp::from_second(1_800_000_000).unwrap(),
    ));
    pod.status = Some(running_status());
    let world = World {
        nodes: nodes.clone(),
        pods: vec![pod.clone()],
        services: vec![headless_service(&mi)],
        instances: vec![],
    };
    let calls = serve_reconcile(
        &mut api,
        tokio::spawn(reconcile(
            Arc::new(mi.clone()),
            context(world, client.clone()),
        )),
    )
    .await;
    let forced: Vec<&Value> = calls
        .iter()
        .filter(|(method, path, _)| {
            *method == Method::DELETE
                && path.starts_with("/api/v1/namespaces/ml/pods/llama-shard-0")
        })
        .map(|(_, _, body)| body)
        .collect();
    assert_eq!(forced.len(), 1, "{calls:?}");
    assert_eq!(forced[0]["gracePeriodSeconds"], 0);
    assert_eq!(forced[0]["preconditions"]["uid"], "uid-pod");
    let told = calls
        .iter()
        .any(|(_, path, body)| path.contains("/events") && body["reason"] == "PodReleased");
    assert!(told, "an Event says why");

    // On a node that is merely NotReady (within the grace period), or one
    // that is fine, a pod being deleted is left to its kubelet.
    let mut recent = serde_json::to_value(&nodes[0]).unwrap();
    recent["status"]["conditions"][0]["lastTransitionTime"] =
        json!(k8s_openapi::jiff::Timestamp::now().to_string());
    nodes[0] = serde_json::from_value(recent).unwrap();
    let world = World {
        nodes,
        pods: vec![pod],
        services: vec![headless_service(&mi)],
        instances: vec![],
    };
    let calls = serve_reconcile(
        &mut api,
        tokio::spawn(reconcile(Arc::new(mi), context(world, client))),
    )
    .await;
    assert!(
        calls.iter().all(|(method, _, _)| *method != Method::DELETE),
        "{calls:?}"
    );
}

#[tokio::test]
async fn a_shard_that_failed_admission_moves_to_other_devices() {
    let (service, mut api) = mock::pair::<Request<Body>, Response<Body>>();
    let client = kube::Client::new(service, "default");
    let (mi, nodes, mut pod) = settled();
    let before = mi.status.as_ref().unwrap().plan[0].devices.clone();
    pod.status = Some(PodStatus {
        phase: Some("Failed".into()),
        reason: Some("UnexpectedAdmissionError".into()),
        message: Some("Allocate failed due to planned devices differ".into()),
        ..Default::default()
    });
    let ctx = context(
        World {
            nodes,
            pods: vec![pod],
            services: vec![headless_service(&mi)],
            instances: vec![],
        },
        client,
    );
    let run = tokio::spawn(reconcile(Arc::new(mi), ctx));
    let c = next(&mut api).await;
    assert_eq!(c.method, Method::DELETE, "{}", c.path);
    respond(
        c.send,
        StatusCode::OK,
        &json!({"kind": "Status", "apiVersion": "v1", "status": "Success"}),
    );
    let c = next(&mut api).await;
    let written: ModelInstanceStatus = serde_json::from_value(c.body["status"].clone()).unwrap();
    respond(
        c.send,
        StatusCode::OK,
        &serde_json::to_value(instance()).unwrap(),
    );
    assert_ne!(
        written.plan[0].devices, before,
        "the shard must leave the devices it failed on"
    );
    let mut reasons = Vec::new();
    for _ in 0..2 {
        let c = next(&mut api).await;
        reasons.push(c.body["reason"].as_str().unwrap().to_string());
        echo(c, StatusCode::CREATED);
    }
    assert_eq!(reasons, ["Replanned", "ShardLost"]);
    run.await.unwrap().unwrap();
}

/// Kubelet does not say which pod it admits, so the controller never leaves
/// two same-sized pods bound to one node and waiting for their devices: the
/// second shard is bound only once the node's agent reports the first one's
/// devices allocated.
#[tokio::test]
async fn a_second_same_sized_shard_is_bound_once_the_first_has_its_devices() {
    let (service, mut api) = mock::pair::<Request<Body>, Response<Body>>();
    let client = kube::Client::new(service, "default");
    let mi = two_stages();
    let (nodes, mut node_writer) = filled(vec![CachedNode::from(node("a", 2))]);
    let (pods, mut pod_writer) = filled(Vec::<Pod>::new());
    let (services, mut service_writer) = filled(Vec::<Service>::new());
    let caches = Caches {
        nodes,
        pods,
        services,
        instances: filled(vec![mi.clone()]).0,
        dra: None,
    };
    let ctx = context_of(client, Settings::default(), caches);

    // First pass: Service, both pods, one binding, status, events.
    let run = tokio::spawn(reconcile(Arc::new(mi.clone()), Arc::clone(&ctx)));
    let service = echo(next(&mut api).await, StatusCode::CREATED);
    let mut created = Vec::new();
    for shard in 0..2 {
        let c = next(&mut api).await;
        assert_eq!(
            (&c.method, c.path.as_str()),
            (&Method::POST, "/api/v1/namespaces/ml/pods?")
        );
        let mut pod = c.body.clone();
        pod["metadata"]["uid"] = json!(format!("uid-shard-{shard}"));
        respond(c.send, StatusCode::CREATED, &pod);
        created.push(pod);
    }
    let c = next(&mut api).await;
    assert_eq!(
        c.path, "/api/v1/namespaces/ml/pods/llama-shard-0/binding?",
        "shard 0 is bound first"
    );
    respond(
        c.send,
        StatusCode::CREATED,
        &json!({"kind": "Status", "code": 201}),
    );
    let c = next(&mut api).await;
    assert!(
        c.path.contains("/modelinstances/llama/status?"),
        "shard 1 waits for shard 0's devices, yet: {} {}",
        c.method,
        c.path
    );
    let status = c.body["status"].clone();
    respond(c.send, StatusCode::OK, &serde_json::to_value(&mi).unwrap());
    for _ in 0..2 {
        echo(next(&mut api).await, StatusCode::CREATED);
    }
    let action = run.await.unwrap().unwrap();
    assert_eq!(action, Action::requeue(Duration::from_secs(1)));

    // The agent reports shard 0's devices allocated: shard 1 is bound.
    let mut bound = created[0].clone();
    bound["spec"]["nodeName"] = json!("a");
    let devices = bound["metadata"]["annotations"]["tessera.dev/devices"]
        .as_str()
        .unwrap()
        .to_string();
    service_writer.apply_watcher_event(&watcher::Event::Apply(
        serde_json::from_value(service).unwrap(),
    ));
    for pod in [&bound, &created[1]] {
        // Their serving gates were opened after they were created.
        let mut pod = pod.clone();
        pod["status"]["conditions"] = json!([{"type": "tessera.dev/serving", "status": "True"}]);
        pod_writer
            .apply_watcher_event(&watcher::Event::Apply(serde_json::from_value(pod).unwrap()));
    }
    let mut a = serde_json::to_value(node("a", 2)).unwrap();
    let mut state: Value = serde_json::from_str(
        a["metadata"]["annotations"]["tessera.dev/gpu-state"]
            .as_str()
            .unwrap(),
    )
    .unwrap();
    state["allocated"] = json!({ devices: "uid-shard-0" });
    a["metadata"]["annotations"]["tessera.dev/gpu-state"] = json!(state.to_string());
    let a: Node = serde_json::from_value(a).unwrap();
    node_writer.apply_watcher_event(&watcher::Event::Apply(a.into()));
    let mut mi = serde_json::to_value(&mi).unwrap();
    mi["status"] = status;
    let mi: ModelInstance = serde_json::from_value(mi).unwrap();
    let run = tokio::spawn(reconcile(Arc::new(mi), ctx));
    let c = next(&mut api).await;
    assert_eq!(
        (&c.method, c.path.as_str()),
        (
            &Method::POST,
            "/api/v1/namespaces/ml/pods/llama-shard-1/binding?"
        )
    );
    respond(
        c.send,
        StatusCode::CREATED,
        &json!({"kind": "Status", "code": 201}),
    );
    let c = next(&mut api).await;
    assert!(c.path.contains("/status?"), "{}", c.path);
    respond(
        c.send,
        StatusCode::OK,
        &serde_json::to_value(instance()).unwrap(),
    );
    echo(next(&mut api).await, StatusCode::CREATED);
    run.await.unwrap().unwrap();
}

fn with_replicas(replicas: u32) -> ModelInstance {
    let mut mi = serde_json::to_value(instance()).unwrap();
    mi["spec"]["replicas"] = json!(replicas);
    serde_json::from_value(mi).unwrap()
}

#[tokio::test]
async fn replicas_get_their_own_pods_on_distinct_devices_and_the_rest_waits_with_a_reason() {
    let (service, mut api) = mock::pair::<Request<Body>, Response<Body>>();
    let client = kube::Client::new(service, "default");
    // Four GPUs, six replicas of a one-GPU model: four placed, two not.
    let mi = with_replicas(6);
    let ctx = context(
        World {
            nodes: vec![node("a", 4)],
            pods: vec![],
            services: vec![],
            instances: vec![mi.clone()],
        },
        client,
    );
    let calls = serve_reconcile(&mut api, tokio::spawn(reconcile(Arc::new(mi), ctx))).await;

    let pods = created_pods(&calls);
    let names: Vec<&str> = pods
        .iter()
        .map(|p| p["metadata"]["name"].as_str().unwrap())
        .collect();
    assert_eq!(
        names,
        [
            "llama-shard-0",
            "llama-r1-shard-0",
            "llama-r2-shard-0",
            "llama-r3-shard-0"
        ]
    );
    let devices: std::collections::BTreeSet<&str> = pods
        .iter()
        .map(|p| {
            p["metadata"]["annotations"]["tessera.dev/devices"]
                .as_str()
                .unwrap()
        })
        .collect();
    assert_eq!(
        devices.len(),
        4,
        "replicas never share a device: {devices:?}"
    );
    let first = &pods[0];
    assert!(
        first["metadata"]["labels"]
            .get("tessera.dev/replica")
            .is_none()
    );
    let second = &pods[1];
    assert_eq!(second["metadata"]["labels"]["tessera.dev/replica"], "1");
    assert_eq!(second["spec"]["hostname"], "llama-r1-shard-0");
    let env = second["spec"]["containers"][0]["env"].as_array().unwrap();
    let var = |name: &str| {
        env.iter()
            .find(|e| e["name"] == name)
            .map(|e| e["value"].as_str().unwrap().to_string())
    };
    assert_eq!(var("TESSERA_REPLICA").as_deref(), Some("1"));
    assert_eq!(
        var("TESSERA_PEERS").as_deref(),
        Some("llama-r1-shard-0.llama.ml.svc"),
        "a replica's peers are its own shards"
    );

    let status = written_status(&calls);
    assert_eq!(status.plan.len(), 4);
    assert_eq!(
        status.plan.iter().map(|s| s.replica).collect::<Vec<_>>(),
        [0, 1, 2, 3]
    );
    assert_eq!(
        status.selector.as_deref(),
        Some("tessera.dev/instance=llama")
    );
    let placed = status
        .conditions
        .iter()
        .find(|c| c.type_ == "Placed")
        .unwrap();
    assert_eq!(placed.status, "False");
    assert!(
        placed
            .message
            .starts_with("4 of 6 replicas placed; replica 4: no placement"),
        "{}",
        placed.message
    );
    // Same-sized shards on one node are bound one at a time.
    let bindings = calls
        .iter()
        .filter(|(_, path, _)| path.contains("/binding"))
        .count();
    assert_eq!(bindings, 1);
    assert_eq!(status.replicas, 1, "one replica has every shard bound");
}

#[tokio::test]
async fn scaling_down_removes_the_newest_replicas_and_keeps_the_rest() {
    let (service, mut api) = mock::pair::<Request<Body>, Response<Body>>();
    let client = kube::Client::new(service, "default");
    let nodes = vec![node("a", 4)];
    // Three replicas planned and running.
    let three = with_replicas(3);
    let ctx = context(
        World {
            nodes: nodes.clone(),
            pods: vec![],
            services: vec![],
            instances: vec![three.clone()],
        },
        client.clone(),
    );
    let calls = serve_reconcile(
        &mut api,
        tokio::spawn(reconcile(Arc::new(three.clone()), ctx)),
    )
    .await;
    let status = written_status(&calls);
    let running: Vec<Pod> = created_pods(&calls)
        .into_iter()
        .enumerate()
        .map(|(index, mut pod)| {
            pod["metadata"]["uid"] = json!(format!("uid-pod-{index}"));
            pod["metadata"]["ownerReferences"][0]["uid"] = json!("uid-llama");
            pod["spec"]["nodeName"] = json!("a");
            pod["status"] = serde_json::to_value(running_status()).unwrap();
            serde_json::from_value(pod).unwrap()
        })
        .collect();
    assert_eq!(running.len(), 3);

    // Scaled to one: replicas 2 and 1 leave their Services first (their
    // serving gates closed, the time noted), replica 0 stays as it is.
    let mut one = with_replicas(1);
    one.status = Some(status);
    let world = |pods: Vec<Pod>| World {
        nodes: nodes.clone(),
        pods,
        services: vec![headless_service(&one)],
        instances: vec![one.clone()],
    };
    let ctx = context(world(running.clone()), client.clone());
    let calls = serve_reconcile(
        &mut api,
        tokio::spawn(reconcile(Arc::new(one.clone()), ctx)),
    )
    .await;
    assert!(
        calls.iter().all(|(method, _, _)| *method != Method::DELETE),
        "{calls:?}"
    );
    let mut closed: Vec<&str> = calls
        .iter()
        .filter(|(_, path, body)| {
            path.contains("/status?") && body["status"]["conditions"][0]["status"] == "False"
        })
        .map(|(_, path, _)| path.as_str())
        .collect();
    closed.sort();
    assert_eq!(
        closed,
        [
            "/api/v1/namespaces/ml/pods/llama-r1-shard-0/status?",
            "/api/v1/namespaces/ml/pods/llama-r2-shard-0/status?"
        ]
    );
    // Out of their Services for longer than the endpoints take to follow,
    // with no runtime measured: their pods go.
    let since = (k8s_openapi::jiff::Timestamp::now()
        - k8s_openapi::jiff::SignedDuration::from_secs(10))
    .to_string();
    let draining: Vec<Pod> = running
        .iter()
        .cloned()
        .map(|mut pod| {
            // Replica 0's pods carry no replica label.
            if pod
                .metadata
                .labels
                .as_ref()
                .unwrap()
                .contains_key("tessera.dev/replica")
            {
                pod.metadata
                    .annotations
                    .get_or_insert_with(Default::default)
                    .insert("tessera.dev/draining-since".into(), since.clone());
            }
            pod
        })
        .collect();
    let ctx = context(world(draining), client);
    let calls = serve_reconcile(&mut api, tokio::spawn(reconcile(Arc::new(one), ctx))).await;
    let mut deleted: Vec<&str> = calls
        .iter()
        .filter(|(method, _, _)| *method == Method::DELETE)
        .map(|(_, path, _)| path.as_str())
        .collect();
    deleted.sort();
    assert_eq!(deleted.len(), 2, "{deleted:?}");
    assert!(deleted[0].starts_with("/api/v1/namespaces/ml/pods/llama-r1-shard-0"));
    assert!(deleted[1].starts_with("/api/v1/namespaces/ml/pods/llama-r2-shard-0"));
    assert!(
        created_pods(&calls).is_empty(),
        "replica 0 is not recreated"
    );
    let status = written_status(&calls);
    assert_eq!(status.plan.len(), 1);
    assert_eq!(status.plan[0].replica, 0);
    assert_eq!((status.replicas, status.ready_replicas), (1, 1));
    assert_eq!(status.phase, Some(Phase::Running));
}

/// The pods a reconcile created, running on the node of their devices
/// (`<node>-g<i>`), with those of `earlier` before them.
fn started(earlier: &[Pod], calls: &[(Method, String, Value)]) -> Vec<Pod> {
    let new = created_pods(calls).into_iter().map(|mut pod| {
        let name = pod["metadata"]["name"].as_str().unwrap().to_string();
        let devices = pod["metadata"]["annotations"]["tessera.dev/devices"]
            .as_str()
            .unwrap()
            .to_string();
        let node = devices.split("-g").next().unwrap().to_string();
        pod["metadata"]["uid"] = json!(format!("uid-{name}"));
        pod["metadata"]["ownerReferences"][0]["uid"] = json!("uid-llama");
        pod["spec"]["nodeName"] = json!(node);
        pod["status"] = serde_json::to_value(running_status()).unwrap();
        serde_json::from_value::<Pod>(pod).unwrap()
    });
    earlier.iter().cloned().chain(new).collect()
}

#[tokio::test]
async fn scaling_down_removes_the_costliest_replica_per_request_whatever_its_number() {
    let (service, mut api) = mock::pair::<Request<Body>, Response<Body>>();
    let client = kube::Client::new(service, "default");
    let slow = node_of("slow", 1, RTX4090);
    let fast = node("fast", 1);
    let reconciled = async |api: &mut ApiHandle, mi: &ModelInstance, nodes: &[Node], pods| {
        let world = World {
            nodes: nodes.to_vec(),
            pods,
            services: vec![headless_service(mi)],
            instances: vec![mi.clone()],
        };
        let ctx = context(world, client.clone());
        serve_reconcile(api, tokio::spawn(reconcile(Arc::new(mi.clone()), ctx))).await
    };
    // Replica 0 placed while only the RTX 4090 was there, replica 1 on the
    // H100 that came later.
    let mut mi = with_replicas(1);
    let calls = reconciled(&mut api, &mi, std::slice::from_ref(&slow), vec![]).await;
    let pods = started(&[], &calls);
    let mut two = with_replicas(2);
    two.status = Some(written_status(&calls));
    let nodes = [slow, fast];
    let calls = reconciled(&mut api, &two, &nodes, pods.clone()).await;
    let pods = started(&pods, &calls);
    let status = written_status(&calls);
    let node_of_replica = |status: &ModelInstanceStatus, replica: u32| {
        status
            .plan
            .iter()
            .find(|s| s.replica == replica)
            .map(|s| s.node.clone())
    };
    assert_eq!(node_of_replica(&status, 0).as_deref(), Some("slow"));
    assert_eq!(node_of_replica(&status, 1).as_deref(), Some("fast"));

    // Scaled to one: replica 0 serves fewer requests/s on its one GPU, so it
    // leaves its Services; replica 1 stays as it is.
    mi = with_replicas(1);
    mi.status = Some(status);
    let calls = reconciled(&mut api, &mi, &nodes, pods.clone()).await;
    let closed: Vec<&str> = calls
        .iter()
        .filter(|(_, path, body)| {
            path.contains("/status?") && body["status"]["conditions"][0]["status"] == "False"
        })
        .map(|(_, path, _)| path.as_str())
        .collect();
    assert_eq!(
        closed,
        ["/api/v1/namespaces/ml/pods/llama-shard-0/status?"],
        "{calls:?}"
    );
    assert!(created_pods(&calls).is_empty(), "{calls:?}");
    let status = written_status(&calls);
    assert_eq!(node_of_replica(&status, 0), None);
    assert_eq!(node_of_replica(&status, 1).as_deref(), Some("fast"));
    let predicted: Vec<u32> = status
        .replica_predictions
        .iter()
        .map(|p| p.replica)
        .collect();
    assert_eq!(predicted, [1], "the status names the replica by its number");

    // Two again: the new replica takes the lowest free number, 0, on the GPU
    // replica 0 left.
    let mut two = with_replicas(2);
    two.status = Some(status);
    let drained = pods
        .into_iter()
        .filter(|pod| pod.metadata.name.as_deref() != Some("llama-shard-0"))
        .collect();
    let calls = reconciled(&mut api, &two, &nodes, drained).await;
    let names: Vec<String> = created_pods(&calls)
        .iter()
        .map(|pod| pod["metadata"]["name"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(names, ["llama-shard-0"]);
    let status = written_status(&calls);
    assert_eq!(node_of_replica(&status, 0).as_deref(), Some("slow"));
    let order: Vec<u32> = status.plan.iter().map(|s| s.replica).collect();
    assert_eq!(order, [0, 1], "the plan lists replicas by number");
}

#[tokio::test]
async fn a_replica_number_added_again_is_told_again_why_it_waits() {
    let (service, mut api) = mock::pair::<Request<Body>, Response<Body>>();
    let client = kube::Client::new(service, "default");
    let mi = with_replicas(2);
    // One controller throughout: what it remembers of unsatisfiable attempts
    // carries from one reconcile to the next.
    let ctx = context(
        World {
            nodes: vec![node("a", 1)],
            pods: vec![],
            services: vec![],
            instances: vec![mi.clone()],
        },
        client,
    );
    let told = |calls: &[(Method, String, Value)]| {
        calls
            .iter()
            .filter(|(_, path, body)| path.contains("/events") && body["reason"] == "Unsatisfiable")
            .count()
    };
    let mut status = {
        let calls = serve_reconcile(
            &mut api,
            tokio::spawn(reconcile(Arc::new(mi.clone()), ctx.clone())),
        )
        .await;
        written_status(&calls)
    };
    // Replica 1 holds the one GPU and replica 0 has none, as numbers stand
    // once replicas came and went.
    for shard in &mut status.plan {
        shard.replica = 1;
    }
    let mut reconciled = async |replicas: u32, status: &ModelInstanceStatus| {
        let mut mi = with_replicas(replicas);
        mi.status = Some(status.clone());
        let calls =
            serve_reconcile(&mut api, tokio::spawn(reconcile(Arc::new(mi), ctx.clone()))).await;
        let written = calls
            .iter()
            .any(|(_, path, _)| path.contains("/modelinstances/") && path.contains("/status?"));
        let status = if written {
            written_status(&calls)
        } else {
            status.clone()
        };
        (told(&calls), status)
    };
    let (first, status) = reconciled(2, &status).await;
    assert_eq!(first, 1, "replica 0 is told why it waits");
    let (repeated, status) = reconciled(2, &status).await;
    assert_eq!(repeated, 0, "and not told twice");
    // Scaled to one, replica 0 (no plan) goes; scaled to two again, the new
    // replica 0 waits for the same reason, and is told again.
    let (_, one) = reconciled(1, &status).await;
    let numbers: BTreeSet<u32> = one.plan.iter().map(|s| s.replica).collect();
    assert_eq!(numbers, BTreeSet::from([1]));
    let (again, _) = reconciled(2, &one).await;
    assert_eq!(again, 1, "replica 0 is told again");
}

/// A ResourceSlice of the driver for node `name`: device `<name>-g<i>` named `dev-<i>`.
fn slice(name: &str, gpus: usize) -> CachedSlice {
    let devices: Vec<Value> = (0..gpus)
        .map(|i| json!({"name": format!("dev-{i}"), "attributes": {"id": {"string": format!("{name}-g{i}")}}}))
        .collect();
    serde_json::from_value(json!({
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": format!("{name}-gpu-tessera-dev-0")},
        "spec": {"driver": "gpu.tessera.dev", "nodeName": name, "pool": {"name": name, "generation": 1, "resourceSliceCount": 1}, "devices": devices},
    }))
    .unwrap()
}

/// `mi` alone on node `a` (2 GPUs, published as a ResourceSlice), DRA on,
/// `claims` cached.
fn dra_context(
    client: kube::Client,
    mi: &ModelInstance,
    claims: Vec<ResourceClaim>,
) -> Arc<Context> {
    let dra = DraCaches::new(filled(vec![slice("a", 2)]).0, filled(claims).0);
    let settings = Settings {
        dra_driver: Some("gpu.tessera.dev".into()),
        ..Settings::default()
    };
    context_with(fresh_world(mi), client, Some(dra), settings)
}

/// A user's claim kube-scheduler allocated device `dev-<i>` of node `node`.
fn users_claim(node: &str, i: usize) -> ResourceClaim {
    serde_json::from_value(json!({
        "metadata": {"name": "users", "namespace": "default", "uid": "uid-users"},
        "spec": {},
        "status": {"allocation": {"devices": {"results": [
            {"request": "gpus", "driver": "gpu.tessera.dev", "pool": node, "device": format!("dev-{i}")}
        ]}}},
    }))
    .unwrap()
}

#[tokio::test]
async fn a_shard_on_a_dra_node_gets_its_claim_allocated_before_its_bind() {
    let (service, mut api) = mock::pair::<Request<Body>, Response<Body>>();
    let client = kube::Client::new(service, "default");
    let mi = instance();
    // Device a-g0 is a user's: the shard must get the other one.
    let ctx = dra_context(client, &mi, vec![users_claim("a", 0)]);
    let run = tokio::spawn(reconcile(Arc::new(mi), ctx));

    let c = next(&mut api).await;
    assert_eq!(
        (&c.method, c.path.as_str()),
        (&Method::POST, "/api/v1/namespaces/ml/services?")
    );
    echo(c, StatusCode::CREATED);

    // The claim first: exactly the planned device, owned by the instance, protected.
    let c = next(&mut api).await;
    assert_eq!(
        (&c.method, c.path.as_str()),
        (
            &Method::POST,
            "/apis/resource.k8s.io/v1/namespaces/ml/resourceclaims?"
        )
    );
    let claim = echo(c, StatusCode::CREATED);
    assert_eq!(claim["metadata"]["name"], "llama-shard-0-gpus");
    assert_eq!(claim["metadata"]["ownerReferences"][0]["uid"], "uid-llama");
    assert_eq!(
        claim["metadata"]["finalizers"],
        json!(["resource.kubernetes.io/delete-protection"])
    );
    let request = &claim["spec"]["devices"]["requests"][0];
    assert_eq!(request["exactly"]["deviceClassName"], "gpu.tessera.dev");
    assert_eq!(request["exactly"]["count"], 1);
    assert_eq!(
        request["exactly"]["selectors"][0]["cel"]["expression"],
        r#"device.attributes["gpu.tessera.dev"].id in ["a-g1"]"#
    );

    // The pod uses the claim, not the extended resource.
    let c = next(&mut api).await;
    assert_eq!(
        (&c.method, c.path.as_str()),
        (&Method::POST, "/api/v1/namespaces/ml/pods?")
    );
    let pod = echo(c, StatusCode::CREATED);
    assert_eq!(
        pod["metadata"]["annotations"]["tessera.dev/devices"],
        "a-g1"
    );
    assert_eq!(
        pod["spec"]["resourceClaims"],
        json!([{"name": "gpus", "resourceClaimName": "llama-shard-0-gpus"}])
    );
    assert_eq!(
        pod["spec"]["containers"][0]["resources"],
        json!({"claims": [{"name": "gpus"}]})
    );

    // Allocated and reserved for the pod, then bound.
    let c = next(&mut api).await;
    assert_eq!(
        (&c.method, c.path.as_str()),
        (
            &Method::PUT,
            "/apis/resource.k8s.io/v1/namespaces/ml/resourceclaims/llama-shard-0-gpus/status?"
        )
    );
    let status = &c.body["status"];
    assert_eq!(
        status["allocation"]["devices"]["results"],
        json!([{"request": "gpus", "driver": "gpu.tessera.dev", "pool": "a", "device": "dev-1"}])
    );
    assert_eq!(
        status["allocation"]["nodeSelector"]["nodeSelectorTerms"][0]["matchFields"][0],
        json!({"key": "metadata.name", "operator": "In", "values": ["a"]})
    );
    assert_eq!(
        status["reservedFor"],
        json!([{"resource": "pods", "name": "llama-shard-0", "uid": "uid-created"}])
    );
    echo(c, StatusCode::OK);
    let c = next(&mut api).await;
    assert_eq!(
        (&c.method, c.path.as_str()),
        (
            &Method::POST,
            "/api/v1/namespaces/ml/pods/llama-shard-0/binding?"
        )
    );
    bound(c.send);
    // Events: Planned, Bound.
    finish(&mut api, run, 2).await;
}

/// The two stages' requests of one kind, both received before either is
/// answered (a controller that waited for each answer would send only one).
async fn both_in_flight(api: &mut ApiHandle, method: Method, path: &str) -> [Call; 2] {
    let (first, second) = (next(api).await, next(api).await);
    for call in [&first, &second] {
        assert_eq!(call.method, method, "{}", call.path);
        assert!(call.path.contains(path), "{} is not {path}", call.path);
    }
    [first, second]
}

#[tokio::test]
async fn a_replicas_claims_pods_allocations_and_binds_are_each_sent_together() {
    let (service, mut api) = mock::pair::<Request<Body>, Response<Body>>();
    let client = kube::Client::new(service, "default");
    let mi = two_stages();
    let ctx = dra_context(client, &mi, vec![]);
    let run = tokio::spawn(reconcile(Arc::new(mi), ctx));

    let c = next(&mut api).await;
    assert_eq!(c.path, "/api/v1/namespaces/ml/services?");
    echo(c, StatusCode::CREATED);
    for call in both_in_flight(&mut api, Method::POST, "/resourceclaims?").await {
        echo(call, StatusCode::CREATED);
    }
    for call in both_in_flight(&mut api, Method::POST, "/pods?").await {
        echo(call, StatusCode::CREATED);
    }
    for call in both_in_flight(&mut api, Method::PUT, "/status?").await {
        echo(call, StatusCode::OK);
    }
    for call in both_in_flight(&mut api, Method::POST, "/binding?").await {
        bound(call.send);
    }
    // Events: Planned, and Bound per shard.
    finish(&mut api, run, 3).await;
}

/// Answers a binding as the API server does.
fn bound(send: SendResponse<Response<Body>>) {
    respond(
        send,
        StatusCode::CREATED,
        &json!({"kind": "Status", "apiVersion": "v1", "status": "Success", "code": 201}),
    );
}

/// Answers the reconcile's status write and its `events` events, and waits
/// for it to end well.
async fn finish(
    api: &mut ApiHandle,
    run: tokio::task::JoinHandle<Result<Action, tessera::controller::reconcile::Error>>,
    events: usize,
) {
    let c = next(api).await;
    assert_eq!(c.method, Method::PATCH);
    let mut echoed = serde_json::to_value(instance()).unwrap();
    echoed["status"] = c.body["status"].clone();
    respond(c.send, StatusCode::OK, &echoed);
    for _ in 0..events {
        let c = next(api).await;
        echo(c, StatusCode::CREATED);
    }
    run.await.unwrap().unwrap();
}

/// Kubelet deletes its node's ResourceSlices when it starts, until the
/// driver writes them again: a running shard that got its device through a
/// claim must not be replaced by one asking for the extended resource.
#[tokio::test]
async fn a_running_dra_shard_keeps_its_claim_while_its_nodes_slices_are_gone() {
    let (service, mut api) = mock::pair::<Request<Body>, Response<Body>>();
    let client = kube::Client::new(service, "default");
    let mut mi = instance();
    let new = plan_on(&mi, &[node("a", 2)]);
    let shard = &new.plan[0];
    let mut pod = shard_pods_with(&mi, &new.plan, |_| {
        ShardGpus::Claim("llama-shard-0-gpus".into())
    })
    .remove(0);
    pod.metadata.uid = Some("uid-shard-0".into());
    pod.spec.as_mut().unwrap().node_name = Some("a".into());
    pod.status = Some(PodStatus {
        phase: Some("Running".into()),
        ..Default::default()
    });
    let claim: ResourceClaim = serde_json::from_value(json!({
        "metadata": {
            "name": "llama-shard-0-gpus", "namespace": "ml", "uid": "uid-claim",
            "labels": {"tessera.dev/instance": "llama"},
            "ownerReferences": [{"apiVersion": "tessera.dev/v1alpha1", "kind": "ModelInstance",
                "name": "llama", "uid": "uid-llama", "controller": true}],
        },
        "spec": {"devices": {"requests": [{"name": "gpus", "exactly": {
            "deviceClassName": "gpu.tessera.dev", "allocationMode": "ExactCount", "count": 1,
            "selectors": [{"cel": {"expression": format!(
                r#"device.attributes["gpu.tessera.dev"].id in ["{}"]"#, shard.devices[0]
            )}}],
        }}]}},
        "status": {
            "allocation": {"devices": {"results": [
                {"request": "gpus", "driver": "gpu.tessera.dev", "pool": "a", "device": "dev-0"}
            ]}},
            "reservedFor": [{"resource": "pods", "name": "llama-shard-0", "uid": "uid-shard-0"}],
        },
    }))
    .unwrap();
    mi.status = Some(running(&mi, new.plan.clone()));
    let world = alone(&mi, vec![node("a", 2)], vec![pod]);
    // The node's slices are gone; the claim is still there.
    let dra = DraCaches::new(filled(Vec::<CachedSlice>::new()).0, filled(vec![claim]).0);
    let settings = Settings {
        dra_driver: Some("gpu.tessera.dev".into()),
        ..Settings::default()
    };
    let ctx = context_with(world, client, Some(dra), settings);
    let calls = serve_reconcile(&mut api, tokio::spawn(reconcile(Arc::new(mi), ctx))).await;
    assert!(deleted(&calls).is_empty(), "nothing is deleted: {calls:?}");
    assert!(created_pods(&calls).is_empty(), "nothing is created");
    assert!(
        calls
            .iter()
            .all(|(_, path, _)| !path.contains("resourceclaims")),
        "the claim is left alone: {calls:?}"
    );
}

#[tokio::test]
async fn nothing_is_decided_before_every_cache_has_listed() {
    // With DRA and with the device plugin alike: before the pod cache has
    // listed, the instance's own running shards look like others' holds.
    for dra in [true, false] {
        let (service, mut api) = mock::pair::<Request<Body>, Response<Body>>();
        let client = kube::Client::new(service, "default");
        let mi = instance();
        let ctx = if dra {
            dra_context(client, &mi, vec![])
        } else {
            context(fresh_world(&mi), client)
        };
        ctx.metrics.mark_synced(false);
        let action = tokio::time::timeout(Duration::from_secs(5), reconcile(Arc::new(mi), ctx))
            .await
            .expect("a reconcile before the caches listed must not wait on the API server")
            .unwrap();
        assert_eq!(action, Action::requeue(Duration::from_secs(1)), "dra {dra}");
        // Whether the client went away (None) or no request came (timeout): none was made.
        let request = tokio::time::timeout(Duration::from_millis(100), api.next_request()).await;
        assert!(
            !matches!(request, Ok(Some(_))),
            "no request before the caches listed (dra {dra})"
        );
    }
}

/// A running two-stage instance, one stage on node `a` and one on `b`, with
/// `spec.restartPolicy` set to `policy` (the default when `None`), and its
/// two bound shard pods.
fn settled_pair(policy: Option<&str>) -> (ModelInstance, Vec<Node>, Vec<Pod>) {
    let mut spec = serde_json::to_value(two_stages()).unwrap();
    if let Some(policy) = policy {
        spec["spec"]["restartPolicy"] = json!(policy);
    }
    let mut mi: ModelInstance = serde_json::from_value(spec).unwrap();
    let nodes = vec![node("a", 1), node("b", 1)];
    let new = plan_on(&mi, &nodes);
    assert_eq!(new.plan.len(), 2);
    let pods = shard_pods(&mi, &new.plan, |_| "tessera.dev/gpu".into())
        .into_iter()
        .zip(&new.plan)
        .map(|(mut pod, shard)| {
            pod.metadata.uid = Some(format!("uid-shard-{}", shard.shard));
            pod.spec.as_mut().unwrap().node_name = Some(shard.node.clone());
            pod.status = Some(PodStatus {
                phase: Some("Running".into()),
                ..Default::default()
            });
            pod
        })
        .collect();
    mi.status = Some(running(&mi, new.plan));
    (mi, nodes, pods)
}

/// `mi` and its Service alone in the world, with `nodes` and `pods`.
fn alone(mi: &ModelInstance, nodes: Vec<Node>, pods: Vec<Pod>) -> World {
    World {
        nodes,
        pods,
        services: vec![headless_service(mi)],
        instances: vec![mi.clone()],
    }
}

fn failed(mut pod: Pod) -> Pod {
    pod.status = Some(PodStatus {
        phase: Some("Failed".into()),
        reason: Some("Error".into()),
        message: Some("vllm exited with code 1".into()),
        ..Default::default()
    });
    pod
}

/// With `restartPolicy: RecreateReplica` (the default), a rank that fails
/// takes its replica's other pods down with it; once they are gone the
/// replica starts again on the devices of the plan it kept.
#[tokio::test]
async fn a_failed_rank_recreates_its_whole_replica_on_the_same_plan() {
    let (service, mut api) = mock::pair::<Request<Body>, Response<Body>>();
    let client = kube::Client::new(service, "default");
    let (mi, nodes, mut pods) = settled_pair(None);
    assert_eq!(
        mi.spec.restart_policy,
        tessera::api::RestartPolicy::RecreateReplica
    );
    let before = mi.status.as_ref().unwrap().plan.clone();
    let devices: Vec<String> = pods
        .iter()
        .map(|p| p.metadata.annotations.as_ref().unwrap()["tessera.dev/devices"].clone())
        .collect();
    pods[1] = failed(pods[1].clone());
    let (svc, first) = (headless_service(&mi), mi.clone());
    let world = |pods: Vec<Pod>| World {
        nodes: nodes.clone(),
        pods,
        services: vec![svc.clone()],
        instances: vec![first.clone()],
    };
    let ctx = context(world(pods), client.clone());
    let calls = serve_reconcile(&mut api, tokio::spawn(reconcile(Arc::new(mi.clone()), ctx))).await;
    assert_eq!(
        deleted(&calls),
        [
            "/api/v1/namespaces/ml/pods/llama-shard-0?",
            "/api/v1/namespaces/ml/pods/llama-shard-1?"
        ],
        "the healthy rank goes too"
    );
    assert!(
        created_pods(&calls).is_empty(),
        "nothing new while the old pods go"
    );
    let written = written_status(&calls);
    assert_eq!(
        written.plan, before,
        "the plan is kept: its devices are fine"
    );
    let events = events_of(&calls);
    assert_eq!(events.len(), 1, "{events:?}");
    let (reason, kind, note) = &events[0];
    assert_eq!(
        (reason.as_str(), kind.as_str()),
        ("ReplicaRecreated", "Warning")
    );
    assert!(
        note.contains("llama-shard-1: pod failed (Error: vllm exited with code 1)")
            && note.contains("recreating all 2 shard pods"),
        "{note}"
    );

    // The old pods are gone: both are created again, on their planned
    // devices, and bound together.
    let mut mi = mi;
    mi.status = Some(written);
    let ctx = context(world(vec![]), client);
    let calls = serve_reconcile(&mut api, tokio::spawn(reconcile(Arc::new(mi), ctx))).await;
    assert!(deleted(&calls).is_empty());
    let created = created_pods(&calls);
    let recreated: Vec<(&str, &str)> = created
        .iter()
        .map(|p| {
            (
                p["metadata"]["name"].as_str().unwrap(),
                p["metadata"]["annotations"]["tessera.dev/devices"]
                    .as_str()
                    .unwrap(),
            )
        })
        .collect();
    assert_eq!(
        recreated,
        [
            ("llama-shard-0", devices[0].as_str()),
            ("llama-shard-1", devices[1].as_str())
        ]
    );
    let bound: Vec<&str> = calls
        .iter()
        .filter(|(_, path, _)| path.contains("/binding"))
        .map(|(_, _, body)| body["target"]["name"].as_str().unwrap())
        .collect();
    assert_eq!(bound, [before[0].node.as_str(), before[1].node.as_str()]);
}

/// A rank whose pod was deleted by hand is lost just the same.
#[tokio::test]
async fn a_deleted_rank_takes_the_running_ones_down_too() {
    let (service, mut api) = mock::pair::<Request<Body>, Response<Body>>();
    let client = kube::Client::new(service, "default");
    let (mi, nodes, mut pods) = settled_pair(Some("RecreateReplica"));
    pods.truncate(1);
    let ctx = context(alone(&mi, nodes, pods), client);
    let calls = serve_reconcile(&mut api, tokio::spawn(reconcile(Arc::new(mi), ctx))).await;
    assert_eq!(
        deleted(&calls),
        ["/api/v1/namespaces/ml/pods/llama-shard-0?"]
    );
    assert!(created_pods(&calls).is_empty());
    let events = events_of(&calls);
    assert_eq!(events.len(), 1, "{events:?}");
    assert!(
        events[0].2.contains("llama-shard-1: its pod is gone"),
        "{events:?}"
    );
}

/// `restartPolicy: RecreatePod` keeps today's repair: only the lost pod goes.
#[tokio::test]
async fn with_recreate_pod_only_the_failed_rank_is_replaced() {
    let (service, mut api) = mock::pair::<Request<Body>, Response<Body>>();
    let client = kube::Client::new(service, "default");
    let (mi, nodes, mut pods) = settled_pair(Some("RecreatePod"));
    pods[1] = failed(pods[1].clone());
    let ctx = context(alone(&mi, nodes, pods), client);
    let calls = serve_reconcile(&mut api, tokio::spawn(reconcile(Arc::new(mi), ctx))).await;
    assert_eq!(
        deleted(&calls),
        ["/api/v1/namespaces/ml/pods/llama-shard-1?"]
    );
    let reasons: Vec<String> = events_of(&calls).into_iter().map(|e| e.0).collect();
    assert_eq!(reasons, ["ShardLost"]);
}

/// The env of a created pod's first container, by name.
fn env_of(pod: &Value) -> std::collections::BTreeMap<String, String> {
    pod["spec"]["containers"][0]["env"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| {
            (
                e["name"].as_str().unwrap().to_string(),
                e["value"].as_str().unwrap_or_default().to_string(),
            )
        })
        .collect()
}

/// A degraded replica (one stage's GPU failed, with nowhere to move it)
/// still makes its surviving stage's new pod for the whole plan: the stage
/// count, peers and layer split of both stages, as vLLM checks them.
#[tokio::test]
async fn a_degraded_replicas_new_pod_gets_the_whole_plans_runtime_values() {
    let (service, mut api) = mock::pair::<Request<Body>, Response<Body>>();
    let client = kube::Client::new(service, "default");
    let (mi, mut nodes, _) = settled_pair(None);
    let plan = mi.status.as_ref().unwrap().plan.clone();
    let broken = plan[1].node.clone();
    let failed_node = nodes
        .iter_mut()
        .find(|n| n.metadata.name.as_deref() == Some(&broken));
    let annotations = failed_node.unwrap().metadata.annotations.as_mut().unwrap();
    let state = annotations["tessera.dev/gpu-state"].replace("Healthy", "Unhealthy");
    annotations.insert("tessera.dev/gpu-state".into(), state);
    // Stage 0's pod is gone too (evicted, say): it is made again, alone.
    let ctx = context(alone(&mi, nodes, vec![]), client);
    let calls = serve_reconcile(&mut api, tokio::spawn(reconcile(Arc::new(mi), ctx))).await;
    assert_eq!(written_status(&calls).phase, Some(Phase::Degraded));
    let created = created_pods(&calls);
    assert_eq!(created.len(), 1, "only the runnable stage gets a pod");
    assert_eq!(created[0]["metadata"]["name"], "llama-shard-0");
    let env = env_of(&created[0]);
    let layers = |s: &tessera::api::PlannedShard| (s.layer_end - s.layer_start).to_string();
    assert_eq!(env["TESSERA_PIPELINE_PARALLEL"], "2");
    assert_eq!(env["TESSERA_SHARD_COUNT"], "2");
    assert_eq!(
        env["VLLM_PP_LAYER_PARTITION"],
        format!("{},{}", layers(&plan[0]), layers(&plan[1]))
    );
    assert_eq!(env["TESSERA_PEERS"].split(',').count(), 2);
    assert_eq!(env["TESSERA_NEXT_PEER"], "llama-shard-1.llama.ml.svc");
    // What the replica's capacity was planned with: the default request
    // length and vLLM's memory share of a whole GPU.
    assert_eq!(env["TESSERA_MAX_MODEL_LEN"], "1280");
    assert_eq!(env["TESSERA_GPU_MEMORY_FRACTION"], "0.9");
}

/// A two-stage replica whose stage 1 failed `count` times already, the
/// last recreation `ago` seconds back.
fn failing_again(count: u32, ago: i64) -> (ModelInstance, Vec<Node>, Vec<Pod>) {
    let (mut mi, nodes, mut pods) = settled_pair(None);
    pods[1] = failed(pods[1].clone());
    let desired = shard_pods(&mi, &mi.status.as_ref().unwrap().plan, |_| {
        "tessera.dev/gpu".into()
    });
    let hashes: Vec<&str> = desired
        .iter()
        .map(|p| p.metadata.annotations.as_ref().unwrap()["tessera.dev/spec-hash"].as_str())
        .collect();
    let now = k8s_openapi::jiff::Timestamp::now().as_second();
    let last = k8s_openapi::jiff::Timestamp::from_second(now - ago).unwrap();
    mi.status.as_mut().unwrap().restarts = vec![tessera::api::ReplicaRestarts {
        replica: 0,
        count,
        last_time: k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(last),
        pod_hash: tessera::controller::hashes::replica_pod_hash(hashes),
        ready_since: None,
    }];
    (mi, nodes, pods)
}

/// A replica that keeps failing backs off: after three recreations in a
/// row the next waits 40 s. Meanwhile the failed pod stays (for its logs),
/// the status says which rank failed and why, once in an event, and the
/// reconcile looks again when the wait ends.
#[tokio::test]
async fn a_replica_that_keeps_failing_waits_before_its_next_recreation() {
    let (service, mut api) = mock::pair::<Request<Body>, Response<Body>>();
    let client = kube::Client::new(service, "default");
    let (mi, nodes, pods) = failing_again(3, 5);
    let ctx = context(alone(&mi, nodes.clone(), pods.clone()), client.clone());
    let run = tokio::spawn(reconcile(Arc::new(mi.clone()), ctx));
    let calls = serve_reconcile(&mut api, run).await;
    assert!(
        deleted(&calls).is_empty(),
        "nothing is deleted while it waits"
    );
    assert!(created_pods(&calls).is_empty());
    let written = written_status(&calls);
    assert_eq!(
        written.restarts,
        mi.status.as_ref().unwrap().restarts,
        "the count stands"
    );
    let condition = written
        .conditions
        .iter()
        .find(|c| c.type_ == "ReplicaFailure")
        .expect("a ReplicaFailure condition");
    assert_eq!(
        (condition.status.as_str(), condition.reason.as_str()),
        ("True", "BackOff")
    );
    assert!(
        condition.message.starts_with(
            "replica 0: llama-shard-1: pod failed (Error: vllm exited with code 1); recreated 3 \
             times in a row"
        ),
        "{}",
        condition.message
    );
    let events = events_of(&calls);
    assert_eq!(events.len(), 1, "{events:?}");
    assert_eq!(
        (events[0].0.as_str(), events[0].1.as_str()),
        ("BackOff", "Warning")
    );
    assert_eq!(events[0].2, condition.message);

    // The next look, still waiting: the condition stands, no second event,
    // and the reconcile comes back when the 40 s are up.
    let mut mi = mi;
    mi.status = Some(written);
    let ctx = context(alone(&mi, nodes, pods), client);
    let (calls, run) =
        serve_reconcile_until(&mut api, tokio::spawn(reconcile(Arc::new(mi), ctx))).await;
    assert!(calls.is_empty(), "nothing to write: {calls:?}");
    let wait = format!("{run:?}");
    assert!(wait.contains("requeue_after: Some("), "{wait}");
    let seconds: f64 = wait
        .split("requeue_after: Some(")
        .nth(1)
        .and_then(|rest| rest.split('s').next())
        .and_then(|s| s.parse().ok())
        .unwrap();
    assert!((30.0..=37.0).contains(&seconds), "{wait}");
}

/// Once the wait is over the replica is recreated, and counted again.
#[tokio::test]
async fn a_replica_whose_wait_is_over_is_recreated_and_counted() {
    let (service, mut api) = mock::pair::<Request<Body>, Response<Body>>();
    let client = kube::Client::new(service, "default");
    let (mi, nodes, pods) = failing_again(3, 41);
    let ctx = context(alone(&mi, nodes, pods), client);
    let calls = serve_reconcile(&mut api, tokio::spawn(reconcile(Arc::new(mi), ctx))).await;
    assert_eq!(deleted(&calls).len(), 2, "the whole replica goes");
    let written = written_status(&calls);
    assert_eq!(written.restarts.len(), 1);
    assert_eq!(written.restarts[0].count, 4);
    let condition = written
        .conditions
        .iter()
        .find(|c| c.type_ == "ReplicaFailure")
        .unwrap();
    assert_eq!(
        (condition.status.as_str(), condition.reason.as_str()),
        ("False", "Recreated")
    );
    let reasons: Vec<String> = events_of(&calls).into_iter().map(|e| e.0).collect();
    assert_eq!(reasons, ["ReplicaRecreated"]);
}

/// A new pod template (the image fixed, say) is tried at once, whatever the
/// count of the pods before it.
#[tokio::test]
async fn a_changed_template_is_tried_at_once() {
    let (service, mut api) = mock::pair::<Request<Body>, Response<Body>>();
    let client = kube::Client::new(service, "default");
    let (mut mi, nodes, pods) = failing_again(6, 5);
    mi.spec
        .template
        .as_mut()
        .unwrap()
        .spec
        .as_mut()
        .unwrap()
        .containers[0]
        .image = Some("busybox:1.38".into());
    let ctx = context(alone(&mi, nodes, pods), client);
    let calls = serve_reconcile(&mut api, tokio::spawn(reconcile(Arc::new(mi), ctx))).await;
    assert_eq!(deleted(&calls).len(), 2);
    assert_eq!(
        written_status(&calls).restarts[0].count,
        1,
        "counted afresh"
    );
}
