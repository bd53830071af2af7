//! The speed model: how long one decoded token spends in one layer of a tensor
//! group, in parts a person can check. Calibrated against published
//! single-stream decode figures (docs/benchmarks.md, "Speed model
//! calibration"; the figures are a test fixture that fails when a prediction
//! drifts more than 25% from one). Every constant is one number for all
//! models and group sizes; what differs between GPUs comes from what a device
//! reports (vendor, FP16 TFLOPS, memory bandwidth) and what links it reports.

use super::precision::Precision;
use super::problem::{Device, Interconnect, ModelShape};

/// Share of datasheet FP16 TFLOPS a decode step reaches. Single-stream decode
/// is far from compute-bound on every calibration figure; this only matters
/// for devices with little compute per byte of bandwidth.
const COMPUTE_EFFICIENCY: f64 = 0.5;

/// Share of datasheet memory bandwidth a decode step reads weights at, by
/// vendor. NVIDIA 0.85: the weight-dominated figures (70B fp8 on 2 and 8 H100s)
/// land within 14% with it, and the H100 and A100 TP1 figures of one framework
/// then leave per-layer remainders (92 and 122 µs) whose ratio is the clock
/// ratio the overhead scales by (below). AMD 0.70: MI300X's GEMV kernels reach a
/// smaller share of its 5.3 TB/s; the 405B fp8 figure on 8 MI300X is met at
/// 0.70 with the overhead below (0.85 would predict it 10% fast). A vendor we
/// know nothing about gets the lower figure.
fn bandwidth_efficiency(vendor: &str) -> f64 {
    match vendor {
        "nvidia" => 0.85,
        _ => 0.70,
    }
}

/// Time every layer pays per token whatever the group size, on a device of
/// [`REFERENCE_TFLOPS`]: kernel launches, the small latency-bound kernels
/// (norms, rotary embedding, attention over a short context, activations,
/// residual adds) and synchronisation. From the TP1 figures after the weight
/// read: 92 µs per layer for Llama-2-7B on H100 under TensorRT-LLM 2023
/// (launch-bound, and 20 output tokens carry the prompt's prefill), 54 µs for
/// Llama-3-8B on H100 under SGLang with CUDA graphs; 70 µs sits between them.
const LAYER_OVERHEAD_S: f64 = 70e-6;

/// The device the overhead and all-reduce latencies are stated for (H100 SXM,
/// FP16 dense TFLOPS).
const REFERENCE_TFLOPS: f64 = 989.0;

/// Latency-bound work runs at the GPU's clock rather than its peak throughput.
/// The fourth root of the TFLOPS ratio tracks the boost-clock ratio of the
/// data-centre GPUs in the figures (A100 vs H100: 1.33 against 1.98/1.41 GHz =
/// 1.40; MI300X: 0.93 against 0.94), and the A100 figures of the same
/// framework and model need 1.3-1.4x the H100's per-layer time at TP1 and
/// TP8. Clamped so one odd telemetry value cannot dominate.
fn latency_scale(tflops: f64) -> f64 {
    (REFERENCE_TFLOPS / tflops).powf(0.25).clamp(0.5, 3.0)
}

/// Latency of one all-reduce of a token's activations over a link of this
/// kind, for a group of two, on the reference device. NVLink 15 µs: the
/// H100 figures of TensorRT-LLM 2023 leave 18-22 µs per all-reduce at TP2-8
/// once weights and overhead are taken out, SGLang's custom all-reduce 14 µs at
/// TP8. xGMI 20 µs (RCCL over xGMI; the MI300X 405B figure at TP8). PCIe 25 µs
/// (peer-to-peer over the host bridge; the two TP2 figures on PCIe cards). No
/// reported link: staged through host memory, 40 µs.
fn all_reduce_latency(kind: Option<Interconnect>) -> f64 {
    match kind {
        Some(Interconnect::NvLink) => 15e-6,
        Some(Interconnect::Xgmi) => 20e-6,
        Some(Interconnect::Pcie) => 25e-6,
        None => 40e-6,
    }
}

/// Added per doubling of the group beyond two (tree and ring steps): the H100
/// TensorRT-LLM figures rise by about 2 µs from TP2 to TP4 and again to TP8.
const ALL_REDUCE_STEP_S: f64 = 2e-6;

/// Bandwidth a tensor group's all-reduce gets from a link (GB/s); a missing
/// or unreported link is taken as PCIe Gen4 x8.
pub(crate) fn link_gbps(reported: Option<f64>) -> f64 {
    match reported {
        Some(gbps) if gbps > 0.0 => gbps,
        _ => 16.0,
    }
}

/// What the speed of one tensor group depends on: its slowest device and its
/// worst link.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct GroupSpeed {
    /// TFLOPS of the slowest device's matrix multiplications (its FP16
    /// rate, or a narrow format's in FP16 terms: `precision`).
    pub tflops: f64,
    /// The TFLOPS the latency-bound work scales by: the clock of the whole
    /// GPU, also for a MIG partition with a share of its multiprocessors.
    pub clock_tflops: f64,
    /// Bandwidth weights are read at (GB/s), after the vendor's efficiency,
    /// of the slowest device.
    pub weight_gbps: f64,
    /// For a group of two or more: its worst link.
    pub link: Option<LinkSpeed>,
}

