//! A stack compiled onto one GPU: each layer's weights packed (`pack`) or named in place, the RoPE
//! tables uploaded, the scratch the phases and layers share allocated, the program (`program`) and each
//! layer's address table compiled, and the shared memory a block needs sized for the kernel that runs it.
//! Both owners of a stack launch their own kernel over the same [`CompiledStack`]: the judge's submission
//! ([`crate::Megakernel`]: one layer or a stack, `kernels/megakernel/megakernel.cu`) and a model
//! (`model::GpuModel`: the stack with its LM head, `kernels/megakernel/model/model.cu`).

use cuda::cudarc::driver::sys::CUfunction_attribute;
use cuda::cudarc::driver::{CudaFunction, CudaSlice, DeviceRepr, LaunchConfig, PushKernelArg};
use cuda::kernels::Kernel;
use cuda::{Context, CudaError, Device};
use half::bf16;
use reference::golden::RopeTable;
use reference::gpu::DeviceWeights;
use spec::{Config, LayerOp, Tensor};
use submission::{Layer, SubmissionError, device_address};

use crate::kernels::{
    ATTN_MAX_GROUP, ATTN_MAX_HD, GATHER, GATHER_BLOCK, MAX_BATCH, MEGAKERNEL, RING_BYTES, THREADS, WARPS,
};
use crate::pack::{self, Packing};
use crate::program::{self, Blocks, Buffers, Forced, Plan, Split};

/// A phase of the compiled program as `grader profile` reports it: the layer's operation it computes,
/// the share of that operation's bytes it reads, and the blocks that run it.
#[derive(Debug, Clone, PartialEq)]
pub struct PhasePlan {
    pub op: LayerOp,
    pub share: f64,
    pub blocks: Blocks,
}

/// What a stack is compiled for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Target {
    /// The judge's kernels: one layer, or a stack of them.
    Layers,
    /// A model's kernel: room in the partials for `vocab` rows of its LM head, whole heads a block in
    /// Qkv where the layers have per-head q/k norms (`qk_norm`), and an arena of activation buffers for
    /// each lane of a batch step.
    Model { vocab: usize, qk_norm: bool },
}

/// How a stack is compiled, beside its layers and shape.
#[derive(Debug, Clone)]
pub struct StackOptions {
    pub target: Target,
    /// Parts of the plan in place of the compiler's choice (for studying plans: `grader profile --roles
    /// / --mlp-parts`); a plan the layer cannot take is refused, saying why.
    pub forced: Forced,
    /// Whether Qkv and GateUp stream in place from the layout handed over (`None`: only when packed
    /// copies do not fit).
    pub in_place: Option<bool>,
    /// RoPE's table when it is not the layer's own (a model's scaled frequencies).
    pub rope: Option<RopeTable>,
    /// Whether the program reduces across GPUs (`program::Split`; the judge's kernels take
    /// `Split::None`, and the split kernel `Split::Over(1)`, the split's own path on one GPU).
    pub split: Split,
}

impl StackOptions {
    /// The compiler's choices throughout, for `target`.
    pub fn new(target: Target) -> StackOptions {
        StackOptions { target, forced: Forced::default(), in_place: None, rope: None, split: Split::None }
    }
}

/// A stack compiled into the megakernel's program on one GPU, and everything its addresses name.
pub struct CompiledStack {
    /// One layer's phases, their layer's addresses named by reference to its table (`program::layer_ref`).
    pub rows: Vec<program::Row>,
    /// Each layer's address table.
    pub tables: Vec<[i64; program::LAYER_WORDS]>,
    pub layout: Plan,
    /// Whether Qkv and GateUp stream in place.
    pub in_place: bool,
    pub d: u32,
    pub plan: Vec<PhasePlan>,
    /// The kernel that runs the stack, its grid (one block per SM), and the dynamic shared memory of a
    /// block: the ring, then `red_rows` rows of partials.
    pub func: CudaFunction,
    pub grid: u32,
    pub smem: u32,
    pub red_rows: u32,
    /// The most rows a block takes in any layer phase for one lane (a batch step's partials hold them).
    pub lane_rows: usize,
    /// Bytes between the lanes' arenas of activation buffers (`LaneArena`).
    pub act_stride: u64,
    /// `(MAX_PHASES + 1)`: per phase, how many blocks have finished it, over all steps so far; the last
    /// counts a model's head phases.
    pub phase_done: CudaSlice<u32>,
    pub cursor: StepCursor,
    // Owned for the program's addresses to stay valid.
    _packed: Vec<CudaSlice<bf16>>,
    _rope: [CudaSlice<f32>; 2],
    _arena: CudaSlice<u8>,
}

