//! `tessera discover`'s flags: this node's GPUs, or a summary of a cluster's.

use std::path::PathBuf;
use std::process::ExitCode;

use super::gpus::{BackendFlags, HealthFlags};
use crate::cli::discover::{DiscoverArgs, DiscoverOutput};

#[derive(clap::Args)]
pub struct DiscoverFlags {
    #[command(flatten)]
    gpus: BackendFlags,
    /// Device registry to read and update (keeps device IDs and probe results
    /// across runs); the agent uses /var/lib/tessera/registry.json.
    #[arg(long, value_name = "FILE")]
    registry: Option<PathBuf>,
    /// Also verify each device with CUDA and measure P2P access and bandwidth.
    #[arg(long)]
    probe: bool,
    /// `table`, or `json`: the exact NodeGpuState the agent publishes.
    #[arg(short, long, value_enum, default_value = "table")]
    output: DiscoverOutput,
    /// Refresh until interrupted.
    #[arg(long)]
    watch: bool,
    /// Seconds between refreshes with --watch.
    #[arg(long, value_name = "SECONDS", default_value = "2", value_parser = clap::value_parser!(u64).range(1..=3600))]
    interval: u64,
    #[command(flatten)]
    health: HealthFlags,
    /// Summarise these GPU states instead of this node: cluster descriptions,
    /// `kubectl get nodes -o yaml` output or `discover -o json` files.
    #[arg(long, value_name = "FILE", num_args = 1.., conflicts_with_all = ["probe", "watch", "backend"])]
    summary: Vec<PathBuf>,
}

impl DiscoverFlags {
    pub fn run(self) -> ExitCode {
        let Self {
            gpus,
            registry,
            probe,
            output,
            watch,
            interval,
            summary,
            health,
        } = self;
        let result = if summary.is_empty() {
            let args = DiscoverArgs {
                detect: gpus.options(),
                registry,
                probe,
                output,
                health: health.policy(),
            };
            crate::cli::discover::run(
                &args,
                watch.then(|| std::time::Duration::from_secs(interval)),
            )
        } else {
            crate::cli::discover::summary(&summary).map(|table| print!("{table}"))
        };
        match result {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("error: {e}");
                ExitCode::from(1)
            }
        }
    }
}
