//! The honest part most adversaries keep: the eager reference ([`Eager`]), correct and simple, and
//! [`Twisted`], the submission that runs it with one [`Twist`]: something done before, after or
//! instead of the honest step.

use cuda::Device;
use cuda::cudarc::driver::CudaSlice;
use half::bf16;
use reference::gpu::Eager;
use spec::Config;

use super::not_built;
use crate::{Layer, Submission, SubmissionError};

/// The one way an adversary departs from the eager reference.
pub trait Twist {
    /// Untimed preparation beyond the reference's own (kernels, scratch).
    fn build(&mut self, _dev: &Device, _layer: &mut Layer<'_>, _cfg: &Config) -> Result<(), SubmissionError> {
        Ok(())
    }

    /// One call; `eager` is the built reference, which [`honest_step`] runs.
    fn step(
        &mut self,
        eager: &mut Eager,
        dev: &Device,
        layer: &mut Layer<'_>,
        x: &CudaSlice<bf16>,
        pos: usize,
        out: &mut CudaSlice<bf16>,
    ) -> Result<(), SubmissionError>;

    /// Frees what [`Twist::build`] made.
    fn teardown(&mut self) {}
}

/// The eager reference's step, exactly as the judge runs it.
pub fn honest_step(
    eager: &mut Eager,
    dev: &Device,
    layer: &mut Layer<'_>,
    x: &CudaSlice<bf16>,
    pos: usize,
    out: &mut CudaSlice<bf16>,
) -> Result<(), SubmissionError> {
    Ok(eager.step(dev, layer.weights, layer.cache, x, pos, out)?)
}

/// The eager reference with a twist, under an adversary's name.
pub struct Twisted<T> {
    name: &'static str,
    eager: Option<Eager>,
    twist: T,
}

impl<T: Twist + 'static> Twisted<T> {
    pub fn boxed(name: &'static str, twist: T) -> Box<dyn Submission> {
        Box::new(Self { name, eager: None, twist })
    }
}

impl<T: Twist> Submission for Twisted<T> {
    fn name(&self) -> &str {
        self.name
    }

    fn build_layer(&mut self, dev: &Device, mut layer: Layer<'_>, cfg: &Config) -> Result<(), SubmissionError> {
        self.eager = Some(Eager::new(dev, cfg)?);
        self.twist.build(dev, &mut layer, cfg)
    }

    fn layer_step(
        &mut self,
        dev: &Device,
        mut layer: Layer<'_>,
        x: &CudaSlice<bf16>,
        pos: usize,
        out: &mut CudaSlice<bf16>,
    ) -> Result<(), SubmissionError> {
        let eager = self.eager.as_mut().ok_or_else(not_built)?;
        self.twist.step(eager, dev, &mut layer, x, pos, out)
    }

    fn teardown(&mut self) {
        self.twist.teardown();
        self.eager = None;
    }
}
