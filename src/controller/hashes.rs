//! The controller's hashes, all FNV-1a over JSON: stable across builds and
//! platforms, so an upgraded controller recognises the plans and pods an older
//! one made.

use std::hash::Hasher;

use k8s_openapi::api::core::v1::Pod;

use super::apply::drain::SERVING_GATE;
use super::runtime_env;
use tessera_core::api::{DemandSource, ModelInstanceSpec, Moves, PlacementPolicy, ServingSpec};

/// Pod annotation: the hash of everything the controller put into a shard pod.
/// A pod whose hash differs from the desired one is replaced (pod specs are
/// mostly immutable).
pub(crate) const SPEC_HASH_ANNOTATION: &str = "tessera.dev/spec-hash";

/// Hash of the spec parts a plan depends on (`status.placementHash`).
/// Specs written before `kvCacheGiB` became optional and before
/// `spec.serving` existed hash as they did (an unset cache as the 0 it was
/// read as), so their plans are kept. `placement.moves` says what may happen
/// to a plan, not what it is, so it is left out: turning moves off keeps the
/// plans. So are `serving.demand` and its replica bounds, which say how many
/// replicas there are, not how each is planned.
pub fn placement_hash(spec: &ModelInstanceSpec) -> String {
    let mut model = spec.model.clone();
    model.kv_cache_gib = Some(model.kv_cache_gib.unwrap_or(0.0));
    let placement = PlacementPolicy {
        moves: Moves::default(),
        ..spec.placement.clone()
    };
    let serving = spec.serving.as_ref().map(|serving| ServingSpec {
        demand: DemandSource::Stated,
        min_replicas: None,
        max_replicas: None,
        ..serving.clone()
    });
    // Plain structs of numbers and strings always serialize.
    let json = match &serving {
        None => serde_json::to_vec(&(&model, &spec.parallelism, &placement)),
        Some(serving) => serde_json::to_vec(&(&model, &spec.parallelism, &placement, serving)),
    }
    .unwrap_or_default();
    format!("{:016x}", fnv(&json))
}

/// Hash of a desired pod as built, before its own hash annotation is added.
/// The multi-node runtime's variables are left out (see
/// [`runtime_env::NAMES`]), and so is the serving gate, so pods made before
/// them are not replaced.
pub(crate) fn pod_hash(pod: &Pod) -> String {
    let mut hashed = pod.clone();
    if let Some(spec) = hashed.spec.as_mut()
        && let Some(gates) = spec.readiness_gates.as_mut()
    {
        gates.retain(|gate| gate.condition_type != SERVING_GATE);
        if gates.is_empty() {
            spec.readiness_gates = None;
        }
    }
    for container in hashed
        .spec
        .iter_mut()
        .flat_map(|spec| spec.containers.iter_mut())
    {
        if let Some(env) = container.env.as_mut() {
            env.retain(|var| !runtime_env::NAMES.contains(&var.name.as_str()));
        }
    }
    // A pod built from deserialized parts always serializes.
    let json = serde_json::to_vec(&hashed).unwrap_or_default();
    format!("{:016x}", fnv(&json))
}

/// The hash a pod was built with, for comparing a desired pod with one that
/// came back from the API server (which adds defaults to the spec).
pub(crate) fn recorded_pod_hash(pod: &Pod) -> Option<&str> {
    pod.metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(SPEC_HASH_ANNOTATION))
        .map(String::as_str)
}

/// Hash of a replica's shard pods from their own hashes, in shard order.
pub fn replica_pod_hash<'a>(pod_hashes: impl IntoIterator<Item = &'a str>) -> String {
    let joined = pod_hashes.into_iter().collect::<Vec<_>>().join(",");
    format!("{:016x}", fnv(joined.as_bytes()))
}

/// Identifies a planning problem, so an unsatisfiable one is not solved twice.
pub(crate) fn problem_hash(value: &impl serde::Serialize) -> u64 {
    fnv(&serde_json::to_vec(value).unwrap_or_default())
}

fn fnv(bytes: &[u8]) -> u64 {
    let mut hasher = fnv::FnvHasher::default();
    hasher.write(bytes);
    hasher.finish()
}

#[cfg(test)]
mod tests {
    use tessera_core::api::{Optimize, ParallelismSpec, PlacementPolicy, Strategy, TensorSize};

    /// Instances made before replicas, `tensor: auto` and strategies existed
    /// keep their placement hash, so an upgraded controller keeps their plans.
    #[test]
    fn fields_added_later_leave_older_specs_hash_alone() {
        let parallelism = serde_json::to_value(ParallelismSpec::default()).unwrap();
        assert_eq!(
            parallelism,
            serde_json::json!({"tensor": 1, "pipeline": "auto"})
        );
        let placement = serde_json::to_value(PlacementPolicy::default()).unwrap();
        assert!(placement.get("strategy").is_none(), "{placement}");
        let spread = PlacementPolicy {
            strategy: Strategy::Spread,
            ..PlacementPolicy::default()
        };
        assert_eq!(serde_json::to_value(&spread).unwrap()["strategy"], "spread");
        let auto = ParallelismSpec {
            tensor: TensorSize::Auto,
            ..ParallelismSpec::default()
        };
        assert_eq!(serde_json::to_value(&auto).unwrap()["tensor"], "auto");
        let goal = ParallelismSpec {
            optimize: Optimize::Latency,
            min_tokens_per_second: Some(50.0),
            ..ParallelismSpec::default()
        };
        let written = serde_json::to_value(&goal).unwrap();
        assert_eq!(written["optimize"], "latency");
        assert_eq!(written["minTokensPerSecond"], 50.0);
    }

    /// What a plan is judged by is in the hash; an unset KV cache hashes as
    /// the 0 older specs wrote.
    #[test]
    fn the_serving_target_moves_the_hash_and_an_unset_cache_is_zero() {
        let spec = |yaml: &str| -> tessera_core::api::ModelInstanceSpec {
            serde_saphyr::from_str(yaml).unwrap()
        };
        const MODEL: &str = "model: {name: m, parametersBillions: 7, layers: 32}\n";
        let plain = super::placement_hash(&spec(MODEL));
        assert_eq!(
            plain,
            super::placement_hash(&spec(
                "model: {name: m, parametersBillions: 7, layers: 32, kvCacheGiB: 0}\n"
            ))
        );
        // The hash older controllers wrote for this spec.
        let older = format!(
            r#"[{{"name":"m","parametersBillions":7.0,"layers":32,"dtype":"bf16","kvCacheGiB":0.0,"overheadGiB":1.5}},{{"tensor":1,"pipeline":"auto"}},{}]"#,
            serde_json::to_string(&PlacementPolicy::default()).unwrap()
        );
        assert_eq!(plain, format!("{:016x}", super::fnv(older.as_bytes())));
        let never = super::placement_hash(&spec(&format!("{MODEL}placement: {{moves: Never}}\n")));
        assert_eq!(plain, never, "moves: Never keeps the plans");
        let served = super::placement_hash(&spec(&format!(
            "{MODEL}serving: {{maxTimePerOutputTokenMs: 30}}\n"
        )));
        assert_ne!(plain, served);
        assert_ne!(
            served,
            super::placement_hash(&spec(&format!(
                "{MODEL}serving: {{maxTimePerOutputTokenMs: 40}}\n"
            )))
        );
        // How many replicas a measured demand gets is not how each is planned.
        assert_eq!(
            served,
            super::placement_hash(&spec(&format!(
                "{MODEL}serving: {{maxTimePerOutputTokenMs: 30, demand: Measured, minReplicas: 2, maxReplicas: 5}}\n"
            )))
        );
    }
}
