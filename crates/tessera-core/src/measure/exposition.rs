//! One scrape of a runtime's Prometheus endpoint: the figures tessera reads
//! from it, each summed over the label sets the runtime exports (one per
//! model name, engine or finish reason).

use openmetrics_parser::prometheus::parse_prometheus;
use openmetrics_parser::{MetricFamily, MetricsExposition, PrometheusType, PrometheusValue};

use super::histogram::Histogram;
use super::names::{RuntimeNames, names};
use crate::api::Runtime;

/// What one scrape read.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Scrape {
    pub(crate) finished: f64,
    pub(crate) generated: f64,
    pub(crate) running: f64,
    pub(crate) waiting: f64,
    pub(crate) kv_usage: Option<f64>,
    pub(crate) preemptions: Option<f64>,
    pub(crate) ttft: Option<Histogram>,
    pub(crate) tpot: Option<Histogram>,
}

/// Why a scrape gave nothing to measure.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum ScrapeError {
    /// The body is not the Prometheus text format.
    #[error("the metrics are not in the Prometheus text format: {0}")]
    Malformed(String),
    /// None of the runtime's counters is there: another runtime, or its
    /// metrics are off.
    #[error("no {runtime} serving metrics in the exposition (none of {expected})")]
    NotTheRuntime { runtime: String, expected: String },
    /// A figure tessera reads is NaN or infinite.
    #[error("{metric} is {value}, not a number tessera can use")]
    NotANumber { metric: String, value: f64 },
    /// A figure is there under a type tessera cannot read it as.
    #[error("{metric} is a {found}, not a {wanted}")]
    WrongType {
        metric: String,
        found: String,
        wanted: &'static str,
    },
}

type Exposition = MetricsExposition<PrometheusType, PrometheusValue>;

impl Scrape {
    /// Reads the figures of `runtime` (any known runtime's for
    /// [`Runtime::Generic`]) from an exposition in the Prometheus text format.
    pub fn parse(text: &str, runtime: Runtime) -> Result<Scrape, ScrapeError> {
        // The grammar wants every line ended, the last one too.
        let owned;
        let text = if text.ends_with('\n') {
            text
        } else {
            owned = format!("{text}\n");
            &owned
        };
        let exposition =
            parse_prometheus(text).map_err(|e| ScrapeError::Malformed(format!("{e:?}")))?;
        let candidates = names(runtime);
        let Some(runtime_names) = candidates
            .iter()
            .find(|n| first_present(&exposition, n.finished).is_some())
        else {
            let expected = candidates
                .iter()
                .flat_map(|n| n.finished.iter().copied())
                .collect::<Vec<_>>()
                .join(", ");
            return Err(ScrapeError::NotTheRuntime {
                runtime: runtime.as_str().to_string(),
                expected,
            });
        };
        read(&exposition, runtime_names)
    }
}

fn read(exposition: &Exposition, names: &RuntimeNames) -> Result<Scrape, ScrapeError> {
    Ok(Scrape {
        finished: number(exposition, names.finished, Sum::Served)?.unwrap_or(0.0),
        generated: number(exposition, names.generated, Sum::Total)?.unwrap_or(0.0),
        running: number(exposition, names.running, Sum::Total)?.unwrap_or(0.0),
        waiting: number(exposition, names.waiting, Sum::Total)?.unwrap_or(0.0),
        kv_usage: number(exposition, names.kv_usage, Sum::Highest)?,
        preemptions: number(exposition, names.preemptions, Sum::Total)?,
        ttft: histogram(exposition, names.ttft)?,
        tpot: histogram(exposition, names.tpot)?,
    })
}

type Family = MetricFamily<PrometheusType, PrometheusValue>;

/// The first of `names` the exposition has, with its family.
fn first_present<'a>(
    exposition: &'a Exposition,
    names: &[&'a str],
) -> Option<(&'a str, &'a Family)> {
    names
        .iter()
        .find_map(|&n| exposition.families.get(n).map(|f| (n, f)))
}

/// How the label sets of a figure combine: counts add up (requests only
/// those served: an aborted or failed request is not), a share of one cache
/// per engine is read as the fullest engine's.
#[derive(Clone, Copy)]
enum Sum {
    Total,
    Served,
    Highest,
}

/// The label that says how a request finished, and its values that mean it
/// was not served (vLLM's and TensorRT-LLM's `request_success` counters).
const FINISHED_REASON: &str = "finished_reason";
const NOT_SERVED: [&str; 2] = ["abort", "error"];

