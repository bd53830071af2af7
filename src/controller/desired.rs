//! The build stage: the shard pods and the headless Service an instance
//! should have for its plan. Pure; `apply` compares these with what exists.

use std::collections::BTreeMap;
use std::sync::Arc;

use k8s_openapi::api::core::v1::{
    Container, EnvVar, Pod, PodReadinessGate, PodResourceClaim, ResourceClaim, Service,
    ServicePort, ServiceSpec,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

use super::apply::drain::SERVING_GATE;
use kube::{Resource, ResourceExt};

use super::hashes::{SPEC_HASH_ANNOTATION, pod_hash};
use super::model_cache::{self, ModelCacheDir};
use super::nodes::NodeInfo;
use super::runtime_env::{Planned, runtime_env};
use tessera_core::api::{
    DEVICES_ANNOTATION, ModelInstance, PlannedShard, ReplicaCapacity, ResourceName, SCHEDULER_NAME,
    SHARD_ANNOTATION, Vendor,
};

pub(crate) use tessera_core::api::{INSTANCE_LABEL, REPLICA_LABEL};

/// The replica a shard pod belongs to: its label, absent on the first
/// replica's pods; `None` for a label that is no number.
pub(crate) fn replica_of(pod: &Pod) -> Option<u32> {
    match pod.labels().get(REPLICA_LABEL) {
        None => Some(0),
        Some(replica) => replica.parse().ok(),
    }
}

/// The labels that name a shard's pod and claim: its instance, shard and
/// (after the first) replica. The agent labels its device metrics with them.
pub(crate) fn shard_labels(instance: &str, shard: &PlannedShard) -> BTreeMap<String, String> {
    let mut labels = BTreeMap::from([
        (INSTANCE_LABEL.to_string(), instance.to_string()),
        (SHARD_ANNOTATION.to_string(), shard.shard.to_string()),
    ]);
    if shard.replica > 0 {
        labels.insert(REPLICA_LABEL.to_string(), shard.replica.to_string());
    }
    labels
}

/// A planned shard's pod name: `<instance>-shard-<i>` for the first
/// replica, `<instance>-r<r>-shard-<i>` for the others, so a replica's
/// shards sort together. The other copy of a replica (`copy` 1, see
/// `PlannedShard::copy`) has `-m` before `-shard`, so a move's new copy runs
/// beside the old one.
pub(crate) fn pod_name_of(instance: &str, shard: &PlannedShard) -> String {
    let replica = if shard.replica == 0 {
        String::new()
    } else {
        format!("-r{}", shard.replica)
    };
    let copy = if shard.copy == 0 { "" } else { "-m" };
    format!("{instance}{replica}{copy}-shard-{}", shard.shard)
}

/// The stable DNS name of a shard: `<pod>.<service>.<namespace>.svc`.
pub(crate) fn shard_address(instance: &str, namespace: &str, shard: &PlannedShard) -> String {
    format!(
        "{}.{instance}.{namespace}.svc",
        pod_name_of(instance, shard)
    )
}

/// The desired shard pods of one replica's plan, in shard order; `resource` names what a shard's
/// pod requests (see [`shard_resource`]). The caller has validated the
/// instance (`validate::check`), so it has a template with containers.
pub fn shard_pods(
    mi: &ModelInstance,
    plan: &[PlannedShard],
    resource: impl Fn(&PlannedShard) -> String,
) -> Vec<Pod> {
    shard_pods_with(mi, plan, |s| ShardGpus::Resource(resource(s)))
}

/// How a shard's pod asks for its devices.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ShardGpus {
    /// The device plugin's extended resource (see [`shard_resource`]).
    Resource(String),
    /// The named ResourceClaim, which the controller allocates (DRA).
    Claim(String),
}

/// [`shard_pods`], each shard asking for its devices as `gpus` says.
pub fn shard_pods_with(
    mi: &ModelInstance,
    plan: &[PlannedShard],
    gpus: impl Fn(&PlannedShard) -> ShardGpus,
) -> Vec<Pod> {
    some_shard_pods(mi, plan, |_| true, gpus, None, None)
}

