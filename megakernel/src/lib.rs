//! The reference submission: the layer compiled into a program (`program`) that one persistent kernel
//! (`kernels/megakernel/megakernel.cu`, its device code in `megakernel.cuh`) interprets, one
//! cooperative launch per token, for one layer or a whole stack of them. `build_stack` (and `build_layer`, a stack of one) packs each layer's weights
//! (`pack`), uploads the RoPE tables, allocates the scratch the phases and layers share and compiles the
//! program and each layer's address table; `stack_step` (and `layer_step`) only launches.
//!
//! [`Mode::PerPhase`] runs the same device code one phase per launch, for debugging and per-phase
//! timing; its results are bitwise those of [`Mode::Fused`].

#[cfg(feature = "model")]
pub mod batch;
pub mod cpu;
pub mod kernels;
#[cfg(feature = "model")]
pub mod model;
pub mod pack;
pub mod program;

use cuda::cudarc::driver::sys::CUfunction_attribute;
use cuda::cudarc::driver::{CudaFunction, CudaSlice, DeviceRepr, LaunchConfig, PushKernelArg};
use cuda::{Context, CudaError, Device};
use half::bf16;
use reference::golden::RopeTable;
use reference::gpu::DeviceWeights;
use spec::{Config, LayerOp, Tensor};

use submission::{Layer, Submission, SubmissionError, device_address};

use cuda::kernels::Kernel;
use kernels::MEGAKERNEL;
use pack::Packing;
use program::{Blocks, Buffers, Forced, Plan};

/// Mirrors of `kernels/megakernel/megakernel.cuh` (a test checks them against the file).
pub const THREADS: u32 = 512;
const WARPS: u32 = THREADS / 32;
const RING_BYTES: u32 = 3 * 64 * 1024;
const ATTN_MAX_HD: usize = 256;
const ATTN_MAX_GROUP: usize = 16;
/// Stamps per block and phase in a trace (`trace_step`): start, input ready, stream done, end.
pub const TRACE_STAMPS: usize = 4;
/// Vectors one weight stream serves at most: a model's batch step's lanes, or a prompt chunk's
/// positions (the kernel's `MAX_BATCH`).
pub const MAX_BATCH: usize = 8;
/// The widest GEMV rows that the kernel runs in slices of the block (`row_slices`: half a block's
/// 16-byte vectors of 8 bf16): a model with such rows gets the model kernel's sliced instance
/// (`Param::kernel`). Choosing by a wrong width would cost speed, never a bit of the output.
const SLICED_MAX_COLS: usize = THREADS as usize / 2 * 8;
/// Whether some GEMV of the layer has rows of at most SLICED_MAX_COLS columns: Qkv's and GateUp's have
/// d, the O projection's q_dim, Down's ffn.
fn has_narrow_rows(cfg: &Config) -> bool {
    [cfg.d, cfg.q_dim(), cfg.ffn].into_iter().min().unwrap_or(0) <= SLICED_MAX_COLS
}

/// The row gather of `kernels/megakernel/megakernel.cu` that packs weights (the red team packs cache rows with it).
pub const GATHER: &str = "gather_rows_u4";
/// Static shared memory the kernels declare beside the dynamic (the ring's barriers, the row source,
/// the reductions' scratch), rounded up: the LM head's partials take what is left.
const STATIC_SMEM_ALLOWANCE: usize = 1024;

/// Rows of partials (WARPS f32 each) the shared memory holds beside the ring and the static variables.
fn partial_rows_room(dev: &Device) -> usize {
    rows_beside(dev, STATIC_SMEM_ALLOWANCE)
}

/// Rows of partials the shared memory holds beside the ring and `static_bytes` of static variables.
fn rows_beside(dev: &Device, static_bytes: usize) -> usize {
    (dev.facts().max_smem_optin_bytes.max(0) as usize).saturating_sub(RING_BYTES as usize + static_bytes)
        / (WARPS as usize * 4)
}

/// The batch step's kernel, its partials all the room the ring leaves (at least the `red_rows` a block
/// of any layer phase needs for one lane).
#[cfg(feature = "model")]
fn batch_kernel(dev: &Device, file: &Kernel, red_rows: usize) -> Result<BatchKernel, SubmissionError> {
    let func = dev.function(file, "megakernel_model_batch_bf16")?;
    let static_bytes = func.shared_size_bytes().context("reading the batch step's static shared memory")?;
    let rows = rows_beside(dev, static_bytes.max(0) as usize);
    if rows < red_rows {
        return Err(SubmissionError::Unsupported(format!(
            "the batch step's partials hold {rows} rows beside its ring; a phase's block needs {red_rows}"
        )));
    }
    let smem = RING_BYTES + rows as u32 * WARPS * 4;
    fit_one_block(&func, smem, "the batch step")?;
    Ok(BatchKernel { func, smem, red_rows: rows as u32 })
}

/// Raises `func`'s dynamic shared memory to `smem` bytes and checks that a block of it fits an SM
/// (`what` names the kernel in the errors).
fn fit_one_block(func: &CudaFunction, smem: u32, what: &str) -> Result<(), SubmissionError> {
    func.set_attribute(CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem as i32)
        .context(format!("raising {what}'s shared memory limit"))?;
    let per_sm = func
        .occupancy_max_active_blocks_per_multiprocessor(THREADS, smem as usize, None)
        .context(format!("reading {what}'s occupancy"))?;
    if per_sm == 0 {
        return Err(SubmissionError::Unsupported(format!(
            "{what} cannot fit one block of {THREADS} threads and {smem} bytes of shared memory on an SM"
        )));
    }
    Ok(())
}

/// Threads per block of the packing gather.
pub const GATHER_BLOCK: u32 = 256;

/// How `layer_step` runs the program.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// One cooperative launch for the whole step: the submission.
    Fused,
    /// One launch per phase: for debugging and per-phase timing.
    PerPhase,
}

/// Where the launches stand in the steps. A step's phases run in order from phase 0: a phase waits
/// until every block of each phase it depends on has counted itself done this step (`phase_done`,
/// monotonic: blocks * steps), so a phase launched out of order would wait forever.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
struct StepCursor {
    /// Steps whose last phase has been launched.
    step: u32,
    /// The phase the next launch must start at.
    next_phase: u32,
}

impl StepCursor {
    /// Refuses a launch of `range` that does not continue the step.
    fn check(&self, range: &std::ops::Range<u32>) -> Result<(), SubmissionError> {
        if range.start == self.next_phase {
            return Ok(());
        }
        Err(SubmissionError::Refused(format!(
            "phases {range:?}: the step's next phase is {} (a step's phases run in order from 0)",
            self.next_phase
        )))
    }

    /// After a launch of phases up to `end` of a program of `phases`.
    fn advance(&mut self, end: u32, phases: u32) {
        if end == phases {
            self.step = self.step.wrapping_add(1);
            self.next_phase = 0;
        } else {
            self.next_phase = end;
        }
    }
}

