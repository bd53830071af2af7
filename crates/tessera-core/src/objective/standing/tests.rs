//! The objective's levels: each decides only where those above tie, a
//! request's weight is its work, and what a change keeps.

use std::cmp::Ordering;

use proptest::prelude::*;

use super::*;

fn spec(yaml: &str) -> ModelInstanceSpec {
    serde_saphyr::from_str(yaml).expect("a valid spec")
}

fn small() -> ModelInstanceSpec {
    spec("model: {name: s, parametersBillions: 1.2, layers: 16}")
}

fn large(demand: Option<f64>) -> ModelInstanceSpec {
    let serving = demand.map_or(String::new(), |rps| {
        format!("\nserving: {{requestsPerSecond: {rps}}}")
    });
    spec(&format!(
        "model: {{name: l, parametersBillions: 34, layers: 48}}{serving}"
    ))
}

#[test]
fn a_large_instance_placed_outweighs_any_small_headroom() {
    // The cluster: the 1.2B on an H100 serving 16.3 requests/s and
    // the 34B not placed, against the 1.2B on an A100 (9.6) and the 34B
    // placed on four H100s serving 0.35.
    let before = [
        InstanceStanding::new(&small(), 1, vec![16.3], 1.0),
        InstanceStanding::new(&large(None), 1, vec![], 0.0),
    ];
    let after = [
        InstanceStanding::new(&small(), 1, vec![9.6], 1.0),
        InstanceStanding::new(&large(None), 1, vec![0.35], 4.0),
    ];
    let (before, after) = (ClusterStanding::of(&before), ClusterStanding::of(&after));
    assert_eq!(before.unplaced, 1);
    assert_eq!(after.compare(&before), Ordering::Greater);
    // Raw requests/s would say otherwise: 16.3 against 9.95.
    assert!(
        before.work_served < after.work_served,
        "{before:?} {after:?}"
    );
}

#[test]
fn demands_come_before_gpus_and_gpus_before_headroom() {
    let demanding = large(Some(1.0));
    let unmet = ClusterStanding::of(&[InstanceStanding::new(&demanding, 2, vec![0.4, 0.4], 2.0)]);
    let met = ClusterStanding::of(&[InstanceStanding::new(
        &demanding,
        3,
        vec![0.4, 0.4, 0.4],
        3.0,
    )]);
    assert_eq!(unmet.demands_unmet, 1);
    assert_eq!(
        met.compare(&unmet),
        Ordering::Greater,
        "more GPUs, demand met"
    );
    let lean = ClusterStanding::of(&[InstanceStanding::new(&demanding, 2, vec![0.6, 0.6], 2.0)]);
    assert_eq!(
        lean.compare(&met),
        Ordering::Greater,
        "fewer GPUs, less headroom"
    );
    let roomy = ClusterStanding::of(&[InstanceStanding::new(&demanding, 2, vec![0.9, 0.9], 2.0)]);
    assert_eq!(
        roomy.compare(&lean),
        Ordering::Greater,
        "same GPUs, more work"
    );
    assert_eq!(roomy.compare(&roomy), Ordering::Equal);
}

#[test]
fn a_replica_missing_its_target_counts_as_much_as_one_unplaced() {
    let missing = ClusterStanding::of(&[InstanceStanding::new(&small(), 1, vec![0.0], 1.0)]);
    let unplaced = ClusterStanding::of(&[InstanceStanding::new(&small(), 1, vec![], 0.0)]);
    assert_eq!(missing.missing_target, 1);
    assert_eq!(
        missing.demands_unmet, 1,
        "no demand: met by meeting the target"
    );
    // Tied at the first two levels, the one holding no GPU is better.
    assert_eq!(unplaced.compare(&missing), Ordering::Greater);
}

