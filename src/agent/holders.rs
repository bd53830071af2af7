//! Who holds what the agent handed out: the pod, and for a shard tessera
//! planned, its instance, replica and shard, read from the labels the
//! controller puts on a shard's pod (device plugin) and claim (DRA). The
//! per-device metrics carry them, so a GPU's series name the model it serves.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use tessera_core::api::{INSTANCE_LABEL, REPLICA_LABEL, SHARD_ANNOTATION};

/// The pod a device was handed to and, for a tessera shard, which one.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Holder {
    pub namespace: String,
    /// The pod's name; empty while a DRA claim is reserved for no pod.
    #[serde(default)]
    pub pod: String,
    /// The ModelInstance; empty for a pod tessera did not plan.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub instance: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub replica: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub shard: String,
}

impl Holder {
    /// The holder named by a shard pod's or claim's `labels`. A tessera shard
    /// of the first replica carries no replica label: it is replica 0.
    pub(crate) fn from_labels(
        namespace: &str,
        pod: &str,
        labels: Option<&BTreeMap<String, String>>,
    ) -> Self {
        let label = |key: &str| {
            labels
                .and_then(|labels| labels.get(key))
                .cloned()
                .unwrap_or_default()
        };
        let instance = label(INSTANCE_LABEL);
        let (replica, shard) = if instance.is_empty() {
            (String::new(), String::new())
        } else {
            let replica = labels
                .and_then(|labels| labels.get(REPLICA_LABEL))
                .cloned()
                .unwrap_or_else(|| "0".to_string());
            (replica, label(SHARD_ANNOTATION))
        };
        Self {
            namespace: namespace.to_string(),
            pod: pod.to_string(),
            instance,
            replica,
            shard,
        }
    }

    /// From a `namespace/name` pod key (what the device plugin's checkpoint
    /// records) when the pod itself is no longer known.
    pub(crate) fn from_pod_key(key: &str) -> Self {
        let (namespace, pod) = key.split_once('/').unwrap_or(("", key));
        Self::from_labels(namespace, pod, None)
    }
}

/// One thing handed out: a whole device, a partition, or a memory share of
/// a whole device.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Holding {
    /// tessera's ID of the device or partition handed out.
    pub device: String,
    /// Set for a memory share of `device`: its bytes.
    pub memory_share_bytes: Option<u64>,
    pub holder: Holder,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn a_shard_is_named_by_its_labels() {
        let first = labels(&[(INSTANCE_LABEL, "llama"), (SHARD_ANNOTATION, "1")]);
        let holder = Holder::from_labels("ml", "llama-shard-1", Some(&first));
        assert_eq!(
            (
                holder.instance.as_str(),
                holder.replica.as_str(),
                holder.shard.as_str()
            ),
            ("llama", "0", "1")
        );
        let later = labels(&[
            (INSTANCE_LABEL, "llama"),
            (SHARD_ANNOTATION, "0"),
            (REPLICA_LABEL, "3"),
        ]);
        assert_eq!(
            Holder::from_labels("ml", "llama-r3-shard-0", Some(&later)).replica,
            "3"
        );
    }

    #[test]
    fn a_pod_tessera_did_not_plan_has_only_its_name() {
        // A replica or shard label without the instance label names no shard.
        let stray = labels(&[(REPLICA_LABEL, "3"), (SHARD_ANNOTATION, "x")]);
        let holder = Holder::from_labels("team", "notebook", Some(&stray));
        assert_eq!(
            holder,
            Holder {
                namespace: "team".into(),
                pod: "notebook".into(),
                ..Holder::default()
            }
        );
        assert_eq!(Holder::from_pod_key("team/notebook"), holder);
        assert_eq!(Holder::from_pod_key("no-slash").pod, "no-slash");
    }
}
