//! The chart's alerts checked and unit-tested by the real `promtool`
//! (Debian's `prometheus` package, which CI installs): the rule file parses,
//! and each alert fires on the series it is meant for, with its labels and
//! texts (`tests/fixtures/alerts_test.yaml`). Skipped, with the reason
//! printed, where no promtool is found (`PROMTOOL` names one elsewhere).
//! That the rules and the dashboard name only exported metrics is a unit
//! test (`src/monitoring_names.rs`).

use std::path::{Path, PathBuf};
use std::process::Command;

fn repo(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(path)
}

fn promtool() -> Option<String> {
    let tool = std::env::var("PROMTOOL").unwrap_or_else(|_| "promtool".to_string());
    match Command::new(&tool).arg("--version").output() {
        Ok(output) if output.status.success() => Some(tool),
        _ => {
            println!(
                "skipped: no promtool ({tool}); install Debian's prometheus package or set PROMTOOL"
            );
            None
        }
    }
}

fn run(tool: &str, args: &[&str]) -> String {
    let output = Command::new(tool)
        .args(args)
        .current_dir(repo("."))
        .output()
        .expect("promtool runs");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(output.status.success(), "promtool {args:?}:\n{text}");
    text
}

#[test]
fn promtool_accepts_the_rules_and_their_unit_tests_pass() {
    let Some(tool) = promtool() else {
        return;
    };
    let checked = run(
        &tool,
        &["check", "rules", "charts/tessera/files/alerts.yaml"],
    );
    assert!(checked.contains("SUCCESS: 5 rules found"), "{checked}");
    let tested = run(&tool, &["test", "rules", "tests/fixtures/alerts_test.yaml"]);
    assert!(tested.contains("SUCCESS"), "{tested}");
}

#[test]
fn a_broken_rule_is_refused_by_promtool() {
    let Some(tool) = promtool() else {
        return;
    };
    let dir = tempfile::tempdir().expect("a temporary folder");
    let broken = dir.path().join("broken.yaml");
    std::fs::write(
        &broken,
        "groups:\n  - name: x\n    rules:\n      - alert: X\n        expr: tessera_gpu_healthy ==\n",
    )
    .expect("a rule file");
    let output = Command::new(&tool)
        .args(["check", "rules"])
        .arg(&broken)
        .output()
        .expect("promtool runs");
    assert!(
        !output.status.success(),
        "a rule that does not parse passed"
    );
}
