//! `tessera-core` stays pure: nothing that does Kubernetes I/O, runs an async
//! runtime or speaks gRPC or HTTP is among its dependencies, direct or indirect.
//! The compiler then keeps I/O out of the API types, the solver and the
//! translation, because the crates that could do it are not there to call.

use std::process::Command;

/// Crates that would mean I/O in the core: kube's client and runtime halves (the
/// core may use kube's types and derive macros only), async runtimes, gRPC, HTTP.
const FORBIDDEN: &[&str] = &[
    "kube-client",
    "kube-runtime",
    "tokio",
    "tonic",
    "hyper",
    "tower",
    "h2",
    "reqwest",
    "futures-executor",
];

/// The forbidden crates among `cargo tree --prefix none --format {p}` lines
/// (`name vX.Y.Z (source)`).
fn forbidden_in(tree: &str) -> Vec<String> {
    let mut found: Vec<String> = tree
        .lines()
        .filter_map(|line| line.split_whitespace().next())
        .filter(|name| FORBIDDEN.contains(name))
        .map(str::to_string)
        .collect();
    found.sort();
    found.dedup();
    found
}

#[test]
fn the_core_builds_without_kubernetes_io_an_async_runtime_or_grpc() {
    let output = Command::new(env!("CARGO"))
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .args([
            "tree",
            "--locked",
            "-p",
            "tessera-core",
            "-e",
            "normal,build",
            "--prefix",
            "none",
            "--format",
            "{p}",
        ])
        .output()
        .expect("cargo tree runs");
    assert!(
        output.status.success(),
        "cargo tree failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let tree = String::from_utf8_lossy(&output.stdout);
    assert!(
        tree.lines().any(|l| l.starts_with("tessera-core ")),
        "cargo tree did not list tessera-core:\n{tree}"
    );
    let found = forbidden_in(&tree);
    assert!(
        found.is_empty(),
        "tessera-core must stay free of I/O, but depends on {found:?} \
         (see `cargo tree -p tessera-core -i <crate>` for the path)"
    );
}

#[test]
fn the_check_names_a_forbidden_crate_and_only_that() {
    let tree = "tessera-core v0.1.0 (/x)\nserde v1.0.0\ntokio v1.40.0\ntokio-util v0.7.0\nkube-core v5.0.0\nkube-client v5.0.0\n";
    assert_eq!(forbidden_in(tree), vec!["kube-client", "tokio"]);
}
