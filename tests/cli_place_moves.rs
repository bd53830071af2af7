//! `tessera place` on a cluster file where an instance is refused: the moves
//! of replicas placed before it that would make room (or why none would),
//! shown under the refusal and in `-o json`, never made.

use serde_json::Value;

#[path = "common/cli.rs"]
mod cli;
use cli::{Scratch, assert_bad_input, run};

const CLUSTER: &str = "tests/fixtures/moves/cluster.yaml";
const INSTANCES: &str = "tests/fixtures/moves/instances.yaml";

fn fixture(rel: &str) -> String {
    std::fs::read_to_string(std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(rel))
        .expect("read a fixture")
}

#[test]
fn a_refused_instance_is_shown_the_move_that_makes_room() {
    let (code, table, stderr) = run(&["place", "-c", CLUSTER, "-f", INSTANCES], None);
    assert_eq!(code, 2, "the refusal stands: {table}\n{stderr}");
    let refused = table
        .find("ml/big (llama-3.1-70b): UNSATISFIABLE")
        .unwrap_or_else(|| panic!("{table}"));
    let advice = &table[refused..];
    assert!(
        advice.contains("moves that would make room (1 GPU(s) moved"),
        "{advice}"
    );
    assert!(
        advice.contains("1. ml/chat replica 1: h100-b h100-b-gpu0 -> h100-a "),
        "{advice}"
    );
    assert!(
        advice.contains("then ml/big: h100-b h100-b-gpu0,h100-b-gpu1,h100-b-gpu2,h100-b-gpu3"),
        "{advice}"
    );

    let (code, json, _) = run(
        &["place", "-o", "json", "-c", CLUSTER, "-f", INSTANCES],
        None,
    );
    assert_eq!(code, 2);
    let report: Value = serde_json::from_str(&json).expect("JSON output parses");
    let big = &report["placements"][3];
    assert!(big.get("plan").is_none(), "shown, not made: {big}");
    let room = &big["moves"]["room"];
    assert_eq!(room["gpusMoved"], 1.0);
    let step = &room["moves"][0];
    assert_eq!(step["replica"], "ml/chat replica 1");
    assert_eq!(step["from"][0]["node"], "h100-b");
    assert_eq!(step["to"][0]["node"], "h100-a");
    assert!(step["requestsPerSecondAfter"].as_f64() >= step["requestsPerSecondBefore"].as_f64());
    assert_eq!(room["then"][0]["devices"].as_array().map(Vec::len), Some(4));
    // Placed instances carry no advice.
    assert!(report["placements"][0].get("moves").is_none());
}

#[test]
fn replicas_that_may_not_move_leave_the_refusal_with_its_reason() {
    let dir = Scratch::new("cli_place_moves", "never");
    let never = fixture(INSTANCES).replace(
        "placement: {strategy: spread}",
        "placement: {strategy: spread, moves: Never}",
    );
    let path = dir.file("never.yaml", &never);
    let (code, table, _) = run(&["place", "-c", CLUSTER, "-f", &path], None);
    assert_eq!(code, 2);
    assert!(
        table.contains("no moves make room: ml/big has no room and none of the 3 running replica(s) may move (placement.moves: Never)"),
        "{table}"
    );
    let (_, json, _) = run(&["place", "-o", "json", "-c", CLUSTER, "-f", &path], None);
    let report: Value = serde_json::from_str(&json).expect("JSON output parses");
    let reason = report["placements"][3]["moves"]["noRoom"]
        .as_str()
        .expect("a reason");
    assert!(reason.contains("placement.moves: Never"), "{reason}");
}

#[test]
fn a_moves_setting_other_than_allowed_or_never_is_bad_input() {
    let dir = Scratch::new("cli_place_moves", "malformed");
    for value in ["sometimes", "never", "true", "[Never]"] {
        let text = fixture(INSTANCES).replace(
            "placement: {strategy: spread}",
            &format!("placement: {{strategy: spread, moves: {value}}}"),
        );
        let path = dir.file("bad.yaml", &text);
        assert_bad_input(&["place", "-c", CLUSTER, "-f", &path], None, &["moves"]);
    }
}
