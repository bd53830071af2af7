//! The scaling rule of `serving.demand: Measured`: from each read of what
//! the replicas serve, the demand they are planned for. Up at once (as soon
//! as a read asks for more than is planned, beyond the tolerance), down only
//! after every read of a whole window asked for less, and then to the most
//! any of them asked for, as the HorizontalPodAutoscaler's scale-down
//! stabilization does. A constant load moves the plan once at most; a load
//! that wavers within the tolerance never moves it.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;

use crate::api::MeasuredDemand;

/// A read's demand may differ from the planned one by this share before the
/// plan follows it: smaller changes are noise of a window's rate.
pub const TOLERANCE: f64 = 0.1;

/// How the planned demand follows the reads (`--demand-headroom`,
/// `--scale-down-window`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ScalingRule {
    /// Planned beyond the measured demand: 0.2 plans for 1.2 × it.
    pub headroom: f64,
    /// Seconds every read must ask for less before the plan comes down.
    pub scale_down_after: f64,
}

/// One read of an instance's replicas.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DemandRead {
    /// The demand measured, requests/s, without headroom.
    pub requests_per_second: f64,
    /// Whether every serving replica was read: a read that missed one may
    /// raise the plan, never lower it.
    pub complete: bool,
}

/// The planned demand after `read` (none this time: the plan holds, and a
/// scale-down starts its window again). `previous` is the status's; without
/// one the plan starts from `start` (`serving.requestsPerSecond`, else 0).
pub fn next(
    previous: Option<&MeasuredDemand>,
    start: Option<f64>,
    read: Option<DemandRead>,
    now: Timestamp,
    rule: ScalingRule,
) -> MeasuredDemand {
    let mut state = previous.cloned().unwrap_or(MeasuredDemand {
        planned_requests_per_second: start.unwrap_or(0.0),
        measured_requests_per_second: None,
        lower_since: None,
        lower_peak: None,
        last_change: None,
        spec_replicas: None,
    });
    let Some(read) = read.filter(|r| r.requests_per_second.is_finite()) else {
        state.lower_since = None;
        state.lower_peak = None;
        return state;
    };
    let measured = read.requests_per_second.max(0.0);
    // Three significant figures: more would only churn the status.
    state.measured_requests_per_second = Some(super::significant(measured, 3));
    let wanted = measured * (1.0 + rule.headroom.max(0.0));
    let planned = state.planned_requests_per_second;
    let change = |state: &mut MeasuredDemand, to: f64| {
        state.planned_requests_per_second = super::significant(to, 3);
        state.last_change = Some(Time(now));
        state.lower_since = None;
        state.lower_peak = None;
    };
    if wanted > planned * (1.0 + TOLERANCE) && wanted > 0.0 {
        change(&mut state, wanted);
    } else if wanted < planned * (1.0 - TOLERANCE) && read.complete {
        let since = state.lower_since.get_or_insert(Time(now)).0;
        let peak = super::significant(state.lower_peak.map_or(wanted, |p| p.max(wanted)), 3);
        state.lower_peak = Some(peak);
        let waited = now.duration_since(since).as_secs_f64();
        if waited >= rule.scale_down_after {
            change(&mut state, peak);
        }
    } else {
        state.lower_since = None;
        state.lower_peak = None;
    }
    state
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    const RULE: ScalingRule = ScalingRule {
        headroom: 0.2,
        scale_down_after: 300.0,
    };

    fn at(seconds: i64) -> Timestamp {
        Timestamp::from_second(1_800_000_000 + seconds).unwrap()
    }

    fn read(rps: f64) -> Option<DemandRead> {
        Some(DemandRead {
            requests_per_second: rps,
            complete: true,
        })
    }

    /// Reads every 15 s from `from`; returns the state after each.
    fn run(
        mut state: Option<MeasuredDemand>,
        reads: &[Option<DemandRead>],
        from: i64,
    ) -> Vec<MeasuredDemand> {
        reads
            .iter()
            .enumerate()
            .map(|(i, r)| {
                let next = next(state.as_ref(), None, *r, at(from + 15 * i as i64), RULE);
                state = Some(next.clone());
                next
            })
            .collect()
    }

    #[test]
    fn a_rise_is_planned_for_at_once_with_headroom() {
        let states = run(None, &[read(10.0)], 0);
        assert!((states[0].planned_requests_per_second - 12.0).abs() < 1e-9);
        assert_eq!(states[0].measured_requests_per_second, Some(10.0));
        assert_eq!(states[0].last_change, Some(Time(at(0))));
    }

    #[test]
    fn a_drop_waits_a_whole_window_and_comes_down_to_the_highest_read_in_it() {
        let mut reads = vec![read(10.0)];
        reads.extend([read(2.0), read(4.0), read(3.0)]);
        reads.extend(std::iter::repeat_n(read(2.0), 18));
        let states = run(None, &reads, 0);
        // The first lower read is at 15 s: nothing comes down before 315 s.
        for state in &states[1..states.len() - 1] {
            assert!((state.planned_requests_per_second - 12.0).abs() < 1e-9);
        }
        let last = states.last().unwrap();
        assert!(
            (last.planned_requests_per_second - 4.8).abs() < 1e-9,
            "{last:?}"
        );
        assert_eq!(last.lower_since, None);
    }

    #[test]
    fn a_read_back_up_or_an_incomplete_or_missing_one_starts_the_window_again() {
        for interruption in [
            read(10.0),
            Some(DemandRead {
                requests_per_second: 1.0,
                complete: false,
            }),
            None,
        ] {
            let mut reads = vec![read(10.0)];
            reads.extend(std::iter::repeat_n(read(1.0), 10));
            reads.push(interruption);
            reads.extend(std::iter::repeat_n(read(1.0), 10));
            let states = run(None, &reads, 0);
            assert!(
                states
                    .iter()
                    .all(|s| (s.planned_requests_per_second - 12.0).abs() < 1e-9),
                "{interruption:?}"
            );
        }
    }

    #[test]
    fn an_incomplete_read_still_raises_the_plan_and_nothing_measured_holds_it() {
        let up = next(
            None,
            Some(1.0),
            Some(DemandRead {
                requests_per_second: 5.0,
                complete: false,
            }),
            at(0),
            RULE,
        );
        assert!((up.planned_requests_per_second - 6.0).abs() < 1e-9);
        let held = next(None, Some(3.0), None, at(0), RULE);
        assert_eq!(held.planned_requests_per_second, 3.0);
        assert_eq!(held.measured_requests_per_second, None);
        let nan = next(None, Some(3.0), read(f64::NAN), at(0), RULE);
        assert_eq!(nan.planned_requests_per_second, 3.0);
    }

    proptest! {
        /// Under a constant load the plan moves once at most, and a load
        /// wavering within the tolerance around what is planned never moves it.
        #[test]
        fn no_flapping(level in 0.0f64..1000.0, start in 0.0f64..1000.0,
                       wobble in proptest::collection::vec(-0.04f64..0.04, 1..80)) {
            let first = next(None, Some(start), read(level), at(0), RULE);
            let constant = run(Some(first.clone()), &vec![read(level); 60], 15);
            let changes = std::iter::once(&first).chain(&constant)
                .filter_map(|s| s.last_change.as_ref().map(|t| t.0))
                .filter(|t| *t > at(0))
                .collect::<std::collections::BTreeSet<_>>();
            prop_assert!(changes.len() <= 1, "{changes:?}");
            let settled = constant.last().unwrap().clone();
            let base = settled.planned_requests_per_second / 1.2;
            let reads: Vec<_> = wobble.iter().map(|w| read(base * (1.0 + w))).collect();
            let after = run(Some(settled.clone()), &reads, 10_000);
            for state in after {
                prop_assert_eq!(state.planned_requests_per_second, settled.planned_requests_per_second);
            }
        }

        /// Whatever the reads, the plan is finite and never negative, and it
        /// never comes down sooner than a window after the first lower read.
        #[test]
        fn bounded_and_patient(reads in proptest::collection::vec(
            proptest::option::of((0.0f64..1e6, any::<bool>())), 1..60)) {
            let reads: Vec<_> = reads.into_iter().map(|r| r.map(|(rps, complete)| DemandRead { requests_per_second: rps, complete })).collect();
            let states = run(None, &reads, 0);
            for (i, pair) in states.windows(2).enumerate() {
                let (before, after) = (&pair[0], &pair[1]);
                let now = 15 * (i as i64 + 1);
                prop_assert!(after.planned_requests_per_second.is_finite() && after.planned_requests_per_second >= 0.0);
                if after.planned_requests_per_second < before.planned_requests_per_second {
                    let since = before.lower_since.as_ref().map(|t| t.0.as_second() - 1_800_000_000);
                    prop_assert!(since.is_some_and(|since| now - since >= 300), "down at {now}, lower since {since:?}");
                }
            }
        }
    }
}
