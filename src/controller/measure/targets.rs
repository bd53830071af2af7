//! Which endpoint to read each serving replica's runtime metrics from: its
//! first shard's pod (the one that serves requests), on the container port
//! named `metrics`, else the one named `http` (vLLM, SGLang and TensorRT-LLM
//! serve `/metrics` beside their API). A pod not Ready is a target too, so
//! that a runtime measured before and now stuck is named, not forgotten; the
//! loop reads it only then.

use std::collections::BTreeMap;

use crate::controller::apply::ready;
use crate::controller::desired::replica_of;
use k8s_openapi::api::core::v1::Pod;
use kube::ResourceExt;
use kube::runtime::reflector::ObjectRef;
use tessera_core::api::{INSTANCE_LABEL, ModelInstance, Runtime, SHARD_ANNOTATION};

/// The port names looked for, in order.
pub(crate) const PORT_NAMES: [&str; 2] = ["metrics", "http"];

/// One replica's metrics endpoint.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Target {
    pub(crate) instance: ObjectRef<ModelInstance>,
    pub(crate) replica: u32,
    /// The pod read; a new one (a move, a recreation) starts a new window.
    pub(crate) pod_uid: String,
    /// Whether the pod is Ready.
    pub(crate) ready: bool,
    /// `Err`: why the replica cannot be read (no port named as above).
    pub(crate) url: Result<String, String>,
    pub(crate) runtime: Runtime,
}

/// The targets among `pods` (the controller's shard pods): per instance
/// and replica, the first-shard pod with an IP, Ready ones before others,
/// the newest first. `runtime`
/// gives an instance's runtime, `None` for an instance the cache no longer
/// has (its pods are going).
pub(crate) fn targets<'a>(
    pods: impl IntoIterator<Item = &'a Pod>,
    runtime: impl Fn(&ObjectRef<ModelInstance>) -> Option<Runtime>,
) -> Vec<Target> {
    // By namespace, instance and replica.
    let mut newest: BTreeMap<(String, String, u32), &Pod> = BTreeMap::new();
    for pod in pods {
        if pod.metadata.deletion_timestamp.is_some() || pod_ip(pod).is_none() {
            continue;
        }
        let labels = pod.labels();
        if labels.get(SHARD_ANNOTATION).map(String::as_str) != Some("0") {
            continue;
        }
        let Some(instance) = labels.get(INSTANCE_LABEL) else {
            continue;
        };
        let Some(replica) = replica_of(pod) else {
            continue;
        };
        let key = (
            pod.namespace().unwrap_or_default(),
            instance.clone(),
            replica,
        );
        let entry = newest.entry(key).or_insert(pod);
        let rank = |p: &Pod| (ready(p), p.creation_timestamp());
        if rank(pod) > rank(entry) {
            *entry = pod;
        }
    }
    newest
        .into_iter()
        .filter_map(|((namespace, instance, replica), pod)| {
            let instance = ObjectRef::new(&instance).within(&namespace);
            let runtime = runtime(&instance)?;
            Some(Target {
                replica,
                pod_uid: pod.uid().unwrap_or_default(),
                ready: ready(pod),
                url: url(pod),
                runtime,
                instance,
            })
        })
        .collect()
}

fn pod_ip(pod: &Pod) -> Option<&str> {
    pod.status
        .as_ref()?
        .pod_ip
        .as_deref()
        .filter(|ip| !ip.is_empty())
}

/// `http://<pod IP>:<port>/metrics`, or why there is none.
fn url(pod: &Pod) -> Result<String, String> {
    let ports: Vec<_> = pod
        .spec
        .iter()
        .flat_map(|s| &s.containers)
        .flat_map(|c| c.ports.iter().flatten())
        .collect();
    let port = PORT_NAMES
        .iter()
        .find_map(|name| ports.iter().find(|p| p.name.as_deref() == Some(*name)))
        .ok_or_else(|| {
            format!(
                "pod {} has no container port named {}",
                pod.name_any(),
                PORT_NAMES.join(" or ")
            )
        })?;
    let ip = pod_ip(pod).unwrap_or_default();
    // An IPv6 address goes in brackets.
    let host = if ip.contains(':') {
        format!("[{ip}]")
    } else {
        ip.to_string()
    };
    Ok(format!("http://{host}:{}/metrics", port.container_port))
}

#[cfg(test)]
mod tests {
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
    use serde_json::json;

    use super::*;
    use tessera_core::api::REPLICA_LABEL;

