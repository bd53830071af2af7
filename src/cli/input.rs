//! Reading the files `tessera place` takes: ModelInstance manifests and cluster
//! descriptions. Every problem comes back as one line naming the file and field.

use std::collections::BTreeSet;
use std::io::Read;
use std::path::Path;

use k8s_openapi::api::core::v1::Node;
use serde::Deserialize;
use serde::de::DeserializeOwned;

use super::InputError;
use tessera_core::api::{
    GROUP, Health, LinkKind, ModelInstance, NodeGpuState, VERSION, Vendor, limits,
};
use tessera_core::translate::ClusterNode;

/// Parses YAML into a type, refusing unknown fields (as `kubectl apply` does with
/// strict field validation) and naming the path of whatever does not fit.
fn strict<T: DeserializeOwned>(value: serde_json::Value, origin: &str) -> Result<T, InputError> {
    let mut unknown = Vec::new();
    let mut track = |path: serde_ignored::Path<'_>| unknown.push(path.to_string());
    let de = serde_ignored::Deserializer::new(value, &mut track);
    let parsed: Result<T, _> = serde_path_to_error::deserialize(de);
    let parsed = parsed.map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        if path == "." || path.is_empty() {
            InputError(format!("{origin}: {inner}"))
        } else {
            InputError(format!("{origin}: {path}: {inner}"))
        }
    })?;
    // The derived custom resource reads `apiVersion` and `kind` through its own
    // check (done by the caller), so they look unused here.
    unknown.retain(|f| f != "apiVersion" && f != "kind");
    if let Some(field) = unknown.first() {
        return Err(InputError(format!("{origin}: unknown field {field}")));
    }
    Ok(parsed)
}

/// The largest input file read. A cluster of 5,000 nodes with 8 GPUs each and
/// a link between every pair of them is about 22 MB of YAML.
pub(crate) const MAX_INPUT_BYTES: u64 = 64 << 20;
/// YAML nodes (scalars, lists, maps) one file may hold: enough for about
/// 8,000 such nodes, where the parser's own default (250,000) stops near 570.
/// Peak memory at this limit (about 450 MB) is in docs/benchmarks.md
/// ("Reading cluster files").
pub const MAX_YAML_NODES: usize = 4_000_000;

/// Reads an input file (`-` for stdin) as text, naming it in every error.
pub(crate) fn read_input(path: &Path) -> Result<String, InputError> {
    let (origin, reader): (String, Box<dyn Read>) = if path.as_os_str() == "-" {
        ("stdin".to_string(), Box::new(std::io::stdin()))
    } else {
        let origin = path.display().to_string();
        let file = std::fs::File::open(path).map_err(|e| InputError(format!("{origin}: {e}")))?;
        (origin, Box::new(file))
    };
    let mut bytes = Vec::new();
    reader
        .take(MAX_INPUT_BYTES + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| InputError(format!("{origin}: {e}")))?;
    if bytes.len() as u64 > MAX_INPUT_BYTES {
        return Err(InputError(format!(
            "{origin}: larger than {} MiB, the most tessera reads from one file",
            MAX_INPUT_BYTES >> 20
        )));
    }
    String::from_utf8(bytes).map_err(|e| {
        let at = e.utf8_error().valid_up_to();
        let byte = e.as_bytes()[at];
        InputError(format!(
            "{origin}: not UTF-8 text (byte 0x{byte:02x} at offset {at}); expected a YAML or JSON file"
        ))
    })
}

fn yaml_documents(text: &str, origin: &str) -> Result<Vec<serde_json::Value>, InputError> {
    yaml_documents_within(text, origin, MAX_YAML_NODES)
}

fn yaml_documents_within(
    text: &str,
    origin: &str,
    max_nodes: usize,
) -> Result<Vec<serde_json::Value>, InputError> {
    // YAML 1.2 booleans only: a label value such as `no` or `y` stays a string.
    let mut options = serde_saphyr::Options::default();
    options.strict_booleans = true;
    options.with_snippet = false;
    let mut budget = serde_saphyr::Budget::default();
    budget.max_nodes = max_nodes;
    // Every node is one event, plus one more for each list or map end.
    budget.max_events = 2 * max_nodes;
    options.budget = Some(budget);
    let docs: Vec<serde_json::Value> = serde_saphyr::from_multiple_with_options(text, options)
        .map_err(|e| match &e {
            serde_saphyr::Error::Budget { breach, .. } => InputError(format!(
                "{origin}: too large to read: {}; tessera reads files of at most {max_nodes} YAML nodes and {} MiB (about 8,000 nodes of 8 GPUs with all their links)",
                budget_breach(breach),
                MAX_INPUT_BYTES >> 20
            )),
            _ => {
                let first = e.to_string();
                let line = first.lines().next().unwrap_or("malformed YAML").to_string();
                InputError(format!("{origin}: not valid YAML: {line}"))
            }
        })?;
    Ok(docs.into_iter().filter(|d| !d.is_null()).collect())
}

