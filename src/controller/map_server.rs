//! The live cluster map on its own port: `/` draws every node's GPUs and who
//! holds them, `/instances/<namespace>/<name>` one instance's plan, what the
//! speed model makes of it, its conditions and last events. Read-only, and
//! drawn from the controller's caches: a page view makes no API request.
//! Only the leader has caches; a standby answers 503.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use axum::Router;
use axum::extract::{Path, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use kube::ResourceExt;

use super::context::Context;
use super::held::{Claims, Held};
use super::nodes::{NodeInfo, Readiness};
use super::observe::{held_except, observe_cluster};
use crate::cluster_map::{
    ClusterView, Curve, MapCondition, MapEvent, MapInstance, MapNode, Prediction, cluster_page,
    instance_page,
};
use tessera_core::api::{ModelInstance, PlannedShard};
use tessera_core::translate::{
    ClusterNode, HeldShares, build_problem, evaluate_placed, placed_capacity,
};

/// Where the map finds the controller's caches once this replica leads.
pub(crate) type MapSource = Arc<Mutex<Option<Arc<Context>>>>;

pub(crate) fn router(source: MapSource) -> Router {
    Router::new()
        .route("/", get(cluster))
        .route("/instances/{namespace}/{name}", get(instance))
        .with_state(source)
}

fn context(source: &MapSource) -> Option<Arc<Context>> {
    super::lock(source).clone()
}

fn not_leader() -> Response {
    (
        StatusCode::SERVICE_UNAVAILABLE,
        "this controller replica stands by and has no caches to draw the map from: \
         port-forward to the leader, the pod named by the controller's Lease (spec.holderIdentity)\n",
    )
        .into_response()
}

fn html(page: String) -> Response {
    (
        [
            (header::CONTENT_TYPE, "text/html; charset=utf-8"),
            // The page is ours alone: no script runs, nothing is framed.
            (
                header::CONTENT_SECURITY_POLICY,
                "default-src 'none'; style-src 'unsafe-inline'; frame-ancestors 'none'",
            ),
        ],
        page,
    )
        .into_response()
}

async fn cluster(State(source): State<MapSource>) -> Response {
    match context(&source) {
        Some(ctx) => html(render_cluster(&ctx)),
        None => not_leader(),
    }
}

async fn instance(
    State(source): State<MapSource>,
    Path((namespace, name)): Path<(String, String)>,
) -> Response {
    let Some(ctx) = context(&source) else {
        return not_leader();
    };
    match render_instance(&ctx, &namespace, &name) {
        Some(page) => html(page),
        None => (
            StatusCode::NOT_FOUND,
            "no such ModelInstance in the controller's cache\n",
        )
            .into_response(),
    }
}

/// The map of the whole cluster as the caches have it now.
fn render_cluster(ctx: &Context) -> String {
    let observed = observe_cluster(ctx);
    let instances = ctx.caches.instances.state();
    let held = held_except(ctx, "", &instances, &Claims::default(), &observed);
    cluster_map(&observed.nodes, &instances, held)
}

/// The map of `nodes` with the plans of `instances`; `held` names who holds
/// devices outside them.
pub fn cluster_map(
    nodes: &[Arc<NodeInfo>],
    instances: &[Arc<ModelInstance>],
    held: Held,
) -> String {
    let mut instances: Vec<&ModelInstance> = instances.iter().map(AsRef::as_ref).collect();
    instances.sort_by_key(|mi| (mi.namespace(), mi.name_any()));
    let mut others = held.devices;
    add_shares(&mut others, &held.shares);
    let mut nodes: Vec<MapNode<'_>> = nodes
        .iter()
        .map(|info| MapNode {
            node: &info.gpus,
            excluded: excluded(info),
        })
        .collect();
    nodes.sort_by(|a, b| a.node.name.cmp(&b.node.name));
    cluster_page(&ClusterView {
        title: "live".to_string(),
        nodes,
        instances: instances
            .iter()
            .map(|mi| map_instance(mi, Judged::default(), Vec::new()))
            .collect(),
        others,
        instance_pages: true,
    })
}

/// One instance's page, `None` when the cache has no such instance.
fn render_instance(ctx: &Context, namespace: &str, name: &str) -> Option<String> {
    let mi = ctx
        .caches
        .instances
        .state()
        .into_iter()
        .find(|mi| mi.namespace().as_deref() == Some(namespace) && mi.name_any() == name)?;
    let observed = observe_cluster(ctx);
    let nodes: Vec<&ClusterNode> = observed.nodes.iter().map(|info| &info.gpus).collect();
    let judged = judged(&mi, &nodes);
    let events = ctx
        .event_log
        .recent(mi.metadata.uid.as_deref().unwrap_or_default())
        .into_iter()
        .map(|e| MapEvent {
            time: e.time.to_string(),
            warning: e.warning,
            reason: e.reason.to_string(),
            message: e.message,
        })
        .collect();
    Some(instance_page(&map_instance(&mi, judged, events)))
}

/// Memory shares held outside the plans, named on the GPU they share.
fn add_shares(others: &mut HashMap<(String, String), String>, shares: &HeldShares) {
    for (device, holders) in shares {
        let names: Vec<String> = holders
            .iter()
            .map(|(holder, bytes)| format!("{holder} ({} GiB)", bytes >> 30))
            .collect();
        others
            .entry(device.clone())
            .or_insert_with(|| names.join(", "));
    }
}

/// Why nothing new is placed on the node, as the map marks it. Taints are
/// named but not judged: an instance may tolerate them.
fn excluded(info: &NodeInfo) -> Option<String> {
    let mut why = Vec::new();
    if info.cordoned {
        why.push("cordoned".to_string());
    }
    if matches!(info.readiness, Readiness::NotReady { .. }) {
        why.push("not ready".to_string());
    }
    for taint in &info.taints {
        if taint.effect == "NoSchedule" || taint.effect == "NoExecute" {
            why.push(format!("taint {}:{}", taint.key, taint.effect));
        }
    }
    (!why.is_empty()).then(|| why.join(", "))
}

fn map_instance(mi: &ModelInstance, judged: Judged, events: Vec<MapEvent>) -> MapInstance {
    let status = mi.status.clone().unwrap_or_default();
    MapInstance {
        namespace: mi.namespace().unwrap_or_default(),
        name: mi.name_any(),
        model: mi.spec.model.name.clone(),
        phase: status
            .phase
            .map_or_else(|| "Pending".to_string(), |p| format!("{p:?}")),
        message: status.message,
        predicted_tokens_per_second: status.predicted_tokens_per_second,
        plan: status.plan,
        moves: status.moves,
        predictions: judged.predictions,
        curves: judged.curves,
        measured: status
            .replica_predictions
            .iter()
            .filter_map(|p| Some((p.replica, p.measured.clone()?)))
            .collect(),
        target_tpot_ms: mi
            .spec
            .serving
            .clone()
            .unwrap_or_default()
            .max_time_per_output_token_ms,
        conditions: status
            .conditions
            .into_iter()
            .map(|c| MapCondition {
                type_: c.type_,
                status: c.status,
                reason: c.reason,
                message: c.message,
            })
            .collect(),
        events,
    }
}

/// Each planned replica as the models judge it, by replica.
#[derive(Default)]
struct Judged {
    predictions: Vec<(u32, Prediction)>,
    curves: Vec<(u32, Curve)>,
}

/// Each planned replica judged by the speed and serving models on the
/// devices it was planned on, the nodes as they are now (nothing else held:
/// the parts describe the plan, not the competition for it).
fn judged(mi: &ModelInstance, nodes: &[&ClusterNode]) -> Judged {
    let plan = mi.status.as_ref().map_or(&[][..], |s| s.plan.as_slice());
    let mut replicas: Vec<u32> = plan.iter().map(|s| s.replica).collect();
    replicas.dedup();
    let mut judged = Judged::default();
    for replica in replicas {
        let shards: Vec<&PlannedShard> = plan.iter().filter(|s| s.replica == replica).collect();
        judged
            .predictions
            .push((replica, predict(mi, &shards, nodes)));
        judged.curves.push((
            replica,
            placed_capacity(
                &mi.spec,
                mi.status.as_ref().map_or(&[][..], |s| &s.corrections),
                nodes.iter().copied(),
                &shards,
            ),
        ));
    }
    judged
}

fn predict(mi: &ModelInstance, shards: &[&PlannedShard], nodes: &[&ClusterNode]) -> Prediction {
    let problem = build_problem(
        &mi.spec,
        nodes.iter().copied(),
        &HashMap::new(),
        &HeldShares::new(),
    );
    evaluate_placed(problem, shards)
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use axum::body::Body;
    use axum::http::Request;
    use k8s_openapi::api::core::v1::{Node, Pod};
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
    use kube::runtime::events::{Recorder, Reporter};
    use kube::runtime::{reflector, watcher};
    use tower::ServiceExt;

    use super::*;
    use crate::controller::context::Caches;
    use crate::controller::events::EventNote;
    use crate::controller::metrics::Metrics;
    use crate::controller::node_cache::CachedNode;
    use crate::controller::testkit::{H100, SMALL, instance, node, node_with, now, state};
    use tessera_core::api::{DEVICES_ANNOTATION, ModelInstanceStatus, Phase};

    const HOSTILE: &str = "<script>alert('map')</script>";

    fn store<K>(objects: Vec<K>) -> reflector::Store<K>
    where
        K: kube::Resource<DynamicType = ()> + Clone + 'static,
    {
        let (store, mut writer) = reflector::store();
        writer.apply_watcher_event(&watcher::Event::Init);
        for object in objects {
            writer.apply_watcher_event(&watcher::Event::InitApply(object));
        }
        writer.apply_watcher_event(&watcher::Event::InitDone);
        store
    }

    fn running(name: &str, node: &str, device: &str) -> ModelInstance {
        let mut mi = instance(name, SMALL);
        mi.status = Some(ModelInstanceStatus {
            phase: Some(Phase::Running),
            plan: vec![PlannedShard {
                copy: 0,
                replica: 0,
                shard: 0,
                node: node.into(),
                devices: vec![device.into()],
                layer_start: 0,
                layer_end: 32,
                predicted_memory_gib: 16.0,
                share: None,
            }],
            conditions: vec![Condition {
                type_: "Ready".into(),
                status: "False".into(),
                reason: "Hostile".into(),
                message: HOSTILE.into(),
                last_transition_time: Time(now()),
                observed_generation: None,
            }],
            ..Default::default()
        });
        mi
    }

    /// A user's pod holding a device by the agent's allocation record.
    fn user_pod() -> Pod {
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": "notebook", "namespace": "team", "uid": "u-1",
                         "annotations": {DEVICES_ANNOTATION: "b-g1"}},
            "spec": {"nodeName": "b", "containers": []},
            "status": {"phase": "Running"},
        }))
        .unwrap()
    }

    /// A context over these caches whose client answers nothing: the test
    /// fails if a page view asks the API server.
    fn context(
        nodes: Vec<Node>,
        instances: Vec<ModelInstance>,
    ) -> (
        Arc<Context>,
        tower_test::mock::Handle<Request<kube::client::Body>, http::Response<kube::client::Body>>,
    ) {
        let (service, handle) = tower_test::mock::pair::<
            Request<kube::client::Body>,
            http::Response<kube::client::Body>,
        >();
        let client = kube::Client::new(service, "default");
        let caches = Caches {
            nodes: store(nodes.into_iter().map(CachedNode::from).collect()),
            pods: store(vec![user_pod()]),
            services: store(Vec::new()),
            instances: store(instances),
            dra: None,
        };
        let recorder = Recorder::new(
            client.clone(),
            Reporter {
                controller: "tessera-controller".into(),
                instance: None,
            },
        );
        let ctx = Context::new(
            client,
            Default::default(),
            caches,
            recorder,
            Arc::new(Metrics::default()),
        );
        (Arc::new(ctx), handle)
    }

    async fn get(app: Router, path: &str) -> (StatusCode, String) {
        let response = app
            .oneshot(Request::get(path).body(Body::empty()).unwrap())
            .await
            .unwrap();
        let status = response.status();
        let body = axum::body::to_bytes(response.into_body(), 1 << 24)
            .await
            .unwrap();
        (status, String::from_utf8(body.to_vec()).unwrap())
    }

    #[tokio::test]
    async fn the_map_is_drawn_from_the_caches_alone() {
        let mut cordoned = node("b", 2, H100);
        cordoned.spec = Some(k8s_openapi::api::core::v1::NodeSpec {
            unschedulable: Some(true),
            ..Default::default()
        });
        let mut sick = state("a", 2, H100);
        sick.devices[1].health = tessera_core::api::Health::Unhealthy;
        sick.devices[1].health_reason = Some("Xid 79".into());
        let (ctx, mut handle) = context(
            vec![node_with("a", &sick), cordoned],
            vec![running("llama", "a", "a-g0")],
        );
        ctx.event_log.record(
            "uid-llama",
            &[EventNote {
                warning: true,
                reason: "Moved",
                message: format!("moved {HOSTILE}"),
            }],
            now(),
            ["uid-llama"],
        );
        let source: MapSource = Arc::new(Mutex::new(None));
        let (status, _) = get(router(Arc::clone(&source)), "/").await;
        assert_eq!(
            status,
            StatusCode::SERVICE_UNAVAILABLE,
            "a standby has no caches"
        );
        *crate::controller::lock(&source) = Some(ctx);

        let (status, page) = get(router(Arc::clone(&source)), "/").await;
        assert_eq!(status, StatusCode::OK);
        for wanted in [
            "data-node=\"a\"",
            "data-node=\"b\"",
            "<b>0</b><span class=\"h c0\">ml/llama shard 0</span>",
            "data-unhealthy=\"Xid 79\"",
            "data-excluded=\"cordoned\"",
            "data-held-by=",
            "href=\"instances/ml/llama\"",
        ] {
            assert!(page.contains(wanted), "{wanted} not in\n{page}");
        }

        let (status, page) = get(router(Arc::clone(&source)), "/instances/ml/llama").await;
        assert_eq!(status, StatusCode::OK);
        assert!(!page.contains("<script"), "{page}");
        assert!(page.contains("moved &lt;script&gt;"), "{page}");
        assert!(page.contains("Replica 0: why this plan"), "{page}");
        assert!(page.contains("<th>all-reduce</th>"), "{page}");
        let (status, _) = get(router(Arc::clone(&source)), "/instances/ml/nobody").await;
        assert_eq!(status, StatusCode::NOT_FOUND);

        let asked = tokio::time::timeout(Duration::from_millis(50), handle.next_request()).await;
        assert!(asked.is_err(), "a page view asked the API server");
    }
}
