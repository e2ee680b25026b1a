//! The CPU golden model of one decode step, rounding where the eager GPU reference rounds; the same
//! step in exact f64 arithmetic to cross-check it; and the same step as other honest implementations
//! round it (the selftest's ensemble).
//!
//! Each op of the eager reference reads bf16 tensors and stores its result as bf16. The rounding
//! points of a step, in order:
//!
//! 1. `h = rmsnorm(x, in_norm)`
//! 2. `q`, `k`, `v`, the three GEMV outputs
//! 3. `q` and `k` after RoPE
//! 4. the K and V cache rows at `pos` (the roped `k` and `v`, already bf16, stored unchanged)
//! 5. `a`, the attention output
//! 6. `o = a @ Wo^T`
//! 7. `x1 = x + o`
//! 8. `h2 = rmsnorm(x1, post_norm)`
//! 9. `gate` and `up`
//! 10. `act = silu(gate) * up`
//! 11. `down = act @ Wdown^T`
//! 12. `x_out = x1 + down`
//!
//! Attention scores and softmax probabilities stay f32, never bf16. Every reduction (the norm's sum
//! of squares, dot products, the softmax sums) accumulates in f64, so the model's own summation error
//! is negligible next to the bf16 rounding it models.
//!
//! One body serves every model: values travel as f64 and a [`Rounding`] decides what each rounding
//! point ([`Point`]) does and how reductions add ([`Sum`]). f32 arithmetic is emulated as f64
//! arithmetic rounded to f32, which is the f32 result bit for bit for `+ - * /` and `sqrt` of f32
//! operands (53 >= 2 * 24 + 2 makes the double rounding innocuous).

use std::ops::Range;
use std::thread;

use half::bf16;
use spec::Config;
use spec::data::{self, Tensor};

pub mod ensemble;
mod rounding;
#[cfg(test)]
mod tests;

pub use rounding::{HONEST, Point, Precision, Rounding, Sum};

/// One layer's weights on the host, row-major with the shapes of [`Tensor::shape`]: matrices are
/// `(out, in)`.
pub type Weights = data::LayerWeights<Vec<bf16>>;

/// The seeded weights of [`spec::data`], bit for bit what the GPU fill kernels produce.
pub fn generate_weights(cfg: &Config, seed: u64) -> Weights {
    Weights::try_from_fn(|t| Ok::<_, std::convert::Infallible>(data::weight(cfg, seed, t)))
        .unwrap_or_else(|e| match e {})
}

/// The KV cache: K and V, each `(batch = 1, n_kv, max_seq_len, hd)` bf16.
#[derive(Debug, Clone, PartialEq)]
pub struct KvCache {
    pub k: Vec<bf16>,
    pub v: Vec<bf16>,
}

impl KvCache {
    /// The seeded prefix of [`spec::data`]: slots `[0, prefill)` filled, anchor keys included, zeros
    /// after.
    pub fn generate(cfg: &Config, seed: u64) -> Self {
        Self { k: data::cache(cfg, seed, Tensor::KCache), v: data::cache(cfg, seed, Tensor::VCache) }
    }
}

/// The flat range of slot `pos` of KV head `head` in a cache tensor (batch 1).
fn slot_range(cfg: &Config, head: usize, pos: usize) -> Range<usize> {
    let start = (head * cfg.max_seq_len + pos) * cfg.hd;
    start..start + cfg.hd
}

/// RoPE's cos and sin for every position, `(max_seq_len, hd / 2)` row-major. The GPU reference
/// uploads this table, so both rotate by the same f32 bits.
#[derive(Debug, Clone, PartialEq)]
pub struct RopeTable {
    pub cos: Vec<f32>,
    pub sin: Vec<f32>,
    /// `hd / 2`: the row length.
    pub half: usize,
}

impl RopeTable {
    /// cos and sin of the exact f64 angles, each rounded once to f32.
    pub fn new(cfg: &Config) -> Self {
        Self::from_inv_freq(cfg.max_seq_len, &inv_freq(cfg))
    }

