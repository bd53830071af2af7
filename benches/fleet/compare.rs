//! tessera against kube-scheduler with DRA on the same simulated nodes and
//! ResourceSlices: the cluster benchmark's seeded arrivals and deletions,
//! each with its seeded demand (`support::demands`), are replayed once per
//! placer, as ModelInstances sized to the demand by tessera's controller or
//! as a careful user writes them for kube-scheduler (`demands::user_sizing`,
//! `user_pods`), then a burst
//! of 405B-class arrivals tests the room left for large models, which
//! tessera's controller makes by moving running replicas (make before
//! break; `tessera-no-moves` runs it with moves off, `tessera-continuous`
//! with continuous moves on). Every
//! replica either placer bound is judged by the same calls
//! (`translate::evaluate_placed`, then the serving model at the instance's
//! target) on the nodes as published: what it serves there, nothing where it
//! cannot meet the target; each instance then by the cluster objective
//! (`tessera::objective`): its demand met or not, the GPUs it holds.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::Path;
use std::time::Duration;

use k8s_openapi::api::core::v1::Node;
use k8s_openapi::api::resource::v1::DeviceClass;
use kube::Client;
use kube::api::{Api, DeleteParams, ListParams, PostParams};
use serde_json::json;
use tessera::api::{ModelInstance, ModelInstanceSpec, PlannedShard};
use tessera::sizing::TensorChoice;
use tessera::translate::{ClusterNode, HeldShares, build_problem, evaluate_placed};
use tokio::time::Instant;

use crate::agents::Fleet;
use crate::instance_watch::InstanceWatch;
use crate::kubelet::{Bindings, Bound};
use crate::nodes::{RUN_LABEL, TAINT_KEY};
use crate::options::Placer;
use crate::support::arrivals::{Arrival, Event, MODEL_405B, describe, sequence};
use crate::support::at_target;
use crate::support::demand_replay::DemandOutcome;
use crate::support::demands::{demands, tessera_spec, user_sizing};
use crate::support::user_claims::user_shards;
use crate::user_pods::UserPods;
use crate::workload::{self, ControllerProcess};
use tessera::objective::{InstanceStanding, TFLOP, work_per_request};

/// Large models in the burst after the sequence.
const BURST: usize = 16;
/// How long a replica may take to be bound or refused.
const SETTLE: Duration = Duration::from_secs(30);
/// A replica found unplaceable is looked at once more after this, in case
/// its placer was still working on it.
const RECHECK: Duration = Duration::from_millis(1500);
/// How long a burst arrival may wait while moves make room for it.
const ROOM: Duration = Duration::from_secs(300);
/// How long moves in flight may take to end before the cluster is judged.
const MOVES_END: Duration = Duration::from_secs(180);

/// What the runs share: the cluster, the run's namespace and the stand-in
/// kubelets' record of bound pods.
pub(crate) struct Bench<'a> {
    pub(crate) client: &'a Client,
    pub(crate) kubeconfig: &'a Path,
    pub(crate) namespace: &'a str,
    pub(crate) run: &'a str,
    pub(crate) driver: &'a str,
    pub(crate) fleet: &'a Fleet,
    pub(crate) bindings: &'a Bindings,
    pub(crate) initial_list: &'a str,
    pub(crate) events: usize,
    pub(crate) seed: u64,
    pub(crate) nodes: usize,
}

/// The placer under test. One per run, so the variants' sizes do not matter.
#[allow(clippy::large_enum_variant)]
enum Side {
    Tessera {
        api: Api<ModelInstance>,
        controller: ControllerProcess,
        watch: InstanceWatch,
        moves: bool,
    },
    Users {
        pods: UserPods,
        scheduler_pid: Option<u32>,
    },
}