impl CompiledStack {
    /// Compiles `layers` (each of shape `cfg`) for the kernel `name` of `file`, as `opts` says. Fails
    /// where the card is not Hopper; [`SubmissionError::Unsupported`] where the shape is over one of the
    /// kernel's limits or the packed copies do not fit; [`SubmissionError::Refused`] for a forced plan
    /// the layer cannot take, no layers, or a RoPE table that does not fit the caches.
    pub fn build(
        dev: &Device,
        layers: &[Layer<'_>],
        cfg: &Config,
        opts: &StackOptions,
        (file, name): (&'static Kernel, &'static str),
    ) -> Result<CompiledStack, SubmissionError> {
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
        let chosen = check_fits(cfg, grid, opts.forced)?;
        // Packed when the copies fit (one layer always is), else streamed in place; `in_place` forces
        // either.
        let shortfall = packing_shortfall(dev, cfg, chosen, layers.len())?;
        let in_place = opts.in_place.unwrap_or(layers.len() > 1 && shortfall.is_some());
        let layout = match (in_place, shortfall) {
            (true, _) => in_place_plan(cfg, grid, layers.len(), opts.forced)?,
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
        let rope = match &opts.rope {
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
        let lanes = match opts.target {
            Target::Layers => 1,
            Target::Model { .. } => MAX_BATCH,
        };
        let lane = LaneArena::of(cfg);
        let arena =
            s.alloc_zeros::<u8>(lanes * lane.stride).context("allocating the megakernel's activation buffers")?;
        let buffers = lane.buffers(device_address(dev, &arena), device_address(dev, &cos), device_address(dev, &sin));
        let rows = program::compile(cfg, &buffers, grid, layout, opts.split);
        if rows.len() > program::MAX_PHASES {
            return Err(SubmissionError::Unsupported(format!(
                "the layer compiled to {} phases; the kernel's program holds {}",
                rows.len(),
                program::MAX_PHASES
            )));
        }
        let tables: Vec<[i64; program::LAYER_WORDS]> = tables.iter().map(program::LayerBuffers::table).collect();
        // The most rows any block gets in any GEMV phase (over the phase's own blocks).
        let layer_rows = rows
            .iter()
            .filter_map(|r| Some(max_block_rows(program::gemv_rows(r)?, Blocks::of(r).count as usize)))
            .max()
            .unwrap_or(0);
        // A model's LM head streams its rows through the partials a chunk at a time: a block's whole
        // share where the shared memory holds it; and its Qkv rows come in whole heads where the layers
        // have q/k norms.
        let (head_rows, qkv_rows) = match opts.target {
            Target::Layers => (0, 0),
            Target::Model { vocab, qk_norm } => (
                vocab.div_ceil(grid as usize).min(partial_rows_room(dev)).max(1),
                if qk_norm { qkv_head_rows(&rows, cfg.hd) } else { 0 },
            ),
        };
        let red_rows = layer_rows.max(head_rows).max(qkv_rows);
        let smem = RING_BYTES + (red_rows as u32) * WARPS * 4;
        if smem as i32 > dev.facts().max_smem_optin_bytes {
            return Err(SubmissionError::Unsupported(format!(
                "the megakernel needs {smem} bytes of shared memory per block; this card allows {}",
                dev.facts().max_smem_optin_bytes
            )));
        }
        let func = dev.function(file, name)?;
        fit_one_block(&func, smem, "the megakernel")?;
        let plan = rows
            .iter()
            .map(|r| PhasePlan {
                op: program::layer_op_of(r).expect("compile emits the layer's ops and their Reduce rows"),
                share: program::share(r, cfg),
                blocks: Blocks::of(r),
            })
            .collect();
        Ok(CompiledStack {
            rows,
            tables,
            layout,
            in_place,
            d: cfg.d as u32,
            plan,
            func,
            grid,
            smem,
            red_rows: red_rows as u32,
            lane_rows: layer_rows.max(qkv_rows),
            act_stride: lane.stride as u64,
            // One more for a model's head phase (the kernel's HEAD_COUNTER).
            phase_done: s.alloc_zeros::<u32>(program::MAX_PHASES + 1).context("allocating the phase counters")?,
            cursor: StepCursor::default(),
            _packed: packed,
            _rope: [cos, sin],
            _arena: arena,
        })
    }

    /// Rows of the program: one layer's phases.
    pub fn phases(&self) -> u32 {
        self.rows.len() as u32
    }

    /// What a trace of this program needs of its rows: each row's operation and waits word
    /// (`Trace::plan`, `Trace::waits`).
    pub fn traced_rows(&self) -> (Vec<LayerOp>, Vec<u64>) {
        (self.plan.iter().map(|p| p.op).collect(), self.rows.iter().map(|r| r[program::WAITS_WORD] as u64).collect())
    }

    /// Layers of the stack: one address table each.
    pub fn layers(&self) -> u32 {
        self.tables.len() as u32
    }

    /// The launch's shape for `smem` bytes of dynamic shared memory a block.
    pub fn launch_config(&self, smem: u32) -> LaunchConfig {
        LaunchConfig { grid_dim: (self.grid, 1, 1), block_dim: (THREADS, 1, 1), shared_mem_bytes: smem }
    }

    /// The compiled plan in words: the grid, the roles, the MLP's parts and how attention splits its
    /// work at position `pos`.
    pub fn describe(&self, cfg: &Config, pos: usize) -> String {
        format!(
            "{} blocks x {THREADS} threads, {} bytes of shared memory; {}",
            self.grid,
            self.smem,
            program::describe(cfg, self.layout, &self.rows, pos)
        )
    }
}

/// Where the launches stand in the steps. A step's phases run in order from phase 0: a phase waits
/// until every block of each phase it depends on has counted itself done this step (`phase_done`,
/// monotonic: blocks * steps), so a phase launched out of order would wait forever.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct StepCursor {
    /// Steps whose last phase has been launched.
    pub step: u32,
    /// The phase the next launch must start at.
    next_phase: u32,
}

impl StepCursor {
    /// Refuses a launch of `range` that does not continue the step.
    pub fn check(&self, range: &std::ops::Range<u32>) -> Result<(), SubmissionError> {
        if range.start == self.next_phase {
            return Ok(());
        }
        Err(SubmissionError::Refused(format!(
            "phases {range:?}: the step's next phase is {} (a step's phases run in order from 0)",
            self.next_phase
        )))
    }

    /// After a launch of phases up to `end` of a program of `phases`.
    pub fn advance(&mut self, end: u32, phases: u32) {
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
pub struct ProgramParam<const L: usize> {
    rows: [program::Row; program::MAX_PHASES],
    tables: [[i64; program::LAYER_WORDS]; L],
}

// SAFETY: plain old data of the layout `struct Program<L>` declares (int64 words, no padding).
unsafe impl<const L: usize> DeviceRepr for ProgramParam<L> {}

impl<const L: usize> ProgramParam<L> {
    /// The rows, then no-op rows (opcode 0) that no block runs, up to `MAX_PHASES`, then the tables
    /// (zero past the last); `None` when there are more rows or tables than it holds.
    pub fn new(rows: &[program::Row], tables: &[[i64; program::LAYER_WORDS]]) -> Option<Box<Self>> {
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

/// Static shared memory the kernels declare beside the dynamic (the ring's barriers, the row source,
/// the reductions' scratch), rounded up: the LM head's partials take what is left.
const STATIC_SMEM_ALLOWANCE: usize = 1024;

/// Rows of partials (WARPS f32 each) the shared memory holds beside the ring and the static variables.
pub(crate) fn partial_rows_room(dev: &Device) -> usize {
    rows_beside(dev, STATIC_SMEM_ALLOWANCE)
}

/// Rows of partials the shared memory holds beside the ring and `static_bytes` of static variables.
pub(crate) fn rows_beside(dev: &Device, static_bytes: usize) -> usize {
    (dev.facts().max_smem_optin_bytes.max(0) as usize).saturating_sub(RING_BYTES as usize + static_bytes)
        / (WARPS as usize * 4)
}

/// Raises `func`'s dynamic shared memory to `smem` bytes and checks that a block of it fits an SM
/// (`what` names the kernel in the errors).
pub(crate) fn fit_one_block(func: &CudaFunction, smem: u32, what: &str) -> Result<(), SubmissionError> {
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

#[cfg(test)]
mod tests {
    use super::*;

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
        let buffers = program::test_buffers();
        for grid in [132u32, 16, 7] {
            let plan = check_fits(&cfg, grid, Forced::default()).unwrap();
            let rows = program::compile(&cfg, &buffers, grid, plan, Split::None);
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
}
