//! Opt-in measurements with the CUDA driver (`--probe`): for each device, a
//! write/read-back check of device memory and measured host→device and
//! device→device bandwidth; and which device pairs CUDA lets access each
//! other's memory directly (P2P). Slow (hundreds of MiB copied per device) and
//! it takes GPU memory for a moment, so it runs only when asked and its result
//! is cached (see `registry`).
//!
//! `cudarc` panics when it cannot load `libcuda`, so the library is looked for
//! first (`cudarc::driver::sys::is_culib_present`, the same names cudarc
//! tries) and its absence is [`BackendError::Unavailable`]. A panic from cudarc
//! later on (a driver too old to have a function of the CUDA 12.8 API this
//! build uses) is caught and returned as [`BackendError::Failed`].
//!
//! Devices are matched to CUDA ordinals by UUID, not by index: CUDA orders
//! devices fastest first unless `CUDA_DEVICE_ORDER=PCI_BUS_ID`, NVML by PCI bus.
//! A device CUDA does not show (hidden by `CUDA_VISIBLE_DEVICES`, lost, or in
//! MIG mode, where CUDA shows the MIG instances instead) is reported as not
//! verified, with the reason.

use std::collections::{BTreeMap, HashMap};
use std::ffi::c_int;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;
use std::time::Instant;

use cudarc::driver::result::{self as cu, DriverError};
use cudarc::driver::{CudaContext, CudaStream, sys};
use serde::{Deserialize, Serialize};

use super::{BackendError, DeviceInfo, DeviceLink};

/// The CUDA driver library.
pub const CUDA_LIBRARY: &str = "libcuda.so.1";

const MIB: usize = 1 << 20;

/// How much the probe copies.
#[derive(Clone, Debug, PartialEq)]
struct ProbeOptions {
    /// Buffer copied for each bandwidth measurement.
    buffer_bytes: usize,
    /// Timed copies per measurement (after one untimed warm-up copy).
    iterations: u32,
    /// Bytes written and read back to verify a device.
    verify_bytes: usize,
}

impl Default for ProbeOptions {
    fn default() -> Self {
        Self {
            buffer_bytes: 256 * MIB,
            iterations: 5,
            verify_bytes: 4 * MIB,
        }
    }
}

/// What the probe found.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ProbeReport {
    /// One entry per device given to [`probe`], in index order.
    pub devices: Vec<DeviceProbe>,
    /// `p2p[a][b]`: whether device `a` can access device `b`'s memory directly
    /// (`cuDeviceCanAccessPeer`), by device id. Only devices CUDA shows appear.
    #[serde(default)]
    pub p2p: BTreeMap<String, BTreeMap<String, bool>>,
}

/// One device's results.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DeviceProbe {
    pub id: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cuda_ordinal: Option<u32>,
    /// Memory written, copied back and compared equal.
    pub verified: bool,
    /// Why verification failed or did not run.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// Pinned host memory to device memory.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_to_device_gbps: Option<f64>,
    /// A copy within device memory, counting bytes read plus bytes written (as
    /// CUDA's bandwidthTest does), so it compares with the memory bandwidth.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device_to_device_gbps: Option<f64>,
    /// Measurements that were skipped or degraded, and why.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub notes: Vec<String>,
}

impl ProbeReport {
    pub fn device(&self, id: &str) -> Option<&DeviceProbe> {
        self.devices.iter().find(|d| d.id == id)
    }

    /// Whether `from` can access `to`'s memory, if the probe saw both.
    pub fn can_access(&self, from: &str, to: &str) -> Option<bool> {
        self.p2p.get(from)?.get(to).copied()
    }

    /// Sets each link's `p2p` from the measured matrix: true only when access
    /// works both ways. Links between devices the probe did not see keep what
    /// the backend said.
    pub fn apply(&self, links: &mut [DeviceLink]) {
        for link in links {
            match (
                self.can_access(&link.a, &link.b),
                self.can_access(&link.b, &link.a),
            ) {
                (Some(forward), Some(backward)) => link.p2p = forward && backward,
                (Some(forward), None) | (None, Some(forward)) => link.p2p = forward,
                (None, None) => {}
            }
        }
    }
}

