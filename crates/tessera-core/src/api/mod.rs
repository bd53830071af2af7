//! The public contract between the node agent, the controller and users: the
//! `ModelInstance` custom resource and the `NodeGpuState` a node publishes.
//! Types and pure validation only; nothing here does I/O.

mod crd;
mod gpu_state;
pub mod limits;
mod measured;
mod model_instance;
mod moves_status;
mod partitions;
mod resource_name;
mod runtime_version;
mod serving_spec;
pub mod telemetry;

pub use crd::{crd, crd_yaml};
pub use gpu_state::{
    GPU_STATE_VERSION, GpuDevice, GpuLink, GpuStateError, Health, LinkKind, NodeGpuState,
    SharesOffered, Vendor,
};
pub use measured::{MeasuredDemand, MeasuredServing, Percentiles, ServingCorrection};
pub use model_instance::{
    DType, InstanceCapacity, InvalidSpec, ModelInstance, ModelInstanceSpec, ModelInstanceStatus,
    ModelSpec, Moves, Optimize, ParallelismSpec, Phase, PipelineStages, PlacementPolicy,
    PlannedShard, ReplicaCapacity, ReplicaCount, ReplicaPrediction, ReplicaRestarts, RestartPolicy,
    ScoreWeights, ShardShare, ShareKind, Sharing, Strategy, TensorSize, layer_range,
};
pub use moves_status::{MoveInFlight, MovePhase};
pub use partitions::{GpuPartition, MigProfile, MigState, SliceOwners};
pub use resource_name::{InvalidResourceName, ResourceName};
pub use runtime_version::{InvalidRuntimeVersion, RuntimeVersion};
pub use serving_spec::{DemandSource, KvCacheDtype, Runtime, ServingSpec};

/// API group of every tessera custom resource.
pub const GROUP: &str = "tessera.dev";
/// The one served version.
pub const VERSION: &str = "v1alpha1";
/// Extended resource the node agent registers with kubelet (configurable at
/// deploy time, see [`ResourceName`]).
pub const DEFAULT_RESOURCE_NAME: &str = "tessera.dev/gpu";
/// Node annotation holding the JSON `NodeGpuState`.
pub const GPU_STATE_ANNOTATION: &str = "tessera.dev/gpu-state";
/// Node labels the agent maintains so people and selectors can see GPU kinds at a glance.
pub const LABEL_GPU_COUNT: &str = "tessera.dev/gpu.count";
pub const LABEL_GPU_VENDOR: &str = "tessera.dev/gpu.vendor";
pub const LABEL_GPU_PRODUCT: &str = "tessera.dev/gpu.product";
pub const LABEL_GPU_MEMORY_GIB: &str = "tessera.dev/gpu.memory-gib";
/// Pod annotation carrying the planned device IDs (comma separated).
pub const DEVICES_ANNOTATION: &str = "tessera.dev/devices";
/// Pod annotation carrying the shard (pipeline stage) index; also a label on
/// shard pods and their claims.
pub const SHARD_ANNOTATION: &str = "tessera.dev/shard";
/// Label on every shard pod, shard claim and the Service: the instance's name.
pub const INSTANCE_LABEL: &str = "tessera.dev/instance";
/// Label on the shard pods and claims of replicas after the first: the
/// replica's index. The first replica's carry none, so pods made before
/// instances had replicas stay exactly as they were built.
pub const REPLICA_LABEL: &str = "tessera.dev/replica";
/// The ResourceSlice device attribute (in the DRA driver's domain) holding
/// tessera's device ID: the agent publishes it, shard claims select on it.
pub const DRA_ID_ATTRIBUTE: &str = "id";
/// The DRA capacity holding a device's memory in bytes: what memory shares
/// of a whole GPU consume.
pub const DRA_MEMORY_CAPACITY: &str = "memory";
/// `spec.schedulerName` of shard pods, so the default scheduler leaves them alone.
pub const SCHEDULER_NAME: &str = "tessera";
/// Well-known node labels that give a node's position in the network.
pub const ZONE_LABEL: &str = "topology.kubernetes.io/zone";
pub const RACK_LABEL: &str = "topology.tessera.dev/rack";

pub const GIB: f64 = 1024.0 * 1024.0 * 1024.0;
