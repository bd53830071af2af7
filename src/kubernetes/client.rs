//! The Kubernetes client the long-running subcommands (`agent`, `controller`)
//! talk through: the one their flags describe, with every request counted.

use std::path::Path;

use super::api_requests::ApiRequests;

/// A client from `--kubeconfig`, or else the in-cluster configuration (or
/// `KUBECONFIG`). The error is one line naming the file and what is wrong
/// with it (parser errors also draw the offending line; that part is dropped).
/// Every request the client sends is counted in `requests`.
pub(crate) async fn kube_client(
    kubeconfig: Option<&Path>,
    requests: &ApiRequests,
) -> Result<kube::Client, String> {
    client(kubeconfig, requests).await.map_err(|e| {
        e.lines()
            .next()
            .unwrap_or("unusable configuration")
            .to_string()
    })
}

async fn client(kubeconfig: Option<&Path>, requests: &ApiRequests) -> Result<kube::Client, String> {
    let config = match kubeconfig {
        Some(path) => {
            let kc = kube::config::Kubeconfig::read_from(path)
                .map_err(|e| format!("{}: {e}", path.display()))?;
            kube::Config::from_custom_kubeconfig(kc, &kube::config::KubeConfigOptions::default())
                .await
                .map_err(|e| format!("{}: {e}", path.display()))?
        }
        None => kube::Config::infer().await.map_err(|e| e.to_string())?,
    };
    let requests = requests.clone();
    let counting =
        tower::util::MapRequestLayer::new(move |request: http::Request<kube::client::Body>| {
            requests.count(&request);
            request
        });
    Ok(kube::client::ClientBuilder::try_from(config)
        .map_err(|e| e.to_string())?
        .with_layer(&counting)
        .build())
}