fn number(exposition: &Exposition, names: &[&str], sum: Sum) -> Result<Option<f64>, ScrapeError> {
    let Some((name, family)) = first_present(exposition, names) else {
        return Ok(None);
    };
    let mut out: Option<f64> = None;
    for sample in family.iter_samples() {
        if matches!(sum, Sum::Served) {
            let reason = sample
                .get_labelset()
                .ok()
                .and_then(|l| l.get_label_value(FINISHED_REASON).map(str::to_string));
            if reason.is_some_and(|r| NOT_SERVED.contains(&r.as_str())) {
                continue;
            }
        }
        let value = match &sample.value {
            PrometheusValue::Counter(c) => c.value.as_f64(),
            PrometheusValue::Gauge(n) | PrometheusValue::Unknown(n) => n.as_f64(),
            PrometheusValue::Histogram(_) | PrometheusValue::Summary(_) => {
                return Err(ScrapeError::WrongType {
                    metric: name.to_string(),
                    found: family.family_type.to_string(),
                    wanted: "counter or gauge",
                });
            }
        };
        if !value.is_finite() {
            return Err(ScrapeError::NotANumber {
                metric: name.to_string(),
                value,
            });
        }
        out = Some(match (out, sum) {
            (None, _) => value,
            (Some(o), Sum::Total | Sum::Served) => o + value,
            (Some(o), Sum::Highest) => o.max(value),
        });
    }
    Ok(out)
}

