//! The NVML backend end to end, against the mock NVML library built from
//! `tests/fixtures/mock-nvml` (`libtessera_mock_nvml.so`, built by `cargo test`
//! from the workspace root).
//!
//! The mock's profile and control file come from environment variables read
//! when it initialises, and its state is process-global, so every test that
//! loads it holds `LOCK` for its whole run: it sets the variables, creates the
//! backend, and drops the backend (shutting the mock down) before releasing
//! the lock. Faults are injected by rewriting the control file.
//!
//! Real-hardware tests are `#[ignore]`d. On a node with the NVIDIA driver run
//! `cargo test --test backend_nvml -- --ignored`.

use std::ffi::OsStr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tessera::api::{LinkKind, MigState, Vendor};
use tessera::backend::nvml::{self, NvmlBackend};
use tessera::backend::{BackendError, DeviceInfo, GpuBackend, RawHealth, snapshot};

mod common;
use common::mock_library;

const PROFILE_ENV: &str = "TESSERA_MOCK_NVML_PROFILE";
const CONTROL_ENV: &str = "TESSERA_MOCK_NVML_CONTROL";

static LOCK: Mutex<()> = Mutex::new(());

/// One test's mock setup; holds the lock until dropped.
struct Scenario {
    dir: PathBuf,
    control: PathBuf,
    _lock: MutexGuard<'static, ()>,
}

