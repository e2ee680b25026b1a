//! A model on the GPU, in one kernel. The checkpoint's weights are uploaded once and its stack compiled
//! into the megakernel's program; the model kernel (`megakernel_model_bf16`, or its instance for narrow
//! rows or for layers with q/k norms: `model_kernel`) then runs every position of a decode step or of
//! a whole generation in one launch: the token's embedding row into the first layer, every layer, the
//! final norm, the LM head (f32 logits) and the greedy token, chosen in the kernel with the CPU model's
//! tie rule (`cpu::argmax`).

use std::time::{Duration, Instant};

use cuda::cudarc::driver::{CudaFunction, CudaSlice, DeviceRepr, PushKernelArg};
use cuda::kernels::Kernel;
use cuda::{Context, CudaError, Device};
use half::bf16;
use reference::gpu::{DeviceCache, DeviceWeights};
use spec::Config;
use spec::bytes::ByteModel;
use submission::{Layer, SubmissionError, device_address};

use super::code_stream::{self, CodedLayer, Format};
use super::hf::{ModelConfig, ModelWeights};
use super::request::{Lane, Limits, MAX_EOS, Stop};
use super::together::generate_together;
use crate::kernels::model::{
    MODEL, MODEL_BATCH, MODEL_FP8, MODEL_FP8_BATCH, MODEL_FP8_TRACED, MODEL_NF4, MODEL_NF4_BATCH,
};
use crate::kernels::{RING_BYTES, TRACE_STAMPS, WARPS, has_narrow_rows};
use crate::program;
use crate::stack::{CompiledStack, ProgramParam, StackOptions, Target, fit_one_block, rows_beside};
use crate::trace::Trace;

/// Lanes of a batch step at most (the kernel's `MAX_BATCH`).
pub const MAX_BATCH: usize = crate::MAX_BATCH;

/// The model kernel's own arguments, laid out as `struct ModelArgs` in `kernels/megakernel/op_head.cuh`.
#[derive(Clone, Copy)]
#[repr(C)]
struct ModelArgs {
    embed: u64,
    final_norm: u64,
    head: u64,
    logits: u64,
    candidates: u64,
    tokens: u64,
    done: u64,
    vocab: u32,
    pos0: u32,
    prompt_end: u32,
    max_new: u32,
    max_seq: u32,
    heads_before: u32,
    eps_bits: u32,
    eos_count: u32,
    eos: [u32; MAX_EOS],
    qk_norms: [u64; program::MAX_STACK_LAYERS],
}

/// `sizeof(ModelArgs)` in the kernel (its `MODEL_ARGS_BYTES`).
const MODEL_ARGS_BYTES: usize = 7 * 8 + 12 * 4 + program::MAX_STACK_LAYERS * 8;
const _: () = assert!(std::mem::size_of::<ModelArgs>() == MODEL_ARGS_BYTES);

// SAFETY: plain old data of the layout `struct ModelArgs` declares (u64 words, then u32 words; no
// padding, checked by the size above).
unsafe impl DeviceRepr for ModelArgs {}

/// A batch step's own arguments, laid out as `struct BatchArgs` in `kernels/megakernel/vm_batch.cuh`.
#[derive(Clone, Copy)]
#[repr(C)]
struct BatchArgs {
    act_stride: i64,
    cache_stride: i64,
    next: u64,
    lanes: u32,
    token: [u32; MAX_BATCH],
    pos: [u32; MAX_BATCH],
    seq: [u32; MAX_BATCH],
    _pad: u32,
}

/// `sizeof(BatchArgs)` in the kernel (its `BATCH_ARGS_BYTES`).
const BATCH_ARGS_BYTES: usize = 3 * 8 + 4 + 3 * MAX_BATCH * 4 + 4;
const _: () = assert!(std::mem::size_of::<BatchArgs>() == BATCH_ARGS_BYTES);

// SAFETY: plain old data of the layout `struct BatchArgs` declares (three 8-byte words, then u32 words,
// the last padding made explicit; checked by the size above).
unsafe impl DeviceRepr for BatchArgs {}

/// Why `lanes` cannot be one batch step of a model of `sequences` sequences, `context` positions and
/// `vocab` tokens; `None` when they can. Lanes of one sequence must hold consecutive positions in lane
/// order (a lane's attention reads what the lanes before it wrote).
pub fn batch_refusal(lanes: &[Lane], sequences: usize, context: usize, vocab: usize) -> Option<String> {
    if lanes.is_empty() || lanes.len() > MAX_BATCH {
        return Some(format!("a batch step of {} lanes: 1 to {MAX_BATCH}", lanes.len()));
    }
    for (i, l) in lanes.iter().enumerate() {
        if l.seq >= sequences {
            return Some(format!("lane {i}'s sequence {} is past the model's {sequences}", l.seq));
        }
        if l.pos >= context {
            return Some(format!("lane {i}'s position {} is past the caches' {context}", l.pos));
        }
        if l.token as usize >= vocab {
            return Some(format!("lane {i}'s token {} is outside the vocabulary of {vocab}", l.token));
        }
        if let Some((j, before)) = lanes[..i].iter().enumerate().rev().find(|(_, b)| b.seq == l.seq)
            && before.pos + 1 != l.pos
        {
            return Some(format!(
                "lanes of sequence {} must hold consecutive positions in lane order: lane {j} has {}, lane {i} {}",
                l.seq, before.pos, l.pos
            ));
        }
    }
    None
}

/// The batch step's kernel (`megakernel_model_batch_bf16`, or a coded decode's `_fp8` or `_nf4`): its row
/// partials take all the shared memory the ring (and a code stream's tail: its scale slots, nf4's
/// codebook) leaves, so that a group of lanes fits as many rows as it can.
struct BatchKernel {
    func: CudaFunction,
    smem: u32,
    red_rows: u32,
}

