//! `examples/vllm-llama-70b.yaml` as the controller renders it: the shard pods
//! of 2- and 3-stage plans, every variable each one gets, and the command
//! line its start script runs — under `sh`, with stand-ins for `vllm`,
//! `getent` and `python3` — so the example cannot drift from what the
//! controller gives its pods.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use k8s_openapi::api::core::v1::{Container, Pod, Service};
use tessera::api::{ModelInstance, PipelineStages, PlannedShard, ResourceName, RestartPolicy};
use tessera::controller::desired::shard_pods;

const EXAMPLE: &str = include_str!("../examples/vllm-llama-70b.yaml");
const NAME: &str = "llama-70b-vllm";
const MASTER: &str = "llama-70b-vllm-shard-0.llama-70b-vllm.ml.svc";

/// The example's ModelInstance (in namespace `ml`) and its API Service.
fn example() -> (ModelInstance, Service) {
    let documents: Vec<&str> = EXAMPLE.split("\n---\n").collect();
    assert_eq!(documents.len(), 2, "a ModelInstance and a Service");
    let mut mi: ModelInstance = serde_saphyr::from_str(documents[0]).expect("the instance parses");
    mi.metadata.namespace = Some("ml".into());
    mi.metadata.uid = Some("uid-vllm".into());
    let service: Service = serde_saphyr::from_str(documents[1]).expect("the Service parses");
    (mi, service)
}

/// One replica's stages, `tensor` GPUs each, with these layer counts.
fn plan(layers: &[u32], tensor: &[usize]) -> Vec<PlannedShard> {
    let mut start = 0;
    layers
        .iter()
        .zip(tensor)
        .enumerate()
        .map(|(i, (&count, &gpus))| {
            let shard = PlannedShard {
                replica: 0,
                shard: i as u32,
                node: format!("node-{i}"),
                devices: (0..gpus).map(|g| format!("node-{i}-gpu-{g}")).collect(),
                layer_start: start,
                layer_end: start + count,
                predicted_memory_gib: 30.0,
            };
            start += count;
            shard
        })
        .collect()
}

fn render(mi: &ModelInstance, plan: &[PlannedShard]) -> Vec<Pod> {
    shard_pods(mi, plan, |_| "nvidia.com/gpu".into())
}

fn runtime(pod: &Pod) -> &Container {
    &pod.spec.as_ref().expect("a pod spec").containers[0]
}

/// The container's plain variables (those with a value).
fn env(pod: &Pod) -> BTreeMap<String, String> {
    runtime(pod)
        .env
        .iter()
        .flatten()
        .filter_map(|var| Some((var.name.clone(), var.value.clone()?)))
        .collect()
}

/// A folder of stand-in programs: `vllm` prints its arguments, one a line;
/// `getent` and `python3` write theirs to `calls` and succeed, or (python3,
/// the health check) fail as a server that is not up yet does.
fn stand_ins(dir: &Path) -> PathBuf {
    let bin = dir.join("bin");
    std::fs::create_dir_all(&bin).expect("a bin folder");
    let calls = dir.join("calls");
    for (name, body) in [
        (
            "vllm",
            "for arg in \"$@\"; do printf '%s\\n' \"$arg\"; done".to_string(),
        ),
        (
            "getent",
            format!("echo \"getent $*\" >> '{}'", calls.display()),
        ),
        (
            "python3",
            format!("echo \"python3 $*\" >> '{}'; exit 1", calls.display()),
        ),
    ] {
        let path = bin.join(name);
        std::fs::write(&path, format!("#!/bin/sh\n{body}\n")).expect("a stand-in");
        let mut permissions = std::fs::metadata(&path).expect("metadata").permissions();
        std::os::unix::fs::PermissionsExt::set_mode(&mut permissions, 0o755);
        std::fs::set_permissions(&path, permissions).expect("executable");
    }
    bin
}

struct Ran {
    success: bool,
    stdout: Vec<String>,
    stderr: String,
    calls: Vec<String>,
}

