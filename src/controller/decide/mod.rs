//! The decide stage: keep the current plan while it holds, re-plan only the
//! shards that lost their devices, and plan from scratch when the spec changed
//! or a partial repair cannot be found. Pure: the solver gets an injected
//! deadline and everything else comes in as values.

use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::Toleration;
use k8s_openapi::jiff::Timestamp;

use super::hashes::{placement_hash, problem_hash};
use super::held::Held;
use super::nodes::NodeInfo;
use super::settings::Settings;
use crate::process::wall_deadline::WallDeadline;
use tessera_core::api::{
    GpuDevice, GpuPartition, Health, ModelInstanceSpec, PlannedShard, ServingCorrection, Vendor,
};
use tessera_core::placement::{Deadline, Problem, SolveOptions, Stages, Unsatisfiable, solve};
use tessera_core::sizing::solve_parallelism;
use tessera_core::translate::{build_problem, evaluate_placed, planned_shards, tensor_choice};

mod corrections;
mod demand;
pub(crate) mod measured_demand;
mod replicas;
pub(crate) mod stage;
pub(crate) use demand::{Counted, decide_count};
pub use replicas::{ReplicaDecision, Replicas, decide_replicas};

/// Everything the plan stage reads besides the instance.
pub struct PlanInputs<'a> {
    pub(crate) nodes: &'a [Arc<NodeInfo>],
    pub(crate) held: &'a Held,
    pub(crate) now: Timestamp,
    /// How long a NotReady node keeps its shards before they count as lost.
    pub(crate) node_grace: Duration,
    pub(crate) max_steps: u64,
    /// The inputs and answer of this replica's last unsatisfiable attempt:
    /// the same problem is not solved twice.
    pub(crate) known_unsatisfiable: Option<&'a (u64, Unsatisfiable)>,
    /// The replica being planned; `held` includes the other replicas' devices.
    pub(crate) replica: u32,
    /// Nodes of the instance's other replicas, one entry per shard (what
    /// `placement.strategy: spread` keeps away from).
    pub(crate) replica_nodes: &'a [String],
    /// What the instance's predictions were measured off by
    /// (`status.corrections`), applied to every plan judged.
    pub(crate) corrections: &'a [ServingCorrection],
}

impl<'a> PlanInputs<'a> {
    /// Inputs with the grace period and step budget of `settings`.
    pub fn new(
        nodes: &'a [Arc<NodeInfo>],
        held: &'a Held,
        now: Timestamp,
        settings: &Settings,
    ) -> Self {
        Self {
            nodes,
            held,
            now,
            node_grace: settings.node_grace,
            max_steps: settings.max_steps,
            known_unsatisfiable: None,
            replica: 0,
            replica_nodes: &[],
            corrections: &[],
        }
    }
}

/// The instance's current plan as its status records it.
pub struct Current<'a> {
    pub(crate) plan: &'a [PlannedShard],
    pub(crate) placement_hash: Option<&'a str>,
    /// Shards whose pod failed admission: re-planned away from their devices.
    pub(crate) failed_admission: &'a [u32],
}

impl Current<'_> {
    /// An instance that has no plan yet.
    pub const NONE: Current<'static> = Current {
        plan: &[],
        placement_hash: None,
        failed_admission: &[],
    };
}

#[derive(Clone, Debug, PartialEq)]
pub enum PlanDecision {
    /// The current plan still holds.
    Keep,
    Planned(NewPlan),
    /// No plan (or no repair) exists. `inputs` identifies what was tried, so
    /// the same cluster is not solved again.
    Unsatisfiable {
        explanation: Unsatisfiable,
        /// Why a plan was needed (empty for a first plan).
        reasons: Vec<String>,
        inputs: u64,
        /// Same inputs as `known_unsatisfiable`: nothing new to report.
        repeated: bool,
    },
}

#[derive(Clone, Debug, PartialEq)]
pub struct NewPlan {
    pub plan: Vec<PlannedShard>,
    pub tokens_per_second: Option<f64>,
    /// Shards that moved (all of them for a whole new plan).
    pub moved: Vec<u32>,
    /// True when every shard was planned anew.
    pub whole: bool,
    /// Why (empty for a first plan).
    pub reasons: Vec<String>,
    /// How `parallelism.tensor: auto` chose, when it did.
    pub parallelism: Option<String>,
    /// FP8 or FP4 weights on GPUs without that rate: the format they run in
    /// there (the plan's `performance.widened`).
    pub widened: Vec<String>,
}

