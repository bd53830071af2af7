//! How far apart two stages are, as the cost the network part of the score
//! and the spread strategy read.

/// Hop costs by where the next stage is. Inside a node any path is cheap for the
/// few kilobytes one token's activations take; across nodes the network decides.
pub(crate) const HOP_SAME_NODE: f64 = 0.05;
pub(crate) const HOP_SAME_RACK: f64 = 0.4;
pub(crate) const HOP_SAME_ZONE: f64 = 0.7;
pub(crate) const HOP_CROSS_ZONE: f64 = 1.0;

/// A node's zone and rack as small numbers (the same name, the same number),
/// so the search compares positions without comparing strings.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Place {
    pub zone: Option<u32>,
    pub rack: Option<u32>,
}

impl Place {
    /// The cost of a hop to a different node at `other`, by the rule
    /// `PreparedProblem::node_distance` applies to the names.
    pub(crate) fn hop_to(self, other: Place) -> f64 {
        let same_zone = self.zone.is_some() && self.zone == other.zone;
        hop_between_nodes(
            same_zone,
            same_zone && self.rack.is_some() && self.rack == other.rack,
        )
    }
}

/// The cost of a hop between two different nodes: the one rule for plans,
/// the search's leaves and spreading replicas.
pub(crate) fn hop_between_nodes(same_zone: bool, same_rack: bool) -> f64 {
    if same_zone && same_rack {
        HOP_SAME_RACK
    } else if same_zone {
        HOP_SAME_ZONE
    } else {
        HOP_CROSS_ZONE
    }
}
