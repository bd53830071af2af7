//! Optional telemetry from ROCm SMI (cargo feature `rocm-smi`), for readings
//! sysfs does not give on some products or kernels (power, temperature,
//! utilization). The sysfs backend stays the source of devices, memory, links
//! and health; this only fills telemetry gaps (see
//! [`AmdBackend::with_rocm_smi`](super::amd::AmdBackend::with_rocm_smi)).
//!
//! Built against `librocm_smi64` (Debian: `librocm-smi-dev`; ROCm:
//! `rocm-smi-lib`); the `rocm_smi_lib` crate generates its bindings with
//! bindgen, so building also needs libclang. Only calls present since ROCm
//! 5.2 are used. The crate's own `RocmSmi::init` ignores the status of
//! `rsmi_init`, so this module calls the re-exported C functions itself and
//! checks every status.
//!
//! Devices are matched by PCI bus id (`rsmi_dev_pci_id_get`: domain in bits
//! 63..32, bus 15..8, device 7..3, function 2..0), never by index, since the
//! SMI's order need not match ours.

use std::collections::HashMap;
use std::ffi::CStr;

use rocm_smi_lib::{
    rsmi_dev_busy_percent_get, rsmi_dev_pci_id_get, rsmi_dev_power_ave_get,
    rsmi_dev_temp_metric_get, rsmi_init, rsmi_num_monitor_devices, rsmi_shut_down,
    rsmi_status_string, rsmi_status_t, rsmi_status_t_RSMI_STATUS_SUCCESS,
    rsmi_temperature_metric_t_RSMI_TEMP_CURRENT, rsmi_temperature_type_t_RSMI_TEMP_TYPE_EDGE,
    rsmi_temperature_type_t_RSMI_TEMP_TYPE_JUNCTION,
};

use super::BackendError;

/// What ROCm SMI read for one device; `None` where it has no reading.
#[derive(Clone, Debug, Default, PartialEq)]
pub(crate) struct SmiReading {
    pub(crate) temperature_c: Option<f64>,
    pub(crate) power_w: Option<f64>,
    pub(crate) utilization_percent: Option<u32>,
}

/// An initialised ROCm SMI; shut down when dropped.
#[derive(Debug)]
pub(crate) struct RocmSmiTelemetry {
    /// PCI bus id (`0000:c1:00.0`) → SMI device index.
    by_pci: HashMap<String, u32>,
}

/// The library's description of a status code.
fn status_text(status: rsmi_status_t) -> String {
    let mut text: *const std::os::raw::c_char = std::ptr::null();
    // SAFETY: `rsmi_status_string` writes a pointer to a static, NUL-terminated
    // string into `text`, or leaves it null on failure; both are checked.
    let rc = unsafe { rsmi_status_string(status, &mut text) };
    if rc != rsmi_status_t_RSMI_STATUS_SUCCESS || text.is_null() {
        return format!("ROCm SMI status {status}");
    }
    // SAFETY: non-null and NUL-terminated per the library's contract; the
    // string is static, so it outlives this borrow.
    let message = unsafe { CStr::from_ptr(text) };
    format!("{} (status {status})", message.to_string_lossy())
}

fn check(what: &str, status: rsmi_status_t) -> Result<(), String> {
    if status == rsmi_status_t_RSMI_STATUS_SUCCESS {
        Ok(())
    } else {
        Err(format!("{what}: {}", status_text(status)))
    }
}

/// `0000:c1:00.0` from a ROCm SMI BDF id.
fn pci_bus_id_from_bdfid(bdfid: u64) -> String {
    format!(
        "{:04x}:{:02x}:{:02x}.{:x}",
        (bdfid >> 32) & 0xffff_ffff,
        (bdfid >> 8) & 0xff,
        (bdfid >> 3) & 0x1f,
        bdfid & 0x7
    )
}

