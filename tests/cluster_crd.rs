//! The committed CRD and the Helm chart as a user installs them, on the real API
//! server named by `TESSERA_TEST_KUBECONFIG`: `kubectl apply` (with kubectl's
//! validation against the server's OpenAPI) as a server-side dry run, failing
//! on any warning the API server sends back. A `null` among an
//! enum's values once made kubectl refuse the CRD on 1.24 servers; API servers
//! from 1.33 on warned about every format Kubernetes does not define.
//!
//! Needs `kubectl` on the PATH (or `KUBECTL` naming one), and `helm` (or `HELM`)
//! for the chart; skipped, saying why, without them or without the kubeconfig.

#[path = "common/real_cluster.rs"]
mod real_cluster;

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use real_cluster::kubeconfig_path;

/// A dry run of namespaced objects needs their namespace to exist, and every
/// cluster has this one; nothing is stored in it.
const CHECK_NAMESPACE: &str = "default";

fn repo(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(path)
}

fn tool(var: &str, default: &str) -> String {
    std::env::var(var).unwrap_or_else(|_| default.to_string())
}

/// Runs `kubectl` against the test cluster, feeding it `stdin`; `None` (said)
/// when kubectl cannot be run at all.
fn kubectl(kubeconfig: &Path, args: &[&str], stdin: Option<&str>) -> Option<Output> {
    let kubectl = tool("KUBECTL", "kubectl");
    let mut child = match Command::new(&kubectl)
        .arg("--kubeconfig")
        .arg(kubeconfig)
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
    {
        Ok(child) => child,
        Err(e) => {
            println!("skipped: cannot run {kubectl}: {e}");
            return None;
        }
    };
    let mut input = child.stdin.take().expect("stdin is piped");
    if let Some(text) = stdin {
        input
            .write_all(text.as_bytes())
            .expect("kubectl reads its input");
    }
    drop(input);
    Some(child.wait_with_output().expect("kubectl runs to its end"))
}

/// A server-side dry-run apply that must succeed without a single warning.
fn apply_without_warnings(kubeconfig: &Path, what: &str, file: &str, manifests: Option<&str>) {
    let Some(out) = kubectl(
        kubeconfig,
        &[
            "apply",
            // Server-side: a client-side apply over objects another test created
            // warns that they lack kubectl's last-applied annotation.
            "--server-side",
            "--force-conflicts",
            "--field-manager=tessera-install-check",
            "--dry-run=server",
            "--warnings-as-errors",
            "-f",
            file,
        ],
        manifests,
    ) else {
        return;
    };
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "kubectl apply of {what} failed: {stderr}"
    );
    assert!(
        !stderr.to_lowercase().contains("warning"),
        "the API server warned about {what}: {stderr}"
    );
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("modelinstances.tessera.dev"),
        "{what}: the CRD was not among the applied objects: {stderr}"
    );
}

#[test]
fn kubectl_applies_the_committed_crd_without_a_warning() {
    let Some(kubeconfig) = kubeconfig_path() else {
        return;
    };
    let crd = repo("crds/modelinstance.yaml");
    let crd = crd.to_str().expect("the checkout's path is UTF-8");
    apply_without_warnings(&kubeconfig, crd, crd, None);
}

#[test]
fn the_chart_applies_without_a_warning() {
    let Some(kubeconfig) = kubeconfig_path() else {
        return;
    };
    let helm = tool("HELM", "helm");
    let chart = repo("charts/tessera");
    // The default values and the ones the real-node e2e installs with (host
    // networking, the fake backend); a ServiceMonitor needs the Prometheus
    // operator's CRD, which a bare cluster does not have.
    let value_sets = [None, Some(repo("e2e/values-real-node.yaml"))];
    let mut rendered = Vec::new();
    for values in &value_sets {
        let mut command = Command::new(&helm);
        command.args(["template", "tessera"]).arg(&chart).args([
            "--include-crds",
            "--namespace",
            CHECK_NAMESPACE,
        ]);
        if let Some(values) = values {
            command.arg("--values").arg(values);
        }
        match command.output() {
            Ok(out) if out.status.success() => {
                rendered.push((values, String::from_utf8_lossy(&out.stdout).into_owned()))
            }
            Ok(out) => panic!(
                "helm template with {values:?} failed: {}",
                String::from_utf8_lossy(&out.stderr)
            ),
            Err(e) => {
                println!("skipped: cannot run {helm}: {e}");
                return;
            }
        }
    }
    for (values, manifests) in &rendered {
        let what = format!("the chart rendered with {values:?}");
        apply_without_warnings(&kubeconfig, &what, "-", Some(manifests));
    }
}
