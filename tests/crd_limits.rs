//! One set of limits: every range and length the ModelInstance CRD schema
//! declares is walked, and each boundary and the values just past it are fed
//! to `tessera place`'s reader and to the controller's validate stage; both
//! must accept the boundary and refuse what lies past it, naming the field.
//! The limits the schema keeps in CEL rules (pipeline, metadata.name) are
//! added by hand.
//!
//! With `TESSERA_TEST_KUBECONFIG` set, every case also goes to the real API
//! server as a server-side dry-run create (nothing is stored), and the API
//! server must decide the same way: it is the reference the other two follow.

#[path = "common/real_cluster.rs"]
mod real_cluster;

use kube::Client;
use kube::api::{Api, DynamicObject, PostParams};
use kube::core::ApiResource;
use real_cluster::{install_crd, kubeconfig_path, load_config};
use serde_json::{Value, json};
use tessera::api::ModelInstance;

/// A valid instance with a pod template, so the controller can judge it too.
fn base() -> Value {
    json!({
        "apiVersion": "tessera.dev/v1alpha1",
        "kind": "ModelInstance",
        "metadata": {"name": "limits"},
        "spec": {
            "model": {"name": "m", "parametersBillions": 7.0, "layers": 32, "hiddenSize": 4096,
                      "kvCacheGiB": 1.0, "overheadGiB": 1.5},
            "parallelism": {"tensor": 1, "pipeline": "auto"},
            "placement": {
                "weights": {"compute": 0.4, "memory": 0.3, "network": 0.15, "thermal": 0.1, "bandwidth": 0.05},
                "maxTemperatureC": 85.0,
                "deadlineMs": 2000
            },
            // The latency targets at their extremes, so each can be tried at
            // its own bounds without the other's rule (first token >= per token)
            // getting in the way. A measured demand, so its replica bounds
            // are tried at theirs.
            "serving": {"maxTimePerOutputTokenMs": 0.1, "maxTimeToFirstTokenMs": 3600000.0,
                        "demand": "Measured", "maxReplicas": 64},
            "template": {"spec": {"containers": [{"name": "shard", "image": "busybox:1.37"}]}}
        }
    })
}

/// One value to try: the object, whether it is valid, and the field an error must name.
struct Case {
    what: String,
    object: Value,
    valid: bool,
    field: String,
}

/// A limit the schema declares: where, which keyword, the bound, the field's type.
struct Limit {
    path: Vec<String>,
    keyword: String,
    bound: f64,
    integer: bool,
}

fn walk(schema: &Value, path: &mut Vec<String>, out: &mut Vec<Limit>) {
    for keyword in ["minimum", "maximum", "minLength", "maxLength"] {
        if let Some(bound) = schema.get(keyword).and_then(Value::as_f64) {
            out.push(Limit {
                path: path.clone(),
                keyword: keyword.to_string(),
                bound,
                integer: schema["type"] == "integer" || keyword.ends_with("Length"),
            });
        }
    }
    if let Some(props) = schema.get("properties").and_then(Value::as_object) {
        for (name, sub) in props {
            path.push(name.clone());
            walk(sub, path, out);
            path.pop();
        }
    }
}

fn schema_limits() -> Vec<Limit> {
    let crd = serde_json::to_value(tessera::api::crd()).expect("the CRD serializes");
    let spec = &crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"];
    let mut out = Vec::new();
    walk(spec, &mut vec!["spec".to_string()], &mut out);
    out
}

fn with(path: &[String], value: Value) -> Value {
    let mut object = base();
    let mut slot = &mut object;
    for key in path {
        slot = &mut slot[key.as_str()];
    }
    *slot = value;
    object
}

