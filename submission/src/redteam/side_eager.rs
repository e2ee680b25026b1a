//! The eager reference's step on a stream of one's choosing: the same kernels of
//! `kernels/reference.cu`, the same launch shapes and the same order as `reference::gpu::Eager`, so
//! the same bits. `Eager` itself enqueues on the device's stream, the legacy default stream, which
//! cannot be captured into a CUDA graph; this mirror runs on a non-blocking stream of its own, which
//! can.

use std::sync::Arc;

use cuda::cudarc::driver::{CudaFunction, CudaSlice, CudaStream, LaunchArgs, LaunchConfig, PushKernelArg};
use cuda::kernels::REFERENCE;
use cuda::{Context, CudaError, Device, grid_1d};
use half::bf16;
use reference::golden::RopeTable;
use reference::gpu::{DeviceCache, DeviceWeights};
use spec::Config;

// The launch shapes of reference/src/gpu/eager.rs.
const WARP: u32 = 32;
const ELEMENTWISE_BLOCK: u32 = 256;
const SUMSQ_BLOCK: u32 = 1024;
const GEMV_WARPS: u32 = 8;
const SCORE_WARPS: u32 = 8;
const SOFTMAX_BLOCK: u32 = 256;
const WSUM_WARPS: u32 = 16;

/// A loaded kernel of `kernels/reference.cu` and its name.
struct Func {
    f: CudaFunction,
    name: &'static str,
}

/// The kernels, the stream, the sizes and the read-only tables: everything a launch needs but its
/// buffers.
struct Launcher {
    stream: Arc<CudaStream>,
    sms: i32,
    eps: f32,
    n_q: u32,
    n_kv: u32,
    hd: u32,
    max_seq_len: u32,
    cos: CudaSlice<f32>,
    sin: CudaSlice<f32>,
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

/// The activations and scratch of a step.
struct Buffers {
    mean_square: CudaSlice<f32>,
    scores: CudaSlice<f32>,
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

/// The eager reference on its own stream.
pub struct SideEager {
    l: Launcher,
    b: Buffers,
}

fn u32_of(n: usize) -> u32 {
    u32::try_from(n).unwrap_or_else(|_| panic!("{n} does not fit the kernels' 32-bit sizes"))
}

/// A launch of a `grid` of blocks of `warps` warps.
fn warps_grid(grid: (u32, u32), warps: u32) -> LaunchConfig {
    LaunchConfig { grid_dim: (grid.0.max(1), grid.1.max(1), 1), block_dim: (warps * WARP, 1, 1), shared_mem_bytes: 0 }
}

impl SideEager {
    /// Loads the kernels, creates the stream and allocates every buffer, for a valid `cfg`.
    pub fn new(dev: &Device, cfg: &Config) -> Result<Self, CudaError> {
        let stream = dev.ctx().new_stream().context("creating the eager mirror's stream")?;
        let f =
            |name: &'static str| -> Result<Func, CudaError> { Ok(Func { f: dev.function(&REFERENCE, name)?, name }) };
        let table = RopeTable::new(cfg);
        let l = Launcher {
            sms: dev.facts().sms,
            eps: cfg.eps,
            n_q: u32_of(cfg.n_q),
            n_kv: u32_of(cfg.n_kv),
            hd: u32_of(cfg.hd),
            max_seq_len: u32_of(cfg.max_seq_len),
            cos: stream.clone_htod(&table.cos).context("uploading the RoPE cos table")?,
            sin: stream.clone_htod(&table.sin).context("uploading the RoPE sin table")?,
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
            stream,
        };
        let buf = |len: usize| l.stream.alloc_zeros::<bf16>(len).context("allocating an activation");
        let (d, qd, kvd, ffn) = (cfg.d, cfg.q_dim(), cfg.kv_dim(), cfg.ffn);
        let b = Buffers {
            mean_square: l.stream.alloc_zeros(1).context("allocating the norm's scratch")?,
            scores: l.stream.alloc_zeros(cfg.n_q * cfg.max_seq_len).context("allocating the attention scores")?,
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
        Ok(Self { l, b })
    }

    /// The stream every launch goes to.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.l.stream
    }

