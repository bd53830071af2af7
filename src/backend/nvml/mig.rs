//! A GPU's MIG state through NVML: its mode now and after the next reset, the
//! profiles it offers, and in MIG mode its MIG devices, each with its GPU
//! instance's profile and placement (the raw calls are in `mig_raw`).
//!
//! Nothing here fails the GPU's reading. What cannot be read is left out and
//! said in a warning, which the caller logs once while it lasts: a GPU whose
//! mode cannot be read is reported without MIG, a profile without placements
//! is not listed, and a MIG device without a UUID or GPU instance is not
//! listed (a partition whose memory slices are unknown could be planned beside
//! one it overlaps). A MIG device's memory or multiprocessor count that cannot
//! be read is its profile's.

use nvml_wrapper::Device;
use nvml_wrapper::error::NvmlError;
use nvml_wrapper::struct_wrappers::device::ProfileInfo;

use super::mig_names::{profile_absent, profile_name};
use super::mig_raw;
use tessera_core::api::{GpuPartition, MigProfile, MigState, SliceOwners};

/// `NVML_GPU_INSTANCE_PROFILE_COUNT`: the profile indices NVML knows.
const PROFILE_INDICES: u32 = 17;
/// `NVML_DEVICE_MIG_ENABLE`.
const MIG_ENABLE: u32 = 1;
/// More MIG device slots than any GPU has (7 on A100 and H100): a bound on a
/// driver's answer.
const MAX_SLOTS: u32 = 64;
/// The memory slices taken when no profile can be read. Only an Ampere GPU
/// outside MIG mode does that, and it has no partition to measure by them.
const FALLBACK_MEMORY_SLICES: u32 = 8;
/// The variant suffix-free name of a profile (see `mig_names`).
const NO_VARIANT: u32 = u32::MAX;
const MIB: u64 = 1 << 20;

/// The GPU a MIG state is read for, with what the backend read of it.
pub(super) struct Gpu<'a> {
    pub(super) uuid: &'a str,
    pub(super) memory_total_bytes: u64,
    /// Streaming multiprocessors; 0 when unknown.
    pub(super) multiprocessors: u32,
}

/// A profile as read, with NVML's profile ID (what a GPU instance names).
struct Profile {
    id: u32,
    published: MigProfile,
}

/// The GPU's MIG state; `None` for a GPU without MIG (NVML answers
/// NOT_SUPPORTED) or whose mode cannot be read.
pub(super) fn read_mig(
    device: &Device<'_>,
    gpu: &Gpu<'_>,
    warnings: &mut Vec<String>,
) -> Option<MigState> {
    let mode = match device.mig_mode() {
        Ok(mode) => mode,
        Err(NvmlError::NotSupported) => return None,
        Err(error) => {
            warnings.push(format!(
                "GPU {}: MIG mode unreadable ({error}); reported without MIG",
                gpu.uuid
            ));
            return None;
        }
    };
    let enabled = mode.current == MIG_ENABLE;
    let after_reset = mode.pending == MIG_ENABLE;
    let profiles = read_profiles(device, gpu, warnings);
    let partitions = if enabled {
        read_partitions(device, gpu, &profiles, warnings)
    } else {
        Vec::new()
    };
    // The whole GPU's count where the backend knows it (a 7-slice A100
    // partition has 98 of its 108); else the largest NVML gives.
    let multiprocessors = if gpu.multiprocessors > 0 {
        gpu.multiprocessors
    } else {
        profiles
            .iter()
            .map(|profile| profile.published.multiprocessors)
            .chain(partitions.iter().map(|partition| partition.multiprocessors))
            .max()
            .unwrap_or(1)
            .max(1)
    };
    let mut state = MigState {
        enabled,
        pending: (after_reset != enabled).then_some(after_reset),
        // The full-GPU profile's placement covers every slice.
        memory_slices: profiles
            .iter()
            .map(|profile| profile.published.memory_slices)
            .max()
            .unwrap_or(FALLBACK_MEMORY_SLICES),
        multiprocessors,
        partitions: Vec::new(),
        profiles: profiles
            .into_iter()
            .map(|profile| profile.published)
            .collect(),
    };
    state.partitions = fitting(partitions, &state, gpu, warnings);
    Some(state)
}

/// Every profile index NVML knows, asked in turn: a GPU answers those it
/// does not offer with NOT_SUPPORTED (or INVALID_ARGUMENT), and the ones it
/// offers need not be consecutive.
fn read_profiles(device: &Device<'_>, gpu: &Gpu<'_>, warnings: &mut Vec<String>) -> Vec<Profile> {
    let mut profiles = Vec::new();
    for index in 0..PROFILE_INDICES {
        let read = match device.profile_info(index) {
            Ok(info) => profile(device, gpu, index, &info),
            Err(error) if profile_absent(&error) => continue,
            Err(error) => Err(error.to_string()),
        };
        match read {
            Ok(profile) => profiles.push(profile),
            Err(why) => warnings.push(format!(
                "GPU {}: MIG profile index {index} not listed: {why}",
                gpu.uuid
            )),
        }
    }
    profiles
}

