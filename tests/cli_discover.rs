//! End-to-end tests of `tessera discover`: the node's GPUs (fake devices here,
//! so no test depends on the machine having GPUs), the registry, the cluster
//! summary, `--watch`, and bad input.
//!
//! Contract: exit 0 on success; 1 on any error (bad flag, no backend,
//! unreadable or malformed file) with exactly one `error: ...` line on stderr
//! and nothing on stdout. Never a panic.
//!
//! Every run points NVML at a library that does not exist and the AMD backend
//! at an empty sysfs tree, and removes `TESSERA_FAKE_GPUS` and `RUST_LOG` from
//! the child's environment unless a test sets them.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use serde_json::Value;

#[path = "common/cli.rs"]
mod cli;
use cli::{Scratch, assert_bad_input_result, finish};
use tessera::api::{Health, NodeGpuState};

const NO_NVML: &str = "/nonexistent/libnvidia-ml.so.1";
const MIXED: &str = "4xH100-80GiB,2xMI300X-192GiB";

/// `discover`'s scratch directories also hold an empty sysfs tree.
trait EmptySysfs {
    fn empty_sysfs(&self) -> String;
}

impl EmptySysfs for Scratch {
    /// An empty directory to use as `--sysfs-root` (no AMD GPUs in it).
    fn empty_sysfs(&self) -> String {
        let dir = self.0.join("sysfs");
        std::fs::create_dir_all(&dir).expect("create empty sysfs root");
        dir.display().to_string()
    }
}

fn repo_path(rel: &str) -> String {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join(rel)
        .display()
        .to_string()
}

/// The binary with a clean environment: no fake devices, no log level.
fn tessera(args: &[&str], env: &[(&str, &str)]) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_tessera"));
    cmd.args(args)
        .env_remove("TESSERA_FAKE_GPUS")
        .env_remove("NODE_NAME")
        .env_remove("RUST_LOG")
        .envs(env.iter().copied())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    cmd
}

/// Runs the built binary; returns (exit code, stdout, stderr).
fn run_env(args: &[&str], env: &[(&str, &str)]) -> (i32, String, String) {
    let out = tessera(args, env).output().expect("run the tessera binary");
    finish(args, out)
}

fn run(args: &[&str]) -> (i32, String, String) {
    run_env(args, &[])
}

/// Success: exit 0; returns stdout.
fn ok(args: &[&str]) -> String {
    let (code, stdout, stderr) = run(args);
    assert_eq!(
        code, 0,
        "tessera {args:?}: exit code\nstdout: {stdout}\nstderr: {stderr}"
    );
    stdout
}

/// Bad input: exit 1, nothing on stdout, one `error: ` line naming every `needle`.
fn assert_bad_input_env(args: &[&str], env: &[(&str, &str)], needles: &[&str]) {
    assert_bad_input_result(args, run_env(args, env), needles);
}

fn assert_bad_input(args: &[&str], needles: &[&str]) {
    assert_bad_input_env(args, &[], needles);
}

/// `discover` with no real backend available, plus `extra` flags.
fn discover_args<'a>(sysfs: &'a str, extra: &[&'a str]) -> Vec<&'a str> {
    let mut args = vec!["discover", "--nvml-library", NO_NVML, "--sysfs-root", sysfs];
    args.extend_from_slice(extra);
    args
}

/// The device rows of a discover table (lines starting with an index).
fn device_rows(table: &str) -> Vec<&str> {
    table
        .lines()
        .take_while(|l| !l.starts_with("links"))
        .filter(|l| {
            l.split_whitespace()
                .next()
                .is_some_and(|w| w.chars().all(|c| c.is_ascii_digit()))
        })
        .collect()
}

fn row_of<'a>(table: &'a str, id: &str) -> &'a str {
    device_rows(table)
        .into_iter()
        .find(|r| r.split_whitespace().nth(1) == Some(id))
        .unwrap_or_else(|| panic!("no row for {id}:\n{table}"))
}

fn ids(state: &Value) -> Vec<&str> {
    state["devices"]
        .as_array()
        .expect("devices")
        .iter()
        .map(|d| d["id"].as_str().expect("id"))
        .collect()
}

const FAULTS: &str = "gpus:
  - {profile: H100-80GiB, count: 4}
