//! What an AMD GPU can do, worked out from what sysfs says about it: dense
//! FP16 throughput and memory bandwidth from the GFX target's per-clock
//! factors, PCIe and xGMI bandwidths from link speeds and counts, with the
//! datasheet ([`super::products`]) and deliberately low fallbacks where
//! sysfs has no answer.

use super::kfd::{Gpu, RawLink};
use super::products::AmdProduct;

/// Memory bandwidth used when neither sysfs nor the product table can tell:
/// low on purpose (dual-channel DDR5 class) so the planner never favours a
/// device it cannot characterise.
pub(super) const FALLBACK_MEMORY_BANDWIDTH_GBPS: f64 = 64.0;
/// One xGMI link, both directions, when neither the product nor the kernel
/// says: 16 lanes × 25 Gb/s each way, the kernel's own assumption for MI200.
const FALLBACK_XGMI_LINK_GBPS: f64 = 100.0;
/// PCIe between two GPUs when the link speed cannot be read: Gen4 x16, both directions.
pub(super) const FALLBACK_PCIE_GBPS: f64 = 63.0;

/// `gfx942` from KFD's `gfx_target_version` (`90402`).
pub(super) fn gfx_target_name(version: u64) -> String {
    let (major, minor, stepping) = gfx_parts(version);
    format!("gfx{major}{minor}{stepping:x}")
}

fn gfx_parts(version: u64) -> (u64, u64, u64) {
    (version / 10000, (version / 100) % 100, version % 100)
}

/// Dense FP16/BF16 FLOPs one compute unit retires per clock, by GFX target:
///
/// | target | products | FLOPs/CU/clock | check |
/// |---|---|---|---|
/// | gfx950 | MI350X, MI355X | 4096 | 256 CUs × 2.4 GHz → 2.5 PF (MI355X) |
/// | gfx940–942 | MI300A/X, MI325X | 2048 | 304 × 2.1 GHz → 1307 TF (MI300X) |
/// | gfx90a | MI210, MI250(X) | 1024 | 104 × 1.7 GHz → 181 TF (MI210) |
/// | gfx908 | MI100 | 1024 | 120 × 1.502 GHz → 184.6 TF |
/// | gfx12xx | RDNA4 | 1024 | 64 × 2.97 GHz → 195 TF (RX 9070 XT; not checked on hardware) |
/// | gfx11xx | RDNA3 | 512 | 96 × 2.5 GHz → 123 TF (RX 7900 XTX) |
/// | others | GCN, RDNA1/2 | 256 | packed FP16 on the vector ALUs: 64 lanes × FMA × 2 |
pub(super) fn fp16_flops_per_cu_clock(gfx_target_version: u64) -> u32 {
    match gfx_parts(gfx_target_version) {
        (9, 5, _) => 4096,
        (9, 4, _) => 2048,
        (9, 0, 10) | (9, 0, 8) => 1024,
        (12, _, _) => 1024,
        (11, _, _) => 512,
        _ => 256,
    }
}

/// How many times the FP16 rate the dense FP8 and FP4 rates are, by GFX
/// target; 0 where the matrix cores lack the format. CDNA3 (gfx94x) added FP8
/// at twice the FP16 rate (MI300X 2,615 TF), CDNA4 (gfx950) FP4 at four times
/// it (MI355X 10.1 PF MXFP4), RDNA4 (gfx12) FP8 at twice (not checked on
/// hardware).
pub(super) fn narrow_ratios(gfx_target_version: u64) -> (f64, f64) {
    match gfx_parts(gfx_target_version) {
        (9, 5, _) => (2.0, 4.0),
        (9, 4, _) | (12, _, _) => (2.0, 0.0),
        _ => (0.0, 0.0),
    }
}

/// Data transfers per pin per reported memory clock (`mem_clk_max`), by GFX
/// target, where known: HBM3 on gfx94x reports a quarter of the data rate
/// (MI300X: 1300 MHz → 5.2 Gb/s → 8192 bit → 5.3 TB/s); HBM2/HBM2e on gfx906,
/// gfx908 and gfx90a report half (MI210: 1600 MHz → 3.2 Gb/s → 4096 bit →
/// 1.64 TB/s). Other targets (GDDR, HBM3E on gfx950) are not known here.
fn transfers_per_memory_clock(gfx_target_version: u64) -> Option<u32> {
    match gfx_parts(gfx_target_version) {
        (9, 4, _) => Some(4),
        (9, 0, 6) | (9, 0, 8) | (9, 0, 10) => Some(2),
        _ => None,
    }
}

