//! The gates a submission must pass, with their numbers. docs/task.md states them in prose; the
//! grader reads them from here.

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Gates {
    /// Largest allowed `||x_out - ref|| / ||ref||` at any call (in a stack, of every layer's output
    /// against the reference layer on the submission's own input to it).
    pub rel_err_tol: f64,
    /// In a stack, the largest allowed `||out - ref|| / ||ref - input||` of every layer: its error over
    /// what the layer adds to the residual stream. The residual grows with depth, so a layer's update
    /// becomes a small share of its output and the output's error alone loses sight of a layer's
    /// work (a whole layer skipped at layer 40 of 80 stayed within `rel_err_tol` on 22 of 72 calls);
    /// on the update, honest work stays within half of this and a skipped layer is 1.0 off
    /// (`docs/stack.md`). One layer is judged on its output alone: the data makes its update a large
    /// share of it.
    pub stack_update_tol: f64,
    /// Largest allowed number of kernels in any call.
    pub max_kernels_per_step: f64,
    /// Smallest allowed share of a call's kernel time taken by its largest kernel, in any call.
    pub min_dominant_share: f64,
    /// Smallest share of the byte model (weights and KV attended) each call must read from DRAM.
    pub min_bytes_read: f64,
    /// Smallest share of a timed call's time (judge's clock) the recorded GPU work must cover:
    /// work the record does not show must not fill the rest.
    pub min_coverage: f64,
    /// How far under the read-only ceiling measured in the same run a call may seem to run (noise
    /// of the ceiling's own measurement) before its timing is implausible.
    pub read_ceiling_margin: f64,
}

impl Gates {
    pub const TASK: Gates = Gates {
        rel_err_tol: 1.5e-2,
        stack_update_tol: 0.1,
        max_kernels_per_step: 2.0,
        min_dominant_share: 0.95,
        min_bytes_read: 0.98,
        min_coverage: 0.5,
        read_ceiling_margin: 0.03,
    };
}

/// The gates' measure of an output: `||out - reference|| / ||reference||` in f64; `None` when `out`
/// holds a NaN or an Inf, or the lengths differ. A zero reference with a zero output gives 0.
pub fn rel_err(out: &[f32], reference: &[f32]) -> Option<f64> {
    if out.len() != reference.len() || out.iter().any(|v| !v.is_finite()) {
        return None;
    }
    let (mut num, mut den) = (0f64, 0f64);
    for (&o, &r) in out.iter().zip(reference) {
        num += (o as f64 - r as f64).powi(2);
        den += (r as f64).powi(2);
    }
    Some(if num == 0.0 { 0.0 } else { (num / den).sqrt() })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rel_err_of_known_vectors() {
        assert_eq!(rel_err(&[1.0, 2.0], &[1.0, 2.0]), Some(0.0));
        let e = rel_err(&[3.0, 4.0], &[0.0, 5.0]).unwrap();
        assert!((e - (10f64).sqrt() / 5.0).abs() < 1e-12);
        assert_eq!(rel_err(&[0.0], &[0.0]), Some(0.0));
        assert_eq!(rel_err(&[1.0], &[0.0]), Some(f64::INFINITY));
    }

    #[test]
    fn nan_and_inf_never_pass() {
        assert_eq!(rel_err(&[f32::NAN, 1.0], &[1.0, 1.0]), None);
        assert_eq!(rel_err(&[f32::INFINITY], &[1.0]), None);
        assert_eq!(rel_err(&[1.0], &[1.0, 2.0]), None);
    }
}
