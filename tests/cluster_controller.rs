//! The controller against a real API server (no kubelet needed).
//!
//! Runs only when `TESSERA_TEST_KUBECONFIG` names a kubeconfig; otherwise it
//! says it was skipped and passes. The kubeconfig's user needs cluster-admin
//! rights or close: it applies the ModelInstance CRD (server-side apply; an
//! installed CRD of the same name is updated to this build's), creates a
//! namespace and three Nodes, and runs two `tessera controller` processes
//! with a per-vendor resource name (`tessera.dev/{vendor}-gpu`), so the API
//! server accepts or refuses the shard pods' vendor resources for real.
//!
//! What stands in for the parts of a cluster that are not needed: the test
//! keeps its Nodes' Ready condition fresh (so the node lifecycle controller
//! leaves them alone), writes their `tessera.dev/gpu-state` annotations as an
//! agent would, and finishes the termination of deleted pods as a kubelet
//! would. Shard pods therefore stay Pending, but creation, binding, status,
//! events, leader election and garbage collection are all real.
//!
//! Everything it creates carries the label `tessera.dev/test=true` and is
//! deleted at the end, also when an assertion fails (Nodes with their UID as
//! a precondition). The Nodes are tainted `tessera.dev/test=true:NoSchedule`
//! so nothing else lands on them, and the test's instances select them by a
//! per-run label, so real GPU nodes in the cluster are never planned on.
//! Leftovers of a killed run: `kubectl get nodes,ns -l tessera.dev/test=true`.
//! Run it against a cluster without a cloud provider (kind, k3d): a cloud node
//! lifecycle controller deletes Nodes that have no machine behind them.

#[path = "common/real_cluster.rs"]
mod real_cluster;

use std::collections::BTreeMap;
use std::hash::{BuildHasher, Hasher};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Namespace, Node, Pod};
use k8s_openapi::api::events::v1::Event;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams, Preconditions};
use kube::{Client, Config, ResourceExt};
use real_cluster::{http_get, install_crd, kubeconfig_path, load_config};
use serde_json::json;
use tessera::api::{GPU_STATE_ANNOTATION, ModelInstance, Phase};
use tokio::time::{Instant, sleep, timeout};

const TEST_LABEL: &str = "tessera.dev/test";
const RUN_LABEL: &str = "tessera.dev/test-run";
const LEASE: &str = "tessera-test-controller";
/// Bound on every single API call.
const CALL: Duration = Duration::from_secs(20);
/// How long a reconcile result may take to show.
const SETTLE: Duration = Duration::from_secs(90);

