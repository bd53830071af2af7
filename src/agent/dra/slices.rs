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
    CapacityRequestPolicy, CapacityRequestPolicyRange, CounterSet, Device, DeviceAttribute,
    DeviceCapacity, ResourcePool, ResourceSlice, ResourceSliceSpec,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};

use super::device_names::{hash_hex, pool_device_names};
use super::partition_devices::partition_devices;
use super::slice_fields::{MEMORY_CAPACITY, string_attribute, unhealthy_taint};
use crate::backend::{DeviceState, RawHealth, Snapshot, fake, is_fallback_id};
use tessera_core::api::DRA_ID_ATTRIBUTE;

/// A slice may hold at most 64 devices once any of them has a taint or
/// consumes counters (128 without); GPU nodes have far fewer, so every slice
/// keeps to 64.
const DEVICES_PER_SLICE: usize = 64;
/// A slice holds at most 8 counter sets.
const COUNTER_SETS_PER_SLICE: usize = 8;
/// The smallest memory share of a whole GPU.
const SMALLEST_SHARE: &str = "1Gi";
/// The longest object name (a DNS subdomain).
const MAX_NAME: usize = 253;
/// The standard attribute for a device's PCI address.
pub(crate) const PCI_BUS_ID: &str = "resource.kubernetes.io/pciBusID";
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

/// What the node's pool holds: its devices, and the counter sets its MIG
/// partitions consume.
#[derive(Clone, Debug, Default, PartialEq)]
pub(crate) struct PoolContents {
    pub(crate) devices: Vec<Device>,
    pub(crate) counter_sets: Vec<CounterSet>,
}

/// How the pool is written.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct PoolOptions {
    /// Whether the API server keeps device taints (else unhealthy devices
    /// are left out).
    pub(crate) taints: bool,
    /// Whole GPUs are offered for memory shares: several claims may each
    /// take part of a GPU's `memory` capacity (consumable capacity). A claim
    /// that asks for no capacity still takes all of it.
    pub(crate) memory_shares: bool,
}

/// The node's pool: whole GPUs in device order, then the partitions of each
/// GPU in MIG mode with the GPU's counter set. A GPU waiting for a MIG mode
/// change is offered neither way.
pub(crate) fn pool_devices(
    snapshot: &Snapshot,
    driver: &str,
    options: PoolOptions,
) -> PoolContents {
    let names = pool_device_names(snapshot);
    let domains = scale_up_domains(snapshot);
    let mut pool = PoolContents::default();
    let mut partitions = Vec::new();
    for state in &snapshot.devices {
        if state.info.not_whole().is_some() {
            if let Some(mig) = &state.info.mig
                && let Some((devices, counters)) =
                    partition_devices(state, mig, &names, driver, options.taints)
                && !devices.is_empty()
            {
                partitions.extend(devices);
                pool.counter_sets.push(counters);
            }
            continue;
        }
        let healthy = state.health == RawHealth::Healthy;
        if !healthy && !options.taints {
            continue;
        }
        let Some(name) = names.get(&state.info.id) else {
            continue;
        };
        let uuid = (snapshot.backend != fake::BACKEND_NAME && !is_fallback_id(&state.info.id))
            .then_some(state.info.id.as_str());
        let memory = Quantity(state.info.memory_total_bytes.to_string());
        pool.devices.push(Device {
            name: name.clone(),
            attributes: Some(attributes(
                state,
                uuid,
                domains.get(&state.info.id).copied(),
            )),
            capacity: Some(BTreeMap::from([(
                MEMORY_CAPACITY.to_string(),
                DeviceCapacity {
                    request_policy: options.memory_shares.then(|| share_policy(&memory)),
                    value: memory,
                },
            )])),
            allow_multiple_allocations: options.memory_shares.then_some(true),
            taints: (!healthy).then(|| vec![unhealthy_taint(driver)]),
            ..Device::default()
        });
    }
    pool.devices.extend(partitions);
    pool
}

