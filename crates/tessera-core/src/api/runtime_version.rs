//! `spec.serving.runtimeVersion`: which release of the runtime the shards
//! run. The same runtime serves 2-3x more on the same GPUs from one release
//! to a later one (vLLM's V1 engine, from 0.8), so the serving model keeps
//! constants per version range (`serving::Constants`).

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// A runtime release as `major.minor.patch`. Read from what images and
/// packages are tagged with: a leading `v`, two or three numbers, and any
/// pre-release or build suffix after them (`0.6.3.post2`, `0.10.0rc1`,
/// `v0.20.0+rocm`), which is not compared.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct RuntimeVersion {
    pub major: u32,
    pub minor: u32,
    pub patch: u32,
}

impl RuntimeVersion {
    pub const fn new(major: u32, minor: u32, patch: u32) -> Self {
        Self {
            major,
            minor,
            patch,
        }
    }
}

/// Why a runtime version was refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("`{0}` is not a release number: write major.minor or major.minor.patch, e.g. 0.10.1")]
pub struct InvalidRuntimeVersion(pub String);

impl FromStr for RuntimeVersion {
    type Err = InvalidRuntimeVersion;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let invalid = || InvalidRuntimeVersion(text.to_string());
        let digits = text.strip_prefix('v').unwrap_or(text);
        let mut numbers = Vec::new();
        let mut rest = digits;
        loop {
            let end = rest
                .find(|c: char| !c.is_ascii_digit())
                .unwrap_or(rest.len());
            if end == 0 {
                break;
            }
            numbers.push(rest[..end].parse::<u32>().map_err(|_| invalid())?);
            rest = &rest[end..];
            if numbers.len() == 3 {
                break;
            }
            match rest.strip_prefix('.') {
                Some(after) if after.starts_with(|c: char| c.is_ascii_digit()) => rest = after,
                _ => break,
            }
        }
        // A suffix may follow the numbers, but only after a separator or a
        // pre-release word, never glued digits or a second dot run.
        let suffix_ok = rest.is_empty()
            || rest.starts_with(['.', '-', '+'])
            || rest.starts_with(|c: char| c.is_ascii_alphabetic());
        match numbers.as_slice() {
            [major, minor] if suffix_ok => Ok(Self::new(*major, *minor, 0)),
            [major, minor, patch] if suffix_ok => Ok(Self::new(*major, *minor, *patch)),
            _ => Err(invalid()),
        }
    }
}

impl TryFrom<String> for RuntimeVersion {
    type Error = InvalidRuntimeVersion;

    fn try_from(text: String) -> Result<Self, Self::Error> {
        text.parse()
    }
}

impl From<RuntimeVersion> for String {
    fn from(version: RuntimeVersion) -> String {
        version.to_string()
    }
}

impl fmt::Display for RuntimeVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}.{}", self.major, self.minor, self.patch)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn release_tags_parse_with_their_suffixes() {
        for (text, want) in [
            ("0.10.0", RuntimeVersion::new(0, 10, 0)),
            ("v0.20.0", RuntimeVersion::new(0, 20, 0)),
            ("0.17", RuntimeVersion::new(0, 17, 0)),
            ("0.6.3.post2.dev308", RuntimeVersion::new(0, 6, 3)),
            ("0.6.4.dev4", RuntimeVersion::new(0, 6, 4)),
            ("0.10.0rc1", RuntimeVersion::new(0, 10, 0)),
            ("1.0.0+rocm6.4", RuntimeVersion::new(1, 0, 0)),
            ("0.9.0-beta", RuntimeVersion::new(0, 9, 0)),
        ] {
            assert_eq!(text.parse::<RuntimeVersion>(), Ok(want), "{text}");
        }
    }

    #[test]
    fn what_is_not_a_release_number_is_refused() {
        for text in [
            "",
            "v",
            "latest",
            "1",
            "v1",
            "0.",
            ".1",
            "x.1",
            "0..1",
            "99999999999.1",
            "0.8_1",
            " 0.8",
            "0.8 ",
        ] {
            let read = text.parse::<RuntimeVersion>();
            assert!(read.is_err(), "{text:?} was read as {read:?}");
        }
        let error = "latest".parse::<RuntimeVersion>().expect_err("refused");
        assert!(error.to_string().contains("major.minor"), "{error}");
    }

    #[test]
    fn versions_order_by_number_not_text() {
        let parse = |text: &str| text.parse::<RuntimeVersion>().expect("a version");
        assert!(parse("0.10.0") > parse("0.9.1"));
        assert!(parse("0.8") > parse("0.7.3"));
        assert_eq!(parse("0.8"), parse("0.8.0"));
    }
}
