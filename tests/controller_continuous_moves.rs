//! Continuous moves in the controller's reconciles against a mocked API
//! server: off by default; on, a replica that misses its target on a slow
//! GPU while an H100 is free is handed its move after the first interval
//! and records it with what it gains; `placement.moves: Never` keeps it,
//! and so does a move under way elsewhere.

use std::sync::Arc;
use std::time::Duration;

use http::Method;
use k8s_openapi::api::core::v1::{Node, Pod};
use serde_json::{Value, json};
use tessera::api::{ModelInstance, ModelInstanceStatus, MoveInFlight, MovePhase, PlannedShard};
use tessera::controller::reconcile::{Context, ContinuousMoves, MoveSettings, Settings, reconcile};
use tower_test::mock;

#[path = "common/mock_api.rs"]
mod mock_api;
use mock_api::*;

/// A node of one GPU that decodes a 7B far slower than 50 ms a token.
fn slow_node(name: &str) -> Node {
    one_gpu_node(
        name,
        &[
            ("NVIDIA H100 80GB HBM3", "NVIDIA Slow 80GB"),
            ("\"fp16Tflops\":989.0", "\"fp16Tflops\":20.0"),
            (
                "\"memoryBandwidthGbps\":3350.0",
                "\"memoryBandwidthGbps\":150.0",
            ),
        ],
    )
}

fn model(name: &str, moves: &str) -> ModelInstance {
    serde_json::from_value(json!({
        "apiVersion": "tessera.dev/v1alpha1",
        "kind": "ModelInstance",
        "metadata": {"name": name, "namespace": "ml", "uid": format!("uid-{name}"), "generation": 1},
        "spec": {
            "model": {"name": name, "parametersBillions": 7, "layers": 32, "kvCacheGiB": 2},
            "parallelism": {"tensor": 1, "pipeline": 1},
            "placement": {"moves": moves},
            "template": {"spec": {"containers": [{"name": "shard", "image": "busybox:1.37"}]}},
        },
    }))
    .unwrap()
}

fn shard(node: &str, device: &str) -> PlannedShard {
    PlannedShard {
        replica: 0,
        copy: 0,
        shard: 0,
        node: node.into(),
        devices: vec![device.into()],
        layer_start: 0,
        layer_end: 32,
        predicted_memory_gib: 16.54,
        share: None,
    }
}

/// `mi` running on `at` with its one replica Ready, and its Ready pod.
fn serving(mut mi: ModelInstance, at: PlannedShard) -> (ModelInstance, Pod) {
    mi.status = Some(ModelInstanceStatus {
        replicas: 1,
        ready_replicas: 1,
        ..running(&mi, vec![at.clone()])
    });
    let pod = ready_pod(&mi, &at);
    (mi, pod)
}

fn settings(continuous: Option<ContinuousMoves>) -> Settings {
    Settings {
        moves: MoveSettings {
            continuous,
            ..MoveSettings::default()
        },
        ..Settings::default()
    }
}

/// Continuous moves looking at every reconcile after the first.
fn every_time() -> Option<ContinuousMoves> {
    Some(ContinuousMoves {
        min_gain: 0.2,
        interval: Duration::ZERO,
    })
}

/// Node a (one slow GPU), node b (one H100) and node c (two H100s).
fn on(
    pods: Vec<Pod>,
    instances: Vec<ModelInstance>,
    settings: Settings,
) -> (Arc<Context>, ApiHandle) {
    let (service, api) = mock::pair();
    let world = World {
        nodes: vec![slow_node("a"), node("b", 1), node("c", 2)],
        pods,
        services: vec![],
        instances,
    };
    (
        context_with(world, kube::Client::new(service, "default"), None, settings),
        api,
    )
}

/// The moves each of `times` reconciles of `mi` wrote into its status.
async fn reconciled(
    mi: &ModelInstance,
    ctx: &Arc<Context>,
    api: &mut ApiHandle,
    times: usize,
) -> Vec<Vec<MoveInFlight>> {
    let mut written = Vec::new();
    for _ in 0..times {
        let calls = serve_reconcile(
            api,
            tokio::spawn(reconcile(Arc::new(mi.clone()), ctx.clone())),
        )
        .await;
        written.push(statuses(&calls).into_iter().flat_map(|s| s.moves).collect());
    }
    written
}

