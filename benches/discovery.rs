//! Discovery + telemetry of one node's 8 GPUs, through the real backend code:
//! the fake backend, and the NVML backend loading the mock NVML library
//! (`tests/fixtures/mock-nvml`, built here in release mode when missing).
//!
//! - `discover/fake_8`: a full snapshot (devices, telemetry, health, links).
//! - `discover/nvml_mock_8`: the same through NVML, library already loaded.
//! - `discover/nvml_mock_8_cold`: loading and initialising NVML plus a snapshot,
//!   what an agent start costs.
//! - `discover_real/nvml_<n>` and `discover_real/nvml_<n>_cold`: the same two
//!   against the node's own driver (`libnvidia-ml.so.1`) and its `<n>` GPUs; left
//!   out, with the reason printed, where NVML does not load.

use std::hint::black_box;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use criterion::{Criterion, SamplingMode, criterion_group, criterion_main};
use tessera::backend::fake::FakeBackend;
use tessera::backend::nvml::NvmlBackend;
use tessera::backend::snapshot;

fn mock_library() -> PathBuf {
    let exe = std::env::current_exe().expect("bench executable path");
    let profile_dir = exe
        .parent()
        .and_then(Path::parent)
        .expect("bench executable lives in target/<profile>/deps")
        .to_path_buf();
    if let Some(cargo) = std::env::var_os("CARGO") {
        let status = Command::new(cargo)
            .args([
                "build",
                "--offline",
                "--quiet",
                "--release",
                "-p",
                "tessera-mock-nvml",
            ])
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .status()
            .expect("run cargo to build the mock NVML library");
        assert!(status.success(), "building the mock NVML library failed");
    }
    let lib = profile_dir.join("libtessera_mock_nvml.so");
    assert!(lib.exists(), "{} is missing", lib.display());
    lib
}

fn discovery(c: &mut Criterion) {
    let mut group = c.benchmark_group("discover");
    group
        .sample_size(50)
        .measurement_time(Duration::from_secs(3));

    let mut fake = FakeBackend::new("8xH100-80GiB").expect("fake spec");
    group.bench_function("fake_8", |b| {
        b.iter(|| black_box(snapshot(&mut fake).expect("snapshot")))
    });

    // SAFETY: set before any NVML is loaded, and this process loads only the mock.
    unsafe { std::env::set_var("TESSERA_MOCK_NVML_PROFILE", "h100-sxm-8") };
    let lib = mock_library();
    let mut nvml = NvmlBackend::new(Some(lib.as_os_str())).expect("mock NVML loads");
    assert_eq!(snapshot(&mut nvml).expect("snapshot").devices.len(), 8);
    group.bench_function("nvml_mock_8", |b| {
        b.iter(|| black_box(snapshot(&mut nvml).expect("snapshot")))
    });
    drop(nvml);

    group.bench_function("nvml_mock_8_cold", |b| {
        b.iter(|| {
            let mut nvml = NvmlBackend::new(Some(lib.as_os_str())).expect("mock NVML loads");
            black_box(snapshot(&mut nvml).expect("snapshot"))
        })
    });
    group.finish();
}

fn real_nvml(c: &mut Criterion) {
    let mut nvml = match NvmlBackend::new(None) {
        Ok(nvml) => nvml,
        Err(e) => {
            println!("discover_real left out: {e}");
            return;
        }
    };
    let gpus = snapshot(&mut nvml).expect("snapshot").devices.len();
    let mut group = c.benchmark_group("discover_real");
    // The driver's own calls take milliseconds, and initialising it far longer.
    group
        .sample_size(10)
        .sampling_mode(SamplingMode::Flat)
        .measurement_time(Duration::from_secs(5));
    group.bench_function(format!("nvml_{gpus}"), |b| {
        b.iter(|| black_box(snapshot(&mut nvml).expect("snapshot")))
    });
    drop(nvml);
    group.bench_function(format!("nvml_{gpus}_cold"), |b| {
        b.iter(|| {
            let mut nvml = NvmlBackend::new(None).expect("NVML loads again");
            black_box(snapshot(&mut nvml).expect("snapshot"))
        })
    });
    group.finish();
}

// The real driver first: the mock's profile variable is set for the rest of the process.
criterion_group!(benches, real_nvml, discovery);
criterion_main!(benches);