/// The batch step's kernel `name` of `file`, its partials all the room the ring and `slots` bytes at the
/// end of its shared memory (a code stream's tail, or none) leave (at least the `red_rows` a
/// block of any layer phase needs for one lane).
fn batch_kernel(
    dev: &Device,
    file: &Kernel,
    name: &str,
    red_rows: usize,
    slots: usize,
) -> Result<BatchKernel, SubmissionError> {
    let func = dev.function(file, name)?;
    let static_bytes = func.shared_size_bytes().context("reading the batch step's static shared memory")?;
    let rows = rows_beside(dev, static_bytes.max(0) as usize + slots);
    if rows < red_rows {
        return Err(SubmissionError::Unsupported(format!(
            "the batch step's partials hold {rows} rows beside its ring; a phase's block needs {red_rows}"
        )));
    }
    let smem = RING_BYTES + rows as u32 * WARPS * 4 + slots as u32;
    fit_one_block(&func, smem, "the batch step")?;
    Ok(BatchKernel { func, smem, red_rows: rows as u32 })
}

/// The model kernel that runs a stack of layers with per-head q/k norms (`qk_norm`), or with rows of
/// at most SLICED_MAX_COLS columns (`narrow`: they stream in full stages as groups of one), or neither;
/// each instance is the machine code measured for its models. `traced`: its twin in which every block
/// stamps its phases (`GpuModel::trace`).
fn model_kernel(qk_norm: bool, narrow: bool, traced: bool) -> &'static str {
    match (traced, qk_norm, narrow) {
        (false, true, _) => "megakernel_model_qk_norm_bf16",
        (false, false, true) => "megakernel_model_sliced_bf16",
        (false, false, false) => "megakernel_model_bf16",
        (true, true, _) => "megakernel_model_qk_norm_traced_bf16",
        (true, false, true) => "megakernel_model_sliced_traced_bf16",
        (true, false, false) => "megakernel_model_traced_bf16",
    }
}

/// The model kernel's instance that streams a quantised checkpoint's wide rows as codes of `format`
/// (`kernels/megakernel/model/model_fp8.cu`, `model_nf4.cu`): for layers with rows narrow enough for
/// slices (`narrow`) or without. `traced`: its twin (`model_fp8_traced.cu`; nf4's have none: None).
fn coded_kernel(format: Format, narrow: bool, traced: bool) -> Option<&'static str> {
    Some(match (format, traced, narrow) {
        (Format::Fp8, false, true) => "megakernel_model_sliced_fp8",
        (Format::Fp8, false, false) => "megakernel_model_fp8",
        (Format::Fp8, true, true) => "megakernel_model_sliced_traced_fp8",
        (Format::Fp8, true, false) => "megakernel_model_traced_fp8",
        (Format::Nf4, false, true) => "megakernel_model_sliced_nf4",
        (Format::Nf4, false, false) => "megakernel_model_nf4",
        (Format::Nf4, true, _) => return None,
    })
}

/// The bf16 batch step's kernel, model_batch.cu's (its own file: its ring keeps one stage in flight).
const BF16_BATCH: &str = "megakernel_model_batch_bf16";

/// The kernel file of `format`'s decode instances, and of its batch step with that kernel's name.
fn coded_files(format: Format) -> (&'static Kernel, &'static Kernel, &'static str) {
    match format {
        Format::Fp8 => (&MODEL_FP8, &MODEL_FP8_BATCH, "megakernel_model_batch_fp8"),
        Format::Nf4 => (&MODEL_NF4, &MODEL_NF4_BATCH, "megakernel_model_batch_nf4"),
    }
}

/// What a model's decode steps stream its quantised GEMVs as.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WeightStream {
    /// As the checkpoint stores them where the kernel can (a quantised checkpoint's wide rows as codes,
    /// `code_stream`), else bf16.
    AsStored,
    /// bf16 throughout (a quantised checkpoint's weights as the loader dequantised them), for comparing
    /// the two streams: outputs that part from the codes' fused products by the weights' rounding to bf16.
    Bf16,
}

/// The decode step of a quantised checkpoint that streams its codes (`code_stream`): the format's
/// instance of the model kernel, its program (the bf16 program's rows and tables with the coded
/// matrices in), and those matrices.
struct CodedDecode {
    format: Format,
    func: CudaFunction,
    /// Its shared memory: the ring, `red_rows` rows of partials and the format's tail
    /// (`Format::tail_bytes`), which the instance keeps at the end; the stack's own where its partials
    /// leave the tail room for a layer's rows.
    smem: u32,
    red_rows: u32,
    program: Box<ProgramParam<{ program::MAX_STACK_LAYERS }>>,
    /// Bytes a decode step streams less than the bf16 stream, over every layer.
    saved: u64,
    /// GEMV matrices a layer streams as codes.
    matrices: usize,
    /// The batch step streaming the same codes (its lanes the bits of their decode steps).
    batch: BatchKernel,
    _packed: Vec<CudaSlice<u8>>,
}

