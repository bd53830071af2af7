//! What NVML does not say outright about a GPU's speed, estimated from what it
//! does say: dense FP16 tensor throughput from SMs, clock and compute
//! capability (FP8 and FP4 from it where the tensor cores have them), memory
//! bandwidth from bus width and memory clock, and SM counts by product for
//! drivers that do not report them. The tables carry the data-sheet checks
//! they were fitted to.

/// Dense FP16 tensor-core FLOPs per SM per clock, by compute capability; a GPU
/// uses the last entry at or below its own capability (8.7 → 8.6, 10.3 → 10.0).
///
/// | cc   | FLOPs | check (SMs × clock × FLOPs)                           |
/// |------|-------|-------------------------------------------------------|
/// | 6.0  | 256   | P100: 56 × 1480 MHz → 21.2 TFLOPS (half2 on CUDA cores)|
/// | 6.1  | 4     | consumer Pascal: FP16 at 1/64 of FP32                 |
/// | 7.0  | 1024  | V100 SXM2: 80 × 1530 → 125                            |
/// | 7.5  | 1024  | T4: 40 × 1590 → 65                                    |
/// | 8.0  | 2048  | A100: 108 × 1410 → 312; A30: 56 × 1440 → 165          |
/// | 8.6  | 1024  | A40: 84 × 1740 → 150; A10: 72 × 1695 → 125            |
/// | 8.9  | 1024  | L4: 58 × 2040 → 121; L40S: 142 × 2520 → 366 (≈ 362)   |
/// | 9.0  | 4096  | H100 SXM: 132 × 1830 → 989                            |
/// | 10.0 | 8192  | B200: 148 × ~1860 → ~2250                             |
/// | 12.0 | 1024  | (workstation Blackwell; GeForce halved, see below)    |
///
/// Anything older than 6.0 gets 128, a rough figure: such GPUs have no fast
/// FP16 and are not a target for large models. GeForce cards from Turing (7.5)
/// on run FP16 tensor math with FP32 accumulate at half rate, so a product
/// named "GeForce" gets half (RTX 4090: 128 × 2520 × 512 → 165).
const FP16_FLOPS_PER_SM_CLOCK: &[((i32, i32), f64)] = &[
    ((0, 0), 128.0),
    ((6, 0), 256.0),
    ((6, 1), 4.0),
    ((7, 0), 1024.0),
    ((7, 5), 1024.0),
    ((8, 0), 2048.0),
    ((8, 6), 1024.0),
    ((8, 9), 1024.0),
    ((9, 0), 4096.0),
    ((10, 0), 8192.0),
    ((12, 0), 1024.0),
];

/// FP8 and FP4 rates as multiples of the FP16 rate.
type NarrowRatios = (f64, f64);

/// How many times the FP16 tensor rate the FP8 and FP4 tensor rates are, by
/// compute capability (same lookup as above); 0 where the tensor cores lack
/// the format. Ada (8.9) and Hopper (9.0) added FP8 at twice the FP16 rate
/// (H100 SXM 1,979 dense; L4 242.5; L40S 733; RTX 4090 330 with FP32
/// accumulate, twice its halved FP16), Blackwell (10.0, 12.0) FP4 at four
/// times it (B200 9 PFLOPS dense). Blackwell Ultra's larger FP4 rate (B300)
/// is not told apart: it gets B200's ratio.
const NARROW_RATIOS: &[((i32, i32), NarrowRatios)] = &[
    ((0, 0), (0.0, 0.0)),
    ((8, 9), (2.0, 0.0)),
    ((9, 0), (2.0, 0.0)),
    ((10, 0), (2.0, 4.0)),
    ((12, 0), (2.0, 4.0)),
];

/// The dense FP8 and FP4 rates of a GPU of this capability whose FP16 rate
/// is `fp16_tflops`, where its tensor cores have them.
pub(super) fn estimate_narrow_tflops(
    major: i32,
    minor: i32,
    fp16_tflops: Option<f64>,
) -> (Option<f64>, Option<f64>) {
    let (fp8, fp4) = by_capability(NARROW_RATIOS, major, minor).unwrap_or((0.0, 0.0));
    let rate = |ratio: f64| fp16_tflops.filter(|_| ratio > 0.0).map(|fp16| fp16 * ratio);
    (rate(fp8), rate(fp4))
}

/// FP32 CUDA cores per SM, to turn `nvmlDeviceGetNumGpuCores` into SMs
/// (A100: 6912 / 64 = 108; H100 SXM: 16896 / 128 = 132). Same lookup as above.
const CUDA_CORES_PER_SM: &[((i32, i32), u32)] = &[
    ((3, 0), 192),
    ((5, 0), 128),
    ((6, 0), 64),
    ((6, 1), 128),
    ((7, 0), 64),
    ((8, 0), 64),
    ((8, 6), 128),
    ((9, 0), 128),
    ((10, 0), 128),
];

/// A product-name rule: every word of the first list is in the name, none of
/// the second (case-insensitive, words split at anything not alphanumeric).
type ProductRule = (&'static [&'static str], &'static [&'static str], u32);

