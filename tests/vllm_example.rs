//! `examples/vllm-llama-70b.yaml` as the controller renders it: the shard pods
//! of 2- and 3-stage plans, every variable each one gets, the command line
//! its start script runs and what its readiness probe decides — under `sh`,
//! with stand-ins for `vllm`, `getent` and `python3`, and real loopback
//! connections for the probe of the headless ranks — the model cache volume
//! and the GPUs it may be placed on, so the example cannot drift from what
//! the controller gives its pods.

use std::collections::BTreeMap;
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{Container, Pod, Service};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use tessera::api::{ModelInstance, NodeGpuState, PipelineStages, PlannedShard, RestartPolicy};
use tessera::controller::desired::{ShardGpus, some_shard_pods};
use tessera::controller::model_cache;
use tessera::controller::reconcile::Settings;
use tessera::translate::{ClusterNode, build_problem};

const EXAMPLE: &str = include_str!("../examples/vllm-llama-70b.yaml");
const NAME: &str = "llama-70b-vllm";
const MASTER: &str = "llama-70b-vllm-shard-0.llama-70b-vllm.ml.svc";
/// The controller's `--model-cache-dir` in these tests.
const CACHE: &str = "/var/lib/tessera/models";

/// The controller's settings in these tests: the model cache on.
fn settings() -> Settings {
    Settings {
        model_cache: Some(CACHE.parse().expect("a good directory")),
        ..Settings::default()
    }
}

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
                copy: 0,
                replica: 0,
                shard: i as u32,
                node: format!("node-{i}"),
                devices: (0..gpus).map(|g| format!("node-{i}-gpu-{g}")).collect(),
                layer_start: start,
                layer_end: start + count,
                predicted_memory_gib: 30.0,
                share: None,
            };
            start += count;
            shard
        })
        .collect()
}

fn render(mi: &ModelInstance, plan: &[PlannedShard]) -> Vec<Pod> {
    let gpus = |_: &PlannedShard| ShardGpus::Resource("nvidia.com/gpu".into());
    some_shard_pods(
        mi,
        plan,
        |_| true,
        gpus,
        settings().model_cache.as_ref(),
        Some(&planned_capacity()),
    )
}

/// The replica's capacity as the decide stage would give it.
fn planned_capacity() -> tessera::api::ReplicaCapacity {
    tessera::api::ReplicaCapacity {
        concurrency: 64,
        requests_per_second: 1.5,
        output_tokens_per_second: 1536.0,
        tpot_ms: 42.0,
        ttft_ms: 800.0,
        target_missed: None,
        correction: None,
    }
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
/// `getent` and `python3` write theirs to `calls`; `getent` then answers
/// with `$STAND_IN_ADDRESS` (default 127.0.0.1), `python3` (the health
/// check) fails as a server that is not up yet does.
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
            format!(
                "echo \"getent $*\" >> '{}'; echo \"${{STAND_IN_ADDRESS:-127.0.0.1}}       $2\"",
                calls.display()
            ),
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
/// container's variables, nothing else, and the stand-ins on PATH; `extra`
/// replaces or adds variables.
fn run(argv: &[String], pod: &Pod, extra: &[(&str, &str)]) -> Ran {
    let dir = tempfile::tempdir().expect("a temporary folder");
    let bin = stand_ins(dir.path());
    let mut vars = env(pod);
    vars.extend(extra.iter().map(|(k, v)| (k.to_string(), v.to_string())));
    let output = Command::new(&argv[0])
        .args(&argv[1..])
        .env_clear()
        .envs(vars)
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
    run(runtime(pod).command.as_ref().expect("a command"), pod, &[])
}

/// The readiness probe, with `extra` variables (a stand-in store's port).
fn probe(pod: &Pod, extra: &[(&str, &str)]) -> Ran {
    let probe = runtime(pod)
        .readiness_probe
        .as_ref()
        .expect("a readiness probe");
    let exec = probe.exec.as_ref().expect("an exec probe");
    run(exec.command.as_ref().expect("a probe command"), pod, extra)
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
        "--distributed-timeout-seconds",
        "3600",
        "--max-num-seqs",
        "64",
        "--max-model-len",
        "4096",
        "--gpu-memory-utilization",
        "0.9",
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

        // A store port nothing is connected to: a rank that has not joined.
        let store = TcpListener::bind("127.0.0.1:0").expect("a loopback port");
        let port = store.local_addr().expect("an address").port().to_string();
        let ready = probe(pod, &[("TESSERA_MASTER_PORT", &port)]);
        if rank == 0 {
            assert!(!ready.success, "{what}: ready while the server is down");
            assert_eq!(ready.calls.len(), 1, "{what}");
            assert!(
                ready.calls[0].contains("http://127.0.0.1:8000/health"),
                "{what}: {:?}",
                ready.calls
            );
        } else {
            assert!(!ready.success, "{what}: ready before it joined");
            assert_eq!(
                ready.calls,
                [format!("getent hosts {MASTER}")],
                "{what}: looks rank 0 up"
            );
        }
    }
}