    /// Enqueues one step at `pos` on [`SideEager::stream`]: K and V at `pos` into `cache`, `x_out` into
    /// `out`. 21 launches, as the reference's, and nothing else (no allocation, no copy, no event), so the whole step
    /// can be captured into a graph.
    pub fn enqueue(
        &mut self,
        w: &DeviceWeights,
        cache: &mut DeviceCache,
        x: &CudaSlice<bf16>,
        pos: usize,
        out: &mut CudaSlice<bf16>,
    ) -> Result<(), CudaError> {
        let (l, b) = (&self.l, &mut self.b);
        l.rmsnorm(x, &w.in_norm, &mut b.mean_square, &mut b.h)?;
        l.gemv(&w.q, &b.h, &mut b.q)?;
        l.gemv(&w.k, &b.h, &mut b.k)?;
        l.gemv(&w.v, &b.h, &mut b.v)?;
        l.rope(&mut b.q, pos)?;
        l.rope(&mut b.k, pos)?;
        l.cache_write(&mut cache.k, &b.k, pos)?;
        l.cache_write(&mut cache.v, &b.v, pos)?;
        l.attention(&b.q, cache, pos, &mut b.scores, &mut b.a)?;
        l.gemv(&w.o, &b.a, &mut b.o)?;
        l.elementwise(&l.add, x, &b.o, &mut b.x1)?;
        l.rmsnorm(&b.x1, &w.post_norm, &mut b.mean_square, &mut b.h2)?;
        l.gemv(&w.gate, &b.h2, &mut b.gate)?;
        l.gemv(&w.up, &b.h2, &mut b.up)?;
        l.elementwise(&l.silu_mul, &b.gate, &b.up, &mut b.act)?;
        l.gemv(&w.down, &b.act, &mut b.down)?;
        l.elementwise(&l.add, &b.x1, &b.down, out)
    }
}

impl Launcher {
    fn args<'a>(&'a self, func: &'a Func) -> LaunchArgs<'a> {
        self.stream.launch_builder(&func.f)
    }

    /// Submits `args` with `cfg`; a refusal names the kernel.
    ///
    /// # Safety
    ///
    /// As `reference::gpu::eager`'s `launch`: `args` match `func`'s parameters in
    /// `kernels/reference.cu`, in order and type, and every buffer holds what the kernel indexes.
    unsafe fn launch(func: &Func, mut args: LaunchArgs<'_>, cfg: LaunchConfig) -> Result<(), CudaError> {
        // SAFETY: the caller's contract.
        unsafe { args.launch(cfg) }.map(|_| ()).context(format!("launching {}", func.name))
    }

    fn grid(&self, n: usize) -> LaunchConfig {
        grid_1d(n, ELEMENTWISE_BLOCK, self.sms)
    }

    fn rmsnorm(
        &self,
        x: &CudaSlice<bf16>,
        g: &CudaSlice<bf16>,
        mean_square: &mut CudaSlice<f32>,
        out: &mut CudaSlice<bf16>,
    ) -> Result<(), CudaError> {
        let len = out.len();
        assert!(x.len() == len && g.len() == len, "rmsnorm: lengths differ");
        let n = u32_of(len);
        let mut b = self.args(&self.rms_sumsq);
        b.arg(&mut *mean_square).arg(x).arg(&n);
        let one_block = LaunchConfig { grid_dim: (1, 1, 1), block_dim: (SUMSQ_BLOCK, 1, 1), shared_mem_bytes: 0 };
        // SAFETY: rms_sumsq_f32(ms (1), x (n), n: u32).
        unsafe { Self::launch(&self.rms_sumsq, b, one_block) }?;
        let mut b = self.args(&self.rms_scale);
        b.arg(out).arg(x).arg(g).arg(&*mean_square).arg(&n).arg(&self.eps);
        // SAFETY: rms_scale_bf16(out (n), x (n), g (n), ms (1), n: u32, eps: f32).
        unsafe { Self::launch(&self.rms_scale, b, self.grid(len)) }
    }

    fn gemv(&self, w: &CudaSlice<bf16>, h: &CudaSlice<bf16>, y: &mut CudaSlice<bf16>) -> Result<(), CudaError> {
        let (rows, cols) = (y.len(), h.len());
        assert!(cols.is_multiple_of(8) && w.len() == rows * cols, "gemv: W is not ({rows}, {cols}) in whole vectors");
        let (r, c) = (u32_of(rows), u32_of(cols));
        let mut b = self.args(&self.gemv);
        b.arg(y).arg(w).arg(h).arg(&r).arg(&c);
        // SAFETY: gemv_bf16(y (rows), w (rows, cols), h (cols), rows: u32, cols: u32); cols is a
        // multiple of 8 and every buffer an allocation's base, so the 16-byte loads are aligned.
        unsafe { Self::launch(&self.gemv, b, warps_grid((r.div_ceil(GEMV_WARPS), 1), GEMV_WARPS)) }
    }

