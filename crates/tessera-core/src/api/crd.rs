//! The `ModelInstance` CustomResourceDefinition as tessera ships it: what
//! kube-derive generates, with the schema cut to what every API server we claim
//! understands.

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::{
    CustomResourceDefinition, JSONSchemaProps, JSONSchemaPropsOrArray, JSONSchemaPropsOrBool,
};
use kube::CustomResourceExt;

use super::ModelInstance;

/// The formats Kubernetes' CRD validation knows. API servers from 1.33 on warn
/// about any other on every apply (`unrecognized format "uint32"`), and older
/// ones ignore them silently.
const KUBERNETES_FORMATS: &[&str] = &[
    "bsonobjectid",
    "uri",
    "email",
    "hostname",
    "ipv4",
    "ipv6",
    "cidr",
    "mac",
    "uuid",
    "uuid3",
    "uuid4",
    "uuid5",
    "isbn",
    "isbn10",
    "isbn13",
    "creditcard",
    "ssn",
    "hexcolor",
    "rgbcolor",
    "byte",
    "password",
    "date",
    "duration",
    "datetime",
    "date-time",
    "int32",
    "int64",
    "float",
    "double",
];

/// The CRD, every schema format one Kubernetes defines.
pub fn crd() -> CustomResourceDefinition {
    let mut crd = ModelInstance::crd();
    for version in &mut crd.spec.versions {
        if let Some(schema) = version
            .schema
            .as_mut()
            .and_then(|s| s.open_api_v3_schema.as_mut())
        {
            kubernetes_formats_only(schema);
        }
    }
    crd
}

/// The CRD as YAML, exactly as committed under `crds/`.
pub fn crd_yaml() -> String {
    // The CRD is built from our own static types; serializing it cannot fail.
    serde_saphyr::to_string(&crd()).unwrap_or_default()
}

/// Replaces the formats schemars gives Rust's unsigned and narrow integers by
/// the bounds they stand for, and drops any other format Kubernetes does not
/// define, all through the schema.
fn kubernetes_formats_only(schema: &mut JSONSchemaProps) {
    if let Some(format) = schema.format.take() {
        if KUBERNETES_FORMATS.contains(&format.as_str()) {
            schema.format = Some(format);
        } else if let Some((min, max)) = integer_range(&format) {
            schema.minimum = Some(schema.minimum.map_or(min, |m| m.max(min)));
            schema.maximum = Some(schema.maximum.map_or(max, |m| m.min(max)));
        }
    }
    let children = schema
        .properties
        .iter_mut()
        .chain(schema.pattern_properties.iter_mut())
        .chain(schema.definitions.iter_mut())
        .flat_map(|map| map.values_mut())
        .chain(
            [&mut schema.all_of, &mut schema.any_of, &mut schema.one_of]
                .into_iter()
                .flatten()
                .flatten(),
        );
    for child in children {
        kubernetes_formats_only(child);
    }
    if let Some(not) = schema.not.as_deref_mut() {
        kubernetes_formats_only(not);
    }
    match schema.items.as_mut() {
        Some(JSONSchemaPropsOrArray::Schema(item)) => kubernetes_formats_only(item),
        Some(JSONSchemaPropsOrArray::Schemas(items)) => {
            items.iter_mut().for_each(kubernetes_formats_only)
        }
        None => {}
    }
    for extra in [
        &mut schema.additional_properties,
        &mut schema.additional_items,
    ] {
        if let Some(JSONSchemaPropsOrBool::Schema(s)) = extra.as_mut() {
            kubernetes_formats_only(s);
        }
    }
}

