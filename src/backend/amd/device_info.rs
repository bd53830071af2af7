//! The [`DeviceInfo`] of one AMD GPU, put together from its KFD nodes, its
//! DRM device and the datasheet, by the decisions in the backend's docs (id,
//! product name, memory, FP16, memory bandwidth, NUMA node).

use super::super::DeviceInfo;
use super::drm::Card;
use super::estimates::{
    fp16_flops_per_cu_clock, gfx_target_name, memory_bandwidth, narrow_ratios, round1,
};
use super::kfd::Gpu;
use super::products::product;
use super::sysfs_files::{parse_i64, read_opt_i64, read_text};
use tessera_core::api::Vendor;

/// The device at position `index`; `None` for a GPU without KFD nodes.
pub(super) fn describe(gpu: &Gpu, card: Option<&Card>, index: u32) -> Option<DeviceInfo> {
    let first = gpu.first()?;
    let table = product(first.device_id);
    let device = card.map(|card| card.device.as_path());

    let product_name = device
        .and_then(|dir| read_text(&dir.join("product_name")).ok())
        .map(|name| name.trim().to_string())
        .filter(|name| !name.is_empty())
        .or_else(|| table.map(|datasheet| datasheet.name.to_string()))
        .unwrap_or_else(|| format!("AMD GPU {:#06x}", first.device_id));

    let kfd_vram: u64 = gpu.nodes.iter().map(|node| node.vram_bytes).sum();
    let drm_vram = device.and_then(|dir| {
        let path = dir.join("mem_info_vram_total");
        match read_opt_i64(&path) {
            Ok(Some(bytes)) if bytes > 0 => u64::try_from(bytes).ok(),
            Ok(_) => None,
            Err(error) => {
                tracing::warn!(%error, "using the KFD memory size instead");
                None
            }
        }
    });
    let memory_total_bytes = drm_vram.unwrap_or(kfd_vram);

    let compute_units: u64 = gpu.nodes.iter().map(|node| node.compute_units).sum();
    let compute_units = u32::try_from(compute_units).unwrap_or(u32::MAX);
    let gfx = first.gfx_target_version;
    let fp16_tflops = match f64::from(compute_units)
        * first.max_engine_clk_mhz as f64
        * f64::from(fp16_flops_per_cu_clock(gfx))
        / 1e6
    {
        tflops if tflops > 0.0 => round1(tflops),
        _ => table.map_or(0.0, |datasheet| datasheet.fp16_tflops),
    };
    let (fp8_ratio, fp4_ratio) = narrow_ratios(gfx);
    let narrow =
        |ratio: f64| (ratio > 0.0 && fp16_tflops > 0.0).then(|| round1(fp16_tflops * ratio));
    let memory_bandwidth_gbps = memory_bandwidth(gpu, table);

    let numa_node = device.and_then(|dir| {
        let path = dir.join("numa_node");
        let text = read_text(&path).ok()?;
        match parse_i64(&path, &text) {
            Ok(node) if node >= 0 => i32::try_from(node).ok(),
            Ok(_) => None,
            Err(error) => {
                tracing::warn!(%error, "NUMA node unknown");
                None
            }
        }
    });

    let unique_id = first.unique_id.or_else(|| {
        let text = read_text(&device?.join("unique_id")).ok()?;
        u64::from_str_radix(text.trim().trim_start_matches("0x"), 16)
            .ok()
            .filter(|unique| *unique != 0)
    });

    Some(DeviceInfo {
        id: unique_id.map_or_else(|| gpu.pci_bus_id.clone(), |unique| format!("{unique:#x}")),
        index,
        vendor: Vendor::Amd,
        product: product_name,
        memory_total_bytes,
        architecture: gfx_target_name(gfx),
        compute_units,
        fp16_tflops,
        fp8_tflops: narrow(fp8_ratio),
        fp4_tflops: narrow(fp4_ratio),
        memory_bandwidth_gbps,
        pci_bus_id: gpu.pci_bus_id.clone(),
        numa_node,
        mig: None,
    })
}
