//! The megakernel's program: the layer compiled into a table of phases, `ROW_WORDS` int64 words per
//! phase, that one persistent kernel interprets. This file is the one source of truth for the format;
//! `kernels/program.cuh` mirrors it and a test checks every constant against that file.
//!
//! The program is data: the same table runs on the GPU (pointers are device addresses) and on the
//! CPU executor (pointers are addresses in a host arena), so CI checks the compiler without a GPU.

use spec::{Config, LayerOp};

/// Words per phase row.
pub const ROW_WORDS: usize = 16;
/// Rows the kernel's by-value program parameter holds (the rows past a program's are no-ops).
pub const MAX_PHASES: usize = 8;
/// Cached positions per attention work item.
pub const ATTN_CHUNK: usize = 128;

/// One phase row.
pub type Row = [i64; ROW_WORDS];

/// What a phase does. The step's own arguments are kernel parameters: `Qkv` and `OProj` read `x`,
/// `Down` writes `out`, and `Qkv` and `Attention` use `pos`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(i64)]
pub enum Op {
    Nop = 0,
    /// `h = rmsnorm(x)`; `[q|k|v] = W h` over RoPE-pair-interleaved rows; rope `q`, `k`; append `k`, `v`.
    Qkv = 1,
    /// Attention of `q` over cache slots `0..=pos` in chunks, partials combined into `a`.
    Attention = 2,
    /// `x1 = x + Wo a`.
    OProj = 3,
    /// `h2 = rmsnorm(x1)`; `act = silu(Wg h2) * (Wu h2)` over gate/up-interleaved rows.
    GateUp = 4,
    /// `out = x1 + Wd act`.
    Down = 5,
}

impl Op {
    pub const ALL: [Op; 6] = [Op::Nop, Op::Qkv, Op::Attention, Op::OProj, Op::GateUp, Op::Down];

    pub fn from_word(w: i64) -> Option<Op> {
        Op::ALL.into_iter().find(|op| *op as i64 == w)
    }

    /// The operation of the task's layer this phase computes (`ByteModel::by_op` names its bytes).
    pub fn layer_op(self) -> Option<LayerOp> {
        match self {
            Op::Nop => None,
            Op::Qkv => Some(LayerOp::Qkv),
            Op::Attention => Some(LayerOp::Attention),
            Op::OProj => Some(LayerOp::OProj),
            Op::GateUp => Some(LayerOp::GateUp),
            Op::Down => Some(LayerOp::Down),
        }
    }
}

/// Declares an opcode's operand words (from word 1 on) with the names `kernels/program.cuh` uses.
macro_rules! operands {
    ($module:ident { $first:ident $(, $name:ident)* $(,)? }) => {
        #[allow(non_snake_case, non_upper_case_globals, dead_code)]
        pub mod $module {
            #[derive(Debug, Clone, Copy, PartialEq, Eq)]
            #[repr(usize)]
            pub enum Word { $first = 1 $(, $name)* }
            pub use Word::*;
            /// Every operand, in word order.
            pub const ALL: &[Word] = &[$first $(, $name)*];
        }
    };
}

operands!(qkv { W, Norm, QOut, KCache, VCache, Cos, Sin, D, NQ, NKv, Hd, MaxSeq, EpsBits });
operands!(attn { Q, KCache, VCache, PartO, PartMl, Counters, AOut, NQ, NKv, Hd, MaxSeq, Chunk });
operands!(oproj { W, A, X1Out, Rows, Cols });
operands!(gateup { W, Norm, X1, ActOut, D, Ffn, EpsBits });
operands!(down { W, Act, X1, Rows, Cols });

/// The addresses of every buffer the program names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Buffers {
    /// `(q_dim + 2 kv_dim, d)`: q, k, v rows with RoPE pairs adjacent (see `pack::qkv_row`).
    pub w_qkv: u64,
    pub in_norm: u64,
    /// `(n_q, hd)` roped queries, bf16.
    pub q: u64,
    pub k_cache: u64,
    pub v_cache: u64,
    /// `(max_seq_len, hd / 2)` f32 RoPE tables.
    pub cos: u64,
    pub sin: u64,
    /// `(n_kv, max_chunks, group, hd)` f32 attention partial outputs.
    pub part_o: u64,
    /// `(n_kv, max_chunks, group, 2)` f32 running max and sum of each partial.
    pub part_ml: u64,
    /// `(2, n_kv)` u32 arrival and departure counters of the attention combine, zero between steps.
    pub counters: u64,
    /// `(n_q * hd)` attention output, bf16.
    pub a: u64,
    pub w_o: u64,
    /// `(d)` residual after attention, bf16.
    pub x1: u64,
    /// `(2 ffn, d)`: gate and up rows interleaved (see `pack::gateup_row`).
    pub w_gateup: u64,
    pub post_norm: u64,
    /// `(ffn)` SwiGLU activation, bf16.
    pub act: u64,
    pub w_down: u64,
}

/// Attention chunks needed for the deepest slot of the cache.
pub fn max_chunks(cfg: &Config) -> usize {
    cfg.max_seq_len.div_ceil(ATTN_CHUNK)
}

/// A row with `op` in word 0 and `words` set.
fn row<W: Copy + Into<usize>>(op: Op, words: &[(W, i64)]) -> Row {
    let mut r = [0i64; ROW_WORDS];
    r[0] = op as i64;
    for &(w, v) in words {
        r[w.into()] = v;
    }
    r
}

macro_rules! word_into_usize {
    ($($m:ident),*) => { $(impl From<$m::Word> for usize { fn from(w: $m::Word) -> usize { w as usize } })* };
}
word_into_usize!(qkv, attn, oproj, gateup, down);

