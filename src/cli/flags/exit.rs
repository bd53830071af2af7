//! How a long-running subcommand's result becomes the exit code.

use std::process::ExitCode;

/// Runs `future` on a new async runtime: exit code 0 when it ends well, 1
/// with its error on stderr otherwise.
pub(crate) fn block_on<F: std::future::Future<Output = Result<(), E>>, E: std::fmt::Display>(
    future: F,
) -> ExitCode {
    match tokio::runtime::Runtime::new() {
        Ok(rt) => match rt.block_on(future) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("error: {e}");
                ExitCode::from(1)
            }
        },
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            ExitCode::from(1)
        }
    }
}
