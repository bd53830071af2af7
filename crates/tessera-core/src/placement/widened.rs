//! What a plan says about the format its weights run in: where FP8 or FP4
//! weights land on a GPU without a rate for that format, they are widened
//! (`precision::TensorRates::runs_in`), and the plan names the product.

use super::plan::Plan;
use super::precision::Precision;
use super::problem::Problem;

/// For a plan of weights in `precision`: each planned GPU product without a
/// rate for it, with the format the weights run in there instead, once per
/// product.
pub(crate) fn widened(problem: &Problem, plan: &Plan) -> Vec<String> {
    let precision = problem.model.precision;
    // Every GPU has the FP16 rate: nothing to look up (most plans).
    if precision == Precision::Fp16 {
        return Vec::new();
    }
    let mut said: Vec<String> = Vec::new();
    for stage in &plan.stages {
        let Some(node) = problem.nodes.iter().find(|node| node.name == stage.node) else {
            continue;
        };
        for device in node
            .devices
            .iter()
            .filter(|device| stage.devices.contains(&device.id))
        {
            let runs_in = device.tensor_rates().runs_in(precision);
            if runs_in == precision {
                continue;
            }
            let line = format!(
                "{} weights run at the {} rate on {}: it has no {} tensor rate",
                precision.as_str(),
                runs_in.as_str(),
                device.product,
                precision.as_str()
            );
            if !said.contains(&line) {
                said.push(line);
            }
        }
    }
    said
}

#[cfg(test)]
mod tests {
    use super::super::problem::{SolveOptions, Stages};
    use super::super::{solve, testutil};
    use super::*;

    fn fp8_problem(kind: testutil::Kind, fp8: Option<f64>) -> Problem {
        let mut node = testutil::node("n", 1, kind);
        node.devices[0].fp8_tflops = fp8;
        let mut problem = testutil::problem(vec![node], 8, 1, Stages::Fixed(1));
        problem.model.precision = Precision::Fp8;
        problem
    }

    #[test]
    fn a_plan_says_where_narrow_weights_are_widened() {
        let options = SolveOptions::default();
        let on_a100 = fp8_problem(testutil::A100, None);
        let plan = solve(&on_a100, &options).expect("fits");
        assert_eq!(
            plan.performance.widened,
            [
                "FP8 weights run at the FP16 rate on NVIDIA A100-PCIE-40GB: it has no FP8 tensor rate"
            ]
        );
        let on_h100 = fp8_problem(testutil::H100, Some(1979.0));
        let plan = solve(&on_h100, &options).expect("fits");
        assert!(plan.performance.widened.is_empty());
    }

    #[test]
    fn the_single_stream_speed_computes_at_the_narrow_rate() {
        // Little compute for its bandwidth: the FP8 rate shows in the speed.
        let slow = testutil::Kind {
            tflops: 5.0,
            ..testutil::H100
        };
        let options = SolveOptions::default();
        let widened = solve(&fp8_problem(slow, None), &options).expect("fits");
        let narrow = solve(&fp8_problem(slow, Some(40.0)), &options).expect("fits");
        let (narrow, widened) = (&narrow.performance, &widened.performance);
        // Compute outweighed the weight reads at the FP16 rate, not at FP8's.
        assert!(widened.token_time.compute_ms > 0.0);
        assert_eq!(narrow.token_time.compute_ms, 0.0);
        assert!(narrow.tokens_per_second > widened.tokens_per_second);
    }
}