/// [`shard_pods_with`] for the shards of `plan` that `wanted` picks. Each
/// pod's peers, stage count and layer split still describe the whole
/// replica: a shard of a degraded replica whose peer has no pod yet must
/// join the same group once it has. A pod that mounts the model cache gets
/// `cache`'s directory (see `model_cache`); the runtime is told the
/// replica's planned `capacity` (see `runtime_env`).
pub fn some_shard_pods(
    mi: &ModelInstance,
    plan: &[PlannedShard],
    wanted: impl Fn(&PlannedShard) -> bool,
    gpus: impl Fn(&PlannedShard) -> ShardGpus,
    cache: Option<&ModelCacheDir>,
    capacity: Option<&ReplicaCapacity>,
) -> Vec<Pod> {
    plan.iter()
        .filter(|s| wanted(s))
        .map(|s| shard_pod(mi, plan, s, &gpus(s), (cache, capacity)))
        .collect()
}

/// The extended resource `shard`'s pod requests. Per vendor it is that of
/// the shard's planned devices; should their node not say (its GPU state
/// just went away), the resource the existing pod asks for stands, so the
/// pod is not replaced for it. Without either, the `unknown` vendor's name
/// makes kubelet refuse the pod, and the shard is placed anew.
pub fn shard_resource(
    name: &ResourceName,
    shard: &PlannedShard,
    nodes: &[Arc<NodeInfo>],
    existing: Option<&Pod>,
) -> String {
    if !name.per_vendor() {
        return name.to_string();
    }
    let vendor = nodes
        .iter()
        .find(|n| n.name() == shard.node)
        .and_then(|n| {
            let first = shard.devices.first()?;
            n.gpus.gpu_state.find_device(first)
        })
        .map(|(gpu, _)| gpu.vendor)
        .filter(|v| *v != Vendor::Unknown);
    if let Some(vendor) = vendor {
        return name.for_vendor(vendor);
    }
    let requested = existing
        .and_then(|p| {
            p.spec
                .as_ref()?
                .containers
                .first()?
                .resources
                .as_ref()?
                .limits
                .as_ref()
        })
        .and_then(|limits| name.all().into_iter().find(|n| limits.contains_key(n)));
    requested.unwrap_or_else(|| name.for_vendor(Vendor::Unknown))
}

fn shard_pod(
    mi: &ModelInstance,
    plan: &[PlannedShard],
    shard: &PlannedShard,
    gpus: &ShardGpus,
    (cache, capacity): (Option<&ModelCacheDir>, Option<&ReplicaCapacity>),
) -> Pod {
    let name = mi.name_any();
    let namespace = mi.namespace().unwrap_or_default();
    let template = mi.spec.template.clone().unwrap_or_default();
    let tmeta = template.metadata.unwrap_or_default();
    let mut spec = template.spec.unwrap_or_default();
    let replica = shard.replica;
    let pod_name = pod_name_of(&name, shard);

    let mut labels = tmeta.labels.unwrap_or_default();
    labels.extend(shard_labels(&name, shard));
    let mut annotations = tmeta.annotations.unwrap_or_default();
    annotations.insert(DEVICES_ANNOTATION.to_string(), shard.devices.join(","));
    annotations.insert(SHARD_ANNOTATION.to_string(), shard.shard.to_string());

    spec.scheduler_name = Some(SCHEDULER_NAME.to_string());
    // Bound through pods/binding once every shard has a plan, never at creation.
    spec.node_name = None;
    spec.hostname = Some(pod_name.clone());
    spec.subdomain = Some(name.clone());
    // Ready only while wanted: a replica scaled away leaves its Services
    // before its pods go (apply::drain).
    spec.readiness_gates
        .get_or_insert_with(Vec::new)
        .push(PodReadinessGate {
            condition_type: SERVING_GATE.to_string(),
        });
    model_cache::add_volume(&mut spec, &namespace, cache);

    let peers: Vec<String> = plan
        .iter()
        .map(|s| shard_address(&name, &namespace, s))
        .collect();
    let neighbour = |i: Option<u32>| {
        i.and_then(|i| plan.iter().find(|s| s.shard == i))
            .map(|s| shard_address(&name, &namespace, s))
            .unwrap_or_default()
    };
    let mut env = vec![
        ("TESSERA_INSTANCE", name.clone()),
        ("TESSERA_MODEL", mi.spec.model.name.clone()),
        ("TESSERA_SHARD_INDEX", shard.shard.to_string()),
        ("TESSERA_SHARD_COUNT", plan.len().to_string()),
        ("TESSERA_LAYER_START", shard.layer_start.to_string()),
        ("TESSERA_LAYER_END", shard.layer_end.to_string()),
        ("TESSERA_TENSOR_PARALLEL", shard.devices.len().to_string()),
        ("TESSERA_PEERS", peers.join(",")),
        (
            "TESSERA_PREVIOUS_PEER",
            neighbour(shard.shard.checked_sub(1)),
        ),
        ("TESSERA_NEXT_PEER", neighbour(Some(shard.shard + 1))),
    ];
    if replica > 0 {
        env.push(("TESSERA_REPLICA", replica.to_string()));
    }
    let master = plan
        .iter()
        .find(|s| s.shard == 0)
        .map(|s| shard_address(&name, &namespace, s))
        .unwrap_or_default();
    env.extend(runtime_env(
        plan,
        master,
        &Planned {
            spec: &mi.spec,
            capacity,
        },
    ));
    for (i, c) in spec.containers.iter_mut().enumerate() {
        add_env(c, &env);
        // The first container is the shard runtime and gets the GPUs.
        if i == 0 {
            match gpus {
                ShardGpus::Resource(resource) => {
                    request_gpus(c, resource, shard.devices.len() as u32)
                }
                ShardGpus::Claim(_) => use_claim(c),
            }
        }
    }
    if let ShardGpus::Claim(claim) = gpus {
        let mut claims = spec.resource_claims.take().unwrap_or_default();
        claims.retain(|c| c.name != CLAIM_ENTRY);
        claims.push(PodResourceClaim {
            name: CLAIM_ENTRY.to_string(),
            resource_claim_name: Some(claim.clone()),
            resource_claim_template_name: None,
        });
        spec.resource_claims = Some(claims);
    }

    let mut pod = Pod {
        metadata: ObjectMeta {
            name: Some(pod_name),
            namespace: Some(namespace),
            labels: Some(labels),
            annotations: Some(annotations),
            owner_references: mi.controller_owner_ref(&()).map(|o| vec![o]),
            ..ObjectMeta::default()
        },
        spec: Some(spec),
        status: None,
    };
    let hash = pod_hash(&pod);
    if let Some(a) = pod.metadata.annotations.as_mut() {
        a.insert(SPEC_HASH_ANNOTATION.to_string(), hash);
    }
    pod
}