fn statuses(calls: &[(Method, String, Value)]) -> Vec<ModelInstanceStatus> {
    calls
        .iter()
        .filter(|(_, path, _)| path.contains("/status?"))
        .filter_map(|(_, _, body)| serde_json::from_value(body["status"].clone()).ok())
        .collect()
}

#[tokio::test]
async fn a_replica_missing_its_target_moves_to_a_free_gpu_that_meets_it_only_when_asked() {
    let (small, pod) = serving(model("small", "Allowed"), shard("a", "a-g0"));

    // Off by default: the replica stays on its slow GPU.
    let (ctx, mut api) = on(vec![pod.clone()], vec![small.clone()], settings(None));
    let written = reconciled(&small, &ctx, &mut api, 3).await;
    assert!(written.iter().all(Vec::is_empty), "{written:?}");

    // On: the first look only starts the clock, the next hands the move,
    // and the reconcile after that records it, make before break.
    let (ctx, mut api) = on(vec![pod], vec![small.clone()], settings(every_time()));
    let written = reconciled(&small, &ctx, &mut api, 3).await;
    assert!(
        written[0].is_empty() && written[1].is_empty(),
        "{written:?}"
    );
    let [record] = written[2].as_slice() else {
        panic!("one move recorded: {written:?}")
    };
    assert_eq!(record.phase, MovePhase::Surging);
    assert_eq!(record.from, vec![shard("a", "a-g0")]);
    assert_eq!(record.to[0].node, "b");
    assert_eq!(record.to[0].copy, 1);
    assert!(
        record.reason.starts_with("to serve more: ")
            && record
                .reason
                .contains("instead of 0.0 for the 1 replica(s) moved"),
        "{}",
        record.reason
    );
}

#[tokio::test]
async fn a_continuous_move_goes_only_to_a_node_whose_taints_the_pods_tolerate() {
    let looked = |(mi, pod): (ModelInstance, Pod)| async move {
        let (service, mut api) = mock::pair();
        let world = World {
            nodes: vec![slow_node("a"), dedicated(node("b", 1))],
            pods: vec![pod],
            services: vec![],
            instances: vec![mi.clone()],
        };
        let ctx = context_with(
            world,
            kube::Client::new(service, "default"),
            None,
            settings(every_time()),
        );
        reconciled(&mi, &ctx, &mut api, 3).await
    };
    // The one H100 is tainted: the replica stays on its slow GPU.
    let small = model("small", "Allowed");
    let written = looked(serving(small.clone(), shard("a", "a-g0"))).await;
    assert!(written.iter().all(Vec::is_empty), "{written:?}");
    // Its pods tolerating the taint, it moves there.
    let written = looked(serving(tolerating_dedicated(small), shard("a", "a-g0"))).await;
    let [record] = written[2].as_slice() else {
        panic!("one move recorded: {written:?}")
    };
    assert_eq!(record.to[0].node, "b");
}

#[tokio::test]
async fn an_instance_that_never_moves_or_a_move_under_way_keeps_the_replica_where_it_is() {
    let (fixed, pod) = serving(model("small", "Never"), shard("a", "a-g0"));
    let (ctx, mut api) = on(vec![pod], vec![fixed.clone()], settings(every_time()));
    let written = reconciled(&fixed, &ctx, &mut api, 3).await;
    assert!(written.iter().all(Vec::is_empty), "{written:?}");

    // Another instance's move in flight (on node c, b stays free), though
    // two may be: continuous moves wait for it.
    let (small, pod) = serving(model("small", "Allowed"), shard("a", "a-g0"));
    let (mut other, _) = serving(model("other", "Allowed"), shard("c", "c-g1"));
    if let Some(status) = other.status.as_mut() {
        status.moves = vec![MoveInFlight {
            replica: 0,
            phase: MovePhase::Draining,
            from: vec![shard("c", "c-g0")],
            to: vec![shard("c", "c-g1")],
            started: k8s_openapi::jiff::Timestamp::now().to_string(),
            reason: "to make room for ml/big replica 0".into(),
            waiting: None,
        }];
    }
    let mut two_at_once = settings(every_time());
    two_at_once.moves.max_in_flight = 2;
    let (ctx, mut api) = on(vec![pod], vec![small.clone(), other], two_at_once);
    let written = reconciled(&small, &ctx, &mut api, 3).await;
    assert!(written.iter().all(Vec::is_empty), "{written:?}");
}