impl RocmSmiTelemetry {
    /// Initialises ROCm SMI and maps its devices by PCI bus id.
    pub(crate) fn init() -> Result<Self, BackendError> {
        // SAFETY: plain C call with a flags value; 0 means default behaviour.
        let status = unsafe { rsmi_init(0) };
        check("rsmi_init", status).map_err(BackendError::Unavailable)?;
        // From here on the library is initialised: `Self`'s Drop shuts it down.
        let mut smi = Self {
            by_pci: HashMap::new(),
        };
        let mut count = 0u32;
        // SAFETY: `count` is a valid, writable u32 for the duration of the call.
        let status = unsafe { rsmi_num_monitor_devices(&mut count) };
        check("rsmi_num_monitor_devices", status).map_err(BackendError::Failed)?;
        for index in 0..count {
            let mut bdfid = 0u64;
            // SAFETY: `index` is below the device count; `bdfid` is writable.
            let status = unsafe { rsmi_dev_pci_id_get(index, &mut bdfid) };
            match check("rsmi_dev_pci_id_get", status) {
                Ok(()) => {
                    smi.by_pci.insert(pci_bus_id_from_bdfid(bdfid), index);
                }
                Err(e) => tracing::warn!(index, error = %e, "ROCm SMI device without a PCI id"),
            }
        }
        Ok(smi)
    }

    /// Current readings of the device at `pci_bus_id`; `None` if ROCm SMI does
    /// not know it. A reading the device does not support is `None` inside.
    pub(crate) fn read(&self, pci_bus_id: &str) -> Option<SmiReading> {
        let index = *self.by_pci.get(&pci_bus_id.to_ascii_lowercase())?;
        let temperature_c = [
            rsmi_temperature_type_t_RSMI_TEMP_TYPE_EDGE,
            rsmi_temperature_type_t_RSMI_TEMP_TYPE_JUNCTION,
        ]
        .into_iter()
        .find_map(|sensor| {
            let mut milli = 0i64;
            // SAFETY: valid index and sensor/metric enumerators; `milli` is writable.
            let status = unsafe {
                rsmi_dev_temp_metric_get(
                    index,
                    sensor,
                    rsmi_temperature_metric_t_RSMI_TEMP_CURRENT,
                    &mut milli,
                )
            };
            (status == rsmi_status_t_RSMI_STATUS_SUCCESS).then(|| milli as f64 / 1000.0)
        });
        let mut micro = 0u64;
        // SAFETY: valid index, sensor 0, `micro` is writable.
        let status = unsafe { rsmi_dev_power_ave_get(index, 0, &mut micro) };
        let power_w =
            (status == rsmi_status_t_RSMI_STATUS_SUCCESS).then(|| micro as f64 / 1_000_000.0);
        let mut busy = 0u32;
        // SAFETY: valid index, `busy` is writable.
        let status = unsafe { rsmi_dev_busy_percent_get(index, &mut busy) };
        let utilization_percent =
            (status == rsmi_status_t_RSMI_STATUS_SUCCESS).then(|| busy.min(100));
        Some(SmiReading {
            temperature_c,
            power_w,
            utilization_percent,
        })
    }
}

impl Drop for RocmSmiTelemetry {
    fn drop(&mut self) {
        // SAFETY: balances the successful `rsmi_init` of `init`.
        let status = unsafe { rsmi_shut_down() };
        if let Err(e) = check("rsmi_shut_down", status) {
            tracing::warn!(error = %e, "ROCm SMI shutdown failed");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bdf_ids_decode() {
        assert_eq!(pci_bus_id_from_bdfid(0xc1 << 8), "0000:c1:00.0");
        assert_eq!(
            pci_bus_id_from_bdfid((1 << 32) | (0x63 << 8) | (2 << 3) | 1),
            "0001:63:02.1"
        );
        // Newer ROCm keeps a partition id in reserved bits 31..28: ignored.
        assert_eq!(
            pci_bus_id_from_bdfid((3 << 28) | (0x05 << 8)),
            "0000:05:00.0"
        );
    }
}
