//! The layouts the megakernel streams: which row of which weight each packed row is.
//!
//! QKV: the q, k and v heads of a range of KV groups as one matrix, each head's rows in RoPE pairs
//! `(i, i + hd/2)` placed next to each other, so one block computes both rows of a pair and rotates
//! them itself. The program streams the groups in one range or two halves (the program's plan).
//! O projection: the columns of a range of KV groups' query heads, for every row.
//! Gate/up: gate row r and up row r next to each other, so one block computes `silu(g) * u` itself.
//! Down: one part of `ffn`'s columns, for every row (the program runs the MLP in parts of `ffn`).

use spec::{Config, Tensor};

/// KV groups `kv0..kv0 + n_kv`: those KV heads and their query heads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Groups {
    pub kv0: usize,
    pub n_kv: usize,
}

impl Groups {
    pub fn all(cfg: &Config) -> Groups {
        Groups { kv0: 0, n_kv: cfg.n_kv }
    }

    /// The first query head.
    pub fn q0(&self, cfg: &Config) -> usize {
        self.kv0 * cfg.group()
    }

    pub fn n_q(&self, cfg: &Config) -> usize {
        self.n_kv * cfg.group()
    }
}

/// Rows of the packed QKV matrix of `groups`.
pub fn qkv_rows(cfg: &Config, groups: Groups) -> usize {
    (groups.n_q(cfg) + 2 * groups.n_kv) * cfg.hd
}

/// The weight and row of packed QKV row `p` of `groups`: pair `p / 2` of the q heads, then k, then v;
/// member `p % 2` is row `i` (0) or `i + hd/2` (1) of the head.
pub fn qkv_source(cfg: &Config, groups: Groups, p: usize) -> (Tensor, usize) {
    let half = cfg.hd / 2;
    let (pair, member) = (p / 2, p % 2);
    let (q_pairs, kv_pairs) = (groups.n_q(cfg) * half, groups.n_kv * half);
    let (tensor, j, first_head) = if pair < q_pairs {
        (Tensor::Wq, pair, groups.q0(cfg))
    } else if pair < q_pairs + kv_pairs {
        (Tensor::Wk, pair - q_pairs, groups.kv0)
    } else {
        (Tensor::Wv, pair - q_pairs - kv_pairs, groups.kv0)
    };
    (tensor, (first_head + j / half) * cfg.hd + j % half + member * half)
}

/// Where row `r` of the packed O-projection columns of `groups` starts in `Wo`, in elements: the
/// row's columns of those groups' query heads.
pub fn oproj_offset(cfg: &Config, groups: Groups, r: usize) -> usize {
    r * cfg.q_dim() + groups.q0(cfg) * cfg.hd
}

/// The weight and row of packed gate/up row `p`: gate row `p / 2` for even `p`, up row for odd.
pub fn gateup_source(p: usize) -> (Tensor, usize) {
    (if p.is_multiple_of(2) { Tensor::Wgate } else { Tensor::Wup }, p / 2)
}

/// A packed matrix: `rows` rows of `cols` elements, row `p` starting at element `start(p).1` of weight
/// `start(p).0`. The GPU gathers it (`gather` in lib.rs), the CPU executor copies it.
pub struct Packing<F: Fn(usize) -> (Tensor, usize)> {
    pub rows: usize,
    pub cols: usize,
    pub start: F,
}

/// The QKV rows of `groups` (`qkv_source`).
pub fn qkv(cfg: &Config, groups: Groups) -> Packing<impl Fn(usize) -> (Tensor, usize) + '_> {
    let start = move |p| {
        let (t, r) = qkv_source(cfg, groups, p);
        (t, r * cfg.d)
    };
    Packing { rows: qkv_rows(cfg, groups), cols: cfg.d, start }
}

/// The O projection's columns of `groups`' query heads, for every row (`oproj_offset`).
pub fn oproj(cfg: &Config, groups: Groups) -> Packing<impl Fn(usize) -> (Tensor, usize) + '_> {
    Packing { rows: cfg.d, cols: groups.n_q(cfg) * cfg.hd, start: move |r| (Tensor::Wo, oproj_offset(cfg, groups, r)) }
}

/// Gate and up rows interleaved (`gateup_source`).
pub fn gateup(cfg: &Config) -> Packing<impl Fn(usize) -> (Tensor, usize) + '_> {
    let start = move |p| {
        let (t, r) = gateup_source(p);
        (t, r * cfg.d)
    };
    Packing { rows: 2 * cfg.ffn, cols: cfg.d, start }
}