/// SM counts by product, for when NVML does not tell (`nvmlDeviceGetAttributes`
/// only answers for MIG devices; `nvmlDeviceGetNumGpuCores` needs a recent
/// driver). First match wins. Data-sheet figures.
const SM_COUNT_BY_PRODUCT: &[ProductRule] = &[
    (&["H100", "PCIe"], &[], 114),
    (&["H100"], &[], 132),
    (&["H800", "PCIe"], &[], 114),
    (&["H800"], &[], 132),
    (&["H200"], &[], 132),
    (&["GH200"], &[], 132),
    (&["B200"], &[], 148),
    (&["A100"], &[], 108),
    (&["A800"], &[], 108),
    (&["A30"], &[], 56),
    (&["A10G"], &[], 80),
    (&["A10"], &[], 72),
    (&["A40"], &[], 84),
    (&["L40S"], &[], 142),
    (&["L40"], &[], 142),
    (&["L4"], &[], 58),
    (&["V100"], &[], 80),
    (&["V100S"], &[], 80),
    (&["T4"], &[], 40),
    (&["GeForce", "4090"], &["D"], 128),
    (&["GeForce", "3090", "Ti"], &[], 84),
    (&["GeForce", "3090"], &[], 82),
];

/// Products whose data-sheet tensor throughput is quoted at a lower SM clock
/// than the maximum NVML reports: H100 SXM reports 1980 MHz, but NVIDIA's 989
/// TFLOPS is 132 × 4096 × 1830 MHz; H100 PCIe (max 1755) is quoted at 1620
/// (114 SMs → 756); RTX 4090 reports ~3105 but its 165 TFLOPS is at the 2520
/// MHz boost clock. Dense tensor math does not sustain the maximum clock under
/// the power limit, so the quoted clock is the better estimate. The smaller of
/// this and NVML's maximum is used.
const TENSOR_CLOCK_MHZ_BY_PRODUCT: &[ProductRule] = &[
    (&["H100", "HBM3"], &[], 1830),
    (&["H100", "PCIe"], &[], 1620),
    (&["H200"], &["NVL"], 1830),
    (&["GH200"], &[], 1830),
    (&["GeForce", "4090"], &[], 2520),
];

fn matches_product(product: &str, all_of: &[&str], none_of: &[&str]) -> bool {
    let words: Vec<String> = product
        .split(|c: char| !c.is_ascii_alphanumeric())
        .filter(|w| !w.is_empty())
        .map(str::to_ascii_lowercase)
        .collect();
    let has = |wanted: &&str| words.iter().any(|word| word.eq_ignore_ascii_case(wanted));
    all_of.iter().all(has) && !none_of.iter().any(has)
}

fn product_rule(rules: &[ProductRule], product: &str) -> Option<u32> {
    rules
        .iter()
        .find(|(all, none, _)| matches_product(product, all, none))
        .map(|r| r.2)
}

fn by_capability<T: Copy>(table: &[((i32, i32), T)], major: i32, minor: i32) -> Option<T> {
    table
        .iter()
        .rev()
        .find(|(cc, _)| *cc <= (major, minor))
        .map(|e| e.1)
}

/// FP32 CUDA cores per SM for this compute capability (see `CUDA_CORES_PER_SM`).
pub(super) fn cuda_cores_per_sm(major: i32, minor: i32) -> Option<u32> {
    by_capability(CUDA_CORES_PER_SM, major, minor)
}

/// SM count from the product table (see `SM_COUNT_BY_PRODUCT`).
pub(super) fn sm_count_by_product(product: &str) -> Option<u32> {
    product_rule(SM_COUNT_BY_PRODUCT, product)
}

/// Dense FP16 tensor FLOPs per SM per clock for a product of this capability.
fn fp16_flops_per_sm_clock(product: &str, major: i32, minor: i32) -> Option<f64> {
    let per_sm = by_capability(FP16_FLOPS_PER_SM_CLOCK, major, minor)?;
    let geforce_half_rate = (major, minor) >= (7, 5) && matches_product(product, &["GeForce"], &[]);
    Some(if geforce_half_rate {
        per_sm / 2.0
    } else {
        per_sm
    })
}

/// Estimated dense FP16 TFLOPS = SMs × SM clock × FP16 tensor FLOPs per SM per
/// clock (`FP16_FLOPS_PER_SM_CLOCK`). The clock is NVML's maximum SM clock,
/// capped by the clock NVIDIA quotes tensor throughput at for the products in
/// `TENSOR_CLOCK_MHZ_BY_PRODUCT`. `None` when the SM count or a clock is
/// unknown.
pub(super) fn estimate_fp16_tflops(
    product: &str,
    major: i32,
    minor: i32,
    sms: Option<u32>,
    max_sm_clock_mhz: Option<u32>,
) -> Option<f64> {
    let sms = sms.filter(|&s| s > 0)?;
    let quoted = product_rule(TENSOR_CLOCK_MHZ_BY_PRODUCT, product);
    let mhz = match (max_sm_clock_mhz.filter(|&c| c > 0), quoted) {
        (Some(max), Some(q)) => max.min(q),
        (Some(c), None) | (None, Some(c)) => c,
        (None, None) => return None,
    };
    let per_sm = fp16_flops_per_sm_clock(product, major, minor)?;
    Some(f64::from(sms) * f64::from(mhz) * per_sm / 1e6)
}

