//! Resident memory of the `tessera agent` process (this build's binary) with
//! 8 fake GPUs, as it runs on a node: registered with a kubelet stand-in
//! over its unix socket, one `ListAndWatch` stream open, a few allocations,
//! and its HTTP endpoints scraped. Prints the agent's VmRSS and peak (VmHWM),
//! and what a scrape of its /metrics (with the per-device series) takes;
//! run with `cargo bench --bench agent_memory`.

#[path = "../tests/common/kubelet.rs"]
mod kubelet;
#[allow(dead_code)]
mod support;

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_stream::StreamExt;

use kubelet::FakeKubelet;
use support::memory::status_kib;
use tessera::agent::device_plugin::kubelet_api::v1beta1::device_plugin_client::DevicePluginClient;
use tessera::agent::device_plugin::kubelet_api::v1beta1::{
    AllocateRequest, ContainerAllocateRequest, Empty,
};
use tessera::agent::device_plugin::registration::connect_unix;

const GPUS: &str = "8xH100-80GiB";
const SCRAPES: usize = 20;

async fn get(port: u16, path: &str) -> String {
    let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .expect("the agent's HTTP endpoint");
    let request = format!("GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n");
    s.write_all(request.as_bytes()).await.expect("a request");
    let mut text = String::new();
    s.read_to_string(&mut text).await.expect("an answer");
    text
}

#[tokio::main]
async fn main() {
    let dir = std::env::temp_dir().join(format!("tessera-agent-memory-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("a scratch directory");
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free loopback port");

    let mut kubelet = FakeKubelet::start(&dir);
    let mut agent = Command::new(env!("CARGO_BIN_EXE_tessera"))
        .args(["agent", "--backend", "fake", "--fake", GPUS, "--no-publish"])
        .arg("--plugin-dir")
        .arg(&dir)
        .arg("--registry")
        .arg(dir.join("registry.json"))
        .args(["--listen", &format!("127.0.0.1:{port}")])
        .env_remove("NODE_NAME")
        .env_remove("TESSERA_FAKE_GPUS")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("starting tessera agent");
    let pid = agent.id();

    let registration = kubelet.next_registration().await;
    let socket: PathBuf = dir.join(&registration.endpoint);
    let channel = connect_unix(&socket).await.expect("the plugin socket");
    let mut plugin = DevicePluginClient::new(channel);
    let mut stream = plugin
        .list_and_watch(Empty {})
        .await
        .expect("ListAndWatch")
        .into_inner();
    let devices: Vec<String> = match stream.next().await {
        Some(Ok(list)) => list.devices.into_iter().map(|d| d.id).collect(),
        other => panic!("no device list: {other:?}"),
    };
    assert_eq!(devices.len(), 8, "{devices:?}");
    for pair in devices.chunks(2) {
        plugin
            .allocate(AllocateRequest {
                container_requests: vec![ContainerAllocateRequest {
                    devices_ids: pair.to_vec(),
                }],
            })
            .await
            .expect("Allocate");
    }
    // Each scrape timed from connect to the last byte: what Prometheus waits.
    let mut took = Vec::with_capacity(SCRAPES);
    let mut size = 0;
    for _ in 0..SCRAPES {
        let started = std::time::Instant::now();
        let text = get(port, "/metrics").await;
        took.push(started.elapsed());
        assert!(text.contains("tessera_gpu_memory_used_bytes"), "{text}");
        size = text.len();
    }
    took.sort();
    assert!(get(port, "/readyz").await.starts_with("HTTP/1.1 200"));
    // A few polls of the GPUs after all that.
    tokio::time::sleep(Duration::from_secs(2)).await;

    let rss = status_kib(&pid.to_string(), "VmRSS:");
    let peak = status_kib(&pid.to_string(), "VmHWM:");
    eprintln!(
        "REPORT agent memory: {GPUS}, registered, 1 ListAndWatch stream, 4 allocations, \
         {SCRAPES} scrapes: VmRSS {:.1} MiB, peak {:.1} MiB",
        rss as f64 / 1024.0,
        peak as f64 / 1024.0
    );
    eprintln!(
        "REPORT agent scrape: {GPUS}, /metrics over loopback HTTP ({size} bytes): median {:.2} ms, max {:.2} ms",
        took[SCRAPES / 2].as_secs_f64() * 1e3,
        took[SCRAPES - 1].as_secs_f64() * 1e3
    );
    drop(stream);
    let _ = Command::new("kill")
        .args(["-TERM", &pid.to_string()])
        .status();
    let _ = agent.wait();
    kubelet.stop().await;
    let _ = std::fs::remove_dir_all(&dir);
    assert!(rss > 0, "could not read the agent's memory");
}