impl Side {
    /// Creates one arrival's replicas and waits until each is bound or
    /// refused: per replica wanted, how long it took to be bound; and the
    /// shards a replica has where the user fixed them (tessera plans them
    /// whole). With `room`, a tessera arrival refused waits while moves
    /// make room for it.
    async fn place(
        &self,
        bench: &Bench<'_>,
        (name, spec): (&str, &ModelInstanceSpec),
        room: bool,
    ) -> (Option<usize>, Vec<Option<Duration>>) {
        let created = Instant::now();
        let replicas = spec.fixed_replicas().unwrap_or(1);
        let refused = vec![None; replicas as usize];
        match self {
            Side::Tessera {
                api, watch, moves, ..
            } => {
                let mi: ModelInstance = ModelInstance::new(name, spec.clone());
                if let Err(e) = api.create(&PostParams::default(), &mi).await {
                    eprintln!("creating {name}: {e}");
                    return (None, refused);
                }
                if room && *moves {
                    let placed = room_made(watch, bench.bindings, name, created).await;
                    return (None, vec![placed]);
                }
                (
                    None,
                    tessera_settled(api, bench.bindings, (name, spec), created).await,
                )
            }
            Side::Users { pods, .. } => {
                let largest = bench.fleet.largest_gpu_bytes();
                let shards = match user_shards(spec, largest) {
                    Ok(shards) => shards,
                    Err(e) => {
                        eprintln!("{name}: {e}");
                        return (Some(0), refused);
                    }
                };
                for replica in 0..replicas {
                    if let Err(e) = pods.create(name, replica, &shards, spec).await {
                        eprintln!("{e}");
                    }
                }
                let mut out = Vec::new();
                for replica in 0..replicas {
                    out.push(
                        users_settled(pods, bench.bindings, name, replica, shards.len(), created)
                            .await,
                    );
                }
                (Some(shards.len()), out)
            }
        }
    }

    async fn delete(&self, name: &str) {
        match self {
            Side::Tessera { api, .. } => workload::delete(api, name).await,
            Side::Users { pods, .. } => pods.delete(name).await,
        }
    }

    /// Lets the moves in flight end (a move's two copies would be judged
    /// as one replica).
    async fn let_moves_end(&self, scenario: &str) {
        if let Side::Tessera { watch, .. } = self
            && !moves_ended(watch, MOVES_END).await
        {
            eprintln!(
                "{scenario}: {} moves still in flight after {} s",
                watch.moving(),
                MOVES_END.as_secs()
            );
        }
    }

    /// Prints the moves the controller made since `before` and what the
    /// instances' status writes showed meanwhile; returns the figures now.
    fn report_moves(
        &self,
        scenario: &str,
        part: &str,
        before: Option<MovesSoFar>,
    ) -> Option<MovesSoFar> {
        let Side::Tessera {
            controller, watch, ..
        } = self
        else {
            return None;
        };
        let now = MovesSoFar {
            controller: crate::measure::controller(controller.pid(), controller.port),
            record: watch.record(),
        };
        let then = before.unwrap_or_default();
        let new_drops = &now.record.drops[then.record.drops.len().min(now.record.drops.len())..];
        println!(
            "REPORT {scenario} moves in the {part}: {} moved, {} abandoned, {:.0} GPU-seconds held by surge copies; {} moves seen in status writes, {} status writes while moving; ready replicas fewer than an earlier write of the same instance said: {}{}",
            now.controller.moved - then.controller.moved,
            now.controller.abandoned - then.controller.abandoned,
            now.controller.surge_gpu_seconds - then.controller.surge_gpu_seconds,
            now.record.moves_seen - then.record.moves_seen,
            now.record.writes_moving - then.record.writes_moving,
            new_drops.len(),
            new_drops
                .iter()
                .take(5)
                .map(|d| format!("; {d}"))
                .collect::<String>(),
        );
        Some(now)
    }

    /// CPU seconds the placer's process has used.
    fn cpu_seconds(&self) -> f64 {
        match self {
            Side::Tessera { controller, .. } => {
                crate::measure::controller(controller.pid(), controller.port).cpu_seconds
            }
            Side::Users { scheduler_pid, .. } => scheduler_pid.map_or(f64::NAN, |pid| {
                crate::measure::controller(pid, 0).cpu_seconds
            }),
        }
    }
}