/// Estimated memory bandwidth in GB/s = bus width in bytes × maximum memory
/// clock × 2 (NVML's memory clock counts one transfer per edge of the double
/// data rate). H100 SXM: 5120 / 8 × 2619 MHz × 2 = 3352; A100 40 GB: 5120 / 8 ×
/// 1215 × 2 = 1555; RTX 4090: 384 / 8 × 10501 × 2 = 1008.
pub(super) fn estimate_memory_bandwidth_gbps(
    bus_width_bits: Option<u32>,
    max_memory_clock_mhz: Option<u32>,
) -> Option<f64> {
    let bits = bus_width_bits.filter(|&b| b > 0)?;
    let mhz = max_memory_clock_mhz.filter(|&c| c > 0)?;
    Some(f64::from(bits) / 8.0 * f64::from(mhz) * 2.0 / 1000.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(got: f64, want: f64, tolerance: f64) -> bool {
        (got - want).abs() <= tolerance
    }

    #[test]
    fn narrow_rates_only_where_the_tensor_cores_have_them() {
        assert_eq!(estimate_narrow_tflops(8, 0, Some(312.0)), (None, None));
        assert_eq!(estimate_narrow_tflops(8, 6, Some(150.0)), (None, None));
        assert_eq!(
            estimate_narrow_tflops(8, 9, Some(121.0)),
            (Some(242.0), None)
        );
        assert_eq!(
            estimate_narrow_tflops(9, 0, Some(989.0)),
            (Some(1978.0), None)
        );
        assert_eq!(
            estimate_narrow_tflops(10, 0, Some(2250.0)),
            (Some(4500.0), Some(9000.0))
        );
        // No FP16 estimate, no narrow one.
        assert_eq!(estimate_narrow_tflops(9, 0, None), (None, None));
    }

    #[test]
    fn fp16_estimates_match_data_sheets() {
        // Product, compute capability, SMs, NVML max SM clock, data-sheet TFLOPS.
        type Case = (&'static str, (i32, i32), u32, u32, f64);
        let cases: &[Case] = &[
            ("NVIDIA H100 80GB HBM3", (9, 0), 132, 1980, 989.4),
            ("NVIDIA H100 PCIe", (9, 0), 114, 1755, 756.0),
            ("NVIDIA A100-SXM4-80GB", (8, 0), 108, 1410, 312.0),
            ("NVIDIA A100-PCIE-40GB", (8, 0), 108, 1410, 312.0),
            ("NVIDIA GeForce RTX 4090", (8, 9), 128, 3105, 165.2),
            ("NVIDIA L4", (8, 9), 58, 2040, 121.0),
            ("Tesla V100-SXM2-32GB", (7, 0), 80, 1530, 125.0),
            ("Tesla T4", (7, 5), 40, 1590, 65.0),
            ("NVIDIA A40", (8, 6), 84, 1740, 149.7),
        ];
        for &(product, (major, minor), sms, clock, want) in cases {
            let got = estimate_fp16_tflops(product, major, minor, Some(sms), Some(clock)).unwrap();
            assert!(close(got, want, want * 0.01), "{product}: {got} vs {want}");
        }
        assert_eq!(estimate_fp16_tflops("x", 9, 0, None, Some(1980)), None);
        assert_eq!(estimate_fp16_tflops("x", 9, 0, Some(132), None), None);
    }

    #[test]
    fn bandwidth_estimates_match_data_sheets() {
        let h100 = estimate_memory_bandwidth_gbps(Some(5120), Some(2619)).unwrap();
        assert!(close(h100, 3352.3, 0.1), "{h100}");
        let a100 = estimate_memory_bandwidth_gbps(Some(5120), Some(1215)).unwrap();
        assert!(close(a100, 1555.2, 0.1), "{a100}");
        let rtx = estimate_memory_bandwidth_gbps(Some(384), Some(10501)).unwrap();
        assert!(close(rtx, 1008.1, 0.1), "{rtx}");
        assert_eq!(estimate_memory_bandwidth_gbps(Some(0), Some(1)), None);
    }

    #[test]
    fn sm_counts_by_product() {
        assert_eq!(sm_count_by_product("NVIDIA A100-PCIE-40GB"), Some(108));
        assert_eq!(sm_count_by_product("NVIDIA A10"), Some(72));
        assert_eq!(sm_count_by_product("NVIDIA A10G"), Some(80));
        assert_eq!(sm_count_by_product("NVIDIA H100 PCIe"), Some(114));
        assert_eq!(sm_count_by_product("NVIDIA H100 80GB HBM3"), Some(132));
        assert_eq!(sm_count_by_product("NVIDIA L40S"), Some(142));
        assert_eq!(sm_count_by_product("NVIDIA T400"), None);
    }
}