fn histogram(exposition: &Exposition, names: &[&str]) -> Result<Option<Histogram>, ScrapeError> {
    let Some((name, family)) = first_present(exposition, names) else {
        return Ok(None);
    };
    let mut out: Option<Histogram> = None;
    for sample in family.iter_samples() {
        let PrometheusValue::Histogram(h) = &sample.value else {
            return Err(ScrapeError::WrongType {
                metric: name.to_string(),
                found: family.family_type.to_string(),
                wanted: "histogram",
            });
        };
        let mut buckets: Vec<(f64, f64)> = Vec::with_capacity(h.buckets.len());
        for b in &h.buckets {
            let count = b.count.as_f64();
            if !count.is_finite() || b.upper_bound.is_nan() {
                return Err(ScrapeError::NotANumber {
                    metric: format!("{name}_bucket"),
                    value: if count.is_finite() {
                        b.upper_bound
                    } else {
                        count
                    },
                });
            }
            buckets.push((b.upper_bound, count));
        }
        buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
        let this = Histogram { buckets };
        out = Some(match out {
            None => this,
            Some(o) => o.add(&this),
        });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    /// vLLM 0.20's CPU build after three requests of 64 output tokens.
    const VLLM: &str = include_str!("testdata/vllm-0.20-cpu.prom");

    #[test]
    fn reads_a_real_vllm_exposition() {
        let s = Scrape::parse(VLLM, Runtime::Vllm).unwrap();
        assert_eq!(s.finished, 3.0);
        assert_eq!(s.generated, 192.0);
        assert_eq!((s.running, s.waiting), (0.0, 0.0));
        assert_eq!(s.kv_usage, Some(0.0));
        assert_eq!(s.preemptions, Some(0.0));
        assert_eq!(s.ttft.as_ref().map(Histogram::count), Some(3.0));
        assert_eq!(s.tpot.as_ref().map(Histogram::count), Some(189.0));
        // A runtime tessera does not know reads any known runtime's names.
        assert_eq!(Scrape::parse(VLLM, Runtime::Generic).unwrap(), s);
    }

    #[test]
    fn aborted_and_failed_requests_are_not_counted_as_served() {
        let text = VLLM.replace(
            "finished_reason=\"abort\",model_name=\"/tmp/tiny\"} 0.0",
            "finished_reason=\"abort\",model_name=\"/tmp/tiny\"} 7.0",
        );
        assert_ne!(text, VLLM);
        assert_eq!(Scrape::parse(&text, Runtime::Vllm).unwrap().finished, 3.0);
    }

    #[test]
    fn another_runtimes_exposition_is_a_clear_error() {
        let err = Scrape::parse(VLLM, Runtime::Sglang).unwrap_err();
        assert_eq!(
            err.to_string(),
            "no sglang serving metrics in the exposition (none of sglang:num_requests_total)"
        );
        let err = Scrape::parse("process_cpu_seconds_total 4.5\n", Runtime::Vllm).unwrap_err();
        assert!(matches!(err, ScrapeError::NotTheRuntime { .. }), "{err}");
        assert!(Scrape::parse("", Runtime::Vllm).is_err());
    }

    #[test]
    fn sglang_and_tensorrt_llm_names_are_read() {
        let sglang = "\
# TYPE sglang:num_requests_total counter
sglang:num_requests_total{model_name=\"m\"} 10
# TYPE sglang:generation_tokens_total counter
sglang:generation_tokens_total{model_name=\"m\"} 640
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name=\"m\"} 4
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name=\"m\"} 1
# TYPE sglang:token_usage gauge
sglang:token_usage{model_name=\"m\"} 0.28
";
        let s = Scrape::parse(sglang, Runtime::Sglang).unwrap();
        assert_eq!(
            (s.finished, s.generated, s.running, s.waiting),
            (10.0, 640.0, 4.0, 1.0)
        );
        assert_eq!(
            (s.kv_usage, s.preemptions, s.tpot),
            (Some(0.28), None, None)
        );
        let trtllm = "\
# TYPE trtllm_request_success_total counter
trtllm_request_success_total{finished_reason=\"length\"} 2
trtllm_request_success_total{finished_reason=\"error\"} 5
# TYPE trtllm_time_per_output_token_seconds histogram
trtllm_time_per_output_token_seconds_bucket{le=\"0.01\"} 3
trtllm_time_per_output_token_seconds_bucket{le=\"+Inf\"} 4
trtllm_time_per_output_token_seconds_sum 0.05
trtllm_time_per_output_token_seconds_count 4
";
        let s = Scrape::parse(trtllm, Runtime::Generic).unwrap();
        assert_eq!(s.finished, 2.0);
        assert_eq!(
            s.tpot.unwrap().buckets,
            vec![(0.01, 3.0), (f64::INFINITY, 4.0)]
        );
    }

    #[test]
    fn malformed_text_and_nan_are_clear_errors_not_panics() {
        for text in [
            "vllm:request_success_total{engine=\"0\" 3\n",
            "vllm:request_success_total three\n",
            "<html>502 Bad Gateway</html>",
            "# TYPE vllm:request_success_total counter\nvllm:request_success_total NaN\n",
        ] {
            let err = Scrape::parse(text, Runtime::Vllm).unwrap_err();
            assert!(matches!(err, ScrapeError::Malformed(_)), "{text}: {err}");
        }
        let nan_gauge = VLLM.replace(
            "vllm:kv_cache_usage_perc{engine=\"0\",model_name=\"/tmp/tiny\"} 0.0",
            "vllm:kv_cache_usage_perc{engine=\"0\",model_name=\"/tmp/tiny\"} NaN",
        );
        let err = Scrape::parse(&nan_gauge, Runtime::Vllm).unwrap_err();
        assert!(
            matches!(&err, ScrapeError::NotANumber { metric, value }
                if metric == "vllm:kv_cache_usage_perc" && value.is_nan()),
            "{err}"
        );
        assert!(
            err.to_string()
                .starts_with("vllm:kv_cache_usage_perc is NaN"),
            "{err}"
        );
    }

    /// A line of an exposition as a runtime gone wrong might write it: real
    /// names, types and label sets, in any order, with any value.
    fn line() -> impl Strategy<Value = String> {
        let name = prop::sample::select(vec![
            "vllm:request_success_total",
            "vllm:num_requests_running",
            "vllm:time_to_first_token_seconds",
            "vllm:time_to_first_token_seconds_bucket",
            "vllm:time_to_first_token_seconds_count",
            "vllm:time_to_first_token_seconds_sum",
            "vllm:inter_token_latency_seconds_bucket",
            "vllm:request_success_created",
        ]);
        let kind = prop::sample::select(vec![
            "counter",
            "gauge",
            "histogram",
            "summary",
            "untyped",
            "bogus",
        ]);
        let labels = prop::sample::select(vec![
            "",
            "{le=\"0.1\"}",
            "{le=\"+Inf\"}",
            "{le=\"x\"}",
            "{quantile=\"0.5\"}",
            "{finished_reason=\"abort\"}",
            "{engine=\"0\",le=\"1\"}",
            "{engine=\"0\"",
        ]);
        let value =
            prop::sample::select(vec!["1", "2.0", "-1", "NaN", "+Inf", "1e400", "x", "0.5"]);
        prop_oneof![
            (name.clone(), kind).prop_map(|(n, k)| format!("# TYPE {n} {k}")),
            (name, labels, value).prop_map(|(n, l, v)| format!("{n}{l} {v}")),
            Just("# HELP vllm:x text".to_string()),
            Just(String::new()),
        ]
    }

    proptest::proptest! {
        /// Whatever a runtime writes, reading it is an answer, never a panic.
        #[test]
        fn any_exposition_is_read_or_refused(lines in proptest::collection::vec(line(), 0..12)) {
            let text = lines.join("\n");
            for runtime in [Runtime::Vllm, Runtime::Generic] {
                let _ = Scrape::parse(&text, runtime);
            }
        }
    }

    #[test]
    fn a_histogram_where_a_counter_belongs_is_a_clear_error() {
        let text = "\
# TYPE vllm:request_success_total counter
vllm:request_success_total 1
# TYPE vllm:num_requests_running histogram
vllm:num_requests_running_bucket{le=\"+Inf\"} 1
vllm:num_requests_running_sum 1
vllm:num_requests_running_count 1
";
        let err = Scrape::parse(text, Runtime::Vllm).unwrap_err();
        assert_eq!(
            err.to_string(),
            "vllm:num_requests_running is a histogram, not a counter or gauge"
        );
    }
}