/// Why each shard of `plan` can no longer stay where it is, by shard.
pub(crate) fn broken_shards(
    plan: &[PlannedShard],
    failed_admission: &[u32],
    inputs: &PlanInputs,
) -> BTreeMap<u32, String> {
    let nodes: BTreeMap<&str, &NodeInfo> = inputs
        .nodes
        .iter()
        .map(|n| (n.name(), n.as_ref()))
        .collect();
    let mut broken = BTreeMap::new();
    for shard in plan {
        let Some(node) = nodes.get(shard.node.as_str()) else {
            broken.insert(
                shard.shard,
                format!(
                    "node {} is gone or no longer publishes GPU state",
                    shard.node
                ),
            );
            continue;
        };
        if node.lost(inputs.now, inputs.node_grace) {
            broken.insert(
                shard.shard,
                format!(
                    "node {} has been NotReady for more than {}s",
                    shard.node,
                    inputs.node_grace.as_secs()
                ),
            );
            continue;
        }
        if failed_admission.contains(&shard.shard) {
            broken.insert(
                shard.shard,
                format!("the shard pod failed admission on node {}", shard.node),
            );
            continue;
        }
        for id in &shard.devices {
            let found = node.gpus.gpu_state.find_device(id);
            let why = match found {
                None => Some(format!("device {id} is no longer on node {}", shard.node)),
                Some((device, _))
                    if device.health != Health::Healthy || device.vendor == Vendor::Unknown =>
                {
                    Some(format!(
                        "device {id} on node {} is unhealthy{}",
                        shard.node,
                        device
                            .health_reason
                            .as_deref()
                            .map(|r| format!(" ({r})"))
                            .unwrap_or_default()
                    ))
                }
                Some((gpu, partition)) if unusable(gpu, partition).is_some() => {
                    unusable(gpu, partition)
                        .map(|why| format!("device {id} on node {} {why}", shard.node))
                }
                Some(_) => inputs
                    .held
                    .get(&(shard.node.clone(), id.clone()))
                    .map(|who| format!("device {id} on node {} is held by {who}", shard.node)),
            };
            if let Some(why) = why {
                broken.insert(shard.shard, why);
                break;
            }
        }
    }
    broken
}

/// Why a planned device can no longer be used as planned though it is
/// there and healthy: a whole GPU put into MIG mode (or about to change
/// mode), a partition whose GPU is changing mode.
fn unusable(gpu: &GpuDevice, partition: Option<&GpuPartition>) -> Option<String> {
    let mig = gpu.mig.as_ref()?;
    match partition {
        None => mig
            .why_not_whole()
            .map(|why| format!("is no longer a whole GPU ({why})")),
        Some(partition) if !mig.usable_partitions().contains(partition) => Some(format!(
            "is a partition its GPU no longer offers ({})",
            mig.why_not_whole().unwrap_or_else(|| "MIG mode off".into())
        )),
        Some(_) => None,
    }
}

/// The plan stage.
pub fn decide(
    spec: &ModelInstanceSpec,
    tolerations: &[Toleration],
    current: &Current,
    inputs: &PlanInputs,
) -> PlanDecision {
    let hash = placement_hash(spec);
    if current.plan.is_empty() {
        return whole(spec, tolerations, inputs, &HashSet::new(), Vec::new());
    }
    if current.placement_hash != Some(hash.as_str()) {
        return whole(
            spec,
            tolerations,
            inputs,
            &HashSet::new(),
            vec!["the model, parallelism or placement of the spec changed".to_string()],
        );
    }
    let broken = broken_shards(current.plan, current.failed_admission, inputs);
    if broken.is_empty() {
        return PlanDecision::Keep;
    }
    let reasons: Vec<String> = broken
        .iter()
        .map(|(shard, why)| format!("shard {shard}: {why}"))
        .collect();
    // Devices of shards that failed admission are avoided for this attempt.
    let avoid: HashSet<(String, String)> = current
        .plan
        .iter()
        .filter(|s| current.failed_admission.contains(&s.shard))
        .flat_map(|s| s.devices.iter().map(|d| (s.node.clone(), d.clone())))
        .collect();
    match repair(spec, tolerations, current.plan, &broken, &avoid, inputs) {
        Some(new) => PlanDecision::Planned(NewPlan { reasons, ..new }),
        None => whole(spec, tolerations, inputs, &avoid, reasons),
    }
}

