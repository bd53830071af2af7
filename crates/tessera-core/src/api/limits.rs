//! Every limit a `ModelInstance` is held to, defined once. The CRD schema
//! (range and length attributes, CEL rules) and [`ModelInstanceSpec::validate`]
//! both read these constants, so `tessera place`, the controller and the API
//! server refuse exactly the same objects; a test walks the generated schema
//! and feeds each boundary to both.
//!
//! [`ModelInstanceSpec::validate`]: super::ModelInstanceSpec::validate

/// An inclusive range a field must lie in.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Bounds<T> {
    pub min: T,
    pub max: T,
}

impl Bounds<f64> {
    /// Records `field: value is outside …` unless `value` is a number in range.
    pub(crate) fn check(&self, field: &str, value: f64, problems: &mut Vec<String>) {
        if !(value.is_finite() && value >= self.min && value <= self.max) {
            problems.push(format!(
                "{field}: {} is outside the allowed range {} to {}",
                number(value),
                number(self.min),
                number(self.max)
            ));
        }
    }
}

impl Bounds<u32> {
    pub(crate) fn check(&self, field: &str, value: u32, problems: &mut Vec<String>) {
        if !(self.min..=self.max).contains(&value) {
            problems.push(format!(
                "{field}: {value} is outside the allowed range {} to {}",
                self.min, self.max
            ));
        }
    }
}

/// `model.name`: characters.
pub const MODEL_NAME_LENGTH: Bounds<u32> = Bounds { min: 1, max: 253 };
/// `model.parametersBillions`.
pub const PARAMETERS_BILLIONS: Bounds<f64> = Bounds {
    min: 0.001,
    max: 100_000.0,
};
/// `model.layers`.
pub const LAYERS: Bounds<u32> = Bounds {
    min: 1,
    max: 100_000,
};
/// `model.hiddenSize`.
pub const HIDDEN_SIZE: Bounds<u32> = Bounds {
    min: 1,
    max: 1_000_000,
};
/// `model.kvCacheGiB`.
pub const KV_CACHE_GIB: Bounds<f64> = Bounds {
    min: 0.0,
    max: 1_000_000.0,
};
/// Bytes a parameter of `model.weightsGiB` may take: one bit (the narrowest
/// quantisations) to fp32. Its range in GiB follows from the parameters'.
pub const WEIGHT_BYTES_PER_PARAMETER: Bounds<f64> = Bounds {
    min: 0.125,
    max: 4.0,
};
/// `model.overheadGiB`.
pub const OVERHEAD_GIB: Bounds<f64> = Bounds {
    min: 0.0,
    max: 10_000.0,
};
/// `model.attentionHeads` and `model.kvHeads`: far above any model's (128
/// for the largest Llama).
pub const HEADS: Bounds<u32> = Bounds { min: 1, max: 4096 };
/// `serving.maxRunningRequests`: what runtimes accept for their batch cap.
pub const RUNNING_REQUESTS: Bounds<u32> = Bounds {
    min: 1,
    max: 65_536,
};
/// `serving.inputTokens` and `serving.outputTokens`: one token to ten million.
pub const SERVING_TOKENS: Bounds<u32> = Bounds {
    min: 1,
    max: 10_000_000,
};
/// `serving.maxTimePerOutputTokenMs`: from a tenth of a millisecond to a minute.
pub const TIME_PER_OUTPUT_TOKEN_MS: Bounds<f64> = Bounds {
    min: 0.1,
    max: 60_000.0,
};
/// `serving.maxTimeToFirstTokenMs`: up to an hour.
pub const TIME_TO_FIRST_TOKEN_MS: Bounds<f64> = Bounds {
    min: 0.1,
    max: 3_600_000.0,
};
/// A measured correction of the serving model (`status.corrections`). Wide,
/// because a runtime may run on what the model knows nothing of (vLLM's CPU
/// build behind a fake H100 in the real-node tests is about 20× slower);
/// beyond it a reading is taken as broken, not as a runtime.
pub const CORRECTION: Bounds<f64> = Bounds {
    min: 0.01,
    max: 1000.0,
};
/// `serving.requestsPerSecond`: above zero.
pub const REQUESTS_PER_SECOND: Bounds<f64> = Bounds {
    min: 0.0001,
    max: 10_000_000.0,
};
/// `spec.replicas`. Every replica's shards are listed in the status, which
/// etcd holds to about 1.5 MiB; 256 replicas of a few shards each stay well
/// inside that.
pub const REPLICAS: Bounds<u32> = Bounds { min: 0, max: 256 };
/// Replicas a demand (`serving.requestsPerSecond` without `replicas`) is
/// served with at most: a demand that needs more is reported unmet.
pub const DEMAND_REPLICAS: Bounds<u32> = Bounds { min: 1, max: 64 };
/// `parallelism.tensor` when it is a number.
pub const TENSOR: Bounds<u32> = Bounds { min: 1, max: 64 };
/// `parallelism.minTokensPerSecond`: above zero; a million is far beyond any
/// single-stream decode speed.
pub const MIN_TOKENS_PER_SECOND: Bounds<f64> = Bounds {
    min: 0.001,
    max: 1_000_000.0,
};
/// `parallelism.pipeline` when it is a number (also at most `model.layers`).
pub const PIPELINE: Bounds<u32> = Bounds { min: 1, max: 1024 };
/// Each of `placement.weights.*`.
pub const WEIGHT: Bounds<f64> = Bounds { min: 0.0, max: 1.0 };
/// `placement.maxTemperatureC`.
pub const MAX_TEMPERATURE_C: Bounds<f64> = Bounds {
    min: 1.0,
    max: 150.0,
};
/// `placement.deadlineMs`.
pub const DEADLINE_MS: Bounds<u32> = Bounds {
    min: 1,
    max: 600_000,
};

