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
    /// Not the GPU kind a comparison of kinds restricted the plan to.
    OtherKind,
    NodeSelector,
    /// Free bytes vs. bytes one layer (plus overhead) needs on one device.
    TooLittleMemory {
        free: f64,
        need: f64,
    },
    /// Under `optimize: throughput` a shard that shares GPUs takes the
    /// smallest piece that holds it: GPU memory this one takes vs. the
    /// smallest that would do.
    LargerThanNeeded {
        taken: f64,
        smallest: f64,
    },
    /// Under `optimize: throughput` with `pack`, a whole GPU is left whole
    /// while a split one holds the shard.
    KeptWhole,
    /// Predicted tokens/s of the shard on this device with every tenant of
    /// its GPU decoding at once, below the instance's minimum.
    TooSlowShared {
        speed: f64,
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
        Exclusion::OtherKind => format!(
            "not {}, the GPU kind compared",
            problem.selector.kind.as_deref().unwrap_or_default()
        ),
        Exclusion::NodeSelector => "node does not match the node selector".into(),
        Exclusion::TooLittleMemory { free, need } => {
            format!("{} free, one layer needs {}", gib(*free), gib(*need))
        }
        Exclusion::LargerThanNeeded { taken, smallest } => format!(
            "takes {} of GPU memory where {} hold the shard (optimize: throughput takes the smallest piece)",
            gib(*taken),
            gib(*smallest)
        ),
        Exclusion::KeptWhole => {
            "kept whole: a GPU split already holds the shard (pack, optimize: throughput)".into()
        }
        Exclusion::TooSlowShared { speed } => format!(
            "{speed:.1} tokens/s with every tenant of the GPU decoding at once, below the {} asked for",
            problem.goal.min_tokens_per_second.unwrap_or_default()
        ),
    }
}

fn gib(bytes: f64) -> String {
    format!("{:.1} GiB", bytes / GIB)
}
