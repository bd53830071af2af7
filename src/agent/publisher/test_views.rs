//! Device views for the publisher's tests.

use std::collections::BTreeMap;

use crate::agent::state::DeviceView;
use crate::backend::{DeviceInfo, DeviceState, RawHealth, Snapshot, Telemetry};
use tessera_core::api::Vendor;

const GIB: u64 = 1 << 30;

pub(super) fn device(id: &str, index: u32, vendor: Vendor, product: &str, gib: u64) -> DeviceState {
    DeviceState {
        info: DeviceInfo {
            id: id.into(),
            index,
            vendor,
            product: product.into(),
            memory_total_bytes: gib * GIB,
            architecture: "9.0".into(),
            compute_units: 132,
            fp16_tflops: 989.0,
            fp8_tflops: None,
            fp4_tflops: None,
            memory_bandwidth_gbps: 3350.0,
            pci_bus_id: format!("0000:{:02x}:00.0", 0x10 + index),
            numa_node: Some(0),
            mig: None,
        },
        telemetry: Telemetry {
            temperature_c: Some(40.0),
            power_w: Some(100.0),
            graphics_clock_mhz: Some(1410),
            memory_clock_mhz: Some(1593),
            utilization_percent: Some(0),
            memory_used_bytes: GIB,
            memory_free_bytes: (gib - 1) * GIB,
            ..Telemetry::default()
        },
        health: RawHealth::Healthy,
    }
}

pub(super) fn view() -> DeviceView {
    DeviceView {
        snapshot: Snapshot {
            backend: "fake".into(),
            devices: vec![
                device("GPU-a", 0, Vendor::Nvidia, "NVIDIA H100 80GB HBM3", 80),
                device("GPU-b", 1, Vendor::Nvidia, "NVIDIA H100 80GB HBM3", 80),
            ],
            links: vec![],
        },
        allocated: BTreeMap::new(),
        holdings: Vec::new(),
        shares: Default::default(),
        ready: true,
        error: None,
    }
}