/// The program as a kernel receives it: by value, `program::MAX_PHASES` rows and `L` layers' address
/// tables (see `kernels/megakernel/program.cuh`, `struct Program`): one for the one-layer kernel, whose rows carry
/// the layer's addresses themselves, `program::MAX_STACK_LAYERS` for the stack kernel.
#[derive(Clone, Copy)]
#[repr(C)]
struct ProgramParam<const L: usize> {
    rows: [program::Row; program::MAX_PHASES],
    tables: [[i64; program::LAYER_WORDS]; L],
}

// SAFETY: plain old data of the layout `struct Program<L>` declares (int64 words, no padding).
unsafe impl<const L: usize> DeviceRepr for ProgramParam<L> {}

impl<const L: usize> ProgramParam<L> {
    /// The rows, then no-op rows (opcode 0) that no block runs, up to `MAX_PHASES`, then the tables
    /// (zero past the last); `None` when there are more rows or tables than it holds.
    fn new(rows: &[program::Row], tables: &[[i64; program::LAYER_WORDS]]) -> Option<Box<Self>> {
        if rows.len() > program::MAX_PHASES || tables.len() > L {
            return None;
        }
        let mut nop = [0i64; program::ROW_WORDS];
        nop[program::BLOCKS_WORD] = Blocks { first: 0, count: 0, stride: 1 }.word();
        let mut param =
            Box::new(ProgramParam { rows: [nop; program::MAX_PHASES], tables: [[0; program::LAYER_WORDS]; L] });
        param.rows[..rows.len()].copy_from_slice(rows);
        param.tables[..tables.len()].copy_from_slice(tables);
        Some(param)
    }
}

/// The compiled program and the kernel that runs it: one layer, a stack, or a model's stack (the same
/// parameter block, for the model kernel, which `model::GpuModel` launches).
enum Param {
    One(Box<ProgramParam<1>>),
    Stack(Box<ProgramParam<{ program::MAX_STACK_LAYERS }>>),
    Model(Box<ProgramParam<{ program::MAX_STACK_LAYERS }>>),
}

impl Param {
    fn rows(&self) -> &[program::Row; program::MAX_PHASES] {
        match self {
            Param::One(p) => &p.rows,
            Param::Stack(p) | Param::Model(p) => &p.rows,
        }
    }

    /// The kernel that takes this parameter block (in `kernels/megakernel/megakernel.cu`, a model's in
    /// the model's kernel file, `ForModel::kernels`). A model's has three
    /// instances, each the machine code measured for its models: for layers with per-head q/k norms
    /// (`qk_norm`), for layers with rows of at most SLICED_MAX_COLS columns (`narrow`: they stream in
    /// full stages as groups of one), and for the rest; each with a traced twin (`traced`: every block
    /// stamps its phases, `model::GpuModel::trace`).
    fn kernel(&self, qk_norm: bool, narrow: bool, traced: bool) -> &'static str {
        match (self, traced) {
            (Param::One(_), _) => "megakernel_bf16",
            (Param::Stack(_), _) => "megakernel_stack_bf16",
            (Param::Model(_), false) if qk_norm => "megakernel_model_qk_norm_bf16",
            (Param::Model(_), false) if narrow => "megakernel_model_sliced_bf16",
            (Param::Model(_), false) => "megakernel_model_bf16",
            (Param::Model(_), true) if qk_norm => "megakernel_model_qk_norm_traced_bf16",
            (Param::Model(_), true) if narrow => "megakernel_model_sliced_traced_bf16",
            (Param::Model(_), true) => "megakernel_model_traced_bf16",
        }
    }
}

/// A phase of the compiled program as `grader profile` reports it: the layer's operation it computes,
/// the share of that operation's bytes it reads, and the blocks that run it.
#[derive(Debug, Clone, PartialEq)]
pub struct PhasePlan {
    pub op: LayerOp,
    pub share: f64,
    pub blocks: Blocks,
}

/// Everything `build_stack` made; dropped by `teardown`.
struct Built {
    program: Param,
    layout: Plan,
    /// Rows of the program: one layer's phases.
    phases: u32,
    layers: u32,
    in_place: bool,
    d: u32,
    plan: Vec<PhasePlan>,
    func: CudaFunction,
    /// A model's traced kernel (`Param::kernel`'s `traced`), loaded by `model::GpuModel::trace`.
    #[cfg(feature = "model")]
    traced: Option<&'static str>,
    grid: u32,
    smem: u32,
    red_rows: u32,
    /// A model's head phases run so far (the kernel's head counter is `grid * heads`).
    #[cfg(feature = "model")]
    heads: u32,
    /// `(MAX_PHASES + 1)`: per phase, how many blocks have finished it, over all steps so far; the last
    /// counts a model's head phases.
    phase_done: CudaSlice<u32>,
    cursor: StepCursor,
    /// Bytes between the lanes' arenas of activation buffers (`LaneArena`).
    #[cfg(feature = "model")]
    act_stride: u64,
    /// A model's batch step (`model::GpuModel::decode_batch`).
    #[cfg(feature = "model")]
    batch: Option<BatchKernel>,
    // Owned for the program's pointers to stay valid.
    _packed: Vec<CudaSlice<bf16>>,
    _rope: [CudaSlice<f32>; 2],
    _arena: CudaSlice<u8>,
}

/// The batch step's kernel (`megakernel_model_batch_bf16`): its row partials take all the shared
/// memory the ring leaves, so that a group of lanes fits as many rows as it can.
#[cfg(feature = "model")]
struct BatchKernel {
    func: CudaFunction,
    smem: u32,
    red_rows: u32,
}

/// Where a lane's activation buffers lie in its arena (byte offsets, each 256-aligned), and the arena's
/// size: lane b's are lane 0's (the program's) plus b strides, as the batch step reads them.
struct LaneArena {
    q: usize,
    a: usize,
    x1: usize,
    act: usize,
    part_o: usize,
    part_ml: usize,
    counters: usize,
    x1_part: usize,
    down_part: usize,
    stride: usize,
}

impl LaneArena {
    fn of(cfg: &Config) -> LaneArena {
        let partials = program::max_splits(cfg) * cfg.n_kv * cfg.group();
        let sizes = [
            2 * cfg.q_dim(),
            2 * cfg.q_dim(),
            2 * cfg.d,
            2 * cfg.ffn,
            4 * partials * cfg.hd,
            4 * partials * 2,
            // Arrivals and departures per KV head (see phase_attention).
            4 * 2 * cfg.n_kv,
            4 * cfg.d,
            4 * cfg.d,
        ];
        let mut at = [0usize; 10];
        for (i, bytes) in sizes.iter().enumerate() {
            at[i + 1] = at[i] + bytes.next_multiple_of(256);
        }
        let [q, a, x1, act, part_o, part_ml, counters, x1_part, down_part, stride] = at;
        LaneArena { q, a, x1, act, part_o, part_ml, counters, x1_part, down_part, stride }
    }

