//! The reference submission: the layer compiled into a program (`program`) that one persistent kernel
//! (`kernels/megakernel/megakernel.cu`, its device code in `megakernel.cuh`) interprets, one
//! cooperative launch per token, for one layer or a whole stack of them. `build_stack` (and
//! `build_layer`, a stack of one) compiles the stack onto the GPU (`stack::CompiledStack`: packing,
//! RoPE tables, scratch, the program and each layer's address table); `stack_step` (and `layer_step`)
//! only launches. A model (`model::GpuModel`) owns a compiled stack of its own and its own kernel.
//!
//! [`Mode::PerPhase`] runs the same device code one phase per launch, for debugging and per-phase
//! timing; its results are bitwise those of [`Mode::Fused`].

#[cfg(feature = "model")]
pub mod batch;
pub mod cpu;
pub mod kernels;
pub mod machine;
#[cfg(feature = "model")]
pub mod model;
pub mod pack;
pub mod program;
pub mod split;
pub mod stack;
pub mod trace;
#[cfg(test)]
mod warp_sums;

use cuda::cudarc::driver::{CudaSlice, PushKernelArg};
use cuda::{Context, Device};
use half::bf16;
use spec::Config;

use submission::{Layer, Submission, SubmissionError, device_address};

use kernels::{MEGAKERNEL, SPLIT, has_narrow_rows};
use program::{Forced, Split};
use stack::{CompiledStack, ProgramParam, StackOptions, Target};

pub use kernels::{GATHER, GATHER_BLOCK, MAX_BATCH, THREADS, TRACE_END, TRACE_SM, TRACE_STAMPS};
pub use stack::PhasePlan;
pub use trace::{LateSms, PhaseShare, Trace, per_layer};

/// How `layer_step` runs the program.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// One cooperative launch for the whole step: the submission.
    Fused,
    /// One launch per phase: for debugging and per-phase timing.
    PerPhase,
}

pub struct Megakernel {
    mode: Mode,
    forced: Forced,
    /// Whether a stack streams Qkv and GateUp in place (`None`: only when packed copies do not fit).
    in_place: Option<bool>,
    /// `Split::Over(1)`: the split kernel's path on one GPU (`split_over_one`).
    split: Split,
    built: Option<Built>,
}

/// What `build_stack` made; dropped by `teardown`.
struct Built {
    stack: CompiledStack,
    program: LayerProgram,
}

/// The compiled program as the judge's kernels take it, by value: one layer's rows, which carry its
/// addresses themselves (no operand is read through a table), or a stack's rows and tables.
enum LayerProgram {
    One(Box<ProgramParam<1>>),
    Stack(Box<ProgramParam<{ program::MAX_STACK_LAYERS }>>),
}

impl LayerProgram {
    /// The program of `stack` as the judge's kernels take it.
    fn of(stack: &CompiledStack) -> LayerProgram {
        let fits = "rows and tables within the parameter block (build checks them)";
        match stack.tables.as_slice() {
            [one] => {
                let resolved: Vec<program::Row> = stack.rows.iter().map(|r| program::resolve_row(r, one)).collect();
                LayerProgram::One(ProgramParam::new(&resolved, &[]).expect(fits))
            }
            tables => LayerProgram::Stack(ProgramParam::new(&stack.rows, tables).expect(fits)),
        }
    }

    /// The split kernel (`split.cu`): a stack's rows and tables, Reduce rows among them.
    const SPLIT_KERNEL: &'static str = "megakernel_split_bf16";

    /// The kernel that runs a stack of `layers` layers of `cfg`: its sliced instance where some GEMV's
    /// rows run in slices of the block (as the model kernel's, `has_narrow_rows`).
    fn kernel(layers: usize, cfg: &Config) -> &'static str {
        match (layers == 1, has_narrow_rows(cfg)) {
            (true, false) => "megakernel_bf16",
            (false, false) => "megakernel_stack_bf16",
            (true, true) => "megakernel_sliced_bf16",
            (false, true) => "megakernel_stack_sliced_bf16",
        }
    }
}

