//! The `mig:` field of a fake GPU group: MIG mode and partitions for fake
//! NVIDIA GPUs, with the published figures of their profiles (`mig_table`).
//!
//! ```yaml
//! gpus:
//!   - {profile: H100-80GiB, mig: {partitions: [3g.40gb, 2g.20gb, 1g.10gb]}}
//!   - {profile: H100-80GiB, mig: {partitions: ["3g.40gb@4", 1g.10gb]}}
//!   - {profile: A100-80GiB, mig: {pending: true}}
//! ```
//!
//! - `partitions`: profile names, each placed at the memory slice after `@`
//!   or, without one, at the first slice its profile may start at that is
//!   free (in the order listed, after the placed ones), as NVIDIA's driver
//!   places a partition it is given no placement for.
//! - `enabled`: MIG mode now; on when partitions are listed, else off.
//! - `pending`: the mode changes at the next GPU reset (to off when on now,
//!   to on when off).
//!
//! Every GPU of the group gets the same layout. Its partitions are named
//! `MIG-<gpu id>-<first slice>-<profile>`, the same at every read.

use std::ops::Range;

use serde::Deserialize;

use super::mig_table::{MigTable, PublishedProfile};
use tessera_core::api::{GpuPartition, MigProfile, MigState, SliceOwners};

const MIB: u64 = 1 << 20;

#[derive(Clone, Debug, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub(super) struct FakeMig {
    #[serde(default)]
    enabled: Option<bool>,
    #[serde(default)]
    pending: bool,
    #[serde(default)]
    partitions: Vec<String>,
}

/// A partition placed: its profile and first memory slice.
type Placed = (&'static PublishedProfile, u32);

/// The fake GPU a MIG state is made for.
pub(super) struct FakeGpu<'a> {
    pub(super) id: &'a str,
    pub(super) multiprocessors: u32,
}

impl FakeMig {
    fn enabled(&self) -> bool {
        self.enabled.unwrap_or(!self.partitions.is_empty())
    }

    /// The partitions placed, in placement order, or what is wrong with the
    /// field; `field` is where it is (`gpus[0].mig`).
    pub(super) fn layout(&self, table: &MigTable, field: &str) -> Result<Vec<Placed>, String> {
        if !self.enabled() && !self.partitions.is_empty() {
            return Err(format!(
                "{field}.partitions: partitions exist only in MIG mode, and enabled is false"
            ));
        }
        let mut requested = Vec::with_capacity(self.partitions.len());
        for (index, text) in self.partitions.iter().enumerate() {
            let at = format!("{field}.partitions[{index}]");
            let (name, start) = match text.split_once('@') {
                Some((name, start)) => {
                    let start = start.trim().parse::<u32>().map_err(|_| {
                        format!("{at}: {text:?}: the memory slice after @ must be a whole number")
                    })?;
                    (name.trim(), Some(start))
                }
                None => (text.trim(), None),
            };
            let profile = table.profile(name).ok_or_else(|| {
                format!(
                    "{at}: unknown MIG profile {name:?}; this GPU's profiles: {}",
                    table.names()
                )
            })?;
            requested.push((at, profile, start));
        }
        let mut owners = SliceOwners::new(table.memory_slices);
        let mut placed: Vec<Placed> = Vec::new();
        // The placed ones first, so a partition without a placement never takes
        // the slices another is given.
        let (given, free): (Vec<_>, Vec<_>) = requested
            .into_iter()
            .partition(|(_, _, start)| start.is_some());
        for (at, profile, start) in given.into_iter().chain(free) {
            let count = placed
                .iter()
                .filter(|(p, _)| p.name == profile.name)
                .count();
            if count >= profile.max_count as usize {
                return Err(format!(
                    "{at}: one GPU holds at most {} {}",
                    profile.max_count, profile.name
                ));
            }
            let span = match start {
                Some(start) => check_placement(&owners, profile, start)
                    .map_err(|why| format!("{at}: {why}"))?,
                None => first_fit(&owners, profile).ok_or_else(|| {
                    format!(
                        "{at}: no room for {}: it starts at memory slice {} and the partitions \
                         before it take {}",
                        profile.name,
                        starts_text(profile),
                        taken_text(&owners)
                    )
                })?,
            };
            let start = span.start;
            owners.take(span, &format!("{}@{start}", profile.name));
            placed.push((profile, start));
        }
        placed.sort_by_key(|&(_, start)| start);
        Ok(placed)
    }

