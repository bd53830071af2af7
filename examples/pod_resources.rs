//! Prints what kubelet's PodResources API says each running container holds,
//! one JSON object a line (namespace, pod, container, source, device, and for
//! DRA the claim, pool and share ID), for the real-node end-to-end checks.
//!   cargo run --release --example pod-resources [-- SOCKET]
//! SOCKET defaults to kubelet's own. Exit code 1 with the reason on stderr
//! when kubelet cannot be asked.

use std::path::PathBuf;
use std::process::ExitCode;

use tessera::agent::pod_resources::{self, kubelet_api::DEFAULT_SOCKET};

#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    let socket = std::env::args_os()
        .nth(1)
        .map_or_else(|| PathBuf::from(DEFAULT_SOCKET), PathBuf::from);
    match pod_resources::list(&socket).await {
        Ok(rows) => {
            for row in rows {
                match serde_json::to_string(&row) {
                    Ok(line) => println!("{line}"),
                    Err(e) => {
                        eprintln!("error: {e}");
                        return ExitCode::from(1);
                    }
                }
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(1)
        }
    }
}
