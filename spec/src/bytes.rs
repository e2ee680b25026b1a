//! The byte model: the fewest bytes one decode step must move through device memory. At batch 1 the
//! layer is pure weight bandwidth, so these bytes over the measured copy bandwidth are the floor. All
//! arithmetic is checked: a config too large for 64-bit byte counts is refused, never wrapped.

use serde::{Deserialize, Serialize};

use crate::Config;

/// Bytes of one bf16 element.
pub const BF16_BYTES: u64 = 2;

/// Bytes one step moves, by kind. Every matrix is read once, the KV cache up to the deepest timed
/// position is read once, one K and one V row are written, `x` is read and `x_out` written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ByteModel {
    /// The seven weight matrices (q, k, v, o, gate, up, down), bf16.
    pub matrices: u64,
    /// The two RMSNorm weight vectors, bf16.
    pub norms: u64,
    /// K and V read over positions `0 ..= deepest timed position`, bf16.
    pub kv_read: u64,
    /// The K and V rows appended at `pos`, bf16.
    pub kv_append: u64,
    /// `x` read and `x_out` written, bf16.
    pub activations: u64,
    /// `matrices + kv_read`: the figure `docs/task.md` quotes (1,728,184,320 for the graded config).
    pub weights_plus_kv: u64,
    /// Everything above: the floor's numerator.
    pub total: u64,
    /// `total` split over the layer's operations, in order; the parts sum to `total`.
    pub by_op: [OpBytes; 5],
}

/// The layer's operations in order, as `grader profile` and the megakernel's program name them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum LayerOp {
    /// `rmsnorm`, the q, k and v projections, RoPE and the cache append.
    Qkv,
    Attention,
    OProj,
    /// `rmsnorm` and the gate and up projections.
    GateUp,
    Down,
}

impl LayerOp {
    pub const ALL: [LayerOp; 5] = [LayerOp::Qkv, LayerOp::Attention, LayerOp::OProj, LayerOp::GateUp, LayerOp::Down];
}

/// One operation's share of the byte model.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct OpBytes {
    pub op: LayerOp,
    pub bytes: u64,
}

impl ByteModel {
    /// The floor's byte model: a call at the deepest timed position, of a validated configuration
    /// ([`Config::validate`] bounds every size, so [`ByteModel::checked`] cannot overflow for it).
    pub fn of(cfg: &Config) -> Self {
        Self::at(cfg, cfg.deepest_timed_pos())
    }

    /// What a call at position `pos` of a validated configuration must move (it attends over
    /// positions `0 ..= pos`).
    pub fn at(cfg: &Config, pos: usize) -> Self {
        Self::checked(cfg, pos).expect("a validated config's byte model fits in 64 bits")
    }

    /// The byte model at `pos` in checked arithmetic: `None` when a figure overflows 64 bits.
    pub fn checked(cfg: &Config, pos: usize) -> Option<Self> {
        let (d, ffn, batch) = (cfg.d as u64, cfg.ffn as u64, cfg.batch as u64);
        let q = (cfg.n_q as u64).checked_mul(cfg.hd as u64)?;
        let kv = (cfg.n_kv as u64).checked_mul(cfg.hd as u64)?;
        let bf16 = |elems: u64| elems.checked_mul(BF16_BYTES);
        // Wq and Wo are q x d, Wk and Wv kv x d, gate, up and down ffn x d.
        let matrix_elems = sum(&[mul(&[2, q, d])?, mul(&[2, kv, d])?, mul(&[3, ffn, d])?])?;
        let matrices = bf16(matrix_elems)?;
        let norms = bf16(mul(&[2, d])?)?;
        // Positions 0 ..= pos.
        let positions = (pos as u64).checked_add(1)?;
        let kv_read = bf16(mul(&[2, kv, positions, batch])?)?;
        let kv_append = bf16(mul(&[2, kv, batch])?)?;
        let activations = bf16(mul(&[2, d, batch])?)?;
        // Each operation is charged the weights it reads, a norm with the projection it feeds, the
        // cache with attention, x with the first operation and x_out with the last.
        let (x, norm) = (bf16(mul(&[d, batch])?)?, bf16(d)?);
        let part = |op, terms: &[u64]| Some(OpBytes { op, bytes: sum(terms)? });
        let by_op = [
            part(LayerOp::Qkv, &[bf16(mul(&[q + 2 * kv, d])?)?, norm, x])?,
            part(LayerOp::Attention, &[kv_read, kv_append])?,
            part(LayerOp::OProj, &[bf16(mul(&[q, d])?)?])?,
            part(LayerOp::GateUp, &[bf16(mul(&[2, ffn, d])?)?, norm])?,
            part(LayerOp::Down, &[bf16(mul(&[ffn, d])?)?, x])?,
        ];
        Some(Self {
            matrices,
            norms,
            kv_read,
            kv_append,
            activations,
            weights_plus_kv: matrices.checked_add(kv_read)?,
            total: sum(&[matrices, norms, kv_read, kv_append, activations])?,
            by_op,
        })
    }

