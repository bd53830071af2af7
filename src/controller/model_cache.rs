//! The node-local model cache: a host directory per namespace that a shard
//! pod's template asks for by mounting the volume `tessera-model-cache`
//! without defining it. Weights downloaded there outlive the pod: a replica
//! recreated on its plan comes back to the same nodes and reads them from
//! local disk instead of downloading them again. The directory is the
//! controller's `--model-cache-dir`; without it such a template is refused.

use std::fmt;
use std::str::FromStr;

use k8s_openapi::api::core::v1::{HostPathVolumeSource, PodSpec, Volume};

/// The volume a template mounts to ask for the cache.
pub const VOLUME: &str = "tessera-model-cache";

/// The host directory under which each namespace gets its own cache
/// (`--model-cache-dir`): absolute, without `.` or `..` components, not `/`
/// itself, and kept in normal form (no repeated or trailing `/`) so that the
/// same directory always gives the same pods.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ModelCacheDir(String);

impl FromStr for ModelCacheDir {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        if text.trim().is_empty() {
            return Err("must not be empty".to_string());
        }
        if !text.starts_with('/') {
            return Err(format!(
                "{text:?} is not an absolute path (it must start with '/')"
            ));
        }
        if text.chars().any(char::is_control) {
            return Err(format!("{text:?} contains a control character"));
        }
        let parts: Vec<&str> = text.split('/').filter(|part| !part.is_empty()).collect();
        // `..` would let `<dir>/<namespace>` point outside the directory the
        // administrator chose; `.` is refused with it so a path reads as is.
        if parts.iter().any(|part| *part == ".." || *part == ".") {
            return Err(format!(
                "{text:?} has a '.' or '..' component; give the directory itself"
            ));
        }
        if parts.is_empty() {
            // Namespaces are named freely (`etc`, `var`, `proc`), so their
            // directories must never land in the host's root.
            return Err(
                "\"/\" is the host's root; give a directory of its own (e.g. /var/lib/tessera/models)"
                    .to_string(),
            );
        }
        Ok(Self(format!("/{}", parts.join("/"))))
    }
}

