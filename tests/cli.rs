//! End-to-end tests of the `tessera` binary: exit codes, what goes to stdout and
//! stderr, and the plans `tessera place` prints.
//!
//! Contract: exit 0 when every instance has a plan, 2 when one is unsatisfiable
//! (explained on stdout), 1 for bad input (one `error: ...` line on stderr and
//! nothing on stdout). Never a panic.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;

#[path = "common/cli.rs"]
mod cli;
use cli::{Scratch, assert_bad_input, instance, run};

fn repo_path(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(rel)
}

fn repo_file(rel: &str) -> String {
    std::fs::read_to_string(repo_path(rel)).expect("read a committed file")
}

const SMALL_MODEL: &str = "name: m, parametersBillions: 7, layers: 32";

/// Layer counts of the sample instances, by instance name.
fn sample_layers() -> BTreeMap<String, u64> {
    ["llama-7b", "llama-70b", "llama-405b"]
        .iter()
        .map(|name| {
            let doc: Value = serde_saphyr::from_str(&repo_file(&format!("examples/{name}.yaml")))
                .expect("sample instance parses");
            let layers = doc["spec"]["model"]["layers"].as_u64().expect("layers");
            (name.to_string(), layers)
        })
        .collect()
}

fn json_report(args: &[&str]) -> Value {
    let (code, stdout, stderr) = run(args, None);
    assert_eq!(
        code, 0,
        "tessera {args:?}\nstdout: {stdout}\nstderr: {stderr}"
    );
    serde_json::from_str(&stdout).expect("JSON output parses")
}

/// The output block of the README's quick start, as it stands there.
fn readme_quick_start_block() -> String {
    let readme = repo_file("README.md");
    let start = readme
        .find("```\ncluster: examples/cluster-mixed.yaml\n")
        .expect("the README's quick start shows `tessera place`'s output");
    let block = &readme[start + "```\n".len()..];
    block[..block.find("```").expect("the block ends")].to_string()
}

#[test]
fn the_readme_quick_start_shows_what_place_prints() {
    let (code, stdout, stderr) = run(&["place"], None);
    assert_eq!(code, 0, "stdout: {stdout}\nstderr: {stderr}");
    let shown = readme_quick_start_block();
    assert!(
        stdout == shown,
        "the README's quick start differs from `tessera place`; paste this into it:\n{stdout}"
    );
}

#[test]
fn sample_run_places_all_three_instances() {
    let report = json_report(&["place", "-o", "json"]);
    let placements = report["placements"].as_array().expect("placements");
    assert_eq!(placements.len(), 3);
    let layers = sample_layers();
    let mut devices = BTreeSet::new();
    let mut nodes = BTreeSet::new();
    for p in placements {
        let name = p["name"].as_str().expect("name");
        let stages = p["plan"]["stages"].as_array().expect("a plan with stages");
        assert!(!stages.is_empty(), "{name}: no stages");
        let mut next = 0;
        for s in stages {
            assert_eq!(
                s["layerStart"].as_u64(),
                Some(next),
                "{name}: gap or overlap"
            );
            let end = s["layerEnd"].as_u64().expect("layerEnd");
            assert!(end > next, "{name}: empty stage");
            next = end;
            let node = s["node"].as_str().expect("node").to_string();
            for d in s["devices"].as_array().expect("devices") {
                let d = d.as_str().expect("device id").to_string();
                assert!(
                    devices.insert((node.clone(), d.clone())),
                    "{node}/{d} planned twice"
                );
            }
            nodes.insert(node);
        }
        assert_eq!(
            Some(&next),
            layers.get(name),
            "{name}: stages do not cover all layers"
        );
    }

    let (code, table, stderr) = run(&["place"], None);
    assert_eq!(code, 0, "stderr: {stderr}");
    for name in layers.keys().chain(nodes.iter()) {
        assert!(
            table.contains(name.as_str()),
            "table lacks {name}:\n{table}"
        );
    }
    assert!(!table.contains("UNSATISFIABLE"), "{table}");

    let (code, yaml, stderr) = run(&["place", "-o", "yaml"], None);
    assert_eq!(code, 0, "stderr: {stderr}");
    let from_yaml: Value = serde_saphyr::from_str(&yaml).expect("YAML output parses");
    assert_eq!(from_yaml["placements"].as_array().map(Vec::len), Some(3));
}

