//! What the node's ResourceSlices say: one pool named after the node, each
//! device with its name ([`device_names`]), typed attributes a claim's CEL
//! selector can read, and its memory as capacity. A device the health tracker
//! calls unhealthy carries a `NoSchedule` taint where the API server serves
//! device taints, and is left out where it does not, so no allocator hands it
//! out either way.
//!
//! Attributes (unqualified names live in the driver's domain, so a selector
//! reads `device.attributes["gpu.tessera.dev"].id`):
//! `id` (tessera's device ID, the one plans name), `index`, `vendor`,
//! `product`, `architecture`, `uuid` (where the vendor gave one), `numaNode`,
//! `scaleUpDomain` (devices joined by NVLink or xGMI share a number), and
//! the standard `resource.kubernetes.io/pciBusID`.

use std::collections::BTreeMap;

use k8s_openapi::api::resource::v1::{
    Device, DeviceAttribute, DeviceCapacity, DeviceTaint, ResourcePool, ResourceSlice,
    ResourceSliceSpec,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};

use super::device_names::{device_names, hash_hex};
use crate::backend::{DeviceState, RawHealth, Snapshot, fake, is_fallback_id};
use tessera_core::api::DRA_ID_ATTRIBUTE;

/// A slice may hold at most 64 devices once any of them has a taint (128
/// without); GPU nodes have far fewer, so every slice keeps to 64.
const DEVICES_PER_SLICE: usize = 64;
/// The longest object name (a DNS subdomain).
const MAX_NAME: usize = 253;
/// The API server refuses longer string attribute values.
const MAX_STRING_ATTRIBUTE: usize = 64;
/// The standard attribute for a device's PCI address.
pub(crate) const PCI_BUS_ID: &str = "resource.kubernetes.io/pciBusID";
/// The capacity holding a device's memory in bytes.
pub(crate) const MEMORY_CAPACITY: &str = "memory";
/// The label every slice of this agent carries: the node it describes.
pub(crate) const NODE_LABEL_SUFFIX: &str = "node";

/// Who the slices belong to and how to write them.
#[derive(Clone, Debug)]
pub(crate) struct SliceOwner {
    /// The DRA driver name (`gpu.tessera.dev`).
    pub(crate) driver: String,
    pub(crate) node_name: String,
    /// The Node's UID: the slices are owned by the Node, so they go with it.
    pub(crate) node_uid: String,
}

/// The devices of the node's pool, in device order. `taints`: whether the API
/// server keeps device taints (else unhealthy devices are left out).
pub(crate) fn pool_devices(snapshot: &Snapshot, driver: &str, taints: bool) -> Vec<Device> {
    let names = device_names(snapshot.devices.iter().map(|d| d.info.id.as_str()));
    let domains = scale_up_domains(snapshot);
    let mut devices = Vec::with_capacity(snapshot.devices.len());
    for state in &snapshot.devices {
        // A GPU in MIG mode, or about to change it, is no whole GPU to offer.
        if state.info.not_whole().is_some() {
            continue;
        }
        let healthy = state.health == RawHealth::Healthy;
        if !healthy && !taints {
            continue;
        }
        let Some(name) = names.get(&state.info.id) else {
            continue;
        };
        let uuid = (snapshot.backend != fake::BACKEND_NAME && !is_fallback_id(&state.info.id))
            .then_some(state.info.id.as_str());
        devices.push(Device {
            name: name.clone(),
            attributes: Some(attributes(
                state,
                uuid,
                domains.get(&state.info.id).copied(),
            )),
            capacity: Some(BTreeMap::from([(
                MEMORY_CAPACITY.to_string(),
                DeviceCapacity {
                    value: Quantity(state.info.memory_total_bytes.to_string()),
                    request_policy: None,
                },
            )])),
            taints: (!healthy).then(|| vec![unhealthy_taint(driver)]),
            ..Device::default()
        });
    }
    devices
}

/// The taint an unhealthy device carries: no new allocation (`NoSchedule`),
/// but pods already using it are not evicted by kube-controller-manager —
/// the controller repairs tessera's own shards itself.
pub(crate) fn unhealthy_taint(driver: &str) -> DeviceTaint {
    DeviceTaint {
        key: format!("{driver}/unhealthy"),
        effect: "NoSchedule".to_string(),
        value: None,
        time_added: None,
    }
}

