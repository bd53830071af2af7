//! What the publisher writes and the write itself: a JSON merge patch of the
//! Node's metadata that names only our annotation and labels.

use std::future::Future;
use std::pin::Pin;

use k8s_openapi::api::core::v1::Node;
use kube::api::{Api, Patch, PatchParams};
use serde_json::{Map, Value, json};

use super::PublisherConfig;
use crate::agent::api_call::{CallError, within};
use crate::agent::state::DeviceView;
use tessera_core::api::{
    GPU_STATE_ANNOTATION, GpuDevice, LABEL_GPU_COUNT, LABEL_GPU_MEMORY_GIB, LABEL_GPU_PRODUCT,
    LABEL_GPU_VENDOR, NodeGpuState,
};

/// Longest label value Kubernetes accepts.
const LABEL_VALUE_MAX: usize = 63;

/// The merge patch for the Node: our annotation and our labels, nothing else.
///
/// With no devices only the count (`0`) is written; the vendor, product and
/// memory labels keep their last values.
pub(crate) fn patch_body(state: &NodeGpuState) -> Value {
    let mut labels = Map::new();
    labels.insert(
        LABEL_GPU_COUNT.to_string(),
        Value::String(state.devices.len().to_string()),
    );
    if let Some(vendor) = vendor_label(&state.devices) {
        labels.insert(LABEL_GPU_VENDOR.to_string(), Value::String(vendor));
    }
    if let Some((product, memory_gib)) = common_product(&state.devices) {
        labels.insert(
            LABEL_GPU_PRODUCT.to_string(),
            Value::String(label_value(product)),
        );
        labels.insert(
            LABEL_GPU_MEMORY_GIB.to_string(),
            Value::String(memory_gib.to_string()),
        );
    }
    let mut annotations = Map::new();
    annotations.insert(
        GPU_STATE_ANNOTATION.to_string(),
        Value::String(state.to_json()),
    );
    json!({ "metadata": { "annotations": annotations, "labels": labels } })
}

/// `nvidia`, `amd` (or `unknown`) when all devices agree, `mixed` otherwise.
fn vendor_label(devices: &[GpuDevice]) -> Option<String> {
    let first = devices.first()?.vendor;
    if devices.iter().all(|d| d.vendor == first) {
        Some(first.as_str().to_string())
    } else {
        Some("mixed".to_string())
    }
}

/// The product most devices have (ties go to the one seen first) and the
/// smallest total memory among its devices, in whole GiB.
fn common_product(devices: &[GpuDevice]) -> Option<(&str, u64)> {
    // (product, count, smallest total memory), in order of first appearance.
    let mut seen: Vec<(&str, usize, u64)> = Vec::new();
    for device in devices {
        match seen
            .iter_mut()
            .find(|(product, _, _)| *product == device.product)
        {
            Some(entry) => {
                entry.1 += 1;
                entry.2 = entry.2.min(device.memory_total_bytes);
            }
            None => seen.push((&device.product, 1, device.memory_total_bytes)),
        }
    }
    let mut best: Option<(&str, usize, u64)> = None;
    for entry in seen {
        if best.is_none_or(|b| entry.1 > b.1) {
            best = Some(entry);
        }
    }
    best.map(|(product, _, bytes)| (product, bytes >> 30))
}

/// A label-safe form of a free-text name: every run of characters outside
/// `[A-Za-z0-9._-]` becomes one `-`, at most 63 characters, starting and ending
/// alphanumeric; `unknown` if nothing usable is left.
pub(crate) fn label_value(text: &str) -> String {
    let mut out = String::with_capacity(text.len().min(LABEL_VALUE_MAX));
    let mut replaced = false;
    for character in text.chars() {
        if character.is_ascii_alphanumeric() || matches!(character, '.' | '_' | '-') {
            out.push(character);
            replaced = false;
        } else if !replaced {
            out.push('-');
            replaced = true;
        }
    }
    // Only ASCII is left, so byte positions are character positions.
    out.truncate(LABEL_VALUE_MAX);
    let trimmed = out.trim_matches(|c: char| !c.is_ascii_alphanumeric());
    if trimmed.is_empty() {
        "unknown".to_string()
    } else {
        trimmed.to_string()
    }
}

