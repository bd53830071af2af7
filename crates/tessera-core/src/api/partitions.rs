//! A GPU split into hardware partitions (NVIDIA MIG), as a node agent
//! publishes it within a device of `NodeGpuState`. A GPU in MIG mode is its
//! partitions and never a whole GPU; nesting them under their GPU keeps a
//! reader that does not know partitions from planning them beside it.
//!
//! The partition's figures are the hardware's: its memory, its
//! multiprocessors, and which of the GPU's memory slices it sits on (each
//! slice brings its share of the memory bandwidth).

use std::ops::Range;

use serde::{Deserialize, Serialize};

/// A GPU's MIG mode, its partitions and the profiles it can be split into.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct MigState {
    /// MIG mode is on: the GPU serves only through its partitions.
    pub enabled: bool,
    /// The mode once the GPU is reset, where a change waits for it: until then
    /// the GPU is neither a whole GPU nor a reliable set of partitions.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pending: Option<bool>,
    /// The GPU's memory slices (8 on A100 and H100): the unit a partition's
    /// placement counts in.
    pub memory_slices: u32,
    /// The whole GPU's streaming multiprocessors.
    pub multiprocessors: u32,
    /// The partitions (MIG devices) that exist now.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub partitions: Vec<GpuPartition>,
    /// The profiles the GPU offers, for explanations (creating partitions is
    /// left to the node's administrator).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub profiles: Vec<MigProfile>,
}

/// One MIG device.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct GpuPartition {
    /// The MIG device's UUID (`MIG-…`): what a container is given.
    pub id: String,
    /// NVIDIA's profile name, e.g. `3g.40gb`.
    pub profile: String,
    pub memory_total_bytes: u64,
    pub multiprocessors: u32,
    /// The first memory slice the partition sits on, and how many it takes.
    pub placement_start: u32,
    pub placement_size: u32,
}

/// A profile a GPU can be split by.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct MigProfile {
    pub name: String,
    pub memory_total_bytes: u64,
    pub multiprocessors: u32,
    /// Memory slices one partition of the profile takes.
    pub memory_slices: u32,
    /// How many partitions of this profile fit on the GPU at once.
    pub max_count: u32,
}

impl MigState {
    /// Whether the GPU may be planned on now as a whole GPU: neither in MIG
    /// mode nor waiting for a mode change.
    pub fn whole(&self) -> bool {
        !self.enabled && self.pending.is_none()
    }

    /// The partitions a shard may be planned on: those of a GPU in MIG mode
    /// with no change pending.
    pub fn usable_partitions(&self) -> &[GpuPartition] {
        if self.enabled && self.pending.is_none() {
            &self.partitions
        } else {
            &[]
        }
    }

    /// Why the GPU itself cannot be planned on, if it cannot.
    pub fn why_not_whole(&self) -> Option<String> {
        match (self.enabled, self.pending) {
            (_, Some(after)) => Some(format!(
                "MIG mode change to {} pending a GPU reset",
                if after { "on" } else { "off" }
            )),
            (true, None) => Some(format!(
                "in MIG mode: offered as its {} partition{}",
                self.partitions.len(),
                if self.partitions.len() == 1 { "" } else { "s" }
            )),
            (false, None) => None,
        }
    }

