//! tessera's pure core: what the node agent, the controller and `tessera place` agree
//! on, and the decision they all rely on.
//!
//! - [`api`]: the `ModelInstance` custom resource, the `NodeGpuState` a node agent
//!   publishes, extended resource names, and every input limit.
//! - [`placement`]: the solver, `Problem -> Plan | Unsatisfiable`, deterministic and
//!   bounded by an injected deadline.
//! - [`translate`]: Kubernetes Nodes and a ModelInstance spec -> a placement `Problem`.
//! - [`serving`]: what one replica of a plan serves when it batches: time per token,
//!   time to first token and tokens/s by concurrency, and the load a latency target allows.
//! - [`sizing`]: an instance as users ask for it: `tensor: auto` and the GPU kind chosen
//!   by what a replica serves at the target, and replicas one after another.
//! - [`objective`]: the one order on how well a cluster serves (replicas at their
//!   target, demands met, fewest GPUs, then work-weighted headroom).
//! - [`moves`]: running replicas moved, make before break, so that a replica that
//!   cannot be placed gets room.
//!
//! Nothing here talks to a cluster, a device or a clock of its own; the crate builds
//! without a Kubernetes client, an async runtime or gRPC, so that stays true.

pub mod api;
pub mod measure;
pub mod moves;
pub mod objective;
pub mod placement;
pub mod serving;
pub mod sizing;
pub mod translate;
