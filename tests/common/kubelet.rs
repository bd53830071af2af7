//! A kubelet stand-in for the device plugin tests: kubelet's `Registration`
//! service on `<dir>/kubelet.sock`, recording every request. Included by the
//! tests that need it with `#[path = "common/kubelet.rs"] mod kubelet;`.

// Each test binary uses only part of it.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::time::Duration;

use tokio::net::UnixListener;
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;
use tokio_stream::wrappers::UnixListenerStream;
use tonic::{Request, Response, Status};

use tessera::agent::kubelet_api::v1beta1::registration_server::{Registration, RegistrationServer};
use tessera::agent::kubelet_api::v1beta1::{Empty, RegisterRequest};

/// Longest wait for a registration or for the stand-in to stop.
const WAIT: Duration = Duration::from_secs(5);

/// Kubelet's registration service: records every request.
struct Recorder(mpsc::UnboundedSender<RegisterRequest>);

#[tonic::async_trait]
impl Registration for Recorder {
    async fn register(&self, request: Request<RegisterRequest>) -> Result<Response<Empty>, Status> {
        let _ = self.0.send(request.into_inner());
        Ok(Response::new(Empty {}))
    }
}

/// A kubelet stand-in serving `Registration` at `<dir>/kubelet.sock`.
pub struct FakeKubelet {
    path: PathBuf,
    requests: mpsc::UnboundedReceiver<RegisterRequest>,
    stop: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<()>>,
}

impl FakeKubelet {
    /// Binds `<dir>/kubelet.sock` (replacing a stale one) and serves on it.
    pub fn start(dir: &Path) -> Self {
        let path = dir.join("kubelet.sock");
        let _ = std::fs::remove_file(&path);
        let listener = UnixListener::bind(&path).unwrap();
        let (tx, requests) = mpsc::unbounded_channel();
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(async move {
            tonic::transport::Server::builder()
                .add_service(RegistrationServer::new(Recorder(tx)))
                .serve_with_incoming_shutdown(UnixListenerStream::new(listener), async {
                    let _ = stopped.await;
                })
                .await
                .unwrap();
        });
        Self {
            path,
            requests,
            stop: Some(stop),
            task: Some(task),
        }
    }

    /// The next `Register` call; fails the test after five seconds.
    pub async fn next_registration(&mut self) -> RegisterRequest {
        match tokio::time::timeout(WAIT, self.requests.recv()).await {
            Ok(Some(request)) => request,
            Ok(None) => panic!("the kubelet stand-in stopped before a Register call"),
            Err(_) => panic!("timed out after {WAIT:?} waiting for a Register call"),
        }
    }

    /// Whether no `Register` call has arrived (that was not taken already).
    pub fn nothing_registered(&mut self) -> bool {
        self.requests.try_recv().is_err()
    }

    /// Stops serving and removes `kubelet.sock`, as an exiting kubelet leaves things.
    pub async fn stop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(task) = self.task.take() {
            match tokio::time::timeout(WAIT, task).await {
                Ok(joined) => joined.unwrap(),
                Err(_) => {
                    panic!("timed out after {WAIT:?} waiting for the kubelet stand-in to stop")
                }
            }
        }
        let _ = std::fs::remove_file(&self.path);
    }
}