impl CodedDecode {
    /// The coded decode of `stack` (compiled for `cfg`'s layers of shape `layer`) from the checkpoint's
    /// `coded` layers: `Ok(Err(why))` where it cannot be (`code_stream::stream_format`, or a weight `pack`
    /// does not take), and the model then streams bf16.
    fn build(
        dev: &Device,
        cfg: &ModelConfig,
        layer: &Config,
        stack: &CompiledStack,
        coded: &[CodedLayer],
        progress: &mut dyn FnMut(&str),
    ) -> Result<Result<CodedDecode, String>, GpuModelError> {
        let format = match code_stream::stream_format(layer, stack.layout, coded, cfg.qk_norm, stack.in_place) {
            Ok(format) => format,
            Err(why) => return Ok(Err(why)),
        };
        let (mut tables, mut packed, mut saved, mut matrices) = (Vec::new(), Vec::new(), 0, 0);
        // Packing a layer is one core's work (tile_pairs' reordering: 0.5-0.7 s a layer of Llama-3.1-8B's
        // shape, 16-22 s of every load of its 32): the layers are packed a thread each, as many at a time
        // as the machine has cores (bounding the packed bytes held at once), and uploaded in order.
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
        for (batch, at) in coded.chunks(threads).zip((0..).step_by(threads)) {
            let last = at + batch.len();
            progress(&format!("packing layers {} to {last} of {}'s {} codes", at + 1, coded.len(), format.name()));
            let packings: Vec<_> = std::thread::scope(|scope| {
                let each = batch.iter().map(|coded_layer| {
                    scope.spawn(|| code_stream::layer_matrices(format, layer, stack.layout, coded_layer))
                });
                each.collect::<Vec<_>>()
                    .into_iter()
                    .map(|h| h.join().unwrap_or_else(|e| std::panic::resume_unwind(e)))
                    .collect()
            });
            for (l, (m, bf16_table)) in (at..).zip(packings.into_iter().zip(&stack.tables[at..last])) {
                let m = match m {
                    Ok(m) => m,
                    Err(why) => return Ok(Err(format!("layer {l}: {why}"))),
                };
                let mut placed = Vec::new();
                for (slot, bytes) in &m.matrices {
                    let what = format!("uploading layer {l}'s {} {slot:?}", format.name());
                    let up = dev.stream().clone_htod(bytes).context(what)?;
                    placed.push((*slot, device_address(dev, &up)));
                    packed.push(up);
                }
                tables.push(code_stream::table(*bf16_table, &placed));
                (saved, matrices) = (saved + m.saved, m.matrices.len());
            }
        }
        // A block of a phase in pair tiles may take more rows than the bf16 program's (whole tiles).
        let rows = code_stream::decode_rows(format, layer, stack.layout, &stack.rows);
        let lane_rows = stack.lane_rows.max(code_stream::pair_block_rows(format, has_narrow_rows(layer), &rows));
        // The stack's shared memory where its partials leave the tail room for a layer's rows (the LM head
        // streams through fewer a chunk at a time); else more, where the card has it.
        let tail_rows = (format.tail_bytes() / (WARPS as usize * 4)) as u32;
        let red_rows = stack.red_rows.saturating_sub(tail_rows).max(lane_rows as u32);
        let smem = RING_BYTES + (red_rows + tail_rows) * WARPS * 4;
        let program = ProgramParam::new(&rows, &tables).expect("the bf16 program's rows and tables fit");
        let (decode_file, batch_file, batch_name) = coded_files(format);
        let name = coded_kernel(format, has_narrow_rows(layer), false).expect("every format has a timed instance");
        let func = dev.function(decode_file, name)?;
        match fit_one_block(&func, smem, "the coded model kernel") {
            Ok(()) => {}
            Err(SubmissionError::Unsupported(why)) => return Ok(Err(why)),
            Err(e) => return Err(e.into()),
        }
        // Where its partials would not fit beside the tail, the model streams bf16 and says why.
        let batch = match batch_kernel(dev, batch_file, batch_name, lane_rows, format.tail_bytes()) {
            Ok(batch) => batch,
            Err(SubmissionError::Unsupported(why)) => return Ok(Err(why)),
            Err(e) => return Err(e.into()),
        };
        Ok(Ok(CodedDecode { format, func, smem, red_rows, program, saved, matrices, batch, _packed: packed }))
    }
}

/// Which instance of the model kernel a launch runs.
enum Instance<'a> {
    /// The timed one: the coded instance where the decode steps stream codes and the stream allows, else
    /// the bf16 one.
    Timed(WeightStream),
    /// The traced twin (of the coded instance where the decode steps stream codes and the format has
    /// one: `coded`), stamping into room for every position the launch may run, zeroed.
    Traced { func: &'a CudaFunction, stamps: &'a mut CudaSlice<u64>, coded: bool },
}

