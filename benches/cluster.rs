//! Cluster-level placement: one seeded sequence of a few hundred ModelInstance
//! arrivals and deletions (8B/70B/405B-class, fixed and `auto` tensor sizes,
//! pipeline `auto`, one to three replicas; see `support::arrivals`) replayed on
//! the mixed 64-node cluster and on the 1,000-node cluster of the placement
//! benchmark, under four policies: first-fit, the score alone (today's
//! objective), `pack` and `spread`.
//!
//! Every arrival states what it serves (`serving: {}`, the default request
//! and latency target), so the solver refuses a replica that cannot meet the
//! target; first-fit places it anyway, and it serves nothing.
//!
//! For each cluster and policy a `REPORT` line on stderr gives the replicas
//! placed before the first refusal and in all, the requests/s they serve at
//! the target per GPU (and those placed missing it), the predicted tokens/s
//! of the replicas running at the end, the mean predicted tokens/s per
//! placement,
//! the largest free NVLink/xGMI domain left (and how many nodes are free and
//! fast-linked whole), how close an instance's replicas came to each other,
//! and the time per placement (mean
//! and max, measured around the library call). On the 64-node cluster eight
//! more sequences (other seeds) compare `pack` with the score alone, so the
//! figures of the one sequence can be told from luck. Criterion then times one
//! representative placement per cluster size: a 70B instance with tensor
//! `auto` under `pack`, on the cluster as the first half of the sequence left
//! it. After each policy's sequence every other running instance is deleted
//! and a burst of 16 405B-class arrivals (8 GPUs a shard) measures the room
//! each policy kept for large models; for the solver's policies the burst
//! runs once more with moves (an arrival refused asks `moves::plan_moves`
//! for room and the moves are made), against the most that could fit with
//! every replica kept on its GPU kind.
//!
//! Then the same sequences with a demand per instance (a request rate and
//! request lengths, seeded: `support::demands`), on the same nodes handing
//! out memory shares, placed by tessera (replicas sized to the demand, with
//! and without sharing) and by a careful user (the smallest size that
//! holds, replicas added until the demand is served) and judged by the
//! cluster objective (`support::demand_replay`), on the default sequence and
//! the further sequences 1 and 2, on both clusters.

#[allow(dead_code)]
mod support;

use std::hint::black_box;
use std::time::Duration;

use criterion::{Criterion, SamplingMode, criterion_group, criterion_main};
use tessera::placement::{NodeState, SolveOptions, Strategy};
use tessera::sizing::{TensorChoice, solve_replicas};
use tessera::translate::ClusterNode;

use support::arrivals::{Arrival, Event, MODEL_70B, describe as describe_events, sequence};
use support::demand_replay::{DemandOutcome, Placer, replay_demands};
use support::demands::demands;
use support::replay::{Outcome, Policy, Room, burst, replay};
use support::shared_nodes::shared_cluster;
use support::{cluster, describe};

/// The placement benchmark's clusters.
const CLUSTER_SEED: u64 = 0x7e55_e7a0_5eed_0001;
const SEQUENCE_SEED: u64 = 0xc1a5_7e55_0000_0013;
/// Seeds of the further sequences on the 64-node cluster.
const MORE_SEQUENCES: std::ops::RangeInclusive<u64> = 1..=8;
const EVENTS: usize = 300;

const POLICIES: [Policy; 4] = [
    Policy::FirstFit,
    Policy::Solver(Strategy::ScoreOnly),
    Policy::Solver(Strategy::Pack),
    Policy::Solver(Strategy::Spread),
];

/// 405B-class arrivals (8 GPUs a shard) once the sequence has run: pack's
/// real measure, room kept for large models.
const BURST: usize = 16;
/// What `pack` must fit of the burst against the score alone.
const BURST_TARGET: f64 = 1.5;

/// How many of the burst fit under each policy, and pack against score-only.
fn burst_line(scenario: &str, fitted: &[usize]) -> String {
    let each: Vec<String> = POLICIES
        .iter()
        .zip(fitted)
        .map(|(policy, n)| format!("{}={n}", policy.name()))
        .collect();
    let ratio = fitted[2] as f64 / fitted[1].max(1) as f64;
    format!(
        "REPORT cluster/{scenario} large-model burst after the sequence and every other running instance deleted ({BURST} 405B-class, 8 GPUs a shard): fit {}; pack vs score-only x{ratio:.2} (target >= {BURST_TARGET}: {})",
        each.join(" "),
        if ratio >= BURST_TARGET {
            "met"
        } else {
            "MISSED"
        }
    )
}

