//! `tessera place` against hostile and borderline cluster files: telemetry is
//! compared raw against hard limits, impossible or ambiguous states are bad
//! input naming file, node and field, devices held by pods are never planned
//! again, and cluster files at the documented scale are read.

#[path = "common/cli.rs"]
mod cli;
use cli::{Scratch, assert_bad_input, instance, run};

const SMALL_MODEL: &str = "name: m, parametersBillions: 7, layers: 32";

/// One H100 as a flow-map line of a cluster file; `extra` adds or overrides fields.
fn h100(id: &str, index: u32, extra: &str) -> String {
    format!(
        "{{id: {id}, index: {index}, vendor: nvidia, product: NVIDIA H100 80GB HBM3, memoryTotalBytes: 85899345920, memoryFreeBytes: 85899345920, fp16Tflops: 989.0, memoryBandwidthGbps: 3350.0, health: Healthy{extra}}}"
    )
}

/// A cluster of one node `a` with these devices; `state_extra` lines go into gpuState.
fn cluster(devices: &[String], state_extra: &str) -> String {
    let mut text = String::from(
        "nodes:\n- name: a\n  gpuState:\n    version: v1\n    backend: fake\n    devices:\n",
    );
    for d in devices {
        text.push_str(&format!("    - {d}\n"));
    }
    text.push_str(state_extra);
    text
}

#[test]
fn the_temperature_limit_compares_raw_telemetry() {
    let dir = Scratch::new("hostile", "temperature");
    // (reading, limit, exit code): each was decided the other way when the
    // reading was rounded before the comparison.
    for (reading, limit, code) in [
        ("84.6", None, 0),
        ("84.4", Some("84.4"), 2),
        ("75.3", Some("75.3"), 2),
    ] {
        let c = dir.file(
            "c.yaml",
            &cluster(&[h100("g0", 0, &format!(", temperatureC: {reading}"))], ""),
        );
        let placement = limit
            .map(|l| format!("  placement: {{maxTemperatureC: {l}}}\n"))
            .unwrap_or_default();
        let f = dir.file("m.yaml", &instance(SMALL_MODEL, &placement));
        let (got, stdout, stderr) = run(&["place", "-c", &c, "-f", &f], None);
        assert_eq!(got, code, "{reading} °C, limit {limit:?}\n{stdout}{stderr}");
        if code == 2 {
            let limit = limit.unwrap_or("85");
            assert!(
                stdout.contains(&format!("at {reading} °C, not below the {limit} °C limit")),
                "{stdout}"
            );
        }
    }
}

#[test]
fn unknown_fields_and_values_in_a_cluster_file_are_bad_input() {
    let dir = Scratch::new("hostile", "unknown_fields");
    for (devices, state_extra, needle) in [
        (
            vec![h100("g0", 0, ", temperatureCelsius: 95")],
            "",
            "node a: gpuState: unknown field devices.0.temperatureCelsius",
        ),
        (
            vec![h100("g0", 0, "")],
            "    coolant: water\n",
            "node a: gpuState: unknown field coolant",
        ),
        (
            vec![h100("g0", 0, "").replace("vendor: nvidia", "vendor: nvidai")],
            "",
            "devices.0.vendor: \"nvidai\" is not one of",
        ),
        (
            vec![h100("g0", 0, "").replace("health: Healthy", "health: Degraded")],
            "",
            "devices.0.health: \"Degraded\" is not one of",
        ),
        (
            vec![h100("g0", 0, ""), h100("g1", 1, "")],
            "    links:\n    - {a: g0, b: g1, kind: infinityfabric, bandwidthGbps: 1}\n",
            "links.0.kind: \"infinityfabric\" is not one of",
        ),
    ] {
        let c = dir.file("c.yaml", &cluster(&devices, state_extra));
        assert_bad_input(&["place", "-c", &c], None, &[c.as_str(), needle]);
    }
    // The same state in a Node annotation, as `kubectl get nodes -o yaml` prints it.
    let state = r#"{"version":"v1","backend":"fake","devices":[{"id":"g0","index":0,"vendor":"nvidia","product":"X","memoryTotalBytes":100,"memoryFreeBytes":50,"fp16Tflops":1.0,"memoryBandwidthGbps":1.0,"health":"Healthy","temperatureCelsius":95}]}"#;
    let c = dir.file(
        "kubectl.yaml",
        &format!(
            "apiVersion: v1\nkind: List\nitems:\n- apiVersion: v1\n  kind: Node\n  metadata:\n    name: a\n    annotations:\n      tessera.dev/gpu-state: '{state}'\n"
        ),
    );
    assert_bad_input(
        &["place", "-c", &c],
        None,
        &["node a: gpuState: unknown field devices.0.temperatureCelsius"],
    );
}