/// Whether the CUDA driver library can be loaded.
pub fn cuda_library_available() -> bool {
    // SAFETY: loads and unloads the candidate libraries, running their
    // initialisers, exactly as cudarc itself does on first use.
    unsafe { sys::is_culib_present() }
}

/// `probe_with` with the default options (256 MiB copied 5 times).
pub fn probe(devices: &[DeviceInfo]) -> Result<ProbeReport, BackendError> {
    probe_with(devices, &ProbeOptions::default())
}

fn probe_with(devices: &[DeviceInfo], options: &ProbeOptions) -> Result<ProbeReport, BackendError> {
    if !cuda_library_available() {
        return Err(BackendError::Unavailable(format!(
            "the CUDA driver library ({CUDA_LIBRARY}) cannot be loaded, so the GPU probe cannot \
             run. Usual causes: the NVIDIA driver is not installed on this node; or the driver \
             libraries are not mounted into this container: run the pod with the NVIDIA runtime \
             class (`runtimeClassName: nvidia`) or the NVIDIA container toolkit, with \
             NVIDIA_DRIVER_CAPABILITIES including `compute` (`utility` alone mounts NVML but \
             not libcuda)."
        )));
    }
    match catch_unwind(AssertUnwindSafe(|| run(devices, options))) {
        Ok(result) => result,
        Err(panic) => {
            let what = panic
                .downcast_ref::<String>()
                .map(String::as_str)
                .or_else(|| panic.downcast_ref::<&str>().copied())
                .unwrap_or("unknown panic");
            Err(BackendError::Failed(format!(
                "the CUDA driver library could not serve the probe ({what}); the driver may be \
                 older than the CUDA 12.8 API this build uses"
            )))
        }
    }
}

fn run(devices: &[DeviceInfo], options: &ProbeOptions) -> Result<ProbeReport, BackendError> {
    cu::init().map_err(|e| {
        if e.0 == sys::CUresult::CUDA_ERROR_NO_DEVICE {
            BackendError::Unavailable(format!(
                "CUDA sees no GPU ({e}); check CUDA_VISIBLE_DEVICES and NVIDIA_VISIBLE_DEVICES"
            ))
        } else {
            BackendError::Failed(format!("cuInit failed: {e}"))
        }
    })?;
    let failed = |what: &'static str| {
        move |e: DriverError| BackendError::Failed(format!("{what} failed: {e}"))
    };
    let count = cu::device::get_count().map_err(failed("cuDeviceGetCount"))?;
    let mut by_uuid: HashMap<String, (usize, sys::CUdevice)> = HashMap::new();
    for ordinal in 0..count.max(0) {
        let dev = cu::device::get(ordinal).map_err(failed("cuDeviceGet"))?;
        let uuid = cu::device::get_uuid(dev).map_err(failed("cuDeviceGetUuid"))?;
        by_uuid.insert(uuid_key(&format_uuid(&uuid)), (ordinal as usize, dev));
    }

    let mut sorted: Vec<&DeviceInfo> = devices.iter().collect();
    sorted.sort_by_key(|d| d.index);
    let mut report = ProbeReport::default();
    let mut visible = Vec::new();
    for device in sorted {
        match by_uuid.get(&uuid_key(&device.id)) {
            Some(&(ordinal, dev)) => {
                report
                    .devices
                    .push(probe_device(&device.id, ordinal, options));
                visible.push((device.id.as_str(), dev));
            }
            None => report.devices.push(DeviceProbe {
                id: device.id.clone(),
                error: Some(
                    "not visible to CUDA (hidden by CUDA_VISIBLE_DEVICES, lost, or in MIG mode)"
                        .to_string(),
                ),
                ..DeviceProbe::default()
            }),
        }
    }
    for &(from, from_dev) in &visible {
        for &(to, to_dev) in &visible {
            if from == to {
                continue;
            }
            let mut can: c_int = 0;
            // SAFETY: both devices come from cuDeviceGet; `can` is a valid
            // out-pointer.
            let access = unsafe { sys::cuDeviceCanAccessPeer(&mut can, from_dev, to_dev) }.result();
            let entry = report.p2p.entry(from.to_string()).or_default();
            match access {
                Ok(()) => {
                    entry.insert(to.to_string(), can != 0);
                }
                Err(e) => {
                    tracing::warn!(from = from, to = to, error = %e, "cuDeviceCanAccessPeer failed")
                }
            }
        }
    }
    Ok(report)
}

