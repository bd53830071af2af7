//! The node agent (`tessera agent`, a DaemonSet): watches the node's GPUs
//! through the backend layer, offers them to kubelet — as a device plugin or
//! as a DRA driver — so kubelet can hand devices to containers, and publishes
//! the node's GPU state on its Node object for the controller.
//!
//! Each kubelet-facing plugin has its own folder (`device_plugin`, `dra`),
//! and so has kubelet's PodResources API, which the end-to-end checks read
//! (`pod_resources`);
//! what they share sits beside them: the device view (`state`), what a
//! container needs for its devices (`container_devices`), the gRPC server on
//! a unix socket (`unix_server`), the planned bindings of the device plugin
//! (`binding`), the Node publisher (`publisher`), API calls given up when
//! unanswered (`api_call`), the HTTP endpoints (`http`) and the wiring (`run`).

mod api_call;
pub mod binding;
pub mod container_devices;
mod device_metrics;
pub mod device_plugin;
pub mod dra;
pub mod holders;
pub(crate) mod http;
pub mod pod_resources;
pub mod publisher;
pub mod run;
pub mod state;
mod unix_authority;
mod unix_server;
