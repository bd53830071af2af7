//! What the caches' cut-down types (`CachedNode`, `CachedSlice`) share: each
//! is watched and cached as the Kubernetes kind it cuts down, with its own
//! metadata.

/// `impl kube::Resource for $cached` as the kind `$kind`: its API group,
/// version, kind, plural and scope, and `$cached`'s own `metadata`.
macro_rules! cached_resource {
    ($cached:ty, $kind:ty) => {
        impl kube::Resource for $cached {
            type DynamicType = ();
            type Scope = <$kind as kube::Resource>::Scope;

            fn kind(dt: &()) -> std::borrow::Cow<'_, str> {
                <$kind as kube::Resource>::kind(dt)
            }

            fn group(dt: &()) -> std::borrow::Cow<'_, str> {
                <$kind as kube::Resource>::group(dt)
            }

            fn version(dt: &()) -> std::borrow::Cow<'_, str> {
                <$kind as kube::Resource>::version(dt)
            }

            fn plural(dt: &()) -> std::borrow::Cow<'_, str> {
                <$kind as kube::Resource>::plural(dt)
            }

            fn meta(&self) -> &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta {
                &self.metadata
            }

            fn meta_mut(
                &mut self,
            ) -> &mut k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta {
                &mut self.metadata
            }
        }
    };
}

pub(crate) use cached_resource;