/// The form in which an NVML device ID and a CUDA UUID are compared: NVML's
/// IDs are `GPU-` and lower-case hex today, but the hex's case is not promised.
fn uuid_key(id: &str) -> String {
    id.to_ascii_lowercase()
}

/// `GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`, as NVML writes it.
fn format_uuid(uuid: &sys::CUuuid) -> String {
    let bytes: Vec<u8> = uuid.bytes.iter().map(|&c| c as u8).collect();
    let hex = |r: std::ops::Range<usize>| -> String {
        bytes[r].iter().map(|x| format!("{x:02x}")).collect()
    };
    format!(
        "GPU-{}-{}-{}-{}-{}",
        hex(0..4),
        hex(4..6),
        hex(6..8),
        hex(8..10),
        hex(10..16)
    )
}

fn probe_device(id: &str, ordinal: usize, options: &ProbeOptions) -> DeviceProbe {
    let mut probe = DeviceProbe {
        id: id.to_string(),
        cuda_ordinal: u32::try_from(ordinal).ok(),
        ..DeviceProbe::default()
    };
    let ctx = match CudaContext::new(ordinal) {
        Ok(c) => c,
        Err(e) => {
            probe.error = Some(format!("cannot create a CUDA context: {e}"));
            return probe;
        }
    };
    let stream = ctx.default_stream();
    if let Err(e) = verify(&stream, options.verify_bytes) {
        probe.error = Some(e);
        return probe;
    }
    probe.verified = true;
    match host_to_device(&ctx, &stream, options) {
        Ok((gbps, note)) => {
            probe.host_to_device_gbps = Some(gbps);
            probe.notes.extend(note);
        }
        Err(e) => probe
            .notes
            .push(format!("host-to-device bandwidth not measured: {e}")),
    }
    match device_to_device(&stream, options) {
        Ok(gbps) => probe.device_to_device_gbps = Some(gbps),
        Err(e) => probe
            .notes
            .push(format!("device-to-device bandwidth not measured: {e}")),
    }
    probe
}

/// Allocate, copy host→device→host, synchronise, free, compare.
fn verify(stream: &Arc<CudaStream>, bytes: usize) -> Result<(), String> {
    let pattern: Vec<u8> = (0..bytes)
        .map(|i| ((i as u32).wrapping_mul(2_654_435_761) >> 24) as u8)
        .collect();
    let on_device = stream
        .clone_htod(&pattern)
        .map_err(|e| format!("copy to the GPU failed: {e}"))?;
    let back = stream
        .clone_dtoh(&on_device)
        .map_err(|e| format!("copy from the GPU failed: {e}"))?;
    stream
        .synchronize()
        .map_err(|e| format!("synchronising failed: {e}"))?;
    drop(on_device);
    stream
        .synchronize()
        .map_err(|e| format!("freeing device memory failed: {e}"))?;
    match back.iter().zip(&pattern).position(|(a, b)| a != b) {
        None if back.len() == pattern.len() => Ok(()),
        None => Err(format!(
            "read back {} bytes of {}",
            back.len(),
            pattern.len()
        )),
        Some(at) => Err(format!(
            "device memory returned different data (first difference at byte {at} of {bytes})"
        )),
    }
}

