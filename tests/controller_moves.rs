//! Moves in the controller's reconciles against a mocked API server: a
//! blocked instance hands a move to the instance in its way, which records
//! it, starts its new copy on the planned devices, switches once that copy
//! is Ready, takes the old pods out of their Services and then evicts them
//! through the Eviction API, and is done; a
//! refused eviction leaves the old copy serving and says why.

use std::sync::Arc;

use http::{Method, StatusCode};
use k8s_openapi::api::core::v1::{Pod, PodStatus};
use serde_json::{Value, json};
use tessera::api::{ModelInstance, ModelInstanceStatus, MoveInFlight, MovePhase, PlannedShard};
use tessera::controller::reconcile::{Context, reconcile};
use tower_test::mock;

#[path = "common/mock_api.rs"]
mod mock_api;
use mock_api::*;

/// A 7B instance of `tensor` GPUs per shard, one stage.
fn model(name: &str, tensor: u32) -> ModelInstance {
    serde_json::from_value(json!({
        "apiVersion": "tessera.dev/v1alpha1",
        "kind": "ModelInstance",
        "metadata": {"name": name, "namespace": "ml", "uid": format!("uid-{name}"), "generation": 1, "resourceVersion": "1"},
        "spec": {
            "model": {"name": name, "parametersBillions": 7, "layers": 32, "kvCacheGiB": 2},
            "parallelism": {"tensor": tensor, "pipeline": 1},
            "template": {"spec": {"containers": [{"name": "shard", "image": "busybox:1.37"}]}},
        },
    }))
    .unwrap()
}

fn shard(node: &str, device: &str, copy: u32) -> PlannedShard {
    PlannedShard {
        replica: 0,
        copy,
        shard: 0,
        node: node.into(),
        devices: vec![device.into()],
        layer_start: 0,
        layer_end: 32,
        predicted_memory_gib: 16.54,
        share: None,
    }
}

/// A context over node a (2 GPUs) and node b (1 GPU) with `pods` and
/// `instances` cached, and the mocked API server behind its client.
fn on_two_nodes(pods: Vec<Pod>, instances: Vec<ModelInstance>) -> (Arc<Context>, ApiHandle) {
    on(vec![node("a", 2), node("b", 1)], pods, instances)
}

/// [`on_two_nodes`] with the nodes given.
fn on(
    nodes: Vec<k8s_openapi::api::core::v1::Node>,
    pods: Vec<Pod>,
    instances: Vec<ModelInstance>,
) -> (Arc<Context>, ApiHandle) {
    let (service, api) = mock::pair();
    let world = World {
        nodes,
        pods,
        services: vec![],
        instances,
    };
    (context(world, kube::Client::new(service, "default")), api)
}

/// `small` running on `a-g0`, with the move (if any) in its status.
fn small_with(plan: PlannedShard, moves: Vec<MoveInFlight>) -> ModelInstance {
    let mut small = model("small", 1);
    small.status = Some(ModelInstanceStatus {
        moves,
        ..running(&small, vec![plan])
    });
    small
}

/// `small`'s move from a-g0 to b-g0, surging since `started`.
fn surging_since(started: k8s_openapi::jiff::Timestamp) -> MoveInFlight {
    MoveInFlight {
        replica: 0,
        phase: MovePhase::Surging,
        from: vec![shard("a", "a-g0", 0)],
        to: vec![shard("b", "b-g0", 1)],
        started: started.to_string(),
        reason: "to make room for ml/big replica 0".into(),
        waiting: None,
    }
}

/// The `OnCordonedNode` condition of the last status written, as (status,
/// reason, message).
fn on_cordoned(calls: &[(Method, String, Value)]) -> Option<(String, String, String)> {
    written_status(calls)
        .conditions
        .into_iter()
        .find(|c| c.type_ == "OnCordonedNode")
        .map(|c| (c.status, c.reason, c.message))
}

fn reasons(calls: &[(Method, String, Value)]) -> Vec<String> {
    events_of(calls)
        .into_iter()
        .map(|(reason, _, _)| reason)
        .collect()
}