    /// The byte model of `cfg`'s whole stack at position `pos`: every layer moves one layer's bytes
    /// (its weights, its cache, its input read and its output written), so each figure is `cfg.layers`
    /// times one layer's.
    pub fn stack_at(cfg: &Config, pos: usize) -> Self {
        let one = Self::at(cfg, pos);
        let l = cfg.layers as u64;
        // A validated config's data (every layer's weights and cache) fits 64-bit byte counts, and so
        // does any multiple of one layer's reads up to its depth.
        let times = |v: u64| v.checked_mul(l).expect("a validated stack's bytes fit in 64 bits");
        Self {
            matrices: times(one.matrices),
            norms: times(one.norms),
            kv_read: times(one.kv_read),
            kv_append: times(one.kv_append),
            activations: times(one.activations),
            weights_plus_kv: times(one.weights_plus_kv),
            total: times(one.total),
            by_op: one.by_op.map(|o| OpBytes { op: o.op, bytes: times(o.bytes) }),
        }
    }

    /// The floor's byte model of `cfg`'s whole stack (`stack_at` the deepest timed position).
    pub fn stack(cfg: &Config) -> Self {
        Self::stack_at(cfg, cfg.deepest_timed_pos())
    }

    /// The roofline floor in microseconds at a measured bandwidth in bytes per second.
    pub fn floor_us(&self, bandwidth_bytes_per_s: f64) -> f64 {
        self.total as f64 / bandwidth_bytes_per_s * 1e6
    }
}

/// Device bytes of one copy of the data of a run of `calls` calls: every layer's weights and whole
/// KV cache (K and V at capacity), and every call's input and output. Each side of a run (the judge,
/// the runner) holds one such copy; `None` when the figure overflows 64 bits.
pub fn data_bytes(cfg: &Config, calls: usize) -> Option<u64> {
    let deepest = (cfg.prefill as u64).checked_add(cfg.timed_steps as u64)?.checked_sub(1)? as usize;
    let b = ByteModel::checked(cfg, deepest)?;
    let cache_elems = mul(&[cfg.batch as u64, cfg.n_kv as u64, cfg.max_seq_len as u64, cfg.hd as u64])?;
    let cache = mul(&[2, cache_elems, BF16_BYTES])?;
    let layer = sum(&[b.matrices, b.norms, cache])?;
    let io = mul(&[2, calls as u64, cfg.d as u64, cfg.batch as u64, BF16_BYTES])?;
    sum(&[mul(&[layer, cfg.layers as u64])?, io])
}

/// The product of `factors`, `None` on overflow.
fn mul(factors: &[u64]) -> Option<u64> {
    factors.iter().try_fold(1u64, |acc, &f| acc.checked_mul(f))
}

