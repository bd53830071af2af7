//! NVIDIA's published MIG profiles of the GPUs the fake backend pretends to
//! be: the H100 80GB and the A100 80GB and 40GB. The NVML backend reads its
//! profiles from the driver; this table is for GPUs that have none.
//!
//! Figures from NVIDIA's MIG user guide and `nvidia-smi mig -lgip`: memory as
//! NVML reports it (MiB), multiprocessors, memory slices (of 8) and instances
//! at most. Placements from `nvidia-smi mig -lgipp`, the same on the three
//! GPUs: a 1-slice profile starts at any of slices 0 to 6, a 2-slice one at an
//! even slice (a 1g profile with two memory slices at 0, 2, 4 or 6; 2g at 0, 2
//! or 4), a 3g profile at 0 or 4, and 4g and 7g at 0.

/// One profile as NVIDIA publishes it.
#[derive(Debug, PartialEq)]
pub(crate) struct PublishedProfile {
    pub(crate) name: &'static str,
    pub(crate) memory_mib: u64,
    pub(crate) multiprocessors: u32,
    pub(crate) memory_slices: u32,
    pub(crate) max_count: u32,
    /// The memory slices a partition of it may start at.
    pub(crate) starts: &'static [u32],
}

/// A GPU's profiles.
#[derive(Debug, PartialEq)]
pub(crate) struct MigTable {
    pub(crate) memory_slices: u32,
    pub(crate) profiles: &'static [PublishedProfile],
}

impl MigTable {
    pub(crate) fn profile(&self, name: &str) -> Option<&'static PublishedProfile> {
        self.profiles
            .iter()
            .find(|profile| profile.name.eq_ignore_ascii_case(name))
    }

    pub(crate) fn names(&self) -> String {
        self.profiles
            .iter()
            .map(|profile| profile.name)
            .collect::<Vec<_>>()
            .join(", ")
    }
}

const ANY_OF_SEVEN: &[u32] = &[0, 1, 2, 3, 4, 5, 6];
const EVEN: &[u32] = &[0, 2, 4, 6];
const EVEN_BELOW_SIX: &[u32] = &[0, 2, 4];
const HALVES: &[u32] = &[0, 4];
const FIRST: &[u32] = &[0];

const fn published(
    name: &'static str,
    (memory_mib, multiprocessors): (u64, u32),
    (memory_slices, max_count, starts): (u32, u32, &'static [u32]),
) -> PublishedProfile {
    PublishedProfile {
        name,
        memory_mib,
        multiprocessors,
        memory_slices,
        max_count,
        starts,
    }
}

pub(crate) const H100_80GB: MigTable = MigTable {
    memory_slices: 8,
    profiles: &[
        published("1g.10gb", (9984, 16), (1, 7, ANY_OF_SEVEN)),
        published("1g.10gb+me", (9984, 16), (1, 1, ANY_OF_SEVEN)),
        published("1g.20gb", (20096, 26), (2, 4, EVEN)),
        published("2g.20gb", (20096, 32), (2, 3, EVEN_BELOW_SIX)),
        published("3g.40gb", (40448, 60), (4, 2, HALVES)),
        published("4g.40gb", (40448, 64), (4, 1, FIRST)),
        published("7g.80gb", (81152, 132), (8, 1, FIRST)),
    ],
};

pub(crate) const A100_80GB: MigTable = MigTable {
    memory_slices: 8,
    profiles: &[
        published("1g.10gb", (9728, 14), (1, 7, ANY_OF_SEVEN)),
        published("1g.10gb+me", (9728, 14), (1, 1, ANY_OF_SEVEN)),
        published("1g.20gb", (19968, 14), (2, 4, EVEN)),
        published("2g.20gb", (19968, 28), (2, 3, EVEN_BELOW_SIX)),
        published("3g.40gb", (40192, 42), (4, 2, HALVES)),
        published("4g.40gb", (40192, 56), (4, 1, FIRST)),
        published("7g.80gb", (80640, 98), (8, 1, FIRST)),
    ],
};

pub(crate) const A100_40GB: MigTable = MigTable {
    memory_slices: 8,
    profiles: &[
        published("1g.5gb", (4864, 14), (1, 7, ANY_OF_SEVEN)),
        published("1g.5gb+me", (4864, 14), (1, 1, ANY_OF_SEVEN)),
        published("1g.10gb", (9856, 14), (2, 4, EVEN)),
        published("2g.10gb", (9856, 28), (2, 3, EVEN_BELOW_SIX)),
        published("3g.20gb", (19968, 42), (4, 2, HALVES)),
        published("4g.20gb", (19968, 56), (4, 1, FIRST)),
        published("7g.40gb", (40192, 98), (8, 1, FIRST)),
    ],
};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_placement_fits_and_every_instance_has_one() {
        for table in [&H100_80GB, &A100_80GB, &A100_40GB] {
            for profile in table.profiles {
                assert!(
                    profile
                        .starts
                        .iter()
                        .all(|start| start + profile.memory_slices <= table.memory_slices),
                    "{profile:?}"
                );
                assert!(profile.max_count as usize <= profile.starts.len());
            }
            assert_eq!(
                table.profile("7G.80GB").is_some(),
                table == &H100_80GB || table == &A100_80GB
            );
        }
    }
}
