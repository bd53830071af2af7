//! The GPUs NVML counts, read into [`DeviceInfo`]s, and what stands in for a
//! GPU that cannot be read (see "A GPU that cannot be read" in the backend's
//! docs): its last good reading, or a placeholder under a positional id.

use std::collections::{HashMap, HashSet};

use nvml_wrapper::Device;
use nvml_wrapper::enum_wrappers::device::Clock;
use nvml_wrapper::error::NvmlError;

use super::super::{BackendError, DeviceInfo};
use super::NvmlBackend;
use super::errors::{is_library_error, library_failed, optional};
use super::mig;
use super::pci::{normalize_pci_bus_id, read_numa_node};
use super::specs::{
    cuda_cores_per_sm, estimate_fp16_tflops, estimate_memory_bandwidth_gbps,
    estimate_narrow_tflops, sm_count_by_product,
};
use tessera_core::api::Vendor;

/// Prefix of the id given to a GPU whose UUID cannot be read.
const FALLBACK_ID_PREFIX: &str = "nvml-index-";
/// Stand-in for a figure that cannot be known (an unreadable GPU, or a GPU
/// whose SM count or clocks NVML does not give): positive so the published
/// state stays valid, and small enough that nothing is planned on it.
const PLACEHOLDER_FIGURE: f64 = 0.001;

/// The id of a GPU whose UUID could not be read.
pub(crate) fn fallback_id(index: u32) -> String {
    format!("{FALLBACK_ID_PREFIX}{index}")
}

/// Whether an id is a positional stand-in (see the backend's docs).
pub fn is_fallback_id(id: &str) -> bool {
    id.starts_with(FALLBACK_ID_PREFIX)
}

impl NvmlBackend {
    /// Every GPU NVML counts, in index order; unreadable ones as described in
    /// the backend's docs.
    pub(super) fn list_devices(&mut self) -> Result<Vec<DeviceInfo>, BackendError> {
        let count = self
            .nvml
            .device_count()
            .map_err(|error| library_failed("counting the GPUs", &error))?;
        let mut mig_warnings = Vec::new();
        let readings: Vec<Result<DeviceInfo, NvmlError>> = (0..count)
            .map(|index| self.read_device(index, &mut mig_warnings))
            .collect();
        let readable: HashSet<String> = readings
            .iter()
            .filter_map(|reading| reading.as_ref().ok().map(|info| info.id.clone()))
            .collect();
        let trust_cache = self.known_count == Some(count);
        let mut known = HashMap::new();
        let mut unreadable = HashSet::new();
        let mut listed = Vec::with_capacity(readings.len());
        for (index, reading) in (0..count).zip(readings) {
            let info = match reading {
                Ok(info) => info,
                Err(error) if is_library_error(&error) => {
                    return Err(library_failed(&format!("reading GPU {index}"), &error));
                }
                Err(error) => {
                    let cached = self
                        .known
                        .get(&index)
                        .filter(|last| trust_cache && !readable.contains(&last.id))
                        .cloned();
                    if !self.unreadable.contains(&index) {
                        tracing::warn!(
                            index, error = %error, known = cached.is_some(),
                            "GPU cannot be read; listing it so it is reported unhealthy"
                        );
                    }
                    unreadable.insert(index);
                    cached.unwrap_or_else(|| placeholder(index))
                }
            };
            if !is_fallback_id(&info.id) {
                let unestimated = info.fp16_tflops == PLACEHOLDER_FIGURE
                    || info.memory_bandwidth_gbps == PLACEHOLDER_FIGURE;
                if unestimated && self.unestimated.insert(info.product.clone()) {
                    tracing::warn!(
                        index, product = %info.product, sms = info.compute_units,
                        "NVML does not give what the throughput or bandwidth estimate needs \
                         (SM count, clocks, bus width); using a placeholder. Add the product \
                         to the tables in backend/nvml/specs.rs"
                    );
                }
                known.insert(index, info.clone());
            }
            listed.push(info);
        }
        self.known = known;
        self.known_count = Some(count);
        self.unreadable = unreadable;
        self.log_mig_warnings(mig_warnings);
        Ok(listed)
    }

