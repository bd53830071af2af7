//! Kubernetes objects for the controller benchmarks: Nodes carrying the
//! generated clusters' GPU states, and ModelInstances.
// Each benchmark binary uses its own part of this module.
#![allow(dead_code)]

use k8s_openapi::api::core::v1::Node;
use serde_json::json;
use tessera::api::{GPU_STATE_ANNOTATION, ModelInstance, RACK_LABEL, ZONE_LABEL};
use tessera::placement::{Interconnect, NodeState};

/// A Node as the API server returns it once its agent has published.
pub(crate) fn to_node(n: &NodeState) -> Node {
    let devices: Vec<_> = n
        .devices
        .iter()
        .map(|d| {
            json!({
                "id": d.id, "index": d.index, "vendor": d.vendor, "product": d.product,
                "memoryTotalBytes": d.memory_total_bytes, "memoryFreeBytes": d.memory_free_bytes,
                "fp16Tflops": d.fp16_tflops, "memoryBandwidthGbps": d.memory_bandwidth_gbps,
                "temperatureC": d.temperature_c, "numaNode": 0,
                "health": if d.healthy { "Healthy" } else { "Unhealthy" },
                "healthReason": d.health_reason,
            })
        })
        .collect();
    let links: Vec<_> = n
        .links
        .iter()
        .map(|l| {
            let kind = match l.kind {
                Interconnect::NvLink => "nvlink",
                Interconnect::Xgmi => "xgmi",
                Interconnect::Pcie => "pcie",
            };
            json!({"a": l.a, "b": l.b, "kind": kind, "bandwidthGbps": l.bandwidth_gbps})
        })
        .collect();
    let state = json!({"version": "v1", "backend": "nvml", "devices": devices, "links": links});
    serde_json::from_value(json!({
        "metadata": {
            "name": n.name,
            "resourceVersion": "1",
            "labels": {ZONE_LABEL: n.zone, RACK_LABEL: n.rack},
            "annotations": {GPU_STATE_ANNOTATION: state.to_string()},
        },
        "status": {"conditions": [{"type": "Ready", "status": "True"}]},
    }))
    .expect("a valid Node")
}

/// The 1.8T model of the placement benchmark, as 64 single-GPU stages.
pub(crate) fn instance_1_8t() -> ModelInstance {
    serde_json::from_value(json!({
        "apiVersion": "tessera.dev/v1alpha1",
        "kind": "ModelInstance",
        "metadata": {"name": "big", "namespace": "ml", "uid": "uid-big", "generation": 1},
        "spec": {
            "model": {"name": "big", "parametersBillions": 1800, "layers": 128, "hiddenSize": 25600,
                      "kvCacheGiB": 160, "overheadGiB": 2},
            "parallelism": {"tensor": 1, "pipeline": 64},
            "template": {"spec": {"containers": [{"name": "shard", "image": "runtime:1"}]}},
        },
    }))
    .expect("a valid ModelInstance")
}
