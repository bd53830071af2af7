//! The committed CRD as a user installs it: `kubectl apply` (with kubectl's
//! client-side validation against the server's OpenAPI) on the real API server
//! named by `TESSERA_TEST_KUBECONFIG`, as a server-side dry run. A `null` among
//! an enum's values once made kubectl refuse the CRD on 1.24 servers.
//!
//! Needs `kubectl` on the PATH (or `KUBECTL` naming one); skipped, saying why,
//! without it or without the kubeconfig.

#[path = "common/real_cluster.rs"]
mod real_cluster;

use std::path::Path;
use std::process::Command;

use real_cluster::kubeconfig_path;

#[test]
fn kubectl_applies_the_committed_crd() {
    let Some(kubeconfig) = kubeconfig_path() else {
        return;
    };
    let kubectl = std::env::var("KUBECTL").unwrap_or_else(|_| "kubectl".to_string());
    let crd = Path::new(env!("CARGO_MANIFEST_DIR")).join("crds/modelinstance.yaml");
    let out = match Command::new(&kubectl)
        .arg("--kubeconfig")
        .arg(&kubeconfig)
        .args(["apply", "--dry-run=server", "-f"])
        .arg(&crd)
        .output()
    {
        Ok(out) => out,
        Err(e) => {
            println!("skipped: cannot run {kubectl}: {e}");
            return;
        }
    };
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "kubectl apply -f {} failed: {stderr}",
        crd.display()
    );
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("modelinstances.tessera.dev"),
        "{stderr}"
    );
}