fn add_env(container: &mut Container, vars: &[(&str, String)]) {
    let mut env = container.env.take().unwrap_or_default();
    env.retain(|e| !vars.iter().any(|(k, _)| e.name == *k));
    env.extend(vars.iter().map(|(k, v)| EnvVar {
        name: (*k).to_string(),
        value: Some(v.clone()),
        value_from: None,
    }));
    container.env = Some(env);
}

fn request_gpus(container: &mut Container, resource: &str, count: u32) {
    let mut resources = container.resources.take().unwrap_or_default();
    let quantity = Quantity(count.to_string());
    resources
        .requests
        .get_or_insert_with(BTreeMap::new)
        .insert(resource.to_string(), quantity.clone());
    resources
        .limits
        .get_or_insert_with(BTreeMap::new)
        .insert(resource.to_string(), quantity);
    container.resources = Some(resources);
}

/// The name of the pod's claim entry its first container uses (DRA).
pub(crate) const CLAIM_ENTRY: &str = "gpus";

/// The first container uses the pod's claim (all of its devices).
fn use_claim(container: &mut Container) {
    let mut resources = container.resources.take().unwrap_or_default();
    let mut claims = resources.claims.take().unwrap_or_default();
    claims.retain(|c| c.name != CLAIM_ENTRY);
    claims.push(ResourceClaim {
        name: CLAIM_ENTRY.to_string(),
        request: None,
    });
    resources.claims = Some(claims);
    container.resources = Some(resources);
}

