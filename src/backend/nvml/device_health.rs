//! A GPU's raw health as NVML sees it: faults events reported (held for a
//! while after the last one) together with what polling finds right now.

use std::time::Instant;

use nvml_wrapper::enum_wrappers::device::{EccCounter, MemoryError, TemperatureSensor};

use super::super::{BackendError, DeviceInfo, RawHealth};
use super::NvmlBackend;
use super::errors::{describe_device_error, device_failed, is_device_failure, is_library_error};

impl NvmlBackend {
    /// Raw health: unhealthy while an event-reported fault (a critical Xid or a
    /// double-bit ECC error) is younger than the fault hold, or when polling
    /// finds uncorrected ECC errors since the driver loaded, or the GPU lost or
    /// gone. All reasons found are joined with `; `. Pending events are drained
    /// first (zero timeout).
    pub(super) fn read_health(&mut self, info: &DeviceInfo) -> Result<RawHealth, BackendError> {
        self.drain_events();
        let mut reasons = Vec::new();
        let now = Instant::now();
        if let Some(fault) = self.faults.get(&info.id) {
            if now.saturating_duration_since(fault.seen) < self.fault_hold {
                reasons.push(fault.reason.clone());
            } else {
                self.faults.remove(&info.id);
            }
        }
        match self.handle(info) {
            Err(error) if is_library_error(&error) => return Err(device_failed(info, &error)),
            Err(error) => reasons.push(describe_device_error(&error)),
            Ok(device) => match device.total_ecc_errors(MemoryError::Uncorrected, EccCounter::Volatile)
            {
                Ok(0) => {}
                Ok(count) => reasons.push(format!(
                    "{count} uncorrectable (double-bit) ECC error(s) since the driver loaded; the GPU needs a reset"
                )),
                Err(error) if is_library_error(&error) => {
                    return Err(device_failed(info, &error));
                }
                Err(error) if is_device_failure(&error) => {
                    reasons.push(describe_device_error(&error))
                }
                // No ECC (or no permission): check the GPU answers at all.
                Err(_) => match device.temperature(TemperatureSensor::Gpu) {
                    Err(error) if is_device_failure(&error) => {
                        reasons.push(describe_device_error(&error))
                    }
                    _ => {}
                },
            },
        }
        Ok(if reasons.is_empty() {
            RawHealth::Healthy
        } else {
            RawHealth::Unhealthy(reasons.join("; "))
        })
    }
}
