//! A replica's scrapes over a sliding window, and what they say together:
//! rates from the counters' increase (a counter that went down means the
//! runtime restarted, and its new value is all increase, as in PromQL's
//! `increase`), gauges averaged, latency percentiles from the histograms'
//! increase.

use std::collections::VecDeque;

use super::exposition::Scrape;
use super::histogram::Histogram;
use crate::api::{MeasuredServing, Percentiles};

/// The scrapes of one replica's runtime within the last `span` seconds.
#[derive(Clone, Debug)]
pub struct Window {
    span: f64,
    scrapes: VecDeque<(f64, Scrape)>,
}

impl Window {
    /// An empty window `span_seconds` long.
    pub fn new(span_seconds: f64) -> Window {
        Window {
            span: span_seconds,
            scrapes: VecDeque::new(),
        }
    }

    /// Adds a scrape taken at `at` (seconds on any clock that only goes
    /// forward); scrapes that fall out of the window go. A scrape not after
    /// the last one replaces it.
    pub fn push(&mut self, at: f64, scrape: Scrape) {
        while self.scrapes.back().is_some_and(|&(t, _)| t >= at) {
            self.scrapes.pop_back();
        }
        self.scrapes.push_back((at, scrape));
        while self
            .scrapes
            .front()
            .is_some_and(|&(t, _)| t < at - self.span)
        {
            self.scrapes.pop_front();
        }
    }

    /// Forgets every scrape: the replica's pod was replaced, so its counters
    /// start over at values that need not be lower.
    pub fn clear(&mut self) {
        self.scrapes.clear();
    }

    /// What the window's scrapes say, once it holds two.
    pub fn measurement(&self) -> Option<Measurement> {
        let (&(first, _), &(last, ref newest)) = (self.scrapes.front()?, self.scrapes.back()?);
        let seconds = last - first;
        if seconds <= 0.0 {
            return None;
        }
        let (mut finished, mut generated, mut preemptions) = (0.0, 0.0, None::<f64>);
        let (mut ttft, mut tpot) = (None::<Histogram>, None::<Histogram>);
        for ((_, a), (_, b)) in self.scrapes.iter().zip(self.scrapes.iter().skip(1)) {
            finished += increase(a.finished, b.finished);
            generated += increase(a.generated, b.generated);
            if let Some(now) = b.preemptions {
                let before = a.preemptions.unwrap_or(0.0);
                preemptions = Some(preemptions.unwrap_or(0.0) + increase(before, now));
            }
            ttft = added(ttft, a.ttft.as_ref(), b.ttft.as_ref());
            tpot = added(tpot, a.tpot.as_ref(), b.tpot.as_ref());
        }
        let n = self.scrapes.len() as f64;
        let mean = |f: fn(&Scrape) -> f64| self.scrapes.iter().map(|(_, s)| f(s)).sum::<f64>() / n;
        let kv: Vec<f64> = self
            .scrapes
            .iter()
            .filter_map(|(_, s)| s.kv_usage)
            .collect();
        Some(Measurement {
            seconds,
            requests_per_second: finished / seconds,
            output_tokens_per_second: generated / seconds,
            running: mean(|s| s.running),
            waiting: mean(|s| s.waiting),
            kv_usage: (!kv.is_empty()).then(|| kv.iter().sum::<f64>() / kv.len() as f64),
            kv_caches: usize::from(newest.kv_usage.is_some()),
            in_flight: newest.running + newest.waiting,
            preemptions_per_second: preemptions.map(|p| p / seconds),
            ttft,
            tpot,
        })
    }
}

fn increase(before: f64, now: f64) -> f64 {
    if now < before { now } else { now - before }
}

fn added(
    sum: Option<Histogram>,
    before: Option<&Histogram>,
    now: Option<&Histogram>,
) -> Option<Histogram> {
    let Some(now) = now else {
        return sum;
    };
    let step = match before {
        Some(before) => now.since(before),
        None => now.clone(),
    };
    Some(match sum {
        Some(sum) => sum.add(&step),
        None => step,
    })
}

/// What one replica (or several, [`Measurement::combine`]d) served over a
/// window.
#[derive(Clone, Debug, PartialEq)]
pub struct Measurement {
    seconds: f64,
    requests_per_second: f64,
    output_tokens_per_second: f64,
    running: f64,
    waiting: f64,
    kv_usage: Option<f64>,
    /// How many KV caches `kv_usage` averages (replicas that report one).
    kv_caches: usize,
    /// Requests running and waiting at the newest scrape.
    in_flight: f64,
    preemptions_per_second: Option<f64>,
    ttft: Option<Histogram>,
    tpot: Option<Histogram>,
}

