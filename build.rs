//! Compiles the kubelet device plugin API (`proto/deviceplugin/v1beta1/api.proto`)
//! into Rust: messages, the `Registration` and `DevicePlugin` servers and
//! clients. `protoc` comes from `protoc-bin-vendored`, so building needs no
//! system package; a `PROTOC` set in the environment still wins (for platforms
//! the vendored binaries do not cover).

use std::path::PathBuf;

const PROTO: &str = "proto/deviceplugin/v1beta1/api.proto";
const INCLUDE: &str = "proto";

fn main() {
    println!("cargo:rerun-if-changed={PROTO}");
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-env-changed=PROTOC");

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
        .compile_with_config(config, &[PathBuf::from(PROTO)], &[PathBuf::from(INCLUDE)]);
    if let Err(e) = result {
        fail(&format!("compiling {PROTO}: {e}"));
    }
}

fn fail(message: &str) -> ! {
    eprintln!("error: {message}");
    std::process::exit(1);
}
