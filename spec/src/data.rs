//! What the run's data is: every tensor of the layer, its shape, its stream of the RNG and its
//! distribution. The GPU fill kernels and the CPU golden model both read this recipe, so the same seed
//! gives the same bits on both.
//!
//! The recipe serves the correctness gate, which must pass every honest implementation with margin
//! and fail cheap work:
//!
//! - **Weights** scale like a trained model's (normal / sqrt(fan_in), norms near 1), with two gains
//!   that make the layer's own work most of its output: `Wo` at [`O_GAIN`], `Wdown` at [`DOWN_GAIN`].
//!   The MLP then carries most of `x_out`, so an error in it cannot hide behind the residual.
//! - **Outlier channels**, as in trained LLMs: one channel in every [`OUTLIER_SPACING`] of `d` and of
//!   `ffn` is read by weights [`OUTLIER_GAIN`] times larger than the rest, and fed by a norm weight or
//!   an `up` row as many times smaller ([`Tensor::layout`]): the layer's function is unchanged, but an
//!   int8 scale fitted to a row (or a group of columns) holding one of those entries rounds the rest
//!   to a few steps.
//! - **Massive activations**: a few channels of the input `x` hold [`MASSIVE_SHARE`] of its energy
//!   ([`massive_channels`]); they persist through the residual stream from call to call.
//! - **Anchor keys** make attention matter without large scores: in the oldest three quarters of the
//!   prefix, one key in every [`ANCHOR_SPACING`] per KV head has [`ANCHOR_KEY_STD`] times the others'
//!   standard deviation. Scores stay a few units (the background's with a standard deviation of 1,
//!   each head's largest 5 to 13 at the graded size), so a bf16 rounding of `q` moves the softmax
//!   little, yet most of its mass sits on far anchors: skipping attention, or attending only to recent
//!   positions, misses the tolerance by a wide margin.

use half::bf16;
use serde::Serialize;

use crate::Config;
use crate::rng::{normal_bf16, scale_for_std, stream_key};

/// Each block of this many slots of the oldest three quarters of the prefix holds one anchor key per
/// KV head.
pub const ANCHOR_SPACING: usize = 16;
/// Standard deviation of an anchor key's elements (the other keys and all values have 1).
pub const ANCHOR_KEY_STD: f64 = 3.0;
/// Standard deviation of the RMSNorm weights around their mean of 1.
pub const NORM_STD: f64 = 0.1;
/// Gain of the output projection `Wo` over the `1 / sqrt(fan_in)` of the other matrices.
pub const O_GAIN: f64 = 0.5;
/// Gain of the down projection `Wdown` over `1 / sqrt(fan_in)`.
pub const DOWN_GAIN: f64 = 1.75;
/// Each block of this many consecutive channels (of the model dimension `d`, or of the MLP's `ffn`)
/// holds exactly one outlier channel.
pub const OUTLIER_SPACING: usize = 256;
/// How many times larger the weights reading an outlier channel are, and smaller what feeds it.
pub const OUTLIER_GAIN: f64 = 64.0;
/// The input's massive-activation channels: the model dimension's outlier channels of the first this
/// many blocks.
pub const MASSIVE_CHANNELS: usize = 4;
/// The share of the input's expected sum of squares that its massive channels hold.
pub const MASSIVE_SHARE: f64 = 1.0 / 8.0;
/// Standard deviation of a massive channel's value, relative to its magnitude.
pub const MASSIVE_SPREAD: f64 = 1.0 / 8.0;
/// Stream of the anchor layout.
const ANCHOR_STREAM: u64 = 100;
/// The outlier channels are a property of the model's shape, the same for every seed (so that the
/// inputs, drawn from their own seed, know their massive channels): they come from this seed.
const LAYOUT_SEED: u64 = 0;
/// Streams of the outlier channels of `d` and of `ffn`.
const MODEL_OUTLIER_STREAM: u64 = 200;
const FFN_OUTLIER_STREAM: u64 = 201;
/// Streams of per-call inputs start here; call `c` of a run uses `INPUT_STREAM_BASE + c`.
pub const INPUT_STREAM_BASE: u64 = 1 << 32;

