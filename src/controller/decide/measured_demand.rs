//! `serving.demand: Measured` for one reconcile: the instance's replicas
//! read together (the measuring loop's latest windows), the scaling rule
//! taken one step (`tessera_core::measure::demand`), and what the
//! `DemandFollowed` condition says of it. Pure.

use std::collections::BTreeMap;

use k8s_openapi::jiff::Timestamp;
use tessera_core::api::{DemandSource, MeasuredDemand, ModelInstance};
use tessera_core::measure::Measurement;
use tessera_core::measure::demand::{DemandRead, ScalingRule, next};

use super::super::measure::ReplicaMeasure;
use super::super::settings::ScalingSettings;

/// Where a measured demand stands after this reconcile.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Followed {
    /// What `status.demand` becomes.
    pub(crate) state: Option<MeasuredDemand>,
    /// The demand the replicas are planned for, while it is followed
    /// (`None` before the first read where no demand is stated).
    pub(crate) planned: Option<f64>,
    /// `spec.replicas` was changed since the measured demand began to be
    /// followed: it is the count.
    pub(crate) by_hand: bool,
    /// The `DemandFollowed` condition: status, reason, message.
    pub(crate) condition: (&'static str, &'static str, String),
}

/// The step for an instance with `serving.demand: Measured`; `None` for
/// any other. `measuring` is false where the controller reads no runtime
/// (`--measure-interval=0`).
pub(crate) fn follow(
    mi: &ModelInstance,
    measured: Option<&BTreeMap<u32, ReplicaMeasure>>,
    measuring: bool,
    now: Timestamp,
    settings: &ScalingSettings,
) -> Option<Followed> {
    let serving = mi.spec.serving.as_ref()?;
    if serving.demand != DemandSource::Measured {
        return None;
    }
    let previous = mi.status.as_ref().and_then(|s| s.demand.as_ref());
    let replicas = mi.spec.replicas;
    if let Some(was) = previous.and_then(|p| p.spec_replicas)
        && was != replicas
    {
        return Some(Followed {
            state: previous.cloned(),
            planned: None,
            by_hand: true,
            condition: (
                "False",
                "ReplicasSetByHand",
                format!(
                    "spec.replicas was changed to {replicas} (it was {was} when the measured demand began to be followed): it is the count; set it back to {was}, or serving.demand to Stated and back, to follow the measured demand again"
                ),
            ),
        });
    }
    if !measuring {
        return Some(Followed {
            state: previous.cloned(),
            planned: serving.requests_per_second,
            by_hand: false,
            condition: (
                "False",
                "NotMeasuring",
                "the controller reads no runtime (--measure-interval=0): planned for serving.requestsPerSecond, else minReplicas".to_string(),
            ),
        });
    }
    let read = demand_read(measured);
    let rule = ScalingRule {
        headroom: settings.headroom,
        scale_down_after: settings.scale_down_window.as_secs_f64(),
    };
    let mut state = next(previous, serving.requests_per_second, read, now, rule);
    state.spec_replicas = Some(replicas);
    let planned = state.planned_requests_per_second;
    let headroom = (settings.headroom * 100.0).round();
    let condition = match state.measured_requests_per_second {
        None => (
            "Unknown",
            "NotMeasured",
            format!(
                "no replica measured yet: planned for {planned} requests/s (serving.requestsPerSecond, else minReplicas)"
            ),
        ),
        Some(measured) => {
            let lowering = match (&state.lower_since, state.lower_peak) {
                (Some(since), Some(peak)) => format!(
                    "; every read since {} asked for less: down to {peak} once that lasts {} s",
                    since.0,
                    settings.scale_down_window.as_secs()
                ),
                _ => String::new(),
            };
            let partial = if read.is_some_and(|r| !r.complete) {
                " (a replica could not be read: nothing is removed until every one is)"
            } else {
                ""
            };
            (
                "True",
                "Following",
                format!(
                    "measured {measured} requests/s (finished, with those queued){partial}; planned for {planned} with {headroom}% headroom{lowering}"
                ),
            )
        }
    };
    Some(Followed {
        state: Some(state),
        planned: Some(planned),
        by_hand: false,
        condition,
    })
}