#[test]
fn html_output_is_the_cluster_map_of_the_plan() {
    let (code, page, stderr) = run(&["place", "-o", "html"], None);
    assert_eq!(code, 0, "stderr: {stderr}");
    assert!(page.starts_with("<!DOCTYPE html>"), "{page}");
    // The cell of GPU `index` of `node`: from its index to its end.
    let cell = |node: &str, index: u64| {
        let row = &page[page.find(&format!("data-node=\"{node}\"")).expect(node)..];
        let row = &row[..row.find("</section>").unwrap()];
        let at = row.find(&format!("<b>{index}</b>")).unwrap();
        let end = row[at..].find("</div>").map_or(row.len(), |n| at + n);
        row[at..end].to_string()
    };
    let report = json_report(&["place", "-o", "json"]);
    for placement in report["placements"].as_array().unwrap() {
        let name = placement["name"].as_str().unwrap();
        let stages = placement["plan"]["stages"].as_array().unwrap();
        for (shard, stage) in stages.iter().enumerate() {
            for index in stage["deviceIndices"].as_array().unwrap() {
                let node = stage["node"].as_str().unwrap();
                let text = cell(node, index.as_u64().unwrap());
                assert!(
                    text.contains(&format!(">{name} shard {shard}</span>")),
                    "{node} GPU {index}: {text}"
                );
            }
        }
    }
    for node in ["a100-0", "h100-0", "mi300x-0", "rtx4090-0"] {
        assert!(page.contains(&format!("data-node=\"{node}\"")), "{node}");
    }
}

#[test]
fn kubectl_cluster_gives_the_same_plans_as_the_sample_cluster() {
    let kubectl = repo_path("examples/cluster-mixed.kubectl.yaml");
    let mut from_kubectl = json_report(&["place", "-o", "json", "-c", kubectl.to_str().unwrap()]);
    let mut from_sample = json_report(&["place", "-o", "json"]);
    assert_eq!(
        from_kubectl["cluster"].as_str(),
        kubectl.to_str(),
        "the report names the cluster file"
    );
    from_kubectl["cluster"] = Value::Null;
    from_sample["cluster"] = Value::Null;
    assert_eq!(from_kubectl, from_sample);
}

#[test]
fn malformed_yaml_is_bad_input() {
    let dir = Scratch::new("cli", "malformed_yaml");
    let path = dir.file("broken.yaml", "apiVersion: [tessera.dev/v1alpha1\n");
    assert_bad_input(&["place", "-f", &path], None, &[&path, "not valid YAML"]);
}

#[test]
fn unknown_field_is_bad_input() {
    let dir = Scratch::new("cli", "unknown_field");
    let path = dir.file(
        "colour.yaml",
        &instance(&format!("{SMALL_MODEL}, colour: red"), ""),
    );
    assert_bad_input(
        &["place", "-f", &path],
        None,
        &[&path, "unknown field", "spec.model.colour"],
    );
}

#[test]
fn out_of_range_model_numbers_are_bad_input() {
    let dir = Scratch::new("cli", "model_numbers");
    for (name, model, needles) in [
        (
            "negative-layers.yaml",
            "name: m, parametersBillions: 7, layers: -4",
            &["spec.model.layers", "-4"][..],
        ),
        (
            "zero-parameters.yaml",
            "name: m, parametersBillions: 0, layers: 32",
            &["model.parametersBillions: 0 is outside the allowed range 0.001 to 100000"][..],
        ),
        (
            "negative-kv-cache.yaml",
            "name: m, parametersBillions: 7, layers: 32, kvCacheGiB: -1",
            &["model.kvCacheGiB: -1 is outside"][..],
        ),
        // Each of these was accepted, or refused for a wrong reason, before the
        // limits came from one place.
        (
            "too-many-layers.yaml",
            "name: m, parametersBillions: 7, layers: 100001",
            &["model.layers: 100001 is outside the allowed range 1 to 100000"][..],
        ),
        (
            "huge-hidden-size.yaml",
            "name: m, parametersBillions: 7, layers: 32, hiddenSize: 2000000",
            &["model.hiddenSize: 2000000 is outside"][..],
        ),
        (
            "tiny-parameters.yaml",
            "name: m, parametersBillions: 0.0001, layers: 32",
            &["model.parametersBillions: 0.0001 is outside"][..],
        ),
        (
            "huge-parameters.yaml",
            "name: m, parametersBillions: 1e308, layers: 32",
            &["model.parametersBillions: 1e308 is outside"][..],
        ),
        (
            "huge-kv-cache.yaml",
            "name: m, parametersBillions: 7, layers: 32, kvCacheGiB: 1e308",
            &["model.kvCacheGiB: 1e308 is outside"][..],
        ),
        (
            "huge-overhead.yaml",
            "name: m, parametersBillions: 7, layers: 32, overheadGiB: 1e12",
            &["model.overheadGiB: 1e12 is outside"][..],
        ),
        (
            "weights-smaller-than-one-bit.yaml",
            "name: m, parametersBillions: 7, layers: 32, weightsGiB: 0.5",
            &["model.weightsGiB: 0.5 GiB is 0.077 bytes a parameter of 7 billion"][..],
        ),
        (
            "weights-in-words.yaml",
            "name: m, parametersBillions: 7, layers: 32, weightsGiB: thirteen",
            &["weightsGiB"][..],
        ),
        (
            "long-model-name.yaml",
            &format!(
                "name: {}, parametersBillions: 7, layers: 32",
                "m".repeat(300)
            ),
            &["model.name: 300 characters; it must have 1 to 253"][..],
        ),
        (
            "four-billion-layers.yaml",
            "name: m, parametersBillions: 7, layers: 4000000000",
            &["model.layers: 4000000000 is outside"][..],
        ),
    ] {
        let path = dir.file(name, &instance(model, ""));
        let mut all = vec![path.as_str()];
        all.extend_from_slice(needles);
        assert_bad_input(&["place", "-f", &path], None, &all);
    }
}