    /// The table of `positions` rows whose angle `i` at position `pos` is `pos * inv_freq[i]` (in
    /// f64, rounded once to f32): for frequencies other than the layer's (a model's scaled RoPE).
    pub fn from_inv_freq(positions: usize, inv_freq: &[f64]) -> Self {
        let (mut cos, mut sin) = (Vec::new(), Vec::new());
        for pos in 0..positions {
            let exact = Rotation::at(pos, inv_freq);
            cos.extend(exact.cos.iter().map(|&c| c as f32));
            sin.extend(exact.sin.iter().map(|&s| s as f32));
        }
        Self { cos, sin, half: inv_freq.len() }
    }

    /// The table's row for `pos`.
    fn rotation(&self, pos: usize) -> Rotation {
        let row = |t: &[f32]| t[pos * self.half..(pos + 1) * self.half].iter().map(|&v| f64::from(v)).collect();
        Rotation { cos: row(&self.cos), sin: row(&self.sin) }
    }
}

/// cos and sin of one position's `hd / 2` angles.
struct Rotation {
    cos: Vec<f64>,
    sin: Vec<f64>,
}

/// RoPE's frequencies: `theta^(-2i / hd)` for `i < hd / 2`, in f64.
pub fn inv_freq(cfg: &Config) -> Vec<f64> {
    (0..cfg.hd / 2).map(|i| cfg.theta.powf(-2.0 * i as f64 / cfg.hd as f64)).collect()
}

impl Rotation {
    /// Angle `i` is `pos * theta^(-2i / hd)`, all in f64.
    fn exact(cfg: &Config, pos: usize) -> Self {
        Self::at(pos, &inv_freq(cfg))
    }

    /// Angle `i` is `pos * inv_freq[i]`, in f64.
    fn at(pos: usize, inv_freq: &[f64]) -> Self {
        let (cos, sin) = inv_freq
            .iter()
            .map(|f| {
                let angle = pos as f64 * f;
                (angle.cos(), angle.sin())
            })
            .unzip();
        Self { cos, sin }
    }

    /// Each cos and sin kept at `precision`.
    fn rounded(self, precision: Precision) -> Self {
        let round = |v: Vec<f64>| v.into_iter().map(|c| precision.round(c)).collect();
        Self { cos: round(self.cos), sin: round(self.sin) }
    }
}

/// Which cached slots a step attends over. The layer is [`AttentionSpan::Full`]; the others are
/// wrong answers, kept to show that the correctness gate rejects a step that cuts attention short.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttentionSpan {
    /// Slots `0..=pos`: the layer.
    Full,
    /// No slots: the attention output is zero, so `x1 = x`.
    Skip,
    /// The most recent quarter only: slots `(pos + 1) - (pos + 1) / 4 ..= pos`.
    RecentQuarter,
}

impl AttentionSpan {
    pub fn slots(self, pos: usize) -> Range<usize> {
        let end = pos + 1;
        match self {
            AttentionSpan::Full => 0..end,
            AttentionSpan::Skip => end..end,
            AttentionSpan::RecentQuarter => end - end / 4..end,
        }
    }
}

fn to_f64(x: &[bf16]) -> Vec<f64> {
    x.iter().map(|v| v.to_f64()).collect()
}

/// Exact for values that have passed a [`Precision::Bf16`] rounding point.
fn to_bf16(x: &[f64]) -> Vec<bf16> {
    x.iter().map(|&v| bf16::from_f64(v)).collect()
}

/// The step's output as the contract returns it: computed in f32, stored as bf16.
pub fn output_bf16(x: &[f64]) -> Vec<bf16> {
    x.iter().map(|&v| bf16::from_f32(v as f32)).collect()
}