/// The replicas read together: `None` before any replica was measured;
/// incomplete while one that serves could not be read.
fn demand_read(measured: Option<&BTreeMap<u32, ReplicaMeasure>>) -> Option<DemandRead> {
    let measured = measured?;
    let windows: Vec<&Measurement> = measured
        .values()
        .filter_map(|read| match read {
            ReplicaMeasure::Measured { measurement, .. } => Some(measurement),
            _ => None,
        })
        .collect();
    let together = Measurement::combine(windows)?;
    Some(DemandRead {
        requests_per_second: together.demand(),
        complete: !measured.values().any(|read| {
            matches!(
                read,
                ReplicaMeasure::Failed(_) | ReplicaMeasure::NoEndpoint(_)
            )
        }),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::controller::measure::measured_after;
    use crate::controller::testkit::instance;

    const MEASURED: &str = "model: {name: m, parametersBillions: 1, layers: 4}\nserving: {demand: Measured, maxReplicas: 4, requestsPerSecond: 2}";

    fn at(seconds: i64) -> Timestamp {
        Timestamp::from_second(1_800_000_000 + seconds).unwrap()
    }

    #[test]
    fn a_stated_demand_is_not_followed() {
        let mi = instance("m", "model: {name: m, parametersBillions: 1, layers: 4}");
        assert_eq!(
            follow(&mi, None, true, at(0), &ScalingSettings::default()),
            None
        );
    }

    #[test]
    fn before_any_read_the_stated_demand_is_planned_for() {
        let mi = instance("m", MEASURED);
        let followed = follow(&mi, None, true, at(0), &ScalingSettings::default()).unwrap();
        assert_eq!(followed.planned, Some(2.0));
        assert_eq!(followed.condition.0, "Unknown");
        assert_eq!(followed.condition.1, "NotMeasured");
    }

    #[test]
    fn reads_raise_the_plan_and_a_failed_replica_makes_them_incomplete() {
        let mut mi = instance("m", MEASURED);
        let settings = ScalingSettings::default();
        let mut reads = BTreeMap::new();
        reads.insert(0, measured_after(3000));
        let followed = follow(&mi, Some(&reads), true, at(0), &settings).unwrap();
        let planned = followed.planned.unwrap();
        assert!(planned > 2.0, "{followed:?}");
        assert_eq!(followed.condition.1, "Following");
        // The plan is kept in the status; a failed read of another replica
        // is said, and holds a scale-down.
        mi.status = Some(tessera_core::api::ModelInstanceStatus {
            demand: followed.state.clone(),
            ..Default::default()
        });
        reads.insert(1, ReplicaMeasure::Failed("timed out".into()));
        let partial = follow(&mi, Some(&reads), true, at(15), &settings).unwrap();
        assert!(
            partial.condition.2.contains("could not be read"),
            "{partial:?}"
        );
        assert_eq!(partial.planned, Some(planned));
    }

    #[test]
    fn replicas_changed_by_hand_or_no_measuring_turn_it_off_and_say_so() {
        let mut mi = instance("m", &format!("{MEASURED}\nreplicas: 3"));
        let settings = ScalingSettings::default();
        let on = follow(&mi, None, true, at(0), &settings).unwrap();
        assert!(!on.by_hand, "replicas as created are not a hand's");
        assert_eq!(on.state.as_ref().and_then(|s| s.spec_replicas), Some(3));
        mi.status = Some(tessera_core::api::ModelInstanceStatus {
            demand: on.state.clone(),
            ..Default::default()
        });
        mi.spec.replicas = 5;
        let off = follow(&mi, None, true, at(15), &settings).unwrap();
        assert!(off.by_hand);
        assert_eq!(
            (off.condition.0, off.condition.1),
            ("False", "ReplicasSetByHand")
        );
        assert!(
            off.condition.2.contains("set it back to 3"),
            "{}",
            off.condition.2
        );
        assert_eq!(off.state, on.state, "kept for when it is set back");
        mi.spec.replicas = 3;
        assert!(!follow(&mi, None, true, at(30), &settings).unwrap().by_hand);
        let off = follow(&mi, None, false, at(0), &settings).unwrap();
        assert_eq!(off.condition.1, "NotMeasuring");
    }
}