/// The sum of `terms`, `None` on overflow.
fn sum(terms: &[u64]) -> Option<u64> {
    terms.iter().try_fold(0u64, |acc, &t| acc.checked_add(t))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn graded_byte_model_matches_task_md() {
        let b = ByteModel::of(&Config::graded());
        assert_eq!(b.matrices, 1_711_276_032);
        assert_eq!(b.norms, 32_768);
        assert_eq!(b.weights_plus_kv, 1_728_184_320);
        assert_eq!(b.kv_append, 4096);
        assert_eq!(b.total, 1_728_184_320 + 32_768 + 4096 + 32_768);
        // docs/task.md: about 408 us at 4.23 TB/s.
        let floor = b.floor_us(4.23e12);
        assert!((floor - 408.0).abs() < 1.5, "{floor}");
    }

    #[test]
    fn the_operations_share_the_total_exactly() {
        for cfg in [Config::graded(), Config::small(), Config::tiny()] {
            for pos in [0, cfg.prefill, cfg.deepest_timed_pos()] {
                let b = ByteModel::at(&cfg, pos);
                assert_eq!(b.by_op.iter().map(|o| o.bytes).sum::<u64>(), b.total, "{} at {pos}", cfg.name);
                assert_eq!(b.by_op.map(|o| o.op), LayerOp::ALL);
                assert_eq!(b.by_op[1].bytes, b.kv_read + b.kv_append);
            }
        }
        // The graded layer: Wq, Wk, Wv and in_norm and x; Wo; Wgate, Wup and post_norm; Wdown and out.
        let g = ByteModel::of(&Config::graded());
        assert_eq!(g.by_op[0].bytes, 2 * (10240 * 8192 + 8192 + 8192));
        assert_eq!(g.by_op[2].bytes, 2 * 8192 * 8192);
        assert_eq!(g.by_op[3].bytes, 2 * (2 * 28672 * 8192 + 8192));
        assert_eq!(g.by_op[4].bytes, 2 * (28672 * 8192 + 8192));
    }

    /// A stack holds every layer's weights and cache once; the calls' inputs and outputs once.
    #[test]
    fn a_stacks_bytes_are_its_layers_bytes_times_its_depth() {
        let one = Config::graded();
        let stack = Config { layers: 80, ..one.clone() };
        assert_eq!(ByteModel::stack(&one), ByteModel::of(&one));
        let (b1, b80) = (ByteModel::of(&one), ByteModel::stack(&stack));
        assert_eq!(b80.total, 80 * b1.total);
        assert_eq!(b80.by_op.iter().map(|o| o.bytes).sum::<u64>(), b80.total);
        assert_eq!(b80.matrices + b80.norms + b80.kv_read + b80.kv_append + b80.activations, b80.total);
    }

    #[test]
    fn a_stacks_data_is_its_layers_data_times_its_depth() {
        let one = Config::graded();
        let stack = Config { layers: 80, ..one.clone() };
        let io = 2 * 72 * 8192 * 2;
        let layer = data_bytes(&one, 72).unwrap() - io;
        assert_eq!(data_bytes(&stack, 72).unwrap(), 80 * layer + io);
        // docs/stack.md: 80 x (1.711 GB of weights + 17.3 MB of cache) = 138.3 GB.
        assert!((80 * layer) as f64 > 138.2e9 && ((80 * layer) as f64) < 138.4e9, "{}", 80 * layer);
    }

    #[test]
    fn byte_model_scales_with_the_config() {
        let tiny = ByteModel::of(&Config::tiny());
        let c = Config::tiny();
        let params = c.d * c.q_dim() * 2 + 2 * c.d * c.kv_dim() + 3 * c.d * c.ffn;
        assert_eq!(tiny.matrices, 2 * params as u64);
        assert_eq!(tiny.kv_read, 2 * 2 * (c.kv_dim() * (c.prefill + c.timed_steps)) as u64);
    }
}
