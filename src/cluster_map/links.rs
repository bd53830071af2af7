//! How the map's pages name each other: an instance's anchor on the offline
//! page and the path segments of its own page, percent-encoded.

use percent_encoding::{AsciiSet, NON_ALPHANUMERIC, utf8_percent_encode};

use super::model::MapInstance;

/// Everything but RFC 3986's unreserved characters.
const RESERVED: &AsciiSet = &NON_ALPHANUMERIC
    .remove(b'-')
    .remove(b'.')
    .remove(b'_')
    .remove(b'~');

pub(super) fn anchor(instance: &MapInstance) -> String {
    format!("instance-{}", encode_segment(&instance.key()))
}

/// `text` as one path segment or fragment (Kubernetes names need no
/// encoding, but a cluster file's may).
pub(super) fn encode_segment(text: &str) -> String {
    utf8_percent_encode(text, RESERVED).to_string()
}