/// The pods whose serving gate a call turned False.
fn closed_gates(calls: &[(Method, String, Value)]) -> Vec<String> {
    calls
        .iter()
        .filter(|(_, path, body)| {
            path.contains("/pods/")
                && path.contains("/status?")
                && body["status"]["conditions"][0]["type"] == "tessera.dev/serving"
                && body["status"]["conditions"][0]["status"] == "False"
        })
        .filter_map(|(_, path, _)| path.split("/pods/").nth(1)?.split('/').next())
        .map(String::from)
        .collect()
}

/// `pod` out of its Services for `seconds` already.
fn leaving_for(pod: &Pod, seconds: i64) -> Pod {
    let since =
        k8s_openapi::jiff::Timestamp::now() - k8s_openapi::jiff::SignedDuration::from_secs(seconds);
    let mut pod = pod.clone();
    pod.metadata
        .annotations
        .get_or_insert_with(Default::default)
        .insert("tessera.dev/draining-since".into(), since.to_string());
    pod
}

fn posted(calls: &[(Method, String, Value)], part: &str) -> Vec<String> {
    calls
        .iter()
        .filter(|(method, path, _)| *method == Method::POST && path.contains(part))
        .map(|(_, path, _)| path.clone())
        .collect()
}

#[tokio::test]
async fn a_blocked_instance_gets_room_by_a_move_made_before_the_old_copy_goes() {
    // `big` needs both GPUs of node a; `small` holds one of them and fits on b.
    let small = small_with(shard("a", "a-g0", 0), Vec::new());
    let big = model("big", 2);
    let old_pod = ready_pod(&small, &shard("a", "a-g0", 0));
    let (ctx, mut api) = on_two_nodes(vec![old_pod.clone()], vec![small.clone(), big.clone()]);

    // 1. big's reconcile finds no place and hands small a move.
    let calls = serve_reconcile(
        &mut api,
        tokio::spawn(reconcile(Arc::new(big), ctx.clone())),
    )
    .await;
    let status = written_status(&calls);
    let placed = status
        .conditions
        .iter()
        .find(|c| c.type_ == "Placed")
        .unwrap();
    assert_eq!(placed.status, "False");
    assert!(
        placed
            .message
            .contains("making room: moving ml/small replica 0 from a [a-g0] to b [b-g0]"),
        "{}",
        placed.message
    );
    assert!(
        reasons(&calls).contains(&"MakingRoom".to_string()),
        "{calls:?}"
    );

    // 2. small's reconcile writes the move into its status, and starts
    // nothing before that write.
    let calls = serve_reconcile(
        &mut api,
        tokio::spawn(reconcile(Arc::new(small.clone()), ctx)),
    )
    .await;
    assert!(created_pods(&calls).is_empty(), "{calls:?}");
    let status = written_status(&calls);
    assert_eq!(status.plan, vec![shard("a", "a-g0", 0)]);
    let [record] = status.moves.as_slice() else {
        panic!("one move recorded: {:?}", status.moves)
    };
    assert_eq!(record.phase, MovePhase::Surging);
    assert_eq!(record.to, vec![shard("b", "b-g0", 1)]);
    assert_eq!(record.reason, "to make room for ml/big replica 0");
    assert!(reasons(&calls).contains(&"MoveStarted".to_string()));

    // 3. With the move recorded, the new copy's pod is made and bound on b
    // beside the old one, which stays.
    let small = small_with(shard("a", "a-g0", 0), vec![record.clone()]);
    let (ctx, mut api) = on_two_nodes(vec![old_pod.clone()], vec![small.clone(), model("big", 2)]);
    let calls = serve_reconcile(&mut api, tokio::spawn(reconcile(Arc::new(small), ctx))).await;
    let created = created_pods(&calls);
    assert_eq!(created.len(), 1, "{calls:?}");
    assert_eq!(created[0]["metadata"]["name"], "small-m-shard-0");
    assert_eq!(
        created[0]["metadata"]["annotations"]["tessera.dev/devices"],
        "b-g0"
    );
    assert_eq!(
        posted(&calls, "/binding"),
        ["/api/v1/namespaces/ml/pods/small-m-shard-0/binding?"]
    );
    assert!(deleted(&calls).is_empty() && posted(&calls, "/eviction").is_empty());
    let status = written_status(&calls);
    assert_eq!(status.moves[0].phase, MovePhase::Surging);
    assert_eq!(
        status.moves[0].waiting.as_deref(),
        Some("the new copy: 0 of 1 pods Ready")
    );

    // 4. The new copy is Ready: the replica switches to it, and the old pod
    // leaves its Services first (its serving gate False), not yet evicted.
    let small = small_with(shard("a", "a-g0", 0), vec![record.clone()]);
    let new_pod = ready_pod(&small, &shard("b", "b-g0", 1));
    let (ctx, mut api) = on_two_nodes(vec![old_pod.clone(), new_pod.clone()], vec![small.clone()]);
    let calls = serve_reconcile(&mut api, tokio::spawn(reconcile(Arc::new(small), ctx))).await;
    // Only once a dry run says its eviction would be allowed.
    assert_eq!(
        posted(&calls, "/eviction"),
        ["/api/v1/namespaces/ml/pods/small-shard-0/eviction?&dryRun=All"]
    );
    assert_eq!(closed_gates(&calls), ["small-shard-0"]);
    assert!(deleted(&calls).is_empty(), "{calls:?}");
    assert!(created_pods(&calls).is_empty());
    let status = written_status(&calls);
    assert_eq!(status.plan, vec![shard("b", "b-g0", 1)]);
    assert_eq!(status.moves[0].phase, MovePhase::Draining);
    let draining = status.moves[0].clone();

    // 4b. Out of its Services for longer than the endpoints take to follow:
    // the old pod is evicted, not deleted.
    let small = small_with(shard("b", "b-g0", 1), vec![draining.clone()]);
    let (ctx, mut api) = on_two_nodes(
        vec![leaving_for(&old_pod, 10), new_pod.clone()],
        vec![small.clone()],
    );
    let calls = serve_reconcile(&mut api, tokio::spawn(reconcile(Arc::new(small), ctx))).await;
    assert_eq!(
        posted(&calls, "/eviction"),
        ["/api/v1/namespaces/ml/pods/small-shard-0/eviction?"]
    );
    // A policy/v1 Eviction whose deleteOptions hold the very pod seen: a
    // pod made again under the name is not evicted in its place.
    let (_, _, eviction) = calls
        .iter()
        .find(|(_, path, _)| path.contains("/eviction"))
        .expect("an eviction");
    assert_eq!(eviction["apiVersion"], "policy/v1", "{eviction}");
    assert_eq!(eviction["kind"], "Eviction");
    assert_eq!(eviction["metadata"]["name"], "small-shard-0");
    assert_eq!(
        eviction["deleteOptions"]["preconditions"]["uid"],
        old_pod.metadata.uid.clone().expect("the old pod has a uid")
    );
    assert!(deleted(&calls).is_empty(), "{calls:?}");
    assert_eq!(written_status(&calls).moves[0].phase, MovePhase::Draining);

    // 5. The old pod is gone: the move is done.
    let small = small_with(shard("b", "b-g0", 1), vec![draining]);
    let (ctx, mut api) = on_two_nodes(vec![new_pod], vec![small.clone()]);
    let calls = serve_reconcile(&mut api, tokio::spawn(reconcile(Arc::new(small), ctx))).await;
    let status = written_status(&calls);
    assert!(status.moves.is_empty());
    assert_eq!(status.plan, vec![shard("b", "b-g0", 1)]);
    let moved = events_of(&calls);
    let (_, kind, note) = moved
        .iter()
        .find(|(reason, _, _)| reason == "Moved")
        .expect("Moved");
    assert_eq!(kind, "Normal");
    assert!(note.contains("from a [a-g0] to b [b-g0]"), "{note}");
    assert!(created_pods(&calls).is_empty() && deleted(&calls).is_empty());
}