/// `metadata.name` of a ModelInstance with one replica, at most. Shard pods
/// are named `<name>-shard-<i>` (up to four digits for 1024 stages) and the
/// shards' headless Service `<name>`; both must stay DNS labels of 63
/// characters. Replicas after the first are named `<name>-r<r>-shard-<i>`,
/// so more replicas leave room for a shorter name only (see
/// [`instance_name_max`]).
pub const INSTANCE_NAME_MAX: usize = 63 - "-shard-".len() - 4;

/// The longest name an instance with `replicas` replicas may have: its last
/// replica's pods add `-r<replicas - 1>`.
pub fn instance_name_max(replicas: u32) -> usize {
    if replicas <= 1 {
        INSTANCE_NAME_MAX
    } else {
        INSTANCE_NAME_MAX - "-r".len() - (replicas - 1).to_string().len()
    }
}

/// The CEL rule on the CRD's root that holds `metadata.name` to
/// [`check_instance_name`], so `kubectl apply` (and `kubectl scale`) refuses a
/// name the controller could not run.
/// The count is the larger of `spec.replicas` and `serving.maxReplicas`
/// (which only a measured demand has).
pub fn instance_name_rule() -> String {
    let replicas = "(has(self.spec.replicas) ? self.spec.replicas : 1)";
    let measured = "(has(self.spec.serving) && has(self.spec.serving.maxReplicas) ? self.spec.serving.maxReplicas : 0)";
    let most = format!("({replicas} > {measured} ? {replicas} : {measured})");
    format!(
        "size(self.metadata.name) + ({most} > 1 ? 2 + size(string({most} - 1)) : 0) <= {INSTANCE_NAME_MAX} && self.metadata.name.matches('^[a-z]([-a-z0-9]*[a-z0-9])?$')"
    )
}

pub fn instance_name_message() -> String {
    format!("metadata.name {}", instance_name_requirement(1))
}

fn instance_name_requirement(replicas: u32) -> String {
    let max = instance_name_max(replicas);
    let with = if replicas > 1 {
        format!(" with {replicas} replicas")
    } else {
        format!(" ({INSTANCE_NAME_MAX} with one replica, fewer with more)")
    };
    format!(
        "must be at most {max} characters{with} of lower-case letters, digits and '-', start with a letter and end with a letter or digit (it names the shard pods and their Service)"
    )
}

/// `Err` with the reason when `name` cannot name a ModelInstance with
/// `replicas` replicas: a DNS-1035 label (what a Service name must be) short
/// enough for its shard pods' names (see [`instance_name_max`]).
pub fn check_instance_name(name: &str, replicas: u32) -> Result<(), String> {
    if is_dns_label(name, instance_name_max(replicas), true) {
        return Ok(());
    }
    let shown: String = name.chars().take(64).collect();
    let more = if name.chars().count() > 64 { "…" } else { "" };
    Err(format!(
        "metadata.name: {shown:?}{more} ({} characters) is not a valid name: {}",
        name.chars().count(),
        instance_name_requirement(replicas)
    ))
}