    fn pod(name: &str, labels: serde_json::Value, ready: bool, ip: &str, created: &str) -> Pod {
        serde_json::from_value(json!({
            "metadata": {"name": name, "namespace": "ml", "uid": format!("uid-{name}"),
                "labels": labels, "creationTimestamp": created},
            "spec": {"containers": [{"name": "vllm", "ports": [
                {"name": "dist", "containerPort": 29500},
                {"name": "http", "containerPort": 8000}]}]},
            "status": {"podIP": ip, "conditions": [
                {"type": "Ready", "status": if ready { "True" } else { "False" }}]}
        }))
        .unwrap()
    }

    const T0: &str = "2026-12-01T00:00:00Z";
    const T1: &str = "2026-12-01T00:05:00Z";

    fn vllm(_: &ObjectRef<ModelInstance>) -> Option<Runtime> {
        Some(Runtime::Vllm)
    }

    #[test]
    fn each_replicas_first_ready_shard_is_read_on_its_http_port() {
        let pods = [
            pod(
                "llama-shard-0",
                json!({INSTANCE_LABEL: "llama", SHARD_ANNOTATION: "0"}),
                true,
                "10.0.0.1",
                T0,
            ),
            pod(
                "llama-shard-1",
                json!({INSTANCE_LABEL: "llama", SHARD_ANNOTATION: "1"}),
                true,
                "10.0.0.2",
                T0,
            ),
            pod(
                "llama-r1-shard-0",
                json!({INSTANCE_LABEL: "llama", SHARD_ANNOTATION: "0", REPLICA_LABEL: "1"}),
                false,
                "10.0.0.3",
                T0,
            ),
            pod(
                "llama-r2-shard-0",
                json!({INSTANCE_LABEL: "llama", SHARD_ANNOTATION: "0", REPLICA_LABEL: "2"}),
                true,
                "fd00::5",
                T0,
            ),
        ];
        let got = targets(&pods, vllm);
        let seen: Vec<_> = got
            .iter()
            .map(|t| (t.replica, t.ready, t.url.clone().unwrap()))
            .collect();
        let url = |ip: &str| format!("http://{ip}:8000/metrics");
        assert_eq!(
            seen,
            [
                (0, true, url("10.0.0.1")),
                (1, false, url("10.0.0.3")),
                (2, true, url("[fd00::5]")),
            ]
        );
        assert_eq!(got[0].instance, ObjectRef::new("llama").within("ml"));
    }

    #[test]
    fn a_moves_new_copy_is_read_once_ready_and_a_port_named_metrics_wins() {
        let old = pod(
            "llama-shard-0",
            json!({INSTANCE_LABEL: "llama", SHARD_ANNOTATION: "0"}),
            true,
            "10.0.0.1",
            T0,
        );
        let mut new = pod(
            "llama-m-shard-0",
            json!({INSTANCE_LABEL: "llama", SHARD_ANNOTATION: "0"}),
            true,
            "10.0.0.9",
            T1,
        );
        new.spec.as_mut().unwrap().containers[0]
            .ports
            .as_mut()
            .unwrap()
            .push(
                serde_json::from_value(json!({"name": "metrics", "containerPort": 9090})).unwrap(),
            );
        let mut starting = new.clone();
        starting
            .status
            .as_mut()
            .unwrap()
            .conditions
            .as_mut()
            .unwrap()[0]
            .status = "False".into();
        let old_ready = targets([&old, &starting], vllm);
        assert_eq!(
            old_ready[0].pod_uid, "uid-llama-shard-0",
            "the Ready one, though older"
        );
        let got = targets([&old, &new], vllm);
        assert_eq!(got.len(), 1);
        assert_eq!(got[0].url, Ok("http://10.0.0.9:9090/metrics".to_string()));
        // Going: not read.
        new.metadata.deletion_timestamp = Some(Time(k8s_openapi::jiff::Timestamp::UNIX_EPOCH));
        assert_eq!(targets([&old, &new], vllm)[0].pod_uid, "uid-llama-shard-0");
    }

    #[test]
    fn no_port_to_read_and_a_bad_replica_label_say_so_or_are_skipped() {
        let mut p = pod(
            "llama-shard-0",
            json!({INSTANCE_LABEL: "llama", SHARD_ANNOTATION: "0"}),
            true,
            "10.0.0.1",
            T0,
        );
        p.spec.as_mut().unwrap().containers[0].ports = None;
        let bad = pod(
            "x-shard-0",
            json!({INSTANCE_LABEL: "x", SHARD_ANNOTATION: "0", REPLICA_LABEL: "one"}),
            true,
            "10.0.0.2",
            T0,
        );
        let got = targets([&p, &bad], vllm);
        assert_eq!(got.len(), 1);
        assert_eq!(
            got[0].url,
            Err("pod llama-shard-0 has no container port named metrics or http".to_string())
        );
        assert!(
            targets([&p], |_| None).is_empty(),
            "an instance that is gone is not read"
        );
    }
}
