//! The layouts the megakernel streams: which row of which weight each packed row is.
//!
//! QKV: the q, k and v heads as one matrix, each head's rows in RoPE pairs `(i, i + hd/2)` placed
//! next to each other, so one block computes both rows of a pair and rotates them itself.
//! Gate/up: gate row r and up row r next to each other, so one block computes `silu(g) * u` itself.

use spec::{Config, Tensor};

/// Rows of the packed QKV matrix.
pub fn qkv_rows(cfg: &Config) -> usize {
    cfg.q_dim() + 2 * cfg.kv_dim()
}

/// The weight and row of packed QKV row `p`: pair `p / 2` of the q heads, then k, then v; member
/// `p % 2` is row `i` (0) or `i + hd/2` (1) of the head.
pub fn qkv_source(cfg: &Config, p: usize) -> (Tensor, usize) {
    let half = cfg.hd / 2;
    let (pair, member) = (p / 2, p % 2);
    let (q_pairs, kv_pairs) = (cfg.q_dim() / 2, cfg.kv_dim() / 2);
    let (tensor, j) = if pair < q_pairs {
        (Tensor::Wq, pair)
    } else if pair < q_pairs + kv_pairs {
        (Tensor::Wk, pair - q_pairs)
    } else {
        (Tensor::Wv, pair - q_pairs - kv_pairs)
    };
    (tensor, (j / half) * cfg.hd + j % half + member * half)
}

/// The weight and row of packed gate/up row `p`: gate row `p / 2` for even `p`, up row for odd.
pub fn gateup_source(p: usize) -> (Tensor, usize) {
    (if p.is_multiple_of(2) { Tensor::Wgate } else { Tensor::Wup }, p / 2)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every row of every source appears exactly once, and pairs are (i, i + hd/2) of one head.
    #[test]
    fn packings_are_permutations() {
        let cfg = Config::small();
        let mut seen = std::collections::HashSet::new();
        for p in 0..qkv_rows(&cfg) {
            assert!(seen.insert(qkv_source(&cfg, p)), "row {p} repeats");
        }
        for p in (0..qkv_rows(&cfg)).step_by(2) {
            let ((t0, r0), (t1, r1)) = (qkv_source(&cfg, p), qkv_source(&cfg, p + 1));
            assert_eq!(t0, t1);
            assert_eq!(r1, r0 + cfg.hd / 2);
            assert!(r0 % cfg.hd < cfg.hd / 2);
        }
        assert_eq!(seen.iter().filter(|(t, _)| *t == Tensor::Wq).count(), cfg.q_dim());
        assert_eq!(seen.iter().filter(|(t, _)| *t == Tensor::Wv).count(), cfg.kv_dim());
        assert_eq!(gateup_source(6), (Tensor::Wgate, 3));
        assert_eq!(gateup_source(7), (Tensor::Wup, 3));
    }
}