impl Measurement {
    /// Several replicas together: rates and requests add up, the KV-cache
    /// share is the mean, latencies come from the histograms added.
    pub fn combine<'a>(all: impl IntoIterator<Item = &'a Measurement>) -> Option<Measurement> {
        all.into_iter().cloned().reduce(|a, b| {
            let kv_caches = a.kv_caches + b.kv_caches;
            let kv_usage = match (a.kv_usage, b.kv_usage) {
                (Some(x), Some(y)) => Some(
                    (x * a.kv_caches as f64 + y * b.kv_caches as f64) / kv_caches.max(1) as f64,
                ),
                (x, y) => x.or(y),
            };
            let add = |x: Option<Histogram>, y: Option<Histogram>| match (x, y) {
                (Some(x), Some(y)) => Some(x.add(&y)),
                (x, y) => x.or(y),
            };
            Measurement {
                seconds: a.seconds.max(b.seconds),
                requests_per_second: a.requests_per_second + b.requests_per_second,
                output_tokens_per_second: a.output_tokens_per_second + b.output_tokens_per_second,
                running: a.running + b.running,
                waiting: a.waiting + b.waiting,
                kv_usage,
                kv_caches,
                in_flight: a.in_flight + b.in_flight,
                preemptions_per_second: match (a.preemptions_per_second, b.preemptions_per_second) {
                    (Some(x), Some(y)) => Some(x + y),
                    (x, y) => x.or(y),
                },
                ttft: add(a.ttft, b.ttft),
                tpot: add(a.tpot, b.tpot),
            }
        })
    }

    /// Requests finished per second.
    pub fn requests_per_second(&self) -> f64 {
        self.requests_per_second
    }

    /// Requests running and waiting at the window's newest scrape: none once
    /// a replica out of its Services has finished what it had.
    pub fn in_flight_now(&self) -> f64 {
        self.in_flight
    }

    /// The requests/s asked of the replicas: those finished, scaled up by
    /// the requests queued behind the ones decoding. A replica that is full
    /// finishes only what it can; by Little's law the requests in it grow
    /// with what arrives, so `running + waiting` over `running` says how
    /// much more than it finishes is asked of it.
    pub fn demand(&self) -> f64 {
        if self.running > 0.0 && self.waiting > 0.0 {
            self.requests_per_second * (self.running + self.waiting) / self.running
        } else {
            self.requests_per_second
        }
    }

    /// The figures as the status shows them: latencies in ms, everything
    /// to three significant figures (more would only churn the status).
    pub fn serving(&self) -> MeasuredServing {
        let percentiles = |h: &Option<Histogram>| {
            let h = h.as_ref()?;
            Some(Percentiles {
                p50: significant(h.quantile(0.5)? * 1000.0),
                p90: significant(h.quantile(0.9)? * 1000.0),
            })
        };
        MeasuredServing {
            window_seconds: significant(self.seconds),
            requests_per_second: significant(self.requests_per_second),
            output_tokens_per_second: significant(self.output_tokens_per_second),
            running: significant(self.running),
            waiting: significant(self.waiting),
            kv_cache_usage: self.kv_usage.map(significant),
            preemptions_per_second: self.preemptions_per_second.map(significant),
            tpot_ms: percentiles(&self.tpot),
            ttft_ms: percentiles(&self.ttft),
        }
    }
}

