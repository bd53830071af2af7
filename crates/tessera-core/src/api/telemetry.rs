//! What of a node's GPU state is telemetry: the readings that move on their
//! own (each device's temperature, power and free memory) and the time they
//! were read. Everything else (which devices there are, what they are, their
//! links, health and allocations) is what placement hinges on.
//!
//! The one definition every part uses: the agent publishes a change beyond
//! telemetry at once and telemetry at its publish interval; the controller
//! wakes waiting instances at once for the former and at most every ten
//! seconds for the latter; placement reads free memory in steps and scores
//! temperature in whole degrees, so drift within those does not change plans.

use super::gpu_state::{GpuDevice, NodeGpuState};

/// Free memory is planned on in steps of this size. Drift of a few MiB then
/// neither changes plans nor hides identical devices from the solver's
/// symmetry breaking.
pub const FREE_MEMORY_STEP: u64 = 256 << 20;

/// Free memory as placement reads it: rounded down to [`FREE_MEMORY_STEP`].
/// Down is the safe direction: a plan made on the rounded figure fits the
/// raw one.
pub fn planned_free_memory(bytes: u64) -> u64 {
    bytes / FREE_MEMORY_STEP * FREE_MEMORY_STEP
}

/// A temperature as the score reads it: whole degrees. The temperature limit
/// is a hard constraint and is compared with the raw reading.
pub fn scored_temperature(celsius: f64) -> f64 {
    celsius.round()
}

impl GpuDevice {
    /// The device with its telemetry taken out.
    pub fn without_telemetry(&self) -> GpuDevice {
        GpuDevice {
            temperature_c: None,
            power_w: None,
            memory_free_bytes: 0,
            ..self.clone()
        }
    }

    /// Whether a telemetry reading differs between two readings of one device
    /// (free memory by at least `free_memory_step` bytes; 0 counts every
    /// byte). A reading that is NaN both times has not changed.
    pub fn telemetry_moved(&self, later: &GpuDevice, free_memory_step: u64) -> bool {
        let same = |a: Option<f64>, b: Option<f64>| match (a, b) {
            (Some(a), Some(b)) => a == b || (a.is_nan() && b.is_nan()),
            (None, None) => true,
            _ => false,
        };
        let free_delta = self.memory_free_bytes.abs_diff(later.memory_free_bytes);
        !same(self.temperature_c, later.temperature_c)
            || !same(self.power_w, later.power_w)
            || (free_delta > 0 && free_delta >= free_memory_step)
    }
}

impl NodeGpuState {
    /// The state with its telemetry taken out.
    pub fn without_telemetry(&self) -> NodeGpuState {
        NodeGpuState {
            timestamp: None,
            devices: self
                .devices
                .iter()
                .map(GpuDevice::without_telemetry)
                .collect(),
            ..self.clone()
        }
    }

    /// Whether `later` differs from this state in more than telemetry.
    pub fn changed_beyond_telemetry(&self, later: &NodeGpuState) -> bool {
        self.without_telemetry() != later.without_telemetry()
    }
}

#[cfg(test)]
mod tests {
    use super::super::gpu_state::{GpuLink, Health, LinkKind, Vendor};
    use super::*;

    fn device(id: &str) -> GpuDevice {
        GpuDevice {
            mig: None,
            id: id.into(),
            index: 0,
            vendor: Vendor::Nvidia,
            product: "NVIDIA H100 80GB HBM3".into(),
            memory_total_bytes: 80 << 30,
            memory_free_bytes: 70 << 30,
            fp16_tflops: 989.0,
            fp8_tflops: None,
            fp4_tflops: None,
            memory_bandwidth_gbps: 3350.0,
            temperature_c: Some(40.0),
            power_w: Some(300.0),
            numa_node: None,
            health: Health::Healthy,
            health_reason: None,
        }
    }

    fn state() -> NodeGpuState {
        NodeGpuState {
            version: "v1".into(),
            backend: "fake".into(),
            devices: vec![device("g0"), device("g1")],
            links: Vec::new(),
            timestamp: Some("2026-01-01T00:00:00Z".into()),
            allocated: Default::default(),
            shares: Default::default(),
        }
    }

    #[test]
    fn readings_and_their_time_are_telemetry() {
        let before = state();
        let mut after = state();
        after.timestamp = Some("2026-01-01T00:05:00Z".into());
        after.devices[0].temperature_c = Some(83.0);
        after.devices[1].power_w = None;
        after.devices[1].memory_free_bytes = 1;
        assert!(!before.changed_beyond_telemetry(&after));
    }

    #[test]
    fn everything_else_is_not() {
        let before = state();
        let changes: [fn(&mut NodeGpuState); 6] = [
            |s| s.devices[0].health = Health::Unhealthy,
            |s| s.devices[0].health_reason = Some("Xid 79".into()),
            |s| {
                s.allocated.insert("g0".into(), "uid-1".into());
            },
            |s| {
                s.devices.pop();
            },
            |s| s.backend = "nvml".into(),
            |s| {
                s.links.push(GpuLink {
                    a: "g0".into(),
                    b: "g1".into(),
                    kind: LinkKind::Nvlink,
                    bandwidth_gbps: 900.0,
                })
            },
        ];
        for (i, change) in changes.iter().enumerate() {
            let mut after = state();
            change(&mut after);
            assert!(before.changed_beyond_telemetry(&after), "change {i}");
        }
    }

    #[test]
    fn telemetry_moves_by_reading_and_by_free_memory_step() {
        let a = device("g0");
        assert!(!a.telemetry_moved(&a.clone(), 1 << 30));
        let mut warmer = a.clone();
        warmer.temperature_c = Some(41.0);
        assert!(a.telemetry_moved(&warmer, 1 << 30));
        let mut nan = a.clone();
        nan.power_w = Some(f64::NAN);
        assert!(
            !nan.telemetry_moved(&nan.clone(), 0),
            "NaN twice is no change"
        );
        let mut freed = a.clone();
        freed.memory_free_bytes += 512 << 20;
        assert!(!a.telemetry_moved(&freed, 1 << 30), "below the step");
        assert!(a.telemetry_moved(&freed, 256 << 20));
        assert!(a.telemetry_moved(&freed, 0));
    }

    #[test]
    fn placement_reads_free_memory_down_in_steps_and_temperature_in_degrees() {
        assert_eq!(planned_free_memory(FREE_MEMORY_STEP - 1), 0);
        assert_eq!(
            planned_free_memory(3 * FREE_MEMORY_STEP + 5),
            3 * FREE_MEMORY_STEP
        );
        assert_eq!(scored_temperature(61.4), 61.0);
        assert_eq!(scored_temperature(61.5), 62.0);
    }
}
