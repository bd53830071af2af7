//! A generated cluster as the controller reads it when every node hands out
//! GPU partitions and memory shares, optionally with MIG layouts: what the
//! sharing and demand benchmarks place on.
// Only those two benchmarks use it.
#![allow(dead_code)]

use tessera::api::{GpuPartition, MigState};
use tessera::placement::NodeState;
use tessera::translate::ClusterNode;

use super::objects::to_node;

const GIB: u64 = 1 << 30;

/// A GPU's MIG layout 3g + 2g + 1g + 1g by its product, with NVIDIA's
/// published figures; `None` for a GPU without MIG.
fn split(product: &str, gpu: &str) -> Option<MigState> {
    let (sms, profiles): (u32, [(&str, u64, u32); 3]) = if product.contains("H100") {
        (
            132,
            [
                ("3g.40gb", 40, 60),
                ("2g.20gb", 20, 32),
                ("1g.10gb", 10, 16),
            ],
        )
    } else if product.contains("A100") {
        (
            108,
            [("3g.20gb", 20, 42), ("2g.10gb", 10, 28), ("1g.5gb", 5, 14)],
        )
    } else {
        return None;
    };
    let layout = [(0, 4, 0), (4, 2, 1), (6, 1, 2), (7, 1, 2)];
    let partitions = layout
        .iter()
        .map(|&(start, size, profile)| {
            let (name, gib, multiprocessors) = profiles[profile];
            GpuPartition {
                id: format!("MIG-{gpu}-{start}-{name}"),
                profile: name.to_string(),
                memory_total_bytes: gib * GIB,
                multiprocessors,
                placement_start: start,
                placement_size: size,
            }
        })
        .collect();
    Some(MigState {
        enabled: true,
        pending: None,
        memory_slices: 8,
        multiprocessors: sms,
        partitions,
        profiles: Vec::new(),
    })
}

/// The generated cluster as the controller reads it, every node handing out
/// partitions and memory shares; with `mig`, a quarter of its H100 and A100
/// nodes in MIG mode.
pub(crate) fn shared_cluster(nodes: &[NodeState], mig: bool) -> Vec<ClusterNode> {
    let mut splittable = 0;
    nodes
        .iter()
        .map(|state| {
            let mut node = ClusterNode::from_node(&to_node(state))
                .expect("a valid GPU state")
                .expect("a GPU node");
            node.gpu_state.shares.partitions = true;
            node.gpu_state.shares.memory = true;
            let has_mig = node
                .gpu_state
                .devices
                .first()
                .is_some_and(|gpu| split(&gpu.product, &gpu.id).is_some());
            if mig && has_mig {
                splittable += 1;
                if splittable % 4 == 1 {
                    for gpu in &mut node.gpu_state.devices {
                        gpu.mig = split(&gpu.product, &gpu.id);
                    }
                }
            }
            node
        })
        .collect()
}
