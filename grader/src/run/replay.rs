//! The judge's reference: the eager GPU layer replayed over the very same calls (positions and
//! inputs, the submission's own outputs where a call's input was the previous output), on the
//! judge's private copies of the weights and the cache, after the runner has exited (so the two
//! never share the GPU while one is timed). Its launches are recorded too, for the report's
//! side-by-side line.

use std::time::Instant;

use cuda::{Context, Device};
use half::bf16;
use reference::gpu::{DeviceCache, DeviceWeights, Eager};
use spec::{Call, Config};

use super::Progress;
use crate::cupti::{self, CallWindow, Recording, StepLaunches, Tag};
use crate::error::GraderError;

/// What the reference computed and how it ran.
pub struct Replayed {
    pub outputs: Vec<Vec<bf16>>,
    pub cache_k: Vec<bf16>,
    pub cache_v: Vec<bf16>,
    /// Each call's kernels.
    pub launches: Vec<StepLaunches>,
    /// Each call between two device-wide synchronisations, in microseconds.
    pub call_us: Vec<f64>,
}

pub fn replay(
    dev: &Device,
    cfg: &Config,
    weights: &DeviceWeights,
    weights_seed: u64,
    calls: &[Call],
    inputs: &[Vec<bf16>],
    progress: &Progress,
) -> Result<Replayed, GraderError> {
    progress.say(&format!("reference: replaying {} calls", calls.len()));
    let mut cache = DeviceCache::generate(dev, cfg, weights_seed)?;
    let mut eager = Eager::new(dev, cfg)?;
    let s = dev.stream();
    let xs =
        inputs.iter().map(|x| s.clone_htod(x).context("uploading a replayed input")).collect::<Result<Vec<_>, _>>()?;
    let mut outs = (0..calls.len())
        .map(|_| s.alloc_zeros::<bf16>(cfg.batch * cfg.d))
        .collect::<Result<Vec<_>, _>>()
        .context("allocating the reference's outputs")?;
    dev.synchronize()?;
    let recording = Recording::start()?;
    let mut windows = Vec::with_capacity(calls.len());
    let mut call_us = Vec::with_capacity(calls.len());
    for c in calls {
        cupti::set_current(Tag::Call(c.index));
        let start_ns = cupti::timestamp()?;
        let t = Instant::now();
        eager.step(dev, weights, &mut cache, &xs[c.index], c.pos, &mut outs[c.index])?;
        dev.synchronize()?;
        call_us.push(t.elapsed().as_secs_f64() * 1e6);
        windows.push(CallWindow { start_ns, end_ns: cupti::timestamp()? });
    }
    cupti::set_current(Tag::Outside);
    let record =
        cupti::record::attribute(recording.finish()?, &windows, cupti::OwnWork::default(), |_| Vec::new(), Vec::new());
    let read = |v| s.clone_dtoh(v).context("reading the reference's results");
    Ok(Replayed {
        outputs: outs.iter().map(read).collect::<Result<_, _>>()?,
        cache_k: read(&cache.k)?,
        cache_v: read(&cache.v)?,
        launches: record.calls,
        call_us,
    })
}