    /// The MIG state of one GPU of the group (the layout checked before).
    pub(super) fn state(
        &self,
        table: &MigTable,
        gpu: &FakeGpu<'_>,
        field: &str,
    ) -> Result<MigState, String> {
        let enabled = self.enabled();
        let partitions = self
            .layout(table, field)?
            .into_iter()
            .map(|(profile, start)| GpuPartition {
                id: format!("MIG-{}-{start}-{}", gpu.id, profile.name),
                profile: profile.name.to_string(),
                memory_total_bytes: profile.memory_mib * MIB,
                multiprocessors: profile.multiprocessors,
                placement_start: start,
                placement_size: profile.memory_slices,
            })
            .collect();
        Ok(MigState {
            enabled,
            pending: self.pending.then_some(!enabled),
            memory_slices: table.memory_slices,
            multiprocessors: gpu.multiprocessors,
            partitions,
            profiles: table
                .profiles
                .iter()
                .map(|profile| MigProfile {
                    name: profile.name.to_string(),
                    memory_total_bytes: profile.memory_mib * MIB,
                    multiprocessors: profile.multiprocessors,
                    memory_slices: profile.memory_slices,
                    max_count: profile.max_count,
                })
                .collect(),
        })
    }
}

/// The slices `profile` takes from `start`, or why it cannot start there.
fn check_placement(
    owners: &SliceOwners,
    profile: &PublishedProfile,
    start: u32,
) -> Result<Range<u32>, String> {
    let span = owners
        .span(start, profile.memory_slices)
        .filter(|_| profile.starts.contains(&start))
        .ok_or_else(|| {
            format!(
                "{} cannot start at memory slice {start}; it starts at {}",
                profile.name,
                starts_text(profile)
            )
        })?;
    match owners.held(span.clone()) {
        Some((slice, owner)) => Err(format!(
            "{}@{start} overlaps {owner} on memory slice {slice}",
            profile.name
        )),
        None => Ok(span),
    }
}

/// The slices of the first start of `profile` whose slices are free.
fn first_fit(owners: &SliceOwners, profile: &PublishedProfile) -> Option<Range<u32>> {
    profile
        .starts
        .iter()
        .find_map(|&start| check_placement(owners, profile, start).ok())
}

fn starts_text(profile: &PublishedProfile) -> String {
    let starts: Vec<String> = profile.starts.iter().map(u32::to_string).collect();
    match starts.split_last() {
        Some((last, [])) => last.clone(),
        Some((last, rest)) => format!("{} or {last}", rest.join(", ")),
        None => "no slice".to_string(),
    }
}

fn taken_text(owners: &SliceOwners) -> String {
    let taken: Vec<String> = owners
        .all_held()
        .map(|(slice, owner)| format!("{slice} ({owner})"))
        .collect();
    if taken.is_empty() {
        "none".to_string()
    } else {
        taken.join(", ")
    }
}

#[cfg(test)]
mod tests {
    use super::super::mig_table::{A100_40GB, H100_80GB};
    use super::*;

    fn mig(partitions: &[&str]) -> FakeMig {
        FakeMig {
            partitions: partitions.iter().map(|p| p.to_string()).collect(),
            ..FakeMig::default()
        }
    }

    fn placed(layout: &[Placed]) -> Vec<String> {
        layout
            .iter()
            .map(|(profile, start)| format!("{}@{start}", profile.name))
            .collect()
    }

