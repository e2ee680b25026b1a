//! The megakernel's program: the layer compiled into a table of phases, `ROW_WORDS` int64 words per
//! phase, that one persistent kernel interprets. This file is the one source of truth for the format;
//! `kernels/megakernel/program.cuh` mirrors it and a test checks every constant against that file.
//!
//! The program is data: the same table runs on the GPU (pointers are device addresses) and on the
//! CPU executor (pointers are addresses in a host arena), so CI checks the compiler without a GPU.
//!
//! Every row also names the blocks that run it and the phases it waits for (its last two words): a
//! block walks the table, skips the rows that are not its own, and before each of its rows waits until
//! every block of each phase it depends on has finished that phase. The layer compiles to one of two
//! layouts (`compile`, as `Plan` chooses by the layer's width): one role, every phase on every block
//! but Qkv and the O projection, which leave attention's first blocks to it (`beside_attention`), or the
//! two-role plan, in which the two halves of the grid take turns streaming and running attention so
//! that HBM keeps streaming while attention runs. On wide layers the MLP also runs in two parts of
//! `ffn`, so that Down's first part waits only for GateUp's first, long finished, and no block waits
//! at the end of GateUp; on narrow ones both cost more hand-offs than they save.

use spec::{Config, LayerOp};

use super::pack::{Groups, mlp_part};

/// Words per phase row.
pub const ROW_WORDS: usize = 16;
/// Rows the kernel's by-value program parameter holds (the rows past a program's are no-ops that no
/// block runs).
pub const MAX_PHASES: usize = 12;
/// The longest row a GEMV phase streams, in bf16: `MAX_VPT` 16-byte vectors for each of the kernel's
/// `THREADS` threads (both mirrored from `kernels/megakernel/vm_config.cuh` in lib.rs). Longer products are split
/// into parts of columns (`Plan::mlp_parts`).
pub const MAX_ROW: usize = 7 * 512 * 8;
/// Cached positions of an attention chunk: at most `ATTN_MAX_CHUNK`, and `ATTN_CHUNK_ELEMS / hd` for
/// wider heads, so that a chunk's K and V take the same shared memory at every head size.
pub const ATTN_MAX_CHUNK: usize = 128;
pub const ATTN_CHUNK_ELEMS: usize = 64 * 128;
/// Splits of one KV head's chunks at most (the combine's lanes hold one split's statistics each).
pub const ATTN_MAX_SPLITS: usize = 128;
/// Attention's teams per block (the kernel's `TEAMS`), each taking its own work items.
pub const ATTN_TEAMS: usize = 2;
/// Parts of `ffn` the MLP runs in at most: the two-role plan's six attention phases and two per part
/// fill the `MAX_PHASES` rows.
pub const MAX_MLP_PARTS: usize = 3;

/// One phase row.
pub type Row = [i64; ROW_WORDS];

/// The word of every row that names its blocks (see [`Blocks::word`]).
pub const BLOCKS_WORD: usize = ROW_WORDS - 2;
/// The word of every row that names the phases it waits for, one bit per phase: of its own layer from
/// bit 0, of the layer before from bit `PREV_LAYER_WAITS` (in a stack, for every layer but the first).
pub const WAITS_WORD: usize = ROW_WORDS - 1;
/// The first bit of the waits word that names a phase of the layer before.
pub const PREV_LAYER_WAITS: usize = 16;

/// Words of a layer's address table, one per [`Slot`]. A stack runs the same rows for every layer; each
/// row names the addresses that differ between layers (weights, cache) by reference to its layer's
/// table (see [`layer_ref`]), which the kernel resolves for the layer it runs. The tables travel by
/// value with the rows; a one-layer program has its rows resolved instead.
pub const LAYER_WORDS: usize = 15;
/// The most layers the stack kernel's parameter block holds tables for: the spec's deepest stack.
pub const MAX_STACK_LAYERS: usize = spec::config::MAX_LAYERS;
/// Low bits of a reference that name the slot; the rest is a byte offset.
const SLOT_BITS: u32 = 4;

/// The slots of a layer's address table ([`LayerBuffers::table`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Slot {
    WQkv0,
    WQkv1,
    InNorm,
    KCache,
    VCache,
    WO0,
    WO1,
    WGateUp,
    PostNorm,
    WDown0,
    WDown1,
    WDown2,
    /// No row names these; the kernel reads them to stream Qkv and GateUp in place (see
    /// [`LayerBuffers::in_place`]).
    WK,
    WV,
    WUp,
}

/// A row word standing for `slot`'s address plus `offset` bytes in the layer being run: negative, so
/// that no address, size or flag (all non-negative) reads as one.
pub fn layer_ref(slot: Slot, offset: u64) -> i64 {
    assert!(offset < 1 << (62 - SLOT_BITS), "an offset within one layer's buffers");
    !(((offset << SLOT_BITS) | slot as u64) as i64)
}

/// `word` as the kernel reads it while running the layer whose table is `table` (its `resolve`).
pub fn resolve(word: i64, table: &[i64; LAYER_WORDS]) -> i64 {
    if word >= 0 {
        return word;
    }
    let v = !word as u64;
    table[(v & ((1 << SLOT_BITS) - 1)) as usize] + (v >> SLOT_BITS) as i64
}

/// Row `row` as it runs for the layer whose table is `table`.
pub fn resolve_row(row: &Row, table: &[i64; LAYER_WORDS]) -> Row {
    row.map(|w| resolve(w, table))
}

/// The blocks `first + i * stride` of the grid, `i < count`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Blocks {
    pub first: u32,
    pub count: u32,
    pub stride: u32,
}

impl Blocks {
    /// The grid's first `count` blocks.
    pub fn first(count: u32) -> Blocks {
        Blocks { first: 0, count, stride: 1 }
    }

    /// The count in bits 0-31, the first block in bits 32-47, the stride in bits 48-62 (program.cuh).
    /// The count stays under 2^16: the kernel lets the offset of a block before `first` wrap, and the
    /// wrapped offset over a stride under 2^15 is then past any count.
    pub fn word(self) -> i64 {
        assert!(
            self.first < 1 << 16 && self.count < 1 << 16 && (1..1 << 15).contains(&self.stride),
            "{self:?} does not fit its word"
        );
        ((self.stride as i64) << 48) | ((self.first as i64) << 32) | self.count as i64
    }

    pub fn of(row: &Row) -> Blocks {
        let w = row[BLOCKS_WORD] as u64;
        Blocks { first: (w >> 32) as u32 & 0xFFFF, count: w as u32, stride: (w >> 48) as u32 & 0x7FFF }
    }

    pub fn contains(self, block: usize) -> bool {
        let d = block.wrapping_sub(self.first as usize);
        block >= self.first as usize
            && d.is_multiple_of(self.stride as usize)
            && d / (self.stride as usize) < self.count as usize
    }
}

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
    /// A layer split over GPUs ([`Split::Over`]): `out = residual + the sum of every GPU's partials`, in
    /// rank order, where O's and Down's last parts left their partial products. The CPU executor runs
    /// it across the GPUs' shares (`split::SplitCpu`), the split kernel (`split.cu`) over one GPU; the
    /// judge's kernels never meet it.
    Reduce = 6,
}

