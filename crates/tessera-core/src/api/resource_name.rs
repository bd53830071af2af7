//! The extended resource GPUs are offered as: one name for every GPU
//! (`tessera.dev/gpu`), or one per vendor when the name holds `{vendor}`
//! (`tessera.dev/{vendor}-gpu` → `tessera.dev/nvidia-gpu`, `tessera.dev/amd-gpu`),
//! for clusters whose quotas or dashboards count NVIDIA and AMD apart.

use std::fmt;
use std::str::FromStr;

use super::Vendor;
use super::limits::is_dns_label;

const PLACEHOLDER: &str = "{vendor}";

/// A validated extended resource name, possibly with one `{vendor}`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ResourceName(String);

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid extended resource name {name:?}: {why}")]
pub struct InvalidResourceName {
    pub name: String,
    pub why: String,
}

impl ResourceName {
    /// Whether each vendor gets its own resource.
    pub fn per_vendor(&self) -> bool {
        self.0.contains(PLACEHOLDER)
    }

    /// The resource a device of `vendor` is offered as.
    pub fn for_vendor(&self, vendor: Vendor) -> String {
        self.0.replace(PLACEHOLDER, vendor.as_str())
    }

    /// Every name this can stand for.
    pub fn all(&self) -> Vec<String> {
        if self.per_vendor() {
            Vendor::ALL
                .into_iter()
                .map(|v| self.for_vendor(v))
                .collect()
        } else {
            vec![self.0.clone()]
        }
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl Default for ResourceName {
    fn default() -> Self {
        ResourceName(super::DEFAULT_RESOURCE_NAME.to_string())
    }
}

impl fmt::Display for ResourceName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl FromStr for ResourceName {
    type Err = InvalidResourceName;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let fail = |why: String| InvalidResourceName {
            name: s.to_string(),
            why,
        };
        if s.matches(PLACEHOLDER).count() > 1 {
            return Err(fail(format!("{PLACEHOLDER} may appear once")));
        }
        // The longest vendor name stands in, so length limits hold for all.
        let longest = Vendor::ALL
            .into_iter()
            .map(Vendor::as_str)
            .max_by_key(|name| name.len())
            .unwrap_or_default();
        check(&s.replace(PLACEHOLDER, longest)).map_err(fail)?;
        Ok(ResourceName(s.to_string()))
    }
}

/// Kubernetes' rules for extended resources: `<domain>/<name>` outside the
/// `kubernetes.io` domain, the domain a DNS subdomain, the name a qualified
/// name part (kubelet refuses anything else at registration).
fn check(name: &str) -> Result<(), String> {
    let Some((domain, local)) = name.split_once('/') else {
        return Err("must be <domain>/<name>, e.g. tessera.dev/gpu".into());
    };
    if local.contains('/') {
        return Err("must hold exactly one '/'".into());
    }
    if domain.is_empty() || domain.len() > 253 {
        return Err("the domain must have 1 to 253 characters".into());
    }
    if !domain.split('.').all(|l| is_dns_label(l, 63, false)) {
        return Err(format!(
            "the domain {domain:?} must be a DNS subdomain: lower-case letters, digits, '-' and '.'"
        ));
    }
    if domain == "kubernetes.io" || domain.ends_with(".kubernetes.io") {
        return Err("the kubernetes.io domain is reserved for native resources".into());
    }
    let edge = |b: Option<u8>| b.is_some_and(|b| b.is_ascii_alphanumeric());
    let name_ok = !local.is_empty()
        && local.len() <= 63
        && local
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
        && edge(local.bytes().next())
        && edge(local.bytes().last());
    if !name_ok {
        return Err(format!(
            "the name {local:?} must have 1 to 63 letters, digits, '-', '_' or '.', starting and ending with a letter or digit"
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(s: &str) -> Result<ResourceName, String> {
        s.parse::<ResourceName>().map_err(|e| e.to_string())
    }

    #[test]
    fn one_name_for_every_vendor() {
        let r = parse("tessera.dev/gpu").unwrap();
        assert!(!r.per_vendor());
        assert_eq!(r.for_vendor(Vendor::Amd), "tessera.dev/gpu");
        assert_eq!(r.all(), ["tessera.dev/gpu"]);
        assert_eq!(ResourceName::default(), r);
    }

    #[test]
    fn a_placeholder_gives_each_vendor_its_own() {
        let r = parse("tessera.dev/{vendor}-gpu").unwrap();
        assert!(r.per_vendor());
        assert_eq!(r.for_vendor(Vendor::Nvidia), "tessera.dev/nvidia-gpu");
        assert_eq!(r.all(), ["tessera.dev/nvidia-gpu", "tessera.dev/amd-gpu"]);
        assert_eq!(
            parse("{vendor}.example.com/gpu")
                .unwrap()
                .for_vendor(Vendor::Amd),
            "amd.example.com/gpu"
        );
    }

    #[test]
    fn malformed_names_are_explained() {
        for (bad, why) in [
            ("", "must be <domain>/<name>"),
            ("gpu", "must be <domain>/<name>"),
            ("a/b/c", "exactly one '/'"),
            ("/gpu", "1 to 253 characters"),
            ("Tessera.dev/gpu", "DNS subdomain"),
            ("tessera..dev/gpu", "DNS subdomain"),
            ("-tessera.dev/gpu", "DNS subdomain"),
            ("kubernetes.io/gpu", "reserved"),
            ("example.kubernetes.io/gpu", "reserved"),
            ("tessera.dev/", "the name"),
            ("tessera.dev/-gpu", "the name"),
            ("tessera.dev/gpu!", "the name"),
            ("tessera.dev/{vendor}-{vendor}", "may appear once"),
            ("tessera.dev/{gpu}", "the name"),
        ] {
            let err = parse(bad).expect_err(bad);
            assert!(err.contains(why), "{bad:?}: {err}");
            assert!(err.contains("invalid extended resource name"), "{err}");
        }
        let long = format!("tessera.dev/{}", "g".repeat(64));
        assert!(parse(&long).unwrap_err().contains("1 to 63"));
        let long = format!("tessera.dev/{}-{}", PLACEHOLDER, "g".repeat(57));
        assert!(parse(&long).is_err(), "checked with the vendor filled in");
    }
}
