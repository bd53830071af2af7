//! `tessera discover`: the node's GPUs as the agent sees them, and a summary of
//! a whole cluster's published GPU states.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use super::InputError;
use super::input::parse_cluster;
use super::render::write_rows;
use crate::backend::cuda_probe::{self, ProbeReport};
use crate::backend::detect::{DetectOptions, detect};
use crate::backend::health::{HealthPolicy, HealthTracker};
use crate::backend::registry::Registry;
use crate::backend::{GpuBackend, Snapshot, is_fallback_id, snapshot};
use tessera_core::api::{GIB, Health, LinkKind, MigState, NodeGpuState};
use tessera_core::translate::ClusterNode;

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum DiscoverOutput {
    Table,
    Json,
}

pub struct DiscoverArgs {
    pub detect: DetectOptions,
    /// Registry file; `None` neither reads nor writes one.
    pub registry: Option<PathBuf>,
    pub probe: bool,
    pub output: DiscoverOutput,
    pub health: HealthPolicy,
}

/// One discovery: backend state with the registry's stable IDs, and probe
/// results when asked for (reused from the registry when they cover the same
/// devices).
pub(crate) struct Discovery {
    pub(crate) snapshot: Snapshot,
    pub(crate) probe: Option<Result<ProbeReport, String>>,
}

pub(crate) struct Discoverer {
    backend: Box<dyn GpuBackend>,
    tracker: HealthTracker,
    registry: Option<(PathBuf, Registry)>,
    probe: bool,
}

impl Discoverer {
    pub(crate) fn new(args: &DiscoverArgs) -> Result<Self, InputError> {
        let backend = detect(&args.detect).map_err(|e| InputError(e.to_string()))?;
        let registry = args.registry.as_ref().map(|path| {
            let registry = Registry::load(path).unwrap_or_else(|| Registry::new(Vec::new()));
            (path.clone(), registry)
        });
        Ok(Self {
            backend,
            tracker: HealthTracker::new(args.health),
            registry,
            probe: args.probe,
        })
    }

    pub(crate) fn discover(&mut self) -> Result<Discovery, InputError> {
        let mut snap = snapshot(self.backend.as_mut()).map_err(|e| InputError(e.to_string()))?;
        if let Some((_, r)) = &self.registry {
            r.stabilize_snapshot(&mut snap, is_fallback_id);
        }
        self.tracker.apply(&mut snap, Instant::now());
        let infos: Vec<_> = snap.devices.iter().map(|d| d.info.clone()).collect();
        let mut probe = None;
        if self.probe {
            let cached = self
                .registry
                .as_ref()
                .and_then(|(_, r)| r.probe_for(&infos))
                .and_then(|v| serde_json::from_value::<ProbeReport>(v.clone()).ok());
            let result = match cached {
                Some(report) => Ok(report),
                None => cuda_probe::probe(&infos).map_err(|e| e.to_string()),
            };
            if let Ok(report) = &result {
                report.apply(&mut snap.links);
                if let Some((_, r)) = &mut self.registry {
                    r.probe = serde_json::to_value(report).ok();
                    r.probed_devices = infos.iter().map(|d| d.id.clone()).collect();
                }
            }
            probe = Some(result);
        }
        if let Some((path, r)) = &mut self.registry {
            r.devices = infos;
            if let Err(e) = r.save(path) {
                tracing::warn!(path = %path.display(), error = %e, "could not write the device registry");
            }
        }
        Ok(Discovery {
            snapshot: snap,
            probe,
        })
    }
}

fn now_rfc3339() -> String {
    k8s_openapi::jiff::Timestamp::now().to_string()
}

pub(crate) fn render(discovery: &Discovery, output: DiscoverOutput) -> String {
    let state = discovery.snapshot.to_gpu_state(Some(now_rfc3339()));
    match output {
        DiscoverOutput::Json => serde_json::to_string_pretty(&state).unwrap_or_default() + "\n",
        DiscoverOutput::Table => table(&state, discovery.probe.as_ref()),
    }
}

fn short(kind: LinkKind) -> &'static str {
    match kind {
        LinkKind::Nvlink => "NV",
        LinkKind::Xgmi => "XG",
        LinkKind::Pcie => "PCI",
        LinkKind::Unknown => "?",
    }
}

