//! The committed CRD must be exactly what the code generates: regenerate it with
//! `cargo run -- crd > crds/modelinstance.yaml` after changing `crates/tessera-core/src/api`. The Helm
//! chart carries an identical copy (Helm installs CRDs from the chart's `crds/`), and
//! `deploy/tessera.yaml` (the chart rendered for `kubectl apply`) embeds it too.

const REGENERATE: &str = "run `cargo run -- crd > crds/modelinstance.yaml && \
     cp crds/modelinstance.yaml charts/tessera/crds/ && .ci/render-deploy`";

#[test]
fn committed_crd_matches_the_generated_one() {
    let committed = include_str!("../crds/modelinstance.yaml");
    let generated = tessera::api::crd_yaml();
    assert!(
        committed == generated,
        "crds/modelinstance.yaml is out of date: {REGENERATE}"
    );
}

#[test]
fn helm_chart_crd_matches_the_generated_one() {
    let chart = include_str!("../charts/tessera/crds/modelinstance.yaml");
    let generated = tessera::api::crd_yaml();
    assert!(
        chart == generated,
        "charts/tessera/crds/modelinstance.yaml is out of date: {REGENERATE}"
    );
}

#[test]
fn plain_manifests_embed_the_generated_crd() {
    let deploy = include_str!("../deploy/tessera.yaml");
    let generated = tessera::api::crd_yaml();
    assert!(
        deploy.contains(generated.trim_end()),
        "deploy/tessera.yaml does not contain the current CRD: {REGENERATE}"
    );
}