#[test]
fn malformed_speed_goals_are_bad_input() {
    let dir = Scratch::new("cli", "speed_goals");
    for (name, parallelism, needles) in [
        (
            "optimize-unknown.yaml",
            "{tensor: auto, optimize: fastest}",
            &["spec.parallelism.optimize", "fastest"][..],
        ),
        (
            "optimize-number.yaml",
            "{tensor: auto, optimize: 1}",
            &["spec.parallelism.optimize"][..],
        ),
        (
            "min-zero.yaml",
            "{tensor: auto, minTokensPerSecond: 0}",
            &["parallelism.minTokensPerSecond: 0 is outside the allowed range 0.001 to 1000000"][..],
        ),
        (
            "min-negative.yaml",
            "{tensor: auto, minTokensPerSecond: -20}",
            &["parallelism.minTokensPerSecond: -20 is outside"][..],
        ),
        (
            "min-huge.yaml",
            "{tensor: auto, minTokensPerSecond: 1e308}",
            &["parallelism.minTokensPerSecond: 1e308 is outside"][..],
        ),
        (
            "min-text.yaml",
            "{tensor: auto, minTokensPerSecond: fast}",
            &["spec.parallelism.minTokensPerSecond"][..],
        ),
    ] {
        let path = dir.file(
            name,
            &instance(SMALL_MODEL, &format!("  parallelism: {parallelism}\n")),
        );
        let mut all = vec![path.as_str()];
        all.extend_from_slice(needles);
        assert_bad_input(&["place", "-f", &path], None, &all);
    }
}

#[test]
fn a_refusal_names_only_the_target_missed_and_show_missed_plans_anyway() {
    let cluster = repo_path("tests/fixtures/long-prompt/two-h100.yaml");
    let long = repo_path("tests/fixtures/long-prompt/long-prompt-70b.yaml");
    let (cluster, long) = (cluster.to_string_lossy(), long.to_string_lossy());
    let (code, stdout, stderr) = run(&["place", "-c", &cluster, "-f", &long], None);
    assert_eq!(code, 2, "stdout: {stdout}\nstderr: {stderr}");
    // 20.4 ms a token meets the 50 ms target: only the first token misses.
    assert!(
        stdout.contains("against serving.maxTimeToFirstTokenMs 2000: "),
        "{stdout}"
    );
    assert!(!stdout.contains("maxTimePerOutputTokenMs"), "{stdout}");
    let (code, stdout, stderr) = run(
        &[
            "place",
            "-c",
            &cluster,
            "-f",
            &long,
            "--show-missed",
            "-o",
            "json",
        ],
        None,
    );
    assert_eq!(
        code, 2,
        "a plan missing its target is not placed as asked: {stderr}"
    );
    let report: Value = serde_json::from_str(&stdout).expect("JSON");
    let plan = &report["placements"][0]["plan"];
    let curve = plan["serving"]["curve"]
        .as_array()
        .expect("the curve is shown");
    assert!(!curve.is_empty(), "{plan}");
    let missed = &plan["serving"]["targetMissed"];
    assert!(missed["bestTtftMs"].as_f64().expect("best first token") > 2000.0);
    assert!(missed["bestTpotMs"].as_f64().expect("best per token") < 50.0);
    // The flag takes no value.
    assert_bad_input(
        &["place", "-c", &cluster, "-f", &long, "--show-missed=yes"],
        None,
        &["--show-missed"],
    );
}

#[test]
fn a_speed_nothing_reaches_is_unsatisfiable_and_the_goal_is_explained() {
    let dir = Scratch::new("cli", "speed_goal_place");
    let slow = dir.file(
        "slow.yaml",
        &instance(
            SMALL_MODEL,
            "  parallelism: {tensor: auto, minTokensPerSecond: 100000}\n",
        ),
    );
    let (code, stdout, stderr) = run(&["place", "-f", &slow], None);
    assert_eq!(code, 2, "stdout: {stdout}\nstderr: {stderr}");
    // A floor on every user's speed is a latency target: refused with the
    // best time per token there is and what would do.
    assert!(
        stdout.contains("against parallelism.minTokensPerSecond 100000 (0.01 ms per token)"),
        "{stdout}"
    );
    assert!(
        stdout.contains("lower parallelism.minTokensPerSecond to "),
        "{stdout}"
    );
    let fast = dir.file(
        "fast.yaml",
        &instance(
            SMALL_MODEL,
            "  parallelism: {tensor: auto, optimize: latency}\n",
        ),
    );
    let (code, stdout, stderr) = run(&["place", "-o", "json", "-f", &fast], None);
    assert_eq!(code, 0, "stdout: {stdout}\nstderr: {stderr}");
    let report: Value = serde_json::from_str(&stdout).expect("JSON output parses");
    let placement = &report["placements"][0];
    let note = placement["parallelism"]
        .as_str()
        .expect("auto explains its choice");
    assert!(note.contains("latency: the most tokens/s"), "{note}");
    let time = &placement["plan"]["performance"]["tokenTime"];
    for part in [
        "weightsMs",
        "computeMs",
        "layerOverheadMs",
        "allReduceMs",
        "hopsMs",
    ] {
        assert!(time[part].as_f64().is_some(), "{part} in {time}");
    }
}

