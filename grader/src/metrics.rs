//! How far an output is from the reference: relative L2 error in f64, NaN/Inf detection, and bf16
//! distances in units in the last place.

use half::bf16;
use serde::Serialize;

pub use spec::gates::rel_err;

/// bf16 values as f32.
pub fn to_f32(v: &[bf16]) -> Vec<f32> {
    v.iter().map(|x| x.to_f32()).collect()
}

/// bf16 bits mapped so that consecutive values are consecutive integers (-0 and +0 coincide).
fn ordered(v: bf16) -> i32 {
    let b = v.to_bits() as i32;
    if b & 0x8000 != 0 { -(b & 0x7FFF) } else { b }
}

/// One bf16 ulp at magnitude `m` (normal range): 2^(exponent of m - 7).
fn bf16_ulp_at(m: f32) -> f32 {
    f32::from_bits(m.abs().to_bits() & 0x7F80_0000) / 128.0
}

/// Elements of `out` more than `ulps` bf16 ulp from `reference` both at their own value and at the
/// reference's RMS. A dot product's rounding error scales with its terms, which the row's magnitude
/// reflects: an element that cancelled to near zero may differ by many of its own (tiny) ulps after
/// summing in another order, and still be exact to the row's precision. A NaN or an Inf, or a length
/// mismatch, counts every element.
pub fn beyond_ulps_at_scale(out: &[bf16], reference: &[bf16], ulps: u32) -> usize {
    if out.len() != reference.len() || !out.iter().chain(reference).all(|v| v.is_finite()) {
        return out.len().max(reference.len());
    }
    let rms =
        (reference.iter().map(|v| (v.to_f32() as f64).powi(2)).sum::<f64>() / reference.len().max(1) as f64).sqrt();
    let allowed = ulps as f32 * bf16_ulp_at(rms as f32);
    out.iter()
        .zip(reference)
        .filter(|&(&a, &b)| ordered(a).abs_diff(ordered(b)) > ulps && (a.to_f32() - b.to_f32()).abs() > allowed)
        .count()
}

/// How two bf16 tensors differ.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Diff {
    /// Largest distance in bf16 units in the last place (`u32::MAX` for NaN/Inf or a length mismatch).
    pub max_ulp: u32,
    /// Elements whose bits differ.
    pub differing: usize,
    /// Relative L2 error (`f64::INFINITY` for NaN/Inf).
    pub rel_err: f64,
}

impl Diff {
    pub fn of(out: &[bf16], reference: &[bf16]) -> Self {
        let finite = out.iter().chain(reference).all(|v| v.is_finite());
        if out.len() != reference.len() || !finite {
            return Self { max_ulp: u32::MAX, differing: out.len().max(reference.len()), rel_err: f64::INFINITY };
        }
        let max_ulp = out.iter().zip(reference).map(|(&a, &b)| ordered(a).abs_diff(ordered(b))).max().unwrap_or(0);
        let differing = out.iter().zip(reference).filter(|(a, b)| a.to_bits() != b.to_bits()).count();
        let rel_err = rel_err(&to_f32(out), &to_f32(reference)).unwrap_or(f64::INFINITY);
        Self { max_ulp, differing, rel_err }
    }
}

impl std::fmt::Display for Diff {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "max {} ulp, {} differ, rel {:.1e}", self.max_ulp, self.differing, self.rel_err)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_nan_is_the_largest_distance() {
        let d = Diff::of(&[bf16::NAN], &[bf16::ONE]);
        assert_eq!(d.max_ulp, u32::MAX);
        assert!(d.rel_err.is_infinite());
    }

    #[test]
    fn near_zero_elements_are_judged_at_the_rows_scale() {
        // A row of magnitude ~1 whose element 0 cancelled to about 1e-3 and came out 6 of its own ulp
        // away in another summation order: 2.4e-5 apart, far under one ulp at the row's scale.
        let reference: Vec<bf16> = [1.0e-3, 1.5, -0.75, 2.0].iter().map(|&v| bf16::from_f32(v)).collect();
        let mut out = reference.clone();
        out[0] = bf16::from_bits(reference[0].to_bits() + 6);
        assert_eq!(Diff::of(&out, &reference).max_ulp, 6);
        assert_eq!(beyond_ulps_at_scale(&out, &reference, 2), 0);
        // Three ulp off on a large element is beyond both.
        out[1] = bf16::from_bits(reference[1].to_bits() + 3);
        assert_eq!(beyond_ulps_at_scale(&out, &reference, 2), 1);
        // A wrong row is wrong in every element that carries the row's magnitude.
        let wrong: Vec<bf16> = reference.iter().map(|v| -*v).collect();
        assert_eq!(beyond_ulps_at_scale(&wrong, &reference, 2), 3);
        assert_eq!(beyond_ulps_at_scale(&[bf16::NAN], &[bf16::ONE], 2), 1);
        assert_eq!(bf16_ulp_at(1.5), 1.0 / 128.0);
    }

    #[test]
    fn ulp_distance_crosses_zero() {
        let one = bf16::ONE;
        let next = bf16::from_bits(one.to_bits() + 1);
        assert_eq!(Diff::of(&[next], &[one]).max_ulp, 1);
        let tiny_pos = bf16::from_bits(1);
        let tiny_neg = bf16::from_bits(0x8001);
        assert_eq!(Diff::of(&[tiny_pos], &[tiny_neg]).max_ulp, 2);
        assert_eq!(Diff::of(&[bf16::ZERO], &[bf16::NEG_ZERO]).max_ulp, 0);
        assert_eq!(Diff::of(&[one, one], &[one, next]).differing, 1);
    }
}