impl Megakernel {
    pub fn new(mode: Mode) -> Self {
        Self { mode, forced: Forced::default(), in_place: None, split: Split::None, built: None }
    }

    /// The same through the path of a stack split over GPUs, over this one GPU: the program with its
    /// Reduce rows (`Split::Over(1)`) on the split kernel (`split.cu`), whose outputs must be the
    /// unsplit kernel's bit for bit. It runs wide stacks (two layers or more, no rows in slices) and
    /// refuses the rest.
    pub fn split_over_one(mut self) -> Self {
        self.split = Split::Over(1);
        self
    }

    /// The same, with the parts of the plan `forced` names in place of the compiler's choice (for
    /// studying plans: `grader profile --roles / --mlp-parts`); `build_layer` refuses a forced plan
    /// the layer cannot take, saying why.
    pub fn forcing(mut self, forced: Forced) -> Self {
        self.forced = forced;
        self
    }

    /// The same, streaming a stack's Qkv and GateUp rows in place from the layout handed over (`true`)
    /// or from packed copies (`false`), instead of choosing by the memory free (for checking both).
    pub fn in_place(mut self, yes: bool) -> Self {
        self.in_place = Some(yes);
        self
    }

    /// Phases of the compiled program, over every layer (after `build_stack`).
    pub fn phases(&self) -> Option<u32> {
        self.built.as_ref().map(|b| b.stack.phases() * b.stack.layers())
    }

    /// What each phase of the compiled program computes and which blocks run it (after
    /// `build_layer`).
    pub fn plan(&self) -> Option<&[PhasePlan]> {
        self.built.as_ref().map(|b| b.stack.plan.as_slice())
    }

    /// The launch's grid and dynamic shared memory per block, in bytes (after `build_layer`).
    pub fn launch_shape(&self) -> Option<(u32, u32)> {
        self.built.as_ref().map(|b| (b.stack.grid, b.stack.smem))
    }

    /// The compiled plan in words (after `build_layer`): the grid, the roles, the MLP's parts and how
    /// attention splits its work at position `pos`.
    pub fn describe(&self, cfg: &Config, pos: usize) -> Option<String> {
        self.built.as_ref().map(|b| b.stack.describe(cfg, pos))
    }

    /// Launches phases `[begin, end)` of the current step once, numbered over every layer (`phases()`).
    /// A step's phases must be launched in order from phase 0 (whole, or in consecutive ranges);
    /// anything else is refused. `hidden` as `stack_step` takes it.
    pub fn launch_phases(
        &mut self,
        dev: &Device,
        x: &CudaSlice<bf16>,
        pos: usize,
        hidden: Option<&mut CudaSlice<bf16>>,
        out: &mut CudaSlice<bf16>,
        phases: std::ops::Range<u32>,
    ) -> Result<(), SubmissionError> {
        self.launch(dev, x, pos, hidden, out, phases, None)
    }

    /// Whether the stack streams Qkv and GateUp in place (after `build_stack`).
    pub fn streams_in_place(&self) -> Option<bool> {
        self.built.as_ref().map(|b| b.stack.in_place)
    }

    /// Runs the whole program in one launch, as `stack_step` does in [`Mode::Fused`], with every
    /// block stamping the GPU's global timer at the start and end of each phase it runs, and in a GEMV
    /// phase also when its input is ready and when its stream is done (zero for the phases and stamps
    /// a block does not take). `Ok` holds the stamps, `(block, phase over every layer, [start, input,
    /// streamed, end in ns, SM])` flattened, as a [`Trace`] of one position without a head, the launch
    /// timed by events (`Trace::step_shares` reads it).
    pub fn trace_step(
        &mut self,
        dev: &Device,
        x: &CudaSlice<bf16>,
        pos: usize,
        hidden: Option<&mut CudaSlice<bf16>>,
        out: &mut CudaSlice<bf16>,
    ) -> Result<Trace, SubmissionError> {
        let (phases, grid, (plan, waits)) = match (self.phases(), &self.built) {
            (Some(phases), Some(b)) => (phases, b.stack.grid, b.stack.traced_rows()),
            _ => return Err(SubmissionError::Refused("trace_step before build_stack".into())),
        };
        let mut trace = dev
            .stream()
            .alloc_zeros::<u64>(grid as usize * phases as usize * TRACE_STAMPS)
            .context("allocating the trace")?;
        let kernel_ms = dev.time_ms(|| self.launch(dev, x, pos, hidden, out, 0..phases, Some(&mut trace)))?;
        let stamps = dev.stream().clone_dtoh(&trace).context("reading the trace")?;
        let layers = phases as usize / plan.len().max(1);
        Ok(Trace { stamps, grid: grid as usize, plan, waits, layers, head: false, prompt: 0, kernel_ms })
    }

