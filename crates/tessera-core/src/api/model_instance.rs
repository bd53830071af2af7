//! The `ModelInstance` custom resource: a model to serve, how to split it, and
//! where it may go. The CRD schema carries every range and enum so the API server
//! refuses bad objects at `kubectl apply`; `validate` repeats those rules for
//! input that does not pass through an API server (the CLI, or an older CRD).

// kube-derive's `KubeSchema` copies each struct into a private module of its own
// to build the schema; the lint would flag those copies, not our items.
#![allow(unreachable_pub)]

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::PodTemplateSpec;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kube::{CustomResource, KubeSchema};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::limits::{
    self, DEADLINE_MS, DEMAND_REPLICAS, HEADS, HIDDEN_SIZE, KV_CACHE_GIB, LAYERS,
    MAX_TEMPERATURE_C, MIN_TOKENS_PER_SECOND, MODEL_NAME_LENGTH, OVERHEAD_GIB, PARAMETERS_BILLIONS,
    PIPELINE, REPLICAS, TENSOR, WEIGHT, WEIGHT_BYTES_PER_PARAMETER,
};
use super::{
    GIB, KvCacheDtype, MeasuredDemand, MeasuredServing, MoveInFlight, ServingCorrection,
    ServingSpec, Vendor,
};

/// A large model served as a pipeline of shards placed on exactly planned GPUs.
// Two printer columns share `type_ = "integer"`, which clippy mistakes for a repeated attribute.
#[allow(clippy::duplicated_attributes)]
#[derive(CustomResource, KubeSchema, Clone, Debug, PartialEq, Serialize, Deserialize)]
#[kube(
    group = "tessera.dev",
    version = "v1alpha1",
    kind = "ModelInstance",
    plural = "modelinstances",
    shortname = "mi",
    namespaced,
    status = "ModelInstanceStatus",
    scale(
        spec_replicas_path = ".spec.replicas",
        status_replicas_path = ".status.replicas",
        label_selector_path = ".status.selector"
    ),
    derive = "PartialEq",
    doc = "A large model served as a pipeline of shards, each bound to the GPUs it was planned for.",
    printcolumn(name = "Phase", type_ = "string", json_path = ".status.phase"),
    printcolumn(name = "Replicas", type_ = "integer", json_path = ".spec.replicas"),
    printcolumn(
        name = "Ready-Replicas",
        type_ = "integer",
        json_path = ".status.readyReplicas",
        priority = 1
    ),
    printcolumn(name = "Shards", type_ = "integer", json_path = ".status.shards"),
    printcolumn(name = "Ready", type_ = "integer", json_path = ".status.readyShards"),
    printcolumn(
        name = "Tokens/s",
        type_ = "number",
        json_path = ".status.predictedTokensPerSecond",
        priority = 1
    ),
    printcolumn(
        name = "Requests/s",
        type_ = "number",
        json_path = ".status.capacity.requestsPerSecond",
        priority = 1
    ),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[kube(validation = Rule::new(limits::instance_name_rule()).message(kube::core::Message::Message(limits::instance_name_message())))]
#[x_kube(validation = Rule::new(
    "type(self.parallelism.pipeline) == string || self.parallelism.pipeline <= self.model.layers"
).message("parallelism.pipeline cannot exceed model.layers: every stage needs at least one layer"))]
#[x_kube(validation = Rule::new(SHARING_RULE).message(SHARING_MESSAGE))]
#[serde(rename_all = "camelCase")]
pub struct ModelInstanceSpec {
    /// The model to serve: its size, shape and data type, from which the
    /// memory each shard needs and its predicted speed follow.
    pub model: ModelSpec,
    /// Independent copies of the model, each a gang of shards placed all or
    /// nothing. `kubectl scale` and a HorizontalPodAutoscaler set it through
    /// the scale subresource. With serving.replicasFromDemand the controller
    /// plans as many as serving.requestsPerSecond needs instead, and this
    /// field is not read; so with serving.demand Measured, until it is
    /// changed: then it is the count and the measured demand is not followed
    /// (the status says so) until it is set back.
    #[serde(default = "one_replica")]
    #[schemars(range(min = REPLICAS.min, max = REPLICAS.max))]
    pub replicas: u32,
    /// How a replica is split: GPUs per shard (tensor) and shards in a
    /// pipeline, fixed or chosen by the solver.
    #[serde(default)]
    pub parallelism: ParallelismSpec,
    /// Where and how the shards may be placed: which GPUs and nodes, the
    /// score weights, the strategy, sharing and the solver's deadline.
    #[serde(default)]
    pub placement: PlacementPolicy,
    /// What happens to a replica when one of its shard pods fails, is
    /// deleted or has to be replaced: `RecreateReplica` (default) recreates
    /// all of the replica's pods, `RecreatePod` only that one.
    // Left out when the default, like the other enums added after v1alpha1's
    // first objects; it is in no hash, so no plan or pod changes with it.
    #[serde(default, skip_serializing_if = "RestartPolicy::is_recreate_replica")]
    pub restart_policy: RestartPolicy,
    /// What the instance is served with and for: the runtime, the typical
    /// request, the latency every user must get and the demand. Unset: vLLM,
    /// 1024 prompt and 256 output tokens, 50 ms per token, 2 s to the first.
    /// The predicted capacity at that target is in `tessera place`.
    // Not in the placement hash (yet): it judges plans, it does not change them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub serving: Option<ServingSpec>,
    /// Pod template for every shard's runtime container(s). The controller adds the
    /// GPU request, the device annotations and the shard environment. Required to
    /// run the instance; `tessera place` does not need it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "pod_template_schema")]
    pub template: Option<PodTemplateSpec>,
}

/// `model.attentionHeads` and `kvHeads`: in range, heads dividing the hidden
/// size, KV heads dividing the heads.
fn check_heads(model: &ModelSpec, problems: &mut Vec<String>) {
    if let Some(heads) = model.attention_heads {
        HEADS.check("model.attentionHeads", heads, problems);
        if let Some(hidden) = model.hidden_size
            && heads > 0
            && hidden % heads != 0
        {
            problems.push(format!(
                "model.attentionHeads: {heads} heads do not divide hiddenSize {hidden}; {HEADS_DIVIDE_HIDDEN_MESSAGE}"
            ));
        }
    }
    if let Some(kv) = model.kv_heads {
        HEADS.check("model.kvHeads", kv, problems);
        if let Some(heads) = model.attention_heads
            && kv > 0
            && (kv > heads || heads % kv != 0)
        {
            problems.push(format!(
                "model.kvHeads: {kv} for {heads} attention heads; {KV_HEADS_MESSAGE}"
            ));
        }
    }
}

/// `model.weightsGiB`: a size the parameters can take.
fn check_weights(model: &ModelSpec, problems: &mut Vec<String>) {
    let Some(gib) = model.weights_gib else {
        return;
    };
    let parameters = model.parameters_billions * 1e9;
    if !(parameters.is_finite() && parameters > 0.0) {
        return; // parametersBillions has its own problem
    }
    let per_parameter = gib * GIB / parameters;
    let bounds = WEIGHT_BYTES_PER_PARAMETER;
    if !(bounds.min..=bounds.max).contains(&per_parameter) {
        problems.push(format!(
            "model.weightsGiB: {gib} GiB is {per_parameter:.3} bytes a parameter of {} billion; {WEIGHTS_MESSAGE}",
            model.parameters_billions
        ));
    }
}

impl ModelInstanceSpec {
    /// How the replica count is decided while a measured demand is
    /// followed; `measured` is the demand it is planned for now (the
    /// controller's, from the status), unset before anything was measured.
    pub fn replica_count(&self, measured: Option<f64>) -> ReplicaCount {
        let serving = self.serving.as_ref();
        if let Some((least, most)) = serving.and_then(ServingSpec::measured_bounds) {
            return ReplicaCount::ForDemand {
                requests_per_second: measured.or(self.demand()).unwrap_or(0.0),
                least,
                most,
            };
        }
        match self.demand() {
            Some(demand) if serving.is_some_and(|s| s.replicas_from_demand) => {
                ReplicaCount::ForDemand {
                    requests_per_second: demand,
                    least: 1,
                    most: DEMAND_REPLICAS.max,
                }
            }
            _ => ReplicaCount::Fixed(self.replicas),
        }
    }

    /// The replicas asked for: `replicas`, or `None` for as many as a
    /// demand needs.
    pub fn fixed_replicas(&self) -> Option<u32> {
        match self.replica_count(None) {
            ReplicaCount::Fixed(count) => Some(count),
            ReplicaCount::ForDemand { .. } => None,
        }
    }

