//! What an NVML error means: the library unusable (the backend fails or does
//! not apply) or one device broken (that device is unhealthy), and the words
//! that tell a person what to do about it.

use std::ffi::OsStr;

use nvml_wrapper::error::NvmlError;

use super::super::{BackendError, DeviceInfo};

const LOST: &str = "GPU is lost: it has fallen off the bus or is otherwise inaccessible \
    (NVML_ERROR_GPU_IS_LOST); it needs a reset or a reboot of the node";

const LOAD_HINTS: &str = "Usual causes: \
    (1) the NVIDIA driver is not installed on this node (expected on nodes without NVIDIA GPUs; \
    otherwise check `nvidia-smi` on the host); \
    (2) the driver libraries are not mounted into this container: run the pod with the NVIDIA \
    runtime class (`runtimeClassName: nvidia`) or with the NVIDIA container toolkit as the \
    default runtime, with NVIDIA_DRIVER_CAPABILITIES including `utility`, so that \
    libnvidia-ml.so.1 and /dev/nvidia* are injected; \
    (3) a driver/library version mismatch: the library found does not belong to the loaded \
    kernel module (typically after a driver upgrade without a reboot; `nvidia-smi` then says \
    \"Driver/library version mismatch\").";

/// Errors that mean NVML itself is unusable, not one device.
pub(super) fn is_library_error(error: &NvmlError) -> bool {
    matches!(
        error,
        NvmlError::Uninitialized
            | NvmlError::DriverNotLoaded
            | NvmlError::LibRmVersionMismatch
            | NvmlError::LibloadingError(_)
            | NvmlError::FailedToLoadSymbol(_)
            | NvmlError::FunctionNotFound
            | NvmlError::LibraryNotFound
    )
}

/// Errors that mean the device itself is gone or broken.
pub(super) fn is_device_failure(error: &NvmlError) -> bool {
    matches!(
        error,
        NvmlError::GpuLost | NvmlError::ResetRequired | NvmlError::NotFound
    )
}

/// What a per-device error means for the device, in words.
pub(super) fn describe_device_error(error: &NvmlError) -> String {
    match error {
        NvmlError::GpuLost => LOST.to_string(),
        NvmlError::NotFound => "the GPU is no longer present".to_string(),
        NvmlError::ResetRequired => {
            "the GPU needs a reset before it can be used again (NVML_ERROR_RESET_REQUIRED)"
                .to_string()
        }
        other => format!("NVML cannot query the GPU: {other}"),
    }
}

pub(super) fn library_failed(what: &str, error: &NvmlError) -> BackendError {
    BackendError::Failed(format!("NVML failed while {what}: {error}"))
}

pub(super) fn device_failed(info: &DeviceInfo, error: &NvmlError) -> BackendError {
    if is_library_error(error) {
        return library_failed(&format!("reading GPU {} ({})", info.index, info.id), error);
    }
    BackendError::Failed(format!(
        "GPU {} ({}): {}",
        info.index,
        info.id,
        describe_device_error(error)
    ))
}

pub(super) fn init_error(library: &OsStr, error: NvmlError) -> BackendError {
    let lib = library.to_string_lossy();
    match error {
        NvmlError::LibloadingError(_)
        | NvmlError::FailedToLoadSymbol(_)
        | NvmlError::LibraryNotFound
        | NvmlError::FunctionNotFound => BackendError::Unavailable(format!(
            "NVML is not available: cannot load {lib} ({error}). {LOAD_HINTS}"
        )),
        NvmlError::DriverNotLoaded => BackendError::Unavailable(format!(
            "NVML is not available: {lib} loaded, but the NVIDIA kernel driver is not running \
             ({error}). {LOAD_HINTS}"
        )),
        NvmlError::LibRmVersionMismatch => BackendError::Failed(format!(
            "NVML cannot start: driver/library version mismatch: {lib} does not belong to the \
             loaded NVIDIA kernel module ({error}). This usually follows a driver upgrade without a \
             reboot: reboot the node or reload the nvidia kernel modules. In a container, the \
             driver libraries must come from the host (the NVIDIA runtime, \
             `runtimeClassName: nvidia`), not from the image."
        )),
        NvmlError::NoPermission => BackendError::Failed(format!(
            "NVML cannot start: no permission to talk to the NVIDIA driver ({error}). The container \
             cannot open /dev/nvidia*: run the pod with the NVIDIA runtime class \
             (`runtimeClassName: nvidia`) or the NVIDIA container toolkit."
        )),
        other => BackendError::Failed(format!(
            "NVML failed to initialise from {lib}: {other}. {LOAD_HINTS}"
        )),
    }
}

/// `Ok(Some)` for a value, `Ok(None)` for a reading the device or driver does
/// not give, `Err` when the device or library has failed.
pub(super) fn optional<T>(reading: Result<T, NvmlError>) -> Result<Option<T>, NvmlError> {
    match reading {
        Ok(value) => Ok(Some(value)),
        Err(error) if is_device_failure(&error) || matches!(error, NvmlError::Uninitialized) => {
            Err(error)
        }
        Err(_) => Ok(None),
    }
}