#[test]
fn names_the_api_server_refuses_are_bad_input() {
    let dir = Scratch::new("cli", "instance_names");
    for (name, needle) in [
        (
            "\"My_Model!!\"",
            "metadata.name: \"My_Model!!\" (10 characters) is not a valid name",
        ),
        (&"m".repeat(300), "(300 characters) is not a valid name"),
        (&"m".repeat(53), "at most 52 characters"),
    ] {
        let text = instance(SMALL_MODEL, "").replace(
            "metadata: {name: m}",
            &format!("metadata: {{name: {name}}}"),
        );
        let path = dir.file("named.yaml", &text);
        assert_bad_input(&["place", "-f", &path], None, &[path.as_str(), needle]);
    }
}

#[test]
fn model_larger_than_the_cluster_is_unsatisfiable() {
    let dir = Scratch::new("cli", "too_large");
    let path = dir.file(
        "huge.yaml",
        &instance(
            "name: huge, parametersBillions: 5000, layers: 200",
            "  parallelism: {pipeline: auto}\n",
        ),
    );
    let (code, stdout, stderr) = run(&["place", "-f", &path], None);
    assert_eq!(code, 2, "stdout: {stdout}\nstderr: {stderr}");
    let line = stdout
        .lines()
        .find(|l| l.contains("UNSATISFIABLE"))
        .unwrap_or_else(|| panic!("no UNSATISFIABLE line:\n{stdout}"));
    assert!(line.contains("GiB"), "the reason gives sizes: {line}");
    assert!(!stderr.contains("error:"), "{stderr}");

    let (code, stdout, _) = run(&["place", "-o", "json", "-f", &path], None);
    assert_eq!(code, 2);
    let report: Value = serde_json::from_str(&stdout).expect("JSON output parses");
    let p = &report["placements"][0];
    assert!(p.get("plan").is_none(), "{p}");
    let reason = p["unsatisfiable"]["reason"].as_str().expect("a reason");
    assert!(reason.contains("GiB"), "{reason}");
}

#[test]
fn empty_cluster_is_unsatisfiable() {
    let dir = Scratch::new("cli", "empty_cluster");
    let mi = dir.file("mi.yaml", &instance(SMALL_MODEL, ""));
    let cluster = dir.file("cluster.yaml", "nodes: []\n");
    let (code, stdout, stderr) = run(&["place", "-f", &mi, "-c", &cluster], None);
    assert_eq!(code, 2, "stdout: {stdout}\nstderr: {stderr}");
    assert!(stdout.contains("UNSATISFIABLE"), "{stdout}");
    assert!(stdout.contains("no GPUs"), "{stdout}");
}

#[test]
fn unsupported_gpu_state_version_is_bad_input_in_both_cluster_formats() {
    let dir = Scratch::new("cli", "state_version");
    let mi = dir.file("mi.yaml", &instance(SMALL_MODEL, ""));
    // The first node in both sample files is h100-0.
    for (name, rel, from, to) in [
        (
            "nodes.yaml",
            "examples/cluster-mixed.yaml",
            "version: v1",
            "version: v2",
        ),
        (
            "kubectl.yaml",
            "examples/cluster-mixed.kubectl.yaml",
            r#""version":"v1""#,
            r#""version":"v2""#,
        ),
    ] {
        let original = repo_file(rel);
        let text = original.replacen(from, to, 1);
        assert_ne!(text, original, "{rel} has no {from}");
        let cluster = dir.file(name, &text);
        assert_bad_input(
            &["place", "-f", &mi, "-c", &cluster],
            None,
            &[&cluster, "version", "v2", "h100-0"],
        );
    }
}

#[test]
fn missing_files_are_bad_input() {
    let dir = Scratch::new("cli", "missing_file");
    let missing = dir.0.join("does-not-exist.yaml").display().to_string();
    assert_bad_input(&["place", "-f", &missing], None, &[&missing]);
    let mi = dir.file("mi.yaml", &instance(SMALL_MODEL, ""));
    assert_bad_input(&["place", "-f", &mi, "-c", &missing], None, &[&missing]);
}

#[test]
fn unknown_flag_is_bad_input() {
    assert_bad_input(&["place", "--bogus"], None, &["--bogus"]);
}

