//! Which devices are not free for an instance: those in other instances'
//! plans, those named by other shard pods' device annotations, and those the
//! node agents report as handed out to pods that are not this instance's.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use k8s_openapi::api::core::v1::Pod;

use super::nodes::NodeInfo;
use tessera_core::api::{DEVICES_ANNOTATION, ModelInstance, NodeGpuState, PlannedShard, ShareKind};
use tessera_core::translate::{HeldShares, hold_shard, pod_holder};

/// What others hold: devices whole, `(node, device ID)` → who (for the
/// explanation of a refusal), and memory shares of whole GPUs.
#[derive(Clone, Debug, Default)]
pub struct Held {
    pub(crate) devices: HashMap<(String, String), String>,
    pub(crate) shares: HeldShares,
}

impl Held {
    pub fn new() -> Self {
        Self::default()
    }

    /// `holder` holds the device whole.
    pub fn insert(&mut self, device: (String, String), holder: String) {
        self.devices.insert(device, holder);
    }

    /// Who holds the device whole, if anyone.
    pub fn get(&self, device: &(String, String)) -> Option<&String> {
        self.devices.get(device)
    }

    /// `holder` holds what the planned `shard` was given: a memory share of
    /// its GPU, or its devices whole (where nobody is recorded yet).
    pub(crate) fn shard(&mut self, shard: &PlannedShard, holder: &str) {
        let mut devices = HashMap::new();
        hold_shard(shard, holder, &mut devices, &mut self.shares);
        for (device, who) in devices {
            self.devices.entry(device).or_insert(who);
        }
    }
}

/// Plans this controller decided, by instance UID, that its cache may not
/// show yet (the status write has not come back through the watch).
pub(crate) type Claims = HashMap<String, Vec<PlannedShard>>;

