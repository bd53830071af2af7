//! The names a node's devices go by in its ResourceSlices and in claims'
//! allocations. A name must be a DNS label (at most 63 characters of `a-z`,
//! `0-9` and `-`, alphanumeric at both ends) and must stay the same for the
//! same device across agent restarts — an allocation written before a restart
//! names it — so it is made from the device ID, not from its position.

use std::collections::{BTreeMap, BTreeSet};
use std::hash::Hasher;

/// The names of every device a node's pool may list: its GPUs and the MIG
/// partitions they have (whether offered now or not, so a name does not
/// change with a mode).
pub(crate) fn pool_device_names(snapshot: &crate::backend::Snapshot) -> BTreeMap<String, String> {
    let gpus = snapshot.devices.iter().map(|state| state.info.id.as_str());
    let partitions = snapshot
        .devices
        .iter()
        .filter_map(|state| state.info.mig.as_ref())
        .flat_map(|mig| mig.partitions.iter().map(|partition| partition.id.as_str()));
    device_names(gpus.chain(partitions))
}

/// The longest DNS label.
const MAX_LABEL: usize = 63;

/// The DNS-label name of each device ID: the ID lowercased, every other
/// character a `-`; an ID that loses information that way (truncated, or
/// two IDs meeting on one name, or nothing left) gets a hash of the ID as
/// suffix, so names never collide.
pub fn device_names<'a>(ids: impl IntoIterator<Item = &'a str>) -> BTreeMap<String, String> {
    let ids: BTreeSet<&str> = ids.into_iter().collect();
    let mut by_plain: BTreeMap<String, Vec<&str>> = BTreeMap::new();
    for id in &ids {
        by_plain.entry(plain_label(id)).or_default().push(id);
    }
    let mut names = BTreeMap::new();
    for (plain, owners) in by_plain {
        for id in owners.iter().copied() {
            let exact = owners.len() == 1 && !plain.is_empty() && plain.len() <= MAX_LABEL;
            let name = if exact {
                plain.clone()
            } else {
                hashed_label(&plain, id)
            };
            names.insert(id.to_string(), name);
        }
    }
    names
}

/// `GPU-8A3F…` → `gpu-8a3f…`; may be empty or too long.
fn plain_label(id: &str) -> String {
    let mapped: String = id
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() {
                c.to_ascii_lowercase()
            } else {
                '-'
            }
        })
        .collect();
    mapped.trim_matches('-').to_string()
}

/// The plain label cut to leave room for `-` and 16 hex digits of the ID's hash.
fn hashed_label(plain: &str, id: &str) -> String {
    let suffix = hash_hex(id);
    let room = MAX_LABEL - suffix.len() - 1;
    let head = plain[..plain.len().min(room)].trim_end_matches('-');
    if head.is_empty() {
        format!("gpu-{suffix}")
    } else {
        format!("{head}-{suffix}")
    }
}

/// 16 hex digits of a stable hash of `text` (FNV-1a: the same on every
/// build and machine, unlike the standard library's hasher).
pub(crate) fn hash_hex(text: &str) -> String {
    let mut hasher = fnv::FnvHasher::default();
    hasher.write(text.as_bytes());
    format!("{:016x}", hasher.finish())
}

/// Whether `name` is a DNS label.
#[cfg(test)]
pub(crate) fn is_dns_label(name: &str) -> bool {
    let bytes = name.as_bytes();
    !bytes.is_empty()
        && bytes.len() <= MAX_LABEL
        && bytes
            .iter()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || *b == b'-')
        && bytes.first().is_some_and(u8::is_ascii_alphanumeric)
        && bytes.last().is_some_and(u8::is_ascii_alphanumeric)
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    #[test]
    fn a_vendor_uuid_becomes_its_lowercase_self() {
        let names = device_names([
            "GPU-8a3f0c2e-1b2c-4d5e-9f00-0123456789ab",
            "fake-h100-80gib-0",
        ]);
        assert_eq!(
            names["GPU-8a3f0c2e-1b2c-4d5e-9f00-0123456789ab"],
            "gpu-8a3f0c2e-1b2c-4d5e-9f00-0123456789ab"
        );
        assert_eq!(names["fake-h100-80gib-0"], "fake-h100-80gib-0");
    }

    #[test]
    fn ids_that_meet_on_one_label_or_lose_characters_get_distinct_hashed_names() {
        let long = "x".repeat(80);
        let names = device_names(["GPU_1", "gpu.1", "---", long.as_str(), "0x1A2b"]);
        assert_ne!(names["GPU_1"], names["gpu.1"]);
        assert!(names["GPU_1"].starts_with("gpu-1-"), "{}", names["GPU_1"]);
        assert!(names["---"].starts_with("gpu-"), "{}", names["---"]);
        assert_eq!(names[&long].len(), MAX_LABEL);
        assert_eq!(names["0x1A2b"], "0x1a2b");
        for name in names.values() {
            assert!(is_dns_label(name), "{name}");
        }
    }

    #[test]
    fn the_same_id_gets_the_same_name_whatever_else_is_on_the_node() {
        let alone = device_names(["GPU_1", "a"]);
        let with_more = device_names(["GPU_1", "gpu.1", "b"]);
        assert_eq!(alone["GPU_1"], "gpu-1");
        // Only a newcomer that collides changes a name; the agent's prepared
        // claims keep the device ID beside the name, so they still resolve.
        assert_ne!(with_more["GPU_1"], "gpu-1");
        assert_eq!(
            device_names(["GPU_1", "gpu.1"]),
            device_names(["gpu.1", "GPU_1"])
        );
    }

    proptest! {
        #[test]
        fn every_name_is_a_distinct_dns_label(ids in prop::collection::btree_set(".{0,90}", 0..12)) {
            let names = device_names(ids.iter().map(String::as_str));
            prop_assert_eq!(names.len(), ids.len());
            let distinct: BTreeSet<&String> = names.values().collect();
            prop_assert_eq!(distinct.len(), ids.len());
            for name in names.values() {
                prop_assert!(is_dns_label(name), "{}", name);
            }
        }
    }
}
