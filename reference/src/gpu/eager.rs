//! The eager GPU reference: the decoder layer run the way an eager framework (PyTorch, bf16) runs it,
//! one kernel launch per elementary op (`kernels/reference/reference.cu`), 21 launches per step. Straightforward
//! rather than fast: the GEMVs stream their weights near bandwidth, the rest is small.
//!
//! Every op reads bf16, computes in f32 (f32 accumulation in every reduction, each in a fixed order,
//! so a step gives the same bits on every run) and stores its result as bf16. The rounding points,
//! identical to those of [`crate::golden`]:
//!
//! 1. `h = rmsnorm(x, in_norm)`
//! 2. `q`, `k`, `v`, the three GEMV outputs
//! 3. `q` and `k` after RoPE (by the f32 cos and sin of [`RopeTable`], uploaded)
//! 4. the K and V cache rows at `pos`: the roped `k` and `v`, already bf16, stored unchanged
//! 5. `a`, the attention output
//! 6. `o = a @ Wo^T`
//! 7. `x1 = x + o`
//! 8. `h2 = rmsnorm(x1, post_norm)`
//! 9. `gate` and `up`
//! 10. `act = silu(gate) * up`
//! 11. `down = act @ Wdown^T`
//! 12. `x_out = x1 + down`
//!
//! The attention scores and softmax probabilities stay f32 and are never rounded to bf16.
//!
//! The per-op launchers of [`Ops`] are public so that the selftest can check each op against the
//! golden model. They panic when a buffer's length does not fit the op: the kernels trust the lengths.

use std::ops::Range;

use std::sync::Arc;

use crate::kernels::REFERENCE;
use cuda::cudarc::driver::{CudaFunction, CudaSlice, CudaStream, LaunchArgs, LaunchConfig, PushKernelArg};
use cuda::{Context, CudaError, Device, grid_1d};
use half::bf16;
use spec::Config;

use super::data::{DeviceCache, DeviceWeights};
pub use crate::golden::AttentionSpan;
use crate::golden::RopeTable;

/// Threads per warp.
const WARP: u32 = 32;
/// Threads per block of the grid-stride elementwise kernels (norm scale, RoPE, cache write, add, SiLU).
const ELEMENTWISE_BLOCK: u32 = 256;
/// Threads of the single block that sums RMSNorm's squares.
const SUMSQ_BLOCK: u32 = 1024;
/// GEMV rows per block, one warp each.
const GEMV_WARPS: u32 = 8;
/// Attention slots per score block, one warp each.
const SCORE_WARPS: u32 = 8;
/// Threads per softmax block; one block per query head.
const SOFTMAX_BLOCK: u32 = 256;
/// Warps per attention-sum block, splitting the slots between them.
const WSUM_WARPS: u32 = 16;
/// bf16 per 16-byte GEMV load: a GEMV's row length must be a multiple of it.
const VEC: usize = 8;

/// One kernel of `kernels/reference/reference.cu`, with its name for error messages.
struct Func {
    f: CudaFunction,
    name: &'static str,
}

impl Func {
    fn load(dev: &Device, name: &'static str) -> Result<Self, CudaError> {
        Ok(Self { f: dev.function(&REFERENCE, name)?, name })
    }

    /// An empty argument list for a launch of this kernel on `stream`.
    fn args<'a>(&'a self, stream: &'a Arc<CudaStream>) -> LaunchArgs<'a> {
        stream.launch_builder(&self.f)
    }
}

/// Submits `args` with `cfg`; a refusal names the kernel.
///
/// # Safety
///
/// `args` must match `func`'s parameter list in `kernels/reference/reference.cu`, in order and in type, and each
/// buffer must hold every element the kernel indexes with those sizes.
unsafe fn launch(func: &Func, mut args: LaunchArgs<'_>, cfg: LaunchConfig) -> Result<(), CudaError> {
    // SAFETY: the caller's contract.
    unsafe { args.launch(cfg) }
        .map(|_| ())
        .map_err(|source| CudaError::Driver { context: format!("launching {}", func.name), source })
}

