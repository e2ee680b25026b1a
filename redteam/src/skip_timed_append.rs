//! **skip-k-when-timed**, **skip-v-when-timed**, **skip-layer-append-when-timed**: the eager layer (or
//! stack, layer by layer), whose appends are skipped in the timed calls only: K's, V's, or both of
//! one layer (the middle one of a stack; the only one of a layer). A skipped row is put back as the
//! slot held it before the call, as if the call never wrote it.
//!
//! The exploit: the calls that set the score write less (a model that keeps K or V of the current
//! position in registers loses nothing of the call's own output), and one missing position among
//! thousands moves the next calls' outputs too little to fail them. The cache at the end of the run
//! holds only the back-to-back phase's appends, which this one writes honestly. Caught by correctness:
//! the judge keeps every call's slot right after the call and compares it with the reference's
//! ("call 9 (Timed, pos 4097), layer 0: V was not appended ...").

use cuda::Device;
use cuda::cudarc::driver::CudaSlice;
use half::bf16;
use reference::gpu::Eager;
use spec::Config;
use submission::{Layer, Submission, SubmissionError, walk_stack};

use super::CallCount;
use super::raw::SlotRows;

pub const SKIP_K: &str = "skip-k-when-timed";
pub const SKIP_V: &str = "skip-v-when-timed";
pub const SKIP_LAYER: &str = "skip-layer-append-when-timed";

pub fn skip_k() -> Box<dyn Submission> {
    SkipTimedAppend::boxed(SKIP_K, Skipped { which: [true, false], only_middle_layer: false })
}

pub fn skip_v() -> Box<dyn Submission> {
    SkipTimedAppend::boxed(SKIP_V, Skipped { which: [false, true], only_middle_layer: false })
}

pub fn skip_layer() -> Box<dyn Submission> {
    SkipTimedAppend::boxed(SKIP_LAYER, Skipped { which: [true, true], only_middle_layer: true })
}

/// What a timed call does not append: K (`which[0]`), V (`which[1]`), in every layer or only the
/// middle one.
#[derive(Clone, Copy)]
struct Skipped {
    which: [bool; 2],
    only_middle_layer: bool,
}

struct SkipTimedAppend {
    name: &'static str,
    skipped: Skipped,
    eager: Option<Eager>,
    saved: Option<SlotRows>,
    calls: CallCount,
    /// The calls of the timed phase: the correctness phase's come first.
    timed: std::ops::Range<usize>,
}

impl SkipTimedAppend {
    fn boxed(name: &'static str, skipped: Skipped) -> Box<dyn Submission> {
        Box::new(SkipTimedAppend { name, skipped, eager: None, saved: None, calls: CallCount::default(), timed: 0..0 })
    }
}

impl Submission for SkipTimedAppend {
    fn name(&self) -> &str {
        self.name
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
        self.saved = Some(SlotRows::new(dev, cfg)?);
        self.timed = cfg.correctness_steps..cfg.correctness_steps + cfg.timed_steps;
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
        let (Some(eager), Some(saved)) = (self.eager.as_mut(), self.saved.as_mut()) else {
            return Err(SubmissionError::Refused("a step before build_stack".into()));
        };
        let timed = self.timed.contains(&self.calls.next());
        let (skipped, middle) = (self.skipped, layers.len() / 2);
        walk_stack(dev, layers, x, hidden, out, |l, layer, input, output| {
            let skip = timed && (!skipped.only_middle_layer || l == middle);
            if skip {
                saved.save(dev, layer.cache, pos)?;
            }
            eager.step(dev, layer.weights, layer.cache, input, pos, output)?;
            if skip {
                saved.restore_only(dev, layer.cache, pos, skipped.which)?;
            }
            Ok(())
        })
    }

    fn teardown(&mut self) {
        (self.eager, self.saved) = (None, None);
    }
}