#[tokio::test]
async fn the_controller_places_binds_repairs_and_cleans_up() {
    let Some(path) = kubeconfig_path() else {
        return;
    };
    let config = load_config(&path).await;
    let client = Client::try_from(config.clone()).expect("a client from the kubeconfig");

    let run = run_token();
    let ns = format!("tessera-test-{run}");
    // Dropped last: deletes what the test created, whatever happened.
    let mut cleanup = Cleanup::new(config.clone(), ns.clone());
    install_crd(&client).await;
    create_namespace(&client, &ns, &run, &mut cleanup).await;
    let nodes: Api<Node> = Api::all(client.clone());
    let gpu_nodes = [
        (
            format!("tessera-test-{run}-h100"),
            gpu_state("h100", 4, &H100),
        ),
        (
            format!("tessera-test-{run}-mi300x"),
            gpu_state("mi300x", 2, &MI300X),
        ),
        (
            format!("tessera-test-{run}-rtx"),
            gpu_state("rtx", 4, &RTX4090),
        ),
    ];
    for (name, state) in &gpu_nodes {
        create_node(&nodes, name, state, &run, &mut cleanup).await;
    }
    let _heartbeat = Background::spawn(heartbeat(
        nodes.clone(),
        gpu_nodes.iter().map(|n| n.0.clone()).collect(),
    ));
    let pods: Api<Pod> = Api::namespaced(client.clone(), &ns);
    let _kubelet = Background::spawn(finish_terminations(pods.clone()));

    // Two controllers; exactly one may act.
    let scratch = std::env::temp_dir().join(format!("tessera-test-{run}"));
    std::fs::create_dir_all(&scratch).expect("a scratch directory");
    let mut a = ControllerProcess::start(&path, &ns, "ctl-a", &scratch);
    let mut b = ControllerProcess::start(&path, &ns, "ctl-b", &scratch);
    let leases: Api<Lease> = Api::namespaced(client.clone(), &ns);
    let leader = wait(SETTLE, "a controller to take the lease", || async {
        let lease = leases.get_opt(LEASE).await.ok().flatten()?;
        lease.spec?.holder_identity.filter(|h| !h.is_empty())
    })
    .await;
    let (leader_proc, standby_proc) = if leader == "ctl-a" {
        (&mut a, &mut b)
    } else {
        (&mut b, &mut a)
    };
    println!("leader: {leader}");

    // 1. The examples are planned and every shard is bound where planned.
    let instances: Api<ModelInstance> = Api::namespaced(client.clone(), &ns);
    for file in ["llama-7b.yaml", "llama-70b.yaml"] {
        let mi = example(file, &ns, &run);
        instances
            .create(&PostParams::default(), &mi)
            .await
            .unwrap_or_else(|e| panic!("creating {file}: {e}"));
    }
    for name in ["llama-7b", "llama-70b"] {
        let mi = wait_bound(&instances, &pods, &nodes, name, &[]).await;
        let status = mi.status.as_ref().expect("a status");
        assert_eq!(
            status.phase,
            Some(Phase::Bound),
            "no kubelet: shards stay Pending once bound"
        );
        assert_eq!(status.observed_generation, mi.metadata.generation);
        let placed = status
            .conditions
            .iter()
            .find(|c| c.type_ == "Placed")
            .expect("a Placed condition");
        assert_eq!(placed.status, "True", "{placed:?}");
        for s in &status.plan {
            assert!(
                gpu_nodes.iter().any(|(n, _)| *n == s.node),
                "{name} shard {} is planned on {}, not on a test node",
                s.shard,
                s.node
            );
        }
        let reasons = reasons_from(&client, &ns, name, &leader, &["Planned", "Bound"]).await;
        for want in ["Planned", "Bound"] {
            assert!(
                reasons.iter().any(|r| r == want),
                "{name}: events {reasons:?} lack {want}"
            );
        }
    }
    assert_eq!(
        metric(standby_proc.port, "tessera_controller_leader"),
        Some(0.0)
    );
    assert_eq!(
        metric(leader_proc.port, "tessera_controller_leader"),
        Some(1.0)
    );

    // 2. A planned device fails: only its shard moves, to healthy devices.
    let before = instances
        .get("llama-70b")
        .await
        .expect("llama-70b")
        .status
        .expect("a status")
        .plan;
    let victim = before[0].clone();
    let (_, state) = gpu_nodes
        .iter()
        .find(|(n, _)| *n == victim.node)
        .expect("a test node");
    let mut state = state.clone();
    for d in state["devices"].as_array_mut().expect("devices") {
        if d["id"] == json!(victim.devices[0]) {
            d["health"] = json!("Unhealthy");
            d["healthReason"] = json!("Xid 79: GPU has fallen off the bus");
        }
    }
    publish_state(&nodes, &victim.node, &state).await;
    let mi = wait_bound(&instances, &pods, &nodes, "llama-70b", &victim.devices).await;
    let after = &mi.status.as_ref().expect("a status").plan;
    assert!(
        !after[0].devices.contains(&victim.devices[0]),
        "shard 0 still on the failed device"
    );
    for (old, new) in before.iter().zip(after).skip(1) {
        assert_eq!(old, new, "a healthy shard moved");
    }
    let reasons = reasons_from(&client, &ns, "llama-70b", &leader, &["Replanned"]).await;
    assert!(
        reasons.iter().any(|r| r == "Replanned"),
        "events: {reasons:?}"
    );

    // 3. An instance nothing can hold says why, and gets no pods.
    let mut huge = example("llama-405b.yaml", &ns, &run);
    huge.metadata.name = Some("too-big".into());
    huge.spec.model.parameters_billions = 5000.0;
    instances
        .create(&PostParams::default(), &huge)
        .await
        .expect("creating too-big");
    let message = wait(SETTLE, "too-big to be reported unsatisfiable", || async {
        let mi = instances.get("too-big").await.ok()?;
        let status = mi.status?;
        (status.phase == Some(Phase::Pending)).then_some(())?;
        let c = status
            .conditions
            .into_iter()
            .find(|c| c.type_ == "Placed" && c.status == "False")?;
        (c.reason == "Unsatisfiable").then_some(c.message)
    })
    .await;
    assert!(
        message.contains("GiB"),
        "not an actionable reason: {message}"
    );
    let too_big_pods = pods
        .list(&ListParams::default().labels("tessera.dev/instance=too-big"))
        .await
        .expect("pods");
    assert!(
        too_big_pods.items.is_empty(),
        "an unsatisfiable instance got pods"
    );

    // 4. The leader stops; the standby takes over and repairs a deleted shard.
    let code = leader_proc.terminate();
    assert_eq!(
        code,
        Some(0),
        "the leader did not exit cleanly on SIGTERM\n{}",
        leader_proc.log_tail()
    );
    let successor = if leader == "ctl-a" { "ctl-b" } else { "ctl-a" };
    wait(SETTLE, "the standby to take the lease", || async {
        let lease = leases.get_opt(LEASE).await.ok().flatten()?;
        (lease.spec?.holder_identity.as_deref() == Some(successor)).then_some(())
    })
    .await;
    let old = pods
        .get("llama-7b-shard-0")
        .await
        .expect("llama-7b-shard-0");
    pods.delete("llama-7b-shard-0", &DeleteParams::default())
        .await
        .expect("deleting a shard pod");
    wait(
        SETTLE,
        "llama-7b-shard-0 to be recreated and bound",
        || async {
            let p = pods.get_opt("llama-7b-shard-0").await.ok().flatten()?;
            (p.metadata.uid != old.metadata.uid && p.spec.as_ref()?.node_name.is_some())
                .then_some(())
        },
    )
    .await;
    // The Event is written after the binding: on a loaded machine it can
    // show up a moment after the pod does.
    let found = tokio::time::timeout(SETTLE, async {
        loop {
            let events = events_about(&client, &ns, "llama-7b").await;
            if events
                .iter()
                .any(|(r, who)| r == "Bound" && who == successor)
            {
                return;
            }
            sleep(Duration::from_millis(500)).await;
        }
    })
    .await;
    let events = events_about(&client, &ns, "llama-7b").await;
    assert!(found.is_ok(), "the successor did not bind: {events:?}");
    assert_eq!(
        metric(standby_proc.port, "tessera_controller_leader"),
        Some(1.0)
    );

    // 5. Replicas, driven through the scale subresource as a
    // HorizontalPodAutoscaler drives them.
    scale_replicas(&instances, &pods, &ns, &run).await;
    serve_a_demand(&instances, &pods, &ns, &run).await;

    // 6. Deleting an instance takes its pods and Service with it.
    for name in ["llama-7b", "llama-70b", "too-big", "served"] {
        instances
            .delete(name, &DeleteParams::default())
            .await
            .expect("deleting an instance");
    }
    wait(
        SETTLE,
        "the shard pods to be garbage-collected (is kube-controller-manager running?)",
        || async {
            let left = pods
                .list(&ListParams::default().labels("tessera.dev/instance"))
                .await
                .ok()?;
            left.items.is_empty().then_some(())
        },
    )
    .await;
    drop((a, b));
    cleanup.finish().await;
}