faults:
  - {device: 1, unhealthy: \"Xid 79\"}
  - {device: 2, temperatureC: 97}
  - {device: 3, vanish: true}
";

#[test]
fn fake_devices_table_shows_devices_products_and_links() {
    let dir = Scratch::new("cli-discover", "table");
    let sysfs = dir.empty_sysfs();
    let table = ok(&discover_args(
        &sysfs,
        &["--backend", "fake", "--fake", MIXED],
    ));
    assert!(table.starts_with("backend fake: 6 GPUs"), "{table}");
    let rows = device_rows(&table);
    assert_eq!(rows.len(), 6, "{table}");
    assert_eq!(
        rows.iter()
            .filter(|r| r.contains("NVIDIA H100 80GB HBM3"))
            .count(),
        4,
        "{table}"
    );
    assert_eq!(
        rows.iter()
            .filter(|r| r.contains("AMD Instinct MI300X"))
            .count(),
        2,
        "{table}"
    );
    assert!(rows.iter().all(|r| r.ends_with("  Healthy")), "{table}");
    let (_, links) = table.split_once("\nlinks").expect("a link matrix");
    assert!(links.contains("NV900"), "{table}");
    assert!(links.contains("XG128"), "{table}");
    assert!(links.contains("PCI64"), "H100 to MI300X is PCIe:\n{table}");
    for i in 0..6 {
        assert!(links.contains(&format!("GPU{i}")), "{table}");
    }
}

#[test]
fn fake_devices_json_is_the_published_state() {
    let dir = Scratch::new("cli-discover", "json");
    let sysfs = dir.empty_sysfs();
    let text = ok(&discover_args(
        &sysfs,
        &["--backend", "fake", "--fake", MIXED, "-o", "json"],
    ));
    let v: Value = serde_json::from_str(&text).expect("JSON output parses");
    assert_eq!(v["version"], "v1");
    assert_eq!(v["backend"], "fake");
    assert_eq!(
        ids(&v),
        [
            "fake-h100-80gib-0",
            "fake-h100-80gib-1",
            "fake-h100-80gib-2",
            "fake-h100-80gib-3",
            "fake-mi300x-192gib-4",
            "fake-mi300x-192gib-5",
        ]
    );
    let timestamp = v["timestamp"].as_str().expect("a timestamp");
    assert!(
        timestamp.parse::<k8s_openapi::jiff::Timestamp>().is_ok(),
        "not RFC 3339: {timestamp}"
    );
    let links = v["links"].as_array().expect("links");
    assert_eq!(links.len(), 15, "every pair of six devices: {links:?}");
    let kind = |a: &str, b: &str| {
        links
            .iter()
            .find(|l| (l["a"] == a && l["b"] == b) || (l["a"] == b && l["b"] == a))
            .map(|l| {
                (
                    l["kind"].as_str().unwrap(),
                    l["bandwidthGbps"].as_f64().unwrap(),
                )
            })
            .unwrap_or_else(|| panic!("no link {a}-{b}"))
    };
    assert_eq!(
        kind("fake-h100-80gib-0", "fake-h100-80gib-3"),
        ("nvlink", 900.0)
    );
    assert_eq!(
        kind("fake-mi300x-192gib-4", "fake-mi300x-192gib-5"),
        ("xgmi", 128.0)
    );
    assert_eq!(
        kind("fake-h100-80gib-1", "fake-mi300x-192gib-5"),
        ("pcie", 64.0)
    );

    let state = NodeGpuState::from_json(&text).expect("the library reads what discover prints");
    assert_eq!(state.devices.len(), 6);
    assert_eq!(state.links.len(), 15);
    assert!(state.devices.iter().all(|d| d.health == Health::Healthy));
}

#[test]
fn auto_falls_back_to_fake_devices_from_the_environment() {
    let dir = Scratch::new("cli-discover", "auto_env");
    let sysfs = dir.empty_sysfs();
    let args = discover_args(&sysfs, &["--backend", "auto", "-o", "json"]);
    let (code, stdout, stderr) = run_env(&args, &[("TESSERA_FAKE_GPUS", "2xL4-24GiB")]);
    assert_eq!(code, 0, "stdout: {stdout}\nstderr: {stderr}");
    let state = NodeGpuState::from_json(&stdout).expect("JSON output parses");
    assert_eq!(state.backend, "fake");
    assert_eq!(state.devices.len(), 2);
    assert!(
        state.devices.iter().all(|d| d.product == "NVIDIA L4"),
        "{stdout}"
    );

    let args = discover_args(&sysfs, &["--backend", "auto"]);
    let (code, table, stderr) = run_env(&args, &[("TESSERA_FAKE_GPUS", "2xL4-24GiB")]);
    assert_eq!(code, 0, "stderr: {stderr}");
    assert!(table.starts_with("backend fake: 2 GPUs"), "{table}");
}

#[test]
fn faults_from_a_fake_file_show_in_table_and_json() {
    let dir = Scratch::new("cli-discover", "faults");
    let sysfs = dir.empty_sysfs();
    let gpus = dir.file("gpus.yaml", FAULTS);

    let table = ok(&discover_args(
        &sysfs,
        &["--backend", "fake", "--fake", &gpus],
    ));
    assert!(
        table.starts_with("backend fake: 3 GPUs"),
        "device 3 vanished:\n{table}"
    );
    assert!(!table.contains("fake-h100-80gib-3"), "{table}");
    assert!(
        row_of(&table, "fake-h100-80gib-0").ends_with("  Healthy"),
        "{table}"
    );
    assert!(
        row_of(&table, "fake-h100-80gib-1").contains("Unhealthy: Xid 79"),
        "{table}"
    );
    let hot = row_of(&table, "fake-h100-80gib-2");
    assert!(hot.contains("97 °C"), "{table}");
    assert!(hot.contains("Unhealthy: too hot"), "{table}");

    let text = ok(&discover_args(
        &sysfs,
        &["--backend", "fake", "--fake", &gpus, "-o", "json"],
    ));
    let state = NodeGpuState::from_json(&text).expect("JSON output parses");
    let ids: Vec<&str> = state.devices.iter().map(|d| d.id.as_str()).collect();
    assert_eq!(
        ids,
        [
            "fake-h100-80gib-0",
            "fake-h100-80gib-1",
            "fake-h100-80gib-2"
        ]
    );
    let [d0, d1, d2] = &state.devices[..] else {
        unreachable!()
    };
    assert_eq!(
        (d0.health, d0.health_reason.as_deref()),
        (Health::Healthy, None)
    );
    assert_eq!(d1.health, Health::Unhealthy);
    assert_eq!(d1.health_reason.as_deref(), Some("Xid 79"));
    assert_eq!(d2.temperature_c, Some(97.0));
    assert_eq!(
        d2.health,
        Health::Unhealthy,
        "97 °C is above the 90 °C limit"
    );
    let reason = d2.health_reason.as_deref().unwrap_or_default();
    assert!(
        reason.contains("too hot") && reason.contains("90 °C limit"),
        "{reason}"
    );
    assert_eq!(
        state.links.len(),
        3,
        "links among the three present devices"
    );
    assert!(
        state
            .links
            .iter()
            .all(|l| l.a != "fake-h100-80gib-3" && l.b != "fake-h100-80gib-3"),
        "{text}"
    );
}

const MIG: &str = "gpus:
  - {profile: H100-80GiB, mig: {partitions: [3g.40gb, 2g.20gb, 1g.10gb]}}
  - {profile: A100-80GiB, mig: {pending: true}}
  - {profile: L4-24GiB}
";

#[test]
fn mig_partitions_show_under_their_gpu_in_table_and_json() {
    let dir = Scratch::new("cli-discover", "mig");
    let sysfs = dir.empty_sysfs();
    let gpus = dir.file("gpus.yaml", MIG);

    let table = ok(&discover_args(
        &sysfs,
        &["--backend", "fake", "--fake", &gpus],
    ));
    assert!(table.starts_with("backend fake: 3 GPUs"), "{table}");
    assert_eq!(
        device_rows(&table).len(),
        3,
        "partitions are no GPUs:\n{table}"
    );
    let lines: Vec<&str> = table.lines().collect();
    let gpu0 = lines
        .iter()
        .position(|l| l.contains("fake-h100-80gib-0 "))
        .unwrap_or_else(|| panic!("no GPU 0:\n{table}"));
    let under: Vec<Vec<&str>> = lines[gpu0 + 1..gpu0 + 5]
        .iter()
        .map(|l| l.split_whitespace().collect())
        .collect();
    assert_eq!(
        under[0][..2],
        ["MIG", "on"],
        "the mode under the GPU:\n{table}"
    );
    assert!(
        lines[gpu0 + 1].contains("offered as its 3 partitions"),
        "{table}"
    );
    for (row, (id, profile, slices, memory)) in under[1..].iter().zip([
        (
            "MIG-fake-h100-80gib-0-0-3g.40gb",
            "3g.40gb:",
            "slices 0-3 of 8, 60 SMs",
            "39.5",
        ),
        (
            "MIG-fake-h100-80gib-0-4-2g.20gb",
            "2g.20gb:",
            "slices 4-5 of 8, 32 SMs",
            "19.6",
        ),
        (
            "MIG-fake-h100-80gib-0-6-1g.10gb",
            "1g.10gb:",
            "slice 6 of 8, 16 SMs",
            "9.8",
        ),
    ]) {
        let text = row.join(" ");
        assert_eq!(row[1], id, "{table}");
        assert_eq!(row[2], profile, "{table}");
        assert!(text.contains(slices), "{text}");
        assert!(
            text.ends_with(&format!("{memory} GiB")),
            "no health of its own: {text}"
        );
    }
    assert!(under[3][0] == "└" && under[1][0] == "├", "{table}");
    let gpu1 = lines
        .iter()
        .position(|l| l.contains("fake-a100-80gib-1 "))
        .unwrap_or_else(|| panic!("no GPU 1:\n{table}"));
    assert!(
        lines[gpu1 + 1].contains("MIG off → on")
            && lines[gpu1 + 1].contains("MIG mode change to on pending a GPU reset"),
        "{table}"
    );
    assert!(
        lines[gpu1 + 2].contains("fake-l4-24gib-2"),
        "nothing under a GPU without MIG:\n{table}"
    );

    let text = ok(&discover_args(
        &sysfs,
        &["--backend", "fake", "--fake", &gpus, "-o", "json"],
    ));
    let v: Value = serde_json::from_str(&text).expect("JSON output parses");
    let mig = &v["devices"][0]["mig"];
    assert_eq!(mig["enabled"], true);
    assert_eq!(mig["memorySlices"], 8);
    assert_eq!(mig["multiprocessors"], 132);
    let partitions = mig["partitions"].as_array().expect("partitions");
    assert_eq!(partitions.len(), 3);
    assert_eq!(partitions[1]["id"], "MIG-fake-h100-80gib-0-4-2g.20gb");
    assert_eq!(partitions[1]["profile"], "2g.20gb");
    assert_eq!(partitions[1]["placementStart"], 4);
    assert_eq!(partitions[1]["placementSize"], 2);
    assert_eq!(partitions[1]["memoryTotalBytes"], 20096u64 << 20);
    assert_eq!(partitions[1]["multiprocessors"], 32);
    assert_eq!(v["devices"][1]["mig"]["pending"], true);
    assert!(v["devices"][2].get("mig").is_none(), "{text}");
    let state = NodeGpuState::from_json(&text).expect("the library reads what discover prints");
    let a100 = state.devices[1].mig.as_ref().expect("the A100's MIG state");
    assert!(!a100.whole() && a100.usable_partitions().is_empty());
}

#[test]
fn bad_mig_layouts_are_bad_input() {
    let dir = Scratch::new("cli-discover", "bad_mig");
    let sysfs = dir.empty_sysfs();
    for (name, text, needles) in [
        (
            "unknown.yaml",
            "gpus: [{profile: H100-80GiB, mig: {partitions: [5g.50gb]}}]\n",
            &[
                "gpus[0].mig.partitions[0]",
                "unknown MIG profile \"5g.50gb\"",
                "3g.40gb",
            ][..],
        ),
        (
            "overlap.yaml",
            "gpus: [{profile: A100-40GiB, mig: {partitions: [\"4g.20gb@0\", \"3g.20gb@0\"]}}]\n",
            &[
                "gpus[0].mig.partitions[1]",
                "3g.20gb@0 overlaps 4g.20gb@0 on memory slice 0",
            ],
        ),
        (
            "amd.yaml",
            "gpus: [{profile: MI300X-192GiB, mig: {pending: true}}]\n",
            &["gpus[0].mig", "MI300X-192GiB has no MIG"],
        ),
        (
            "type.yaml",
            "gpus: [{profile: H100-80GiB, mig: {enabled: sometimes}}]\n",
            &["gpus[0].mig.enabled", "invalid boolean"],
        ),
    ] {
        let path = dir.file(name, text);
        let mut wanted = vec![path.as_str()];
        wanted.extend_from_slice(needles);
        assert_bad_input(
            &discover_args(&sysfs, &["--backend", "fake", "--fake", &path]),
            &wanted,
        );
    }
}

#[test]
fn registry_is_written_and_a_corrupt_one_is_replaced() {
    let dir = Scratch::new("cli-discover", "registry");
    let sysfs = dir.empty_sysfs();
    let reg = dir.path("reg.json");
    let args = discover_args(
        &sysfs,
        &[
            "--backend",
            "fake",
            "--fake",
            "2xH100-80GiB",
            "--registry",
            &reg,
        ],
    );
    let check = |why: &str| {
        let text = std::fs::read_to_string(&reg)
            .unwrap_or_else(|e| panic!("{why}: registry {reg} not written: {e}"));
        let v: Value = serde_json::from_str(&text)
            .unwrap_or_else(|e| panic!("{why}: registry is not JSON ({e}):\n{text}"));
        assert_eq!(
            ids(&v),
            ["fake-h100-80gib-0", "fake-h100-80gib-1"],
            "{why}: {text}"
        );
        assert!(
            !Path::new(&format!("{reg}.tmp")).exists(),
            "{why}: temp file left over"
        );
    };

    let table = ok(&args);
    assert!(table.starts_with("backend fake: 2 GPUs"), "{table}");
    check("fresh");

    std::fs::write(&reg, "{").expect("corrupt the registry");
    let (code, stdout, stderr) = run(&args);
    assert_eq!(
        code, 0,
        "a corrupt registry is a cache miss, not an error\nstderr: {stderr}"
    );
    assert!(stdout.starts_with("backend fake: 2 GPUs"), "{stdout}");
    assert!(!stderr.contains("error:"), "{stderr}");
    check("after a corrupt registry");
    // The corrupt file is kept for a person to read, and the warning says where.
    let aside = format!("{reg}.bad");
    assert_eq!(
        std::fs::read_to_string(&aside).ok().as_deref(),
        Some("{"),
        "the corrupt registry was not kept at {aside}"
    );
    assert!(
        stderr.contains(&aside),
        "the warning does not name {aside}: {stderr}"
    );
}

#[test]
fn summary_of_cluster_files_and_discover_json() {
    let mixed = repo_path("examples/cluster-mixed.yaml");
    let out = ok(&["discover", "--summary", &mixed]);
    assert!(out.contains("28 (27 healthy)"), "{out}");
    assert!(out.contains("8× amd"), "{out}");
    assert!(out.contains("bottleneck:"), "{out}");
    let nodes_line = out.lines().find(|l| l.starts_with("nodes:")).unwrap_or("");
    assert!(nodes_line.ends_with(" 4"), "{out}");

    let kubectl = repo_path("examples/cluster-mixed.kubectl.yaml");
    let from_kubectl = ok(&["discover", "--summary", &kubectl]);
    assert_eq!(from_kubectl, out, "both forms of the sample cluster agree");

    // A single NodeGpuState as printed by `discover -o json`, named after its file.
    let dir = Scratch::new("cli-discover", "summary");
    let sysfs = dir.empty_sysfs();
    let json = ok(&discover_args(
        &sysfs,
        &["--backend", "fake", "--fake", MIXED, "-o", "json"],
    ));
    let node = dir.file("node-a.json", &json);
    let out = ok(&["discover", "--summary", &node]);
    assert!(out.contains("6 (6 healthy)"), "{out}");
    assert!(out.contains("2× amd"), "{out}");
    assert!(out.contains("4× nvidia"), "{out}");
    assert!(
        out.contains("on node-a"),
        "the node is named after the file:\n{out}"
    );
    assert!(!out.contains("node-a.json"), "{out}");

    // Several files at once add up.
    let out = ok(&["discover", "--summary", &mixed, &node]);
    assert!(out.contains("34 (33 healthy)"), "{out}");
    assert!(out.contains("10× amd"), "{out}");
}

#[test]
fn no_backend_is_bad_input() {
    let dir = Scratch::new("cli-discover", "no_backend");
    let sysfs = dir.empty_sysfs();
    assert_bad_input(
        &discover_args(&sysfs, &["--backend", "auto"]),
        &["no GPU backend applies", "nvidia:", "amd:", NO_NVML],
    );
    // `auto` is the default.
    assert_bad_input(
        &discover_args(&sysfs, &[]),
        &["no GPU backend applies", "nvidia:", "amd:"],
    );
    assert_bad_input(
        &discover_args(&sysfs, &["--backend", "nvidia"]),
        &[NO_NVML, "runtimeClassName"],
    );
    assert_bad_input(&discover_args(&sysfs, &["--backend", "amd"]), &[&sysfs]);
    assert_bad_input(
        &discover_args(&sysfs, &["--backend", "fake"]),
        &["TESSERA_FAKE_GPUS", "--fake"],
    );
}

#[test]
fn a_fake_directory_gives_each_node_its_file() {
    let dir = Scratch::new("cli-discover", "fake_dir");
    let sysfs = dir.empty_sysfs();
    let profiles = dir.path("profiles");
    std::fs::create_dir_all(&profiles).expect("create the profiles directory");
    dir.file("profiles/default.yaml", "gpus: [{profile: L4-24GiB}]\n");
    dir.file(
        "profiles/kind-worker.yaml",
        "gpus: [{profile: H100-80GiB, count: 2}]\n",
    );
    let args = discover_args(
        &sysfs,
        &["--backend", "fake", "--fake", &profiles, "-o", "json"],
    );
    let json = |env: &[(&str, &str)]| -> Value {
        let (code, stdout, stderr) = run_env(&args, env);
        assert_eq!(code, 0, "{env:?}: {stderr}");
        serde_json::from_str(&stdout).expect("discover -o json prints JSON")
    };
    let worker = json(&[("NODE_NAME", "kind-worker")]);
    assert_eq!(ids(&worker), ["fake-h100-80gib-0", "fake-h100-80gib-1"]);
    // A node without a file of its own, and no node name at all: default.yaml.
    assert_eq!(
        ids(&json(&[("NODE_NAME", "kind-worker2")])),
        ["fake-l4-24gib-0"]
    );
    assert_eq!(ids(&json(&[])), ["fake-l4-24gib-0"]);
    // The same through auto and TESSERA_FAKE_GPUS.
    let (code, stdout, stderr) = run_env(
        &discover_args(&sysfs, &["--backend", "auto", "-o", "json"]),
        &[
            ("TESSERA_FAKE_GPUS", &profiles),
            ("NODE_NAME", "kind-worker"),
        ],
    );
    assert_eq!(code, 0, "{stderr}");
    let via_env: Value = serde_json::from_str(&stdout).expect("JSON");
    assert_eq!(ids(&via_env), ids(&worker));
}

#[test]
fn a_fake_directory_without_a_usable_file_is_bad_input() {
    let dir = Scratch::new("cli-discover", "fake_dir_bad");
    let sysfs = dir.empty_sysfs();
    let empty = dir.path("empty");
    std::fs::create_dir_all(&empty).expect("create an empty directory");
    let args = discover_args(&sysfs, &["--backend", "fake", "--fake", &empty]);
    let node_file = format!("{empty}/kind-worker.yaml");
    let default = format!("{empty}/default.yaml");
    assert_bad_input_env(
        &args,
        &[("NODE_NAME", "kind-worker")],
        &[&node_file, &default, "kind-worker"],
    );
    // Without a node name only default.yaml can apply, and the error says so.
    assert_bad_input(&args, &[&default, "no node name is known", "NODE_NAME"]);
    // Bad YAML and a file that is not text are named.
    let broken = dir.file("empty/default.yaml", "gpus: [\n");
    assert_bad_input(&args, &[&broken]);
    std::fs::write(&node_file, [0xff_u8, 0xfe, 0x00]).expect("write a binary file");
    assert_bad_input_env(&args, &[("NODE_NAME", "kind-worker")], &[&node_file]);
}

#[test]
fn bad_fake_devices_are_bad_input() {
    let dir = Scratch::new("cli-discover", "bad_fake");
    let sysfs = dir.empty_sysfs();
    assert_bad_input(
        &discover_args(&sysfs, &["--backend", "fake", "--fake", "4xB300"]),
        &["B300", "unknown profile", "H100-80GiB", "MI300X-192GiB"],
    );
    // The same through auto and the environment.
    assert_bad_input_env(
        &discover_args(&sysfs, &["--backend", "auto"]),
        &[("TESSERA_FAKE_GPUS", "4xB300")],
        &["B300", "known profiles"],
    );
    assert_bad_input(
        &discover_args(
            &sysfs,
            &["--backend", "fake", "--fake", "/nonexistent/gpus.yaml"],
        ),
        &["/nonexistent/gpus.yaml"],
    );
    let broken = dir.file("broken.yaml", "gpus: [\n");
    assert_bad_input(
        &discover_args(&sysfs, &["--backend", "fake", "--fake", &broken]),
        &[&broken],
    );
    let colour = dir.file(
        "colour.yaml",
        "gpus: [{profile: H100-80GiB, colour: red}]\n",
    );
    assert_bad_input(
        &discover_args(&sysfs, &["--backend", "fake", "--fake", &colour]),
        &[&colour, "colour"],
    );
    let fault = dir.file(
        "fault.yaml",
        "gpus: [{profile: H100-80GiB}]\nfaults: [{device: 4, vanish: true}]\n",
    );
    assert_bad_input(
        &discover_args(&sysfs, &["--backend", "fake", "--fake", &fault]),
        &[&fault, "device 4"],
    );
}

#[test]
fn bad_flags_are_bad_input() {
    let dir = Scratch::new("cli-discover", "bad_flags");
    let sysfs = dir.empty_sysfs();
    assert_bad_input(
        &discover_args(&sysfs, &["--backend", "quantum"]),
        &["quantum", "--backend"],
    );
    assert_bad_input(
        &discover_args(
            &sysfs,
            &[
                "--backend",
                "fake",
                "--fake",
                "1xL4-24GiB",
                "--interval",
                "0",
            ],
        ),
        &["--interval", "0"],
    );
    assert_bad_input(&discover_args(&sysfs, &["-o", "xml"]), &["xml", "--output"]);
    assert_bad_input(&discover_args(&sysfs, &["--bogus"]), &["--bogus"]);
    let mixed = repo_path("examples/cluster-mixed.yaml");
    assert_bad_input(
        &["discover", "--probe", "--summary", &mixed],
        &["--summary", "--probe"],
    );
    assert_bad_input(
        &["discover", "--summary", &mixed, "--watch"],
        &["--summary", "--watch"],
    );
}

#[test]
fn bad_summary_files_are_bad_input() {
    let dir = Scratch::new("cli-discover", "bad_summary");
    let missing = dir.path("missing.yaml");
    assert_bad_input(&["discover", "--summary", &missing], &[&missing]);

    // A discover -o json file of a version this build does not read.
    let sysfs = dir.empty_sysfs();
    let json = ok(&discover_args(
        &sysfs,
        &["--backend", "fake", "--fake", "2xH100-80GiB", "-o", "json"],
    ));
    let mut v: Value = serde_json::from_str(&json).expect("JSON output parses");
    v["version"] = "v2".into();
    let v2 = dir.file("node-v2.json", &v.to_string());
    assert_bad_input(&["discover", "--summary", &v2], &[&v2, "v2", "version"]);

    // The same inside a cluster description.
    let text = std::fs::read_to_string(repo_path("examples/cluster-mixed.yaml"))
        .expect("read the sample cluster");
    let changed = text.replacen("version: v1", "version: v2", 1);
    assert_ne!(changed, text);
    let cluster = dir.file("cluster-v2.yaml", &changed);
    assert_bad_input(
        &["discover", "--summary", &cluster],
        &[&cluster, "v2", "h100-0"],
    );

    let broken = dir.file("broken.yaml", "nodes: [\n");
    assert_bad_input(&["discover", "--summary", &broken], &[&broken]);
}

#[test]
fn probe_without_cuda_says_why_it_did_not_run() {
    if tessera::backend::cuda_probe::cuda_library_available() {
        println!("skipped: a CUDA driver library is present on this machine");
        return;
    }
    let dir = Scratch::new("cli-discover", "probe");
    let sysfs = dir.empty_sysfs();
    let table = ok(&discover_args(
        &sysfs,
        &["--backend", "fake", "--fake", "2xH100-80GiB", "--probe"],
    ));
    assert!(table.starts_with("backend fake: 2 GPUs"), "{table}");
    let line = table
        .lines()
        .find(|l| l.starts_with("probe: not run: "))
        .unwrap_or_else(|| panic!("no `probe: not run:` line:\n{table}"));
    let reason = line.trim_start_matches("probe: not run: ");
    assert!(reason.contains("libcuda"), "{line}");
    assert!(reason.contains("runtimeClassName"), "{line}");
}

/// Kills and reaps the child when dropped, so a failing test leaves no process.
struct KillOnDrop(Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn watch_refreshes_until_killed() {
    let dir = Scratch::new("cli-discover", "watch");
    let sysfs = dir.empty_sysfs();
    let args = discover_args(
        &sysfs,
        &[
            "--backend",
            "fake",
            "--fake",
            "2xH100-80GiB",
            "--watch",
            "--interval",
            "1",
        ],
    );
    let mut child = KillOnDrop(
        tessera(&args, &[])
            .spawn()
            .expect("start the tessera binary"),
    );
    let stdout = child.0.stdout.take().expect("stdout is piped");
    let (tx, rx) = mpsc::channel();
    // Ends by itself when the child dies and the pipe closes.
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            if tx.send(line).is_err() {
                break;
            }
        }
    });

    // A refresh is complete once its last device row has arrived.
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut seen = String::new();
    let mut tables = 0;
    while tables < 2 {
        let left = deadline.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok(Ok(line)) => {
                if line.split_whitespace().nth(1) == Some("fake-h100-80gib-1") {
                    tables += 1;
                }
                seen.push_str(&line);
                seen.push('\n');
            }
            Ok(Err(e)) => panic!("reading stdout: {e}\n{seen}"),
            Err(mpsc::RecvTimeoutError::Timeout) => {
                panic!("{tables} refresh(es) in 10 s, expected 2:\n{seen}")
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                let status = child.0.wait().expect("wait for tessera");
                let mut stderr = String::new();
                if let Some(mut pipe) = child.0.stderr.take() {
                    let _ = std::io::Read::read_to_string(&mut pipe, &mut stderr);
                }
                panic!(
                    "tessera exited ({status}) after {tables} refresh(es):\n{seen}\nstderr: {stderr}"
                );
            }
        }
    }
    assert_eq!(
        child.0.try_wait().expect("poll tessera"),
        None,
        "--watch keeps running"
    );
    drop(child);
    assert_eq!(seen.matches("backend fake: 2 GPUs").count(), 2, "{seen}");
    // Each refresh clears the screen first.
    assert_eq!(seen.matches("\x1b[2J\x1b[H").count(), 2, "{seen:?}");
    assert!(!seen.contains("panicked"), "{seen}");
}

#[test]
fn health_flags_set_the_thermal_limit_and_refuse_bad_values() {
    let table = ok(&[
        "discover",
        "--backend",
        "fake",
        "--fake",
        "2xL4-24GiB",
        "--max-temperature",
        "34.5",
    ]);
    // The fake L4s sit at 34 and 35 °C.
    assert!(
        row_of(&table, "fake-l4-24gib-0").contains("Healthy"),
        "{table}"
    );
    assert!(
        row_of(&table, "fake-l4-24gib-1").contains("too hot: reached the 34 °C limit"),
        "{table}"
    );
    for (flag, value) in [
        ("--max-temperature", "hot"),
        ("--max-temperature", "-5"),
        ("--max-temperature", "NaN"),
        ("--thermal-margin", "200"),
        ("--health-recovery", "-1"),
        ("--health-recovery", "100000"),
    ] {
        // `flag=value`, so that a negative number reaches the flag's own check.
        let arg = format!("{flag}={value}");
        assert_bad_input(
            &[
                "discover",
                "--backend",
                "fake",
                "--fake",
                "2xL4-24GiB",
                &arg,
            ],
            &[flag],
        );
    }
}
