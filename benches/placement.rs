//! Placement solver benchmarks on generated mixed-GPU clusters.
//!
//! - `solve/8x2_over_64x8`: 8 stages × tensor 2 of a 405B model over 64 nodes × 8 GPUs.
//! - `solve/64_stages_over_1000x8`: 64 stages × tensor 1 of a 1.8T model over 1,000 × 8 GPUs.
//! - `greedy/8000_devices`: `solve_greedy` on the 1,000 × 8 problem.
//! - `limits/...`: the largest instance the CRD admits (100,000 layers, 1,024
//!   stages) over 1,000 × 8 GPUs, with the deadline already past (what is
//!   left is the greedy start the solver always returns) and with the default
//!   budget: every phase's time is bounded, layer splitting included.
//!
//! - `serving/70b_auto_over_{64,1000}x8`: one replica of a 70B model as
//!   `tessera place` and the controller plan it: `tensor: auto`, `pipeline:
//!   auto`, `pack`, every GPU kind compared, each plan judged by the serving
//!   model (requests/s at the default 50 ms target per GPU).
//!
//! Each scenario's plan is checked for validity and compared with a first-fit
//! baseline once, outside the timed code; the comparison goes to stderr as a
//! line starting with `REPORT`.

mod support;

use std::hint::black_box;
use std::time::Duration;

use criterion::{Criterion, SamplingMode, criterion_group, criterion_main};
use tessera::placement::{
    Deadline, Problem, Served, SolveOptions, Stages, Strategy, solve, solve_greedy,
};
use tessera::sizing::{TensorChoice, solve_parallelism};

use support::{ModelSpec, assert_valid, cluster, describe, problem, report};

const SEED: u64 = 0x7e55_e7a0_5eed_0001;

/// A 405B-class dense decoder (Llama 3.1 405B shape) with a 40 GiB KV cache.
const MODEL_405B: ModelSpec = ModelSpec {
    parameters: 405e9,
    layers: 126,
    hidden: 16384,
    attention_heads: 128,
    kv_heads: 8,
    kv_cache_gib: 40.0,
    overhead_gib: 2.0,
};

/// A 1.8-trillion-parameter dense decoder: 3.6 TB of bf16 weights, about
/// 28.7 GB per layer with its KV share. One GPU holds 7 layers on an MI300X,
/// 2 on an H100, 1 on an A100 and none on an RTX 4090: 64 single-GPU stages are
/// feasible (64 H100s exactly fit 128 layers), 64 A100s are not, and the fewest
/// stages that fit are 19 MI300X (`Stages::Auto` would pick those).
const MODEL_1_8T: ModelSpec = ModelSpec {
    parameters: 1.8e12,
    layers: 128,
    hidden: 25600,
    attention_heads: 160,
    kv_heads: 8,
    kv_cache_gib: 64.0,
    overhead_gib: 2.0,
};

/// The most layers and stages a ModelInstance may ask for, on a 20T model:
/// about 39 GB a stage, which H100s and MI300Xs hold.
const MODEL_AT_THE_LIMITS: ModelSpec = ModelSpec {
    parameters: 20e12,
    layers: 100_000,
    hidden: 65536,
    attention_heads: 512,
    kv_heads: 8,
    kv_cache_gib: 0.0,
    overhead_gib: 2.0,
};

struct Expired;

impl Deadline for Expired {
    fn expired(&self) -> bool {
        true
    }
}

fn small_problem() -> Problem {
    problem(cluster(64, SEED), &MODEL_405B, 2, 8)
}

fn large_problem() -> Problem {
    problem(cluster(1000, SEED), &MODEL_1_8T, 1, 64)
}

fn solve_benches(c: &mut Criterion) {
    let scenarios = [
        ("8x2_over_64x8", small_problem(), 8),
        ("64_stages_over_1000x8", large_problem(), 64),
    ];
    let mut group = c.benchmark_group("solve");
    // A solve can take tens of milliseconds: flat sampling keeps the run short.
    group
        .sampling_mode(SamplingMode::Flat)
        .sample_size(20)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(4));
    for (id, p, stages) in &scenarios {
        let scenario = format!("solve/{id}");
        eprintln!("CLUSTER {scenario}: {}", describe(&p.nodes));
        let plan = solve(p, &SolveOptions::default()).expect("the scenario has a plan");
        assert_valid(p, &plan, *stages);
        eprintln!("{}", report(&scenario, p, &plan));
        group.bench_function(*id, |b| {
            b.iter(|| solve(black_box(p), &SolveOptions::default()))
        });
    }
    group.finish();
}

