//! The honest ensemble: every implementation of [`HONEST`] run beside a reference over a run's calls,
//! each on its own cache, and its output compared with the reference's as the correctness gate
//! compares a submission's. The data recipe must keep every one of them within half the gate's
//! tolerance; `cargo test` checks that at `tiny` and `small` against the golden model, `grader
//! selftest` at every size against the eager GPU reference.

use std::thread;

use half::bf16;
use spec::Config;

use super::{HONEST, KvCache, Weights, output_bf16, step_as};

/// Weight seeds per configuration: `base..base + SEEDS`.
pub const SEEDS: u64 = 16;

/// Calls per seed at `cfg`: the first on a fresh input, each later one on the reference's previous
/// output, as the throughput phase chains them. A graded step costs a variant 3 to 5 core-seconds,
/// so the graded size takes one call per seed.
pub fn calls(cfg: &Config) -> usize {
    /// Multiply-adds of a step's matrices up to which a config gets [`MAX_CALLS`] calls.
    const CHEAP_STEP: usize = 1 << 23;
    const MAX_CALLS: usize = 4;
    let macs = cfg.d * (cfg.q_dim() + 2 * cfg.kv_dim() + cfg.q_dim() + 3 * cfg.ffn);
    if macs <= CHEAP_STEP { MAX_CALLS } else { (MAX_CALLS * CHEAP_STEP / macs).max(1) }
}

/// `||out - reference|| / ||reference||` in f64: the correctness gate's measure.
pub fn rel_err(out: &[bf16], reference: &[bf16]) -> f64 {
    let (mut num, mut den) = (0f64, 0f64);
    for (o, r) in out.iter().zip(reference) {
        num += (o.to_f64() - r.to_f64()).powi(2);
        den += r.to_f64().powi(2);
    }
    (num / den).sqrt()
}

/// The variants of [`HONEST`] on one layer, each with its own cache, and the worst error each has
/// shown so far.
pub struct Ensemble<'a> {
    cfg: &'a Config,
    w: &'a Weights,
    caches: Vec<KvCache>,
    worst: [f64; HONEST.len()],
}

impl<'a> Ensemble<'a> {
    /// The variants on `w`, each starting from its own copy of `cache`.
    pub fn new(cfg: &'a Config, w: &'a Weights, cache: &KvCache) -> Self {
        Self { cfg, w, caches: vec![cache.clone(); HONEST.len()], worst: [0.0; HONEST.len()] }
    }

    /// One call: every variant's step at `pos` on `x`, in parallel, each compared with `reference`,
    /// the reference's output for the same call. Returns each variant's error.
    pub fn call(&mut self, x: &[bf16], pos: usize, reference: &[bf16]) -> [f64; HONEST.len()] {
        let (cfg, w) = (self.cfg, self.w);
        let mut errors = [0.0; HONEST.len()];
        thread::scope(|s| {
            for ((cache, err), (_, rounding)) in self.caches.iter_mut().zip(&mut errors).zip(&HONEST) {
                s.spawn(move || *err = rel_err(&output_bf16(&step_as(rounding, cfg, w, cache, x, pos)), reference));
            }
        });
        for (worst, err) in self.worst.iter_mut().zip(errors) {
            *worst = worst.max(err);
        }
        errors
    }

    /// Each variant's worst error over the calls so far, in [`HONEST`]'s order.
    pub fn worst(&self) -> [f64; HONEST.len()] {
        self.worst
    }
}
