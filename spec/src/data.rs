//! What the run's data is: every tensor of the layer, its shape, its stream of the RNG and its
//! distribution. The GPU fill kernels and the CPU golden model both read this recipe, so the same seed
//! gives the same bits on both.
//!
//! Weights scale like a trained model's (normal / sqrt(fan_in), norms near 1). The KV prefix makes
//! attention matter: per KV head, [`ANCHORS_PER_HEAD`] keys at random positions in the oldest three
//! quarters of the prefix are [`ANCHOR_KEY_STD`] times larger than the rest, so every query head has a
//! few far positions with scores far above the background, and the softmax mass sits there. Skipping
//! attention, or attending only to recent positions, then changes the output by far more than the
//! tolerance.

use half::bf16;
use serde::Serialize;

use crate::Config;
use crate::rng::{normal_bf16, scale_for_std, stream_key};

/// Large keys per KV head.
pub const ANCHORS_PER_HEAD: usize = 8;
/// Standard deviation of an anchor key's elements (the other keys and all values have 1).
pub const ANCHOR_KEY_STD: f64 = 8.0;
/// Standard deviation of the RMSNorm weights around their mean of 1.
pub const NORM_STD: f64 = 0.1;
/// Stream of the anchor positions.
const ANCHOR_STREAM: u64 = 100;
/// Streams of per-call inputs start here; call `c` of a run uses `INPUT_STREAM_BASE + c`.
pub const INPUT_STREAM_BASE: u64 = 1 << 32;

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

    /// The distribution of the tensor's elements; for K, that of the non-anchor keys.
    pub fn dist(self, cfg: &Config) -> Dist {
        match self {
            Tensor::InNorm | Tensor::PostNorm => Dist { mean: 1.0, std: NORM_STD },
            Tensor::KCache | Tensor::VCache => Dist { mean: 0.0, std: 1.0 },
            _ => {
                let fan_in = self.shape(cfg)[1];
                Dist { mean: 0.0, std: 1.0 / (fan_in as f64).sqrt() }
            }
        }
    }
}

/// The anchor positions of every KV head, `(n_kv, ANCHORS_PER_HEAD)` row-major, each in
/// `[0, 3 * prefill / 4)`. Duplicates are allowed; they only make that position an anchor once.
pub fn anchor_positions(cfg: &Config, seed: u64) -> Vec<u32> {
    let key = stream_key(seed, ANCHOR_STREAM);
    let far = (3 * cfg.prefill / 4).max(1) as u64;
    (0..cfg.n_kv * ANCHORS_PER_HEAD).map(|i| (crate::rng::bits(key, i as u64) % far) as u32).collect()
}

/// Element `index` of a weight tensor (not a cache tensor).
pub fn weight_elem(cfg: &Config, seed: u64, tensor: Tensor, index: usize) -> bf16 {
    debug_assert!(!matches!(tensor, Tensor::KCache | Tensor::VCache));
    let dist = tensor.dist(cfg);
    normal_bf16(stream_key(seed, tensor.stream()), index as u64, dist.mean, dist.scale())
}

/// A whole weight tensor on the CPU.
pub fn weight(cfg: &Config, seed: u64, tensor: Tensor) -> Vec<bf16> {
    let dist = tensor.dist(cfg);
    let key = stream_key(seed, tensor.stream());
    let (mean, scale) = (dist.mean, dist.scale());
    generate_parallel(tensor.elems(cfg), |i| normal_bf16(key, i, mean, scale))
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
pub fn cache(cfg: &Config, seed: u64, tensor: Tensor, anchors: &[u32]) -> Vec<bf16> {
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
        let is_anchor = anchors[h * ANCHORS_PER_HEAD..(h + 1) * ANCHORS_PER_HEAD].contains(&(p as u32));
        let scale = if is_anchor { anchor } else { normal };
        for (e, v) in chunk.iter_mut().enumerate() {
            *v = normal_bf16(key, (row * cfg.hd + e) as u64, 0.0, scale);
        }
    }
    out
}

/// The input `x` of call `call` of a run, `(batch, d)`, from the run's input seed.
pub fn input(cfg: &Config, input_seed: u64, call: usize) -> Vec<bf16> {
    let key = stream_key(input_seed, INPUT_STREAM_BASE + call as u64);
    let scale = scale_for_std(1.0);
    (0..(cfg.batch * cfg.d) as u64).map(|i| normal_bf16(key, i, 0.0, scale)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn streams_are_pinned_and_distinct() {
        let streams: Vec<u64> = Tensor::ALL.iter().map(|t| t.stream()).collect();
        assert_eq!(streams, (1..=11).collect::<Vec<u64>>());
    }

    #[test]
    fn weights_scale_like_a_model() {
        let cfg = Config::tiny();
        let w = weight(&cfg, 1, Tensor::Wdown);
        let var = w.iter().map(|v| (v.to_f32() as f64).powi(2)).sum::<f64>() / w.len() as f64;
        let want = 1.0 / cfg.ffn as f64;
        assert!((var / want - 1.0).abs() < 0.05, "var {var} want {want}");
        let g = weight(&cfg, 1, Tensor::InNorm);
        let mean = g.iter().map(|v| v.to_f32() as f64).sum::<f64>() / g.len() as f64;
        assert!((mean - 1.0).abs() < 0.02, "{mean}");
    }

    #[test]
    fn cache_has_anchors_in_the_far_prefix_and_zeros_after() {
        let cfg = Config::tiny();
        let anchors = anchor_positions(&cfg, 9);
        assert_eq!(anchors.len(), cfg.n_kv * ANCHORS_PER_HEAD);
        assert!(anchors.iter().all(|&p| (p as usize) < 3 * cfg.prefill / 4));
        let k = cache(&cfg, 9, Tensor::KCache, &anchors);
        let row_rms = |h: usize, p: usize| {
            let base = (h * cfg.max_seq_len + p) * cfg.hd;
            (k[base..base + cfg.hd].iter().map(|v| v.to_f32().powi(2)).sum::<f32>() / cfg.hd as f32).sqrt()
        };
        let a = anchors[0] as usize;
        assert!(row_rms(0, a) > 4.0, "anchor rms {}", row_rms(0, a));
        let plain = (0..cfg.prefill).find(|p| !anchors[..ANCHORS_PER_HEAD].contains(&(*p as u32))).unwrap();
        assert!(row_rms(0, plain) < 2.0);
        assert!(k[cfg.prefill * cfg.hd..cfg.max_seq_len * cfg.hd].iter().all(|v| v.to_f32() == 0.0));
    }

    #[test]
    fn inputs_differ_per_call_and_seed() {
        let cfg = Config::tiny();
        assert_ne!(input(&cfg, 1, 0), input(&cfg, 1, 1));
        assert_ne!(input(&cfg, 1, 0), input(&cfg, 2, 0));
    }
}
