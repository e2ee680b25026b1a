//! Every call's append, checked: the contract's one in-place write is each call's K and V rows at
//! its position, in every layer. The cache at the end of the run holds only the last phase's
//! appends (every phase starts again at the same position), so the judge keeps each call's slot as
//! it is right after the call ([`read_slot`], outside the timed window, beside its output read),
//! the replay keeps the reference's, and [`check`] compares them: each (call, layer, K or V) row
//! that is missing (still zero), stale (what an earlier call left there) or wrong (beyond the
//! tolerance) is named.
//!
//! The back-to-back calls run without the judge between them, so theirs are read after the batch;
//! their positions are distinct, so nothing in the batch overwrites them.

use cuda::cudarc::driver::CudaSlice;
use cuda::{Context, CudaError, Device};
use half::bf16;
use reference::gpu::DeviceCache;
use serde::Serialize;
use spec::{Call, Config};

use crate::metrics::{rel_err, to_f32};

/// One layer's K and V rows at one position: `(batch, n_kv, hd)` each.
#[derive(Debug, Clone, PartialEq)]
pub struct Slot {
    pub k: Vec<bf16>,
    pub v: Vec<bf16>,
}

/// Reads slot `pos` of `cache` (`(batch, n_kv, max_seq_len, hd)` each): one row per batch lane and
/// KV head.
pub fn read_slot(dev: &Device, cfg: &Config, cache: &DeviceCache, pos: usize) -> Result<Slot, CudaError> {
    let read = |c: &CudaSlice<bf16>| -> Result<Vec<bf16>, CudaError> {
        let mut rows = Vec::with_capacity(cfg.batch * cfg.n_kv * cfg.hd);
        for head in 0..cfg.batch * cfg.n_kv {
            let at = (head * cfg.max_seq_len + pos) * cfg.hd;
            rows.extend(dev.stream().clone_dtoh(&c.slice(at..at + cfg.hd)).context("reading an appended slot")?);
        }
        Ok(rows)
    };
    Ok(Slot { k: read(&cache.k)?, v: read(&cache.v)? })
}

/// K or V.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum Tensor {
    K,
    V,
}

/// What is wrong with one appended row.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Fault {
    /// Still zero: the call wrote nothing there.
    Missing,
    /// Bitwise what an earlier call (this index) left in the slot: the call did not write it.
    Stale { since: usize },
    /// Written, but off the reference's by this relative error (`None`: NaN or Inf).
    Wrong { rel_err: Option<f64> },
}

/// One faulty row: the call, the layer, K or V, and what is wrong.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Faulty {
    pub call: Call,
    pub layer: usize,
    pub tensor: Tensor,
    pub fault: Fault,
}

impl std::fmt::Display for Faulty {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let c = &self.call;
        let what = match self.tensor {
            Tensor::K => "K",
            Tensor::V => "V",
        };
        write!(f, "call {} ({:?}, pos {}), layer {}: {what} ", c.index, c.phase, c.pos, self.layer)?;
        match self.fault {
            Fault::Missing => write!(f, "was not appended (its slot is still zero)"),
            Fault::Stale { since } => write!(f, "was not appended (its slot holds what call {since} wrote)"),
            Fault::Wrong { rel_err: Some(e) } => write!(f, "differs from the reference's by {e:.3e}"),
            Fault::Wrong { rel_err: None } => write!(f, "holds NaN or Inf"),
        }
    }
}

/// Every faulty row, in call order: `theirs[c][l]` is the submission's slot of layer `l` right after
/// call `c`, `reference[c][l]` the replay's, and a row is right within `tol` relative error.
pub fn check(calls: &[Call], theirs: &[Vec<Slot>], reference: &[Vec<Slot>], tol: f64) -> Vec<Faulty> {
    let mut faults = Vec::new();
    for c in calls {
        for (layer, (mine, want)) in theirs[c.index].iter().zip(&reference[c.index]).enumerate() {
            for tensor in [Tensor::K, Tensor::V] {
                let pick = |s: &Slot| match tensor {
                    Tensor::K => s.k.clone(),
                    Tensor::V => s.v.clone(),
                };
                let (got, expected) = (pick(mine), pick(want));
                let Some(fault) = fault_of(&got, &expected, tol) else { continue };
                // An unwritten row that still holds an earlier call's write at this position.
                let earlier = calls[..c.index].iter().rev().find(|e| e.pos == c.pos).filter(|e| {
                    let before = pick(&theirs[e.index][layer]);
                    before.iter().zip(&got).all(|(a, b)| a.to_bits() == b.to_bits())
                });
                let fault = match (fault, earlier) {
                    (Fault::Wrong { .. }, Some(e)) => Fault::Stale { since: e.index },
                    (f, _) => f,
                };
                faults.push(Faulty { call: *c, layer, tensor, fault });
            }
        }
    }
    faults
}