#[test]
fn a_change_keeps_the_target_and_the_demand_or_says_what_it_loses() {
    let demanding = large(Some(1.0));
    let before = InstanceStanding::new(&demanding, 2, vec![0.8, 0.9], 2.0);
    // Slower but together still 2 × 0.5 = 1.0.
    let slower = InstanceStanding::new(&demanding, 2, vec![0.8, 0.5], 2.0);
    assert_eq!(slower.keeps(&before), Ok(()));
    let below = InstanceStanding::new(&demanding, 2, vec![0.8, 0.4], 2.0);
    let lost = below.keeps(&before).unwrap_err();
    assert_eq!(
        lost,
        Lost::Demand {
            demand: 1.0,
            before: 1.6,
            after: 0.8
        }
    );
    assert!(
        lost.to_string().contains("below its demand of 1.00"),
        "{lost}"
    );
    let missing = InstanceStanding::new(&demanding, 2, vec![0.8, 0.0], 2.0);
    assert_eq!(missing.keeps(&before), Err(Lost::Target));
    // Without a demand, serving less while meeting the target is kept.
    let free = InstanceStanding::new(&small(), 1, vec![16.3], 1.0);
    assert_eq!(
        InstanceStanding::new(&small(), 1, vec![9.6], 1.0).keeps(&free),
        Ok(())
    );
    // A demand not met before may not be served less.
    let short = InstanceStanding::new(&demanding, 1, vec![0.6], 1.0);
    assert!(
        InstanceStanding::new(&demanding, 1, vec![0.5], 1.0)
            .keeps(&short)
            .is_err()
    );
    assert_eq!(
        InstanceStanding::new(&demanding, 1, vec![0.7], 1.0).keeps(&short),
        Ok(())
    );
}

#[test]
fn the_standing_in_words() {
    let words = ClusterStanding::of(&[InstanceStanding::new(&small(), 1, vec![10.0], 1.0)]).words();
    assert_eq!(
        words,
        "1 of 1 instance(s) served as asked (demand met, or the target where none is stated), 0 replica(s) unplaced, 0 missing their target, 1.00 GPUs, 30.7 TFLOP/s of model work served at the targets"
    );
}

fn standing() -> impl Strategy<Value = ClusterStanding> {
    (0usize..3, 0usize..3, 0usize..3, 0u32..8, 0u32..50).prop_map(
        |(unplaced, missing_target, demands_unmet, gpus, work)| ClusterStanding {
            instances: 3,
            unplaced,
            missing_target,
            demands_unmet,
            gpus: f64::from(gpus),
            work_served: f64::from(work) * 1e12,
        },
    )
}

fn instance() -> impl Strategy<Value = InstanceStanding> {
    (
        1usize..4,
        proptest::collection::vec(prop_oneof![Just(0.0), 0.1f64..20.0], 0..4),
        proptest::option::of(0.5f64..30.0),
    )
        .prop_map(|(wanted, per_replica, demand)| {
            let mut instance = InstanceStanding::new(&small(), wanted, per_replica, 1.0);
            instance.demand = demand;
            instance
        })
}

proptest! {
    #[test]
    fn the_order_is_a_total_preorder(a in standing(), b in standing(), c in standing()) {
        prop_assert_eq!(a.compare(&b), b.compare(&a).reverse());
        if a.compare(&b) != Ordering::Less && b.compare(&c) != Ordering::Less {
            prop_assert_ne!(a.compare(&c), Ordering::Less);
        }
    }

    #[test]
    fn fewer_replicas_short_of_their_target_always_wins(a in standing(), b in standing()) {
        let (short_a, short_b) = (a.unplaced + a.missing_target, b.unplaced + b.missing_target);
        if short_a < short_b {
            prop_assert_eq!(a.compare(&b), Ordering::Greater);
        }
    }

    #[test]
    fn a_change_that_serves_no_less_is_always_kept(
        before in instance(),
        raise in proptest::collection::vec(0.0f64..5.0, 4),
    ) {
        let mut after = before.clone();
        for (rps, up) in after.per_replica.iter_mut().zip(raise) {
            if *rps > 0.0 {
                *rps += up;
            }
        }
        prop_assert_eq!(after.keeps(&before), Ok(()));
    }

    #[test]
    fn a_kept_change_never_leaves_a_met_demand_unmet(before in instance(), after in instance()) {
        let mut after = after;
        after.demand = before.demand;
        if after.keeps(&before).is_ok() {
            prop_assert!(after.missing_target() <= before.missing_target());
            if before.demand.is_some() && before.demand_met() {
                prop_assert!(after.demand_met());
            }
        }
    }
}
