//! The MIG queries `nvml-wrapper` 0.13 lacks or gets wrong, made through its
//! raw bindings. With `events`, this is the backend's unsafe code.
//!
//! - **A MIG device's GPU instance** (its profile and placement): NVML gives
//!   it through `nvmlDeviceGetGpuInstanceId` on the MIG handle, then
//!   `nvmlDeviceGetGpuInstanceById` and `nvmlGpuInstanceGetInfo` on its GPU;
//!   `nvml-wrapper` wraps none of the three.
//! - **A profile's possible placements**: `Device::possible_placements`
//!   reserves room for NVML's answer but never sets the vector's length, so
//!   it always answers an empty list. The same two calls are made here, and
//!   the length set to what NVML says it wrote.
//!
//! Symbols are taken through `nvml-wrapper`'s checked accessors (`nvml_sym`):
//! a driver without one answers an error. The bindings' own methods would
//! panic instead.

use std::ffi::c_uint;

use nvml_wrapper::Device;
use nvml_wrapper::error::{NvmlError, nvml_sym, nvml_try, nvml_try_count};

/// More placements than any profile has (7 on A100 and H100): a bound on
/// what is reserved for NVML's answer.
const MAX_PLACEMENTS: c_uint = 64;

/// A GPU instance as NVML describes it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct GpuInstance {
    /// The profile ID (`ProfileInfo::id`, e.g. 9 for a 3-slice profile).
    pub(super) profile_id: u32,
    /// The first memory slice, and how many.
    pub(super) placement_start: u32,
    pub(super) placement_size: u32,
}

/// A placement: first memory slice, and how many.
pub(super) type Placement = (u32, u32);

/// The GPU instance the MIG device `mig` of `gpu` belongs to.
pub(super) fn gpu_instance(gpu: &Device<'_>, mig: &Device<'_>) -> Result<GpuInstance, NvmlError> {
    let lib = gpu.nvml().lib();
    let instance_id_of = nvml_sym(lib.nvmlDeviceGetGpuInstanceId.as_ref())?;
    let instance_by_id = nvml_sym(lib.nvmlDeviceGetGpuInstanceById.as_ref())?;
    let instance_info = nvml_sym(lib.nvmlGpuInstanceGetInfo.as_ref())?;
    // SAFETY: both handles come from live `Device`s of an initialised NVML,
    // which outlives this call (the devices borrow it). Every out-pointer
    // points at a local of the type the binding declares, and a zeroed
    // `nvmlGpuInstanceInfo_t` (integers and a pointer) is a valid value. The
    // GPU-instance handle belongs to NVML: it is only passed back to NVML and
    // never freed (destroying it would destroy the partition).
    unsafe {
        let mut instance_id: c_uint = 0;
        nvml_try(instance_id_of(mig.handle(), &mut instance_id))?;
        let mut instance = std::ptr::null_mut();
        nvml_try(instance_by_id(gpu.handle(), instance_id, &mut instance))?;
        let mut info = std::mem::zeroed();
        nvml_try(instance_info(instance, &mut info))?;
        Ok(GpuInstance {
            profile_id: info.profileId,
            placement_start: info.placement.start,
            placement_size: info.placement.size,
        })
    }
}

/// Where GPU instances of the profile with ID `profile_id` can be placed.
pub(super) fn possible_placements(
    gpu: &Device<'_>,
    profile_id: u32,
) -> Result<Vec<Placement>, NvmlError> {
    let placements_of = nvml_sym(
        gpu.nvml()
            .lib()
            .nvmlDeviceGetGpuInstancePossiblePlacements_v2
            .as_ref(),
    )?;
    // SAFETY: the handle comes from a live `Device` of an initialised NVML.
    // The first call passes no array, only a count to fill. The second
    // passes an array with room for `capacity` placements and says so in
    // `written`; NVML writes at most that many and sets `written` to how many
    // it wrote, and the length is set to no more than the room reserved.
    // Placements are two integers: any bytes NVML wrote are a valid value.
    unsafe {
        let mut count: c_uint = 0;
        nvml_try_count(placements_of(
            gpu.handle(),
            profile_id,
            std::ptr::null_mut(),
            &mut count,
        ))?;
        if count == 0 {
            return Ok(Vec::new());
        }
        let capacity = count.min(MAX_PLACEMENTS);
        let mut placements = Vec::with_capacity(capacity as usize);
        let mut written = capacity;
        nvml_try(placements_of(
            gpu.handle(),
            profile_id,
            placements.as_mut_ptr(),
            &mut written,
        ))?;
        placements.set_len(written.min(capacity) as usize);
        Ok(placements
            .iter()
            .map(|placement| (placement.start, placement.size))
            .collect())
    }
}
