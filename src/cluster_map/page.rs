//! The map as HTML. Every text that comes from a cluster (names, reasons,
//! messages) goes through maud's splices, which escape it: a page never
//! carries markup it did not write itself. No script: the page is read-only
//! and works without JavaScript.

use maud::{DOCTYPE, Markup, PreEscaped, html};

use super::model::{
    ClusterView, Hold, MapInstance, MapNode, Prediction, colour, too_hot, unhealthy,
};
use tessera_core::api::{GpuDevice, PlannedShard, ShareKind};

const STYLE: &str = include_str!("map.css");

fn page(title: &str, body: Markup) -> String {
    html! {
        (DOCTYPE)
        html lang="en" {
            head {
                meta charset="utf-8";
                meta name="viewport" content="width=device-width, initial-scale=1";
                title { "tessera · " (title) }
                style { (PreEscaped(STYLE)) }
            }
            body { (body) }
        }
    }
    .into_string()
}

/// The whole cluster: a row of GPU cells per node. Offline (no instance
/// pages) every instance's details follow the map.
pub(crate) fn cluster_page(view: &ClusterView<'_>) -> String {
    let holds = view.holds();
    let held = holds.len();
    let body = html! {
        h1 { "tessera cluster map" }
        p.summary {
            (view.title) " · " (view.nodes.len()) " nodes · " (view.gpu_count()) " GPUs · "
            (view.instances.len()) " instances · " (held) " devices planned"
        }
        (legend(view))
        @for node in &view.nodes {
            (node_row(view, node, &holds))
        }
        @if !view.instance_pages {
            @for instance in &view.instances {
                (instance_section(instance))
            }
        }
    };
    page(&view.title, body)
}

/// One instance's own page (the live map links to it).
pub(crate) fn instance_page(instance: &MapInstance) -> String {
    let body = html! {
        p { a href="../../" { "← cluster map" } }
        (instance_section(instance))
    };
    page(&instance.key(), body)
}

fn instance_href(view: &ClusterView<'_>, instance: &MapInstance) -> String {
    if view.instance_pages {
        format!(
            "instances/{}/{}",
            encode_segment(&instance.namespace),
            encode_segment(&instance.name)
        )
    } else {
        format!("#{}", anchor(instance))
    }
}

fn anchor(instance: &MapInstance) -> String {
    format!("instance-{}", encode_segment(&instance.key()))
}

/// Percent-encodes everything but unreserved characters, for a path
/// segment or fragment (Kubernetes names need none, but a cluster file may).
fn encode_segment(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for byte in text.bytes() {
        if byte.is_ascii_alphanumeric() || b"-._~".contains(&byte) {
            out.push(byte as char);
        } else {
            out.push_str(&format!("%{byte:02X}"));
        }
    }
    out
}

fn legend(view: &ClusterView<'_>) -> Markup {
    html! {
        ul.legend {
            @for (index, instance) in view.instances.iter().enumerate() {
                li.key style={ "background:" (colour(index)) } data-instance=(instance.key()) {
                    a href=(instance_href(view, instance)) { (instance.key()) }
                    " " span.phase { (instance.phase) }
                    @if let Some(tps) = instance.predicted_tokens_per_second {
                        " · " (format!("{tps:.1}")) " tok/s"
                    }
                }
            }
            li.key.other { "held outside tessera" }
        }
    }
}

fn node_row(
    view: &ClusterView<'_>,
    node: &MapNode<'_>,
    holds: &std::collections::HashMap<(&str, &str), Vec<Hold<'_>>>,
) -> Markup {
    let name = node.node.name.as_str();
    let state = &node.node.gpu_state;
    html! {
        section.node.excluded[node.excluded.is_some()] data-node=(name) {
            h2 {
                (name)
                span.backend { " " (state.backend) }
                @if let Some(why) = &node.excluded {
                    " " span.mark.excluded data-excluded=(why) { "excluded: " (why) }
                }
            }
            div.gpus {
                @for gpu in &state.devices {
                    (gpu_cell(view, name, gpu, holds))
                }
                @if state.devices.is_empty() {
                    p.none { "no GPUs reported" }
                }
            }
        }
    }
}

fn gpu_cell(
    view: &ClusterView<'_>,
    node: &str,
    gpu: &GpuDevice,
    holds: &std::collections::HashMap<(&str, &str), Vec<Hold<'_>>>,
) -> Markup {
    let sick = unhealthy(gpu);
    let hot = too_hot(gpu);
    let memory_gib = gpu.memory_total_bytes as f64 / (1u64 << 30) as f64;
    let partitions = gpu
        .mig
        .as_ref()
        .filter(|m| m.enabled)
        .map(|m| &m.partitions);
    html! {
        div.gpu.unhealthy[sick.is_some()].hot[hot.is_some()] data-device=(gpu.id) {
            div.head {
                span.index { "GPU " (gpu.index) }
                " " span.product { (gpu.product) }
                " " span.memory { (format!("{memory_gib:.0}")) " GiB" }
            }
            @if let Some(why) = &sick {
                div.mark.bad data-unhealthy=(why) { "unhealthy: " (why) }
            }
            @if let Some(t) = hot {
                div.mark.warm { "too hot: " (format!("{t:.0}")) " °C" }
            }
            @match partitions {
                Some(partitions) => {
                    @for partition in partitions {
                        div.part data-device=(partition.id) {
                            span.profile { (partition.profile) }
                            (holders(view, node, &partition.id, holds))
                        }
                    }
                    @if partitions.is_empty() {
                        div.free { "MIG mode, no partitions" }
                    }
                }
                None => (holders(view, node, &gpu.id, holds)),
            }
        }
    }
}

