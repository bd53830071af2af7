//! NVIDIA's MIG profile names (`3g.40gb`, `1g.10gb+me`), made from what NVML
//! says of a GPU-instance profile. NVML 12.x gives no name with the profile
//! (only the newer `…ProfileInfoV` does, and not on every driver), so the
//! name is made the way NVIDIA's own tools make it.

use nvml_wrapper::error::NvmlError;

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;
/// The share of the GPU's memory a name's figure is rounded up to: eighths,
/// the memory slices of every MIG GPU so far.
const NAME_FRACTION: u64 = 8;

/// The name of a profile: `<compute slices>g.<GB>gb`, then a suffix for the
/// variants of a profile index (`profile_index` is NVML's
/// `NVML_GPU_INSTANCE_PROFILE_*` index, not the profile ID).
///
/// The GB figure is not the profile's memory rounded. NVIDIA rounds the
/// profile's share of the GPU's memory up to an eighth, scales the GPU's
/// memory in whole GiB (rounded up) by that share and rounds to the nearest
/// whole number. So a 1-slice profile of 4.75 GiB on an A100 40GB is
/// `1g.5gb`, and a 1-slice profile of 16 GiB on an H200 (140.4 GiB) is
/// `1g.18gb`.
pub(crate) fn profile_name(
    profile_index: u32,
    compute_slices: u32,
    memory_mib: u64,
    gpu_memory_bytes: u64,
) -> String {
    let gb = if gpu_memory_bytes == 0 {
        memory_mib.div_ceil(1024)
    } else {
        let eighths = memory_mib
            .saturating_mul(MIB)
            .saturating_mul(NAME_FRACTION)
            .div_ceil(gpu_memory_bytes);
        let gpu_gib = gpu_memory_bytes.div_ceil(GIB);
        // Nearest whole number, halves up: (2x + 1) / 2 in sixteenths.
        eighths
            .saturating_mul(gpu_gib)
            .saturating_mul(2)
            .saturating_add(NAME_FRACTION)
            / (2 * NAME_FRACTION)
    };
    format!("{compute_slices}g.{gb}gb{}", variant_suffix(profile_index))
}

/// What sets a profile index's variants apart in their names: media engines
/// (`+me`: one decoder, JPEG and OFA engine; `+me.all`: all of them; `-me`:
/// none) or graphics (`+gfx`), by `NVML_GPU_INSTANCE_PROFILE_*` index.
fn variant_suffix(profile_index: u32) -> &'static str {
    match profile_index {
        // 1_SLICE_REV1, 2_SLICE_REV1
        7 | 8 => "+me",
        // 1_SLICE_GFX, 2_SLICE_GFX, 4_SLICE_GFX
        10..=12 => "+gfx",
        // 1_SLICE_NO_ME, 2_SLICE_NO_ME
        13 | 14 => "-me",
        // 1_SLICE_ALL_ME, 2_SLICE_ALL_ME
        15 | 16 => "+me.all",
        _ => "",
    }
}

/// Whether NVML's answer to a profile index means the GPU does not offer
/// that profile: NVML says so with NOT_SUPPORTED, and INVALID_ARGUMENT for an
/// index the driver does not know.
pub(super) fn profile_absent(error: &NvmlError) -> bool {
    matches!(error, NvmlError::NotSupported | NvmlError::InvalidArg)
}

#[cfg(test)]
mod tests {
    use super::*;

    const GPU_MIB: u64 = 1 << 20;

    /// (GPU memory MiB, profile index, compute slices, profile MiB, name):
    /// the published `nvidia-smi mig -lgip` figures.
    const PUBLISHED: &[(u64, u32, u32, u64, &str)] = &[
        // A100-SXM4-40GB
        (40960, 0, 1, 4864, "1g.5gb"),
        (40960, 7, 1, 4864, "1g.5gb+me"),
        (40960, 9, 1, 9856, "1g.10gb"),
        (40960, 1, 2, 9856, "2g.10gb"),
        (40960, 2, 3, 19968, "3g.20gb"),
        (40960, 3, 4, 19968, "4g.20gb"),
        (40960, 4, 7, 40192, "7g.40gb"),
        // A100 80GB
        (81920, 0, 1, 9728, "1g.10gb"),
        (81920, 9, 1, 19968, "1g.20gb"),
        (81920, 2, 3, 40192, "3g.40gb"),
        (81920, 4, 7, 80640, "7g.80gb"),
        // H100 80GB HBM3 (81559 MiB)
        (81559, 0, 1, 9984, "1g.10gb"),
        (81559, 7, 1, 9984, "1g.10gb+me"),
        (81559, 9, 1, 20096, "1g.20gb"),
        (81559, 1, 2, 20096, "2g.20gb"),
        (81559, 2, 3, 40448, "3g.40gb"),
        (81559, 3, 4, 40448, "4g.40gb"),
        (81559, 4, 7, 81152, "7g.80gb"),
        // H100 NVL (a 94 GB board: more than 93 GiB)
        (95830, 0, 1, 11264, "1g.12gb"),
        (95830, 2, 3, 47488, "3g.47gb"),
        (95830, 4, 7, 95360, "7g.94gb"),
        // H200 (a 141 GB board: more than 140 GiB)
        (143771, 0, 1, 16384, "1g.18gb"),
    ];

    #[test]
    fn names_are_nvidias() {
        for &(gpu_mib, index, slices, mib, want) in PUBLISHED {
            assert_eq!(
                profile_name(index, slices, mib, gpu_mib * GPU_MIB),
                want,
                "{gpu_mib} MiB GPU, profile index {index}"
            );
        }
    }

    #[test]
    fn the_fake_gpus_published_profiles_have_these_names() {
        use crate::backend::mig_table::{A100_40GB, A100_80GB, H100_80GB};
        for (table, gpu_gib) in [(&H100_80GB, 80), (&A100_80GB, 80), (&A100_40GB, 40)] {
            for profile in table.profiles {
                let (slices, _) = profile.name.split_once('g').unwrap();
                let index = if profile.name.ends_with("+me") { 7 } else { 0 };
                let name = profile_name(
                    index,
                    slices.parse().unwrap(),
                    profile.memory_mib,
                    gpu_gib * GIB,
                );
                assert_eq!(name, profile.name);
            }
        }
    }

    #[test]
    fn variants_and_odd_figures() {
        assert_eq!(profile_name(15, 1, 4864, 40960 * GPU_MIB), "1g.5gb+me.all");
        assert_eq!(profile_name(13, 1, 4864, 40960 * GPU_MIB), "1g.5gb-me");
        assert_eq!(profile_name(10, 1, 4864, 40960 * GPU_MIB), "1g.5gb+gfx");
        // The GPU's memory unknown: the profile's own, rounded up.
        assert_eq!(profile_name(0, 1, 4864, 0), "1g.5gb");
        // Nonsense from a driver never panics.
        assert!(profile_name(99, u32::MAX, u64::MAX, 1).starts_with("4294967295g."));
    }
}
