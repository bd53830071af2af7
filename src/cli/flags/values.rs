//! Flag values: the parsers that refuse a bad one with a reason, and the
//! `--allocation` choices.

use crate::api::ResourceName;
use crate::controller::model_cache::ModelCacheDir;
use crate::kubernetes::AllocationMode;

/// A flag that must not be empty or blank.
pub(crate) fn non_empty(text: &str) -> Result<String, String> {
    if text.trim().is_empty() {
        Err("must not be empty".to_string())
    } else {
        Ok(text.to_string())
    }
}

/// `--allocation`'s values.
#[derive(Clone, Copy, clap::ValueEnum)]
pub(crate) enum AllocationFlag {
    Auto,
    Dra,
    DevicePlugin,
}

impl From<AllocationFlag> for AllocationMode {
    fn from(flag: AllocationFlag) -> Self {
        match flag {
            AllocationFlag::Auto => Self::Auto,
            AllocationFlag::Dra => Self::Dra,
            AllocationFlag::DevicePlugin => Self::DevicePlugin,
        }
    }
}

pub(crate) fn driver_name(text: &str) -> Result<String, String> {
    crate::agent::dra::check_driver_name(text).map(|()| text.to_string())
}

pub(crate) fn model_cache_dir(text: &str) -> Result<ModelCacheDir, String> {
    text.parse()
}

pub(crate) fn resource_name(text: &str) -> Result<ResourceName, String> {
    text.parse::<ResourceName>().map_err(|e| e.why)
}

/// This machine's host name: the lease identity outside a pod.
pub(crate) fn host_name() -> Option<String> {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
}

/// A temperature flag: a finite number of degrees from 0 to 150.
pub(crate) fn celsius(text: &str) -> Result<f64, String> {
    match text.parse::<f64>() {
        Ok(v) if v.is_finite() && (0.0..=150.0).contains(&v) => Ok(v),
        _ => Err(format!("{text:?} is not a temperature from 0 to 150 °C")),
    }
}

/// A share flag: a finite number from 0 to 10 (0.2: a fifth).
pub(crate) fn fraction(text: &str) -> Result<f64, String> {
    match text.parse::<f64>() {
        Ok(v) if v.is_finite() && (0.0..=10.0).contains(&v) => Ok(v),
        _ => Err(format!(
            "{text:?} is not a fraction from 0 to 10 (0.2: a fifth)"
        )),
    }
}