    #[allow(clippy::too_many_arguments)]
    fn launch(
        &mut self,
        dev: &Device,
        x: &CudaSlice<bf16>,
        pos: usize,
        hidden: Option<&mut CudaSlice<bf16>>,
        out: &mut CudaSlice<bf16>,
        phases: std::ops::Range<u32>,
        trace: Option<&mut CudaSlice<u64>>,
    ) -> Result<(), SubmissionError> {
        let Built { stack: b, program } =
            self.built.as_mut().ok_or_else(|| SubmissionError::Refused("a step before build_stack".into()))?;
        let layers = b.layers();
        let total = b.phases() * layers;
        if phases.is_empty() || phases.end > total {
            return Err(SubmissionError::Refused(format!("phases {phases:?} of a program of {total} phases")));
        }
        let row = b.d as usize;
        let hidden = submission::checked_hidden(layers as usize, row, hidden)?.map_or(0, |h| device_address(dev, h));
        if x.len() < row || out.len() < row {
            return Err(SubmissionError::Refused(format!("x and out need {row} elements")));
        }
        b.cursor.check(&phases)?;
        let cfg = b.launch_config(b.smem);
        let (pos, begin, end, rows) = (pos as u32, phases.start, phases.end, b.phases());
        let no_trace = 0u64;
        let mut args = dev.stream().launch_builder(&b.func);
        match program {
            LayerProgram::One(p) => args.arg(&**p),
            LayerProgram::Stack(p) => args.arg(&**p),
        };
        args.arg(&rows).arg(&layers).arg(&begin).arg(&end);
        args.arg(x).arg(out).arg(&hidden).arg(&b.d).arg(&pos);
        args.arg(&b.cursor.step).arg(&mut b.phase_done).arg(&b.red_rows);
        match trace {
            Some(t) => args.arg(t),
            None => args.arg(&no_trace),
        };
        // SAFETY: megakernel_[sliced_]bf16 / megakernel_stack_[sliced_]bf16 / megakernel_split_bf16(program: Program<1 or
        // MAX_STACK_LAYERS> by value, as `LayerProgram::kernel` pairs them (the split kernel: a stack's), phases: u32, layers: u32 (at most its tables), phase_begin: u32, phase_end: u32, x (d), out (d), hidden (null, or (layers - 1, d),
        // checked above), d: u32, pos: u32, step: u32, phase_done (MAX_PHASES), red_rows: u32, trace (null
        // or grid * (end - begin) * TRACE_STAMPS u64)); the grid is co-resident (occupancy-sized, and the
        // cooperative launch fails rather than run it otherwise), smem as build_stack sized it; the phases
        // continue the step (checked above).
        unsafe { args.launch_cooperative(cfg) }.context("launching the megakernel")?;
        b.cursor.advance(end, total);
        Ok(())
    }
}