/// A tensor group's worst link as the all-reduce sees it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct LinkSpeed {
    /// The reported GB/s.
    pub gbps: f64,
    /// One all-reduce's latency (s) for the reference device.
    pub latency: f64,
    /// Every pair has a link of its own
    /// ([`Interconnect::is_point_to_point`]).
    pub point_to_point: bool,
}

impl GroupSpeed {
    /// One device's figures.
    pub(crate) fn device(vendor: &str, tflops: f64, bandwidth_gbps: f64) -> Self {
        Self {
            tflops,
            clock_tflops: tflops,
            weight_gbps: bandwidth_gbps * bandwidth_efficiency(vendor),
            link: None,
        }
    }

    /// One device's speed for matrix multiplications in `precision`, at
    /// its GPU's clock.
    pub(crate) fn of(device: &Device, precision: Precision) -> Self {
        Self {
            clock_tflops: device.clock_tflops(),
            ..Self::device(
                &device.vendor,
                device.fp16_tflops,
                device.memory_bandwidth_gbps,
            )
        }
        .computing_at(device.tensor_rates().compute_tflops(precision))
    }

    /// With matrix multiplications at `tflops` (a narrow format's rate in
    /// FP16 terms); the clock stays the FP16 figure's.
    pub(crate) fn computing_at(self, tflops: f64) -> Self {
        Self { tflops, ..self }
    }

    /// The speed one of `tenants` decoding at once on the same GPU gets:
    /// compute and bandwidth split evenly, latencies unchanged.
    pub(crate) fn split(self, tenants: u32) -> Self {
        let share = f64::from(tenants.max(1));
        Self {
            tflops: self.tflops / share,
            weight_gbps: self.weight_gbps / share,
            ..self
        }
    }

    /// The slower of two groups' devices.
    pub(crate) fn slowest(self, other: Self) -> Self {
        Self {
            tflops: self.tflops.min(other.tflops),
            clock_tflops: self.clock_tflops.min(other.clock_tflops),
            weight_gbps: self.weight_gbps.min(other.weight_gbps),
            link: self.link,
        }
    }

    /// The faster of two groups' devices.
    pub(crate) fn fastest(self, other: Self) -> Self {
        Self {
            tflops: self.tflops.max(other.tflops),
            clock_tflops: self.clock_tflops.max(other.clock_tflops),
            weight_gbps: self.weight_gbps.max(other.weight_gbps),
            link: self.link,
        }
    }

    /// With a link of `kind` at `gbps` as the group's worst.
    pub(crate) fn with_link(self, gbps: f64, kind: Option<Interconnect>) -> Self {
        Self {
            link: Some(LinkSpeed {
                gbps,
                latency: all_reduce_latency(kind),
                point_to_point: kind.is_some_and(Interconnect::is_point_to_point),
            }),
            ..self
        }
    }
}

/// One layer's time for one token, by part, in seconds.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub(crate) struct LayerTime {
    /// Reading this device's share of the layer's weights.
    pub weights: f64,
    /// This device's share of the layer's FLOPs.
    pub compute: f64,
    /// Kernel launches, small kernels, synchronisation.
    pub overhead: f64,
    /// The two all-reduces of a tensor group (0 for one device).
    pub all_reduce: f64,
}

impl LayerTime {
    /// Weights and compute overlap; the rest comes on top.
    pub(crate) fn total(&self) -> f64 {
        self.weights.max(self.compute) + self.overhead + self.all_reduce
    }
}

/// Seconds one layer takes for one token on `tensor` devices.
pub(crate) fn layer_time(model: &ModelShape, tensor: u32, group: &GroupSpeed) -> LayerTime {
    let size = f64::from(tensor.max(1));
    let scale = latency_scale(group.clock_tflops);
    let mut time = LayerTime {
        weights: model.weight_bytes_per_layer / (size * group.weight_gbps * 1e9),
        compute: model.flops_per_layer_token / (size * group.tflops * 1e12 * COMPUTE_EFFICIENCY),
        overhead: LAYER_OVERHEAD_S * scale,
        all_reduce: 0.0,
    };
    if let Some(link) = group.link
        && tensor > 1
    {
        let doublings_beyond_two = (size / 2.0).log2().max(0.0);
        let latency = (link.latency + ALL_REDUCE_STEP_S * doublings_beyond_two) * scale;
        // A ring all-reduce moves 2(t-1)/t of the activations out of each
        // device: over its one link to a switch, or spread over its t - 1
        // links to the others.
        let links = if link.point_to_point { size - 1.0 } else { 1.0 };
        let transfer = 2.0 * (size - 1.0) / size * model.activation_bytes_per_token
            / (links * link.gbps * 1e9);
        // One after attention, one after the MLP.
        time.all_reduce = 2.0 * (latency + transfer);
    }
    time
}