impl Op {
    pub const ALL: [Op; 7] = [Op::Nop, Op::Qkv, Op::Attention, Op::OProj, Op::GateUp, Op::Down, Op::Reduce];

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
            Op::Reduce => None,
        }
    }
}

/// Declares an opcode's operand words (from word 1 on) with the names `kernels/megakernel/program.cuh` uses.
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
operands!(oproj { W, A, X1Out, Rows, Cols, PartIn, PartOut });
operands!(gateup { W, Norm, X1, ActOut, D, Ffn, EpsBits });
operands!(down { W, Act, X1, Rows, Cols, PartIn, PartOut });
// Parts: the f32 partials every GPU holds at this address; Residual: 0 for the layer's input (as OProj
// reads it), else its address; Out: 0 for the layer's output (as Down writes it), else its address.
operands!(reduce { Parts, Residual, Out, Rows });

/// The addresses of one layer's weights and cache, which the rows name by [`Slot`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LayerBuffers {
    /// Per half of the KV groups (`Plan::halves`; the second 0 when there is one): its q, k and v rows with
    /// RoPE pairs adjacent (`pack::qkv_source`).
    pub w_qkv: [u64; 2],
    pub in_norm: u64,
    pub k_cache: u64,
    pub v_cache: u64,
    /// Two halves: per half, `(d, its query heads * hd)`, the O projection's columns of its heads.
    /// One: `Wo` itself.
    pub w_o: [u64; 2],
    /// `(2 ffn, d)`: gate and up rows interleaved (see `pack::gateup_source`).
    pub w_gateup: u64,
    pub post_norm: u64,
    /// Per part of the MLP (`Plan::mlp_parts`; 0 past the last), `(d, its columns)`: the columns of `Wdown`
    /// that read its part of `act`. One part: `Wdown` itself.
    pub w_down: [u64; MAX_MLP_PARTS],
    /// `Wk`, `Wv` and `Wup` as handed over, when Qkv and GateUp stream their rows in place (a stack
    /// with no room for packed copies): `w_qkv[0]` is then `Wq` and `w_gateup` is `Wgate`, and the
    /// kernel gathers each stage's pairs from them. `None`: packed.
    pub in_place: Option<[u64; 3]>,
}

impl LayerBuffers {
    /// The layer's address table, by [`Slot`].
    pub fn table(&self) -> [i64; LAYER_WORDS] {
        let mut t = [0i64; LAYER_WORDS];
        let [q0, q1] = self.w_qkv;
        let [o0, o1] = self.w_o;
        let [d0, d1, d2] = self.w_down;
        for (slot, a) in [
            (Slot::WQkv0, q0),
            (Slot::WQkv1, q1),
            (Slot::InNorm, self.in_norm),
            (Slot::KCache, self.k_cache),
            (Slot::VCache, self.v_cache),
            (Slot::WO0, o0),
            (Slot::WO1, o1),
            (Slot::WGateUp, self.w_gateup),
            (Slot::PostNorm, self.post_norm),
            (Slot::WDown0, d0),
            (Slot::WDown1, d1),
            (Slot::WDown2, d2),
            (Slot::WK, self.in_place.map_or(0, |w| w[0])),
            (Slot::WV, self.in_place.map_or(0, |w| w[1])),
            (Slot::WUp, self.in_place.map_or(0, |w| w[2])),
        ] {
            t[slot as usize] = a as i64;
        }
        t
    }
}

/// The addresses of the buffers every layer shares: the scratch between phases and the RoPE tables.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Buffers {
    /// `(n_q, hd)` roped queries, bf16.
    pub q: u64,
    /// `(max_seq_len, hd / 2)` f32 RoPE tables.
    pub cos: u64,
    pub sin: u64,
    /// `(n_kv, max_splits, group, hd)` f32 attention partial outputs.
    pub part_o: u64,
    /// `(n_kv, max_splits, group, 2)` f32 running max and sum of each partial.
    pub part_ml: u64,
    /// u32 counters of the attention combine, zero between steps: per half, `(2, its n_kv)`, its KV
    /// heads' arrivals, then their departures.
    pub counters: u64,
    /// `(n_q * hd)` attention output, bf16.
    pub a: u64,
    /// `(d)` f32: the first half's O projection, which the second half's adds (two halves only).
    pub x1_part: u64,
    /// `(d)` residual after attention, bf16.
    pub x1: u64,
    /// `(ffn)` SwiGLU activation, bf16.
    pub act: u64,
    /// `(d)` f32: Down's products so far, which each later part adds to (several parts only).
    pub down_part: u64,
}

/// Shared buffers at distinct made-up addresses, for tests that compile a program without memory.
#[cfg(test)]
pub(crate) fn test_buffers() -> Buffers {
    Buffers {
        q: 3,
        cos: 6,
        sin: 7,
        part_o: 8,
        part_ml: 9,
        counters: 10,
        a: 11,
        x1_part: 20,
        x1: 13,
        act: 16,
        down_part: 22,
    }
}

/// Cached positions per attention chunk at this head size (a multiple of 16, the tensor-core tiles').
pub fn chunk(cfg: &Config) -> usize {
    ATTN_MAX_CHUNK.min(ATTN_CHUNK_ELEMS / cfg.hd / 16 * 16)
}

/// The most splits of a KV head any position can have: the partials' room per head (the kernel's
/// `max_splits`).
pub fn max_splits(cfg: &Config) -> usize {
    cfg.max_seq_len.div_ceil(chunk(cfg)).min(ATTN_MAX_SPLITS)
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
word_into_usize!(qkv, attn, oproj, gateup, down, reduce);

/// How the layer is laid out on a grid: in one role or two (`compile`), and the MLP in how many parts
/// of `ffn`. [`Plan::choose`] is the compiler's choice; `grader profile --roles / --mlp-parts` force
/// others to study them ([`Forced`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Plan {
    /// 2: the two-role plan, the grid's halves taking turns over the two halves of the KV heads;
    /// 1: one role, every phase on every block but for attention's first blocks (`beside_attention`).
    pub roles: usize,
    /// Parts of `ffn` that GateUp and Down run in.
    pub mlp_parts: usize,
}

/// The parts of a plan a user forces (`None`: the compiler's choice).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Forced {
    pub roles: Option<usize>,
    pub mlp_parts: Option<usize>,
}

/// Layers at least this wide (`d`) take the two-role plan and the MLP in two parts or more; narrower
/// ones run in one role with as few parts as Down's rows allow. Measured on an H200 (docs/perf.md,
/// "Plans by width"), traced after an L2 eviction as a timed call finds it: each of the family's eight
/// members under 8192 wide ran 2-11 us faster in one role with one part, where the two roles' overlap
/// of attention saves less than their extra hand-offs cost; each one 8192 wide or more ran 5-7 us
/// slower that way.
pub const WIDE_D: usize = 8192;

