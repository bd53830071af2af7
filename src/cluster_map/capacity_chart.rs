//! A replica's capacity curve as a small SVG chart: output tokens/s against
//! the time per output token, one point per concurrency of the curve, the
//! latency target as a dashed line and the load that meets it marked, and
//! what the replica's runtime was measured doing (its median time per token
//! and its output tokens/s) as a point of its own. Drawn on the server, so
//! the offline map needs no script.

use maud::{Markup, html};

use tessera_core::api::MeasuredServing;
use tessera_core::serving::Capacity;

const WIDTH: f64 = 480.0;
const HEIGHT: f64 = 220.0;
/// Room for the axis labels (left, bottom) and breathing space (top, right).
const LEFT: f64 = 56.0;
const BOTTOM: f64 = 36.0;
const TOP: f64 = 12.0;
const RIGHT: f64 = 16.0;

/// The chart of `capacity`, with the target `target_tpot_ms` and the
/// replica's `measured` figures where it has them.
pub(super) fn capacity_chart(
    replica: u32,
    capacity: &Capacity,
    target_tpot_ms: f64,
    measured: Option<&MeasuredServing>,
) -> Markup {
    // Where the measured point goes: its median time per token and tokens/s.
    let seen = measured.and_then(|m| {
        let ms = m.tpot_ms?.p50;
        (ms.is_finite() && m.output_tokens_per_second.is_finite()).then_some((
            ms,
            m.output_tokens_per_second,
            m,
        ))
    });
    let points: Vec<(f64, f64, u32)> = capacity
        .curve
        .iter()
        .filter(|p| p.tpot_ms.is_finite() && p.output_tokens_per_second.is_finite())
        .map(|p| (p.tpot_ms, p.output_tokens_per_second, p.concurrency))
        .collect();
    let most_ms = points
        .iter()
        .map(|p| p.0)
        .chain(seen.map(|s| s.0))
        .fold(target_tpot_ms, f64::max)
        .max(1.0)
        * 1.1;
    let most_tokens = points
        .iter()
        .map(|p| p.1)
        .chain(seen.map(|s| s.1))
        .fold(1.0, f64::max)
        * 1.1;
    let x = |ms: f64| LEFT + ms / most_ms * (WIDTH - LEFT - RIGHT);
    let y = |tokens: f64| HEIGHT - BOTTOM - tokens / most_tokens * (HEIGHT - BOTTOM - TOP);
    let line: Vec<String> = points
        .iter()
        .map(|(ms, tokens, _)| format!("{:.1},{:.1}", x(*ms), y(*tokens)))
        .collect();
    let at = capacity.at_slo.as_ref();
    html! {
        figure.capacity {
            svg width=(WIDTH) height=(HEIGHT) viewBox=(format!("0 0 {WIDTH} {HEIGHT}")) role="img"
                aria-label=(format!("replica {replica}: output tokens/s against ms per output token")) {
                line.axis x1=(LEFT) y1=(HEIGHT - BOTTOM) x2=(WIDTH - RIGHT) y2=(HEIGHT - BOTTOM) {}
                line.axis x1=(LEFT) y1=(TOP) x2=(LEFT) y2=(HEIGHT - BOTTOM) {}
                text x=(LEFT) y=(HEIGHT - 8.0) { "0" }
                text x=(WIDTH - RIGHT) y=(HEIGHT - 8.0) text-anchor="end" { (format!("{most_ms:.0} ms per output token")) }
                text x=(LEFT - 6.0) y=(TOP + 10.0) text-anchor="end" { (format!("{most_tokens:.0}")) }
                text x=(LEFT - 6.0) y=(HEIGHT - BOTTOM) text-anchor="end" { "0" }
                text x="4" y=(TOP + 24.0) { "tokens/s" }
                line.target x1=(x(target_tpot_ms)) y1=(TOP) x2=(x(target_tpot_ms)) y2=(HEIGHT - BOTTOM) {}
                text.target x=(x(target_tpot_ms) + 4.0) y=(TOP + 10.0) { (format!("target {target_tpot_ms} ms")) }
                polyline.curve points=(line.join(" ")) {}
                @for (ms, tokens, concurrency) in &points {
                    circle.point.at-target[at.is_some_and(|at| at.concurrency == *concurrency)]
                        cx=(format!("{:.1}", x(*ms))) cy=(format!("{:.1}", y(*tokens))) r="3" {
                        title { (format!("{concurrency} at once: {ms:.1} ms per token, {tokens:.0} tokens/s")) }
                    }
                }
                @if let Some(at) = at {
                    circle.point.at-target cx=(format!("{:.1}", x(at.tpot_ms))) cy=(format!("{:.1}", y(at.output_tokens_per_second))) r="5" {
                        title { (format!("at the target: {} at once, {:.1} ms per token, {:.0} tokens/s", at.concurrency, at.tpot_ms, at.output_tokens_per_second)) }
                    }
                }
                @if let Some((ms, tokens, m)) = seen {
                    rect.point.measured x=(format!("{:.1}", x(ms) - 4.0)) y=(format!("{:.1}", y(tokens) - 4.0)) width="8" height="8" {
                        title { (format!("measured over {} s: {} running, {ms} ms per token (median), {tokens} tokens/s", m.window_seconds, m.running)) }
                    }
                }
            }
            figcaption {
                @match (at, &capacity.target_missed) {
                    (Some(at), _) => {
                        (format!("Replica {replica}: {:.2} requests/s and {:.0} tokens/s at the target, {} requests at once ({:.1} ms per token, {:.0} ms to the first)",
                            at.requests_per_second, at.output_tokens_per_second, at.concurrency, at.tpot_ms, at.ttft_ms))
                    }
                    (None, Some(miss)) => { (format!("Replica {replica}: misses the target, {miss}")) }
                    (None, None) => { (format!("Replica {replica}")) }
                }
                @if let Some((ms, tokens, m)) = seen {
                    (format!("; measured: {} requests/s and {tokens} tokens/s, {} running, {ms} ms per token (median)", m.requests_per_second, m.running))
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tessera_core::serving::{AtTarget, CurvePoint, Limit};

    fn capacity() -> Capacity {
        let point = |concurrency: u32, tpot_ms: f64, tokens: f64| CurvePoint {
            concurrency,
            tpot_ms,
            ttft_ms: 100.0,
            output_tokens_per_second: tokens,
        };
        Capacity {
            max_concurrency: 100,
            limited_by: Limit::KvCache,
            curve: vec![
                point(1, 10.0, 100.0),
                point(64, 40.0, 1600.0),
                point(100, 70.0, 1430.0),
            ],
            at_slo: Some(AtTarget {
                concurrency: 64,
                output_tokens_per_second: 1600.0,
                requests_per_second: 6.25,
                tpot_ms: 40.0,
                ttft_ms: 150.0,
            }),
            target_missed: None,
            correction: None,
        }
    }

    #[test]
    fn every_point_the_target_and_the_load_that_meets_it_are_drawn() {
        let html = capacity_chart(0, &capacity(), 50.0, None).into_string();
        assert_eq!(
            html.matches("<circle").count(),
            4,
            "three points and the one at the target: {html}"
        );
        assert_eq!(
            html.matches("class=\"point at-target\"").count(),
            2,
            "{html}"
        );
        assert!(html.contains("target 50 ms"), "{html}");
        assert!(html.contains("6.25 requests/s"), "{html}");
        // 1.1 × the slowest point's 70 ms spans the axis.
        assert!(html.contains("77 ms per output token"), "{html}");
    }

    #[test]
    fn the_measured_point_is_drawn_and_widens_the_axes() {
        let measured = MeasuredServing {
            window_seconds: 60.0,
            requests_per_second: 2.5,
            output_tokens_per_second: 1800.0,
            running: 8.0,
            tpot_ms: Some(tessera_core::api::Percentiles {
                p50: 90.0,
                p90: 120.0,
            }),
            ..MeasuredServing::default()
        };
        let html = capacity_chart(0, &capacity(), 50.0, Some(&measured)).into_string();
        assert_eq!(
            html.matches("class=\"point measured\"").count(),
            1,
            "{html}"
        );
        assert!(
            html.contains("99 ms per output token"),
            "1.1 × the measured 90 ms: {html}"
        );
        assert!(
            html.contains(
                "measured: 2.5 requests/s and 1800 tokens/s, 8 running, 90 ms per token (median)"
            ),
            "{html}"
        );
        // Without a time per token there is no point to draw.
        let no_tokens = MeasuredServing {
            tpot_ms: None,
            ..measured
        };
        let html = capacity_chart(0, &capacity(), 50.0, Some(&no_tokens)).into_string();
        assert!(!html.contains("measured"), "{html}");
    }

    #[test]
    fn a_missed_target_says_so_and_bad_figures_are_left_out() {
        let mut missed = capacity();
        missed.at_slo = None;
        missed.curve[1].tpot_ms = f64::NAN;
        missed.target_missed = Some(tessera_core::serving::TargetMiss {
            best_tpot_ms: 10.0,
            best_ttft_ms: 100.0,
            target: Default::default(),
        });
        let html = capacity_chart(1, &missed, 5.0, None).into_string();
        assert_eq!(html.matches("<circle").count(), 2, "{html}");
        assert!(
            html.contains("misses the target, at best 10 ms per token"),
            "{html}"
        );
        assert!(!html.contains("NaN"), "{html}");
    }
}