    /// What makes the state impossible, for `NodeGpuState::validate`:
    /// `device` is the GPU's ID, `memory_total_bytes` its memory.
    pub(crate) fn problem(&self, device: &str, memory_total_bytes: u64) -> Option<String> {
        if self.memory_slices == 0 || self.multiprocessors == 0 {
            return Some(format!(
                "device {device} has MIG memorySlices {} and multiprocessors {}; both must be positive",
                self.memory_slices, self.multiprocessors
            ));
        }
        if self.pending == Some(self.enabled) {
            return Some(format!(
                "device {device} has a MIG mode change pending to the mode it is in"
            ));
        }
        let mut owners = SliceOwners::new(self.memory_slices);
        for partition in &self.partitions {
            let id = &partition.id;
            if id.trim().is_empty() {
                return Some(format!("device {device} has a partition with an empty id"));
            }
            if partition.memory_total_bytes == 0
                || partition.memory_total_bytes > memory_total_bytes
            {
                return Some(format!(
                    "partition {id} of device {device} has memoryTotalBytes {}; it must be positive and at most the GPU's {memory_total_bytes}",
                    partition.memory_total_bytes
                ));
            }
            if partition.multiprocessors == 0 || partition.multiprocessors > self.multiprocessors {
                return Some(format!(
                    "partition {id} of device {device} has multiprocessors {}; it must be 1 to the GPU's {}",
                    partition.multiprocessors, self.multiprocessors
                ));
            }
            let Some(span) = owners.span(partition.placement_start, partition.placement_size)
            else {
                return Some(format!(
                    "partition {id} of device {device} sits on memory slices {}+{}; the GPU has {}",
                    partition.placement_start, partition.placement_size, self.memory_slices
                ));
            };
            if let Some((slice, _)) = owners.held(span.clone()) {
                return Some(format!(
                    "partition {id} of device {device} overlaps another on memory slice {slice}"
                ));
            }
            owners.take(span, id);
        }
        None
    }
}

/// Which partition holds each of a GPU's memory slices, as partitions are
/// laid on it one by one: the bookkeeping every reader of a MIG layout needs
/// (the core checking a published state, the NVML backend checking the
/// driver's answer, the fake backend placing its YAML's partitions), each
/// with its own words for what it finds.
#[derive(Clone, Debug)]
pub struct SliceOwners(Vec<Option<String>>);

impl SliceOwners {
    pub fn new(memory_slices: u32) -> Self {
        Self(vec![None; memory_slices as usize])
    }

    /// The `size` slices from `start`, where they lie on the GPU (at least one).
    pub fn span(&self, start: u32, size: u32) -> Option<Range<u32>> {
        let end = start.checked_add(size)?;
        (size > 0 && end as usize <= self.0.len()).then_some(start..end)
    }

    /// The first slice of `span` held already, and its owner.
    pub fn held(&self, span: Range<u32>) -> Option<(u32, &str)> {
        span.into_iter()
            .find_map(|slice| Some((slice, self.0.get(slice as usize)?.as_deref()?)))
    }

    /// `owner` takes the slices of `span` (from `span`, so on the GPU).
    pub fn take(&mut self, span: Range<u32>, owner: &str) {
        for slice in span {
            if let Some(held) = self.0.get_mut(slice as usize) {
                *held = Some(owner.to_string());
            }
        }
    }

