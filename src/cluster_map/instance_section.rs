//! One instance's details: its plan and moves in flight, what the speed model makes of each
//! replica (score parts, where a token's time goes), what each serves at the
//! target (its capacity curve), its conditions and last events. The live map gives it a page; the offline map puts it below the
//! nodes. Every text from the cluster is spliced, so escaped.

use maud::{Markup, html};

use super::capacity_chart::capacity_chart;
use super::links::anchor;
use super::model::{MapInstance, Prediction};
use tessera_core::api::{PlannedShard, ShareKind};

/// `node [devices]`, shard by shard.
fn places(shards: &[PlannedShard]) -> String {
    shards
        .iter()
        .map(|shard| format!("{} [{}]", shard.node, shard.devices.join(", ")))
        .collect::<Vec<_>>()
        .join("; ")
}

/// An instance's plan, moves in flight, predictions, conditions and last events.
pub(super) fn instance_section(instance: &MapInstance) -> Markup {
    html! {
        section.instance id=(anchor(instance)) data-instance=(instance.key()) {
            h2 { (instance.key()) }
            p {
                "model " (instance.model) " · phase " strong { (instance.phase) }
                @if let Some(tps) = instance.predicted_tokens_per_second {
                    " · " (format!("{tps:.1}")) " tokens/s predicted"
                }
            }
            @if let Some(message) = &instance.message {
                p.message { (message) }
            }
            h3 { "Plan" }
            @if instance.plan.is_empty() {
                p.none { "no plan" }
            } @else {
                table {
                    tr { th { "replica" } th { "shard" } th { "node" } th { "devices" } th { "layers" } th { "memory" } th { "share" } }
                    @for shard in &instance.plan {
                        tr {
                            td { (shard.replica) } td { (shard.shard) } td { (shard.node) }
                            td { (shard.devices.join(", ")) }
                            td { (shard.layers()) }
                            td { (format!("{:.1}", shard.predicted_memory_gib)) " GiB" }
                            td { (share_text(shard)) }
                        }
                    }
                }
            }
            @if !instance.moves.is_empty() {
                h3 { "Moves in flight" }
                table {
                    tr { th { "replica" } th { "phase" } th { "from" } th { "to" } th { "started" } th { "why" } th { "waiting for" } }
                    @for record in &instance.moves {
                        tr.move {
                            td { (record.replica) } td { (format!("{:?}", record.phase)) }
                            td { (places(&record.from)) } td { (places(&record.to)) }
                            td { (record.started) } td.message { (record.reason) }
                            td.message { (record.waiting.as_deref().unwrap_or("")) }
                        }
                    }
                }
            }
            @for (replica, prediction) in &instance.predictions {
                (prediction_table(*replica, prediction))
            }
            @if !instance.curves.is_empty() {
                h3 { "Capacity at the target" }
                @for (replica, curve) in &instance.curves {
                    @match curve {
                        Ok(capacity) => (capacity_chart(*replica, capacity, instance.target_tpot_ms, instance.measured.get(replica))),
                        Err(why) => p.none { "Replica " (replica) ": no prediction (" (why) ")" },
                    }
                }
            }
            h3 { "Conditions" }
            table {
                tr { th { "type" } th { "status" } th { "reason" } th { "message" } }
                @for condition in &instance.conditions {
                    tr.condition {
                        td { (condition.type_) } td { (condition.status) }
                        td { (condition.reason) } td.message { (condition.message) }
                    }
                }
            }
            h3 { "Last events" }
            @if instance.events.is_empty() {
                p.none { "none since the controller started" }
            } @else {
                table {
                    tr { th { "time" } th { "type" } th { "reason" } th { "message" } }
                    @for event in instance.events.iter().rev() {
                        tr.event.warning[event.warning] {
                            td { (event.time) }
                            td { @if event.warning { "Warning" } @else { "Normal" } }
                            td { (event.reason) } td.message { (event.message) }
                        }
                    }
                }
            }
        }
    }
}

fn share_text(shard: &PlannedShard) -> String {
    let Some(share) = &shard.share else {
        return "whole GPUs".to_string();
    };
    match share.kind {
        ShareKind::Partition => format!(
            "MIG {} of {}",
            share.profile.as_deref().unwrap_or("partition"),
            share.gpu
        ),
        ShareKind::Memory => format!(
            "{} GiB of {} ({} other tenants)",
            share.memory_gib.unwrap_or(0),
            share.gpu,
            share.tenants
        ),
    }
}

fn prediction_table(replica: u32, prediction: &Prediction) -> Markup {
    html! {
        h3 { "Replica " (replica) ": why this plan" }
        @match prediction {
            Err(why) => p.none { "not evaluated: " (why) },
            Ok(plan) => {
                @let score = &plan.score;
                @let time = &plan.performance.token_time;
                table.parts {
                    tr { th { "score" } th { "compute" } th { "memory" } th { "network" } th { "thermal" } th { "bandwidth" } th { "sharing" } }
                    tr {
                        @for part in [score.total, score.compute, score.memory, score.network, score.thermal, score.bandwidth, score.sharing] {
                            td { (format!("{part:.3}")) }
                        }
                    }
                }
                table.parts {
                    tr { th { "token (ms)" } th { "weights" } th { "compute" } th { "layer overhead" } th { "all-reduce" } th { "hops" } th { "tokens/s" } }
                    tr {
                        @for part in [time.total_ms(), time.weights_ms, time.compute_ms, time.layer_overhead_ms, time.all_reduce_ms, time.hops_ms] {
                            td { (format!("{part:.2}")) }
                        }
                        td { (format!("{:.1}", plan.performance.tokens_per_second)) }
                    }
                }
            }
        }
    }
}
