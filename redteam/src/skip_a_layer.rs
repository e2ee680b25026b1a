//! **skip-a-layer**: in a stack, the last layer passes its input through (its cache row still
//! written by the eager layer, every other layer computed honestly).
//!
//! The exploit: over many layers, honest rounding drifts the final state further than one missing
//! layer does (`docs/depth.md`: 8.1e-2 against 4.5e-2 at 80 layers), so a judge of the final state
//! alone could not tell them apart; and deep in a stack the residual stream dwarfs a layer's update,
//! so the layer's output is close to its input (skipping layer 40 of `stack-70b` stayed within the
//! output tolerance on 22 of 72 calls). The last layer is where that is most so. Caught by
//! correctness: the judge compares every layer's output and its update with the reference layer's on
//! the submission's own input to it, and names the layer. On one layer it is a pass-through with the
//! cache written.

use cuda::cudarc::driver::CudaSlice;
use cuda::{Context, Device};
use half::bf16;
use reference::gpu::Eager;
use spec::Config;

use submission::{Layer, Submission, SubmissionError, walk_stack};

pub const NAME: &str = "skip-a-layer";

pub fn make() -> Box<dyn Submission> {
    Box::new(SkipALayer { eager: None, scratch: None })
}

struct SkipALayer {
    eager: Option<Eager>,
    /// Where the skipped layer's real output goes, unused.
    scratch: Option<CudaSlice<bf16>>,
}

impl Submission for SkipALayer {
    fn name(&self) -> &str {
        NAME
    }

    fn build_layer(&mut self, dev: &Device, mut layer: Layer<'_>, cfg: &Config) -> Result<(), SubmissionError> {
        self.build_stack(dev, &mut [layer.reborrow()], cfg)
    }

    fn layer_step(
        &mut self,
        dev: &Device,
        mut layer: Layer<'_>,
        x: &CudaSlice<bf16>,
        pos: usize,
        out: &mut CudaSlice<bf16>,
    ) -> Result<(), SubmissionError> {
        self.stack_step(dev, &mut [layer.reborrow()], x, pos, None, out)
    }

    fn build_stack(&mut self, dev: &Device, _layers: &mut [Layer<'_>], cfg: &Config) -> Result<(), SubmissionError> {
        self.eager = Some(Eager::new(dev, cfg)?);
        self.scratch = Some(dev.stream().alloc_zeros(cfg.batch * cfg.d).context("allocating the scratch")?);
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
        let (Some(eager), Some(scratch)) = (self.eager.as_mut(), self.scratch.as_mut()) else {
            return Err(SubmissionError::Refused("a step before build_stack".into()));
        };
        let skipped = layers.len() - 1;
        walk_stack(dev, layers, x, hidden, out, |l, layer, input, output| {
            if l != skipped {
                return Ok(eager.step(dev, layer.weights, layer.cache, input, pos, output)?);
            }
            eager.step(dev, layer.weights, layer.cache, input, pos, scratch)?;
            Ok(dev.stream().memcpy_dtod(input, output).context("passing the layer's input through")?)
        })
    }

    fn teardown(&mut self) {
        self.eager = None;
        self.scratch = None;
    }
}