/// Every kernel of `kernels/reference/reference.cu`.
struct Funcs {
    rms_sumsq: Func,
    rms_scale: Func,
    gemv: Func,
    rope: Func,
    cache_write: Func,
    attn_scores: Func,
    softmax: Func,
    attn_wsum: Func,
    add: Func,
    silu_mul: Func,
}

impl Funcs {
    fn load(dev: &Device) -> Result<Self, CudaError> {
        let f = |name| Func::load(dev, name);
        Ok(Self {
            rms_sumsq: f("rms_sumsq_f32")?,
            rms_scale: f("rms_scale_bf16")?,
            gemv: f("gemv_bf16")?,
            rope: f("rope_bf16")?,
            cache_write: f("cache_write_bf16")?,
            attn_scores: f("attn_scores_f32")?,
            softmax: f("softmax_f32")?,
            attn_wsum: f("attn_wsum_bf16")?,
            add: f("add_bf16")?,
            silu_mul: f("silu_mul_bf16")?,
        })
    }
}

/// A size as the kernels take it.
fn u32_of(n: usize) -> u32 {
    u32::try_from(n).unwrap_or_else(|_| panic!("{n} does not fit the kernels' 32-bit sizes"))
}

/// Panics unless every buffer holds `want` elements.
fn check_len(op: &str, buffers: &[(&str, usize)], want: usize) {
    for &(name, len) in buffers {
        assert_eq!(len, want, "{op}: {name} holds {len} elements, not {want}");
    }
}

/// A launch of one block.
fn one_block(threads: u32) -> LaunchConfig {
    LaunchConfig { grid_dim: (1, 1, 1), block_dim: (threads, 1, 1), shared_mem_bytes: 0 }
}

/// A launch of a `grid` of blocks of `warps` warps.
fn warps_grid(grid: (u32, u32), warps: u32) -> LaunchConfig {
    LaunchConfig { grid_dim: (grid.0.max(1), grid.1.max(1), 1), block_dim: (warps * WARP, 1, 1), shared_mem_bytes: 0 }
}

/// The ops of the eager reference, one method each, with what they need beyond their operands: the
/// loaded kernels, the RoPE table and the scratch of the norm (its mean square) and of attention (its
/// scores). Every method enqueues its launches on the device's stream and returns without waiting.
pub struct Ops {
    f: Funcs,
    cfg: Config,
    /// `cfg`'s sizes as the kernels take them.
    n_q: u32,
    n_kv: u32,
    hd: u32,
    max_seq_len: u32,
    /// `(max_seq_len, hd / 2)`, from [`RopeTable`].
    cos: CudaSlice<f32>,
    /// `(max_seq_len, hd / 2)`, from [`RopeTable`].
    sin: CudaSlice<f32>,
    /// `(1)`: the mean square of the vector being normalised.
    mean_square: CudaSlice<f32>,
    /// `(n_q, max_seq_len)`: attention scores, then probabilities, over the attended slots.
    scores: CudaSlice<f32>,
    /// Where every launch goes.
    stream: Arc<CudaStream>,
}

impl Ops {
    /// Loads the kernels, uploads the RoPE table and allocates the scratch, for a valid `cfg`; every
    /// launch goes on the device's stream.
    pub fn new(dev: &Device, cfg: &Config) -> Result<Self, CudaError> {
        Self::on_stream(dev, cfg, dev.stream().clone())
    }