/// The bound shard pods of instance `name`, by pod name, with their UIDs.
async fn bound_pods(pods: &Api<Pod>, name: &str) -> Option<BTreeMap<String, String>> {
    let list = pods
        .list(&ListParams::default().labels(&format!("tessera.dev/instance={name}")))
        .await
        .ok()?;
    Some(
        list.items
            .iter()
            .filter(|p| p.metadata.deletion_timestamp.is_none())
            .filter(|p| p.spec.as_ref().and_then(|s| s.node_name.as_ref()).is_some())
            .map(|p| (p.name_any(), p.metadata.uid.clone().unwrap_or_default()))
            .collect(),
    )
}

/// Starts the bound pods of instance `name` as a kubelet would (phase
/// Running): no kubelet runs the test nodes, and the controller binds the
/// next same-sized pod on a node only once the last one is admitted (or its
/// hold, 30 s, has passed).
async fn admit(pods: &Api<Pod>, name: &str) {
    let running = json!({"status": {"phase": "Running"}});
    for pod in bound_pods(pods, name).await.unwrap_or_default().keys() {
        let _ = pods
            .patch_status(pod, &PatchParams::default(), &Patch::Strategic(&running))
            .await;
    }
}

/// Scales the one-GPU `served` instance through `/scale`: up, past what the
/// test nodes hold (the placed replicas stay, the rest wait with a reason),
/// and down to one (the costliest per request go).
async fn scale_replicas(instances: &Api<ModelInstance>, pods: &Api<Pod>, ns: &str, run: &str) {
    let mut served = example("llama-7b.yaml", ns, run);
    served.metadata.name = Some("served".into());
    served.spec.replicas = 2;
    served.spec.placement.strategy = tessera::api::Strategy::Spread;
    instances
        .create(&PostParams::default(), &served)
        .await
        .expect("creating served");
    // No agent reports allocations here: same-sized shards on one node are
    // bound one per hold period unless started (`admit`). Room for the holds.
    let bind = SETTLE * 3;
    wait(bind, "served's 2 replicas to be bound", || async {
        admit(pods, "served").await;
        let mi = instances.get("served").await.ok()?;
        (mi.status?.replicas == 2).then_some(())
    })
    .await;
    let scale = instances
        .get_scale("served")
        .await
        .expect("GET served/scale");
    assert_eq!(scale.spec.and_then(|s| s.replicas), Some(2));
    let scale_status = scale.status.expect("a scale status");
    assert_eq!(scale_status.replicas, 2);
    assert_eq!(
        scale_status.selector.as_deref(),
        Some("tessera.dev/instance=served")
    );

    let patch = |replicas: u32| json!({"spec": {"replicas": replicas}});
    instances
        .patch_scale("served", &PatchParams::default(), &Patch::Merge(&patch(3)))
        .await
        .expect("scaling served to 3");
    let three = wait(bind, "served's 3 replicas to be bound", || async {
        admit(pods, "served").await;
        let mi = instances.get("served").await.ok()?;
        (mi.status?.replicas == 3).then_some(())?;
        bound_pods(pods, "served").await
    })
    .await;
    assert!(three.contains_key("served-r2-shard-0"), "{three:?}");

    // More than the test nodes hold: the placed replicas stay, the rest say why.
    instances
        .patch_scale("served", &PatchParams::default(), &Patch::Merge(&patch(40)))
        .await
        .expect("scaling served to 40");
    let message = wait(
        SETTLE,
        "served to say how many of 40 replicas are placed",
        || async {
            let mi = instances.get("served").await.ok()?;
            let placed = mi
                .status?
                .conditions
                .into_iter()
                .find(|c| c.type_ == "Placed" && c.status == "False")?;
            placed
                .message
                .contains("of 40 replicas placed")
                .then_some(placed.message)
        },
    )
    .await;
    assert!(message.contains("no placement"), "{message}");
    let now = bound_pods(pods, "served").await.expect("pods");
    for (pod, uid) in &three {
        assert_eq!(
            now.get(pod),
            Some(uid),
            "{pod} was recreated while scaling up"
        );
    }

    // Down to one: the replica that serves the most requests/s on its one
    // GPU stays as it was (the lowest number of those within 1%), the
    // costlier ones go.
    let placed = instances
        .get("served")
        .await
        .expect("GET served")
        .status
        .expect("served's status")
        .replica_predictions;
    let best = placed
        .iter()
        .filter_map(|p| p.capacity.as_ref().map(|c| c.requests_per_second))
        .fold(0.0, f64::max);
    let stays = placed
        .iter()
        .filter(|p| {
            p.capacity
                .as_ref()
                .is_some_and(|c| c.requests_per_second >= best * 0.99)
        })
        .map(|p| p.replica)
        .min()
        .expect("a placed replica with a capacity");
    let stays_pod = match stays {
        0 => "served-shard-0".to_string(),
        r => format!("served-r{r}-shard-0"),
    };
    let before = bound_pods(pods, "served").await.expect("pods");
    instances
        .patch_scale("served", &PatchParams::default(), &Patch::Merge(&patch(1)))
        .await
        .expect("scaling served to 1");
    wait(SETTLE, "served to shrink to one replica", || async {
        let mi = instances.get("served").await.ok()?;
        let status = mi.status?;
        (status.plan.len() == 1 && status.replicas == 1).then_some(())?;
        let left = pods
            .list(&ListParams::default().labels("tessera.dev/instance=served"))
            .await
            .ok()?;
        (left.items.len() == 1).then_some(())
    })
    .await;
    let mi = instances.get("served").await.expect("GET served");
    let plan = mi.status.expect("served's status").plan;
    assert_eq!(plan[0].replica, stays, "{placed:?}");
    let left = bound_pods(pods, "served").await.expect("pods");
    assert!(before.contains_key(&stays_pod), "{before:?}");
    assert_eq!(
        left.get(&stays_pod),
        before.get(&stays_pod),
        "replica {stays} was recreated while scaling down"
    );
}