fn attributes(
    state: &DeviceState,
    uuid: Option<&str>,
    domain: Option<u32>,
) -> BTreeMap<String, DeviceAttribute> {
    let info = &state.info;
    let mut attributes = BTreeMap::new();
    let mut string = |key: &str, value: &str| {
        if !value.is_empty() {
            attributes.insert(
                key.to_string(),
                DeviceAttribute {
                    string: Some(truncated(value)),
                    ..DeviceAttribute::default()
                },
            );
        }
    };
    string(DRA_ID_ATTRIBUTE, &info.id);
    string("vendor", info.vendor.as_str());
    string("product", &info.product);
    string("architecture", &info.architecture);
    string("uuid", uuid.unwrap_or_default());
    string(PCI_BUS_ID, &info.pci_bus_id.to_ascii_lowercase());
    let int = |value: i64| DeviceAttribute {
        int: Some(value),
        ..DeviceAttribute::default()
    };
    attributes.insert("index".to_string(), int(i64::from(info.index)));
    if let Some(numa) = info.numa_node.filter(|n| *n >= 0) {
        attributes.insert("numaNode".to_string(), int(i64::from(numa)));
    }
    if let Some(domain) = domain {
        attributes.insert("scaleUpDomain".to_string(), int(i64::from(domain)));
    }
    attributes
}

fn truncated(value: &str) -> String {
    let mut end = value.len().min(MAX_STRING_ATTRIBUTE);
    while !value.is_char_boundary(end) {
        end -= 1;
    }
    value[..end].to_string()
}

/// Devices joined by scale-up links (NVLink, xGMI), directly or through
/// others, share a domain: the smallest index among them. A device with no
/// such link has none.
fn scale_up_domains(snapshot: &Snapshot) -> BTreeMap<String, u32> {
    let index: BTreeMap<&str, u32> = snapshot
        .devices
        .iter()
        .map(|d| (d.info.id.as_str(), d.info.index))
        .collect();
    let mut domain: BTreeMap<&str, u32> = BTreeMap::new();
    // Few devices: relax until nothing changes.
    let mut changed = true;
    while changed {
        changed = false;
        for link in &snapshot.links {
            if !link.kind.is_scale_up() || link.a == link.b {
                continue;
            }
            let (Some(&ia), Some(&ib)) = (index.get(link.a.as_str()), index.get(link.b.as_str()))
            else {
                continue;
            };
            let a = *domain.get(link.a.as_str()).unwrap_or(&ia);
            let b = *domain.get(link.b.as_str()).unwrap_or(&ib);
            let least = a.min(b);
            for id in [link.a.as_str(), link.b.as_str()] {
                if domain.get(id) != Some(&least) {
                    domain.insert(id, least);
                    changed = true;
                }
            }
        }
    }
    domain
        .into_iter()
        .map(|(id, d)| (id.to_string(), d))
        .collect()
}

/// The slices publishing `devices` as generation `generation` of the pool.
/// Always at least one slice, so an empty node still says it has nothing.
pub(crate) fn node_slices(
    owner: &SliceOwner,
    devices: &[Device],
    generation: i64,
) -> Vec<ResourceSlice> {
    let chunks: Vec<&[Device]> = if devices.is_empty() {
        vec![&[]]
    } else {
        devices.chunks(DEVICES_PER_SLICE).collect()
    };
    let count = i64::try_from(chunks.len()).unwrap_or(i64::MAX);
    chunks
        .into_iter()
        .enumerate()
        .map(|(i, chunk)| ResourceSlice {
            metadata: ObjectMeta {
                name: Some(slice_name(owner, i)),
                labels: Some(BTreeMap::from([(
                    node_label(&owner.driver),
                    owner.node_name.clone(),
                )])),
                owner_references: Some(vec![OwnerReference {
                    api_version: "v1".to_string(),
                    kind: "Node".to_string(),
                    name: owner.node_name.clone(),
                    uid: owner.node_uid.clone(),
                    controller: Some(true),
                    block_owner_deletion: None,
                }]),
                ..ObjectMeta::default()
            },
            spec: ResourceSliceSpec {
                driver: owner.driver.clone(),
                node_name: Some(owner.node_name.clone()),
                pool: ResourcePool {
                    name: owner.node_name.clone(),
                    generation,
                    resource_slice_count: count,
                },
                devices: Some(chunk.to_vec()),
                ..ResourceSliceSpec::default()
            },
        })
        .collect()
}

