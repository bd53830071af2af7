//! Pods and device lists for the binding module's unit tests.

use k8s_openapi::api::core::v1::Pod;

use tessera_core::api::DEVICES_ANNOTATION;

/// Device IDs from string literals.
pub(super) fn ids(devices: &[&str]) -> Vec<String> {
    devices.iter().map(|device| device.to_string()).collect()
}

/// A pod `ns/pod-<uid>` on node `n1` in `phase`, planned on `devices`.
pub(super) fn pod(uid: &str, phase: &str, devices: &str) -> Pod {
    serde_json::from_value(serde_json::json!({
        "metadata": {
            "name": format!("pod-{uid}"),
            "namespace": "ns",
            "uid": uid,
            "annotations": { DEVICES_ANNOTATION: devices },
        },
        "spec": { "nodeName": "n1", "containers": [] },
        "status": { "phase": phase },
    }))
    .expect("a test pod is valid JSON for a Pod")
}