/// `Err` with the reason when `namespace` is not a DNS-1123 label, as the API
/// server requires of a namespace name.
pub fn check_namespace(namespace: &str) -> Result<(), String> {
    if is_dns_label(namespace, 63, false) {
        Ok(())
    } else {
        Err(format!(
            "metadata.namespace: {namespace:?} is not a valid namespace: at most 63 lower-case letters, digits and '-', starting and ending with a letter or digit"
        ))
    }
}

/// Lower-case letters, digits and '-', at most `max` of them, starting with a
/// letter (DNS-1035) or a letter or digit (DNS-1123), ending with either.
pub(crate) fn is_dns_label(name: &str, max: usize, letter_first: bool) -> bool {
    let bytes = name.as_bytes();
    let (Some(first), Some(last)) = (bytes.first(), bytes.last()) else {
        return false;
    };
    bytes.len() <= max
        && bytes
            .iter()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'-')
        && (first.is_ascii_lowercase() || !letter_first && first.is_ascii_digit())
        && *last != b'-'
}

/// A number as a person reads it: `1e308` stays short, `0.001` stays exact.
pub(crate) fn number(value: f64) -> String {
    if value != 0.0 && value.is_finite() && !(1e-4..1e7).contains(&value.abs()) {
        format!("{value:e}")
    } else {
        format!("{value}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bounds_name_the_field_and_the_range() {
        let mut p = Vec::new();
        PARAMETERS_BILLIONS.check("model.parametersBillions", 1e308, &mut p);
        PARAMETERS_BILLIONS.check("model.parametersBillions", f64::NAN, &mut p);
        PARAMETERS_BILLIONS.check("model.parametersBillions", 0.001, &mut p);
        LAYERS.check("model.layers", 100_001, &mut p);
        LAYERS.check("model.layers", 100_000, &mut p);
        assert_eq!(
            p,
            vec![
                "model.parametersBillions: 1e308 is outside the allowed range 0.001 to 100000",
                "model.parametersBillions: NaN is outside the allowed range 0.001 to 100000",
                "model.layers: 100001 is outside the allowed range 1 to 100000",
            ]
        );
    }

    #[test]
    fn instance_names_are_dns_labels_short_enough_for_their_shards() {
        assert_eq!(INSTANCE_NAME_MAX, 52);
        for good in ["m", "llama-70b", "a1", &"a".repeat(52)] {
            assert_eq!(check_instance_name(good, 1), Ok(()), "{good}");
        }
        for bad in [
            "",
            "My_Model!!",
            "1abc",
            "abc-",
            "a.b",
            "Abc",
            &"a".repeat(53),
            &"a".repeat(300),
        ] {
            let e = check_instance_name(bad, 1).unwrap_err();
            assert!(e.starts_with("metadata.name: "), "{e}");
            assert!(e.len() < 400, "the name is shortened: {e}");
        }
    }

    #[test]
    fn more_replicas_leave_room_for_shorter_names_only() {
        assert_eq!(instance_name_max(0), 52);
        assert_eq!(instance_name_max(2), 49, "-r1");
        assert_eq!(instance_name_max(11), 48, "-r10");
        assert_eq!(instance_name_max(REPLICAS.max), 47, "-r255");
        // The longest pod name of the longest allowed name stays a DNS label.
        for replicas in [2, 10, 11, 101, REPLICAS.max] {
            let name = "a".repeat(instance_name_max(replicas));
            let pod = format!("{name}-r{}-shard-1023", replicas - 1);
            assert_eq!(pod.len(), 63, "{pod}");
        }
        assert!(check_instance_name(&"a".repeat(48), 11).is_ok());
        let e = check_instance_name(&"a".repeat(49), 11).unwrap_err();
        assert!(e.contains("at most 48 characters with 11 replicas"), "{e}");
    }

    #[test]
    fn namespaces_are_dns_labels() {
        assert_eq!(check_namespace("ml-team"), Ok(()));
        for bad in ["", "ML", "-a", "a_b", &"a".repeat(64)] {
            assert!(check_namespace(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn numbers_print_short() {
        assert_eq!(number(1e308), "1e308");
        assert_eq!(number(0.001), "0.001");
        assert_eq!(number(100_000.0), "100000");
        assert_eq!(number(0.0), "0");
        assert_eq!(number(-1e-9), "-1e-9");
    }
}