    /// As [`Ops::new`], every launch on `stream` (one that can be captured into a graph, say).
    pub fn on_stream(dev: &Device, cfg: &Config, stream: Arc<CudaStream>) -> Result<Self, CudaError> {
        let valid = cfg.hd.is_multiple_of(VEC) && cfg.n_q.is_multiple_of(cfg.n_kv) && cfg.batch == 1;
        assert!(valid, "{}: not a valid configuration", cfg.name);
        let table = RopeTable::new(cfg);
        let table_len = cfg.max_seq_len * cfg.hd / 2;
        check_len("rope table", &[("cos", table.cos.len()), ("sin", table.sin.len())], table_len);
        let s = &stream;
        Ok(Self {
            f: Funcs::load(dev)?,
            cfg: cfg.clone(),
            n_q: u32_of(cfg.n_q),
            n_kv: u32_of(cfg.n_kv),
            hd: u32_of(cfg.hd),
            max_seq_len: u32_of(cfg.max_seq_len),
            cos: s.clone_htod(&table.cos).context("uploading the RoPE cos table")?,
            sin: s.clone_htod(&table.sin).context("uploading the RoPE sin table")?,
            mean_square: s.alloc_zeros(1).context("allocating the norm's scratch")?,
            scores: s.alloc_zeros(cfg.n_q * cfg.max_seq_len).context("allocating the attention scores")?,
            stream,
        })
    }

    /// `out = rmsnorm(x, g)`: `mean(x^2)` by one block, then `(x * (1 / sqrt(mean + eps))) * g`.
    pub fn rmsnorm(
        &mut self,
        dev: &Device,
        x: &CudaSlice<bf16>,
        g: &CudaSlice<bf16>,
        out: &mut CudaSlice<bf16>,
    ) -> Result<(), CudaError> {
        self.rmsnorm_then(dev, x, g, out, || ())
    }

    /// [`Ops::rmsnorm`], running `between` on the host once the first of its two launches is enqueued.
    fn rmsnorm_then(
        &mut self,
        dev: &Device,
        x: &CudaSlice<bf16>,
        g: &CudaSlice<bf16>,
        out: &mut CudaSlice<bf16>,
        between: impl FnOnce(),
    ) -> Result<(), CudaError> {
        let len = out.len();
        check_len("rmsnorm", &[("x", x.len()), ("g", g.len())], len);
        let n = u32_of(len);

        let mut b = self.f.rms_sumsq.args(&self.stream);
        b.arg(&mut self.mean_square).arg(x).arg(&n);
        // SAFETY: rms_sumsq_f32(ms (1), x (n), n: u32); mean_square holds 1 f32, x holds n.
        unsafe { launch(&self.f.rms_sumsq, b, one_block(SUMSQ_BLOCK)) }?;
        between();

        let grid = grid_1d(len, ELEMENTWISE_BLOCK, dev.facts().sms);
        let mut b = self.f.rms_scale.args(&self.stream);
        b.arg(out).arg(x).arg(g).arg(&self.mean_square);
        b.arg(&n).arg(&self.cfg.eps);
        // SAFETY: rms_scale_bf16(out (n), x (n), g (n), ms (1), n: u32, eps: f32); lengths checked
        // above.
        unsafe { launch(&self.f.rms_scale, b, grid) }
    }

    /// `y = W h` for row-major `W (y.len(), h.len())`; `h.len()` must be a multiple of 8.
    pub fn gemv(&self, w: &CudaSlice<bf16>, h: &CudaSlice<bf16>, y: &mut CudaSlice<bf16>) -> Result<(), CudaError> {
        let (rows, cols) = (y.len(), h.len());
        assert!(cols.is_multiple_of(VEC), "gemv: rows of {cols} are not whole 16-byte vectors");
        check_len("gemv", &[("W", w.len())], rows * cols);
        let (r, c) = (u32_of(rows), u32_of(cols));
        let grid = warps_grid((r.div_ceil(GEMV_WARPS), 1), GEMV_WARPS);
        let mut b = self.f.gemv.args(&self.stream);
        b.arg(y).arg(w).arg(h).arg(&r).arg(&c);
        // SAFETY: gemv_bf16(y (rows), w (rows, cols), h (cols), rows: u32, cols: u32); lengths
        // checked above; cols is a multiple of 8 and every pointer the base of an allocation, so the
        // 16-byte loads are aligned.
        unsafe { launch(&self.f.gemv, b, grid) }
    }

