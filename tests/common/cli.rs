//! Helpers for the tests that run the `tessera` binary: scratch directories,
//! reading a finished run, and the bad-input contract (exit 1, nothing on
//! stdout, one `error: ` line). Included with `#[path = "common/cli.rs"] mod cli;`.

// Each test binary uses only part of it.
#![allow(dead_code)]

use std::io::Write;
use std::path::PathBuf;
use std::process::{Command, Output, Stdio};

/// A scratch directory under the system temp dir, removed when dropped.
pub(crate) struct Scratch(pub PathBuf);

impl Scratch {
    /// `<temp>/tessera-<suite>-<test>-<pid>`, empty.
    pub(crate) fn new(suite: &str, test: &str) -> Self {
        let dir =
            std::env::temp_dir().join(format!("tessera-{suite}-{test}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("create scratch dir");
        Scratch(dir)
    }

    /// Writes a fixture file and returns its path as a string for the command line.
    pub(crate) fn file(&self, name: &str, text: &str) -> String {
        let path = self.0.join(name);
        std::fs::write(&path, text).expect("write fixture");
        path.display().to_string()
    }

    pub(crate) fn path(&self, name: &str) -> String {
        self.0.join(name).display().to_string()
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// (exit code, stdout, stderr) of a finished run; fails on a panic or a
/// run killed by a signal.
pub(crate) fn finish(args: &[&str], out: Output) -> (i32, String, String) {
    let stdout = String::from_utf8(out.stdout).expect("stdout is UTF-8");
    let stderr = String::from_utf8(out.stderr).expect("stderr is UTF-8");
    assert!(
        !stdout.contains("panicked") && !stderr.contains("panicked"),
        "tessera {args:?} panicked:\n{stderr}"
    );
    let code = out.status.code().expect("tessera exited, not killed");
    (code, stdout, stderr)
}

/// Bad input: exit 1, nothing on stdout, one `error: ` line naming every `needle`.
pub(crate) fn assert_bad_input_result(
    args: &[&str],
    result: (i32, String, String),
    needles: &[&str],
) {
    let (code, stdout, stderr) = result;
    assert_eq!(code, 1, "tessera {args:?}: exit code\nstderr: {stderr}");
    assert!(
        stdout.is_empty(),
        "tessera {args:?}: stdout not empty:\n{stdout}"
    );
    let lines: Vec<&str> = stderr.lines().collect();
    assert!(
        lines.len() == 1 && lines[0].starts_with("error: "),
        "tessera {args:?}: stderr is not one `error: ` line:\n{stderr}"
    );
    for needle in needles {
        assert!(
            stderr.contains(needle),
            "tessera {args:?}: {stderr:?} lacks {needle:?}"
        );
    }
}

/// Runs the built binary; returns (exit code, stdout, stderr).
pub(crate) fn run(args: &[&str], stdin: Option<&str>) -> (i32, String, String) {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_tessera"));
    cmd.args(args)
        .env_remove("RUST_LOG")
        .stdin(if stdin.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = cmd.spawn().expect("start the tessera binary");
    if let Some(text) = stdin {
        let mut pipe = child.stdin.take().expect("stdin is piped");
        pipe.write_all(text.as_bytes()).expect("write stdin");
    }
    let out = child.wait_with_output().expect("wait for tessera");
    finish(args, out)
}

/// Bad input: exit 1, nothing on stdout, one `error: ` line naming every `needle`.
pub(crate) fn assert_bad_input(args: &[&str], stdin: Option<&str>, needles: &[&str]) {
    assert_bad_input_result(args, run(args, stdin), needles);
}

/// A minimal valid ModelInstance; `extra_spec` lines go under `spec:`.
pub(crate) fn instance(model: &str, extra_spec: &str) -> String {
    format!(
        "apiVersion: tessera.dev/v1alpha1\nkind: ModelInstance\nmetadata: {{name: m}}\nspec:\n  model: {{{model}}}\n{extra_spec}"
    )
}