impl Scenario {
    fn new(profile: &str, name: &str) -> Self {
        let lock = LOCK.lock().unwrap_or_else(|e| e.into_inner());
        let dir = std::env::temp_dir().join(format!(
            "tessera-backend-nvml-{}-{name}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let control = dir.join("control");
        std::fs::write(&control, "").unwrap();
        // SAFETY: every test that touches these variables (or loads the mock,
        // which reads them) holds LOCK.
        unsafe {
            std::env::set_var(PROFILE_ENV, profile);
            std::env::set_var(CONTROL_ENV, &control);
        }
        Self {
            dir,
            control,
            _lock: lock,
        }
    }

    /// A sysfs tree giving the first half of the bus ids NUMA node 0, the rest 1.
    fn sysfs(&self, bus_ids: &[&str]) -> PathBuf {
        let root = self.dir.join("sys");
        for (i, bus) in bus_ids.iter().enumerate() {
            let d = root.join("bus/pci/devices").join(bus);
            std::fs::create_dir_all(&d).unwrap();
            let node = if i < bus_ids.len() / 2 { "0\n" } else { "1\n" };
            std::fs::write(d.join("numa_node"), node).unwrap();
        }
        root
    }

    fn backend(&self) -> NvmlBackend {
        NvmlBackend::new(Some(mock_library().as_os_str()))
            .unwrap()
            .with_sysfs_root(self.dir.join("sys"))
    }

    fn inject(&self, directives: &str) {
        std::fs::write(&self.control, directives).unwrap();
    }
}

impl Drop for Scenario {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

const H100_BUSES: [&str; 8] = [
    "0000:18:00.0",
    "0000:2a:00.0",
    "0000:3a:00.0",
    "0000:5d:00.0",
    "0000:9a:00.0",
    "0000:ab:00.0",
    "0000:ba:00.0",
    "0000:db:00.0",
];

fn unhealthy_reason(h: &RawHealth) -> &str {
    match h {
        RawHealth::Unhealthy(r) => r,
        RawHealth::Healthy => panic!("expected unhealthy, got healthy"),
    }
}

#[test]
fn h100_hgx_devices_and_nvlink() {
    let s = Scenario::new("h100-sxm-8", "h100");
    s.sysfs(&H100_BUSES);
    let mut b = s.backend();
    assert_eq!(b.name(), "nvml");
    let devices = b.devices().unwrap();
    assert_eq!(devices.len(), 8);
    for (i, d) in devices.iter().enumerate() {
        assert_eq!(d.index, i as u32);
        assert!(d.id.starts_with("GPU-"), "{}", d.id);
        assert_eq!(d.vendor, Vendor::Nvidia);
        assert_eq!(d.product, "NVIDIA H100 80GB HBM3");
        assert_eq!(d.memory_total_bytes, 81559 << 20);
        assert_eq!(d.architecture, "9.0");
        assert_eq!(d.compute_units, 132, "SMs from 16896 CUDA cores / 128");
        assert!((d.fp16_tflops - 989.4).abs() < 1.0, "{}", d.fp16_tflops);
        assert!(
            (d.memory_bandwidth_gbps - 3352.3).abs() < 1.0,
            "{}",
            d.memory_bandwidth_gbps
        );
        assert_eq!(d.pci_bus_id, H100_BUSES[i]);
        assert_eq!(d.numa_node, Some(if i < 4 { 0 } else { 1 }));
        assert_eq!(d.mig, None, "this profile's GPUs answer MIG NOT_SUPPORTED");
    }
    let ids: std::collections::HashSet<&str> = devices.iter().map(|d| d.id.as_str()).collect();
    assert_eq!(ids.len(), 8, "ids are unique");
    assert_eq!(b.event_registered_devices().len(), 8);

    let links = b.links(&devices).unwrap();
    assert_eq!(links.len(), 28, "every pair once");
    for l in &links {
        assert_eq!(l.kind, LinkKind::Nvlink, "{l:?}");
        assert_eq!(l.bandwidth_gbps, 900.0, "{l:?}");
        assert!(l.p2p);
        let ia = devices.iter().find(|d| d.id == l.a).unwrap().index;
        let ib = devices.iter().find(|d| d.id == l.b).unwrap().index;
        assert!(ia < ib, "{l:?}");
    }
}

#[test]
fn a100_pcie_devices_and_links() {
    let s = Scenario::new("a100-pcie-4", "a100");
    let mut b = s.backend();
    let devices = b.devices().unwrap();
    assert_eq!(devices.len(), 4);
    for d in &devices {
        assert_eq!(d.product, "NVIDIA A100-PCIE-40GB");
        assert_eq!(d.memory_total_bytes, 40 << 30);
        assert_eq!(d.architecture, "8.0");
        assert_eq!(d.compute_units, 108, "SMs from the product table");
        assert!((d.fp16_tflops - 311.9).abs() < 1.0, "{}", d.fp16_tflops);
        assert!(
            (d.memory_bandwidth_gbps - 1555.2).abs() < 1.0,
            "{}",
            d.memory_bandwidth_gbps
        );
        assert_eq!(d.numa_node, None, "no sysfs entry");
    }
    assert_eq!(devices[0].pci_bus_id, "0000:17:00.0");
    assert_eq!(devices[2].pci_bus_id, "0000:b1:00.0");
    let links = b.links(&devices).unwrap();
    assert_eq!(links.len(), 6);
    for l in &links {
        assert_eq!(l.kind, LinkKind::Pcie, "{l:?}");
        // Gen4 x16 (the maximum; the idle card's current generation is 1).
        assert!((l.bandwidth_gbps - 63.0).abs() < 0.1, "{l:?}");
        assert!(l.p2p, "{l:?}");
    }
}

#[test]
fn telemetry_readings() {
    let s = Scenario::new("h100-sxm-8", "telemetry");
    let mut b = s.backend();
    let devices = b.devices().unwrap();
    let t = b.telemetry(&devices[2]).unwrap();
    assert_eq!(t.temperature_c, Some(33.0));
    assert_eq!(t.power_w, Some(74.0));
    assert_eq!(t.graphics_clock_mhz, Some(1755));
    assert_eq!(t.memory_clock_mhz, Some(2619));
    assert_eq!(t.utilization_percent, Some(20));
    assert_eq!(t.memory_used_bytes, 3 << 30);
    assert_eq!(
        t.memory_free_bytes,
        devices[2].memory_total_bytes - (584 << 20) - (3 << 30)
    );
    s.inject("temp 2 91\n");
    assert_eq!(b.telemetry(&devices[2]).unwrap().temperature_c, Some(91.0));
}

#[test]
fn ecc_counts_are_read_on_every_poll() {
    let s = Scenario::new("a100-pcie-4", "ecc-counts");
    let mut b = s.backend();
    let devices = b.devices().unwrap();
    let counts = |b: &mut NvmlBackend, i: usize| {
        let t = b.telemetry(&devices[i]).unwrap();
        (t.ecc_corrected_errors, t.ecc_uncorrected_errors)
    };
    assert_eq!(counts(&mut b, 0), (Some(0), Some(0)));
    s.inject("ecc-corrected 0 17\necc 0 2\nunsupported 1 ecc\n");
    assert_eq!(counts(&mut b, 0), (Some(17), Some(2)));
    assert_eq!(counts(&mut b, 1), (None, None), "no ECC: no counts");
    assert_eq!(counts(&mut b, 2), (Some(0), Some(0)));
}

#[test]
fn every_xid_is_counted_per_device_with_the_last_code() {
    let s = Scenario::new("h100-sxm-8", "xid-counts");
    let mut b = s.backend();
    let devices = b.devices().unwrap();
    let counts = |b: &mut NvmlBackend, i: usize| {
        let t = b.telemetry(&devices[i]).unwrap();
        (t.xid_errors, t.last_xid)
    };
    assert_eq!(counts(&mut b, 1), (Some(0), None), "watched, none yet");
    s.inject("xid 1 79\nxid 1 13\nxid 2 48\n");
    assert_eq!(
        counts(&mut b, 1),
        (Some(2), Some(13)),
        "application Xids count too"
    );
    assert_eq!(counts(&mut b, 2), (Some(1), Some(48)));
    assert_eq!(counts(&mut b, 0), (Some(0), None));
    // Counted once however often it is read, and the health check that
    // follows still sees the fault the event left.
    assert_eq!(counts(&mut b, 1), (Some(2), Some(13)));
    let h = b.health(&devices[1]).unwrap();
    assert_eq!(unhealthy_reason(&h), "Xid 79: GPU has fallen off the bus");
    s.inject("xid 1 79\nxid 1 13\nxid 2 48\nxid 1 31\n");
    let snap = snapshot(&mut b).unwrap();
    assert_eq!(snap.devices[1].telemetry.xid_errors, Some(3));
    assert_eq!(snap.devices[1].telemetry.last_xid, Some(31));
}

#[test]
fn unsupported_readings_are_none() {
    let s = Scenario::new("a100-pcie-4", "unsupported");
    let mut b = s.backend();
    let devices = b.devices().unwrap();
    s.inject(
        "unsupported 1 temperature\nunsupported 1 power\nunsupported 1 utilization\n\
         unsupported 1 clocks\nunsupported 1 ecc\n",
    );
    let t = b.telemetry(&devices[1]).unwrap();
    assert_eq!(t.temperature_c, None);
    assert_eq!(t.power_w, None);
    assert_eq!(t.utilization_percent, None);
    assert_eq!(t.graphics_clock_mhz, None);
    assert_eq!(t.memory_clock_mhz, None);
    assert_eq!(t.memory_used_bytes, 2 << 30, "memory is still read");
    // No ECC counters: health falls back to checking the GPU answers.
    assert_eq!(b.health(&devices[1]).unwrap(), RawHealth::Healthy);
    let full = b.telemetry(&devices[0]).unwrap();
    assert_eq!(full.temperature_c, Some(38.0));
    assert_eq!(full.power_w, Some(36.0));
}

#[test]
fn critical_xid_makes_a_device_unhealthy_until_the_hold_passes() {
    let s = Scenario::new("h100-sxm-8", "xid");
    let mut b = s.backend().with_fault_hold(Duration::from_millis(250));
    let devices = b.devices().unwrap();
    for d in &devices {
        assert_eq!(b.health(d).unwrap(), RawHealth::Healthy);
    }
    s.inject("xid 1 79\n");
    let h = b.health(&devices[1]).unwrap();
    assert_eq!(unhealthy_reason(&h), "Xid 79: GPU has fallen off the bus");
    // The event was consumed but the fault is held.
    assert!(matches!(
        b.health(&devices[1]).unwrap(),
        RawHealth::Unhealthy(_)
    ));
    assert_eq!(b.health(&devices[0]).unwrap(), RawHealth::Healthy);
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(
        b.health(&devices[1]).unwrap(),
        RawHealth::Healthy,
        "the fault clears when no new event came within the hold"
    );
    // A new event on the same line position counts again.
    s.inject("xid 1 79\nxid 1 48\n");
    let h = b.health(&devices[1]).unwrap();
    assert_eq!(unhealthy_reason(&h), "Xid 48: double-bit ECC error");
    let h = b.health(&devices[1]).unwrap();
    assert!(unhealthy_reason(&h).starts_with("Xid 48"));
}

#[test]
fn application_xids_are_ignored() {
    let s = Scenario::new("h100-sxm-8", "xid13");
    let mut b = s.backend();
    let devices = b.devices().unwrap();
    s.inject("xid 3 13\nxid 3 31\nxid 3 43\n");
    assert_eq!(b.health(&devices[3]).unwrap(), RawHealth::Healthy);
    s.inject("xid 3 13\nxid 3 31\nxid 3 43\nxid 3 4242\n");
    let h = b.health(&devices[3]).unwrap();
    assert_eq!(
        unhealthy_reason(&h),
        "Xid 4242",
        "unknown codes are critical"
    );
}

#[test]
fn uncorrected_ecc_errors_make_a_device_unhealthy() {
    let s = Scenario::new("a100-pcie-4", "ecc");
    let mut b = s.backend();
    let devices = b.devices().unwrap();
    s.inject("ecc 2 3\n");
    let h = b.health(&devices[2]).unwrap();
    assert!(
        unhealthy_reason(&h).contains("3 uncorrectable (double-bit) ECC error"),
        "{h:?}"
    );
    assert_eq!(b.health(&devices[1]).unwrap(), RawHealth::Healthy);
    s.inject("");
    assert_eq!(b.health(&devices[2]).unwrap(), RawHealth::Healthy);
}

#[test]
fn a_vanished_device_is_no_longer_listed() {
    let s = Scenario::new("h100-sxm-8", "vanish");
    let mut b = s.backend();
    let before = b.devices().unwrap();
    s.inject("vanish 3\n");
    let after = b.devices().unwrap();
    assert_eq!(after.len(), 7);
    assert!(after.iter().all(|d| d.id != before[3].id));
    assert_eq!(
        after[3].id, before[4].id,
        "later devices move down one index"
    );
    assert_eq!(after[3].index, 3);
    let h = b.health(&before[3]).unwrap();
    assert!(unhealthy_reason(&h).contains("no longer present"), "{h:?}");
    let links = b.links(&after).unwrap();
    assert_eq!(links.len(), 21);
}

#[test]
fn a_lost_device_stays_listed_and_is_unhealthy() {
    let s = Scenario::new("h100-sxm-8", "lost");
    let mut b = s.backend();
    let before = b.devices().unwrap();
    s.inject("lost 5\n");
    let after = b.devices().unwrap();
    assert_eq!(after.len(), 8);
    assert_eq!(after[5], before[5], "the last good reading, same UUID");
    let h = b.health(&after[5]).unwrap();
    assert!(unhealthy_reason(&h).contains("GPU is lost"), "{h:?}");
    assert!(matches!(
        b.telemetry(&after[5]),
        Err(BackendError::Failed(m)) if m.contains("GPU is lost")
    ));
    assert_eq!(b.health(&after[4]).unwrap(), RawHealth::Healthy);
    let links = b.links(&after).unwrap();
    assert_eq!(links.len(), 21, "no links for the lost GPU");
    assert!(
        links
            .iter()
            .all(|l| l.a != after[5].id && l.b != after[5].id)
    );

    let snap = snapshot(&mut b).unwrap();
    assert!(
        matches!(&snap.devices[5].health, RawHealth::Unhealthy(r) if r.contains("GPU is lost"))
    );
    snap.to_gpu_state(None).validate().unwrap();

    s.inject("");
    assert_eq!(b.health(&after[5]).unwrap(), RawHealth::Healthy);
}

#[test]
fn a_device_lost_before_it_was_ever_read_gets_a_placeholder() {
    let s = Scenario::new("h100-sxm-8", "lost-early");
    s.inject("lost 2\n");
    let mut b = s.backend();
    assert_eq!(b.event_registered_devices().len(), 7);
    let devices = b.devices().unwrap();
    assert_eq!(devices.len(), 8);
    let lost = &devices[2];
    assert!(nvml::is_fallback_id(&lost.id), "{}", lost.id);
    assert_eq!(lost.index, 2);
    let h = b.health(lost).unwrap();
    assert!(unhealthy_reason(&h).contains("GPU is lost"), "{h:?}");
    let snap = snapshot(&mut b).unwrap();
    let state = snap.to_gpu_state(None);
    state.validate().unwrap();
    assert_eq!(state.devices[2].health, tessera::api::Health::Unhealthy);
}

#[test]
fn snapshot_of_the_mock_is_a_valid_gpu_state() {
    let s = Scenario::new("h100-sxm-8", "snapshot");
    s.sysfs(&H100_BUSES);
    let mut b = s.backend();
    let snap = snapshot(&mut b).unwrap();
    assert_eq!(snap.backend, "nvml");
    assert_eq!(snap.devices.len(), 8);
    assert!(snap.devices.iter().all(|d| d.health == RawHealth::Healthy));
    assert_eq!(snap.links.len(), 28);
    let state = snap.to_gpu_state(Some("2025-01-01T00:00:00Z".into()));
    state.validate().unwrap();
    assert_eq!(state.devices[0].temperature_c, Some(31.0));
    assert_eq!(state.devices[7].numa_node, Some(1));
    let again = tessera::api::NodeGpuState::from_json(&state.to_json()).unwrap();
    assert_eq!(again, state);
}

#[test]
fn a100_snapshot_is_valid() {
    let s = Scenario::new("a100-pcie-4", "a100-snapshot");
    let mut b = s.backend();
    let snap = snapshot(&mut b).unwrap();
    assert_eq!(snap.links.len(), 6);
    snap.to_gpu_state(None).validate().unwrap();
}

// ---------------------------------------------------------------------------
// MIG (the mock's `mig-3` profile: an H100 in MIG mode, an A100 turning MIG on
// at its next reset, an L4 without MIG).

const GIB: u64 = 1 << 30;
const MIB: u64 = 1 << 20;

/// Runs `f` with this thread's log written to a buffer: `f`'s result and
/// what was logged.
fn logged<R>(f: impl FnOnce() -> R) -> (R, String) {
    #[derive(Clone, Default)]
    struct Buffer(Arc<Mutex<Vec<u8>>>);
    impl std::io::Write for Buffer {
        fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
            self.0
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .extend_from_slice(bytes);
            Ok(bytes.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let buffer = Buffer::default();
    let writer = buffer.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_writer(move || writer.clone())
        .with_ansi(false)
        .finish();
    let result = tracing::subscriber::with_default(subscriber, f);
    let text =
        String::from_utf8_lossy(&buffer.0.lock().unwrap_or_else(|e| e.into_inner())).into_owned();
    (result, text)
}

/// The backend's snapshot is a GPU state the core accepts (what the agent
/// publishes).
fn assert_publishable(b: &mut NvmlBackend) {
    snapshot(b).unwrap().to_gpu_state(None).validate().unwrap();
}

fn mig_of(device: &DeviceInfo) -> &MigState {
    device
        .mig
        .as_ref()
        .unwrap_or_else(|| panic!("{} has no MIG state", device.id))
}

/// Partitions as (profile, start, size, memory MiB, multiprocessors).
fn layout(mig: &MigState) -> Vec<(&str, u32, u32, u64, u32)> {
    mig.partitions
        .iter()
        .map(|p| {
            (
                p.profile.as_str(),
                p.placement_start,
                p.placement_size,
                p.memory_total_bytes / MIB,
                p.multiprocessors,
            )
        })
        .collect()
}

#[test]
fn mig_devices_are_read_with_their_figures() {
    let s = Scenario::new("mig-3", "mig");
    let mut b = s.backend();
    let (devices, log) = logged(|| b.devices().unwrap());
    assert!(!log.contains("WARN"), "nothing fails to read:\n{log}");
    assert_eq!(devices.len(), 3);

    let h100 = mig_of(&devices[0]);
    assert_eq!(devices[0].product, "NVIDIA H100 80GB HBM3");
    assert!(h100.enabled);
    assert_eq!(h100.pending, None);
    assert_eq!(h100.memory_slices, 8, "the 7g profile's placement");
    assert_eq!(h100.multiprocessors, 132);
    assert_eq!(
        layout(h100),
        [
            ("3g.40gb", 0, 4, 40448, 60),
            ("2g.20gb", 4, 2, 20096, 32),
            ("1g.10gb", 6, 1, 9984, 16),
        ],
        "empty slots between the MIG devices are skipped"
    );
    assert_eq!(
        h100.partitions[0].id,
        "MIG-4f2a9c1d-0000-5e8a-9d61-0c4f8a2b0009"
    );
    let profiles: Vec<(&str, u64, u32, u32, u32)> = h100
        .profiles
        .iter()
        .map(|p| {
            (
                p.name.as_str(),
                p.memory_total_bytes / MIB,
                p.multiprocessors,
                p.memory_slices,
                p.max_count,
            )
        })
        .collect();
    assert_eq!(
        profiles,
        [
            ("1g.10gb", 9984, 16, 1, 7),
            ("2g.20gb", 20096, 32, 2, 3),
            ("3g.40gb", 40448, 60, 4, 2),
            ("4g.40gb", 40448, 64, 4, 1),
            ("7g.80gb", 81152, 132, 8, 1),
            ("1g.10gb+me", 9984, 16, 1, 1),
            ("1g.20gb", 20096, 26, 2, 4),
        ]
    );

    // An Ampere GPU outside MIG mode offers no profiles until it is in it.
    let a100 = mig_of(&devices[1]);
    assert_eq!(devices[1].product, "NVIDIA A100 80GB PCIe");
    assert!(!a100.enabled);
    assert_eq!(a100.pending, Some(true), "MIG on after the next reset");
    assert_eq!((a100.memory_slices, a100.multiprocessors), (8, 108));
    assert!(a100.partitions.is_empty() && a100.profiles.is_empty());
    assert!(!a100.whole(), "not planned on while the change waits");

    assert_eq!(devices[2].product, "NVIDIA L4");
    assert_eq!(devices[2].mig, None, "no MIG on an L4");

    let state = snapshot(&mut b).unwrap().to_gpu_state(None);
    state.validate().unwrap();
    let published = state.devices[0].mig.as_ref().unwrap();
    assert_eq!(published.usable_partitions().len(), 3);
    assert!(published.partitions[0].memory_total_bytes < 40 * GIB);
    assert!(state.devices[2].mig.is_none());
}

#[test]
fn a_new_mig_layout_is_seen_at_the_next_listing() {
    let s = Scenario::new("mig-3", "mig-change");
    let mut b = s.backend();
    let before = b.devices().unwrap();
    assert_eq!(mig_of(&before[0]).partitions.len(), 3);

    // The administrator repartitions the H100 and resets the A100 into MIG mode.
    s.inject("mig 0 7g.80gb@0\nmigmode 1 1 1\nmig 1 4g.40gb@0 1g.20gb@4 1g.10gb@6\n");
    let after = b.devices().unwrap();
    let h100 = mig_of(&after[0]);
    assert_eq!(layout(h100), [("7g.80gb", 0, 8, 81152, 132)]);
    assert_ne!(h100.partitions[0].id, mig_of(&before[0]).partitions[0].id);
    let a100 = mig_of(&after[1]);
    assert!(a100.enabled && a100.pending.is_none());
    assert_eq!(
        layout(a100),
        [
            ("4g.40gb", 0, 4, 40192, 56),
            ("1g.20gb", 4, 2, 19968, 14),
            ("1g.10gb", 6, 1, 9728, 14),
        ]
    );
    assert_eq!(
        a100.profiles.len(),
        7,
        "an Ampere GPU in MIG mode lists them"
    );
    assert!(
        a100.profiles
            .iter()
            .any(|p| p.name == "7g.80gb" && p.multiprocessors == 98)
    );

    // MIG off on the H100, to stay off: no partitions, the profiles still offered.
    s.inject("migmode 0 0 0\n");
    let off = b.devices().unwrap();
    let h100 = mig_of(&off[0]);
    assert!(!h100.enabled && h100.pending.is_none() && h100.whole());
    assert!(h100.partitions.is_empty());
    assert_eq!(h100.profiles.len(), 7);
    assert_publishable(&mut b);
}

#[test]
fn a_mig_device_that_fails_mid_read_is_left_out_with_a_warning() {
    let s = Scenario::new("mig-3", "mig-fail");
    let mut b = s.backend();
    s.inject("migfail 0 4\n");
    let (devices, log) = logged(|| b.devices().unwrap());
    assert_eq!(
        layout(mig_of(&devices[0])),
        [("3g.40gb", 0, 4, 40448, 60), ("1g.10gb", 6, 1, 9984, 16)],
        "the others are still listed"
    );
    assert!(log.contains("WARN"), "{log}");
    assert!(
        log.contains("MIG device in slot 4 not listed")
            && log.contains("its GPU instance is unreadable"),
        "{log}"
    );
    assert!(log.contains(&devices[0].id), "the GPU is named: {log}");
    assert_publishable(&mut b);

    // Once while it lasts; again after it cleared and came back.
    let (_, log) = logged(|| b.devices().unwrap());
    assert!(!log.contains("slot 4"), "{log}");
    s.inject("");
    assert_eq!(mig_of(&b.devices().unwrap()[0]).partitions.len(), 3);
    s.inject("migfail 0 4\n");
    let (_, log) = logged(|| b.devices().unwrap());
    assert!(log.contains("slot 4"), "{log}");

    // A figure it does not give is its profile's.
    s.inject("migfail 0 6 memory\n");
    let (devices, log) = logged(|| b.devices().unwrap());
    assert_eq!(mig_of(&devices[0]).partitions.len(), 3);
    assert_eq!(
        mig_of(&devices[0]).partitions[2].memory_total_bytes,
        9984 * MIB
    );
    assert!(
        log.contains("memory unreadable") && log.contains("the 1g.10gb profile's used"),
        "{log}"
    );
}

#[test]
fn missing_library_is_unavailable_with_advice() {
    // No lock: nothing of the mock is touched.
    let path = "/nonexistent/libnvidia-ml.so.1";
    let err = match NvmlBackend::new(Some(OsStr::new(path))) {
        Err(e) => e,
        Ok(_) => panic!("loading {path} cannot succeed"),
    };
    let BackendError::Unavailable(msg) = &err else {
        panic!("expected Unavailable, got {err:?}");
    };
    assert!(msg.contains(path), "{msg}");
    assert!(msg.contains("runtimeClassName: nvidia"), "{msg}");
    assert!(msg.contains("driver is not installed"), "{msg}");
    assert!(msg.contains("version mismatch"), "{msg}");
    assert!(msg.contains("No such file"), "the loader's error: {msg}");
}

#[test]
fn default_library_name() {
    assert_eq!(nvml::DEFAULT_LIBRARY, "libnvidia-ml.so.1");
}

// ---------------------------------------------------------------------------
// Real hardware: `cargo test --test backend_nvml -- --ignored` on a node with
// the NVIDIA driver.

fn real_backend() -> NvmlBackend {
    match NvmlBackend::new(None) {
        Ok(b) => b,
        Err(e) => panic!("this test needs the NVIDIA driver: {e}"),
    }
}

fn check_real_device(d: &DeviceInfo) {
    assert!(d.id.starts_with("GPU-"), "{d:?}");
    assert_eq!(d.vendor, Vendor::Nvidia);
    assert!(d.memory_total_bytes > 1 << 30, "{d:?}");
    assert!(
        d.compute_units > 0,
        "SM count unknown for {}: extend the table",
        d.product
    );
    assert!(d.fp16_tflops > 1.0 && d.fp16_tflops < 20_000.0, "{d:?}");
    assert!(
        d.memory_bandwidth_gbps > 50.0 && d.memory_bandwidth_gbps < 20_000.0,
        "{d:?}"
    );
    assert_eq!(d.pci_bus_id.len(), 12, "{d:?}");
    assert!(d.architecture.contains('.'), "{d:?}");
}

#[test]
#[ignore = "needs an NVIDIA GPU and driver"]
fn real_nvml_lists_devices() {
    let mut b = real_backend();
    let devices = b.devices().unwrap();
    assert!(!devices.is_empty(), "NVML lists no GPU");
    for d in &devices {
        println!("{d:?}");
        check_real_device(d);
    }
    let links = b.links(&devices).unwrap();
    assert_eq!(links.len(), devices.len() * (devices.len() - 1) / 2);
    for l in &links {
        println!("{l:?}");
        assert!(l.bandwidth_gbps > 0.0, "{l:?}");
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU and driver"]
fn real_nvml_telemetry_and_health() {
    let mut b = real_backend();
    let devices = b.devices().unwrap();
    for d in &devices {
        let t = b.telemetry(d).unwrap();
        println!("{} {t:?}", d.id);
        let temp = t.temperature_c.expect("GPU temperature");
        assert!((5.0..110.0).contains(&temp), "{temp}");
        assert!(t.memory_used_bytes + t.memory_free_bytes <= d.memory_total_bytes);
        println!("{} {:?}", d.id, b.health(d).unwrap());
    }
    let snap = snapshot(&mut b).unwrap();
    snap.to_gpu_state(None).validate().unwrap();
}

/// NVIDIA's profile names: `<slices>g.<GB>gb`, and a variant after `+` or `-`.
fn looks_like_a_profile_name(name: &str) -> bool {
    let Some((slices, rest)) = name.split_once("g.") else {
        return false;
    };
    let memory = rest.split(['+', '-']).next().unwrap_or_default();
    let digits = |text: &str| !text.is_empty() && text.chars().all(|c| c.is_ascii_digit());
    digits(slices) && memory.strip_suffix("gb").is_some_and(digits)
}

#[test]
#[ignore = "needs an NVIDIA GPU and driver"]
fn real_nvml_mig_state() {
    let mut b = real_backend();
    let (devices, log) = logged(|| b.devices().unwrap());
    print!("{log}");
    assert!(
        !log.contains("MIG mode unreadable"),
        "the mode reads, or NVML says the GPU has no MIG: {log}"
    );
    for d in &devices {
        println!("GPU {} {} ({}): {:#?}", d.index, d.product, d.id, d.mig);
        let Some(mig) = &d.mig else {
            continue;
        };
        assert!(mig.memory_slices > 0 && mig.multiprocessors > 0, "{mig:?}");
        assert_ne!(
            mig.pending,
            Some(mig.enabled),
            "a change to the mode it is in"
        );
        if !mig.enabled {
            assert!(
                mig.partitions.is_empty(),
                "partitions with MIG off: {mig:?}"
            );
        }
        for profile in &mig.profiles {
            assert!(looks_like_a_profile_name(&profile.name), "{profile:?}");
            assert!(
                profile.memory_total_bytes > 0
                    && profile.memory_total_bytes <= d.memory_total_bytes,
                "{profile:?}"
            );
            assert!(
                profile.multiprocessors > 0 && profile.multiprocessors <= mig.multiprocessors,
                "{profile:?}"
            );
            assert!(
                (1..=mig.memory_slices).contains(&profile.memory_slices),
                "{profile:?}"
            );
            assert!(
                (1..=mig.memory_slices).contains(&profile.max_count),
                "{profile:?}"
            );
        }
        for partition in &mig.partitions {
            assert!(partition.id.starts_with("MIG-"), "{partition:?}");
            assert!(
                looks_like_a_profile_name(&partition.profile),
                "{partition:?}"
            );
        }
    }
    assert_publishable(&mut b);
}

#[test]
fn profile_names_are_recognised() {
    for name in [
        "1g.10gb",
        "1g.10gb+me",
        "7g.141gb",
        "1g.24gb-me",
        "2g.24gb+me.all",
    ] {
        assert!(looks_like_a_profile_name(name), "{name}");
    }
    for name in ["", "g.10gb", "1g.gb", "1g.10", "3g.40gb@4", "MIG 1g.10gb"] {
        assert!(!looks_like_a_profile_name(name), "{name}");
    }
}
