//! The serving model's fitted constants: the few numbers no datasheet gives,
//! set by fitting the model to published batched figures
//! (tests/serving_calibration; docs/serving-model.md, "Constants", says
//! what each moved and which figures set it). Everything else the model
//! uses is a device's reported figures, a model's shape or a runtime's
//! documented default.
//!
//! They are a value rather than scattered `const`s so the calibration can fit
//! them on some sources and judge them on the others (leave one source out);
//! [`Constants::FITTED`] is that fit on every source, and a test fails when
//! the committed values stop being it.

use super::runtime::{Runtime, RuntimeConfig};

/// What the serving model does not read from a device, a model or a runtime's
/// flags.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Constants {
    /// Share of the datasheet compute (FP16, or a narrow format's as
    /// `placement::precision` says) that batched matrix multiplications,
    /// prefill included, reach under TensorRT-LLM: an engine compiled with
    /// fused kernels.
    pub compiled_efficiency: f64,
    /// The same share under vLLM and SGLang: PyTorch model code with
    /// separate norm, rotary and activation kernels, and the CPU scheduling
    /// between steps. One share for every vLLM release: the figures at hand
    /// do not tell its V1 engine from its V0 (docs/serving-model.md).
    pub pytorch_efficiency: f64,
    /// What a GPU of another vendor than NVIDIA reaches of its datasheet
    /// compute, as a share of what an NVIDIA GPU reaches under the same
    /// runtime: its GEMM kernels are younger (MI300X's FP16 and FP8 peaks
    /// are 1.3x H100's; measured GEMMs are about even).
    pub other_vendor_compute_share: f64,
    /// Share of a tensor link's reported GB/s a batch's all-reduces move
    /// activations at: the reported figure counts both directions, a ring
    /// sends one way at a time, and collectives of a few MB stay under the
    /// link's peak.
    pub all_reduce_bandwidth_share: f64,
}

impl Constants {
    /// The fit on every published source (tests/serving_calibration).
    pub const FITTED: Constants = Constants {
        compiled_efficiency: 0.64,
        pytorch_efficiency: 0.42,
        other_vendor_compute_share: 0.45,
        all_reduce_bandwidth_share: 0.30,
    };

    /// The compute share `runtime` reaches on a GPU of `vendor`. A runtime
    /// tessera knows nothing of is promised no more than the slower kind.
    pub(super) fn compute_efficiency(&self, runtime: &RuntimeConfig, vendor: &str) -> f64 {
        let runtime = match runtime.runtime {
            Runtime::TensorrtLlm => self.compiled_efficiency,
            Runtime::Vllm | Runtime::Sglang => self.pytorch_efficiency,
            Runtime::Generic => self.compiled_efficiency.min(self.pytorch_efficiency),
        };
        match vendor {
            "nvidia" => runtime,
            _ => runtime * self.other_vendor_compute_share,
        }
    }

    /// Every constant a share in (0, 1].
    pub fn validate(&self) -> Result<(), String> {
        for (name, value) in [
            ("compiledEfficiency", self.compiled_efficiency),
            ("pytorchEfficiency", self.pytorch_efficiency),
            ("otherVendorComputeShare", self.other_vendor_compute_share),
            ("allReduceBandwidthShare", self.all_reduce_bandwidth_share),
        ] {
            if !(value.is_finite() && value > 0.0 && value <= 1.0) {
                return Err(format!("{name} must be in (0, 1], not {value}"));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_generic_runtime_is_promised_no_more_than_the_known_ones() {
        for constants in [
            Constants::FITTED,
            Constants {
                compiled_efficiency: 0.3,
                ..Constants::FITTED
            },
        ] {
            let config = |runtime| RuntimeConfig {
                runtime,
                ..RuntimeConfig::default()
            };
            let generic = constants.compute_efficiency(&config(Runtime::Generic), "nvidia");
            for runtime in [Runtime::Vllm, Runtime::Sglang, Runtime::TensorrtLlm] {
                assert!(generic <= constants.compute_efficiency(&config(runtime), "nvidia"));
            }
        }
    }

    #[test]
    fn other_vendors_reach_their_share_of_what_nvidia_reaches() {
        let vllm = RuntimeConfig::default();
        let constants = Constants::FITTED;
        assert_eq!(
            constants.compute_efficiency(&vllm, "amd"),
            constants.compute_efficiency(&vllm, "nvidia") * constants.other_vendor_compute_share
        );
    }

    #[test]
    fn shares_outside_zero_to_one_are_refused() {
        assert!(Constants::FITTED.validate().is_ok());
        for bad in [0.0, -0.1, 1.5, f64::NAN, f64::INFINITY] {
            let constants = Constants {
                all_reduce_bandwidth_share: bad,
                ..Constants::FITTED
            };
            let error = constants.validate().expect_err("refused");
            assert!(error.contains("allReduceBandwidthShare"), "{error}");
        }
    }
}