    #[test]
    fn partitions_are_placed_first_fit_after_the_placed_ones() {
        let layout = mig(&["3g.40gb", "2g.20gb", "1g.10gb"])
            .layout(&H100_80GB, "f")
            .unwrap();
        assert_eq!(placed(&layout), ["3g.40gb@0", "2g.20gb@4", "1g.10gb@6"]);
        let layout = mig(&["1g.10gb", "3g.40gb@0"])
            .layout(&H100_80GB, "f")
            .unwrap();
        assert_eq!(placed(&layout), ["3g.40gb@0", "1g.10gb@4"]);
        let layout = mig(&["1g.10gb", "1g.10gb", "2g.20gb"])
            .layout(&H100_80GB, "f")
            .unwrap();
        assert_eq!(placed(&layout), ["1g.10gb@0", "1g.10gb@1", "2g.20gb@2"]);
        let seven = ["1g.5gb"; 7];
        assert_eq!(mig(&seven).layout(&A100_40GB, "f").unwrap().len(), 7);
    }

    #[test]
    fn impossible_layouts_name_the_field() {
        for (partitions, want) in [
            (
                &["9g.90gb"][..],
                "f.partitions[0]: unknown MIG profile \"9g.90gb\"; this GPU's profiles: 1g.10gb,",
            ),
            (
                &["3g.40gb@2"],
                "f.partitions[0]: 3g.40gb cannot start at memory slice 2; it starts at 0 or 4",
            ),
            (
                &["3g.40gb@0", "2g.20gb@2"],
                "f.partitions[1]: 2g.20gb@2 overlaps 3g.40gb@0 on memory slice 2",
            ),
            (
                &["7g.80gb", "1g.10gb"],
                "f.partitions[1]: no room for 1g.10gb: it starts at memory slice 0, 1, 2, 3, 4, 5 or 6 and the partitions before it take 0 (7g.80gb@0)",
            ),
            (
                &["1g.10gb+me", "1g.10gb+me"],
                "f.partitions[1]: one GPU holds at most 1 1g.10gb+me",
            ),
            (
                &["3g.40gb@x"],
                "f.partitions[0]: \"3g.40gb@x\": the memory slice after @ must be a whole number",
            ),
            (&["1g.10gb@7"], "cannot start at memory slice 7"),
        ] {
            let error = mig(partitions).layout(&H100_80GB, "f").unwrap_err();
            assert!(error.contains(want), "{partitions:?}: {error}");
        }
        let off = FakeMig {
            enabled: Some(false),
            ..mig(&["1g.10gb"])
        };
        assert!(
            off.layout(&H100_80GB, "f")
                .unwrap_err()
                .contains("only in MIG mode")
        );
    }

    #[test]
    fn a_state_with_stable_ids_the_core_accepts() {
        let gpu = FakeGpu {
            id: "fake-h100-80gib-0",
            multiprocessors: 132,
        };
        let state = mig(&["3g.40gb", "2g.20gb", "1g.10gb"])
            .state(&H100_80GB, &gpu, "f")
            .unwrap();
        assert!(state.enabled && state.pending.is_none());
        assert_eq!(state.partitions[0].id, "MIG-fake-h100-80gib-0-0-3g.40gb");
        assert_eq!(state.partitions[2].memory_total_bytes, 9984 * MIB);
        assert_eq!(state.profiles.len(), 7);
        let pending = FakeMig {
            pending: true,
            ..FakeMig::default()
        }
        .state(&H100_80GB, &gpu, "f")
        .unwrap();
        assert_eq!((pending.enabled, pending.pending), (false, Some(true)));
        let turning_off = FakeMig {
            pending: true,
            ..mig(&["7g.80gb"])
        }
        .state(&H100_80GB, &gpu, "f")
        .unwrap();
        assert_eq!(
            (turning_off.enabled, turning_off.pending),
            (true, Some(false))
        );
    }
}