/// Who holds `device`: tessera's shards, else someone outside tessera, else
/// nobody.
fn holders(
    view: &ClusterView<'_>,
    node: &str,
    device: &str,
    holds: &std::collections::HashMap<(&str, &str), Vec<Hold<'_>>>,
) -> Markup {
    let planned = holds.get(&(node, device));
    let other = view.others.get(&(node.to_string(), device.to_string()));
    html! {
        @if let Some(planned) = planned {
            @for hold in planned {
                div.hold style={ "background:" (colour(hold.colour)) }
                    data-instance=(hold.instance.key())
                    data-replica=(hold.shard.replica)
                    data-shard=(hold.shard.shard) {
                    a href=(instance_href(view, hold.instance)) { (hold.instance.key()) }
                    " " (shard_label(hold.shard))
                    @if let Some(gib) = memory_share(hold.shard) {
                        " · " (gib) " GiB"
                    }
                }
            }
        } @else if let Some(who) = other {
            div.hold.other data-held-by=(who) { "held by " (who) }
        } @else {
            div.free { "free" }
        }
    }
}

fn shard_label(shard: &PlannedShard) -> String {
    if shard.replica > 0 {
        format!("replica {} shard {}", shard.replica, shard.shard)
    } else {
        format!("shard {}", shard.shard)
    }
}

fn memory_share(shard: &PlannedShard) -> Option<u32> {
    let share = shard.share.as_ref()?;
    (share.kind == ShareKind::Memory).then_some(share.memory_gib?)
}