    /// Lane 0's buffers in the arena at `base`, beside the RoPE tables.
    fn buffers(&self, base: u64, cos: u64, sin: u64) -> Buffers {
        let at = |offset: usize| base + offset as u64;
        Buffers {
            q: at(self.q),
            cos,
            sin,
            part_o: at(self.part_o),
            part_ml: at(self.part_ml),
            counters: at(self.counters),
            a: at(self.a),
            x1_part: at(self.x1_part),
            x1: at(self.x1),
            act: at(self.act),
            down_part: at(self.down_part),
        }
    }
}

pub struct Megakernel {
    mode: Mode,
    forced: Forced,
    /// Whether a stack streams Qkv and GateUp in place (`None`: only when packed copies do not fit).
    in_place: Option<bool>,
    /// The vocabulary of the model whose stack this is (`model::GpuModel`): the stack is built for the
    /// model kernel, with room for its LM head's rows.
    head_vocab: Option<usize>,
    /// The model's kernel file (`kernels/megakernel/model/model.cu`, embedded with the `model`
    /// feature), which the model kernels of `Param::kernel` are loaded from.
    model_kernels: Option<&'static Kernel>,
    /// The model's layers have per-head q/k norms: its Qkv phases give each block whole heads, with room
    /// for their rows.
    qk_norm: bool,
    /// RoPE's table when it is not the layer's own (a model's scaled frequencies).
    rope: Option<RopeTable>,
    built: Option<Built>,
}

