//! The fleet simulator's own parts that need no cluster: its flags and its
//! reading of Prometheus text (the simulator itself runs against a real API
//! server: `cargo bench --bench fleet`).

#[allow(dead_code)]
#[path = "../benches/fleet/measure.rs"]
mod measure;
#[path = "../benches/fleet/options.rs"]
mod options;
#[path = "common/real_cluster.rs"]
mod real_cluster;

use std::time::Duration;

use options::Options;

fn parse(args: &[&str]) -> Result<Options, String> {
    Options::from_args(args.iter().map(|a| a.to_string()))
}

#[test]
fn flags_parse_and_bad_values_name_the_flag() {
    let options = parse(&["--bench", "--nodes", "1000,5000", "--poll-ms", "2000"]).unwrap();
    assert_eq!(options.nodes, vec![1000, 5000]);
    assert_eq!(options.poll, Duration::from_millis(2000));
    assert_eq!(options.publish_interval, None);
    assert_eq!(options.initial_list, "auto");
    assert!(options::USAGE.contains("--initial-list"));
    for how in ["auto", "stream", "list"] {
        assert_eq!(parse(&["--initial-list", how]).unwrap().initial_list, how);
    }
    assert!(!options.dra, "the device plugin unless asked");
    assert!(parse(&["--allocation", "dra"]).unwrap().dra);
    assert!(!parse(&["--allocation", "device-plugin"]).unwrap().dra);
    assert!(options::USAGE.contains("--allocation"));
    assert!(!options.agent_http2, "a real agent's HTTP/1.1 unless asked");
    assert!(parse(&["--agent-transport", "http2"]).unwrap().agent_http2);
    assert!(!parse(&["--agent-transport", "http1"]).unwrap().agent_http2);
    assert!(options::USAGE.contains("--agent-transport"));
    assert_eq!(
        options.nodes_per_connection, 1,
        "a connection per node unless asked"
    );
    assert_eq!(
        parse(&["--nodes-per-connection", "20"])
            .unwrap()
            .nodes_per_connection,
        20
    );
    assert!(options.compare.is_empty(), "no comparison unless asked");
    assert_eq!(options.events, 300, "the cluster benchmark's sequence");
    assert_eq!(options.seed, options::SEQUENCE_SEED);
    assert_eq!(parse(&["--seed", "42"]).unwrap().seed, 42);
    assert_eq!(parse(&["--seed", "0xc1a5_7e55"]).unwrap().seed, 0xc1a5_7e55);
    assert!(options::USAGE.contains("--seed"));
    let compare = parse(&[
        "--allocation",
        "device-plugin",
        "--compare",
        "kube-scheduler,tessera",
    ])
    .unwrap();
    assert_eq!(
        compare.compare,
        [options::Placer::KubeScheduler, options::Placer::Tessera]
    );
    assert!(
        compare.dra,
        "users' claims need DRA whatever --allocation says"
    );
    for placer in [
        options::Placer::Tessera,
        options::Placer::TesseraNoMoves,
        options::Placer::TesseraContinuous,
        options::Placer::KubeScheduler,
        options::Placer::KubeSchedulerGang,
    ] {
        assert_eq!(options::Placer::parse(placer.name()), Ok(placer));
    }
    assert!(options::USAGE.contains("--compare"));
    assert!(options::USAGE.contains("kube-scheduler-gang"));
    assert!(options::USAGE.contains("tessera-no-moves"));
    assert!(options::USAGE.contains("tessera-continuous"));
    assert_eq!(
        options.steady_for(Duration::from_secs(300)),
        Duration::from_secs(360),
        "the window holds every node's drift write"
    );
    for flag in [
        "--nodes",
        "--steady-seconds",
        "--poll-ms",
        "--publish-interval-seconds",
        "--arrivals",
        "--faults",
        "--restarts",
        "--nodes-per-connection",
        "--events",
    ] {
        assert!(options::USAGE.contains(flag), "the usage names {flag}");
        assert!(parse(&[flag, "7"]).is_ok(), "{flag} 7");
    }
    for bad in [
        &["--nodes", "0"][..],
        &["--nodes", "ten"],
        &["--nodes", "1000,"],
        &["--steady-seconds", "-1"],
        &["--publish-interval-seconds", "0"],
        &["--poll-ms"],
        &["--restarts", "0"],
        &["--initial-list", "sometimes"],
        &["--initial-list"],
        &["--allocation", "auto"],
        &["--allocation", "DRA"],
        &["--allocation"],
        &["--agent-transport", "h2"],
        &["--agent-transport"],
        &["--nodes-per-connection", "0"],
        &["--nodes-per-connection", "1001"],
        &["--what", "1"],
        &["--compare", "slurm"],
        &["--compare", "tessera,"],
        &["--compare", "Tessera"],
        &["--compare"],
        &["--events", "0"],
        &["--seed", "-1"],
        &["--seed", "0xg"],
        &["--seed", "seven"],
        &["--seed"],
    ] {
        let error = parse(bad).unwrap_err();
        assert!(error.contains(bad[0]), "{bad:?}: {error}");
    }
}

#[test]
fn metric_sums_take_the_samples_whose_labels_match() {
    let text = "# HELP req_total requests\nreq_total{resource=\"nodes\",verb=\"PATCH\"} 3\nreq_total{resource=\"pods\",verb=\"PATCH\"} 5\nreq_total{resource=\"nodes\",verb=\"GET\"} 7\nreq_total_other 9\ncpu 1.5\n";
    let sum = measure::sum;
    assert_eq!(
        sum(
            text,
            "req_total",
            &[("resource", "nodes"), ("verb", "PATCH")]
        ),
        3.0
    );
    assert_eq!(sum(text, "req_total", &[("resource", "nodes")]), 10.0);
    assert_eq!(sum(text, "cpu", &[]), 1.5);
    assert_eq!(sum(text, "absent", &[]), 0.0);
}
