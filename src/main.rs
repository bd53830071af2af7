//! The `tessera` command: flag parsing only; the work lives in the library.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use tessera::cli::place::{Output, PlaceArgs};
use tessera::cli::{LogFormat, init_logging};

/// Places large models across the GPUs of a Kubernetes cluster.
#[derive(Parser)]
#[command(name = "tessera", version)]
struct Cli {
    /// Log line format on stderr (level from RUST_LOG, default warn).
    #[arg(long, value_enum, default_value = "text", global = true)]
    log_format: LogFormat,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Plan ModelInstances on a cluster description, without a cluster.
    ///
    /// With no files, plans the built-in sample: three Llama-class models on a
    /// mixed NVIDIA + AMD cluster of four nodes. Exit code 0 when every instance
    /// has a plan, 2 when one is unsatisfiable, 1 for bad input.
    Place {
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
        output: Output,
        /// Search steps the solver may spend per instance before it returns the
        /// best plan found (the instance's deadlineMs also applies).
        #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
        max_steps: Option<u64>,
    },
    /// Print the ModelInstance CustomResourceDefinition as YAML.
    Crd,
}

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        // Help and version are not errors; every other parse problem is bad input,
        // reported like all bad input: one line, exit code 1.
        Err(e) if !e.use_stderr() => {
            let _ = e.print();
            return ExitCode::SUCCESS;
        }
        Err(e) => {
            let text = e.render().to_string();
            match text.lines().find(|l| l.starts_with("error:")) {
                Some(line) => eprintln!("{line} (see --help)"),
                None => eprintln!("error: a subcommand is required: place or crd (see --help)"),
            }
            return ExitCode::from(1);
        }
    };
    init_logging(cli.log_format);
    match cli.command {
        Command::Crd => {
            print!("{}", tessera::api::crd_yaml());
            ExitCode::SUCCESS
        }
        Command::Place {
            instances,
            cluster,
            output,
            max_steps,
        } => {
            let args = PlaceArgs {
                instances,
                cluster,
                output,
                max_steps,
            };
            match tessera::cli::place::run(&args) {
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
}
