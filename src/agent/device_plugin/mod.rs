//! The kubelet device plugin: the `DevicePlugin` gRPC service kubelet calls
//! on the agent's socket, and the registration that tells kubelet where it
//! is. It answers from the shared device view and asks the planned bindings
//! ([`Binder`](crate::agent::binding::Binder)) which devices a pod gets.
//!
//! - `kubelet_api`: the v1beta1 messages and services, generated from
//!   `proto/deviceplugin/v1beta1/api.proto`, and kubelet's constants;
//! - `registration`: registering with kubelet, serving the socket, and
//!   registering again when kubelet restarts;
//! - `server`: the `DevicePlugin` service itself;
//! - `preferred`: the topology choice when no plan applies;
//! - `devices_env`: what a container gets for its devices (device nodes,
//!   environment, CDI names);
//! - `allocation_metrics`: the `Allocate` counters.

mod allocation_metrics;
pub mod devices_env;
pub mod kubelet_api;
mod preferred;
pub mod registration;
pub mod server;

pub(crate) use allocation_metrics::AllocationMetrics;
