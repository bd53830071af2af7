//! The AMD sysfs backend through its real code path, against committed sysfs
//! trees (`tests/fixtures/amd/`): 8× MI300X with xGMI all-to-all, and 2× MI210
//! joined by one xGMI bridge. Fault tests work on a copy in a temporary
//! directory and change files while the backend is alive.
//!
//! Real-hardware tests are ignored by default; on a node with AMD GPUs and the
//! amdgpu driver loaded, run them with
//!
//! ```text
//! cargo test --test backend_amd -- --ignored
//! ```

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

use tessera::api::{LinkKind, Vendor};
use tessera::backend::amd::{AmdBackend, DEFAULT_SYSFS_ROOT};
use tessera::backend::{BackendError, DeviceInfo, GpuBackend, RawHealth, snapshot};

const GIB: u64 = 1 << 30;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/amd")
        .join(name)
}

/// A private copy of a fixture, removed when dropped.
struct Scratch {
    root: PathBuf,
}

impl Scratch {
    fn of(name: &str) -> Self {
        let root = Self::unique_dir(name);
        copy_tree(&fixture(name), &root);
        Scratch { root }
    }

    /// An empty directory: a sysfs without the amdgpu driver.
    fn empty() -> Self {
        let root = Self::unique_dir("empty");
        std::fs::create_dir_all(&root).unwrap();
        Scratch { root }
    }

    fn unique_dir(name: &str) -> PathBuf {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let root = std::env::temp_dir().join(format!(
            "tessera-amd-{name}-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::SeqCst)
        ));
        let _ = std::fs::remove_dir_all(&root);
        root
    }

    fn path(&self, rel: &str) -> PathBuf {
        self.root.join(rel)
    }

    fn write(&self, rel: &str, text: &str) {
        let p = self.path(rel);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, text).unwrap();
    }

    fn remove(&self, rel: &str) {
        let p = self.path(rel);
        if p.is_dir() {
            std::fs::remove_dir_all(p).unwrap();
        } else {
            std::fs::remove_file(p).unwrap();
        }
    }

    /// Replaces the value of `key` in a KFD properties file.
    fn set_prop(&self, rel: &str, key: &str, value: &str) {
        let text = std::fs::read_to_string(self.path(rel)).unwrap();
        let mut found = false;
        let out: String = text
            .lines()
            .map(|l| match l.split_once(' ') {
                Some((k, _)) if k == key => {
                    found = true;
                    format!("{k} {value}\n")
                }
                _ => format!("{l}\n"),
            })
            .collect();
        assert!(found, "{rel} has no {key}");
        self.write(rel, &out);
    }

    fn backend(&self) -> AmdBackend {
        AmdBackend::new(&self.root).unwrap()
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.root);
    }
}

fn copy_tree(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let target = to.join(entry.file_name());
        if entry.file_type().unwrap().is_dir() {
            copy_tree(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), &target).unwrap();
        }
    }
}

const KFD: &str = "class/kfd/kfd/topology/nodes";

/// KFD node and DRM card of each MI300X by index (PCI order), as generated.
const MI300X_NODE: [u32; 8] = [3, 2, 5, 4, 6, 7, 8, 9];

fn mi300x_card(index: usize) -> String {
    format!("class/drm/card{}/device", index + 1)
}

fn approx(a: f64, b: f64, tol: f64) -> bool {
    (a - b).abs() <= tol
}

