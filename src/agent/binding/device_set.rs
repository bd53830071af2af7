//! Device sets as the binding rules compare them: sorted, duplicate-free
//! lists of device IDs, so a request matches a plan whatever order kubelet
//! lists the devices in.

use std::cmp::Ordering;

/// `devices` sorted, without duplicates.
pub(super) fn sorted_set(devices: &[String]) -> Vec<String> {
    let mut set = devices.to_vec();
    set.sort();
    set.dedup();
    set
}

/// Whether the sorted set `set` holds `device`.
pub(super) fn contains(set: &[String], device: &str) -> bool {
    set.binary_search_by(|member| member.as_str().cmp(device))
        .is_ok()
}

/// Whether two sorted, duplicate-free lists share an element.
pub(super) fn overlaps(left: &[String], right: &[String]) -> bool {
    let (mut left_at, mut right_at) = (0, 0);
    while left_at < left.len() && right_at < right.len() {
        match left[left_at].cmp(&right[right_at]) {
            Ordering::Less => left_at += 1,
            Ordering::Greater => right_at += 1,
            Ordering::Equal => return true,
        }
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::agent::binding::test_pods::ids;

    #[test]
    fn sets_overlap_when_they_share_a_device() {
        assert!(overlaps(&ids(&["a", "c"]), &ids(&["b", "c"])));
        assert!(!overlaps(&ids(&["a", "c"]), &ids(&["b", "d"])));
        assert!(!overlaps(&[], &ids(&["a"])));
    }

    #[test]
    fn a_set_is_sorted_without_duplicates() {
        let set = sorted_set(&ids(&["b", "a", "b"]));
        assert_eq!(set, ids(&["a", "b"]));
        assert!(contains(&set, "a"));
        assert!(!contains(&set, "c"));
    }
}