/// Why the burst fit what it did: the deletions free a node whole only when
/// every instance on it goes.
fn room_line(scenario: &str, policy: Policy, room: &Room) -> String {
    let [one, two, more] = room.instances_per_node;
    let products: Vec<String> = room
        .by_product
        .iter()
        .map(|(product, (whole, free))| format!("{product} {whole} ({free} GPUs)"))
        .collect();
    format!(
        "REPORT cluster/{scenario} {} room for the burst: nodes in use held by 1/2/3+ instances={one}/{two}/{more} whole nodes the deletions should free={:.1} nodes free whole after them (free GPUs)={}",
        policy.name(),
        room.expected_whole,
        products.join(", "),
    )
}

/// The burst with moves: an arrival refused asks the move planner for room.
const MOVES_BURST_TARGET: usize = 12;

fn moves_line(scenario: &str, policy: Policy, room: &Room) -> String {
    let ms = &room.planner_ms;
    let mean = ms.iter().fold(0.0, |sum, ms| sum + ms) / ms.len().max(1) as f64;
    let max = ms.iter().copied().fold(0.0, f64::max);
    format!(
        "REPORT cluster/{scenario} {} large-model burst with moves: fit {} of {BURST} ({} by moves: {} replicas moved, {} GPUs moved, planner ms mean={mean:.1} max={max:.1}; at most {} fit with every replica kept on its GPU kind) (target >= {MOVES_BURST_TARGET}: {})",
        policy.name(),
        room.fitted,
        room.fitted_by_moves,
        room.moves_made,
        room.gpus_moved,
        room.ceiling,
        if room.fitted >= MOVES_BURST_TARGET {
            "met"
        } else {
            "MISSED"
        }
    )
}

/// What `pack` must reach against the score alone on the mixed cluster, with
/// `auto` instances in `throughput` mode: replicas placed before the first
/// refusal, and requests/s at the target per GPU.
const PLACED_TARGET: f64 = 1.3;
const PER_GPU_TARGET: f64 = 1.0;
/// The longest one placement may take, by cluster size.
fn max_ms_target(nodes: usize) -> f64 {
    if nodes <= 64 { 5.0 } else { 50.0 }
}

fn report_line(scenario: &str, policy: Policy, outcome: &Outcome) -> String {
    let free_at_first_refusal = outcome
        .free_at_first_refusal
        .map_or("none refused".to_string(), |(free, usable)| {
            format!("{free} of {usable}")
        });
    let (auto_gpus, auto_tokens) = outcome.auto_shares();
    format!(
        "REPORT cluster/{scenario} {}: placed before first refusal={} placed={} refused={} placed missing the target={} requests/s at the target per GPU={:.3} at end={:.1} on {} GPUs running at end={} tokens/s at end={:.1} mean tokens/s per placement={:.2} tokens/s per GPU={:.2} largest free NVLink/xGMI domain={} ({}) whole free NVLink/xGMI nodes={} replica pairs sharing a node/rack/zone/apart={}/{}/{}/{} GPUs free at first refusal={free_at_first_refusal} GPUs per placement={:.2} tensor auto share of GPUs/tokens/s placed={:.0}%/{:.0}% ms per placement mean={:.2} max={:.2}",
        policy.name(),
        outcome.before_first_refusal,
        outcome.placed,
        outcome.refused,
        outcome.missed_target,
        outcome.requests_per_second_per_gpu(),
        outcome.requests_per_second_at_end,
        outcome.gpus_at_end,
        outcome.running_at_end,
        outcome.tokens_per_second_at_end,
        outcome.mean_tokens_per_second(),
        outcome.tokens_per_second_per_gpu(),
        outcome.largest_free_domain.0,
        outcome.largest_free_domain.1,
        outcome.whole_free_domains,
        outcome.replica_pairs[0],
        outcome.replica_pairs[1],
        outcome.replica_pairs[2],
        outcome.replica_pairs[3],
        outcome.gpus_per_placement(),
        auto_gpus * 100.0,
        auto_tokens * 100.0,
        outcome.mean_ms(),
        outcome.max_ms(),
    )
}

