//! `tessera agent` as a process: with fake GPUs and no API server
//! (`--no-publish`) it serves the device plugin socket and its HTTP endpoints,
//! is not ready until kubelet registers it, and on SIGTERM stops and removes
//! its socket. Flag errors are one line and exit code 1.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

struct Agent {
    child: Child,
    dir: PathBuf,
}

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A plain HTTP/1.1 GET on loopback; returns (status, body).
fn get(port: u16, path: &str) -> Option<(u16, String)> {
    let mut s = TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut text = String::new();
    s.read_to_string(&mut text).ok()?;
    let status = text.split_whitespace().nth(1)?.parse().ok()?;
    let body = text.split_once("\r\n\r\n").map(|(_, b)| b.to_string())?;
    Some((status, body))
}

fn wait_for(what: &str, mut f: impl FnMut() -> bool) {
    let until = Instant::now() + Duration::from_secs(15);
    while Instant::now() < until {
        if f() {
            return;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    panic!("timed out waiting for {what}");
}

fn start(dir: &Path, port: u16) -> Agent {
    start_with(dir, port, "2xH100-80GiB", &[])
}

fn start_with(dir: &Path, port: u16, fake: &str, extra: &[&str]) -> Agent {
    std::fs::create_dir_all(dir.join("plugins")).unwrap();
    let child = Command::new(env!("CARGO_BIN_EXE_tessera"))
        .args(["agent", "--backend", "fake", "--fake", fake, "--no-publish"])
        .args(extra)
        .arg("--plugin-dir")
        .arg(dir.join("plugins"))
        .arg("--registry")
        .arg(dir.join("registry.json"))
        .args(["--listen", &format!("127.0.0.1:{port}")])
        .env_remove("NODE_NAME")
        .env_remove("TESSERA_FAKE_GPUS")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    Agent {
        child,
        dir: dir.to_path_buf(),
    }
}

#[test]
fn serves_endpoints_and_its_socket_and_stops_cleanly_on_sigterm() {
    let dir = std::env::temp_dir().join(format!("tessera-agent-bin-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let port = free_port();
    let mut agent = start(&dir, port);
    let socket = dir.join("plugins/tessera-tessera-dev-gpu.sock");

    wait_for("/healthz", || {
        get(port, "/healthz").is_some_and(|(s, _)| s == 200)
    });
    wait_for("the plugin socket", || socket.exists());
    // No kubelet here: GPUs are read, but the agent is not registered.
    let (status, body) = get(port, "/readyz").unwrap();
    assert_eq!(status, 503, "{body}");
    assert!(body.contains("kubelet"), "{body}");
    let (status, metrics) = get(port, "/metrics").unwrap();
    assert_eq!(status, 200);
    assert!(
        metrics.contains("tessera_agent_devices{health=\"healthy\"} 2"),
        "{metrics}"
    );
    wait_for("the registry", || dir.join("registry.json").exists());

    let pid = agent.child.id().to_string();
    assert!(
        Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .unwrap()
            .success()
    );
    let until = Instant::now() + Duration::from_secs(15);
    let code = loop {
        if let Some(status) = agent.child.try_wait().unwrap() {
            break status.code();
        }
        assert!(Instant::now() < until, "the agent did not stop on SIGTERM");
        std::thread::sleep(Duration::from_millis(50));
    };
    assert_eq!(code, Some(0));
    assert!(!socket.exists(), "the plugin socket is removed on shutdown");
}

#[test]
fn a_per_vendor_resource_name_takes_the_nodes_vendor() {
    let dir = std::env::temp_dir().join(format!("tessera-agent-bin-amd-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let port = free_port();
    let _agent = start_with(
        &dir,
        port,
        "2xMI300X-192GiB",
        &["--resource-name", "tessera.dev/{vendor}-gpu"],
    );
    let socket = dir.join("plugins/tessera-tessera-dev-amd-gpu.sock");
    wait_for("the AMD resource's plugin socket", || socket.exists());
}

/// The device counts by health in the agent's metrics: (healthy, unhealthy).
fn health_counts(port: u16) -> Option<(u32, u32)> {
    let (_, metrics) = get(port, "/metrics")?;
    let count = |health: &str| -> Option<u32> {
        let key = format!("tessera_agent_devices{{health=\"{health}\"}} ");
        metrics
            .lines()
            .find_map(|l| l.strip_prefix(key.as_str()))?
            .trim()
            .parse()
            .ok()
    };
    Some((count("healthy")?, count("unhealthy")?))
}

#[test]
fn a_fake_directory_is_read_per_node_and_follows_a_configmap_update() {
    use std::os::unix::fs::symlink;
    let dir = std::env::temp_dir().join(format!("tessera-agent-bin-dir-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    // A ConfigMap volume as kubelet lays it out: keys are symlinks into
    // `..data`, itself a symlink to the current version's directory.
    let profiles = dir.join("profiles");
    let version = |name: &str, worker: &str| {
        let v = profiles.join(name);
        std::fs::create_dir_all(&v).unwrap();
        std::fs::write(v.join("default.yaml"), "gpus: [{profile: L4-24GiB}]\n").unwrap();
        std::fs::write(v.join("kind-worker.yaml"), worker).unwrap();
    };
    version("..v1", "gpus: [{profile: H100-80GiB, count: 2}]\n");
    symlink("..v1", profiles.join("..data")).unwrap();
    for key in ["default.yaml", "kind-worker.yaml"] {
        symlink(format!("..data/{key}"), profiles.join(key)).unwrap();
    }
    let port = free_port();
    let _agent = start_with(
        &dir,
        port,
        profiles.to_str().unwrap(),
        &["--node-name", "kind-worker", "--poll-interval-ms", "50"],
    );
    wait_for("two healthy H100s from kind-worker.yaml", || {
        health_counts(port) == Some((2, 0))
    });

    // The ConfigMap is edited: a fault on device 1, swapped in like kubelet does.
    version(
        "..v2",
        "gpus: [{profile: H100-80GiB, count: 2}]\nfaults: [{device: 1, unhealthy: Xid 79}]\n",
    );
    symlink("..v2", profiles.join("..data_tmp")).unwrap();
    std::fs::rename(profiles.join("..data_tmp"), profiles.join("..data")).unwrap();
    std::fs::remove_dir_all(profiles.join("..v1")).unwrap();
    wait_for("device 1 unhealthy", || health_counts(port) == Some((1, 1)));
}

#[test]
fn missing_node_name_and_bad_flags_are_one_line_errors() {
    let empty =
        std::env::temp_dir().join(format!("tessera-agent-bin-empty-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&empty);
    std::fs::create_dir_all(&empty).unwrap();
    let empty_dir = empty.to_str().unwrap();
    let registry = empty.join("registry.json").to_str().unwrap().to_string();
    for (args, want) in [
        (
            vec!["agent", "--backend", "fake", "--fake", "1xL4-24GiB"],
            "NODE_NAME",
        ),
        (vec!["agent", "--listen", "not-an-address"], "--listen"),
        (vec!["agent", "--memory-shares=maybe"], "--memory-shares"),
        (
            vec!["agent", "--poll-interval-ms", "1"],
            "--poll-interval-ms",
        ),
        (
            vec!["agent", "--no-publish", "--backend", "fake"],
            "no fake devices configured",
        ),
        (
            vec![
                "agent",
                "--no-publish",
                "--backend",
                "fake",
                "--node-name",
                "kind-worker",
                "--fake",
                empty_dir,
            ],
            "kind-worker.yaml nor",
        ),
        (
            vec!["agent", "--resource-name", "gpu"],
            "invalid value 'gpu' for '--resource-name <NAME>': must be <domain>/<name>",
        ),
        (
            vec!["agent", "--resource-name", "kubernetes.io/gpu"],
            "reserved for native resources",
        ),
        (
            vec!["agent", "--allocation", "sometimes"],
            "invalid value 'sometimes' for '--allocation <MODE>'",
        ),
        (
            vec!["agent", "--dra-driver-name", "GPU.Tessera.dev"],
            "\"GPU.Tessera.dev\" is not a DRA driver name",
        ),
        (
            vec![
                "agent",
                "--no-publish",
                "--backend",
                "fake",
                "--fake",
                "1xL4-24GiB",
                "--allocation",
                "dra",
                "--registry",
                &registry,
                "--listen",
                "127.0.0.1:0",
            ],
            "--allocation dra needs the API server",
        ),
        (
            vec![
                "agent",
                "--no-publish",
                "--backend",
                "fake",
                "--fake",
                "1xH100-80GiB,1xMI300X-192GiB",
                "--resource-name",
                "tessera.dev/{vendor}-gpu",
                "--registry",
                &registry,
                "--listen",
                "127.0.0.1:0",
            ],
            "has GPUs of nvidia and amd; use a name without {vendor} on mixed nodes",
        ),
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_tessera"))
            .args(&args)
            .env_remove("NODE_NAME")
            .env_remove("TESSERA_FAKE_GPUS")
            .output()
            .unwrap();
        let stderr = String::from_utf8(out.stderr).unwrap();
        assert_eq!(out.status.code(), Some(1), "{args:?}: {stderr}");
        let lines: Vec<&str> = stderr.lines().collect();
        assert!(
            lines.len() == 1 && lines[0].starts_with("error: "),
            "{args:?}: {stderr}"
        );
        assert!(stderr.contains(want), "{args:?}: {stderr}");
    }
    let _ = std::fs::remove_dir_all(&empty);
}