#[tokio::test]
async fn a_reconcile_on_a_cache_that_lacks_the_move_just_written_keeps_it() {
    let small = small_with(shard("a", "a-g0", 0), Vec::new());
    let old_pod = ready_pod(&small, &shard("a", "a-g0", 0));
    let (ctx, mut api) = on_two_nodes(vec![old_pod], vec![small.clone(), model("big", 2)]);
    serve_reconcile(
        &mut api,
        tokio::spawn(reconcile(Arc::new(model("big", 2)), ctx.clone())),
    )
    .await;
    let calls = serve_reconcile(
        &mut api,
        tokio::spawn(reconcile(Arc::new(small.clone()), ctx.clone())),
    )
    .await;
    assert_eq!(written_status(&calls).moves.len(), 1, "{calls:?}");

    // Another object's event wakes small before the watch brings that
    // write back: the cache still shows small as it was.
    let calls = serve_reconcile(&mut api, tokio::spawn(reconcile(Arc::new(small), ctx))).await;
    // The move stands: its new copy starts, nothing of the old one goes, and
    // no status write takes the move back (which would give its devices to
    // the next instance planned).
    let created = created_pods(&calls);
    assert_eq!(created.len(), 1, "{calls:?}");
    assert_eq!(created[0]["metadata"]["name"], "small-m-shard-0");
    assert!(deleted(&calls).is_empty() && posted(&calls, "/eviction").is_empty());
    let status = written_status(&calls);
    assert_eq!(status.moves.len(), 1, "{:?}", status.moves);
    assert_eq!(status.moves[0].phase, MovePhase::Surging);
    assert_eq!(status.plan, vec![shard("a", "a-g0", 0)]);
}

