//! The eager reference as a submission: one launch per elementary op. It passes correctness and
//! fails the launch gates, which is the point: it shows what the gates measure.

use cuda::cudarc::driver::CudaSlice;
use cuda::{Context, Device};
use half::bf16;
use reference::gpu::Eager;
use spec::Config;

use crate::{Layer, Submission, SubmissionError};

#[derive(Default)]
pub struct EagerSubmission {
    eager: Option<Eager>,
    /// A stack's state between layers: layer `l` writes buffer `l % 2` and reads the other.
    between: Option<[CudaSlice<bf16>; 2]>,
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

    /// Layer by layer, each through its own `layer_step`; the state between layers in two buffers of
    /// its own, each layer's output copied into its row of `hidden`.
    fn build_stack(&mut self, dev: &Device, layers: &mut [Layer<'_>], cfg: &Config) -> Result<(), SubmissionError> {
        self.eager = Some(Eager::new(dev, cfg)?);
        let row = cfg.batch * cfg.d;
        let zeros = || dev.stream().alloc_zeros::<bf16>(row).context("allocating the state between layers");
        self.between = if layers.len() > 1 { Some([zeros()?, zeros()?]) } else { None };
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
        let (Some(between), Some(hidden)) = (self.between.as_mut(), hidden) else {
            return match layers {
                [one] => self.layer_step(dev, one.reborrow(), x, pos, out),
                _ => Err(SubmissionError::Refused("stack_step before build_stack".into())),
            };
        };
        let eager = self.eager.as_mut().expect("built with the state between layers");
        let (row, last) = (out.len(), layers.len() - 1);
        let [even, odd] = between;
        for (l, layer) in layers.iter_mut().enumerate() {
            let (input, output) = match (l == 0, l % 2 == 0) {
                (true, _) => (x, &mut *even),
                (false, true) => (&*odd, &mut *even),
                (false, false) => (&*even, &mut *odd),
            };
            if l == last {
                eager.step(dev, layer.weights, layer.cache, input, pos, out)?;
                break;
            }
            eager.step(dev, layer.weights, layer.cache, input, pos, output)?;
            dev.stream()
                .memcpy_dtod(&*output, &mut hidden.slice_mut(l * row..(l + 1) * row))
                .context("copying a layer's output into the hidden states")?;
        }
        Ok(())
    }

    fn teardown(&mut self) {
        self.eager = None;
        self.between = None;
    }
}