#[test]
fn mi300x_devices() {
    let mut b = AmdBackend::new(fixture("mi300x-8")).unwrap();
    assert_eq!(b.name(), "amd");
    let devices = b.devices().unwrap();
    assert_eq!(devices.len(), 8);
    let buses = ["11", "2f", "40", "5f", "8c", "aa", "c1", "de"];
    let ids = [
        "0x4c8d3e2a91f06b17",
        "0x7a02e5c4b8d1f963",
        "0x1f6b9a3d07c4e852",
        "0x63e4d1b8a2f09c7d",
        "0x2d9f4a6c13b8e051",
        "0x58b1c7e3f4a6092d",
        "0xe7c5b2d98a3f461",
        "0x71a8f3c6e05d2b94",
    ];
    for (i, d) in devices.iter().enumerate() {
        assert_eq!(d.index, i as u32);
        assert_eq!(d.pci_bus_id, format!("0000:{}:00.0", buses[i]), "PCI order");
        assert_eq!(d.id, ids[i]);
        assert_eq!(d.vendor, Vendor::Amd);
        assert_eq!(d.product, "AMD Instinct MI300X OAM", "from product_name");
        assert_eq!(d.memory_total_bytes, 192 * GIB);
        assert_eq!(d.architecture, "gfx942");
        assert_eq!(d.compute_units, 304);
        assert!(approx(d.fp16_tflops, 1307.4, 0.05), "{}", d.fp16_tflops);
        assert!(
            approx(d.memory_bandwidth_gbps, 5324.8, 0.05),
            "{}",
            d.memory_bandwidth_gbps
        );
        assert_eq!(d.numa_node, Some(if i < 4 { 0 } else { 1 }));
    }
}

#[test]
fn mi210_devices() {
    let mut b = AmdBackend::new(fixture("mi210-2")).unwrap();
    let devices = b.devices().unwrap();
    assert_eq!(devices.len(), 2);
    let d = &devices[0];
    assert_eq!(d.id, "0x1901ead3a2ecd4a6");
    assert_eq!(d.pci_bus_id, "0000:23:00.0");
    assert_eq!(
        d.product, "AMD Instinct MI210",
        "no product_name: device id table"
    );
    assert_eq!(d.memory_total_bytes, 64 * GIB);
    assert_eq!(d.architecture, "gfx90a");
    assert_eq!(d.compute_units, 104);
    assert!(approx(d.fp16_tflops, 181.0, 0.05), "{}", d.fp16_tflops);
    assert!(approx(d.memory_bandwidth_gbps, 1638.4, 0.05));
    assert_eq!(d.numa_node, None, "numa_node -1");
    assert_eq!(devices[1].index, 1);
    assert_eq!(devices[1].pci_bus_id, "0000:63:00.0");
}

#[test]
fn mi300x_telemetry() {
    let mut b = AmdBackend::new(fixture("mi300x-8")).unwrap();
    let devices = b.devices().unwrap();
    let idle = b.telemetry(&devices[0]).unwrap();
    assert_eq!(
        idle.temperature_c,
        Some(41.0),
        "junction: MI300X has no edge sensor"
    );
    assert_eq!(idle.power_w, Some(142.0), "power1_input");
    assert_eq!(idle.utilization_percent, Some(0));
    assert_eq!(idle.memory_used_bytes, 301_989_888);
    assert_eq!(idle.memory_free_bytes, 192 * GIB - 301_989_888);
    assert_eq!(idle.graphics_clock_mhz, None);

    let busy = b.telemetry(&devices[3]).unwrap();
    assert_eq!(busy.temperature_c, Some(81.0));
    assert_eq!(busy.power_w, Some(716.0));
    assert_eq!(busy.utilization_percent, Some(100));
    assert_eq!(busy.memory_used_bytes, 183_609_851_904);
    assert_eq!(busy.memory_free_bytes, 192 * GIB - 183_609_851_904);
}

#[test]
fn mi210_telemetry() {
    let mut b = AmdBackend::new(fixture("mi210-2")).unwrap();
    let devices = b.devices().unwrap();
    let t = b.telemetry(&devices[1]).unwrap();
    assert_eq!(t.temperature_c, Some(61.0), "edge preferred over junction");
    assert_eq!(t.power_w, Some(271.0), "power1_average");
    assert_eq!(t.graphics_clock_mhz, Some(1700));
    assert_eq!(t.memory_clock_mhz, Some(1600));
    assert_eq!(t.utilization_percent, Some(88));
    assert_eq!(t.memory_used_bytes, 40 * GIB);
    assert_eq!(t.memory_free_bytes, 24 * GIB);
}

