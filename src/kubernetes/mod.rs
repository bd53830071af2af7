//! The Kubernetes plumbing both components use: the client and its request
//! accounting (`client`, `api_requests`), how watches get their first copy
//! and retry (`initial_list`, `watch_backoff`), quantities as DRA writes
//! them (`quantity`), and how GPUs reach containers (`allocation_mode`).

pub mod allocation_mode;
pub mod api_requests;
pub(crate) mod client;
pub mod initial_list;
pub(crate) mod quantity;
pub mod watch_backoff;

pub use allocation_mode::AllocationMode;
