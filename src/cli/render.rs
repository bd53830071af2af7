//! A placement report as text: the human-readable table, JSON or YAML.

use std::fmt::Write;

use super::place::{PlaceOutput, PlacedPlan, Report};
use tessera_core::api::{GIB, ServingSpec, layer_range};
use tessera_core::placement::{Performance, Score, StagePlan, StageShare, TokenTime};
use tessera_core::serving::{Limit, RuntimeConfig, VersionRange};

impl Report {
    pub fn render(&self, output: PlaceOutput) -> String {
        match output {
            PlaceOutput::Table => table(self),
            // Both serializers only see our own plain structs here.
            PlaceOutput::Json => serde_json::to_string_pretty(self).unwrap_or_default() + "\n",
            PlaceOutput::Yaml => serde_saphyr::to_string(self).unwrap_or_default(),
            PlaceOutput::Html => super::html::html(self),
        }
    }
}

fn score_line(score: &Score) -> String {
    format!(
        "score {:.3} = compute {:.2} · memory {:.2} · network {:.2} · thermal {:.2} · bandwidth {:.2} · sharing {:.2} (parts in 0..1, weighted)",
        score.total,
        score.compute,
        score.memory,
        score.network,
        score.thermal,
        score.bandwidth,
        score.sharing
    )
}

/// Where one token's time goes, in one line.
fn token_line(time: &TokenTime) -> String {
    format!(
        "token {:.2} ms = weights {:.2} · compute {:.2} · layer overhead {:.2} · all-reduce {:.2} · hops {:.2} (ms, predicted)",
        time.total_ms(),
        time.weights_ms,
        time.compute_ms,
        time.layer_overhead_ms,
        time.all_reduce_ms,
        time.hops_ms
    )
}

/// What the replica serves at the instance's latency target, in one line.
fn capacity_line(plan: &PlacedPlan, serving: Option<&ServingSpec>) -> String {
    let default = ServingSpec::default();
    let spec = serving.unwrap_or(&default);
    let target = format!(
        "at {} ms per token, {} ms to the first ({}, {}+{} tokens)",
        spec.max_time_per_output_token_ms,
        spec.max_time_to_first_token_ms,
        VersionRange::of(&RuntimeConfig::of_spec(spec)).label(),
        spec.input_tokens,
        spec.output_tokens
    );
    let line = match (&plan.serving, &plan.serving_error) {
        (Some(capacity), _) => match (&capacity.at_slo, &capacity.target_missed) {
            (Some(at), _) => format!(
                "capacity {target}: {:.1} requests/s, {:.0} tokens/s with {} at once ({:.1} ms per token, {:.0} ms to the first); the {} allows {}",
                at.requests_per_second,
                at.output_tokens_per_second,
                at.concurrency,
                at.tpot_ms,
                at.ttft_ms,
                limit_name(capacity.limited_by),
                capacity.max_concurrency
            ),
            (None, Some(miss)) => format!("capacity {target}: none, {miss}"),
            (None, None) => format!("capacity {target}: unknown"),
        },
        (None, Some(why)) => format!("capacity {target}: unknown ({why})"),
        (None, None) => format!("capacity {target}: unknown"),
    };
    match plan.serving.as_ref().and_then(|c| c.correction) {
        Some(factor) => format!("{line}; corrected by measurement: step times ×{factor}"),
        None => line,
    }
}

fn limit_name(limit: Limit) -> &'static str {
    match limit {
        Limit::KvCache => "KV cache",
        Limit::Runtime => "runtime's batch cap",
    }
}

