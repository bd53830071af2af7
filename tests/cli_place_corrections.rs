//! `tessera place` given an instance exported from a cluster with its
//! `status.corrections`: the plan's capacity carries the correction learned
//! for its GPU product and shape, and says so; a broken correction is bad input.

use serde_json::Value;

#[path = "common/cli.rs"]
mod cli;
use cli::{Scratch, assert_bad_input, run};

/// An 8B on one H100 of the sample cluster.
const INSTANCE: &str = "apiVersion: tessera.dev/v1alpha1
kind: ModelInstance
metadata: {name: small}
spec:
  model: {name: m, parametersBillions: 8, layers: 32}
  parallelism: {tensor: 1, pipeline: 1}
  placement: {products: [H100]}
  serving: {runtime: vllm}
";

/// The instance with one correction: `fields` (the factor and whatever else
/// differs) over a correction for this model on one H100, one stage.
fn with_correction(fields: &str) -> String {
    let mut entry = serde_json::json!({
        "model": "m", "runtime": "vllm", "product": "NVIDIA H100 80GB HBM3", "tensor": 1,
        "stages": 1, "observations": 3, "lastObserved": "2026-12-01T00:00:00Z",
    });
    let given: serde_json::Map<String, Value> =
        serde_saphyr::from_str(&format!("{{{fields}}}")).unwrap_or_default();
    for (k, v) in given {
        entry[k] = v;
    }
    format!("{INSTANCE}status:\n  corrections:\n  - {entry}\n")
}

fn serving(path: &str) -> Value {
    let (code, stdout, stderr) = run(&["place", "-o", "json", "-f", path], None);
    assert_eq!(code, 0, "{stderr}");
    let report: Value = serde_json::from_str(&stdout).expect("JSON");
    report["placements"][0]["plan"]["serving"].clone()
}

#[test]
fn the_correction_for_the_plans_gpu_and_shape_is_applied_and_said() {
    let dir = Scratch::new("cli-corrections", "applied");
    let plain = dir.file("plain.yaml", INSTANCE);
    let slower = dir.file("slower.yaml", &with_correction("factor: 4"));
    let (p, s) = (serving(&plain), serving(&slower));
    assert_eq!(p["correction"], Value::Null);
    assert_eq!(s["correction"], 4.0);
    let rps = |v: &Value| {
        v["atSlo"]["requestsPerSecond"]
            .as_f64()
            .expect("meets the target")
    };
    assert!(
        rps(&s) < rps(&p) / 2.0,
        "4× slower steps serve far less: {s} against {p}"
    );

    let (code, table, stderr) = run(&["place", "-f", &slower], None);
    assert_eq!(code, 0, "{stderr}");
    assert!(
        table.contains("corrected by measurement: step times ×4"),
        "{table}"
    );
    let (_, table, _) = run(&["place", "-f", &plain], None);
    assert!(!table.contains("corrected"), "{table}");

    // Learned for another model, or another shape: not this plan's.
    for other in [
        with_correction("factor: 4, model: other"),
        with_correction("factor: 4, tensor: 2"),
        with_correction("factor: 4, runtime: sglang"),
    ] {
        let path = dir.file("other.yaml", &other);
        assert_eq!(serving(&path)["correction"], Value::Null, "{other}");
    }
}

#[test]
fn a_broken_correction_is_bad_input() {
    let dir = Scratch::new("cli-corrections", "bad");
    for (fields, needles) in [
        ("factor: -1", vec!["status.corrections[0].factor"]),
        ("factor: 5000", vec!["status.corrections[0].factor", "5000"]),
        ("factor: fast", vec!["factor", "fast"]),
        ("factor: 2, tensor: 0", vec!["tensor 0"]),
    ] {
        let path = dir.file("bad.yaml", &with_correction(fields));
        assert_bad_input(&["place", "-f", &path], None, &needles);
    }
}
