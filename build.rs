//! Compiles the kubelet plugin APIs listed in [`PROTOS`] into Rust: messages,
//! servers and clients. Each kubelet-facing plugin adds its API to the list;
//! the generated code of each lands in the module its proto package names.
//! `protoc` comes from `protoc-bin-vendored`, so building needs no system
//! package; a `PROTOC` set in the environment still wins (for platforms the
//! vendored binaries do not cover).

use std::path::PathBuf;

/// The proto files, relative to [`INCLUDE`].
const PROTOS: &[&str] = &[
    // Device plugin v1beta1: `Registration` (kubelet's) and `DevicePlugin` (ours).
    "deviceplugin/v1beta1/api.proto",
    // DRA: kubelet's `Registration` (served by the plugin), `DRAPlugin` v1 and
    // v1beta1, and `DRAResourceHealth` (ours, all).
    "pluginregistration/v1/api.proto",
    "dra/v1/api.proto",
    "dra/v1beta1/api.proto",
    "dra-health/v1alpha1/api.proto",
    // Kubelet's PodResources `List` (a client: what kubelet says each pod holds).
    "podresources/v1/api.proto",
];
const INCLUDE: &str = "proto";

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-env-changed=PROTOC");
    let files: Vec<PathBuf> = PROTOS
        .iter()
        .map(|proto| PathBuf::from(INCLUDE).join(proto))
        .collect();
    for file in &files {
        println!("cargo:rerun-if-changed={}", file.display());
    }

    let mut config = tonic_prost_build::Config::new();
    if std::env::var_os("PROTOC").is_none() {
        match protoc_bin_vendored::protoc_bin_path() {
            Ok(path) => {
                config.protoc_executable(path);
            }
            Err(e) => fail(&format!(
                "no vendored protoc for this platform ({e}); set PROTOC to a protoc binary"
            )),
        }
    }
    let result = tonic_prost_build::configure()
        .build_server(true)
        .build_client(true)
        .compile_with_config(config, &files, &[PathBuf::from(INCLUDE)]);
    if let Err(e) = result {
        fail(&format!("compiling {}: {e}", PROTOS.join(", ")));
    }
}

fn fail(message: &str) -> ! {
    eprintln!("error: {message}");
    std::process::exit(1);
}
