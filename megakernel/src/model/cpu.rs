//! A model's decode step on the CPU: the token's embedding row, every decoder layer as the golden
//! model computes it (`reference::golden::step`, rounding where the eager GPU reference rounds), the
//! final RMSNorm, the LM head with each logit summed in f64 and rounded once to f32, and a greedy
//! argmax. The GPU's one-launch decode is to match it layer for layer and token for token.

use half::bf16;
use reference::golden::{self, KvCache, QkNorm, RopeTable};
use spec::Config;

use super::hf::{ModelConfig, ModelWeights};
use super::request::{Limits, Stop};

/// A model with its KV caches, `context` positions deep.
pub struct CpuModel {
    cfg: ModelConfig,
    /// The layer's shape with the caches' depth.
    layer: Config,
    weights: ModelWeights,
    caches: Vec<KvCache>,
    rope: RopeTable,
}

impl CpuModel {
    /// The model with empty caches of `context` positions (at most the model's own context).
    pub fn new(cfg: ModelConfig, weights: ModelWeights, context: usize) -> CpuModel {
        let layer = Config { max_seq_len: context.min(cfg.layer.max_seq_len), ..cfg.layer.clone() };
        let n = layer.cache_elems();
        let caches = (0..layer.layers).map(|_| KvCache { k: vec![bf16::ZERO; n], v: vec![bf16::ZERO; n] }).collect();
        let rope = cfg.rope_table(layer.max_seq_len);
        CpuModel { cfg, layer, weights, caches, rope }
    }

    /// The caches' depth in positions.
    pub fn context(&self) -> usize {
        self.layer.max_seq_len
    }

    /// The logits of the token after `token` at position `pos` (`vocab` of them, f32), its K and V
    /// appended to every layer's cache at `pos`.
    pub fn decode_step(&mut self, token: u32, pos: usize) -> Vec<f32> {
        let (d, vocab) = (self.layer.d, self.cfg.vocab);
        assert!((token as usize) < vocab, "token {token} is outside the vocabulary of {vocab}");
        assert!(pos < self.context(), "position {pos} is past the caches' {} positions", self.context());
        let t = token as usize;
        let mut x = self.weights.embed[t * d..(t + 1) * d].to_vec();
        for (l, (w, cache)) in self.weights.layers.iter().zip(&mut self.caches).enumerate() {
            x = match self.weights.qk_norms.get(l) {
                Some([q, k]) => golden::step_qk_norm(&self.layer, w, QkNorm { q, k }, cache, &self.rope, &x, pos),
                None => golden::step(&self.layer, w, cache, &self.rope, &x, pos),
            };
        }
        let h = golden::rmsnorm(&x, &self.weights.norm, self.layer.eps);
        logits(self.weights.head(), vocab, &h)
    }

    /// Forgets every sequence: the caches zeroed, as a new model's are.
    pub fn reset(&mut self) {
        for cache in &mut self.caches {
            cache.k.fill(bf16::ZERO);
            cache.v.fill(bf16::ZERO);
        }
    }

    /// What its decode steps and generations may ask for (the GPU model's limits, in its words).
    pub fn limits(&self) -> Limits {
        Limits { vocab: self.cfg.vocab, context: self.context() }
    }

    /// `decode_step`, a request outside the limits refused instead of a panic.
    pub fn checked_step(&mut self, token: u32, pos: usize) -> Result<Vec<f32>, String> {
        self.limits().step(token, pos)?;
        Ok(self.decode_step(token, pos))
    }

    /// The logits of the last of `prompt`'s tokens, decoded from position 0 (as `GpuModel::generate`
    /// of one new token leaves them).
    pub fn prefill(&mut self, prompt: &[u32]) -> Result<Vec<f32>, String> {
        self.limits().generation(prompt, 1, &[])?;
        Ok(self.decode_prompt(prompt))
    }

    /// What `GpuModel::generate` does in one launch, a step at a time: `prompt` from position 0, then up
    /// to `max_new` greedy tokens, stopping at one of `eos` or where the caches end; the tokens and why
    /// it stopped.
    pub fn generate(&mut self, prompt: &[u32], max_new: usize, eos: &[u32]) -> Result<(Vec<u32>, Stop), String> {
        self.limits().generation(prompt, max_new, eos)?;
        let mut logits = self.decode_prompt(prompt);
        let mut tokens = Vec::with_capacity(max_new);
        loop {
            let next = argmax(&logits).ok_or("every logit was NaN: no token to choose")? as u32;
            tokens.push(next);
            if let Some(stop) = self.limits().stop(prompt.len(), &tokens, max_new, eos) {
                return Ok((tokens, stop));
            }
            logits = self.decode_step(next, prompt.len() + tokens.len() - 1);
        }
    }

    /// `prompt` (not empty, within the limits) from position 0: its last position's logits.
    fn decode_prompt(&mut self, prompt: &[u32]) -> Vec<f32> {
        let mut logits = Vec::new();
        for (pos, &t) in prompt.iter().enumerate() {
            logits = self.decode_step(t, pos);
        }
        logits
    }
}

/// `head h` for the `(vocab, d)` head: each dot product summed in f64, rounded once to f32.
fn logits(head: &[bf16], vocab: usize, h: &[bf16]) -> Vec<f32> {
    let d = h.len();
    (0..vocab)
        .map(|r| {
            head[r * d..(r + 1) * d]
                .iter()
                .zip(h)
                .map(|(w, x)| f64::from(w.to_f32()) * f64::from(x.to_f32()))
                .sum::<f64>() as f32
        })
        .collect()
}

/// The greedy choice: the largest logit, the lowest index among equal ones (the GPU's argmax keeps
/// the same rule, so both pick the same token); NaN is never chosen, and `None` when every logit is NaN.
pub fn argmax(logits: &[f32]) -> Option<usize> {
    logits
        .iter()
        .enumerate()
        .filter(|(_, v)| !v.is_nan())
        .fold(None, |best: Option<(usize, f32)>, (i, &v)| match best {
            Some((_, b)) if b >= v => best,
            _ => Some((i, v)),
        })
        .map(|(i, _)| i)
}