#[tokio::test]
async fn an_eviction_a_disruption_budget_refuses_keeps_the_old_copy_and_says_why() {
    let small = small_with(
        shard("a", "a-g0", 0),
        vec![surging_since(k8s_openapi::jiff::Timestamp::now())],
    );
    let pods = vec![
        ready_pod(&small, &shard("a", "a-g0", 0)),
        ready_pod(&small, &shard("b", "b-g0", 1)),
    ];
    let (ctx, mut api) = on_two_nodes(pods, vec![small.clone()]);
    let refuse = |method: &Method, path: &str| {
        (*method == Method::POST && path.contains("/eviction")).then(|| {
            (
                StatusCode::TOO_MANY_REQUESTS,
                json!({"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 429,
                       "reason": "TooManyRequests",
                       "message": "Cannot evict pod as it would violate the pod's disruption budget."}),
            )
        })
    };
    let (calls, _) = serve_reconcile_answering(
        &mut api,
        tokio::spawn(reconcile(Arc::new(small), ctx)),
        refuse,
    )
    .await;
    assert!(
        deleted(&calls).is_empty(),
        "the old pod is not deleted: {calls:?}"
    );
    assert!(
        closed_gates(&calls).is_empty(),
        "the old pod stays in its Services: {calls:?}"
    );
    let status = written_status(&calls);
    assert_eq!(status.moves[0].phase, MovePhase::Draining);
    let waiting = status.moves[0].waiting.clone().unwrap_or_default();
    assert!(
        waiting.contains("eviction of pod small-shard-0 was refused")
            && waiting.contains("disruption budget"),
        "{waiting}"
    );
}

#[tokio::test]
async fn a_surge_copy_not_ready_in_time_is_removed_and_the_old_copy_untouched() {
    let started = k8s_openapi::jiff::Timestamp::now()
        .checked_sub(std::time::Duration::from_secs(660))
        .unwrap();
    let small = small_with(shard("a", "a-g0", 0), vec![surging_since(started)]);
    let mut never_ready = ready_pod(&small, &shard("b", "b-g0", 1));
    never_ready.status = Some(PodStatus {
        phase: Some("Pending".into()),
        ..PodStatus::default()
    });
    let (ctx, mut api) = on_two_nodes(
        vec![ready_pod(&small, &shard("a", "a-g0", 0)), never_ready],
        vec![small.clone()],
    );
    let calls = serve_reconcile(&mut api, tokio::spawn(reconcile(Arc::new(small), ctx))).await;
    assert_eq!(
        deleted(&calls),
        ["/api/v1/namespaces/ml/pods/small-m-shard-0?"]
    );
    assert!(posted(&calls, "/eviction").is_empty() && created_pods(&calls).is_empty());
    let status = written_status(&calls);
    assert!(status.moves.is_empty());
    assert_eq!(status.plan, vec![shard("a", "a-g0", 0)]);
    let events = events_of(&calls);
    let (_, kind, note) = events
        .iter()
        .find(|(reason, _, _)| reason == "MoveAbandoned")
        .expect("MoveAbandoned");
    assert_eq!(kind, "Warning");
    assert!(note.contains("not Ready within 600s"), "{note}");
}

