//! The eager reference as a submission: one launch per elementary op. It passes correctness and
//! fails the launch gates, which is the point: it shows what the gates measure.

use std::mem::ManuallyDrop;

use cuda::Device;
use cuda::cudarc::driver::CudaSlice;
use half::bf16;
use reference::gpu::Eager;
use spec::Config;

use crate::{Layer, Submission, SubmissionError};

#[derive(Default)]
pub struct EagerSubmission {
    eager: Option<Eager>,
}

impl Submission for EagerSubmission {
    fn name(&self) -> &str {
        "reference"
    }

    fn build_layer(&mut self, dev: &Device, _layer: Layer<'_>, cfg: &Config) -> Result<(), SubmissionError> {
        self.eager = Some(Eager::new(dev, cfg)?);
        Ok(())
    }

    fn layer_step(
        &mut self,
        dev: &Device,
        layer: Layer<'_>,
        x: &CudaSlice<bf16>,
        pos: usize,
        out: &mut CudaSlice<bf16>,
    ) -> Result<(), SubmissionError> {
        let eager =
            self.eager.as_mut().ok_or_else(|| SubmissionError::Refused("layer_step before build_layer".into()))?;
        Ok(eager.step(dev, layer.weights, layer.cache, x, pos, out)?)
    }

    /// Layer by layer, each through the eager layer: layer `l` reads `x` or row `l - 1` of `hidden` and
    /// writes row `l`, or `out` for the last, in place (views of `hidden`, no copies).
    fn build_stack(&mut self, dev: &Device, _layers: &mut [Layer<'_>], cfg: &Config) -> Result<(), SubmissionError> {
        self.eager = Some(Eager::new(dev, cfg)?);
        Ok(())
    }

    fn stack_step(
        &mut self,
        dev: &Device,
        layers: &mut [Layer<'_>],
        x: &CudaSlice<bf16>,
        pos: usize,
        hidden: Option<&mut CudaSlice<bf16>>,
        out: &mut CudaSlice<bf16>,
    ) -> Result<(), SubmissionError> {
        let eager =
            self.eager.as_mut().ok_or_else(|| SubmissionError::Refused("stack_step before build_stack".into()))?;
        let (row, last) = (out.len(), layers.len() - 1);
        let mut rows: Vec<ManuallyDrop<CudaSlice<bf16>>> = match hidden {
            None if last == 0 => Vec::new(),
            Some(h) if h.len() >= last * row => {
                let base = crate::device_address(dev, h);
                let view = |l: usize| {
                    let at = base + (l * row * size_of::<bf16>()) as u64;
                    // SAFETY: row l of `hidden`, a live allocation that outlives this call; the view is never
                    // freed (ManuallyDrop), and no two views are used mutably at once.
                    ManuallyDrop::new(unsafe { dev.stream().upgrade_device_ptr::<bf16>(at, row) })
                };
                (0..last).map(view).collect()
            }
            _ => return Err(SubmissionError::Refused(format!("{} layers need hidden states of {} rows", last + 1, last))),
        };
        for (l, layer) in layers.iter_mut().enumerate() {
            let (before, rest) = rows.split_at_mut(l.min(last));
            let input: &CudaSlice<bf16> = if l == 0 { x } else { &before[l - 1] };
            let output: &mut CudaSlice<bf16> = if l == last { &mut *out } else { &mut rest[0] };
            eager.step(dev, layer.weights, layer.cache, input, pos, output)?;
        }
        Ok(())
    }

    fn teardown(&mut self) {
        self.eager = None;
    }
}
