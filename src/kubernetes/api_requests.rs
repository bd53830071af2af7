//! Counts the Kubernetes API requests a component makes, by the verb and
//! resource an RBAC rule names (`list` `core/pods`, `create`
//! `core/pods/binding`, `patch` `coordination.k8s.io/leases`). Exposed as
//! `<component>_api_requests_total`, it shows what the component really uses
//! of what its ServiceAccount is granted, so the chart's roles can be held to
//! exactly that.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RequestLabels {
    verb: String,
    resource: String,
}

/// Shared by the client (which counts) and the component's registry.
#[derive(Clone, Default)]
pub(crate) struct ApiRequests {
    counts: Family<RequestLabels, Counter>,
}

impl ApiRequests {
    pub(crate) fn register(&self, registry: &mut Registry) {
        registry.register(
            "api_requests",
            "Kubernetes API requests by RBAC verb and resource (group/resource[/subresource], core for the core group)",
            self.counts.clone(),
        );
    }

    pub(crate) fn count<B>(&self, request: &http::Request<B>) {
        let (verb, resource) = classify(
            request.method().as_str(),
            request.uri().path(),
            request.uri().query().unwrap_or(""),
        );
        self.counts
            .get_or_create(&RequestLabels {
                verb: verb.to_string(),
                resource,
            })
            .inc();
    }
}

/// The RBAC verb and resource of a request to the Kubernetes API.
fn classify(method: &str, path: &str, query: &str) -> (&'static str, String) {
    let segments: Vec<&str> = path.split('/').filter(|s| !s.is_empty()).collect();
    let (group, rest) = match segments.as_slice() {
        ["api", _version, rest @ ..] => ("core", rest),
        ["apis", group, _version, rest @ ..] => (*group, rest),
        _ => return (verb_of(method, false, query), format!("other:{path}")),
    };
    // `namespaces/NS/…` scopes what follows, unless it is the namespace itself.
    let rest = match rest {
        ["namespaces", _ns, tail @ ..] if !tail.is_empty() => tail,
        other => other,
    };
    let (resource, named) = match rest {
        // A group version's discovery document: a non-resource URL, which
        // every authenticated user may read (system:discovery).
        [] => return ("get", format!("discovery:{path}")),
        [resource] => ((*resource).to_string(), false),
        [resource, _name] => ((*resource).to_string(), true),
        [resource, _name, sub, ..] => (format!("{resource}/{sub}"), true),
    };
    (verb_of(method, named, query), format!("{group}/{resource}"))
}

fn verb_of(method: &str, named: bool, query: &str) -> &'static str {
    let watching = query
        .split('&')
        .any(|kv| kv == "watch=true" || kv == "watch=1");
    match (method, named) {
        ("GET", _) if watching => "watch",
        ("GET", true) => "get",
        ("GET", false) => "list",
        ("POST", _) => "create",
        ("PUT", _) => "update",
        ("PATCH", _) => "patch",
        ("DELETE", true) => "delete",
        ("DELETE", false) => "deletecollection",
        _ => "other",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_are_named_as_rbac_rules_name_them() {
        let cases = [
            ("GET", "/api/v1/nodes", "", "list", "core/nodes"),
            (
                "GET",
                "/api/v1/nodes",
                "watch=true&resourceVersion=5",
                "watch",
                "core/nodes",
            ),
            ("PATCH", "/api/v1/nodes/node-1", "", "patch", "core/nodes"),
            (
                "GET",
                "/api/v1/namespaces/ml/pods",
                "labelSelector=a",
                "list",
                "core/pods",
            ),
            (
                "POST",
                "/api/v1/namespaces/ml/pods/p/binding",
                "",
                "create",
                "core/pods/binding",
            ),
            (
                "DELETE",
                "/api/v1/namespaces/ml/pods/p",
                "",
                "delete",
                "core/pods",
            ),
            (
                "DELETE",
                "/api/v1/namespaces/ml/pods",
                "",
                "deletecollection",
                "core/pods",
            ),
            ("GET", "/api/v1/namespaces/ml", "", "get", "core/namespaces"),
            (
                "GET",
                "/apis/resource.k8s.io/v1",
                "",
                "get",
                "discovery:/apis/resource.k8s.io/v1",
            ),
            (
                "PATCH",
                "/apis/tessera.dev/v1alpha1/namespaces/ml/modelinstances/m/status",
                "fieldManager=x",
                "patch",
                "tessera.dev/modelinstances/status",
            ),
            (
                "PUT",
                "/apis/coordination.k8s.io/v1/namespaces/s/leases/l",
                "",
                "update",
                "coordination.k8s.io/leases",
            ),
            (
                "GET",
                "/apis/tessera.dev/v1alpha1/modelinstances",
                "watch=1",
                "watch",
                "tessera.dev/modelinstances",
            ),
        ];
        for (method, path, query, verb, resource) in cases {
            assert_eq!(
                classify(method, path, query),
                (verb, resource.to_string()),
                "{method} {path}?{query}"
            );
        }
        assert_eq!(classify("GET", "/version", "").1, "other:/version");
    }

    #[test]
    fn counts_appear_in_the_registry() {
        let requests = ApiRequests::default();
        let mut registry = Registry::with_prefix("tessera_test");
        requests.register(&mut registry);
        let request = http::Request::post("/api/v1/namespaces/ml/pods/p/binding")
            .body(())
            .unwrap();
        requests.count(&request);
        requests.count(&request);
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
        assert!(
            text.contains(
                "tessera_test_api_requests_total{verb=\"create\",resource=\"core/pods/binding\"} 2"
            ),
            "{text}"
        );
    }
}