/// `x * (1 / sqrt(mean(x^2) + eps)) * g`: the inverse root rounded at [`Point::Arithmetic`], the
/// normalised vector at [`Point::Normalised`], the result at [`Point::Normed`].
fn norm(r: &Rounding, x: &[f64], g: &[bf16], eps: f32) -> Vec<f64> {
    assert_eq!(x.len(), g.len(), "rmsnorm: x and g differ in length");
    let mean_square = r.dot(x.iter().map(|&v| (v, v))) / x.len() as f64;
    let inv_rms = r.round(Point::Arithmetic, 1.0 / (mean_square + f64::from(eps)).sqrt());
    x.iter()
        .zip(g)
        .map(|(&v, g)| r.round(Point::Normed, r.round(Point::Normalised, v * inv_rms) * g.to_f64()))
        .collect()
}

/// Below this many weights per thread, spawning costs more than it saves.
const MIN_WEIGHTS_PER_THREAD: usize = 1 << 18;

/// `y = W h` for row-major `W (rows, cols)`, each result rounded at `point`. Rows are split across
/// threads, but each row's dot product runs in one fixed order, so the result does not depend on the
/// thread count.
fn matvec(r: &Rounding, point: Point, w: &[bf16], rows: usize, cols: usize, h: &[f64]) -> Vec<f64> {
    assert_eq!((w.len(), h.len()), (rows * cols, cols), "gemv: matrix or vector of the wrong size");
    let threads = thread::available_parallelism().map_or(1, |n| n.get());
    let chunk = rows.div_ceil(threads).max(MIN_WEIGHTS_PER_THREAD.div_ceil(cols));
    let mut y = vec![0.0; rows];
    thread::scope(|s| {
        for (ys, ws) in y.chunks_mut(chunk).zip(w.chunks(chunk * cols)) {
            s.spawn(move || {
                for (y, row) in ys.iter_mut().zip(ws.chunks_exact(cols)) {
                    *y = r.round(point, r.dot(row.iter().map(|w| w.to_f64()).zip(h.iter().copied())));
                }
            });
        }
    });
    y
}

/// Rotate-half RoPE of every `hd`-long head of `v`, rounded at `point`: element `i < hd / 2` pairs
/// with `i + hd / 2`.
fn rotate(r: &Rounding, point: Point, v: &mut [f64], hd: usize, rot: &Rotation) {
    let f = |x: f64| r.round(Point::Arithmetic, x);
    for head in v.chunks_exact_mut(hd) {
        let (lo, hi) = head.split_at_mut(hd / 2);
        for (((a, b), &c), &s) in lo.iter_mut().zip(hi).zip(&rot.cos).zip(&rot.sin) {
            let (x, y) = (*a, *b);
            *a = r.round(point, f(x * c) - f(y * s));
            *b = r.round(point, f(y * c) + f(x * s));
        }
    }
}

/// What a step attends over: the cache, except that slot `pos` of every KV head holds this step's
/// own `k` and `v` (`n_kv * hd` each) as [`Point::OwnKv`] keeps them.
struct Context<'a> {
    cfg: &'a Config,
    cache: &'a KvCache,
    pos: usize,
    k: &'a [f64],
    v: &'a [f64],
}

impl Context<'_> {
    /// Slots `slots` of KV head `head` of the cache tensor `tensor`, `(slots.len(), hd)`, with slot
    /// `pos` taken from `own`.
    fn rows(&self, tensor: &[bf16], own: &[f64], head: usize, slots: Range<usize>) -> Vec<f64> {
        let hd = self.cfg.hd;
        let start = slot_range(self.cfg, head, slots.start).start;
        let mut rows = to_f64(&tensor[start..start + slots.len() * hd]);
        if slots.contains(&self.pos) {
            let at = (self.pos - slots.start) * hd;
            rows[at..at + hd].copy_from_slice(&own[head * hd..(head + 1) * hd]);
        }
        rows
    }
}

