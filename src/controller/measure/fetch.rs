//! Reads a replica's metrics endpoint: one plain-HTTP GET, bounded in time
//! and size, whatever the runtime behind it does.

use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Empty, Limited};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;

/// The largest exposition read: vLLM's is about 60 KiB with one model; a
/// body past this is a runtime misbehaving, not metrics.
pub(crate) const MAX_BODY_BYTES: usize = 8 << 20;

/// A reusable client for metrics endpoints (connections kept between scrapes).
#[derive(Clone)]
pub(crate) struct Fetcher {
    client: Client<HttpConnector, Empty<Bytes>>,
    timeout: Duration,
}

impl Fetcher {
    pub(crate) fn new(timeout: Duration) -> Fetcher {
        let mut connector = HttpConnector::new();
        connector.set_connect_timeout(Some(timeout));
        let client = Client::builder(TokioExecutor::new())
            .pool_idle_timeout(Duration::from_secs(90))
            .pool_max_idle_per_host(1)
            .build(connector);
        Fetcher { client, timeout }
    }

    /// The body of `GET url`, or why there is none, in words for a condition.
    pub(crate) async fn get(&self, url: &str) -> Result<String, String> {
        let uri: http::Uri = url.parse().map_err(|e| format!("GET {url}: {e}"))?;
        let request = async {
            let response = self
                .client
                .get(uri)
                .await
                .map_err(|e| format!("GET {url}: {}", error_chain(&e)))?;
            let status = response.status();
            if !status.is_success() {
                return Err(format!("GET {url}: HTTP {status}"));
            }
            let body = Limited::new(response.into_body(), MAX_BODY_BYTES)
                .collect()
                .await
                .map_err(|e| format!("GET {url}: {e}"))?
                .to_bytes();
            String::from_utf8(body.to_vec())
                .map_err(|_| format!("GET {url}: the body is not UTF-8"))
        };
        match tokio::time::timeout(self.timeout, request).await {
            Ok(result) => result,
            Err(_) => Err(format!(
                "GET {url}: no answer within {} s",
                self.timeout.as_secs_f64()
            )),
        }
    }
}

/// An error and its causes, which hyper keeps apart ("client error
/// (Connect)" says little; its source says "connection refused").
fn error_chain(error: &dyn std::error::Error) -> String {
    let mut out = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        out.push_str(": ");
        out.push_str(&cause.to_string());
        source = cause.source();
    }
    out
}

#[cfg(test)]
mod tests {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpListener;

    use super::*;

    /// A loopback server that answers every connection with `response`
    /// (after `delay`).
    async fn serve(response: &'static [u8], delay: Duration) -> String {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap();
        tokio::spawn(async move {
            loop {
                let Ok((mut stream, _)) = listener.accept().await else {
                    return;
                };
                tokio::spawn(async move {
                    let mut request = [0u8; 1024];
                    let _ = stream.read(&mut request).await;
                    tokio::time::sleep(delay).await;
                    let _ = stream.write_all(response).await;
                    let _ = stream.shutdown().await;
                });
            }
        });
        format!("http://{address}/metrics")
    }

    #[tokio::test]
    async fn reads_a_body_and_says_why_when_there_is_none() {
        let fetcher = Fetcher::new(Duration::from_millis(500));
        let ok = serve(
            b"HTTP/1.1 200 OK\r\ncontent-length: 12\r\nconnection: close\r\n\r\nvllm:x 1.0\r\n",
            Duration::ZERO,
        )
        .await;
        assert_eq!(fetcher.get(&ok).await.unwrap(), "vllm:x 1.0\r\n");

        let missing = serve(
            b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\nconnection: close\r\n\r\n",
            Duration::ZERO,
        )
        .await;
        let err = fetcher.get(&missing).await.unwrap_err();
        assert!(err.ends_with("HTTP 404 Not Found"), "{err}");

        let silent = serve(b"", Duration::from_secs(5)).await;
        let err = fetcher.get(&silent).await.unwrap_err();
        assert!(err.ends_with("no answer within 0.5 s"), "{err}");

        // Nothing listens on a port just freed.
        let port = TcpListener::bind("127.0.0.1:0")
            .await
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let err = fetcher
            .get(&format!("http://127.0.0.1:{port}/metrics"))
            .await
            .unwrap_err();
        assert!(err.contains("onnection refused"), "{err}");

        let garbage = serve(b"\xff\xfe not http at all", Duration::ZERO).await;
        assert!(fetcher.get(&garbage).await.is_err());
        assert!(fetcher.get("not a url").await.is_err());
    }
}