    /// Rotate-half RoPE at `pos`, in place, of every `hd`-long head of `v` (`q` or `k`).
    pub fn rope(&self, dev: &Device, v: &mut CudaSlice<bf16>, pos: usize) -> Result<(), CudaError> {
        let hd = self.cfg.hd;
        assert!(v.len().is_multiple_of(hd), "rope: {} is not whole heads of {hd}", v.len());
        assert!(pos < self.cfg.max_seq_len, "rope: position {pos} is past the table");
        let (heads, p) = (u32_of(v.len() / hd), u32_of(pos));
        let grid = grid_1d(v.len() / 2, ELEMENTWISE_BLOCK, dev.facts().sms);
        let mut b = self.f.rope.args(&self.stream);
        b.arg(v).arg(&self.cos).arg(&self.sin);
        b.arg(&heads).arg(&self.hd).arg(&p);
        // SAFETY: rope_bf16(v (heads, hd), cos, sin (max_seq_len, hd / 2), heads: u32, hd: u32,
        // pos: u32); v holds heads * hd, the tables max_seq_len * hd / 2 (checked in new), pos is
        // below max_seq_len.
        unsafe { launch(&self.f.rope, b, grid) }
    }

    /// Writes `k` and `v` (`n_kv * hd` each) into slot `pos` of every KV head of `cache`.
    pub fn append(
        &self,
        dev: &Device,
        k: &CudaSlice<bf16>,
        v: &CudaSlice<bf16>,
        cache: &mut DeviceCache,
        pos: usize,
    ) -> Result<(), CudaError> {
        let cfg = &self.cfg;
        check_len("append", &[("k", k.len()), ("v", v.len())], cfg.kv_dim());
        let cache_lens = [("K cache", cache.k.len()), ("V cache", cache.v.len())];
        check_len("append", &cache_lens, cfg.cache_elems());
        assert!(pos < cfg.max_seq_len, "append: position {pos} is past the cache");
        let p = u32_of(pos);
        let grid = grid_1d(cfg.kv_dim(), ELEMENTWISE_BLOCK, dev.facts().sms);
        for (tensor, row) in [(&mut cache.k, k), (&mut cache.v, v)] {
            let mut b = self.f.cache_write.args(&self.stream);
            b.arg(tensor).arg(row);
            b.arg(&self.n_kv).arg(&self.max_seq_len).arg(&self.hd).arg(&p);
            // SAFETY: cache_write_bf16(cache (n_kv, max_seq_len, hd), row (n_kv, hd), n_kv: u32,
            // max_seq_len: u32, hd: u32, pos: u32); lengths checked above, pos < max_seq_len.
            unsafe { launch(&self.f.cache_write, b, grid) }?;
        }
        Ok(())
    }