    /// The most replicas the instance may have: the fixed count, or the
    /// most a demand is served with (or `replicas`, which a measured demand
    /// hands the count to once it is changed).
    pub fn most_replicas(&self) -> u32 {
        match self.replica_count(None) {
            ReplicaCount::Fixed(count) => count,
            ReplicaCount::ForDemand { most, .. } if self.measured_demand() => {
                most.max(self.replicas)
            }
            ReplicaCount::ForDemand { most, .. } => most,
        }
    }

    /// Whether `serving.demand` is `Measured`.
    pub fn measured_demand(&self) -> bool {
        self.serving
            .as_ref()
            .is_some_and(|s| s.measured_bounds().is_some())
    }

    /// `serving.requestsPerSecond`.
    pub fn demand(&self) -> Option<f64> {
        self.serving.as_ref()?.requests_per_second
    }
}

fn one_replica() -> u32 {
    1
}

/// How many replicas an instance gets.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum ReplicaCount {
    /// `spec.replicas`.
    Fixed(u32),
    /// As many as serve `requests_per_second` at the latency target, at
    /// least `least` and at most `most`.
    ForDemand {
        requests_per_second: f64,
        least: u32,
        most: u32,
    },
}

/// An instance may share GPUs only with one shard on one GPU: MIG partitions
/// have no peer-to-peer between them, so collective libraries cannot span
/// them, and a memory share has no link of its own.
const SHARING_RULE: &str = "!has(self.placement) || !has(self.placement.sharing) || self.placement.sharing == 'Exclusive' || !has(self.parallelism) || ((!has(self.parallelism.pipeline) || type(self.parallelism.pipeline) == string || self.parallelism.pipeline == 1) && (!has(self.parallelism.tensor) || (type(self.parallelism.tensor) == int && self.parallelism.tensor == 1)))";
const SHARING_MESSAGE: &str = "placement.sharing Isolated or Shared runs one shard on one GPU: set parallelism.tensor: 1 and parallelism.pipeline: 1 or auto, which is one stage there (MIG partitions have no peer-to-peer, so a shard cannot span them)";

/// Heads split the hidden size evenly.
const HEADS_DIVIDE_HIDDEN_RULE: &str = "!has(self.attentionHeads) || !has(self.hiddenSize) || self.hiddenSize % self.attentionHeads == 0";
const HEADS_DIVIDE_HIDDEN_MESSAGE: &str =
    "model.attentionHeads must divide model.hiddenSize: every head has the same width";
/// Grouped-query attention: every KV head serves the same number of heads.
const KV_HEADS_RULE: &str = "!has(self.kvHeads) || !has(self.attentionHeads) || (self.kvHeads <= self.attentionHeads && self.attentionHeads % self.kvHeads == 0)";
const KV_HEADS_MESSAGE: &str = "model.kvHeads must be at most model.attentionHeads and divide it (each KV head serves the same number of attention heads)";
/// A checkpoint's size says how its parameters are stored: one bit to fp32
/// each (`WEIGHT_BYTES_PER_PARAMETER`; GiB = 1073741824 bytes).
const WEIGHTS_RULE: &str = "!has(self.weightsGiB) || (self.weightsGiB * 1073741824.0 >= self.parametersBillions * 125000000.0 && self.weightsGiB * 1073741824.0 <= self.parametersBillions * 4000000000.0)";
const WEIGHTS_MESSAGE: &str = "model.weightsGiB must hold 0.125 to 4 bytes a parameter (1-bit to fp32) of model.parametersBillions";

/// How the controller repairs a replica that lost a shard pod.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum RestartPolicy {
    /// Every pod of the replica is deleted and created again, on the
    /// devices of its plan where they are still fine: the ranks of a
    /// multi-node runtime (vLLM, torch.distributed) cannot take a new peer
    /// into a running group. A one-shard replica is the same either way.
    #[default]
    RecreateReplica,
    /// Only the lost pod is created again; the others keep running. For
    /// runtimes whose shards reconnect to a new peer by themselves.
    RecreatePod,
}

impl RestartPolicy {
    fn is_recreate_replica(&self) -> bool {
        *self == RestartPolicy::RecreateReplica
    }
}

/// The pod template is kept as an open object in the CRD: the full PodSpec schema
/// would make the CRD hundreds of kilobytes, and the API server validates the
/// shard pods themselves when the controller creates them.
fn pod_template_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
    schemars::json_schema!({
        "type": "object",
        "description": "A core/v1 PodTemplateSpec (metadata and spec) for the shard pods.",
        "x-kubernetes-preserve-unknown-fields": true,
    })
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new(HEADS_DIVIDE_HIDDEN_RULE).message(HEADS_DIVIDE_HIDDEN_MESSAGE))]
#[x_kube(validation = Rule::new(KV_HEADS_RULE).message(KV_HEADS_MESSAGE))]
#[x_kube(validation = Rule::new(WEIGHTS_RULE).message(WEIGHTS_MESSAGE))]
pub struct ModelSpec {
    /// Model name, for people and for the shard runtime (e.g. `meta-llama/Llama-3.1-70B`).
    #[schemars(length(min = MODEL_NAME_LENGTH.min, max = MODEL_NAME_LENGTH.max))]
    pub name: String,
    /// Parameter count in billions (70.6 for a 70B-class model).
    #[schemars(range(min = PARAMETERS_BILLIONS.min, max = PARAMETERS_BILLIONS.max))]
    pub parameters_billions: f64,
    /// Transformer layers; the unit a pipeline is split by.
    #[schemars(range(min = LAYERS.min, max = LAYERS.max))]
    pub layers: u32,
    /// Weight data type; sets the bytes per parameter, and the tensor rate
    /// the matrix multiplications run at: fp8 and fp4 at the GPU's FP8 and
    /// FP4 rates where it has them (else widened to one it has), the integer
    /// formats dequantised to 16 bits.
    #[serde(default)]
    pub dtype: DType,
    /// The checkpoint's weights in GiB, where they are not parametersBillions
    /// × dtype's bytes: a checkpoint that keeps some layers unquantised
    /// (Meta's Llama-3.1-405B-FP8 keeps attention and its first and last
    /// layers in BF16: 454 GiB, not the 378 of 405.9 billion FP8 parameters).
    /// Sets the memory a shard's weights take and what a decode step reads;
    /// dtype still sets the rate the matrix multiplications run at. 0.125 to
    /// 4 bytes a parameter (1-bit to fp32). Unset: parametersBillions ×
    /// dtype's bytes.
    #[serde(
        default,
        rename = "weightsGiB",
        skip_serializing_if = "Option::is_none"
    )]
    pub weights_gib: Option<f64>,
    /// Hidden size, used for the activation transfer between stages. Estimated
    /// from the parameter and layer counts when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = HIDDEN_SIZE.min, max = HIDDEN_SIZE.max))]
    pub hidden_size: Option<u32>,
    /// Attention heads (`num_attention_heads` in the model's config.json), a
    /// divisor of hiddenSize: with kvHeads they set the KV cache a token
    /// needs. Unknown: hiddenSize / 128 (128-wide heads).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = HEADS.min, max = HEADS.max))]
    pub attention_heads: Option<u32>,
    /// Key/value heads (`num_key_value_heads`; fewer than attentionHeads
    /// with grouped-query attention), a divisor of attentionHeads (without
    /// attentionHeads, of 128-wide heads). Unknown:
    /// one per attention head, the most KV cache a model of this size can
    /// need, so capacity is never overstated. A tensor size above it keeps a
    /// copy of a KV head on several GPUs, and the KV cache is sized so.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = HEADS.min, max = HEADS.max))]
    pub kv_heads: Option<u32>,
    /// What the KV cache is stored in: `auto` (the runtime's default), `fp16`,
    /// `bf16` or `fp8`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(transform = no_null_in_enum)]
    pub kv_cache_dtype: Option<KvCacheDtype>,
    /// KV cache reserved for a replica in GiB, split across its stages with
    /// the layers. Unset (or 0): a shard's KV cache is whatever its devices
    /// hold after the weights and overhead, as vLLM takes it; a plan must
    /// leave room for at least one request of serving.inputTokens +
    /// outputTokens, and a memory share is sized to the requests the demand
    /// keeps in flight.
    #[serde(
        default,
        rename = "kvCacheGiB",
        skip_serializing_if = "Option::is_none"
    )]
    #[schemars(range(min = KV_CACHE_GIB.min, max = KV_CACHE_GIB.max))]
    pub kv_cache_gib: Option<f64>,
    /// Memory every device needs besides weights and KV cache (runtime context,
    /// activations, fragmentation), in GiB.
    #[serde(default = "default_overhead_gib", rename = "overheadGiB")]
    #[schemars(range(min = OVERHEAD_GIB.min, max = OVERHEAD_GIB.max))]
    pub overhead_gib: f64,
}

