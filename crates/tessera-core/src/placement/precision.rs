//! Which of a GPU's tensor rates a model's matrix multiplications run at.
//! FP8 and FP4 weights compute on FP8 and FP4 tensor cores where the GPU has
//! them; elsewhere runtimes widen them to the next format the GPU has, and
//! they compute at that format's rate. The solver's single-stream speed and
//! the serving model's batched steps both read the rate from here.

use serde::{Deserialize, Serialize};

use crate::api::DType;

/// Share of a datasheet FP8 or FP4 rate a runtime's kernels reach, relative
/// to the share FP16 kernels reach of theirs: the narrow format doubles the
/// tensor-core rate, not the norms, rotary embeddings, activations and
/// (de)quantisation around the matrix multiplications. 0.7 (1.4× the FP16
/// rate on H100) puts TensorRT-LLM's compute-bound FP8 figures (Llama-3.1-8B
/// and 70B at 128/128 on H100 and H200) within 16% with the efficiency its
/// FP16 A100 figures set; 0.6 would put them 14-27% slow. No published FP4
/// figure is in the calibration: FP4 gets the FP8 share, unchecked.
pub(crate) const NARROW_PEAK_SHARE: f64 = 0.7;

/// The format a model's matrix multiplications run in. Integer weights
/// (`int8`, `int4`) are dequantised to 16 bits for them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Precision {
    Fp16,
    Fp8,
    Fp4,
}

impl Precision {
    pub fn of(dtype: DType) -> Self {
        match dtype {
            DType::Fp8 => Precision::Fp8,
            DType::Fp4 => Precision::Fp4,
            DType::Fp32 | DType::Bf16 | DType::Fp16 | DType::Int8 | DType::Int4 => Precision::Fp16,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Precision::Fp16 => "FP16",
            Precision::Fp8 => "FP8",
            Precision::Fp4 => "FP4",
        }
    }
}

/// A GPU's dense tensor rates (TFLOPS) by format; FP8 and FP4 only where
/// its tensor cores have them.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TensorRates {
    pub fp16: f64,
    pub fp8: Option<f64>,
    pub fp4: Option<f64>,
}

impl TensorRates {
    /// The format `precision` runs in here: itself where the GPU has a rate
    /// for it, else the next wider one it has.
    pub fn runs_in(&self, precision: Precision) -> Precision {
        match precision {
            Precision::Fp4 if self.fp4.is_some() => Precision::Fp4,
            Precision::Fp4 | Precision::Fp8 if self.fp8.is_some() => Precision::Fp8,
            _ => Precision::Fp16,
        }
    }

    /// The TFLOPS matrix multiplications in `precision` reach, in FP16
    /// terms: a narrow format's rate at [`NARROW_PEAK_SHARE`], never below
    /// the FP16 rate.
    pub fn compute_tflops(&self, precision: Precision) -> f64 {
        let narrow = match self.runs_in(precision) {
            Precision::Fp16 => None,
            Precision::Fp8 => self.fp8,
            Precision::Fp4 => self.fp4,
        };
        narrow.map_or(self.fp16, |rate| self.fp16.max(rate * NARROW_PEAK_SHARE))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const H100: TensorRates = TensorRates {
        fp16: 989.0,
        fp8: Some(1979.0),
        fp4: None,
    };
    const A100: TensorRates = TensorRates {
        fp16: 312.0,
        fp8: None,
        fp4: None,
    };
    const B200: TensorRates = TensorRates {
        fp16: 2250.0,
        fp8: Some(4500.0),
        fp4: Some(9000.0),
    };

    #[test]
    fn narrow_formats_run_where_the_gpu_has_them_and_widen_elsewhere() {
        assert_eq!(H100.runs_in(Precision::Fp8), Precision::Fp8);
        assert_eq!(H100.runs_in(Precision::Fp4), Precision::Fp8);
        assert_eq!(A100.runs_in(Precision::Fp8), Precision::Fp16);
        assert_eq!(A100.runs_in(Precision::Fp4), Precision::Fp16);
        assert_eq!(B200.runs_in(Precision::Fp4), Precision::Fp4);
        assert_eq!(B200.runs_in(Precision::Fp16), Precision::Fp16);
    }

    #[test]
    fn a_narrow_rate_counts_at_its_share_and_never_below_fp16() {
        assert!((H100.compute_tflops(Precision::Fp8) - 1979.0 * 0.7).abs() < 1e-9);
        assert_eq!(H100.compute_tflops(Precision::Fp16), 989.0);
        assert_eq!(A100.compute_tflops(Precision::Fp8), 312.0);
        assert!((B200.compute_tflops(Precision::Fp4) - 6300.0).abs() < 1e-9);
        // A reported FP8 rate below the FP16 one (a bad reading) cannot slow
        // the plan down.
        let odd = TensorRates {
            fp8: Some(100.0),
            ..H100
        };
        assert_eq!(odd.compute_tflops(Precision::Fp8), 989.0);
    }

    #[test]
    fn dtypes_map_to_the_format_their_matrix_multiplications_run_in() {
        assert_eq!(Precision::of(DType::Fp8), Precision::Fp8);
        assert_eq!(Precision::of(DType::Fp4), Precision::Fp4);
        assert_eq!(Precision::of(DType::Int4), Precision::Fp16);
        assert_eq!(Precision::of(DType::Bf16), Precision::Fp16);
    }
}