#[test]
fn mi300x_links_are_xgmi_all_to_all() {
    let mut b = AmdBackend::new(fixture("mi300x-8")).unwrap();
    let devices = b.devices().unwrap();
    let links = b.links(&devices).unwrap();
    assert_eq!(links.len(), 28);
    let index = |id: &str| devices.iter().find(|d| d.id == id).unwrap().index;
    let mut pairs = std::collections::BTreeSet::new();
    for l in &links {
        assert_eq!(l.kind, LinkKind::Xgmi);
        assert_eq!(l.bandwidth_gbps, 128.0);
        assert!(l.p2p);
        let (a, b) = (index(&l.a), index(&l.b));
        assert!(a < b, "lower index first: {a} {b}");
        assert!(pairs.insert((a, b)), "pair {a}-{b} twice");
    }
}

#[test]
fn mi210_bridge_is_one_xgmi_link() {
    let mut b = AmdBackend::new(fixture("mi210-2")).unwrap();
    let devices = b.devices().unwrap();
    let links = b.links(&devices).unwrap();
    assert_eq!(links.len(), 1);
    assert_eq!(links[0].a, devices[0].id);
    assert_eq!(links[0].b, devices[1].id);
    assert_eq!(links[0].kind, LinkKind::Xgmi);
    assert_eq!(links[0].bandwidth_gbps, 100.0);
    assert!(links[0].p2p);
}

#[test]
fn snapshots_are_valid_gpu_states() {
    for name in ["mi300x-8", "mi210-2"] {
        let mut b = AmdBackend::new(fixture(name)).unwrap();
        let s = snapshot(&mut b).unwrap();
        assert!(
            s.devices.iter().all(|d| d.health == RawHealth::Healthy),
            "{name}: {:?}",
            s.devices.iter().map(|d| &d.health).collect::<Vec<_>>()
        );
        let state = s.to_gpu_state(None);
        state.validate().unwrap();
        assert_eq!(state.backend, "amd");
        assert_eq!(
            snapshot(&mut b).unwrap(),
            s,
            "{name}: same files, same snapshot"
        );
    }
}

#[test]
fn mi210_without_bridge_talks_over_pcie() {
    let s = Scratch::of("mi210-2");
    for node in [1, 2] {
        s.remove(&format!("{KFD}/{node}/io_links/1"));
    }
    let mut b = s.backend();
    let devices = b.devices().unwrap();
    let links = b.links(&devices).unwrap();
    assert_eq!(links.len(), 1);
    assert_eq!(links[0].kind, LinkKind::Pcie);
    assert_eq!(links[0].bandwidth_gbps, 63.0, "Gen4 x16 both ways");
    assert!(!links[0].p2p, "no p2p_links: unknown, so not assumed");

    // The kernel's p2p_links say the peers reach each other over PCIe.
    s.write(
        &format!("{KFD}/1/p2p_links/0/properties"),
        "type 2\nnode_from 1\nnode_to 2\nweight 52\nmin_bandwidth 312\nmax_bandwidth 32000\n",
    );
    let links = b.links(&devices).unwrap();
    assert_eq!(links[0].kind, LinkKind::Pcie);
    assert!(links[0].p2p);

    // One side downtrained to Gen4 x8: the pair runs at the slower link.
    s.write("class/drm/card1/device/current_link_width", "8\n");
    assert_eq!(b.links(&devices).unwrap()[0].bandwidth_gbps, 31.5);

    // Unreadable link speeds: the KFD's figure for the host link (32000 MB/s each way).
    s.write("class/drm/card0/device/current_link_speed", "Unknown\n");
    s.write("class/drm/card1/device/current_link_speed", "Unknown\n");
    assert_eq!(b.links(&devices).unwrap()[0].bandwidth_gbps, 64.0);
}

