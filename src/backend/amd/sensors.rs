//! A DRM device's live readings: the hwmon sensors amdgpu registers
//! (temperature, power, clocks) and the RAS count of uncorrectable memory
//! errors.

use std::path::{Path, PathBuf};

use super::super::BackendError;
use super::sysfs_files::{read_opt_i64, read_text};

/// The hwmon directory of a DRM device (amdgpu registers one per device).
pub(super) fn hwmon_dir(device: &Path) -> Option<PathBuf> {
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(device.join("hwmon"))
        .ok()?
        .filter_map(Result::ok)
        .filter(|entry| entry.file_name().to_string_lossy().starts_with("hwmon"))
        .map(|entry| entry.path())
        .collect();
    dirs.sort();
    dirs.into_iter().next()
}

/// The index of the hwmon channel `<prefix><i>` whose label is `label`.
fn labelled_channel(hwmon: &Path, prefix: &str, label: &str) -> Option<u32> {
    (1..=16).find(|channel| {
        read_text(&hwmon.join(format!("{prefix}{channel}_label")))
            .is_ok_and(|text| text.trim().eq_ignore_ascii_case(label))
    })
}

/// The `edge` sensor, else `junction`, else `temp1_input` (see the backend's
/// docs for why edge comes first).
pub(super) fn temperature_c(hwmon: &Path) -> Result<Option<f64>, BackendError> {
    let channel = labelled_channel(hwmon, "temp", "edge")
        .or_else(|| labelled_channel(hwmon, "temp", "junction"))
        .unwrap_or(1);
    let milli = read_opt_i64(&hwmon.join(format!("temp{channel}_input")))?;
    Ok(milli.map(|millidegrees| millidegrees as f64 / 1000.0))
}

pub(super) fn power_w(hwmon: &Path) -> Result<Option<f64>, BackendError> {
    for file in ["power1_average", "power1_input"] {
        if let Some(micro) = read_opt_i64(&hwmon.join(file))? {
            return Ok(Some(micro as f64 / 1_000_000.0));
        }
    }
    Ok(None)
}

/// The clock labelled `label` (`sclk`, `mclk`) in MHz.
pub(super) fn clock_mhz(hwmon: &Path, label: &str) -> Result<Option<u32>, BackendError> {
    let Some(channel) = labelled_channel(hwmon, "freq", label) else {
        return Ok(None);
    };
    let hz = read_opt_i64(&hwmon.join(format!("freq{channel}_input")))?;
    Ok(hz.and_then(|hertz| u32::try_from(hertz / 1_000_000).ok()))
}

/// Uncorrectable errors from a RAS `*_err_count` file (`ue: 0\nce: 0\n`).
pub(super) fn uncorrectable(text: &str) -> Option<u64> {
    text.lines().find_map(|line| {
        let (key, value) = line.split_once(':')?;
        (key.trim() == "ue").then(|| value.trim().parse().ok())?
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ras_counts() {
        assert_eq!(uncorrectable("ue: 0\nce: 12\n"), Some(0));
        assert_eq!(uncorrectable("ue: 3\nce: 0\n"), Some(3));
        assert_eq!(uncorrectable("ce: 1\n"), None);
        assert_eq!(uncorrectable("ue: lots\n"), None);
        assert_eq!(uncorrectable(""), None);
    }
}
