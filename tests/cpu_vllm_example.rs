//! examples/cpu-vllm-tiny.yaml, the instance the real-node e2e serves with vLLM's
//! CPU build (e2e/real-node-vllm.sh): a valid ModelInstance whose spec describes the
//! model its ConfigMap gives vLLM, serving on a port the controller reads.

use k8s_openapi::api::core::v1::{ConfigMap, Service};
use tessera::api::ModelInstance;

const EXAMPLE: &str = include_str!("../examples/cpu-vllm-tiny.yaml");

fn documents() -> (ConfigMap, ModelInstance, Service) {
    let docs: Vec<&str> = EXAMPLE
        .split("\n---\n")
        .map(|d| d.trim())
        .filter(|d| !d.is_empty())
        .collect();
    assert_eq!(docs.len(), 3, "a ConfigMap, a ModelInstance and a Service");
    (
        serde_saphyr::from_str(docs[0]).expect("the ConfigMap parses"),
        serde_saphyr::from_str(docs[1]).expect("the instance parses"),
        serde_saphyr::from_str(docs[2]).expect("the Service parses"),
    )
}

#[test]
fn the_instance_is_valid_and_describes_the_model_vllm_is_given() {
    let (config_map, mi, service) = documents();
    mi.spec.validate().expect("a valid spec");
    let config: serde_json::Value =
        serde_json::from_str(&config_map.data.expect("data")["config.json"])
            .expect("config.json is JSON");
    let model = &mi.spec.model;
    assert_eq!(config["num_hidden_layers"], model.layers);
    assert_eq!(
        Some(config["hidden_size"].as_u64().unwrap() as u32),
        model.hidden_size
    );
    assert_eq!(
        Some(config["num_attention_heads"].as_u64().unwrap() as u32),
        model.attention_heads
    );
    assert_eq!(
        Some(config["num_key_value_heads"].as_u64().unwrap() as u32),
        model.kv_heads
    );

    let pod = mi
        .spec
        .template
        .expect("a template")
        .spec
        .expect("a pod spec");
    let container = &pod.containers[0];
    let ports = container.ports.as_ref().expect("ports");
    assert!(
        ports.iter().any(|p| p.name.as_deref() == Some("http")),
        "the controller reads /metrics on the port named http"
    );
    let args = container.args.as_ref().expect("args").join(" ");
    assert!(
        args.contains("--load-format dummy") && args.contains("--skip-tokenizer-init"),
        "{args}"
    );
    let running = mi
        .spec
        .serving
        .as_ref()
        .and_then(|s| s.max_running_requests);
    assert!(
        running.is_some_and(|n| args.contains(&format!("--max-num-seqs {n}"))),
        "the plan's batch cap is vLLM's: {args}"
    );
    let selector = service.spec.expect("spec").selector.expect("a selector");
    assert_eq!(selector["tessera.dev/instance"], "tiny");
}