/// Nodes that can take new shards, and why the others cannot.
fn eligible<'a>(
    inputs: &'a PlanInputs,
    tolerations: &[Toleration],
) -> (Vec<&'a tessera_core::translate::ClusterNode>, Vec<String>) {
    let mut ok = Vec::new();
    let mut excluded = Vec::new();
    for node in inputs.nodes {
        match node.accepts(tolerations) {
            Ok(()) => ok.push(&node.gpus),
            Err(why) => excluded.push(why),
        }
    }
    (ok, excluded)
}

fn problem_for(
    spec: &ModelInstanceSpec,
    tolerations: &[Toleration],
    inputs: &PlanInputs,
    extra_held: impl IntoIterator<Item = (String, String)>,
) -> (Problem, Vec<String>) {
    let (nodes, excluded) = eligible(inputs, tolerations);
    let mut held = inputs.held.clone();
    for key in extra_held {
        held.devices
            .entry(key)
            .or_insert_with(|| "this instance".to_string());
    }
    let mut problem = build_problem(spec, nodes, &held.devices, &held.shares);
    problem.replica_nodes = inputs.replica_nodes.to_vec();
    problem.served = problem
        .served
        .map(|served| served.corrected(inputs.corrections));
    (problem, excluded)
}

pub(crate) fn options(deadline: &WallDeadline, max_steps: u64) -> SolveOptions<'_> {
    SolveOptions {
        deadline: Some(deadline as &dyn Deadline),
        max_steps,
    }
}

pub(crate) fn deadline(spec: &ModelInstanceSpec) -> WallDeadline {
    WallDeadline::after(Duration::from_millis(u64::from(spec.placement.deadline_ms)))
}

fn whole(
    spec: &ModelInstanceSpec,
    tolerations: &[Toleration],
    inputs: &PlanInputs,
    avoid: &HashSet<(String, String)>,
    reasons: Vec<String>,
) -> PlanDecision {
    let (problem, excluded) = problem_for(spec, tolerations, inputs, avoid.iter().cloned());
    // Hashing a large cluster costs about as much as solving it: only done
    // when there is a failed attempt to compare with, or a new one to record.
    let hash = || problem_hash(&(&problem.canonical(), &excluded));
    if let Some((known, explanation)) = inputs.known_unsatisfiable
        && *known == hash()
    {
        return PlanDecision::Unsatisfiable {
            explanation: explanation.clone(),
            reasons,
            inputs: *known,
            repeated: true,
        };
    }
    let limit = deadline(spec);
    match solve_parallelism(
        &problem,
        tensor_choice(spec),
        &options(&limit, inputs.max_steps),
    ) {
        Ok(chosen) => PlanDecision::Planned(NewPlan {
            moved: (0..chosen.plan.stages.len() as u32).collect(),
            tokens_per_second: Some(chosen.plan.performance.tokens_per_second),
            plan: planned_shards(&chosen.plan, inputs.replica),
            whole: true,
            reasons,
            // The ParallelismChosen event is for `tensor: auto`; a fixed
            // size whose GPU kinds were compared says so in `tessera place`.
            parallelism: chosen.parallelism_note().filter(|_| chosen.auto),
            widened: chosen.plan.performance.widened.clone(),
        }),
        Err(mut explanation) => {
            let inputs = hash();
            explanation.details.extend(excluded);
            PlanDecision::Unsatisfiable {
                explanation,
                reasons,
                inputs,
                repeated: false,
            }
        }
    }
}