fn cases() -> Vec<Case> {
    let mut out = Vec::new();
    for limit in schema_limits() {
        let field = limit.path[1..].join(".");
        let lower = limit.keyword.starts_with("min");
        // Inside the range, then one past it, then (for numbers) a hair past it.
        let mut tries = vec![(0.0, true), (1.0, false)];
        if !limit.integer {
            tries.push((limit.bound.abs().max(1.0) * 1e-9, false));
        }
        for (step, valid) in tries {
            let v = if lower {
                limit.bound - step
            } else {
                limit.bound + step
            };
            if limit.keyword.ends_with("Length") && v < 0.0 {
                continue;
            }
            let value = if limit.keyword.ends_with("Length") {
                json!("x".repeat(v as usize))
            } else if limit.integer {
                json!(v as i64)
            } else {
                json!(v)
            };
            out.push(Case {
                what: format!("{field} = {value} ({} {})", limit.keyword, limit.bound),
                object: with(&limit.path, value),
                valid,
                field: field.clone(),
            });
        }
    }
    // Limits kept in CEL rules rather than in the schema's keywords.
    let path = |p: &str| p.split('.').map(str::to_string).collect::<Vec<_>>();
    for (pipeline, layers, valid) in [
        (json!(1), 32, true),
        (json!(0), 32, false),
        (json!(32), 32, true),
        (json!(33), 32, false),
        (json!(1024), 2000, true),
        (json!(1025), 2000, false),
        (json!("auto"), 1, true),
        (json!("many"), 32, false),
    ] {
        let mut object = with(&path("spec.parallelism.pipeline"), pipeline.clone());
        object["spec"]["model"]["layers"] = json!(layers);
        out.push(Case {
            what: format!("pipeline {pipeline} with {layers} layers"),
            object,
            valid,
            // The controller cannot even read a pipeline out of range: its
            // error names the value, not the path.
            field: "pipeline".into(),
        });
    }
    for (tensor, valid) in [
        (json!(1), true),
        (json!(0), false),
        (json!(64), true),
        (json!(65), false),
        (json!("auto"), true),
        (json!("all"), false),
        (json!(2.5), false),
    ] {
        out.push(Case {
            what: format!("tensor {tensor}"),
            object: with(&path("spec.parallelism.tensor"), tensor.clone()),
            valid,
            field: "tensor".into(),
        });
    }
    for (policy, valid) in [
        (json!("RecreateReplica"), true),
        (json!("RecreatePod"), true),
        (json!("recreatePod"), false),
        (json!("Always"), false),
        (json!(""), false),
        (json!(1), false),
    ] {
        out.push(Case {
            what: format!("restartPolicy {policy}"),
            object: with(&path("spec.restartPolicy"), policy.clone()),
            valid,
            field: "restartPolicy".into(),
        });
    }
    for (moves, valid) in [
        (json!("Allowed"), true),
        (json!("Never"), true),
        (json!("never"), false),
        (json!("Sometimes"), false),
        (json!(""), false),
        (json!(false), false),
    ] {
        out.push(Case {
            what: format!("moves {moves}"),
            object: with(&path("spec.placement.moves"), moves.clone()),
            valid,
            field: "moves".into(),
        });
    }
    for (sharing, tensor, pipeline, valid) in [
        (json!("Exclusive"), json!(2), json!("auto"), true),
        (json!("Isolated"), json!(1), json!(1), true),
        (json!("Shared"), json!(1), json!(1), true),
        (json!("Shared"), json!(1), json!("auto"), true),
        (json!("Isolated"), json!(2), json!(1), false),
        (json!("Shared"), json!("auto"), json!(1), false),
        (json!("Isolated"), json!(1), json!(2), false),
        (json!("shared"), json!(1), json!(1), false),
        (json!("MIG"), json!(1), json!(1), false),
        (json!(1), json!(1), json!(1), false),
    ] {
        let mut object = with(&path("spec.placement.sharing"), sharing.clone());
        object["spec"]["parallelism"] = json!({"tensor": tensor, "pipeline": pipeline});
        out.push(Case {
            what: format!("sharing {sharing} with tensor {tensor}, pipeline {pipeline}"),
            object,
            valid,
            field: "sharing".into(),
        });
    }
    // Heads split the hidden size evenly, KV heads the heads.
    for (heads, kv, valid) in [
        (json!(32), json!(8), true),
        (json!(32), json!(32), true),
        (json!(33), Value::Null, false),
        (json!(32), json!(5), false),
        (json!(32), json!(64), false),
    ] {
        let mut object = base();
        object["spec"]["model"]["attentionHeads"] = heads.clone();
        if !kv.is_null() {
            object["spec"]["model"]["kvHeads"] = kv.clone();
        }
        out.push(Case {
            what: format!("attentionHeads {heads}, kvHeads {kv} for hiddenSize 4096"),
            object,
            valid,
            field: "Heads".into(),
        });
    }
    // A checkpoint's own size holds one bit to four bytes a parameter (the
    // base's 7 billion: 0.815 to 26.08 GiB).
    for (weights, valid) in [
        (json!(13.0), true),
        (json!(0.9), true),
        (json!(26), true),
        (Value::Null, true),
        (json!(0.8), false),
        (json!(26.2), false),
        (json!(0), false),
        (json!(-1.5), false),
        (json!("13Gi"), false),
    ] {
        let mut object = base();
        object["spec"]["model"]["weightsGiB"] = weights.clone();
        out.push(Case {
            what: format!("weightsGiB {weights} for 7 billion parameters"),
            object,
            valid,
            field: "weightsGiB".into(),
        });
    }
    // The first token takes at least one decode step.
    for (tpot, ttft, valid) in [
        (50.0, 2000.0, true),
        (50.0, 50.0, true),
        (100.0, 50.0, false),
    ] {
        let mut object = base();
        object["spec"]["serving"] =
            json!({"maxTimePerOutputTokenMs": tpot, "maxTimeToFirstTokenMs": ttft});
        out.push(Case {
            what: format!("serving per token {tpot} ms, first token {ttft} ms"),
            object,
            valid,
            field: "maxTimeToFirstTokenMs".into(),
        });
    }
    // Replicas from the demand need a demand; a measured demand needs its
    // bounds, and bounds need a measured demand.
    for (serving, valid, field) in [
        (
            json!({"replicasFromDemand": true}),
            false,
            "replicasFromDemand",
        ),
        (
            json!({"replicasFromDemand": true, "requestsPerSecond": 4.0}),
            true,
            "replicasFromDemand",
        ),
        (
            json!({"replicasFromDemand": false}),
            true,
            "replicasFromDemand",
        ),
        (json!({"demand": "Measured"}), false, "Replicas"),
        (
            json!({"demand": "Measured", "maxReplicas": 4}),
            true,
            "Replicas",
        ),
        (
            json!({"demand": "Measured", "minReplicas": 4, "maxReplicas": 4}),
            true,
            "Replicas",
        ),
        (
            json!({"demand": "Measured", "minReplicas": 5, "maxReplicas": 4}),
            false,
            "Replicas",
        ),
        (json!({"maxReplicas": 4}), false, "Replicas"),
        (
            json!({"demand": "Stated", "minReplicas": 1}),
            false,
            "Replicas",
        ),
        (
            json!({"demand": "Measured", "maxReplicas": 4, "replicasFromDemand": true}),
            false,
            "Replicas",
        ),
    ] {
        let mut object = base();
        object["spec"]["serving"] = serving.clone();
        out.push(Case {
            what: format!("serving {serving}"),
            object,
            valid,
            field: field.into(),
        });
    }
    for (name, replicas, valid) in [
        ("a".repeat(52), 1, true),
        ("a".repeat(53), 1, false),
        ("a".repeat(52), 0, true),
        ("a".repeat(49), 2, true),
        ("a".repeat(50), 2, false),
        ("a".repeat(48), 11, true),
        ("a".repeat(49), 11, false),
        ("a".repeat(47), 256, true),
        ("a".repeat(48), 256, false),
    ] {
        let mut object = with(&path("metadata.name"), json!(name));
        object["spec"]["replicas"] = json!(replicas);
        // The base's measured demand would count its 64 replicas at most.
        object["spec"]["serving"]["maxReplicas"] = json!(1);
        out.push(Case {
            what: format!(
                "metadata.name of {} characters with {replicas} replicas",
                name.len()
            ),
            object,
            valid,
            field: "metadata.name".into(),
        });
    }
    // A measured demand's most replicas name pods too.
    for (name, most, valid) in [("a".repeat(49), 10, true), ("a".repeat(49), 11, false)] {
        let mut object = with(&path("metadata.name"), json!(name));
        object["spec"]["serving"]["maxReplicas"] = json!(most);
        out.push(Case {
            what: format!(
                "metadata.name of {} characters with maxReplicas {most}",
                name.len()
            ),
            object,
            valid,
            field: "metadata.name".into(),
        });
    }
    for (name, valid) in [
        ("my-model-2".to_string(), true),
        ("My_Model!!".to_string(), false),
        ("2-models".to_string(), false),
        ("model-".to_string(), false),
    ] {
        out.push(Case {
            what: format!("metadata.name {name:?}"),
            object: with(&path("metadata.name"), json!(name)),
            valid,
            field: "metadata.name".into(),
        });
    }
    out
}