fn budget_breach(breach: &serde_saphyr::budget::BudgetBreach) -> String {
    use serde_saphyr::budget::BudgetBreach;
    match breach {
        BudgetBreach::Nodes { nodes } => format!("more than {} YAML nodes", nodes - 1),
        BudgetBreach::Events { events } => format!("more than {} YAML events", events - 1),
        other => format!("{other:?}"),
    }
}

/// All ModelInstances in a YAML file (several documents allowed), validated.
pub fn parse_instances(text: &str, origin: &str) -> Result<Vec<ModelInstance>, InputError> {
    let docs = yaml_documents(text, origin)?;
    if docs.is_empty() {
        return Err(InputError(format!(
            "{origin}: no ModelInstance in the file"
        )));
    }
    let want_api = format!("{GROUP}/{VERSION}");
    let mut out = Vec::new();
    for doc in docs {
        let api = doc.get("apiVersion").and_then(|v| v.as_str()).unwrap_or("");
        let kind = doc.get("kind").and_then(|v| v.as_str()).unwrap_or("");
        if api != want_api || kind != "ModelInstance" {
            return Err(InputError(format!(
                "{origin}: expected apiVersion {want_api} and kind ModelInstance, found {:?} and {:?}",
                api, kind
            )));
        }
        let mi: ModelInstance = strict(doc, origin)?;
        let name = mi.metadata.name.clone().unwrap_or_default();
        if name.is_empty() {
            return Err(InputError(format!("{origin}: metadata.name is missing")));
        }
        // The API server and the controller refuse these names; so does `place`.
        limits::check_instance_name(&name, mi.spec.most_replicas())
            .and_then(|()| {
                mi.metadata
                    .namespace
                    .as_deref()
                    .map_or(Ok(()), limits::check_namespace)
            })
            .map_err(|e| InputError(format!("{origin}: {e}")))?;
        mi.spec
            .validate()
            .map_err(|e| InputError(format!("{origin}: {name}: {e}")))?;
        // Corrections exported with the instance's status are applied to
        // its plans, so a broken one is bad input, not ignored.
        let mut problems = Vec::new();
        for (i, correction) in mi.status.iter().flat_map(|s| &s.corrections).enumerate() {
            correction.check(&format!("status.corrections[{i}]"), &mut problems);
        }
        if !problems.is_empty() {
            return Err(InputError(format!(
                "{origin}: {name}: {}",
                problems.join("; ")
            )));
        }
        out.push(mi);
    }
    Ok(out)
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ClusterFile {
    nodes: Vec<ClusterFileNode>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct ClusterFileNode {
    name: String,
    #[serde(default)]
    labels: std::collections::BTreeMap<String, String>,
    gpu_state: serde_json::Value,
}

/// A cluster description: either our own `nodes:` list, or what
/// `kubectl get nodes -o yaml` prints (nodes without GPU state are skipped).
pub fn parse_cluster(text: &str, origin: &str) -> Result<Vec<ClusterNode>, InputError> {
    let mut docs = yaml_documents(text, origin)?;
    if docs.len() != 1 {
        return Err(InputError(format!(
            "{origin}: expected one YAML document with the cluster, found {}",
            docs.len()
        )));
    }
    let doc = docs.remove(0);
    let kind = doc.get("kind").and_then(|v| v.as_str()).map(str::to_string);
    let nodes = match kind.as_deref() {
        None if doc.get("nodes").is_some() => {
            let file: ClusterFile = strict(doc, origin)?;
            file.nodes
                .into_iter()
                .map(|n| {
                    let gpu_state = strict_gpu_state(&n.gpu_state.to_string(), origin, &n.name)?;
                    if n.name.trim().is_empty() {
                        return Err(InputError(format!("{origin}: a node has an empty name")));
                    }
                    Ok(ClusterNode {
                        name: n.name,
                        labels: n.labels,
                        gpu_state,
                    })
                })
                .collect::<Result<Vec<_>, _>>()?
        }
        Some("List" | "NodeList") => {
            let items = match doc.get("items") {
                Some(serde_json::Value::Array(items)) => items.clone(),
                None | Some(serde_json::Value::Null) => Vec::new(),
                Some(_) => return Err(InputError(format!("{origin}: items must be a list"))),
            };
            let mut nodes = Vec::new();
            for item in items {
                if let Some(n) = read_node(item, origin)? {
                    nodes.push(n);
                }
            }
            nodes
        }
        Some("Node") => read_node(doc, origin)?.into_iter().collect(),
        _ => {
            return Err(InputError(format!(
                "{origin}: expected a cluster description (a `nodes:` list) or `kubectl get nodes -o yaml` output"
            )));
        }
    };
    let mut names = BTreeSet::new();
    for node in &nodes {
        if !names.insert(node.name.as_str()) {
            return Err(InputError(format!(
                "{origin}: node {} appears twice",
                node.name
            )));
        }
    }
    Ok(nodes)
}

fn read_node(item: serde_json::Value, origin: &str) -> Result<Option<ClusterNode>, InputError> {
    let kind = item.get("kind").and_then(|v| v.as_str()).unwrap_or("Node");
    if kind != "Node" {
        return Err(InputError(format!(
            "{origin}: the list holds a {kind}, not a Node"
        )));
    }
    let node: Node = serde_json::from_value(item)
        .map_err(|e| InputError(format!("{origin}: not a valid Node: {e}")))?;
    let meta = node.metadata;
    let name = meta.name.clone().unwrap_or_default();
    let Some(text) = NodeGpuState::annotation_of(&meta) else {
        return Ok(None);
    };
    Ok(Some(ClusterNode {
        gpu_state: strict_gpu_state(text, origin, &name)?,
        name,
        labels: meta.labels.clone().unwrap_or_default(),
    }))
}

/// A node's GPU state as a cluster file gives it, read strictly: a field or
/// a vendor, health or link kind this build does not know is an error here
/// (a typo would otherwise drop a reading or a device silently), while the
/// controller reads what agents publish tolerantly, since a newer agent may
/// add fields.
fn strict_gpu_state(text: &str, origin: &str, node: &str) -> Result<NodeGpuState, InputError> {
    let fail = |what: String| InputError(format!("{origin}: node {node}: gpuState: {what}"));
    let (state, unknown) = NodeGpuState::from_json_listing_unknown(text)
        .map_err(|e| InputError(format!("{origin}: node {node}: {e}")))?;
    // The values this build does not know are read again only to be named.
    let raw = || serde_json::from_str::<serde_json::Value>(text).unwrap_or_default();
    if let Some(field) = unknown.first() {
        return Err(fail(format!(
            "unknown field {field} (cluster files are read strictly)"
        )));
    }
    for (i, d) in state.devices.iter().enumerate() {
        let given = |field: &str| raw()["devices"][i][field].to_string();
        if d.vendor == Vendor::Unknown {
            return Err(fail(format!(
                "devices.{i}.vendor: {} is not one of \"nvidia\", \"amd\"",
                given("vendor")
            )));
        }
        if d.health == Health::Unknown {
            return Err(fail(format!(
                "devices.{i}.health: {} is not one of \"Healthy\", \"Unhealthy\"",
                given("health")
            )));
        }
    }
    if let Some(i) = state.links.iter().position(|l| l.kind == LinkKind::Unknown) {
        return Err(fail(format!(
            "links.{i}.kind: {} is not one of \"nvlink\", \"xgmi\", \"pcie\"",
            raw()["links"][i]["kind"]
        )));
    }
    Ok(state)
}

#[cfg(test)]
mod tests {
    use super::*;

    const MI: &str = "apiVersion: tessera.dev/v1alpha1
kind: ModelInstance
metadata: {name: m}
spec:
  model: {name: m, parametersBillions: 7, layers: 32}
";

    #[test]
    fn instances_parse_and_multi_document_files_work() {
        let two = format!("{MI}---\n{}", MI.replace("name: m}", "name: n}"));
        let got = parse_instances(&two, "f").unwrap();
        assert_eq!(got.len(), 2);
        assert_eq!(got[1].metadata.name.as_deref(), Some("n"));
    }

    #[test]
    fn instance_errors_name_file_and_field() {
        for (text, want) in [
            (String::new(), "f: no ModelInstance in the file"),
            ("a: [".to_string(), "f: not valid YAML"),
            (
                MI.replace("kind: ModelInstance", "kind: Pod"),
                "expected apiVersion",
            ),
            (
                MI.replace("layers: 32", "layers: -1"),
                "f: spec.model.layers: invalid value",
            ),
            (
                MI.replace("layers: 32", "layers: 32, colour: red"),
                "f: unknown field spec.model.colour",
            ),
            (
                MI.replace("metadata: {name: m}", "metadata: {}"),
                "metadata.name is missing",
            ),
            (
                MI.replace("parametersBillions: 7", "parametersBillions: 0"),
                "model.parametersBillions: 0 is outside the allowed range 0.001 to 100000",
            ),
            (
                MI.replace("name: m}", "name: My_Model!!}"),
                "f: metadata.name: \"My_Model!!\" (10 characters) is not a valid name",
            ),
            (
                MI.replace("name: m}", "name: m, namespace: Team_A}"),
                "f: metadata.namespace: \"Team_A\" is not a valid namespace",
            ),
        ] {
            let err = parse_instances(&text, "f").unwrap_err().0;
            assert!(err.contains(want), "{err:?} lacks {want:?}");
            assert!(!err.contains('\n'), "one line: {err:?}");
        }
    }

    #[test]
    fn a_file_past_the_yaml_budget_is_refused_with_the_limit() {
        let text = "nodes: [a, b, c, d, e, f, g, h, i, j, k]";
        let err = yaml_documents_within(text, "big.yaml", 10).unwrap_err().0;
        assert!(
            err.starts_with("big.yaml: too large to read: more than 10 YAML nodes; tessera reads files of at most 10 YAML nodes and 64 MiB"),
            "{err}"
        );
        assert!(yaml_documents_within(text, "big.yaml", 20).is_ok());
    }

    fn state_json(version: &str) -> String {
        format!(
            r#"{{"version":"{version}","backend":"fake","devices":[{{"id":"g0","index":0,"vendor":"nvidia","product":"X","memoryTotalBytes":100,"memoryFreeBytes":50,"fp16Tflops":1.0,"memoryBandwidthGbps":1.0,"health":"Healthy"}}]}}"#
        )
    }

    #[test]
    fn cluster_files_in_both_formats() {
        let ours = format!(
            "nodes:\n- name: a\n  labels: {{x: y}}\n  gpuState: {}\n",
            state_json("v1")
        );
        let nodes = parse_cluster(&ours, "c").unwrap();
        assert_eq!(nodes[0].labels["x"], "y");

        let kubectl = format!(
            "apiVersion: v1\nkind: List\nitems:\n- apiVersion: v1\n  kind: Node\n  metadata:\n    name: a\n    annotations:\n      tessera.dev/gpu-state: '{}'\n- apiVersion: v1\n  kind: Node\n  metadata: {{name: cpu}}\n",
            state_json("v1")
        );
        let nodes = parse_cluster(&kubectl, "c").unwrap();
        assert_eq!(nodes.len(), 1, "the CPU node is skipped");
        assert_eq!(parse_cluster("nodes: []", "c").unwrap(), vec![]);
    }

    #[test]
    fn cluster_errors() {
        let wrong_version = format!("nodes:\n- name: a\n  gpuState: {}\n", state_json("v7"));
        let dup = format!(
            "nodes:\n- name: a\n  gpuState: {s}\n- name: a\n  gpuState: {s}\n",
            s = state_json("v1")
        );
        let narrow = |rate: &str| {
            let state = state_json("v1").replace(
                r#""fp16Tflops":1.0"#,
                &format!(r#""fp16Tflops":1.0,"fp8Tflops":{rate}"#),
            );
            format!("nodes:\n- name: a\n  gpuState: {state}\n")
        };
        let (negative_fp8, text_fp8) = (narrow("-2"), narrow(r#""fast""#));
        assert!(parse_cluster(&narrow("2.0"), "c").is_ok());
        for (text, want) in [
            (
                negative_fp8.as_str(),
                "device g0 has fp8Tflops -2; it must be a positive number",
            ),
            (
                text_fp8.as_str(),
                "invalid type: string \"fast\", expected f64",
            ),
            (
                wrong_version.as_str(),
                "node a: gpu-state version \"v7\" is not supported",
            ),
            (dup.as_str(), "node a appears twice"),
            ("nodes:\n- name: a\n  gpuStat: {}\n", "unknown field"),
            ("kind: Deployment", "expected a cluster description"),
            (
                "apiVersion: v1\nkind: List\nitems: 3",
                "items must be a list",
            ),
            (
                "apiVersion: v1\nkind: List\nitems: [{kind: Pod}]",
                "holds a Pod",
            ),
            ("nodes: [1, 2", "not valid YAML"),
        ] {
            let err = parse_cluster(text, "c").unwrap_err().0;
            assert!(err.contains(want), "{err:?} lacks {want:?}");
        }
    }
}
