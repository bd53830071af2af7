//! The observe stage: what the caches show when a reconcile (or a map page)
//! starts, and the devices everything but the instance holds.

use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::ResourceClaim;
use kube::ResourceExt;

use super::context::{Context, Instance};
use super::dra::held::held_by_claims;
use super::dra::pools::Pools;
use super::held::{Claims, Held, held_devices};
use super::node_cache::gpu_nodes;
use super::nodes::NodeInfo;
use tessera_core::api::ModelInstance;

/// What the caches showed when this reconcile (or a map page) started.
pub(crate) struct Observed {
    pub(crate) nodes: Vec<Arc<NodeInfo>>,
    pub(crate) pods: Vec<Arc<Pod>>,
    /// This instance's shard pods by name (none for the map).
    pub(crate) mine: BTreeMap<String, Arc<Pod>>,
    /// The DRA nodes' pools (empty without DRA).
    pub(crate) pools: Arc<Pools>,
    /// Every cached ResourceClaim (none without DRA).
    pub(crate) claims: Vec<Arc<ResourceClaim>>,
}

pub(crate) fn observe(ctx: &Context, instance: &Instance) -> Observed {
    let mut observed = observe_cluster(ctx);
    observed.mine = observed
        .pods
        .iter()
        .filter(|p| {
            p.namespace().as_deref() == Some(instance.namespace.as_str())
                && p.owner_references().iter().any(|o| o.uid == instance.uid)
        })
        .map(|p| (p.name_any(), Arc::clone(p)))
        .collect();
    observed
}

/// The caches' nodes, pods and claims.
pub(crate) fn observe_cluster(ctx: &Context) -> Observed {
    let (pools, claims) = match (&ctx.caches.dra, &ctx.settings.dra_driver) {
        (Some(dra), Some(driver)) => (dra.pools(driver), dra.claims.state()),
        _ => (Arc::default(), Vec::new()),
    };
    Observed {
        nodes: gpu_nodes(&ctx.caches.nodes.state()),
        pods: ctx.caches.pods.state(),
        mine: BTreeMap::new(),
        pools,
        claims,
    }
}

/// The devices other instances hold or have just claimed. Claims of deleted
/// instances are dropped on the way.
pub(crate) fn held_by_others(
    ctx: &Context,
    instance: &Instance,
    observed: &Observed,
    claims: &mut Claims,
) -> Held {
    let instances = ctx.caches.instances.state();
    let live: HashSet<&str> = instances
        .iter()
        .filter_map(|i| i.metadata.uid.as_deref())
        .collect();
    claims.retain(|claimed, _| live.contains(claimed.as_str()));
    ctx.written.retain_live(|uid| live.contains(uid));
    held_except(ctx, &instance.uid, &instances, claims, observed)
}

/// The devices held by anything but the instance with UID `me` (pass an
/// empty UID for everything held): instances' plans, pods and claims.
pub(crate) fn held_except(
    ctx: &Context,
    me: &str,
    instances: &[Arc<ModelInstance>],
    claims: &Claims,
    observed: &Observed,
) -> Held {
    let mut held = held_devices(
        me,
        instances.iter().map(AsRef::as_ref),
        claims,
        observed.pods.iter().map(AsRef::as_ref),
        &observed.nodes,
    );
    if let Some(driver) = &ctx.settings.dra_driver {
        for hold in held_by_claims(me, &observed.claims, driver, &observed.pools) {
            match hold.share {
                Some(bytes) => held
                    .shares
                    .entry(hold.device)
                    .or_default()
                    .push((hold.holder, bytes)),
                None => {
                    held.devices.entry(hold.device).or_insert(hold.holder);
                }
            }
        }
    }
    held
}
