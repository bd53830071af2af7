//! A ResourceSlice as the controller caches it: read from the API server's
//! JSON straight into the few fields the controller reads (pool, node, and
//! each device's name, ID and memory) and nothing else.
//!
//! Decoded whole and trimmed afterwards, 5,000 nodes' slices left the
//! controller 140 MiB larger for good: the fields kept were scattered among
//! the freed ones, so hardly a page of the decoded list could go back.

use std::collections::BTreeMap;

use k8s_openapi::api::resource::v1::ResourceSlice;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use serde::{Deserialize, Deserializer};

use crate::controller::cached_resource::cached_resource;

/// A ResourceSlice, cut down to what placement and allocation read.
#[derive(Clone, Debug, Default, Deserialize)]
pub struct CachedSlice {
    /// Name, UID and resourceVersion only (what the cache keys on).
    #[serde(default, deserialize_with = "identity")]
    pub metadata: ObjectMeta,
    pub spec: CachedSliceSpec,
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct CachedSliceSpec {
    pub driver: String,
    #[serde(default)]
    pub node_name: Option<String>,
    pub pool: CachedPool,
    #[serde(default)]
    pub devices: Option<Vec<CachedDevice>>,
    /// Counter sets (partitionable devices): what the devices that consume
    /// them may use of them together.
    #[serde(default, rename = "sharedCounters")]
    pub shared_counters: Vec<CachedCounterSet>,
}

#[derive(Clone, Debug, Default, Deserialize)]
pub struct CachedCounterSet {
    pub name: String,
    #[serde(default)]
    pub counters: BTreeMap<String, CachedCounter>,
}

#[derive(Clone, Debug, Default, Deserialize)]
pub struct CachedCounter {
    pub value: String,
}

/// What a device consumes of one counter set.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct CachedConsumption {
    pub counter_set: String,
    #[serde(default)]
    pub counters: BTreeMap<String, CachedCounter>,
}

#[derive(Clone, Debug, Default, Deserialize)]
pub struct CachedPool {
    pub name: String,
    pub generation: i64,
}

#[derive(Clone, Debug, Default, Deserialize)]
pub struct CachedDevice {
    pub name: String,
    /// The `id` attribute (`DRA_ID_ATTRIBUTE`): tessera's device ID.
    #[serde(default, rename = "attributes", deserialize_with = "id_attribute")]
    pub id: Option<String>,
    /// The `memory` capacity in bytes: what memory shares of the device add
    /// up to at most.
    #[serde(default, rename = "capacity", deserialize_with = "memory_capacity")]
    pub memory: Option<u64>,
    /// The counters it consumes (a MIG partition: its GPU's memory slices
    /// and multiprocessors).
    #[serde(default, rename = "consumesCounters")]
    pub consumes: Vec<CachedConsumption>,
}

/// The metadata fields a cache needs to tell objects and versions apart.
#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Identity {
    name: Option<String>,
    uid: Option<String>,
    resource_version: Option<String>,
}

fn identity<'de, D: Deserializer<'de>>(deserializer: D) -> Result<ObjectMeta, D::Error> {
    let Identity {
        name,
        uid,
        resource_version,
    } = Identity::deserialize(deserializer)?;
    Ok(ObjectMeta {
        name,
        uid,
        resource_version,
        ..ObjectMeta::default()
    })
}

/// A device's attributes, of which only the ID is read; the others are
/// skipped unread.
#[derive(Deserialize)]
struct IdAttribute {
    // The key is `tessera_core::api::DRA_ID_ATTRIBUTE` (a unit test holds it).
    id: Option<StringValue>,
}

#[derive(Deserialize)]
struct StringValue {
    string: Option<String>,
}

fn id_attribute<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Option<String>, D::Error> {
    let attributes = Option::<IdAttribute>::deserialize(deserializer)?;
    Ok(attributes.and_then(|a| a.id).and_then(|v| v.string))
}

/// A device's capacities, of which only the memory is read.
#[derive(Deserialize)]
struct MemoryCapacity {
    memory: Option<CapacityValue>,
}

#[derive(Deserialize)]
struct CapacityValue {
    value: Option<String>,
}

fn memory_capacity<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Option<u64>, D::Error> {
    let capacity = Option::<MemoryCapacity>::deserialize(deserializer)?;
    Ok(capacity
        .and_then(|c| c.memory)
        .and_then(|m| m.value)
        .and_then(|value| crate::kubernetes::quantity::whole_units(&value)))
}

cached_resource!(CachedSlice, ResourceSlice);

#[cfg(test)]
mod tests {
    use kube::Resource;
    use serde_json::json;
    use tessera_core::api::DRA_ID_ATTRIBUTE;

    use super::*;

