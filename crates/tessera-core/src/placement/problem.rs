//! What the solver is asked: devices grouped by node, where the nodes sit in the
//! network, and what the model needs. Built by the controller (or the CLI) from
//! Kubernetes objects; the solver never sees those.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::precision::{Precision, TensorRates};
use crate::api::telemetry::scored_temperature;

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Problem {
    pub nodes: Vec<NodeState>,
    pub model: ModelShape,
    /// Devices per shard, all on one node.
    pub tensor: u32,
    pub stages: Stages,
    pub weights: Weights,
    /// Devices at or above this temperature are excluded.
    pub max_temperature_c: f64,
    pub selector: Selector,
    /// How the plan shares the cluster with other instances and replicas.
    pub strategy: Strategy,
    /// Nodes the instance's other replicas run on, one entry per stage:
    /// what `Strategy::Spread` keeps away from and `Strategy::Pack` fills first.
    pub replica_nodes: Vec<String>,
    /// What `tensor: auto` chooses for, and the speed a plan must reach
    /// (read by `sizing::solve_parallelism`; `solve` plans one size as asked).
    pub goal: SpeedGoal,
    /// What the instance serves: with it, `sizing` judges plans by their
    /// capacity at the latency target; without it, by one stream's speed.
    /// The solver itself never reads it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub served: Option<Served>,
    /// The instance runs one shard on one GPU or a piece of one
    /// (`placement.sharing` Isolated or Shared), so a refusal does not tell
    /// it to split the model over more GPUs.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub one_device: bool,
}

impl Served {
    /// What `spec` serves: its model, its `spec.serving` or the defaults, a
    /// target required when `spec.serving` is given.
    pub fn of(spec: &crate::api::ModelInstanceSpec) -> Served {
        Served {
            model: spec.model.clone(),
            serving: spec.serving.clone().unwrap_or_default(),
            target_required: spec.serving.is_some(),
            corrections: Vec::new(),
        }
    }

    /// `corrections` (an instance's `status.corrections`) of this model and
    /// runtime kept: those learned for another are stale, and an unusable
    /// one (`ServingCorrection::check`) is left out.
    pub fn corrected(mut self, corrections: &[crate::api::ServingCorrection]) -> Served {
        self.corrections = corrections
            .iter()
            .filter(|c| c.model == self.model.name && c.runtime == self.serving.runtime)
            .filter(|c| c.usable())
            .cloned()
            .collect();
        self
    }

    /// The correction learned for replicas on `product` of `tensor` GPUs a
    /// shard and `stages` stages, if any.
    pub fn correction_for(&self, product: &str, tensor: u32, stages: u32) -> Option<f64> {
        self.corrections
            .iter()
            .find(|c| c.product == product && c.tensor == tensor && c.stages == stages)
            .map(|c| c.factor)
    }
}

/// The model and `spec.serving` of an instance, as the serving model reads
/// them to judge a plan.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Served {
    pub model: crate::api::ModelSpec,
    pub serving: crate::api::ServingSpec,
    /// Whether no plan is better than one that misses the latency target:
    /// the instance gave `spec.serving` (or a minimum speed). Otherwise the
    /// best plan is placed and said to miss the default target.
    pub target_required: bool,
    /// What the predictions were measured off by (`Served::corrected`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub corrections: Vec<crate::api::ServingCorrection>,
}

/// What an instance's parallelism is chosen for.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct SpeedGoal {
    pub optimize: Optimize,
    /// Predicted tokens/s a plan must reach: among the plans that do, the
    /// fewest GPUs win; with none, there is no plan.
    pub min_tokens_per_second: Option<f64>,
}

/// What `tensor: auto` compares the sizes by.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum Optimize {
    /// Predicted tokens/s per GPU (all GPUs of all stages).
    #[default]
    Throughput,
    /// Predicted tokens/s.
    Latency,
}

/// How a plan shares the cluster, besides its own score.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum Strategy {
    /// The score alone: the fastest, roomiest devices win, whatever they
    /// leave for later instances. Not offered to users; kept as the baseline
    /// the strategies are measured against.
    ScoreOnly,
    /// The smallest sufficient devices, on nodes and fast-link domains
    /// already in use, so whole nodes and domains stay free.
    #[default]
    Pack,
    /// Away from the nodes, racks and zones of the instance's other replicas.
    Spread,
}