/// [`node`], cordoned.
fn cordoned(name: &str, gpus: usize) -> k8s_openapi::api::core::v1::Node {
    let mut node = node(name, gpus);
    node.spec.get_or_insert_with(Default::default).unschedulable = Some(true);
    node
}

#[tokio::test]
async fn a_replica_on_a_cordoned_node_moves_itself_off_make_before_break() {
    let small = small_with(shard("a", "a-g0", 0), Vec::new());
    let old_pod = ready_pod(&small, &shard("a", "a-g0", 0));
    let (ctx, mut api) = on(
        vec![cordoned("a", 2), node("b", 1)],
        vec![old_pod],
        vec![small.clone()],
    );
    // The first reconcile finds its node cordoned and hands itself the move.
    let calls = serve_reconcile(
        &mut api,
        tokio::spawn(reconcile(Arc::new(small.clone()), ctx.clone())),
    )
    .await;
    let leaving = events_of(&calls);
    let (_, _, note) = leaving
        .iter()
        .find(|(reason, _, _)| reason == "LeavingNode")
        .expect("LeavingNode");
    assert!(
        note.contains("leaves cordoned node a: moving from a [a-g0] to b [b-g0]"),
        "{note}"
    );
    let (status, reason, message) = on_cordoned(&calls).expect("OnCordonedNode");
    assert_eq!((status.as_str(), reason.as_str()), ("True", "Leaving"));
    assert!(
        message.contains("moving from a [a-g0] to b [b-g0]"),
        "{message}"
    );
    // The next records it, and nothing is deleted or evicted before the new
    // copy serves.
    let calls = serve_reconcile(&mut api, tokio::spawn(reconcile(Arc::new(small), ctx))).await;
    let (_, reason, message) = on_cordoned(&calls).expect("OnCordonedNode");
    assert_eq!(reason, "Leaving");
    assert!(
        message.contains("a move is under way (to leave cordoned node a)"),
        "{message}"
    );
    let status = written_status(&calls);
    let [record] = status.moves.as_slice() else {
        panic!("one move recorded: {:?}", status.moves)
    };
    assert_eq!(record.phase, MovePhase::Surging);
    assert_eq!(record.to, vec![shard("b", "b-g0", 1)]);
    assert_eq!(record.reason, "to leave cordoned node a");
    assert!(deleted(&calls).is_empty() && posted(&calls, "/eviction").is_empty());
}

#[tokio::test]
async fn a_replica_with_nowhere_to_go_stays_on_its_cordoned_node_and_says_so_once() {
    let small = small_with(shard("a", "a-g0", 0), Vec::new());
    let (ctx, mut api) = on(
        vec![cordoned("a", 2)],
        vec![ready_pod(&small, &shard("a", "a-g0", 0))],
        vec![small.clone()],
    );
    let calls = serve_reconcile(
        &mut api,
        tokio::spawn(reconcile(Arc::new(small.clone()), ctx.clone())),
    )
    .await;
    let events = events_of(&calls);
    let (_, kind, note) = events
        .iter()
        .find(|(reason, _, _)| reason == "CannotLeave")
        .expect("CannotLeave");
    assert_eq!(kind, "Warning");
    assert!(
        note.starts_with("ml/small replica 0 stays on a cordoned node: "),
        "{note}"
    );
    // The status says so too, while it stays.
    let (status, reason, message) = on_cordoned(&calls).expect("OnCordonedNode");
    assert_eq!((status.as_str(), reason.as_str()), ("True", "CannotLeave"));
    assert_eq!(&message, note);
    assert!(deleted(&calls).is_empty() && posted(&calls, "/eviction").is_empty());
    // Told once.
    let calls = serve_reconcile(&mut api, tokio::spawn(reconcile(Arc::new(small), ctx))).await;
    assert!(
        !events_of(&calls)
            .iter()
            .any(|(reason, _, _)| reason == "CannotLeave"),
        "{calls:?}"
    );
}