/// A dimension whose channels carry outliers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Axis {
    /// The model dimension `d`.
    Model,
    /// The MLP's intermediate dimension `ffn`.
    Ffn,
}

impl Axis {
    /// The RNG key of this axis' outlier layout.
    pub fn key(self) -> u64 {
        stream_key(LAYOUT_SEED, if self == Axis::Model { MODEL_OUTLIER_STREAM } else { FFN_OUTLIER_STREAM })
    }

    /// The outlier channel of block `b` ([`OUTLIER_SPACING`] channels from `b * OUTLIER_SPACING`) and
    /// the block's draw: the channel sits at offset `draw % OUTLIER_SPACING`.
    fn block(self, b: u64) -> (usize, u64) {
        let spacing = OUTLIER_SPACING as u64;
        let draw = crate::rng::bits(self.key(), b);
        ((b * spacing + draw % spacing) as usize, draw)
    }

    /// Whether channel `c` is the outlier channel of its block.
    pub fn is_outlier(self, c: usize) -> bool {
        self.block((c / OUTLIER_SPACING) as u64).0 == c
    }
}

/// Which rows and which columns of a tensor are outlier channels, and the factor that scales their
/// elements (an element in both an outlier row and an outlier column gets both factors).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Layout {
    pub rows: Option<(Axis, f64)>,
    pub cols: Option<(Axis, f64)>,
}

/// The layer's tensors in the order of the contract (docs/task.md), plus the two cache tensors.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
pub enum Tensor {
    InNorm,
    PostNorm,
    Wq,
    Wk,
    Wv,
    Wo,
    Wgate,
    Wup,
    Wdown,
    KCache,
    VCache,
}

/// One layer's nine weights, each a `T`: host vectors for the golden model, device buffers for the GPU.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayerWeights<T> {
    pub in_norm: T,
    pub post_norm: T,
    pub q: T,
    pub k: T,
    pub v: T,
    pub o: T,
    pub gate: T,
    pub up: T,
    pub down: T,
}

impl<T> LayerWeights<T> {
    /// Each weight made by `f`, in the order of [`Tensor::WEIGHTS`]; the first error stops it.
    pub fn try_from_fn<E>(mut f: impl FnMut(Tensor) -> Result<T, E>) -> Result<Self, E> {
        Ok(Self {
            in_norm: f(Tensor::InNorm)?,
            post_norm: f(Tensor::PostNorm)?,
            q: f(Tensor::Wq)?,
            k: f(Tensor::Wk)?,
            v: f(Tensor::Wv)?,
            o: f(Tensor::Wo)?,
            gate: f(Tensor::Wgate)?,
            up: f(Tensor::Wup)?,
            down: f(Tensor::Wdown)?,
        })
    }

    /// Each weight through `f`, in the order of [`Tensor::WEIGHTS`].
    pub fn map<U>(self, mut f: impl FnMut(T) -> U) -> LayerWeights<U> {
        LayerWeights {
            in_norm: f(self.in_norm),
            post_norm: f(self.post_norm),
            q: f(self.q),
            k: f(self.k),
            v: f(self.v),
            o: f(self.o),
            gate: f(self.gate),
            up: f(self.up),
            down: f(self.down),
        }
    }

    /// The weight `t` (not a cache tensor), to change.
    pub fn get_mut(&mut self, t: Tensor) -> &mut T {
        match t {
            Tensor::InNorm => &mut self.in_norm,
            Tensor::PostNorm => &mut self.post_norm,
            Tensor::Wq => &mut self.q,
            Tensor::Wk => &mut self.k,
            Tensor::Wv => &mut self.v,
            Tensor::Wo => &mut self.o,
            Tensor::Wgate => &mut self.gate,
            Tensor::Wup => &mut self.up,
            Tensor::Wdown => &mut self.down,
            Tensor::KCache | Tensor::VCache => panic!("{} is a cache tensor", t.name()),
        }
    }

