//! A DRM device's live readings: the hwmon sensors amdgpu registers
//! (temperature, power, clocks) and its RAS error counts.

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
    ras_count(text, "ue")
}

/// The count after `<key>:` in a RAS `*_err_count` file: `ue` uncorrectable,
/// `ce` correctable (newer kernels add `de`, deferred).
fn ras_count(text: &str, key: &str) -> Option<u64> {
    text.lines().find_map(|line| {
        let (name, value) = line.split_once(':')?;
        (name.trim() == key).then(|| value.trim().parse().ok())?
    })
}

/// Memory errors corrected and not, summed over every RAS block of a device
/// (`ras/<block>_err_count`: `umc` for the memory itself, `gfx`, `sdma`,
/// `xgmi_wafl` ...), as amd-smi totals them. Since the driver loaded.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) struct RasTotals {
    pub(super) corrected: Option<u64>,
    pub(super) uncorrected: Option<u64>,
}

/// The RAS totals of a DRM device: `None` where it has no RAS counts, and
/// also while any block's count cannot be read (the driver answers "Query
/// currently inaccessible" during a RAS interrupt): a total missing a block
/// would fall and then rise again, which reads as a counter reset.
pub(super) fn ras_totals(device: &Path) -> RasTotals {
    let dir = device.join("ras");
    let Ok(entries) = std::fs::read_dir(&dir) else {
        return RasTotals::default();
    };
    let mut files: Vec<PathBuf> = entries
        .filter_map(Result::ok)
        .filter(|entry| entry.file_name().to_string_lossy().ends_with("_err_count"))
        .map(|entry| entry.path())
        .collect();
    files.sort();
    let mut texts = Vec::with_capacity(files.len());
    for file in &files {
        match read_text(file) {
            Ok(text) => texts.push(text),
            Err(error) => {
                tracing::debug!(file = %file.display(), %error, "RAS count unreadable; no ECC totals this time");
                return RasTotals::default();
            }
        }
    }
    sum_ras(texts.iter().map(String::as_str))
}

/// The totals of the texts of every block's `*_err_count` file; a key is
/// `None` when there is no file, or one of them lacks a number for it.
fn sum_ras<'a>(texts: impl IntoIterator<Item = &'a str>) -> RasTotals {
    let mut texts = texts.into_iter().peekable();
    if texts.peek().is_none() {
        return RasTotals::default();
    }
    let mut totals = RasTotals {
        corrected: Some(0),
        uncorrected: Some(0),
    };
    for text in texts {
        let add = |total: Option<u64>, key| Some(total?.saturating_add(ras_count(text, key)?));
        totals.corrected = add(totals.corrected, "ce");
        totals.uncorrected = add(totals.uncorrected, "ue");
    }
    totals
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

    #[test]
    fn ras_totals_sum_every_block() {
        let totals = |texts: &[&str]| sum_ras(texts.iter().copied());
        assert_eq!(totals(&[]), RasTotals::default(), "no RAS: no counts");
        assert_eq!(
            totals(&["ue: 1\nce: 12\n", "ue: 0\nce: 3\nde: 5\n"]),
            RasTotals {
                corrected: Some(15),
                uncorrected: Some(1)
            }
        );
        assert_eq!(
            totals(&["ue: 1\nce: 12\n", "Query currently inaccessible\n"]),
            RasTotals::default(),
            "one block unreadable: no totals rather than part of them"
        );
        assert_eq!(
            totals(&["ue: 2\n", "ue: 1\nce: 4\n"]),
            RasTotals {
                corrected: None,
                uncorrected: Some(3)
            }
        );
        assert_eq!(
            totals(&["ue: 18446744073709551615\nce: 0\n", "ue: 1\nce: 0\n"]).uncorrected,
            Some(u64::MAX)
        );
    }

    #[test]
    fn ras_totals_read_the_err_count_files_of_the_ras_directory() {
        let device = tempfile::tempdir().unwrap();
        assert_eq!(ras_totals(device.path()), RasTotals::default(), "no ras/");
        let ras = device.path().join("ras");
        std::fs::create_dir(&ras).unwrap();
        std::fs::write(ras.join("features"), "feature mask: 0x3fff\n").unwrap();
        assert_eq!(
            ras_totals(device.path()),
            RasTotals::default(),
            "no *_err_count file"
        );
        std::fs::write(ras.join("umc_err_count"), "ue: 0\nce: 7\n").unwrap();
        std::fs::write(ras.join("gfx_err_count"), "ue: 2\nce: 1\n").unwrap();
        assert_eq!(
            ras_totals(device.path()),
            RasTotals {
                corrected: Some(8),
                uncorrected: Some(2)
            }
        );
        // A directory where a file should be cannot be read: no totals.
        std::fs::create_dir(ras.join("sdma_err_count")).unwrap();
        assert_eq!(ras_totals(device.path()), RasTotals::default());
    }
}