fn table(state: &NodeGpuState, probe: Option<&Result<ProbeReport, String>>) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "backend {}: {} GPU{}",
        state.backend,
        state.devices.len(),
        if state.devices.len() == 1 { "" } else { "s" }
    );
    let mut rows = vec![
        [
            "IDX",
            "ID",
            "PRODUCT",
            "MEMORY FREE/TOTAL",
            "TEMP",
            "POWER",
            "HEALTH",
        ]
        .map(String::from)
        .to_vec(),
    ];
    for device in &state.devices {
        rows.push(vec![
            device.index.to_string(),
            device.id.clone(),
            device.product.clone(),
            format!(
                "{:.1}/{:.1} GiB",
                device.memory_free_bytes as f64 / GIB,
                device.memory_total_bytes as f64 / GIB
            ),
            device
                .temperature_c
                .map_or("-".into(), |t| format!("{t:.0} °C")),
            device.power_w.map_or("-".into(), |p| format!("{p:.0} W")),
            match (&device.health, &device.health_reason) {
                (Health::Healthy, _) => "Healthy".into(),
                (_, Some(r)) => format!("Unhealthy: {r}"),
                (_, None) => "Unhealthy".into(),
            },
        ]);
        if let Some(mig) = &device.mig {
            rows.extend(mig_rows(mig));
        }
    }
    write_rows(&mut out, &rows);
    if state.devices.len() > 1 {
        let _ = writeln!(
            out,
            "\nlinks (NV = NVLink, XG = xGMI, PCI = PCIe, GB/s; - = through the host):"
        );
        let pos: BTreeMap<&str, usize> = state
            .devices
            .iter()
            .enumerate()
            .map(|(i, d)| (d.id.as_str(), i))
            .collect();
        let count = state.devices.len();
        let mut matrix = vec![vec!["-".to_string(); count]; count];
        for (i, row) in matrix.iter_mut().enumerate() {
            row[i] = "X".into();
        }
        for link in &state.links {
            if let (Some(&a), Some(&b)) = (pos.get(link.a.as_str()), pos.get(link.b.as_str())) {
                let cell = format!("{}{:.0}", short(link.kind), link.bandwidth_gbps);
                matrix[a][b] = cell.clone();
                matrix[b][a] = cell;
            }
        }
        let mut rows = vec![
            std::iter::once(String::new())
                .chain(state.devices.iter().map(|d| format!("GPU{}", d.index)))
                .collect::<Vec<_>>(),
        ];
        for (i, d) in state.devices.iter().enumerate() {
            rows.push(
                std::iter::once(format!("GPU{}", d.index))
                    .chain(matrix[i].iter().cloned())
                    .collect(),
            );
        }
        write_rows(&mut out, &rows);
    }
    match probe {
        None => {}
        Some(Err(e)) => {
            let _ = writeln!(out, "\nprobe: not run: {e}");
        }
        Some(Ok(report)) => {
            let _ = writeln!(out, "\nprobe (CUDA):");
            let mut rows = vec![
                ["ID", "VERIFIED", "HOST→GPU", "GPU→GPU", "NOTES"]
                    .map(String::from)
                    .to_vec(),
            ];
            let gbps = |v: Option<f64>| v.map_or("-".to_string(), |g| format!("{g:.1} GB/s"));
            for device in &report.devices {
                rows.push(vec![
                    device.id.clone(),
                    if device.verified {
                        "yes".into()
                    } else {
                        format!("no: {}", device.error.clone().unwrap_or_default())
                    },
                    gbps(device.host_to_device_gbps),
                    gbps(device.device_to_device_gbps),
                    device.notes.join("; "),
                ]);
            }
            write_rows(&mut out, &rows);
        }
    }
    out
}

/// A GPU's MIG mode and partitions, as rows under its own: nothing for a GPU
/// that has MIG but is not using it, and no health (a partition's is its GPU's).
fn mig_rows(mig: &MigState) -> Vec<Vec<String>> {
    let Some(why) = mig.why_not_whole() else {
        return Vec::new();
    };
    let mode = match mig.pending {
        Some(after) => format!("MIG {} → {}", on_off(mig.enabled), on_off(after)),
        None => format!("MIG {}", on_off(mig.enabled)),
    };
    let blank = || vec![String::new(); 4];
    let mut rows = vec![[vec![String::new(), mode, why], blank()].concat()];
    for (index, partition) in mig.partitions.iter().enumerate() {
        let branch = if index + 1 == mig.partitions.len() {
            "└"
        } else {
            "├"
        };
        let last = partition.placement_start + partition.placement_size.saturating_sub(1);
        let slices = if partition.placement_size > 1 {
            format!("slices {}-{last}", partition.placement_start)
        } else {
            format!("slice {}", partition.placement_start)
        };
        rows.push(
            [
                vec![
                    String::new(),
                    format!("{branch} {}", partition.id),
                    format!(
                        "{}: {slices} of {}, {} SMs",
                        partition.profile, mig.memory_slices, partition.multiprocessors
                    ),
                    format!("{:.1} GiB", partition.memory_total_bytes as f64 / GIB),
                ],
                vec![String::new(); 3],
            ]
            .concat(),
        );
    }
    rows
}