    /// `out = softmax(q . K[slots] / sqrt(hd)) @ V[slots]` per query head, over the slots `span`
    /// selects at `pos` (zero when it selects none), in three launches: scores, softmax, weighted sum.
    /// The cache must already hold slot `pos`.
    pub fn attention(
        &mut self,
        q: &CudaSlice<bf16>,
        cache: &DeviceCache,
        pos: usize,
        span: AttentionSpan,
        out: &mut CudaSlice<bf16>,
    ) -> Result<(), CudaError> {
        let cfg = &self.cfg;
        let slots: Range<usize> = span.slots(pos);
        check_len("attention", &[("q", q.len()), ("out", out.len())], cfg.q_dim());
        let cache_lens = [("K cache", cache.k.len()), ("V cache", cache.v.len())];
        check_len("attention", &cache_lens, cfg.cache_elems());
        assert!(slots.end <= cfg.max_seq_len, "attention: slots {slots:?} run past the cache");
        let (first, end) = (u32_of(slots.start), u32_of(slots.end));
        let len = u32_of(slots.len());
        let (n_q, n_kv, msl, hd) = (&self.n_q, &self.n_kv, &self.max_seq_len, &self.hd);

        let grid = warps_grid((len.div_ceil(SCORE_WARPS), *n_q), SCORE_WARPS);
        let mut b = self.f.attn_scores.args(&self.stream);
        b.arg(&mut self.scores).arg(q).arg(&cache.k);
        b.arg(n_q).arg(n_kv).arg(msl).arg(hd).arg(&first).arg(&end);
        // SAFETY: attn_scores_f32(s (n_q, max_seq_len), q (n_q, hd), k_cache (n_kv, max_seq_len,
        // hd), n_q, n_kv, max_seq_len, hd, first, end: u32); lengths checked above, and
        // end <= max_seq_len.
        unsafe { launch(&self.f.attn_scores, b, grid) }?;

        let grid = warps_grid((*n_q, 1), SOFTMAX_BLOCK / WARP);
        let mut b = self.f.softmax.args(&self.stream);
        b.arg(&mut self.scores).arg(n_q).arg(msl).arg(&first).arg(&end);
        // SAFETY: softmax_f32(s (n_q, max_seq_len), n_q, max_seq_len, first, end: u32); as above.
        unsafe { launch(&self.f.softmax, b, grid) }?;

        // A block covers one query head and WARP bf16 pairs of it.
        let grid = warps_grid((*n_q, (hd / 2).div_ceil(WARP)), WSUM_WARPS);
        let mut b = self.f.attn_wsum.args(&self.stream);
        b.arg(out).arg(&self.scores).arg(&cache.v);
        b.arg(n_q).arg(n_kv).arg(msl).arg(hd).arg(&first).arg(&end);
        // SAFETY: attn_wsum_bf16(a (n_q, hd), prob (n_q, max_seq_len), v_cache (n_kv, max_seq_len,
        // hd), n_q, n_kv, max_seq_len, hd, first, end: u32); as above.
        unsafe { launch(&self.f.attn_wsum, b, grid) }
    }

    /// `out = a + b`.
    pub fn add(
        &self,
        dev: &Device,
        a: &CudaSlice<bf16>,
        b: &CudaSlice<bf16>,
        out: &mut CudaSlice<bf16>,
    ) -> Result<(), CudaError> {
        self.elementwise(dev, &self.f.add, a, b, out)
    }

    /// `out = silu(gate) * up`.
    pub fn silu_mul(
        &self,
        dev: &Device,
        gate: &CudaSlice<bf16>,
        up: &CudaSlice<bf16>,
        out: &mut CudaSlice<bf16>,
    ) -> Result<(), CudaError> {
        self.elementwise(dev, &self.f.silu_mul, gate, up, out)
    }

    /// A kernel `(out (n), a (n), b (n), n: u32)`: add_bf16 or silu_mul_bf16.
    fn elementwise(
        &self,
        dev: &Device,
        func: &Func,
        a: &CudaSlice<bf16>,
        b: &CudaSlice<bf16>,
        out: &mut CudaSlice<bf16>,
    ) -> Result<(), CudaError> {
        let len = out.len();
        check_len(func.name, &[("a", a.len()), ("b", b.len())], len);
        let n = u32_of(len);
        let mut args = func.args(&self.stream);
        args.arg(out).arg(a).arg(b).arg(&n);
        // SAFETY: add_bf16 and silu_mul_bf16 are both (out (n), a (n), b (n), n: u32); lengths checked.
        unsafe { launch(func, args, grid_1d(len, ELEMENTWISE_BLOCK, dev.facts().sms)) }
    }
}

