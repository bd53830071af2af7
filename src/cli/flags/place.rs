//! `tessera place`'s flags and the report they run.

use std::path::PathBuf;
use std::process::ExitCode;

use super::values::fraction;
use crate::cli::place::{PlaceArgs, PlaceOutput};

#[derive(clap::Args)]
pub struct PlaceFlags {
    /// ModelInstance YAML file (several documents allowed; repeat the flag for
    /// more files; `-` reads stdin). Default: the built-in samples.
    #[arg(short = 'f', long = "instance", value_name = "FILE")]
    instances: Vec<PathBuf>,
    /// Cluster description: a `nodes:` list of NodeGpuStates with labels, or
    /// `kubectl get nodes -o yaml` output. Default: the built-in sample cluster.
    #[arg(short, long, value_name = "FILE")]
    cluster: Option<PathBuf>,
    /// Output format.
    #[arg(short, long, value_enum, default_value = "table")]
    output: PlaceOutput,
    /// Search steps the solver may spend per instance before it returns the
    /// best plan found (the instance's deadlineMs also applies).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    max_steps: Option<u64>,
    /// Once every instance is placed, show the moves that would take
    /// tessera's replicas off NODE, as for a cordoned node (repeat for more
    /// nodes); nothing is moved. Exit 2 when a replica would have to stay.
    #[arg(long, value_name = "NODE")]
    drain: Vec<String>,
    /// Once every instance is placed, show the move the controller's
    /// continuous moves would make: the one that raises the work served at
    /// the targets (requests/s × the work a request costs) the most, by more
    /// than FRACTION of what its replicas serve (0.2 without a value, as
    /// `--continuous-min-gain`). Nothing is moved.
    #[arg(long, value_name = "FRACTION", num_args = 0..=1, default_missing_value = "0.2", value_parser = fraction)]
    improve: Option<f64>,
    /// Plan an instance whose `spec.serving` target no GPUs here meet
    /// anyway, and show its best plan and curve marked as missing the
    /// target, instead of refusing it (exit 2 all the same).
    #[arg(long)]
    show_missed: bool,
}

impl PlaceFlags {
    pub fn run(self) -> ExitCode {
        let Self {
            instances,
            cluster,
            output,
            max_steps,
            drain,
            improve,
            show_missed,
        } = self;
        let args = PlaceArgs {
            instances,
            cluster,
            output,
            max_steps,
            drain,
            improve,
            show_missed,
        };
        match crate::cli::place::run(&args) {
            Ok(report) => {
                print!("{}", report.render(output));
                if report.all_placed() {
                    ExitCode::SUCCESS
                } else {
                    ExitCode::from(2)
                }
            }
            Err(e) => {
                eprintln!("error: {e}");
                ExitCode::from(1)
            }
        }
    }
}