fn table(report: &Report) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "cluster: {}", report.cluster);
    for placement in &report.placements {
        let _ = writeln!(out);
        match (&placement.plan, &placement.unsatisfiable) {
            (Some(plan), _) => {
                let shards = plan.stages.len();
                let _ = writeln!(
                    out,
                    "{}{} ({}): {shards} shard{}, {:.1} tokens/s predicted, {}",
                    placement.name,
                    replica_label(placement.replica),
                    placement.model,
                    if shards == 1 { "" } else { "s" },
                    plan.performance.tokens_per_second,
                    {
                        let steps = format!(
                            "{} search step{}",
                            plan.steps,
                            if plan.steps == 1 { "" } else { "s" }
                        );
                        if plan.optimal {
                            format!("optimal ({steps})")
                        } else {
                            format!("best found in {steps} (budget or deadline reached)")
                        }
                    }
                );
                let header = [
                    "SHARD",
                    "NODE",
                    "DEVICES",
                    "LAYERS",
                    "MEM/GPU",
                    "COMPUTE",
                    "MEMORY",
                    "THERMAL",
                    "BANDWIDTH",
                    "SHARING",
                    "NEXT-HOP",
                ];
                let mut rows = vec![header.map(String::from).to_vec()];
                for (i, s) in plan.stages.iter().enumerate() {
                    let devices: Vec<String> =
                        s.device_indices.iter().map(|d| d.to_string()).collect();
                    rows.push(vec![
                        i.to_string(),
                        s.node.clone(),
                        devices.join(","),
                        layer_range(s.layer_start, s.layer_end),
                        format!("{:.1} GiB", s.memory_per_device_bytes / GIB),
                        format!("{:.2}", s.parts.compute),
                        format!("{:.2}", s.parts.memory),
                        format!("{:.2}", s.parts.thermal),
                        format!("{:.2}", s.parts.bandwidth),
                        format!("{:.2}", s.parts.sharing),
                        if i + 1 == shards {
                            "-".into()
                        } else {
                            format!("{:.2}", s.parts.next_hop_cost)
                        },
                    ]);
                }
                write_rows(&mut out, &rows);
                let _ = writeln!(out, "  {}", score_line(&plan.score));
                let _ = writeln!(out, "  {}", token_line(&plan.performance.token_time));
                for widened in &plan.performance.widened {
                    let _ = writeln!(out, "  {widened}");
                }
                let _ = writeln!(out, "  {}", capacity_line(plan, placement.serving.as_ref()));
                for (i, stage) in plan.stages.iter().enumerate() {
                    if let Some(share) = share_line(stage, &plan.performance) {
                        let _ = writeln!(out, "  shard {i}: {share}");
                    }
                }
                if let Some(parallelism) = &placement.parallelism {
                    let _ = writeln!(out, "  {parallelism}");
                }
            }
            (None, Some(unsatisfiable)) => {
                let _ = writeln!(
                    out,
                    "{}{} ({}): UNSATISFIABLE: {}",
                    placement.name,
                    replica_label(placement.replica),
                    placement.model,
                    unsatisfiable.reason
                );
                for detail in &unsatisfiable.details {
                    let _ = writeln!(out, "  - {detail}");
                }
                for line in placement
                    .moves
                    .iter()
                    .flat_map(|m| m.lines(&placement.name))
                {
                    let _ = writeln!(out, "  {line}");
                }
            }
            (None, None) => {}
        }
    }
    for demand in &report.demands {
        let _ = writeln!(
            out,
            "\n{}: demand {} requests/s: {} replica{} serve {:.1} at the target ({})",
            demand.name,
            demand.requests_per_second,
            demand.replicas,
            if demand.replicas == 1 { "" } else { "s" },
            demand.served_requests_per_second,
            if demand.met { "met" } else { "NOT MET" }
        );
    }
    let _ = writeln!(
        out,
        "\nby the cluster objective: {}",
        report.objective.words()
    );
    if let Some(drain) = &report.drain {
        let _ = writeln!(out);
        for line in drain.lines() {
            let _ = writeln!(out, "{line}");
        }
    }
    if let Some(improve) = &report.improve {
        let _ = writeln!(out);
        for line in improve.lines() {
            let _ = writeln!(out, "{line}");
        }
    }
    out
}

/// Which part of a GPU a stage was given, and for a memory share what the
/// other tenants cost it.
fn share_line(stage: &StagePlan, performance: &Performance) -> Option<String> {
    Some(match stage.share.as_ref()? {
        StageShare::Partition { gpu, profile } => {
            format!("MIG partition {profile} of GPU {gpu} (isolated)")
        }
        StageShare::Memory {
            bytes,
            fraction,
            tenants,
        } => {
            let gpu = stage.devices.first().map_or("", String::as_str);
            let tenancy = match (tenants, performance.contended_tokens_per_second) {
                (0, _) | (_, None) => "the first on its GPU".to_string(),
                (others, Some(speed)) => format!(
                    "beside {others} other share(s): {speed:.1} tokens/s with all {} decoding at once",
                    others + 1
                ),
            };
            format!(
                "memory share of {:.0} GiB ({:.0}% of GPU {gpu}, not isolated), {tenancy}",
                *bytes as f64 / GIB,
                fraction * 100.0
            )
        }
    })
}

/// ` replica 2` for a replica of an instance with several.
fn replica_label(replica: Option<u32>) -> String {
    replica.map(|r| format!(" replica {r}")).unwrap_or_default()
}

/// Left-aligned columns, two spaces apart, each line indented by two.
pub(super) fn write_rows(out: &mut String, rows: &[Vec<String>]) {
    let cols = rows.first().map_or(0, Vec::len);
    let widths: Vec<usize> = (0..cols)
        .map(|c| rows.iter().map(|r| r[c].chars().count()).max().unwrap_or(0))
        .collect();
    for row in rows {
        let mut line = String::from("  ");
        for (column, cell) in row.iter().enumerate() {
            let _ = write!(line, "{cell:<w$}  ", w = widths[column]);
        }
        let _ = writeln!(out, "{}", line.trim_end());
    }
}
