//! A correction of the serving model learned from what replicas were
//! measured doing: per GPU product and shape, the measured time per output
//! token ÷ the one predicted at the load measured, smoothed over reads and
//! bounded (`limits::CORRECTION`).

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

use crate::api::limits::CORRECTION;
use crate::api::{MeasuredServing, Runtime, ServingCorrection};

/// A new read's weight in the smoothed factor, a geometric moving average:
/// after five reads of a new figure, 83% of the way there; one odd window
/// moves it by a third of its (logarithmic) distance at most.
pub const WEIGHT: f64 = 0.3;
/// Requests decoding, on average over the window, for the window to say
/// anything of the step time under load.
pub const MIN_RUNNING: f64 = 0.5;
/// Output tokens generated in the window for its median time per token to
/// be read.
pub const MIN_TOKENS: f64 = 100.0;

/// One replica's read: which kind of replica, and what it was found off by.
#[derive(Clone, Debug, PartialEq)]
pub struct Observation {
    pub product: String,
    pub tensor: u32,
    pub stages: u32,
    /// Measured ÷ predicted time per output token, within the bounds.
    pub ratio: f64,
    /// When the window's last read was taken.
    pub at: Time,
}

/// Measured ÷ predicted time per output token, where the window says
/// enough ([`MIN_RUNNING`], [`MIN_TOKENS`], a measured median);
/// `predicted_tpot_ms` gives the prediction at a concurrency (the mean
/// requests decoding, rounded, at least 1). Bounded.
pub fn ratio(
    measured: &MeasuredServing,
    predicted_tpot_ms: impl FnOnce(u32) -> Option<f64>,
) -> Option<f64> {
    let tpot = measured.tpot_ms?.p50;
    let tokens = measured.output_tokens_per_second * measured.window_seconds;
    if measured.running < MIN_RUNNING || tokens < MIN_TOKENS {
        return None;
    }
    let predicted = predicted_tpot_ms(measured.running.round().max(1.0) as u32)?;
    let ratio = tpot / predicted;
    (ratio.is_finite() && ratio > 0.0).then(|| ratio.clamp(CORRECTION.min, CORRECTION.max))
}

/// `previous` (an instance's `status.corrections`) with `observations`
/// learned: each read newer than its key's last one moves that key's factor
/// by [`WEIGHT`]; a key read for the first time starts at its read.
/// Corrections of another model or runtime are dropped as stale. Factors
/// keep four significant figures (enough for a constant read to be reached
/// within 0.2%, few enough not to churn the status); the list is sorted by
/// key.
pub fn learn(
    model: &str,
    runtime: Runtime,
    previous: &[ServingCorrection],
    observations: &[Observation],
) -> Vec<ServingCorrection> {
    let mut out: Vec<ServingCorrection> = previous
        .iter()
        .filter(|c| c.model == model && c.runtime == runtime)
        .cloned()
        .collect();
    for seen in observations {
        // The status keeps whole seconds: a read is compared, and kept, as
        // the API server will give it back.
        let at = Time(
            k8s_openapi::jiff::Timestamp::from_second(seen.at.0.as_second()).unwrap_or(seen.at.0),
        );
        let key = |c: &ServingCorrection| {
            c.product == seen.product && c.tensor == seen.tensor && c.stages == seen.stages
        };
        match out.iter_mut().find(|c| key(c)) {
            Some(held) if held.last_observed.0 >= at.0 => {}
            Some(held) => {
                let smoothed = (held.factor.ln() * (1.0 - WEIGHT) + seen.ratio.ln() * WEIGHT).exp();
                held.factor = significant(smoothed.clamp(CORRECTION.min, CORRECTION.max));
                held.observations = held.observations.saturating_add(1);
                held.last_observed = at;
            }
            None => out.push(ServingCorrection {
                model: model.to_string(),
                runtime,
                product: seen.product.clone(),
                tensor: seen.tensor,
                stages: seen.stages,
                factor: significant(seen.ratio.clamp(CORRECTION.min, CORRECTION.max)),
                observations: 1,
                last_observed: at,
            }),
        }
    }
    out.sort_by(|a, b| (&a.product, a.tensor, a.stages).cmp(&(&b.product, b.tensor, b.stages)));
    out
}

fn significant(x: f64) -> f64 {
    super::significant(x, 4)
}

#[cfg(test)]
mod tests {
    use k8s_openapi::jiff::Timestamp;
    use proptest::prelude::*;

    use super::*;
    use crate::api::Percentiles;

    fn at(seconds: i64) -> Time {
        Time(Timestamp::from_second(1_800_000_000 + seconds).unwrap())
    }

    fn seen(ratio: f64, seconds: i64) -> Observation {
        Observation {
            product: "NVIDIA-H100-80GB-HBM3".into(),
            tensor: 1,
            stages: 1,
            ratio,
            at: at(seconds),
        }
    }