fn on_off(on: bool) -> &'static str {
    if on { "on" } else { "off" }
}

/// Runs one discovery, or refreshes every `interval` until interrupted.
pub fn run(args: &DiscoverArgs, watch: Option<Duration>) -> Result<(), InputError> {
    let mut discoverer = Discoverer::new(args)?;
    loop {
        let found = discoverer.discover()?;
        if watch.is_some() && args.output == DiscoverOutput::Table {
            // Clear the screen and home the cursor, like `watch`.
            print!("\x1b[2J\x1b[H{}\n\n", now_rfc3339());
        }
        print!("{}", render(&found, args.output));
        match watch {
            Some(interval) => std::thread::sleep(interval),
            None => return Ok(()),
        }
    }
}

/// Totals over many nodes' published states.
#[derive(Debug, PartialEq)]
pub struct ClusterSummary {
    pub(crate) nodes: usize,
    pub(crate) devices: usize,
    pub(crate) healthy: usize,
    pub(crate) memory_bytes: u64,
    pub(crate) free_bytes: u64,
    pub(crate) by_vendor: BTreeMap<String, usize>,
    pub(crate) by_product: BTreeMap<String, usize>,
    /// Fastest over slowest healthy device by FP16 throughput (1 = homogeneous).
    pub(crate) compute_ratio: f64,
    /// Largest over smallest device memory.
    pub(crate) memory_ratio: f64,
    /// The slowest GPU-to-GPU connection inside any multi-GPU node.
    pub(crate) bottleneck: Option<String>,
}

/// `tessera discover --summary`: the GPU states in `paths`, summarised as a table.
pub fn summary(paths: &[PathBuf]) -> Result<String, InputError> {
    let nodes = read_states(paths)?;
    Ok(render_summary(&summarize(&nodes)))
}

pub(crate) fn summarize(nodes: &[ClusterNode]) -> ClusterSummary {
    let mut summary = ClusterSummary {
        nodes: nodes.len(),
        devices: 0,
        healthy: 0,
        memory_bytes: 0,
        free_bytes: 0,
        by_vendor: BTreeMap::new(),
        by_product: BTreeMap::new(),
        compute_ratio: 1.0,
        memory_ratio: 1.0,
        bottleneck: None,
    };
    let (mut tf_min, mut tf_max) = (f64::INFINITY, 0.0f64);
    let (mut mem_min, mut mem_max) = (u64::MAX, 0u64);
    let mut slowest: Option<(f64, String)> = None;
    for node in nodes {
        let state = &node.gpu_state;
        for device in &state.devices {
            summary.devices += 1;
            summary.memory_bytes += device.memory_total_bytes;
            summary.free_bytes += device.memory_free_bytes;
            *summary
                .by_vendor
                .entry(device.vendor.to_string())
                .or_default() += 1;
            *summary
                .by_product
                .entry(device.product.clone())
                .or_default() += 1;
            mem_min = mem_min.min(device.memory_total_bytes);
            mem_max = mem_max.max(device.memory_total_bytes);
            if device.health == Health::Healthy {
                summary.healthy += 1;
                tf_min = tf_min.min(device.fp16_tflops);
                tf_max = tf_max.max(device.fp16_tflops);
            }
        }
        let ids: Vec<&str> = state.devices.iter().map(|d| d.id.as_str()).collect();
        for (index, first) in ids.iter().enumerate() {
            for second in &ids[index + 1..] {
                let link = state.links.iter().find(|l| {
                    (l.a == *first && l.b == *second) || (l.a == *second && l.b == *first)
                });
                let (gbps, what) = match link {
                    Some(link) => (
                        link.bandwidth_gbps,
                        format!(
                            "{} {:.0} GB/s",
                            format!("{:?}", link.kind).to_lowercase(),
                            link.bandwidth_gbps
                        ),
                    ),
                    None => (0.0, "no direct link (through the host)".to_string()),
                };
                if slowest.as_ref().is_none_or(|(g, _)| gbps < *g) {
                    slowest = Some((gbps, format!("{what} on {}", node.name)));
                }
            }
        }
    }
    if tf_max > 0.0 && tf_min.is_finite() && tf_min > 0.0 {
        summary.compute_ratio = tf_max / tf_min;
    }
    if mem_min > 0 && mem_max > 0 && mem_min != u64::MAX {
        summary.memory_ratio = mem_max as f64 / mem_min as f64;
    }
    summary.bottleneck = slowest.map(|(_, w)| w);
    summary
}