/// The activations of a step, each `(len)` bf16, allocated once.
struct Activations {
    h: CudaSlice<bf16>,
    q: CudaSlice<bf16>,
    k: CudaSlice<bf16>,
    v: CudaSlice<bf16>,
    a: CudaSlice<bf16>,
    o: CudaSlice<bf16>,
    x1: CudaSlice<bf16>,
    h2: CudaSlice<bf16>,
    gate: CudaSlice<bf16>,
    up: CudaSlice<bf16>,
    act: CudaSlice<bf16>,
    down: CudaSlice<bf16>,
}

/// The eager reference of one layer: its ops and the activation buffers of a step.
pub struct Eager {
    ops: Ops,
    act: Activations,
}

impl Eager {
    /// Loads the kernels and allocates every buffer a step needs, for a valid `cfg`; every launch goes
    /// on the device's stream.
    pub fn new(dev: &Device, cfg: &Config) -> Result<Self, CudaError> {
        Self::on_stream(dev, cfg, dev.stream().clone())
    }

    /// As [`Eager::new`], every launch on `stream` (one that can be captured into a graph, say).
    pub fn on_stream(dev: &Device, cfg: &Config, stream: Arc<CudaStream>) -> Result<Self, CudaError> {
        let buf = |len: usize| stream.alloc_zeros::<bf16>(len).context("allocating an activation");
        let (d, qd, kvd, ffn) = (cfg.d, cfg.q_dim(), cfg.kv_dim(), cfg.ffn);
        let act = Activations {
            h: buf(d)?,
            q: buf(qd)?,
            k: buf(kvd)?,
            v: buf(kvd)?,
            a: buf(qd)?,
            o: buf(d)?,
            x1: buf(d)?,
            h2: buf(d)?,
            gate: buf(ffn)?,
            up: buf(ffn)?,
            act: buf(ffn)?,
            down: buf(d)?,
        };
        Ok(Self { ops: Ops::on_stream(dev, cfg, stream.clone())?, act })
    }

    /// The per-op launchers, for checking each op on its own.
    pub fn ops(&mut self) -> &mut Ops {
        &mut self.ops
    }

    /// One decode step at `pos`: writes K and V at `pos` into `cache` and `x_out` into `out` (`d`).
    pub fn step(
        &mut self,
        dev: &Device,
        w: &DeviceWeights,
        cache: &mut DeviceCache,
        x: &CudaSlice<bf16>,
        pos: usize,
        out: &mut CudaSlice<bf16>,
    ) -> Result<(), CudaError> {
        self.step_with(dev, w, cache, x, pos, out, AttentionSpan::Full)
    }

    /// [`Eager::step`], attending over `span` instead of every cached slot. 21 launches.
    #[allow(clippy::too_many_arguments)]
    pub fn step_with(
        &mut self,
        dev: &Device,
        w: &DeviceWeights,
        cache: &mut DeviceCache,
        x: &CudaSlice<bf16>,
        pos: usize,
        out: &mut CudaSlice<bf16>,
        span: AttentionSpan,
    ) -> Result<(), CudaError> {
        self.sequence(dev, w, cache, x, pos, out, span, || (), gemv_down(w))
    }

    /// [`Eager::step`], with `after_first_launch` run on the host once the step's first kernel is
    /// enqueued and before the other 20 are: for a caller that changes how the rest are observed (the
    /// red team's recording-off).
    #[allow(clippy::too_many_arguments)]
    pub fn step_after_first_launch(
        &mut self,
        dev: &Device,
        w: &DeviceWeights,
        cache: &mut DeviceCache,
        x: &CudaSlice<bf16>,
        pos: usize,
        out: &mut CudaSlice<bf16>,
        after_first_launch: impl FnOnce(),
    ) -> Result<(), CudaError> {
        self.sequence(dev, w, cache, x, pos, out, AttentionSpan::Full, after_first_launch, gemv_down(w))
    }