    fn measured(running: f64, tokens_per_second: f64, tpot_ms: f64) -> MeasuredServing {
        MeasuredServing {
            window_seconds: 30.0,
            requests_per_second: 1.0,
            output_tokens_per_second: tokens_per_second,
            running,
            tpot_ms: Some(Percentiles {
                p50: tpot_ms,
                p90: tpot_ms * 2.0,
            }),
            ..MeasuredServing::default()
        }
    }

    #[test]
    fn the_ratio_is_read_at_the_load_measured_and_only_with_enough_of_it() {
        let mut asked = None;
        let r = ratio(&measured(7.2, 1000.0, 5.0), |c| {
            asked = Some(c);
            Some(0.1)
        });
        assert_eq!((asked, r), (Some(7), Some(50.0)));
        assert_eq!(
            ratio(&measured(0.2, 1000.0, 5.0), |_| Some(0.1)),
            None,
            "idle"
        );
        assert_eq!(
            ratio(&measured(4.0, 1.0, 5.0), |_| Some(0.1)),
            None,
            "30 tokens"
        );
        assert_eq!(
            ratio(&measured(4.0, 1000.0, 5.0), |_| None),
            None,
            "no prediction"
        );
        assert_eq!(
            ratio(&measured(4.0, 1000.0, 5.0), |_| Some(0.0)),
            None,
            "a zero prediction"
        );
        let none = MeasuredServing {
            tpot_ms: None,
            ..measured(4.0, 1000.0, 5.0)
        };
        assert_eq!(ratio(&none, |_| Some(1.0)), None);
        assert_eq!(
            ratio(&measured(4.0, 1000.0, 1e9), |_| Some(1.0)),
            Some(CORRECTION.max)
        );
    }

    #[test]
    fn a_key_starts_at_its_read_then_moves_a_third_of_the_way_and_old_reads_are_ignored() {
        let first = learn("m", Runtime::Vllm, &[], &[seen(8.0, 0)]);
        assert_eq!(first.len(), 1);
        assert_eq!((first[0].factor, first[0].observations), (8.0, 1));
        let second = learn("m", Runtime::Vllm, &first, &[seen(1.0, 15)]);
        // 8^0.7 × 1^0.3
        assert_eq!(second[0].factor, 4.287);
        assert_eq!(second[0].observations, 2);
        let again = learn(
            "m",
            Runtime::Vllm,
            &second,
            &[seen(1.0, 15), seen(100.0, 10)],
        );
        assert_eq!(
            again, second,
            "reads no newer than the last are not learned twice"
        );
        // A read taken within a second is the same read once the status,
        // which keeps whole seconds, comes back.
        let mut within = seen(1.0, 15);
        within.at = Time(within.at.0 + k8s_openapi::jiff::SignedDuration::from_millis(400));
        let learned = learn("m", Runtime::Vllm, &first, std::slice::from_ref(&within));
        let stored: Vec<ServingCorrection> =
            serde_json::from_value(serde_json::to_value(&learned).unwrap()).unwrap();
        assert_eq!(learn("m", Runtime::Vllm, &stored, &[within]), stored);
        // Another model's or runtime's corrections are stale.
        assert!(learn("other", Runtime::Vllm, &second, &[]).is_empty());
        assert!(learn("m", Runtime::Sglang, &second, &[]).is_empty());
    }

    proptest! {
        /// However the reads go, the factor stays within the bounds and
        /// between the smallest and largest read.
        #[test]
        fn factors_stay_within_the_reads_and_the_bounds(ratios in proptest::collection::vec(0.001f64..5000.0, 1..20)) {
            let mut held = Vec::new();
            for (i, r) in ratios.iter().enumerate() {
                held = learn("m", Runtime::Vllm, &held, &[seen(*r, i as i64)]);
            }
            let f = held[0].factor;
            let lo = ratios.iter().copied().fold(f64::INFINITY, f64::min).clamp(CORRECTION.min, CORRECTION.max);
            let hi = ratios.iter().copied().fold(0.0, f64::max).clamp(CORRECTION.min, CORRECTION.max);
            prop_assert!(f >= lo * 0.995 && f <= hi * 1.005, "{f} outside {lo}..{hi}");
        }

        /// Under a constant load the factor settles on the read.
        #[test]
        fn a_constant_read_is_where_it_settles(r in 0.05f64..500.0) {
            let mut held = learn("m", Runtime::Vllm, &[], &[seen(1.0, 0)]);
            for i in 1..60 {
                held = learn("m", Runtime::Vllm, &held, &[seen(r, i)]);
            }
            prop_assert!((held[0].factor / r - 1.0).abs() < 0.01, "{} for {r}", held[0].factor);
        }
    }
}
