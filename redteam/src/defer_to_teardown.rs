//! **defer-to-teardown**: a step computes nothing; it snapshots `x` (one copy), notes `pos` and the
//! address of `out`, and returns. `teardown`, which the grader calls before it reads anything,
//! replays every deferred call in order with the eager reference, writing each output where it
//! belongs and the cache exactly as the steps would have.
//!
//! The exploit: every output and the final cache are right by the time teardown returns, and every
//! timed step costs a few microseconds. Caught because the grader copies each output away as soon as
//! its call has settled and reads the cache before teardown: the copies are still the NaN the
//! outputs were poisoned with. (The profiled steps also launched no kernel, and at the graded size a
//! step this fast would be physically implausible.)
//!
//! `teardown` gets no device, so it opens one: [`Device::open`] retains the same primary context as
//! the grader's, where the recorded addresses are valid.

use std::convert::Infallible;
use std::mem::ManuallyDrop;

use cuda::cudarc::driver::{CudaSlice, DevicePtr};
use cuda::{Context, Device};
use half::bf16;
use reference::gpu::{DeviceCache, Eager};
use spec::Config;
use spec::data::LayerWeights;
use submission::{Layer, Submission, SubmissionError};

use super::not_built;

pub const NAME: &str = "defer-to-teardown";

pub fn make() -> Box<dyn Submission> {
    Box::new(DeferToTeardown { layer: None, pending: Vec::new() })
}

/// A device buffer by address and length in elements.
type Raw = (u64, usize);

/// What `build_layer` noted: where the layer lives, and how to reach it again.
struct RawLayer {
    ordinal: usize,
    cfg: Config,
    weights: LayerWeights<Raw>,
    k: Raw,
    v: Raw,
}

/// One call, deferred.
struct Pending {
    x: CudaSlice<bf16>,
    pos: usize,
    out: Raw,
}

struct DeferToTeardown {
    layer: Option<RawLayer>,
    pending: Vec<Pending>,
}

fn raw(dev: &Device, s: &CudaSlice<bf16>) -> Raw {
    (s.device_ptr(dev.stream()).0, s.len())
}

impl DeferToTeardown {
    /// Runs every deferred call, in order, on a device opened for the purpose.
    fn flush(&mut self) -> Result<(), SubmissionError> {
        let Some(l) = self.layer.take() else { return Ok(()) };
        let pending = std::mem::take(&mut self.pending);
        let dev = Device::open(l.ordinal)?;
        let s = dev.stream();
        // Every upgrade_device_ptr below is sound: each address is a live allocation of the grader's
        // of that many bf16 (docs/task.md: the buffers stay where they are for the whole run, and the
        // grader frees nothing before teardown returns), in the primary context this device shares.
        // The slices are ManuallyDrop and never dropped: they must not free what the grader owns.
        let Ok(weights) = LayerWeights::try_from_fn(|t| {
            let (ptr, len) = *l.weights.get(t);
            // SAFETY: as above.
            Ok::<_, Infallible>(unsafe { s.upgrade_device_ptr::<bf16>(ptr, len) })
        });
        let weights = ManuallyDrop::new(weights);
        let mut cache = ManuallyDrop::new(DeviceCache {
            // SAFETY: as above.
            k: unsafe { s.upgrade_device_ptr(l.k.0, l.k.1) },
            // SAFETY: as above.
            v: unsafe { s.upgrade_device_ptr(l.v.0, l.v.1) },
        });
        let mut eager = Eager::new(&dev, &l.cfg)?;
        for p in &pending {
            // SAFETY: as above.
            let mut out = ManuallyDrop::new(unsafe { s.upgrade_device_ptr::<bf16>(p.out.0, p.out.1) });
            eager.step(&dev, &weights, &mut cache, &p.x, p.pos, &mut out)?;
        }
        dev.synchronize()?;
        Ok(())
    }
}

impl Submission for DeferToTeardown {
    fn name(&self) -> &str {
        NAME
    }

    fn build_layer(&mut self, dev: &Device, layer: Layer<'_>, cfg: &Config) -> Result<(), SubmissionError> {
        let Ok(weights) = LayerWeights::try_from_fn(|t| Ok::<_, Infallible>(raw(dev, layer.weights.get(t))));
        let (k, v) = (raw(dev, &layer.cache.k), raw(dev, &layer.cache.v));
        self.layer = Some(RawLayer { ordinal: dev.facts().ordinal, cfg: cfg.clone(), weights, k, v });
        Ok(())
    }

    fn layer_step(
        &mut self,
        dev: &Device,
        _layer: Layer<'_>,
        x: &CudaSlice<bf16>,
        pos: usize,
        out: &mut CudaSlice<bf16>,
    ) -> Result<(), SubmissionError> {
        if self.layer.is_none() {
            return Err(not_built());
        }
        let x = dev.stream().clone_dtod(x).context("snapshotting x")?;
        self.pending.push(Pending { x, pos, out: raw(dev, out) });
        Ok(())
    }

    fn teardown(&mut self) {
        // Teardown cannot fail; a failure shows as outputs the grader finds wrong.
        if let Err(e) = self.flush() {
            eprintln!("{NAME}: the deferred steps failed: {e}");
        }
    }
}
