//! Health with recovery. Backends report what they see right now; this turns
//! that into the health the node publishes and kubelet acts on:
//!
//! - a fault makes a device unhealthy at once; it is healthy again only after
//!   the backend has reported it healthy for `recovery` without interruption
//!   (a device that flaps stays out; a device whose fault cleared comes back —
//!   "unhealthy forever until the plugin restarts" is what users hate most);
//! - temperature has hysteresis: a device is too hot at or above the limit and
//!   cool again only below `limit - margin`, so it does not flap at the edge.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use super::{RawHealth, Snapshot};

#[derive(Clone, Copy, Debug, PartialEq)]
pub struct HealthPolicy {
    pub recovery: Duration,
    pub max_temperature_c: f64,
    pub thermal_margin_c: f64,
}

impl Default for HealthPolicy {
    fn default() -> Self {
        Self {
            recovery: Duration::from_secs(60),
            max_temperature_c: 90.0,
            thermal_margin_c: 5.0,
        }
    }
}

#[derive(Debug, Default)]
struct Record {
    /// The last fault and when the backend last reported it.
    fault: Option<(String, Instant)>,
    hot: bool,
}

#[derive(Debug, Default)]
pub struct HealthTracker {
    policy: HealthPolicy,
    devices: HashMap<String, Record>,
}

impl HealthTracker {
    pub fn new(policy: HealthPolicy) -> Self {
        Self {
            policy,
            devices: HashMap::new(),
        }
    }

    /// The health to publish for a device, given what the backend says now.
    fn observe(
        &mut self,
        id: &str,
        raw: &RawHealth,
        temperature_c: Option<f64>,
        now: Instant,
    ) -> RawHealth {
        let policy = self.policy;
        let record = self.devices.entry(id.to_string()).or_default();
        if let RawHealth::Unhealthy(reason) = raw {
            record.fault = Some((reason.clone(), now));
        }
        if let Some(temperature) = temperature_c {
            if temperature >= policy.max_temperature_c {
                record.hot = true;
            } else if temperature < policy.max_temperature_c - policy.thermal_margin_c {
                record.hot = false;
            }
        }
        if let RawHealth::Unhealthy(reason) = raw {
            return RawHealth::Unhealthy(reason.clone());
        }
        if let Some((reason, last)) = &record.fault {
            let quiet = now.saturating_duration_since(*last);
            if quiet < policy.recovery {
                // Stable text: the reason is published, and a countdown in it
                // would rewrite the Node on every poll.
                return RawHealth::Unhealthy(format!(
                    "recovering from {reason}: healthy again after {}s without faults",
                    policy.recovery.as_secs()
                ));
            }
            record.fault = None;
        }
        if record.hot {
            return RawHealth::Unhealthy(format!(
                "too hot: reached the {:.0} °C limit; healthy again below {:.0} °C",
                policy.max_temperature_c,
                policy.max_temperature_c - policy.thermal_margin_c
            ));
        }
        RawHealth::Healthy
    }

    /// Replaces every device's raw health in the snapshot with the tracked one.
    pub(crate) fn apply(&mut self, snapshot: &mut Snapshot, now: Instant) {
        for device in &mut snapshot.devices {
            device.health = self.observe(
                &device.info.id,
                &device.health,
                device.telemetry.temperature_c,
                now,
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tracker() -> HealthTracker {
        HealthTracker::new(HealthPolicy {
            recovery: Duration::from_secs(30),
            max_temperature_c: 90.0,
            thermal_margin_c: 5.0,
        })
    }

    #[test]
    fn a_fault_recovers_only_after_a_quiet_period() {
        let mut t = tracker();
        let t0 = Instant::now();
        let bad = RawHealth::Unhealthy("Xid 79".into());
        assert_eq!(t.observe("g", &bad, None, t0), bad);
        let h = t.observe("g", &RawHealth::Healthy, None, t0 + Duration::from_secs(10));
        assert!(
            matches!(&h, RawHealth::Unhealthy(r) if r == "recovering from Xid 79: healthy again after 30s without faults"),
            "{h:?}"
        );
        // A new fault restarts the clock.
        t.observe("g", &bad, None, t0 + Duration::from_secs(20));
        let h = t.observe("g", &RawHealth::Healthy, None, t0 + Duration::from_secs(40));
        assert!(matches!(h, RawHealth::Unhealthy(_)));
        let h = t.observe("g", &RawHealth::Healthy, None, t0 + Duration::from_secs(50));
        assert_eq!(h, RawHealth::Healthy);
        // Other devices are independent.
        assert_eq!(
            t.observe("h", &RawHealth::Healthy, None, t0),
            RawHealth::Healthy
        );
    }

    #[test]
    fn an_injected_fault_reaches_health_and_recovers_after_the_period() {
        use super::super::{fake::FakeBackend, snapshot};
        let dir = std::env::temp_dir().join(format!("tessera-health-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("gpus.yaml");
        let gpus = "gpus: [{profile: H100-80GiB, count: 2}]\n";
        std::fs::write(
            &path,
            format!("{gpus}faults: [{{device: 1, unhealthy: \"Xid 79\"}}]\n"),
        )
        .unwrap();
        let mut backend = FakeBackend::new(path.to_str().unwrap()).unwrap();
        let mut t = tracker();
        let t0 = Instant::now();
        let state = |backend: &mut FakeBackend, t: &mut HealthTracker, at: u64| {
            let mut s = snapshot(backend).unwrap();
            t.apply(&mut s, t0 + Duration::from_secs(at));
            s.devices[1].health.clone()
        };
        assert_eq!(
            state(&mut backend, &mut t, 0),
            RawHealth::Unhealthy("Xid 79".into())
        );
        std::fs::write(&path, gpus).unwrap();
        assert!(
            matches!(state(&mut backend, &mut t, 29), RawHealth::Unhealthy(r) if r.starts_with("recovering"))
        );
        assert_eq!(state(&mut backend, &mut t, 30), RawHealth::Healthy);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn temperature_has_hysteresis() {
        let mut t = tracker();
        let now = Instant::now();
        let ok = RawHealth::Healthy;
        assert_eq!(t.observe("g", &ok, Some(89.0), now), ok);
        let hot = t.observe("g", &ok, Some(90.0), now);
        assert!(
            matches!(&hot, RawHealth::Unhealthy(r) if r == "too hot: reached the 90 °C limit; healthy again below 85 °C"),
            "{hot:?}"
        );
        assert!(
            matches!(
                t.observe("g", &ok, Some(86.0), now),
                RawHealth::Unhealthy(_)
            ),
            "still hot above 85"
        );
        assert_eq!(t.observe("g", &ok, Some(84.9), now), ok);
        assert_eq!(
            t.observe("g", &ok, Some(88.0), now),
            ok,
            "cool until the limit again"
        );
        assert!(
            matches!(t.observe("g", &ok, None, now), RawHealth::Healthy),
            "no reading keeps the state"
        );
    }
}