impl Megakernel {
    pub fn new(mode: Mode) -> Self {
        Self {
            mode,
            forced: Forced::default(),
            in_place: None,
            head_vocab: None,
            model_kernels: None,
            qk_norm: false,
            rope: None,
            built: None,
        }
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

    /// The same, building the stack for `model::GpuModel`'s kernel (in the kernel file `kernels`),
    /// whose LM head has `vocab` rows and whose layers have per-head q/k norms when `qk_norm`; the
    /// layer kernels' steps are then refused.
    pub fn for_model(mut self, vocab: usize, qk_norm: bool, kernels: &'static Kernel) -> Self {
        self.head_vocab = Some(vocab);
        self.model_kernels = Some(kernels);
        self.qk_norm = qk_norm;
        self
    }

    /// The same, rotating by `rope` (at least the caches' positions, `hd / 2` a row) instead of the
    /// layer's own RoPE.
    pub fn with_rope(mut self, rope: RopeTable) -> Self {
        self.rope = Some(rope);
        self
    }

    /// Phases of the compiled program, over every layer (after `build_stack`).
    pub fn phases(&self) -> Option<u32> {
        self.built.as_ref().map(|b| b.phases * b.layers)
    }

    /// What each phase of the compiled program computes and which blocks run it (after
    /// `build_layer`).
    pub fn plan(&self) -> Option<&[PhasePlan]> {
        self.built.as_ref().map(|b| b.plan.as_slice())
    }

    /// The launch's grid and dynamic shared memory per block, in bytes (after `build_layer`).
    pub fn launch_shape(&self) -> Option<(u32, u32)> {
        self.built.as_ref().map(|b| (b.grid, b.smem))
    }

    /// The compiled plan in words (after `build_layer`): the grid, the roles, the MLP's parts and how
    /// attention splits its work at position `pos`.
    pub fn describe(&self, cfg: &Config, pos: usize) -> Option<String> {
        let b = self.built.as_ref()?;
        let rows = &b.program.rows()[..b.phases as usize];
        Some(format!(
            "{} blocks x {THREADS} threads, {} bytes of shared memory; {}",
            b.grid,
            b.smem,
            program::describe(cfg, b.layout, rows, pos)
        ))
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
        self.built.as_ref().map(|b| b.in_place)
    }

    /// Runs the whole program in one launch, as `stack_step` does in [`Mode::Fused`], with every
    /// block stamping the GPU's global timer at the start and end of each phase it runs, and in a GEMV
    /// phase also when its input is ready and when its stream is done (zero for the phases and stamps
    /// a block does not take). `Ok` holds the stamps in ns, `(block, phase over every layer, [start,
    /// input, streamed, end])` flattened, and the grid.
    pub fn trace_step(
        &mut self,
        dev: &Device,
        x: &CudaSlice<bf16>,
        pos: usize,
        hidden: Option<&mut CudaSlice<bf16>>,
        out: &mut CudaSlice<bf16>,
    ) -> Result<(Vec<u64>, u32), SubmissionError> {
        let (phases, grid) = match (self.phases(), &self.built) {
            (Some(phases), Some(b)) => (phases, b.grid),
            _ => return Err(SubmissionError::Refused("trace_step before build_stack".into())),
        };
        let mut trace = dev
            .stream()
            .alloc_zeros::<u64>(grid as usize * phases as usize * TRACE_STAMPS)
            .context("allocating the trace")?;
        self.launch(dev, x, pos, hidden, out, 0..phases, Some(&mut trace))?;
        Ok((dev.stream().clone_dtoh(&trace).context("reading the trace")?, grid))
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
        let b = self.built.as_mut().ok_or_else(|| SubmissionError::Refused("a step before build_stack".into()))?;
        let total = b.phases * b.layers;
        if phases.is_empty() || phases.end > total {
            return Err(SubmissionError::Refused(format!("phases {phases:?} of a program of {total} phases")));
        }
        let row = b.d as usize;
        let hidden = submission::checked_hidden(b.layers as usize, row, hidden)?.map_or(0, |h| device_address(dev, h));
        if x.len() < row || out.len() < row {
            return Err(SubmissionError::Refused(format!("x and out need {row} elements")));
        }
        b.cursor.check(&phases)?;
        let cfg = LaunchConfig { grid_dim: (b.grid, 1, 1), block_dim: (THREADS, 1, 1), shared_mem_bytes: b.smem };
        let (pos, begin, end) = (pos as u32, phases.start, phases.end);
        let no_trace = 0u64;
        let mut args = dev.stream().launch_builder(&b.func);
        match &b.program {
            Param::One(p) => args.arg(&**p),
            Param::Stack(p) => args.arg(&**p),
            Param::Model(_) => {
                return Err(SubmissionError::Refused("this stack was built for a model: GpuModel runs it".into()));
            }
        };
        args.arg(&b.phases).arg(&b.layers).arg(&begin).arg(&end);
        args.arg(x).arg(out).arg(&hidden).arg(&b.d).arg(&pos);
        args.arg(&b.cursor.step).arg(&mut b.phase_done).arg(&b.red_rows);
        match trace {
            Some(t) => args.arg(t),
            None => args.arg(&no_trace),
        };
        // SAFETY: megakernel_bf16 / megakernel_stack_bf16(program: Program<1 or MAX_STACK_LAYERS> by value, as
        // `Param::kernel` pairs them, phases: u32, layers: u32 (at most its tables), phase_begin: u32, phase_end: u32, x (d), out (d), hidden (null, or (layers - 1, d),
        // checked above), d: u32, pos: u32, step: u32, phase_done (MAX_PHASES), red_rows: u32, trace (null
        // or grid * (end - begin) * TRACE_STAMPS u64)); the grid is co-resident (occupancy-sized, and the
        // cooperative launch fails rather than run it otherwise), smem as build_stack sized it; the phases
        // continue the step (checked above).
        unsafe { args.launch_cooperative(cfg) }.context("launching the megakernel")?;
        b.cursor.advance(end, total);
        Ok(())
    }
}

/// The packed matrix `packing` describes, gathered on the GPU.
fn gather<F: Fn(usize) -> (Tensor, usize)>(
    dev: &Device,
    w: &DeviceWeights,
    packing: Packing<F>,
) -> Result<CudaSlice<bf16>, CudaError> {
    let Packing { rows, cols, start } = packing;
    let table: Vec<u64> = (0..rows)
        .map(|p| {
            let (t, at) = start(p);
            device_address(dev, w.get(t)) + (at * 2) as u64
        })
        .collect();
    let table = dev.stream().clone_htod(&table).context("uploading a packing table")?;
    // SAFETY: the gather writes every element before anything reads it.
    let mut out = unsafe { dev.stream().alloc::<bf16>(rows * cols) }.context("allocating a packed matrix")?;
    let f = dev.function(&MEGAKERNEL, GATHER)?;
    let (r, vecs) = (rows as u32, (cols / 8) as u32);
    let mut args = dev.stream().launch_builder(&f);
    args.arg(&mut out).arg(&table).arg(&r).arg(&vecs);
    // SAFETY: gather_rows_u4(dst (rows, vecs), src_rows (rows), rows: u32, vecs: u32); every table
    // entry is the start of a row of `cols` bf16 inside a weight.
    unsafe { args.launch(cuda::grid_1d(rows * cols / 8, GATHER_BLOCK, dev.facts().sms)) }
        .context("launching gather_rows_u4")?;
    Ok(out)
}

/// A matrix the program streams in `N` parts of columns or fewer (`parts`, one per part): each
/// gathered, and their addresses (0 past the last); or, with one part, the weight `whole` as it is (no
/// copy).
fn column_parts<const N: usize, F: Fn(usize) -> (Tensor, usize)>(
    dev: &Device,
    w: &DeviceWeights,
    parts: Vec<Packing<F>>,
    whole: Tensor,
) -> Result<(Vec<CudaSlice<bf16>>, [u64; N]), CudaError> {
    let mut at = [0u64; N];
    if parts.len() == 1 {
        at[0] = device_address(dev, w.get(whole));
        return Ok((Vec::new(), at));
    }
    let packed = parts.into_iter().map(|p| gather(dev, w, p)).collect::<Result<Vec<_>, _>>()?;
    for (a, p) in at.iter_mut().zip(&packed) {
        *a = device_address(dev, p);
    }
    Ok((packed, at))
}

/// The most rows a block takes in the Qkv phases of `rows` when each block takes whole heads of `hd`
/// rows (a model's layers with per-head q/k norms: the kernel's `qkv_unit`).
fn qkv_head_rows(rows: &[program::Row], hd: usize) -> usize {
    rows.iter()
        .filter(|r| r[0] == program::Op::Qkv as i64)
        .filter_map(|r| Some(hd * (program::gemv_rows(r)? / hd).div_ceil(Blocks::of(r).count as usize)))
        .max()
        .unwrap_or(0)
}

/// The largest row share any block gets in a GEMV phase of `rows` rows over `grid` blocks.
fn max_block_rows(rows: usize, grid: usize) -> usize {
    2 * (rows / 2).div_ceil(grid)
}

/// The plan for a grid of `grid` blocks (the compiler's, with what `forced` names in its place), or
/// why not: the layer is over one of the kernel's fixed limits, named
/// ([`SubmissionError::Unsupported`]), or the forced plan does not fit it
/// ([`SubmissionError::Refused`]). (Every head size these checks admit fits its attention chunk in a
/// team's shared memory: a test checks them all.)
fn check_fits(cfg: &Config, grid: u32, forced: Forced) -> Result<Plan, SubmissionError> {
    let unsupported = |why: String| Err(SubmissionError::Unsupported(why));
    if cfg.d > program::MAX_ROW {
        return unsupported(format!("d = {} is over the megakernel's row of {}", cfg.d, program::MAX_ROW));
    }
    let most_ffn = program::MAX_MLP_PARTS * program::MAX_ROW;
    if cfg.ffn > most_ffn {
        return unsupported(format!(
            "ffn = {} is over the megakernel's {most_ffn} ({} parts of {})",
            cfg.ffn,
            program::MAX_MLP_PARTS,
            program::MAX_ROW
        ));
    }
    // The tensor-core attention takes the head dimension 16 at a time and the group as two tiles of 8.
    if cfg.hd > ATTN_MAX_HD {
        return unsupported(format!("hd = {} is over the megakernel's attention's {ATTN_MAX_HD}", cfg.hd));
    }
    if !cfg.hd.is_multiple_of(16) {
        return unsupported(format!("hd = {} is not a multiple of 16, as the megakernel's attention needs", cfg.hd));
    }
    if cfg.group() > ATTN_MAX_GROUP {
        return unsupported(format!(
            "{} query heads per KV head is over the megakernel's attention's {ATTN_MAX_GROUP}",
            cfg.group()
        ));
    }
    let plan =
        Plan::with(cfg, grid, forced).map_err(|why| SubmissionError::Refused(format!("the forced plan: {why}")))?;
    // The O projection streams whole rows of the query heads of each role's KV groups (Down's rows are
    // split into the MLP's parts).
    let o_cols = plan.halves(cfg).iter().map(|g| g.n_q(cfg) * cfg.hd).max().unwrap_or(0);
    if o_cols > program::MAX_ROW {
        return unsupported(format!(
            "the O projection's row (n_q * hd over the KV heads of a role) = {o_cols} is over the megakernel's row of {}",
            program::MAX_ROW
        ));
    }
    Ok(plan)
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

/// Bytes of one layer's packed copies under `plan`: QKV and GateUp always; the O projection's and
/// Down's column parts when there are two or more (one part streams the weight as it is).
fn packed_bytes(cfg: &Config, plan: Plan) -> u64 {
    let bf16 = |elems: usize| 2 * elems as u64;
    let mut bytes = bf16((cfg.q_dim() + 2 * cfg.kv_dim()) * cfg.d) + bf16(2 * cfg.ffn * cfg.d);
    if plan.roles == 2 {
        bytes += bf16(cfg.q_dim() * cfg.d);
    }
    if plan.mlp_parts > 1 {
        bytes += bf16(cfg.ffn * cfg.d);
    }
    bytes
}

/// Device memory left after the packed copies of every layer, for the contexts' and the run's own
/// needs.
const PACKING_HEADROOM_BYTES: u64 = 1 << 30;

/// Why packed copies of `layers` layers under `plan` do not fit beside what is allocated already, or
/// `None` when they do.
fn packing_shortfall(dev: &Device, cfg: &Config, plan: Plan, layers: usize) -> Result<Option<String>, CudaError> {
    let need = packed_bytes(cfg, plan) * layers as u64;
    let (free, _) = dev.ctx().mem_get_info().context("reading free memory")?;
    Ok((need + PACKING_HEADROOM_BYTES > free as u64).then(|| {
        format!(
            "the megakernel's packed copies of {layers} layer(s) need {:.1} GB and {:.1} GB is free",
            need as f64 / 1e9,
            free as f64 / 1e9
        )
    }))
}

/// The plan of a stack that streams in place: one role and one MLP part, so that the O projection and
/// Down read whole rows of `Wo` and `Wdown` as handed over (column parts would be packed copies); or
/// why the layer cannot (its Down rows need parts).
fn in_place_plan(cfg: &Config, grid: u32, layers: usize, forced: Forced) -> Result<Plan, SubmissionError> {
    if layers == 1 {
        return Err(SubmissionError::Refused("streaming in place is for stacks (one layer is packed)".into()));
    }
    let one = Forced { roles: Some(1), mlp_parts: Some(1) };
    if forced != Forced::default() && forced != one {
        return Err(SubmissionError::Refused("streaming in place runs one role and one MLP part".into()));
    }
    check_fits(cfg, grid, one).map_err(|e| {
        let why = match e {
            SubmissionError::Unsupported(why) | SubmissionError::Refused(why) => why,
            other => other.to_string(),
        };
        SubmissionError::Unsupported(format!(
            "the stack's packed copies do not fit, and streaming it in place (one role, one MLP part) does not fit \
             the kernel: {why}"
        ))
    })
}

/// One layer's addresses as handed over, for streaming in place: Qkv's rows from `Wq`, `Wk` and `Wv`,
/// GateUp's from `Wgate` and `Wup`, the O projection's and Down's whole rows from `Wo` and `Wdown`.
fn handed_buffers(dev: &Device, layer: &Layer<'_>) -> program::LayerBuffers {
    let (w, a) = (layer.weights, |t: Tensor| device_address(dev, layer.weights.get(t)));
    program::LayerBuffers {
        w_qkv: [a(Tensor::Wq), 0],
        in_norm: device_address(dev, &w.in_norm),
        k_cache: device_address(dev, &layer.cache.k),
        v_cache: device_address(dev, &layer.cache.v),
        w_o: [a(Tensor::Wo), 0],
        w_gateup: a(Tensor::Wgate),
        post_norm: device_address(dev, &w.post_norm),
        w_down: [a(Tensor::Wdown), 0, 0],
        in_place: Some([a(Tensor::Wk), a(Tensor::Wv), a(Tensor::Wup)]),
    }
}

/// One layer's packed weights (kept alive in `packed`) and its addresses.
fn layer_buffers(
    dev: &Device,
    layer: &Layer<'_>,
    cfg: &Config,
    plan: Plan,
    packed: &mut Vec<CudaSlice<bf16>>,
) -> Result<program::LayerBuffers, CudaError> {
    let w = layer.weights;
    let halves = plan.halves(cfg);
    let w_qkv: Vec<CudaSlice<bf16>> =
        halves.iter().map(|&g| gather(dev, w, pack::qkv(cfg, g))).collect::<Result<_, _>>()?;
    let o_parts = if halves.len() == 2 {
        halves.iter().map(|&g| pack::oproj(cfg, g)).collect()
    } else {
        vec![pack::oproj(cfg, halves[0])]
    };
    let (w_o, w_o_at) = column_parts(dev, w, o_parts, Tensor::Wo)?;
    let w_gateup = gather(dev, w, pack::gateup(cfg))?;
    let parts = plan.mlp_parts;
    let (w_down, w_down_at) =
        column_parts(dev, w, (0..parts).map(|k| pack::down(cfg, parts, k)).collect(), Tensor::Wdown)?;
    let address = |v: Option<&CudaSlice<bf16>>| v.map_or(0, |v| device_address(dev, v));
    let buffers = program::LayerBuffers {
        w_qkv: [address(w_qkv.first()), address(w_qkv.get(1))],
        in_norm: device_address(dev, &w.in_norm),
        k_cache: device_address(dev, &layer.cache.k),
        v_cache: device_address(dev, &layer.cache.v),
        w_o: w_o_at,
        w_gateup: device_address(dev, &w_gateup),
        post_norm: device_address(dev, &w.post_norm),
        w_down: w_down_at,
        in_place: None,
    };
    packed.extend(w_qkv.into_iter().chain(w_o).chain(w_down).chain([w_gateup]));
    Ok(buffers)
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
        let (major, minor) = dev.facts().compute_capability;
        if !dev.is_hopper() {
            return Err(CudaError::NeedsHopper {
                what: "the megakernel".into(),
                kernel_file: "megakernel",
                major,
                minor,
            }
            .into());
        }
        if layers.is_empty() {
            return Err(SubmissionError::Refused("a stack of no layers".into()));
        }
        if layers.len() > program::MAX_STACK_LAYERS {
            return Err(SubmissionError::Unsupported(format!(
                "a stack of {} layers is over the megakernel's {}",
                layers.len(),
                program::MAX_STACK_LAYERS
            )));
        }
        // One grid per SM (red_rows is sized for it below).
        let grid = dev.facts().sms as u32;
        let chosen = check_fits(cfg, grid, self.forced)?;
        // Packed when the copies fit (one layer always is), else streamed in place; `in_place` forces
        // either.
        let shortfall = packing_shortfall(dev, cfg, chosen, layers.len())?;
        let in_place = self.in_place.unwrap_or(layers.len() > 1 && shortfall.is_some());
        let layout = match (in_place, shortfall) {
            (true, _) => in_place_plan(cfg, grid, layers.len(), self.forced)?,
            (false, Some(why)) => return Err(SubmissionError::Unsupported(why)),
            (false, None) => chosen,
        };
        let s = dev.stream();
        let mut packed = Vec::new();
        let tables = layers
            .iter()
            .map(|layer| match in_place {
                true => Ok(handed_buffers(dev, layer)),
                false => layer_buffers(dev, layer, cfg, layout, &mut packed),
            })
            .collect::<Result<Vec<_>, CudaError>>()?;
        let rope = match &self.rope {
            Some(r) if r.half == cfg.hd / 2 && r.cos.len() >= cfg.max_seq_len * r.half => r.clone(),
            Some(r) => {
                return Err(SubmissionError::Refused(format!(
                    "a RoPE table of {} positions of {} for caches of {} positions of hd {}",
                    r.cos.len() / r.half.max(1),
                    r.half,
                    cfg.max_seq_len,
                    cfg.hd
                )));
            }
            None => RopeTable::new(cfg),
        };
        let (cos, sin) =
            (s.clone_htod(&rope.cos).context("uploading cos")?, s.clone_htod(&rope.sin).context("uploading sin")?);
        // A model's batch step gives each lane its own arena of the activation buffers.
        let lanes = if self.head_vocab.is_some() { MAX_BATCH } else { 1 };
        let lane = LaneArena::of(cfg);
        let arena =
            s.alloc_zeros::<u8>(lanes * lane.stride).context("allocating the megakernel's activation buffers")?;
        let buffers = lane.buffers(device_address(dev, &arena), device_address(dev, &cos), device_address(dev, &sin));
        let rows = program::compile(cfg, &buffers, grid, layout);
        if rows.len() > program::MAX_PHASES {
            return Err(SubmissionError::Unsupported(format!(
                "the layer compiled to {} phases; the kernel's program holds {}",
                rows.len(),
                program::MAX_PHASES
            )));
        }
        let tables: Vec<[i64; program::LAYER_WORDS]> = tables.iter().map(program::LayerBuffers::table).collect();
        let param = match tables.as_slice() {
            // A model's kernel always reads tables.
            _ if self.head_vocab.is_some() => ProgramParam::new(&rows, &tables).map(Param::Model),
            // One layer: its rows carry its addresses themselves, so no operand is read through a table.
            [one] => {
                let resolved: Vec<program::Row> = rows.iter().map(|r| program::resolve_row(r, one)).collect();
                ProgramParam::new(&resolved, &[]).map(Param::One)
            }
            _ => ProgramParam::new(&rows, &tables).map(Param::Stack),
        }
        .expect("rows and tables within the parameter block (checked above)");
        let file = match (&param, self.model_kernels) {
            (Param::Model(_), Some(model)) => model,
            (Param::Model(_), None) => unreachable!("for_model names the model's kernel file"),
            _ => &MEGAKERNEL,
        };
        let func = dev.function(file, param.kernel(self.qk_norm, has_narrow_rows(cfg), false))?;
        #[cfg(feature = "model")]
        let traced = match param {
            Param::Model(_) => Some(param.kernel(self.qk_norm, has_narrow_rows(cfg), true)),
            _ => None,
        };
        // The most rows any block gets in any GEMV phase (over the phase's own blocks).
        let layer_rows = rows
            .iter()
            .filter_map(|r| Some(max_block_rows(program::gemv_rows(r)?, Blocks::of(r).count as usize)))
            .max()
            .unwrap_or(0);
        // A model's LM head streams its rows through the partials a chunk at a time: a block's whole
        // share where the shared memory holds it.
        let most_rows = partial_rows_room(dev);
        let head_rows = self.head_vocab.map(|vocab| vocab.div_ceil(grid as usize).min(most_rows).max(1));
        let qkv_rows = if self.qk_norm { qkv_head_rows(&rows, cfg.hd) } else { 0 };
        let red_rows = layer_rows.max(head_rows.unwrap_or(0)).max(qkv_rows);
        let smem = RING_BYTES + (red_rows as u32) * WARPS * 4;
        if smem as i32 > dev.facts().max_smem_optin_bytes {
            return Err(SubmissionError::Unsupported(format!(
                "the megakernel needs {smem} bytes of shared memory per block; this card allows {}",
                dev.facts().max_smem_optin_bytes
            )));
        }
        fit_one_block(&func, smem, "the megakernel")?;
        // The batch step chunks the head's rows to fit; its layer phases need a unit of rows of a block.
        #[cfg(feature = "model")]
        let batch = match self.model_kernels {
            Some(model) => Some(batch_kernel(dev, model, layer_rows.max(qkv_rows))?),
            None => None,
        };
        let plan = rows
            .iter()
            .map(|r| PhasePlan {
                op: program::Op::from_word(r[0]).and_then(program::Op::layer_op).expect("compile emits layer ops"),
                share: program::share(r, cfg),
                blocks: Blocks::of(r),
            })
            .collect();
        self.built = Some(Built {
            program: param,
            layout,
            phases: rows.len() as u32,
            layers: layers.len() as u32,
            in_place,
            d: cfg.d as u32,
            plan,
            func,
            #[cfg(feature = "model")]
            traced,
            grid,
            smem,
            red_rows: red_rows as u32,
            #[cfg(feature = "model")]
            heads: 0,
            // One more for a model's head phase (the kernel's HEAD_COUNTER).
            phase_done: s.alloc_zeros::<u32>(program::MAX_PHASES + 1).context("allocating the phase counters")?,
            cursor: StepCursor::default(),
            #[cfg(feature = "model")]
            act_stride: lane.stride as u64,
            #[cfg(feature = "model")]
            batch,
            _packed: packed,
            _rope: [cos, sin],
            _arena: arena,
        });
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
    use super::*;

    /// The megakernel's device code and the judge's kernels.
    const CU: &str = concat!(
        include_str!("../../kernels/megakernel/megakernel.cuh"),
        include_str!("../../kernels/megakernel/megakernel.cu")
    );
    // The attention's shared-memory layout, mirrored to check that every head size fits.
    const KS_PAD: usize = 8;
    const PS_PAD: usize = 4;
    const PB_PAD: usize = 8;
    /// Chunk buffers per attention team.
    const ATTN_BUFFERS: usize = 2;

    #[test]
    fn a_lanes_buffers_are_aligned_apart_and_within_its_stride() {
        for cfg in [Config::graded(), Config::small(), Config { n_kv: 1, hd: 48, ..Config::tiny() }] {
            let lane = LaneArena::of(&cfg);
            let partials = program::max_splits(&cfg) * cfg.n_kv * cfg.group();
            let mut spans = [
                (lane.q, 2 * cfg.q_dim()),
                (lane.a, 2 * cfg.q_dim()),
                (lane.x1, 2 * cfg.d),
                (lane.act, 2 * cfg.ffn),
                (lane.part_o, 4 * partials * cfg.hd),
                (lane.part_ml, 4 * partials * 2),
                (lane.counters, 4 * 2 * cfg.n_kv),
                (lane.x1_part, 4 * cfg.d),
                (lane.down_part, 4 * cfg.d),
            ];
            spans.sort();
            assert!(spans.iter().all(|&(at, _)| at.is_multiple_of(256)));
            assert!(spans.windows(2).all(|w| w[0].0 + w[0].1 <= w[1].0), "{spans:?} overlap");
            let (last, bytes) = spans[spans.len() - 1];
            assert!(last + bytes <= lane.stride && lane.stride.is_multiple_of(256));
            let b = lane.buffers(1 << 20, 7, 9);
            assert_eq!(
                (b.q, b.counters, b.cos, b.sin),
                ((1 << 20) + lane.q as u64, (1 << 20) + lane.counters as u64, 7, 9)
            );
        }
    }

    #[test]
    fn narrow_rows_are_those_that_run_in_slices() {
        let with = |d, nq, hd, ffn| Config { d, n_q: nq, hd, ffn, ..Config::graded() };
        // SmolLM2-360M, Llama-3.2-1B (d 2048, the widest rows in slices), Qwen3-0.6B.
        assert!(has_narrow_rows(&with(960, 15, 64, 2560)));
        assert!(has_narrow_rows(&with(2048, 32, 64, 8192)));
        assert!(has_narrow_rows(&with(1024, 16, 128, 3072)));
        // Llama-3.1-8B, Llama-3.2-3B (3072 wide), the graded layer: no row in slices.
        assert!(!has_narrow_rows(&with(4096, 32, 128, 14336)));
        assert!(!has_narrow_rows(&with(3072, 24, 128, 8192)));
        assert!(!has_narrow_rows(&Config::graded()));
    }

    #[test]
    fn constants_mirror_the_kernel() {
        for line in [
            format!("constexpr uint32_t THREADS = {THREADS};"),
            format!("constexpr uint32_t TRACE_STAMPS = {TRACE_STAMPS};"),
            format!("constexpr uint32_t STAGES = {};", RING_BYTES / (64 * 1024)),
            "constexpr uint32_t STAGE_BYTES = 64 * 1024;".to_string(),
            format!("constexpr uint32_t MAX_VPT = {};", program::MAX_ROW / (THREADS as usize * 8)),
            format!("constexpr uint32_t ATTN_MAX_HD = {ATTN_MAX_HD};"),
            format!("constexpr uint32_t ATTN_MAX_GROUP = {ATTN_MAX_GROUP};"),
            format!("constexpr uint32_t ATTN_MAX_CHUNK = {};", program::ATTN_MAX_CHUNK),
            format!("constexpr uint32_t ATTN_CHUNK_ELEMS = {} * 128;", program::ATTN_CHUNK_ELEMS / 128),
            format!("constexpr uint32_t ATTN_MAX_SPLITS = {};", program::ATTN_MAX_SPLITS),
            format!("constexpr uint32_t TEAMS = {};", program::ATTN_TEAMS),
            format!("constexpr uint32_t KS_PAD = {KS_PAD};"),
            format!("constexpr uint32_t PS_PAD = {PS_PAD};"),
            format!("constexpr uint32_t ATTN_BUFFERS = {ATTN_BUFFERS};"),
            format!("constexpr uint32_t PB_PAD = {PB_PAD};"),
            "return (2 * ATTN_BUFFERS * chunk + ATTN_MAX_GROUP) * (hd + KS_PAD) * 2 + ATTN_MAX_GROUP * (chunk + PS_PAD) * 4 + 3 * ATTN_MAX_GROUP * 4 +".to_string(),
            "ATTN_MAX_GROUP * (chunk + PB_PAD) * 2;".to_string(),
            format!("__global__ void {GATHER}("),
        ] {
            assert!(CU.contains(&line), "kernels/megakernel/ lacks `{line}`");
        }
    }

    #[test]
    fn a_step_runs_its_phases_in_order_from_phase_0() {
        let mut c = StepCursor::default();
        assert!(c.check(&(1..2)).is_err(), "a step cannot start past phase 0");
        c.check(&(0..2)).unwrap();
        c.advance(2, 8);
        assert_eq!(c, StepCursor { step: 0, next_phase: 2 });
        assert!(c.check(&(0..8)).is_err(), "nor restart before it has finished");
        assert!(c.check(&(3..8)).is_err(), "nor skip a phase");
        c.check(&(2..8)).unwrap();
        c.advance(8, 8);
        assert_eq!(c, StepCursor { step: 1, next_phase: 0 });
        c.advance(8, 8);
        assert_eq!(c.step, 2, "a whole step in one launch");
    }

    /// The kernel's `blocks_of` takes the fields where `Blocks::word` puts them.
    #[test]
    fn the_kernel_decodes_the_blocks_word_as_it_is_encoded() {
        assert!(CU.contains("return {(uint32_t)(w >> 32) & 0xFFFFu, (uint32_t)w, (uint32_t)(w >> 48) & 0x7FFFu};"));
        let w = Blocks { first: 1, count: 66, stride: 2 }.word() as u64;
        assert_eq!(((w >> 32) & 0xFFFF, w & 0xFFFF_FFFF, (w >> 48) & 0x7FFF), (1, 66, 2));
    }

    #[test]
    fn program_param_pads_with_noops_and_refuses_too_many_rows() {
        let mut row = [0i64; program::ROW_WORDS];
        row[0] = program::Op::Down as i64;
        row[program::ROW_WORDS - 1] = 7;
        let table = [9i64; program::LAYER_WORDS];
        let param = ProgramParam::<3>::new(&[row, row], &[table, table]).unwrap();
        assert_eq!(&param.rows[..2], &[row, row]);
        // The padding: no-ops that wait for nothing and that no block runs (a stride of 1, not 0, which
        // the kernel divides by); the tables, zero past the last.
        for pad in &param.rows[2..] {
            assert_eq!(pad[0], program::Op::Nop as i64);
            assert_eq!(Blocks::of(pad), Blocks { first: 0, count: 0, stride: 1 });
            assert_eq!(pad[program::WAITS_WORD], 0);
        }
        assert_eq!(param.tables, [table, table, [0; program::LAYER_WORDS]]);
        assert_eq!(
            size_of::<ProgramParam<3>>(),
            8 * (program::MAX_PHASES * program::ROW_WORDS + 3 * program::LAYER_WORDS)
        );
        assert!(ProgramParam::<1>::new(&vec![row; program::MAX_PHASES], &[]).is_some());
        assert!(ProgramParam::<1>::new(&vec![row; program::MAX_PHASES + 1], &[]).is_none());
        assert!(ProgramParam::<1>::new(&[row], &[table, table]).is_none());
    }

    /// Qwen3-0.6B's Qkv phase in whole heads (the kernel's block_rows with qkv_unit = hd): every row
    /// is some block's, each block's share is whole heads, and none is over what the partials hold.
    #[test]
    fn whole_heads_per_block_fit_the_partials_the_launcher_sizes() {
        let cfg =
            Config { d: 1024, ffn: 3072, n_q: 16, n_kv: 8, hd: 128, layers: 28, max_seq_len: 4096, ..Config::tiny() };
        let buffers = program::Buffers {
            q: 1,
            cos: 2,
            sin: 3,
            part_o: 4,
            part_ml: 5,
            counters: 6,
            a: 7,
            x1_part: 8,
            x1: 9,
            act: 10,
            down_part: 11,
        };
        for grid in [132u32, 16, 7] {
            let plan = check_fits(&cfg, grid, Forced::default()).unwrap();
            let rows = program::compile(&cfg, &buffers, grid, plan);
            let most = qkv_head_rows(&rows, cfg.hd);
            for r in rows.iter().filter(|r| r[0] == program::Op::Qkv as i64) {
                let (n, set) = (program::gemv_rows(r).unwrap(), Blocks::of(r));
                let units = n / cfg.hd;
                let mut covered = 0;
                for rank in 0..set.count as usize {
                    let (r0, r1) = (
                        cfg.hd * (units * rank / set.count as usize),
                        cfg.hd * (units * (rank + 1) / set.count as usize),
                    );
                    assert_eq!(r0, covered, "grid {grid}: rank {rank} starts where the one before ended");
                    assert!(r1 - r0 <= most && (r1 - r0) % cfg.hd == 0, "grid {grid}: rank {rank} takes {}", r1 - r0);
                    covered = r1;
                }
                assert_eq!(covered, n, "grid {grid}: every row");
            }
            assert_eq!(most, cfg.hd * (32usize).div_ceil(grid as usize), "grid {grid}");
        }
    }

    #[test]
    fn graded_config_fits_and_block_rows_cover_every_row() {
        check_fits(&Config::graded(), 132, Forced::default()).unwrap();
        assert_eq!(max_block_rows(8192, 132), 64);
        assert_eq!(max_block_rows(57344, 132), 436);
        let smem = RING_BYTES + 436 * WARPS * 4;
        assert!(smem <= 232_448, "{smem} bytes of shared memory");
    }

    /// Every member of the family fits: rows of any length the parts allow, head sizes 64 to 256, one
    /// to 16 query heads per KV head, contexts to 128k.
    #[test]
    fn every_family_member_fits() {
        for m in &spec::family::FAMILY {
            check_fits(&m.config(), 132, Forced::default()).unwrap_or_else(|e| panic!("{}: {e}", m.name));
        }
    }

    /// A config over one of the kernel's limits is declined as unsupported, naming the limit.
    #[test]
    fn configs_over_the_limits_are_unsupported_naming_the_limit() {
        let over = |change: fn(&mut Config), words: &[&str]| {
            let mut cfg = Config::graded();
            change(&mut cfg);
            match check_fits(&cfg, 132, Forced::default()) {
                Err(SubmissionError::Unsupported(why)) => {
                    assert!(words.iter().all(|w| why.contains(w)), "{why}");
                    why
                }
                other => panic!("{other:?}"),
            }
        };
        let why = over(|c| c.ffn = 86024, &["ffn = 86024", "86016", "3 parts of 28672"]);
        assert_eq!(
            SubmissionError::Unsupported(why).to_string(),
            "the submission does not support this config: ffn = 86024 is over the megakernel's 86016 (3 parts of 28672)"
        );
        over(|c| c.d = 32768, &["d = 32768", "28672"]);
        over(
            |c| {
                c.n_q = 512;
                c.n_kv = 32;
            },
            &["O projection", "= 32768", "28672"],
        );
        over(
            |c| {
                c.hd = 512;
                c.n_q = 16;
                c.n_kv = 4;
            },
            &["hd = 512", "256"],
        );
        over(|c| c.hd = 120, &["hd = 120", "multiple of 16"]);
        over(|c| c.n_kv = 2, &["32 query heads per KV head", "16"]);
        for fits in [
            Config { ffn: 86016, ..Config::graded() },
            Config { n_kv: 4, ..Config::graded() },
            Config { hd: 256, n_q: 32, n_kv: 8, ..Config::graded() },
            Config { n_kv: 64, ..Config::graded() },
            Config { max_seq_len: 131_200, ..Config::graded() },
        ] {
            check_fits(&fits, 132, Forced::default()).unwrap();
        }
    }

    /// A forced plan replaces the compiler's choice where the layer takes it, and is refused, saying
    /// why, where it does not.
    #[test]
    fn forced_plans_are_taken_where_they_fit_and_refused_naming_why() {
        let graded = Config::graded();
        let force = |roles, mlp_parts| Forced { roles, mlp_parts };
        assert_eq!(check_fits(&graded, 132, force(Some(1), Some(1))).unwrap(), Plan { roles: 1, mlp_parts: 1 });
        assert_eq!(check_fits(&graded, 132, force(None, Some(3))).unwrap(), Plan { roles: 2, mlp_parts: 3 });
        let refused = |cfg: &Config, forced: Forced, words: &[&str]| match check_fits(cfg, 132, forced) {
            Err(SubmissionError::Refused(why)) => assert!(words.iter().all(|w| why.contains(w)), "{why}"),
            other => panic!("{other:?}"),
        };
        refused(&Config::small(), force(Some(2), None), &["two roles", "n_kv = 1"]);
        refused(&graded, force(Some(3), None), &["3 roles"]);
        refused(&Config { ffn: 57344 + 8, ..graded.clone() }, force(None, Some(2)), &["2 part(s)", "3 to 3"]);
        refused(&graded, force(None, Some(4)), &["4 part(s)", "1 to 3"]);
        // One role puts every query head's columns in one O projection row: over MAX_ROW at n_q * hd = 32768.
        let wide = Config { n_q: 256, n_kv: 16, ..graded };
        check_fits(&wide, 132, Forced::default()).unwrap();
        assert!(matches!(check_fits(&wide, 132, force(Some(1), None)), Err(SubmissionError::Unsupported(_))));
    }

    /// A team's shared memory for attention chunks of `chunk` slots at head size `hd` (the kernel's
    /// `attn_smem_bytes`: K and V rows of each buffer and Q rows, padded; scores; running statistics;
    /// softmax weights).
    fn attention_smem_bytes(chunk: usize, hd: usize) -> usize {
        (2 * ATTN_BUFFERS * chunk + ATTN_MAX_GROUP) * (hd + KS_PAD) * 2
            + ATTN_MAX_GROUP * (chunk + PS_PAD) * 4
            + 3 * ATTN_MAX_GROUP * 4
            + ATTN_MAX_GROUP * (chunk + PB_PAD) * 2
    }

    /// The attention chunk keeps a team's shared memory within its share of the ring at every head size
    /// the kernel takes.
    #[test]
    fn the_attention_chunk_fits_a_teams_share_at_every_head_size() {
        for hd in (16..=ATTN_MAX_HD).step_by(16) {
            let chunk = program::chunk(&Config { hd, ..Config::graded() });
            assert!(chunk.is_multiple_of(16) && chunk >= 32, "hd {hd}: chunk {chunk}");
            assert!(attention_smem_bytes(chunk, hd) <= RING_BYTES as usize / program::ATTN_TEAMS, "hd {hd}");
        }
        assert_eq!(program::chunk(&Config::graded()), 64);
        assert_eq!(program::chunk(&Config { hd: 64, ..Config::graded() }), 128);
        assert_eq!(program::chunk(&Config { hd: 256, ..Config::graded() }), 32);
    }
}
