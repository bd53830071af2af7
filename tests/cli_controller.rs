//! `tessera controller` on bad input: every malformed flag or unusable
//! kubeconfig ends in one `error:` line and exit code 1, before anything runs.

use std::process::Command;

#[path = "common/cli.rs"]
mod cli;
use cli::{Scratch, assert_bad_input_result, finish};

fn run(args: &[&str], env: &[(&str, &str)]) -> (i32, String, String) {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_tessera"));
    cmd.args(args)
        .env_remove("POD_NAMESPACE")
        .env_remove("POD_NAME")
        .env_remove("KUBECONFIG")
        .env_remove("KUBERNETES_SERVICE_HOST")
        .env("HOME", "/nonexistent-home");
    for (k, v) in env {
        cmd.env(k, v);
    }
    finish(args, cmd.output().expect("run tessera"))
}

#[test]
fn malformed_flags_are_refused() {
    for (args, needles) in [
        (&["controller", "--leader-elect=maybe"][..], &["maybe"][..]),
        (&["controller", "--listen", "localhost"], &["localhost"]),
        (
            &["controller", "--map-listen", "8082"],
            &["8082", "--map-listen"],
        ),
        (&["controller", "--node-grace-period", "-1"], &["-1"]),
        (
            &["controller", "--node-grace-period", "100000"],
            &["100000"],
        ),
        (&["controller", "--max-steps", "0"], &["0"]),
        (&["controller", "--namespace", " "], &["must not be empty"]),
        (&["controller", "--lease-name", ""], &["must not be empty"]),
        (
            &["controller", "--resource-name", ""],
            &["--resource-name", "must be <domain>/<name>"],
        ),
        (
            &["controller", "--resource-name", "tessera.dev/{vendor}/gpu"],
            &["exactly one '/'"],
        ),
        (
            &["controller", "--initial-list", "sometimes"],
            &["sometimes", "auto", "stream", "list"],
        ),
        (&["controller", "--initial-list", ""], &["--initial-list"]),
        (
            &["controller", "--allocation", "both"],
            &["both", "device-plugin", "dra", "auto"],
        ),
        (
            &["controller", "--dra-driver-name", "GPU_Driver"],
            &["is not a DRA driver name"],
        ),
        (
            &["controller", "--model-cache-dir", ""],
            &["--model-cache-dir", "must not be empty"],
        ),
        (
            &["controller", "--model-cache-dir", "models/cache"],
            &["not an absolute path"],
        ),
        (
            &["controller", "--model-cache-dir", "/var/lib/../../etc"],
            &["'..' component"],
        ),
        (
            &["controller", "--model-cache-dir", "/"],
            &["the host's root"],
        ),
        (&["controller", "--moves", "sometimes"], &["sometimes"]),
        (&["controller", "--max-moves-in-flight", "0"], &["0"]),
        (&["controller", "--max-moves-in-flight", "65"], &["65"]),
        (
            &["controller", "--move-timeout", "5"],
            &["5", "--move-timeout"],
        ),
        (&["controller", "--move-timeout", "ten"], &["ten"]),
        (&["controller", "--move-backoff", "-3"], &["-3"]),
        (&["controller", "--continuous-moves", "yes"], &["yes"]),
        (
            &["controller", "--continuous-min-gain=-0.1"],
            &["-0.1", "a fraction from 0 to 10"],
        ),
        (
            &["controller", "--continuous-min-gain", "11"],
            &["11", "a fraction from 0 to 10"],
        ),
        (
            &["controller", "--continuous-min-gain", "NaN"],
            &["NaN", "a fraction"],
        ),
        (
            &["controller", "--continuous-interval", "1"],
            &["1", "--continuous-interval"],
        ),
        (&["controller", "--measure-interval", "soon"], &["soon"]),
        (
            &["controller", "--measure-interval", "3601"],
            &["3601", "--measure-interval"],
        ),
        (
            &["controller", "--measure-window", "0"],
            &["0", "--measure-window"],
        ),
        (
            &["controller", "--measure-window", "20"],
            &["--measure-window (20 s)", "twice --measure-interval (15 s)"],
        ),
        (&["controller", "--measure-timeout", "61"], &["61"]),
        (
            &["controller", "--demand-headroom=11"],
            &["11", "not a fraction"],
        ),
        (&["controller", "--demand-headroom", "lots"], &["lots"]),
        (
            &["controller", "--scale-down-window", "86401"],
            &["86401", "--scale-down-window"],
        ),
        (
            &["controller", "--drain-timeout", "1h"],
            &["1h", "--drain-timeout"],
        ),
        (&["controller", "--nonsense"], &["--nonsense"]),
    ] {
        assert_bad_input_result(args, run(args, &[]), needles);
    }
}

#[test]
fn leader_election_needs_its_namespace() {
    let args = ["controller"];
    assert_bad_input_result(
        &args,
        run(&args, &[]),
        &["POD_NAMESPACE", "--leader-elect=false"],
    );
}

#[test]
fn an_unusable_kubeconfig_is_named() {
    let scratch = Scratch::new("cli-controller", "kubeconfig");
    let broken = scratch.file("kubeconfig", "apiVersion: v1\nclusters: [not a cluster\n");
    let missing = scratch.path("missing");
    for path in [broken.as_str(), missing.as_str()] {
        let args = [
            "controller",
            "--kubeconfig",
            path,
            "--leader-elect=false",
            "--listen",
            "127.0.0.1:0",
        ];
        assert_bad_input_result(
            &args,
            run(&args, &[]),
            &["cannot reach the Kubernetes API", path],
        );
    }
    // Without any configuration at all.
    let args = [
        "controller",
        "--leader-elect=false",
        "--listen",
        "127.0.0.1:0",
    ];
    assert_bad_input_result(&args, run(&args, &[]), &["cannot reach the Kubernetes API"]);
}
