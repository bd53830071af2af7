//! Restarts a kube-apiserver running on this machine as a crash would: the
//! process named by a pid file is killed and started again with the same
//! command line, environment, working directory and log, and the pid file
//! names the new process. Killed rather than asked to stop because a 1.24
//! kube-apiserver asked to stop closes its listener at once but keeps its
//! open watches for about 30 s, which would blur how long it was away.

use std::ffi::OsString;
use std::os::unix::ffi::OsStringExt;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// A stopped process and how to start it again.
pub(crate) struct Stopped {
    pidfile: std::path::PathBuf,
    program: OsString,
    args: Vec<OsString>,
    environment: Vec<OsString>,
    cwd: std::path::PathBuf,
    log: Option<std::path::PathBuf>,
}

/// Reads how the process was started, then kills it and waits until it is
/// gone.
pub(crate) fn stop(pidfile: &Path) -> Result<Stopped, String> {
    let pid = std::fs::read_to_string(pidfile)
        .map_err(|e| format!("{}: {e}", pidfile.display()))?
        .trim()
        .parse::<u32>()
        .map_err(|e| format!("{}: not a pid: {e}", pidfile.display()))?;
    let proc = format!("/proc/{pid}");
    let split = |bytes: Vec<u8>| -> Vec<OsString> {
        bytes
            .split(|byte| *byte == 0)
            .filter(|part| !part.is_empty())
            .map(|part| OsString::from_vec(part.to_vec()))
            .collect()
    };
    let read = |what: &str| {
        std::fs::read(format!("{proc}/{what}")).map_err(|e| format!("{proc}/{what}: {e}"))
    };
    let argv = split(read("cmdline")?);
    let environment = split(read("environ")?);
    let cwd = std::fs::read_link(format!("{proc}/cwd")).map_err(|e| format!("{proc}/cwd: {e}"))?;
    let log = std::fs::read_link(format!("{proc}/fd/2")).ok();
    let (program, args) = argv
        .split_first()
        .ok_or_else(|| format!("{proc}: empty command line"))?;
    let stopped = Stopped {
        pidfile: pidfile.to_path_buf(),
        program: program.clone(),
        args: args.to_vec(),
        environment,
        cwd,
        log,
    };

    signal("KILL", pid)?;
    let started = Instant::now();
    while alive(&proc) {
        if started.elapsed() > Duration::from_secs(30) {
            return Err(format!("{proc} still there 30 s after SIGKILL"));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok(stopped)
}

impl Stopped {
    /// Starts the process again as it was; the pid file names the new one.
    pub(crate) fn start(self) -> Result<u32, String> {
        let Self {
            pidfile,
            program,
            args,
            environment,
            cwd,
            log,
        } = self;
        start(&pidfile, &program, &args, environment, cwd, &log)
    }
}

fn start(
    pidfile: &Path,
    program: &OsString,
    args: &[OsString],
    environment: Vec<OsString>,
    cwd: std::path::PathBuf,
    log: &Option<std::path::PathBuf>,
) -> Result<u32, String> {
    let output = |log: &Option<std::path::PathBuf>| match log {
        Some(path) => std::fs::OpenOptions::new()
            .append(true)
            .open(path)
            .map_or_else(|_| Stdio::null(), Stdio::from),
        None => Stdio::null(),
    };
    let mut command = Command::new(program);
    command
        .args(args)
        .env_clear()
        .current_dir(cwd)
        .stdin(Stdio::null())
        .stdout(output(log))
        .stderr(output(log))
        // Its own process group: it outlives this benchmark, as the original did.
        .process_group(0);
    for entry in environment {
        let entry = entry.to_string_lossy().into_owned();
        if let Some((key, value)) = entry.split_once('=') {
            command.env(key, value);
        }
    }
    let child = command
        .spawn()
        .map_err(|e| format!("starting {} again: {e}", program.to_string_lossy()))?;
    let new_pid = child.id();
    std::fs::write(pidfile, format!("{new_pid}\n"))
        .map_err(|e| format!("{}: {e}", pidfile.display()))?;
    Ok(new_pid)
}

/// Whether the process is there and not a zombie (one this process started
/// earlier, by a previous restart, stays a zombie until the run ends).
fn alive(proc: &str) -> bool {
    std::fs::read_to_string(format!("{proc}/stat")).is_ok_and(|stat| {
        // The state follows the command name, which is in parentheses.
        stat.rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().next())
            .is_some_and(|state| state != "Z")
    })
}

fn signal(name: &str, pid: u32) -> Result<(), String> {
    let status = Command::new("kill")
        .args([format!("-{name}"), pid.to_string()])
        .status()
        .map_err(|e| format!("kill -{name} {pid}: {e}"))?;
    // The process may have ended by itself meanwhile.
    if status.success() || !alive(&format!("/proc/{pid}")) {
        Ok(())
    } else {
        Err(format!("kill -{name} {pid} failed: {status}"))
    }
}
