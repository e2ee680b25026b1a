//! The eager reference as a submission: one launch per elementary op. It passes correctness and
//! fails the launch gates, which is the point: it shows what the gates measure.

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
        crate::walk_stack(dev, layers, x, hidden, out, |_, layer, input, output| {
            Ok(eager.step(dev, layer.weights, layer.cache, input, pos, output)?)
        })
    }

    fn teardown(&mut self) {
        self.eager = None;
    }
}