fn greedy_benches(c: &mut Criterion) {
    let p = large_problem();
    let scenario = "greedy/8000_devices";
    eprintln!("CLUSTER {scenario}: {}", describe(&p.nodes));
    let plan = solve_greedy(&p).expect("the scenario has a plan");
    assert_valid(&p, &plan, 64);
    eprintln!("{}", report(scenario, &p, &plan));
    let mut group = c.benchmark_group("greedy");
    group
        .sample_size(20)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3));
    group.bench_function("8000_devices", |b| b.iter(|| solve_greedy(black_box(&p))));
    group.finish();
}

fn limits_benches(c: &mut Criterion) {
    let p = problem(cluster(1000, SEED), &MODEL_AT_THE_LIMITS, 1, 1024);
    let expired = SolveOptions {
        deadline: Some(&Expired),
        ..SolveOptions::default()
    };
    let plan = solve(&p, &expired).expect("the scenario has a plan");
    assert_valid(&p, &plan, 1024);
    let mut group = c.benchmark_group("limits");
    group
        .sampling_mode(SamplingMode::Flat)
        .sample_size(10)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(5));
    group.bench_function("100000_layers_1024_stages_deadline_past", |b| {
        b.iter(|| solve(black_box(&p), &expired))
    });
    group.bench_function("100000_layers_1024_stages_default_budget", |b| {
        b.iter(|| solve(black_box(&p), &SolveOptions::default()))
    });
    group.finish();
}

/// A Llama-3.1-70B-shaped model with room for one request of KV cache, as
/// the controller plans one without `kvCacheGiB`.
const MODEL_70B: ModelSpec = ModelSpec {
    parameters: 70.6e9,
    layers: 80,
    hidden: 8192,
    attention_heads: 64,
    kv_heads: 8,
    kv_cache_gib: 0.4,
    overhead_gib: 2.0,
};

/// `problem` planned as an instance is: stages auto, pack, judged by what it
/// serves at the default target.
fn served(mut p: Problem) -> Problem {
    let model = serde_saphyr::from_str(
        "{name: llama-70b, parametersBillions: 70.6, layers: 80, hiddenSize: 8192, attentionHeads: 64, kvHeads: 8, overheadGiB: 2}",
    )
    .expect("the model parses");
    p.stages = Stages::Auto;
    p.strategy = Strategy::Pack;
    p.served = Some(Served {
        model,
        serving: Default::default(),
        target_required: false,
        corrections: Vec::new(),
    });
    p
}

fn serving_benches(c: &mut Criterion) {
    let mut group = c.benchmark_group("serving");
    group
        .sampling_mode(SamplingMode::Flat)
        .sample_size(20)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(4));
    for nodes in [64, 1000] {
        let p = served(problem(cluster(nodes, SEED), &MODEL_70B, 1, 1));
        let id = format!("70b_auto_over_{nodes}x8");
        let chosen = solve_parallelism(&p, TensorChoice::Auto, &SolveOptions::default())
            .expect("the scenario has a plan");
        let sized = Problem {
            tensor: chosen.tensor,
            ..p.clone()
        };
        assert_valid(&sized, &chosen.plan, chosen.plan.stages.len());
        eprintln!(
            "REPORT serving/{id}: {}",
            chosen.parallelism_note().unwrap_or_default()
        );
        group.bench_function(id.as_str(), |b| {
            b.iter(|| {
                solve_parallelism(black_box(&p), TensorChoice::Auto, &SolveOptions::default())
            })
        });
    }
    group.finish();
}

criterion_group!(
    benches,
    solve_benches,
    greedy_benches,
    limits_benches,
    serving_benches
);
criterion_main!(benches);