/// The columns of `ffn` (elements of `act`) part `k` of `parts` covers: whole 16-byte vectors, as even
/// as they can be.
pub fn mlp_part(cfg: &Config, parts: usize, k: usize) -> std::ops::Range<usize> {
    let vecs = cfg.ffn / 8;
    8 * (vecs * k / parts)..8 * (vecs * (k + 1) / parts)
}

/// Part `k` of `parts` of `Wdown`'s columns (`mlp_part`), for every row: the product with that part of
/// act.
pub fn down(cfg: &Config, parts: usize, k: usize) -> Packing<impl Fn(usize) -> (Tensor, usize) + '_> {
    let f = mlp_part(cfg, parts, k);
    Packing { rows: cfg.d, cols: f.len(), start: move |r| (Tensor::Wdown, r * cfg.ffn + f.start) }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every row of every source appears exactly once over the groups, whether one range or split in
    /// two at any KV head; the rows of a range are those of its groups' heads, and pairs are
    /// (i, i + hd/2) of one head.
    #[test]
    fn packings_are_permutations() {
        for cfg in [Config::small(), Config::graded()] {
            let splits = (1..cfg.n_kv)
                .map(|first| vec![Groups { kv0: 0, n_kv: first }, Groups { kv0: first, n_kv: cfg.n_kv - first }]);
            for groups in std::iter::once(vec![Groups::all(&cfg)]).chain(splits) {
                let mut seen = std::collections::HashSet::new();
                for g in groups {
                    for p in 0..qkv_rows(&cfg, g) {
                        let (t, r) = qkv_source(&cfg, g, p);
                        assert!(seen.insert((t, r)), "{}: row {p} repeats", cfg.name);
                        let head = r / cfg.hd;
                        let (first, n) = if t == Tensor::Wq { (g.q0(&cfg), g.n_q(&cfg)) } else { (g.kv0, g.n_kv) };
                        assert!((first..first + n).contains(&head), "{}: {t:?} head {head} outside {g:?}", cfg.name);
                    }
                    for p in (0..qkv_rows(&cfg, g)).step_by(2) {
                        let ((t0, r0), (t1, r1)) = (qkv_source(&cfg, g, p), qkv_source(&cfg, g, p + 1));
                        assert_eq!(t0, t1);
                        assert_eq!(r1, r0 + cfg.hd / 2);
                        assert!(r0 % cfg.hd < cfg.hd / 2);
                    }
                }
                assert_eq!(seen.iter().filter(|(t, _)| *t == Tensor::Wq).count(), cfg.q_dim());
                assert_eq!(seen.iter().filter(|(t, _)| *t == Tensor::Wk).count(), cfg.kv_dim());
                assert_eq!(seen.iter().filter(|(t, _)| *t == Tensor::Wv).count(), cfg.kv_dim());
            }
        }
        assert_eq!(gateup_source(6), (Tensor::Wgate, 3));
        assert_eq!(gateup_source(7), (Tensor::Wup, 3));
    }

    /// Down's parts tile every row of `Wdown`: each element once, in column order within a part, each
    /// part whole 16-byte vectors, in two parts or three, even or not.
    #[test]
    fn down_parts_tile_every_row() {
        for (cfg, parts) in [(Config::tiny(), 2), (Config { ffn: 776, ..Config::tiny() }, 3)] {
            let mut seen = vec![0u8; cfg.d * cfg.ffn];
            let mut next = 0;
            for part in 0..parts {
                let Packing { rows, cols, start } = down(&cfg, parts, part);
                assert_eq!(rows, cfg.d);
                assert!(cols % 8 == 0 && cols.abs_diff(cfg.ffn / parts) <= 8, "{cols}");
                for r in 0..rows {
                    let (t, at) = start(r);
                    assert_eq!((t, at / cfg.ffn, at % cfg.ffn), (Tensor::Wdown, r, next));
                    seen[at..at + cols].iter_mut().for_each(|s| *s += 1);
                }
                next += cols;
            }
            assert!(seen.iter().all(|&s| s == 1));
        }
    }

    #[test]
    fn oproj_halves_split_every_row_at_the_groups_columns() {
        let cfg = Config::graded();
        let (a, b) = (Groups { kv0: 0, n_kv: 4 }, Groups { kv0: 4, n_kv: 4 });
        assert_eq!(oproj_offset(&cfg, a, 0), 0);
        assert_eq!(oproj_offset(&cfg, b, 0), cfg.q_dim() / 2);
        assert_eq!(oproj_offset(&cfg, b, 3), 3 * cfg.q_dim() + cfg.q_dim() / 2);
    }
}
