//! An AMD GPU's live readings: memory use, utilisation and RAS error counts
//! from its DRM device, sensors from hwmon, and, with the `rocm-smi`
//! feature, ROCm SMI's readings where sysfs has none.

use super::super::{BackendError, DeviceInfo, Telemetry};
use super::AmdBackend;
use super::drm::{Card, card_for_pci};
use super::sensors::{clock_mhz, hwmon_dir, power_w, ras_totals, temperature_c};
use super::sysfs_files::{failed, read_opt_i64, read_u64};

impl AmdBackend {
    pub(super) fn read_telemetry(&self, device: &DeviceInfo) -> Result<Telemetry, BackendError> {
        let card = card_for_pci(&self.root, &device.pci_bus_id);
        self.telemetry_of(card.as_ref(), device)
    }

    /// The readings of `device`, whose DRM card (`None`: gone) was found by
    /// the caller.
    pub(super) fn telemetry_of(
        &self,
        card: Option<&Card>,
        device: &DeviceInfo,
    ) -> Result<Telemetry, BackendError> {
        let card = card.ok_or_else(|| {
            failed(format!(
                "the DRM device of {} ({}) is gone",
                device.id, device.pci_bus_id
            ))
        })?;
        let dir = &card.device;
        let used = read_u64(&dir.join("mem_info_vram_used"))?;
        let total = match read_opt_i64(&dir.join("mem_info_vram_total"))? {
            Some(total) if total > 0 => total as u64,
            _ => device.memory_total_bytes,
        };
        let utilization_percent = read_opt_i64(&dir.join("gpu_busy_percent"))?
            .and_then(|percent| u32::try_from(percent.clamp(0, 100)).ok());
        let ras = ras_totals(dir);
        let mut telemetry = Telemetry {
            utilization_percent,
            memory_used_bytes: used,
            memory_free_bytes: total.saturating_sub(used),
            ecc_corrected_errors: ras.corrected,
            ecc_uncorrected_errors: ras.uncorrected,
            // Xid errors are NVIDIA's; amdgpu has nothing alike to count.
            ..Telemetry::default()
        };
        if let Some(hwmon) = hwmon_dir(dir) {
            telemetry.temperature_c = temperature_c(&hwmon)?;
            telemetry.power_w = power_w(&hwmon)?;
            telemetry.graphics_clock_mhz = clock_mhz(&hwmon, "sclk")?;
            telemetry.memory_clock_mhz = clock_mhz(&hwmon, "mclk")?;
        }
        #[cfg(feature = "rocm-smi")]
        if let Some(smi) = &self.smi
            && let Some(reading) = smi.read(&device.pci_bus_id)
        {
            telemetry.temperature_c = telemetry.temperature_c.or(reading.temperature_c);
            telemetry.power_w = telemetry.power_w.or(reading.power_w);
            telemetry.utilization_percent = telemetry
                .utilization_percent
                .or(reading.utilization_percent);
        }
        Ok(telemetry)
    }
}