    /// The weight `t` (not a cache tensor).
    pub fn get(&self, t: Tensor) -> &T {
        match t {
            Tensor::InNorm => &self.in_norm,
            Tensor::PostNorm => &self.post_norm,
            Tensor::Wq => &self.q,
            Tensor::Wk => &self.k,
            Tensor::Wv => &self.v,
            Tensor::Wo => &self.o,
            Tensor::Wgate => &self.gate,
            Tensor::Wup => &self.up,
            Tensor::Wdown => &self.down,
            Tensor::KCache | Tensor::VCache => panic!("{} is a cache tensor", t.name()),
        }
    }
}

/// A normal distribution as the RNG draws it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Dist {
    pub mean: f32,
    pub std: f64,
}

impl Dist {
    /// The f32 multiplier the fill uses (see [`crate::rng::normal_f32`]).
    pub fn scale(&self) -> f32 {
        scale_for_std(self.std)
    }
}

impl Tensor {
    /// The nine weights: every tensor but the two cache tensors, which come last in [`Tensor::ALL`].
    pub const WEIGHTS: &'static [Tensor] = Tensor::ALL.split_at(9).0;
    pub const ALL: [Tensor; 11] = [
        Tensor::InNorm,
        Tensor::PostNorm,
        Tensor::Wq,
        Tensor::Wk,
        Tensor::Wv,
        Tensor::Wo,
        Tensor::Wgate,
        Tensor::Wup,
        Tensor::Wdown,
        Tensor::KCache,
        Tensor::VCache,
    ];

    /// The contract's name of the tensor.
    pub fn name(self) -> &'static str {
        match self {
            Tensor::InNorm => "in_norm",
            Tensor::PostNorm => "post_norm",
            Tensor::Wq => "q",
            Tensor::Wk => "k",
            Tensor::Wv => "v",
            Tensor::Wo => "o",
            Tensor::Wgate => "gate",
            Tensor::Wup => "up",
            Tensor::Wdown => "down",
            Tensor::KCache => "k_cache",
            Tensor::VCache => "v_cache",
        }
    }

    /// The RNG stream of the tensor: fixed forever (pinned by a test).
    pub fn stream(self) -> u64 {
        Tensor::ALL.iter().position(|&t| t == self).unwrap() as u64 + 1
    }

    /// Row-major shape; matrices are `(out, in)`, applied as `h @ W^T`.
    pub fn shape(self, cfg: &Config) -> Vec<usize> {
        let (d, ffn, q, kv) = (cfg.d, cfg.ffn, cfg.q_dim(), cfg.kv_dim());
        match self {
            Tensor::InNorm | Tensor::PostNorm => vec![d],
            Tensor::Wq => vec![q, d],
            Tensor::Wk | Tensor::Wv => vec![kv, d],
            Tensor::Wo => vec![d, q],
            Tensor::Wgate | Tensor::Wup => vec![ffn, d],
            Tensor::Wdown => vec![d, ffn],
            Tensor::KCache | Tensor::VCache => vec![cfg.batch, cfg.n_kv, cfg.max_seq_len, cfg.hd],
        }
    }

    pub fn elems(self, cfg: &Config) -> usize {
        self.shape(cfg).iter().product()
    }

    /// The distribution of the tensor's elements outside outlier channels; for K, that of the
    /// non-anchor keys.
    pub fn dist(self, cfg: &Config) -> Dist {
        match self {
            Tensor::InNorm | Tensor::PostNorm => Dist { mean: 1.0, std: NORM_STD },
            Tensor::KCache | Tensor::VCache => Dist { mean: 0.0, std: 1.0 },
            _ => {
                let fan_in = self.shape(cfg)[1];
                let gain = match self {
                    Tensor::Wo => O_GAIN,
                    Tensor::Wdown => DOWN_GAIN,
                    _ => 1.0,
                };
                Dist { mean: 0.0, std: gain / (fan_in as f64).sqrt() }
            }
        }
    }

    /// The outlier layout: the post-attention norm damps the model's outlier channels, which `Wgate`
    /// and `Wup` read with large columns; `Wup` damps the MLP's outlier channels, which `Wdown` reads
    /// with large columns. The layer computes the same function as without them (a per-channel scale
    /// moved from one tensor to the next, as smoothing a trained model does), but every row of the
    /// three MLP matrices, and one group of columns in every few, now holds entries
    /// [`OUTLIER_GAIN`] times the rest.
    pub fn layout(self) -> Layout {
        let (up, down) = (OUTLIER_GAIN, 1.0 / OUTLIER_GAIN);
        let (rows, cols) = match self {
            Tensor::PostNorm => (None, Some((Axis::Model, down))),
            Tensor::Wgate => (None, Some((Axis::Model, up))),
            Tensor::Wup => (Some((Axis::Ffn, down)), Some((Axis::Model, up))),
            Tensor::Wdown => (None, Some((Axis::Ffn, up))),
            _ => (None, None),
        };
        Layout { rows, cols }
    }

    /// `(rows, cols)` of a weight: a vector is one row.
    pub fn matrix(self, cfg: &Config) -> (usize, usize) {
        match self.shape(cfg)[..] {
            [n] => (1, n),
            [rows, cols] => (rows, cols),
            _ => panic!("{} is not a weight", self.name()),
        }
    }

    /// The f32 mean and scale the fill uses for each class of element: class `2 * (in an outlier row)
    /// + (in an outlier column)`.
    pub fn classes(self, cfg: &Config) -> [(f32, f32); 4] {
        let (dist, layout) = (self.dist(cfg), self.layout());
        let gain = |side: Option<(Axis, f64)>, on: bool| if on { side.map_or(1.0, |s| s.1) } else { 1.0 };
        std::array::from_fn(|class| {
            let g = gain(layout.rows, class & 2 != 0) * gain(layout.cols, class & 1 != 0);
            ((f64::from(dist.mean) * g) as f32, scale_for_std(dist.std * g))
        })
    }
}

