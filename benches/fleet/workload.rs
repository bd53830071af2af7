//! The instances that arrive and leave, and the real `tessera controller`
//! process that places them.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use kube::api::{Api, DeleteParams, PostParams};
use serde_json::json;
use tessera::api::ModelInstance;
use tokio::time::Instant;

use crate::kubelet::Bindings;
use crate::nodes::{RUN_LABEL, TAINT_KEY};

/// Model classes: (name suffix, parameters in billions, layers, hidden size,
/// KV cache GiB, tensor size, share of arrivals).
const CLASSES: [(&str, f64, u32, u32, f64, u32, u32); 3] = [
    ("8b", 8.0, 32, 4096, 8.0, 1, 70),
    ("70b", 70.6, 80, 8192, 20.0, 2, 25),
    ("405b", 405.0, 126, 16384, 40.0, 8, 5),
];

pub(crate) fn class_weights() -> Vec<(usize, u32)> {
    CLASSES
        .iter()
        .enumerate()
        .map(|(index, class)| (index, class.6))
        .collect()
}

/// A ModelInstance of class `class`, confined to this run's nodes.
pub(crate) fn instance(
    name_prefix: &str,
    serial: usize,
    class: usize,
    namespace: &str,
    run: &str,
) -> ModelInstance {
    let (suffix, billions, layers, hidden, kv, tensor, _) = CLASSES[class % CLASSES.len()];
    serde_json::from_value(json!({
        "apiVersion": "tessera.dev/v1alpha1",
        "kind": "ModelInstance",
        "metadata": {"name": format!("{name_prefix}-{serial:05}-{suffix}"), "namespace": namespace},
        "spec": {
            "model": {"name": format!("fleet/{suffix}"), "parametersBillions": billions, "layers": layers,
                      "dtype": "bf16", "hiddenSize": hidden, "kvCacheGiB": kv, "overheadGiB": 1.5},
            "parallelism": {"tensor": tensor, "pipeline": "auto"},
            "placement": {"nodeSelector": {RUN_LABEL: run}},
            "template": {"spec": {
                "containers": [{"name": "shard", "image": "busybox:1.37"}],
                "tolerations": [{"key": TAINT_KEY, "operator": "Exists", "effect": "NoSchedule"}],
            }},
        },
    }))
    .expect("a valid ModelInstance")
}

/// Creates `mi` and waits until every planned shard is bound; returns the
/// time that took (`None` when it did not happen within `limit`).
pub(crate) async fn create_and_wait(
    api: &Api<ModelInstance>,
    mi: &ModelInstance,
    bindings: &Bindings,
    limit: Duration,
) -> Option<Duration> {
    let name = mi.metadata.name.clone().unwrap_or_default();
    let started = Instant::now();
    let mut attempt = 1;
    while let Err(e) = api.create(&PostParams::default(), mi).await {
        // API servers before 1.24.10 / 1.25.6 / 1.26.1 can fail a CEL rule
        // under concurrent requests ("internal error: runtime error: index out
        // of range", kubernetes#114661); a retry is evaluated afresh.
        if attempt >= 5 || !e.to_string().contains("internal error") {
            eprintln!("creating {name}: {e}");
            return None;
        }
        attempt += 1;
    }
    all_bound(api, &name, bindings, started, limit, &[]).await
}

/// Waits until the instance has a plan and a bound pod for every planned
/// shard, none of them on `avoid` devices.
pub(crate) async fn all_bound(
    api: &Api<ModelInstance>,
    name: &str,
    bindings: &Bindings,
    started: Instant,
    limit: Duration,
    avoid: &[String],
) -> Option<Duration> {
    let mut shards = 0;
    while started.elapsed() < limit {
        if shards == 0
            && let Ok(mi) = api.get(name).await
        {
            shards = mi.status.map_or(0, |status| status.plan.len());
        }
        let bound = bindings.of_instance(name);
        let clear = bound
            .iter()
            .all(|pod| !pod.devices.iter().any(|device| avoid.contains(device)));
        if shards > 0 && bound.len() >= shards && clear {
            let last = bound.iter().map(|pod| pod.at).max()?;
            return Some(last.saturating_duration_since(started));
        }
        tokio::time::sleep(Duration::from_millis(if shards == 0 { 50 } else { 5 })).await;
    }
    None
}

pub(crate) async fn delete(api: &Api<ModelInstance>, name: &str) {
    if let Err(e) = api.delete(name, &DeleteParams::default()).await {
        eprintln!("deleting {name}: {e}");
    }
}

/// A `tessera controller` process (this build), killed when dropped.
pub(crate) struct ControllerProcess {
    child: Child,
    pub(crate) port: u16,
    pub(crate) log: PathBuf,
}

impl ControllerProcess {
    pub(crate) fn start(
        kubeconfig: &Path,
        namespace: &str,
        initial_list: &str,
        dra: bool,
        extra: &[&str],
        log: PathBuf,
    ) -> Self {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|listener| listener.local_addr())
            .map(|address| address.port())
            .expect("a free loopback port");
        let file = std::fs::File::create(&log).expect("a log file for the controller");
        let child = Command::new(env!("CARGO_BIN_EXE_tessera"))
            .args(["controller", "--kubeconfig"])
            .arg(kubeconfig)
            .args(["--namespace", namespace, "--leader-elect=false"])
            .args(["--listen", &format!("127.0.0.1:{port}")])
            .args(["--initial-list", initial_list])
            .args(["--allocation", if dra { "dra" } else { "device-plugin" }])
            .args(extra)
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(file)
            .spawn()
            .expect("starting tessera controller");
        Self { child, port, log }
    }

    pub(crate) fn running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    pub(crate) fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Waits for /readyz (caches synced).
    pub(crate) async fn ready(&self, limit: Duration) -> bool {
        let started = Instant::now();
        while started.elapsed() < limit {
            if crate::real_cluster::http_get(self.port, "/readyz")
                .is_some_and(|r| r.contains(" 200 "))
            {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        false
    }
}

impl Drop for ControllerProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
