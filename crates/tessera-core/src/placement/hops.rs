//! How far apart two stages are, as the cost the network part of the score
//! and the spread strategy read.

/// Hop costs by where the next stage is. Inside a node any path is cheap for the
/// few kilobytes one token's activations take; across nodes the network decides.
pub(crate) const HOP_SAME_NODE: f64 = 0.05;
pub(crate) const HOP_SAME_RACK: f64 = 0.4;
pub(crate) const HOP_SAME_ZONE: f64 = 0.7;
pub(crate) const HOP_CROSS_ZONE: f64 = 1.0;