impl fmt::Display for ModelCacheDir {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl ModelCacheDir {
    /// The host directory of `namespace`'s pods; `None` for a name that is not
    /// a namespace name (a DNS label), which could leave the directory.
    pub(crate) fn for_namespace(&self, namespace: &str) -> Option<String> {
        let label = !namespace.is_empty()
            && namespace.len() <= 63
            && namespace
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-');
        label.then(|| format!("{}/{namespace}", self.0))
    }
}

/// Whether a container or init container of `spec` mounts the cache volume.
fn mounts_cache(spec: &PodSpec) -> bool {
    spec.containers
        .iter()
        .chain(spec.init_containers.iter().flatten())
        .flat_map(|container| container.volume_mounts.iter().flatten())
        .any(|mount| mount.name == VOLUME)
}

/// Whether `spec` brings its own volume of the cache's name (a PVC, say).
fn defines_cache(spec: &PodSpec) -> bool {
    spec.volumes
        .iter()
        .flatten()
        .any(|volume| volume.name == VOLUME)
}

/// Gives a shard pod that mounts the cache without defining it the host
/// directory `<dir>/<namespace>`, created by kubelet if missing. A template's
/// own volume of that name stands; without a directory nothing is added (the
/// validate stage refused the instance).
pub(crate) fn add_volume(spec: &mut PodSpec, namespace: &str, dir: Option<&ModelCacheDir>) {
    if !mounts_cache(spec) || defines_cache(spec) {
        return;
    }
    let Some(path) = dir.and_then(|dir| dir.for_namespace(namespace)) else {
        return;
    };
    spec.volumes.get_or_insert_with(Vec::new).push(Volume {
        name: VOLUME.to_string(),
        host_path: Some(HostPathVolumeSource {
            path,
            type_: Some("DirectoryOrCreate".to_string()),
        }),
        ..Volume::default()
    });
}

/// Why a template cannot run under this controller, if it mounts the cache
/// without defining it while the controller has no cache directory.
pub(crate) fn problem(spec: &PodSpec, dir: Option<&ModelCacheDir>) -> Option<String> {
    (dir.is_none() && mounts_cache(spec) && !defines_cache(spec)).then(|| {
        format!(
            "template.spec: mounts the volume {VOLUME}, but this controller has no model cache \
             (--model-cache-dir, Helm value modelCache.hostPath); define a volume named {VOLUME} \
             in the template (e.g. a PersistentVolumeClaim) or have the cache turned on"
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::{Container, PersistentVolumeClaimVolumeSource, VolumeMount};

    fn dir(text: &str) -> ModelCacheDir {
        text.parse().expect("a good directory")
    }

    fn mounting(container_mounts: bool, init_mounts: bool) -> PodSpec {
        let mount = |yes: bool| {
            yes.then(|| {
                vec![VolumeMount {
                    name: VOLUME.to_string(),
                    mount_path: "/models".to_string(),
                    ..VolumeMount::default()
                }]
            })
        };
        PodSpec {
            containers: vec![Container {
                name: "runtime".into(),
                volume_mounts: mount(container_mounts),
                ..Container::default()
            }],
            init_containers: init_mounts.then(|| {
                vec![Container {
                    name: "fetch".into(),
                    volume_mounts: mount(true),
                    ..Container::default()
                }]
            }),
            ..PodSpec::default()
        }
    }

    fn host_path(spec: &PodSpec) -> Option<(&str, Option<&str>)> {
        let volume = spec.volumes.iter().flatten().find(|v| v.name == VOLUME)?;
        let host = volume.host_path.as_ref()?;
        Some((host.path.as_str(), host.type_.as_deref()))
    }

    #[test]
    fn good_directories_are_kept_in_normal_form() {
        assert_eq!(
            dir("/var/lib/tessera/models").to_string(),
            "/var/lib/tessera/models"
        );
        assert_eq!(dir("/data//models/").to_string(), "/data/models");
        assert_eq!(dir("/mnt/nvme..0").to_string(), "/mnt/nvme..0");
    }

    #[test]
    fn bad_directories_are_refused_with_the_reason() {
        for (bad, why) in [
            ("", "must not be empty"),
            ("   ", "must not be empty"),
            ("models", "not an absolute path"),
            ("./models", "not an absolute path"),
            (" /models", "not an absolute path"),
            ("/var/../etc", "'..'"),
            ("/var/lib/..", "'..'"),
            ("/var/./lib", "'.'"),
            ("/", "the host's root"),
            ("//", "the host's root"),
            ("/var/lib\nmodels", "control character"),
        ] {
            let error = bad.parse::<ModelCacheDir>().expect_err(bad);
            assert!(error.contains(why), "{bad:?}: {error}");
        }
    }

    #[test]
    fn a_pod_mounting_the_cache_gets_its_namespace_directory() {
        let cache = dir("/var/lib/tessera/models/");
        for (container, init) in [(true, false), (false, true), (true, true)] {
            let mut spec = mounting(container, init);
            add_volume(&mut spec, "ml", Some(&cache));
            assert_eq!(
                host_path(&spec),
                Some(("/var/lib/tessera/models/ml", Some("DirectoryOrCreate"))),
                "container {container}, init {init}"
            );
            assert_eq!(problem(&spec, Some(&cache)), None);
        }
        // Namespaces never share a directory.
        let mut other = mounting(true, false);
        add_volume(&mut other, "team-b", Some(&cache));
        assert_eq!(
            host_path(&other).unwrap().0,
            "/var/lib/tessera/models/team-b"
        );
    }

    #[test]
    fn pods_that_do_not_ask_or_bring_their_own_volume_are_left_alone() {
        let cache = dir("/var/cache/models");
        let mut plain = mounting(false, false);
        add_volume(&mut plain, "ml", Some(&cache));
        assert_eq!(plain.volumes, None);
        assert_eq!(problem(&plain, None), None, "no mount, nothing to refuse");

        let mut own = mounting(true, false);
        let claim = Volume {
            name: VOLUME.to_string(),
            persistent_volume_claim: Some(PersistentVolumeClaimVolumeSource {
                claim_name: "weights".into(),
                read_only: None,
            }),
            ..Volume::default()
        };
        own.volumes = Some(vec![claim.clone()]);
        add_volume(&mut own, "ml", Some(&cache));
        assert_eq!(own.volumes, Some(vec![claim]), "the template's PVC stands");
        assert_eq!(problem(&own, None), None, "its own volume needs no cache");
    }

    #[test]
    fn a_name_that_is_not_a_namespace_gets_no_directory() {
        let cache = dir("/var/cache/models");
        for bad in ["", "..", "a/b", "Upper", &"x".repeat(64)] {
            let mut spec = mounting(true, false);
            add_volume(&mut spec, bad, Some(&cache));
            assert_eq!(spec.volumes, None, "{bad:?}");
        }
    }

    #[test]
    fn without_a_cache_a_template_that_asks_for_one_is_refused() {
        let spec = mounting(true, false);
        let why = problem(&spec, None).expect("refused");
        assert!(why.contains(VOLUME), "{why}");
        assert!(why.contains("--model-cache-dir"), "{why}");
        assert!(why.contains("modelCache.hostPath"), "{why}");
        let mut unchanged = spec.clone();
        add_volume(&mut unchanged, "ml", None);
        assert_eq!(unchanged, spec);
    }
}