/// Whether each of `n` channels is an outlier of `side`'s axis (none without a side).
fn outlier_flags(side: Option<(Axis, f64)>, n: usize) -> Vec<bool> {
    (0..n).map(|c| side.is_some_and(|(axis, _)| axis.is_outlier(c))).collect()
}

/// The weight seed of layer `l` of a stack whose run has weight seed `seed`: the seed itself for the
/// first layer (so layer 0 of `stack-70b` is the graded layer of the same seed), and for the others a
/// mix of both, so that the stacks of two neighbouring seeds share no layer.
pub fn layer_seed(seed: u64, l: usize) -> u64 {
    if l == 0 {
        return seed;
    }
    // splitmix64's finaliser over the seed mixed with the layer's multiple of the golden ratio.
    let mut z = seed ^ (l as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The RNG key of the anchor layout of `seed`.
pub fn anchor_key(seed: u64) -> u64 {
    stream_key(seed, ANCHOR_STREAM)
}

/// Whether slot `p` of KV head `head` holds an anchor key: in the oldest three quarters of the
/// prefix, each block of [`ANCHOR_SPACING`] slots holds one, at the offset its draw picks.
pub fn is_anchor(cfg: &Config, seed: u64, head: usize, p: usize) -> bool {
    let spacing = ANCHOR_SPACING as u64;
    let draw = crate::rng::bits(anchor_key(seed), ((head as u64) << 32) | (p as u64 / spacing));
    p < 3 * cfg.prefill / 4 && p as u64 % spacing == draw % spacing
}

/// A whole weight tensor on the CPU: element `i` draws counter index `i` with its class's mean and
/// scale ([`Tensor::classes`]).
pub fn weight(cfg: &Config, seed: u64, tensor: Tensor) -> Vec<bf16> {
    assert!(!matches!(tensor, Tensor::KCache | Tensor::VCache), "{} is a cache tensor", tensor.name());
    let key = stream_key(seed, tensor.stream());
    let classes = tensor.classes(cfg);
    let ((rows, cols), layout) = (tensor.matrix(cfg), tensor.layout());
    let (row_flags, col_flags) = (outlier_flags(layout.rows, rows), outlier_flags(layout.cols, cols));
    generate_parallel(rows * cols, |i| {
        let (r, c) = (i as usize / cols, i as usize % cols);
        let (mean, scale) = classes[2 * usize::from(row_flags[r]) + usize::from(col_flags[c])];
        normal_bf16(key, i, mean, scale)
    })
}

/// `(0..n).map(f)`, split over the machine's cores: a full-size layer is 856 M elements. Each
/// element depends only on its index, so the split cannot change a bit.
fn generate_parallel(n: usize, f: impl Fn(u64) -> bf16 + Sync) -> Vec<bf16> {
    let threads = std::thread::available_parallelism().map_or(1, |t| t.get());
    let mut out = vec![bf16::ZERO; n];
    let chunk = n.div_ceil(threads).max(1 << 16);
    std::thread::scope(|s| {
        for (c, part) in out.chunks_mut(chunk).enumerate() {
            let f = &f;
            s.spawn(move || {
                let base = (c * chunk) as u64;
                part.iter_mut().enumerate().for_each(|(i, v)| *v = f(base + i as u64));
            });
        }
    });
    out
}

/// A whole cache tensor on the CPU: the prefix in slots `[0, prefill)`, zeros after. Element
/// `((b * n_kv + h) * max_seq_len + p) * hd + e` draws counter index equal to its flat index.
pub fn cache(cfg: &Config, seed: u64, tensor: Tensor) -> Vec<bf16> {
    assert!(matches!(tensor, Tensor::KCache | Tensor::VCache));
    let key = stream_key(seed, tensor.stream());
    let normal = tensor.dist(cfg).scale();
    let anchor = if tensor == Tensor::KCache { scale_for_std(ANCHOR_KEY_STD) } else { normal };
    let mut out = vec![bf16::ZERO; tensor.elems(cfg)];
    for (row, chunk) in out.chunks_mut(cfg.hd).enumerate() {
        let (h, p) = ((row / cfg.max_seq_len) % cfg.n_kv, row % cfg.max_seq_len);
        if p >= cfg.prefill {
            continue;
        }
        let scale = if is_anchor(cfg, seed, h, p) { anchor } else { normal };
        for (e, v) in chunk.iter_mut().enumerate() {
            *v = normal_bf16(key, (row * cfg.hd + e) as u64, 0.0, scale);
        }
    }
    out
}

/// The input's massive-activation channels with the mean of each (its sign is the top bit of its
/// block's draw): the model dimension's outlier channels of the first [`MASSIVE_CHANNELS`] blocks,
/// holding [`MASSIVE_SHARE`] of the input's expected sum of squares together.
pub fn massive_channels(cfg: &Config) -> Vec<(usize, f32)> {
    let channels: Vec<(usize, u64)> =
        (0..MASSIVE_CHANNELS as u64).map(|b| Axis::Model.block(b)).filter(|&(c, _)| c < cfg.d).collect();
    let magnitude = massive_magnitude(cfg.d, channels.len());
    channels.into_iter().map(|(c, draw)| (c, if draw >> 63 == 1 { -magnitude } else { magnitude })).collect()
}

/// The magnitude of each of `n` massive channels among `d`, for [`MASSIVE_SHARE`] of the energy.
fn massive_magnitude(d: usize, n: usize) -> f32 {
    (MASSIVE_SHARE / (1.0 - MASSIVE_SHARE) * d as f64 / n.max(1) as f64).sqrt() as f32
}

/// The input `x` of call `call` of a run, `(batch, d)`, from the run's input seed: unit normal, but
/// for the massive channels ([`massive_channels`]), drawn around their means with a standard deviation
/// of [`MASSIVE_SPREAD`] times their magnitude.
pub fn input(cfg: &Config, input_seed: u64, call: usize) -> Vec<bf16> {
    let key = stream_key(input_seed, INPUT_STREAM_BASE + call as u64);
    let scale = scale_for_std(1.0);
    let mut x: Vec<bf16> = (0..(cfg.batch * cfg.d) as u64).map(|i| normal_bf16(key, i, 0.0, scale)).collect();
    for (c, mean) in massive_channels(cfg) {
        let spread = scale_for_std(MASSIVE_SPREAD * f64::from(mean.abs()));
        for b in 0..cfg.batch {
            let i = b * cfg.d + c;
            x[i] = normal_bf16(key, i as u64, mean, spread);
        }
    }
    x
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Layer 0 keeps the run's seed; every layer of a stack gets its own, and the stacks of
    /// neighbouring seeds share none.
    #[test]
    fn layer_seeds_are_the_seed_then_distinct() {
        for seed in [0u64, 1, 0x5EED, crate::DEFAULT_SEED, u64::MAX] {
            assert_eq!(layer_seed(seed, 0), seed);
            let mine: std::collections::HashSet<u64> =
                (0..crate::config::MAX_LAYERS).map(|l| layer_seed(seed, l)).collect();
            assert_eq!(mine.len(), crate::config::MAX_LAYERS, "seed {seed}");
            let next: std::collections::HashSet<u64> =
                (0..crate::config::MAX_LAYERS).map(|l| layer_seed(seed.wrapping_add(1), l)).collect();
            assert!(mine.is_disjoint(&next), "seed {seed}");
        }
    }

    #[test]
    fn streams_are_pinned_and_distinct() {
        let streams: Vec<u64> = Tensor::ALL.iter().map(|t| t.stream()).collect();
        assert_eq!(streams, (1..=11).collect::<Vec<u64>>());
    }

    /// Mean square of the elements `keep` selects, in f64.
    fn mean_square(v: &[bf16], keep: impl Fn(usize) -> bool) -> f64 {
        let kept: Vec<f64> = v.iter().enumerate().filter(|(i, _)| keep(*i)).map(|(_, x)| x.to_f64().powi(2)).collect();
        kept.iter().sum::<f64>() / kept.len() as f64
    }

    #[test]
    fn weights_scale_like_a_model_with_outlier_channels() {
        let cfg = Config::small();
        let (d, ffn) = (cfg.d, cfg.ffn);
        let down = weight(&cfg, 1, Tensor::Wdown);
        let (plain, outlier) = (DOWN_GAIN * DOWN_GAIN / ffn as f64, (DOWN_GAIN * OUTLIER_GAIN).powi(2) / ffn as f64);
        let var = mean_square(&down, |i| !Axis::Ffn.is_outlier(i % ffn));
        assert!((var / plain - 1.0).abs() < 0.05, "down: var {var} want {plain}");
        let var = mean_square(&down, |i| Axis::Ffn.is_outlier(i % ffn));
        assert!((var / outlier - 1.0).abs() < 0.1, "down's outlier columns: var {var} want {outlier}");
        // Up's outlier rows are damped as much as its outlier columns are amplified.
        let up = weight(&cfg, 1, Tensor::Wup);
        let var = mean_square(&up, |i| Axis::Ffn.is_outlier(i / d) && !Axis::Model.is_outlier(i % d));
        let want = 1.0 / (OUTLIER_GAIN * OUTLIER_GAIN * d as f64);
        assert!((var / want - 1.0).abs() < 0.1, "up's outlier rows: var {var} want {want}");
        let g = weight(&cfg, 1, Tensor::PostNorm);
        let mean =
            g.iter().enumerate().filter(|(c, _)| !Axis::Model.is_outlier(*c)).map(|(_, v)| v.to_f64()).sum::<f64>()
                / (d - d / OUTLIER_SPACING) as f64;
        assert!((mean - 1.0).abs() < 0.02, "{mean}");
        for (c, v) in g.iter().enumerate().filter(|(c, _)| Axis::Model.is_outlier(*c)) {
            assert!((v.to_f64() * OUTLIER_GAIN - 1.0).abs() < 0.5, "post_norm[{c}] = {v}");
        }
    }

    #[test]
    fn each_block_of_channels_has_one_outlier() {
        for axis in [Axis::Model, Axis::Ffn] {
            for block in 0..64 {
                let channels = block * OUTLIER_SPACING..(block + 1) * OUTLIER_SPACING;
                assert_eq!(channels.filter(|&c| axis.is_outlier(c)).count(), 1, "{axis:?} block {block}");
            }
        }
        let offsets: Vec<usize> = (0..OUTLIER_SPACING * 8).filter(|&c| Axis::Model.is_outlier(c)).collect();
        assert!(offsets.windows(2).any(|w| w[1] - w[0] != OUTLIER_SPACING), "offsets vary: {offsets:?}");
    }

    #[test]
    fn cache_has_anchors_in_the_far_prefix_and_zeros_after() {
        let cfg = Config::small();
        let (seed, far) = (9, 3 * cfg.prefill / 4);
        let k = cache(&cfg, seed, Tensor::KCache);
        let row_ms = |h: usize, p: usize| {
            let base = (h * cfg.max_seq_len + p) * cfg.hd;
            mean_square(&k[base..base + cfg.hd], |_| true)
        };
        for h in 0..cfg.n_kv {
            let anchors: Vec<usize> = (0..cfg.prefill).filter(|&p| is_anchor(&cfg, seed, h, p)).collect();
            assert_eq!(anchors.len(), far / ANCHOR_SPACING, "head {h}: {anchors:?}");
            assert!(anchors.iter().all(|&p| p < far));
            let ms = |slots: &mut dyn Iterator<Item = usize>| {
                let v: Vec<f64> = slots.map(|p| row_ms(h, p)).collect();
                v.iter().sum::<f64>() / v.len() as f64
            };
            let anchor_ms = ms(&mut anchors.iter().copied());
            assert!(
                (anchor_ms / (ANCHOR_KEY_STD * ANCHOR_KEY_STD) - 1.0).abs() < 0.1,
                "anchor mean square {anchor_ms}"
            );
            let plain_ms = ms(&mut (0..cfg.prefill).filter(|p| !anchors.contains(p)));
            assert!((plain_ms - 1.0).abs() < 0.05, "plain mean square {plain_ms}");
        }
        assert!(k[cfg.prefill * cfg.hd..cfg.max_seq_len * cfg.hd].iter().all(|v| v.to_f32() == 0.0));
        assert_ne!(cache(&cfg, seed + 1, Tensor::KCache), k);
    }

    #[test]
    fn inputs_carry_their_massive_channels() {
        for cfg in [Config::tiny(), Config::small(), Config::graded()] {
            let massive = massive_channels(&cfg);
            assert_eq!(massive.len(), MASSIVE_CHANNELS.min(cfg.d / OUTLIER_SPACING), "{}", cfg.name);
            assert!(massive.iter().all(|&(c, _)| Axis::Model.is_outlier(c)));
            let calls = 64;
            let (mut massive_energy, mut total) = (0.0, 0.0);
            for call in 0..calls {
                let x = input(&cfg, 5, call);
                for &(c, mean) in &massive {
                    let v = x[c].to_f32();
                    assert!((v / mean - 1.0).abs() < 0.5, "{}: x[{c}] = {v}, mean {mean}", cfg.name);
                    massive_energy += f64::from(v * v);
                }
                total += mean_square(&x, |_| true) * cfg.d as f64;
            }
            let share = massive_energy / total;
            assert!((share / MASSIVE_SHARE - 1.0).abs() < 0.1, "{}: massive share {share}", cfg.name);
        }
    }

    /// `docs/task.md` ("The data") states this recipe: every number it quotes must be the code's.
    #[test]
    fn the_task_document_states_this_recipe() {
        // Line breaks and indents as single spaces, so that the prose may be rewrapped.
        let doc = include_str!("../../docs/task.md").split_whitespace().collect::<Vec<_>>().join(" ");
        let cfg = Config::graded();
        let has = |quoted: String| assert!(doc.contains(&quoted), "docs/task.md lacks '{quoted}'");
        // An outlier factor as the document writes it: 64x, 1/64x.
        let factor = |g: f64| if g >= 1.0 { format!("{g}x") } else { format!("1/{}x", 1.0 / g) };
        let names: Vec<String> = Tensor::ALL.iter().map(|t| format!("`{}`", t.name())).collect();
        let streams: Vec<u64> = Tensor::ALL.iter().map(|t| t.stream()).collect();
        has(format!("streams {} to {} in the order {}", streams[0], streams[10], names.join(", ")));
        assert_eq!(streams, (streams[0]..=streams[10]).collect::<Vec<_>>());
        // The table: one row per weight, from its distribution and its outlier layout.
        for &t in Tensor::WEIGHTS {
            let dist = t.dist(&cfg);
            let std = match t.shape(&cfg)[..] {
                [_] => format!("{}", dist.std),
                [_, fan_in] => {
                    let gain = (dist.std * (fan_in as f64).sqrt() * 1e9).round() / 1e9;
                    format!("{gain}/sqrt(fan_in)")
                }
                _ => unreachable!(),
            };
            let layout = t.layout();
            let side = |what: &str, side: Option<(Axis, f64)>| {
                side.map(|(axis, g)| {
                    let axis = if axis == Axis::Model { "d" } else { "ffn" };
                    format!("{what} at the outlier channels of `{axis}`: {}", factor(g))
                })
            };
            let cols = if t.shape(&cfg).len() == 1 { "elements" } else { "columns" };
            let outliers: Vec<String> =
                [side("rows", layout.rows), side(cols, layout.cols)].into_iter().flatten().collect();
            let outliers = if outliers.is_empty() { "-".to_string() } else { outliers.join("; ") };
            has(format!("| `{}` | {} | {std} | {outliers} |", t.name(), dist.mean));
        }
        let (k, v) = (Tensor::KCache.dist(&cfg), Tensor::VCache.dist(&cfg));
        has(format!("| `k_cache` prefix | {} | {} (anchor keys {ANCHOR_KEY_STD}) | - |", k.mean, k.std));
        has(format!("| `v_cache` prefix | {} | {} | - |", v.mean, v.std));
        // The gains, the outliers, the massive activations and the anchors, in prose.
        has(format!("`Wo` at {O_GAIN}x"));
        has(format!("`Wdown` at {DOWN_GAIN}x"));
        has(format!("one channel in every {OUTLIER_SPACING} of `d` and of `ffn`"));
        has(format!("each block of {OUTLIER_SPACING} consecutive channels holds exactly one"));
        has(format!("entries {} the rest", factor(OUTLIER_GAIN)));
        has(format!("seed {LAYOUT_SEED}, streams {MODEL_OUTLIER_STREAM} and {FFN_OUTLIER_STREAM}"));
        has(format!("the first {MASSIVE_CHANNELS} blocks"));
        let count = |c: &Config| massive_channels(c).len();
        has(format!("{} channels at the graded size and `small`, {} at `tiny`", count(&cfg), count(&Config::tiny())));
        assert_eq!(count(&Config::small()), count(&cfg));
        has(format!("hold 1/{} of the input's expected", 1.0 / MASSIVE_SHARE));
        has(format!("d·(1/{})/({}/{})", 1.0 / MASSIVE_SHARE, 1.0 / MASSIVE_SHARE - 1.0, 1.0 / MASSIVE_SHARE));
        has(format!("standard deviation m/{}", 1.0 / MASSIVE_SPREAD));
        has(format!("m ≈ {:.1} at the graded size", massive_channels(&cfg)[0].1.abs()));
        let anchors: Vec<usize> = (0..cfg.prefill).filter(|&p| is_anchor(&cfg, 1, 0, p)).collect();
        let far = (anchors[anchors.len() - 1] / ANCHOR_SPACING + 1) * ANCHOR_SPACING;
        assert_eq!(far, 3 * cfg.prefill / 4, "the oldest three quarters");
        has("in the oldest three quarters of the prefix".into());
        has(format!("(slots 0..{} at the graded size), each block of {ANCHOR_SPACING} slots", far - 1));
        has(format!("stream {ANCHOR_STREAM} of the public seed"));
        has(format!("standard deviation {ANCHOR_KEY_STD} where every other key and every value has {}", k.std));
        has(format!("{} anchors per KV head at the graded size", anchors.len()));
        assert_eq!(INPUT_STREAM_BASE, 1 << INPUT_STREAM_BASE.trailing_zeros());
        has(format!("draws stream 2^{} + c of the run's secret input seed", INPUT_STREAM_BASE.trailing_zeros()));
    }

    #[test]
    fn inputs_differ_per_call_and_seed() {
        let cfg = Config::tiny();
        assert_ne!(input(&cfg, 1, 0), input(&cfg, 1, 1));
        assert_ne!(input(&cfg, 1, 0), input(&cfg, 2, 0));
    }
}
