//! The node agent (`tessera agent`, a DaemonSet): watches the node's GPUs
//! through the backend layer, serves the kubelet device plugin API so kubelet
//! can hand devices to containers, and publishes the node's GPU state on its
//! Node object for the controller.
//!
//! Each kubelet-facing plugin has its own folder (`device_plugin`); what it
//! shares with others sits beside it: the device view (`state`), the planned
//! bindings (`binding`), the Node publisher (`publisher`), the HTTP endpoints
//! (`http`) and the wiring (`run`).

pub mod binding;
pub mod device_plugin;
mod http;
pub mod publisher;
pub mod run;
pub mod state;
