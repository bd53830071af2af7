//! A kubelet stand-in for the device plugin tests: kubelet's `Registration`
//! service on `<dir>/kubelet.sock`, recording every request. Included by the
//! tests that need it with `#[path = "common/kubelet.rs"] mod kubelet;`.

// Each test binary uses only part of it.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::time::Duration;

use tokio::net::UnixListener;
use tokio::sync::{Mutex, mpsc, oneshot};
use tokio::task::JoinHandle;
use tokio_stream::wrappers::UnixListenerStream;
use tonic::{Request, Response, Status, Streaming};

use tessera::agent::device_plugin::kubelet_api::v1beta1::device_plugin_client::DevicePluginClient;
use tessera::agent::device_plugin::kubelet_api::v1beta1::registration_server::{
    Registration, RegistrationServer,
};
use tessera::agent::device_plugin::kubelet_api::v1beta1::{
    Empty, ListAndWatchResponse, RegisterRequest,
};
use tessera::agent::device_plugin::registration::connect_unix;

/// Longest wait for a registration or for the stand-in to stop.
const WAIT: Duration = Duration::from_secs(5);

/// Kubelet's registration service: records every request and, like a real
/// kubelet, may open the plugin's `ListAndWatch` before answering.
struct Recorder {
    requests: mpsc::UnboundedSender<RegisterRequest>,
    /// The plugin directory, when `Register` opens `ListAndWatch` first.
    call_back: Option<PathBuf>,
    /// Streams opened that way, kept open as kubelet keeps them.
    streams: Mutex<Vec<Streaming<ListAndWatchResponse>>>,
}

#[tonic::async_trait]
impl Registration for Recorder {
    async fn register(&self, request: Request<RegisterRequest>) -> Result<Response<Empty>, Status> {
        let request = request.into_inner();
        if let Some(dir) = &self.call_back {
            let channel = connect_unix(&dir.join(&request.endpoint))
                .await
                .map_err(|e| Status::unavailable(e.to_string()))?;
            let stream = DevicePluginClient::new(channel)
                .list_and_watch(Empty {})
                .await?
                .into_inner();
            self.streams.lock().await.push(stream);
        }
        let _ = self.requests.send(request);
        Ok(Response::new(Empty {}))
    }
}

/// A kubelet stand-in serving `Registration` at `<dir>/kubelet.sock`.
pub(crate) struct FakeKubelet {
    path: PathBuf,
    requests: mpsc::UnboundedReceiver<RegisterRequest>,
    stop: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<()>>,
}

impl FakeKubelet {
    /// Binds `<dir>/kubelet.sock` (replacing a stale one) and serves on it.
    pub(crate) fn start(dir: &Path) -> Self {
        Self::serve(dir, false)
    }

    /// Like [`FakeKubelet::start`], but each `Register` opens the plugin's
    /// `ListAndWatch` before it answers, as kubelet v1.24 does.
    pub(crate) fn start_calling_back(dir: &Path) -> Self {
        Self::serve(dir, true)
    }

    fn serve(dir: &Path, call_back: bool) -> Self {
        let path = dir.join("kubelet.sock");
        let _ = std::fs::remove_file(&path);
        let listener = UnixListener::bind(&path).unwrap();
        let (tx, requests) = mpsc::unbounded_channel();
        let recorder = Recorder {
            requests: tx,
            call_back: call_back.then(|| dir.to_path_buf()),
            streams: Mutex::new(Vec::new()),
        };
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(async move {
            tonic::transport::Server::builder()
                .add_service(RegistrationServer::new(recorder))
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
    pub(crate) async fn next_registration(&mut self) -> RegisterRequest {
        match tokio::time::timeout(WAIT, self.requests.recv()).await {
            Ok(Some(request)) => request,
            Ok(None) => panic!("the kubelet stand-in stopped before a Register call"),
            Err(_) => panic!("timed out after {WAIT:?} waiting for a Register call"),
        }
    }

    /// Whether no `Register` call has arrived (that was not taken already).
    pub(crate) fn nothing_registered(&mut self) -> bool {
        self.requests.try_recv().is_err()
    }

    /// Stops serving and removes `kubelet.sock`, as an exiting kubelet leaves things.
    pub(crate) async fn stop(&mut self) {
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
