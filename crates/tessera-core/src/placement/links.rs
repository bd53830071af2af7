//! A node's links with both ends resolved to device positions.
//!
//! Every solve reads the links of most nodes, so the lookup avoids hashing:
//! link lists usually run `0-1, 0-2, ..., 1-2, ...`, so the device after the
//! last match is tried first, and a miss falls back to a binary search over
//! the ids sorted once per node.

use super::problem::{Link, NodeState};

/// `(first, second, link)` for every link whose two ends are devices of the
/// node, in the node's link order; links naming an unknown device are left out.
pub(crate) fn link_positions(node: &NodeState) -> impl Iterator<Item = (usize, usize, &Link)> {
    let mut by_id: Vec<(&str, usize)> = node
        .devices
        .iter()
        .enumerate()
        .map(|(position, device)| (device.id.as_str(), position))
        .collect();
    by_id.sort_unstable();
    let position = move |id: &str, guess: usize| {
        if node
            .devices
            .get(guess)
            .is_some_and(|device| device.id == id)
        {
            return Some(guess);
        }
        by_id
            .binary_search_by(|(candidate, _)| (*candidate).cmp(id))
            .ok()
            .map(|found| by_id[found].1)
    };
    let mut last = (0, 0);
    node.links.iter().filter_map(move |link| {
        let first = position(&link.a, last.0)?;
        let second = position(&link.b, last.1 + 1)?;
        last = (first, second);
        Some((first, second, link))
    })
}

#[cfg(test)]
mod tests {
    use super::super::problem::Interconnect;
    use super::super::testutil::{H100, node};
    use super::*;

    #[test]
    fn ends_resolve_in_any_order_and_unknown_devices_are_left_out() {
        let mut sample = node("a", 3, H100);
        sample.links.reverse();
        sample.links.push(Link {
            a: "a-1".into(),
            b: "elsewhere".into(),
            kind: Interconnect::NvLink,
            bandwidth_gbps: 1.0,
        });
        let ends: Vec<(usize, usize)> = link_positions(&sample)
            .map(|(first, second, _)| (first, second))
            .collect();
        assert_eq!(ends, vec![(1, 2), (0, 2), (0, 1)]);
    }
}
