//! The library side of the `tessera` subcommands: their flags and how each
//! becomes its configuration (`flags`), reading input files, running the
//! library, rendering results. `main.rs` only parses and dispatches.

pub mod discover;
pub mod flags;
mod html;
pub mod input;
pub mod place;
mod place_moves;
mod render;

use std::fmt;

/// Bad input: one line a person can act on. The CLI exits with code 1.
#[derive(Debug, Clone, PartialEq)]
pub struct InputError(pub String);

impl fmt::Display for InputError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for InputError {}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    Text,
    Json,
}

/// Structured logs on stderr; `RUST_LOG` picks the level (default `warn`, so
/// command output stays readable).
pub fn init_logging(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr);
    // A second initialisation (tests calling in twice) keeps the first subscriber.
    let _ = match format {
        LogFormat::Text => builder.try_init(),
        LogFormat::Json => builder.json().try_init(),
    };
}