/// One direction of a PCIe link in GB/s from `current_link_speed`
/// (`16.0 GT/s PCIe`) and `current_link_width` (`16`): 8b/10b line encoding
/// below 8 GT/s, 128b/130b from there (also used for Gen6's FLIT mode).
pub(super) fn pcie_gbps_one_way(speed: &str, width: &str) -> Option<f64> {
    let gts: f64 = speed.split_whitespace().next()?.parse().ok()?;
    let lanes: u32 = width.trim().parse().ok()?;
    if !(gts.is_finite() && gts > 0.0) || lanes == 0 {
        return None;
    }
    let encoding = if gts < 8.0 { 0.8 } else { 128.0 / 130.0 };
    Some(gts * f64::from(lanes) * encoding / 8.0)
}

/// A figure rounded to one decimal, as datasheets quote them.
pub(super) fn round1(value: f64) -> f64 {
    (value * 10.0).round() / 10.0
}

/// Memory bandwidth of a GPU, GB/s: VRAM width × `mem_clk_max` × transfers
/// per clock for its GFX target / 8, checked against the datasheet (see the
/// backend's docs for when which wins).
pub(super) fn memory_bandwidth(gpu: &Gpu, table: Option<&AmdProduct>) -> f64 {
    let Some(first) = gpu.first() else {
        return FALLBACK_MEMORY_BANDWIDTH_GBPS;
    };
    // Partitions may each see part of the memory; the datasheet knows the whole.
    if gpu.nodes.len() > 1
        && let Some(datasheet) = table
    {
        return datasheet.memory_bandwidth_gbps;
    }
    let width = gpu
        .nodes
        .iter()
        .map(|node| node.vram_width_bits)
        .max()
        .unwrap_or(0);
    let clock = gpu
        .nodes
        .iter()
        .map(|node| node.mem_clk_max_mhz)
        .max()
        .unwrap_or(0);
    let from_sysfs =
        |transfers: u32| round1(width as f64 * clock as f64 * f64::from(transfers) / 8.0 / 1000.0);
    if width > 0 && clock > 0 {
        let estimate = transfers_per_memory_clock(first.gfx_target_version).map(from_sysfs);
        return match (estimate, table) {
            (Some(estimate), Some(datasheet))
                if (estimate / datasheet.memory_bandwidth_gbps - 1.0).abs() > 0.25 =>
            {
                tracing::debug!(
                    estimate,
                    datasheet = datasheet.memory_bandwidth_gbps,
                    "memory bandwidth from sysfs is off the datasheet; using the datasheet"
                );
                datasheet.memory_bandwidth_gbps
            }
            (Some(estimate), _) => estimate,
            (None, Some(datasheet)) => datasheet.memory_bandwidth_gbps,
            (None, None) => from_sysfs(2),
        };
    }
    table.map_or(FALLBACK_MEMORY_BANDWIDTH_GBPS, |datasheet| {
        datasheet.memory_bandwidth_gbps
    })
}

/// Both directions of an xGMI connection between two GPUs, GB/s.
pub(super) fn xgmi_gbps(link: &RawLink, table: Option<&AmdProduct>) -> f64 {
    let links = if link.min_mbps > 0 && link.max_mbps >= link.min_mbps {
        (link.max_mbps as f64 / link.min_mbps as f64)
            .round()
            .max(1.0)
    } else {
        1.0
    };
    match table {
        Some(datasheet) => round1(links * datasheet.xgmi_link_gbps),
        None if link.max_mbps > 0 => round1(2.0 * link.max_mbps as f64 / 1000.0),
        None => links * FALLBACK_XGMI_LINK_GBPS,
    }
}

#[cfg(test)]
mod tests {
    use super::super::kfd::IOLINK_XGMI;
    use super::super::products::product;
    use super::*;