#[cfg(test)]
mod tests {
    use super::*;

    fn model(params_billions: f64, layers: u32, bytes_per_param: f64) -> ModelShape {
        ModelShape {
            layers,
            weight_bytes_per_layer: params_billions * 1e9 * bytes_per_param / f64::from(layers),
            kv_bytes_per_layer: 0.0,
            overhead_bytes_per_device: 0.0,
            activation_bytes_per_token: 8192.0,
            flops_per_layer_token: 2.0 * params_billions * 1e9 / f64::from(layers),
            precision: crate::placement::Precision::Fp16,
        }
    }

    #[test]
    fn one_device_pays_weights_and_overhead_but_no_all_reduce() {
        let h100 = GroupSpeed::device("nvidia", 989.0, 3350.0);
        let time = layer_time(&model(7.0, 32, 2.0), 1, &h100);
        assert_eq!(time.all_reduce, 0.0);
        assert!((time.overhead - LAYER_OVERHEAD_S).abs() < 1e-15);
        let want = 7e9 * 2.0 / 32.0 / (3350e9 * 0.85);
        assert!((time.weights - want).abs() < 1e-12);
        assert!(time.weights > time.compute, "decode is bandwidth-bound");
        assert!((time.total() - (time.weights + time.overhead)).abs() < 1e-15);
    }

    #[test]
    fn a_group_divides_weights_and_adds_two_all_reduces_that_grow_with_its_size() {
        let shape = model(7.0, 32, 2.0);
        let group = |size: u32| {
            layer_time(
                &shape,
                size,
                &GroupSpeed::device("nvidia", 989.0, 3350.0)
                    .with_link(900.0, Some(Interconnect::NvLink)),
            )
        };
        let (two, eight) = (group(2), group(8));
        assert!((two.weights / eight.weights - 4.0).abs() < 1e-9);
        assert!(two.all_reduce >= 2.0 * 15e-6);
        assert!(eight.all_reduce > two.all_reduce);
        // Two doublings beyond two at 2 µs each, on both all-reduces.
        assert!((eight.all_reduce - two.all_reduce - 2.0 * 4e-6).abs() < 1e-7);
        // The overhead does not shrink with the group: past some size, more
        // GPUs buy little.
        assert_eq!(two.overhead, eight.overhead);
    }

    #[test]
    fn slower_links_and_slower_devices_pay_more_latency() {
        let shape = model(7.0, 32, 2.0);
        let over = |kind| {
            layer_time(
                &shape,
                2,
                &GroupSpeed::device("nvidia", 989.0, 3350.0).with_link(64.0, kind),
            )
            .all_reduce
        };
        assert!(over(Some(Interconnect::NvLink)) < over(Some(Interconnect::Xgmi)));
        assert!(over(Some(Interconnect::Xgmi)) < over(Some(Interconnect::Pcie)));
        assert!(over(Some(Interconnect::Pcie)) < over(None));
        let a100 = layer_time(&shape, 1, &GroupSpeed::device("nvidia", 312.0, 2039.0));
        assert!((a100.overhead / LAYER_OVERHEAD_S - (989.0f64 / 312.0).powf(0.25)).abs() < 1e-9);
    }

    #[test]
    fn a_point_to_point_mesh_moves_activations_over_every_link_at_once() {
        let shape = model(70.0, 80, 1.0);
        let transfer = |size, kind| {
            let group = GroupSpeed::device("amd", 1307.0, 5300.0).with_link(128.0, Some(kind));
            let full = layer_time(&shape, size, &group).all_reduce;
            let latency_only = layer_time(
                &ModelShape {
                    activation_bytes_per_token: 0.0,
                    ..shape.clone()
                },
                size,
                &group,
            )
            .all_reduce;
            full - latency_only
        };
        // Two GPUs have one link either way; eight of xGMI have seven each.
        let (mesh_two, switch_two) = (
            transfer(2, Interconnect::Xgmi),
            transfer(2, Interconnect::NvLink),
        );
        assert!((mesh_two - switch_two).abs() < 1e-15);
        let ratio = transfer(8, Interconnect::NvLink) / transfer(8, Interconnect::Xgmi);
        assert!((ratio - 7.0).abs() < 1e-9, "{ratio}");
    }

    #[test]
    fn vendors_read_at_their_own_efficiency() {
        let nvidia = GroupSpeed::device("nvidia", 1000.0, 5000.0);
        let amd = GroupSpeed::device("amd", 1000.0, 5000.0);
        let unknown = GroupSpeed::device("intel", 1000.0, 5000.0);
        assert!((nvidia.weight_gbps - 4250.0).abs() < 1e-9);
        assert!((amd.weight_gbps - 3500.0).abs() < 1e-9);
        assert_eq!(unknown.weight_gbps, amd.weight_gbps);
        let slowest = nvidia.slowest(amd);
        assert_eq!(slowest.weight_gbps, amd.weight_gbps);
        assert_eq!(nvidia.fastest(amd).weight_gbps, nvidia.weight_gbps);
    }
}
