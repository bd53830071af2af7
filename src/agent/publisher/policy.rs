//! When the publisher writes: a change beyond telemetry at once, telemetry
//! drift at most once per the node's interval, nothing otherwise. Pure: the
//! loop asks with the time.

use std::time::Duration;

use tokio::time::Instant;

use super::PublisherConfig;
use super::patch::unstamped;
use crate::agent::state::DeviceView;
use tessera_core::api::NodeGpuState;

impl PublisherConfig {
    /// How long after the last write drift is published: `min_interval`
    /// plus up to a tenth of it, the same for a node every time and spread
    /// evenly over a fleet. `None` when that is too long to represent.
    pub(crate) fn drift_after(&self) -> Option<Duration> {
        let extra = self.min_interval.as_secs_f64() * DRIFT_SPREAD * node_share(&self.node_name);
        let extra = Duration::try_from_secs_f64(extra).ok()?;
        self.min_interval.checked_add(extra)
    }
}

/// Share of `min_interval` by which nodes spread their drift publishes.
const DRIFT_SPREAD: f64 = 0.1;

/// A node name's place in 0..1: FNV-1a, fixed on every platform and
/// release, then mixed (splitmix64's finaliser) so that names differing only
/// in their last characters land far apart.
fn node_share(name: &str) -> f64 {
    let hash = name.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |hash, byte| {
        (hash ^ u64::from(byte)).wrapping_mul(0x0000_0100_0000_01b3)
    });
    let mut mixed = (hash ^ (hash >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    mixed = (mixed ^ (mixed >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    (mixed ^ (mixed >> 31)) as f64 / u64::MAX as f64
}

/// The view last accepted by the API server, and when it was accepted.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Published {
    pub(crate) view: DeviceView,
    pub(crate) at: Instant,
}

/// What [`needs_publish`] says to do about the current view.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Decision {
    /// Something the controller must see changed, or drift is due: write now.
    Now,
    /// Only telemetry drifted; write at this time unless something else comes first.
    At(Instant),
    /// Nothing that is published changed.
    Nothing,
}

/// Decides whether `view` must be published, given what was published last.
pub(crate) fn needs_publish(
    last: &Published,
    view: &DeviceView,
    now: Instant,
    config: &PublisherConfig,
) -> Decision {
    // Each view as it would be published, once for both questions.
    let (old, new) = (unstamped(&last.view), unstamped(view));
    if old.changed_beyond_telemetry(&new) {
        return Decision::Now;
    }
    if !drifted(&old, &new, config.free_memory_threshold_bytes) {
        return Decision::Nothing;
    }
    match config
        .drift_after()
        .and_then(|after| last.at.checked_add(after))
    {
        Some(due) if due <= now => Decision::Now,
        Some(due) => Decision::At(due),
        // An interval too long to represent: drift alone is never published.
        None => Decision::Nothing,
    }
}

/// Changes that are published at once: anything but telemetry.
pub(super) fn changed_at_once(old: &DeviceView, new: &DeviceView) -> bool {
    unstamped(old).changed_beyond_telemetry(&unstamped(new))
}

/// Telemetry changes that are published, rate-limited. Assumes the device
/// lists match (otherwise the change was published at once).
fn drifted(old: &NodeGpuState, new: &NodeGpuState, free_memory_threshold: u64) -> bool {
    old.devices
        .iter()
        .zip(&new.devices)
        .any(|(x, y)| x.telemetry_moved(y, free_memory_threshold))
}

#[cfg(test)]
mod tests {
    use super::super::test_views::{device, view};
    use super::*;
    use crate::backend::RawHealth;
    use tessera_core::api::Vendor;

    const GIB: u64 = 1 << 30;

    fn config() -> PublisherConfig {
        PublisherConfig::new("node-a")
    }

    fn published(at: Instant) -> Published {
        Published { view: view(), at }
    }

    #[test]
    fn nothing_changed_means_nothing_to_do() {
        let t0 = Instant::now();
        let last = published(t0);
        let later = t0 + Duration::from_secs(3600);
        assert_eq!(
            needs_publish(&last, &view(), later, &config()),
            Decision::Nothing
        );
    }

    #[test]
    fn unpublished_fields_do_not_count() {
        let t0 = Instant::now();
        let last = published(t0);
        let mut v = view();
        v.error = Some("poll failed".into());
        for d in &mut v.snapshot.devices {
            d.telemetry.utilization_percent = Some(99);
            d.telemetry.graphics_clock_mhz = Some(1980);
            d.telemetry.memory_clock_mhz = Some(2619);
            d.telemetry.memory_used_bytes += 5 * GIB;
        }
        // Free memory moved, but by less than the threshold.
        v.snapshot.devices[0].telemetry.memory_free_bytes -= GIB - 1;
        let later = t0 + Duration::from_secs(3600);
        assert_eq!(
            needs_publish(&last, &v, later, &config()),
            Decision::Nothing
        );
    }

    #[test]
    fn structural_changes_are_published_at_once() {
        type Mutation = fn(&mut DeviceView);
        let cases: Vec<(&str, Mutation)> = vec![
            ("device gone", |v| {
                v.snapshot.devices.pop();
            }),
            ("all devices gone", |v| v.snapshot.devices.clear()),
            ("device added", |v| {
                v.snapshot.devices.push(device(
                    "GPU-c",
                    2,
                    Vendor::Nvidia,
                    "NVIDIA H100 80GB HBM3",
                    80,
                ))
            }),
            ("device replaced", |v| {
                v.snapshot.devices[1].info.id = "GPU-z".into()
            }),
            ("unhealthy", |v| {
                v.snapshot.devices[0].health = RawHealth::Unhealthy("Xid 79".into())
            }),
            ("allocated", |v| {
                v.allocated.insert("GPU-a".into(), "pod-uid-1".into());
            }),
            ("links", |v| {
                v.snapshot.links.push(crate::backend::DeviceLink {
                    a: "GPU-a".into(),
                    b: "GPU-b".into(),
                    kind: tessera_core::api::LinkKind::Nvlink,
                    bandwidth_gbps: 900.0,
                    p2p: true,
                })
            }),
            ("backend", |v| v.snapshot.backend = "nvml".into()),
        ];
        let t0 = Instant::now();
        let last = published(t0);
        for (what, mutate) in cases {
            let mut v = view();
            mutate(&mut v);
            // Right after the last publish: no rate limit applies.
            assert_eq!(
                needs_publish(&last, &v, t0, &config()),
                Decision::Now,
                "{what}"
            );
        }
    }

    #[test]
    fn a_changed_mig_layout_is_published_at_once() {
        let t0 = Instant::now();
        let last = published(t0);
        let mut v = last.view.clone();
        v.snapshot.devices[0].info.mig = Some(crate::backend::test_mig(true, None));
        assert_eq!(needs_publish(&last, &v, t0, &config()), Decision::Now);
    }

    #[test]
    fn a_changed_health_reason_is_published_at_once() {
        let t0 = Instant::now();
        let mut last = published(t0);
        last.view.snapshot.devices[0].health = RawHealth::Unhealthy("too hot: 91 °C".into());
        let mut v = last.view.clone();
        v.snapshot.devices[0].health = RawHealth::Unhealthy("Xid 48".into());
        assert_eq!(needs_publish(&last, &v, t0, &config()), Decision::Now);
        // Recovered.
        assert_eq!(needs_publish(&last, &view(), t0, &config()), Decision::Now);
    }

    #[test]
    fn allocation_changes_are_published_at_once() {
        let t0 = Instant::now();
        let mut last = published(t0);
        last.view.allocated.insert("GPU-a".into(), "pod-1".into());
        let mut v = last.view.clone();
        v.allocated.insert("GPU-a".into(), "pod-2".into());
        assert_eq!(needs_publish(&last, &v, t0, &config()), Decision::Now);
        v.allocated.clear();
        assert_eq!(needs_publish(&last, &v, t0, &config()), Decision::Now);
    }

    #[test]
    fn telemetry_drift_is_rate_limited() {
        type Mutation = fn(&mut DeviceView);
        let cases: Vec<(&str, Mutation)> = vec![
            ("temperature", |v| {
                v.snapshot.devices[1].telemetry.temperature_c = Some(41.0)
            }),
            ("temperature gone", |v| {
                v.snapshot.devices[1].telemetry.temperature_c = None
            }),
            ("power", |v| {
                v.snapshot.devices[0].telemetry.power_w = Some(350.0)
            }),
            ("free memory down by the threshold", |v| {
                v.snapshot.devices[0].telemetry.memory_free_bytes -= GIB
            }),
            ("free memory up by more than the threshold", |v| {
                v.snapshot.devices[0].telemetry.memory_free_bytes =
                    v.snapshot.devices[0].info.memory_total_bytes
            }),
        ];
        let t0 = Instant::now();
        let last = published(t0);
        let c = config();
        for (what, mutate) in cases {
            let mut v = view();
            mutate(&mut v);
            let due = t0 + c.drift_after().unwrap();
            assert_eq!(
                needs_publish(&last, &v, t0 + Duration::from_secs(1), &c),
                Decision::At(due),
                "{what}"
            );
            assert_eq!(needs_publish(&last, &v, due, &c), Decision::Now, "{what}");
            assert_eq!(
                needs_publish(&last, &v, due + Duration::from_secs(5), &c),
                Decision::Now,
                "{what}"
            );
        }
    }

    #[test]
    fn free_memory_drift_is_measured_against_the_last_publish() {
        // Many small steps add up: the comparison is with what was published,
        // not with the previous view.
        let t0 = Instant::now();
        let last = published(t0);
        let late = t0 + Duration::from_secs(600);
        let mut v = view();
        v.snapshot.devices[0].telemetry.memory_free_bytes -= GIB / 2;
        assert_eq!(needs_publish(&last, &v, late, &config()), Decision::Nothing);
        v.snapshot.devices[0].telemetry.memory_free_bytes -= GIB / 2;
        assert_eq!(needs_publish(&last, &v, late, &config()), Decision::Now);
    }

    #[test]
    fn zero_threshold_counts_any_free_memory_change() {
        let t0 = Instant::now();
        let last = published(t0);
        let mut c = config();
        c.free_memory_threshold_bytes = 0;
        let late = t0 + Duration::from_secs(600);
        assert_eq!(needs_publish(&last, &view(), late, &c), Decision::Nothing);
        let mut v = view();
        v.snapshot.devices[0].telemetry.memory_free_bytes -= 1;
        assert_eq!(needs_publish(&last, &v, late, &c), Decision::Now);
    }

    #[test]
    fn a_health_change_overrides_pending_drift() {
        let t0 = Instant::now();
        let last = published(t0);
        let mut v = view();
        v.snapshot.devices[0].telemetry.temperature_c = Some(60.0);
        v.snapshot.devices[1].health = RawHealth::Unhealthy("Xid 79".into());
        assert_eq!(needs_publish(&last, &v, t0, &config()), Decision::Now);
    }

    #[test]
    fn nan_readings_do_not_drift_forever() {
        let t0 = Instant::now();
        let mut last = published(t0);
        last.view.snapshot.devices[0].telemetry.power_w = Some(f64::NAN);
        let v = last.view.clone();
        let late = t0 + Duration::from_secs(60);
        assert_eq!(needs_publish(&last, &v, late, &config()), Decision::Nothing);
    }

    #[test]
    fn drift_waits_a_share_of_the_interval_fixed_per_node() {
        let mut c = config();
        let after: Vec<Duration> = (0..1000)
            .map(|n| {
                c.node_name = format!("gpu-node-{n:04}");
                c.drift_after().unwrap()
            })
            .collect();
        let (least, most) = (after.iter().min().unwrap(), after.iter().max().unwrap());
        assert!(*least >= c.min_interval && *most <= c.min_interval.mul_f64(1.1));
        // Spread over the whole tenth, not bunched.
        assert!(
            *most - *least > c.min_interval.mul_f64(0.09),
            "{least:?}..{most:?}"
        );
        let early = after
            .iter()
            .filter(|a| **a < c.min_interval.mul_f64(1.05))
            .count();
        assert!(
            (400..600).contains(&early),
            "{early} of 1000 in the first half"
        );
        c.node_name = "gpu-node-0007".into();
        assert_eq!(c.drift_after(), Some(after[7]), "the same every time");
    }

    #[test]
    fn an_endless_interval_never_publishes_drift() {
        let t0 = Instant::now();
        let last = published(t0);
        let mut c = config();
        c.min_interval = Duration::MAX;
        let mut v = view();
        v.snapshot.devices[0].telemetry.temperature_c = Some(70.0);
        assert_eq!(needs_publish(&last, &v, t0, &c), Decision::Nothing);
    }
}