    /// Each slice held, with its owner, in slice order.
    pub fn all_held(&self) -> impl Iterator<Item = (u32, &str)> {
        (0u32..)
            .zip(&self.0)
            .filter_map(|(slice, owner)| Some((slice, owner.as_deref()?)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    fn partition(id: &str, start: u32, size: u32) -> GpuPartition {
        GpuPartition {
            id: id.into(),
            profile: format!("{size}g"),
            memory_total_bytes: u64::from(size) * 10 * GIB,
            multiprocessors: size * 16,
            placement_start: start,
            placement_size: size,
        }
    }

    fn mig(partitions: Vec<GpuPartition>) -> MigState {
        MigState {
            enabled: true,
            pending: None,
            memory_slices: 8,
            multiprocessors: 132,
            partitions,
            profiles: Vec::new(),
        }
    }

    #[test]
    fn a_gpu_in_mig_mode_is_its_partitions() {
        let on = mig(vec![partition("MIG-a", 0, 4), partition("MIG-b", 4, 4)]);
        assert!(!on.whole());
        assert_eq!(on.usable_partitions().len(), 2);
        assert_eq!(
            on.why_not_whole().as_deref(),
            Some("in MIG mode: offered as its 2 partitions")
        );
        let off = MigState {
            enabled: false,
            ..mig(Vec::new())
        };
        assert!(off.whole() && off.why_not_whole().is_none());
    }

    #[test]
    fn a_pending_change_excludes_the_gpu_and_its_partitions() {
        let turning_off = MigState {
            pending: Some(false),
            ..mig(vec![partition("MIG-a", 0, 4)])
        };
        assert!(!turning_off.whole());
        assert!(turning_off.usable_partitions().is_empty());
        assert_eq!(
            turning_off.why_not_whole().as_deref(),
            Some("MIG mode change to off pending a GPU reset")
        );
    }

    #[test]
    fn impossible_layouts_are_named() {
        let problem = |state: MigState| state.problem("GPU-1", 80 * GIB).unwrap_or_default();
        assert_eq!(problem(mig(vec![partition("MIG-a", 0, 4)])), "");
        assert!(
            problem(mig(vec![
                partition("MIG-a", 0, 4),
                partition("MIG-b", 2, 2)
            ]))
            .contains("overlaps another on memory slice 2")
        );
        assert!(problem(mig(vec![partition("MIG-a", 6, 4)])).contains("the GPU has 8"));
        let mut empty = partition("MIG-a", 0, 1);
        empty.placement_size = 0;
        assert!(problem(mig(vec![empty])).contains("slices 0+0"));
        assert!(problem(mig(vec![partition(" ", 0, 1)])).contains("empty id"));
        let mut huge = partition("MIG-a", 0, 1);
        huge.memory_total_bytes = 81 * GIB;
        assert!(problem(mig(vec![huge])).contains("at most the GPU's"));
        let mut no_sms = partition("MIG-a", 0, 1);
        no_sms.multiprocessors = 0;
        assert!(problem(mig(vec![no_sms])).contains("multiprocessors 0"));
        assert!(
            problem(MigState {
                memory_slices: 0,
                ..mig(Vec::new())
            })
            .contains("both must be positive")
        );
        assert!(
            problem(MigState {
                pending: Some(true),
                ..mig(Vec::new())
            })
            .contains("to the mode it is in")
        );
        // u32 overflow of start + size is a bad placement, not a panic.
        assert!(problem(mig(vec![partition("MIG-a", u32::MAX, 2)])).contains("the GPU has 8"));
    }
    #[test]
    fn slice_owners_say_who_holds_a_slice_and_keep_spans_on_the_gpu() {
        let mut owners = SliceOwners::new(8);
        assert_eq!(owners.span(6, 2), Some(6..8));
        assert_eq!(owners.span(6, 3), None);
        assert_eq!(owners.span(2, 0), None);
        assert_eq!(owners.span(u32::MAX, 2), None);
        owners.take(2..4, "a");
        assert_eq!(owners.held(0..2), None);
        assert_eq!(owners.held(1..5), Some((2, "a")));
        assert_eq!(
            owners.all_held().collect::<Vec<_>>(),
            vec![(2, "a"), (3, "a")]
        );
    }
}

#[cfg(test)]
mod state_tests {
    use crate::api::NodeGpuState;

    const STATE: &str = r#"{"version":"v1","backend":"nvml","devices":[{"id":"GPU-1","index":0,
        "vendor":"nvidia","product":"NVIDIA H100 80GB HBM3","memoryTotalBytes":85899345920,
        "memoryFreeBytes":85000000000,"fp16Tflops":989.0,"memoryBandwidthGbps":3350.0,
        "health":"Healthy","mig":{"enabled":true,"memorySlices":8,"multiprocessors":132,
        "partitions":[{"id":"MIG-a","profile":"3g.40gb","memoryTotalBytes":42949672960,
        "multiprocessors":60,"placementStart":0,"placementSize":4}]}}]}"#;

    #[test]
    fn partitions_travel_in_the_node_state() {
        let state = NodeGpuState::from_json(STATE).unwrap();
        let mig = state.devices[0].mig.as_ref().unwrap();
        assert_eq!(mig.partitions[0].profile, "3g.40gb");
        assert_eq!(NodeGpuState::from_json(&state.to_json()).unwrap(), state);
    }

    #[test]
    fn a_partition_id_is_unique_on_the_node() {
        let twice = STATE.replace("MIG-a", "GPU-1");
        let error = NodeGpuState::from_json(&twice).unwrap_err().to_string();
        assert!(error.contains("device id GPU-1 appears twice"), "{error}");
        let overlapping = STATE.replace("\"placementStart\":0", "\"placementStart\":6");
        let error = NodeGpuState::from_json(&overlapping)
            .unwrap_err()
            .to_string();
        assert!(error.contains("memory slices 6+4"), "{error}");
    }
}