impl Megakernel {
    /// One token through the whole program: in one launch ([`Mode::Fused`]) or one per phase.
    fn step(
        &mut self,
        dev: &Device,
        x: &CudaSlice<bf16>,
        pos: usize,
        mut hidden: Option<&mut CudaSlice<bf16>>,
        out: &mut CudaSlice<bf16>,
    ) -> Result<(), SubmissionError> {
        let phases = self.phases().ok_or_else(|| SubmissionError::Refused("a step before build_stack".into()))?;
        match self.mode {
            Mode::Fused => self.launch_phases(dev, x, pos, hidden, out, 0..phases),
            Mode::PerPhase => {
                (0..phases).try_for_each(|p| self.launch_phases(dev, x, pos, hidden.as_deref_mut(), out, p..p + 1))
            }
        }
    }
}

impl Submission for Megakernel {
    fn name(&self) -> &str {
        match self.mode {
            Mode::Fused => "megakernel",
            Mode::PerPhase => "megakernel-phases",
        }
    }

    fn build_layer(&mut self, dev: &Device, mut layer: Layer<'_>, cfg: &Config) -> Result<(), SubmissionError> {
        self.build_stack(dev, &mut [layer.reborrow()], cfg)
    }

    fn layer_step(
        &mut self,
        dev: &Device,
        _layer: Layer<'_>,
        x: &CudaSlice<bf16>,
        pos: usize,
        out: &mut CudaSlice<bf16>,
    ) -> Result<(), SubmissionError> {
        self.step(dev, x, pos, None, out)
    }

    fn build_stack(&mut self, dev: &Device, layers: &mut [Layer<'_>], cfg: &Config) -> Result<(), SubmissionError> {
        let opts = StackOptions {
            forced: self.forced,
            in_place: self.in_place,
            split: self.split,
            ..StackOptions::new(Target::Layers)
        };
        let kernel = match self.split {
            Split::None => (&MEGAKERNEL, LayerProgram::kernel(layers.len(), cfg)),
            Split::Over(_) if layers.len() < 2 || has_narrow_rows(cfg) => {
                return Err(SubmissionError::Unsupported(format!(
                    "the split kernel runs stacks of two layers or more without rows in slices, not {} layer(s) of {}",
                    layers.len(),
                    cfg.name
                )));
            }
            Split::Over(_) => (&SPLIT, LayerProgram::SPLIT_KERNEL),
        };
        let stack = CompiledStack::build(dev, layers, cfg, &opts, kernel)?;
        self.built = Some(Built { program: LayerProgram::of(&stack), stack });
        Ok(())
    }

    fn stack_step(
        &mut self,
        dev: &Device,
        _layers: &mut [Layer<'_>],
        x: &CudaSlice<bf16>,
        pos: usize,
        hidden: Option<&mut CudaSlice<bf16>>,
        out: &mut CudaSlice<bf16>,
    ) -> Result<(), SubmissionError> {
        self.step(dev, x, pos, hidden, out)
    }

    fn teardown(&mut self) {
        self.built = None;
    }
}

#[cfg(test)]
mod tests {
    use super::LayerProgram;

    /// The judge's narrow shapes (Llama-3.2-1B's layer and its stack) get the sliced instances and every
    /// other member the plain ones, each a kernel of `megakernel.cu`.
    #[test]
    fn layers_with_narrow_rows_take_the_sliced_instances() {
        for m in spec::family::FAMILY.iter() {
            let cfg = m.config();
            let sliced = m.name == "llama-3.2-1b";
            for layers in [1, 16] {
                let name = LayerProgram::kernel(layers, &cfg);
                assert_eq!(name.contains("_sliced_"), sliced, "{} x {layers}: {name}", m.name);
                assert_eq!(name.contains("_stack_"), layers > 1, "{} x {layers}: {name}", m.name);
                let entry = format!(" {name}(MEGAKERNEL_PARAMS(");
                assert!(crate::kernels::DEVICE_SOURCE.contains(&entry), "{name} is not a kernel of megakernel.cu");
            }
        }
        let split = format!(" {}(MEGAKERNEL_PARAMS(PROGRAM_MAX_LAYERS))", LayerProgram::SPLIT_KERNEL);
        assert!(
            include_str!("../../kernels/megakernel/split.cu").contains(&split),
            "the split kernel takes a stack's program"
        );
    }
}