#[test]
fn files_are_reread_on_every_call() {
    let s = Scratch::of("mi300x-8");
    let mut b = s.backend();
    let devices = b.devices().unwrap();
    let card = mi300x_card(6);
    assert_eq!(b.telemetry(&devices[6]).unwrap().temperature_c, Some(42.0));

    s.write(&format!("{card}/hwmon/hwmon8/temp2_input"), "97000\n");
    s.write(
        &format!("{card}/mem_info_vram_used"),
        &format!("{}\n", 100 * GIB),
    );
    let t = b.telemetry(&devices[6]).unwrap();
    assert_eq!(t.temperature_c, Some(97.0), "hot reading visible at once");
    assert_eq!(t.memory_free_bytes, 92 * GIB);
    let s2 = snapshot(&mut b).unwrap();
    assert_eq!(s2.devices[6].telemetry.temperature_c, Some(97.0));
    assert_eq!(
        s2.devices[6].health,
        RawHealth::Healthy,
        "temperature limits are the tracker's job"
    );
}

#[test]
fn removed_card_makes_the_device_unhealthy() {
    let s = Scratch::of("mi300x-8");
    let mut b = s.backend();
    let before = b.devices().unwrap();
    s.remove("class/drm/card3");

    let after = b.devices().unwrap();
    assert_eq!(after.len(), 8, "the KFD still lists it");
    assert_eq!(after[2].id, before[2].id, "id is stable without the card");
    assert_eq!(
        after[2].memory_total_bytes,
        192 * GIB,
        "from the KFD memory bank"
    );
    assert_eq!(after[2].numa_node, None);
    assert_eq!(
        after[2].product, "AMD Instinct MI300X",
        "from the device id table"
    );

    match b.health(&before[2]).unwrap() {
        RawHealth::Unhealthy(r) => assert!(r.contains("DRM device of 0000:40:00.0 is gone"), "{r}"),
        h => panic!("{h:?}"),
    }
    assert!(b.telemetry(&before[2]).is_err());
    let snap = snapshot(&mut b).unwrap();
    match &snap.devices[2].health {
        RawHealth::Unhealthy(r) => assert!(r.contains("telemetry unreadable"), "{r}"),
        h => panic!("{h:?}"),
    }
    assert!(
        snap.devices
            .iter()
            .filter(|d| d.health == RawHealth::Healthy)
            .count()
            == 7
    );
    snap.to_gpu_state(None).validate().unwrap();
}

#[test]
fn removed_kfd_node_drops_the_device() {
    let s = Scratch::of("mi300x-8");
    let mut b = s.backend();
    let before = b.devices().unwrap();
    s.remove(&format!("{KFD}/{}", MI300X_NODE[4]));

    let after = b.devices().unwrap();
    assert_eq!(after.len(), 7);
    assert!(after.iter().all(|d| d.id != before[4].id));
    assert_eq!(
        after.iter().map(|d| d.index).collect::<Vec<_>>(),
        (0..7).collect::<Vec<_>>()
    );
    match b.health(&before[4]).unwrap() {
        RawHealth::Unhealthy(r) => assert!(
            r.contains("KFD topology node of 0000:8c:00.0 is gone"),
            "{r}"
        ),
        h => panic!("{h:?}"),
    }
    assert_eq!(b.links(&after).unwrap().len(), 21);
    assert_eq!(
        b.links(&before).unwrap().len(),
        21,
        "stale devices are left out"
    );
    snapshot(&mut b)
        .unwrap()
        .to_gpu_state(None)
        .validate()
        .unwrap();
}

#[test]
fn ras_counts_of_every_block_are_the_ecc_counts() {
    let s = Scratch::of("mi300x-8");
    let mut b = s.backend();
    let devices = b.devices().unwrap();
    let counts = |b: &mut AmdBackend, i: usize| {
        let t = b.telemetry(&devices[i]).unwrap();
        (
            t.ecc_corrected_errors,
            t.ecc_uncorrected_errors,
            t.xid_errors,
        )
    };
    assert_eq!(counts(&mut b, 5), (Some(3), Some(0), None), "umc's ce: 3");
    s.write(
        &format!("{}/ras/gfx_err_count", mi300x_card(5)),
        "ue: 1\nce: 4\n",
    );
    assert_eq!(
        counts(&mut b, 5),
        (Some(7), Some(1), None),
        "summed over blocks"
    );
    // While the driver cannot answer for a block, no count at all.
    s.write(
        &format!("{}/ras/gfx_err_count", mi300x_card(5)),
        "Query currently inaccessible\n",
    );
    assert_eq!(counts(&mut b, 5), (None, None, None));
    let snap = snapshot(&mut b).unwrap();
    assert_eq!(snap.devices[5].telemetry.ecc_corrected_errors, None);
    assert_eq!(
        snap.devices[5].health,
        RawHealth::Healthy,
        "health reads umc only"
    );
    // Without RAS: no counts.
    s.remove(&format!("{}/ras", mi300x_card(0)));
    assert_eq!(counts(&mut b, 0), (None, None, None));
}

