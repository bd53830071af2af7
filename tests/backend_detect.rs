//! Backend detection: the `auto` order (NVIDIA, AMD, fake if configured), the
//! explicit override, and a node with both vendors merged into one list —
//! through the real backends, against the mock NVML library and the AMD sysfs
//! fixtures.

use std::path::PathBuf;
use std::sync::Mutex;

use tessera::backend::detect::{BackendChoice, DetectOptions, detect};
use tessera::backend::{BackendError, snapshot};

mod common;
use common::mock_library;

/// The mock NVML reads its profile from the environment when it initialises.
static LOCK: Mutex<()> = Mutex::new(());

fn amd_fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/amd")
        .join(name)
}

fn options(
    choice: BackendChoice,
    nvml: Option<PathBuf>,
    amd: PathBuf,
    fake: Option<&str>,
) -> DetectOptions {
    DetectOptions {
        choice,
        nvml_library: nvml.map(PathBuf::into_os_string),
        sysfs_root: amd,
        fake: fake.map(str::to_string),
        node_name: None,
    }
}

fn missing_nvml() -> Option<PathBuf> {
    Some(PathBuf::from("/nonexistent/libnvidia-ml.so.1"))
}

fn no_amd() -> PathBuf {
    PathBuf::from("/nonexistent/sys")
}

fn with_mock<T>(profile: &str, f: impl FnOnce(PathBuf) -> T) -> T {
    let _guard = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    // SAFETY: every test in this file that loads the mock holds LOCK.
    unsafe {
        std::env::set_var("TESSERA_MOCK_NVML_PROFILE", profile);
        std::env::remove_var("TESSERA_MOCK_NVML_CONTROL");
    }
    f(mock_library())
}

#[test]
fn auto_merges_nvidia_and_amd_on_one_node() {
    with_mock("a100-pcie-4", |lib| {
        let mut b = detect(&options(
            BackendChoice::Auto,
            Some(lib),
            amd_fixture("mi210-2"),
            Some("2xL4-24GiB"),
        ))
        .unwrap();
        assert_eq!(b.name(), "nvml+amd");
        let s = snapshot(b.as_mut()).unwrap();
        let vendors: Vec<String> = s
            .devices
            .iter()
            .map(|d| d.info.vendor.to_string())
            .collect();
        assert_eq!(
            vendors,
            ["nvidia", "nvidia", "nvidia", "nvidia", "amd", "amd"]
        );
        let indices: Vec<u32> = s.devices.iter().map(|d| d.info.index).collect();
        assert_eq!(
            indices,
            [0, 1, 2, 3, 4, 5],
            "indices are renumbered across backends"
        );
        // Links stay inside each vendor: 6 pairs among the A100s, 1 between the MI210s.
        assert_eq!(s.links.len(), 7);
        for d in &s.devices {
            assert!(
                d.telemetry.memory_free_bytes > 0,
                "{} has telemetry",
                d.info.id
            );
        }
        s.to_gpu_state(None).validate().unwrap();
    });
}

#[test]
fn auto_takes_nvidia_alone_when_there_is_no_amd() {
    with_mock("h100-sxm-8", |lib| {
        let b = detect(&options(
            BackendChoice::Auto,
            Some(lib),
            no_amd(),
            Some("2xL4-24GiB"),
        ))
        .unwrap();
        assert_eq!(b.name(), "nvml");
    });
}

#[test]
fn auto_falls_to_amd_then_fake() {
    let mut b = detect(&options(
        BackendChoice::Auto,
        missing_nvml(),
        amd_fixture("mi300x-8"),
        Some("2xL4-24GiB"),
    ))
    .unwrap();
    assert_eq!(b.name(), "amd");
    assert_eq!(b.devices().unwrap().len(), 8);

    let b = detect(&options(
        BackendChoice::Auto,
        missing_nvml(),
        no_amd(),
        Some("2xL4-24GiB"),
    ))
    .unwrap();
    assert_eq!(b.name(), "fake");
}

#[test]
fn auto_with_nothing_says_why_for_each_backend() {
    let err = detect(&options(
        BackendChoice::Auto,
        missing_nvml(),
        no_amd(),
        None,
    ))
    .err()
    .unwrap();
    let text = err.to_string();
    assert!(matches!(err, BackendError::Unavailable(_)));
    assert!(
        text.contains("no GPU backend applies to this node"),
        "{text}"
    );
    assert!(
        text.contains("nvidia: ") && text.contains("/nonexistent/libnvidia-ml.so.1"),
        "{text}"
    );
    assert!(text.contains("amd: ") && text.contains("KFD"), "{text}");
}

#[test]
fn an_explicit_choice_is_used_or_fails_with_its_reason() {
    // Fake is configured, but the operator asked for NVIDIA.
    let err = detect(&options(
        BackendChoice::Nvidia,
        missing_nvml(),
        amd_fixture("mi210-2"),
        Some("2xL4-24GiB"),
    ))
    .err()
    .unwrap()
    .to_string();
    assert!(err.contains("runtimeClassName"), "{err}");

    let b = detect(&options(
        BackendChoice::Amd,
        missing_nvml(),
        amd_fixture("mi210-2"),
        None,
    ))
    .unwrap();
    assert_eq!(b.name(), "amd");

    let err = detect(&options(BackendChoice::Fake, None, no_amd(), None))
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("no fake devices configured"), "{err}");

    let err = detect(&options(
        BackendChoice::Fake,
        None,
        no_amd(),
        Some("3xQuantum"),
    ))
    .err()
    .unwrap()
    .to_string();
    assert!(err.contains("unknown profile"), "{err}");

    with_mock("h100-sxm-8", |lib| {
        let b = detect(&options(
            BackendChoice::Nvidia,
            Some(lib),
            amd_fixture("mi210-2"),
            None,
        ))
        .unwrap();
        assert_eq!(b.name(), "nvml", "no merge when a backend is chosen");
    });
}
