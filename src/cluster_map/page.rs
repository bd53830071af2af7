//! The map as HTML. Every text that comes from a cluster (names, reasons,
//! messages) goes through maud's splices, which escape it: a page never
//! carries markup it did not write itself. No script: the page is read-only
//! and works without JavaScript.
//!
//! A cell says little (the GPU's index, its holders, its marks) and a row
//! names its node's products once: the map of a thousand 8-GPU nodes stays
//! under a megabyte.

use std::collections::HashMap;
use std::fmt::Write as _;

use maud::{DOCTYPE, Markup, PreEscaped, html};

use super::instance_section::instance_section;
use super::links::{anchor, encode_segment};
use super::model::{ClusterView, Hold, MapInstance, MapNode, colour, too_hot, unhealthy};
use tessera_core::api::{GpuDevice, PlannedShard, ShareKind};

const STYLE: &str = include_str!("map.css");

type Holds<'v> = HashMap<(&'v str, &'v str), Vec<Hold<'v>>>;

fn page(title: &str, extra_style: &str, body: Markup) -> String {
    html! {
        (DOCTYPE)
        html lang="en" {
            head {
                meta charset="utf-8";
                meta name="viewport" content="width=device-width, initial-scale=1";
                title { "tessera · " (title) }
                style { (PreEscaped(STYLE)) (PreEscaped(extra_style)) }
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
    let body = html! {
        h1 { "tessera cluster map" }
        p.summary {
            (view.title) " · " (view.nodes.len()) " nodes · " (view.gpu_count()) " GPUs · "
            (view.instances.len()) " instances · " (holds.len()) " devices planned"
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
    page(&view.title, &colour_classes(view.instances.len()), body)
}

/// One instance's own page (the live map links to it).
pub(crate) fn instance_page(instance: &MapInstance) -> String {
    let body = html! {
        p { a href="../../" { "← cluster map" } }
        (instance_section(instance))
    };
    page(&instance.key(), "", body)
}

/// `.cN` gives the instance at index N its colour: once per page, not per cell.
fn colour_classes(instances: usize) -> String {
    let mut style = String::new();
    for index in 0..instances {
        let _ = write!(style, ".c{index}{{background:{}}}", colour(index));
    }
    style
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

fn legend(view: &ClusterView<'_>) -> Markup {
    html! {
        ul.legend {
            @for (index, instance) in view.instances.iter().enumerate() {
                li class={ "key c" (index) } data-instance=(instance.key()) {
                    a href=(instance_href(view, instance)) { (instance.key()) }
                    " " span.phase { (instance.phase) }
                    @if let Some(tps) = instance.predicted_tokens_per_second {
                        " · " (format!("{tps:.1}")) " tok/s"
                    }
                }
            }
            li.key.o { "held outside tessera" }
        }
    }
}

/// `8 × NVIDIA H100 80GB HBM3 · 80 GiB`, each kind of GPU the node has once.
fn kinds(devices: &[GpuDevice]) -> String {
    let mut kinds: Vec<(&str, u64, usize)> = Vec::new();
    for gpu in devices {
        let gib = gpu.memory_total_bytes >> 30;
        match kinds
            .iter_mut()
            .find(|(product, memory, _)| *product == gpu.product && *memory == gib)
        {
            Some(kind) => kind.2 += 1,
            None => kinds.push((&gpu.product, gib, 1)),
        }
    }
    let parts: Vec<String> = kinds
        .iter()
        .map(|(product, gib, count)| format!("{count} × {product} · {gib} GiB"))
        .collect();
    parts.join(", ")
}

fn node_row(view: &ClusterView<'_>, node: &MapNode<'_>, holds: &Holds<'_>) -> Markup {
    let name = node.node.name.as_str();
    let state = &node.node.gpu_state;
    html! {
        section.node.excluded[node.excluded.is_some()] data-node=(name) {
            h2 {
                (name) " " span.k { (kinds(&state.devices)) " · " (state.backend) }
                @if let Some(why) = &node.excluded {
                    " " span.m.x data-excluded=(why) { "excluded: " (why) }
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

fn gpu_cell(view: &ClusterView<'_>, node: &str, gpu: &GpuDevice, holds: &Holds<'_>) -> Markup {
    let sick = unhealthy(gpu);
    let hot = too_hot(gpu);
    let partitions = gpu
        .mig
        .as_ref()
        .filter(|m| m.enabled)
        .map(|m| &m.partitions);
    html! {
        div.g.bad[sick.is_some()].hot[hot.is_some()] {
            b { (gpu.index) }
            @if let Some(why) = &sick {
                p.m.u data-unhealthy=(why) { "unhealthy: " (why) }
            }
            @if let Some(t) = hot {
                p.m.w { "too hot: " (format!("{t:.0}")) " °C" }
            }
            @match partitions {
                Some(partitions) => {
                    @for partition in partitions {
                        div.p data-device=(partition.id) {
                            (partition.profile) " " (holders(view, node, &partition.id, holds))
                        }
                    }
                    @if partitions.is_empty() {
                        p.m { "MIG mode, no partitions" }
                    }
                }
                None => (holders(view, node, &gpu.id, holds)),
            }
        }
    }
}

/// Who holds `device`: tessera's shards, else someone outside tessera, else
/// nobody (an empty cell).
fn holders(view: &ClusterView<'_>, node: &str, device: &str, holds: &Holds<'_>) -> Markup {
    let planned = holds.get(&(node, device));
    let other = view.others.get(&(node.to_string(), device.to_string()));
    html! {
        @if let Some(planned) = planned {
            @for hold in planned {
                // The legend links to the instance: a link per cell would double the
                // page of a large cluster.
                span class={ "h c" (hold.colour) } {
                    (hold.instance.key()) " " (shard_label(hold.shard))
                    @if let Some(gib) = memory_share(hold.shard) {
                        " · " (gib) " GiB"
                    }
                }
            }
        } @else if let Some(who) = other {
            span.h.o data-held-by=(who) { "held by " (who) }
        }
    }
}

/// `shard 1`, or `replica 2 shard 1` after the first replica: what the map's
/// readers (and its browser test) find a shard by.
pub(crate) fn shard_label(shard: &PlannedShard) -> String {
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

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;
    use crate::cluster_map::model::{MapCondition, MapEvent};
    use tessera_core::api::{GpuPartition, Health, MigState, MoveInFlight, MovePhase, ShardShare};
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
            copy: 0,
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
            moves: Vec::new(),
            plan,
            predictions: vec![(0, Err(HOSTILE.into()))],
            curves: vec![(0, Err(HOSTILE.into()))],
            measured: Default::default(),
            target_tpot_ms: 50.0,
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

    /// The cell of GPU `index` of `node`, from its index to its end.
    fn cell<'p>(page: &'p str, node: &str, index: u32) -> &'p str {
        let row = &page[page.find(&format!("data-node=\"{node}\"")).unwrap()..];
        let row = &row[..row.find("</section>").unwrap()];
        let at = row.find(&format!("<b>{index}</b>")).unwrap();
        let end = row[at..].find("</div>").map_or(row.len(), |n| at + n);
        &row[at..end]
    }

    fn device(nodes: &[ClusterNode], node: &str, index: usize) -> String {
        let node = nodes.iter().find(|n| n.name == node).unwrap();
        node.gpu_state.devices[index].id.clone()
    }

    #[test]
    fn the_plan_table_shows_layers_inclusive_as_place_does() {
        let nodes = cluster();
        let page = instance_page(&instance(
            "llama",
            vec![shard("h100-0", &device(&nodes, "h100-0", 0), 0, 0)],
        ));
        assert!(page.contains("<td>0-31</td>"), "{page}");
        assert!(!page.contains("0–32") && !page.contains("0-32"), "{page}");
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
        hostile.moves = vec![MoveInFlight {
            replica: 0,
            phase: MovePhase::Surging,
            from: vec![shard("h100-0", &h100, 0, 0)],
            to: vec![shard("h100-0", &device(&nodes, "h100-0", 3), 0, 0)],
            started: HOSTILE.into(),
            reason: HOSTILE.into(),
            waiting: Some(HOSTILE.into()),
        }];
        let mut view = view(&nodes, vec![hostile], true);
        view.others.insert(
            ("h100-0".into(), device(&nodes, "h100-0", 1)),
            HOSTILE.into(),
        );
        for page in [cluster_page(&view), instance_page(&view.instances[0])] {
            assert!(!page.contains("<script"), "{page}");
            assert!(page.contains("&lt;script&gt;"), "{page}");
        }
        assert!(instance_page(&view.instances[0]).contains("Moves in flight"));
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
        assert!(cell(&page, "h100-0", 2).ends_with(">ml/llama shard 0</span>"));
        assert!(cell(&page, "mi300x-0", 5).ends_with(">ml/llama replica 1 shard 1</span>"));
        assert!(
            cell(&page, "mi300x-0", 4).ends_with("<b>4</b>"),
            "a free cell is empty"
        );
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
        assert!(
            page.contains(
                "<h2>a100-0 <span class=\"k\">4 × NVIDIA A100-PCIE-40GB · 40 GiB · fake</span>"
            ),
            "{page}"
        );
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
        assert!(
            page.contains(
                "data-device=\"MIG-p1\">3g.40gb <span class=\"h c1\">ml/part shard 0</span>"
            ),
            "{page}"
        );
        assert!(
            page.contains(".c1{background:hsl("),
            "the colour is a class, once"
        );
    }
}