/// An instance sized by its demand: with a small one, one replica that meets
/// it once its pods are ready (`ReplicasStarting` before); with one no
/// cluster serves, as many replicas as fit and `DemandMet` false with what
/// they serve. The capacity is in the status either way.
async fn serve_a_demand(instances: &Api<ModelInstance>, pods: &Api<Pod>, ns: &str, run: &str) {
    let mut demanded = example("llama-7b.yaml", ns, run);
    demanded.metadata.name = Some("demanded".into());
    demanded.spec.serving = Some(tessera::api::ServingSpec {
        requests_per_second: Some(0.5),
        replicas_from_demand: true,
        ..Default::default()
    });
    instances
        .create(&PostParams::default(), &demanded)
        .await
        .expect("creating demanded");
    let condition = |met: &'static str| {
        move |mi: ModelInstance| {
            let status = mi.status?;
            let condition = status
                .conditions
                .iter()
                .find(|c| c.type_ == "DemandMet" && c.status == met)?
                .clone();
            Some((status, condition))
        }
    };
    let (_, starting) = wait(SETTLE, "demanded to wait for its replica", || async {
        condition("False")(instances.get("demanded").await.ok()?)
    })
    .await;
    assert_eq!(starting.reason, "ReplicasStarting", "{}", starting.message);
    // No kubelet runs these nodes: the pods are made Ready as one would.
    let ready = json!({"status": {"phase": "Running", "conditions": [
        {"type": "Ready", "status": "True"},
        {"type": "tessera.dev/serving", "status": "True"},
    ]}});
    for pod in pods
        .list(&ListParams::default().labels("tessera.dev/instance=demanded"))
        .await
        .expect("demanded's pods")
    {
        pods.patch_status(
            &pod.name_any(),
            &PatchParams::default(),
            &Patch::Strategic(&ready),
        )
        .await
        .expect("making demanded's pod Ready");
    }
    let (status, met) = wait(SETTLE, "demanded to meet its demand", || async {
        condition("True")(instances.get("demanded").await.ok()?)
    })
    .await;
    let capacity = status.capacity.expect("the instance's capacity");
    assert!(capacity.requests_per_second >= 0.5, "{capacity:?}");
    assert_eq!(capacity.demand_requests_per_second, Some(0.5));
    assert!(
        status.replica_predictions[0].capacity.is_some(),
        "{:?}",
        status.replica_predictions
    );
    assert!(
        met.message.starts_with("1 replica serve"),
        "{}",
        met.message
    );
    instances
        .patch(
            "demanded",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"serving": {"requestsPerSecond": 1000000}}})),
        )
        .await
        .expect("raising the demand");
    let (status, unmet) = wait(SETTLE, "demanded to say its demand is not met", || async {
        condition("False")(instances.get("demanded").await.ok()?)
    })
    .await;
    assert_eq!(unmet.reason, "DemandNotMet");
    assert!(
        unmet.message.contains("of 1000000 requests/s"),
        "{}",
        unmet.message
    );
    assert!(
        status.replica_predictions.len() > 1,
        "{:?}",
        status.replica_predictions
    );
    instances
        .delete("demanded", &Default::default())
        .await
        .expect("deleting demanded");
}

