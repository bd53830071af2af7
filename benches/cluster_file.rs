//! Peak memory and time of reading the largest cluster file `tessera place`
//! accepts: 8,000 nodes of 8 GPUs with a link between every pair, just under
//! the reader's YAML node limit, through the same reader the CLI uses. Prints
//! the process's peak resident memory (VmHWM) with the file in memory, before
//! and after reading it; run with `cargo bench --bench cluster_file`.

#[allow(dead_code)]
mod support;

use std::fmt::Write;
use std::time::Instant;

use support::memory::status_kib;
use tessera::cli::input::{MAX_YAML_NODES, parse_cluster};

const NODES: usize = 8_000;
const GPUS: usize = 8;

fn cluster_text() -> String {
    let mut text = String::from("nodes:\n");
    for n in 0..NODES {
        let _ = write!(
            text,
            "- name: node-{n:05}\n  labels: {{topology.kubernetes.io/zone: zone-{}, topology.tessera.dev/rack: rack-{}}}\n  gpuState:\n    version: v1\n    backend: fake\n    devices:\n",
            n % 4,
            n % 40
        );
        for d in 0..GPUS {
            let _ = writeln!(
                text,
                "    - {{id: GPU-{n:05}-{d}, index: {d}, vendor: nvidia, product: NVIDIA H100 80GB HBM3, memoryTotalBytes: 85899345920, memoryFreeBytes: {}, fp16Tflops: 989.0, memoryBandwidthGbps: 3350.0, temperatureC: {}, powerW: 120.5, numaNode: {}, health: Healthy}}",
                85_899_345_920u64 - (n * 7 + d) as u64 * 1_048_576,
                40.0 + ((n + d) % 30) as f64 / 10.0,
                d / 4
            );
        }
        text.push_str("    links:\n");
        for a in 0..GPUS {
            for b in a + 1..GPUS {
                let _ = writeln!(
                    text,
                    "    - {{a: GPU-{n:05}-{a}, b: GPU-{n:05}-{b}, kind: nvlink, bandwidthGbps: 900.0}}"
                );
            }
        }
    }
    text
}

fn main() {
    let text = cluster_text();
    let before = status_kib("self", "VmHWM:");
    let start = Instant::now();
    let nodes = parse_cluster(&text, "generated").expect("the file is within the limits");
    let took = start.elapsed();
    let after = status_kib("self", "VmHWM:");
    assert_eq!(nodes.len(), NODES);
    println!(
        "cluster_file: {NODES} nodes x {GPUS} GPUs with all links, {:.1} MB of YAML (limit {MAX_YAML_NODES} YAML nodes): read in {:.2} s; peak RSS {:.0} MiB with the text loaded, {:.0} MiB after reading",
        text.len() as f64 / 1e6,
        took.as_secs_f64(),
        before as f64 / 1024.0,
        after as f64 / 1024.0
    );
}