impl Plan {
    /// The compiler's plan for a grid of `grid` blocks: on a layer `WIDE_D` wide or more and a grid of
    /// two blocks or more, two roles (with two KV heads or more) and the MLP in two parts or more; else
    /// one role and one part. Always as many parts as keep Down's rows within `MAX_ROW`.
    pub fn choose(cfg: &Config, grid: u32) -> Plan {
        let wide = cfg.d >= WIDE_D && grid >= 2;
        let roles = if wide && cfg.n_kv >= 2 { 2 } else { 1 };
        let needed = Plan::least_mlp_parts(cfg);
        let mlp_parts = if wide && cfg.ffn >= 16 { needed.max(2) } else { needed };
        Plan { roles, mlp_parts }
    }

    /// The fewest parts of `ffn` that keep Down's rows within `MAX_ROW`.
    fn least_mlp_parts(cfg: &Config) -> usize {
        cfg.ffn.div_ceil(MAX_ROW).max(1)
    }

    /// The compiler's plan with what `forced` names put in its place; `Err` says what the layer or
    /// the grid cannot take.
    pub fn with(cfg: &Config, grid: u32, forced: Forced) -> Result<Plan, String> {
        let chosen = Plan::choose(cfg, grid);
        let plan = Plan {
            roles: forced.roles.unwrap_or(chosen.roles),
            mlp_parts: forced.mlp_parts.unwrap_or(chosen.mlp_parts),
        };
        match plan.roles {
            1 => {}
            2 if cfg.n_kv >= 2 && grid >= 2 => {}
            2 => {
                return Err(format!(
                    "two roles need two KV heads and two blocks or more (n_kv = {}, {grid} blocks)",
                    cfg.n_kv
                ));
            }
            r => return Err(format!("{r} roles: a plan has one or two")),
        }
        let least = Plan::least_mlp_parts(cfg);
        let most = MAX_MLP_PARTS.min(cfg.ffn / 8);
        if !(least..=most).contains(&plan.mlp_parts) {
            return Err(format!(
                "the MLP in {} part(s): ffn = {} runs in {least} to {most} (Down's rows at most {MAX_ROW}, at most \
                 {MAX_MLP_PARTS} parts, each of whole 16-byte vectors)",
                plan.mlp_parts, cfg.ffn
            ));
        }
        Ok(plan)
    }

    /// The KV groups each role's phases cover: two halves, or one range of every group.
    pub fn halves(self, cfg: &Config) -> Vec<Groups> {
        if self.roles == 1 {
            return vec![Groups::all(cfg)];
        }
        let first = cfg.n_kv / 2;
        vec![Groups { kv0: 0, n_kv: first }, Groups { kv0: first, n_kv: cfg.n_kv - first }]
    }
}

/// How an attention phase of `n_kv` KV heads run by `blocks` blocks splits its work at position `pos`
/// (the kernel's `AttnItems`, mirrored for `grader profile`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AttentionSplit {
    /// Chunks of each head's cached slots `0..=pos`.
    pub chunks: usize,
    /// Consecutive chunks per work item, and items per head.
    pub span: usize,
    pub splits: usize,
}

impl AttentionSplit {
    /// `ATTN_TEAMS` teams per block; a head split over as many teams as it can have, at most
    /// `ATTN_MAX_SPLITS`, when there are fewer heads than teams, else one item per head.
    pub fn at(cfg: &Config, n_kv: usize, blocks: usize, pos: usize) -> AttentionSplit {
        let chunks = pos / chunk(cfg) + 1;
        let teams = ATTN_TEAMS * blocks;
        let most = if n_kv >= teams { 1 } else { (teams / n_kv).min(ATTN_MAX_SPLITS).min(chunks) };
        let span = chunks.div_ceil(most);
        AttentionSplit { chunks, span, splits: chunks.div_ceil(span) }
    }
}

/// The blocks of a one-role layer's Qkv and O projection: all but the first `n_kv`, where those are at
/// most an eighth of the grid (Llama-3.2-1B's 8 KV heads of 132 blocks: 124 take Qkv's rows).
/// Attention places its items on the blocks' first teams in block order (the kernel's `AttnItems`),
/// so at short contexts, one item a KV head, those blocks run it: off Qkv, they start
/// loading its cached rows while Qkv runs; off the O projection, whose first weights the other blocks
/// stream while they wait for attention, they do not hold back its last rows (their rings hold
/// attention's chunks until it ends). Measured in docs/perf.md ("Attention on blocks of its own").
fn beside_attention(cfg: &Config, grid: u32) -> Blocks {
    let n_kv = cfg.n_kv as u32;
    if grid >= 8 * n_kv { Blocks { first: n_kv, count: grid - n_kv, stride: 1 } } else { Blocks::first(grid) }
}

/// Whether the program reduces O's and Down's products across the GPUs a layer is split over
/// (`spec::parallel`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Split {
    /// One GPU, no Reduce rows: the program the one-GPU kernels run.
    None,
    /// Split over this many GPUs, with the Reduce rows; over one, the split's own path on one GPU,
    /// whose outputs must be the unsplit program's bit for bit.
    Over(usize),
}