/// The state as it is published now: the view's snapshot and allocated set,
/// stamped with the current time (RFC 3339).
pub(crate) fn state_of(view: &DeviceView) -> NodeGpuState {
    let mut state = unstamped(view);
    state.timestamp = Some(k8s_openapi::jiff::Timestamp::now().to_string());
    state
}

/// The state as it would be published, without the time.
pub(super) fn unstamped(view: &DeviceView) -> NodeGpuState {
    let mut state = view.snapshot.to_gpu_state(None);
    state.allocated = view.allocated.clone();
    state.shares = view.shares;
    state
}

pub(super) type PatchFuture =
    Pin<Box<dyn Future<Output = (DeviceView, Result<(), CallError>)> + Send>>;

pub(super) fn start_patch(
    nodes: Api<Node>,
    config: &PublisherConfig,
    view: DeviceView,
) -> PatchFuture {
    let name = config.node_name.clone();
    let limit = config.request_timeout;
    Box::pin(async move {
        let body = patch_body(&state_of(&view));
        let (params, patch) = (PatchParams::default(), Patch::Merge(&body));
        let patch = nodes.patch(&name, &params, &patch);
        let result = within(limit, patch).await.map(|_| ());
        (view, result)
    })
}

#[cfg(test)]
mod tests {
    use super::super::test_views::view;
    use super::*;
    use tessera_core::api::{GPU_STATE_VERSION, Health, Vendor};

    fn gpu(id: &str, vendor: Vendor, product: &str, memory_total_bytes: u64) -> GpuDevice {
        GpuDevice {
            mig: None,
            id: id.into(),
            index: 0,
            vendor,
            product: product.into(),
            memory_total_bytes,
            memory_free_bytes: memory_total_bytes,
            fp16_tflops: 100.0,
            fp8_tflops: None,
            fp4_tflops: None,
            memory_bandwidth_gbps: 1000.0,
            temperature_c: None,
            power_w: None,
            numa_node: None,
            health: Health::Healthy,
            health_reason: None,
        }
    }

    fn state(devices: Vec<GpuDevice>) -> NodeGpuState {
        NodeGpuState {
            version: GPU_STATE_VERSION.into(),
            backend: "fake".into(),
            devices,
            links: vec![],
            timestamp: Some("2025-01-02T03:04:05Z".into()),
            allocated: Default::default(),
            shares: Default::default(),
        }
    }

    #[test]
    fn patch_body_exact_output() {
        let mut a = gpu(
            "GPU-a",
            Vendor::Nvidia,
            "NVIDIA H100 80GB HBM3",
            85_520_809_984,
        );
        a.index = 0;
        a.temperature_c = Some(41.0);
        a.power_w = Some(120.5);
        a.numa_node = Some(0);
        let mut b = gpu(
            "GPU-b",
            Vendor::Nvidia,
            "NVIDIA H100 80GB HBM3",
            85_520_809_984,
        );
        b.index = 1;
        b.memory_free_bytes = 1 << 30;
        b.health = Health::Unhealthy;
        b.health_reason = Some("Xid 79".into());
        let s = state(vec![a, b]);
        let annotation = r#"{"version":"v1","backend":"fake","devices":[{"id":"GPU-a","index":0,"vendor":"nvidia","product":"NVIDIA H100 80GB HBM3","memoryTotalBytes":85520809984,"memoryFreeBytes":85520809984,"fp16Tflops":100.0,"memoryBandwidthGbps":1000.0,"temperatureC":41.0,"powerW":120.5,"numaNode":0,"health":"Healthy"},{"id":"GPU-b","index":1,"vendor":"nvidia","product":"NVIDIA H100 80GB HBM3","memoryTotalBytes":85520809984,"memoryFreeBytes":1073741824,"fp16Tflops":100.0,"memoryBandwidthGbps":1000.0,"health":"Unhealthy","healthReason":"Xid 79"}],"links":[],"timestamp":"2025-01-02T03:04:05Z"}"#;
        let want = json!({
            "metadata": {
                "annotations": { "tessera.dev/gpu-state": annotation },
                "labels": {
                    "tessera.dev/gpu.count": "2",
                    "tessera.dev/gpu.vendor": "nvidia",
                    "tessera.dev/gpu.product": "NVIDIA-H100-80GB-HBM3",
                    // 81559 MiB is 79.6 GiB: rounded down.
                    "tessera.dev/gpu.memory-gib": "79",
                }
            }
        });
        let body = patch_body(&s);
        assert_eq!(body, want);
        // The annotation reads back as the same state.
        let text = body["metadata"]["annotations"]["tessera.dev/gpu-state"]
            .as_str()
            .unwrap();
        assert_eq!(NodeGpuState::from_json(text).unwrap(), s);
    }

