//! The kube-scheduler comparison's workload (`benches/support/user_claims.rs`):
//! what a careful user writes for each shard, sized as the module says, and
//! — against a real API server serving `resource.k8s.io/v1`, when
//! `TESSERA_TEST_KUBECONFIG` is set — templates the API server accepts
//! (server-side dry run: its CEL compiler checks the selectors).

#[path = "common/real_cluster.rs"]
mod real_cluster;
#[path = "../benches/support/user_claims.rs"]
mod user_claims;

use kube::Client;
use kube::api::{Api, PostParams};
use tessera::api::ModelInstanceSpec;
use user_claims::{REQUEST, UserShard, claim_template, user_shards};

const GIB: u64 = 1 << 30;
const DRIVER: &str = "gpu.tessera.dev";

fn spec(yaml: &str) -> ModelInstanceSpec {
    serde_saphyr::from_str(yaml).unwrap()
}

const LLAMA_70B: &str =
    "model: {name: meta-llama/Llama-3.1-70B, parametersBillions: 70.6, layers: 80}";

#[test]
fn auto_is_the_smallest_size_that_holds_the_model() {
    // 141 GB (131.5 GiB) of bf16 weights: one 80 GiB GPU is too few, two hold it.
    let auto = spec(&format!("{LLAMA_70B}\nparallelism: {{tensor: auto}}"));
    let shards = user_shards(&auto, 80 * GIB).unwrap();
    assert_eq!(shards.len(), 1);
    assert_eq!(shards[0].gpus, 2, "{shards:?}");
    assert!((66..=80).contains(&shards[0].memory_gib), "{shards:?}");
    // On 192 GiB GPUs one is enough.
    assert_eq!(user_shards(&auto, 192 * GIB).unwrap()[0].gpus, 1);
    // Eight 16 GiB GPUs are too few: more stages of eight.
    let stages = user_shards(&auto, 16 * GIB).unwrap();
    assert!(
        stages.len() > 1 && stages.iter().all(|s| s.gpus == 8),
        "{stages:?}"
    );
}

#[test]
fn fixed_sizes_are_kept_and_each_gpu_asks_for_its_share() {
    let fixed = spec(&format!(
        "{LLAMA_70B}\nparallelism: {{tensor: 2, pipeline: 2}}"
    ));
    let shards = user_shards(&fixed, 80 * GIB).unwrap();
    assert_eq!(shards.len(), 2);
    let four = user_shards(
        &spec(&format!(
            "{LLAMA_70B}\nparallelism: {{tensor: 4, pipeline: 2}}"
        )),
        80 * GIB,
    )
    .unwrap();
    assert_eq!((shards[0].gpus, four[0].gpus), (2, 4));
    assert!(
        four[0].memory_gib < shards[0].memory_gib,
        "twice the GPUs, a smaller share each: {four:?} {shards:?}"
    );
}

#[test]
fn a_model_no_cluster_gpu_holds_is_refused() {
    let huge = spec("model: {name: huge, parametersBillions: 2000, layers: 4}");
    let error = user_shards(&huge, 24 * GIB).unwrap_err();
    assert!(
        error.contains("huge") && error.contains("24 GiB"),
        "{error}"
    );
}

#[test]
fn the_template_asks_for_count_domain_memory_and_products() {
    let with_products = spec(&format!(
        "{LLAMA_70B}\nplacement: {{products: [H100, \"it's\"]}}"
    ));
    let shard = UserShard {
        gpus: 4,
        memory_gib: 45,
    };
    let template = claim_template("llama-shard-0", DRIVER, &shard, &with_products);
    let devices = template.spec.unwrap().spec.unwrap().devices.unwrap();
    let request = &devices.requests.unwrap()[0];
    assert_eq!(request.name, REQUEST);
    let exactly = request.exactly.as_ref().unwrap();
    assert_eq!(
        (exactly.device_class_name.as_str(), exactly.count),
        (DRIVER, Some(4))
    );
    let selectors: Vec<&str> = exactly
        .selectors
        .iter()
        .flatten()
        .map(|s| s.cel.as_ref().unwrap().expression.as_str())
        .collect();
    assert_eq!(
        selectors,
        [
            "device.capacity['gpu.tessera.dev'].memory.compareTo(quantity('45Gi')) >= 0",
            "device.attributes['gpu.tessera.dev'].product.lowerAscii().contains('h100') || device.attributes['gpu.tessera.dev'].product.lowerAscii().contains('it\\'s')",
        ]
    );
    let constraint = &devices.constraints.unwrap()[0];
    assert_eq!(
        constraint.match_attribute.as_deref(),
        Some("gpu.tessera.dev/scaleUpDomain")
    );
    let one = claim_template(
        "small",
        DRIVER,
        &UserShard {
            gpus: 1,
            memory_gib: 20,
        },
        &with_products,
    );
    assert!(
        one.spec
            .unwrap()
            .spec
            .unwrap()
            .devices
            .unwrap()
            .constraints
            .is_none()
    );
}

#[tokio::test]
async fn the_api_server_accepts_the_templates() {
    let Some(path) = real_cluster::kubeconfig_path() else {
        return;
    };
    let client = Client::try_from(real_cluster::load_config(&path).await).unwrap();
    let api: Api<k8s_openapi::api::resource::v1::ResourceClaimTemplate> =
        Api::namespaced(client, "default");
    let auto = spec(&format!(
        "{LLAMA_70B}\nparallelism: {{tensor: auto}}\nplacement: {{products: [h100, mi300x]}}"
    ));
    for (largest, name) in [
        (80 * GIB, "user-claims-two"),
        (192 * GIB, "user-claims-one"),
    ] {
        let shard = &user_shards(&auto, largest).unwrap()[0];
        let template = claim_template(name, DRIVER, shard, &auto);
        let dry_run = PostParams {
            dry_run: true,
            ..PostParams::default()
        };
        match api.create(&dry_run, &template).await {
            Ok(_) => {}
            Err(kube::Error::Api(e)) if e.code == 404 => {
                println!("skipped: the API server does not serve resource.k8s.io/v1");
                return;
            }
            Err(e) => panic!("the API server refused {name}: {e}"),
        }
    }
}
