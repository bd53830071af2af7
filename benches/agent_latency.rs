//! Health change → ListAndWatch update: a device's health flips in the agent's
//! view and the update reaches a kubelet-side client streaming `ListAndWatch`
//! over the real unix socket and gRPC server.
//!
//! This is the event path the agent adds on top of its GPU polling; end to end
//! a backend fault also waits for the next poll (`--poll-interval-ms`, 500 ms by
//! default, 50 ms at the least).

use std::hint::black_box;
use std::sync::Arc;
use std::time::Duration;

use criterion::{Criterion, criterion_group, criterion_main};
use tessera::agent::binding::NoBinder;
use tessera::agent::device_plugin::kubelet_api::v1beta1::Empty;
use tessera::agent::device_plugin::kubelet_api::v1beta1::device_plugin_client::DevicePluginClient;
use tessera::agent::device_plugin::registration::connect_unix;
use tessera::agent::device_plugin::server::{PluginServer, PluginService};
use tessera::agent::state::channel;
use tessera::backend::fake::FakeBackend;
use tessera::backend::{RawHealth, snapshot};

fn latency(c: &mut Criterion) {
    let rt = tokio::runtime::Runtime::new().expect("tokio runtime");
    let dir = std::env::temp_dir().join(format!("tessera-bench-latency-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("temp dir");
    let socket = dir.join("plugin.sock");

    let (tx, rx) = channel("fake");
    let mut backend = FakeBackend::new("8xH100-80GiB").expect("fake spec");
    let snap = snapshot(&mut backend).expect("snapshot");
    tx.send_modify(|v| {
        v.snapshot = snap;
        v.ready = true;
    });
    let service = PluginService::new(
        "tessera.dev/gpu",
        rx,
        tx.clone(),
        Arc::new(NoBinder),
        Default::default(),
    );
    let (server, mut stream) = rt.block_on(async {
        let server = PluginServer::start(&socket, service).await.expect("serve");
        let channel = connect_unix(&socket).await.expect("connect");
        let mut client = DevicePluginClient::new(channel);
        let mut stream = client
            .list_and_watch(Empty {})
            .await
            .expect("ListAndWatch")
            .into_inner();
        stream.message().await.expect("first list").expect("a list");
        (server, stream)
    });

    let mut healthy = true;
    c.bench_function("list_and_watch/health_change_8_devices", |b| {
        b.iter(|| {
            healthy = !healthy;
            let health = if healthy {
                RawHealth::Healthy
            } else {
                RawHealth::Unhealthy("Xid 79".into())
            };
            tx.send_modify(|v| v.snapshot.devices[3].health = health);
            let update = rt.block_on(async {
                tokio::time::timeout(Duration::from_secs(5), stream.message())
                    .await
                    .expect("update within 5 s")
                    .expect("stream open")
                    .expect("an update")
            });
            black_box(update)
        })
    });
    rt.block_on(server.stop());
    let _ = std::fs::remove_dir_all(&dir);
}

criterion_group!(benches, latency);
criterion_main!(benches);