/// The layer as five phases.
pub fn compile(cfg: &Config, b: &Buffers) -> Vec<Row> {
    let i = |v: usize| v as i64;
    let p = |v: u64| v as i64;
    let eps = cfg.eps.to_bits() as i64;
    vec![
        row(
            Op::Qkv,
            &[
                (qkv::W, p(b.w_qkv)),
                (qkv::Norm, p(b.in_norm)),
                (qkv::QOut, p(b.q)),
                (qkv::KCache, p(b.k_cache)),
                (qkv::VCache, p(b.v_cache)),
                (qkv::Cos, p(b.cos)),
                (qkv::Sin, p(b.sin)),
                (qkv::D, i(cfg.d)),
                (qkv::NQ, i(cfg.n_q)),
                (qkv::NKv, i(cfg.n_kv)),
                (qkv::Hd, i(cfg.hd)),
                (qkv::MaxSeq, i(cfg.max_seq_len)),
                (qkv::EpsBits, eps),
            ],
        ),
        row(
            Op::Attention,
            &[
                (attn::Q, p(b.q)),
                (attn::KCache, p(b.k_cache)),
                (attn::VCache, p(b.v_cache)),
                (attn::PartO, p(b.part_o)),
                (attn::PartMl, p(b.part_ml)),
                (attn::Counters, p(b.counters)),
                (attn::AOut, p(b.a)),
                (attn::NQ, i(cfg.n_q)),
                (attn::NKv, i(cfg.n_kv)),
                (attn::Hd, i(cfg.hd)),
                (attn::MaxSeq, i(cfg.max_seq_len)),
                (attn::Chunk, i(ATTN_CHUNK)),
            ],
        ),
        row(
            Op::OProj,
            &[
                (oproj::W, p(b.w_o)),
                (oproj::A, p(b.a)),
                (oproj::X1Out, p(b.x1)),
                (oproj::Rows, i(cfg.d)),
                (oproj::Cols, i(cfg.q_dim())),
            ],
        ),
        row(
            Op::GateUp,
            &[
                (gateup::W, p(b.w_gateup)),
                (gateup::Norm, p(b.post_norm)),
                (gateup::X1, p(b.x1)),
                (gateup::ActOut, p(b.act)),
                (gateup::D, i(cfg.d)),
                (gateup::Ffn, i(cfg.ffn)),
                (gateup::EpsBits, eps),
            ],
        ),
        row(
            Op::Down,
            &[
                (down::W, p(b.w_down)),
                (down::Act, p(b.act)),
                (down::X1, p(b.x1)),
                (down::Rows, i(cfg.d)),
                (down::Cols, i(cfg.ffn)),
            ],
        ),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    const CUH: &str = include_str!("../../../kernels/program.cuh");

    #[test]
    fn opcodes_mirror_the_cuda_header() {
        assert!(CUH.contains(&format!("PROGRAM_ROW_WORDS = {ROW_WORDS};")));
        assert!(CUH.contains(&format!("PROGRAM_MAX_PHASES = {MAX_PHASES};")));
        let upper = |op: Op| {
            let name = format!("{op:?}");
            let mut s = String::new();
            for (i, c) in name.chars().enumerate() {
                if c.is_uppercase() && i > 0 {
                    s.push('_');
                }
                s.push(c.to_ascii_uppercase());
            }
            s
        };
        for op in Op::ALL {
            let line = format!("OP_{} = {};", upper(op), op as i64);
            assert!(CUH.contains(&line), "kernels/program.cuh lacks `{line}`");
        }
    }

    #[test]
    fn operand_words_mirror_the_cuda_header() {
        fn check<W: std::fmt::Debug + Copy + Into<usize>>(ns: &str, all: &[W]) {
            let names: Vec<String> = all.iter().map(|w| format!("{w:?}")).collect();
            assert_eq!(all.first().map(|w| (*w).into()), Some(1));
            let want = format!("namespace {ns} {{ enum : int {{ {} = 1, {} }}; }}", names[0], names[1..].join(", "));
            assert!(CUH.contains(&want), "kernels/program.cuh lacks `{want}`");
            assert!(all.len() < ROW_WORDS);
        }
        check("qkv", qkv::ALL);
        check("attn", attn::ALL);
        check("oproj", oproj::ALL);
        check("gateup", gateup::ALL);
        check("down", down::ALL);
    }

    #[test]
    fn compile_fills_every_operand() {
        let cfg = Config::tiny();
        let b = Buffers {
            w_qkv: 1,
            in_norm: 2,
            q: 3,
            k_cache: 4,
            v_cache: 5,
            cos: 6,
            sin: 7,
            part_o: 8,
            part_ml: 9,
            counters: 10,
            a: 11,
            w_o: 12,
            x1: 13,
            w_gateup: 14,
            post_norm: 15,
            act: 16,
            w_down: 17,
        };
        let prog = compile(&cfg, &b);
        let ops: Vec<Op> = prog.iter().map(|r| Op::from_word(r[0]).unwrap()).collect();
        assert_eq!(ops, [Op::Qkv, Op::Attention, Op::OProj, Op::GateUp, Op::Down]);
        // Phase p computes the byte model's operation p, which `grader profile` relies on.
        assert_eq!(ops.iter().map(|op| op.layer_op().unwrap()).collect::<Vec<_>>(), LayerOp::ALL);
        let used = [qkv::ALL.len(), attn::ALL.len(), oproj::ALL.len(), gateup::ALL.len(), down::ALL.len()];
        for (r, n) in prog.iter().zip(used) {
            assert!(r[1..=n].iter().all(|&w| w != 0), "{r:?}");
            assert!(r[n + 1..].iter().all(|&w| w == 0), "{r:?}");
        }
    }
}