#[tokio::test]
async fn an_instance_that_never_moves_stays_on_its_cordoned_node() {
    let mut small = small_with(shard("a", "a-g0", 0), Vec::new());
    small.spec.placement.moves = tessera::api::Moves::Never;
    let (ctx, mut api) = on(
        vec![cordoned("a", 2), node("b", 1)],
        vec![ready_pod(&small, &shard("a", "a-g0", 0))],
        vec![small.clone()],
    );
    for _ in 0..2 {
        let calls = serve_reconcile(
            &mut api,
            tokio::spawn(reconcile(Arc::new(small.clone()), ctx.clone())),
        )
        .await;
        assert!(created_pods(&calls).is_empty(), "{calls:?}");
        assert!(
            calls
                .iter()
                .filter(|(_, path, _)| path.contains("/status?"))
                .all(|(_, _, body)| body["status"]["moves"].is_null()),
            "{calls:?}"
        );
    }
    let (ctx, mut api) = on(
        vec![cordoned("a", 2), node("b", 1)],
        vec![ready_pod(&small, &shard("a", "a-g0", 0))],
        vec![small.clone()],
    );
    let calls = serve_reconcile(&mut api, tokio::spawn(reconcile(Arc::new(small), ctx))).await;
    let (_, reason, message) = on_cordoned(&calls).expect("OnCordonedNode");
    assert_eq!(reason, "CannotLeave");
    assert_eq!(
        message,
        "on cordoned node a: its instance has placement.moves: Never; a drain evicts its pods as they are"
    );
}

#[tokio::test]
async fn an_instance_on_no_cordoned_node_has_no_cordon_condition() {
    let small = small_with(shard("a", "a-g0", 0), Vec::new());
    let (ctx, mut api) = on(
        vec![node("a", 2), cordoned("b", 1)],
        vec![ready_pod(&small, &shard("a", "a-g0", 0))],
        vec![small.clone()],
    );
    let calls = serve_reconcile(&mut api, tokio::spawn(reconcile(Arc::new(small), ctx))).await;
    assert_eq!(on_cordoned(&calls), None);
}

#[tokio::test]
async fn room_is_not_made_by_moving_a_replica_onto_a_node_its_pods_do_not_tolerate() {
    // `big` tolerates node b's taint and needs both GPUs of a; the only
    // place for `small` is b, whose taint small's pods do not tolerate.
    let small = small_with(shard("a", "a-g0", 0), Vec::new());
    let big = tolerating_dedicated(model("big", 2));
    let (ctx, mut api) = on(
        vec![node("a", 2), dedicated(node("b", 1))],
        vec![ready_pod(&small, &shard("a", "a-g0", 0))],
        vec![small.clone(), big.clone()],
    );
    let calls = serve_reconcile(&mut api, tokio::spawn(reconcile(Arc::new(big), ctx))).await;
    let placed = written_status(&calls)
        .conditions
        .into_iter()
        .find(|c| c.type_ == "Placed")
        .expect("Placed");
    assert_eq!(placed.status, "False");
    assert!(
        placed.message.contains(
            "no moves make room: the moves found take a replica to b, whose taints its pods do not tolerate"
        ),
        "{}",
        placed.message
    );
    assert!(
        !reasons(&calls).contains(&"MakingRoom".to_string()),
        "{calls:?}"
    );
}

#[tokio::test]
async fn a_replica_does_not_leave_its_cordoned_node_for_one_its_pods_do_not_tolerate() {
    let small = small_with(shard("a", "a-g0", 0), Vec::new());
    let (ctx, mut api) = on(
        vec![cordoned("a", 2), dedicated(node("b", 1))],
        vec![ready_pod(&small, &shard("a", "a-g0", 0))],
        vec![small.clone()],
    );
    let calls = serve_reconcile(&mut api, tokio::spawn(reconcile(Arc::new(small), ctx))).await;
    let (status, reason, message) = on_cordoned(&calls).expect("OnCordonedNode");
    assert_eq!((status.as_str(), reason.as_str()), ("True", "CannotLeave"));
    assert!(
        message.contains("the move found takes it to b, whose taints its pods do not tolerate"),
        "{message}"
    );
    assert!(
        !reasons(&calls).contains(&"LeavingNode".to_string()),
        "{calls:?}"
    );
    assert!(created_pods(&calls).is_empty() && posted(&calls, "/eviction").is_empty());
}

