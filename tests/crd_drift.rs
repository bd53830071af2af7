//! The committed CRD must be exactly what the code generates: regenerate it with
//! `cargo run -- crd > crds/modelinstance.yaml` after changing `src/api`.

#[test]
fn committed_crd_matches_the_generated_one() {
    let committed = include_str!("../crds/modelinstance.yaml");
    let generated = tessera::api::crd_yaml();
    assert!(
        committed == generated,
        "crds/modelinstance.yaml is out of date: run `cargo run -- crd > crds/modelinstance.yaml`"
    );
}
