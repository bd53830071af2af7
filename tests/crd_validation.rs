//! The CEL rules (`x-kubernetes-validations`) of the committed CRD, evaluated
//! client-side as an API server evaluates them: valid instances pass, each
//! malformed field is refused with our message. Range, enum and type checks of
//! the OpenAPI schema are the API server's own; `tessera place` repeats them in
//! `ModelInstanceSpec::validate` (tested there and in `tests/cli.rs`).
//!
//! The two `pipeline` rules use `type(self) == string`, the Kubernetes idiom for
//! int-or-string fields, which the client-side evaluator cannot run; their
//! errors are recognised here and those rules are left to the API server.

use kube::core::cel::Validator;
use serde_json::{Value, json};

fn schema() -> Value {
    let crd: Value = serde_saphyr::from_str(include_str!("../crds/modelinstance.yaml"))
        .expect("the committed CRD is YAML");
    crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"].clone()
}

/// A valid instance as the API server stores it (defaults applied).
fn instance() -> Value {
    json!({
        "apiVersion": "tessera.dev/v1alpha1",
        "kind": "ModelInstance",
        "metadata": {"name": "m"},
        "spec": {
            "model": {"name": "m", "parametersBillions": 7.0, "layers": 32, "dtype": "bf16",
                      "kvCacheGiB": 0.0, "overheadGiB": 1.5},
            "parallelism": {"tensor": 1, "pipeline": "auto"},
            "placement": {
                "weights": {"compute": 0.4, "memory": 0.3, "network": 0.15, "thermal": 0.1, "bandwidth": 0.05},
                "maxTemperatureC": 85.0,
                "deadlineMs": 2000,
                "vendors": ["nvidia", "amd"],
                "products": ["H100"]
            }
        }
    })
}

fn errors(object: &Value) -> Vec<String> {
    match Validator::new().validate(&schema(), object, None) {
        Ok(()) => Vec::new(),
        Err(e) => e
            .into_vec()
            .iter()
            .filter(|e| !e.rule.contains("type("))
            .map(|e| e.to_string())
            .collect(),
    }
}

#[test]
fn only_the_int_or_string_rules_are_beyond_the_client_side_evaluator() {
    let skipped: Vec<String> = match Validator::new().validate(&schema(), &instance(), None) {
        Ok(()) => Vec::new(),
        Err(e) => e.into_vec().iter().map(|e| e.rule.clone()).collect(),
    };
    assert_eq!(skipped.len(), 3, "pipeline twice, tensor once: {skipped:?}");
    assert!(skipped.iter().all(|r| r.contains("type(")), "{skipped:?}");
}

#[test]
fn valid_instances_pass() {
    assert_eq!(errors(&instance()), Vec::<String>::new());
    let mut fixed = instance();
    fixed["spec"]["parallelism"]["pipeline"] = json!(4);
    assert_eq!(errors(&fixed), Vec::<String>::new());
    let mut goal = instance();
    goal["spec"]["parallelism"]["optimize"] = json!("latency");
    goal["spec"]["parallelism"]["minTokensPerSecond"] = json!(120.0);
    assert_eq!(errors(&goal), Vec::<String>::new());
}

#[test]
fn each_malformed_field_is_refused_with_its_message() {
    let cases: Vec<(&str, Value, &str)> = vec![
        (
            "/spec/placement/vendors",
            json!(["nvidia", "intel"]),
            "vendors may only contain",
        ),
        (
            "/spec/placement/products",
            json!(["H100", ""]),
            "products may not contain empty strings",
        ),
        (
            "/spec/placement/weights",
            json!({"compute": 0.0, "memory": 0.0, "network": 0.0, "thermal": 0.0, "bandwidth": 0.0}),
            "at least one score weight",
        ),
    ];
    for (pointer, value, want) in cases {
        let mut object = instance();
        *object.pointer_mut(pointer).expect("field exists") = value.clone();
        let got = errors(&object);
        assert!(
            got.iter().any(|e| e.contains(want)),
            "{pointer} = {value}: expected {want:?}, got {got:?}"
        );
    }
}

#[test]
fn a_runtime_version_must_be_a_release_number() {
    let with_version = |version: &str| {
        let mut object = instance();
        object["spec"]["serving"] = json!({
            "runtime": "vllm", "inputTokens": 1024, "outputTokens": 256,
            "maxTimePerOutputTokenMs": 50.0, "maxTimeToFirstTokenMs": 2000.0,
            "runtimeVersion": version
        });
        errors(&object)
    };
    for good in [
        "0.10.1",
        "v0.20.0",
        "0.6.3.post2.dev308",
        "0.17",
        "0.10.0rc1",
    ] {
        assert_eq!(with_version(good), Vec::<String>::new(), "{good}");
    }
    for bad in ["latest", "1", "0.", "v", "0.8_1"] {
        let got = with_version(bad);
        assert!(
            got.iter()
                .any(|error| error.contains("serving.runtimeVersion must be a release number")),
            "{bad}: {got:?}"
        );
    }
}