#[test]
fn impossible_or_ambiguous_device_states_are_bad_input() {
    let dir = Scratch::new("hostile", "impossible");
    for (devices, needle) in [
        (
            vec![h100("g0", 0, ""), h100("g1", 0, "")],
            "node a: gpu-state is invalid: devices g0 and g1 both have index 0",
        ),
        (
            vec![h100("g0", 0, ", temperatureC: -300")],
            "device g0 has temperatureC -300",
        ),
        (
            vec![h100("g0", 0, ", temperatureC: 4000")],
            "device g0 has temperatureC 4000",
        ),
        (
            vec![h100("g0", 0, ", powerW: -1")],
            "device g0 has powerW -1",
        ),
        (
            vec![h100("g0", 0, ", numaNode: -7")],
            "device g0 has numaNode -7",
        ),
    ] {
        let c = dir.file("c.yaml", &cluster(&devices, ""));
        assert_bad_input(&["place", "-c", &c], None, &[c.as_str(), needle]);
    }
}

#[test]
fn devices_the_agent_reports_allocated_are_not_planned_again() {
    let dir = Scratch::new("hostile", "allocated");
    let f = dir.file("m.yaml", &instance(SMALL_MODEL, ""));
    let both = cluster(
        &[h100("g0", 0, ""), h100("g1", 1, "")],
        "    allocated: {g0: 9d1c-uid}\n",
    );
    let c = dir.file("c.yaml", &both);
    let (code, stdout, stderr) = run(&["place", "-c", &c, "-f", &f, "-o", "json"], None);
    assert_eq!(code, 0, "{stdout}{stderr}");
    let report: serde_json::Value = serde_json::from_str(&stdout).expect("JSON report");
    assert_eq!(
        report["placements"][0]["statusPlan"][0]["devices"],
        serde_json::json!(["g1"])
    );

    let only = cluster(&[h100("g0", 0, "")], "    allocated: {g0: unbound}\n");
    let c = dir.file("c.yaml", &only);
    let (code, stdout, _) = run(&["place", "-c", &c, "-f", &f], None);
    assert_eq!(code, 2, "{stdout}");
    assert!(
        stdout.contains("allocated to a pod on a without a planned binding"),
        "{stdout}"
    );
}

#[test]
fn markup_in_a_cluster_file_is_text_on_the_map() {
    let dir = Scratch::new("hostile", "map");
    let f = dir.file("m.yaml", &instance(SMALL_MODEL, ""));
    let sick = h100("g0", 0, ", healthReason: '<script>alert(1)</script>'")
        .replace("health: Healthy", "health: Unhealthy");
    let odd = h100("g1", 1, "").replace(
        "product: NVIDIA H100 80GB HBM3",
        "product: '<img src=x onerror=alert(1)>'",
    );
    let hostile = cluster(
        &[sick, odd, h100("g2", 2, "")],
        "    allocated: {g0: '\"><script>alert(2)</script>'}\n",
    );
    let c = dir.file("c.yaml", &hostile);
    let (code, page, stderr) = run(&["place", "-c", &c, "-f", &f, "-o", "html"], None);
    assert_eq!(code, 0, "{stderr}");
    assert!(
        !page.contains("<script") && !page.contains("<img"),
        "{page}"
    );
    assert!(page.contains("&lt;script&gt;alert(1)"), "{page}");
    assert!(
        page.contains("&lt;img src=x onerror=alert(1)&gt;"),
        "{page}"
    );
    assert!(page.contains("&quot;&gt;&lt;script&gt;alert(2)"), "{page}");
}

#[test]
fn a_cluster_of_hundreds_of_fully_linked_nodes_is_read() {
    // 600 nodes of 8 GPUs with a link between every pair: past the YAML
    // reader's default budget (refused at 570 nodes before).
    let mut text = String::from("nodes:\n");
    for n in 0..600 {
        text.push_str(&format!(
            "- name: n{n}\n  gpuState:\n    version: v1\n    backend: fake\n    devices:\n"
        ));
        for d in 0..8 {
            text.push_str(&format!("    - {}\n", h100(&format!("n{n}-g{d}"), d, "")));
        }
        text.push_str("    links:\n");
        for a in 0..8 {
            for b in a + 1..8 {
                text.push_str(&format!(
                    "    - {{a: n{n}-g{a}, b: n{n}-g{b}, kind: nvlink, bandwidthGbps: 900}}\n"
                ));
            }
        }
    }
    let dir = Scratch::new("hostile", "large");
    let c = dir.file("c.yaml", &text);
    let f = dir.file("m.yaml", &instance(SMALL_MODEL, ""));
    let (code, stdout, stderr) = run(&["place", "-c", &c, "-f", &f], None);
    assert_eq!(code, 0, "{stderr}");
    assert!(stdout.contains("m (m):"), "{stdout}");
}

#[test]
fn binary_files_are_named() {
    let dir = Scratch::new("hostile", "binary");
    let path = dir.0.join("blob.yaml");
    std::fs::write(&path, b"nodes: []\n\xff\xfe\x00").expect("write");
    let p = path.display().to_string();
    let needle = "not UTF-8 text (byte 0xff at offset 10)";
    assert_bad_input(&["place", "-c", &p], None, &[p.as_str(), needle]);
    assert_bad_input(&["place", "-f", &p], None, &[p.as_str(), needle]);
    assert_bad_input(&["discover", "--summary", &p], None, &[p.as_str(), needle]);
}