    #[test]
    fn patch_body_names_only_our_keys() {
        let s = state(vec![gpu(
            "a",
            Vendor::Amd,
            "AMD Instinct MI300X",
            192 << 30,
        )]);
        let body = patch_body(&s);
        let top: Vec<&String> = body.as_object().unwrap().keys().collect();
        assert_eq!(top, ["metadata"]);
        let meta: Vec<&String> = body["metadata"].as_object().unwrap().keys().collect();
        assert_eq!(meta, ["annotations", "labels"]);
        let annotations: Vec<&String> = body["metadata"]["annotations"]
            .as_object()
            .unwrap()
            .keys()
            .collect();
        assert_eq!(annotations, [GPU_STATE_ANNOTATION]);
        let mut labels: Vec<&str> = body["metadata"]["labels"]
            .as_object()
            .unwrap()
            .keys()
            .map(String::as_str)
            .collect();
        labels.sort();
        let mut want = vec![
            LABEL_GPU_COUNT,
            LABEL_GPU_VENDOR,
            LABEL_GPU_PRODUCT,
            LABEL_GPU_MEMORY_GIB,
        ];
        want.sort();
        assert_eq!(labels, want);
        // No nulls: a merge patch null would delete someone's key.
        let values: Vec<&Value> = body["metadata"]["labels"]
            .as_object()
            .unwrap()
            .values()
            .chain(
                body["metadata"]["annotations"]
                    .as_object()
                    .unwrap()
                    .values(),
            )
            .collect();
        assert!(values.iter().all(|v| v.is_string()), "{body}");
    }

    #[test]
    fn patch_body_with_no_devices_sets_only_the_count() {
        let body = patch_body(&state(vec![]));
        assert_eq!(
            body,
            json!({
                "metadata": {
                    "annotations": {
                        "tessera.dev/gpu-state": r#"{"version":"v1","backend":"fake","devices":[],"links":[],"timestamp":"2025-01-02T03:04:05Z"}"#
                    },
                    "labels": { "tessera.dev/gpu.count": "0" }
                }
            })
        );
    }

    #[test]
    fn mixed_vendors_and_the_most_common_product() {
        let s = state(vec![
            gpu("n0", Vendor::Nvidia, "NVIDIA L4", 24 << 30),
            gpu("a0", Vendor::Amd, "AMD Instinct MI300X", 192 << 30),
            gpu("a1", Vendor::Amd, "AMD Instinct MI300X", 191 << 30),
        ]);
        let labels = &patch_body(&s)["metadata"]["labels"];
        assert_eq!(
            labels,
            &json!({
                "tessera.dev/gpu.count": "3",
                "tessera.dev/gpu.vendor": "mixed",
                "tessera.dev/gpu.product": "AMD-Instinct-MI300X",
                // The smallest of that product's devices.
                "tessera.dev/gpu.memory-gib": "191",
            })
        );
    }

