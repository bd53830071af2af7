//! The measured side of the status: each replica's runtime figures beside
//! its prediction, the instance's together, and the `Measured` condition.

use std::collections::BTreeMap;

use tessera_core::api::MeasuredServing;
use tessera_core::measure::Measurement;

use super::ConditionText;
use crate::controller::measure::ReplicaMeasure;

/// Present while any replica's metrics are read: `True` when every one read
/// is measured, `False` (`NotMeasured`) naming each that cannot be read and
/// why, `Unknown` (`Measuring`) while one waits for its second read.
pub(crate) const MEASURED: &str = "Measured";

/// What the status shows of the measurements.
#[derive(Debug, Default)]
pub(crate) struct MeasuredStatus {
    pub(crate) replicas: BTreeMap<u32, MeasuredServing>,
    pub(crate) instance: Option<MeasuredServing>,
    pub(crate) condition: Option<(&'static str, ConditionText)>,
}

pub(crate) fn measured(read: Option<&BTreeMap<u32, ReplicaMeasure>>) -> MeasuredStatus {
    let Some(read) = read.filter(|r| !r.is_empty()) else {
        return MeasuredStatus::default();
    };
    let measurements: BTreeMap<u32, &Measurement> = read
        .iter()
        .filter_map(|(&replica, m)| match m {
            ReplicaMeasure::Measured { measurement, .. } => Some((replica, measurement)),
            _ => None,
        })
        .collect();
    let instance = Measurement::combine(measurements.values().copied()).map(|m| m.serving());
    let measured_ones = replica_list(measurements.keys());
    let failed: Vec<String> = read
        .iter()
        .filter_map(|(replica, m)| match m {
            ReplicaMeasure::Failed(why) | ReplicaMeasure::NoEndpoint(why) => {
                Some(format!("replica {replica}: {why}"))
            }
            _ => None,
        })
        .collect();
    let waiting: Vec<&u32> = read
        .iter()
        .filter(|(_, m)| matches!(m, ReplicaMeasure::Measuring))
        .map(|(r, _)| r)
        .collect();
    let condition = if !failed.is_empty() {
        let mut message = failed.join("; ");
        if !measurements.is_empty() {
            message.push_str(&format!("; {measured_ones} measured"));
        }
        ("False", "NotMeasured", message)
    } else if !waiting.is_empty() {
        (
            "Unknown",
            "Measuring",
            format!(
                "{} read once; rates need a second read",
                replica_list(waiting.into_iter())
            ),
        )
    } else {
        let figures = instance.as_ref().map(summary).unwrap_or_default();
        (
            "True",
            "Measured",
            format!("{measured_ones} measured{figures}"),
        )
    };
    MeasuredStatus {
        replicas: measurements
            .into_iter()
            .map(|(replica, m)| (replica, m.serving()))
            .collect(),
        instance,
        condition: Some((MEASURED, condition)),
    }
}

/// "replica 0" or "replicas 0, 2".
fn replica_list<'a>(replicas: impl Iterator<Item = &'a u32>) -> String {
    let replicas: Vec<String> = replicas.map(u32::to_string).collect();
    match replicas.len() {
        1 => format!("replica {}", replicas[0]),
        _ => format!("replicas {}", replicas.join(", ")),
    }
}

/// " over 60 s: 3.2 requests/s, 410 output tokens/s, ..." for the condition.
fn summary(s: &MeasuredServing) -> String {
    let mut out = format!(
        " over {} s: {} requests/s, {} output tokens/s",
        s.window_seconds, s.requests_per_second, s.output_tokens_per_second
    );
    if let Some(tpot) = s.tpot_ms {
        out.push_str(&format!(", {} ms per output token (p90)", tpot.p90));
    }
    if let Some(ttft) = s.ttft_ms {
        out.push_str(&format!(", {} ms to the first token (p90)", ttft.p90));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::controller::measure::measured_after;

    #[test]
    fn nothing_read_no_condition() {
        let status = measured(None);
        assert!(status.condition.is_none() && status.instance.is_none());
        assert!(measured(Some(&BTreeMap::new())).condition.is_none());
    }

    #[test]
    fn every_replica_measured_is_true_with_the_instances_figures() {
        let read = BTreeMap::from([(0, measured_after(20)), (1, measured_after(30))]);
        let status = measured(Some(&read));
        assert_eq!(status.replicas[&0].requests_per_second, 2.0);
        assert_eq!(status.replicas[&1].output_tokens_per_second, 192.0);
        let instance = status.instance.unwrap();
        assert_eq!(instance.requests_per_second, 5.0);
        assert_eq!(instance.running, 4.0);
        assert_eq!(
            status.condition,
            Some((
                MEASURED,
                (
                    "True",
                    "Measured",
                    "replicas 0, 1 measured over 10 s: 5 requests/s, 320 output tokens/s, 23.5 ms per output token (p90)".to_string()
                )
            ))
        );
    }

    #[test]
    fn a_replica_that_cannot_be_read_is_named_and_the_rest_still_measured() {
        let read = BTreeMap::from([
            (0, measured_after(20)),
            (
                1,
                ReplicaMeasure::Failed(
                    "GET http://10.0.0.2:8000/metrics: connection refused".into(),
                ),
            ),
            (2, ReplicaMeasure::Measuring),
        ]);
        let status = measured(Some(&read));
        assert_eq!(status.instance.unwrap().requests_per_second, 2.0);
        assert_eq!(status.replicas.keys().collect::<Vec<_>>(), [&0]);
        assert_eq!(
            status.condition.unwrap().1,
            (
                "False",
                "NotMeasured",
                "replica 1: GET http://10.0.0.2:8000/metrics: connection refused; replica 0 measured"
                    .to_string()
            )
        );
        let first_read = BTreeMap::from([(0, ReplicaMeasure::Measuring)]);
        assert_eq!(
            measured(Some(&first_read)).condition.unwrap().1,
            (
                "Unknown",
                "Measuring",
                "replica 0 read once; rates need a second read".to_string()
            )
        );
    }
}