/// Waits for tessera's decision on every replica (the status of this
/// generation), then for the planned replicas' pods to be bound. An
/// instance sized to its demand wants the replicas planned, and one more
/// while its demand is not met.
async fn tessera_settled(
    api: &Api<ModelInstance>,
    bindings: &Bindings,
    (name, spec): (&str, &ModelInstanceSpec),
    created: Instant,
) -> Vec<Option<Duration>> {
    let mut planned: Option<BTreeMap<u32, usize>> = None;
    let mut short = false;
    while planned.is_none() && created.elapsed() < SETTLE {
        if let Ok(mi) = api.get(name).await
            && let Some(status) = &mi.status
            && status.observed_generation.is_some()
            && status.observed_generation == mi.metadata.generation
        {
            let mut shards = BTreeMap::new();
            for shard in &status.plan {
                *shards.entry(shard.replica).or_insert(0) += 1;
            }
            // Replicas placed but not ready yet (no kubelet runs the
            // simulated nodes) are not a shortfall.
            short = status.conditions.iter().any(|c| {
                c.type_ == "DemandMet" && c.status == "False" && c.reason != "ReplicasStarting"
            });
            planned = Some(shards);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let planned = planned.unwrap_or_default();
    let replicas = spec
        .fixed_replicas()
        .unwrap_or(planned.len() as u32 + u32::from(short))
        .max(1);
    let mut out = Vec::new();
    for replica in 0..replicas {
        let Some(&shards) = planned.get(&replica) else {
            out.push(None);
            continue;
        };
        out.push(bound_within(bindings, (name, replica, shards), created, SETTLE).await);
    }
    out
}

/// Waits for a refused replica 0 to be placed by the moves made for it:
/// bound in whole, or `None` once the controller says no moves make room,
/// or nothing moves and it is still refused.
async fn room_made(
    watch: &InstanceWatch,
    bindings: &Bindings,
    name: &str,
    created: Instant,
) -> Option<Duration> {
    let mut still_since: Option<Instant> = None;
    while created.elapsed() < ROOM {
        let status = watch.get(name).and_then(|mi| {
            let status = mi.status.clone()?;
            (status.observed_generation.is_some()
                && status.observed_generation == mi.metadata.generation)
                .then_some(status)
        });
        if let Some(status) = status {
            let shards = status.plan.iter().filter(|s| s.replica == 0).count();
            if shards > 0 {
                return bound_within(bindings, (name, 0, shards), created, ROOM).await;
            }
            let message = status.message.unwrap_or_default();
            if message.contains("no moves make room") {
                return None;
            }
            if message.contains("making room") || watch.moving() > 0 {
                still_since = None;
            } else if still_since.get_or_insert_with(Instant::now).elapsed() >= RECHECK {
                return None;
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    None
}

/// Waits until no instance has a move in flight; `false` if some still do
/// after `limit`.
async fn moves_ended(watch: &InstanceWatch, limit: Duration) -> bool {
    let started = Instant::now();
    while watch.moving() > 0 {
        if started.elapsed() >= limit {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    true
}

/// Waits for kube-scheduler's decision on every pod of the replica; bound
/// in whole, or `None`.
async fn users_settled(
    pods: &UserPods,
    bindings: &Bindings,
    name: &str,
    replica: u32,
    shards: usize,
    created: Instant,
) -> Option<Duration> {
    let mut settled_since = None;
    while created.elapsed() < SETTLE {
        let standing = pods.standing(name, replica).await;
        if standing.bound == shards {
            return bound_within(bindings, (name, replica, shards), created, SETTLE).await;
        }
        if standing.settled(shards) {
            let since = *settled_since.get_or_insert_with(Instant::now);
            if since.elapsed() >= RECHECK {
                return None;
            }
        } else {
            settled_since = None;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    None
}

/// The time from `created` to the last of the replica's pods bound, once
/// the stand-in kubelets have seen all `shards` of them (within `limit` of
/// `created`).
async fn bound_within(
    bindings: &Bindings,
    (name, replica, shards): (&str, u32, usize),
    created: Instant,
    limit: Duration,
) -> Option<Duration> {
    while created.elapsed() < limit {
        let bound = replica_pods(bindings, name, replica);
        if bound.len() >= shards {
            let last = bound.iter().map(|pod| pod.at).max()?;
            return Some(last.saturating_duration_since(created));
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    None
}

fn gpus(pods: &[Bound]) -> usize {
    pods.iter().map(|pod| pod.devices.len()).sum()
}

fn replica_pods(bindings: &Bindings, name: &str, replica: u32) -> Vec<Bound> {
    bindings
        .of_instance(name)
        .into_iter()
        .filter(|pod| pod.replica == replica)
        .collect()
}

/// One replica the sequence asked for.
struct Replica {
    instance: String,
    replica: u32,
    /// Its shards where the user fixed them; tessera binds a replica's
    /// planned shards together, so any bound pod of its is a whole replica's.
    expected: Option<usize>,
    /// Bound in whole when it settled.
    placed: bool,
}

/// Some of a replica's `expected` shards are bound and others are not: GPUs
/// held for nothing.
fn partial(expected: Option<usize>, bound: usize) -> bool {
    bound > 0 && expected.is_some_and(|shards| bound < shards)
}

/// The moves counted up to a point of a tessera run.
#[derive(Default)]
struct MovesSoFar {
    controller: crate::measure::Controller,
    record: crate::instance_watch::ReadyRecord,
}

/// What one placer's run measured.
#[derive(Default)]
struct Figures {
    asked: usize,
    placed: usize,
    before_first_refusal: usize,
    refused_seen: bool,
    create_to_bound: Vec<Duration>,
    /// GPU-seconds held by replicas with some shards bound and others not.
    partial_gpu_seconds: f64,
}

/// Runs the sequence and the burst under `placer` and prints its REPORT
/// lines; everything it created is deleted before it returns.
pub(crate) async fn run(bench: &Bench<'_>, placer: Placer) {
    let scenario = format!("compare/{}_nodes/{}", bench.nodes, placer.name());
    let class_created = ensure_device_class(bench.client, bench.driver).await;
    let side = match placer {
        Placer::Tessera | Placer::TesseraNoMoves | Placer::TesseraContinuous => {
            let moves = placer != Placer::TesseraNoMoves;
            let continuous = if placer == Placer::TesseraContinuous {
                "true"
            } else {
                "false"
            };
            let log =
                std::env::temp_dir().join(format!("tessera-compare-{}-controller.log", bench.run));
            let controller = ControllerProcess::start(
                bench.kubeconfig,
                bench.namespace,
                bench.initial_list,
                true,
                &[
                    "--moves",
                    if moves { "true" } else { "false" },
                    "--continuous-moves",
                    continuous,
                    "--continuous-interval",
                    "10",
                ],
                log,
            );
            if !controller.ready(Duration::from_secs(300)).await {
                eprintln!(
                    "{scenario}: the controller did not become ready; its log: {}",
                    controller.log.display()
                );
                return;
            }
            let api = Api::namespaced(bench.client.clone(), bench.namespace);
            Side::Tessera {
                watch: InstanceWatch::start(api.clone()).await,
                api,
                controller,
                moves,
            }
        }
        Placer::KubeScheduler | Placer::KubeSchedulerGang => Side::Users {
            pods: UserPods::new(
                bench.client,
                bench.namespace,
                bench.run,
                bench.driver,
                placer == Placer::KubeSchedulerGang,
            ),
            scheduler_pid: process_named("kube-scheduler"),
        },
    };
    let events = sequence(bench.events, bench.seed);
    let demands = demands(&events, bench.seed);
    eprintln!("{scenario}: {}", describe(&events));
    // The user sizes replicas by the hardware, every GPU free.
    let nominal = nominal_nodes(bench.client, bench.run).await;
    let cpu_before = side.cpu_seconds();
    let mut figures = Figures::default();
    let mut replicas: Vec<Replica> = Vec::new();
    let mut instances: HashMap<String, Instance> = HashMap::new();
    let mut live: Vec<String> = Vec::new();
    let mut partial = PartialClock::new();
    for (step, event) in events.iter().enumerate() {
        match event {
            Event::Arrive(arrival) => {
                let Some(demand) = demands.get(&arrival.id) else {
                    continue;
                };
                let name = format!("a{:03}-{}", arrival.id, arrival.class.to_lowercase());
                let asked = confined(
                    serde_json::to_value(tessera_spec(arrival, demand)).expect("a spec serializes"),
                    bench.run,
                );
                let spec = match &side {
                    Side::Tessera { .. } => Some(asked.clone()),
                    Side::Users { .. } => user_sizing(&asked, &nominal),
                };
                live.push(name.clone());
                let Some(spec) = spec else {
                    eprintln!("{name}: no size of it meets its target on any GPU here");
                    figures.asked += 1;
                    figures.refused_seen = true;
                    let refused = Instance {
                        class: arrival.class,
                        spec: asked,
                        wanted: 1,
                        expected: None,
                    };
                    instances.insert(name, refused);
                    continue;
                };
                let (expected, results) = side.place(bench, (&name, &spec), false).await;
                for (replica, result) in results.iter().enumerate() {
                    figures.asked += 1;
                    if let Some(took) = result {
                        figures.create_to_bound.push(*took);
                        figures.placed += 1;
                        if !figures.refused_seen {
                            figures.before_first_refusal += 1;
                        }
                    } else {
                        figures.refused_seen = true;
                    }
                    replicas.push(Replica {
                        instance: name.clone(),
                        replica: replica as u32,
                        expected,
                        placed: result.is_some(),
                    });
                }
                let instance = Instance {
                    class: arrival.class,
                    spec,
                    wanted: results.len(),
                    expected,
                };
                instances.insert(name, instance);
            }
            Event::Delete(id) => {
                if let Some(at) = live
                    .iter()
                    .position(|name| name.starts_with(&format!("a{id:03}-")))
                {
                    let name = live.remove(at);
                    side.delete(&name).await;
                    replicas.retain(|r| r.instance != name);
                    instances.remove(&name);
                }
            }
        }
        partial.tick(bench.bindings, &replicas);
        if step % 50 == 49 {
            eprintln!(
                "{scenario}: {} events, {} of {} replicas placed",
                step + 1,
                figures.placed,
                figures.asked
            );
        }
    }
    figures.partial_gpu_seconds = partial.gpu_seconds;
    side.let_moves_end(&scenario).await;
    let cpu = side.cpu_seconds() - cpu_before;
    let end = judge(bench.bindings, &replicas, &instances, &nominal);
    println!(
        "REPORT {scenario} sequence ({} events, seed {:#x}): replicas placed before the first refusal {}, placed {} of {} wanted; at the end {} replicas bound in whole ({} of them after waiting) on {} GPUs; missing the target (serving nothing) {} replicas on {} GPUs; bound but unable to hold their shards {}; partial replicas at the end {} holding {} GPUs ({:.0} GPU-seconds held by partial replicas over the sequence); created to all shards bound {}; placer CPU {:.1} s",
        bench.events,
        bench.seed,
        figures.before_first_refusal,
        figures.placed,
        figures.asked,
        end.replicas,
        end.late,
        end.gpus,
        end.missed,
        end.missed_gpus,
        end.cannot_hold,
        end.partial,
        end.partial_gpus,
        figures.partial_gpu_seconds,
        crate::summary(&figures.create_to_bound),
        cpu,
    );
    println!(
        "{}",
        end.outcome
            .line(&format!("{scenario} at the end"), placer.name())
    );
    println!(
        "REPORT {scenario} at the end by class and GPU: {}",
        end.breakdown()
    );
    let moves_before = side.report_moves(&scenario, "sequence", None);
    if !end.cannot_hold_examples.is_empty() {
        eprintln!(
            "{scenario}: bound but unable to hold their shards: {}",
            end.cannot_hold_examples.join("; ")
        );
    }

    // Room for large models: every other instance still running goes, then
    // 405B-class arrivals come one after the other.
    let deleted: Vec<String> = live.iter().step_by(2).cloned().collect();
    for name in &deleted {
        side.delete(name).await;
    }
    live.retain(|name| !deleted.contains(name));
    wait_gone(bench.bindings, &deleted, Duration::from_secs(60)).await;
    // The claims of deleted pods are freed after the pods go.
    tokio::time::sleep(Duration::from_secs(5)).await;
    let mut fitted = 0;
    for k in 0..BURST {
        let arrival = Arrival {
            id: 900 + k,
            class: "405B",
            model: MODEL_405B,
            tensor: TensorChoice::Fixed(8),
            replicas: 1,
        };
        let name = format!("burst-{k:02}");
        let spec = confined(arrival.spec_json(), bench.run);
        if side.place(bench, (&name, &spec), true).await.1[0].is_some() {
            fitted += 1;
        }
        live.push(name);
    }
    side.let_moves_end(&scenario).await;
    let burst: Vec<&String> = live.iter().filter(|n| n.starts_with("burst-")).collect();
    let at_end = burst
        .iter()
        .filter(|name| !bench.bindings.of_instance(name).is_empty())
        .count();
    println!(
        "REPORT {scenario} burst: {fitted} of {BURST} 405B-class replicas (tensor 8, pipeline auto) fit after every other instance was deleted; bound at the end {at_end}"
    );
    side.report_moves(&scenario, "burst", moves_before);

    for name in &live {
        side.delete(name).await;
    }
    if let Side::Users { pods, .. } = &side {
        for name in pods.instances().await {
            pods.delete(&name).await;
        }
    }
    wait_gone(bench.bindings, &live, Duration::from_secs(120)).await;
    if class_created {
        let classes: Api<DeviceClass> = Api::all(bench.client.clone());
        if let Err(e) = classes.delete(bench.driver, &DeleteParams::default()).await {
            eprintln!("deleting DeviceClass {}: {e}", bench.driver);
        }
    }
    tokio::time::sleep(Duration::from_secs(5)).await;
}

/// A ModelInstance spec confined to the run's nodes.
fn confined(mut spec: serde_json::Value, run: &str) -> ModelInstanceSpec {
    spec["placement"]["nodeSelector"] = json!({RUN_LABEL: run});
    spec["template"] = json!({"spec": {
        "containers": [{"name": "shard", "image": "busybox:1.37"}],
        "tolerations": [{"key": TAINT_KEY, "operator": "Exists", "effect": "NoSchedule"}],
    }});
    serde_json::from_value(spec).expect("a valid ModelInstance spec")
}

/// Accumulates the GPU-seconds that replicas bound in part hold.
struct PartialClock {
    last: Instant,
    gpu_seconds: f64,
}

impl PartialClock {
    fn new() -> Self {
        Self {
            last: Instant::now(),
            gpu_seconds: 0.0,
        }
    }

    fn tick(&mut self, bindings: &Bindings, replicas: &[Replica]) {
        let bound = bindings.by_replica();
        let held: usize = replicas
            .iter()
            .filter_map(|r| {
                let pods = bound.get(&(r.instance.clone(), r.replica))?;
                partial(r.expected, pods.len()).then(|| gpus(pods))
            })
            .sum();
        let now = Instant::now();
        self.gpu_seconds += held as f64 * now.duration_since(self.last).as_secs_f64();
        self.last = now;
    }
}

/// One instance of the sequence as its placer runs it.
struct Instance {
    class: &'static str,
    /// The spec as created: tessera's sized to the demand, the user's with
    /// its replicas, sizes and products fixed.
    spec: ModelInstanceSpec,
    /// Replicas it wants (tessera: those planned, one more while short).
    wanted: usize,
    /// Shards of each replica where the user fixed them.
    expected: Option<usize>,
}

/// The end of the sequence as the serving model sees it: what each replica
/// bound in whole serves at its target, and each instance by the objective.
#[derive(Default)]
struct End {
    replicas: usize,
    gpus: usize,
    /// Replicas bound where they cannot meet their target (served nothing),
    /// and their GPUs (counted in `gpus`).
    missed: usize,
    missed_gpus: usize,
    cannot_hold: usize,
    cannot_hold_examples: Vec<String>,
    partial: usize,
    partial_gpus: usize,
    /// Replicas refused when they arrived and bound later (room freed).
    late: usize,
    /// The instances by the cluster objective.
    outcome: DemandOutcome,
    /// By model class: replicas, GPUs, requests/s.
    by_class: BTreeMap<String, (usize, usize, f64)>,
    /// By GPU product: GPUs, their replicas' work at the target (FLOP/s)
    /// split evenly over them.
    by_product: BTreeMap<String, (usize, f64)>,
    /// GPUs by model class and GPU product.
    class_on_product: BTreeMap<String, usize>,
}

impl End {
    /// One line: per class and per GPU product, GPUs and what they serve.
    fn breakdown(&self) -> String {
        let classes = self
            .by_class
            .iter()
            .map(|(class, (replicas, gpus, served))| {
                format!(
                    "{class}: {replicas} replicas on {gpus} GPUs, {:.3} requests/s per GPU",
                    served / (*gpus).max(1) as f64
                )
            });
        let products = self.by_product.iter().map(|(product, (gpus, work))| {
            format!(
                "{product}: {gpus} GPUs, {:.1} TFLOP/s of model work per GPU",
                work / TFLOP / (*gpus).max(1) as f64
            )
        });
        let mix = self
            .class_on_product
            .iter()
            .map(|(what, gpus)| format!("{what}: {gpus} GPUs"));
        classes
            .chain(products)
            .chain(mix)
            .collect::<Vec<_>>()
            .join("; ")
    }
}

/// Every replica bound now, judged by `evaluate_placed` and the serving
/// model on `nodes`: what it serves at its spec's target, nothing where it
/// cannot meet it; then every instance by the objective.
fn judge(
    bindings: &Bindings,
    replicas: &[Replica],
    instances: &HashMap<String, Instance>,
    nodes: &[ClusterNode],
) -> End {
    let mut end = End::default();
    let products: HashMap<&str, &str> = nodes
        .iter()
        .filter_map(|node| {
            Some((
                node.name.as_str(),
                node.gpu_state.devices.first()?.product.as_str(),
            ))
        })
        .collect();
    let placed_at_once: HashSet<(&str, u32)> = replicas
        .iter()
        .filter(|r| r.placed)
        .map(|r| (r.instance.as_str(), r.replica))
        .collect();
    // Each instance's replicas at the target, and its GPUs.
    let mut served: HashMap<&str, (Vec<f64>, usize)> = HashMap::new();
    let mut bound: Vec<((String, u32), Vec<Bound>)> = bindings.by_replica().into_iter().collect();
    bound.sort_by(|a, b| a.0.cmp(&b.0));
    for ((name, replica), mut pods) in bound {
        let Some((name, instance)) = instances.get_key_value(&name) else {
            continue;
        };
        pods.sort_by_key(|pod| pod.shard);
        let held = gpus(&pods);
        if partial(instance.expected, pods.len()) {
            end.partial += 1;
            end.partial_gpus += held;
            continue;
        }
        let spec = &instance.spec;
        let shards: Vec<PlannedShard> = pods
            .iter()
            .map(|pod| PlannedShard {
                copy: 0,
                replica,
                shard: pod.shard,
                node: pod.node.clone(),
                devices: pod.devices.clone(),
                layer_start: 0,
                layer_end: 0,
                predicted_memory_gib: 0.0,
                share: None,
            })
            .collect();
        let refs: Vec<&PlannedShard> = shards.iter().collect();
        let problem = build_problem(spec, nodes, &HashMap::new(), &HeldShares::new());
        let plan = match evaluate_placed(problem.clone(), &refs) {
            Ok(plan) => plan,
            Err(e) => {
                end.cannot_hold += 1;
                if end.cannot_hold_examples.len() < 3 {
                    end.cannot_hold_examples
                        .push(format!("{name} replica {replica}: {e}"));
                }
                continue;
            }
        };
        let rps = at_target(&problem, &plan).map_or(0.0, |(at, _)| at.requests_per_second);
        let of = served.entry(name.as_str()).or_default();
        of.0.push(rps);
        of.1 += held;
        end.replicas += 1;
        end.late += usize::from(!placed_at_once.contains(&(name.as_str(), replica)));
        end.gpus += held;
        if rps <= 0.0 {
            end.missed += 1;
            end.missed_gpus += held;
        }
        let class = instance.class;
        let of_class = end.by_class.entry(class.to_string()).or_default();
        of_class.0 += 1;
        of_class.1 += held;
        of_class.2 += rps;
        let work = rps * work_per_request(spec);
        for pod in &pods {
            let product = products.get(pod.node.as_str()).copied().unwrap_or("?");
            *end.class_on_product
                .entry(format!("{class} on {product}"))
                .or_default() += pod.devices.len();
            let of_product = end.by_product.entry(product.to_string()).or_default();
            of_product.0 += pod.devices.len();
            // A replica's work counts for each of its GPUs alike.
            of_product.1 += work * pod.devices.len() as f64 / held.max(1) as f64;
        }
    }
    let mut names: Vec<&String> = instances.keys().collect();
    names.sort();
    for name in names {
        let instance = &instances[name];
        let (per_replica, gpus) = served.remove(name.as_str()).unwrap_or_default();
        let wanted = instance.wanted.max(per_replica.len());
        let standing = InstanceStanding::new(&instance.spec, wanted, per_replica, gpus as f64);
        let demand = instance.spec.demand().unwrap_or(0.0);
        end.outcome.add(instance.class, demand, standing);
    }
    end
}

/// The run's nodes as their agents publish them, with every GPU free: the
/// speed model judges a placement, not the competition for it.
async fn nominal_nodes(client: &Client, run: &str) -> Vec<ClusterNode> {
    let nodes: Api<Node> = Api::all(client.clone());
    let list = nodes
        .list(&ListParams::default().labels(&format!("{RUN_LABEL}={run}")))
        .await
        .map(|l| l.items)
        .unwrap_or_default();
    list.iter()
        .filter_map(|node| ClusterNode::from_node(node).ok().flatten())
        .map(|mut node| {
            node.gpu_state.allocated.clear();
            for device in &mut node.gpu_state.devices {
                device.memory_free_bytes = device.memory_total_bytes;
            }
            node
        })
        .collect()
}

/// Waits until no pod of `instances` is bound any more.
async fn wait_gone(bindings: &Bindings, instances: &[String], limit: Duration) {
    let started = Instant::now();
    while started.elapsed() < limit
        && instances
            .iter()
            .any(|name| !bindings.of_instance(name).is_empty())
    {
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// The DeviceClass users' claims name (the chart's, which this benchmark
/// does not install), created unless it exists; whether it was created here
/// (and is to be deleted at the end).
async fn ensure_device_class(client: &Client, driver: &str) -> bool {
    let classes: Api<DeviceClass> = Api::all(client.clone());
    if classes.get_opt(driver).await.ok().flatten().is_some() {
        return false;
    }
    let class: DeviceClass = serde_json::from_value(json!({
        "metadata": {"name": driver},
        "spec": {"selectors": [{"cel": {"expression": format!("device.driver == '{driver}'")}}]},
    }))
    .expect("a valid DeviceClass");
    match classes.create(&PostParams::default(), &class).await {
        Ok(_) => true,
        Err(e) => {
            eprintln!("creating DeviceClass {driver}: {e}");
            false
        }
    }
}

/// The pid of the process whose command name is `name`, if one runs on
/// this machine (the kit's kube-scheduler does).
fn process_named(name: &str) -> Option<u32> {
    std::fs::read_dir("/proc")
        .ok()?
        .flatten()
        .find_map(|entry| {
            let pid: u32 = entry.file_name().to_str()?.parse().ok()?;
            let comm = std::fs::read_to_string(entry.path().join("comm")).ok()?;
            (comm.trim() == name).then_some(pid)
        })
}