/// GB/s of `bytes_per_step` moved per step: one untimed warm-up step, then
/// `iterations` timed ones.
fn time(
    stream: &Arc<CudaStream>,
    iterations: u32,
    bytes_per_step: usize,
    mut step: impl FnMut() -> Result<(), DriverError>,
) -> Result<f64, String> {
    step().map_err(|e| e.to_string())?;
    stream.synchronize().map_err(|e| e.to_string())?;
    let start = Instant::now();
    for _ in 0..iterations.max(1) {
        step().map_err(|e| e.to_string())?;
    }
    stream.synchronize().map_err(|e| e.to_string())?;
    let seconds = start.elapsed().as_secs_f64();
    if seconds <= 0.0 {
        return Err("the copies took no measurable time".to_string());
    }
    Ok(bytes_per_step as f64 * f64::from(iterations.max(1)) / seconds / 1e9)
}

/// Pinned host memory → device; pageable memory (slower) if pinning fails,
/// with a note saying so.
fn host_to_device(
    ctx: &Arc<CudaContext>,
    stream: &Arc<CudaStream>,
    options: &ProbeOptions,
) -> Result<(f64, Option<String>), String> {
    let buffer_bytes = options.buffer_bytes;
    let mut dst = stream
        .alloc_zeros::<u8>(buffer_bytes)
        .map_err(|e| format!("cannot allocate {} MiB on the GPU: {e}", buffer_bytes / MIB))?;
    // SAFETY: the pinned buffer is filled through its raw pointer before any
    // read (cudarc hands it out uninitialised).
    match unsafe { ctx.alloc_pinned::<u8>(buffer_bytes) } {
        Ok(mut host) => {
            let ptr = host.as_mut_ptr().map_err(|e| e.to_string())?;
            // SAFETY: `ptr` points to `buffer_bytes` bytes of pinned memory owned by `host`.
            unsafe { std::ptr::write_bytes(ptr, 0x5a, buffer_bytes) };
            let gbps = time(stream, options.iterations, buffer_bytes, || {
                stream.memcpy_htod(&host, &mut dst)
            })?;
            Ok((gbps, None))
        }
        Err(e) => {
            let host = vec![0x5a_u8; buffer_bytes];
            let gbps = time(stream, options.iterations, buffer_bytes, || {
                stream.memcpy_htod(&host, &mut dst)
            })?;
            Ok((
                gbps,
                Some(format!(
                    "host memory could not be pinned ({e}); measured from pageable memory"
                )),
            ))
        }
    }
}

/// A copy within the device; counts bytes read plus written.
fn device_to_device(stream: &Arc<CudaStream>, options: &ProbeOptions) -> Result<f64, String> {
    let buffer_bytes = options.buffer_bytes;
    let alloc_error = |e: DriverError| {
        format!(
            "cannot allocate 2 × {} MiB on the GPU: {e}",
            buffer_bytes / MIB
        )
    };
    let src = stream
        .alloc_zeros::<u8>(buffer_bytes)
        .map_err(alloc_error)?;
    let mut dst = stream
        .alloc_zeros::<u8>(buffer_bytes)
        .map_err(alloc_error)?;
    time(stream, options.iterations, 2 * buffer_bytes, || {
        stream.memcpy_dtod(&src, &mut dst)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uuid_format_matches_nvml() {
        let mut uuid = sys::CUuuid { bytes: [0; 16] };
        for (i, b) in uuid.bytes.iter_mut().enumerate() {
            *b = (i as u8 * 17) as std::ffi::c_char;
        }
        assert_eq!(
            format_uuid(&uuid),
            "GPU-00112233-4455-6677-8899-aabbccddeeff"
        );
    }

    #[test]
    fn an_nvml_id_finds_its_cuda_uuid_whatever_the_case() {
        let mut uuid = sys::CUuuid { bytes: [0; 16] };
        for (i, b) in uuid.bytes.iter_mut().enumerate() {
            *b = (i as u8 * 17) as std::ffi::c_char;
        }
        let cuda = uuid_key(&format_uuid(&uuid));
        for nvml in [
            "GPU-00112233-4455-6677-8899-aabbccddeeff",
            "GPU-00112233-4455-6677-8899-AABBCCDDEEFF",
        ] {
            assert_eq!(uuid_key(nvml), cuda, "{nvml}");
        }
    }
}