/// Devices held by anything but the instance with UID `me`. An instance's
/// plan is its entry in `claimed` when it has one (newer than the cached
/// status), else its cached `status.plan` and both copies of a move in
/// flight. The instance's own shard pods' allocations are its own.
pub(crate) fn held_devices<'a>(
    me: &str,
    instances: impl IntoIterator<Item = &'a ModelInstance>,
    claimed: &'a Claims,
    shard_pods: impl IntoIterator<Item = &'a Pod>,
    nodes: &[Arc<NodeInfo>],
) -> Held {
    let instances: Vec<&ModelInstance> = instances.into_iter().collect();
    // A move in flight holds both copies' devices.
    let plan_of = |mi: &'a ModelInstance| -> Vec<&'a PlannedShard> {
        match mi.metadata.uid.as_ref().and_then(|uid| claimed.get(uid)) {
            Some(plan) => plan.iter().collect(),
            None => mi.status.as_ref().map_or_else(Vec::new, |s| {
                s.plan
                    .iter()
                    .chain(s.moves.iter().flat_map(|m| m.held()))
                    .collect()
            }),
        }
    };
    // The memory shares instances plan, by (instance UID, node, GPU): a shard
    // pod names its GPU in its devices annotation, but holds only its share,
    // which the instance's plan counts.
    let planned_shares: HashSet<(&str, &str, &str)> = instances
        .iter()
        .flat_map(|mi| {
            let uid = mi.metadata.uid.as_deref().unwrap_or_default();
            plan_of(mi).into_iter().filter_map(move |shard| {
                let share = shard.share.as_ref()?;
                (share.kind == ShareKind::Memory).then_some((
                    uid,
                    shard.node.as_str(),
                    share.gpu.as_str(),
                ))
            })
        })
        .collect();
    let mut held = Held::new();
    let mut mine = HashSet::new();
    for pod in shard_pods {
        let owned_by_me = pod
            .metadata
            .owner_references
            .iter()
            .flatten()
            .any(|o| o.uid == me);
        if owned_by_me {
            if let Some(uid) = &pod.metadata.uid {
                mine.insert(uid.clone());
            }
            continue;
        }
        if finished(pod) {
            continue;
        }
        let (Some(node), Some(devices)) = (
            pod.spec.as_ref().and_then(|s| s.node_name.as_ref()),
            pod.metadata
                .annotations
                .as_ref()
                .and_then(|a| a.get(DEVICES_ANNOTATION)),
        ) else {
            continue;
        };
        let owner = format!(
            "pod {}/{}",
            pod.metadata.namespace.as_deref().unwrap_or(""),
            pod.metadata.name.as_deref().unwrap_or("")
        );
        let shared = |device: &str| {
            pod.metadata
                .owner_references
                .iter()
                .flatten()
                .any(|o| planned_shares.contains(&(o.uid.as_str(), node.as_str(), device)))
        };
        for device in devices
            .split(',')
            .map(str::trim)
            .filter(|device| !device.is_empty() && !shared(device))
        {
            held.insert((node.clone(), device.to_string()), owner.clone());
        }
    }
    let mut my_devices = HashSet::new();
    for mi in instances {
        let plan = plan_of(mi);
        if mi.metadata.uid.as_deref() == Some(me) {
            my_devices.extend(
                plan.iter()
                    .flat_map(|s| s.devices.iter().map(|d| (s.node.as_str(), d.as_str()))),
            );
            continue;
        }
        let owner = format!(
            "ModelInstance {}/{}",
            mi.metadata.namespace.as_deref().unwrap_or(""),
            mi.metadata.name.as_deref().unwrap_or("")
        );
        for shard in plan {
            hold_shard(shard, &owner, &mut held.devices, &mut held.shares);
        }
    }
    for node in nodes {
        for (device, pod_uid) in &node.gpus.gpu_state.allocated {
            // A hold the agent cannot tie to a pod, on a device of this
            // instance's own plan, is most likely this instance's shard
            // admitted before the agent saw its binding: no proof the shard
            // lost the device. Were it another pod's, the shard's admission
            // fails and the shard is re-placed then.
            let unexplained_on_mine = pod_uid == NodeGpuState::UNBOUND_OWNER
                && my_devices.contains(&(node.name(), device.as_str()));
            if !mine.contains(pod_uid) && !unexplained_on_mine {
                held.devices
                    .entry((node.name().to_string(), device.clone()))
                    .or_insert_with(|| pod_holder(node.name(), pod_uid));
            }
        }
    }
    held
}

