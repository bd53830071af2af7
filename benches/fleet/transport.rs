//! How the simulated agents reach the API server. A real agent is its own
//! process with kube-rs's HTTP/1.1 connections: one per watch, plus pooled
//! ones for writes. Thousands of agents in this one process would hold that
//! many sockets, and at 5,000 DRA nodes (a slice watch each) they pass the
//! process's open-file limit. With `--agent-transport http2` each node's agent
//! (and its stand-in kubelet's Lease renewals) multiplex over one HTTP/2
//! connection, as a kubelet multiplexes its own: the API server sees the same
//! requests and the same watches over fewer sockets.

use hyper_util::client::legacy::Client as HyperClient;
use hyper_util::rt::TokioExecutor;
use kube::client::ConfigExt;
use kube::{Client, Config};
use tower::ServiceBuilder;

/// A client with its own HTTP/2 connection (hyper's pool keeps one per
/// client): clones share it.
fn http2_client(config: &Config) -> Result<Client, kube::Error> {
    // The connector offers h2 by ALPN itself.
    let tls = config.rustls_client_config()?;
    let https = hyper_rustls::HttpsConnectorBuilder::new()
        .with_tls_config(tls)
        .https_only()
        .enable_http2()
        .build();
    let http = HyperClient::builder(TokioExecutor::new())
        .http2_only(true)
        .build(https);
    let service = ServiceBuilder::new()
        .layer(config.base_uri_layer())
        .option_layer(config.auth_layer()?)
        .map_err(tower::BoxError::from)
        .service(http);
    Ok(Client::new(service, config.default_namespace.clone()))
}

/// The client of each of `nodes` nodes: under HTTP/2 one connection per
/// `per_connection` nodes in a row, else `shared` for all.
pub(crate) fn agent_clients(
    config: &Config,
    shared: &Client,
    nodes: usize,
    http2: bool,
    per_connection: usize,
) -> Result<Vec<Client>, kube::Error> {
    if !http2 {
        return Ok(vec![shared.clone(); nodes]);
    }
    let per_connection = per_connection.max(1);
    let connections = (0..nodes.div_ceil(per_connection))
        .map(|_| http2_client(config))
        .collect::<Result<Vec<_>, _>>()?;
    Ok((0..nodes)
        .map(|index| connections[index / per_connection].clone())
        .collect())
}