#[derive(Debug, thiserror::Error)]
pub enum GpuModelError {
    #[error(transparent)]
    Cuda(#[from] CudaError),
    #[error("the megakernel: {0}")]
    Megakernel(#[from] SubmissionError),
    #[error("{0}")]
    Refused(String),
}

impl From<String> for GpuModelError {
    fn from(why: String) -> Self {
        GpuModelError::Refused(why)
    }
}

/// What one launch generated.
#[derive(Debug, Clone)]
pub struct Generation {
    /// The generated tokens, in order (an end-of-sequence token included).
    pub tokens: Vec<u32>,
    pub stop: Stop,
    /// Positions the launch ran: the prompt's and every generated token's but the last.
    pub positions: usize,
    /// From the launch to its results on the host.
    pub elapsed: Duration,
    /// The kernel alone, by events around its launch.
    pub kernel_ms: f32,
}

/// A model's weights, caches and compiled stack on the GPU.
pub struct GpuModel {
    cfg: ModelConfig,
    /// The layer's shape with the caches' depth.
    layer: Config,
    /// The compiled stack, its program as the model kernel takes it (by value, with every layer's
    /// table), the batch step's kernel, and the head phases run so far (the kernel's head counter is
    /// `grid * heads`).
    stack: CompiledStack,
    program: Box<ProgramParam<{ program::MAX_STACK_LAYERS }>>,
    /// A quantised checkpoint's decode steps, where they stream codes; else why not (for the summary).
    coded: Result<CodedDecode, String>,
    batch: BatchKernel,
    heads: u32,
    embed: CudaSlice<bf16>,
    norm: CudaSlice<bf16>,
    head: Option<CudaSlice<bf16>>,
    /// Sequences with their own caches, for batch steps (sequence 0's are the decode's).
    sequences: usize,
    /// `(MAX_BATCH, vocab)`: a decode's logits, or each lane's of a batch step.
    logits: CudaSlice<f32>,
    /// `(MAX_BATCH, grid)`: each block's best row, per lane.
    candidates: CudaSlice<u64>,
    tokens: CudaSlice<i32>,
    done: CudaSlice<u32>,
    /// `(MAX_BATCH)`: each lane's greedy token after a batch step.
    next: CudaSlice<i32>,
    /// `(MAX_BATCH, d)` and `(MAX_BATCH, layers - 1, d)`: each lane's last layer's output and hidden
    /// states.
    out: CudaSlice<bf16>,
    hidden: Option<CudaSlice<bf16>>,
    /// Qwen3: each layer's q and k norm weights, one after the other (`hd` each); empty without them.
    qk_norms: Vec<CudaSlice<bf16>>,
    // Owned for the compiled program's addresses to stay valid (the caches also for `reset`).
    _weights: Vec<DeviceWeights>,
    caches: Vec<DeviceCache>,
}

impl GpuModel {
    /// Uploads the model with caches of `context` positions (at most the model's own) for `sequences`
    /// sequences (1 to [`MAX_BATCH`]: a batch step's) and compiles its stack, its decode steps streaming
    /// as `stream` says; `progress` hears what it is doing.
    pub fn new(
        dev: &Device,
        cfg: &ModelConfig,
        weights: &ModelWeights,
        context: usize,
        sequences: usize,
        stream: WeightStream,
        progress: &mut dyn FnMut(&str),
    ) -> Result<GpuModel, GpuModelError> {
        let layer = Config { max_seq_len: context.min(cfg.layer.max_seq_len), ..cfg.layer.clone() };
        if layer.max_seq_len == 0 {
            return Err(GpuModelError::Refused("a context of 0 positions".into()));
        }
        if sequences == 0 || sequences > MAX_BATCH {
            return Err(GpuModelError::Refused(format!("{sequences} sequences: 1 to {MAX_BATCH}")));
        }
        let s = dev.stream();
        let up = |v: &[bf16], what: &str| s.clone_htod(v).context(format!("uploading {what}"));
        let mut layers = Vec::with_capacity(weights.layers.len());
        for (l, w) in weights.layers.iter().enumerate() {
            progress(&format!("uploading layer {} of {}", l + 1, weights.layers.len()));
            layers.push(DeviceWeights::try_from_fn(|t| up(w.get(t), &format!("layer {l}'s {t:?}")))?);
        }
        // Each layer's caches of every sequence in one piece, sequence 0's first (the program's).
        let cache =
            |what: &str| s.alloc_zeros::<bf16>(sequences * layer.cache_elems()).context(format!("allocating {what}"));
        let mut caches = (0..layers.len())
            .map(|_| Ok(DeviceCache { k: cache("a K cache")?, v: cache("a V cache")? }))
            .collect::<Result<Vec<_>, CudaError>>()?;
        let embed = up(&weights.embed, "the embedding")?;
        let norm = up(&weights.norm, "the final norm")?;
        let head = weights.lm_head.as_deref().map(|h| up(h, "the LM head")).transpose()?;
        let qk_norms = weights
            .qk_norms
            .iter()
            .enumerate()
            .map(|(l, [q, k])| up(&[q.as_slice(), k.as_slice()].concat(), &format!("layer {l}'s q and k norms")))
            .collect::<Result<Vec<_>, _>>()?;
        progress("compiling the stack into the megakernel's program");
        let opts = StackOptions {
            rope: Some(cfg.rope_table(layer.max_seq_len)),
            ..StackOptions::new(Target::Model { vocab: cfg.vocab, qk_norm: cfg.qk_norm })
        };
        let kernel = model_kernel(cfg.qk_norm, has_narrow_rows(&layer), false);
        let stack = CompiledStack::build(dev, &Layer::stack(&layers, &mut caches), &layer, &opts, (&MODEL, kernel))?;
        // The model kernel always reads the layers' tables.
        let program =
            ProgramParam::new(&stack.rows, &stack.tables).expect("rows and tables within the parameter block");
        let batch = batch_kernel(dev, &MODEL_BATCH, BF16_BATCH, stack.lane_rows, 0)?;
        let coded = match stream {
            WeightStream::AsStored => CodedDecode::build(dev, cfg, &layer, &stack, &weights.coded, progress)?,
            WeightStream::Bf16 => Err("bf16 asked for".into()),
        };
        let grid = stack.grid as usize;
        let row = |n: usize, what: &str| s.alloc_zeros::<bf16>(n).context(format!("allocating {what}"));
        Ok(GpuModel {
            sequences,
            logits: s.alloc_zeros::<f32>(MAX_BATCH * cfg.vocab).context("allocating the logits")?,
            candidates: s.alloc_zeros::<u64>(MAX_BATCH * grid).context("allocating the head's candidates")?,
            tokens: s.alloc_zeros::<i32>(layer.max_seq_len + 1).context("allocating the tokens")?,
            done: s.alloc_zeros::<u32>(2).context("allocating the launch's counts")?,
            next: s.alloc_zeros::<i32>(MAX_BATCH).context("allocating the batch's tokens")?,
            out: row(MAX_BATCH * layer.d, "the last layer's output")?,
            hidden: (layers.len() > 1)
                .then(|| row(MAX_BATCH * (layers.len() - 1) * layer.d, "the hidden states"))
                .transpose()?,
            qk_norms,
            cfg: cfg.clone(),
            layer,
            stack,
            program,
            coded,
            batch,
            heads: 0,
            embed,
            norm,
            head,
            _weights: layers,
            caches,
        })
    }

    /// The caches' depth in positions.
    pub fn context(&self) -> usize {
        self.layer.max_seq_len
    }

    /// The compiled plan in words.
    pub fn describe(&self) -> String {
        self.stack.describe(&self.layer, 0)
    }

    /// What the decode steps stream a quantised checkpoint's weights as, in words (None for a bf16,
    /// f16 or f32 checkpoint).
    pub fn streams(&self) -> Option<String> {
        let q = self.cfg.quantized?;
        Some(match &self.coded {
            Ok(f) => format!(
                "{}: decode steps stream the rows wider than {} columns{} as {} codes, a scale a row per {} columns \
                 ({} GEMV matrices a layer), the rest bf16; {:.2} GB a token at position 0 against bf16's {:.2}, \
                 which a floor counts; batch steps stream the same codes",
                q.name(),
                crate::kernels::SLICED_MAX_COLS,
                if f.format == Format::Nf4 && has_narrow_rows(&self.layer) {
                    " and those of 2048 in whole tiles of 16 rows"
                } else {
                    ""
                },
                match f.format {
                    Format::Fp8 => "e4m3",
                    Format::Nf4 => "nf4",
                },
                f.format.scale_cols(),
                f.matrices,
                self.bytes_at(0) as f64 / 1e9,
                (self.bytes_at(0) + f.saved) as f64 / 1e9
            ),
            Err(why) => {
                format!("{} read into bf16 and streamed as bf16 ({why}), so a floor counts bf16's bytes", q.name())
            }
        })
    }

    /// The logits after `token` at position `pos` (its K and V appended to every layer's cache at
    /// `pos`), in one launch, as `CpuModel::decode_step` computes them.
    pub fn decode_step(&mut self, dev: &Device, token: u32, pos: usize) -> Result<Vec<f32>, GpuModelError> {
        self.step(dev, token, pos)?;
        self.last_logits(dev)
    }

    /// `decode_step` leaving its logits on the GPU (`last_logits`, `last_logits_on_device`).
    pub fn step(&mut self, dev: &Device, token: u32, pos: usize) -> Result<(), GpuModelError> {
        self.limits().step(token, pos)?;
        self.launch(dev, pos, &[token], 1, &[], Instance::Timed(WeightStream::AsStored))?;
        Ok(())
    }

    /// Whether the decode steps stream a quantised checkpoint's codes (`code_stream`).
    pub fn streams_codes(&self) -> bool {
        self.coded.is_ok()
    }

    /// Whether a trace runs the instance that streams the codes (nf4's decode instances have no traced
    /// twin: a trace of an nf4 checkpoint runs its bf16 stream).
    pub fn traces_codes(&self) -> bool {
        self.coded.as_ref().is_ok_and(|c| coded_kernel(c.format, false, true).is_some())
    }

    /// `decode_step` through the bf16 stream of the loader's weights, where the decode steps stream
    /// codes: logits that part from theirs by the weights' rounding to bf16 alone (`megakernel check`
    /// bounds it).
    pub fn decode_step_bf16(&mut self, dev: &Device, token: u32, pos: usize) -> Result<Vec<f32>, GpuModelError> {
        self.limits().step(token, pos)?;
        self.launch(dev, pos, &[token], 1, &[], Instance::Timed(WeightStream::Bf16))?;
        self.last_logits(dev)
    }

    /// The logits of the last position the last launch decoded.
    pub fn last_logits(&self, dev: &Device) -> Result<Vec<f32>, GpuModelError> {
        Ok(dev.stream().clone_dtoh(&self.logits.slice(..self.cfg.vocab)).context("reading the logits")?)
    }

    /// `last_logits` as a buffer of their own on the GPU (the next launch overwrites the model's),
    /// complete when this returns.
    pub fn last_logits_on_device(&self, dev: &Device) -> Result<CudaSlice<f32>, GpuModelError> {
        let s = dev.stream();
        let copy = s.clone_dtod(&self.logits.slice(..self.cfg.vocab)).context("copying the logits")?;
        s.synchronize().context("copying the logits")?;
        Ok(copy)
    }

    /// Forgets every sequence: the caches and the logits zeroed, as a new model's are.
    pub fn reset(&mut self, dev: &Device) -> Result<(), GpuModelError> {
        let s = dev.stream();
        for cache in &mut self.caches {
            s.memset_zeros(&mut cache.k).context("zeroing a K cache")?;
            s.memset_zeros(&mut cache.v).context("zeroing a V cache")?;
        }
        s.memset_zeros(&mut self.logits).context("zeroing the logits")?;
        s.synchronize().context("zeroing the caches")?;
        Ok(())
    }

    /// The vocabulary's size.
    pub fn vocab(&self) -> usize {
        self.cfg.vocab
    }

    /// Sequences with their own caches (batch steps' `Lane::seq`).
    pub fn sequences(&self) -> usize {
        self.sequences
    }

    /// One step of every lane in one launch (a batch's sequences, or a prompt's chunk, or both), each
    /// lane's logits and greedy token bitwise those of its own decode step (`decode_step` at the lane's
    /// position, over the same sequence's earlier tokens), the weights streamed once per group of
    /// lanes. Returns the kernel's time in ms; `batch_logits` and `batch_next` read the results.
    pub fn decode_batch(&mut self, dev: &Device, lanes: &[Lane]) -> Result<f32, GpuModelError> {
        if let Some(why) = batch_refusal(lanes, self.sequences, self.context(), self.cfg.vocab) {
            return Err(GpuModelError::Refused(why));
        }
        let mut batch = BatchArgs {
            act_stride: 0,
            cache_stride: (self.layer.cache_elems() * 2) as i64,
            next: device_address(dev, &self.next),
            lanes: lanes.len() as u32,
            token: [0; MAX_BATCH],
            pos: [0; MAX_BATCH],
            seq: [0; MAX_BATCH],
            _pad: 0,
        };
        for (i, l) in lanes.iter().enumerate() {
            (batch.token[i], batch.pos[i], batch.seq[i]) = (l.token, l.pos as u32, l.seq as u32);
        }
        let args = self.model_args(dev, 0, 0, 1, &[]);
        // A coded decode's batch step streams its codes, through its program (the bf16 program's with the
        // coded matrices in).
        let (program, k) = match &self.coded {
            Ok(f) => (&*f.program, &f.batch),
            Err(_) => (&*self.program, &self.batch),
        };
        let b = &mut self.stack;
        batch.act_stride = b.act_stride as i64;
        let hidden = self.hidden.as_ref().map_or(0, |h| device_address(dev, h));
        let (cfg, phases, layers) = (b.launch_config(k.smem), b.phases(), b.layers());
        let mut l = dev.stream().launch_builder(&k.func);
        l.arg(program).arg(&args).arg(&batch).arg(&phases).arg(&layers).arg(&mut self.out).arg(&hidden);
        l.arg(&b.d).arg(&b.cursor.step).arg(&mut b.phase_done).arg(&k.red_rows);
        // SAFETY: megakernel_model_batch_bf16, _fp8 or _nf4 (program and model as for the model kernel
        // (launch), a coded one's program with its matrices packed as code_stream packs them; batch:
        // BatchArgs by value, 1 to MAX_BATCH lanes, each token in the vocabulary, position within the
        // caches and sequence within those allocated (sequences x cache_elems per layer's K and V, at
        // cache_stride), lanes of a sequence consecutive (batch_refusal); act_stride the arena's lane
        // stride, MAX_BATCH lanes allocated (CompiledStack::build for a model); next (MAX_BATCH); phases,
        // layers, out (MAX_BATCH, d), hidden (MAX_BATCH, layers - 1, d) or null, d, step, phase_done
        // (MAX_PHASES + 1), red_rows the batch kernel's); the grid is co-resident (the cooperative launch fails
        // rather than run otherwise), smem as batch_kernel sized it.
        let ms = dev.time_ms(|| unsafe { l.launch_cooperative(cfg) }.map(drop).context("launching the batch step"))?;
        // One step of the program and one head phase.
        b.cursor.step = b.cursor.step.wrapping_add(1);
        self.heads = self.heads.wrapping_add(1);
        Ok(ms)
    }

    /// The logits of the first `lanes` lanes of the last batch step.
    pub fn batch_logits(&self, dev: &Device, lanes: usize) -> Result<Vec<Vec<f32>>, GpuModelError> {
        let all =
            dev.stream().clone_dtoh(&self.logits.slice(..lanes * self.cfg.vocab)).context("reading the logits")?;
        Ok(all.chunks(self.cfg.vocab).map(<[f32]>::to_vec).collect())
    }

    /// The greedy tokens of the first `lanes` lanes of the last batch step (`None` where every logit was
    /// NaN).
    pub fn batch_next(&self, dev: &Device, lanes: usize) -> Result<Vec<Option<u32>>, GpuModelError> {
        let next = dev.stream().clone_dtoh(&self.next.slice(..lanes)).context("reading the batch's tokens")?;
        Ok(next.into_iter().map(|t| u32::try_from(t).ok()).collect())
    }

    /// Runs `prompt` from position 0 and generates up to `max_new` tokens greedily, stopping at one of
    /// `eos` (at most [`MAX_EOS`]; none to run all `max_new`) or at the caches' end, in one launch.
    pub fn generate(
        &mut self,
        dev: &Device,
        prompt: &[u32],
        max_new: usize,
        eos: &[u32],
    ) -> Result<Generation, GpuModelError> {
        self.limits().generation(prompt, max_new, eos)?;
        let start = Instant::now();
        let ([positions, generated], kernel_ms) =
            self.launch(dev, 0, prompt, max_new, eos, Instance::Timed(WeightStream::AsStored))?;
        let n = prompt.len();
        let mut tokens = vec![0i32; generated as usize];
        let s = dev.stream();
        s.memcpy_dtoh(&self.tokens.slice(n..n + generated as usize), &mut tokens).context("reading the tokens")?;
        s.synchronize().context("reading the tokens")?;
        let elapsed = start.elapsed();
        let tokens = tokens
            .into_iter()
            .map(|t| {
                u32::try_from(t).map_err(|_| GpuModelError::Refused("every logit was NaN: no token to choose".into()))
            })
            .collect::<Result<Vec<_>, _>>()?;
        let stop = Stop::of(&tokens, max_new, eos);
        Ok(Generation { tokens, stop, positions: positions as usize, elapsed, kernel_ms })
    }

    /// The generations of `prompts` (at most `sequences()`), each as `generate` would make it alone, in
    /// a batch step per position for all of them (`generate_together`): tokens and why each stopped.
    pub fn generate_batch(
        &mut self,
        dev: &Device,
        prompts: &[Vec<u32>],
        max_new: usize,
        eos: &[u32],
    ) -> Result<Vec<(Vec<u32>, Stop)>, GpuModelError> {
        let (limits, sequences) = (self.limits(), self.sequences);
        generate_together(limits, sequences, prompts, max_new, eos, |lanes| {
            self.decode_batch(dev, lanes)?;
            self.batch_next(dev, lanes.len())
        })
    }

    /// `generate(prompt, max_new, [])` in the traced instance of the model kernel: every block stamps
    /// the global timer around each phase of every position (`Trace`). Its machine code is not
    /// the timed kernel's, so its times say where a token's time goes, not how long it takes.
    pub fn trace(&mut self, dev: &Device, prompt: &[u32], max_new: usize) -> Result<Trace, GpuModelError> {
        self.limits().generation(prompt, max_new, &[])?;
        self.traced(dev, 0, prompt, max_new)
    }

    /// `decode_step` in the traced instance (`trace`; `Trace::step_shares` reads it); the logits
    /// are the decode step's (`last_logits`).
    pub fn trace_step(&mut self, dev: &Device, token: u32, pos: usize) -> Result<Trace, GpuModelError> {
        self.limits().step(token, pos)?;
        self.traced(dev, pos, &[token], 1)
    }

    /// The traced instance's launch from `pos0`, the tokens from there `given` (checked by the caller).
    fn traced(&mut self, dev: &Device, pos0: usize, given: &[u32], max_new: usize) -> Result<Trace, GpuModelError> {
        let b = &self.stack;
        // Loaded here, not with the stack: only a trace runs it. The coded twin where the decode steps
        // stream codes and the format has one (launch runs it with the coded program).
        let narrow = has_narrow_rows(&self.layer);
        let coded = self.traces_codes();
        let traced = match &self.coded {
            Ok(c) if coded => {
                dev.function(&MODEL_FP8_TRACED, coded_kernel(c.format, narrow, true).expect("traces_codes"))?
            }
            _ => dev.function(&MODEL, model_kernel(self.cfg.qk_norm, narrow, true))?,
        };
        let smem = match &self.coded {
            Ok(c) if coded => c.smem,
            _ => b.smem,
        };
        fit_one_block(&traced, smem, "the traced model kernel")?;
        let (grid, layers, per_step) = (b.grid as usize, b.layers() as usize, (b.phases() * b.layers()) as usize + 1);
        let (plan, waits) = b.traced_rows();
        let positions = (given.len() + max_new - 1).min(self.context() - pos0);
        let mut stamps = dev
            .stream()
            .alloc_zeros::<u64>(positions * grid * per_step * TRACE_STAMPS)
            .context("allocating the trace")?;
        let instance = Instance::Traced { func: &traced, stamps: &mut stamps, coded };
        let ([ran, _], kernel_ms) = self.launch(dev, pos0, given, max_new, &[], instance)?;
        let mut stamps = dev.stream().clone_dtoh(&stamps).context("reading the trace")?;
        stamps.truncate(ran as usize * grid * per_step * TRACE_STAMPS);
        Ok(Trace { stamps, grid, plan, waits, layers, head: true, prompt: given.len(), kernel_ms })
    }

    /// Bytes a decode step at `pos` must move: every layer's (`ByteModel::stack_at`), the LM head and
    /// the final norm read, the logits written.
    pub fn bytes_at(&self, pos: usize) -> u64 {
        let (d, vocab) = (self.layer.d as u64, self.cfg.vocab as u64);
        let saved = self.coded.as_ref().map_or(0, |f| f.saved);
        ByteModel::stack_at(&self.layer, pos).total + 2 * vocab * d + 2 * d + 4 * vocab - saved
    }

    /// What its decode steps and generations may ask for.
    pub fn limits(&self) -> Limits {
        Limits { vocab: self.cfg.vocab, context: self.context() }
    }

    /// The model kernel's arguments for positions `pos0 .. prompt_end` given and up to `max_new` tokens
    /// generated, stopping at `eos` (a batch step reads only the model's addresses and sizes).
    fn model_args(&self, dev: &Device, pos0: usize, prompt_end: usize, max_new: usize, eos: &[u32]) -> ModelArgs {
        let mut eos_words = [0u32; MAX_EOS];
        eos_words[..eos.len()].copy_from_slice(eos);
        let mut qk_norms = [0u64; program::MAX_STACK_LAYERS];
        for (word, norms) in qk_norms.iter_mut().zip(&self.qk_norms) {
            *word = device_address(dev, norms);
        }
        ModelArgs {
            embed: device_address(dev, &self.embed),
            final_norm: device_address(dev, &self.norm),
            head: device_address(dev, self.head.as_ref().unwrap_or(&self.embed)),
            logits: device_address(dev, &self.logits),
            candidates: device_address(dev, &self.candidates),
            tokens: device_address(dev, &self.tokens),
            done: device_address(dev, &self.done),
            vocab: self.cfg.vocab as u32,
            pos0: pos0 as u32,
            prompt_end: prompt_end as u32,
            max_new: max_new.min(u32::MAX as usize) as u32,
            max_seq: self.layer.max_seq_len as u32,
            heads_before: self.heads,
            eps_bits: self.layer.eps.to_bits(),
            eos_count: eos.len() as u32,
            eos: eos_words,
            qk_norms,
        }
    }

    /// One launch of the model kernel, the `instance` given, from position `pos0`, the tokens from there
    /// `given`; returns the positions it ran, the tokens it generated and the kernel's time in ms.
    fn launch(
        &mut self,
        dev: &Device,
        pos0: usize,
        given: &[u32],
        max_new: usize,
        eos: &[u32],
        instance: Instance<'_>,
    ) -> Result<([u32; 2], f32), GpuModelError> {
        let s = dev.stream();
        let given_i32: Vec<i32> = given.iter().map(|&t| t as i32).collect();
        s.memcpy_htod(&given_i32, &mut self.tokens.slice_mut(pos0..pos0 + given.len()))
            .context("uploading the tokens")?;
        let args = self.model_args(dev, pos0, pos0 + given.len(), max_new, eos);
        let b = &mut self.stack;
        let hidden = self.hidden.as_ref().map_or(0, |h| device_address(dev, h));
        let (phases, layers) = (b.phases(), b.layers());
        // A decode or a trace of a quantised checkpoint runs the coded program, with the coded instances'
        // shared memory and partials, where it has one (and for a trace, where `traced` chose the coded
        // twin), unless the decode asks for bf16.
        let (func, program, smem, red_rows, stamps) = match (instance, &self.coded) {
            (Instance::Traced { func, stamps, coded: true }, Ok(c)) => {
                (func, &c.program, c.smem, c.red_rows, Some(stamps))
            }
            (Instance::Traced { func, stamps, .. }, _) => (func, &self.program, b.smem, b.red_rows, Some(stamps)),
            (Instance::Timed(WeightStream::AsStored), Ok(c)) => (&c.func, &c.program, c.smem, c.red_rows, None),
            (Instance::Timed(_), _) => (&b.func, &self.program, b.smem, b.red_rows, None),
        };
        let cfg = b.launch_config(smem);
        let mut l = s.launch_builder(func);
        l.arg(&**program).arg(&args).arg(&phases).arg(&layers).arg(&mut self.out).arg(&hidden);
        l.arg(&b.d).arg(&b.cursor.step).arg(&mut b.phase_done).arg(&red_rows);
        if let Some(t) = stamps {
            l.arg(t);
        }
        // SAFETY: megakernel_model_bf16 and its instances (the coded ones and their traced twins too, whose
        // program names packed matrices of the layout model_fp8.cu and model_nf4.cu read: code_stream) take (program:
        // Program<MAX_STACK_LAYERS> by value, model: ModelArgs by value (its buffers allocated above:
        // logits (vocab), candidates (grid), tokens (max_seq + 1), done (2)), phases, layers, out (d),
        // hidden ((layers - 1) x d or null for one layer), d, step, phase_done (MAX_PHASES + 1),
        // red_rows: the stack's, or for a coded instance its own, which leave its tail the last
        // Format::tail_bytes of its smem), and the traced instance a trace of (positions, grid, layers * phases + 1,
        // TRACE_STAMPS) u64 for every position it may run (`trace`); pos0 < prompt_end <= max_seq and
        // max_new >= 1 (checked by the callers); the grid is co-resident (occupancy-sized; the
        // cooperative launch fails rather than run otherwise), smem as CompiledStack::build sized it with the
        // head's rows, or as CodedDecode::build sized it.
        let ms =
            dev.time_ms(|| unsafe { l.launch_cooperative(cfg) }.map(drop).context("launching the model kernel"))?;
        let done = s.clone_dtoh(&self.done).context("reading what the launch ran")?;
        b.cursor.step = b.cursor.step.wrapping_add(done[0]);
        self.heads = self.heads.wrapping_add(done[1]);
        Ok(([done[0], done[1]], ms))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn model_args_mirror_the_kernel() {
        use crate::kernels::DEVICE_SOURCE as CU;
        for line in [
            format!("constexpr uint32_t MODEL_MAX_EOS = {MAX_EOS};"),
            "constexpr uint32_t MODEL_ARGS_BYTES = 7 * 8 + 12 * 4 + PROGRAM_MAX_LAYERS * 8;".to_string(),
            "const bf16* qk_norms[PROGRAM_MAX_LAYERS];".to_string(),
            "const bf16* embed;".to_string(),
            "uint32_t eos[MODEL_MAX_EOS];".to_string(),
            format!("constexpr uint32_t MAX_BATCH = {MAX_BATCH};"),
            "constexpr uint32_t BATCH_ARGS_BYTES = 3 * 8 + 4 + 3 * MAX_BATCH * 4 + 4;".to_string(),
            "int64_t act_stride;\n    int64_t cache_stride;\n    int32_t* next;".to_string(),
            "uint32_t token[MAX_BATCH];\n    uint32_t pos[MAX_BATCH];\n    uint32_t seq[MAX_BATCH];".to_string(),
        ] {
            assert!(CU.contains(&line), "kernels/megakernel/ lacks `{line}`");
        }
    }

    /// Every instance the model launches is an entry point of its file: model.cu's bf16 ones and their
    /// traced twins, model_fp8.cu's fp8 ones and model_fp8_traced.cu's twins of those, model_nf4.cu's
    /// nf4 ones, and each format's batch step (in model_batch.cu, model_fp8_batch.cu and model_nf4_batch.cu).
    #[test]
    fn the_model_kernels_named_are_entry_points() {
        let bf16 = include_str!("../../../kernels/megakernel/model/model.cu");
        let fp8 = include_str!("../../../kernels/megakernel/model/model_fp8.cu");
        let fp8_traced = include_str!("../../../kernels/megakernel/model/model_fp8_traced.cu");
        let bf16_batch = include_str!("../../../kernels/megakernel/model/model_batch.cu");
        let fp8_batch = include_str!("../../../kernels/megakernel/model/model_fp8_batch.cu");
        let nf4 = include_str!("../../../kernels/megakernel/model/model_nf4.cu");
        let nf4_batch = include_str!("../../../kernels/megakernel/model/model_nf4_batch.cu");
        for (qk_norm, narrow, traced) in (0..8).map(|i| (i & 1 == 1, i & 2 == 2, i & 4 == 4)) {
            let params = if traced { "MODEL_TRACE_PARAMS" } else { "MODEL_PARAMS" };
            let name = model_kernel(qk_norm, narrow, traced);
            assert!(bf16.contains(&format!(" {name}({params})")), "{name} is not a kernel of model.cu");
        }
        for narrow in [false, true] {
            let name = coded_kernel(Format::Fp8, narrow, false).unwrap();
            assert!(fp8.contains(&format!(" {name}(MODEL_PARAMS)")), "{name} is not a kernel of model_fp8.cu");
            let name = coded_kernel(Format::Fp8, narrow, true).unwrap();
            assert!(
                fp8_traced.contains(&format!(" {name}(MODEL_TRACE_PARAMS)")),
                "{name} is not a kernel of model_fp8_traced.cu"
            );
            let name = coded_kernel(Format::Nf4, narrow, false).unwrap();
            assert!(nf4.contains(&format!(" {name}(MODEL_PARAMS)")), "{name} is not a kernel of model_nf4.cu");
            assert_eq!(coded_kernel(Format::Nf4, narrow, true), None);
        }
        for (name, file) in
            [(BF16_BATCH, bf16_batch), (coded_files(Format::Fp8).2, fp8_batch), (coded_files(Format::Nf4).2, nf4_batch)]
        {
            assert!(file.contains(&format!(" {name}(BATCH_PARAMS)")), "{name} is not a kernel of its file");
        }
    }

    #[test]
    fn batch_steps_are_refused_naming_the_lane_and_what_is_wrong() {
        let lane = |seq, token, pos| Lane { seq, token, pos };
        let refusal = |lanes: &[Lane]| batch_refusal(lanes, 3, 100, 50);
        // Taken: sequences side by side at any positions, and a chunk of one sequence beside them.
        assert_eq!(refusal(&[lane(0, 1, 7), lane(1, 2, 0), lane(2, 49, 99)]), None);
        assert_eq!(refusal(&[lane(1, 1, 4), lane(0, 3, 9), lane(1, 2, 5), lane(1, 0, 6)]), None);
        assert_eq!(refusal(&Lane::chunk(2, 92, &[1; MAX_BATCH])), None);
        for (lanes, needle) in [
            (vec![], "0 lanes: 1 to 8"),
            (vec![lane(0, 1, 0); MAX_BATCH + 1], "9 lanes: 1 to 8"),
            (vec![lane(0, 1, 0), lane(3, 1, 0)], "lane 1's sequence 3 is past the model's 3"),
            (vec![lane(1, 1, 100)], "lane 0's position 100 is past the caches' 100"),
            (vec![lane(2, 50, 0)], "lane 0's token 50 is outside the vocabulary of 50"),
            (vec![lane(1, 1, 4), lane(0, 1, 0), lane(1, 1, 6)], "lane 0 has 4, lane 2 6"),
            (vec![lane(1, 1, 4), lane(1, 1, 4)], "lane 0 has 4, lane 1 4"),
            (vec![lane(1, 1, 5), lane(1, 1, 4)], "lane 0 has 5, lane 1 4"),
        ] {
            let why = refusal(&lanes).unwrap_or_else(|| panic!("{lanes:?} taken"));
            assert!(why.contains(needle), "{why}");
        }
    }
}