/// `tessera place`'s reader, as it reads a file.
fn place_verdict(object: &Value) -> Result<(), String> {
    let text = serde_json::to_string(object).expect("JSON is YAML");
    tessera::cli::input::parse_instances(&text, "case.yaml")
        .map(|_| ())
        .map_err(|e| e.0)
}

/// The controller's validate stage, on the object as the API server would hand it over.
fn controller_verdict(object: &Value) -> Result<(), String> {
    let mi: ModelInstance = match serde_path_to_error::deserialize(object.clone()) {
        Ok(mi) => mi,
        // Not representable at all (a pipeline of "many", -1 replicas): never
        // reaches validate; the API server refuses it before.
        Err(e) => return Err(format!("{e}")),
    };
    tessera::controller::validate::check(&mi, &tessera::controller::reconcile::Settings::default())
        .map_err(|e| e.to_string())
}

fn judge(case: &Case, who: &str, verdict: Result<(), String>, failures: &mut Vec<String>) {
    match (case.valid, verdict) {
        (true, Ok(())) => {}
        (false, Err(e)) if e.contains(&case.field) => {}
        (true, Err(e)) => failures.push(format!("{who} refused {}: {e}", case.what)),
        (false, Ok(())) => failures.push(format!("{who} accepted {}", case.what)),
        (false, Err(e)) => failures.push(format!(
            "{who} refused {} without naming {}: {e}",
            case.what, case.field
        )),
    }
}