/// `<driver>/node`: the label selecting one node's slices of this driver.
pub(crate) fn node_label(driver: &str) -> String {
    format!("{driver}/{NODE_LABEL_SUFFIX}")
}

/// `<node>-<driver, dots as dashes>-<i>`, cut (with a hash of the whole) to
/// the 253 characters of a DNS subdomain.
fn slice_name(owner: &SliceOwner, i: usize) -> String {
    let name = format!("{}-{}-{i}", owner.node_name, owner.driver.replace('.', "-"));
    if name.len() <= MAX_NAME {
        return name;
    }
    let tail = format!("-{}-{i}", hash_hex(&name));
    let head = name[..MAX_NAME - tail.len()].trim_end_matches(['-', '.']);
    format!("{head}{tail}")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::fake::FakeBackend;
    use crate::backend::snapshot;

    fn owner() -> SliceOwner {
        SliceOwner {
            driver: "gpu.tessera.dev".into(),
            node_name: "node-1".into(),
            node_uid: "uid-1".into(),
        }
    }

    fn read(spec: &str) -> Snapshot {
        snapshot(&mut FakeBackend::new(spec).unwrap()).unwrap()
    }

    fn string_attribute<'a>(device: &'a Device, key: &str) -> Option<&'a str> {
        device.attributes.as_ref()?.get(key)?.string.as_deref()
    }

    #[test]
    fn each_device_says_what_a_selector_needs() {
        let snap = read("2xH100-80GiB");
        let devices = pool_devices(&snap, "gpu.tessera.dev", true);
        assert_eq!(devices.len(), 2);
        let first = &devices[0];
        assert_eq!(
            first.name,
            crate::agent::dra::device_names::device_names([snap.devices[0].info.id.as_str()])
                [&snap.devices[0].info.id]
        );
        assert_eq!(
            string_attribute(first, DRA_ID_ATTRIBUTE),
            Some(snap.devices[0].info.id.as_str())
        );
        assert_eq!(string_attribute(first, "vendor"), Some("nvidia"));
        assert_eq!(
            string_attribute(first, "product"),
            Some(snap.devices[0].info.product.as_str())
        );
        // Fake devices have no vendor UUID.
        assert_eq!(string_attribute(first, "uuid"), None);
        let attributes = first.attributes.as_ref().unwrap();
        assert_eq!(attributes["index"].int, Some(0));
        assert_eq!(
            first.capacity.as_ref().unwrap()[MEMORY_CAPACITY].value,
            Quantity((80u64 << 30).to_string())
        );
        assert!(first.taints.is_none());
    }

    #[test]
    fn devices_joined_by_scale_up_links_share_a_domain() {
        let mut snap = read("4xH100-80GiB");
        let ids: Vec<String> = snap.devices.iter().map(|d| d.info.id.clone()).collect();
        snap.links = vec![
            link(&ids[1], &ids[2], tessera_core::api::LinkKind::Nvlink),
            link(&ids[2], &ids[3], tessera_core::api::LinkKind::Nvlink),
            link(&ids[0], &ids[1], tessera_core::api::LinkKind::Pcie),
        ];
        let domains = scale_up_domains(&snap);
        assert_eq!(domains.get(&ids[0]), None);
        assert_eq!(domains[&ids[1]], 1);
        assert_eq!(domains[&ids[3]], 1);
        let devices = pool_devices(&snap, "d", true);
        assert_eq!(
            devices[3].attributes.as_ref().unwrap()["scaleUpDomain"].int,
            Some(1)
        );
        assert!(
            !devices[0]
                .attributes
                .as_ref()
                .unwrap()
                .contains_key("scaleUpDomain")
        );
    }

    fn link(a: &str, b: &str, kind: tessera_core::api::LinkKind) -> crate::backend::DeviceLink {
        crate::backend::DeviceLink {
            a: a.into(),
            b: b.into(),
            kind,
            bandwidth_gbps: 900.0,
            p2p: true,
        }
    }

    #[test]
    fn a_gpu_in_mig_mode_or_changing_it_is_not_offered_whole() {
        use crate::backend::test_mig;
        let mut snap = read("3xH100-80GiB");
        snap.devices[0].info.mig = Some(test_mig(true, None));
        snap.devices[1].info.mig = Some(test_mig(false, Some(true)));
        snap.devices[2].info.mig = Some(test_mig(false, None));
        let offered = pool_devices(&snap, "gpu.tessera.dev", true);
        let names = device_names(snap.devices.iter().map(|d| d.info.id.as_str()));
        assert_eq!(offered.len(), 1, "only the GPU with MIG off");
        assert_eq!(offered[0].name, names[&snap.devices[2].info.id]);
    }

    #[test]
    fn an_unhealthy_device_is_tainted_or_left_out() {
        let mut snap = read("2xMI300X-192GiB");
        snap.devices[1].health = RawHealth::Unhealthy("XID 79".into());
        let tainted = pool_devices(&snap, "gpu.tessera.dev", true);
        assert_eq!(tainted.len(), 2);
        let taint = &tainted[1].taints.as_ref().unwrap()[0];
        assert_eq!(taint.key, "gpu.tessera.dev/unhealthy");
        assert_eq!(taint.effect, "NoSchedule");
        let left_out = pool_devices(&snap, "gpu.tessera.dev", false);
        assert_eq!(left_out.len(), 1);
        assert_eq!(left_out[0].name, tainted[0].name);
    }

    #[test]
    fn long_strings_are_cut_to_what_the_api_server_takes() {
        let mut snap = read("1xH100-80GiB");
        snap.devices[0].info.product = "é".repeat(40);
        snap.devices[0].info.pci_bus_id = "0000:1A:00.0".into();
        let devices = pool_devices(&snap, "d", true);
        let product = string_attribute(&devices[0], "product").unwrap();
        assert!(product.len() <= MAX_STRING_ATTRIBUTE && product.starts_with('é'));
        assert_eq!(
            string_attribute(&devices[0], PCI_BUS_ID),
            Some("0000:1a:00.0")
        );
    }

    #[test]
    fn slices_hold_the_pool_owned_by_the_node() {
        let devices = pool_devices(&read("3xH100-80GiB"), "gpu.tessera.dev", true);
        let slices = node_slices(&owner(), &devices, 4);
        assert_eq!(slices.len(), 1);
        let slice = &slices[0];
        assert_eq!(
            slice.metadata.name.as_deref(),
            Some("node-1-gpu-tessera-dev-0")
        );
        assert_eq!(slice.spec.pool.name, "node-1");
        assert_eq!(slice.spec.pool.generation, 4);
        assert_eq!(slice.spec.pool.resource_slice_count, 1);
        assert_eq!(slice.spec.node_name.as_deref(), Some("node-1"));
        assert_eq!(slice.spec.devices.as_ref().unwrap().len(), 3);
        let owner_ref = &slice.metadata.owner_references.as_ref().unwrap()[0];
        assert_eq!(
            (owner_ref.kind.as_str(), owner_ref.uid.as_str()),
            ("Node", "uid-1")
        );
        assert_eq!(
            slice.metadata.labels.as_ref().unwrap()["gpu.tessera.dev/node"],
            "node-1"
        );

        let empty = node_slices(&owner(), &[], 5);
        assert_eq!(empty.len(), 1);
        assert_eq!(empty[0].spec.devices.as_ref().unwrap().len(), 0);
    }

    #[test]
    fn many_devices_spread_over_slices_that_count_each_other() {
        let devices: Vec<Device> = (0..130)
            .map(|i| Device {
                name: format!("d{i}"),
                ..Device::default()
            })
            .collect();
        let slices = node_slices(&owner(), &devices, 1);
        assert_eq!(slices.len(), 3);
        assert!(slices.iter().all(|s| s.spec.pool.resource_slice_count == 3));
        assert_eq!(slices[2].spec.devices.as_ref().unwrap().len(), 2);
        let long = SliceOwner {
            node_name: "n".repeat(250),
            ..owner()
        };
        let name = node_slices(&long, &devices, 1)[2]
            .metadata
            .name
            .clone()
            .unwrap();
        assert!(name.len() <= 253 && name.ends_with("-2"), "{name}");
    }
}
