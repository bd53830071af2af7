//! The CUDA probe. Without a CUDA driver (as on CI) it must say so and not
//! panic; the real measurement test is `#[ignore]`d: on a node with the NVIDIA
//! driver run `cargo test --test cuda_probe -- --ignored`.

use std::collections::BTreeMap;

use tessera::api::{LinkKind, Vendor};
use tessera::backend::cuda_probe::{self, DeviceProbe, ProbeReport};
use tessera::backend::{BackendError, DeviceInfo, DeviceLink, GpuBackend};

fn device(id: &str, index: u32) -> DeviceInfo {
    DeviceInfo {
        id: id.into(),
        index,
        vendor: Vendor::Nvidia,
        product: "NVIDIA H100 80GB HBM3".into(),
        memory_total_bytes: 80 << 30,
        architecture: "9.0".into(),
        compute_units: 132,
        fp16_tflops: 989.4,
        fp8_tflops: None,
        fp4_tflops: None,
        memory_bandwidth_gbps: 3352.0,
        pci_bus_id: format!("0000:{:02x}:00.0", 0x18 + index),
        numa_node: Some(0),
        mig: None,
    }
}

#[test]
fn without_libcuda_the_probe_is_unavailable() {
    if cuda_probe::cuda_library_available() {
        println!("skipped: a CUDA driver library is present on this machine");
        return;
    }
    let devices = [device("GPU-a", 0), device("GPU-b", 1)];
    match cuda_probe::probe(&devices) {
        Err(BackendError::Unavailable(msg)) => {
            assert!(msg.contains(cuda_probe::CUDA_LIBRARY), "{msg}");
            assert!(msg.contains("runtimeClassName: nvidia"), "{msg}");
            assert!(msg.contains("compute"), "{msg}");
        }
        other => panic!("expected Unavailable, got {other:?}"),
    }
}

fn link(a: &str, b: &str, p2p: bool) -> DeviceLink {
    DeviceLink {
        a: a.into(),
        b: b.into(),
        kind: LinkKind::Pcie,
        bandwidth_gbps: 63.0,
        p2p,
    }
}

#[test]
fn report_sets_link_p2p_from_the_matrix() {
    let mut p2p: BTreeMap<String, BTreeMap<String, bool>> = BTreeMap::new();
    let mut set = |a: &str, b: &str, v: bool| {
        p2p.entry(a.into()).or_default().insert(b.into(), v);
    };
    set("GPU-a", "GPU-b", true);
    set("GPU-b", "GPU-a", true);
    set("GPU-a", "GPU-c", true);
    set("GPU-c", "GPU-a", false);
    let report = ProbeReport {
        devices: vec![],
        p2p,
    };
    let mut links = vec![
        link("GPU-a", "GPU-b", false),
        link("GPU-a", "GPU-c", true),
        link("GPU-b", "GPU-x", true),
    ];
    report.apply(&mut links);
    assert!(links[0].p2p, "both ways: p2p");
    assert!(!links[1].p2p, "one way only: no p2p");
    assert!(links[2].p2p, "not probed: unchanged");
    assert_eq!(report.can_access("GPU-a", "GPU-c"), Some(true));
    assert_eq!(report.can_access("GPU-a", "GPU-x"), None);
}

#[test]
fn report_serialises_in_camel_case() {
    let report = ProbeReport {
        devices: vec![DeviceProbe {
            id: "GPU-a".into(),
            cuda_ordinal: Some(0),
            verified: true,
            error: None,
            host_to_device_gbps: Some(25.1),
            device_to_device_gbps: Some(2900.0),
            notes: vec![],
        }],
        p2p: BTreeMap::from([(
            "GPU-a".to_string(),
            BTreeMap::from([("GPU-b".to_string(), true)]),
        )]),
    };
    let json = serde_json::to_value(&report).unwrap();
    assert_eq!(json["devices"][0]["hostToDeviceGbps"], 25.1);
    assert_eq!(json["devices"][0]["deviceToDeviceGbps"], 2900.0);
    assert_eq!(json["devices"][0]["cudaOrdinal"], 0);
    assert_eq!(json["p2p"]["GPU-a"]["GPU-b"], true);
    assert!(json["devices"][0].get("error").is_none());
    let back: ProbeReport = serde_json::from_value(json).unwrap();
    assert_eq!(back, report);
    assert_eq!(back.device("GPU-a").unwrap().cuda_ordinal, Some(0));
}

#[test]
#[ignore = "needs an NVIDIA GPU and driver"]
fn real_probe_verifies_and_measures() {
    let mut nvml = tessera::backend::nvml::NvmlBackend::new(None).expect("NVML");
    let devices = nvml.devices().unwrap();
    let report = cuda_probe::probe(&devices).unwrap();
    println!("{}", serde_json::to_string_pretty(&report).unwrap());
    assert_eq!(report.devices.len(), devices.len());
    for d in &report.devices {
        assert!(d.verified, "{d:?}");
        assert!(d.host_to_device_gbps.unwrap() > 1.0, "{d:?}");
        assert!(d.device_to_device_gbps.unwrap() > 50.0, "{d:?}");
    }
    let mut links = nvml.links(&devices).unwrap();
    report.apply(&mut links);
    for l in &links {
        println!("{l:?}");
    }
}
