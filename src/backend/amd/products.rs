//! The datasheet table of AMD Instinct products: what sysfs does not say
//! about a board, looked up by its PCI device id.

/// Datasheet figures of AMD Instinct products, by PCI device id (ids from the
/// `amdgpu.ids` table shipped with libdrm). Used for the product name when the
/// board has no `product_name`, for the xGMI per-link bandwidth, and as the
/// fallback for compute and memory figures sysfs does not give.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) struct AmdProduct {
    pub(super) device_id: u32,
    pub(super) name: &'static str,
    /// Dense FP16 TFLOPS of one KFD device (one GCD on MI250X).
    pub(super) fp16_tflops: f64,
    /// Peak memory bandwidth of one KFD device, GB/s.
    pub(super) memory_bandwidth_gbps: f64,
    /// One Infinity Fabric (xGMI) link, both directions, GB/s.
    pub(super) xgmi_link_gbps: f64,
}

const PRODUCTS: &[AmdProduct] = &[
    // 304 CUs × 2100 MHz, HBM3 8192 bit × 5.2 Gb/s, 7 links of 128 GB/s.
    AmdProduct {
        device_id: 0x74a1,
        name: "AMD Instinct MI300X",
        fp16_tflops: 1307.4,
        memory_bandwidth_gbps: 5300.0,
        xgmi_link_gbps: 128.0,
    },
    // Same compute as MI300X, 256 GB HBM3E at 6 TB/s.
    AmdProduct {
        device_id: 0x74a5,
        name: "AMD Instinct MI325X",
        fp16_tflops: 1307.4,
        memory_bandwidth_gbps: 6000.0,
        xgmi_link_gbps: 128.0,
    },
    // APU: 228 CUs × 2100 MHz, 128 GB unified HBM3.
    AmdProduct {
        device_id: 0x74a0,
        name: "AMD Instinct MI300A",
        fp16_tflops: 980.6,
        memory_bandwidth_gbps: 5300.0,
        xgmi_link_gbps: 128.0,
    },
    // Each MI250X package is two GCDs, each its own KFD node: per GCD 110 CUs
    // × 1700 MHz, 64 GB HBM2e 4096 bit × 3.2 Gb/s; links 100 GB/s.
    AmdProduct {
        device_id: 0x7408,
        name: "AMD Instinct MI250X",
        fp16_tflops: 191.5,
        memory_bandwidth_gbps: 1638.4,
        xgmi_link_gbps: 100.0,
    },
    // amdgpu.ids names 0x740c "MI250X / MI250"; figures are MI250X's per GCD
    // (MI250: 104 CUs, 181 TFLOPS per GCD).
    AmdProduct {
        device_id: 0x740c,
        name: "AMD Instinct MI250X / MI250",
        fp16_tflops: 191.5,
        memory_bandwidth_gbps: 1638.4,
        xgmi_link_gbps: 100.0,
    },
    // 104 CUs × 1700 MHz, HBM2e 4096 bit × 3.2 Gb/s, bridge links 100 GB/s.
    AmdProduct {
        device_id: 0x740f,
        name: "AMD Instinct MI210",
        fp16_tflops: 181.0,
        memory_bandwidth_gbps: 1638.4,
        xgmi_link_gbps: 100.0,
    },
    // 120 CUs × 1502 MHz, HBM2 4096 bit × 2.4 Gb/s, 3 links of 92 GB/s.
    AmdProduct {
        device_id: 0x738c,
        name: "AMD Instinct MI100",
        fp16_tflops: 184.6,
        memory_bandwidth_gbps: 1228.8,
        xgmi_link_gbps: 92.0,
    },
    // 256 CUs × 2200 / 2400 MHz, HBM3E 8 TB/s, 7 links of 153.6 GB/s.
    AmdProduct {
        device_id: 0x75a0,
        name: "AMD Instinct MI350X",
        fp16_tflops: 2306.9,
        memory_bandwidth_gbps: 8000.0,
        xgmi_link_gbps: 153.6,
    },
    AmdProduct {
        device_id: 0x75a3,
        name: "AMD Instinct MI355X",
        fp16_tflops: 2516.6,
        memory_bandwidth_gbps: 8000.0,
        xgmi_link_gbps: 153.6,
    },
];

/// The datasheet entry of a PCI device id.
pub(super) fn product(device_id: u32) -> Option<&'static AmdProduct> {
    PRODUCTS.iter().find(|entry| entry.device_id == device_id)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn product_ids() {
        assert_eq!(product(0x74a1).unwrap().name, "AMD Instinct MI300X");
        assert_eq!(product(0x740f).unwrap().name, "AMD Instinct MI210");
        assert_eq!(product(0x738c).unwrap().name, "AMD Instinct MI100");
        assert!(product(0x740c).unwrap().name.contains("MI250X"));
        assert!(product(0x1234).is_none());
    }
}
