//! A gRPC server on a unix socket, as every kubelet-facing plugin runs one:
//! bind the path (replacing a stale file), serve until told to stop, say
//! whether the socket file is still the one bound (kubelet or a person may
//! delete it), and on stop remove the file only if it is still ours. Sockets
//! kubelet's plugin watcher dials take its requests with their `:authority`
//! mended ([`Authority::FromPluginWatcher`]).

use std::io;
use std::path::{Path, PathBuf};
use std::time::Duration;

use tokio::net::UnixListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio_stream::StreamExt;
use tokio_stream::wrappers::UnixListenerStream;
use tonic::service::Routes;

use super::unix_authority::LocalhostAuthority;

/// How long a stopping server may take to finish its connections.
const STOP_GRACE: Duration = Duration::from_secs(3);

/// What the callers on a socket send as `:authority`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Authority {
    /// Something HTTP/2 accepts (kubelet's device plugin client: `localhost`).
    Valid,
    /// The socket path: kubelet's plugin watcher and the clients it hands
    /// the path to (see `unix_authority`).
    FromPluginWatcher,
}

pub(crate) struct UnixServer {
    /// What the logs call it ("device plugin", "DRA driver").
    what: &'static str,
    path: PathBuf,
    /// Device and inode of the socket file we bound.
    identity: Option<(u64, u64)>,
    stop: watch::Sender<bool>,
    task: JoinHandle<Result<(), tonic::transport::Error>>,
}

impl UnixServer {
    /// Binds `path` and serves `routes` on it. `stop` is the signal the
    /// services' own long calls (streams) watch as well.
    pub(crate) fn start(
        what: &'static str,
        path: &Path,
        authority: Authority,
        routes: Routes,
        stop: watch::Sender<bool>,
    ) -> io::Result<Self> {
        match std::fs::symlink_metadata(path) {
            Ok(_) => std::fs::remove_file(path)?,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir)?;
        }
        let listener = UnixListener::bind(path)?;
        let identity = file_identity(path);
        let mut signal = stop.subscribe();
        let incoming = UnixListenerStream::new(listener).map(move |accepted| {
            accepted.map(|stream| match authority {
                Authority::Valid => LocalhostAuthority::unchanged(stream),
                Authority::FromPluginWatcher => LocalhostAuthority::new(stream),
            })
        });
        let task = tokio::spawn(async move {
            tonic::transport::Server::builder()
                .add_routes(routes)
                .serve_with_incoming_shutdown(incoming, async move {
                    // A dropped sender also means stop.
                    let _ = signal.wait_for(|s| *s).await;
                })
                .await
        });
        tracing::info!(socket = %path.display(), "{what} serving");
        Ok(Self {
            what,
            path: path.to_path_buf(),
            identity,
            stop,
            task,
        })
    }

    /// Whether our socket file is still there (not removed or replaced) and
    /// the server still runs.
    pub(crate) fn is_intact(&self) -> bool {
        !self.task.is_finished()
            && self.identity.is_some()
            && file_identity(&self.path) == self.identity
    }

    /// Stops serving (ending open streams) and removes the socket file if it
    /// is still the one we bound.
    pub(crate) async fn stop(mut self) {
        let what = self.what;
        let _ = self.stop.send(true);
        match tokio::time::timeout(STOP_GRACE, &mut self.task).await {
            Ok(Ok(Ok(()))) => {}
            Ok(Ok(Err(e))) => tracing::warn!(error = %e, "{what} server failed"),
            Ok(Err(e)) => tracing::warn!(error = %e, "{what} server task failed"),
            Err(_) => {
                tracing::warn!("{what} server did not stop in time; aborting it");
                self.task.abort();
            }
        }
        if self.identity.is_some()
            && file_identity(&self.path) == self.identity
            && let Err(e) = std::fs::remove_file(&self.path)
        {
            tracing::warn!(socket = %self.path.display(), error = %e, "removing our {what} socket failed");
        }
    }
}

/// Device and inode of a file (not following symlinks).
pub(crate) fn file_identity(path: &Path) -> Option<(u64, u64)> {
    use std::os::unix::fs::MetadataExt;
    let metadata = std::fs::symlink_metadata(path).ok()?;
    Some((metadata.dev(), metadata.ino()))
}