#[test]
fn malformed_flag_values_are_bad_input() {
    assert_bad_input(&["place", "-o", "xml"], None, &["xml", "--output"]);
    assert_bad_input(
        &["--log-format", "xml", "place"],
        None,
        &["xml", "--log-format"],
    );
    assert_bad_input(
        &["place", "--max-steps", "many"],
        None,
        &["many", "--max-steps"],
    );
    assert_bad_input(&["place", "-f"], None, &["--instance"]);
    assert_bad_input(&[], None, &["subcommand"]);
}

#[test]
fn zero_max_steps_is_bad_input() {
    assert_bad_input(&["place", "--max-steps", "0"], None, &["--max-steps"]);
}

#[test]
fn help_succeeds() {
    let (code, stdout, stderr) = run(&["place", "--help"], None);
    assert_eq!(code, 0, "stderr: {stderr}");
    assert!(stdout.contains("Usage"), "{stdout}");
    assert!(stderr.is_empty(), "{stderr}");
}

#[test]
fn crd_prints_the_committed_crd() {
    let (code, stdout, stderr) = run(&["crd"], None);
    assert_eq!(code, 0, "stderr: {stderr}");
    assert!(
        stdout == repo_file("crds/modelinstance.yaml"),
        "`tessera crd` differs from crds/modelinstance.yaml"
    );
}

#[test]
fn instance_from_stdin() {
    let text = instance("name: from-stdin, parametersBillions: 7, layers: 32", "");
    let (code, stdout, stderr) = run(&["place", "-o", "json", "-f", "-"], Some(&text));
    assert_eq!(code, 0, "stdout: {stdout}\nstderr: {stderr}");
    let report: Value = serde_json::from_str(&stdout).expect("JSON output parses");
    let placements = report["placements"].as_array().expect("placements");
    assert_eq!(placements.len(), 1);
    assert_eq!(placements[0]["model"], "from-stdin");
    assert!(placements[0]["plan"]["stages"].is_array(), "{report}");

    assert_bad_input(&["place", "-f", "-"], Some(""), &["no ModelInstance"]);
}

#[test]
fn impossible_parallelism_is_bad_input() {
    let dir = Scratch::new("cli", "parallelism");
    let path = dir.file(
        "pipeline.yaml",
        &instance(SMALL_MODEL, "  parallelism: {pipeline: 40}\n"),
    );
    assert_bad_input(
        &["place", "-f", &path],
        None,
        &[&path, "pipeline", "at least one layer"],
    );
    let path = dir.file(
        "tensor.yaml",
        &instance(SMALL_MODEL, "  parallelism: {tensor: 0}\n"),
    );
    assert_bad_input(&["place", "-f", &path], None, &[&path, "tensor"]);
}

#[test]
fn log_format_json_writes_json_lines_at_the_requested_level() {
    let out = Command::new(env!("CARGO_BIN_EXE_tessera"))
        .args(["place", "--log-format", "json"])
        .env("RUST_LOG", "info")
        .output()
        .expect("run tessera");
    assert_eq!(out.status.code(), Some(0));
    let stderr = String::from_utf8(out.stderr).expect("stderr is UTF-8");
    let lines: Vec<&str> = stderr.lines().collect();
    assert!(!lines.is_empty(), "info logs expected on stderr");
    for line in lines {
        let v: Value = serde_json::from_str(line).expect("every log line is JSON");
        assert_eq!(v["level"], "INFO");
    }
    // Without RUST_LOG the default level (warn) keeps stderr quiet.
    let (_, _, quiet) = run(&["place"], None);
    assert!(quiet.is_empty(), "{quiet}");
}

#[test]
fn replicas_strategy_and_auto_parallelism_refuse_bad_values_naming_the_field() {
    let dir = Scratch::new("cli", "serving");
    for (name, extra, needles) in [
        ("negative.yaml", "  replicas: -1\n", &["replicas", "-1"][..]),
        (
            "absurd.yaml",
            "  replicas: 100000\n",
            &["replicas: 100000 is outside the allowed range 0 to 256"][..],
        ),
        (
            "strategy.yaml",
            "  placement: {strategy: densest}\n",
            &["placement.strategy", "densest"][..],
        ),
        (
            "tensor.yaml",
            "  parallelism: {tensor: all}\n",
            &["tensor \"all\" is neither \"auto\" nor a number of GPUs per shard"][..],
        ),
    ] {
        let path = dir.file(name, &instance(SMALL_MODEL, extra));
        let mut all = vec![path.as_str()];
        all.extend_from_slice(needles);
        assert_bad_input(&["place", "-f", &path], None, &all);
    }
    // A long name that fits one replica's pods but not the tenth's.
    let text = instance(SMALL_MODEL, "  replicas: 11\n").replace(
        "metadata: {name: m}",
        &format!("metadata: {{name: {}}}", "m".repeat(50)),
    );
    let path = dir.file("long.yaml", &text);
    assert_bad_input(
        &["place", "-f", &path],
        None,
        &[path.as_str(), "at most 48 characters with 11 replicas"],
    );
}

