//! Simulated GPUs behind the agent's backend trait: eight devices of one
//! kind per node whose telemetry drifts the way real boards do. Temperature
//! walks within ±3 °C of the node's level, power follows load with a few
//! watts of noise, free memory falls when a shard loads its model and a
//! little with background use; a fault can be set and cleared.

use tessera::api::{LinkKind, Vendor};
use tessera::backend::{BackendError, DeviceInfo, DeviceLink, GpuBackend, RawHealth, Telemetry};

use crate::support::SplitMix64;

const GIB: u64 = 1 << 30;
pub(crate) const GPUS_PER_NODE: u32 = 8;

#[derive(Clone, Copy, Debug)]
pub(crate) struct Kind {
    pub(crate) name: &'static str,
    vendor: Vendor,
    product: &'static str,
    memory_gib: u64,
    tflops: f64,
    /// Dense FP8 TFLOPS, where the product has FP8 tensor cores (as the
    /// agents publish it).
    fp8_tflops: Option<f64>,
    bandwidth_gbps: f64,
    link: LinkKind,
    link_gbps: f64,
    idle_w: f64,
    busy_w: f64,
}

impl Kind {
    pub(crate) fn memory_bytes(self) -> u64 {
        self.memory_gib * GIB
    }
}

pub(crate) const KINDS: [(Kind, u32); 4] = [
    (
        Kind {
            name: "h100",
            vendor: Vendor::Nvidia,
            product: "NVIDIA H100 80GB HBM3",
            memory_gib: 80,
            tflops: 989.0,
            fp8_tflops: Some(1979.0),
            bandwidth_gbps: 3350.0,
            link: LinkKind::Nvlink,
            link_gbps: 900.0,
            idle_w: 70.0,
            busy_w: 600.0,
        },
        35,
    ),
    (
        Kind {
            name: "a100",
            vendor: Vendor::Nvidia,
            product: "NVIDIA A100-SXM4-40GB",
            memory_gib: 40,
            tflops: 312.0,
            fp8_tflops: None,
            bandwidth_gbps: 1555.0,
            link: LinkKind::Nvlink,
            link_gbps: 600.0,
            idle_w: 55.0,
            busy_w: 350.0,
        },
        25,
    ),
    (
        Kind {
            name: "mi300x",
            vendor: Vendor::Amd,
            product: "AMD Instinct MI300X",
            memory_gib: 192,
            tflops: 1307.0,
            fp8_tflops: Some(2615.0),
            bandwidth_gbps: 5300.0,
            link: LinkKind::Xgmi,
            link_gbps: 128.0,
            idle_w: 140.0,
            busy_w: 700.0,
        },
        15,
    ),
    (
        Kind {
            name: "rtx4090",
            vendor: Vendor::Nvidia,
            product: "NVIDIA GeForce RTX 4090",
            memory_gib: 24,
            tflops: 165.0,
            fp8_tflops: Some(330.0),
            bandwidth_gbps: 1008.0,
            link: LinkKind::Pcie,
            link_gbps: 32.0,
            idle_w: 25.0,
            busy_w: 400.0,
        },
        25,
    ),
];

/// Largest distance of a device's temperature from its node's level.
const TEMPERATURE_SPREAD_C: f64 = 3.0;
/// Background memory use (driver, monitoring) wanders within this.
const BACKGROUND_MAX: u64 = 768 << 20;

struct Board {
    info: DeviceInfo,
    temperature_c: f64,
    power_w: f64,
    background_used: u64,
    /// Memory a shard's model and KV cache hold.
    shard_used: u64,
    fault: Option<String>,
}

/// One node's GPUs.
pub(crate) struct SimGpus {
    kind: Kind,
    level_c: f64,
    boards: Vec<Board>,
    rng: SplitMix64,
}

