//! The KV cache a plan must hold room for, per layer: what `kvCacheGiB`
//! reserves; without it, one request of the typical length on a whole GPU
//! (the runtime takes whatever else the devices hold), and on a memory
//! share the requests the demand keeps in flight (the share is sized to
//! it). The solver adds it to each layer's weights when it sizes stages and
//! shares.

use crate::api::ModelInstanceSpec;
use crate::placement::{Served, SpeedGoal};
use crate::serving::{ServingModel, kv_bytes_per_token_layer, requests_in_flight};

/// Requests a memory share holds room for when the instance names no demand:
/// enough for a batch to pay for its weight reads, little beside the weights
/// of the models that share GPUs (16 requests of 1,280 tokens of an 8B model
/// with 8 KV heads are 2.5 GiB).
pub(crate) const SHARE_REQUESTS_WITHOUT_DEMAND: f64 = 16.0;

pub(super) fn per_layer(spec: &ModelInstanceSpec) -> f64 {
    if let Some(reserved) = spec.model.reserved_kv_bytes_per_layer() {
        return reserved;
    }
    let served = Served::of(spec);
    let workload = crate::sizing::workload_of(&served);
    let runtime = crate::sizing::runtime_of(&served, !spec.placement.sharing.is_exclusive());
    let requests = if spec.placement.sharing.is_exclusive() {
        1.0
    } else {
        match served.serving.requests_per_second {
            Some(rps) => {
                let replicas = f64::from(spec.fixed_replicas().unwrap_or(1).max(1));
                let goal = SpeedGoal {
                    min_tokens_per_second: spec.parallelism.min_tokens_per_second,
                    ..SpeedGoal::default()
                };
                let target = crate::sizing::target(&served, &goal);
                // The GPUs are not chosen yet: the smaller batch cap.
                requests_in_flight(rps / replicas, &workload, &target)
                    .min(f64::from(runtime.max_num_seqs(false)))
            }
            None => SHARE_REQUESTS_WITHOUT_DEMAND,
        }
    };
    let model = ServingModel {
        spec: spec.model.clone(),
        head_dim: None,
    };
    kv_bytes_per_token_layer(&model, &runtime) * workload.sequence_tokens() * requests
}