#[test]
fn place_plans_every_replica_on_its_own_devices() {
    let dir = Scratch::new("cli", "replicas");
    let path = dir.file(
        "replicas.yaml",
        &instance(
            SMALL_MODEL,
            "  replicas: 3\n  parallelism: {tensor: auto}\n",
        ),
    );
    let report = json_report(&["place", "-o", "json", "-f", &path]);
    let placements = report["placements"].as_array().expect("placements");
    assert_eq!(placements.len(), 3);
    let mut devices = std::collections::BTreeSet::new();
    for (index, placement) in placements.iter().enumerate() {
        assert_eq!(placement["replica"], index);
        assert!(
            placement["parallelism"]
                .as_str()
                .is_some_and(|note| note.starts_with(
                    "tensor auto (throughput: the most requests/s at the target per GPU) chose"
                )),
            "{placement}"
        );
        for shard in placement["statusPlan"].as_array().expect("a plan") {
            assert_eq!(shard["replica"].as_u64().unwrap_or(0), index as u64);
            for device in shard["devices"].as_array().unwrap() {
                assert!(
                    devices.insert((shard["node"].to_string(), device.to_string())),
                    "{device} planned twice"
                );
            }
        }
    }
    let (code, table, stderr) = run(&["place", "-f", &path], None);
    assert_eq!(code, 0, "{stderr}");
    assert!(table.contains("m replica 2 (m):"), "{table}");
    assert!(table.contains("tensor auto (throughput"), "{table}");
    // Where a token's time goes, under every plan.
    assert_eq!(
        table.matches("· layer overhead ").count(),
        3,
        "one token line per replica: {table}"
    );
}

#[test]
fn every_plan_carries_its_capacity_at_the_serving_target() {
    let report = json_report(&["place", "-o", "json"]);
    for placement in report["placements"].as_array().expect("placements") {
        let name = placement["name"].as_str().unwrap_or_default();
        let serving = &placement["plan"]["serving"];
        let max = serving["maxConcurrency"].as_u64().expect("maxConcurrency");
        assert!(max >= 1, "{name}: {serving}");
        let curve: Vec<u64> = serving["curve"]
            .as_array()
            .expect("a curve")
            .iter()
            .map(|point| {
                for field in ["tpotMs", "ttftMs", "outputTokensPerSecond"] {
                    assert!(
                        point[field].as_f64().is_some_and(|v| v > 0.0),
                        "{name}: {point}"
                    );
                }
                point["concurrency"].as_u64().expect("concurrency")
            })
            .collect();
        // Every power of two below maxConcurrency, and maxConcurrency.
        let mut want: Vec<u64> = (0..).map(|k| 1u64 << k).take_while(|c| *c < max).collect();
        want.push(max);
        assert_eq!(curve, want, "{name}");
        match (serving.get("atSlo"), serving.get("targetMissed")) {
            (Some(at), None) => {
                assert!(
                    at["tpotMs"].as_f64().is_some_and(|t| t <= 50.0),
                    "{name}: {at}"
                );
                assert!(
                    at["requestsPerSecond"].as_f64().is_some_and(|r| r > 0.0),
                    "{name}: {at}"
                );
                assert!(
                    at["concurrency"].as_u64().is_some_and(|c| c <= max),
                    "{name}: {at}"
                );
            }
            (None, Some(miss)) => {
                assert!(
                    miss["bestTpotMs"].as_f64().is_some_and(|t| t > 50.0),
                    "{name}: {miss}"
                );
            }
            other => panic!("{name}: {other:?}"),
        }
    }
    // The 405B model on the sample meets no 50 ms target; with 150 ms it does.
    let dir = Scratch::new("cli", "serving-target");
    let relaxed = repo_file("examples/llama-405b.yaml").replace(
        "  parallelism:\n",
        "  serving: {maxTimePerOutputTokenMs: 150}\n  parallelism:\n",
    );
    let path = dir.file("405b.yaml", &relaxed);
    let report = json_report(&["place", "-f", &path, "-o", "json"]);
    let serving = &report["placements"][0]["plan"]["serving"];
    assert!(
        serving["atSlo"]["concurrency"]
            .as_u64()
            .is_some_and(|c| c >= 1),
        "{serving}"
    );
}

