//! The `tessera` command's flags, one file per subcommand (`place`, `agent`,
//! `controller`, `discover`), the pieces several share apart (`gpus`,
//! `values`, `exit`). Each subcommand's flags turn into the library's
//! configuration and run it; `main.rs` only parses and dispatches.

mod agent;
mod controller;
mod discover;
mod exit;
mod gpus;
mod place;
mod values;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

pub use agent::AgentFlags;
pub use controller::ControllerFlags;
pub use discover::DiscoverFlags;
pub use place::PlaceFlags;

use crate::cli::LogFormat;

/// Places large models across the GPUs of a Kubernetes cluster.
#[derive(Parser)]
#[command(name = "tessera", version)]
pub struct Cli {
    /// Log line format on stderr (level from RUST_LOG, default warn).
    #[arg(long, value_enum, default_value = "text", global = true)]
    pub log_format: LogFormat,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Subcommand)]
pub enum Command {
    /// Plan ModelInstances on a cluster description, without a cluster.
    ///
    /// With no files, plans the built-in sample: three Llama-class models on a
    /// mixed NVIDIA + AMD cluster of four nodes. Exit code 0 when every instance
    /// has a plan, 2 when one is unsatisfiable, 1 for bad input.
    Place(PlaceFlags),
    /// Print the ModelInstance CustomResourceDefinition as YAML.
    Crd,
    /// Run the node agent (DaemonSet): kubelet device plugin, GPU health, and the
    /// node's GPU state published on its Node object.
    Agent(Box<AgentFlags>),
    /// Run the controller (Deployment): reconcile ModelInstances into placed
    /// shard pods bound to their planned nodes and devices.
    Controller(ControllerFlags),
    /// List this node's GPUs as the node agent sees them, or summarise the GPU
    /// states of a whole cluster (`--summary`).
    Discover(DiscoverFlags),
}

/// The command line, or the exit code when there is nothing to run: 0 after
/// help or the version, 1 for bad input, told the way all bad input is told
/// (one line on stderr).
pub fn parse() -> Result<Cli, ExitCode> {
    match Cli::try_parse() {
        Ok(cli) => Ok(cli),
        Err(e) if !e.use_stderr() => {
            let _ = e.print();
            Err(ExitCode::SUCCESS)
        }
        Err(e) => {
            let text = e.render().to_string();
            // An enum flag's choices are on a line of their own.
            let choices = text
                .lines()
                .find_map(|l| l.trim().strip_prefix("[possible values: "))
                .and_then(|l| l.strip_suffix(']'))
                .map(|values| format!("; expected one of: {values}"))
                .unwrap_or_default();
            match text.lines().find(|l| l.starts_with("error:")) {
                Some(line) => eprintln!("{line}{choices} (see --help)"),
                None => eprintln!(
                    "error: a subcommand is required: place, discover, agent, controller or crd (see --help)"
                ),
            }
            Err(ExitCode::from(1))
        }
    }
}
