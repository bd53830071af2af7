//! Helpers shared by the integration tests.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

/// `target/<profile>/libtessera_mock_nvml.so`, next to this test's `deps/`.
///
/// `cargo test` from the workspace root builds it (the fixture crate is a
/// default member), but `cargo test --test backend_nvml` builds only this test,
/// which could leave the library missing or stale. So when run by cargo (which
/// sets `CARGO`), the fixture is built first (`cargo build --offline -p
/// tessera-mock-nvml`, a no-op when up to date) with the test's profile.
pub(crate) fn mock_library() -> PathBuf {
    static LIBRARY: OnceLock<PathBuf> = OnceLock::new();
    LIBRARY
        .get_or_init(|| {
            let exe = std::env::current_exe().unwrap();
            let profile_dir = exe
                .parent()
                .and_then(Path::parent)
                .expect("test executable lives in target/<profile>/deps");
            if let Some(cargo) = std::env::var_os("CARGO") {
                let mut cmd = Command::new(cargo);
                cmd.args(["build", "--offline", "--quiet", "-p", "tessera-mock-nvml"])
                    .current_dir(env!("CARGO_MANIFEST_DIR"));
                match profile_dir.file_name().and_then(|n| n.to_str()) {
                    Some("debug") | None => {}
                    Some("release") => {
                        cmd.arg("--release");
                    }
                    Some(other) => {
                        cmd.args(["--profile", other]);
                    }
                }
                let out = cmd.output().unwrap();
                assert!(
                    out.status.success(),
                    "building the mock NVML library failed:\n{}",
                    String::from_utf8_lossy(&out.stderr)
                );
            }
            let lib = profile_dir.join("libtessera_mock_nvml.so");
            assert!(
                lib.exists(),
                "the mock NVML library {} is missing; run `cargo test` from the workspace root \
                 (it builds the tests/fixtures/mock-nvml crate), or `cargo build -p tessera-mock-nvml`",
                lib.display()
            );
            lib
        })
        .clone()
}