/// `pack` against the score alone: (placed before the first refusal, placed,
/// requests/s at the target per GPU, mean tokens/s per placement), each as a
/// ratio.
fn ratios(score_only: &Outcome, pack: &Outcome) -> [f64; 4] {
    [
        pack.before_first_refusal as f64 / score_only.before_first_refusal.max(1) as f64,
        pack.placed as f64 / score_only.placed.max(1) as f64,
        pack.requests_per_second_per_gpu() / score_only.requests_per_second_per_gpu().max(1e-9),
        pack.mean_tokens_per_second() / score_only.mean_tokens_per_second().max(1e-9),
    ]
}

fn target_line(scenario: &str, [first, placed, per_gpu, speed]: [f64; 4]) -> String {
    let met = |ok: bool| if ok { "met" } else { "MISSED" };
    format!(
        "REPORT cluster/{scenario} pack vs score-only: placed before first refusal x{first:.3} (target >= {PLACED_TARGET}: {}), placed x{placed:.3}, requests/s at the target per GPU x{per_gpu:.3} (target >= {PER_GPU_TARGET}: {}), mean tokens/s per placement x{speed:.3}",
        met(first >= PLACED_TARGET),
        met(per_gpu >= PER_GPU_TARGET),
    )
}

fn time_line(scenario: &str, nodes: usize, outcomes: &[Outcome]) -> String {
    let worst = outcomes
        .iter()
        .flat_map(|outcome| outcome.placement_ms.iter().copied())
        .fold(0.0, f64::max);
    let target = max_ms_target(nodes);
    format!(
        "REPORT cluster/{scenario} longest placement of any policy {worst:.2} ms (target < {target} ms: {})",
        if worst < target { "met" } else { "MISSED" }
    )
}

/// The ratios over further sequences: mean and the worst; and the burst
/// after each, summed.
fn more_sequences_line(nodes: &[NodeState]) -> String {
    let mut fitted = [0, 0];
    let all: Vec<[f64; 4]> = MORE_SEQUENCES
        .map(|seed| {
            let events = sequence(EVENTS, seed);
            let (score_only, score_only_left) =
                replay(nodes, &events, Policy::Solver(Strategy::ScoreOnly));
            let (pack, pack_left) = replay(nodes, &events, Policy::Solver(Strategy::Pack));
            fitted[0] += burst(
                score_only_left,
                Policy::Solver(Strategy::ScoreOnly),
                BURST,
                false,
            )
            .fitted;
            fitted[1] += burst(pack_left, Policy::Solver(Strategy::Pack), BURST, false).fitted;
            ratios(&score_only, &pack)
        })
        .collect();
    let summary = |index: usize| {
        let values = all.iter().map(|ratio| ratio[index]);
        let mean = values.clone().sum::<f64>() / all.len() as f64;
        format!(
            "x{mean:.3} (min x{:.3})",
            values.fold(f64::INFINITY, f64::min)
        )
    };
    format!(
        "REPORT cluster/64_nodes over {} more sequences, pack vs score-only: placed before first refusal {}, placed {}, requests/s at the target per GPU {}, mean tokens/s per placement {}, large-model burst fit {} vs {} (x{:.2})",
        all.len(),
        summary(0),
        summary(1),
        summary(2),
        summary(3),
        fitted[1],
        fitted[0],
        fitted[1] as f64 / fitted[0].max(1) as f64,
    )
}

/// The sequences judged with demands: the default one and two further ones.
const DEMAND_SEQUENCES: [u64; 3] = [SEQUENCE_SEED, 1, 2];
/// tessera's GPUs per unit of work-weighted demand met against the careful
/// user's, at most.
const DEMAND_GPU_TARGET: f64 = 0.7;