/// Softmax attention of every query head over `slots` of its KV head; an empty span contributes
/// nothing (zeros). The softmax subtracts the maximum score before exponentiating and normalises the
/// probabilities before weighting the values, as the eager reference does; a GPU's one-pass running
/// maximum with rescaling computes the same function and differs only in rounding.
fn attend(r: &Rounding, ctx: &Context, q: &[f64], slots: Range<usize>) -> Vec<f64> {
    let (cfg, hd) = (ctx.cfg, ctx.cfg.hd);
    let mut out = vec![0.0; cfg.q_dim()];
    if slots.is_empty() {
        return out;
    }
    let scale = (hd as f64).sqrt();
    let f = |x: f64| r.round(Point::Arithmetic, x);
    for head in 0..cfg.n_kv {
        let keys = ctx.rows(&ctx.cache.k, ctx.k, head, slots.clone());
        let values = ctx.rows(&ctx.cache.v, ctx.v, head, slots.clone());
        for j in head * cfg.group()..(head + 1) * cfg.group() {
            let qj = &q[j * hd..(j + 1) * hd];
            let scores: Vec<f64> = keys
                .chunks_exact(hd)
                .map(|k| r.round(Point::Scores, r.dot(qj.iter().copied().zip(k.iter().copied())) / scale))
                .collect();
            let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let weights: Vec<f64> = scores.iter().map(|&s| f(f(s - max).exp())).collect();
            let total = r.dot(weights.iter().map(|&w| (w, 1.0)));
            let probs: Vec<f64> = weights.iter().map(|&w| r.round(Point::Probs, w / total)).collect();
            for (e, o) in out[j * hd..(j + 1) * hd].iter_mut().enumerate() {
                let terms = probs.iter().zip(values.chunks_exact(hd)).map(|(&p, v)| (p, v[e]));
                *o = r.round(Point::Attended, r.dot(terms));
            }
        }
    }
    out
}

/// `silu(gate) * up` with `silu(g) = g / (1 + exp(-g))`, SiLU's parts rounded at
/// [`Point::Arithmetic`], SiLU at [`Point::Silu`], the product at [`Point::Act`].
fn swiglu(r: &Rounding, gate: &[f64], up: &[f64]) -> Vec<f64> {
    assert_eq!(gate.len(), up.len(), "silu_mul: operands differ in length");
    let f = |x: f64| r.round(Point::Arithmetic, x);
    gate.iter()
        .zip(up)
        .map(|(&g, &u)| r.round(Point::Act, r.round(Point::Silu, f(g / f(1.0 + f((-g).exp())))) * u))
        .collect()
}

/// `a + b`, each sum rounded at `point`.
fn residual(r: &Rounding, point: Point, a: &[f64], b: &[f64]) -> Vec<f64> {
    assert_eq!(a.len(), b.len(), "add: operands differ in length");
    a.iter().zip(b).map(|(a, b)| r.round(point, a + b)).collect()
}

/// One decode step at `pos` as `r` rounds it, rotating by `rot` and attending over `span`: writes the
/// roped k and v, as bf16, into slot `pos` of `cache` and returns `x_out` unrounded.
#[allow(clippy::too_many_arguments)]
/// Qwen3's per-head RMSNorm of the queries and the keys, between their projection and RoPE: each
/// head's `hd` values normalised as [`rmsnorm`] does, by these weights (`hd` each). The task's layer
/// has none.
#[derive(Debug, Clone, Copy)]
pub struct QkNorm<'a> {
    pub q: &'a [bf16],
    pub k: &'a [bf16],
}

/// `v`'s heads of `hd` values, each normalised by `g`.
fn norm_heads(r: &Rounding, v: &[f64], hd: usize, g: &[bf16], eps: f32) -> Vec<f64> {
    v.chunks(hd).flat_map(|head| norm(r, head, g, eps)).collect()
}

