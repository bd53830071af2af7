//! Why a device cannot take part in any plan, and that reason in words.

use super::problem::Problem;
use crate::api::GIB;

#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Exclusion {
    Allocated(String),
    /// Split into partitions, or about to be: why.
    NotWhole(String),
    Unhealthy(Option<String>),
    TooHot(f64),
    BadTelemetry,
    Vendor,
    Product,
    NodeSelector,
    /// Free bytes vs. bytes one layer (plus overhead) needs on one device.
    TooLittleMemory {
        free: f64,
        need: f64,
    },
}

pub(crate) fn exclusion_text(exclusion: &Exclusion, problem: &Problem) -> String {
    match exclusion {
        Exclusion::Allocated(holder) => format!("allocated to {holder}"),
        Exclusion::NotWhole(why) => why.clone(),
        Exclusion::Unhealthy(Some(reason)) => format!("unhealthy ({reason})"),
        Exclusion::Unhealthy(None) => "unhealthy".into(),
        // Raw values: the comparison is made on them, so a rounded figure could
        // show a device "at 85 °C" refused by an 85.4 °C limit.
        Exclusion::TooHot(temperature) => {
            format!(
                "at {temperature} °C, not below the {} °C limit",
                problem.max_temperature_c
            )
        }
        Exclusion::BadTelemetry => "reports no usable throughput or bandwidth".into(),
        Exclusion::Vendor => format!("vendor not in {:?}", problem.selector.vendors),
        Exclusion::Product => format!("product not matching {:?}", problem.selector.products),
        Exclusion::NodeSelector => "node does not match the node selector".into(),
        Exclusion::TooLittleMemory { free, need } => {
            format!("{} free, one layer needs {}", gib(*free), gib(*need))
        }
    }
}

fn gib(bytes: f64) -> String {
    format!("{:.1} GiB", bytes / GIB)
}