/// The layer as a program for a grid of `grid` blocks laid out as `plan` says.
///
/// With one role: Qkv, attention and the O projection, each waiting for the one before, attention on
/// every block and the other two beside its first blocks (`beside_attention`); then the MLP.
///
/// With two halves, A (the grid's even blocks) and B (the odd ones) take turns (the weights' bytes
/// stream while attention's latency-bound chain runs):
///
/// | phase | blocks | waits for | |
/// |---|---|---|---|
/// | 0 Qkv, half 0 | all | - | the first half's q, k, v |
/// | 1 Qkv, half 1 | B | - | while A runs 2 and 3 |
/// | 2 attention, half 0 | A | 0 | |
/// | 3 O projection, half 0's columns | A | 2 | f32 partials, while B runs 1 and 4 |
/// | 4 attention, half 1 | B | 1 | |
/// | 5 O projection, half 1's columns | all | 3, 4 | adds the partials: x1 |
///
/// The MLP follows on every block, in P parts of `ffn` (`Plan::mlp_parts`), with `o` the O projection's
/// last phase (P = 2 shown; one part is GateUp, then Down):
///
/// | phase | waits for | |
/// |---|---|---|
/// | o + 1 GateUp, act's first part | o | |
/// | o + 2 GateUp, act's second part | o | |
/// | o + 3 Down, act's first part | o + 1 | f32 partials, one per row |
/// | o + 4 Down, act's second part | o + 2 | adds the partials: out |
///
/// Down's parts run on the same blocks with the same rows, so each block adds the partials it wrote
/// itself and a later part waits only for its own GateUp part. A block that ends GateUp starts Down at
/// once: the part it needs finished a whole GateUp part ago. Parts beyond two exist for `ffn` over
/// `MAX_ROW`: a middle part adds its products to the partials and writes them back.
///
/// Split over GPUs ([`Split::Over`], `cfg` one GPU's share, `spec::parallel::shard`), O's and Down's
/// last parts leave their f32 partials too, and a Reduce phase after each, on every block and waiting
/// for every phase that writes those partials, adds every GPU's partials to the residual: x1 after O,
/// the layer's output after Down (which a stack's next layer then waits for in place of Down's
/// phases). Two more phases a layer.
pub fn compile(cfg: &Config, b: &Buffers, grid: u32, plan: Plan, split: Split) -> Vec<Row> {
    let split = match split {
        Split::None => false,
        Split::Over(ranks) => {
            assert!(ranks >= 1, "a layer is split over one GPU or more");
            true
        }
    };
    let i = |v: usize| v as i64;
    let p = |v: u64| v as i64;
    let eps = cfg.eps.to_bits() as i64;
    let (hd, max_seq, group) = (cfg.hd, cfg.max_seq_len, cfg.group());
    let halves = plan.halves(cfg);
    let all = Blocks::first(grid);
    // The halves interleave (A the even blocks, B the odd): the launch places blocks 2i and 2i + 1 on
    // neighbouring SMs, so each half has one SM of every such pair and reads at the whole grid's rate,
    // where the grid's first half lands on an uneven set of SMs (it read 3.2 TB/s against 4.5 on one
    // card; docs/perf.md, "The two-role plan, measured").
    let (a, bb) =
        (Blocks { first: 0, count: grid.div_ceil(2), stride: 2 }, Blocks { first: 1, count: grid / 2, stride: 2 });
    let qkv_row = |h: usize, g: Groups| {
        let cache = 2 * (g.kv0 * max_seq * hd) as u64;
        row(
            Op::Qkv,
            &[
                (qkv::W, layer_ref([Slot::WQkv0, Slot::WQkv1][h], 0)),
                (qkv::Norm, layer_ref(Slot::InNorm, 0)),
                (qkv::QOut, p(b.q + 2 * (g.q0(cfg) * hd) as u64)),
                (qkv::KCache, layer_ref(Slot::KCache, cache)),
                (qkv::VCache, layer_ref(Slot::VCache, cache)),
                (qkv::Cos, p(b.cos)),
                (qkv::Sin, p(b.sin)),
                (qkv::D, i(cfg.d)),
                (qkv::NQ, i(g.n_q(cfg))),
                (qkv::NKv, i(g.n_kv)),
                (qkv::Hd, i(hd)),
                (qkv::MaxSeq, i(max_seq)),
                (qkv::EpsBits, eps),
            ],
        )
    };
    let attn_row = |g: Groups| {
        let cache = 2 * (g.kv0 * max_seq * hd) as u64;
        let partials = (g.kv0 * max_splits(cfg) * group) as u64;
        row(
            Op::Attention,
            &[
                (attn::Q, p(b.q + 2 * (g.q0(cfg) * hd) as u64)),
                (attn::KCache, layer_ref(Slot::KCache, cache)),
                (attn::VCache, layer_ref(Slot::VCache, cache)),
                (attn::PartO, p(b.part_o + 4 * partials * hd as u64)),
                (attn::PartMl, p(b.part_ml + 4 * partials * 2)),
                (attn::Counters, p(b.counters + 4 * 2 * g.kv0 as u64)),
                (attn::AOut, p(b.a + 2 * (g.q0(cfg) * hd) as u64)),
                (attn::NQ, i(g.n_q(cfg))),
                (attn::NKv, i(g.n_kv)),
                (attn::Hd, i(hd)),
                (attn::MaxSeq, i(max_seq)),
                (attn::Chunk, i(chunk(cfg))),
            ],
        )
    };
    // The O projection of the columns of `g`'s query heads from `w`; `part_in` / `part_out` as the
    // operands say (0: none).
    let oproj_row = |w: Slot, g: Groups, part_in: u64, part_out: u64| {
        row(
            Op::OProj,
            &[
                (oproj::W, layer_ref(w, 0)),
                (oproj::A, p(b.a + 2 * (g.q0(cfg) * hd) as u64)),
                (oproj::X1Out, p(b.x1)),
                (oproj::Rows, i(cfg.d)),
                (oproj::Cols, i(g.n_q(cfg) * hd)),
                (oproj::PartIn, p(part_in)),
                (oproj::PartOut, p(part_out)),
            ],
        )
    };
    // Part k of the MLP's parts (`Plan::mlp_parts`, columns `mlp_part` of `ffn`): GateUp's rows of act's
    // k-th part, and the product of Down's columns that read it. Down's first part writes its f32
    // products to `down_part`, each later part adds its own to them, and the last rounds the sum.
    let parts = plan.mlp_parts;
    let gateup_row = |k: usize| {
        let f = mlp_part(cfg, parts, k);
        row(
            Op::GateUp,
            &[
                (gateup::W, layer_ref(Slot::WGateUp, 2 * (2 * f.start * cfg.d) as u64)),
                (gateup::Norm, layer_ref(Slot::PostNorm, 0)),
                (gateup::X1, p(b.x1)),
                (gateup::ActOut, p(b.act + 2 * f.start as u64)),
                (gateup::D, i(cfg.d)),
                (gateup::Ffn, i(f.len())),
                (gateup::EpsBits, eps),
            ],
        )
    };
    let down_row = |k: usize| {
        let f = mlp_part(cfg, parts, k);
        row(
            Op::Down,
            &[
                (down::W, layer_ref([Slot::WDown0, Slot::WDown1, Slot::WDown2][k], 0)),
                (down::Act, p(b.act + 2 * f.start as u64)),
                (down::X1, p(b.x1)),
                (down::Rows, i(cfg.d)),
                (down::Cols, i(f.len())),
                (down::PartIn, p(if k > 0 { b.down_part } else { 0 })),
                (down::PartOut, p(if k + 1 < parts { b.down_part } else { 0 })),
            ],
        )
    };
    // Every GPU's partials added to the residual (0: the layer's input), into `out` (0: the layer's
    // output).
    let reduce_row = |partials: u64, residual: u64, out: u64| {
        row(
            Op::Reduce,
            &[
                (reduce::Parts, p(partials)),
                (reduce::Residual, p(residual)),
                (reduce::Out, p(out)),
                (reduce::Rows, i(cfg.d)),
            ],
        )
    };
    let o_out = if split { b.x1_part } else { 0 };
    let mut phases: Vec<(Row, Blocks, Vec<usize>)> = if halves.len() == 1 {
        let g = Groups::all(cfg);
        vec![
            (qkv_row(0, g), beside_attention(cfg, grid), vec![]),
            (attn_row(g), all, vec![0]),
            (oproj_row(Slot::WO0, g, 0, o_out), beside_attention(cfg, grid), vec![1]),
        ]
    } else {
        let (h0, h1) = (halves[0], halves[1]);
        vec![
            (qkv_row(0, h0), all, vec![]),
            (qkv_row(1, h1), bb, vec![]),
            (attn_row(h0), a, vec![0]),
            (oproj_row(Slot::WO0, h0, 0, b.x1_part), a, vec![2]),
            (attn_row(h1), bb, vec![1]),
            (oproj_row(Slot::WO1, h1, b.x1_part, o_out), all, vec![3, 4]),
        ]
    };
    if split {
        let writers = (0..phases.len()).filter(|&k| phases[k].0[0] == Op::OProj as i64).collect();
        phases.push((reduce_row(b.x1_part, 0, b.x1), all, writers));
    }
    let o = phases.len() - 1;
    for k in 0..parts {
        phases.push((gateup_row(k), all, vec![o]));
    }
    for k in 0..parts {
        let mut r = down_row(k);
        if split && k + 1 == parts {
            r[down::PartOut as usize] = p(b.down_part);
        }
        phases.push((r, all, vec![o + 1 + k]));
    }
    if split {
        phases.push((reduce_row(b.down_part, b.x1, 0), all, (phases.len() - parts..phases.len()).collect()));
    }
    // In a stack, a layer's Qkv phases read the layer before's output, which its Down phases write (or,
    // split over GPUs, the Reduce after them). Every other phase reads it only after its own layer's Qkv
    // (through the waits above).
    let downs = if split { phases.len() - 1..phases.len() } else { phases.len() - parts..phases.len() };
    phases
        .into_iter()
        .map(|(mut r, blocks, waits)| {
            r[BLOCKS_WORD] = blocks.word();
            r[WAITS_WORD] = waits.iter().map(|w| 1i64 << w).sum();
            if r[0] == Op::Qkv as i64 {
                r[WAITS_WORD] |= downs.clone().map(|w| 1i64 << (PREV_LAYER_WAITS + w)).sum::<i64>();
            }
            r
        })
        .collect()
}

