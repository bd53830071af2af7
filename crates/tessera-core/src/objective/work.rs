//! The work a request costs: what weighs a request to one model against a
//! request to another.

use crate::api::{ModelInstanceSpec, ServingSpec};

/// FLOPs in a TFLOP: work per second is shown in TFLOP/s.
pub const TFLOP: f64 = 1e12;

/// FLOPs one typical request of `spec` costs: a forward pass spends two
/// FLOPs per parameter per token (a multiply and an add), over the prompt's
/// and the output's tokens (`spec.serving`'s request, its defaults where
/// unset). Attention's share, which grows with the context, is left out: it
/// is the same for every model at the same request length to within a few
/// percent of the weights' share at the lengths served, and what matters
/// here is the ratio between models (a 405B request costs ~340 times a 1.2B
/// one), not the absolute figure.
pub fn work_per_request(spec: &ModelInstanceSpec) -> f64 {
    let serving = spec.serving.clone().unwrap_or_default();
    let tokens = request_tokens(&serving);
    let parameters = spec.model.parameters_billions.max(0.0) * 1e9;
    2.0 * parameters * tokens
}

fn request_tokens(serving: &ServingSpec) -> f64 {
    f64::from(serving.input_tokens) + f64::from(serving.output_tokens)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(yaml: &str) -> ModelInstanceSpec {
        serde_saphyr::from_str(yaml).expect("a valid spec")
    }

    #[test]
    fn a_request_costs_two_flops_a_parameter_a_token() {
        let small = spec("model: {name: s, parametersBillions: 1.2, layers: 16}");
        // 1,024 prompt and 256 output tokens by default.
        assert_eq!(work_per_request(&small), 2.0 * 1.2e9 * 1280.0);
        let large = spec(
            "model: {name: l, parametersBillions: 34, layers: 48}\nserving: {inputTokens: 2000, outputTokens: 500}",
        );
        assert_eq!(work_per_request(&large), 2.0 * 34e9 * 2500.0);
        // The ratio the example names: a 34B request is ~28x a 1.2B one.
        let same_length = spec("model: {name: l, parametersBillions: 34, layers: 48}");
        let ratio = work_per_request(&same_length) / work_per_request(&small);
        assert!((ratio - 28.33).abs() < 0.01, "{ratio}");
    }
}
