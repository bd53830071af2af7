//! Splitting a pipeline's layers over its stages so the slowest stage is as
//! fast as it can be: each stage gets one layer, then each further layer goes
//! to the stage that would finish it soonest and still has room (the lower
//! stage on a tie). Faster and larger stages get more.
//!
//! That rule, applied a layer at a time, costs layers × stages, and the split
//! runs for every plan the search scores. Taking the `n` smallest finish times
//! at once gives the same split in time independent of the layer count: the
//! threshold finish time is found by bisection, then every stage takes the
//! layers that finish before it, and the ties at it go to the lower stages.

/// Above this many layer-by-stage steps the threshold form is used.
const SCAN_LIMIT: u64 = 1 << 14;

pub(crate) fn split_layers(layers: u32, caps: &[u32], seconds_per_layer: &[f64]) -> Vec<u32> {
    let extra = layers.saturating_sub(caps.len() as u32);
    let well_formed = seconds_per_layer
        .iter()
        .all(|seconds| seconds.is_finite() && *seconds >= 0.0);
    if u64::from(extra) * caps.len() as u64 <= SCAN_LIMIT || !well_formed {
        by_scan(extra, caps, seconds_per_layer)
    } else {
        by_threshold(extra, caps, seconds_per_layer)
    }
}

/// When the stage's `layer`-th layer finishes, per token.
fn finish(layer: u32, seconds_per_layer: f64) -> f64 {
    f64::from(layer) * seconds_per_layer
}

fn by_scan(mut extra: u32, caps: &[u32], seconds_per_layer: &[f64]) -> Vec<u32> {
    let mut given = vec![1u32; caps.len()];
    while extra > 0 {
        let mut best: Option<(f64, usize)> = None;
        for (stage, (&stage_layers, &cap)) in given.iter().zip(caps).enumerate() {
            if stage_layers < cap {
                let finish_time = finish(stage_layers + 1, seconds_per_layer[stage]);
                if best.is_none_or(|(best_time, _)| finish_time < best_time) {
                    best = Some((finish_time, stage));
                }
            }
        }
        match best {
            Some((_, stage)) => given[stage] += 1,
            None => break,
        }
        extra -= 1;
    }
    given
}

/// Layers after its first that a stage takes when every finish time below
/// `threshold` (or up to `threshold`, with `inclusive`) is taken. Finish times grow with the
/// layer number, so this is a bisection over the stage's room.
fn taken(cap: u32, seconds_per_layer: f64, threshold: f64, inclusive: bool) -> u32 {
    let ok = |layer: u32| {
        let finish_time = finish(layer, seconds_per_layer);
        if inclusive {
            finish_time <= threshold
        } else {
            finish_time < threshold
        }
    };
    if cap < 2 || !ok(2) {
        return 0;
    }
    let (mut lo, mut hi) = (2, cap);
    while lo < hi {
        let mid = lo + (hi - lo).div_ceil(2);
        if ok(mid) { lo = mid } else { hi = mid - 1 }
    }
    lo - 1
}

fn by_threshold(extra: u32, caps: &[u32], seconds_per_layer: &[f64]) -> Vec<u32> {
    let total = |threshold: f64, inclusive: bool| -> u64 {
        caps.iter()
            .zip(seconds_per_layer)
            .map(|(&cap, &seconds)| u64::from(taken(cap, seconds, threshold, inclusive)))
            .sum()
    };
    let extra_wanted = u64::from(extra);
    if total(f64::INFINITY, true) <= extra_wanted {
        return caps.iter().map(|&cap| cap.max(1)).collect();
    }
    // Non-negative floats order as their bit patterns do.
    let (mut lo, mut hi) = (0u64, f64::INFINITY.to_bits());
    while lo < hi {
        let mid = lo + (hi - lo) / 2;
        if total(f64::from_bits(mid), true) >= extra_wanted {
            hi = mid;
        } else {
            lo = mid + 1;
        }
    }
    let threshold = f64::from_bits(lo);
    let mut given: Vec<u32> = caps
        .iter()
        .zip(seconds_per_layer)
        .map(|(&cap, &seconds)| 1 + taken(cap, seconds, threshold, false))
        .collect();
    let mut rest = extra_wanted - total(threshold, false);
    for (stage, (&cap, &seconds)) in caps.iter().zip(seconds_per_layer).enumerate() {
        if rest == 0 {
            break;
        }
        let at_threshold =
            u64::from(taken(cap, seconds, threshold, true) - taken(cap, seconds, threshold, false));
        let take = at_threshold.min(rest);
        // `take` is at most a stage's room, which is a u32.
        given[stage] += u32::try_from(take).unwrap_or(0);
        rest -= take;
    }
    given
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn layers_follow_speed_and_room() {
        // Twice the speed per layer gets about twice the layers.
        assert_eq!(split_layers(30, &[30, 30], &[1.0, 2.0]), vec![20, 10]);
        // A stage that is full passes the rest on.
        assert_eq!(split_layers(30, &[5, 30], &[1.0, 2.0]), vec![5, 25]);
        // Every stage gets at least one layer however slow.
        assert_eq!(split_layers(10, &[10, 10], &[1.0, 1000.0]), vec![9, 1]);
    }

    #[test]
    fn many_layers_split_the_same_way_in_bounded_time() {
        let caps = vec![20_000; 200];
        let seconds: Vec<f64> = (0..200).map(|i| 1.0 + f64::from(i % 7)).collect();
        let given = split_layers(20_000, &caps, &seconds);
        assert_eq!(given.iter().sum::<u32>(), 20_000);
        assert_eq!(given, by_scan(20_000 - 200, &caps, &seconds));
    }

    #[test]
    fn ties_go_to_the_lower_stage_and_zero_time_stages_fill_first() {
        assert_eq!(
            by_threshold(4, &[4, 4, 4], &[1.0, 1.0, 1.0]),
            by_scan(4, &[4, 4, 4], &[1.0, 1.0, 1.0])
        );
        assert_eq!(by_threshold(5, &[4, 9], &[0.0, 0.0]), vec![4, 3]);
        assert_eq!(by_threshold(50, &[4, 9], &[1.0, 3.0]), vec![4, 9]);
    }

    proptest! {
        #[test]
        fn the_threshold_form_is_the_layer_by_layer_rule(
            stages in prop::collection::vec((1u32..400, 0usize..6, 0.0f64..4.0), 1..12),
            extra in 0u32..3000,
        ) {
            // A few shared speeds make ties common; the rest are arbitrary.
            let speeds = [0.0, 1.0, 2.0, 0.5, 3.0];
            let caps: Vec<u32> = stages.iter().map(|s| s.0).collect();
            let seconds: Vec<f64> = stages
                .iter()
                .map(|&(_, pick, free)| speeds.get(pick).copied().unwrap_or(free))
                .collect();
            prop_assert_eq!(
                by_threshold(extra, &caps, &seconds),
                by_scan(extra, &caps, &seconds)
            );
        }
    }
}