/// The values a schemars integer format allows; `None` for formats that are
/// not integers.
fn integer_range(format: &str) -> Option<(f64, f64)> {
    Some(match format {
        "uint8" => (0.0, f64::from(u8::MAX)),
        "uint16" => (0.0, f64::from(u16::MAX)),
        "uint32" => (0.0, f64::from(u32::MAX)),
        "int8" => (f64::from(i8::MIN), f64::from(i8::MAX)),
        "int16" => (f64::from(i16::MIN), f64::from(i16::MAX)),
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn formats(schema: &JSONSchemaProps, path: &str, found: &mut Vec<(String, String)>) {
        if let Some(f) = &schema.format {
            found.push((path.to_string(), f.clone()));
        }
        for (name, child) in schema.properties.iter().flatten() {
            formats(child, &format!("{path}.{name}"), found);
        }
        if let Some(JSONSchemaPropsOrArray::Schema(item)) = &schema.items {
            formats(item, &format!("{path}[]"), found);
        }
        if let Some(JSONSchemaPropsOrBool::Schema(s)) = &schema.additional_properties {
            formats(s, &format!("{path}{{}}"), found);
        }
    }

    fn root(crd: &CustomResourceDefinition) -> &JSONSchemaProps {
        crd.spec.versions[0]
            .schema
            .as_ref()
            .and_then(|s| s.open_api_v3_schema.as_ref())
            .unwrap()
    }

    /// The paths of the properties below `schema` with no description.
    fn undescribed(schema: &JSONSchemaProps, path: &str, found: &mut Vec<String>) {
        for (name, child) in schema.properties.iter().flatten() {
            let here = format!("{path}.{name}");
            if child
                .description
                .as_deref()
                .is_none_or(|d| d.trim().is_empty())
            {
                found.push(here.clone());
            }
            undescribed(child, &here, found);
        }
        if let Some(JSONSchemaPropsOrArray::Schema(item)) = &schema.items {
            undescribed(item, &format!("{path}[]"), found);
        }
        if let Some(JSONSchemaPropsOrBool::Schema(s)) = &schema.additional_properties {
            undescribed(s, &format!("{path}{{}}"), found);
        }
    }

    #[test]
    fn every_field_of_the_crd_explains_itself_in_kubectl_explain() {
        let mut found = Vec::new();
        undescribed(root(&crd()), "", &mut found);
        assert!(
            found.is_empty(),
            "fields without a description (a doc comment on the field): {found:?}"
        );
    }

    #[test]
    fn every_format_in_the_crd_is_one_kubernetes_defines() {
        let mut found = Vec::new();
        formats(root(&crd()), "", &mut found);
        assert!(!found.is_empty(), "the walk found no format at all");
        for (path, format) in found {
            assert!(
                KUBERNETES_FORMATS.contains(&format.as_str()),
                "{path}: format {format}"
            );
        }
    }

    #[test]
    fn a_u32_keeps_its_bounds_without_its_format() {
        let generated = ModelInstance::crd();
        let shards = &root(&generated).properties.as_ref().unwrap()["status"]
            .properties
            .as_ref()
            .unwrap()["shards"];
        assert_eq!(shards.format.as_deref(), Some("uint32"), "schemars changed");
        let shipped = crd();
        let shards = &root(&shipped).properties.as_ref().unwrap()["status"]
            .properties
            .as_ref()
            .unwrap()["shards"];
        assert_eq!(shards.format, None);
        assert_eq!(shards.minimum, Some(0.0));
        assert_eq!(shards.maximum, Some(4_294_967_295.0));
    }

    #[test]
    fn a_tighter_bound_of_the_field_stays() {
        let mut schema = JSONSchemaProps {
            format: Some("uint32".into()),
            minimum: Some(1.0),
            maximum: Some(64.0),
            ..Default::default()
        };
        kubernetes_formats_only(&mut schema);
        assert_eq!((schema.minimum, schema.maximum), (Some(1.0), Some(64.0)));
        let mut unknown = JSONSchemaProps {
            format: Some("color-name".into()),
            ..Default::default()
        };
        kubernetes_formats_only(&mut unknown);
        assert_eq!(unknown, JSONSchemaProps::default());
    }
}