impl Problem {
    /// The problem as the solver reads it: temperatures in whole degrees, and a
    /// device at or over the temperature limit marked unhealthy (its exact
    /// reading no longer matters). Two problems
    /// with equal canonical forms get the same answer, so a caller can tell
    /// whether telemetry drift changed anything the solver would see (the raw
    /// temperature decides the limit, the rounded one the score).
    pub fn canonical(&self) -> Problem {
        let mut canonical = self.clone();
        let limit = canonical.max_temperature_c;
        for device in canonical
            .nodes
            .iter_mut()
            .flat_map(|node| node.devices.iter_mut())
        {
            device.temperature_c = match device.temperature_c {
                Some(temperature) if temperature.is_nan() || temperature >= limit => {
                    if device.healthy {
                        device.healthy = false;
                        device.health_reason = Some("too hot".into());
                    }
                    None
                }
                reading => reading.map(scored_temperature),
            };
        }
        canonical
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Stages {
    /// The fewest stages that hold the model, then the best score.
    Auto,
    Fixed(u32),
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct NodeState {
    pub name: String,
    /// Network position: nodes sharing a rack are closer than nodes sharing only
    /// a zone, which are closer than nodes in different zones.
    pub zone: Option<String>,
    pub rack: Option<String>,
    pub labels: BTreeMap<String, String>,
    pub devices: Vec<Device>,
    pub links: Vec<Link>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Device {
    pub id: String,
    pub index: u32,
    /// Lower-case vendor name (`nvidia`, `amd`).
    pub vendor: String,
    pub product: String,
    pub memory_total_bytes: u64,
    pub memory_free_bytes: u64,
    pub fp16_tflops: f64,
    /// Dense FP8 and FP4 rates, where the GPU's tensor cores have them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fp8_tflops: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fp4_tflops: Option<f64>,
    pub memory_bandwidth_gbps: f64,
    pub temperature_c: Option<f64>,
    pub healthy: bool,
    pub health_reason: Option<String>,
    /// Set when another workload holds the device (e.g. `team-a/llama-70b`).
    pub allocated_to: Option<String>,
    /// Set when the GPU cannot be handed out whole: why (in MIG mode, or a
    /// MIG mode change pending).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub not_whole: Option<String>,
    /// Set when the device is part of a GPU rather than a whole one: a MIG
    /// partition, or a memory share sized to the shard it is given to. Only
    /// instances that allow sharing are offered such devices.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub share: Option<DeviceShare>,
}

/// What part of a GPU a device is.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum DeviceShare {
    /// A MIG partition of GPU `gpu`: the device's memory, compute and
    /// bandwidth are the partition's (its multiprocessors' and memory
    /// slices' share of the GPU's).
    Partition {
        gpu: String,
        profile: String,
        /// The whole GPU's FP16 TFLOPS: a partition runs at the GPU's clock,
        /// so its per-layer latencies are the GPU's.
        gpu_tflops: f64,
    },
    /// Part of a whole GPU's memory, sized to the shard, beside the shares
    /// other shards hold already (`memory_free_bytes` is what they leave).
    /// Compute and bandwidth are the GPU's, and are split between the
    /// tenants when they decode at once: no hardware isolation.
    Memory { tenants: u32 },
}

impl Device {
    pub fn tensor_rates(&self) -> TensorRates {
        TensorRates {
            fp16: self.fp16_tflops,
            fp8: self.fp8_tflops,
            fp4: self.fp4_tflops,
        }
    }

    /// The FP16 TFLOPS the device's clock corresponds to: a partition's are
    /// its GPU's.
    pub(crate) fn clock_tflops(&self) -> f64 {
        match &self.share {
            Some(DeviceShare::Partition { gpu_tflops, .. }) => *gpu_tflops,
            _ => self.fp16_tflops,
        }
    }

    /// The GPU memory taking this device for a stage needing `need` bytes
    /// removes from the cluster: a whole GPU's or partition's memory, or a
    /// memory share's size.
    pub(crate) fn taken_bytes(&self, need: f64) -> f64 {
        match &self.share {
            Some(DeviceShare::Memory { .. }) if !self.taken_whole(need) => share_bytes(need) as f64,
            _ => self.memory_total_bytes as f64,
        }
    }

    /// Whether a stage needing `need` bytes takes this memory-share device
    /// as a whole GPU: on a GPU no one shares yet, a share of more than half
    /// would leave a piece few others fit, while the whole GPU gives the
    /// stage all its compute and the rest of the memory as KV cache.
    pub(crate) fn taken_whole(&self, need: f64) -> bool {
        match &self.share {
            Some(DeviceShare::Memory { tenants: 0 }) => {
                share_bytes(need) as f64 > self.memory_total_bytes as f64 / 2.0
            }
            _ => false,
        }
    }

    /// Other shards already on the same GPU (a memory share's tenants).
    pub(crate) fn tenants(&self) -> u32 {
        match &self.share {
            Some(DeviceShare::Memory { tenants }) => *tenants,
            _ => 0,
        }
    }

    /// Whether the device is on a GPU that is split already (a partition, or
    /// a memory share beside others): taking it breaks nothing whole.
    pub(crate) fn on_split_gpu(&self) -> bool {
        match &self.share {
            Some(DeviceShare::Partition { .. }) => true,
            Some(DeviceShare::Memory { tenants }) => *tenants > 0,
            None => false,
        }
    }
}

/// A memory share for a stage needing `need` bytes: whole GiB, as the DRA
/// capacity is counted, at least one.
pub(crate) fn share_bytes(need: f64) -> u64 {
    const GIB: f64 = (1u64 << 30) as f64;
    let gib = (need.max(0.0) / GIB).ceil().max(1.0);
    (gib as u64).saturating_mul(1 << 30)
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum Interconnect {
    NvLink,
    Xgmi,
    Pcie,
}

impl Interconnect {
    /// A direct GPU-to-GPU fabric: devices joined by it form one scale-up
    /// domain, where tensor groups belong.
    pub fn is_scale_up(self) -> bool {
        matches!(self, Interconnect::NvLink | Interconnect::Xgmi)
    }

    /// Whether the bandwidth reported for a pair is that pair's own link
    /// rather than each GPU's share of a switch. xGMI joins each pair of
    /// GPUs directly (AMD's backend reports one pair's links), and RCCL runs
    /// its rings over all of them at once; NVLink's figure is a GPU's total
    /// to its NVSwitch, whatever the peer; PCIe shares the host bridge.
    pub fn is_point_to_point(self) -> bool {
        matches!(self, Interconnect::Xgmi)
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Link {
    pub a: String,
    pub b: String,
    pub kind: Interconnect,
    pub bandwidth_gbps: f64,
}

/// The model as the solver sees it: bytes and FLOPs per layer.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ModelShape {
    pub layers: u32,
    pub weight_bytes_per_layer: f64,
    pub kv_bytes_per_layer: f64,
    /// Needed on every device regardless of its share of layers.
    pub overhead_bytes_per_device: f64,
    /// Bytes of activations one token carries from one stage to the next.
    pub activation_bytes_per_token: f64,
    /// Floating-point operations one layer spends on one decoded token.
    pub flops_per_layer_token: f64,
    /// The format those operations run in (from the weights' dtype).
    pub precision: Precision,
}

impl ModelShape {
    /// The model as the solver sees it, with `kv_bytes_per_layer` the
    /// reserved KV cache (`kvCacheGiB`, 0 when none is).
    pub fn of(model: &crate::api::ModelSpec) -> ModelShape {
        let layers = model.layers;
        ModelShape {
            layers,
            weight_bytes_per_layer: model.weight_bytes_per_layer(),
            kv_bytes_per_layer: model.reserved_kv_bytes_per_layer().unwrap_or(0.0),
            overhead_bytes_per_device: model.overhead_gib * crate::api::GIB,
            // Activations cross stages in 16-bit precision whatever the weight dtype.
            activation_bytes_per_token: model.effective_hidden_size() * 2.0,
            flops_per_layer_token: 2.0 * model.parameters_billions * 1e9 / f64::from(layers.max(1)),
            precision: Precision::of(model.dtype),
        }
    }
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Selector {
    /// Allowed vendors; empty allows all.
    pub vendors: Vec<String>,
    /// Allowed products as case-insensitive substrings; empty allows all.
    pub products: Vec<String>,
    /// Labels a node must carry.
    pub node_labels: BTreeMap<String, String>,
    /// Exactly this product: set by `sizing` when it compares GPU kinds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kind: Option<String>,
}

/// Relative weights of the score parts; normalised by their sum when scoring.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Weights {
    pub compute: f64,
    pub memory: f64,
    pub network: f64,
    pub thermal: f64,
    pub bandwidth: f64,
}

impl Default for Weights {
    fn default() -> Self {
        Self {
            compute: 0.40,
            memory: 0.30,
            network: 0.15,
            thermal: 0.10,
            bandwidth: 0.05,
        }
    }
}

impl Weights {
    /// The weights scaled to sum to one (all-zero weights count parts equally).
    pub fn normalized(self) -> Weights {
        let parts = [
            self.compute,
            self.memory,
            self.network,
            self.thermal,
            self.bandwidth,
        ]
        .map(|weight| {
            if weight.is_finite() {
                weight.max(0.0)
            } else {
                0.0
            }
        });
        let sum: f64 = parts.iter().sum();
        if sum <= 0.0 {
            return Weights {
                compute: 0.2,
                memory: 0.2,
                network: 0.2,
                thermal: 0.2,
                bandwidth: 0.2,
            };
        }
        Weights {
            compute: parts[0] / sum,
            memory: parts[1] / sum,
            network: parts[2] / sum,
            thermal: parts[3] / sum,
            bandwidth: parts[4] / sum,
        }
    }
}

/// The only clock the solver knows: whoever calls it decides what "too late" is.
pub trait Deadline {
    fn expired(&self) -> bool;
}

/// How long the solver may search. `max_steps` bounds the search deterministically
/// (the same input always stops at the same point); the deadline bounds wall time.
pub struct SolveOptions<'a> {
    pub deadline: Option<&'a dyn Deadline>,
    pub max_steps: u64,
}

impl Default for SolveOptions<'_> {
    fn default() -> Self {
        Self {
            deadline: None,
            max_steps: 250_000,
        }
    }
}
