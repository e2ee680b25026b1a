//! The honest ensemble against the eager GPU reference, the judge's own: every implementation of
//! `reference::golden::HONEST` (the eager style with another accumulation order, with q kept in f32,
//! a framework's extra roundings, an fp32 residual stream, exact arithmetic), run on the CPU, must
//! stay within half the correctness gate's tolerance at every call: the data must not fail honest
//! work on an unlucky seed, at any shape the grader judges. `grader selftest` runs it over many
//! seeds at three sizes, `grader sweep` over a few seeds at every member of the family.
//!
//! Seed `s` draws the weights, the prefix and the first input; each later call takes the
//! reference's previous output as its input, as the throughput phase does. The variants run in
//! parallel on the host's cores.

use std::ops::Range;

use cuda::cudarc::driver::CudaSlice;
use cuda::{Context, CudaError, Device};
use half::bf16;
use reference::golden::ensemble::{Ensemble, calls};
use reference::golden::{HONEST, KvCache, Weights};
use reference::gpu::{DeviceCache, Eager};
use spec::data::input;
use spec::{Config, Gates};

/// Each honest variant's worst relative error from the reference over a range of seeds.
#[derive(Debug, Clone)]
pub struct Margins {
    pub seeds: usize,
    pub calls: usize,
    pub worst: [f64; HONEST.len()],
}

impl Margins {
    /// Half the correctness gate's tolerance: what an honest variant may reach.
    pub fn limit() -> f64 {
        Gates::TASK.rel_err_tol / 2.0
    }

    /// The smallest margin, tolerance over error, of any variant.
    pub fn least(&self) -> f64 {
        self.worst.iter().map(|&e| Gates::TASK.rel_err_tol / e).fold(f64::INFINITY, f64::min)
    }

    /// Every variant's worst error and its margin to the tolerance.
    pub fn shown(&self) -> String {
        let tol = Gates::TASK.rel_err_tol;
        let each: Vec<String> = HONEST
            .iter()
            .zip(self.worst)
            .map(|((name, _), err)| format!("{name} {err:.2e} ({:.2}x)", tol / err))
            .collect();
        format!("{} seeds x {} calls, worst error (margin to {tol:.1e}): {}", self.seeds, self.calls, each.join(", "))
    }

    /// The first variant over half the tolerance, as a sentence; `None` when all are within it.
    pub fn failure(&self) -> Option<String> {
        let limit = Self::limit();
        HONEST.iter().zip(self.worst).find(|&(_, err)| err.is_nan() || err > limit).map(|((name, _), err)| {
            format!("{name}: {err:.2e} from the reference, over half the tolerance ({limit:.2e}); {}", self.shown())
        })
    }
}

fn download(dev: &Device, v: &CudaSlice<bf16>) -> Result<Vec<bf16>, CudaError> {
    dev.stream().clone_dtoh(v).context("reading a tensor back")
}

/// Runs the ensemble beside the eager GPU reference at `cfg` for every seed of `seeds`.
pub fn margins(dev: &Device, cfg: &Config, seeds: Range<u64>) -> Result<Margins, CudaError> {
    let mut eager = Eager::new(dev, cfg)?;
    let mut worst = [0f64; HONEST.len()];
    let n = seeds.clone().count();
    for seed in seeds {
        let gpu_w = reference::gpu::generate_weights(dev, cfg, seed)?;
        let mut gpu_cache = DeviceCache::generate(dev, cfg, seed)?;
        // The host copies of the GPU's data: the data checks show they are the CPU recipe's bits.
        let w = Weights::try_from_fn(|t| download(dev, gpu_w.get(t)))?;
        let cache = KvCache { k: download(dev, &gpu_cache.k)?, v: download(dev, &gpu_cache.v)? };
        let mut ens = Ensemble::new(cfg, &w, &cache);
        let mut x = input(cfg, seed, 0);
        for call in 0..calls(cfg) {
            let pos = cfg.prefill + call;
            let gx = dev.stream().clone_htod(&x).context("uploading an input")?;
            let mut out = dev.stream().clone_htod(&vec![bf16::NAN; cfg.d]).context("allocating an output")?;
            eager.step(dev, &gpu_w, &mut gpu_cache, &gx, pos, &mut out)?;
            let reference = download(dev, &out)?;
            ens.call(&x, pos, &reference);
            x = reference;
        }
        worst.iter_mut().zip(ens.worst()).for_each(|(w, e)| *w = w.max(e));
    }
    Ok(Margins { seeds: n, calls: calls(cfg), worst })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with(worst: f64) -> Margins {
        let mut m = Margins { seeds: 1, calls: 1, worst: [Margins::limit() / 4.0; HONEST.len()] };
        m.worst[1] = worst;
        m
    }

    #[test]
    fn a_variant_over_half_the_tolerance_or_nan_fails_and_names_itself() {
        assert!(with(Margins::limit()).failure().is_none(), "at the limit is within it");
        for bad in [Margins::limit() * 1.01, f64::NAN] {
            let why = with(bad).failure().expect("over the limit fails");
            assert!(why.starts_with(HONEST[1].0), "{why}");
        }
        assert!((with(Margins::limit()).least() - 2.0).abs() < 1e-12, "the least margin is the worst variant's");
    }
}
