//! An API server call the agent gives up on when it is not answered in
//! time: both publishers retry with backoff, and a call stuck on a stalled
//! connection would otherwise hold its node's state back until the client's
//! read timeout.

use std::future::Future;
use std::time::Duration;

/// Why a call failed.
#[derive(Debug, thiserror::Error)]
pub(crate) enum CallError {
    #[error(transparent)]
    Api(#[from] kube::Error),
    #[error("the API server did not answer within {0:?}")]
    Timeout(Duration),
}

/// `call`, given up after `limit`.
pub(crate) async fn within<T>(
    limit: Duration,
    call: impl Future<Output = Result<T, kube::Error>>,
) -> Result<T, CallError> {
    match tokio::time::timeout(limit, call).await {
        Ok(result) => Ok(result?),
        Err(_) => Err(CallError::Timeout(limit)),
    }
}
