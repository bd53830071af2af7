//! The `tessera` command: parse the flags, run the subcommand, exit with its
//! code. The flags live in `tessera::cli::flags`, the work in the library.

use std::process::ExitCode;

use tessera::cli::flags::{self, Command};
use tessera::cli::init_logging;

// Why jemalloc: see its entry in Cargo.toml.
#[cfg(target_os = "linux")]
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

fn main() -> ExitCode {
    let cli = match flags::parse() {
        Ok(cli) => cli,
        Err(code) => return code,
    };
    init_logging(cli.log_format);
    match cli.command {
        Command::Crd => {
            print!("{}", tessera::api::crd_yaml());
            ExitCode::SUCCESS
        }
        Command::Agent(flags) => flags.run(),
        Command::Controller(flags) => flags.run(),
        Command::Discover(flags) => flags.run(),
        Command::Place(flags) => flags.run(),
    }
}