/// Whether phase `row` reads its layer's input (`x`, or the layer before's output): Qkv, the O
/// projection (its residual), and a Reduce row whose residual it is.
pub fn reads_layer_input(row: &Row) -> bool {
    match Op::from_word(row[0]) {
        Some(Op::Qkv | Op::OProj) => true,
        Some(Op::Reduce) => row[reduce::Residual as usize] == 0,
        _ => false,
    }
}

/// The partials a part of a GEMV split by columns adds (`PartIn`) and leaves (`PartOut`), 0 where it
/// has none: for the O projection's and Down's rows; `None` for any other.
pub fn partials(row: &Row) -> Option<(i64, i64)> {
    match Op::from_word(row[0])? {
        Op::OProj => Some((row[oproj::PartIn as usize], row[oproj::PartOut as usize])),
        Op::Down => Some((row[down::PartIn as usize], row[down::PartOut as usize])),
        _ => None,
    }
}

/// The row before row `i` whose partials row `i` adds: the part before it in its GEMV's chain of
/// parts (`None` for a first part, or a row of no GEMV split by columns).
pub fn part_writer(rows: &[Row], i: usize) -> Option<usize> {
    let (part_in, _) = partials(&rows[i]).filter(|&(part_in, _)| part_in != 0)?;
    (0..i).rev().find(|&j| partials(&rows[j]).is_some_and(|(_, out)| out == part_in))
}

/// What each phase of a step over `layers` layers must follow, the phases numbered over every layer as
/// the kernel numbers them (phase f is row f % rows.len() of layer f / rows.len()): the phases its waits
/// word names (of its own layer, and from `PREV_LAYER_WAITS` of the layer before within the step), and
/// the part of a split GEMV whose partials it adds where both run on the same blocks with the same
/// rows, which no wait orders: each block adds only what it wrote itself, in program order. Nothing else
/// orders two phases, so any order that keeps these (`cpu::CpuStack::step_in_order`) is one the kernel
/// may run; the CPU executor's tests run such orders against the golden model.
pub fn dependencies(rows: &[Row], layers: usize) -> Vec<Vec<usize>> {
    let n = rows.len();
    (0..n * layers)
        .map(|f| {
            let (l, i) = (f / n, f % n);
            let waits = rows[i][WAITS_WORD];
            let mut after: Vec<usize> = (0..n).filter(|&w| (waits >> w) & 1 == 1).map(|w| l * n + w).collect();
            if l > 0 {
                after.extend((0..n).filter(|&w| (waits >> (PREV_LAYER_WAITS + w)) & 1 == 1).map(|w| (l - 1) * n + w));
            }
            // The part before whose partials this one adds, run by the same blocks over the same rows.
            if let Some(j) = part_writer(rows, i)
                .filter(|&j| rows[j][BLOCKS_WORD] == rows[i][BLOCKS_WORD] && gemv_rows(&rows[j]) == gemv_rows(&rows[i]))
            {
                after.push(l * n + j);
            }
            after.sort_unstable();
            after.dedup();
            after
        })
        .collect()
}

/// The program compiled with `plan` in words: its phases, its roles, the MLP's parts and how its first
/// attention phase splits the cache at position `pos` (`grader profile` prints it).
pub fn describe(cfg: &Config, plan: Plan, rows: &[Row], pos: usize) -> String {
    let roles = match plan.halves(cfg).as_slice() {
        [h0, h1] => format!(
            "two roles (KV heads {}-{} on the even blocks, {}-{} on the odd)",
            h0.kv0,
            h0.kv0 + h0.n_kv - 1,
            h1.kv0,
            h1.kv0 + h1.n_kv - 1
        ),
        _ => match rows.iter().find(|r| r[0] == Op::Qkv as i64).map(Blocks::of) {
            Some(b) if b.first > 0 => format!(
                "one role (attention on every block, Qkv and the O projection beside its first items' blocks 0-{}, on the other {})",
                b.first - 1,
                b.count
            ),
            _ => "one role (every phase on every block)".into(),
        },
    };
    let parts = plan.mlp_parts;
    let widths: Vec<String> = (0..parts).map(|k| mlp_part(cfg, parts, k).len().to_string()).collect();
    let attention = rows.iter().find(|r| r[0] == Op::Attention as i64).map(|r| {
        let (n_kv, blocks) = (r[attn::NKv as usize] as usize, Blocks::of(r).count as usize);
        let (s, teams) = (AttentionSplit::at(cfg, n_kv, blocks, pos), ATTN_TEAMS * blocks);
        format!(
            "; attention in chunks of {} slots, at position {pos} {} chunks per KV head as {} splits of {} ({n_kv} heads over {teams} teams)",
            chunk(cfg),
            s.chunks,
            s.splits,
            s.span
        )
    });
    format!(
        "{} phases, {} on the longest chain; {roles}; the MLP in {parts} part(s) of ffn ({}){}",
        rows.len(),
        longest_chain(rows),
        widths.join(" + "),
        attention.unwrap_or_default()
    )
}

/// Phases on a layer's longest chain of [`dependencies`]: the hand-offs a token pays in every layer
/// whatever its bytes, the count the dataflow plan (docs/perf.md) is to cut. A phase depends only on
/// phases before it, so one pass in row order finds it.
pub fn longest_chain(rows: &[Row]) -> usize {
    let after = dependencies(rows, 1);
    let mut depth = vec![0usize; rows.len()];
    for f in 0..rows.len() {
        depth[f] = 1 + after[f].iter().map(|&p| depth[p]).max().unwrap_or(0);
    }
    depth.into_iter().max().unwrap_or(0)
}

/// The operation of the task's layer that phase `row` computes or completes: a Reduce row completes the
/// O projection (it writes x1) or Down (it writes the layer's output).
pub fn layer_op_of(row: &Row) -> Option<LayerOp> {
    match Op::from_word(row[0])? {
        Op::Reduce if row[reduce::Out as usize] == 0 => Some(LayerOp::Down),
        Op::Reduce => Some(LayerOp::OProj),
        op => op.layer_op(),
    }
}

