//! The validate stage: what makes an instance impossible to run whatever the
//! cluster looks like. The CRD schema catches most of it at `kubectl apply`;
//! this repeats those rules (for older CRDs) and adds the ones that need the
//! pod template or the controller's configuration.

use super::model_cache;
use super::settings::Settings;
use tessera_core::api::limits;
use tessera_core::api::{InvalidSpec, ModelInstance};

pub fn check(mi: &ModelInstance, settings: &Settings) -> Result<(), InvalidSpec> {
    let resource = &settings.resource_name;
    let mut problems = match mi.spec.validate() {
        Ok(()) => Vec::new(),
        Err(e) => e.problems,
    };
    if let Err(e) = limits::check_instance_name(
        mi.metadata.name.as_deref().unwrap_or(""),
        mi.spec.most_replicas(),
    ) {
        problems.push(e);
    }
    match mi.spec.template.as_ref().and_then(|t| t.spec.as_ref()) {
        None => problems.push(
            "template: a pod template with at least one container is required to run the shards"
                .to_string(),
        ),
        Some(spec) => {
            // An empty container list is already reported by `validate`.
            for (index, container) in spec.containers.iter().enumerate() {
                let resources = container.resources.as_ref();
                let asked = resource.all().into_iter().find(|resource_name| {
                    resources
                        .and_then(|r| r.requests.as_ref())
                        .is_some_and(|m| m.contains_key(resource_name))
                        || resources
                            .and_then(|r| r.limits.as_ref())
                            .is_some_and(|m| m.contains_key(resource_name))
                });
                if let Some(name) = asked {
                    problems.push(format!(
                        "template.spec.containers[{index}]: requests {name} itself; leave it out, the controller requests parallelism.tensor GPUs for the first container"
                    ));
                }
            }
            if spec.node_name.is_some() {
                problems.push(
                    "template.spec.nodeName: must be empty; tessera binds every shard to its planned node"
                        .to_string(),
                );
            }
            problems.extend(model_cache::problem(spec, settings.model_cache.as_ref()));
        }
    }
    if problems.is_empty() {
        Ok(())
    } else {
        Err(InvalidSpec { problems })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::controller::testkit::{SMALL, instance, pod_spec};
    use k8s_openapi::api::core::v1::ResourceRequirements;
    use k8s_openapi::apimachinery::pkg::api::resource::Quantity;

    fn problems(mi: &ModelInstance) -> String {
        check(mi, &Settings::default())
            .unwrap_err()
            .problems
            .join("\n")
    }

    #[test]
    fn a_good_instance_passes() {
        check(&instance("llama", SMALL), &Settings::default()).unwrap();
    }

    #[test]
    fn bad_instances_are_explained() {
        let mut mi = instance("llama", SMALL);
        mi.spec.template = None;
        assert!(problems(&mi).contains("a pod template with at least one container is required"));

        let mut mi = instance("llama", SMALL);
        pod_spec(&mut mi).containers.clear();
        assert!(problems(&mi).contains("no containers"));

        let mut mi = instance("llama", SMALL);
        let spec = pod_spec(&mut mi);
        spec.node_name = Some("n".into());
        spec.containers[0].resources = Some(ResourceRequirements {
            limits: Some([("tessera.dev/gpu".to_string(), Quantity("1".into()))].into()),
            ..Default::default()
        });
        let p = problems(&mi);
        assert!(
            p.contains("containers[0]: requests tessera.dev/gpu itself"),
            "{p}"
        );
        assert!(p.contains("template.spec.nodeName"), "{p}");

        // Per vendor, any vendor's resource in the template is refused.
        let mut mi = instance("llama", SMALL);
        pod_spec(&mut mi).containers[0].resources = Some(ResourceRequirements {
            requests: Some([("tessera.dev/amd-gpu".to_string(), Quantity("1".into()))].into()),
            ..Default::default()
        });
        let per_vendor = Settings {
            resource_name: "tessera.dev/{vendor}-gpu".parse().unwrap(),
            ..Settings::default()
        };
        let p = check(&mi, &per_vendor).unwrap_err().problems.join("\n");
        assert!(p.contains("requests tessera.dev/amd-gpu itself"), "{p}");
        assert!(check(&mi, &Settings::default()).is_ok());

        for bad in [&"x".repeat(53), "7b-llama", "My_Model!!", "a.b"] {
            let mi = instance(bad, SMALL);
            assert!(problems(&mi).contains("is not a valid name"), "{bad}");
        }

        let mut mi = instance("llama", SMALL);
        mi.spec.parallelism.tensor = tessera_core::api::TensorSize::Fixed(0);
        assert!(problems(&mi).contains("parallelism.tensor"));
    }

    /// Without a model cache, a template that mounts one without defining it
    /// is refused.
    #[test]
    fn a_template_asking_for_a_model_cache_the_controller_lacks_is_refused() {
        use k8s_openapi::api::core::v1::VolumeMount;
        let mut mi = instance("llama", SMALL);
        pod_spec(&mut mi).containers[0].volume_mounts = Some(vec![VolumeMount {
            name: model_cache::VOLUME.into(),
            mount_path: "/models".into(),
            ..Default::default()
        }]);
        let p = problems(&mi);
        assert!(
            p.contains("mounts the volume tessera-model-cache") && p.contains("--model-cache-dir"),
            "{p}"
        );
    }
}