pub(crate) fn render_summary(summary: &ClusterSummary) -> String {
    let mut out = String::new();
    let list = |m: &BTreeMap<String, usize>| {
        m.iter()
            .map(|(k, v)| format!("{v}× {k}"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let _ = writeln!(out, "nodes:          {}", summary.nodes);
    let _ = writeln!(
        out,
        "devices:        {} ({} healthy)",
        summary.devices, summary.healthy
    );
    let _ = writeln!(
        out,
        "memory:         {:.1} GiB total, {:.1} GiB free",
        summary.memory_bytes as f64 / GIB,
        summary.free_bytes as f64 / GIB
    );
    let _ = writeln!(out, "vendors:        {}", list(&summary.by_vendor));
    let _ = writeln!(out, "products:       {}", list(&summary.by_product));
    let _ = writeln!(
        out,
        "heterogeneity:  {:.1}× compute (fastest/slowest healthy GPU), {:.1}× memory (largest/smallest)",
        summary.compute_ratio, summary.memory_ratio
    );
    let _ = writeln!(
        out,
        "bottleneck:     {}",
        summary.bottleneck.as_deref().unwrap_or("no multi-GPU node")
    );
    out
}

/// Reads states for the summary: cluster descriptions, `kubectl get nodes -o
/// yaml` output, or single NodeGpuState JSON files (named after the file).
pub(crate) fn read_states(paths: &[PathBuf]) -> Result<Vec<ClusterNode>, InputError> {
    let mut nodes = Vec::new();
    for path in paths {
        let origin = path.display().to_string();
        let text = super::input::read_input(path)?;
        let single = serde_json::from_str::<serde_json::Value>(&text)
            .ok()
            .filter(|v| v.get("version").is_some() && v.get("devices").is_some());
        if single.is_some() {
            let gpu_state =
                NodeGpuState::from_json(&text).map_err(|e| InputError(format!("{origin}: {e}")))?;
            nodes.push(ClusterNode {
                name: node_name(path),
                labels: BTreeMap::new(),
                gpu_state,
            });
        } else {
            nodes.extend(parse_cluster(&text, &origin)?);
        }
    }
    Ok(nodes)
}

fn node_name(path: &Path) -> String {
    path.file_stem()
        .map(|stem| stem.to_string_lossy().into_owned())
        .unwrap_or_else(|| path.display().to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::detect::BackendChoice;

    fn fake_args(spec: &str) -> DiscoverArgs {
        DiscoverArgs {
            detect: DetectOptions {
                choice: BackendChoice::Fake,
                fake: Some(spec.into()),
                ..DetectOptions::default()
            },
            registry: None,
            probe: false,
            output: DiscoverOutput::Table,
            health: HealthPolicy::default(),
        }
    }

    #[test]
    fn table_lists_devices_and_the_link_matrix() {
        let mut d = Discoverer::new(&fake_args("2xH100-80GiB,1xRTX4090-24GiB")).unwrap();
        let text = render(&d.discover().unwrap(), DiscoverOutput::Table);
        assert!(text.starts_with("backend fake: 3 GPUs"), "{text}");
        assert!(text.contains("NVIDIA H100 80GB HBM3"), "{text}");
        assert!(text.contains("79.5/80.0 GiB"), "{text}");
        assert!(text.contains("NV900"), "{text}");
        assert!(text.contains("PCI64"), "{text}");
    }

    #[test]
    fn json_is_the_published_state() {
        let mut d = Discoverer::new(&fake_args("2xMI300X-192GiB")).unwrap();
        let text = render(&d.discover().unwrap(), DiscoverOutput::Json);
        let state = NodeGpuState::from_json(&text).unwrap();
        assert_eq!(state.devices.len(), 2);
        assert!(state.timestamp.is_some());
    }

    #[test]
    fn summary_of_the_sample_cluster() {
        let nodes = read_states(&[PathBuf::from(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/examples/cluster-mixed.yaml"
        ))])
        .unwrap();
        let s = summarize(&nodes);
        assert_eq!((s.nodes, s.devices, s.healthy), (4, 28, 27));
        assert_eq!(s.by_vendor["amd"], 8);
        assert!((s.compute_ratio - 1307.0 / 165.0).abs() < 1e-9);
        assert!((s.memory_ratio - 8.0).abs() < 1e-9);
        assert_eq!(s.bottleneck.as_deref(), Some("pcie 64 GB/s on a100-0"));
        let text = render_summary(&s);
        assert!(text.contains("28 (27 healthy)"), "{text}");
    }
}
