//! The node agent (`tessera agent`, a DaemonSet): watches the node's GPUs
//! through the backend layer, serves the kubelet device plugin API so kubelet
//! can hand devices to containers, and publishes the node's GPU state on its
//! Node object for the controller.

mod allocation_metrics;
pub mod binding;
pub mod devices_env;
mod http;
pub mod kubelet_api;
pub mod plugin;
mod preferred;
pub mod publisher;
pub mod registration;
pub mod run;
pub mod state;
