//! tessera: places large models across the GPUs of a Kubernetes cluster and binds
//! every shard to the devices it was planned for.

pub mod agent;
pub mod api;
pub mod api_requests;
pub mod backend;
pub mod cli;
pub mod controller;
pub mod placement;
pub mod process;
pub mod translate;