/// The headless Service that gives every shard a DNS name. Not-ready shards
/// are published too: peers must find each other while they load.
pub fn headless_service(mi: &ModelInstance) -> Service {
    let name = mi.name_any();
    let ports: Vec<ServicePort> = mi
        .spec
        .template
        .as_ref()
        .and_then(|t| t.spec.as_ref())
        .and_then(|s| s.containers.first())
        .and_then(|c| c.ports.as_ref())
        .into_iter()
        .flatten()
        .map(|p| ServicePort {
            name: p.name.clone(),
            port: p.container_port,
            protocol: p.protocol.clone(),
            ..ServicePort::default()
        })
        .collect();
    Service {
        metadata: ObjectMeta {
            name: Some(name.clone()),
            namespace: mi.namespace(),
            labels: Some([(INSTANCE_LABEL.to_string(), name.clone())].into()),
            owner_references: mi.controller_owner_ref(&()).map(|o| vec![o]),
            ..ObjectMeta::default()
        },
        spec: Some(ServiceSpec {
            cluster_ip: Some("None".to_string()),
            selector: Some([(INSTANCE_LABEL.to_string(), name)].into()),
            publish_not_ready_addresses: Some(true),
            ports: (!ports.is_empty()).then_some(ports),
            ..ServiceSpec::default()
        }),
        status: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::controller::hashes::recorded_pod_hash;
    use crate::controller::testkit::*;

    const GPU: &str = "tessera.dev/gpu";

    fn plan() -> Vec<PlannedShard> {
        (0..2)
            .map(|i| PlannedShard {
                copy: 0,
                replica: 0,
                shard: i,
                node: format!("n{i}"),
                devices: vec![format!("n{i}-g0"), format!("n{i}-g1")],
                layer_start: i * 16,
                layer_end: (i + 1) * 16,
                predicted_memory_gib: 10.0,
                share: None,
            })
            .collect()
    }

    fn env(pod: &Pod, container: usize) -> BTreeMap<String, String> {
        pod.spec.as_ref().unwrap().containers[container]
            .env
            .iter()
            .flatten()
            .map(|e| (e.name.clone(), e.value.clone().unwrap_or_default()))
            .collect()
    }

    #[test]
    fn a_moved_replicas_new_copy_has_pod_names_of_its_own() {
        let mut shard = plan().remove(0);
        assert_eq!(pod_name_of("llama", &shard), "llama-shard-0");
        shard.copy = 1;
        assert_eq!(pod_name_of("llama", &shard), "llama-m-shard-0");
        shard.replica = 2;
        assert_eq!(pod_name_of("llama", &shard), "llama-r2-m-shard-0");
        shard.copy = 0;
        assert_eq!(pod_name_of("llama", &shard), "llama-r2-shard-0");
        // Its peers are named after their own copy.
        let mi = instance("llama", SMALL);
        let mut stages = plan();
        for stage in &mut stages {
            stage.copy = 1;
        }
        let pods = shard_pods(&mi, &stages, |_| "tessera.dev/gpu".into());
        assert_eq!(pods[1].metadata.name.as_deref(), Some("llama-m-shard-1"));
        let peers = env(&pods[1], 0)["TESSERA_PEERS"].clone();
        assert!(peers.starts_with("llama-m-shard-0.llama."), "{peers}");
    }

    #[test]
    fn shard_pods_carry_the_plan() {
        let mut mi = instance(
            "llama",
            &format!("{SMALL}\nparallelism: {{tensor: 2, pipeline: 2}}"),
        );
        let spec = mi.spec.template.as_mut().unwrap().spec.as_mut().unwrap();
        spec.containers.push(Container {
            name: "sidecar".into(),
            env: Some(vec![EnvVar {
                name: "TESSERA_SHARD_INDEX".into(),
                value: Some("stale".into()),
                value_from: None,
            }]),
            ..Default::default()
        });
        let pods = shard_pods(&mi, &plan(), |_| GPU.into());
        assert_eq!(pods.len(), 2);
        let p = &pods[1];
        let meta = &p.metadata;
        assert_eq!(meta.name.as_deref(), Some("llama-shard-1"));
        assert_eq!(meta.namespace.as_deref(), Some("ml"));
        let ann = meta.annotations.as_ref().unwrap();
        assert_eq!(ann[DEVICES_ANNOTATION], "n1-g0,n1-g1");
        assert_eq!(ann[SHARD_ANNOTATION], "1");
        assert_eq!(ann[SPEC_HASH_ANNOTATION].len(), 16);
        assert_eq!(meta.labels.as_ref().unwrap()[INSTANCE_LABEL], "llama");
        let owner = &meta.owner_references.as_ref().unwrap()[0];
        assert_eq!(
            (owner.kind.as_str(), owner.uid.as_str()),
            ("ModelInstance", "uid-llama")
        );
        assert_eq!(owner.controller, Some(true));
        let spec = p.spec.as_ref().unwrap();
        assert_eq!(spec.scheduler_name.as_deref(), Some(SCHEDULER_NAME));
        assert_eq!(spec.node_name, None);
        assert_eq!(spec.hostname.as_deref(), Some("llama-shard-1"));
        assert_eq!(spec.subdomain.as_deref(), Some("llama"));
        let gpu = |c: usize| {
            spec.containers[c]
                .resources
                .as_ref()
                .and_then(|r| r.limits.as_ref())
                .and_then(|l| l.get(GPU))
                .map(|q| q.0.clone())
        };
        assert_eq!(gpu(0).as_deref(), Some("2"));
        assert_eq!(gpu(1), None, "only the first container gets the GPUs");
        let e = env(p, 0);
        assert_eq!(e["TESSERA_SHARD_INDEX"], "1");
        assert_eq!(e["TESSERA_SHARD_COUNT"], "2");
        assert_eq!(e["TESSERA_LAYER_START"], "16");
        assert_eq!(e["TESSERA_LAYER_END"], "32");
        assert_eq!(e["TESSERA_MODEL"], "small");
        assert_eq!(
            e["TESSERA_PEERS"],
            "llama-shard-0.llama.ml.svc,llama-shard-1.llama.ml.svc"
        );
        assert_eq!(e["TESSERA_PREVIOUS_PEER"], "llama-shard-0.llama.ml.svc");
        assert_eq!(e["TESSERA_NEXT_PEER"], "");
        assert_eq!(e["TESSERA_MASTER_ADDR"], "llama-shard-0.llama.ml.svc");
        assert_eq!(e["TESSERA_MASTER_PORT"], "29501");
        assert_eq!(e["TESSERA_PIPELINE_PARALLEL"], "2");
        assert_eq!(e["VLLM_PP_LAYER_PARTITION"], "16,16");
        assert_eq!(
            env(p, 1)["TESSERA_SHARD_INDEX"],
            "1",
            "template values are replaced"
        );
    }

    #[test]
    fn a_shard_on_a_dra_node_uses_its_claim_instead_of_the_resource() {
        let mi = instance(
            "llama",
            &format!("{SMALL}\nparallelism: {{tensor: 2, pipeline: 2}}"),
        );
        let plan = plan();
        let pods = shard_pods_with(&mi, &plan, |s| {
            if s.shard == 0 {
                ShardGpus::Claim(format!("llama-shard-{}-gpus", s.shard))
            } else {
                ShardGpus::Resource(GPU.into())
            }
        });
        let dra = pods[0].spec.as_ref().unwrap();
        let entry = &dra.resource_claims.as_ref().unwrap()[0];
        assert_eq!(
            (entry.name.as_str(), entry.resource_claim_name.as_deref()),
            ("gpus", Some("llama-shard-0-gpus"))
        );
        let resources = dra.containers[0].resources.as_ref().unwrap();
        assert_eq!(resources.claims.as_ref().unwrap()[0].name, "gpus");
        assert!(resources.limits.is_none() && resources.requests.is_none());
        let plugin = pods[1].spec.as_ref().unwrap();
        assert!(plugin.resource_claims.is_none());
        assert_eq!(
            plugin.containers[0]
                .resources
                .as_ref()
                .unwrap()
                .limits
                .as_ref()
                .unwrap()[GPU],
            Quantity("2".into())
        );
        // The way a shard asks is part of its pod: switching it replaces the pod.
        let as_resource = shard_pods(&mi, &plan, |_| GPU.into());
        assert_ne!(
            recorded_pod_hash(&pods[0]),
            recorded_pod_hash(&as_resource[0])
        );
        assert_eq!(
            recorded_pod_hash(&pods[1]),
            recorded_pod_hash(&as_resource[1])
        );
    }

    #[test]
    fn the_hash_follows_plan_and_template_only() {
        let mi = instance("llama", SMALL);
        let a = shard_pods(&mi, &plan(), |_| GPU.into());
        let again = shard_pods(&mi, &plan(), |_| GPU.into());
        assert_eq!(recorded_pod_hash(&a[0]), recorded_pod_hash(&again[0]));
        let mut moved = plan();
        moved[0].devices = vec!["n0-g2".into(), "n0-g3".into()];
        let b = shard_pods(&mi, &moved, |_| GPU.into());
        assert_ne!(recorded_pod_hash(&a[0]), recorded_pod_hash(&b[0]));
        assert_eq!(
            recorded_pod_hash(&a[1]),
            recorded_pod_hash(&b[1]),
            "an unmoved shard keeps its pod"
        );
        let mut edited = mi.clone();
        pod_spec(&mut edited).containers[0].image = Some("busybox:1.38".into());
        let c = shard_pods(&edited, &plan(), |_| GPU.into());
        assert_ne!(recorded_pod_hash(&a[1]), recorded_pod_hash(&c[1]));
    }

    /// Pods an older controller made, without the runtime variables, match
    /// the desired pods' hash and are not replaced.
    #[test]
    fn pods_made_before_the_runtime_variables_keep_their_hash() {
        let mi = instance("llama", SMALL);
        for desired in shard_pods(&mi, &plan(), |_| GPU.into()) {
            let mut older = desired.clone();
            let container = &mut older.spec.as_mut().unwrap().containers[0];
            let env = container.env.as_mut().unwrap();
            let before = env.len();
            env.retain(|var| !crate::controller::runtime_env::NAMES.contains(&var.name.as_str()));
            // All of them but TESSERA_MAX_NUM_SEQS, which needs a capacity.
            assert_eq!(before - env.len(), 6);
            older
                .metadata
                .annotations
                .as_mut()
                .unwrap()
                .remove(SPEC_HASH_ANNOTATION);
            assert_eq!(Some(pod_hash(&older).as_str()), recorded_pod_hash(&desired));
        }
    }

    #[test]
    fn replicas_after_the_first_name_their_own_shard_0_as_master() {
        let mi = instance("llama", SMALL);
        let mut second = plan();
        for shard in &mut second {
            shard.replica = 2;
        }
        let pods = shard_pods(&mi, &second, |_| GPU.into());
        for pod in &pods {
            assert_eq!(
                env(pod, 0)["TESSERA_MASTER_ADDR"],
                "llama-r2-shard-0.llama.ml.svc"
            );
        }
    }

    #[test]
    fn the_service_is_headless_and_publishes_unready_shards() {
        let mut mi = instance("llama", SMALL);
        pod_spec(&mut mi).containers[0].ports =
            Some(vec![k8s_openapi::api::core::v1::ContainerPort {
                name: Some("nccl".into()),
                container_port: 29500,
                ..Default::default()
            }]);
        let s = headless_service(&mi);
        let spec = s.spec.unwrap();
        assert_eq!(spec.cluster_ip.as_deref(), Some("None"));
        assert_eq!(spec.publish_not_ready_addresses, Some(true));
        assert_eq!(spec.selector.unwrap()[INSTANCE_LABEL], "llama");
        assert_eq!(spec.ports.unwrap()[0].port, 29500);
        assert_eq!(s.metadata.owner_references.unwrap()[0].uid, "uid-llama");
    }

    #[test]
    fn per_vendor_shards_request_their_devices_vendor() {
        let per_vendor: ResourceName = "tessera.dev/{vendor}-gpu".parse().unwrap();
        let nodes = infos(&[node("n0", 2, H100), node("n1", 2, MI300X)]);
        let plan = plan();
        let mi = instance("llama", SMALL);
        let pods = shard_pods(&mi, &plan, |s| shard_resource(&per_vendor, s, &nodes, None));
        let requested = |p: &Pod| {
            let r = p.spec.as_ref().unwrap().containers[0].resources.clone();
            let limits = r.unwrap().limits.unwrap();
            limits.keys().cloned().collect::<Vec<_>>()
        };
        assert_eq!(requested(&pods[0]), ["tessera.dev/nvidia-gpu"]);
        assert_eq!(requested(&pods[1]), ["tessera.dev/amd-gpu"]);

        // One name for all: the nodes do not matter.
        let one = ResourceName::default();
        assert_eq!(shard_resource(&one, &plan[1], &[], None), GPU);

        // The node's GPU state went away: the existing pod's request stands.
        let gone = &nodes[..1];
        assert_eq!(
            shard_resource(&per_vendor, &plan[1], gone, Some(&pods[1])),
            "tessera.dev/amd-gpu"
        );
        let foreign = shard_pods(&mi, &plan, |_| GPU.into());
        assert_eq!(
            shard_resource(&per_vendor, &plan[1], gone, Some(&foreign[1])),
            "tessera.dev/unknown-gpu",
            "a request of another name is not one of ours"
        );
        assert_eq!(
            shard_resource(&per_vendor, &plan[1], gone, None),
            "tessera.dev/unknown-gpu"
        );
    }
}