/// Node n of the issue that made room the default: four H100s (n-g0..3)
/// and four A100s of 80 GB (n-g4..7).
fn h100s_and_a100s(name: &str) -> k8s_openapi::api::core::v1::Node {
    let mut node = node(name, 8);
    let annotations = node
        .metadata
        .annotations
        .get_or_insert_with(Default::default);
    let mut state: Value = serde_json::from_str(&annotations["tessera.dev/gpu-state"]).unwrap();
    for device in state["devices"].as_array_mut().unwrap().iter_mut().skip(4) {
        device["product"] = json!("NVIDIA A100-SXM4-80GB");
        device["fp16Tflops"] = json!(312.0);
        device["memoryBandwidthGbps"] = json!(2039.0);
    }
    annotations.insert("tessera.dev/gpu-state".into(), state.to_string());
    node
}

/// The `Placed` message the 34B's reconcile writes on node n of
/// [`h100s_and_a100s`], where a 1.2B replica with `serving` holds n-g0 (an
/// H100) and the 34B may only use H100s and asks for four; and the Event
/// reasons.
async fn the_34b_beside_a_small_replica(serving: Value) -> (String, Vec<String>) {
    let mut small = model("small", 1);
    small.spec.model.parameters_billions = 1.2;
    small.spec.model.layers = 16;
    small.spec.model.kv_cache_gib = None;
    small.spec.serving = serde_json::from_value(serving).unwrap();
    let at_g0 = PlannedShard {
        layer_end: 16,
        predicted_memory_gib: 4.0,
        ..shard("n", "n-g0", 0)
    };
    small.status = Some(running(&small, vec![at_g0.clone()]));
    let mut big = model("big", 4);
    big.spec.model.parameters_billions = 34.0;
    big.spec.model.layers = 48;
    big.spec.model.kv_cache_gib = None;
    big.spec.placement.products = vec!["H100".into()];
    let pod = ready_pod(&small, &at_g0);
    let (ctx, mut api) = on(
        vec![h100s_and_a100s("n")],
        vec![pod],
        vec![small, big.clone()],
    );
    let calls = serve_reconcile(&mut api, tokio::spawn(reconcile(Arc::new(big), ctx))).await;
    let placed = written_status(&calls)
        .conditions
        .into_iter()
        .find(|c| c.type_ == "Placed")
        .map(|c| c.message)
        .unwrap_or_default();
    (placed, reasons(&calls))
}

#[tokio::test]
async fn a_small_replica_makes_way_on_a_slower_gpu_where_it_still_meets_its_target() {
    // The 1.2B serves less on an A100 but still meets 50 ms a token there,
    // so by default it moves (make before break) and the 34B gets the four
    // H100s.
    let (placed, reasons) = the_34b_beside_a_small_replica(Value::Null).await;
    assert!(
        placed.contains("making room: moving ml/small replica 0 from n [n-g0] to n [n-g"),
        "{placed}"
    );
    // To an A100: the only GPUs the 34B does not need.
    let to = placed.split("to n [n-g").nth(1).unwrap_or_default();
    assert!(
        ["4]", "5]", "6]", "7]"].iter().any(|d| to.starts_with(d)),
        "{placed}"
    );
    assert!(reasons.contains(&"MakingRoom".to_string()), "{reasons:?}");
}

#[tokio::test]
async fn no_replica_makes_way_where_its_instance_would_fall_short_of_its_demand() {
    // The 1.2B instance asks for 25 requests/s: one replica serves 38.5 on
    // an H100 and 18.3 on an A100, so it stays, and the refusal says why.
    let (placed, _) = the_34b_beside_a_small_replica(json!({"requestsPerSecond": 25})).await;
    assert!(
        placed.contains("no moves make room")
            && placed.contains("moving ml/small replica 0 would leave ml/small short")
            && placed.contains("below its demand of 25.00"),
        "{placed}"
    );
}