#[allow(clippy::too_many_arguments)]
fn layer(
    r: &Rounding,
    cfg: &Config,
    w: &Weights,
    cache: &mut KvCache,
    x: &[f64],
    pos: usize,
    rot: &Rotation,
    span: AttentionSpan,
    qk_norm: Option<QkNorm<'_>>,
) -> Vec<f64> {
    let (d, qd, kvd) = (cfg.d, cfg.q_dim(), cfg.kv_dim());
    let h = norm(r, x, &w.in_norm, cfg.eps);
    let mut q = matvec(r, Point::Projected, &w.q, qd, d, &h);
    let mut k = matvec(r, Point::Projected, &w.k, kvd, d, &h);
    let v = matvec(r, Point::Projected, &w.v, kvd, d, &h);
    if let Some(n) = qk_norm {
        q = norm_heads(r, &q, cfg.hd, n.q, cfg.eps);
        k = norm_heads(r, &k, cfg.hd, n.k, cfg.eps);
    }
    rotate(r, Point::RopedQ, &mut q, cfg.hd, rot);
    rotate(r, Point::RopedK, &mut k, cfg.hd, rot);
    append(cache, cfg, &to_bf16(&k), &to_bf16(&v), pos);
    let own = |t: &[f64]| -> Vec<f64> { t.iter().map(|&v| r.round(Point::OwnKv, v)).collect() };
    let (k, v) = (own(&k), own(&v));
    let a = attend(r, &Context { cfg, cache, pos, k: &k, v: &v }, &q, span.slots(pos));
    let x1 = residual(r, Point::Residual, x, &matvec(r, Point::OutProj, &w.o, d, qd, &a));
    let h2 = norm(r, &x1, &w.post_norm, cfg.eps);
    let gate = matvec(r, Point::GateUp, &w.gate, cfg.ffn, d, &h2);
    let up = matvec(r, Point::GateUp, &w.up, cfg.ffn, d, &h2);
    let act = swiglu(r, &gate, &up);
    residual(r, Point::Arithmetic, &x1, &matvec(r, Point::Down, &w.down, d, cfg.ffn, &act))
}

/// `rmsnorm(x, g)` as the eager reference computes it: `mean(x^2)` in f64, `1 / sqrt(mean + eps)`
/// rounded to f32, `(x * that) * g` in f32, stored as bf16.
pub fn rmsnorm(x: &[bf16], g: &[bf16], eps: f32) -> Vec<bf16> {
    to_bf16(&norm(&Rounding::EAGER, &to_f64(x), g, eps))
}

/// `y = W h` for row-major `W (rows, cols)`: each sum in f64, rounded to f32, stored as bf16.
pub fn gemv(w: &[bf16], rows: usize, cols: usize, h: &[bf16]) -> Vec<bf16> {
    to_bf16(&matvec(&Rounding::EAGER, Point::Projected, w, rows, cols, &to_f64(h)))
}

/// Rotate-half RoPE at `pos` of `heads` heads of size `hd`, in place, in f32 (no fused multiply-add)
/// by the table's cos and sin, stored as bf16.
pub fn rope(v: &mut [bf16], heads: usize, hd: usize, table: &RopeTable, pos: usize) {
    assert_eq!(v.len(), heads * hd, "rope: vector is not heads * hd long");
    let mut x = to_f64(v);
    rotate(&Rounding::EAGER, Point::RopedQ, &mut x, hd, &table.rotation(pos));
    v.copy_from_slice(&to_bf16(&x));
}

/// Writes `k` and `v` (`n_kv * hd` each) into slot `pos` of every KV head, and nothing else.
pub fn append(cache: &mut KvCache, cfg: &Config, k: &[bf16], v: &[bf16], pos: usize) {
    assert_eq!((k.len(), v.len()), (cfg.kv_dim(), cfg.kv_dim()), "append: k or v is not n_kv * hd long");
    for head in 0..cfg.n_kv {
        let own = head * cfg.hd..(head + 1) * cfg.hd;
        cache.k[slot_range(cfg, head, pos)].copy_from_slice(&k[own.clone()]);
        cache.v[slot_range(cfg, head, pos)].copy_from_slice(&v[own]);
    }
}

/// Slot `pos` of every KV head of a cache tensor, `(n_kv * hd)`.
fn slot_rows(cfg: &Config, tensor: &[bf16], pos: usize) -> Vec<f64> {
    (0..cfg.n_kv).flat_map(|head| to_f64(&tensor[slot_range(cfg, head, pos)])).collect()
}

