//! The search over load: the curve a replica traces as its concurrency
//! grows, and the highest concurrency that still meets a latency target.
//!
//! Both the time per output token and the time to the first token grow with
//! the concurrency (every term of a step does), so the concurrencies that
//! meet a target are the ones up to some limit, and a binary search between 1
//! and the largest concurrency finds it.

use std::fmt;

use serde::Serialize;

use super::kv_cache::Limit;
use super::step_time::StepModel;
use super::{LatencyTarget, ServingPoint};

/// One point of a replica's curve.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct CurvePoint {
    pub concurrency: u32,
    pub tpot_ms: f64,
    pub ttft_ms: f64,
    pub output_tokens_per_second: f64,
}

impl From<ServingPoint> for CurvePoint {
    fn from(point: ServingPoint) -> Self {
        CurvePoint {
            concurrency: point.concurrency,
            tpot_ms: point.tpot_ms,
            ttft_ms: point.ttft_ms,
            output_tokens_per_second: point.output_tokens_per_second,
        }
    }
}

/// The replica at the highest concurrency meeting the target.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct AtTarget {
    pub concurrency: u32,
    pub output_tokens_per_second: f64,
    pub requests_per_second: f64,
    pub tpot_ms: f64,
    pub ttft_ms: f64,
}

impl From<ServingPoint> for AtTarget {
    fn from(point: ServingPoint) -> Self {
        AtTarget {
            concurrency: point.concurrency,
            output_tokens_per_second: point.output_tokens_per_second,
            requests_per_second: point.requests_per_second,
            tpot_ms: point.tpot_ms,
            ttft_ms: point.ttft_ms,
        }
    }
}

/// What a replica serves, as `tessera place` and the status show it: the
/// most sequences it holds at once and why no more, its curve, and its
/// capacity at the latency target (or, when no load meets it, what it does
/// at best).
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Capacity {
    pub max_concurrency: u32,
    pub limited_by: Limit,
    pub curve: Vec<CurvePoint>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub at_slo: Option<AtTarget>,
    /// Set when not even one sequence meets the target.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub target_missed: Option<TargetMiss>,
    /// The measured correction the figures carry (`RuntimeConfig::correction`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub correction: Option<f64>,
}

/// No concurrency meets the target: even one sequence alone is too slow.
/// Carries the best the replica does, at concurrency 1.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct TargetMiss {
    pub best_tpot_ms: f64,
    pub best_ttft_ms: f64,
    pub target: LatencyTarget,
}

impl fmt::Display for TargetMiss {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "at best {:.0} ms per token and {:.0} ms to the first token",
            self.best_tpot_ms, self.best_ttft_ms
        )?;
        let mut limits = Vec::new();
        if let Some(tpot) = self.target.max_tpot_ms {
            limits.push(format!("{tpot} ms per token"));
        }
        if let Some(ttft) = self.target.max_ttft_ms {
            limits.push(format!("{ttft} ms to the first token"));
        }
        if !limits.is_empty() {
            write!(f, " (the target: {})", limits.join(", "))?;
        }
        Ok(())
    }
}

impl std::error::Error for TargetMiss {}

/// Requests a replica holds at once to serve `requests_per_second` when each
/// takes at most the target's first token and its output tokens at the
/// target's pace (Little's law; a faster replica holds fewer). At least 1.
pub fn requests_in_flight(
    requests_per_second: f64,
    workload: &super::Workload,
    target: &LatencyTarget,
) -> f64 {
    let seconds = (target.max_ttft_ms.unwrap_or(0.0)
        + workload.output_tokens.max(1.0) * target.max_tpot_ms.unwrap_or(0.0))
        / 1e3;
    let in_flight = requests_per_second * seconds;
    if in_flight.is_finite() {
        in_flight.ceil().max(1.0)
    } else {
        1.0
    }
}

