//! One replica of a model as a user without tessera runs it on kube-scheduler
//! with DRA: a pod per shard, each with its own ResourceClaimTemplate (sized
//! by `support::user_claims`), and, with gang scheduling, a PodGroup that
//! admits the replica's pods all together or not at all.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::ResourceClaimTemplate;
use kube::api::{Api, ApiResource, DeleteParams, DynamicObject, ListParams, PostParams};
use kube::core::GroupVersionKind;
use kube::{Client, ResourceExt};
use serde_json::json;
use tessera::api::{INSTANCE_LABEL, ModelInstanceSpec, REPLICA_LABEL, SHARD_ANNOTATION};

use crate::nodes::{RUN_LABEL, TAINT_KEY};
use crate::support::user_claims::{REQUEST, UserShard, claim_template};

/// Where a replica's pods stand with kube-scheduler.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub(crate) struct Standing {
    pub(crate) bound: usize,
    /// Tried and found no room (`PodScheduled` False, `Unschedulable`).
    pub(crate) unschedulable: usize,
    pub(crate) pods: usize,
}

impl Standing {
    /// Every pod is bound or was found unschedulable.
    pub(crate) fn settled(&self, shards: usize) -> bool {
        self.pods == shards && self.bound + self.unschedulable == shards
    }
}

/// The objects of the user's replicas in one namespace.
#[derive(Clone)]
pub(crate) struct UserPods {
    pods: Api<Pod>,
    templates: Api<ResourceClaimTemplate>,
    groups: Api<DynamicObject>,
    run: String,
    driver: String,
    /// Gang: each replica's pods join a PodGroup of as many members.
    gang: bool,
}

fn pod_group_resource() -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("scheduling.k8s.io", "v1alpha2", "PodGroup"),
        "podgroups",
    )
}

/// `<instance>-r<replica>`: a replica's name, its pods' and templates' prefix.
fn replica_name(instance: &str, replica: u32) -> String {
    format!("{instance}-r{replica}")
}

impl UserPods {
    pub(crate) fn new(
        client: &Client,
        namespace: &str,
        run: &str,
        driver: &str,
        gang: bool,
    ) -> Self {
        Self {
            pods: Api::namespaced(client.clone(), namespace),
            templates: Api::namespaced(client.clone(), namespace),
            groups: Api::namespaced_with(client.clone(), namespace, &pod_group_resource()),
            run: run.to_string(),
            driver: driver.to_string(),
            gang,
        }
    }

    /// Creates the replica's PodGroup (gang), templates and pods, in that
    /// order, as `kubectl apply` of one file would.
    pub(crate) async fn create(
        &self,
        instance: &str,
        replica: u32,
        shards: &[UserShard],
        spec: &ModelInstanceSpec,
    ) -> Result<(), String> {
        let name = replica_name(instance, replica);
        let labels = |shard: usize| {
            BTreeMap::from([
                (INSTANCE_LABEL.to_string(), instance.to_string()),
                (REPLICA_LABEL.to_string(), replica.to_string()),
                (SHARD_ANNOTATION.to_string(), shard.to_string()),
            ])
        };
        if self.gang {
            let mut group_spec = json!({"schedulingPolicy": {"gang": {"minCount": shards.len()}}});
            // A replica of several stages stays within one zone, as the
            // topology-aware workload scheduling it comes with allows.
            if shards.len() > 1 {
                group_spec["schedulingConstraints"] =
                    json!({"topology": [{"key": "topology.kubernetes.io/zone"}]});
            }
            let group: DynamicObject = serde_json::from_value(json!({
                "apiVersion": "scheduling.k8s.io/v1alpha2", "kind": "PodGroup",
                "metadata": {"name": name, "labels": labels(0)},
                "spec": group_spec,
            }))
            .map_err(|e| format!("PodGroup {name}: {e}"))?;
            self.groups
                .create(&PostParams::default(), &group)
                .await
                .map_err(|e| format!("creating PodGroup {name}: {e}"))?;
        }
        for (index, shard) in shards.iter().enumerate() {
            let pod_name = format!("{name}-s{index}");
            let mut template = claim_template(&pod_name, &self.driver, shard, spec);
            template.metadata.labels = Some(labels(index));
            self.templates
                .create(&PostParams::default(), &template)
                .await
                .map_err(|e| format!("creating ResourceClaimTemplate {pod_name}: {e}"))?;
            let mut pod_spec = json!({
                "containers": [{"name": "shard", "image": "busybox:1.37",
                                "resources": {"claims": [{"name": REQUEST}]}}],
                "nodeSelector": {RUN_LABEL: self.run},
                "tolerations": [{"key": TAINT_KEY, "operator": "Exists", "effect": "NoSchedule"}],
                "resourceClaims": [{"name": REQUEST, "resourceClaimTemplateName": pod_name}],
            });
            if self.gang {
                pod_spec["schedulingGroup"] = json!({"podGroupName": name});
            }
            let pod: Pod = serde_json::from_value(json!({
                "metadata": {"name": pod_name, "labels": labels(index)},
                "spec": pod_spec,
            }))
            .map_err(|e| format!("pod {pod_name}: {e}"))?;
            self.pods
                .create(&PostParams::default(), &pod)
                .await
                .map_err(|e| format!("creating pod {pod_name}: {e}"))?;
        }
        Ok(())
    }

    /// The replica's pods: how many are bound and how many were found
    /// unschedulable.
    pub(crate) async fn standing(&self, instance: &str, replica: u32) -> Standing {
        let selector = format!("{INSTANCE_LABEL}={instance},{REPLICA_LABEL}={replica}");
        let Ok(list) = self
            .pods
            .list(&ListParams::default().labels(&selector))
            .await
        else {
            return Standing::default();
        };
        let mut standing = Standing {
            pods: list.items.len(),
            ..Standing::default()
        };
        for pod in &list.items {
            if pod.spec.as_ref().is_some_and(|s| s.node_name.is_some()) {
                standing.bound += 1;
            } else if unschedulable(pod) {
                standing.unschedulable += 1;
            }
        }
        standing
    }

    /// Deletes every object of the instance (its claims go with its pods).
    pub(crate) async fn delete(&self, instance: &str) {
        let params = ListParams::default().labels(&format!("{INSTANCE_LABEL}={instance}"));
        let delete = DeleteParams::default();
        if let Err(e) = self.pods.delete_collection(&delete, &params).await {
            eprintln!("deleting the pods of {instance}: {e}");
        }
        if let Err(e) = self.templates.delete_collection(&delete, &params).await {
            eprintln!("deleting the claim templates of {instance}: {e}");
        }
        if self.gang
            && let Err(e) = self.groups.delete_collection(&delete, &params).await
        {
            eprintln!("deleting the PodGroups of {instance}: {e}");
        }
    }

    /// The instances that still have pods.
    pub(crate) async fn instances(&self) -> Vec<String> {
        let mut names: Vec<String> = self
            .pods
            .list(&ListParams::default().labels(INSTANCE_LABEL))
            .await
            .map(|l| l.items)
            .unwrap_or_default()
            .iter()
            .filter_map(|pod| pod.labels().get(INSTANCE_LABEL).cloned())
            .collect();
        names.sort();
        names.dedup();
        names
    }
}

fn unschedulable(pod: &Pod) -> bool {
    pod.status
        .as_ref()
        .and_then(|status| status.conditions.as_ref())
        .is_some_and(|conditions| {
            conditions.iter().any(|c| {
                c.type_ == "PodScheduled"
                    && c.status == "False"
                    && c.reason.as_deref() == Some("Unschedulable")
            })
        })
}