/// Moves only the broken shards, each keeping its layer range: the sub-problem
/// for a shard is a one-stage model of its layers, with every device the rest
/// of the instance keeps counted as taken. `None` when a shard finds no room.
fn repair(
    spec: &ModelInstanceSpec,
    tolerations: &[Toleration],
    plan: &[PlannedShard],
    broken: &BTreeMap<u32, String>,
    avoid: &HashSet<(String, String)>,
    inputs: &PlanInputs,
) -> Option<NewPlan> {
    let mut new_plan = plan.to_vec();
    let mut moved = Vec::new();
    for &shard in broken.keys() {
        let index = new_plan.iter().position(|s| s.shard == shard)?;
        let taken: Vec<(String, String)> = new_plan
            .iter()
            .enumerate()
            .filter(|(i, _)| *i != index)
            .flat_map(|(_, s)| s.devices.iter().map(|d| (s.node.clone(), d.clone())))
            .chain(avoid.iter().cloned())
            .collect();
        let (mut problem, _) = problem_for(spec, tolerations, inputs, taken);
        let old = &new_plan[index];
        problem.model.layers = old.layer_end - old.layer_start;
        problem.stages = Stages::Fixed(1);
        // The rest of the pipeline keeps its tensor size, whether fixed or chosen.
        problem.tensor = old.devices.len() as u32;
        let limit = deadline(spec);
        let found = solve(&problem, &options(&limit, inputs.max_steps)).ok()?;
        let stage = planned_shards(&found, inputs.replica).into_iter().next()?;
        new_plan[index] = PlannedShard {
            shard,
            copy: old.copy,
            layer_start: old.layer_start,
            layer_end: old.layer_end,
            ..stage
        };
        moved.push(shard);
    }
    // The prediction for the repaired pipeline, with this instance's devices free.
    let (problem, _) = problem_for(spec, tolerations, inputs, std::iter::empty());
    let shards: Vec<&PlannedShard> = new_plan.iter().collect();
    let evaluated = evaluate_placed(problem, &shards).ok();
    Some(NewPlan {
        plan: new_plan,
        tokens_per_second: evaluated.as_ref().map(|p| p.performance.tokens_per_second),
        moved,
        whole: false,
        reasons: Vec::new(),
        parallelism: None,
        widened: evaluated.map(|p| p.performance.widened).unwrap_or_default(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::controller::testkit::*;

    fn plan_of(d: &PlanDecision) -> &NewPlan {
        match d {
            PlanDecision::Planned(p) => p,
            other => panic!("expected a plan, got {other:?}"),
        }
    }

    fn first(spec: &ModelInstanceSpec, nodes: &[Arc<NodeInfo>], held: &Held) -> NewPlan {
        let current = Current::NONE;
        plan_of(&decide(spec, &[], &current, &inputs(nodes, held))).clone()
    }

    fn two_stage() -> ModelInstanceSpec {
        instance("m", &format!("{SMALL}\nparallelism: {{pipeline: 2}}")).spec
    }

    #[test]
    fn healthy_path_plans_every_shard_with_a_prediction() {
        let nodes = infos(&[node("a", 2, H100), node("b", 2, H100)]);
        let p = first(&instance("m", SMALL).spec, &nodes, &Held::new());
        assert!(p.whole);
        assert!(p.reasons.is_empty());
        assert_eq!(p.plan.len(), 1);
        assert_eq!((p.plan[0].layer_start, p.plan[0].layer_end), (0, 32));
        assert_eq!(p.moved, vec![0]);
        assert!(p.tokens_per_second.unwrap() > 0.0);
    }

    /// What becomes the `PrecisionWidened` event: FP8 weights on a GPU whose
    /// node state gives no FP8 rate.
    #[test]
    fn fp8_weights_on_a_gpu_without_an_fp8_rate_are_said_to_be_widened() {
        let fp8 = instance(
            "m",
            "model: {name: small, parametersBillions: 7, layers: 32, kvCacheGiB: 2, dtype: fp8}",
        )
        .spec;
        let without = infos(&[node("a", 1, H100)]);
        assert_eq!(
            first(&fp8, &without, &Held::new()).widened,
            [
                "FP8 weights run at the FP16 rate on NVIDIA H100 80GB HBM3: it has no FP8 tensor rate"
            ]
        );
        let mut with_rate = state("a", 1, H100);
        with_rate.devices[0].fp8_tflops = Some(1979.0);
        let with = infos(&[node_with("a", &with_rate)]);
        assert!(first(&fp8, &with, &Held::new()).widened.is_empty());
    }

    /// What becomes the `ParallelismChosen` event: the goal and every size's
    /// speed, by default per GPU.
    #[test]
    fn tensor_auto_explains_what_it_chose_for() {
        let nodes = infos(&[node("a", 4, H100)]);
        let auto = first(
            &instance("m", &format!("{SMALL}\nparallelism: {{tensor: auto}}")).spec,
            &nodes,
            &Held::new(),
        );
        let note = auto.parallelism.expect("auto explains its choice");
        assert!(
            note.starts_with(
                "tensor auto (throughput: the most requests/s at the target per GPU) chose 1 GPU(s)"
            ),
            "{note}"
        );
        assert!(note.contains("per GPU)"), "{note}");
        let fastest = first(
            &instance(
                "m",
                &format!("{SMALL}\nparallelism: {{tensor: auto, optimize: latency}}"),
            )
            .spec,
            &nodes,
            &Held::new(),
        );
        let note = fastest.parallelism.expect("auto explains its choice");
        assert!(
            note.starts_with("tensor auto (latency: the most tokens/s) chose 4 GPU(s)"),
            "{note}"
        );
        let unreachable = instance(
            "m",
            &format!("{SMALL}\nparallelism: {{tensor: auto, minTokensPerSecond: 100000}}"),
        )
        .spec;
        match decide(
            &unreachable,
            &[],
            &Current::NONE,
            &inputs(&nodes, &Held::new()),
        ) {
            PlanDecision::Unsatisfiable { explanation, .. } => assert!(
                explanation.reason.contains("minTokensPerSecond 100000"),
                "{}",
                explanation.reason
            ),
            other => panic!("expected a refusal, got {other:?}"),
        }
    }

    #[test]
    fn heterogeneous_devices_get_unequal_layer_ranges() {
        // 120B in bf16 (about 224 GiB) needs the MI300X and the H100 together.
        let spec = instance(
            "big",
            "model: {name: big, parametersBillions: 120, layers: 96, kvCacheGiB: 8}\nparallelism: {pipeline: 2}",
        )
        .spec;
        let nodes = infos(&[node("h", 1, H100), node("m", 1, MI300X)]);
        let p = first(&spec, &nodes, &Held::new());
        let layers = |node: &str| {
            let s = p.plan.iter().find(|s| s.node == node).unwrap();
            s.layer_end - s.layer_start
        };
        assert_eq!(layers("h") + layers("m"), 96);
        assert!(
            layers("m") > layers("h"),
            "the larger, faster MI300X takes more layers"
        );
    }

    #[test]
    fn unsatisfiable_explains_and_is_not_solved_twice() {
        let spec = instance(
            "huge",
            "model: {name: huge, parametersBillions: 400, layers: 126}",
        )
        .spec;
        let nodes = infos(&[node("r", 2, RTX4090)]);
        let held = Held::new();
        let current = Current::NONE;
        let d = decide(&spec, &[], &current, &inputs(&nodes, &held));
        let PlanDecision::Unsatisfiable {
            explanation,
            inputs: tried,
            repeated,
            ..
        } = d
        else {
            panic!("{d:?}")
        };
        assert!(!repeated);
        assert!(explanation.reason.contains("GiB"), "{}", explanation.reason);
        let known = (tried, explanation.clone());
        let again = PlanInputs {
            known_unsatisfiable: Some(&known),
            ..inputs(&nodes, &held)
        };
        match decide(&spec, &[], &current, &again) {
            PlanDecision::Unsatisfiable { repeated, .. } => assert!(repeated),
            other => panic!("{other:?}"),
        }
        // A changed cluster is tried again.
        let bigger = infos(&[node("r", 2, RTX4090), node("m", 8, MI300X)]);
        let changed = PlanInputs {
            known_unsatisfiable: Some(&known),
            ..inputs(&bigger, &held)
        };
        assert!(matches!(
            decide(&spec, &[], &current, &changed),
            PlanDecision::Planned(_)
        ));
    }

    #[test]
    fn temperatures_are_compared_raw_and_drift_below_a_degree_is_not_solved_again() {
        let spec = instance("m", SMALL).spec;
        let at = |t: f64| {
            let mut s = state("h", 1, H100);
            s.devices[0].temperature_c = Some(t);
            infos(&[node_with("h", &s)])
        };
        let held = Held::new();
        // 84.6 °C is below the default 85 °C limit: rounding made it 85 and refused it.
        assert!(matches!(
            decide(&spec, &[], &Current::NONE, &inputs(&at(84.6), &held)),
            PlanDecision::Planned(_)
        ));
        let hot = at(85.3);
        let PlanDecision::Unsatisfiable {
            explanation,
            inputs: tried,
            ..
        } = decide(&spec, &[], &Current::NONE, &inputs(&hot, &held))
        else {
            panic!("85.3 °C is over the limit")
        };
        let known = (tried, explanation);
        let again = |nodes: &[Arc<NodeInfo>]| {
            let inputs = PlanInputs {
                known_unsatisfiable: Some(&known),
                ..inputs(nodes, &held)
            };
            decide(&spec, &[], &Current::NONE, &inputs)
        };
        assert!(
            matches!(
                again(&at(85.1)),
                PlanDecision::Unsatisfiable { repeated: true, .. }
            ),
            "still over the limit: nothing the solver sees has changed"
        );
        assert!(
            matches!(again(&at(84.9)), PlanDecision::Planned(_)),
            "under the limit again: solved again and placed"
        );
    }

    #[test]
    fn a_shard_on_a_partition_stays_and_one_on_a_gpu_turned_into_partitions_moves() {
        use tessera_core::api::{GpuPartition, MigState};
        let spec = instance(
            "m",
            &format!(
                "{SMALL}\nparallelism: {{tensor: 1, pipeline: 1}}\nplacement: {{sharing: Isolated}}"
            ),
        )
        .spec;
        let split = |gpu: &str| MigState {
            enabled: true,
            pending: None,
            memory_slices: 8,
            multiprocessors: 132,
            partitions: vec![GpuPartition {
                id: format!("MIG-{gpu}"),
                profile: "4g.40gb".into(),
                memory_total_bytes: 40 << 30,
                multiprocessors: 64,
                placement_start: 0,
                placement_size: 4,
            }],
            profiles: Vec::new(),
        };
        let mut gpus = state("a", 2, H100);
        gpus.shares.partitions = true;
        gpus.devices[0].mig = Some(split("a-g0"));
        let nodes = infos(&[node_with("a", &gpus)]);
        let held = Held::new();
        let p = first(&spec, &nodes, &held);
        assert_eq!(p.plan[0].devices, ["MIG-a-g0"], "the smallest piece");
        let hash = placement_hash(&spec);
        let current = Current {
            plan: &p.plan,
            placement_hash: Some(&hash),
            failed_admission: &[],
        };
        // Planned again, the partition is where the shard stays.
        assert!(matches!(
            decide(&spec, &[], &current, &inputs(&nodes, &held)),
            PlanDecision::Keep
        ));
        // Its GPU waiting to leave MIG mode: the partition is no longer offered.
        gpus.devices[0].mig = Some(MigState {
            pending: Some(false),
            ..split("a-g0")
        });
        let nodes = infos(&[node_with("a", &gpus)]);
        let moved = plan_of(&decide(&spec, &[], &current, &inputs(&nodes, &held))).clone();
        assert_eq!(moved.moved, vec![0]);
        assert!(
            moved
                .reasons
                .iter()
                .any(|r| r.contains("a partition its GPU no longer offers")),
            "{:?}",
            moved.reasons
        );
        assert_eq!(moved.plan[0].devices, ["a-g1"]);
        // A whole GPU switched into MIG mode moves its shard onto a partition.
        let on_whole = Current {
            plan: &moved.plan,
            placement_hash: Some(&hash),
            failed_admission: &[],
        };
        gpus.devices[0].mig = Some(split("a-g0"));
        gpus.devices[1].mig = Some(split("a-g1"));
        let nodes = infos(&[node_with("a", &gpus)]);
        let again = plan_of(&decide(&spec, &[], &on_whole, &inputs(&nodes, &held))).clone();
        assert!(
            again
                .reasons
                .iter()
                .any(|r| r.contains("no longer a whole GPU (in MIG mode")),
            "{:?}",
            again.reasons
        );
        assert!(again.plan[0].devices[0].starts_with("MIG-"));
    }

    #[test]
    fn a_failed_device_moves_only_its_shard() {
        let spec = two_stage();
        let mut states = [
            state("a", 1, H100),
            state("b", 1, H100),
            state("c", 1, H100),
        ];
        let nodes = infos(
            &states
                .iter()
                .map(|s| node_with(&s.devices[0].id[..1], s))
                .collect::<Vec<_>>(),
        );
        let held = Held::new();
        let p = first(&spec, &nodes, &held);
        let hash = placement_hash(&spec);
        let victim = p.plan[1].clone();
        let survivor = p.plan[0].clone();
        let s = states
            .iter_mut()
            .find(|s| s.devices[0].id == victim.devices[0])
            .unwrap();
        s.devices[0].health = Health::Unhealthy;
        s.devices[0].health_reason = Some("Xid 79".into());
        let nodes = infos(
            &states
                .iter()
                .map(|s| node_with(&s.devices[0].id[..1], s))
                .collect::<Vec<_>>(),
        );
        let current = Current {
            plan: &p.plan,
            placement_hash: Some(&hash),
            failed_admission: &[],
        };
        let d = decide(&spec, &[], &current, &inputs(&nodes, &held));
        let new = plan_of(&d);
        assert!(!new.whole);
        assert_eq!(new.moved, vec![1]);
        assert_eq!(
            new.plan[0], survivor,
            "the healthy shard stays exactly as it was"
        );
        assert_ne!(new.plan[1].node, victim.node);
        assert_ne!(new.plan[1].node, survivor.node);
        assert_eq!(
            (new.plan[1].layer_start, new.plan[1].layer_end),
            (victim.layer_start, victim.layer_end)
        );
        assert!(
            new.reasons[0].contains("unhealthy (Xid 79)"),
            "{:?}",
            new.reasons
        );
        assert!(new.tokens_per_second.is_some());
    }

    #[test]
    fn no_room_for_a_repair_plans_the_whole_instance_again() {
        let spec = two_stage();
        let nodes = infos(&[node("a", 1, H100), node("b", 1, H100)]);
        let held = Held::new();
        let p = first(&spec, &nodes, &held);
        let hash = placement_hash(&spec);
        // Node b disappears: one H100 is left, and a two-stage plan needs two.
        let nodes = infos(&[node("a", 1, H100)]);
        let current = Current {
            plan: &p.plan,
            placement_hash: Some(&hash),
            failed_admission: &[],
        };
        match decide(&spec, &[], &current, &inputs(&nodes, &held)) {
            PlanDecision::Unsatisfiable { reasons, .. } => {
                assert!(
                    reasons.iter().any(|r| r.contains("node b is gone")),
                    "{reasons:?}"
                )
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_spec_change_replans_everything() {
        let spec = instance("m", SMALL).spec;
        let nodes = infos(&[node("a", 2, H100)]);
        let held = Held::new();
        let p = first(&spec, &nodes, &held);
        let old_hash = placement_hash(&spec);
        let changed = two_stage();
        assert_ne!(placement_hash(&changed), old_hash);
        let current = Current {
            plan: &p.plan,
            placement_hash: Some(&old_hash),
            failed_admission: &[],
        };
        let new = plan_of(&decide(&changed, &[], &current, &inputs(&nodes, &held))).clone();
        assert!(new.whole);
        assert_eq!(new.plan.len(), 2);
        assert!(new.reasons[0].contains("spec changed"));
    }

    #[test]
    fn telemetry_drift_keeps_the_plan() {
        let spec = two_stage();
        let mut a = state("a", 2, H100);
        let nodes = infos(&[node_with("a", &a)]);
        let held = Held::new();
        let p = first(&spec, &nodes, &held);
        let hash = placement_hash(&spec);
        for d in &mut a.devices {
            d.memory_free_bytes -= 3 << 30;
            d.temperature_c = Some(71.0);
        }
        let nodes = infos(&[node_with("a", &a)]);
        let current = Current {
            plan: &p.plan,
            placement_hash: Some(&hash),
            failed_admission: &[],
        };
        assert_eq!(
            decide(&spec, &[], &current, &inputs(&nodes, &held)),
            PlanDecision::Keep
        );
        // The pod template is not part of the plan.
        let mut with_other_image = instance("m", &format!("{SMALL}\nparallelism: {{pipeline: 2}}"));
        with_other_image.spec.template = None;
        assert_eq!(placement_hash(&with_other_image.spec), hash);
    }

    #[test]
    fn devices_held_by_others_are_avoided_and_taken_plans_break() {
        let spec = instance("m", SMALL).spec;
        let nodes = infos(&[node("a", 2, H100)]);
        let mut held = Held::new();
        held.insert(("a".into(), "a-g0".into()), "ModelInstance ml/other".into());
        let p = first(&spec, &nodes, &held);
        assert_eq!(p.plan[0].devices, vec!["a-g1".to_string()]);
        // The other way round: a plan on a device someone else now holds.
        let mut taken = Held::new();
        taken.insert(("a".into(), "a-g1".into()), "pod ml/intruder".into());
        let broken = broken_shards(&p.plan, &[], &inputs(&nodes, &taken));
        assert!(broken[&0].contains("held by pod ml/intruder"), "{broken:?}");
    }

    #[test]
    fn not_ready_nodes_keep_shards_for_the_grace_period_only() {
        use k8s_openapi::api::core::v1::NodeCondition;
        use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
        let spec = instance("m", SMALL).spec;
        let held = Held::new();
        let nodes = infos(&[node("a", 1, H100), node("b", 1, H100)]);
        let p = first(&spec, &nodes, &held);
        let hash = placement_hash(&spec);
        let planned = p.plan[0].node.clone();
        let not_ready = |since: &str| {
            let mut n = node(&planned, 1, H100);
            n.status.as_mut().unwrap().conditions = Some(vec![NodeCondition {
                type_: "Ready".into(),
                status: "Unknown".into(),
                last_transition_time: Some(Time(since.parse().unwrap())),
                ..Default::default()
            }]);
            let other = if planned == "a" { "b" } else { "a" };
            infos(&[n, node(other, 1, H100)])
        };
        let current = Current {
            plan: &p.plan,
            placement_hash: Some(&hash),
            failed_admission: &[],
        };
        let recent = not_ready("2026-06-01T11:58:00Z");
        assert_eq!(
            decide(&spec, &[], &current, &inputs(&recent, &held)),
            PlanDecision::Keep
        );
        let long = not_ready("2026-06-01T11:50:00Z");
        let d = decide(&spec, &[], &current, &inputs(&long, &held));
        let new = plan_of(&d);
        assert_ne!(new.plan[0].node, planned);
        assert!(
            new.reasons[0].contains("NotReady for more than 300s"),
            "{:?}",
            new.reasons
        );
    }

    #[test]
    fn failed_admission_moves_the_shard_off_its_devices() {
        let spec = instance("m", SMALL).spec;
        let nodes = infos(&[node("a", 2, H100)]);
        let held = Held::new();
        let p = first(&spec, &nodes, &held);
        let hash = placement_hash(&spec);
        let current = Current {
            plan: &p.plan,
            placement_hash: Some(&hash),
            failed_admission: &[0],
        };
        let new = plan_of(&decide(&spec, &[], &current, &inputs(&nodes, &held))).clone();
        assert_ne!(new.plan[0].devices, p.plan[0].devices);
        assert!(new.reasons[0].contains("failed admission"));
    }

    #[test]
    fn a_tensor_size_no_node_has_is_explained() {
        let spec = instance("m", &format!("{SMALL}\nparallelism: {{tensor: 16}}")).spec;
        let nodes = infos(&[node("a", 8, H100), node("b", 2, MI300X)]);
        let held = Held::new();
        let current = Current::NONE;
        match decide(&spec, &[], &current, &inputs(&nodes, &held)) {
            PlanDecision::Unsatisfiable { explanation, .. } => {
                assert!(explanation.reason.contains("16"), "{}", explanation.reason);
                assert!(explanation.reason.contains('8'), "{}", explanation.reason);
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn untolerated_taints_are_named_when_nothing_fits() {
        use k8s_openapi::api::core::v1::{NodeSpec, Taint};
        let spec = instance("m", SMALL).spec;
        let mut n = node("a", 1, H100);
        n.spec = Some(NodeSpec {
            taints: Some(vec![Taint {
                key: "gpu".into(),
                effect: "NoSchedule".into(),
                ..Default::default()
            }]),
            ..Default::default()
        });
        let nodes = infos(&[n]);
        let held = Held::new();
        let current = Current::NONE;
        match decide(&spec, &[], &current, &inputs(&nodes, &held)) {
            PlanDecision::Unsatisfiable { explanation, .. } => assert!(
                explanation
                    .details
                    .iter()
                    .any(|d| d.contains("taint gpu:NoSchedule")),
                "{explanation:?}"
            ),
            other => panic!("{other:?}"),
        }
        let tolerate = k8s_openapi::api::core::v1::Toleration {
            key: Some("gpu".into()),
            operator: Some("Exists".into()),
            ..Default::default()
        };
        assert!(matches!(
            decide(&spec, &[tolerate], &current, &inputs(&nodes, &held)),
            PlanDecision::Planned(_)
        ));
    }
}