fn default_overhead_gib() -> f64 {
    1.5
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum DType {
    Fp32,
    #[default]
    Bf16,
    Fp16,
    Fp8,
    Int8,
    Int4,
    Fp4,
}

impl DType {
    pub fn bytes_per_parameter(self) -> f64 {
        match self {
            DType::Fp32 => 4.0,
            DType::Bf16 | DType::Fp16 => 2.0,
            DType::Fp8 | DType::Int8 => 1.0,
            DType::Int4 | DType::Fp4 => 0.5,
        }
    }
}

impl ModelSpec {
    /// The checkpoint's weights: `weightsGiB` where set, else the
    /// parameters at dtype's bytes.
    pub fn weight_bytes(&self) -> f64 {
        match self.weights_gib {
            Some(gib) => gib * GIB,
            None => self.parameters_billions * 1e9 * self.dtype.bytes_per_parameter(),
        }
    }

    pub fn weight_bytes_per_layer(&self) -> f64 {
        self.weight_bytes() / f64::from(self.layers.max(1))
    }

    /// The KV cache reserved per layer, when `kvCacheGiB` reserves one.
    pub fn reserved_kv_bytes_per_layer(&self) -> Option<f64> {
        self.reserved_kv_gib()
            .map(|gib| gib * GIB / f64::from(self.layers.max(1)))
    }

    /// `kvCacheGiB` when it reserves something (0 reserves nothing: the
    /// devices' room is the cache, as when it is unset).
    pub fn reserved_kv_gib(&self) -> Option<f64> {
        self.kv_cache_gib.filter(|gib| *gib > 0.0)
    }

    /// The given hidden size, or the one a standard decoder block of this size has
    /// (about 12·h² parameters per layer).
    pub fn effective_hidden_size(&self) -> f64 {
        match self.hidden_size {
            Some(h) => f64::from(h),
            None => (self.parameters_billions * 1e9 / (12.0 * f64::from(self.layers.max(1))))
                .sqrt()
                .max(1.0),
        }
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct ParallelismSpec {
    /// GPUs per shard, all on one node (tensor parallelism): a number, or
    /// `auto` for the size (and GPU kind) that serves best under `optimize`.
    #[serde(default)]
    pub tensor: TensorSize,
    /// Pipeline stages (= shards): a number, or `auto` for the fewest stages
    /// that fit, then the best score; under `optimize: throughput` up to two
    /// more stages where they serve more requests/s at the target per GPU.
    #[serde(default)]
    pub pipeline: PipelineStages,
    /// What `tensor: auto` and `pipeline: auto` choose for: `throughput`
    /// (default) the most requests/s at the latency target (`spec.serving`)
    /// per GPU, `latency` the lowest time per output token for one request.
    // Left out when `throughput`, so specs written before it existed keep
    // their placement hash and their running plans.
    #[serde(default, skip_serializing_if = "Optimize::is_throughput")]
    pub optimize: Optimize,
    /// Predicted single-stream tokens/s a replica must reach: the fewest GPUs
    /// that reach it win, and the instance is refused when no plan does.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = MIN_TOKENS_PER_SECOND.min, max = MIN_TOKENS_PER_SECOND.max))]
    pub min_tokens_per_second: Option<f64>,
}

impl Default for ParallelismSpec {
    fn default() -> Self {
        Self {
            tensor: TensorSize::default(),
            pipeline: PipelineStages::Auto,
            optimize: Optimize::default(),
            min_tokens_per_second: None,
        }
    }
}

/// What `parallelism.tensor: auto` optimises.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum Optimize {
    /// The most requests/s at the latency target per GPU among the shapes
    /// that hold the model, batched as the runtime batches them.
    #[default]
    Throughput,
    /// The lowest time per output token for one request (the highest
    /// single-stream tokens/s), however many GPUs it takes.
    Latency,
}

impl Optimize {
    fn is_throughput(&self) -> bool {
        *self == Optimize::Throughput
    }
}

/// `auto` or a stage count. On the wire an int-or-string, as Kubernetes users know
/// from `maxUnavailable`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum PipelineStages {
    #[default]
    Auto,
    Fixed(u32),
}

/// `auto` or a number of GPUs per shard; an int-or-string like
/// [`PipelineStages`]. One GPU when absent.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TensorSize {
    Auto,
    Fixed(u32),
}

impl Default for TensorSize {
    fn default() -> Self {
        TensorSize::Fixed(1)
    }
}

impl TensorSize {
    /// The fixed size, if it is one.
    pub fn fixed(self) -> Option<u32> {
        match self {
            TensorSize::Auto => None,
            TensorSize::Fixed(size) => Some(size),
        }
    }
}

/// What an int-or-string field holding `auto` or a count is called and may hold.
struct AutoOrCount {
    field: &'static str,
    /// What the count counts, for messages (`stages`).
    unit: &'static str,
    bounds: super::limits::Bounds<u32>,
}

const PIPELINE_FIELD: AutoOrCount = AutoOrCount {
    field: "pipeline",
    unit: "stages",
    bounds: PIPELINE,
};

const TENSOR_FIELD: AutoOrCount = AutoOrCount {
    field: "tensor",
    unit: "GPUs per shard",
    bounds: TENSOR,
};

impl AutoOrCount {
    fn serialize<S: serde::Serializer>(count: Option<u32>, s: S) -> Result<S::Ok, S::Error> {
        match count {
            None => s.serialize_str("auto"),
            Some(n) => s.serialize_u32(n),
        }
    }

    /// `None` for `auto`.
    fn deserialize<'de, D: serde::Deserializer<'de>>(
        &'static self,
        d: D,
    ) -> Result<Option<u32>, D::Error> {
        d.deserialize_any(AutoOrCountVisitor(self))
    }

    fn schema(&self) -> schemars::Schema {
        let (field, unit) = (self.field, self.unit);
        let (min, max) = (self.bounds.min, self.bounds.max);
        schemars::json_schema!({
            "description": format!("\"auto\" or a number of {unit} from {min} to {max}."),
            "x-kubernetes-int-or-string": true,
            "x-kubernetes-validations": [{
                "rule": format!("type(self) == string ? self == 'auto' : (self >= {min} && self <= {max})"),
                "message": format!("{field} must be \"auto\" or a number of {unit} from {min} to {max}"),
            }],
        })
    }
}

struct AutoOrCountVisitor(&'static AutoOrCount);

impl serde::de::Visitor<'_> for AutoOrCountVisitor {
    type Value = Option<u32>;
    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        let spec = self.0;
        write!(
            f,
            "\"auto\" or a number of {} from {} to {}",
            spec.unit, spec.bounds.min, spec.bounds.max
        )
    }
    fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Self::Value, E> {
        if v == "auto" {
            return Ok(None);
        }
        // Quoted numbers are what YAML authors write by accident; accept them.
        match v.parse::<i64>() {
            Ok(n) => self.visit_i64(n),
            Err(_) => Err(E::custom(format!(
                "{} {v:?} is neither \"auto\" nor a number of {}",
                self.0.field, self.0.unit
            ))),
        }
    }
    fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<Self::Value, E> {
        let spec = self.0;
        match u32::try_from(v) {
            Ok(n) if (spec.bounds.min..=spec.bounds.max).contains(&n) => Ok(Some(n)),
            _ => Err(E::custom(format!(
                "{} {v} is out of range: use \"auto\" or {} to {} {}",
                spec.field, spec.bounds.min, spec.bounds.max, spec.unit
            ))),
        }
    }
    fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<Self::Value, E> {
        self.visit_i64(i64::try_from(v).unwrap_or(i64::MAX))
    }
    fn visit_f64<E: serde::de::Error>(self, v: f64) -> Result<Self::Value, E> {
        Err(E::custom(format!(
            "{} {v} is not a whole number of {}",
            self.0.field, self.0.unit
        )))
    }
}

impl Serialize for PipelineStages {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let count = match self {
            PipelineStages::Auto => None,
            PipelineStages::Fixed(n) => Some(*n),
        };
        AutoOrCount::serialize(count, s)
    }
}

impl<'de> Deserialize<'de> for PipelineStages {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Ok(PIPELINE_FIELD
            .deserialize(d)?
            .map_or(PipelineStages::Auto, PipelineStages::Fixed))
    }
}

impl JsonSchema for PipelineStages {
    fn schema_name() -> std::borrow::Cow<'static, str> {
        "PipelineStages".into()
    }
    fn json_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
        PIPELINE_FIELD.schema()
    }
    fn inline_schema() -> bool {
        true
    }
}

impl Serialize for TensorSize {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        AutoOrCount::serialize(self.fixed(), s)
    }
}

impl<'de> Deserialize<'de> for TensorSize {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Ok(TENSOR_FIELD
            .deserialize(d)?
            .map_or(TensorSize::Auto, TensorSize::Fixed))
    }
}

impl JsonSchema for TensorSize {
    fn schema_name() -> std::borrow::Cow<'static, str> {
        "TensorSize".into()
    }
    fn json_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
        TENSOR_FIELD.schema()
    }
    fn inline_schema() -> bool {
        true
    }
}