/// Runs the probe of `pod` against a stand-in store at `address` until it
/// answers `want` (the kernel moves a closed connection on by itself, so a
/// change may take a moment), at most 5 s.
fn probe_until(pod: &Pod, address: &std::net::SocketAddr, want: bool) -> bool {
    let ip = address.ip().to_string();
    let port = address.port().to_string();
    let extra = [
        ("TESSERA_MASTER_PORT", port.as_str()),
        ("STAND_IN_ADDRESS", ip.as_str()),
    ];
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let ready = probe(pod, &extra);
        if ready.success == want || Instant::now() > deadline {
            return ready.success;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A headless rank is "starting" until it holds a connection to rank 0's
/// store and "joined" while it does; when rank 0 goes (its end closes), it
/// is not ready again. Checked with real loopback connections, which the
/// probe finds in /proc/net/tcp (tcp6 for IPv6) as it would in the pod.
#[test]
fn a_headless_rank_is_ready_while_connected_to_rank_0s_store() {
    let (mi, _) = example();
    let pods = render(&mi, &plan(&[44, 36], &[4, 4]));
    let rank1 = &pods[1];
    let mut families = vec!["127.0.0.1:0"];
    match TcpListener::bind("[::1]:0") {
        Ok(_) => families.push("[::1]:0"),
        Err(e) => println!("skipping the IPv6 case: no IPv6 loopback here ({e})"),
    }
    for bind in families {
        let store = TcpListener::bind(bind).expect("a loopback port");
        let address = store.local_addr().expect("an address");
        assert!(
            !probe_until(rank1, &address, false),
            "{bind}: ready with no connection to the store"
        );
        let worker = TcpStream::connect(address).expect("connects to the store");
        let (rank0_end, _) = store.accept().expect("the store accepts");
        assert!(
            probe_until(rank1, &address, true),
            "{bind}: not ready while connected"
        );
        drop(rank0_end);
        assert!(
            !probe_until(rank1, &address, false),
            "{bind}: still ready after rank 0 closed its end"
        );
        drop(worker);
    }
}

/// Every pod mounts the node-local model cache at `HF_HOME`, and the
/// controller's directory for the namespace backs it; the container asks
/// for the ephemeral storage it keeps besides the GPUs.
#[test]
fn weights_go_to_the_namespace_model_cache_and_the_rest_is_requested() {
    let (mi, _) = example();
    let template = mi
        .spec
        .template
        .as_ref()
        .and_then(|t| t.spec.as_ref())
        .expect("a pod template");
    let volumes: Vec<&str> = template
        .volumes
        .iter()
        .flatten()
        .map(|v| v.name.as_str())
        .collect();
    assert_eq!(
        volumes,
        ["shm"],
        "the weights are in no emptyDir, and the cache volume is left to the controller"
    );
    for pod in render(&mi, &plan(&[44, 36], &[4, 4])) {
        let spec = pod.spec.as_ref().expect("a pod spec");
        let cache = spec
            .volumes
            .iter()
            .flatten()
            .find(|v| v.name == model_cache::VOLUME)
            .and_then(|v| v.host_path.as_ref())
            .expect("the model cache volume");
        assert_eq!(cache.path, format!("{CACHE}/ml"));
        assert_eq!(cache.type_.as_deref(), Some("DirectoryOrCreate"));
        let container = runtime(&pod);
        let mounted = container
            .volume_mounts
            .iter()
            .flatten()
            .find(|m| m.name == model_cache::VOLUME)
            .map(|m| m.mount_path.clone());
        assert_eq!(
            mounted,
            env(&pod).get("HF_HOME").cloned(),
            "HF_HOME is the cache"
        );
        let resources = container.resources.as_ref().expect("resources");
        let asked = |map: &Option<BTreeMap<String, Quantity>>, name: &str| {
            map.as_ref().and_then(|m| m.get(name)).map(|q| q.0.clone())
        };
        assert_eq!(
            asked(&resources.requests, "ephemeral-storage").as_deref(),
            Some("10Gi")
        );
        assert_eq!(
            asked(&resources.limits, "ephemeral-storage").as_deref(),
            Some("20Gi")
        );
        assert_eq!(
            asked(&resources.limits, "nvidia.com/gpu").as_deref(),
            Some("4")
        );
    }
}

/// One node of 8 devices of `product` from `vendor`, 80 GiB each, so that
/// only the example's placement rules decide.
fn gpu_node(name: &str, vendor: &str, product: &str) -> ClusterNode {
    let devices: Vec<String> = (0..8)
        .map(|i| {
            format!(
                r#"{{"id":"{name}-{i}","index":{i},"vendor":"{vendor}","product":"{product}","memoryTotalBytes":85899345920,"memoryFreeBytes":85899345920,"fp16Tflops":300.0,"memoryBandwidthGbps":2000.0,"health":"Healthy"}}"#
            )
        })
        .collect();
    let state = format!(
        r#"{{"version":"v1","backend":"fake","devices":[{}]}}"#,
        devices.join(",")
    );
    ClusterNode {
        name: name.into(),
        labels: BTreeMap::new(),
        gpu_state: NodeGpuState::from_json(&state).expect("a GPU state"),
    }
}

/// The example is placed on NVIDIA cards that run bf16 (compute capability
/// 8.0 and later) and on nothing older or of another vendor, by the
/// planner's own product and vendor matching.
#[test]
fn the_example_is_placed_only_on_nvidia_gpus_that_run_bf16() {
    let (mi, _) = example();
    let placed = |vendor: &str, product: &str| {
        let node = gpu_node("n", vendor, product);
        let problem = build_problem(&mi.spec, [&node], &Default::default(), &Default::default());
        tessera::placement::solve(&problem, &Default::default()).is_ok()
    };
    for product in [
        "NVIDIA A100-SXM4-80GB",
        "NVIDIA A100 80GB PCIe",
        "NVIDIA A800-SXM4-80GB",
        "NVIDIA A40",
        "NVIDIA H100 80GB HBM3",
        "NVIDIA H100 PCIe",
        "NVIDIA H800",
        "NVIDIA H200",
        "NVIDIA GH200 480GB",
        "NVIDIA B200",
        "NVIDIA L40S",
        "NVIDIA L40",
        "NVIDIA GeForce RTX 4090",
        "NVIDIA RTX 6000 Ada Generation",
        "NVIDIA RTX A6000",
    ] {
        assert!(placed("nvidia", product), "{product} runs bf16");
    }
    for product in [
        "Tesla V100-SXM2-32GB",
        "Tesla V100S-PCIE-32GB",
        "Tesla T4",
        "Tesla P100-PCIE-16GB",
        "Tesla P40",
        "Quadro RTX 6000",
        "Quadro RTX 8000",
        "Quadro GV100",
        "NVIDIA TITAN V",
        "NVIDIA TITAN RTX",
        "NVIDIA GeForce RTX 2080 Ti",
        "NVIDIA GeForce GTX 1080 Ti",
    ] {
        assert!(!placed("nvidia", product), "{product} has no bf16");
    }
    assert!(!placed("amd", "AMD Instinct MI300X"), "the image is CUDA's");
}

#[test]
fn the_example_is_a_valid_instance_for_multi_node_vllm() {
    let (mi, _) = example();
    tessera::controller::validate::check(&mi, &settings())
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
    assert_eq!(mi.spec.placement.vendors, ["nvidia"]);
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

/// `examples/vllm-llama-8b-shared.yaml`'s instance, in namespace `ml`.
fn shared_example() -> ModelInstance {
    let mut mi: ModelInstance =
        serde_saphyr::from_str(include_str!("../examples/vllm-llama-8b-shared.yaml"))
            .expect("the shared example parses");
    mi.metadata.namespace = Some("ml".into());
    mi.metadata.uid = Some("uid-shared".into());
    mi
}

#[test]
fn the_shared_example_keeps_vllm_to_its_memory_share() {
    let mi = shared_example();
    mi.spec.validate().expect("a valid spec");
    assert_eq!(mi.spec.placement.sharing, tessera::api::Sharing::Shared);
    let pods = render(&mi, &plan(&[32], &[1]));
    let started = |fraction: &[(&str, &str)]| {
        let command = runtime(&pods[0]).command.as_ref().expect("a command");
        let ran = run(command, &pods[0], fraction);
        assert!(ran.success, "{}", ran.stderr);
        let at = ran
            .stdout
            .iter()
            .position(|arg| arg == "--gpu-memory-utilization")
            .expect("the flag is passed");
        ran.stdout[at + 1].clone()
    };
    // The agent's CDI spec gives a memory share's fraction; a partition has none.
    assert_eq!(
        started(&[("TESSERA_GPU_MEMORY_FRACTION", "0.312")]),
        "0.312"
    );
    assert_eq!(started(&[]), "0.9");
}

/// What vLLM's own parser makes of each command line (`TESSERA_TEST_VLLM_PYTHON`:
/// a Python with vLLM installed), one entry per line: the engine arguments or
/// the parser's error.
fn vllm_reads(python: &std::ffi::OsStr, lines: &[Vec<String>]) -> Vec<serde_json::Value> {
    let script =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/vllm/parse_serve_args.py");
    let mut child = Command::new(python)
        .arg(script)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("the Python of TESSERA_TEST_VLLM_PYTHON starts");
    let input = serde_json::to_vec(lines).expect("command lines as JSON");
    std::io::Write::write_all(child.stdin.as_mut().expect("a stdin"), &input).expect("written");
    drop(child.stdin.take());
    let output = child.wait_with_output().expect("the parser ends");
    assert!(
        output.status.success(),
        "vLLM's parser failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    serde_json::from_slice(&output.stdout).expect("the parser's JSON")
}

/// Every rank's `vllm serve` command line of 2- and 3-stage plans, and the
/// shared example's with and without a memory share, read by vLLM's own
/// argument parser (the version of the examples' image): each
/// flag is one vLLM knows, and it reads the planned concurrency, context
/// length and memory fraction, the parallel sizes and the rendezvous as the
/// controller gave them. A bad value the example passes on is refused there.
/// Skipped, saying why, without such a Python (CI installs one).
#[test]
fn vllms_own_parser_reads_every_ranks_command_line() {
    let Some(python) = std::env::var_os("TESSERA_TEST_VLLM_PYTHON") else {
        eprintln!(
            "skipped: TESSERA_TEST_VLLM_PYTHON is not set (a Python with vLLM installed, as .ci/run installs it)"
        );
        return;
    };
    let (mi, _) = example();
    let mut lines = Vec::new();
    let mut wants = Vec::new();
    for layers in [&[44, 36][..], &[30, 26, 24]] {
        let pods = render(&mi, &plan(layers, &vec![4; layers.len()]));
        for (rank, pod) in pods.iter().enumerate() {
            let started = start(pod);
            assert!(started.success, "rank {rank}: {}", started.stderr);
            lines.push(started.stdout);
            wants.push((rank, env(pod)));
        }
    }
    // The shared example's single GPU, with a memory share's fraction and without.
    let shared = shared_example();
    let shared_pod = &render(&shared, &plan(&[32], &[1]))[0];
    let shared_command = runtime(shared_pod).command.as_ref().expect("a command");
    let mut shared_fractions = Vec::new();
    for extra in [&[("TESSERA_GPU_MEMORY_FRACTION", "0.312")][..], &[]] {
        let ran = run(shared_command, shared_pod, extra);
        assert!(ran.success, "{}", ran.stderr);
        lines.push(ran.stdout);
        shared_fractions.push(
            extra
                .first()
                .map_or(0.9, |(_, f)| f.parse().expect("a fraction")),
        );
    }
    // The planned concurrency as a pod would get it from a bad edit of the example.
    let pod = &render(&mi, &plan(&[44, 36], &[4, 4]))[0];
    let command = runtime(pod).command.as_ref().expect("a command");
    let bad = run(command, pod, &[("TESSERA_MAX_NUM_SEQS", "sixty-four")]);
    assert!(bad.success, "{}", bad.stderr);
    lines.push(bad.stdout);

    let read = vllm_reads(&python, &lines);
    assert_eq!(read.len(), lines.len());
    for ((rank, vars), read) in wants.iter().zip(&read) {
        let what = format!("rank {rank} of {}", vars["TESSERA_SHARD_COUNT"]);
        let args = read.get("ok").unwrap_or_else(|| panic!("{what}: {read}"));
        for (field, name) in [
            ("tensor_parallel_size", "TESSERA_TENSOR_PARALLEL"),
            ("pipeline_parallel_size", "TESSERA_PIPELINE_PARALLEL"),
            ("nnodes", "TESSERA_SHARD_COUNT"),
            ("node_rank", "TESSERA_SHARD_INDEX"),
            ("master_port", "TESSERA_MASTER_PORT"),
            ("max_num_seqs", "TESSERA_MAX_NUM_SEQS"),
            ("max_model_len", "TESSERA_MAX_MODEL_LEN"),
            ("gpu_memory_utilization", "TESSERA_GPU_MEMORY_FRACTION"),
        ] {
            let planned: f64 = vars[name].parse().expect("a number");
            assert_eq!(args[field].as_f64(), Some(planned), "{what}: {field}");
        }
        assert_eq!(args["model"], vars["TESSERA_MODEL"], "{what}");
        assert_eq!(args["master_addr"], vars["TESSERA_MASTER_ADDR"], "{what}");
        assert_eq!(args["distributed_executor_backend"], "mp", "{what}");
        assert_eq!(args["headless"], *rank != 0, "{what}");
        if *rank == 0 {
            assert_eq!(args["host"], "0.0.0.0", "{what}");
            assert_eq!(args["port"], 8000, "{what}");
        }
    }
    for (read, fraction) in read[wants.len()..].iter().zip(&shared_fractions) {
        let args = read
            .get("ok")
            .unwrap_or_else(|| panic!("the shared example: {read}"));
        assert_eq!(args["model"], shared.spec.model.name.as_str());
        assert_eq!(args["gpu_memory_utilization"].as_f64(), Some(*fraction));
        assert_eq!(args["tensor_parallel_size"], 1);
        assert_eq!(args["host"], "0.0.0.0");
    }
    let refused = read.last().expect("the bad line's answer");
    let error = refused["error"].as_str().unwrap_or_default();
    assert!(
        error.contains("--max-num-seqs") && error.contains("sixty-four"),
        "vLLM refuses a concurrency that is not a number: {refused}"
    );
}
