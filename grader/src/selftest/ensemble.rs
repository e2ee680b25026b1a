//! The honest ensemble against the eager GPU reference, the judge's own: every implementation of
//! `reference::golden::HONEST` (the eager style with another accumulation order, with q kept in f32,
//! a framework's extra roundings, an fp32 residual stream, exact arithmetic), run on the CPU over
//! [`SEEDS`] weight seeds per size, must stay within half the correctness gate's tolerance at every
//! call: the data must not fail honest work on an unlucky seed. Each check prints every variant's worst
//! error and its margin to the tolerance.
//!
//! Seed `s` of `seed..seed + SEEDS` draws the weights, the prefix and the first input; each later call
//! takes the reference's previous output as its input, as the throughput phase does. The variants run
//! in parallel on the host's cores; the graded size gets one call per seed (a graded step costs a
//! variant 3 to 5 core-seconds), the others more.

use cuda::cudarc::driver::CudaSlice;
use cuda::{Context, CudaError, Device};
use half::bf16;
use reference::golden::ensemble::{Ensemble, SEEDS, calls};
use reference::golden::{HONEST, KvCache, Weights};
use reference::gpu::{DeviceCache, Eager};
use spec::data::input;
use spec::{Config, Gates};

use super::{Check, CheckResult, Ctx, ensure};

pub fn checks() -> Vec<Check> {
    vec![
        Check { name: "honest ensemble (tiny)", run: |c| ensemble(c, Config::tiny()) },
        Check { name: "honest ensemble (small)", run: |c| ensemble(c, Config::small()) },
        Check { name: "honest ensemble (graded)", run: |c| ensemble(c, Config::graded()) },
    ]
}

fn download(dev: &Device, v: &CudaSlice<bf16>) -> Result<Vec<bf16>, CudaError> {
    dev.stream().clone_dtoh(v).context("reading a tensor back")
}

fn ensemble(ctx: &mut Ctx, cfg: Config) -> CheckResult {
    let dev = &ctx.dev;
    let mut eager = Eager::new(dev, &cfg)?;
    let mut worst = [0f64; HONEST.len()];
    for seed in ctx.seed..ctx.seed + SEEDS {
        let gpu_w = reference::gpu::generate_weights(dev, &cfg, seed)?;
        let mut gpu_cache = DeviceCache::generate(dev, &cfg, seed)?;
        // The host copies of the GPU's data: the data checks show they are the CPU recipe's bits.
        let w = Weights::try_from_fn(|t| download(dev, gpu_w.get(t)))?;
        let cache = KvCache { k: download(dev, &gpu_cache.k)?, v: download(dev, &gpu_cache.v)? };
        let mut ens = Ensemble::new(&cfg, &w, &cache);
        let mut x = input(&cfg, seed, 0);
        for call in 0..calls(&cfg) {
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
    let tol = Gates::TASK.rel_err_tol;
    let shown: Vec<String> =
        HONEST.iter().zip(worst).map(|((name, _), err)| format!("{name} {err:.2e} ({:.2}x)", tol / err)).collect();
    let (limit, calls) = (tol / 2.0, calls(&cfg));
    for ((name, _), err) in HONEST.iter().zip(worst) {
        ensure(err <= limit, || {
            format!("{name}: {err:.2e} from the reference, over half the tolerance ({limit:.2e}); {}", shown.join(", "))
        })?;
    }
    Ok(format!("{SEEDS} seeds x {calls} calls, worst error (margin to {tol:.1e}): {}", shown.join(", ")))
}