/// Rows of the GEMV `row` streams (the kernel's `gemv_of`); `None` for a phase without one.
pub fn gemv_rows(row: &Row) -> Option<usize> {
    let w = |i: usize| row[i] as usize;
    match Op::from_word(row[0])? {
        Op::Qkv => Some((w(qkv::NQ as usize) + 2 * w(qkv::NKv as usize)) * w(qkv::Hd as usize)),
        Op::OProj => Some(w(oproj::Rows as usize)),
        Op::GateUp => Some(2 * w(gateup::Ffn as usize)),
        Op::Down => Some(w(down::Rows as usize)),
        Op::Nop | Op::Attention | Op::Reduce => None,
    }
}

/// Columns of the GEMV `row` streams (the kernel's `gemv_of`); `None` for a phase without one.
pub fn gemv_cols(row: &Row) -> Option<usize> {
    let w = |i: usize| row[i] as usize;
    match Op::from_word(row[0])? {
        Op::Qkv => Some(w(qkv::D as usize)),
        Op::OProj => Some(w(oproj::Cols as usize)),
        Op::GateUp => Some(w(gateup::D as usize)),
        Op::Down => Some(w(down::Cols as usize)),
        Op::Nop | Op::Attention | Op::Reduce => None,
    }
}

/// The share of its operation's bytes (`ByteModel::by_op`) that `row` reads: the part of the groups, of
/// the O projection's columns or of `ffn` it covers (a Reduce row, none).
pub fn share(row: &Row, cfg: &Config) -> f64 {
    match Op::from_word(row[0]) {
        Some(Op::Qkv) => row[qkv::NKv as usize] as f64 / cfg.n_kv as f64,
        Some(Op::Attention) => row[attn::NKv as usize] as f64 / cfg.n_kv as f64,
        Some(Op::OProj) => row[oproj::Cols as usize] as f64 / cfg.q_dim() as f64,
        Some(Op::GateUp) => row[gateup::Ffn as usize] as f64 / cfg.ffn as f64,
        Some(Op::Down) => row[down::Cols as usize] as f64 / cfg.ffn as f64,
        Some(Op::Reduce) => 0.0,
        Some(Op::Nop) | None => 1.0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The phases a row waits for.
    fn waits(row: &Row) -> Vec<usize> {
        (0..MAX_PHASES).filter(|p| row[WAITS_WORD] >> p & 1 == 1).collect()
    }

    /// One past the last block of `b`.
    fn end(b: Blocks) -> u32 {
        if b.count == 0 { b.first } else { b.first + (b.count - 1) * b.stride + 1 }
    }

    const CUH: &str = include_str!("../../kernels/megakernel/program.cuh");

    #[test]
    fn opcodes_mirror_the_cuda_header() {
        assert!(CUH.contains(&format!("PROGRAM_ROW_WORDS = {ROW_WORDS};")));
        assert!(CUH.contains(&format!("PROGRAM_MAX_PHASES = {MAX_PHASES};")));
        // BLOCKS_WORD and WAITS_WORD are defined the same way.
        assert!(CUH.contains("ROW_BLOCKS = PROGRAM_ROW_WORDS - 2;"));
        assert!(CUH.contains("ROW_WAITS = PROGRAM_ROW_WORDS - 1;"));
        assert!(CUH.contains(&format!("PREV_LAYER_WAITS = {PREV_LAYER_WAITS};")));
        assert!(CUH.contains(&format!("LAYER_WORDS = {LAYER_WORDS};")));
        assert!(CUH.contains(&format!("LAYER_SLOT_BITS = {SLOT_BITS};")));
        assert!(CUH.contains(&format!("PROGRAM_MAX_LAYERS = {MAX_STACK_LAYERS};")));
        for (slot, name) in [(Slot::WK, "SLOT_WK"), (Slot::WV, "SLOT_WV"), (Slot::WUp, "SLOT_WUP")] {
            assert!(CUH.contains(&format!("{name} = {};", slot as usize)), "{name}");
        }
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
            assert!(CUH.contains(&line), "kernels/megakernel/program.cuh lacks `{line}`");
        }
    }

    #[test]
    fn operand_words_mirror_the_cuda_header() {
        fn check<W: std::fmt::Debug + Copy + Into<usize>>(ns: &str, all: &[W]) {
            let names: Vec<String> = all.iter().map(|w| format!("{w:?}")).collect();
            assert_eq!(all.first().map(|w| (*w).into()), Some(1));
            let want = format!("namespace {ns} {{ enum : int {{ {} = 1, {} }}; }}", names[0], names[1..].join(", "));
            assert!(CUH.contains(&want), "kernels/megakernel/program.cuh lacks `{want}`");
            assert!(all.len() < ROW_WORDS);
        }
        check("qkv", qkv::ALL);
        check("attn", attn::ALL);
        check("oproj", oproj::ALL);
        check("gateup", gateup::ALL);
        check("down", down::ALL);
        check("reduce", reduce::ALL);
    }

    fn layer() -> LayerBuffers {
        LayerBuffers {
            w_qkv: [1, 18],
            in_norm: 2,
            k_cache: 4,
            v_cache: 5,
            w_o: [12, 19],
            w_gateup: 14,
            post_norm: 15,
            w_down: [17, 21, 23],
            in_place: None,
        }
    }

    /// The program as it runs for `layer()`.
    fn compiled(cfg: &Config, grid: u32, plan: Plan) -> Vec<Row> {
        compile(cfg, &test_buffers(), grid, plan, Split::None)
            .iter()
            .map(|r| resolve_row(r, &layer().table()))
            .collect()
    }

    /// A layer's table resolves every reference to its slot's address plus the offset; other words
    /// stay as they are; Qkv waits for the layer before's Down phases, and nothing else does.
    #[test]
    fn references_resolve_per_layer() {
        let t = layer().table();
        assert_eq!(resolve(layer_ref(Slot::KCache, 0), &t), 4);
        assert_eq!(resolve(layer_ref(Slot::WDown2, 1 << 40), &t), 23 + (1 << 40));
        assert_eq!(resolve(7, &t), 7);
        let cfg = Config::graded();
        let prog = compile(&cfg, &test_buffers(), 132, Plan::choose(&cfg, 132), Split::None);
        let other = LayerBuffers { k_cache: 1000, ..layer() };
        assert_eq!(resolve_row(&prog[0], &other.table())[qkv::KCache as usize], 1000);
        for r in &prog {
            let prev = (r[WAITS_WORD] >> PREV_LAYER_WAITS) as usize;
            let want = if r[0] == Op::Qkv as i64 { 0b11 << 8 } else { 0 };
            assert_eq!(prev, want, "{r:?}");
        }
    }

    /// Operand words of each opcode, which end before the blocks and waits words.
    fn operands(op: Op) -> usize {
        match op {
            Op::Nop => 0,
            Op::Qkv => qkv::ALL.len(),
            Op::Attention => attn::ALL.len(),
            Op::OProj => oproj::ALL.len(),
            Op::GateUp => gateup::ALL.len(),
            Op::Down => down::ALL.len(),
            Op::Reduce => reduce::ALL.len(),
        }
    }

    /// The compiler's choice: wide layers in two roles and two MLP parts or more, narrow ones in one
    /// role and as few parts as Down's rows allow, whatever the grid; one block in one role.
    #[test]
    fn wide_layers_take_two_roles_and_narrow_ones_one() {
        for m in &spec::family::FAMILY {
            let cfg = m.config();
            let plan = Plan::choose(&cfg, 132);
            let least = cfg.ffn.div_ceil(MAX_ROW);
            if cfg.d >= WIDE_D {
                assert_eq!(plan, Plan { roles: 2, mlp_parts: least.max(2) }, "{}", m.name);
            } else {
                assert_eq!(plan, Plan { roles: 1, mlp_parts: least }, "{}", m.name);
            }
            assert_eq!(Plan::with(&cfg, 132, Forced::default()), Ok(plan));
            assert_eq!(Plan::choose(&cfg, 1).roles, 1);
        }
        assert_eq!(Plan::choose(&Config::small(), 132), Plan { roles: 1, mlp_parts: 1 });
    }

    #[test]
    fn the_one_role_plan_chains_its_phases_beside_attentions_first_blocks() {
        let mut cfg = Config::small();
        assert_eq!(cfg.n_kv, 1);
        let prog = compiled(&cfg, 132, Plan { roles: 1, mlp_parts: 2 });
        let ops: Vec<Op> = prog.iter().map(|r| Op::from_word(r[0]).unwrap()).collect();
        use Op::*;
        assert_eq!(ops, [Qkv, Attention, OProj, GateUp, GateUp, Down, Down]);
        let w: Vec<Vec<usize>> = prog.iter().map(waits).collect();
        assert_eq!(w, [vec![], vec![0], vec![1], vec![2], vec![2], vec![3], vec![4]]);
        let beside = Blocks { first: 1, count: 131, stride: 1 };
        assert!(
            prog.iter().all(|r| Blocks::of(r)
                == if r[0] == OProj as i64 || r[0] == Qkv as i64 { beside } else { Blocks::first(132) })
        );
        // Attention's first blocks are left to it only where they are at most an eighth of the grid.
        let eight = Config { n_kv: 8, n_q: 32, ..Config::small() };
        assert_eq!(beside_attention(&eight, 64), Blocks { first: 8, count: 56, stride: 1 });
        assert_eq!(beside_attention(&eight, 63), Blocks::first(63));
        // One block: five phases, each the byte model's operation of its index, whatever the layer.
        for c in [Config::small(), Config::graded()] {
            cfg = c;
            let prog = compiled(&cfg, 1, Plan::choose(&cfg, 1));
            let ops: Vec<LayerOp> = prog.iter().map(|r| Op::from_word(r[0]).unwrap().layer_op().unwrap()).collect();
            assert_eq!(ops, LayerOp::ALL);
            assert!(prog.iter().all(|r| share(r, &cfg) == 1.0 && Blocks::of(r) == Blocks::first(1)));
            assert_eq!(prog.iter().map(waits).collect::<Vec<_>>(), [vec![], vec![0], vec![1], vec![2], vec![3]]);
        }
    }

    /// GateUp's halves write the two halves of act from the two halves of the packed rows; Down's
    /// read them with their halves of the columns, the first writing the partials the second adds, on
    /// the same blocks with the same rows (the kernel adds a block's own partials without a wait).
    #[test]
    fn the_mlp_parts_split_act_and_share_downs_rows() {
        for (cfg, grid) in [(Config::graded(), 132), (Config::small(), 132), (Config::tiny(), 2)] {
            let plan = Plan::with(&cfg, grid, Forced { roles: None, mlp_parts: Some(2) }).unwrap();
            let prog = compiled(&cfg, grid, plan);
            let of = |op: Op| prog.iter().filter(move |r| r[0] == op as i64).collect::<Vec<_>>();
            let (g, d) = (of(Op::GateUp), of(Op::Down));
            assert_eq!((g.len(), d.len()), (2, 2), "{}", cfg.name);
            let f = cfg.ffn / 2;
            assert!(g.iter().chain(&d).all(|r| share(r, &cfg) == 0.5));
            assert_eq!(g[1][gateup::W as usize] - g[0][gateup::W as usize], (2 * 2 * f * cfg.d) as i64);
            assert_eq!(g[1][gateup::ActOut as usize] - g[0][gateup::ActOut as usize], (2 * f) as i64);
            assert_eq!((g[0][gateup::Ffn as usize], g[1][gateup::Ffn as usize]), (f as i64, f as i64));
            assert_eq!((d[0][down::W as usize], d[1][down::W as usize]), (17, 21));
            assert_eq!(d[0][down::Act as usize], g[0][gateup::ActOut as usize]);
            assert_eq!(d[1][down::Act as usize], g[1][gateup::ActOut as usize]);
            assert_eq!((d[0][down::Cols as usize], d[1][down::Cols as usize]), (f as i64, f as i64));
            assert_eq!((d[0][down::PartIn as usize], d[0][down::PartOut as usize]), (0, 22));
            assert_eq!((d[1][down::PartIn as usize], d[1][down::PartOut as usize]), (22, 0));
            assert_eq!(Blocks::of(d[0]), Blocks::of(d[1]));
            assert_eq!(gemv_rows(d[0]), gemv_rows(d[1]));
            // Each half of Down waits for the GateUp half it reads, and nothing else.
            let index = |r: &Row| prog.iter().position(|q| q == r).unwrap();
            assert_eq!(waits(d[0]), [index(g[0])]);
            assert_eq!(waits(d[1]), [index(g[1])]);
        }
        // One block: one part, whatever ffn's vectors.
        assert_eq!(Plan::choose(&Config { ffn: 776, ..Config::tiny() }, 1).mlp_parts, 1);
    }

    /// An ffn over two rows of `MAX_ROW` runs in three parts: the middle part of Down adds its products
    /// to the first's partials and writes them back for the last, and every row stays within `MAX_ROW`.
    #[test]
    fn an_ffn_over_two_rows_runs_in_three_parts_chained_through_the_partials() {
        for (ffn, parts) in [(28672, 2), (53248, 2), (2 * MAX_ROW, 2), (2 * MAX_ROW + 8, 3), (3 * MAX_ROW, 3)] {
            let cfg = Config { ffn, ..Config::graded() };
            assert_eq!(Plan::choose(&cfg, 132).mlp_parts, parts, "ffn {ffn}");
            let prog = compiled(&cfg, 132, Plan::choose(&cfg, 132));
            assert!(prog.len() <= MAX_PHASES);
            let downs: Vec<&Row> = prog.iter().filter(|r| r[0] == Op::Down as i64).collect();
            assert_eq!(downs.len(), parts);
            let cols: Vec<i64> = downs.iter().map(|r| r[down::Cols as usize]).collect();
            assert!(cols.iter().all(|&c| c as usize <= MAX_ROW && c % 8 == 0), "{cols:?}");
            assert_eq!(cols.iter().sum::<i64>(), ffn as i64);
            for (k, r) in downs.iter().enumerate() {
                let (pin, pout) = (r[down::PartIn as usize], r[down::PartOut as usize]);
                assert_eq!((pin != 0, pout != 0), (k > 0, k + 1 < parts), "part {k}");
                assert_eq!(r[down::W as usize], [17, 21, 23][k]);
            }
        }
    }

    #[test]
    fn the_two_role_plan_splits_qkv_attention_and_oproj_by_halves_of_the_groups() {
        let cfg = Config::graded();
        let prog = compiled(&cfg, 132, Plan::choose(&cfg, 132));
        let ops: Vec<Op> = prog.iter().map(|r| Op::from_word(r[0]).unwrap()).collect();
        use Op::*;
        assert_eq!(ops, [Qkv, Qkv, Attention, OProj, Attention, OProj, GateUp, GateUp, Down, Down]);
        let (all, a, b) =
            (Blocks::first(132), Blocks { first: 0, count: 66, stride: 2 }, Blocks { first: 1, count: 66, stride: 2 });
        let blocks: Vec<Blocks> = prog.iter().map(Blocks::of).collect();
        assert_eq!(blocks, [all, b, a, a, b, all, all, all, all, all]);
        // The halves are the even and the odd blocks, and together every block once.
        assert!((0..132).all(|k| a.contains(k) == (k % 2 == 0) && b.contains(k) == (k % 2 == 1)));
        assert!(!a.contains(132) && !b.contains(133) && end(a) == 131 && end(b) == 132);
        let w: Vec<Vec<usize>> = prog.iter().map(waits).collect();
        assert_eq!(w, [vec![], vec![], vec![0], vec![2], vec![1], vec![3, 4], vec![5], vec![5], vec![6], vec![7]]);
        // Each operation's shares add up to the whole of it.
        for op in [Qkv, Attention, OProj, GateUp, Down] {
            let total: f64 = prog.iter().filter(|r| r[0] == op as i64).map(|r| share(r, &cfg)).sum();
            assert_eq!(total, 1.0, "{op:?}");
        }
        // The halves' heads: the second half's q, caches, partials, counters and a start past the first's.
        let (q_half, cache_half) = (2 * (cfg.q_dim() / 2) as i64, 2 * (4 * cfg.max_seq_len * cfg.hd) as i64);
        assert_eq!(prog[1][qkv::QOut as usize] - prog[0][qkv::QOut as usize], q_half);
        assert_eq!(prog[1][qkv::KCache as usize] - prog[0][qkv::KCache as usize], cache_half);
        assert_eq!(prog[4][attn::Q as usize] - prog[2][attn::Q as usize], q_half);
        assert_eq!(prog[4][attn::AOut as usize] - prog[2][attn::AOut as usize], q_half);
        assert_eq!(prog[4][attn::Counters as usize] - prog[2][attn::Counters as usize], 4 * 2 * 4);
        assert_eq!(prog[5][oproj::A as usize] - prog[3][oproj::A as usize], q_half);
        // The first half's O projection writes the partials the second half's reads.
        assert_eq!((prog[3][oproj::PartIn as usize], prog[3][oproj::PartOut as usize]), (0, 20));
        assert_eq!((prog[5][oproj::PartIn as usize], prog[5][oproj::PartOut as usize]), (20, 0));
    }

    /// Each head's chunks are split over at most the teams there are for it: two chunks per team at the
    /// graded layer's 4k (one per buffer, both in flight at once), long runs of chunks at long contexts.
    #[test]
    fn attention_splits_cover_every_chunk_within_the_teams() {
        let cfg = Config::graded();
        assert_eq!(AttentionSplit::at(&cfg, 4, 66, 4096), AttentionSplit { chunks: 65, span: 2, splits: 33 });
        assert_eq!(AttentionSplit::at(&cfg, 4, 66, 131_072), AttentionSplit { chunks: 2049, span: 63, splits: 33 });
        assert_eq!(AttentionSplit::at(&cfg, 200, 66, 4096), AttentionSplit { chunks: 65, span: 65, splits: 1 });
        for (n_kv, blocks, pos) in [(1, 132, 100_000), (4, 66, 5000), (20, 66, 4096), (1, 1, 300), (132, 66, 9000)] {
            let s = AttentionSplit::at(&cfg, n_kv, blocks, pos);
            assert!(s.span * s.splits >= s.chunks && s.span * (s.splits - 1) < s.chunks, "{s:?}");
            assert!(s.splits <= ATTN_MAX_SPLITS && (s.splits == 1 || n_kv * s.splits <= 2 * blocks), "{s:?}");
        }
    }

    /// The plan in words names what the compiler chose: at the graded layer two roles, the MLP in two
    /// halves, two chunks of 64 slots per team at 4k; on one block one role and one part.
    #[test]
    fn the_plan_is_described_as_compiled() {
        let cfg = Config::graded();
        let text = describe(&cfg, Plan::choose(&cfg, 132), &compiled(&cfg, 132, Plan::choose(&cfg, 132)), 4127);
        assert_eq!(
            text,
            "10 phases, 7 on the longest chain; two roles (KV heads 0-3 on the even blocks, 4-7 on the odd); the MLP in \
             2 part(s) of ffn (14336 + 14336); attention in chunks of 64 slots, at position 4127 65 chunks per KV head as \
             33 splits of 2 (4 heads over 132 teams)"
        );
        let one = describe(&cfg, Plan::choose(&cfg, 1), &compiled(&cfg, 1, Plan::choose(&cfg, 1)), 4127);
        assert!(
            one.starts_with(
                "5 phases, 5 on the longest chain; one role (every phase on every block); the MLP in 1 part(s) of ffn \
                 (28672)"
            ),
            "{one}"
        );
        assert!(one.ends_with("65 chunks per KV head as 1 splits of 65 (8 heads over 2 teams)"), "{one}");
    }

    /// Every row waits only for earlier phases, so no block can wait, directly or through others, for a
    /// phase it has yet to run itself: the program cannot deadlock.
    #[test]
    fn every_plan_waits_only_for_earlier_phases() {
        let configs = [(Config::tiny(), 2), (Config::tiny(), 132), (Config::small(), 132), (Config::graded(), 132)];
        let plans = configs.iter().flat_map(|(cfg, grid)| {
            (1..=2).flat_map(move |roles| {
                (1..=MAX_MLP_PARTS).filter_map(move |mlp_parts| {
                    let forced = Forced { roles: Some(roles), mlp_parts: Some(mlp_parts) };
                    Some((cfg, *grid, Plan::with(cfg, *grid, forced).ok()?))
                })
            })
        });
        for (cfg, grid, plan) in plans {
            let prog = compiled(cfg, grid, plan);
            assert!(prog.len() <= MAX_PHASES);
            for (k, r) in prog.iter().enumerate() {
                assert!(waits(r).iter().all(|&w| w < k), "{}: phase {k} waits for {:?}", cfg.name, waits(r));
                let op = Op::from_word(r[0]).unwrap();
                let n = operands(op);
                assert!(n < BLOCKS_WORD, "{op:?}");
                let optional = |w: usize| match op {
                    Op::OProj => w == oproj::PartIn as usize || w == oproj::PartOut as usize,
                    Op::Down => w == down::PartIn as usize || w == down::PartOut as usize,
                    _ => false,
                };
                assert!((1..=n).all(|w| r[w] != 0 || optional(w)), "{r:?}");
                assert!(r[n + 1..BLOCKS_WORD].iter().all(|&w| w == 0), "{r:?}");
                let bl = Blocks::of(r);
                assert!(bl.count > 0 && end(bl) <= grid, "{}: {bl:?}", cfg.name);
                assert_eq!(Blocks::of(&[bl.word(); ROW_WORDS]), bl, "the word round-trips");
            }
        }
    }
}
