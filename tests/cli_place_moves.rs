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

/// The fixture's first instance alone: three 8B replicas over both nodes.
fn chat_only(dir: &Scratch) -> String {
    let text = fixture(INSTANCES);
    let chat = text.split("\n---\n").next().expect("the first document");
    dir.file("chat.yaml", chat)
}

#[test]
fn a_drain_shows_the_moves_that_empty_the_node() {
    let dir = Scratch::new("cli_place_moves", "drain");
    let chat = chat_only(&dir);
    let (code, table, stderr) = run(
        &["place", "-c", CLUSTER, "-f", &chat, "--drain", "h100-a"],
        None,
    );
    assert_eq!(
        code, 0,
        "every replica has somewhere to go: {table}\n{stderr}"
    );
    let drain = &table[table
        .find("drain h100-a: 2 replica(s) would move")
        .unwrap_or_else(|| panic!("{table}"))..];
    assert!(drain.contains("0 would stay (shown, not made)"), "{drain}");
    assert!(
        drain.contains("1. ml/chat replica 0: h100-a h100-a-gpu0 -> h100-b "),
        "{drain}"
    );

    let (_, json, _) = run(
        &[
            "place", "-o", "json", "-c", CLUSTER, "-f", &chat, "--drain", "h100-a",
        ],
        None,
    );
    let report: Value = serde_json::from_str(&json).expect("JSON output parses");
    assert_eq!(report["drain"]["nodes"], serde_json::json!(["h100-a"]));
    let moves = report["drain"]["moves"].as_array().expect("moves");
    assert_eq!(moves.len(), 2);
    assert!(
        moves.iter().all(|m| m["to"][0]["node"] == "h100-b"),
        "{moves:?}"
    );
    assert_eq!(report["drain"]["staying"], serde_json::json!([]));
    // The plans themselves stay where they were placed.
    assert_eq!(
        report["placements"][0]["plan"]["stages"][0]["node"],
        "h100-a"
    );

    // Both nodes drained: nowhere to go, exit 2, each replica says why.
    let (code, table, _) = run(
        &[
            "place", "-c", CLUSTER, "-f", &chat, "--drain", "h100-a", "--drain", "h100-b",
        ],
        None,
    );
    assert_eq!(code, 2, "{table}");
    assert_eq!(
        table.matches("  stays: ml/chat replica ").count(),
        3,
        "{table}"
    );
    assert!(
        table.contains("no devices off the leaving nodes hold it"),
        "{table}"
    );
}

#[test]
fn a_drain_of_a_node_the_cluster_lacks_is_bad_input() {
    for node in ["nope", "", "H100-A"] {
        assert_bad_input(
            &["place", "-c", CLUSTER, "-f", INSTANCES, "--drain", node],
            None,
            &["--drain", "has no node of that name"],
        );
    }
}