/// `softmax(q . K[0..=pos] / sqrt(hd)) @ V[0..=pos]` per query head (query head `j` reads KV head
/// `j / group`), `(n_q * hd)`. Scores are f64 dot products rounded to f32, the softmax is f32 and the
/// weighted sum of values f64, stored as bf16. The cache must already hold slot `pos`.
pub fn attention(cfg: &Config, q: &[bf16], cache: &KvCache, pos: usize) -> Vec<bf16> {
    let (k, v) = (slot_rows(cfg, &cache.k, pos), slot_rows(cfg, &cache.v, pos));
    let ctx = Context { cfg, cache, pos, k: &k, v: &v };
    to_bf16(&attend(&Rounding::EAGER, &ctx, &to_f64(q), AttentionSpan::Full.slots(pos)))
}

/// `a + b` in f32, stored as bf16.
pub fn add(a: &[bf16], b: &[bf16]) -> Vec<bf16> {
    to_bf16(&residual(&Rounding::EAGER, Point::Residual, &to_f64(a), &to_f64(b)))
}

/// `silu(gate) * up` in f32, stored as bf16 once (the activation is one op boundary).
pub fn silu_mul(gate: &[bf16], up: &[bf16]) -> Vec<bf16> {
    to_bf16(&swiglu(&Rounding::EAGER, &to_f64(gate), &to_f64(up)))
}

/// One decode step at `pos` with the eager reference's rounding points: writes K and V at `pos` into
/// `cache` and returns `x_out` (`d`).
pub fn step(cfg: &Config, w: &Weights, cache: &mut KvCache, table: &RopeTable, x: &[bf16], pos: usize) -> Vec<bf16> {
    step_with(cfg, w, cache, table, x, pos, AttentionSpan::Full)
}

/// [`step`] of a layer with Qwen3's per-head q/k norms ([`QkNorm`]).
pub fn step_qk_norm(
    cfg: &Config,
    w: &Weights,
    qk_norm: QkNorm<'_>,
    cache: &mut KvCache,
    table: &RopeTable,
    x: &[bf16],
    pos: usize,
) -> Vec<bf16> {
    let rot = table.rotation(pos);
    output_bf16(&layer(&Rounding::EAGER, cfg, w, cache, &to_f64(x), pos, &rot, AttentionSpan::Full, Some(qk_norm)))
}

/// [`step`], attending over `span` instead of every cached slot.
pub fn step_with(
    cfg: &Config,
    w: &Weights,
    cache: &mut KvCache,
    table: &RopeTable,
    x: &[bf16],
    pos: usize,
    span: AttentionSpan,
) -> Vec<bf16> {
    output_bf16(&layer(&Rounding::EAGER, cfg, w, cache, &to_f64(x), pos, &table.rotation(pos), span, None))
}

/// One decode step at `pos` of an implementation that rounds as `r` says, with RoPE by the exact
/// angles rounded at [`Point::Arithmetic`] (for f32 arithmetic, the reference's table): writes the
/// roped k and v, as bf16, into slot `pos` of `cache` and returns `x_out` unrounded ([`output_bf16`]
/// gives what the implementation returns).
pub fn step_as(r: &Rounding, cfg: &Config, w: &Weights, cache: &mut KvCache, x: &[bf16], pos: usize) -> Vec<f64> {
    let rot = Rotation::exact(cfg, pos).rounded(r.at(Point::Arithmetic));
    layer(r, cfg, w, cache, &to_f64(x), pos, &rot, AttentionSpan::Full, None)
}

/// [`step`] in exact f64 arithmetic ([`Rounding::EXACT`]), with no rounding anywhere and RoPE by exact
/// angles rather than the f32 table: the weights, the cache and `x` are taken as exact values. Slot
/// `pos` holds the step's own unrounded k and v; `cache` is not written.
pub fn step_f64(cfg: &Config, w: &Weights, cache: &KvCache, x: &[bf16], pos: usize) -> Vec<f64> {
    step_as(&Rounding::EXACT, cfg, w, &mut cache.clone(), x, pos)
}