    #[test]
    fn a_tie_goes_to_the_first_product_seen() {
        let s = state(vec![
            gpu("a", Vendor::Amd, "AMD Instinct MI210", 64 << 30),
            gpu("b", Vendor::Amd, "AMD Instinct MI300X", 192 << 30),
        ]);
        let labels = &patch_body(&s)["metadata"]["labels"];
        assert_eq!(labels["tessera.dev/gpu.vendor"], "amd");
        assert_eq!(labels["tessera.dev/gpu.product"], "AMD-Instinct-MI210");
        assert_eq!(labels["tessera.dev/gpu.memory-gib"], "64");
    }

    #[test]
    fn unknown_vendors_are_named_so() {
        let s = state(vec![gpu("x", Vendor::Unknown, "Some GPU", 8 << 30)]);
        let labels = &patch_body(&s)["metadata"]["labels"];
        assert_eq!(labels["tessera.dev/gpu.vendor"], "unknown");
    }

    #[test]
    fn label_values_are_sanitised() {
        let long = "A".repeat(70);
        let long_with_tail = format!("{}--xyz", "B".repeat(62));
        let cases = [
            ("NVIDIA H100 80GB HBM3", "NVIDIA-H100-80GB-HBM3"),
            ("NVIDIA A100-SXM4-80GB", "NVIDIA-A100-SXM4-80GB"),
            ("AMD Instinct MI300X (rev. 2)", "AMD-Instinct-MI300X-rev.-2"),
            ("  Radeon™ Pro W7900  ", "Radeon-Pro-W7900"),
            ("GeForce RTX 4090/24G", "GeForce-RTX-4090-24G"),
            ("_.-weird-._", "weird"),
            ("a/b\\c:d=e,f", "a-b-c-d-e-f"),
            ("Ünïcödé GPU", "n-c-d-GPU"),
            ("", "unknown"),
            ("???", "unknown"),
            ("日本語", "unknown"),
            (long.as_str(), &long[..63]),
            // Cut at 63, then the trailing separators go.
            (long_with_tail.as_str(), &long_with_tail[..62]),
        ];
        for (input, want) in cases {
            let got = label_value(input);
            assert_eq!(got, want, "{input:?}");
            assert!(is_label_value(&got), "{got:?}");
        }
    }

    /// The Kubernetes rule for label values, written out independently.
    fn is_label_value(v: &str) -> bool {
        let bytes = v.as_bytes();
        bytes.len() <= 63
            && bytes
                .iter()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
            && bytes.first().is_none_or(u8::is_ascii_alphanumeric)
            && bytes.last().is_none_or(u8::is_ascii_alphanumeric)
    }

    #[test]
    fn the_published_state_carries_an_rfc3339_timestamp() {
        let s = state_of(&view());
        let ts = s.timestamp.clone().unwrap();
        assert!(ts.parse::<k8s_openapi::jiff::Timestamp>().is_ok(), "{ts}");
        assert_eq!(s.devices.len(), 2);
        assert_eq!(s.version, GPU_STATE_VERSION);
        assert!(s.allocated.is_empty());
    }

    #[test]
    fn the_published_state_carries_the_allocated_set() {
        let mut v = view();
        v.allocated.insert("GPU-a".into(), "pod-uid-1".into());
        v.allocated.insert("GPU-b".into(), "unbound".into());
        let s = state_of(&v);
        assert_eq!(s.allocated, v.allocated);
        let body = patch_body(&s);
        let text = body["metadata"]["annotations"][GPU_STATE_ANNOTATION]
            .as_str()
            .unwrap();
        assert!(
            text.ends_with(r#","allocated":{"GPU-a":"pod-uid-1","GPU-b":"unbound"}}"#),
            "{text}"
        );
        assert_eq!(
            NodeGpuState::from_json(text).unwrap().allocated,
            v.allocated
        );
    }
}