impl SimGpus {
    pub(crate) fn new(node: &str, kind: Kind, seed: u64) -> Self {
        let mut rng = SplitMix64::new(seed);
        let level_c = 35.0 + rng.below(15) as f64;
        let boards = (0..GPUS_PER_NODE)
            .map(|index| Board {
                info: DeviceInfo {
                    id: format!("{node}-gpu{index}"),
                    index,
                    vendor: kind.vendor,
                    product: kind.product.to_string(),
                    memory_total_bytes: kind.memory_gib * GIB,
                    architecture: String::new(),
                    compute_units: 0,
                    fp16_tflops: kind.tflops,
                    fp8_tflops: kind.fp8_tflops,
                    fp4_tflops: None,
                    memory_bandwidth_gbps: kind.bandwidth_gbps,
                    pci_bus_id: format!("0000:{:02x}:00.0", 0x10 + index),
                    numa_node: Some(i32::from(index >= GPUS_PER_NODE / 2)),
                    mig: None,
                },
                temperature_c: level_c,
                power_w: kind.idle_w,
                background_used: 512 << 20,
                shard_used: 0,
                fault: None,
            })
            .collect();
        Self {
            kind,
            level_c,
            boards,
            rng,
        }
    }

    pub(crate) fn kind(&self) -> Kind {
        self.kind
    }

    /// One poll interval of drift.
    pub(crate) fn drift(&mut self) {
        for board in &mut self.boards {
            let busy = board.shard_used > 0;
            // Whole degrees, as NVML and ROCm SMI report them.
            let step = self.rng.below(3) as f64 - 1.0;
            let target = self.level_c + if busy { 2.0 } else { 0.0 };
            board.temperature_c = (board.temperature_c + step)
                .clamp(target - TEMPERATURE_SPREAD_C, target + TEMPERATURE_SPREAD_C);
            let base = if busy {
                self.kind.busy_w * 0.7
            } else {
                self.kind.idle_w
            };
            board.power_w = (base + self.rng.unit() * 0.05 * base).round();
            let wander = self.rng.below(65) << 20;
            board.background_used = (256 << 20) + wander.min(BACKGROUND_MAX);
        }
    }

    /// A shard holds `share` of the device's memory (or none: 0.0).
    pub(crate) fn load(&mut self, device: &str, share: f64) {
        if let Some(board) = self.boards.iter_mut().find(|b| b.info.id == device) {
            board.shard_used = (board.info.memory_total_bytes as f64 * share) as u64;
        }
    }

    pub(crate) fn set_fault(&mut self, device: &str, fault: Option<String>) {
        if let Some(board) = self.boards.iter_mut().find(|b| b.info.id == device) {
            board.fault = fault;
        }
    }

    fn board(&self, device: &DeviceInfo) -> Result<&Board, BackendError> {
        self.boards
            .iter()
            .find(|b| b.info.id == device.id)
            .ok_or_else(|| BackendError::Failed(format!("no simulated device {}", device.id)))
    }
}

impl GpuBackend for SimGpus {
    fn name(&self) -> &str {
        "fake"
    }

    fn devices(&mut self) -> Result<Vec<DeviceInfo>, BackendError> {
        Ok(self.boards.iter().map(|b| b.info.clone()).collect())
    }

    fn telemetry(&mut self, device: &DeviceInfo) -> Result<Telemetry, BackendError> {
        let board = self.board(device)?;
        let used = (board.background_used + board.shard_used).min(board.info.memory_total_bytes);
        Ok(Telemetry {
            temperature_c: Some(board.temperature_c),
            power_w: Some(board.power_w),
            graphics_clock_mhz: Some(1410),
            memory_clock_mhz: Some(1593),
            utilization_percent: Some(if board.shard_used > 0 { 60 } else { 0 }),
            memory_used_bytes: used,
            memory_free_bytes: board.info.memory_total_bytes - used,
            ..Telemetry::default()
        })
    }

    fn health(&mut self, device: &DeviceInfo) -> Result<RawHealth, BackendError> {
        Ok(match &self.board(device)?.fault {
            Some(reason) => RawHealth::Unhealthy(reason.clone()),
            None => RawHealth::Healthy,
        })
    }

    fn links(&mut self, devices: &[DeviceInfo]) -> Result<Vec<DeviceLink>, BackendError> {
        let mut links = Vec::new();
        for (at, a) in devices.iter().enumerate() {
            for b in &devices[at + 1..] {
                links.push(DeviceLink {
                    a: a.id.clone(),
                    b: b.id.clone(),
                    kind: self.kind.link,
                    bandwidth_gbps: self.kind.link_gbps,
                    p2p: true,
                });
            }
        }
        Ok(links)
    }
}