/// One profile; its memory slices are its placements' size.
fn profile(
    device: &Device<'_>,
    gpu: &Gpu<'_>,
    index: u32,
    info: &ProfileInfo,
) -> Result<Profile, String> {
    let placements = mig_raw::possible_placements(device, info.id)
        .map_err(|error| format!("its placements are unreadable ({error})"))?;
    let memory_slices = placements
        .iter()
        .map(|&(_, size)| size)
        .max()
        .filter(|&size| size > 0)
        .ok_or("NVML gives it no placement")?;
    Ok(Profile {
        id: info.id,
        published: MigProfile {
            name: profile_name(
                index,
                info.slice_count,
                info.memory_size_mb,
                gpu.memory_total_bytes,
            ),
            memory_total_bytes: info.memory_size_mb.saturating_mul(MIB),
            multiprocessors: info.multiprocessor_count,
            memory_slices,
            max_count: info.instance_count,
        },
    })
}

/// The MIG devices of a GPU in MIG mode. NVML counts the slots a GPU has
/// (`nvmlDeviceGetMaxMigDeviceCount`), not the devices in them: an empty
/// slot answers NOT_FOUND.
fn read_partitions(
    device: &Device<'_>,
    gpu: &Gpu<'_>,
    profiles: &[Profile],
    warnings: &mut Vec<String>,
) -> Vec<GpuPartition> {
    let slots = match device.mig_device_count() {
        Ok(slots) => slots.min(MAX_SLOTS),
        Err(error) => {
            warnings.push(format!(
                "GPU {}: MIG devices cannot be counted ({error}); none listed",
                gpu.uuid
            ));
            return Vec::new();
        }
    };
    let mut partitions = Vec::new();
    for slot in 0..slots {
        let read = match device.mig_device_by_index(slot) {
            Ok(mig) => read_partition(device, &mig, gpu, profiles, warnings),
            Err(NvmlError::NotFound) => continue,
            Err(error) => Err(format!("the slot is unreadable ({error})")),
        };
        match read {
            Ok(partition) => partitions.push(partition),
            Err(why) => warnings.push(format!(
                "GPU {}: MIG device in slot {slot} not listed: {why}",
                gpu.uuid
            )),
        }
    }
    partitions
}

/// One MIG device: its UUID and GPU instance are needed; its memory and
/// multiprocessors are its profile's when it does not give them.
fn read_partition(
    device: &Device<'_>,
    mig: &Device<'_>,
    gpu: &Gpu<'_>,
    profiles: &[Profile],
    warnings: &mut Vec<String>,
) -> Result<GpuPartition, String> {
    let id = mig
        .uuid()
        .map_err(|error| format!("its UUID is unreadable ({error})"))?;
    let instance = mig_raw::gpu_instance(device, mig).map_err(|error| {
        format!("{id}: its GPU instance is unreadable ({error}), so where it sits is unknown")
    })?;
    let profile = profiles
        .iter()
        .find(|profile| profile.id == instance.profile_id)
        .map(|profile| &profile.published);
    // NVML gives a MIG device's multiprocessors only as an attribute.
    let attributes = mig.attributes();
    let mut from_profile = |what: &str, error: String| -> Result<(), String> {
        match profile {
            Some(profile) => {
                warnings.push(format!(
                    "GPU {}: MIG device {id}: {what} unreadable ({error}); the {} profile's used",
                    gpu.uuid, profile.name
                ));
                Ok(())
            }
            None => Err(format!(
                "{id}: its {what} is unreadable ({error}) and its profile {} is not listed",
                instance.profile_id
            )),
        }
    };
    let memory_total_bytes = match mig.memory_info() {
        Ok(memory) => memory.total,
        Err(error) => {
            from_profile("memory", error.to_string())?;
            profile.map_or(0, |profile| profile.memory_total_bytes)
        }
    };
    let multiprocessors = match &attributes {
        Ok(attributes) if attributes.multiprocessor_count > 0 => attributes.multiprocessor_count,
        Ok(_) => {
            from_profile("multiprocessor count", "NVML gives 0".into())?;
            profile.map_or(0, |profile| profile.multiprocessors)
        }
        Err(error) => {
            from_profile("multiprocessor count", error.to_string())?;
            profile.map_or(0, |profile| profile.multiprocessors)
        }
    };
    let name = match (profile, &attributes) {
        (Some(profile), _) => profile.name.clone(),
        // A profile the GPU did not list: named from the instance itself.
        (None, Ok(attributes)) => profile_name(
            NO_VARIANT,
            attributes.gpu_instance_slice_count,
            memory_total_bytes / MIB,
            gpu.memory_total_bytes,
        ),
        (None, Err(error)) => {
            return Err(format!(
                "{id}: its profile {} is not listed and its attributes are unreadable ({error})",
                instance.profile_id
            ));
        }
    };
    Ok(GpuPartition {
        id,
        profile: name,
        memory_total_bytes,
        multiprocessors,
        placement_start: instance.placement_start,
        placement_size: instance.placement_size,
    })
}