/// A whole GPU's memory as consumable capacity: by default a claim takes
/// all of it (so claims that ask for nothing get the GPU to themselves), and
/// one may ask for any amount from 1 GiB up to the whole.
fn share_policy(memory: &Quantity) -> CapacityRequestPolicy {
    CapacityRequestPolicy {
        default: Some(memory.clone()),
        valid_range: Some(CapacityRequestPolicyRange {
            min: Quantity(SMALLEST_SHARE.to_string()),
            max: Some(memory.clone()),
            step: None,
        }),
        valid_values: None,
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
        if let Some(attribute) = string_attribute(value) {
            attributes.insert(key.to_string(), attribute);
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

/// One slice's devices or counter sets.
type SliceContents = (Option<Vec<Device>>, Option<Vec<CounterSet>>);

/// The slices publishing `pool` as generation `generation`: its devices 64
/// to a slice, then its counter sets 8 to a slice (a slice holds devices or
/// counter sets, never both). Always at least one slice, so an empty node
/// still says it has nothing.
pub(crate) fn node_slices(
    owner: &SliceOwner,
    pool: &PoolContents,
    generation: i64,
) -> Vec<ResourceSlice> {
    let mut specs: Vec<SliceContents> = pool
        .devices
        .chunks(DEVICES_PER_SLICE)
        .map(|chunk| (Some(chunk.to_vec()), None))
        .collect();
    specs.extend(
        pool.counter_sets
            .chunks(COUNTER_SETS_PER_SLICE)
            .map(|chunk| (None, Some(chunk.to_vec()))),
    );
    if specs.is_empty() {
        specs.push((Some(Vec::new()), None));
    }
    let count = i64::try_from(specs.len()).unwrap_or(i64::MAX);
    specs
        .into_iter()
        .enumerate()
        .map(|(i, (devices, shared_counters))| ResourceSlice {
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
                devices,
                shared_counters,
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
    use super::super::slice_fields::MAX_STRING_ATTRIBUTE;
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

    const WHOLE: PoolOptions = PoolOptions {
        taints: true,
        memory_shares: false,
    };

    /// The devices of the pool, whole GPUs first.
    fn offered(snap: &Snapshot, driver: &str, options: PoolOptions) -> Vec<Device> {
        pool_devices(snap, driver, options).devices
    }

    /// A GPU in MIG mode split into a 3g.40gb and a 2g.20gb partition.
    fn split_gpu() -> tessera_core::api::MigState {
        let partition =
            |id: &str, profile: &str, start, size, sms| tessera_core::api::GpuPartition {
                id: id.into(),
                profile: profile.into(),
                memory_total_bytes: (u64::from(size) * 10) << 30,
                multiprocessors: sms,
                placement_start: start,
                placement_size: size,
            };
        tessera_core::api::MigState {
            partitions: vec![
                partition("MIG-a", "3g.40gb", 0, 4, 60),
                partition("MIG-b", "2g.20gb", 4, 2, 32),
            ],
            ..crate::backend::test_mig(true, None)
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
        let devices = offered(&snap, "gpu.tessera.dev", WHOLE);
        assert_eq!(devices.len(), 2);
        let first = &devices[0];
        assert_eq!(
            first.name,
            pool_device_names(&snap)[&snap.devices[0].info.id]
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
        let devices = offered(&snap, "d", WHOLE);
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
        use tessera_core::api::MigState;
        let mut snap = read("3xH100-80GiB");
        snap.devices[0].info.mig = Some(split_gpu());
        snap.devices[1].info.mig = Some(MigState {
            pending: Some(false),
            ..split_gpu()
        });
        snap.devices[2].info.mig = Some(test_mig(false, None));
        let pool = pool_devices(&snap, "gpu.tessera.dev", WHOLE);
        let names = pool_device_names(&snap);
        let whole: Vec<&Device> = pool
            .devices
            .iter()
            .filter(|d| d.consumes_counters.is_none())
            .collect();
        assert_eq!(whole.len(), 1, "only the GPU with MIG off");
        assert_eq!(whole[0].name, names[&snap.devices[2].info.id]);
        // The GPU in MIG mode is its partitions, the one waiting for a
        // mode change is nothing.
        let partitions = &snap.devices[0].info.mig.as_ref().unwrap().partitions;
        assert_eq!(pool.devices.len(), 1 + partitions.len());
        assert_eq!(pool.counter_sets.len(), 1);
    }

    #[test]
    fn an_unhealthy_device_is_tainted_or_left_out() {
        let mut snap = read("2xMI300X-192GiB");
        snap.devices[1].health = RawHealth::Unhealthy("XID 79".into());
        let tainted = offered(&snap, "gpu.tessera.dev", WHOLE);
        assert_eq!(tainted.len(), 2);
        let taint = &tainted[1].taints.as_ref().unwrap()[0];
        assert_eq!(taint.key, "gpu.tessera.dev/unhealthy");
        assert_eq!(taint.effect, "NoSchedule");
        let left_out = offered(
            &snap,
            "gpu.tessera.dev",
            PoolOptions {
                taints: false,
                ..WHOLE
            },
        );
        assert_eq!(left_out.len(), 1);
        assert_eq!(left_out[0].name, tainted[0].name);
    }

    #[test]
    fn long_strings_are_cut_to_what_the_api_server_takes() {
        let mut snap = read("1xH100-80GiB");
        snap.devices[0].info.product = "é".repeat(40);
        snap.devices[0].info.pci_bus_id = "0000:1A:00.0".into();
        let devices = offered(&snap, "d", WHOLE);
        let product = string_attribute(&devices[0], "product").unwrap();
        assert!(product.len() <= MAX_STRING_ATTRIBUTE && product.starts_with('é'));
        assert_eq!(
            string_attribute(&devices[0], PCI_BUS_ID),
            Some("0000:1a:00.0")
        );
    }

    #[test]
    fn slices_hold_the_pool_owned_by_the_node() {
        let pool = pool_devices(&read("3xH100-80GiB"), "gpu.tessera.dev", WHOLE);
        let slices = node_slices(&owner(), &pool, 4);
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

        let empty = node_slices(&owner(), &PoolContents::default(), 5);
        assert_eq!(empty.len(), 1);
        assert_eq!(empty[0].spec.devices.as_ref().unwrap().len(), 0);
    }

    #[test]
    fn many_devices_spread_over_slices_that_count_each_other() {
        let pool = PoolContents {
            devices: (0..130)
                .map(|i| Device {
                    name: format!("d{i}"),
                    ..Device::default()
                })
                .collect(),
            counter_sets: (0..9)
                .map(|i| CounterSet {
                    name: format!("gpu-{i}"),
                    counters: BTreeMap::new(),
                })
                .collect(),
        };
        let slices = node_slices(&owner(), &pool, 1);
        assert_eq!(slices.len(), 5);
        assert!(slices.iter().all(|s| s.spec.pool.resource_slice_count == 5));
        assert_eq!(slices[2].spec.devices.as_ref().unwrap().len(), 2);
        // Counter sets in slices of their own, eight at most.
        assert!(slices[3].spec.devices.is_none());
        assert_eq!(slices[3].spec.shared_counters.as_ref().unwrap().len(), 8);
        assert_eq!(slices[4].spec.shared_counters.as_ref().unwrap().len(), 1);
        let devices = pool;
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

    #[test]
    fn memory_shares_make_whole_gpus_shareable_by_capacity_defaulting_to_all() {
        let snap = read("1xH100-80GiB");
        let shared = offered(
            &snap,
            "d",
            PoolOptions {
                memory_shares: true,
                ..WHOLE
            },
        );
        assert_eq!(shared[0].allow_multiple_allocations, Some(true));
        let memory = &shared[0].capacity.as_ref().unwrap()[MEMORY_CAPACITY];
        let policy = memory.request_policy.as_ref().unwrap();
        assert_eq!(policy.default.as_ref(), Some(&memory.value));
        let range = policy.valid_range.as_ref().unwrap();
        assert_eq!(range.min.0, "1Gi");
        assert_eq!(range.max.as_ref(), Some(&memory.value));
        let whole = offered(&snap, "d", WHOLE);
        assert_eq!(whole[0].allow_multiple_allocations, None);
        assert!(
            whole[0].capacity.as_ref().unwrap()[MEMORY_CAPACITY]
                .request_policy
                .is_none()
        );
    }

    #[test]
    fn partitions_consume_their_slices_and_multiprocessors_of_their_gpus_counter_set() {
        let mut snap = read("1xH100-80GiB");
        let mig = split_gpu();
        snap.devices[0].info.mig = Some(mig.clone());
        let pool = pool_devices(&snap, "gpu.tessera.dev", WHOLE);
        let names = pool_device_names(&snap);
        let set = &pool.counter_sets[0];
        assert_eq!(set.name, names[&snap.devices[0].info.id]);
        assert_eq!(set.counters.len() as u32, mig.memory_slices + 1);
        assert_eq!(
            set.counters["multiprocessors"].value.0,
            mig.multiprocessors.to_string()
        );
        for (device, partition) in pool.devices.iter().zip(&mig.partitions) {
            assert_eq!(device.name, names[&partition.id]);
            assert_eq!(
                string_attribute(device, DRA_ID_ATTRIBUTE),
                Some(partition.id.as_str())
            );
            assert_eq!(
                string_attribute(device, "profile"),
                Some(partition.profile.as_str())
            );
            assert_eq!(
                string_attribute(device, "parent"),
                Some(snap.devices[0].info.id.as_str())
            );
            let consumed = &device.consumes_counters.as_ref().unwrap()[0];
            assert_eq!(consumed.counter_set, set.name);
            let slices: Vec<&String> = consumed
                .counters
                .keys()
                .filter(|k| k.starts_with("memory-slice-"))
                .collect();
            assert_eq!(slices.len() as u32, partition.placement_size);
            assert!(
                consumed
                    .counters
                    .contains_key(&format!("memory-slice-{}", partition.placement_start))
            );
            assert_eq!(
                device.capacity.as_ref().unwrap()[MEMORY_CAPACITY].value.0,
                partition.memory_total_bytes.to_string()
            );
        }
        let slices = node_slices(&owner(), &pool, 1);
        assert_eq!(slices.len(), 2, "devices, then the counter set");
        assert_eq!(
            slices[1].spec.shared_counters.as_ref().unwrap()[0].name,
            set.name
        );
    }
}