    /// [`Eager::step`] with the down projection (step 11: `down = act @ Wdown^T`, `act` of `ffn`
    /// elements into `down` of `d`) enqueued by `down_proj` instead of the bf16 GEMV, for a submission
    /// that keeps that matrix in another form. 20 launches plus `down_proj`'s.
    #[allow(clippy::too_many_arguments)]
    pub fn step_with_down(
        &mut self,
        dev: &Device,
        w: &DeviceWeights,
        cache: &mut DeviceCache,
        x: &CudaSlice<bf16>,
        pos: usize,
        out: &mut CudaSlice<bf16>,
        down_proj: impl FnOnce(&CudaSlice<bf16>, &mut CudaSlice<bf16>) -> Result<(), CudaError>,
    ) -> Result<(), CudaError> {
        self.sequence(dev, w, cache, x, pos, out, AttentionSpan::Full, || (), |_, act, down| down_proj(act, down))
    }

    /// The step's ops in order, `after_first_launch` on the host once the first is enqueued, the
    /// down projection by `down_proj(ops, act, down)`.
    #[allow(clippy::too_many_arguments)]
    fn sequence(
        &mut self,
        dev: &Device,
        w: &DeviceWeights,
        cache: &mut DeviceCache,
        x: &CudaSlice<bf16>,
        pos: usize,
        out: &mut CudaSlice<bf16>,
        span: AttentionSpan,
        after_first_launch: impl FnOnce(),
        down_proj: impl FnOnce(&Ops, &CudaSlice<bf16>, &mut CudaSlice<bf16>) -> Result<(), CudaError>,
    ) -> Result<(), CudaError> {
        let (ops, a) = (&mut self.ops, &mut self.act);
        ops.rmsnorm_then(dev, x, &w.in_norm, &mut a.h, after_first_launch)?;
        ops.gemv(&w.q, &a.h, &mut a.q)?;
        ops.gemv(&w.k, &a.h, &mut a.k)?;
        ops.gemv(&w.v, &a.h, &mut a.v)?;
        ops.rope(dev, &mut a.q, pos)?;
        ops.rope(dev, &mut a.k, pos)?;
        ops.append(dev, &a.k, &a.v, cache, pos)?;
        ops.attention(&a.q, cache, pos, span, &mut a.a)?;
        ops.gemv(&w.o, &a.a, &mut a.o)?;
        ops.add(dev, x, &a.o, &mut a.x1)?;
        ops.rmsnorm(dev, &a.x1, &w.post_norm, &mut a.h2)?;
        ops.gemv(&w.gate, &a.h2, &mut a.gate)?;
        ops.gemv(&w.up, &a.h2, &mut a.up)?;
        ops.silu_mul(dev, &a.gate, &a.up, &mut a.act)?;
        down_proj(ops, &a.act, &mut a.down)?;
        ops.add(dev, &a.x1, &a.down, out)
    }
}

/// The down projection of a plain step: the bf16 GEMV of `w.down`.
fn gemv_down(
    w: &DeviceWeights,
) -> impl FnOnce(&Ops, &CudaSlice<bf16>, &mut CudaSlice<bf16>) -> Result<(), CudaError> + '_ {
    |ops, act, down| ops.gemv(&w.down, act, down)
}

#[cfg(test)]
mod tests {
    /// Every kernel of `kernels/reference/reference.cu` is loaded here by its exact name.
    #[test]
    fn every_kernel_is_loaded() {
        let cu = include_str!("../../../kernels/reference/reference.cu");
        let names: Vec<&str> =
            cu.split("__global__ void ").skip(1).map(|s| s.split('(').next().unwrap().trim()).collect();
        assert!(!names.is_empty(), "no kernel found in kernels/reference/reference.cu");
        let rs = include_str!("eager.rs");
        for name in names {
            assert!(rs.contains(&format!("f(\"{name}\")")), "{name} is not loaded");
        }
    }
}