/// Runs `argv` (a command of the container) as kubelet would: the
/// container's variables, nothing else, and the stand-ins on PATH.
fn run(argv: &[String], pod: &Pod) -> Ran {
    let dir = tempfile::tempdir().expect("a temporary folder");
    let bin = stand_ins(dir.path());
    let output = Command::new(&argv[0])
        .args(&argv[1..])
        .env_clear()
        .envs(env(pod))
        .env("PATH", &bin)
        .output()
        .expect("sh runs");
    let calls = std::fs::read_to_string(dir.path().join("calls")).unwrap_or_default();
    Ran {
        success: output.status.success(),
        stdout: String::from_utf8_lossy(&output.stdout)
            .lines()
            .map(str::to_string)
            .collect(),
        stderr: String::from_utf8_lossy(&output.stderr).into_owned(),
        calls: calls.lines().map(str::to_string).collect(),
    }
}

fn start(pod: &Pod) -> Ran {
    run(runtime(pod).command.as_ref().expect("a command"), pod)
}

fn probe(pod: &Pod) -> Ran {
    let probe = runtime(pod)
        .readiness_probe
        .as_ref()
        .expect("a readiness probe");
    let exec = probe.exec.as_ref().expect("an exec probe");
    run(exec.command.as_ref().expect("a probe command"), pod)
}