#[test]
fn malformed_serving_and_head_fields_are_bad_input() {
    let dir = Scratch::new("cli", "serving-bad");
    for (extra, needles) in [
        ("  serving: {runtime: trt}\n", vec!["trt"]),
        ("  serving: {inputTokens: 0}\n", vec!["serving.inputTokens"]),
        (
            "  serving: {maxTimePerOutputTokenMs: 100, maxTimeToFirstTokenMs: 10}\n",
            vec!["maxTimeToFirstTokenMs"],
        ),
        (
            "  serving: {requestsPerSecond: -3}\n",
            vec!["serving.requestsPerSecond"],
        ),
        (
            "  serving: {replicasFromDemand: true}\n",
            vec!["serving.replicasFromDemand needs serving.requestsPerSecond"],
        ),
        (
            "  serving: {runtimeVersion: latest}\n",
            vec!["serving.runtimeVersion", "`latest` is not a release number"],
        ),
        (
            "  serving: {runtimeVersion: '0.'}\n",
            vec!["serving.runtimeVersion"],
        ),
    ] {
        let path = dir.file("bad.yaml", &instance(SMALL_MODEL, extra));
        assert_bad_input(&["place", "-f", &path], None, &needles);
    }
    for (model, needle) in [
        (
            "name: m, parametersBillions: 7, layers: 32, hiddenSize: 4096, attentionHeads: 30",
            "model.attentionHeads",
        ),
        (
            "name: m, parametersBillions: 7, layers: 32, attentionHeads: 32, kvHeads: 3",
            "model.kvHeads",
        ),
        (
            "name: m, parametersBillions: 7, layers: 32, kvCacheDtype: int3",
            "int3",
        ),
    ] {
        let path = dir.file("bad.yaml", &instance(model, ""));
        assert_bad_input(&["place", "-f", &path], None, &[needle]);
    }
}

#[test]
fn the_runtime_version_sets_the_batch_defaults_the_plan_names() {
    let dir = Scratch::new("cli", "runtime-version");
    let model = "name: m, parametersBillions: 8, layers: 32, hiddenSize: 4096, attentionHeads: 32, kvHeads: 8";
    let place = |serving: &str| {
        let path = dir.file("instance.yaml", &instance(model, serving));
        let (code, stdout, stderr) = run(&["place", "-f", &path], None);
        assert_eq!(code, 0, "stdout: {stdout}\nstderr: {stderr}");
        stdout
    };
    let v1 = place(
        "  serving: {runtimeVersion: v0.20.0, inputTokens: 64, outputTokens: 64, maxTimePerOutputTokenMs: 1000, maxTimeToFirstTokenMs: 60000}\n",
    );
    let v0 = place(
        "  serving: {runtimeVersion: 0.6.3.post1, inputTokens: 64, outputTokens: 64, maxTimePerOutputTokenMs: 1000, maxTimeToFirstTokenMs: 60000}\n",
    );
    assert!(v1.contains("(vllm >= 0.8, 64+64 tokens)"), "{v1}");
    assert!(v0.contains("(vllm < 0.8, 64+64 tokens)"), "{v0}");
    // With a loose target and short requests the batch cap decides: 256 on
    // the V0 engine on any GPU.
    assert!(v0.contains("the runtime's batch cap allows 256"), "{v0}");
    assert!(!v1.contains("allows 256"), "{v1}");
}

#[test]
fn pipeline_auto_with_sharing_is_one_stage_and_refused_only_when_nothing_holds_it() {
    let dir = Scratch::new("cli", "sharing-auto");
    let auto = "  parallelism: {tensor: 1, pipeline: auto}\n  placement: {sharing: Shared}\n";
    // The samples' way of writing it: an 8B model takes one share of one GPU.
    let small = dir.file(
        "small.yaml",
        &instance("name: m, parametersBillions: 8, layers: 32", auto),
    );
    let report = json_report(&[
        "place",
        "-c",
        "examples/cluster-shared.yaml",
        "-f",
        &small,
        "-o",
        "json",
    ]);
    let stages = report["placements"][0]["plan"]["stages"]
        .as_array()
        .expect("a plan");
    assert_eq!(stages.len(), 1, "{report}");
    // A model no single device or share holds is refused with that reason,
    // not told to use more stages.
    let large = dir.file(
        "large.yaml",
        &instance(
            "name: m, parametersBillions: 405, layers: 126, dtype: fp8",
            auto,
        ),
    );
    let (code, stdout, stderr) = run(&["place", "-f", &large], None);
    assert_eq!(code, 2, "stdout: {stdout}\nstderr: {stderr}");
    assert!(
        stdout.contains("UNSATISFIABLE: pipeline=1 × tensor=1"),
        "{stdout}"
    );
    assert!(stdout.contains("must fit one device or share"), "{stdout}");
    assert!(!stdout.contains("Use more stages"), "{stdout}");
}