#[test]
fn uncorrectable_memory_errors_make_the_device_unhealthy() {
    let s = Scratch::of("mi300x-8");
    let mut b = s.backend();
    let devices = b.devices().unwrap();
    assert_eq!(
        b.health(&devices[5]).unwrap(),
        RawHealth::Healthy,
        "ce only"
    );
    s.write(
        &format!("{}/ras/umc_err_count", mi300x_card(1)),
        "ue: 2\nce: 17\n",
    );
    assert_eq!(
        b.health(&devices[1]).unwrap(),
        RawHealth::Unhealthy("uncorrectable memory errors: 2 (ras/umc_err_count)".into())
    );
    let snap = snapshot(&mut b).unwrap();
    assert!(matches!(snap.devices[1].health, RawHealth::Unhealthy(_)));
    assert_eq!(snap.devices[0].health, RawHealth::Healthy);

    // No RAS support at all is fine.
    s.remove(&format!("{}/ras", mi300x_card(0)));
    assert_eq!(b.health(&devices[0]).unwrap(), RawHealth::Healthy);
}

#[test]
fn missing_kfd_is_unavailable_with_a_clear_message() {
    let s = Scratch::empty();
    let err = AmdBackend::new(&s.root).unwrap_err();
    assert!(matches!(err, BackendError::Unavailable(_)), "{err:?}");
    let msg = err.to_string();
    assert!(msg.contains("no KFD topology at"), "{msg}");
    assert!(msg.contains("amdgpu driver is not loaded"), "{msg}");
    assert!(msg.contains("/sys is not mounted"), "{msg}");

    let err = AmdBackend::new("/nonexistent/sysfs").unwrap_err();
    assert!(matches!(err, BackendError::Unavailable(_)), "{err:?}");
}

#[test]
fn cpu_only_topology_is_unavailable() {
    let s = Scratch::of("mi210-2");
    s.remove(&format!("{KFD}/1"));
    s.remove(&format!("{KFD}/2"));
    let err = AmdBackend::new(&s.root).unwrap_err();
    assert!(matches!(err, BackendError::Unavailable(_)), "{err:?}");
    assert!(err.to_string().contains("lists no AMD GPU"), "{err}");
}

#[test]
fn driver_unloaded_while_running_is_an_error_not_a_panic() {
    let s = Scratch::of("mi210-2");
    let mut b = s.backend();
    let devices = b.devices().unwrap();
    s.remove("class/kfd");
    let err = b.devices().unwrap_err();
    assert!(
        err.to_string().contains("was the amdgpu driver unloaded?"),
        "{err}"
    );
    assert!(matches!(
        b.health(&devices[0]).unwrap(),
        RawHealth::Unhealthy(_)
    ));
    assert!(snapshot(&mut b).is_err());
}