/// `x` to three significant figures.
fn significant(x: f64) -> f64 {
    super::significant(x, 3)
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn scrape(finished: f64, generated: f64, running: f64, tpot: &[(f64, f64)]) -> Scrape {
        Scrape {
            finished,
            generated,
            running,
            waiting: 1.0,
            kv_usage: Some(running / 10.0),
            preemptions: Some(0.0),
            ttft: None,
            tpot: Some(Histogram {
                buckets: tpot.to_vec(),
            }),
        }
    }

    const INF: f64 = f64::INFINITY;

    #[test]
    fn rates_come_from_the_counters_increase_and_gauges_are_averaged() {
        let mut w = Window::new(60.0);
        assert_eq!(w.measurement(), None);
        w.push(
            0.0,
            scrape(10.0, 1000.0, 2.0, &[(0.01, 100.0), (INF, 100.0)]),
        );
        assert_eq!(w.measurement(), None, "one scrape says nothing about rates");
        w.push(
            15.0,
            scrape(40.0, 4000.0, 4.0, &[(0.01, 150.0), (INF, 300.0)]),
        );
        let m = w.measurement().unwrap().serving();
        assert_eq!(m.window_seconds, 15.0);
        assert_eq!(m.requests_per_second, 2.0);
        assert_eq!(m.output_tokens_per_second, 200.0);
        assert_eq!((m.running, m.waiting), (3.0, 1.0));
        assert_eq!(m.kv_cache_usage, Some(0.3));
        assert_eq!(m.preemptions_per_second, Some(0.0));
        assert_eq!(m.ttft_ms, None, "the runtime reported no first tokens");
        // Of the window's 200 new observations, 50 are at most 10 ms: the
        // median lies in the +Inf bucket, read as 10 ms.
        let tpot = m.tpot_ms.unwrap();
        assert!((tpot.p50 - 10.0).abs() < 1e-9, "{tpot:?}");
    }

    #[test]
    fn the_demand_is_what_finished_scaled_by_the_queue() {
        let mut w = Window::new(60.0);
        w.push(0.0, scrape(0.0, 0.0, 2.0, &[]));
        w.push(10.0, scrape(30.0, 0.0, 2.0, &[]));
        // 3 finished a second with 2 decoding and 1 waiting: 4.5 asked.
        assert!((w.measurement().unwrap().demand() - 4.5).abs() < 1e-9);
        let mut idle = Window::new(60.0);
        idle.push(
            0.0,
            Scrape {
                waiting: 0.0,
                ..scrape(0.0, 0.0, 0.0, &[])
            },
        );
        idle.push(
            10.0,
            Scrape {
                waiting: 0.0,
                ..scrape(5.0, 0.0, 0.0, &[])
            },
        );
        assert_eq!(idle.measurement().unwrap().demand(), 0.5);
        assert_eq!(idle.measurement().unwrap().in_flight_now(), 0.0);
        assert_eq!(
            w.measurement().unwrap().in_flight_now(),
            3.0,
            "the newest scrape's"
        );
    }

    #[test]
    fn a_counter_that_went_down_is_a_restart_and_its_value_all_increase() {
        let mut w = Window::new(60.0);
        w.push(0.0, scrape(100.0, 0.0, 0.0, &[(INF, 50.0)]));
        w.push(10.0, scrape(120.0, 0.0, 0.0, &[(INF, 60.0)]));
        // Restarted: 5 since, the 20 before counted once.
        w.push(20.0, scrape(5.0, 0.0, 0.0, &[(INF, 3.0)]));
        let m = w.measurement().unwrap().serving();
        assert_eq!(m.requests_per_second, 25.0 / 20.0);
    }

    #[test]
    fn scrapes_older_than_the_window_go_and_a_repeated_time_replaces() {
        let mut w = Window::new(30.0);
        for (t, n) in [(0.0, 0.0), (15.0, 100.0), (30.0, 200.0), (45.0, 300.0)] {
            w.push(t, scrape(n, 0.0, 0.0, &[(INF, 0.0)]));
        }
        let m = w.measurement().unwrap().serving();
        assert_eq!((m.window_seconds, m.requests_per_second), (30.0, 6.67));
        w.push(45.0, scrape(330.0, 0.0, 0.0, &[(INF, 0.0)]));
        assert_eq!(w.measurement().unwrap().requests_per_second(), 230.0 / 30.0);
        w.clear();
        assert_eq!(w.measurement(), None);
    }

    #[test]
    fn replicas_combine_into_the_instance() {
        let mut a = Window::new(60.0);
        a.push(0.0, scrape(0.0, 0.0, 2.0, &[(0.01, 0.0), (INF, 0.0)]));
        a.push(10.0, scrape(10.0, 100.0, 2.0, &[(0.01, 10.0), (INF, 10.0)]));
        let mut b = Window::new(60.0);
        b.push(0.0, scrape(0.0, 0.0, 6.0, &[(0.01, 0.0), (INF, 0.0)]));
        b.push(20.0, scrape(20.0, 400.0, 6.0, &[(0.01, 0.0), (INF, 10.0)]));
        let (a, b) = (a.measurement().unwrap(), b.measurement().unwrap());
        let both = Measurement::combine([&a, &b]).unwrap().serving();
        assert_eq!(both.requests_per_second, 2.0);
        assert_eq!(both.output_tokens_per_second, 30.0);
        assert_eq!(both.running, 8.0);
        assert_eq!(both.kv_cache_usage, Some(0.4));
        assert_eq!(both.tpot_ms.unwrap().p50, 10.0);
        assert_eq!(Measurement::combine([]), None);
    }

    proptest! {
        /// Whatever the counters do (restarts included), rates are finite
        /// and never negative.
        #[test]
        fn rates_never_go_negative(values in proptest::collection::vec((0u32..1000, 0u32..50), 2..20)) {
            let mut w = Window::new(1e9);
            for (i, &(finished, ttft)) in values.iter().enumerate() {
                let mut s = scrape(f64::from(finished), f64::from(finished) * 3.0, 1.0, &[(INF, f64::from(ttft))]);
                s.ttft = s.tpot.clone();
                w.push(i as f64, s);
            }
            let m = w.measurement().unwrap().serving();
            prop_assert!(m.requests_per_second >= 0.0 && m.requests_per_second.is_finite());
            prop_assert!(m.output_tokens_per_second >= 0.0);
        }
    }
}
