//! tessera: places large models across the GPUs of a Kubernetes cluster and binds
//! every shard to the devices it was planned for.

pub mod agent;
pub mod api_requests;
pub mod backend;
pub mod cli;
pub mod controller;
pub mod process;

// The pure core lives in its own crate so the compiler keeps it free of I/O; it is
// re-exported under the paths the rest of tessera and its users have always used.
pub use tessera_core::{api, placement, translate};