impl Strategy {
    fn is_pack(&self) -> bool {
        *self == Strategy::Pack
    }
}

/// How replicas and instances share the cluster.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum Strategy {
    /// The smallest sufficient devices, on the smallest nodes and NVLink/xGMI
    /// domains, so large ones stay free for large models where few are left.
    #[default]
    Pack,
    /// Replicas on different nodes, racks and zones, so one failure takes
    /// down as few replicas as possible.
    Spread,
}

/// Whether an instance's shards may be given part of a GPU.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum Sharing {
    /// Whole GPUs only.
    #[default]
    Exclusive,
    /// Whole GPUs or MIG partitions: each partition has its own memory,
    /// multiprocessors and memory bandwidth, isolated by the hardware.
    Isolated,
    /// Whole GPUs, MIG partitions, or a memory share of a whole GPU sized to
    /// the shard. Shares of one GPU split its compute and bandwidth with no
    /// isolation (like time-slicing): a tenant that overruns its memory
    /// share can starve the others.
    Shared,
}

impl Sharing {
    pub(crate) fn is_exclusive(&self) -> bool {
        *self == Sharing::Exclusive
    }
}

/// Whether tessera may move an instance's running replicas to other devices.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum Moves {
    /// A replica may be moved, make before break (its new copy Ready before
    /// the old one goes): to make room for a replica that cannot be placed
    /// (to devices where it serves as much at its latency target, or with
    /// the controller's continuous moves less, for more the blocked replica
    /// serves), off a cordoned node, and with continuous moves where the
    /// cluster serves more. Never where it would miss a target it meets.
    #[default]
    Allowed,
    /// The instance's replicas stay where they were placed.
    Never,
}

impl Moves {
    pub fn is_allowed(&self) -> bool {
        *self == Moves::Allowed
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct PlacementPolicy {
    /// `pack` (default) keeps large devices, whole nodes and whole NVLink/xGMI
    /// domains free; `spread` puts replicas on different nodes, racks and zones.
    // Left out when `pack`, so specs written before strategies existed keep
    // their placement hash and their running plans.
    #[serde(default, skip_serializing_if = "Strategy::is_pack")]
    pub strategy: Strategy,
    #[serde(default)]
    pub weights: ScoreWeights,
    /// Devices at or above this temperature are not planned on.
    #[serde(default = "default_max_temperature")]
    #[schemars(range(min = MAX_TEMPERATURE_C.min, max = MAX_TEMPERATURE_C.max))]
    pub max_temperature_c: f64,
    /// Allowed vendors (`nvidia`, `amd`); empty allows both.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[x_kube(validation = vendors_rule())]
    pub vendors: Vec<String>,
    /// Allowed products, matched case-insensitively as substrings of the product
    /// name (`H100`, `MI300X`); empty allows all.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[x_kube(validation = Rule::new("self.all(p, size(p) > 0)")
        .message("products may not contain empty strings"))]
    pub products: Vec<String>,
    /// Only nodes with all of these labels are used.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub node_selector: BTreeMap<String, String>,
    /// Whether shards may be given part of a GPU: `Exclusive` (default)
    /// whole GPUs only; `Isolated` also MIG partitions (hardware-isolated
    /// memory and compute); `Shared` also memory shares of whole GPUs
    /// (sized to the shard, no isolation: like time-slicing). Isolated and
    /// Shared need `parallelism.tensor: 1` and `parallelism.pipeline: 1`.
    // Left out when `Exclusive`, so specs written before it existed keep
    // their placement hash and their running plans.
    #[serde(default, skip_serializing_if = "Sharing::is_exclusive")]
    pub sharing: Sharing,
    /// Whether tessera may move this instance's running replicas, make
    /// before break: `Allowed` (default) or `Never`. Moves make room for a
    /// replica that cannot be placed, leave cordoned nodes and, with the
    /// controller's continuous moves, go where the cluster serves more. A
    /// replica is never moved where it would miss a latency target it meets.
    // Left out when `Allowed`, so specs written before it existed keep their
    // placement hash; the hash leaves it out in any case.
    #[serde(default, skip_serializing_if = "Moves::is_allowed")]
    pub moves: Moves,
    /// Time the solver may search for a better plan before it returns the best found.
    #[serde(default = "default_deadline_ms")]
    #[schemars(range(min = DEADLINE_MS.min, max = DEADLINE_MS.max))]
    pub deadline_ms: u32,
}

fn default_max_temperature() -> f64 {
    85.0
}

fn default_deadline_ms() -> u32 {
    2000
}

impl Default for PlacementPolicy {
    fn default() -> Self {
        Self {
            strategy: Strategy::default(),
            weights: ScoreWeights::default(),
            max_temperature_c: default_max_temperature(),
            vendors: Vec::new(),
            products: Vec::new(),
            node_selector: BTreeMap::new(),
            sharing: Sharing::default(),
            moves: Moves::default(),
            deadline_ms: default_deadline_ms(),
        }
    }
}

/// Weights of the five parts of a plan's score. Relative: they are normalised by
/// their sum, so they need not add up to 1.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new(
    "self.compute + self.memory + self.network + self.thermal + self.bandwidth > 0.0"
).message("at least one score weight must be above zero"))]
pub struct ScoreWeights {
    /// Weight of the score part for compute: the slowest device's FP16 TFLOPS against the fastest eligible device's.
    #[serde(default = "w_compute")]
    #[schemars(range(min = WEIGHT.min, max = WEIGHT.max))]
    pub compute: f64,
    /// Weight of the score part for memory: the share of the planned devices' memory left free once the model is loaded.
    #[serde(default = "w_memory")]
    #[schemars(range(min = WEIGHT.min, max = WEIGHT.max))]
    pub memory: f64,
    /// Weight of the score part for network: how cheap the pipeline hops and the tensor groups' links are.
    #[serde(default = "w_network")]
    #[schemars(range(min = WEIGHT.min, max = WEIGHT.max))]
    pub network: f64,
    /// Weight of the score part for thermal: the hottest device's headroom below the temperature limit.
    #[serde(default = "w_thermal")]
    #[schemars(range(min = WEIGHT.min, max = WEIGHT.max))]
    pub thermal: f64,
    /// Weight of the score part for bandwidth: the slowest device's memory bandwidth against the best eligible device's.
    #[serde(default = "w_bandwidth")]
    #[schemars(range(min = WEIGHT.min, max = WEIGHT.max))]
    pub bandwidth: f64,
}

fn w_compute() -> f64 {
    0.40
}
fn w_memory() -> f64 {
    0.30
}
fn w_network() -> f64 {
    0.15
}
fn w_thermal() -> f64 {
    0.10
}
fn w_bandwidth() -> f64 {
    0.05
}

impl Default for ScoreWeights {
    fn default() -> Self {
        Self {
            compute: w_compute(),
            memory: w_memory(),
            network: w_network(),
            thermal: w_thermal(),
            bandwidth: w_bandwidth(),
        }
    }
}

/// What the controller planned and sees running, written by it alone: the
/// phase and conditions, the plan shard by shard, the counts the scale
/// subresource reads, and the predicted speed.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ModelInstanceStatus {
    /// Where the instance stands: `Pending` (no plan, or none fits: the
    /// `Placed` condition says why), `Placing` (pods being made and bound),
    /// `Bound` (every pod bound, not all ready), `Running` (every shard
    /// ready), `Degraded` (a plan that lost shards, or some not ready after
    /// running) or `Failed` (the spec cannot run).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(transform = no_null_in_enum)]
    pub phase: Option<Phase>,
    /// The `metadata.generation` of the spec this status was written for.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// `Placed`, `Ready`, `Progressing` and, while replicas are being
    /// recreated, `ReplicaFailure`, each with its reason and message.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
    /// Planned shards, replica by replica, each replica's in pipeline order.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub plan: Vec<PlannedShard>,
    /// Shards of every replica.
    #[serde(default)]
    pub shards: u32,
    /// Shards of every replica whose pod is ready.
    #[serde(default)]
    pub ready_shards: u32,
    /// Replicas with a pod for every shard (the scale subresource's
    /// `status.replicas`).
    #[serde(default)]
    pub replicas: u32,
    /// Replicas whose shards are all ready.
    #[serde(default)]
    pub ready_replicas: u32,
    /// Label selector of the instance's shard pods, for a
    /// HorizontalPodAutoscaler (the scale subresource's selector).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub selector: Option<String>,
    /// Predicted single-stream decode tokens/s of the placed replicas
    /// together (replicas serve independent requests, so their speeds add).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub predicted_tokens_per_second: Option<f64>,
    /// Each placed replica's predicted single-stream decode tokens/s and its
    /// capacity at the latency target.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub replica_predictions: Vec<ReplicaPrediction>,
    /// What the placed replicas serve together at the latency target
    /// (`spec.serving`), and the demand; the `DemandMet` condition says
    /// whether they meet it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub capacity: Option<InstanceCapacity>,
    /// One line on where the instance stands and, when it is stuck, why.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    /// Hash of the spec parts the plan was made for (model, parallelism,
    /// placement). When they change the instance is planned anew; a change of
    /// the pod template alone keeps the plan and replaces the pods.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub placement_hash: Option<String>,
    /// Replicas recreated after losing a rank, counted in a row until the
    /// replica has been ready for 10 minutes. A replica with N recreations
    /// counted waits 10 s × 2^(N-1), at most 10 minutes, before its next one.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub restarts: Vec<ReplicaRestarts>,
    /// Replicas being moved, make before break (at most one at a time):
    /// where from, where to, and how far the move has got.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub moves: Vec<MoveInFlight>,
    /// What the serving replicas' runtimes report together over the last
    /// window (each replica's under replicaPredictions): the measured side
    /// of predictedTokensPerSecond and capacity. Unset until two reads of a
    /// replica's metrics succeeded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub measured: Option<MeasuredServing>,
    /// What the predictions were found off by, per GPU product and shape,
    /// learned from the measured replicas and applied to later plans
    /// (`tessera place` applies them too when given the instance with its
    /// status). Kept while the model and runtime stay the same.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub corrections: Vec<ServingCorrection>,
    /// With `serving.demand: Measured`: the demand the replicas are planned
    /// for, the one last measured, and where the scale-down window stands;
    /// the `DemandFollowed` condition says whether the measured demand is
    /// followed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub demand: Option<MeasuredDemand>,
}

