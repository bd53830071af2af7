//! Reading a Kubernetes quantity (`25Gi`, `26843545600`, `1.5G`, `5e9`) as a
//! whole number of units, as DRA capacities and their consumption are
//! written: by this controller in whole GiB, by kube-scheduler in whatever
//! canonical form it chooses. Used by the agent (what a claim was given) and
//! the controller (what claims hold).

/// The quantity in whole units, rounded up; `None` for anything that is not
/// a non-negative quantity within `u64`.
pub(crate) fn whole_units(text: &str) -> Option<u64> {
    let text = text.trim();
    let split = text
        .find(|c: char| !(c.is_ascii_digit() || c == '.' || c == '+'))
        .unwrap_or(text.len());
    let (number, suffix) = text.split_at(split);
    if number.is_empty() || number.starts_with('.') && number.len() == 1 {
        return None;
    }
    let value: f64 = number.parse().ok()?;
    let scale = match suffix {
        "" => 1.0,
        "m" => 1e-3,
        "k" => 1e3,
        "M" => 1e6,
        "G" => 1e9,
        "T" => 1e12,
        "P" => 1e15,
        "E" => 1e18,
        "Ki" => 1024f64,
        "Mi" => 1024f64.powi(2),
        "Gi" => 1024f64.powi(3),
        "Ti" => 1024f64.powi(4),
        "Pi" => 1024f64.powi(5),
        "Ei" => 1024f64.powi(6),
        exponent => {
            let digits = exponent.strip_prefix(['e', 'E'])?;
            let power: i32 = digits.parse().ok()?;
            10f64.powi(power)
        }
    };
    let units = (value * scale).ceil();
    (units.is_finite() && units >= 0.0 && units < u64::MAX as f64).then_some(units as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_form_the_api_server_writes_is_read() {
        assert_eq!(whole_units("25Gi"), Some(25 << 30));
        assert_eq!(whole_units("26843545600"), Some(25 << 30));
        assert_eq!(whole_units("1500Mi"), Some(1500 << 20));
        assert_eq!(whole_units("1.5G"), Some(1_500_000_000));
        assert_eq!(whole_units("5e9"), Some(5_000_000_000));
        assert_eq!(whole_units("1500m"), Some(2), "rounded up");
        assert_eq!(whole_units(" 0 "), Some(0));
    }

    #[test]
    fn malformed_quantities_are_none() {
        for text in [
            "", "Gi", "-1Gi", "1Xi", "1e", "1e9999", "1..5", ".", "1 Gi", "NaN",
        ] {
            assert_eq!(whole_units(text), None, "{text:?}");
        }
    }
}