/// The partitions that fit the GPU as it is published, in placement order.
/// A driver's answer is not taken on trust: the published state must hold
/// together (the core refuses it otherwise). Two MIG devices of one GPU
/// instance (several compute instances in it) sit on the same slices; the
/// first is kept.
fn fitting(
    mut partitions: Vec<GpuPartition>,
    state: &MigState,
    gpu: &Gpu<'_>,
    warnings: &mut Vec<String>,
) -> Vec<GpuPartition> {
    partitions.sort_by(|a, b| (a.placement_start, &a.id).cmp(&(b.placement_start, &b.id)));
    let mut owners = SliceOwners::new(state.memory_slices);
    let mut kept = Vec::new();
    for partition in partitions {
        let start = partition.placement_start;
        let span = owners.span(start, partition.placement_size);
        let problem = if partition.id.trim().is_empty() {
            Some("its UUID is empty".to_string())
        } else if partition.memory_total_bytes == 0
            || partition.memory_total_bytes > gpu.memory_total_bytes
        {
            Some(format!(
                "its memory ({} bytes) does not fit the GPU's {}",
                partition.memory_total_bytes, gpu.memory_total_bytes
            ))
        } else if partition.multiprocessors == 0
            || partition.multiprocessors > state.multiprocessors
        {
            Some(format!(
                "its {} multiprocessors do not fit the GPU's {}",
                partition.multiprocessors, state.multiprocessors
            ))
        } else if let Some(span) = &span {
            owners.held(span.clone()).map(|(slice, other)| {
                format!("it shares memory slice {slice} with {other} (one GPU instance, several compute instances)")
            })
        } else {
            Some(format!(
                "it sits on memory slices {start}+{} of the GPU's {}",
                partition.placement_size, state.memory_slices
            ))
        };
        match (problem, span) {
            (None, Some(span)) => {
                owners.take(span, &partition.id);
                kept.push(partition);
            }
            (problem, _) => warnings.push(format!(
                "GPU {}: MIG device {} not listed: {}",
                gpu.uuid,
                partition.id,
                problem.unwrap_or_default()
            )),
        }
    }
    kept
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

    fn state() -> MigState {
        MigState {
            enabled: true,
            pending: None,
            memory_slices: 8,
            multiprocessors: 132,
            partitions: Vec::new(),
            profiles: Vec::new(),
        }
    }

    #[test]
    fn only_partitions_that_hold_together_are_kept() {
        let gpu = Gpu {
            uuid: "GPU-1",
            memory_total_bytes: 80 * GIB,
            multiprocessors: 132,
        };
        let mut huge = partition("MIG-huge", 0, 1);
        huge.memory_total_bytes = 81 * GIB;
        let mut no_sms = partition("MIG-none", 0, 1);
        no_sms.multiprocessors = 0;
        let mut warnings = Vec::new();
        let kept = fitting(
            vec![
                partition("MIG-b", 4, 2),
                partition("MIG-a", 0, 4),
                partition("MIG-a2", 0, 4),
                partition("MIG-out", 6, 4),
                partition("MIG-max", u32::MAX, 2),
                partition(" ", 6, 1),
                huge,
                no_sms,
            ],
            &state(),
            &gpu,
            &mut warnings,
        );
        let ids: Vec<&str> = kept.iter().map(|p| p.id.as_str()).collect();
        assert_eq!(ids, ["MIG-a", "MIG-b"], "{warnings:#?}");
        assert_eq!(warnings.len(), 6, "{warnings:#?}");
        let all = warnings.join("\n");
        for want in [
            "MIG-a2 not listed: it shares memory slice 0 with MIG-a",
            "MIG-out not listed: it sits on memory slices 6+4 of the GPU's 8",
            "MIG-max not listed: it sits on memory slices 4294967295+2",
            "its UUID is empty",
            "MIG-huge not listed: its memory",
            "MIG-none not listed: its 0 multiprocessors",
        ] {
            assert!(all.contains(want), "{want}:\n{all}");
        }
        let mut published = state();
        published.partitions = kept;
        let device_state = serde_json::json!({"version": "v1", "backend": "nvml", "devices": [{
            "id": "GPU-1", "index": 0, "vendor": "nvidia", "product": "p",
            "memoryTotalBytes": 80 * GIB, "memoryFreeBytes": 0, "fp16Tflops": 1.0,
            "memoryBandwidthGbps": 1.0, "health": "Healthy", "mig": published}]});
        tessera_core::api::NodeGpuState::from_json(&device_state.to_string()).unwrap();
    }
}