/// What one placed replica is predicted to do.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ReplicaPrediction {
    /// The replica (0 for the first).
    pub replica: u32,
    /// Its predicted single-stream decode tokens/s on the devices planned.
    pub tokens_per_second: f64,
    /// What it serves at the latency target; unset where the serving model
    /// has no answer for its plan.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub capacity: Option<ReplicaCapacity>,
    /// What its runtime reports over the last window, read from its first
    /// shard's metrics endpoint; unset until two reads succeeded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub measured: Option<MeasuredServing>,
}

/// One replica at the highest load that meets the latency target.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ReplicaCapacity {
    /// Requests decoded at once at that load (0 when not even one meets
    /// the target).
    pub concurrency: u32,
    /// Requests/s it serves at the target.
    pub requests_per_second: f64,
    /// Output tokens/s it serves at the target.
    pub output_tokens_per_second: f64,
    /// Predicted time per output token at that load, ms (the best there is,
    /// at one request, when the target is missed).
    pub tpot_ms: f64,
    /// Predicted time to the first token at that load, ms.
    pub ttft_ms: f64,
    /// Set when not even one request meets the target: the best it does.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target_missed: Option<String>,
    /// The measured correction these figures carry (status.corrections):
    /// every step time × this factor.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub correction: Option<f64>,
}

/// What an instance's placed replicas serve together at the latency target.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct InstanceCapacity {
    /// Requests/s the instance serves at the target: its replicas × the
    /// slowest one's, since a Service spreads requests evenly.
    pub requests_per_second: f64,
    /// Output tokens/s at that load.
    pub output_tokens_per_second: f64,
    /// Requests decoded at once at that load, every replica's together.
    pub concurrency: u32,
    /// The slowest replica's time per output token at that load, ms.
    pub tpot_ms: f64,
    /// The slowest replica's time to the first token at that load, ms.
    pub ttft_ms: f64,
    /// The demand (`serving.requestsPerSecond`), when one is given.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub demand_requests_per_second: Option<f64>,
}

/// How often one replica was recreated in a row, for its restart backoff.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ReplicaRestarts {
    /// The replica (0 for the first).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub replica: u32,
    /// Recreations in a row without the replica staying ready.
    pub count: u32,
    /// When the last recreation began.
    pub last_time: Time,
    /// Hash of the replica's shard pods as they were when it was last
    /// recreated: a new pod template or plan starts the count afresh.
    pub pod_hash: String,
    /// Since when every shard of the replica has been ready, while it is.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ready_since: Option<Time>,
}

