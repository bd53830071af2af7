//! Shards on DRA nodes: each shard pod gets one ResourceClaim asking for
//! exactly its planned devices, and the controller — the shard pods'
//! scheduler — allocates it before binding the pod, as a custom scheduler
//! must. A node is a DRA node when its agent publishes ResourceSlices of the
//! driver (`pools`); the others keep the device plugin's extended resource.
//!
//! - `cached_slice`: a slice as the controller reads and caches it;
//! - `pools`: nodes and device names, from the slices;
//! - `claims`: the claim of a shard and the allocation written into it;
//! - `held`: devices allocated to claims of others, kept out of plans;
//! - `apply`: creating, allocating and deleting shard claims.

pub(crate) mod apply;
mod cached_slice;
pub(crate) mod claims;
pub(crate) mod conflicts;
pub(crate) mod held;
pub mod pools;

use std::sync::Arc;

use k8s_openapi::api::resource::v1::ResourceClaim;
use kube::runtime::reflector::Store;

pub use cached_slice::CachedSlice;
use pools::{Pools, PoolsMemo};

/// The stores DRA needs, when the controller allocates claims.
#[derive(Clone)]
pub struct DraCaches {
    /// The driver's ResourceSlices (all nodes).
    pub slices: Store<CachedSlice>,
    /// Every ResourceClaim (of the watched namespaces): others' allocations
    /// hold devices.
    pub claims: Store<ResourceClaim>,
    pools: Arc<PoolsMemo>,
}

impl DraCaches {
    /// The caches over the driver's slices and the claims.
    pub fn new(slices: Store<CachedSlice>, claims: Store<ResourceClaim>) -> Self {
        Self {
            slices,
            claims,
            pools: Arc::default(),
        }
    }

    /// The pools of `driver` in the cached slices.
    pub fn pools(&self, driver: &str) -> Arc<Pools> {
        self.pools.of(self.slices.state(), driver)
    }
}