#[test]
fn malformed_kfd_properties_are_clear_errors() {
    let node = format!("{KFD}/1/properties");
    type Breakage<'a> = Box<dyn Fn(&Scratch) + 'a>;
    let cases: Vec<(Breakage<'_>, &str)> = vec![
        (
            Box::new(|s| s.set_prop(&node, "simd_count", "lots")),
            "`simd_count` is \"lots\", not a whole number",
        ),
        (
            Box::new(|s| s.set_prop(&node, "max_engine_clk_fcompute", "-5")),
            "`max_engine_clk_fcompute` is \"-5\"",
        ),
        (
            Box::new(|s| s.set_prop(&node, "simd_per_cu", "0")),
            "`simd_per_cu` is 0",
        ),
        (
            Box::new(|s| s.write(&node, "")),
            "no `simd_count` line (the file is empty)",
        ),
        (
            Box::new(|s| s.write(&node, "simd_count 416\nsimd_per_cu 4\n")),
            "no `location_id` line",
        ),
        (
            Box::new(|s| {
                s.set_prop(
                    &format!("{KFD}/1/mem_banks/0/properties"),
                    "size_in_bytes",
                    "",
                )
            }),
            "`size_in_bytes` is \"\"",
        ),
        (
            Box::new(|s| {
                s.write(
                    &format!("{KFD}/1/io_links/1/properties"),
                    "type xgmi\nnode_to 2\n",
                )
            }),
            "`type` is \"xgmi\"",
        ),
    ];
    for (i, (break_it, want)) in cases.into_iter().enumerate() {
        let s = Scratch::of("mi210-2");
        let mut b = s.backend();
        let devices = b.devices().unwrap();
        break_it(&s);
        let err = b.devices().unwrap_err();
        assert!(matches!(err, BackendError::Failed(_)), "case {i}: {err:?}");
        let msg = err.to_string();
        assert!(msg.contains(want), "case {i}: {msg} lacks {want}");
        assert!(
            msg.contains("/properties"),
            "case {i}: names the file: {msg}"
        );
        assert!(b.links(&devices).is_err(), "case {i}");
        assert!(snapshot(&mut b).is_err(), "case {i}");
        // The other GPU keeps answering.
        assert_eq!(
            b.health(&devices[1]).unwrap(),
            RawHealth::Healthy,
            "case {i}"
        );
        match b.health(&devices[0]).unwrap() {
            RawHealth::Unhealthy(r) => {
                assert!(r.contains(want) || r.contains("is gone"), "case {i}: {r}")
            }
            h => panic!("case {i}: {h:?}"),
        }
        // A broken topology from the start is Failed, not Unavailable.
        let err = AmdBackend::new(&s.root).map(|_| ()).err();
        if let Some(e) = err {
            assert!(matches!(e, BackendError::Failed(_)), "case {i}: {e:?}");
        }
    }
}

#[test]
fn malformed_drm_files_make_the_device_unhealthy() {
    let cases: [(&str, &str, &str); 6] = [
        ("mem_info_vram_used", "", "mem_info_vram_used is empty"),
        (
            "mem_info_vram_used",
            "12 GB\n",
            "\"12 GB\" is not a whole number",
        ),
        (
            "hwmon/hwmon1/temp1_input",
            "hot\n",
            "\"hot\" is not a number",
        ),
        (
            "hwmon/hwmon1/power1_average",
            "\n",
            "power1_average is empty",
        ),
        ("gpu_busy_percent", "n/a\n", "\"n/a\" is not a number"),
        ("ras/umc_err_count", "garbage\n", "has no `ue:` count"),
    ];
    for (file, text, want) in cases {
        let s = Scratch::of("mi210-2");
        let mut b = s.backend();
        s.write(&format!("class/drm/card0/device/{file}"), text);
        let snap = snapshot(&mut b).unwrap();
        match &snap.devices[0].health {
            RawHealth::Unhealthy(r) => assert!(r.contains(want), "{file}: {r} lacks {want}"),
            h => panic!("{file}: {h:?}"),
        }
        assert_eq!(snap.devices[1].health, RawHealth::Healthy, "{file}");
        snap.to_gpu_state(None).validate().unwrap();
    }
}