/// Every power of two below `max`, and `max`.
pub(super) fn curve(steps: &StepModel, max: u32) -> Vec<CurvePoint> {
    let max = max.max(1);
    let mut points = Vec::new();
    let mut concurrency: u32 = 1;
    while concurrency < max {
        points.push(steps.point(concurrency).into());
        concurrency = match concurrency.checked_mul(2) {
            Some(next) => next,
            None => break,
        };
    }
    points.push(steps.point(max).into());
    points
}

/// Whether a point meets a target; a limit that is not a positive number
/// is met by nothing.
fn meets(point: &ServingPoint, target: &LatencyTarget) -> bool {
    let within = |value: f64, limit: Option<f64>| limit.is_none_or(|limit| value <= limit);
    within(point.tpot_ms, target.max_tpot_ms) && within(point.ttft_ms, target.max_ttft_ms)
}

/// The highest concurrency up to `max` meeting `target`.
pub(super) fn highest_meeting(
    steps: &StepModel,
    max: u32,
    target: &LatencyTarget,
) -> Result<ServingPoint, TargetMiss> {
    let one = steps.point(1);
    if !meets(&one, target) {
        return Err(TargetMiss {
            best_tpot_ms: one.tpot_ms,
            best_ttft_ms: one.ttft_ms,
            target: *target,
        });
    }
    // `low` meets the target; everything above `high` does not.
    let (mut low, mut high) = (1, max.max(1));
    let mut best = one;
    while low < high {
        let middle = low + (high - low).div_ceil(2);
        let point = steps.point(middle);
        if meets(&point, target) {
            low = middle;
            best = point;
        } else {
            high = middle - 1;
        }
    }
    Ok(best)
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::super::testutil::*;
    use super::super::{GpuFigures, Replica, Runtime, ServingInput};
    use super::*;
    use crate::api::{DType, GIB};

    fn eight_b() -> Replica {
        Replica::new(&input(h100(), 1, llama("8b", DType::Bf16), Runtime::Vllm)).expect("fits")
    }

    #[test]
    fn the_curve_holds_the_powers_of_two_and_the_largest_concurrency() {
        let replica = eight_b();
        let max = replica.concurrency().max;
        let concurrencies: Vec<u32> = replica.curve().iter().map(|p| p.concurrency).collect();
        let mut want: Vec<u32> = (0..).map(|k| 1 << k).take_while(|&c| c < max).collect();
        want.push(max);
        assert_eq!(concurrencies, want);
        let mut one = input(h100(), 1, llama("8b", DType::Bf16), Runtime::Vllm);
        one.runtime.max_num_seqs = Some(1);
        let single = Replica::new(&one).expect("fits").curve();
        assert_eq!(single.len(), 1);
        assert_eq!(single[0].concurrency, 1);
    }

    #[test]
    fn the_target_is_met_at_the_highest_concurrency_that_meets_it() {
        let replica = eight_b();
        let one = replica.at(1);
        let target = LatencyTarget {
            max_tpot_ms: Some(1.5 * one.tpot_ms),
            max_ttft_ms: None,
        };
        let best = replica.at_target(&target).expect("one sequence meets it");
        assert!(best.tpot_ms <= 1.5 * one.tpot_ms);
        assert!(best.concurrency > 1);
        assert!(best.output_tokens_per_second >= one.output_tokens_per_second);
        if best.concurrency < replica.concurrency().max {
            assert!(replica.at(best.concurrency + 1).tpot_ms > 1.5 * one.tpot_ms);
        }
        let open = replica
            .at_target(&LatencyTarget::default())
            .expect("no limit");
        assert_eq!(open.concurrency, replica.concurrency().max);
    }

    #[test]
    fn a_target_nothing_meets_reports_the_best_there_is() {
        let replica = eight_b();
        let one = replica.at(1);
        let miss = replica
            .at_target(&LatencyTarget {
                max_tpot_ms: Some(1.0),
                max_ttft_ms: Some(5000.0),
            })
            .expect_err("1 ms per token is out of reach");
        assert_eq!(miss.best_tpot_ms, one.tpot_ms);
        let text = miss.to_string();
        assert!(
            text.starts_with(&format!("at best {:.0} ms per token", one.tpot_ms)),
            "{text}"
        );
        assert!(text.contains("the target: 1 ms per token"), "{text}");
        for nonsense in [f64::NAN, 0.0, -3.0] {
            let target = LatencyTarget {
                max_tpot_ms: Some(nonsense),
                max_ttft_ms: None,
            };
            assert!(replica.at_target(&target).is_err(), "{nonsense}");
        }
    }

    #[test]
    fn a_time_to_first_token_limit_caps_the_concurrency_too() {
        let replica = eight_b();
        let loose = replica
            .at_target(&LatencyTarget::default())
            .expect("no limit");
        let one = replica.at(1);
        let tight = replica
            .at_target(&LatencyTarget {
                max_tpot_ms: None,
                max_ttft_ms: Some(one.ttft_ms + one.decode_step_ms),
            })
            .expect("one sequence meets it");
        assert!(tight.concurrency < loose.concurrency);
    }

    /// A dense model of `billions` parameters on `tensor` of `gpu`, with
    /// `(input, output)` tokens a request.
    fn drawn(
        gpu: GpuFigures,
        billions: f64,
        tensor: u32,
        (input_tokens, output_tokens): (f64, f64),
        runtime: Runtime,
    ) -> ServingInput {
        let layers = (billions.sqrt() * 10.0).round().max(1.0) as u32;
        let mut model = llama("8b", DType::Bf16);
        model.spec.parameters_billions = billions;
        model.spec.layers = layers;
        model.spec.hidden_size = None;
        model.spec.attention_heads = None;
        model.spec.kv_heads = None;
        let mut drawn = input(gpu, tensor, model, runtime);
        drawn.workload.input_tokens = input_tokens;
        drawn.workload.output_tokens = output_tokens;
        drawn
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]

        /// TPOT never falls as the concurrency grows, and the replica's
        /// tokens/s never falls up to its cap, wherever one sequence's KV
        /// read costs less than a single-stream step (what the model
        /// assumes; see step_time).
        #[test]
        fn tpot_rises_and_throughput_does_not_fall_with_concurrency(
            billions in 1.0f64..80.0,
            tflops in 50.0f64..2000.0,
            bandwidth in 500.0f64..8000.0,
            memory_gib in 16.0f64..192.0,
            tensor in prop::sample::select(vec![1u32, 2, 4, 8]),
            input_tokens in 1.0f64..8192.0,
            output_tokens in 1.0f64..4096.0,
            runtime in prop::sample::select(vec![
                Runtime::Vllm, Runtime::Sglang, Runtime::TensorrtLlm, Runtime::Generic,
            ]),
        ) {
            let gpu = GpuFigures {
                vendor: "nvidia".into(),
                fp16_tflops: tflops,
                fp8_tflops: None,
                fp4_tflops: None,
                memory_bandwidth_gbps: bandwidth,
                memory_bytes: memory_gib * GIB,
            };
            let drawn = drawn(gpu, billions, tensor, (input_tokens, output_tokens), runtime);
            let Ok(replica) = Replica::new(&drawn) else {
                // Too large for the drawn GPUs: refused, which is fine.
                return Ok(());
            };
            let max = replica.concurrency().max;
            let one = replica.at(1);
            let mut last = one;
            let step = (max / 64).max(1);
            let mut concurrency = 1;
            while concurrency < max {
                concurrency = (concurrency + step).min(max);
                let point = replica.at(concurrency);
                prop_assert!(point.tpot_ms >= last.tpot_ms, "{concurrency}: {point:?} {last:?}");
                prop_assert!(point.decode_step_ms >= last.decode_step_ms);
                prop_assert!(
                    point.output_tokens_per_second >= last.output_tokens_per_second * (1.0 - 1e-12),
                    "{concurrency}: {point:?} after {last:?}"
                );
                last = point;
            }
            let best = replica.at_target(&LatencyTarget {
                max_tpot_ms: Some(2.0 * one.tpot_ms),
                max_ttft_ms: None,
            });
            prop_assert!(best.is_ok());
            if let Ok(best) = best {
                prop_assert!(best.output_tokens_per_second >= one.output_tokens_per_second);
            }
        }
    }
}