/// An instance's plan, predictions, conditions and last events.
fn instance_section(instance: &MapInstance) -> Markup {
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
                            td { (shard.layer_start) "–" (shard.layer_end) }
                            td { (format!("{:.1}", shard.predicted_memory_gib)) " GiB" }
                            td { (share_text(shard)) }
                        }
                    }
                }
            }
            @for (replica, prediction) in &instance.predictions {
                (prediction_table(*replica, prediction))
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

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;
    use crate::cluster_map::model::{MapCondition, MapEvent};
    use tessera_core::api::{GpuPartition, Health, MigState, ShardShare};
    use tessera_core::translate::ClusterNode;

    const HOSTILE: &str = "<script>alert(1)</script>";

    fn cluster() -> Vec<ClusterNode> {
        crate::cli::input::parse_cluster(
            include_str!("../../examples/cluster-mixed.yaml"),
            "cluster",
        )
        .unwrap()
    }

    fn shard(node: &str, device: &str, replica: u32, index: u32) -> PlannedShard {
        PlannedShard {
            replica,
            shard: index,
            node: node.into(),
            devices: vec![device.into()],
            layer_start: 0,
            layer_end: 32,
            predicted_memory_gib: 20.0,
            share: None,
        }
    }

    fn instance(name: &str, plan: Vec<PlannedShard>) -> MapInstance {
        MapInstance {
            namespace: "ml".into(),
            name: name.into(),
            model: "meta-llama/Llama-3.1-8B".into(),
            phase: "Running".into(),
            message: Some(format!("{HOSTILE} & more")),
            predicted_tokens_per_second: Some(120.0),
            plan,
            predictions: vec![(0, Err(HOSTILE.into()))],
            conditions: vec![MapCondition {
                type_: "Ready".into(),
                status: "False".into(),
                reason: "Hostile".into(),
                message: HOSTILE.into(),
            }],
            events: vec![MapEvent {
                time: "2026-11-28T10:00:00Z".into(),
                warning: true,
                reason: "Moved".into(),
                message: format!("\"{HOSTILE}\""),
            }],
        }
    }

    fn view<'a>(
        nodes: &'a [ClusterNode],
        instances: Vec<MapInstance>,
        live: bool,
    ) -> ClusterView<'a> {
        ClusterView {
            title: "test".into(),
            nodes: nodes
                .iter()
                .map(|node| MapNode {
                    node,
                    excluded: (node.name == "a100-0").then(|| format!("cordoned {HOSTILE}")),
                })
                .collect(),
            instances,
            others: HashMap::new(),
            instance_pages: live,
        }
    }

    fn device(nodes: &[ClusterNode], node: &str, index: usize) -> String {
        let node = nodes.iter().find(|n| n.name == node).unwrap();
        node.gpu_state.devices[index].id.clone()
    }

    #[test]
    fn every_text_from_the_cluster_is_escaped() {
        let mut nodes = cluster();
        nodes[0].gpu_state.devices[0].health = Health::Unhealthy;
        nodes[0].gpu_state.devices[0].health_reason = Some(HOSTILE.into());
        nodes[0].gpu_state.devices[1].product = HOSTILE.into();
        let h100 = device(&nodes, "h100-0", 0);
        let mut hostile = instance("llama", vec![shard("h100-0", &h100, 0, 0)]);
        hostile.name = format!("x\"><script>{}", "y");
        let mut view = view(&nodes, vec![hostile], true);
        view.others.insert(
            ("h100-0".into(), device(&nodes, "h100-0", 1)),
            HOSTILE.into(),
        );
        for page in [cluster_page(&view), instance_page(&view.instances[0])] {
            assert!(!page.contains("<script"), "{page}");
            assert!(page.contains("&lt;script&gt;"), "{page}");
        }
        let page = cluster_page(&view);
        // The instance's own page link is percent-encoded, not just escaped.
        assert!(page.contains("instances/ml/x%22%3E%3Cscript%3Ey"), "{page}");
    }

    #[test]
    fn each_planned_device_names_its_instance_and_shard() {
        let nodes = cluster();
        let (a, b) = (device(&nodes, "h100-0", 2), device(&nodes, "mi300x-0", 5));
        let llama = instance(
            "llama",
            vec![shard("h100-0", &a, 0, 0), shard("mi300x-0", &b, 1, 1)],
        );
        let page = cluster_page(&view(&nodes, vec![llama], false));
        for (device, replica, index) in [(&a, 0, 0), (&b, 1, 1)] {
            let cell = format!(
                "data-instance=\"ml/llama\" data-replica=\"{replica}\" data-shard=\"{index}\""
            );
            let at = page.find(&format!("data-device=\"{device}\"")).unwrap();
            let next = page[at..]
                .find("class=\"gpu")
                .map_or(page.len(), |n| at + n);
            assert!(
                page[at..next].contains(&cell),
                "{device}: {}",
                &page[at..next]
            );
        }
        assert!(page.contains("replica 1 shard 1"));
        for node in &nodes {
            assert!(page.contains(&format!("data-node=\"{}\"", node.name)));
        }
        // Offline, the instance's details are on the same page.
        assert!(page.contains("id=\"instance-ml%2Fllama\""), "{page}");
        assert!(page.contains("href=\"#instance-ml%2Fllama\""));
    }

    #[test]
    fn marks_say_what_needs_a_look() {
        let mut nodes = cluster();
        let rtx = nodes.iter().position(|n| n.name == "rtx4090-0").unwrap();
        let page = cluster_page(&view(&nodes, Vec::new(), true));
        // The sample has an unhealthy GPU (Xid 79) and a hot one.
        assert!(page.contains("data-unhealthy=\"Xid 79"), "{page}");
        assert!(page.contains("too hot: 88 °C"));
        assert!(page.contains("class=\"node excluded\" data-node=\"a100-0\""));
        assert!(page.contains("data-excluded=\"cordoned &lt;script&gt;"));

        // A user's claim, a MIG GPU's partitions and memory shares.
        let gpu = &mut nodes[rtx].gpu_state.devices[0];
        gpu.mig = Some(MigState {
            enabled: true,
            pending: None,
            memory_slices: 8,
            multiprocessors: 132,
            partitions: vec![GpuPartition {
                id: "MIG-p1".into(),
                profile: "3g.40gb".into(),
                memory_total_bytes: 40 << 30,
                multiprocessors: 60,
                placement_start: 0,
                placement_size: 4,
            }],
            profiles: Vec::new(),
        });
        let shared = device(&nodes, "rtx4090-0", 1);
        let mut memory = shard("rtx4090-0", &shared, 0, 0);
        memory.share = Some(ShardShare {
            kind: ShareKind::Memory,
            gpu: shared.clone(),
            profile: None,
            memory_gib: Some(9),
            memory_fraction: Some(0.375),
            tenants: 1,
            contended_tokens_per_second: None,
        });
        let partition = shard("rtx4090-0", "MIG-p1", 0, 0);
        let mut view = view(
            &nodes,
            vec![
                instance("small", vec![memory]),
                instance("part", vec![partition]),
            ],
            true,
        );
        view.others.insert(
            ("rtx4090-0".into(), device(&nodes, "rtx4090-0", 2)),
            "team/notebook".into(),
        );
        let page = cluster_page(&view);
        assert!(page.contains("data-held-by=\"team/notebook\""), "{page}");
        assert!(page.contains("shard 0 · 9 GiB"), "{page}");
        let at = page.find("data-device=\"MIG-p1\"").unwrap();
        assert!(
            page[at..].starts_with(
                "data-device=\"MIG-p1\"><span class=\"profile\">3g.40gb</span><div class=\"hold\""
            ),
            "{}",
            &page[at..at + 200]
        );
        assert!(page[at..at + 400].contains("data-instance=\"ml/part\""));
    }
}