#[test]
fn odd_but_harmless_drm_files_are_tolerated() {
    let s = Scratch::of("mi210-2");
    let dev = "class/drm/card0/device";
    s.write(&format!("{dev}/numa_node"), "zero\n");
    s.write(&format!("{dev}/mem_info_vram_total"), "\n");
    s.write(&format!("{dev}/product_name"), "  \n");
    s.write(&format!("{dev}/current_link_speed"), "\n");
    s.remove(&format!("{dev}/hwmon"));
    let mut b = s.backend();
    let devices = b.devices().unwrap();
    assert_eq!(devices[0].numa_node, None);
    assert_eq!(devices[0].memory_total_bytes, 64 * GIB, "KFD size");
    assert_eq!(devices[0].product, "AMD Instinct MI210");
    let links = b.links(&devices).unwrap();
    assert_eq!(links[0].kind, LinkKind::Xgmi);
    let t = b.telemetry(&devices[0]).unwrap_err();
    assert!(
        t.to_string().contains("mem_info_vram_total is empty"),
        "{t}"
    );
    s.remove(&format!("{dev}/mem_info_vram_total"));
    let t = b.telemetry(&devices[0]).unwrap();
    assert_eq!(t.temperature_c, None, "no hwmon: no readings");
    assert_eq!(t.power_w, None);
    assert_eq!(t.memory_free_bytes, 64 * GIB - 11_534_336);
}

#[test]
fn identity_fallbacks() {
    let s = Scratch::of("mi210-2");
    // No KFD unique_id: the DRM unique_id file.
    s.set_prop(&format!("{KFD}/1/properties"), "unique_id", "0");
    // Neither: the PCI bus id.
    s.set_prop(&format!("{KFD}/2/properties"), "unique_id", "0");
    s.remove("class/drm/card1/device/unique_id");
    // An unknown device id: a generic name.
    s.set_prop(&format!("{KFD}/2/properties"), "device_id", "4660");
    let mut b = s.backend();
    let devices = b.devices().unwrap();
    assert_eq!(devices[0].id, "0x1901ead3a2ecd4a6");
    assert_eq!(devices[1].id, "0000:63:00.0");
    assert_eq!(devices[1].product, "AMD GPU 0x1234");
    let links = b.links(&devices).unwrap();
    assert_eq!(links[0].b, "0000:63:00.0");
    snapshot(&mut b)
        .unwrap()
        .to_gpu_state(None)
        .validate()
        .unwrap();
}

#[test]
fn duplicate_unique_ids_fall_back_to_pci_addresses() {
    let s = Scratch::of("mi210-2");
    s.set_prop(
        &format!("{KFD}/2/properties"),
        "unique_id",
        "1801979520617338022",
    );
    let mut b = s.backend();
    let devices = b.devices().unwrap();
    assert_eq!(devices[0].id, "0000:23:00.0");
    assert_eq!(devices[1].id, "0000:63:00.0");
    snapshot(&mut b)
        .unwrap()
        .to_gpu_state(None)
        .validate()
        .unwrap();
}

#[test]
fn partitions_of_one_gpu_are_one_device() {
    let s = Scratch::of("mi210-2");
    // A second KFD node at the same PCI address, as MI300 shows in CPX mode.
    copy_tree(&s.path(&format!("{KFD}/1")), &s.path(&format!("{KFD}/3")));
    s.set_prop(&format!("{KFD}/3/properties"), "drm_render_minor", "130");
    let mut b = s.backend();
    let devices = b.devices().unwrap();
    assert_eq!(devices.len(), 2);
    assert_eq!(devices[0].compute_units, 208, "CUs of both partitions");
    assert_eq!(b.links(&devices).unwrap().len(), 1);
}

#[test]
fn cards_match_by_render_node_without_a_pci_address() {
    let s = Scratch::of("mi210-2");
    s.remove("class/drm/card0/device/uevent");
    s.write("class/drm/card0/device/drm/renderD128/dev", "226:128\n");
    let mut b = s.backend();
    let devices = b.devices().unwrap();
    assert_eq!(devices[0].numa_node, None);
    let t = b.telemetry(&devices[0]).unwrap();
    assert_eq!(t.temperature_c, Some(34.0));
    assert_eq!(b.health(&devices[0]).unwrap(), RawHealth::Healthy);
}

