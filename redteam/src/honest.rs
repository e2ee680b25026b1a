//! The honest parts most adversaries keep: the eager reference ([`Eager`]), correct and simple, and
//! [`Twisted`], the submission that runs it with one [`Twist`]: something done before, after or
//! instead of the honest step; and the megakernel, honest and fast, with [`Extra`] work around it
//! ([`WithExtra`]), for adversaries whose timing must otherwise pass.

use cuda::Device;
use cuda::cudarc::driver::CudaSlice;
use half::bf16;
use megakernel::{Megakernel, Mode};
use reference::gpu::Eager;
use spec::Config;
use submission::{Layer, Submission, SubmissionError};

use super::not_built;

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

/// What an adversary adds around the megakernel's honest steps.
pub trait Extra {
    /// Untimed, after the megakernel's own `build_layer`.
    fn build(&mut self, _dev: &Device, _layer: &Layer<'_>, _cfg: &Config) -> Result<(), SubmissionError> {
        Ok(())
    }

    /// In each call, before the megakernel's step.
    fn before_step(&mut self, _dev: &Device) -> Result<(), SubmissionError> {
        Ok(())
    }

    /// In each call, after the megakernel's step.
    fn after_step(&mut self, _dev: &Device) -> Result<(), SubmissionError> {
        Ok(())
    }

    /// Frees what [`Extra::build`] made, before the megakernel's teardown.
    fn teardown(&mut self) {}
}

/// The megakernel with an [`Extra`], under an adversary's name.
pub struct WithExtra<T> {
    name: &'static str,
    mega: Megakernel,
    extra: T,
}

impl<T: Extra + 'static> WithExtra<T> {
    pub fn boxed(name: &'static str, extra: T) -> Box<dyn Submission> {
        Box::new(Self { name, mega: Megakernel::new(Mode::Fused), extra })
    }
}

impl<T: Extra> Submission for WithExtra<T> {
    fn name(&self) -> &str {
        self.name
    }

    fn build_layer(&mut self, dev: &Device, mut layer: Layer<'_>, cfg: &Config) -> Result<(), SubmissionError> {
        self.mega.build_layer(dev, layer.reborrow(), cfg)?;
        self.extra.build(dev, &layer, cfg)
    }

    fn layer_step(
        &mut self,
        dev: &Device,
        layer: Layer<'_>,
        x: &CudaSlice<bf16>,
        pos: usize,
        out: &mut CudaSlice<bf16>,
    ) -> Result<(), SubmissionError> {
        self.extra.before_step(dev)?;
        self.mega.layer_step(dev, layer, x, pos, out)?;
        self.extra.after_step(dev)
    }

    fn teardown(&mut self) {
        self.extra.teardown();
        self.mega.teardown();
    }
}