    /// A MIG reading that fails fails again at every poll: each is logged
    /// when it starts, and again only after it has cleared.
    fn log_mig_warnings(&mut self, warnings: Vec<String>) {
        let current: HashSet<String> = warnings.into_iter().collect();
        for warning in current.difference(&self.mig_warnings) {
            tracing::warn!("{warning}");
        }
        self.mig_warnings = current;
    }

    fn read_device(
        &self,
        index: u32,
        mig_warnings: &mut Vec<String>,
    ) -> Result<DeviceInfo, NvmlError> {
        let device = self.nvml.device_by_index(index)?;
        let id = device.uuid()?;
        let product = device.name()?;
        let memory_total_bytes = device.memory_info()?.total;
        let capability = device.cuda_compute_capability()?;
        let (major, minor) = (capability.major, capability.minor);
        let sms = sm_count(&device, &product, major, minor)?;
        let max_sm = optional(device.max_clock_info(Clock::SM))?;
        let max_mem = optional(device.max_clock_info(Clock::Memory))?;
        let bus_width = optional(device.memory_bus_width())?;
        let pci_bus_id = normalize_pci_bus_id(&device.pci_info()?.bus_id);
        let numa_node = read_numa_node(&self.sysfs_root, &pci_bus_id);
        let fp16_tflops = estimate_fp16_tflops(&product, major, minor, sms, max_sm);
        let (fp8_tflops, fp4_tflops) = estimate_narrow_tflops(major, minor, fp16_tflops);
        let memory_bandwidth_gbps = estimate_memory_bandwidth_gbps(bus_width, max_mem);
        let gpu = mig::Gpu {
            uuid: &id,
            memory_total_bytes,
            multiprocessors: sms.unwrap_or(0),
        };
        let mig = mig::read_mig(&device, &gpu, mig_warnings);
        Ok(DeviceInfo {
            id,
            index,
            vendor: Vendor::Nvidia,
            product,
            memory_total_bytes,
            architecture: format!("{major}.{minor}"),
            compute_units: sms.unwrap_or(0),
            fp16_tflops: fp16_tflops.unwrap_or(PLACEHOLDER_FIGURE),
            fp8_tflops,
            fp4_tflops,
            memory_bandwidth_gbps: memory_bandwidth_gbps.unwrap_or(PLACEHOLDER_FIGURE),
            pci_bus_id,
            numa_node,
            mig,
        })
    }
}

/// SMs: NVML attributes (MIG devices), else CUDA cores / cores per SM, else the
/// product table.
fn sm_count(
    device: &Device<'_>,
    product: &str,
    major: i32,
    minor: i32,
) -> Result<Option<u32>, NvmlError> {
    if let Some(attributes) = optional(device.attributes())?
        && attributes.multiprocessor_count > 0
    {
        return Ok(Some(attributes.multiprocessor_count));
    }
    if let Some(cores) = optional(device.num_cores())?
        && let Some(per_sm) = cuda_cores_per_sm(major, minor)
        && cores > 0
        && cores % per_sm == 0
    {
        return Ok(Some(cores / per_sm));
    }
    Ok(sm_count_by_product(product))
}

fn placeholder(index: u32) -> DeviceInfo {
    DeviceInfo {
        id: fallback_id(index),
        index,
        vendor: Vendor::Nvidia,
        product: "NVIDIA GPU (unreadable)".to_string(),
        memory_total_bytes: 1,
        architecture: "unknown".to_string(),
        compute_units: 0,
        fp16_tflops: PLACEHOLDER_FIGURE,
        fp8_tflops: None,
        fp4_tflops: None,
        memory_bandwidth_gbps: PLACEHOLDER_FIGURE,
        pci_bus_id: String::new(),
        numa_node: None,
        mig: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fallback_ids() {
        assert!(is_fallback_id(&fallback_id(3)));
        assert!(!is_fallback_id("GPU-1234"));
    }
}