/// Waits until `probe` answers, polling every half second; panics after `limit`.
async fn wait<T, F, Fut>(limit: Duration, what: &str, mut probe: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let start = Instant::now();
    loop {
        if let Ok(Some(v)) = timeout(CALL, probe()).await {
            return v;
        }
        if start.elapsed() > limit {
            panic!("waited {limit:?} for {what}");
        }
        sleep(Duration::from_millis(500)).await;
    }
}

/// The vendor of a shard's first planned device, from its Node's GPU state.
async fn planned_vendor(
    nodes: &Api<Node>,
    shard: &tessera::api::PlannedShard,
) -> Result<String, String> {
    let node = timeout(CALL, nodes.get(&shard.node))
        .await
        .map_err(|_| "no answer".to_string())?
        .map_err(|e| e.to_string())?;
    let state: serde_json::Value = node
        .annotations()
        .get(GPU_STATE_ANNOTATION)
        .and_then(|a| serde_json::from_str(a).ok())
        .ok_or(format!("node {} has no GPU state", shard.node))?;
    let first = shard.devices.first().ok_or("a shard without devices")?;
    state["devices"]
        .as_array()
        .and_then(|d| d.iter().find(|d| d["id"] == json!(first)))
        .and_then(|d| d["vendor"].as_str())
        .map(str::to_string)
        .ok_or(format!("node {} does not list {first}", shard.node))
}

/// Waits until the instance has a plan avoiding `not_on` and every shard pod
/// is bound to its planned node with its planned devices.
async fn wait_bound(
    instances: &Api<ModelInstance>,
    pods: &Api<Pod>,
    nodes: &Api<Node>,
    name: &str,
    not_on: &[String],
) -> ModelInstance {
    let start = Instant::now();
    loop {
        let why = match check_bound(instances, pods, nodes, name, not_on).await {
            Ok(mi) => return mi,
            Err(why) => why,
        };
        if start.elapsed() > SETTLE {
            panic!("{name} was not bound as planned within {SETTLE:?}: {why}");
        }
        sleep(Duration::from_millis(500)).await;
    }
}