/// What is wrong with row `got` against `expected`, if anything.
fn fault_of(got: &[bf16], expected: &[bf16], tol: f64) -> Option<Fault> {
    if got.iter().all(|v| v.to_bits() == 0) && expected.iter().any(|v| v.to_bits() != 0) {
        return Some(Fault::Missing);
    }
    match rel_err(&to_f32(got), &to_f32(expected)) {
        Some(e) if e <= tol => None,
        e => Some(Fault::Wrong { rel_err: e }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use spec::{Input, Phase};

    fn call(index: usize, phase: Phase, pos: usize) -> Call {
        Call { index, phase, pos, input: Input::Fresh }
    }

    fn row(seed: u32) -> Vec<bf16> {
        (0..16).map(|i| bf16::from_f32(((seed * 31 + i) % 17) as f32 * 0.25 - 2.0)).collect()
    }

    fn slot(k: u32, v: u32) -> Slot {
        Slot { k: row(k), v: row(v) }
    }

    /// Two phases over the same two positions: an honest run has no fault; a call that skips its V
    /// append in the second phase is named stale (the first phase's row is still there), a first
    /// call that skips K is named missing, a wrong row wrong, each with its call, layer and tensor.
    #[test]
    fn each_skipped_or_wrong_row_is_named() {
        let calls = [
            call(0, Phase::Correctness, 10),
            call(1, Phase::Correctness, 11),
            call(2, Phase::Timed, 10),
            call(3, Phase::Timed, 11),
        ];
        // Two layers; every call's rows differ (fresh inputs).
        let reference: Vec<Vec<Slot>> =
            (0..4).map(|c| vec![slot(10 * c, 10 * c + 1), slot(10 * c + 2, 10 * c + 3)]).collect();
        assert!(check(&calls, &reference, &reference, 1e-2).is_empty());

        let mut theirs = reference.clone();
        theirs[0][1].k = vec![bf16::ZERO; 16];
        theirs[2][0].v = theirs[0][0].v.clone();
        theirs[3][1].k[3] = bf16::from_f32(40.0);
        let faults = check(&calls, &theirs, &reference, 1e-2);
        let named: Vec<(usize, usize, Tensor, Fault)> =
            faults.iter().map(|f| (f.call.index, f.layer, f.tensor, f.fault)).collect();
        assert_eq!(named[0], (0, 1, Tensor::K, Fault::Missing));
        assert_eq!(named[1], (2, 0, Tensor::V, Fault::Stale { since: 0 }));
        assert!(matches!(named[2], (3, 1, Tensor::K, Fault::Wrong { rel_err: Some(e) }) if e > 1e-2));
        assert_eq!(named.len(), 3);
        assert_eq!(
            faults[1].to_string(),
            "call 2 (Timed, pos 10), layer 0: V was not appended (its slot holds what call 0 wrote)"
        );
        assert!(faults[0].to_string().ends_with("K was not appended (its slot is still zero)"));
    }

    /// Honest rounding differences within the tolerance pass; NaN is wrong.
    #[test]
    fn rounding_passes_and_nan_fails() {
        let calls = [call(0, Phase::Timed, 5)];
        let want = vec![slot(1, 2)];
        let mut near = want.clone();
        near[0].k[0] = bf16::from_bits(near[0].k[0].to_bits() + 1);
        assert!(check(&calls, &[near], std::slice::from_ref(&want), 1.5e-2).is_empty());
        let mut nan = want.clone();
        nan[0].v[2] = bf16::NAN;
        let faults = check(&calls, &[nan], &[want], 1.5e-2);
        assert_eq!(faults[0].fault, Fault::Wrong { rel_err: None });
    }
}