/// Both placers on one sequence with demands, and the targets: every demand
/// tessera accepts met, at least as many demands met as the careful user,
/// and GPUs per unit of demand met at most 0.7 of the user's.
fn demand_lines(scenario: &str, nodes: &[ClusterNode], seed: u64) -> Vec<String> {
    let events = sequence(EVENTS, seed);
    let demands = demands(&events, seed);
    let scenario = format!("{scenario} seed {seed:#x}");
    let placers = [
        Placer::Tessera,
        Placer::TesseraWholeGpus,
        Placer::CarefulUser,
    ];
    let outcomes: Vec<DemandOutcome> = placers
        .into_iter()
        .map(|placer| replay_demands(nodes, &events, &demands, placer))
        .collect();
    let (tessera, whole, user) = (&outcomes[0], &outcomes[1], &outcomes[2]);
    let ratio = tessera.gpus_per_pflops_met() / user.gpus_per_pflops_met();
    let met = |ok: bool| if ok { "met" } else { "MISSED" };
    let whole_ratio = whole.gpus_per_pflops_met() / user.gpus_per_pflops_met();
    let (mine, theirs) = (tessera.standing(), user.standing());
    let verdict = match mine.compare(&theirs) {
        std::cmp::Ordering::Greater => "tessera first",
        std::cmp::Ordering::Equal => "a tie",
        std::cmp::Ordering::Less => "the user first",
    };
    let tag = format!("cluster/{scenario}");
    vec![
        tessera.line(&tag, Placer::Tessera.name()),
        whole.line(&tag, Placer::TesseraWholeGpus.name()),
        user.line(&tag, Placer::CarefulUser.name()),
        format!(
            "REPORT cluster/{scenario} demand tessera vs careful user: the objective's order: {verdict}; every demand tessera accepts met ({} short: {}), demands met {} vs {} (target >=: {}), GPUs per PFLOP/s of demand met x{ratio:.2} (target <= {DEMAND_GPU_TARGET}: {}); on whole GPUs x{whole_ratio:.2}",
            tessera.short,
            met(tessera.short == 0),
            mine.demands_met(),
            theirs.demands_met(),
            met(mine.demands_met() >= theirs.demands_met()),
            met(ratio <= DEMAND_GPU_TARGET),
        ),
    ]
}

/// The placement criterion times: one replica of a 70B instance with tensor `auto`.
fn representative() -> Arrival {
    Arrival {
        id: usize::MAX,
        class: "70B",
        model: MODEL_70B,
        tensor: TensorChoice::Auto,
        replicas: 1,
    }
}

fn cluster_benches(c: &mut Criterion) {
    let events: Vec<Event> = sequence(EVENTS, SEQUENCE_SEED);
    eprintln!("SEQUENCE {}", describe_events(&events));
    let mut group = c.benchmark_group("cluster");
    group
        .sampling_mode(SamplingMode::Flat)
        .sample_size(20)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(4));
    for nodes in [64, 1000] {
        let scenario = format!("{nodes}_nodes");
        let generated = cluster(nodes, CLUSTER_SEED);
        eprintln!("CLUSTER cluster/{scenario}: {}", describe(&generated));
        let mut outcomes = Vec::new();
        let mut fitted = Vec::new();
        for policy in POLICIES {
            let (outcome, left) = replay(&generated, &events, policy);
            eprintln!("{}", report_line(&scenario, policy, &outcome));
            outcomes.push(outcome);
            if policy != Policy::FirstFit {
                let moved = burst(left.clone(), policy, BURST, true);
                eprintln!("{}", moves_line(&scenario, policy, &moved));
            }
            let room = burst(left, policy, BURST, false);
            eprintln!("{}", room_line(&scenario, policy, &room));
            fitted.push(room.fitted);
        }
        eprintln!("{}", burst_line(&scenario, &fitted));
        eprintln!(
            "{}",
            target_line(&scenario, ratios(&outcomes[1], &outcomes[2]))
        );
        eprintln!("{}", time_line(&scenario, nodes, &outcomes));
        if nodes == 64 {
            eprintln!("{}", more_sequences_line(&generated));
        }
        let shared = shared_cluster(&generated, false);
        for seed in DEMAND_SEQUENCES {
            for line in demand_lines(&scenario, &shared, seed) {
                eprintln!("{line}");
            }
        }

        let (_, mid_sequence) = replay(
            &generated,
            &events[..EVENTS / 2],
            Policy::Solver(Strategy::Pack),
        );
        let arrival = representative();
        let problem = mid_sequence.problem(&arrival, Strategy::Pack);
        let options = SolveOptions::default();
        let owner = "bench/representative";
        let placed = solve_replicas(&problem, arrival.tensor, 1, owner, &options);
        assert!(placed[0].is_ok(), "the representative instance has a plan");
        group.bench_function(
            format!("pack_70b_tensor_auto_on_{scenario}_mid_sequence"),
            |b| b.iter(|| solve_replicas(black_box(&problem), arrival.tensor, 1, owner, &options)),
        );
    }
    group.finish();
}

criterion_group!(benches, cluster_benches);
criterion_main!(benches);