    fn rope(&self, v: &mut CudaSlice<bf16>, pos: usize) -> Result<(), CudaError> {
        assert!(pos < self.max_seq_len as usize, "rope: position {pos} is past the table");
        let len = v.len();
        let (heads, p) = (u32_of(len) / self.hd, u32_of(pos));
        let mut b = self.args(&self.rope);
        b.arg(v).arg(&self.cos).arg(&self.sin).arg(&heads).arg(&self.hd).arg(&p);
        // SAFETY: rope_bf16(v (heads, hd), cos, sin (max_seq_len, hd / 2), heads, hd, pos: u32).
        unsafe { Self::launch(&self.rope, b, self.grid(len / 2)) }
    }

    fn cache_write(&self, tensor: &mut CudaSlice<bf16>, row: &CudaSlice<bf16>, pos: usize) -> Result<(), CudaError> {
        let (n_kv, msl, hd) = (self.n_kv as usize, self.max_seq_len as usize, self.hd as usize);
        assert!(row.len() == n_kv * hd && tensor.len() == n_kv * msl * hd && pos < msl, "cache_write: bad shapes");
        let p = u32_of(pos);
        let mut b = self.args(&self.cache_write);
        b.arg(tensor).arg(row).arg(&self.n_kv).arg(&self.max_seq_len).arg(&self.hd).arg(&p);
        // SAFETY: cache_write_bf16(cache (n_kv, max_seq_len, hd), row (n_kv, hd), n_kv, max_seq_len,
        // hd, pos: u32); shapes checked above.
        unsafe { Self::launch(&self.cache_write, b, self.grid(row.len())) }
    }

    /// Full attention at `pos`: slots `[0, pos + 1)`, in three launches.
    fn attention(
        &self,
        q: &CudaSlice<bf16>,
        cache: &DeviceCache,
        pos: usize,
        scores: &mut CudaSlice<f32>,
        out: &mut CudaSlice<bf16>,
    ) -> Result<(), CudaError> {
        let (first, end) = (0u32, u32_of(pos + 1));
        assert!(end <= self.max_seq_len, "attention: slots past the cache");
        let (n_q, n_kv, msl, hd) = (&self.n_q, &self.n_kv, &self.max_seq_len, &self.hd);

        let mut b = self.args(&self.attn_scores);
        b.arg(&mut *scores).arg(q).arg(&cache.k).arg(n_q).arg(n_kv).arg(msl).arg(hd).arg(&first).arg(&end);
        // SAFETY: attn_scores_f32(s (n_q, max_seq_len), q (n_q, hd), k_cache (n_kv, max_seq_len, hd),
        // n_q, n_kv, max_seq_len, hd, first, end: u32); end <= max_seq_len.
        unsafe { Self::launch(&self.attn_scores, b, warps_grid((end.div_ceil(SCORE_WARPS), *n_q), SCORE_WARPS)) }?;

        let mut b = self.args(&self.softmax);
        b.arg(&mut *scores).arg(n_q).arg(msl).arg(&first).arg(&end);
        // SAFETY: softmax_f32(s (n_q, max_seq_len), n_q, max_seq_len, first, end: u32).
        unsafe { Self::launch(&self.softmax, b, warps_grid((*n_q, 1), SOFTMAX_BLOCK / WARP)) }?;

        let mut b = self.args(&self.attn_wsum);
        b.arg(out).arg(&*scores).arg(&cache.v).arg(n_q).arg(n_kv).arg(msl).arg(hd).arg(&first).arg(&end);
        // SAFETY: attn_wsum_bf16(a (n_q, hd), prob (n_q, max_seq_len), v_cache (n_kv, max_seq_len,
        // hd), n_q, n_kv, max_seq_len, hd, first, end: u32).
        unsafe { Self::launch(&self.attn_wsum, b, warps_grid((*n_q, (hd / 2).div_ceil(WARP)), WSUM_WARPS)) }
    }

    /// `(out (n), a (n), b (n), n: u32)`: add_bf16 or silu_mul_bf16.
    fn elementwise(
        &self,
        func: &Func,
        a: &CudaSlice<bf16>,
        b: &CudaSlice<bf16>,
        out: &mut CudaSlice<bf16>,
    ) -> Result<(), CudaError> {
        let len = out.len();
        assert!(a.len() == len && b.len() == len, "{}: lengths differ", func.name);
        let n = u32_of(len);
        let mut args = self.args(func);
        args.arg(out).arg(a).arg(b).arg(&n);
        // SAFETY: add_bf16 and silu_mul_bf16 are both (out (n), a (n), b (n), n: u32).
        unsafe { Self::launch(func, args, self.grid(len)) }
    }
}