/// What `vllm` must be started with on rank `rank` of `stages` stages of
/// `tensor` GPUs.
fn expected_args(rank: usize, stages: usize, tensor: usize) -> Vec<String> {
    let mut args: Vec<String> = [
        "serve",
        "meta-llama/Llama-3.1-70B-Instruct",
        "--tensor-parallel-size",
        &tensor.to_string(),
        "--pipeline-parallel-size",
        &stages.to_string(),
        "--distributed-executor-backend",
        "mp",
        "--nnodes",
        &stages.to_string(),
        "--node-rank",
        &rank.to_string(),
        "--master-addr",
        MASTER,
        "--master-port",
        "29501",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    if rank == 0 {
        args.extend(["--host", "0.0.0.0", "--port", "8000"].map(String::from));
    } else {
        args.push("--headless".into());
    }
    args
}

fn check_replica(mi: &ModelInstance, layers: &[u32], partition: &str) {
    let stages = layers.len();
    let plan = plan(layers, &vec![4; stages]);
    let pods = render(mi, &plan);
    assert_eq!(pods.len(), stages);
    for (rank, pod) in pods.iter().enumerate() {
        let what = format!("{stages} stages, rank {rank}");
        let vars = env(pod);
        for (name, want) in [
            (
                "TESSERA_MODEL",
                "meta-llama/Llama-3.1-70B-Instruct".to_string(),
            ),
            ("TESSERA_SHARD_INDEX", rank.to_string()),
            ("TESSERA_SHARD_COUNT", stages.to_string()),
            ("TESSERA_TENSOR_PARALLEL", "4".to_string()),
            ("TESSERA_PIPELINE_PARALLEL", stages.to_string()),
            ("TESSERA_MASTER_ADDR", MASTER.to_string()),
            ("TESSERA_MASTER_PORT", "29501".to_string()),
            ("VLLM_PP_LAYER_PARTITION", partition.to_string()),
            ("TESSERA_LAYER_START", plan[rank].layer_start.to_string()),
            ("TESSERA_LAYER_END", plan[rank].layer_end.to_string()),
            ("HF_HOME", "/models".to_string()),
        ] {
            assert_eq!(vars.get(name), Some(&want), "{what}: {name}");
        }
        let token = runtime(pod)
            .env
            .iter()
            .flatten()
            .find(|var| var.name == "HF_TOKEN")
            .and_then(|var| var.value_from.as_ref()?.secret_key_ref.as_ref())
            .expect("HF_TOKEN from the Secret");
        assert_eq!(
            (token.name.as_str(), token.key.as_str()),
            ("hf-token", "token")
        );

        let started = start(pod);
        assert!(started.success, "{what}: {}", started.stderr);
        assert_eq!(started.stdout, expected_args(rank, stages, 4), "{what}");
        assert_eq!(
            started.calls,
            [format!("getent hosts {MASTER}")],
            "{what}: waits for rank 0's name"
        );

        let ready = probe(pod);
        if rank == 0 {
            assert!(!ready.success, "{what}: ready while the server is down");
            assert_eq!(ready.calls.len(), 1, "{what}");
            assert!(
                ready.calls[0].contains("http://127.0.0.1:8000/health"),
                "{what}: {:?}",
                ready.calls
            );
        } else {
            assert!(
                ready.success,
                "{what}: a headless rank is ready once it runs"
            );
            assert!(ready.calls.is_empty(), "{what}: {:?}", ready.calls);
        }
    }
}

#[test]
fn the_example_is_a_valid_instance_for_multi_node_vllm() {
    let (mi, _) = example();
    tessera::controller::validate::check(&mi, &ResourceName::default())
        .expect("the controller accepts the example");
    assert_eq!(mi.spec.restart_policy, RestartPolicy::RecreateReplica);
    assert_eq!(mi.spec.parallelism.pipeline, PipelineStages::Fixed(2));
    let spec = mi
        .spec
        .template
        .as_ref()
        .and_then(|t| t.spec.as_ref())
        .expect("a pod template");
    assert_eq!(spec.restart_policy.as_deref(), Some("Never"));
    let shm = spec
        .volumes
        .iter()
        .flatten()
        .find(|v| v.name == "shm")
        .and_then(|v| v.empty_dir.as_ref())
        .expect("an emptyDir named shm");
    assert_eq!(shm.medium.as_deref(), Some("Memory"));
    let mounted = spec.containers[0]
        .volume_mounts
        .iter()
        .flatten()
        .any(|m| m.name == "shm" && m.mount_path == "/dev/shm");
    assert!(mounted, "shm is mounted at /dev/shm");
}

#[test]
fn a_two_stage_plan_starts_vllm_on_both_ranks() {
    let (mi, _) = example();
    check_replica(&mi, &[44, 36], "44,36");
}

#[test]
fn a_three_stage_plan_starts_vllm_on_every_rank() {
    let (mut mi, _) = example();
    mi.spec.parallelism.pipeline = PipelineStages::Fixed(3);
    check_replica(&mi, &[30, 26, 24], "30,26,24");
}

#[test]
fn stages_of_different_tensor_sizes_are_refused_with_the_reason() {
    let (mi, _) = example();
    let pods = render(&mi, &plan(&[50, 30], &[4, 2]));
    for pod in &pods {
        assert!(!env(pod).contains_key("VLLM_PP_LAYER_PARTITION"));
        let started = start(pod);
        assert!(!started.success);
        assert!(started.stdout.is_empty(), "vllm must not start");
        assert!(
            started.stderr.contains("differ in tensor size"),
            "{}",
            started.stderr
        );
    }
}

#[test]
fn the_api_service_reaches_rank_0_of_every_replica_only() {
    let (mi, service) = example();
    let selector = service
        .spec
        .as_ref()
        .and_then(|s| s.selector.clone())
        .expect("a selector");
    let pods = render(&mi, &plan(&[44, 36], &[4, 4]));
    let selected: Vec<String> = pods
        .iter()
        .filter(|pod| {
            let labels = pod.metadata.labels.clone().unwrap_or_default();
            selector.iter().all(|(k, v)| labels.get(k) == Some(v))
        })
        .map(|pod| pod.metadata.name.clone().unwrap_or_default())
        .collect();
    assert_eq!(selected, [format!("{NAME}-shard-0")]);
    let port = &service
        .spec
        .as_ref()
        .and_then(|s| s.ports.clone())
        .expect("ports")[0];
    let target = port.target_port.as_ref().expect("a target port");
    let named = match target {
        k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::String(name) => name,
        other => panic!("the target port is named, not {other:?}"),
    };
    let container_port = runtime(&pods[0])
        .ports
        .iter()
        .flatten()
        .find(|p| p.name.as_deref() == Some(named.as_str()))
        .expect("the container has the Service's port");
    assert_eq!(container_port.container_port, 8000);
}