#[test]
fn unsupported_sensors_are_absent() {
    // A device list from one tree asked of another with fewer sensors.
    let s = Scratch::of("mi210-2");
    for f in [
        "power1_average",
        "temp1_input",
        "temp1_label",
        "temp2_label",
        "temp3_label",
    ] {
        s.remove(&format!("class/drm/card1/device/hwmon/hwmon2/{f}"));
    }
    s.remove("class/drm/card1/device/gpu_busy_percent");
    let mut b = s.backend();
    let devices: Vec<DeviceInfo> = b.devices().unwrap();
    let t = b.telemetry(&devices[1]).unwrap();
    assert_eq!(t.temperature_c, None, "no labels and no temp1: none");
    assert_eq!(t.power_w, None);
    assert_eq!(t.utilization_percent, None);
    s.write(
        "class/drm/card1/device/hwmon/hwmon2/power1_input",
        "250000000\n",
    );
    assert_eq!(b.telemetry(&devices[1]).unwrap().power_w, Some(250.0));
}

/// On a node with AMD GPUs: `cargo test --test backend_amd -- --ignored`.
#[test]
#[ignore = "needs AMD GPUs and the amdgpu driver"]
fn real_hardware_snapshot() {
    let mut b = AmdBackend::new(DEFAULT_SYSFS_ROOT).expect("AMD backend on this node");
    let s = snapshot(&mut b).expect("snapshot");
    assert!(!s.devices.is_empty());
    for d in &s.devices {
        println!(
            "{} {} {} {} GiB {} CUs {:.1} TF {:.0} GB/s numa {:?}: {:?} {:?}",
            d.info.index,
            d.info.id,
            d.info.product,
            d.info.memory_total_bytes >> 30,
            d.info.compute_units,
            d.info.fp16_tflops,
            d.info.memory_bandwidth_gbps,
            d.info.numa_node,
            d.telemetry,
            d.health
        );
        assert!(d.telemetry.memory_used_bytes <= d.info.memory_total_bytes);
    }
    for l in &s.links {
        println!(
            "{} - {}: {:?} {} GB/s p2p {}",
            l.a, l.b, l.kind, l.bandwidth_gbps, l.p2p
        );
    }
    let n = s.devices.len();
    assert_eq!(s.links.len(), n * (n - 1) / 2, "every pair once");
    s.to_gpu_state(None).validate().expect("valid gpu-state");
}

#[cfg(feature = "rocm-smi")]
#[test]
#[ignore = "needs AMD GPUs, the amdgpu driver and librocm_smi64"]
fn real_hardware_rocm_smi() {
    let mut b = AmdBackend::new(DEFAULT_SYSFS_ROOT)
        .and_then(AmdBackend::with_rocm_smi)
        .expect("AMD backend with ROCm SMI");
    let devices = b.devices().unwrap();
    for d in &devices {
        let t = b.telemetry(d).unwrap();
        println!("{}: {t:?}", d.pci_bus_id);
        assert!(t.temperature_c.is_some() || t.power_w.is_some());
    }
}

#[test]
fn memory_bandwidth_fallbacks() {
    let s = Scratch::of("mi210-2");
    let bank = |node: u32| format!("{KFD}/{node}/mem_banks/0/properties");
    // A clock reported in another convention: the datasheet wins for a known product.
    s.set_prop(&bank(1), "mem_clk_max", "3200");
    // An unknown product and target: width × clock as double data rate.
    s.set_prop(&format!("{KFD}/2/properties"), "device_id", "4660");
    s.set_prop(
        &format!("{KFD}/2/properties"),
        "gfx_target_version",
        "120001",
    );
    s.set_prop(&bank(2), "mem_clk_max", "1000");
    let mut b = s.backend();
    let d = b.devices().unwrap();
    assert_eq!(d[0].memory_bandwidth_gbps, 1638.4, "MI210 datasheet");
    assert_eq!(
        d[1].memory_bandwidth_gbps, 1024.0,
        "4096 bit × 1000 MHz × 2 / 8"
    );
    assert_eq!(d[1].architecture, "gfx1201");
    assert_eq!(d[1].fp16_tflops, 181.0, "gfx12: 1024 FLOPs/CU/clock");
    // No width or clock at all: a deliberately low placeholder.
    s.set_prop(&bank(2), "width", "0");
    let d = b.devices().unwrap();
    assert_eq!(d[1].memory_bandwidth_gbps, 64.0);
    snapshot(&mut b)
        .unwrap()
        .to_gpu_state(None)
        .validate()
        .unwrap();
}
