//! tessera: places large models across the GPUs of a Kubernetes cluster and binds
//! every shard to the devices it was planned for.
//!
//! # Public API
//!
//! What the `tessera` binary runs, re-exported here:
//!
//! - the node agent: [`run_agent`] with an [`AgentConfig`] (its kubelet side in
//!   [`PluginConfig`], its Node publishing in [`PublishOptions`]);
//! - the controller: [`run_controller`] with a [`ControllerConfig`] (how it plans in
//!   [`ControllerSettings`], its Lease in [`LeaderElection`]);
//! - `tessera place`: [`place`] with [`PlaceArgs`], giving a report to render;
//! - `tessera discover`: [`discover`] with [`DiscoverArgs`], and [`discover_summary`];
//! - the pure core (the `tessera-core` crate): [`api`] (the ModelInstance resource,
//!   NodeGpuState, limits), [`placement`] (the solver) and [`translate`] (Kubernetes
//!   objects into a placement problem).
//!
//! The modules stay public so that the integration tests and benchmarks drive the
//! same code paths as the binary; within them, what only the crate uses is
//! `pub(crate)`. Layers: the core below everything, `backend` below `agent`;
//! `agent` and `controller` never use each other, and share the Kubernetes plumbing
//! in `kubernetes` and the process plumbing in `process`; `cli` uses the core and
//! `backend`.

pub mod agent;
pub mod backend;
pub mod cli;
pub(crate) mod cluster_map;
pub mod controller;
pub mod kubernetes;
pub mod process;

// The pure core lives in its own crate so the compiler keeps it free of I/O; it is
// re-exported under the paths the rest of tessera and its users have always used.
pub use tessera_core::{api, moves, objective, placement, serving, sizing, translate};

pub use agent::device_plugin::registration::PluginConfig;
pub use agent::dra::DraConfig;
pub use agent::run::{AgentConfig, PublishOptions, run as run_agent};
pub use cli::discover::{DiscoverArgs, run as discover, summary as discover_summary};
pub use cli::place::{PlaceArgs, run as place};
pub use controller::reconcile::Settings as ControllerSettings;
pub use controller::run::{ControllerConfig, LeaderElection, run as run_controller};
pub use kubernetes::AllocationMode;