async fn check_bound(
    instances: &Api<ModelInstance>,
    pods: &Api<Pod>,
    nodes: &Api<Node>,
    name: &str,
    not_on: &[String],
) -> Result<ModelInstance, String> {
    let mi = timeout(CALL, instances.get(name))
        .await
        .map_err(|_| "no answer".to_string())?
        .map_err(|e| e.to_string())?;
    let status = mi.status.clone().ok_or("no status yet")?;
    if status.plan.is_empty() {
        return Err(format!(
            "no plan yet (phase {:?}, message {:?})",
            status.phase, status.message
        ));
    }
    for s in &status.plan {
        if s.devices.iter().any(|d| not_on.contains(d)) {
            return Err(format!(
                "shard {} still planned on {:?}",
                s.shard, s.devices
            ));
        }
        let pod_name = format!("{name}-shard-{}", s.shard);
        let pod = timeout(CALL, pods.get_opt(&pod_name))
            .await
            .map_err(|_| "no answer".to_string())?
            .map_err(|e| e.to_string())?
            .ok_or(format!("{pod_name} does not exist"))?;
        if pod.metadata.deletion_timestamp.is_some() {
            return Err(format!("{pod_name} is terminating"));
        }
        let spec = pod.spec.as_ref().ok_or("a pod without spec")?;
        if spec.scheduler_name.as_deref() != Some("tessera") {
            return Err(format!(
                "{pod_name} has scheduler {:?}",
                spec.scheduler_name
            ));
        }
        if spec.node_name.as_deref() != Some(s.node.as_str()) {
            return Err(format!(
                "{pod_name} is on {:?}, planned for {}",
                spec.node_name, s.node
            ));
        }
        let devices = pod
            .annotations()
            .get("tessera.dev/devices")
            .cloned()
            .unwrap_or_default();
        if devices != s.devices.join(",") {
            return Err(format!(
                "{pod_name} has devices {devices:?}, planned {:?}",
                s.devices
            ));
        }
        if pod.annotations().get("tessera.dev/shard") != Some(&s.shard.to_string()) {
            return Err(format!("{pod_name} has the wrong shard annotation"));
        }
        // The controllers run with a per-vendor resource name.
        let want = format!("tessera.dev/{}-gpu", planned_vendor(nodes, s).await?);
        let limits = spec
            .containers
            .first()
            .and_then(|c| c.resources.as_ref())
            .and_then(|r| r.limits.as_ref());
        if !limits.is_some_and(|l| l.contains_key(&want)) {
            return Err(format!("{pod_name} does not request {want}: {limits:?}"));
        }
    }
    if status.phase != Some(Phase::Bound) {
        return Err(format!("phase {:?}", status.phase));
    }
    Ok(mi)
}

/// `(reason, reporting instance)` of the controller's events about an instance.
async fn events_about(client: &Client, ns: &str, instance: &str) -> Vec<(String, String)> {
    let events: Api<Event> = Api::namespaced(client.clone(), ns);
    let list = timeout(CALL, events.list(&ListParams::default()))
        .await
        .expect("listing events: no answer")
        .expect("listing events");
    list.items
        .into_iter()
        .filter(|e| {
            e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(instance)
                && e.reporting_controller.as_deref() == Some("tessera-controller")
        })
        .map(|e| {
            (
                e.reason.unwrap_or_default(),
                e.reporting_instance.unwrap_or_default(),
            )
        })
        .collect()
}

/// The reasons of an instance's events, all of which must come from `leader`:
/// a standby never acts.
/// The reasons of the events about `instance`, once they include every one
/// of `want` (events are written after the status, so they may trail it) or
/// after 30 s.
async fn reasons_from(
    client: &Client,
    ns: &str,
    instance: &str,
    leader: &str,
    want: &[&str],
) -> Vec<String> {
    let start = Instant::now();
    let events = loop {
        let events = events_about(client, ns, instance).await;
        let complete = want.iter().all(|w| events.iter().any(|(r, _)| r == w));
        if complete || start.elapsed() > Duration::from_secs(30) {
            break events;
        }
        sleep(Duration::from_millis(200)).await;
    };
    for (reason, reporter) in &events {
        assert_eq!(
            reporter, leader,
            "event {reason} about {instance} came from the standby"
        );
    }
    events.into_iter().map(|(r, _)| r).collect()
}

/// One metric's value from a controller's /metrics on loopback.
fn metric(port: u16, name: &str) -> Option<f64> {
    http_get(port, "/metrics")?
        .lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
}

fn run_token() -> String {
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u32(std::process::id());
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    format!("{:08x}", h.finish() as u32)
}

async fn create_namespace(client: &Client, ns: &str, run: &str, cleanup: &mut Cleanup) {
    let namespaces: Api<Namespace> = Api::all(client.clone());
    let created = namespaces
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({
                "metadata": {"name": ns, "labels": {TEST_LABEL: "true", RUN_LABEL: run}}
            }))
            .expect("a namespace"),
        )
        .await
        .unwrap_or_else(|e| panic!("creating namespace {ns}: {e}"));
    cleanup.namespace_uid = created.metadata.uid;
}

struct Kind {
    vendor: &'static str,
    product: &'static str,
    memory_gib: u64,
    tflops: f64,
    bandwidth: f64,
}

const H100: Kind = Kind {
    vendor: "nvidia",
    product: "NVIDIA H100 80GB HBM3",
    memory_gib: 80,
    tflops: 989.0,
    bandwidth: 3350.0,
};
const MI300X: Kind = Kind {
    vendor: "amd",
    product: "AMD Instinct MI300X",
    memory_gib: 192,
    tflops: 1307.0,
    bandwidth: 5300.0,
};
const RTX4090: Kind = Kind {
    vendor: "nvidia",
    product: "NVIDIA GeForce RTX 4090",
    memory_gib: 24,
    tflops: 165.0,
    bandwidth: 1008.0,
};