#[test]
fn the_sharing_example_takes_partitions_and_memory_shares_and_says_which() {
    let report = json_report(&[
        "place",
        "-c",
        "examples/cluster-shared.yaml",
        "-f",
        "examples/llama-8b-shared.yaml",
        "-o",
        "json",
    ]);
    let placements = report["placements"].as_array().expect("placements");
    let shares: Vec<&Value> = placements
        .iter()
        .map(|p| &p["statusPlan"][0]["share"])
        .collect();
    assert_eq!(shares.len(), 4, "three 8B replicas and the guard model");
    assert_eq!(shares[0]["profile"], "3g.40gb", "a split GPU first");
    assert_eq!(shares[1]["kind"], "Memory");
    assert_eq!(shares[1]["memoryGiB"], 25);
    assert_eq!(shares[2]["tenants"], 1, "the shared GPU filled first");
    assert!(
        shares[2]["contendedTokensPerSecond"].as_f64()
            < shares[1]["contendedTokensPerSecond"].as_f64()
    );
    assert_eq!(
        shares[3]["profile"], "1g.10gb",
        "the smallest that holds 1B"
    );
    let (code, stdout, _) = run(
        &[
            "place",
            "-c",
            "examples/cluster-shared.yaml",
            "-f",
            "examples/llama-8b-shared.yaml",
        ],
        None,
    );
    assert_eq!(code, 0);
    assert!(stdout.contains("MIG partition 3g.40gb"), "{stdout}");
    assert!(
        stdout.contains("not isolated), beside 1 other share(s)"),
        "{stdout}"
    );
}

#[test]
fn sharing_with_more_than_one_shard_is_bad_input() {
    let dir = Scratch::new("cli", "sharing");
    let path = dir.file(
        "sharing.yaml",
        &instance(
            SMALL_MODEL,
            "  parallelism: {tensor: 2, pipeline: 1}\n  placement: {sharing: Isolated}\n",
        ),
    );
    assert_bad_input(
        &["place", "-f", &path],
        None,
        &[&path, "placement.sharing", "tensor 2"],
    );
    let path = dir.file(
        "typo.yaml",
        &instance(SMALL_MODEL, "  placement: {sharing: MIG}\n"),
    );
    assert_bad_input(&["place", "-f", &path], None, &[&path, "MIG"]);
}

#[test]
fn place_sizes_replicas_to_a_demand_and_says_when_it_is_not_met() {
    let dir = Scratch::new("cli", "demand");
    let model = "name: m, parametersBillions: 8, layers: 32, hiddenSize: 4096, attentionHeads: 32, kvHeads: 8";
    let one = dir.file("one.yaml", &instance(model, ""));
    let report = json_report(&["place", "-o", "json", "-f", &one]);
    let each = report["placements"][0]["plan"]["serving"]["atSlo"]["requestsPerSecond"]
        .as_f64()
        .expect("one replica's requests/s");
    let demand = (each * 2.5 * 100.0).round() / 100.0;
    let sized = dir.file(
        "sized.yaml",
        &instance(
            model,
            &format!("  serving: {{requestsPerSecond: {demand}, replicasFromDemand: true}}\n"),
        ),
    );
    let report = json_report(&["place", "-o", "json", "-f", &sized]);
    let placements = report["placements"].as_array().expect("placements");
    assert!(placements.len() >= 2, "{report}");
    let outcome = &report["demands"][0];
    assert_eq!(outcome["met"], true, "{outcome}");
    assert_eq!(outcome["replicas"], placements.len());
    assert!(outcome["servedRequestsPerSecond"].as_f64().unwrap_or(0.0) >= demand);
    let (code, table, _) = run(&["place", "-f", &sized], None);
    assert_eq!(code, 0);
    assert!(
        table.contains(&format!(
            "m: demand {demand} requests/s: {} replicas serve",
            placements.len()
        )),
        "{table}"
    );
    // A demand the sample cluster cannot serve: every replica it holds, then
    // exit code 2 and NOT MET.
    let huge = dir.file(
        "huge.yaml",
        &instance(
            model,
            "  serving: {requestsPerSecond: 1000000, replicasFromDemand: true}\n",
        ),
    );
    let (code, table, stderr) = run(&["place", "-f", &huge], None);
    assert_eq!(code, 2, "{table}\n{stderr}");
    assert!(table.contains("(NOT MET)"), "{table}");
    assert!(
        table.contains("by the cluster objective: 0 of 1 instance(s) served as asked"),
        "{table}"
    );
    // The objective's levels in JSON: the sized instance is served as asked.
    let objective = &report["objective"];
    assert_eq!(objective["instances"], 1, "{objective}");
    assert_eq!(objective["demandsUnmet"], 0, "{objective}");
    assert_eq!(objective["unplaced"], 0, "{objective}");
    assert_eq!(objective["gpus"].as_f64(), Some(placements.len() as f64));
    let (code, json, _) = run(&["place", "-o", "json", "-f", &huge], None);
    assert_eq!(code, 2);
    let huge_report: Value = serde_json::from_str(&json).expect("JSON output parses");
    assert_eq!(huge_report["objective"]["demandsUnmet"], 1, "{json}");
    // A fixed count with a demand is kept, and judged.
    let fixed = dir.file(
        "fixed.yaml",
        &instance(
            model,
            &format!("  replicas: 1\n  serving: {{requestsPerSecond: {demand}}}\n"),
        ),
    );
    let (code, table, _) = run(&["place", "-f", &fixed], None);
    assert_eq!(code, 2, "{table}");
    assert!(table.contains("1 replica serve"), "{table}");
}
