//! Link bandwidths by technology, both directions together as NVIDIA quotes
//! them: NVLink per link by version, PCIe by generation and width.

/// Bandwidth of one NVLink link, both directions together, by the value of
/// `nvmlDeviceGetNvLinkVersion` (an `nvmlNvlinkVersion_t`):
///
/// | value | NVLink | GPU       | GB/s per link | links × GB/s |
/// |-------|--------|-----------|---------------|--------------|
/// | 1     | 1.0    | P100      | 40            | 4 → 160      |
/// | 2, 3  | 2.0/2.2| V100      | 50            | 6 → 300      |
/// | 4, 5  | 3.0/3.1| A100      | 50            | 12 → 600     |
/// | 6     | 4.0    | H100      | 50            | 18 → 900     |
/// | 7     | 5.0    | B200      | 100           | 18 → 1800    |
///
/// Newer values get the newest known rate; an unknown version (0) 50.
pub(super) fn nvlink_gbps_per_link(version: u32) -> f64 {
    match version {
        1 => 40.0,
        7.. => 100.0,
        _ => 50.0,
    }
}

/// PCIe bandwidth in GB/s, both directions together, like the NVLink figures
/// (so a Gen4 x16 link is 63 GB/s, what NVIDIA calls "64 GB/s"). Per lane and
/// direction: Gen1 0.25 and Gen2 0.5 (8b/10b), Gen3 0.985, Gen4 1.969, Gen5
/// 3.938 (128b/130b), Gen6 7.563 (FLIT). Newer generations get Gen6's rate.
pub(super) fn pcie_gbps(generation: u32, width: u32) -> Option<f64> {
    let per_lane_one_way = match generation {
        0 => return None,
        1 => 0.25,
        2 => 0.5,
        3 => 0.985,
        4 => 1.969,
        5 => 3.938,
        _ => 7.563,
    };
    (width > 0).then(|| per_lane_one_way * 2.0 * f64::from(width))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(got: f64, want: f64, tolerance: f64) -> bool {
        (got - want).abs() <= tolerance
    }

    #[test]
    fn link_tables() {
        assert_eq!(18.0 * nvlink_gbps_per_link(6), 900.0);
        assert_eq!(12.0 * nvlink_gbps_per_link(4), 600.0);
        assert_eq!(18.0 * nvlink_gbps_per_link(7), 1800.0);
        assert!(close(pcie_gbps(4, 16).unwrap(), 63.0, 0.01));
        assert!(close(pcie_gbps(5, 16).unwrap(), 126.0, 0.1));
        assert_eq!(pcie_gbps(0, 16), None);
        assert_eq!(pcie_gbps(4, 0), None);
    }
}