/// A `NodeGpuState` as a node agent publishes it.
fn gpu_state(prefix: &str, count: u32, kind: &Kind) -> serde_json::Value {
    let devices: Vec<_> = (0..count)
        .map(|i| {
            json!({
                "id": format!("{prefix}-g{i}"), "index": i, "vendor": kind.vendor, "product": kind.product,
                "memoryTotalBytes": kind.memory_gib << 30, "memoryFreeBytes": (kind.memory_gib << 30) - (1 << 30),
                "fp16Tflops": kind.tflops, "memoryBandwidthGbps": kind.bandwidth, "temperatureC": 40.0,
                "health": "Healthy",
            })
        })
        .collect();
    json!({"version": "v1", "backend": "fake", "devices": devices, "links": []})
}

async fn create_node(
    nodes: &Api<Node>,
    name: &str,
    state: &serde_json::Value,
    run: &str,
    cleanup: &mut Cleanup,
) {
    let node: Node = serde_json::from_value(json!({
        "metadata": {
            "name": name,
            "labels": {TEST_LABEL: "true", RUN_LABEL: run},
            "annotations": {GPU_STATE_ANNOTATION: state.to_string()},
        },
        "spec": {"taints": [{"key": TEST_LABEL, "value": "true", "effect": "NoSchedule"}]},
    }))
    .expect("a valid Node");
    let created = nodes
        .create(&PostParams::default(), &node)
        .await
        .unwrap_or_else(|e| {
            panic!("creating Node {name}: {e} (the user needs create/patch/delete on nodes)")
        });
    cleanup
        .nodes
        .push((name.to_string(), created.metadata.uid.unwrap_or_default()));
}

async fn publish_state(nodes: &Api<Node>, name: &str, state: &serde_json::Value) {
    let patch = json!({"metadata": {"annotations": {GPU_STATE_ANNOTATION: state.to_string()}}});
    nodes
        .patch(name, &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .unwrap_or_else(|e| panic!("publishing the GPU state of {name}: {e}"));
}

/// Keeps the Nodes' Ready condition fresh, as their kubelets would.
async fn heartbeat(nodes: Api<Node>, names: Vec<String>) {
    let since = k8s_openapi::jiff::Timestamp::now().to_string();
    loop {
        let now = k8s_openapi::jiff::Timestamp::now().to_string();
        for name in &names {
            let patch = json!({"status": {"conditions": [{
                "type": "Ready", "status": "True", "reason": "TesseraTest",
                "message": "heartbeat from the tessera controller test",
                "lastHeartbeatTime": now, "lastTransitionTime": since,
            }]}});
            if let Err(e) = nodes
                .patch_status(name, &PatchParams::default(), &Patch::Strategic(&patch))
                .await
            {
                eprintln!("heartbeat for {name}: {e}");
            }
        }
        sleep(Duration::from_secs(10)).await;
    }
}

/// Deletes terminating pods for good, as a kubelet does once containers stop.
async fn finish_terminations(pods: Api<Pod>) {
    loop {
        if let Ok(list) = pods.list(&ListParams::default()).await {
            for p in list
                .items
                .iter()
                .filter(|p| p.metadata.deletion_timestamp.is_some())
            {
                let params = DeleteParams {
                    grace_period_seconds: Some(0),
                    preconditions: Some(Preconditions {
                        uid: p.metadata.uid.clone(),
                        resource_version: None,
                    }),
                    ..DeleteParams::default()
                };
                let _ = pods.delete(&p.name_any(), &params).await;
            }
        }
        sleep(Duration::from_secs(1)).await;
    }
}

/// An example instance, confined to this run's Nodes.
fn example(file: &str, ns: &str, run: &str) -> ModelInstance {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("examples")
        .join(file);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let mut mi: ModelInstance =
        serde_saphyr::from_str(&text).unwrap_or_else(|e| panic!("{file}: {e}"));
    mi.metadata.namespace = Some(ns.to_string());
    mi.spec.placement.node_selector = BTreeMap::from([(RUN_LABEL.to_string(), run.to_string())]);
    let template = mi.spec.template.get_or_insert_with(Default::default);
    let spec = template.spec.get_or_insert_with(Default::default);
    spec.tolerations.get_or_insert_with(Vec::new).push(
        serde_json::from_value(
            json!({"key": TEST_LABEL, "operator": "Exists", "effect": "NoSchedule"}),
        )
        .expect("a toleration"),
    );
    mi
}

/// A `tessera controller` process, killed when dropped.
struct ControllerProcess {
    child: Child,
    port: u16,
    log: PathBuf,
}

impl ControllerProcess {
    fn start(kubeconfig: &Path, ns: &str, identity: &str, scratch: &Path) -> Self {
        // A free loopback port: bind, read, release. Another process could take
        // it in between; then this controller exits and the test says so.
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .expect("a free loopback port");
        let log = scratch.join(format!("{identity}.log"));
        let file = std::fs::File::create(&log).expect("a log file");
        let child = Command::new(env!("CARGO_BIN_EXE_tessera"))
            .args(["controller", "--kubeconfig"])
            .arg(kubeconfig)
            .args([
                "--namespace",
                ns,
                "--lease-namespace",
                ns,
                "--lease-name",
                LEASE,
                "--identity",
                identity,
            ])
            .args([
                "--listen",
                &format!("127.0.0.1:{port}"),
                "--node-grace-period",
                "30",
                "--resource-name",
                "tessera.dev/{vendor}-gpu",
            ])
            .env("POD_NAME", identity)
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(file)
            .spawn()
            .expect("starting tessera controller");
        Self { child, port, log }
    }

    fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(30)..].join("\n")
    }

    /// SIGTERM, then the exit code (None if it had to be killed).
    fn terminate(&mut self) -> Option<i32> {
        let _ = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status();
        let start = std::time::Instant::now();
        while start.elapsed() < Duration::from_secs(20) {
            if let Ok(Some(status)) = self.child.try_wait() {
                return status.code();
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        let _ = self.child.kill();
        None
    }
}

impl Drop for ControllerProcess {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
            if std::thread::panicking() {
                eprintln!(
                    "controller log ({}):\n{}",
                    self.log.display(),
                    self.log_tail()
                );
            }
        }
    }
}

