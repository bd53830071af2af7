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

const MIXED_CLUSTER: &str = "tests/fixtures/moves/h200-h100-cluster.yaml";
const CHAT_AND_BIG: &str = "tests/fixtures/moves/chat-and-big.yaml";

#[test]
fn improve_shows_the_continuous_moves_that_raise_what_the_cluster_serves() {
    // The 8B took the H200 first; the 70B runs on an H100 with little KV
    // cache. The 8B making way to the free H100 and the 70B taking the H200
    // gain a tenth of what the two serve in raw requests/s (3.22 + 1.03 ->
    // 2.59 + 2.10), but seven tenths weighed by work: a 70B request costs
    // 8.75 times an 8B one.
    let args = ["place", "-c", MIXED_CLUSTER, "-f", CHAT_AND_BIG];
    let (code, table, stderr) = run(&[&args[..], &["--improve"]].concat(), None);
    assert_eq!(code, 0, "{table}\n{stderr}");
    let shown = &table[table
        .find("improve: 2 move(s)")
        .unwrap_or_else(|| panic!("{table}"))..];
    assert!(shown.contains("shown, not made"), "{shown}");
    assert!(
        shown.contains("1. ml/chat: h200-a h200-a-gpu0 -> h100-c h100-c-gpu0"),
        "{shown}"
    );
    assert!(
        shown.contains("2. ml/big: h100-b h100-b-gpu0 -> h200-a h200-a-gpu0"),
        "{shown}"
    );
    assert!(
        shown.contains("249.8 -> 429.7 TFLOP/s of model work at the targets"),
        "{shown}"
    );
    // Twice what they serve is not reached.
    let (_, table, _) = run(&[&args[..], &["--improve", "1"]].concat(), None);
    assert!(
        table.contains("improve: no move gains more than 100% of what its replicas serve"),
        "{table}"
    );
    // Without --improve nothing is said.
    let (_, table, _) = run(&args, None);
    assert!(!table.contains("improve:"), "{table}");

    let (_, json, _) = run(
        &[&args[..], &["-o", "json", "--improve=0.05"]].concat(),
        None,
    );
    let report: Value = serde_json::from_str(&json).expect("JSON output parses");
    let found = &report["improve"]["found"];
    assert_eq!(report["improve"]["minGain"], 0.05);
    assert_eq!(found["moves"].as_array().map(Vec::len), Some(2), "{found}");
    assert!(
        found["workTflopsAfter"].as_f64() > found["workTflopsBefore"].as_f64(),
        "{found}"
    );
    assert!(
        found["clusterTflopsPerGpuAfter"].as_f64() > found["clusterTflopsPerGpuBefore"].as_f64()
    );
    // The placements stay as placed.
    assert_eq!(
        report["placements"][0]["plan"]["stages"][0]["node"],
        "h200-a"
    );
}

#[test]
fn room_is_made_where_the_replica_moved_still_meets_its_target_and_demand() {
    // The 70B asks for the H200 the 8B holds: the 8B serves less on an H100
    // but still meets its target there, so moves make room.
    let dir = Scratch::new("cli_place_moves", "room");
    let only_h200 = fixture(CHAT_AND_BIG).replace(
        "dtype: fp8}\n",
        "dtype: fp8}\n  placement: {products: [\"NVIDIA H200\"]}\n",
    );
    let path = dir.file("only-h200.yaml", &only_h200);
    let (code, table, _) = run(&["place", "-c", MIXED_CLUSTER, "-f", &path], None);
    assert_eq!(code, 2, "refused until the moves are made: {table}");
    assert!(
        table.contains("moves that would make room (1 GPU(s) moved"),
        "{table}"
    );
    assert!(table.contains("then ml/big: h200-a h200-a-gpu0"), "{table}");
    // With a demand the H100 cannot serve, the 8B stays, and the refusal
    // names what blocks it.
    let demanding = only_h200.replace(
        "kvCacheGiB: 1}\n  parallelism: {tensor: 1, pipeline: 1}\n",
        "kvCacheGiB: 1}\n  parallelism: {tensor: 1, pipeline: 1}\n  serving: {requestsPerSecond: 4.5}\n",
    );
    assert_ne!(demanding, only_h200);
    let path = dir.file("demanding.yaml", &demanding);
    let (code, table, _) = run(&["place", "-c", MIXED_CLUSTER, "-f", &path], None);
    assert_eq!(code, 2, "{table}");
    assert!(
        table.contains("no moves make room: ml/big fits on h200-a by moving 1 replica(s) (ml/chat), but ml/chat would fall short of its demand elsewhere: it would serve")
            && table.contains("below its demand of 4.50"),
        "{table}"
    );
}

#[test]
fn a_malformed_least_gain_is_bad_input() {
    for gain in [
        "--improve=much",
        "--improve=-0.5",
        "--improve=11",
        "--improve=inf",
    ] {
        assert_bad_input(
            &["place", "-c", MIXED_CLUSTER, "-f", CHAT_AND_BIG, gain],
            None,
            &["a fraction from 0 to 10"],
        );
    }
}

#[test]
fn a_small_model_moves_to_a_slower_gpu_so_a_large_one_is_placed() {
    // The worked example of docs/placement.md: the 1.2B on an H100 makes way
    // for the 34B that may only use H100s, on an A100 where it serves less
    // but meets its target; with a demand the A100 cannot serve, it stays.
    let cluster = "tests/fixtures/moves/h100-a100-node.yaml";
    let instances = "tests/fixtures/moves/small-and-34b.yaml";
    let (code, table, _) = run(&["place", "-c", cluster, "-f", instances], None);
    assert_eq!(code, 2, "refused until the move is made: {table}");
    assert!(
        table.contains("1. ml/small: n n-g0 -> n n-g4 (39.03 -> 18.71 requests/s at its target)")
            && table.contains("then ml/big: n n-g0,n-g1,n-g2,n-g3"),
        "{table}"
    );
    let dir = Scratch::new("cli_place_moves", "worked-example");
    let demanding = fixture(instances).replace(
        "  parallelism: {tensor: 1, pipeline: 1}\n",
        "  parallelism: {tensor: 1, pipeline: 1}\n  serving: {requestsPerSecond: 25}\n",
    );
    let path = dir.file("demanding.yaml", &demanding);
    let (_, table, _) = run(&["place", "-c", cluster, "-f", &path], None);
    assert!(
        table.contains("no moves make room: ml/big fits on n by moving 1 replica(s) (ml/small), but ml/small would fall short of its demand elsewhere: it would serve 18.71 requests/s at the target, below its demand of 25.00 (it serves 39.03)"),
        "{table}"
    );
}
