//! How the simulated agents reach the API server. A real agent is its own
//! process with kube-rs's HTTP/1.1 connections: one per watch, plus pooled
//! ones for writes. Thousands of agents in this one process would hold that
//! many sockets, and at 5,000 DRA nodes (a slice watch each) they pass the
//! process's open-file limit. With `--agent-transport http2` the agents (and
//! the stand-in kubelets' Lease renewals) share HTTP/2 connections instead,
//! `NODES_PER_CONNECTION` nodes to one, as kubelets multiplex theirs: the API
//! server sees the same requests and the same watches over far fewer sockets.

use hyper_util::client::legacy::Client as HyperClient;
use hyper_util::rt::TokioExecutor;
use kube::client::ConfigExt;
use kube::{Client, Config};
use tower::ServiceBuilder;

/// A node holds one watch stream on its connection, and writes besides. On
/// the 1.36 kit, with 100 nodes a connection, writes stalled past the agent's
/// 30-s timeout once the watches were open; with 20 none did at 1,000 nodes.
/// At 5,000 some connections still stall during the first publish, more the
/// more requests the agents give up (stream resets): see "DRA at 1,000 and
/// 5,000 nodes" in docs/benchmarks.md.
pub(crate) const NODES_PER_CONNECTION: usize = 20;

/// A client with its own HTTP/2 connection (hyper's pool keeps one per
/// client): clones share it.
pub(crate) fn http2_client(config: &Config) -> Result<Client, kube::Error> {
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

/// The clients the fleet's agents use, one per `NODES_PER_CONNECTION` nodes
/// under HTTP/2, else `shared` for all.
pub(crate) fn agent_clients(
    config: &Config,
    shared: &Client,
    nodes: usize,
    http2: bool,
) -> Result<Vec<Client>, kube::Error> {
    if !http2 {
        return Ok(vec![shared.clone()]);
    }
    (0..nodes.div_ceil(NODES_PER_CONNECTION).max(1))
        .map(|_| http2_client(config))
        .collect()
}

/// What node `index` goes through: `of[index / NODES_PER_CONNECTION]`
/// (wrapping, so one shared client serves all).
pub(crate) fn client_of<T: Clone>(of: &[T], index: usize) -> T {
    of[(index / NODES_PER_CONNECTION) % of.len()].clone()
}
