//! A runtime's latency histogram as Prometheus exposes it: cumulative counts
//! per upper bound, and what a window of it says.

/// Cumulative bucket counts: `(upper bound, observations ≤ it)`, bounds
/// ascending, the last `+Inf` (every observation).
#[derive(Clone, Debug, Default, PartialEq)]
pub(crate) struct Histogram {
    pub(crate) buckets: Vec<(f64, f64)>,
}

impl Histogram {
    /// Observations in all.
    pub(crate) fn count(&self) -> f64 {
        self.buckets.last().map_or(0.0, |&(_, n)| n)
    }

    /// This histogram plus `other` (another label set or replica of the
    /// same runtime). Bounds only one of them has count, for the other, the
    /// observations at its next lower bound: never more than it saw.
    pub(crate) fn add(&self, other: &Histogram) -> Histogram {
        let mut bounds: Vec<f64> = self
            .buckets
            .iter()
            .chain(&other.buckets)
            .map(|&(b, _)| b)
            .collect();
        bounds.sort_by(f64::total_cmp);
        bounds.dedup();
        let buckets = bounds
            .into_iter()
            .map(|b| (b, self.at(b) + other.at(b)))
            .collect();
        Histogram { buckets }
    }

    /// Observations at or below `bound`, from the highest bucket not above it.
    fn at(&self, bound: f64) -> f64 {
        self.buckets
            .iter()
            .take_while(|&&(b, _)| b <= bound)
            .last()
            .map_or(0.0, |&(_, n)| n)
    }

    /// The observations made since `earlier`. A bucket that went down means
    /// the runtime restarted in between: everything it holds is new.
    pub(crate) fn since(&self, earlier: &Histogram) -> Histogram {
        let reset =
            self.count() < earlier.count() || self.buckets.iter().any(|&(b, n)| n < earlier.at(b));
        if reset {
            return self.clone();
        }
        let buckets = self
            .buckets
            .iter()
            .map(|&(b, n)| (b, n - earlier.at(b)))
            .collect();
        Histogram { buckets }
    }

    /// The `q` quantile (0 to 1), interpolated linearly within its bucket as
    /// Prometheus's `histogram_quantile` does: the lowest bucket from 0, and
    /// one that falls in the `+Inf` bucket reads as the highest finite bound.
    /// None without observations.
    pub(crate) fn quantile(&self, q: f64) -> Option<f64> {
        let total = self.count();
        if total <= 0.0 || !q.is_finite() {
            return None;
        }
        let rank = q.clamp(0.0, 1.0) * total;
        let mut below = (0.0, 0.0);
        for &(bound, count) in &self.buckets {
            if count >= rank && count > below.1 {
                if bound.is_infinite() {
                    return Some(below.0);
                }
                let lower = if below.0 == 0.0 && bound < 0.0 {
                    bound
                } else {
                    below.0
                };
                return Some(lower + (bound - lower) * (rank - below.1) / (count - below.1));
            }
            below = (bound, count);
        }
        Some(below.0)
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn histogram(buckets: &[(f64, f64)]) -> Histogram {
        Histogram {
            buckets: buckets.to_vec(),
        }
    }

    #[test]
    fn a_quantile_interpolates_within_its_bucket() {
        // 10 observations: 4 up to 10 ms, 6 more up to 20 ms.
        let h = histogram(&[(0.01, 4.0), (0.02, 10.0), (f64::INFINITY, 10.0)]);
        assert_eq!(h.quantile(0.2), Some(0.005));
        let p50 = h.quantile(0.5).unwrap();
        assert!((p50 - (0.01 + 0.01 * 1.0 / 6.0)).abs() < 1e-12, "{p50}");
        assert!((h.quantile(0.9).unwrap() - (0.01 + 0.01 * 5.0 / 6.0)).abs() < 1e-12);
        assert_eq!(h.quantile(1.0), Some(0.02));
    }

    #[test]
    fn a_quantile_in_the_inf_bucket_reads_as_the_highest_finite_bound() {
        let h = histogram(&[(0.5, 1.0), (1.0, 2.0), (f64::INFINITY, 10.0)]);
        assert_eq!(h.quantile(0.9), Some(1.0));
    }

    #[test]
    fn no_observations_no_quantile() {
        assert_eq!(histogram(&[]).quantile(0.5), None);
        assert_eq!(
            histogram(&[(0.1, 0.0), (f64::INFINITY, 0.0)]).quantile(0.5),
            None
        );
        assert_eq!(
            histogram(&[(0.1, 3.0), (f64::INFINITY, 3.0)]).quantile(f64::NAN),
            None
        );
    }

    #[test]
    fn since_subtracts_bucket_by_bucket_and_a_reset_keeps_the_new_counts() {
        let before = histogram(&[(0.1, 2.0), (f64::INFINITY, 5.0)]);
        let after = histogram(&[(0.1, 6.0), (f64::INFINITY, 12.0)]);
        assert_eq!(
            after.since(&before),
            histogram(&[(0.1, 4.0), (f64::INFINITY, 7.0)])
        );
        let restarted = histogram(&[(0.1, 1.0), (f64::INFINITY, 1.0)]);
        assert_eq!(restarted.since(&after), restarted);
    }

    #[test]
    fn adding_histograms_with_other_bounds_never_counts_more_than_was_seen() {
        let a = histogram(&[(0.1, 2.0), (f64::INFINITY, 4.0)]);
        let b = histogram(&[(0.2, 1.0), (f64::INFINITY, 3.0)]);
        assert_eq!(
            a.add(&b),
            histogram(&[(0.1, 2.0), (0.2, 3.0), (f64::INFINITY, 7.0)])
        );
    }

    proptest! {
        #[test]
        fn quantiles_rise_with_q_and_stay_within_the_finite_bounds(
            steps in proptest::collection::vec(0u32..50, 1..12),
            extra in 0u32..20,
        ) {
            let mut total = 0.0;
            let mut buckets: Vec<(f64, f64)> = steps
                .iter()
                .enumerate()
                .map(|(i, &n)| {
                    total += f64::from(n);
                    (0.001 * 2f64.powi(i as i32), total)
                })
                .collect();
            let highest = buckets.last().map(|&(b, _)| b).unwrap_or(0.0);
            buckets.push((f64::INFINITY, total + f64::from(extra)));
            let h = histogram(&buckets);
            let mut last = 0.0;
            for q in [0.1, 0.5, 0.9, 0.99] {
                match h.quantile(q) {
                    Some(v) => {
                        prop_assert!(v >= last && v <= highest, "q {q}: {v} after {last}");
                        last = v;
                    }
                    None => prop_assert_eq!(h.count(), 0.0),
                }
            }
        }
    }
}
