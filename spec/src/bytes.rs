//! The byte model: the fewest bytes one decode step must move through device memory. At batch 1 the
//! layer is pure weight bandwidth, so these bytes over the measured copy bandwidth are the floor.

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
    /// `matrices + kv_read`: the figure TASK.md quotes (1,728,184,320 for the graded config).
    pub weights_plus_kv: u64,
    /// Everything above: the floor's numerator.
    pub total: u64,
}

impl ByteModel {
    /// The floor's byte model: a call at the deepest timed position.
    pub fn of(cfg: &Config) -> Self {
        Self::at(cfg, cfg.deepest_timed_pos())
    }

    /// What a call at position `pos` must move (it attends over positions `0 ..= pos`).
    pub fn at(cfg: &Config, pos: usize) -> Self {
        let (d, ffn) = (cfg.d as u64, cfg.ffn as u64);
        let (q, kv) = (cfg.q_dim() as u64, cfg.kv_dim() as u64);
        let matrices = BF16_BYTES * (q * d + 2 * kv * d + d * q + 3 * ffn * d);
        let norms = BF16_BYTES * 2 * d;
        let positions = pos as u64 + 1;
        let kv_read = BF16_BYTES * 2 * kv * positions * cfg.batch as u64;
        let kv_append = BF16_BYTES * 2 * kv * cfg.batch as u64;
        let activations = BF16_BYTES * 2 * d * cfg.batch as u64;
        Self {
            matrices,
            norms,
            kv_read,
            kv_append,
            activations,
            weights_plus_kv: matrices + kv_read,
            total: matrices + norms + kv_read + kv_append + activations,
        }
    }

    /// The roofline floor in microseconds at a measured bandwidth in bytes per second.
    pub fn floor_us(&self, bandwidth_bytes_per_s: f64) -> f64 {
        self.total as f64 / bandwidth_bytes_per_s * 1e6
    }
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
        // TASK.md: about 408 us at 4.23 TB/s.
        let floor = b.floor_us(4.23e12);
        assert!((floor - 408.0).abs() < 1.5, "{floor}");
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
