//! Reaching the real API server that `TESSERA_TEST_KUBECONFIG` names, for the
//! tests that run against one (skipped, saying so, when it is not set).
//! Included with `#[path = "common/real_cluster.rs"] mod real_cluster;`.

// Each test binary uses only part of it.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, Patch, PatchParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Client, Config};
use tessera::api;

pub(crate) const ENV: &str = "TESSERA_TEST_KUBECONFIG";

/// The kubeconfig to test against; `None` (with the reason printed) skips the test.
pub(crate) fn kubeconfig_path() -> Option<PathBuf> {
    match std::env::var_os(ENV).filter(|p| !p.is_empty()) {
        Some(path) => Some(PathBuf::from(path)),
        None => {
            println!("skipped: {ENV} is not set");
            None
        }
    }
}

pub(crate) async fn load_config(path: &Path) -> Config {
    let kubeconfig = Kubeconfig::read_from(path)
        .unwrap_or_else(|e| panic!("{ENV}={}: cannot read the kubeconfig: {e}", path.display()));
    Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
        .await
        .unwrap_or_else(|e| panic!("{ENV}={}: unusable kubeconfig: {e}", path.display()))
}

/// Applies this build's ModelInstance CRD (server-side, forced: an installed
/// CRD of the same name is updated) and waits until it is established.
pub(crate) async fn install_crd(client: &Client) {
    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    let crd = api::crd();
    let name = crd.metadata.name.clone().unwrap_or_default();
    crds.patch(
        &name,
        &PatchParams::apply("tessera-test").force(),
        &Patch::Apply(&crd),
    )
    .await
    .unwrap_or_else(|e| panic!("applying the CRD {name}: {e}"));
    let limit = Duration::from_secs(90);
    let start = Instant::now();
    loop {
        let established = crds
            .get(&name)
            .await
            .ok()
            .and_then(|c| c.status?.conditions)
            .is_some_and(|c| {
                c.iter()
                    .any(|c| c.type_ == "Established" && c.status == "True")
            });
        if established {
            return;
        }
        assert!(
            start.elapsed() < limit,
            "the CRD {name} was not established in {limit:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// GET on a loopback HTTP/1.0 endpoint (a controller's /metrics or /readyz):
/// the whole response, headers included.
pub(crate) fn http_get(port: u16, path: &str) -> Option<String> {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(("127.0.0.1", port)).ok()?;
    stream.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    stream
        .write_all(format!("GET {path} HTTP/1.0\r\nHost: 127.0.0.1:{port}\r\n\r\n").as_bytes())
        .ok()?;
    let mut text = String::new();
    stream.read_to_string(&mut text).ok()?;
    Some(text)
}
