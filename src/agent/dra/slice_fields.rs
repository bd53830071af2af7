//! What every device in the node's slices carries whatever it is (a whole
//! GPU, a partition): the name of its memory capacity, string attributes cut
//! to what the API server takes, and the taint of an unhealthy device.

use k8s_openapi::api::resource::v1::{DeviceAttribute, DeviceTaint};

pub(crate) use tessera_core::api::DRA_MEMORY_CAPACITY as MEMORY_CAPACITY;
/// The API server refuses longer string attribute values.
pub(crate) const MAX_STRING_ATTRIBUTE: usize = 64;

/// The taint an unhealthy device carries: no new allocation (`NoSchedule`),
/// but pods already using it are not evicted by kube-controller-manager —
/// the controller repairs tessera's own shards itself.
pub(crate) fn unhealthy_taint(driver: &str) -> DeviceTaint {
    DeviceTaint {
        key: format!("{driver}/unhealthy"),
        effect: "NoSchedule".to_string(),
        value: None,
        time_added: None,
    }
}

/// A string attribute holding `value` (cut to what the API server takes),
/// or none for an empty value.
pub(crate) fn string_attribute(value: &str) -> Option<DeviceAttribute> {
    (!value.is_empty()).then(|| DeviceAttribute {
        string: Some(truncated(value)),
        ..DeviceAttribute::default()
    })
}

fn truncated(value: &str) -> String {
    let mut end = value.len().min(MAX_STRING_ATTRIBUTE);
    while !value.is_char_boundary(end) {
        end -= 1;
    }
    value[..end].to_string()
}