/// A pod that has ended holds no devices any more.
pub(crate) fn finished(pod: &Pod) -> bool {
    matches!(
        pod.status.as_ref().and_then(|s| s.phase.as_deref()),
        Some("Succeeded" | "Failed")
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::controller::testkit::*;
    use k8s_openapi::api::core::v1::{PodSpec, PodStatus};
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
    use tessera_core::api::{NodeGpuState, PlannedShard};

    fn pod(name: &str, owner: &str, node: &str, devices: &str, phase: &str) -> Pod {
        Pod {
            metadata: ObjectMeta {
                name: Some(name.into()),
                namespace: Some("ml".into()),
                uid: Some(format!("pod-{name}")),
                annotations: Some([(DEVICES_ANNOTATION.to_string(), devices.to_string())].into()),
                owner_references: Some(vec![OwnerReference {
                    uid: owner.into(),
                    ..Default::default()
                }]),
                ..Default::default()
            },
            spec: Some(PodSpec {
                node_name: Some(node.into()),
                ..Default::default()
            }),
            status: Some(PodStatus {
                phase: Some(phase.into()),
                ..Default::default()
            }),
        }
    }

    #[test]
    fn everything_but_my_own_devices_is_held() {
        let mut other = instance("other", SMALL);
        other.status = Some(tessera_core::api::ModelInstanceStatus {
            plan: vec![PlannedShard {
                copy: 0,
                replica: 0,
                shard: 0,
                node: "a".into(),
                devices: vec!["a-g0".into()],
                layer_start: 0,
                layer_end: 32,
                predicted_memory_gib: 1.0,
                share: None,
            }],
            ..Default::default()
        });
        let me = instance("me", SMALL);
        let pods = [
            pod("other-shard-1", "uid-other", "a", "a-g1, a-g2", "Running"),
            pod("old", "uid-other", "a", "a-g3", "Failed"),
            pod("me-shard-0", "uid-me", "a", "a-g4", "Running"),
        ];
        let mut s: NodeGpuState = state("a", 8, H100);
        s.allocated.insert("a-g4".into(), "pod-me-shard-0".into());
        s.allocated
            .insert("a-g5".into(), NodeGpuState::UNBOUND_OWNER.into());
        let nodes = infos(&[node_with("a", &s)]);
        let held = held_devices("uid-me", [&other, &me], &Claims::new(), pods.iter(), &nodes);
        let who = |d: &str| held.get(&("a".to_string(), d.to_string())).cloned();
        assert_eq!(who("a-g0").as_deref(), Some("ModelInstance ml/other"));
        assert_eq!(who("a-g1").as_deref(), Some("pod ml/other-shard-1"));
        assert_eq!(who("a-g2").as_deref(), Some("pod ml/other-shard-1"));
        assert_eq!(who("a-g3"), None, "a finished pod holds nothing");
        assert_eq!(who("a-g4"), None, "my own shard's devices are mine");
        assert!(who("a-g5").unwrap().contains("without a planned binding"));
        assert_eq!(held.devices.len(), 4);
    }

    #[test]
    fn another_instances_memory_share_is_held_as_a_share_of_its_gpu() {
        use tessera_core::api::{ShardShare, ShareKind};
        let mut other = instance("other", SMALL);
        other.status = Some(tessera_core::api::ModelInstanceStatus {
            plan: vec![PlannedShard {
                copy: 0,
                replica: 0,
                shard: 0,
                node: "a".into(),
                devices: vec!["a-g0".into()],
                layer_start: 0,
                layer_end: 32,
                predicted_memory_gib: 24.4,
                share: Some(ShardShare {
                    kind: ShareKind::Memory,
                    gpu: "a-g0".into(),
                    profile: None,
                    memory_gib: Some(25),
                    memory_fraction: Some(0.312),
                    tenants: 0,
                    contended_tokens_per_second: None,
                }),
            }],
            ..Default::default()
        });
        let nodes = infos(&[node_with("a", &state("a", 8, H100))]);
        // Its pod names the GPU it has a share of; a pod of a gone
        // instance still holds what it names.
        let pods = [
            pod("other-shard-0", "uid-other", "a", "a-g0", "Running"),
            pod("orphan-shard-0", "uid-gone", "a", "a-g1", "Running"),
        ];
        let held = held_devices("uid-me", [&other], &Claims::new(), pods.iter(), &nodes);
        assert_eq!(
            held.devices.keys().collect::<Vec<_>>(),
            [&("a".to_string(), "a-g1".to_string())],
            "a share holds no GPU whole"
        );
        assert_eq!(
            held.shares[&("a".to_string(), "a-g0".to_string())],
            [("ModelInstance ml/other".to_string(), 25 << 30)]
        );
    }

    #[test]
    fn an_unexplained_hold_on_my_own_planned_device_is_not_taken_from_me() {
        // Kubelet admitted my shard before the agent saw its binding: the agent
        // publishes the devices as held by a pod it cannot name.
        let mut me = instance("me", SMALL);
        me.status = Some(tessera_core::api::ModelInstanceStatus {
            plan: vec![PlannedShard {
                copy: 0,
                replica: 0,
                shard: 0,
                node: "a".into(),
                devices: vec!["a-g4".into(), "a-g5".into()],
                layer_start: 0,
                layer_end: 32,
                predicted_memory_gib: 1.0,
                share: None,
            }],
            ..Default::default()
        });
        let mut s: NodeGpuState = state("a", 8, H100);
        for d in ["a-g4", "a-g5", "a-g6"] {
            s.allocated
                .insert(d.into(), NodeGpuState::UNBOUND_OWNER.into());
        }
        let nodes = infos(&[node_with("a", &s)]);
        let none: [&Pod; 0] = [];
        let held = held_devices("uid-me", [&me], &Claims::new(), none, &nodes);
        let who = |d: &str| held.get(&("a".to_string(), d.to_string())).cloned();
        assert_eq!(who("a-g4"), None);
        assert_eq!(who("a-g5"), None);
        assert!(
            who("a-g6").is_some(),
            "outside my plan an unexplained hold still counts"
        );
        // For any other instance the same devices are taken.
        let held = held_devices("uid-other", [&me], &Claims::new(), none, &nodes);
        assert_eq!(held.devices.len(), 3);
    }

    #[test]
    fn a_move_in_flight_holds_both_copies() {
        use tessera_core::api::{ModelInstanceStatus, MoveInFlight, MovePhase};
        let mut other = instance("other", SMALL);
        other.status = Some(ModelInstanceStatus {
            plan: vec![shard("a", "a-g0")],
            moves: vec![MoveInFlight {
                replica: 0,
                phase: MovePhase::Surging,
                from: vec![shard("a", "a-g0")],
                to: vec![PlannedShard {
                    copy: 1,
                    ..shard("b", "b-g0")
                }],
                started: "2026-06-01T11:59:00Z".into(),
                reason: "to make room".into(),
                waiting: None,
            }],
            ..Default::default()
        });
        let nodes = infos(&[
            node_with("a", &state("a", 2, H100)),
            node_with("b", &state("b", 2, H100)),
        ]);
        let none: [&Pod; 0] = [];
        let held = held_devices("uid-me", [&other], &Claims::new(), none, &nodes);
        let who = |n: &str, d: &str| held.get(&(n.to_string(), d.to_string())).cloned();
        assert_eq!(who("a", "a-g0").as_deref(), Some("ModelInstance ml/other"));
        assert_eq!(who("b", "b-g0").as_deref(), Some("ModelInstance ml/other"));
        assert_eq!(held.devices.len(), 2);
    }

    fn shard(node: &str, device: &str) -> PlannedShard {
        PlannedShard {
            copy: 0,
            replica: 0,
            shard: 0,
            node: node.into(),
            devices: vec![device.into()],
            layer_start: 0,
            layer_end: 32,
            predicted_memory_gib: 1.0,
            share: None,
        }
    }

    #[test]
    fn a_claimed_plan_counts_before_the_cache_shows_it() {
        let nodes = infos(&[node_with("a", &state("a", 4, H100))]);
        // Just planned on a-g1; the cache still has no status, or the old one.
        let mut moved = instance("moved", SMALL);
        moved.status = Some(tessera_core::api::ModelInstanceStatus {
            plan: vec![shard("a", "a-g0")],
            ..Default::default()
        });
        let fresh = instance("fresh", SMALL);
        let me = instance("me", SMALL);
        let claimed = Claims::from([
            ("uid-moved".to_string(), vec![shard("a", "a-g1")]),
            ("uid-fresh".to_string(), vec![shard("a", "a-g2")]),
            ("uid-me".to_string(), vec![shard("a", "a-g3")]),
        ]);
        let none: [&Pod; 0] = [];
        let held = held_devices("uid-me", [&moved, &fresh, &me], &claimed, none, &nodes);
        let who = |d: &str| held.get(&("a".to_string(), d.to_string())).cloned();
        assert_eq!(who("a-g0"), None, "the cached plan is superseded");
        assert_eq!(who("a-g1").as_deref(), Some("ModelInstance ml/moved"));
        assert_eq!(who("a-g2").as_deref(), Some("ModelInstance ml/fresh"));
        assert_eq!(who("a-g3"), None, "my own claim is mine");
        assert_eq!(held.devices.len(), 2);
    }
}