/// Aborts a background task when dropped.
struct Background(tokio::task::JoinHandle<()>);

impl Background {
    fn spawn(f: impl std::future::Future<Output = ()> + Send + 'static) -> Self {
        Self(tokio::spawn(f))
    }
}

impl Drop for Background {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Deletes the namespace (after force-deleting its pods, which no kubelet
/// will finish) and the Nodes this run created, with UID preconditions.
struct Cleanup {
    config: Config,
    namespace: String,
    namespace_uid: Option<String>,
    nodes: Vec<(String, String)>,
    done: bool,
}

impl Cleanup {
    fn new(config: Config, namespace: String) -> Self {
        Self {
            config,
            namespace,
            namespace_uid: None,
            nodes: Vec::new(),
            done: false,
        }
    }

    async fn finish(mut self) {
        let report = clean(
            self.config.clone(),
            self.namespace.clone(),
            self.namespace_uid.clone(),
            self.nodes.clone(),
        )
        .await;
        self.done = true;
        assert!(report.is_empty(), "cleanup failed: {}", report.join("; "));
    }
}

async fn clean(
    config: Config,
    ns: String,
    ns_uid: Option<String>,
    nodes: Vec<(String, String)>,
) -> Vec<String> {
    let mut problems = Vec::new();
    let Ok(client) = Client::try_from(config) else {
        return vec!["no client".into()];
    };
    let guarded = |uid: Option<String>| DeleteParams {
        preconditions: Some(Preconditions {
            uid,
            resource_version: None,
        }),
        ..DeleteParams::default()
    };
    if let Some(uid) = ns_uid {
        let pods: Api<Pod> = Api::namespaced(client.clone(), &ns);
        if let Ok(Ok(list)) = timeout(CALL, pods.list(&ListParams::default())).await {
            for p in list.items {
                let mut params = guarded(p.metadata.uid.clone());
                params.grace_period_seconds = Some(0);
                let _ = timeout(CALL, pods.delete(&p.name_any(), &params)).await;
            }
        }
        let namespaces: Api<Namespace> = Api::all(client.clone());
        match timeout(CALL, namespaces.delete(&ns, &guarded(Some(uid)))).await {
            Ok(Ok(_)) => {}
            Ok(Err(kube::Error::Api(s))) if s.is_not_found() => {}
            other => problems.push(format!("namespace {ns}: {other:?}")),
        }
    }
    let api: Api<Node> = Api::all(client);
    for (name, uid) in nodes {
        match timeout(CALL, api.delete(&name, &guarded(Some(uid)))).await {
            Ok(Ok(_)) => {}
            Ok(Err(kube::Error::Api(s))) if s.is_not_found() => {}
            other => problems.push(format!(
                "Node {name}: {other:?} (remove it with `kubectl delete node {name}`)"
            )),
        }
    }
    problems
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        // Drop cannot await and the test's runtime may be unwinding: clean up
        // from a thread with its own runtime.
        let (config, ns, uid, nodes) = (
            self.config.clone(),
            self.namespace.clone(),
            self.namespace_uid.clone(),
            self.nodes.clone(),
        );
        let report = std::thread::spawn(move || {
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .map(|rt| rt.block_on(clean(config, ns, uid, nodes)))
                .unwrap_or_else(|e| vec![e.to_string()])
        })
        .join()
        .unwrap_or_else(|_| vec!["the cleanup thread panicked".into()]);
        for problem in report {
            eprintln!("cleanup: {problem}");
        }
    }
}