    /// A slice as an agent publishes it and the API server returns it.
    fn whole_slice() -> serde_json::Value {
        let device = |name: &str, id: Option<&str>| {
            let mut attributes = json!({
                "vendor": {"string": "nvidia"},
                "product": {"string": "NVIDIA H100 80GB HBM3"},
                "index": {"int": 0},
                "resource.kubernetes.io/pciBusID": {"string": "0000:18:00.0"},
            });
            if let Some(id) = id {
                attributes[DRA_ID_ATTRIBUTE] = json!({"string": id});
            }
            json!({
                "name": name,
                "attributes": attributes,
                "capacity": {"memory": {"value": "80Gi"}},
                "taints": [{"key": "gpu.tessera.dev/unhealthy", "effect": "NoSchedule"}],
            })
        };
        json!({
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceSlice",
            "metadata": {
                "name": "n1-gpu.tessera.dev-0",
                "uid": "uid-1",
                "resourceVersion": "42",
                "labels": {"a": "b"},
                "ownerReferences": [{"apiVersion": "v1", "kind": "Node", "name": "n1", "uid": "uid-n1"}],
                "managedFields": [{"manager": "tessera-agent", "operation": "Apply", "fieldsType": "FieldsV1", "fieldsV1": {"f:spec": {}}}],
            },
            "spec": {
                "driver": "gpu.tessera.dev",
                "nodeName": "n1",
                "pool": {"name": "n1", "generation": 3, "resourceSliceCount": 1},
                "devices": [device("gpu-a", Some("GPU-A")), device("gpu-b", Some("GPU-B")), device("no-id", None)],
            },
        })
    }

    #[test]
    fn a_whole_slice_is_read_into_what_is_used() {
        let whole = whole_slice();
        // It is a valid ResourceSlice to begin with.
        serde_json::from_value::<ResourceSlice>(whole.clone()).unwrap();
        let cached: CachedSlice = serde_json::from_value(whole).unwrap();
        assert_eq!(
            cached.metadata.name.as_deref(),
            Some("n1-gpu.tessera.dev-0")
        );
        assert_eq!(cached.metadata.uid.as_deref(), Some("uid-1"));
        assert_eq!(cached.metadata.resource_version.as_deref(), Some("42"));
        assert_eq!(cached.metadata.labels, None);
        assert_eq!(cached.metadata.owner_references, None);
        assert_eq!(cached.metadata.managed_fields, None);
        assert_eq!(cached.spec.driver, "gpu.tessera.dev");
        assert_eq!(cached.spec.node_name.as_deref(), Some("n1"));
        assert_eq!(
            (cached.spec.pool.name.as_str(), cached.spec.pool.generation),
            ("n1", 3)
        );
        let devices: Vec<(&str, Option<&str>)> = cached
            .spec
            .devices
            .iter()
            .flatten()
            .map(|d| (d.name.as_str(), d.id.as_deref()))
            .collect();
        assert_eq!(
            devices,
            [
                ("gpu-a", Some("GPU-A")),
                ("gpu-b", Some("GPU-B")),
                ("no-id", None)
            ]
        );
    }

    #[test]
    fn counter_sets_and_what_partitions_consume_are_read() {
        let counters = json!({
            "metadata": {"name": "n1-gpu.tessera.dev-1"},
            "spec": {
                "driver": "gpu.tessera.dev",
                "nodeName": "n1",
                "pool": {"name": "n1", "generation": 3, "resourceSliceCount": 2},
                "sharedCounters": [{"name": "gpu-a", "counters": {
                    "memory-slice-0": {"value": "1"}, "multiprocessors": {"value": "132"}}}],
            },
        });
        serde_json::from_value::<ResourceSlice>(counters.clone()).unwrap();
        let cached: CachedSlice = serde_json::from_value(counters).unwrap();
        let set = &cached.spec.shared_counters[0];
        assert_eq!(set.name, "gpu-a");
        assert_eq!(set.counters["multiprocessors"].value, "132");
        let mut partition = whole_slice();
        partition["spec"]["devices"] = json!([{
            "name": "mig-1",
            "attributes": {DRA_ID_ATTRIBUTE: {"string": "MIG-1"}},
            "capacity": {"memory": {"value": "40Gi"}},
            "consumesCounters": [{"counterSet": "gpu-a", "counters": {"memory-slice-0": {"value": "1"}}}],
        }]);
        serde_json::from_value::<ResourceSlice>(partition.clone()).unwrap();
        let cached: CachedSlice = serde_json::from_value(partition).unwrap();
        let device = &cached.spec.devices.as_ref().unwrap()[0];
        assert_eq!(device.memory, Some(40 << 30));
        assert_eq!(device.consumes[0].counter_set, "gpu-a");
        assert_eq!(device.consumes[0].counters["memory-slice-0"].value, "1");
    }

    #[test]
    fn missing_and_null_parts_read_as_absent_and_a_malformed_slice_is_an_error() {
        let cached: CachedSlice = serde_json::from_value(json!({
            "metadata": {"name": "s"},
            "spec": {"driver": "d", "pool": {"name": "p", "generation": 1}, "devices": [{"name": "x", "attributes": null}]},
        }))
        .unwrap();
        assert_eq!(cached.spec.node_name, None);
        assert_eq!(cached.spec.devices.unwrap()[0].id, None);
        for bad in [
            json!({"metadata": {"name": "s"}, "spec": {"driver": "d"}}),
            json!({"spec": {"driver": "d", "pool": {"name": "p", "generation": "one"}}}),
            json!({"spec": {"driver": "d", "pool": {"name": "p", "generation": 1}, "devices": [{"name": "x", "attributes": {"id": {"string": 7}}}]}}),
        ] {
            assert!(
                serde_json::from_value::<CachedSlice>(bad.clone()).is_err(),
                "{bad}"
            );
        }
    }

    #[test]
    fn it_is_watched_as_resource_slices() {
        assert_eq!(
            CachedSlice::api_version(&()),
            ResourceSlice::api_version(&())
        );
        assert_eq!(CachedSlice::plural(&()), "resourceslices");
        assert_eq!(CachedSlice::kind(&()), "ResourceSlice");
    }
}