    #[test]
    fn gfx_names() {
        assert_eq!(gfx_target_name(90402), "gfx942");
        assert_eq!(gfx_target_name(90010), "gfx90a");
        assert_eq!(gfx_target_name(90008), "gfx908");
        assert_eq!(gfx_target_name(110000), "gfx1100");
        assert_eq!(gfx_target_name(100300), "gfx1030");
        assert_eq!(gfx_target_name(90500), "gfx950");
    }

    #[test]
    fn datasheet_checks() {
        let tf =
            |cus: f64, mhz: f64, gfx| cus * mhz * f64::from(fp16_flops_per_cu_clock(gfx)) / 1e6;
        assert!((tf(304.0, 2100.0, 90402) - 1307.4).abs() < 0.1, "MI300X");
        assert!((tf(104.0, 1700.0, 90010) - 181.0).abs() < 0.1, "MI210");
        assert!((tf(120.0, 1502.0, 90008) - 184.6).abs() < 0.1, "MI100");
        assert!((tf(256.0, 2400.0, 90500) - 2516.6).abs() < 0.1, "MI355X");
        let bw = |bits: f64, mhz: f64, gfx| {
            bits * mhz * f64::from(transfers_per_memory_clock(gfx).unwrap()) / 8.0 / 1000.0
        };
        assert!((bw(8192.0, 1300.0, 90402) - 5324.8).abs() < 0.1, "MI300X");
        assert!((bw(4096.0, 1600.0, 90010) - 1638.4).abs() < 0.1, "MI210");
        assert!((bw(4096.0, 1200.0, 90008) - 1228.8).abs() < 0.1, "MI100");
    }

    #[test]
    fn narrow_rates_by_target() {
        // MI300X: 2,614.9 FP8 TF; MI355X: 10.1 PF MXFP4; MI210: neither.
        assert_eq!(narrow_ratios(90402), (2.0, 0.0));
        assert_eq!(narrow_ratios(90500), (2.0, 4.0));
        assert_eq!(narrow_ratios(90010), (0.0, 0.0));
        assert_eq!(narrow_ratios(110000), (0.0, 0.0));
    }

    #[test]
    fn pcie_speeds() {
        let g4 = pcie_gbps_one_way("16.0 GT/s PCIe\n", "16\n").unwrap();
        assert!((g4 - 31.5).abs() < 0.1, "{g4}");
        let g5 = pcie_gbps_one_way("32.0 GT/s PCIe", "16").unwrap();
        assert!((g5 - 63.0).abs() < 0.1, "{g5}");
        let g1 = pcie_gbps_one_way("2.5 GT/s", "1").unwrap();
        assert!((g1 - 0.25).abs() < 1e-9, "{g1}");
        assert_eq!(pcie_gbps_one_way("Unknown", "16"), None);
        assert_eq!(pcie_gbps_one_way("16.0 GT/s PCIe", "x"), None);
        assert_eq!(pcie_gbps_one_way("16.0 GT/s PCIe", "0"), None);
        assert_eq!(pcie_gbps_one_way("", ""), None);
    }

    #[test]
    fn xgmi_link_counts() {
        let link = |min, max| RawLink {
            kind: IOLINK_XGMI,
            from: 1,
            to: 2,
            min_mbps: min,
            max_mbps: max,
        };
        let mi300x = product(0x74a1);
        assert_eq!(xgmi_gbps(&link(64000, 64000), mi300x), 128.0);
        assert_eq!(
            xgmi_gbps(&link(50000, 50000), mi300x),
            128.0,
            "older kernels"
        );
        let mi250x = product(0x7408);
        assert_eq!(
            xgmi_gbps(&link(50000, 200000), mi250x),
            400.0,
            "4 links in a package"
        );
        assert_eq!(
            xgmi_gbps(&link(0, 0), product(0x738c)),
            92.0,
            "MI100 reports no bandwidth"
        );
        assert_eq!(xgmi_gbps(&link(50000, 50000), None), 100.0);
        assert_eq!(xgmi_gbps(&link(0, 0), None), FALLBACK_XGMI_LINK_GBPS);
    }
}