/// An optional enum is `nullable: true` already; a `null` among the enum's
/// values makes kubectl's client-side validation against 1.24 API servers
/// refuse the whole CRD ("unknown object type nil").
fn no_null_in_enum(schema: &mut schemars::Schema) {
    if let Some(serde_json::Value::Array(values)) = schema.get_mut("enum") {
        values.retain(|v| !v.is_null());
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum Phase {
    Pending,
    Placing,
    Bound,
    Running,
    Degraded,
    Failed,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PlannedShard {
    /// The replica the shard belongs to (0 for the first).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub replica: u32,
    /// Which of the replica's two sets of pod names its shards' pods have
    /// (0: `<instance>-shard-<i>`, 1: `<instance>-m-shard-<i>`, with `-r<r>`
    /// after the instance for replicas after the first). A move starts the
    /// new copy under the other set, so both run side by side until the
    /// switch.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub copy: u32,
    /// The shard's place in the replica's pipeline (0 for the first stage).
    pub shard: u32,
    /// The node the shard's pod is bound to.
    pub node: String,
    /// tessera's IDs of the devices (GPUs, MIG partitions) the shard holds.
    pub devices: Vec<String>,
    /// First layer of the stage (inclusive).
    pub layer_start: u32,
    /// One past the last layer of the stage (exclusive: a stage of layers 0
    /// to 31 has layerStart 0 and layerEnd 32). People read ranges inclusive,
    /// as `0-31`.
    pub layer_end: u32,
    /// Predicted memory use on each device of the shard, in GiB.
    #[serde(rename = "predictedMemoryGiB")]
    pub predicted_memory_gib: f64,
    /// Set when the shard was given part of a GPU rather than whole GPUs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub share: Option<ShardShare>,
}

impl PlannedShard {
    /// The shard's layers as people read them everywhere tessera prints
    /// them: first to last, inclusive (`0-31` for the first 32 layers).
    pub fn layers(&self) -> String {
        layer_range(self.layer_start, self.layer_end)
    }

    /// The GPUs the shard holds: its devices, a memory share as its
    /// fraction of the GPU.
    pub fn gpus(&self) -> f64 {
        match &self.share {
            Some(share) if share.kind == ShareKind::Memory => share.memory_fraction.unwrap_or(1.0),
            _ => self.devices.len() as f64,
        }
    }
}

/// Layers `start` to `end` (exclusive, as the API keeps them) as people read
/// them: `start-last`, inclusive; one layer alone is `7-7`.
pub fn layer_range(start: u32, end: u32) -> String {
    format!("{start}-{}", end.saturating_sub(1).max(start))
}

/// The part of a GPU a shard was given.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ShardShare {
    /// `Partition`: a MIG device, named in `devices` by its UUID.
    /// `Memory`: a memory share of the GPU named in `devices`.
    pub kind: ShareKind,
    /// The physical GPU the partition or share is part of.
    pub gpu: String,
    /// A partition's MIG profile, e.g. `3g.40gb`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub profile: Option<String>,
    /// A memory share's size in GiB: the memory the shard's runtime may use.
    #[serde(rename = "memoryGiB", default, skip_serializing_if = "Option::is_none")]
    pub memory_gib: Option<u32>,
    /// A memory share's size as a fraction of the GPU's memory.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_fraction: Option<f64>,
    /// Other shards on the GPU when this one was planned.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub tenants: u32,
    /// Predicted tokens/s with every tenant of the GPU decoding at once
    /// (the alone figure is `status.predictedTokensPerSecond`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub contended_tokens_per_second: Option<f64>,
}

/// What kind of GPU part a shard was given.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum ShareKind {
    /// A MIG partition.
    Partition,
    /// A memory share of a whole GPU.
    Memory,
}

fn is_zero(value: &u32) -> bool {
    *value == 0
}

/// Everything wrong with a spec, each as `field: what is wrong`.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("invalid ModelInstance spec: {}", .problems.join("; "))]
pub struct InvalidSpec {
    pub problems: Vec<String>,
}

impl ModelInstanceSpec {
    /// The same rules the CRD schema enforces (the limits in [`limits`]), for
    /// input that did not come through an API server.
    pub fn validate(&self) -> Result<(), InvalidSpec> {
        let mut problems = Vec::new();
        let model = &self.model;
        // Counted in characters, as the API server counts `maxLength`.
        let name_length = u32::try_from(model.name.chars().count()).unwrap_or(u32::MAX);
        if !(MODEL_NAME_LENGTH.min..=MODEL_NAME_LENGTH.max).contains(&name_length) {
            problems.push(format!(
                "model.name: {name_length} characters; it must have {} to {}",
                MODEL_NAME_LENGTH.min, MODEL_NAME_LENGTH.max
            ));
        }
        PARAMETERS_BILLIONS.check(
            "model.parametersBillions",
            model.parameters_billions,
            &mut problems,
        );
        LAYERS.check("model.layers", model.layers, &mut problems);
        if let Some(hidden_size) = model.hidden_size {
            HIDDEN_SIZE.check("model.hiddenSize", hidden_size, &mut problems);
        }
        check_heads(model, &mut problems);
        if let Some(kv_cache_gib) = model.kv_cache_gib {
            KV_CACHE_GIB.check("model.kvCacheGiB", kv_cache_gib, &mut problems);
        }
        OVERHEAD_GIB.check("model.overheadGiB", model.overhead_gib, &mut problems);
        check_weights(model, &mut problems);

        REPLICAS.check("replicas", self.replicas, &mut problems);
        if let Some(serving) = &self.serving {
            serving.check(&mut problems);
        }
        let parallelism = &self.parallelism;
        if let TensorSize::Fixed(tensor) = parallelism.tensor {
            TENSOR.check("parallelism.tensor", tensor, &mut problems);
        }
        if let Some(rate) = parallelism.min_tokens_per_second {
            MIN_TOKENS_PER_SECOND.check("parallelism.minTokensPerSecond", rate, &mut problems);
        }
        if let PipelineStages::Fixed(stages) = parallelism.pipeline {
            let before = problems.len();
            PIPELINE.check("parallelism.pipeline", stages, &mut problems);
            if problems.len() == before && stages > model.layers {
                problems.push(format!(
                    "parallelism.pipeline: {stages} stages for {} layers; every stage needs at least one layer",
                    model.layers
                ));
            }
        }

        let placement = &self.placement;
        let weights = &placement.weights;
        let parts = [
            ("compute", weights.compute),
            ("memory", weights.memory),
            ("network", weights.network),
            ("thermal", weights.thermal),
            ("bandwidth", weights.bandwidth),
        ];
        for (name, weight) in parts {
            WEIGHT.check(&format!("placement.weights.{name}"), weight, &mut problems);
        }
        if parts.iter().map(|(_, v)| v.max(0.0)).sum::<f64>() <= 0.0 {
            problems.push("placement.weights: at least one weight must be above zero".into());
        }
        MAX_TEMPERATURE_C.check(
            "placement.maxTemperatureC",
            placement.max_temperature_c,
            &mut problems,
        );
        for vendor in &placement.vendors {
            if !Vendor::ALL.iter().any(|known| known.as_str() == vendor) {
                problems.push(format!(
                    "placement.vendors: {vendor:?} is not one of {}",
                    quoted_vendors().join(", ")
                ));
            }
        }
        if placement.products.iter().any(|s| s.is_empty()) {
            problems.push("placement.products: must not contain empty strings".into());
        }
        DEADLINE_MS.check("placement.deadlineMs", placement.deadline_ms, &mut problems);
        // A pipeline of `auto` is one stage there (`translate::build_problem`).
        let one_shard_on_one_gpu = parallelism.tensor == TensorSize::Fixed(1)
            && matches!(
                parallelism.pipeline,
                PipelineStages::Fixed(1) | PipelineStages::Auto
            );
        if !placement.sharing.is_exclusive() && !one_shard_on_one_gpu {
            problems.push(format!(
                "{SHARING_MESSAGE}; this spec has tensor {} and pipeline {}",
                tensor_text(parallelism.tensor),
                pipeline_text(parallelism.pipeline)
            ));
        }
        if let Some(template) = &self.template {
            let containers = template.spec.as_ref().map_or(0, |s| s.containers.len());
            if containers == 0 {
                problems.push(
                    "template.spec.containers: the shard pod template has no containers".into(),
                );
            }
        }
        if problems.is_empty() {
            Ok(())
        } else {
            Err(InvalidSpec { problems })
        }
    }
}

fn tensor_text(tensor: TensorSize) -> String {
    tensor
        .fixed()
        .map_or_else(|| "auto".to_string(), |size| size.to_string())
}

fn pipeline_text(pipeline: PipelineStages) -> String {
    match pipeline {
        PipelineStages::Auto => "auto".to_string(),
        PipelineStages::Fixed(stages) => stages.to_string(),
    }
}

/// `"nvidia"`, `"amd"`: the known vendors as the messages name them.
fn quoted_vendors() -> Vec<String> {
    Vendor::ALL
        .iter()
        .map(|v| format!("{:?}", v.as_str()))
        .collect()
}

/// The CEL rule that keeps `placement.vendors` to [`Vendor::ALL`].
fn vendors_rule() -> kube::core::Rule {
    let allowed: Vec<String> = Vendor::ALL
        .iter()
        .map(|v| format!("v == '{}'", v.as_str()))
        .collect();
    let mut names = quoted_vendors();
    let last = names.pop().unwrap_or_default();
    let listed = if names.is_empty() {
        last
    } else {
        format!("{} and {last}", names.join(", "))
    };
    kube::core::Rule::new(format!("self.all(v, {})", allowed.join(" || "))).message(
        kube::core::Message::Message(format!("vendors may only contain {listed}")),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::crd_yaml;
    use kube::CustomResourceExt;

    const MINIMAL: &str = "
model:
  name: m
  parametersBillions: 7
  layers: 32
";

    fn parse(yaml: &str) -> Result<ModelInstanceSpec, String> {
        serde_saphyr::from_str::<ModelInstanceSpec>(yaml).map_err(|e| e.to_string())
    }

    /// MINIMAL with `extra` lines under `model:` (indented by two).
    fn with_model(extra: &str) -> String {
        format!("{MINIMAL}{extra}")
    }

    #[test]
    fn attention_and_kv_heads_parse_and_must_split_evenly() {
        let good = parse(&with_model(
            "  hiddenSize: 4096\n  attentionHeads: 32\n  kvHeads: 8\n  kvCacheDtype: fp8\n",
        ))
        .unwrap();
        assert_eq!(good.validate(), Ok(()));
        assert_eq!(
            (
                good.model.attention_heads,
                good.model.kv_heads,
                good.model.kv_cache_dtype
            ),
            (Some(32), Some(8), Some(KvCacheDtype::Fp8))
        );
        // Left out when unset, so the placement hash of older specs stays.
        let written = serde_json::to_value(parse(MINIMAL).unwrap()).unwrap();
        for field in ["attentionHeads", "kvHeads", "kvCacheDtype"] {
            assert!(written["model"].get(field).is_none(), "{written}");
        }
        for (extra, needle) in [
            (
                "  hiddenSize: 4096\n  attentionHeads: 33\n",
                "do not divide hiddenSize",
            ),
            ("  attentionHeads: 32\n  kvHeads: 5\n", "kvHeads: 5 for 32"),
            (
                "  attentionHeads: 32\n  kvHeads: 64\n",
                "kvHeads: 64 for 32",
            ),
            (
                "  attentionHeads: 0\n",
                "model.attentionHeads: 0 is outside",
            ),
            (
                "  attentionHeads: 32\n  kvHeads: 0\n",
                "model.kvHeads: 0 is outside",
            ),
        ] {
            let spec = parse(&with_model(extra)).unwrap();
            let problems = spec.validate().unwrap_err().problems;
            assert!(
                problems.iter().any(|p| p.contains(needle)),
                "{extra:?}: {problems:?}"
            );
        }
        for (extra, needle) in [
            ("  attentionHeads: -1\n", "attentionHeads"),
            ("  attentionHeads: many\n", "attentionHeads"),
            ("  kvHeads: 2.5\n", "kvHeads"),
            ("  kvCacheDtype: fp7\n", "fp7"),
        ] {
            let err = parse(&with_model(extra)).unwrap_err();
            assert!(
                err.contains(needle) || err.contains("invalid"),
                "{extra:?}: {err}"
            );
        }
    }

    #[test]
    fn serving_takes_its_defaults_and_refuses_what_no_replica_can_serve() {
        let spec = parse(&format!("{MINIMAL}serving: {{}}\n")).unwrap();
        assert_eq!(spec.serving, Some(ServingSpec::default()));
        let defaults = ServingSpec::default();
        assert_eq!(
            (
                defaults.runtime,
                defaults.input_tokens,
                defaults.output_tokens,
                defaults.max_time_per_output_token_ms,
                defaults.max_time_to_first_token_ms,
                defaults.requests_per_second
            ),
            (crate::api::Runtime::Vllm, 1024, 256, 50.0, 2000.0, None)
        );
        assert_eq!(spec.validate(), Ok(()));
        assert!(
            serde_json::to_value(parse(MINIMAL).unwrap())
                .unwrap()
                .get("serving")
                .is_none()
        );
        for (text, runtime) in [
            ("vllm", crate::api::Runtime::Vllm),
            ("sglang", crate::api::Runtime::Sglang),
            ("tensorrt-llm", crate::api::Runtime::TensorrtLlm),
            ("generic", crate::api::Runtime::Generic),
        ] {
            let spec = parse(&format!(
                "{MINIMAL}serving: {{runtime: {text}, requestsPerSecond: 12.5}}\n"
            ))
            .unwrap();
            assert_eq!(spec.serving.as_ref().map(|s| s.runtime), Some(runtime));
            assert_eq!(spec.validate(), Ok(()));
        }
        let spec = parse(&format!(
            "{MINIMAL}serving: {{runtimeVersion: v0.6.3.post1}}\n"
        ))
        .unwrap();
        assert_eq!(spec.validate(), Ok(()));
        assert_eq!(
            spec.serving.map(|serving| serving.version()),
            Some(Ok(Some(crate::api::RuntimeVersion::new(0, 6, 3))))
        );
        for (serving, needle) in [
            ("{inputTokens: 0}", "serving.inputTokens: 0 is outside"),
            (
                "{outputTokens: 20000000}",
                "serving.outputTokens: 20000000 is outside",
            ),
            (
                "{maxTimePerOutputTokenMs: 0}",
                "serving.maxTimePerOutputTokenMs: 0 is outside",
            ),
            (
                "{maxTimePerOutputTokenMs: .nan}",
                "serving.maxTimePerOutputTokenMs",
            ),
            (
                "{maxTimeToFirstTokenMs: -1}",
                "serving.maxTimeToFirstTokenMs: -1 is outside",
            ),
            (
                "{maxTimePerOutputTokenMs: 100, maxTimeToFirstTokenMs: 50}",
                "first token takes at least one decode step",
            ),
            (
                "{requestsPerSecond: 0}",
                "serving.requestsPerSecond: 0 is outside",
            ),
            (
                "{runtimeVersion: latest}",
                "serving.runtimeVersion: `latest` is not a release number",
            ),
            ("{runtimeVersion: '0.'}", "serving.runtimeVersion"),
            (
                "{runtimeVersion: '99999999999.1'}",
                "serving.runtimeVersion",
            ),
        ] {
            let spec = parse(&format!("{MINIMAL}serving: {serving}\n")).unwrap();
            let problems = spec.validate().unwrap_err().problems;
            assert!(
                problems.iter().any(|p| p.contains(needle)),
                "{serving}: {problems:?}"
            );
        }
        for (serving, needle) in [
            ("{runtime: trt}", "trt"),
            ("{runtime: vLLM}", "vLLM"),
            ("{inputTokens: many}", "inputTokens"),
            ("{requestsPerSecond: fast}", "requestsPerSecond"),
            ("12", "serving"),
        ] {
            let err = parse(&format!("{MINIMAL}serving: {serving}\n")).unwrap_err();
            assert!(
                err.contains(needle) || err.contains("invalid"),
                "{serving}: {err}"
            );
        }
    }

    #[test]
    fn defaults_fill_the_optional_parts() {
        let s = parse(MINIMAL).unwrap();
        assert_eq!(s.model.dtype, DType::Bf16);
        assert_eq!(s.parallelism, ParallelismSpec::default());
        assert_eq!(s.placement, PlacementPolicy::default());
        assert_eq!(s.model.overhead_gib, 1.5);
        s.validate().unwrap();
    }

    #[test]
    fn pipeline_accepts_auto_and_numbers_only() {
        for (text, want) in [
            ("auto", Ok(PipelineStages::Auto)),
            ("4", Ok(PipelineStages::Fixed(4))),
            ("\"8\"", Ok(PipelineStages::Fixed(8))),
            ("0", Err("out of range")),
            ("-3", Err("out of range")),
            ("2000", Err("out of range")),
            ("1.5", Err("whole number")),
            ("many", Err("neither")),
        ] {
            let got = parse(&format!("{MINIMAL}parallelism:\n  pipeline: {text}\n"))
                .map(|s| s.parallelism.pipeline);
            match want {
                Ok(v) => assert_eq!(got, Ok(v), "{text}"),
                Err(frag) => {
                    let e = got.unwrap_err();
                    assert!(e.contains(frag), "{text}: {e}");
                }
            }
        }
        let json = serde_json::to_string(&PipelineStages::Fixed(3)).unwrap();
        assert_eq!(json, "3");
        assert_eq!(
            serde_json::to_string(&PipelineStages::Auto).unwrap(),
            "\"auto\""
        );
    }

    #[test]
    fn optimize_and_a_minimum_speed_parse_and_are_left_out_at_their_defaults() {
        let spec = parse(&format!(
            "{MINIMAL}parallelism:\n  tensor: auto\n  optimize: latency\n  minTokensPerSecond: 150.5\n"
        ))
        .unwrap();
        assert_eq!(spec.parallelism.optimize, Optimize::Latency);
        assert_eq!(spec.parallelism.min_tokens_per_second, Some(150.5));
        spec.validate().unwrap();
        let throughput =
            parse(&format!("{MINIMAL}parallelism:\n  optimize: throughput\n")).unwrap();
        assert_eq!(throughput.parallelism, ParallelismSpec::default());
        // Defaults are not written out, so specs from before these fields
        // keep their placement hash (and their running plans).
        let written = serde_json::to_value(&throughput.parallelism).unwrap();
        assert_eq!(
            written,
            serde_json::json!({"tensor": 1, "pipeline": "auto"})
        );
        for (text, fragment) in [
            ("optimize: fastest", "fastest"),
            ("optimize: 3", "optimize"),
            ("minTokensPerSecond: fast", "minTokensPerSecond"),
            ("minTokensPerSecond: [1]", "minTokensPerSecond"),
        ] {
            let err = parse(&format!("{MINIMAL}parallelism:\n  {text}\n")).unwrap_err();
            assert!(err.contains(fragment), "{text}: {err}");
        }
        for rate in [0.0, -5.0, 1e7, f64::NAN, f64::INFINITY] {
            let mut spec = parse(MINIMAL).unwrap();
            spec.parallelism.min_tokens_per_second = Some(rate);
            let err = spec.validate().unwrap_err().to_string();
            assert!(
                err.contains("parallelism.minTokensPerSecond"),
                "{rate}: {err}"
            );
        }
    }

    #[test]
    fn restart_policy_parses_and_is_left_out_at_its_default() {
        let default = parse(MINIMAL).unwrap();
        assert_eq!(default.restart_policy, RestartPolicy::RecreateReplica);
        let written = serde_json::to_value(&default).unwrap();
        assert!(written.get("restartPolicy").is_none(), "{written}");
        let pod = parse(&format!("{MINIMAL}restartPolicy: RecreatePod\n")).unwrap();
        assert_eq!(pod.restart_policy, RestartPolicy::RecreatePod);
        assert_eq!(
            serde_json::to_value(&pod).unwrap()["restartPolicy"],
            "RecreatePod"
        );
        let replica = parse(&format!("{MINIMAL}restartPolicy: RecreateReplica\n")).unwrap();
        assert_eq!(replica, default);
        // Kubernetes spells its enums in CamelCase: other spellings are
        // refused rather than guessed at.
        for text in [
            "recreatePod",
            "recreate_replica",
            "Always",
            "\"\"",
            "3",
            "[RecreatePod]",
            "{policy: RecreatePod}",
        ] {
            let err = parse(&format!("{MINIMAL}restartPolicy: {text}\n")).unwrap_err();
            assert!(
                err.contains("restartPolicy") || err.contains("variant"),
                "{text}: {err}"
            );
        }
    }

    #[test]
    fn sharing_parses_is_left_out_at_its_default_and_needs_one_shard_on_one_gpu() {
        let default = parse(MINIMAL).unwrap();
        assert_eq!(default.placement.sharing, Sharing::Exclusive);
        let written = serde_json::to_value(&default).unwrap();
        assert!(written["placement"].get("sharing").is_none(), "{written}");
        let one = "parallelism: {tensor: 1, pipeline: 1}\n";
        let auto = "parallelism: {tensor: 1, pipeline: auto}\n";
        for (text, want) in [("Isolated", Sharing::Isolated), ("Shared", Sharing::Shared)] {
            let spec = parse(&format!("{MINIMAL}{one}placement: {{sharing: {text}}}\n")).unwrap();
            assert_eq!(spec.placement.sharing, want);
            assert_eq!(spec.validate(), Ok(()));
            // `pipeline: auto` (the samples' way) is one stage there.
            let spec = parse(&format!("{MINIMAL}{auto}placement: {{sharing: {text}}}\n")).unwrap();
            assert_eq!(spec.validate(), Ok(()), "{text} with pipeline auto");
            assert_eq!(
                serde_json::to_value(&spec).unwrap()["placement"]["sharing"],
                text
            );
        }
        for text in ["shared", "MIG", "\"\"", "3", "[Shared]", "{mode: Shared}"] {
            let err = parse(&format!("{MINIMAL}placement: {{sharing: {text}}}\n")).unwrap_err();
            assert!(
                err.contains("sharing") || err.contains("variant"),
                "{text}: {err}"
            );
        }
        for parallelism in [
            "{tensor: 2, pipeline: 1}",
            "{tensor: auto, pipeline: 1}",
            "{tensor: 1, pipeline: 2}",
        ] {
            let spec = parse(&format!(
                "{MINIMAL}parallelism: {parallelism}\nplacement: {{sharing: Shared}}\n"
            ))
            .unwrap();
            let problems = spec.validate().unwrap_err().problems;
            assert!(
                problems.iter().any(|p| p.starts_with("placement.sharing")),
                "{parallelism}: {problems:?}"
            );
        }
        assert!(crd_yaml().contains("self.placement.sharing == 'Exclusive'"));
    }

    #[test]
    fn moves_parse_are_left_out_when_allowed_and_refuse_other_words() {
        let default = parse(MINIMAL).unwrap();
        assert_eq!(default.placement.moves, Moves::Allowed);
        let written = serde_json::to_value(&default).unwrap();
        assert!(written["placement"].get("moves").is_none(), "{written}");
        for (text, want) in [("Allowed", Moves::Allowed), ("Never", Moves::Never)] {
            let spec = parse(&format!("{MINIMAL}placement: {{moves: {text}}}\n")).unwrap();
            assert_eq!(spec.placement.moves, want);
            assert_eq!(spec.validate(), Ok(()));
        }
        for text in ["never", "No", "\"\"", "0", "[Never]", "{when: Never}"] {
            let err = parse(&format!("{MINIMAL}placement: {{moves: {text}}}\n")).unwrap_err();
            assert!(
                err.contains("moves") || err.contains("variant"),
                "{text}: {err}"
            );
        }
        let crd = crd_yaml();
        assert!(
            crd.contains("- Allowed") && crd.contains("- Never"),
            "an enum in the CRD"
        );
    }

    #[test]
    fn layer_ranges_read_inclusive_from_the_exclusive_end() {
        assert_eq!(layer_range(0, 32), "0-31");
        assert_eq!(layer_range(42, 84), "42-83");
        assert_eq!(layer_range(7, 8), "7-7");
        // A malformed empty range never reads backwards.
        assert_eq!(layer_range(5, 0), "5-5");
    }

    #[test]
    fn malformed_fields_are_parse_errors() {
        for (extra, frag) in [("  layers: -1\n", "layers"), ("  dtype: fp7\n", "fp7")] {
            let yaml = MINIMAL.replace("  layers: 32\n", "") + extra;
            let e = parse(&yaml).unwrap_err();
            assert!(e.contains(frag), "{e}");
        }
        assert!(parse("model: 3").is_err());
        assert!(
            parse("parallelism: {tensor: 2}")
                .unwrap_err()
                .contains("model")
        );
    }

    #[test]
    fn validate_names_every_problem() {
        let mut s = parse(MINIMAL).unwrap();
        s.model.name = String::new();
        s.model.parameters_billions = -7.0;
        s.model.kv_cache_gib = Some(f64::NAN);
        s.parallelism.tensor = TensorSize::Fixed(0);
        s.parallelism.pipeline = PipelineStages::Fixed(40);
        s.parallelism.min_tokens_per_second = Some(0.0);
        s.placement.weights.compute = 1.5;
        s.placement.max_temperature_c = 0.0;
        s.placement.vendors = vec!["intel".into()];
        s.placement.products = vec!["".into()];
        s.placement.deadline_ms = 0;
        s.template = Some(PodTemplateSpec::default());
        let err = s.validate().unwrap_err();
        for frag in [
            "model.name",
            "model.parametersBillions",
            "model.kvCacheGiB",
            "parallelism.tensor",
            "40 stages for 32 layers",
            "parallelism.minTokensPerSecond",
            "weights.compute",
            "maxTemperatureC",
            "\"intel\"",
            "placement.products",
            "deadlineMs",
            "no containers",
        ] {
            assert!(err.to_string().contains(frag), "{err} lacks {frag}");
        }
        assert_eq!(err.problems.len(), 12);
    }

    #[test]
    fn all_zero_weights_are_refused() {
        let mut s = parse(MINIMAL).unwrap();
        s.placement.weights = ScoreWeights {
            compute: 0.0,
            memory: 0.0,
            network: 0.0,
            thermal: 0.0,
            bandwidth: 0.0,
        };
        assert!(s.validate().unwrap_err().to_string().contains("above zero"));
    }

    #[test]
    fn a_checkpoints_own_size_replaces_parameters_times_dtype() {
        // Meta's Llama-3.1-405B-FP8: attention and the outer layers in BF16.
        let meta = parse(
            "model:\n  name: m\n  parametersBillions: 405.9\n  layers: 126\n  dtype: fp8\n  weightsGiB: 454\n",
        )
        .unwrap();
        assert_eq!(meta.validate(), Ok(()));
        assert_eq!(meta.model.weight_bytes(), 454.0 * GIB);
        assert_eq!(meta.model.weight_bytes_per_layer(), 454.0 * GIB / 126.0);
        // Left out when unset, so the placement hash of older specs stays.
        let written = serde_json::to_value(parse(MINIMAL).unwrap()).unwrap();
        assert!(written["model"].get("weightsGiB").is_none(), "{written}");
        // 7 billion parameters: 0.82 GiB is 1 bit each, 26.1 GiB fp32.
        for (gib, needle) in [
            ("0", "model.weightsGiB: 0 GiB is 0.000 bytes"),
            ("-3", "model.weightsGiB: -3 GiB is -0.460 bytes"),
            (".nan", "model.weightsGiB: NaN GiB is NaN bytes"),
            ("2e6", "306783.378 bytes a parameter of 7 billion"),
            ("0.5", "0.077 bytes a parameter of 7 billion"),
            ("40", "6.136 bytes a parameter of 7 billion"),
        ] {
            let spec = parse(&with_model(&format!("  weightsGiB: {gib}\n"))).unwrap();
            let problems = spec.validate().unwrap_err().problems;
            assert!(
                problems.iter().any(|p| p.contains(needle)),
                "{gib}: {problems:?}"
            );
            assert_eq!(problems.len(), 1, "{gib}: {problems:?}");
        }
        for (gib, fine) in [("0.9", true), ("26", true), ("0.8", false), ("26.2", false)] {
            let spec = parse(&with_model(&format!("  weightsGiB: {gib}\n"))).unwrap();
            assert_eq!(spec.validate().is_ok(), fine, "{gib}");
        }
        for bad in ["  weightsGiB: much\n", "  weightsGiB: [1]\n"] {
            let err = parse(&with_model(bad)).unwrap_err();
            assert!(
                err.contains("weightsGiB") || err.contains("invalid"),
                "{bad:?}: {err}"
            );
        }
    }

    #[test]
    fn model_sizes() {
        let s = parse(MINIMAL).unwrap();
        assert_eq!(s.model.weight_bytes(), 14e9);
        assert_eq!(s.model.weight_bytes_per_layer(), 14e9 / 32.0);
        let h = s.model.effective_hidden_size();
        assert!((4000.0..5000.0).contains(&h), "{h}");
        assert_eq!(DType::Int4.bytes_per_parameter(), 0.5);
        assert_eq!(DType::Fp4.bytes_per_parameter(), 0.5);
    }

    #[test]
    fn no_enum_in_the_crd_lists_null() {
        fn walk(v: &serde_json::Value, path: &str) {
            match v {
                serde_json::Value::Object(map) => {
                    if let Some(serde_json::Value::Array(values)) = map.get("enum") {
                        assert!(!values.iter().any(|e| e.is_null()), "{path}: {values:?}");
                    }
                    for (k, sub) in map {
                        walk(sub, &format!("{path}.{k}"));
                    }
                }
                serde_json::Value::Array(items) => items.iter().for_each(|i| walk(i, path)),
                _ => {}
            }
        }
        walk(&serde_json::to_value(ModelInstance::crd()).unwrap(), "crd");
    }

    #[test]
    fn crd_has_the_public_names_and_rules() {
        let crd = ModelInstance::crd();
        assert_eq!(
            crd.metadata.name.as_deref(),
            Some("modelinstances.tessera.dev")
        );
        assert_eq!(crd.spec.names.short_names, Some(vec!["mi".to_string()]));
        assert_eq!(crd.spec.scope, "Namespaced");
        let yaml = crd_yaml();
        for frag in [
            "x-kubernetes-int-or-string: true",
            "x-kubernetes-validations",
            "self.all(v, v == 'nvidia' || v == 'amd')",
            "- RecreateReplica\n",
            "- RecreatePod\n",
            "x-kubernetes-preserve-unknown-fields: true",
            "status: {}",
        ] {
            assert!(yaml.contains(frag), "CRD lacks {frag}");
        }
    }
}