#[test]
fn the_schema_declares_every_documented_limit() {
    let found: Vec<String> = schema_limits()
        .iter()
        .map(|l| format!("{}.{}", l.path[1..].join("."), l.keyword))
        .collect();
    for want in [
        "model.name.minLength",
        "model.name.maxLength",
        "model.parametersBillions.minimum",
        "model.parametersBillions.maximum",
        "model.layers.minimum",
        "model.layers.maximum",
        "model.hiddenSize.maximum",
        "model.kvCacheGiB.maximum",
        "model.overheadGiB.maximum",
        "model.attentionHeads.minimum",
        "model.attentionHeads.maximum",
        "model.kvHeads.minimum",
        "model.kvHeads.maximum",
        "serving.inputTokens.minimum",
        "serving.outputTokens.maximum",
        "serving.maxTimePerOutputTokenMs.minimum",
        "serving.maxTimeToFirstTokenMs.maximum",
        "serving.requestsPerSecond.minimum",
        "replicas.minimum",
        "replicas.maximum",
        "parallelism.minTokensPerSecond.minimum",
        "parallelism.minTokensPerSecond.maximum",
        "placement.weights.compute.maximum",
        "placement.maxTemperatureC.minimum",
        "placement.deadlineMs.maximum",
    ] {
        assert!(found.contains(&want.to_string()), "{want} not in {found:?}");
    }
}

#[test]
fn place_and_the_controller_hold_every_boundary_the_schema_declares() {
    let mut failures = Vec::new();
    let cases = cases();
    for case in &cases {
        judge(case, "place", place_verdict(&case.object), &mut failures);
        judge(
            case,
            "controller",
            controller_verdict(&case.object),
            &mut failures,
        );
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    assert!(cases.len() > 60, "only {} cases", cases.len());
}

#[tokio::test]
async fn the_api_server_decides_every_boundary_the_same_way() {
    let Some(path) = kubeconfig_path() else {
        return;
    };
    let client = Client::try_from(load_config(&path).await).expect("a client from the kubeconfig");
    install_crd(&client).await;
    // A freshly changed schema takes a moment to reach the serving handler.
    tokio::time::sleep(std::time::Duration::from_secs(2)).await;
    let resource = ApiResource::erase::<ModelInstance>(&());
    let api: Api<DynamicObject> = Api::namespaced_with(client, "default", &resource);
    let dry_run = PostParams {
        dry_run: true,
        ..PostParams::default()
    };
    let mut failures = Vec::new();
    for case in cases() {
        let object: DynamicObject =
            serde_json::from_value(case.object.clone()).expect("a dynamic object");
        let verdict = match api.create(&dry_run, &object).await {
            Ok(_) => Ok(()),
            Err(kube::Error::Api(status)) if status.code == 422 => Err(status.message),
            Err(e) => panic!("{}: the API server did not answer: {e}", case.what),
        };
        judge(&case, "the API server", verdict, &mut failures);
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
