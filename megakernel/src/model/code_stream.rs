//! A quantised checkpoint's matrices as the model kernel's coded instances stream them
//! (`kernels/megakernel/model/model_fp8.cu` for fine-grained fp8, `model_nf4.cu` for bitsandbytes nf4):
//! a decode step streams each GEMV whose rows are too wide for slices as its codes and scales (fp8: a
//! byte a weight and an f32 scale per 128 columns, half of bf16's bytes; nf4: half a byte a weight and
//! the block's absmax per 64 columns, 28% of bf16's), each vector of 8 codes' values dotted with x in
//! f32 and the sum times its scale (the fused form: no weight rounded to bf16, so its outputs part from
//! the bf16 stream of the loader's weights by those roundings), or for nf4 rows of 4096 or 2048 columns
//! in whole tiles of 16 rows on the tensor cores (`pair_tiled`); the batch step streams the same codes
//! in the same arithmetic (`model_fp8_batch.cu`, `model_nf4_batch.cu`), so its lanes stay the bits of their
//! decode steps. Other narrow rows, the LM head and the norms stream bf16 as before.
//!
//! A packed matrix is the bf16 packing's rows in the same order (`pack`), each its row's codes (nf4's
//! repacked: code e of each 8 columns at bits 4e of their 32-bit word, as the kernel's `nf4_values8`
//! reads them), then every row's scales, one f32 for each `scale_cols` columns (its source block's),
//! in one allocation: the kernel finds the scales after the codes of the phase's `rows` rows. GateUp's
//! MLP parts are each such a matrix, one after the other, so the decode program's GateUp rows name
//! their part's offset (`decode_rows`); every other coded matrix has a slot of its own. A checkpoint
//! that cannot stream this way streams bf16, and says why (`stream_format`, `pack`).

use std::borrow::Cow;

use half::bf16;
use spec::data::LayerWeights;
use spec::{Config, Tensor};

use super::quantized::Coded;
use super::quantized::fp8::weight;
use crate::kernels::{SLICED_MAX_COLS, STAGE_BYTES, STAGES, has_narrow_rows};
use crate::pack::{self, Packing, mlp_part};
use crate::program::{self, LAYER_WORDS, Op, Plan, Row, Slot, gateup};

/// Columns of a packed fp8 row one scale covers (the kernel's `FP8_SCALE_COLS`): the checkpoints' usual
/// block of 128 x 128 (transformers' `FineGrainedFP8Config`, Qwen3's and DeepSeek's FP8 releases).
pub const FP8_SCALE_COLS: usize = 128;

/// Columns of a packed nf4 row one absmax covers (the kernel's `NF4_SCALE_COLS`): bitsandbytes' usual
/// block of 64 elements.
pub const NF4_SCALE_COLS: usize = 64;

/// bitsandbytes' NF4 code values (the kernel's `NF4_VALUES`): the nf4 stream's codebook, which a
/// checkpoint's `quant_map` must equal bit for bit.
pub const NF4_VALUES: [f32; 16] = [
    -1.0,
    -0.696_192_8,
    -0.525_073_05,
    -0.394_917_5,
    -0.284_441_38,
    -0.184_773_43,
    -0.091_050_036,
    0.0,
    0.079_580_3,
    0.160_930_2,
    0.246_112_3,
    0.337_915_24,
    0.440_709_83,
    0.562_617,
    0.722_956_84,
    1.0,
];

/// Rows of this many columns, or half as many, stream nf4 in pair tiles (`pair_tiled`), for the tensor
/// cores: a warp takes 256 columns of a tile's 16 rows, a 64-column group (one absmax) at a time, as
/// four bf16 mmas (m16n8k16) whose A registers are each one byte of codes, the two values of adjacent
/// columns of a row looked up at once (docs/perf.md, "The nf4 stream's arithmetic on the tensor cores: a
/// probe", which measured this layout in `scripts/probes/nf4_mma.cu`'s `pairs`; the kernel's
/// `vm_pairs.cuh` streams it). A stage holds one tile of the wide rows, or two of the narrow (warp w
/// then takes tile w / 8), 32 KB of codes either way.
pub const NF4_PAIR_COLS: usize = 4096;

/// A pair tile's rows: an mma's 16, which is a stage of NF4_PAIR_COLS columns' codes.
pub const NF4_TILE_ROWS: usize = 16;

/// Whether a packed matrix of `rows` rows of `cols` columns in `format` is in pair tiles: its codes
/// tile by tile of NF4_TILE_ROWS rows, each in `pair_code_index`'s order, and its scales the same way
/// (`pair_scale_index`). Rows of NF4_PAIR_COLS / 2 columns only in a `narrow` model (one with rows of at
/// most 2048 columns: `kernels::has_narrow_rows`), which runs the sliced instance, the decode instance
/// that streams them (the kernel's `pair_tiled_shape`); a wide model's, the O projection's halves of
/// two roles, stream bf16.
pub fn pair_tiled(format: Format, narrow: bool, rows: usize, cols: usize) -> bool {
    let width = cols == NF4_PAIR_COLS || (narrow && cols == NF4_PAIR_COLS / 2);
    format == Format::Nf4 && width && rows.is_multiple_of(NF4_TILE_ROWS)
}

/// The most rows a block takes of any phase of `rows` (a decode program) whose matrix streams in pair
/// tiles: the kernel gives such a phase's blocks whole tiles (`row_unit`), up to NF4_TILE_ROWS - 2 rows
/// more than an even share in pairs; 0 where no phase does.
pub fn pair_block_rows(format: Format, narrow: bool, rows: &[Row]) -> usize {
    rows.iter()
        .filter_map(|r| {
            let (n, cols) = (program::gemv_rows(r)?, program::gemv_cols(r)?);
            let blocks = program::Blocks::of(r).count as usize;
            pair_tiled(format, narrow, n, cols).then(|| NF4_TILE_ROWS * (n / NF4_TILE_ROWS).div_ceil(blocks))
        })
        .max()
        .unwrap_or(0)
}

/// Where a pair tile keeps byte `b` of its row `row` (columns 2b, 2b + 1, the first in the low nibble):
/// in warp w's group j, lane 4g + q's 16 bytes, register r of k-step m, where the mma's A fragment holds
/// row g + 8 (r % 2) at columns 256 w + 64 j + 16 m + 2q + 8 (r / 2) and the next, so that a lane reads
/// its 16 bytes of a group in one load. A tile of the narrow rows is half a stage: the next tile is the
/// stage's other half, warps 8 to 15's.
fn pair_code_index(row: usize, b: usize) -> usize {
    let col = 2 * b;
    let (w, j, c) = (col / 256, col % 256 / 64, col % 64);
    let (m, q, r) = (c / 16, c % 8 / 2, 2 * (c % 16 / 8) + row / 8);
    (((w * 4 + j) * 32 + 4 * (row % 8) + q) * 4 + m) * 4 + r
}

/// Where a pair tile keeps row `row`'s scale of group `group`: rows g and g + 8 side by side, the lane
/// holding both rows of the fragment reading them in one 8-byte load.
fn pair_scale_index(row: usize, group: usize) -> usize {
    (group * (NF4_TILE_ROWS / 2) + row % 8) * 2 + row / 8
}

/// Row-major codes and scales of `rows` rows of `cols` columns in pair tiles (`forward`), or back (not
/// `forward`).
fn tile_pairs(codes: &[u8], scales: &[f32], rows: usize, cols: usize, forward: bool) -> (Vec<u8>, Vec<f32>) {
    let (row_bytes, groups) = (cols / 2, cols / NF4_SCALE_COLS);
    let (mut out_codes, mut out_scales) = (vec![0u8; codes.len()], vec![0f32; scales.len()]);
    for t in 0..rows / NF4_TILE_ROWS {
        let (c0, s0) = (t * NF4_TILE_ROWS * row_bytes, t * NF4_TILE_ROWS * groups);
        for r in 0..NF4_TILE_ROWS {
            for b in 0..row_bytes {
                let (flat, tiled) = (c0 + r * row_bytes + b, c0 + pair_code_index(r, b));
                let (from, to) = if forward { (flat, tiled) } else { (tiled, flat) };
                out_codes[to] = codes[from];
            }
            for g in 0..groups {
                let (flat, tiled) = (s0 + r * groups + g, s0 + pair_scale_index(r, g));
                let (from, to) = if forward { (flat, tiled) } else { (tiled, flat) };
                out_scales[to] = scales[from];
            }
        }
    }
    (out_codes, out_scales)
}

/// The format of a checkpoint's codes, as the model kernel streams them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    Fp8,
    Nf4,
}

impl Format {
    /// The format of `m`'s codes.
    pub fn of(m: &Coded) -> Format {
        match m {
            Coded::Fp8(_) => Format::Fp8,
            Coded::Nf4(_) => Format::Nf4,
        }
    }

    /// The format in words.
    pub fn name(self) -> &'static str {
        match self {
            Format::Fp8 => "fp8",
            Format::Nf4 => "nf4",
        }
    }

    /// Columns one scale covers.
    pub fn scale_cols(self) -> usize {
        match self {
            Format::Fp8 => FP8_SCALE_COLS,
            Format::Nf4 => NF4_SCALE_COLS,
        }
    }

    /// Bytes of a row's codes for `cols` columns.
    fn code_bytes(self, cols: usize) -> usize {
        match self {
            Format::Fp8 => cols,
            Format::Nf4 => cols / 2,
        }
    }

    /// Bytes the format's instances keep at the end of their dynamic shared memory (the kernel's
    /// `code_tail_bytes`): a scale slot per ring stage, each the scales of a stage's codes (an nf4
    /// stage's codes at most half a stage, `stage_code_bytes`), and for nf4 the codebook after them.
    /// The partials then stop short of them.
    pub fn tail_bytes(self) -> usize {
        let (stages, stage) = (STAGES as usize, STAGE_BYTES as usize);
        match self {
            Format::Fp8 => stages * (stage / FP8_SCALE_COLS * 4),
            Format::Nf4 => stages * (stage / 2 * 2 / NF4_SCALE_COLS * 4) + NF4_VALUES.len() * 4,
        }
    }

    /// Columns of a streamed row must be a multiple of this: a stage's scales are then whole 16-byte
    /// pieces that a bulk copy takes (a multiple of 4 scales a row).
    pub fn cols_multiple(self) -> usize {
        4 * self.scale_cols()
    }

    /// Bytes of a packed matrix of `rows` rows of `cols`: its codes, then its scales.
    pub fn packed_bytes(self, rows: usize, cols: usize) -> usize {
        rows * self.code_bytes(cols) + 4 * rows * cols.div_ceil(self.scale_cols())
    }
}

/// Whether the coded instances stream a matrix of `rows` rows of `cols` columns in `format` as codes
/// (the kernel's `streams_codes` or `pair_tiled`): rows too wide for slices, and those in pair tiles
/// (`narrow` as for `pair_tiled`).
pub fn streams_codes(format: Format, narrow: bool, rows: usize, cols: usize) -> bool {
    cols > SLICED_MAX_COLS || pair_tiled(format, narrow, rows, cols)
}

/// Whether GateUp's MLP parts stream as codes: `stream_format` has refused parts that would not all.
fn gateup_streams_codes(format: Format, cfg: &Config, parts: usize) -> bool {
    let narrow = has_narrow_rows(cfg);
    (0..parts).all(|k| {
        let (rows, cols) = shape(&gateup_part(cfg, parts, k));
        streams_codes(format, narrow, rows, cols)
    })
}

/// One layer's weights as a quantised checkpoint stores them (`ModelWeights::coded`).
pub type CodedLayer = LayerWeights<Option<Coded>>;

/// The format of `layers`' codes, or None where no weight has any.
fn format_of(layers: &[CodedLayer]) -> Option<Format> {
    layers.iter().flat_map(|l| Tensor::WEIGHTS.iter().filter_map(|&t| l.get(t).as_ref())).map(Format::of).next()
}

/// Row `r`'s codes of `m` for columns [c0, c0 + cols), as the kernel reads them, appended to `out`
/// (`groups_refusal` holds first).
fn push_codes(m: &Coded, r: usize, c0: usize, cols: usize, out: &mut Vec<u8>) {
    match m {
        Coded::Fp8(m) => out.extend_from_slice(&m.codes[r * m.cols + c0..r * m.cols + c0 + cols]),
        // A row starts at an even element (`groups_refusal` holds it to a group's edge): the stored
        // bytes are the row's pairs, each with its first code in the high nibble; the kernel's in the low.
        Coded::Nf4(m) => {
            let at = (r * m.cols + c0) / 2;
            out.extend(m.codes[at..at + cols / 2].iter().map(|b| b.rotate_left(4)));
        }
    }
}

/// Why the packed row of `m`'s row `r` from column `c0` cannot have a scale per group of the format's
/// columns (a group must lie in one block of the source), or None where it can.
fn groups_refusal(m: &Coded, name: &str, r: usize, c0: usize) -> Option<String> {
    match m {
        Coded::Fp8(m) => {
            // Blocks of whole groups, the row starting at a group's edge; or one block across the row.
            let whole_row = m.block[1] >= m.cols;
            (!whole_row && (!m.block[1].is_multiple_of(FP8_SCALE_COLS) || !c0.is_multiple_of(FP8_SCALE_COLS))).then(|| {
                format!(
                    "{name}'s blocks of {} columns, its rows streamed from column {c0}: the stream takes a scale per \
                     {FP8_SCALE_COLS} columns",
                    m.block[1]
                )
            })
        }
        Coded::Nf4(m) => {
            if m.quant_map != NF4_VALUES {
                return Some(format!("{name}'s quant_map is not bitsandbytes' NF4 values, the stream's codebook"));
            }
            // Blocks of whole groups over the row-major elements, the row starting at a group's edge.
            let first = r * m.cols + c0;
            (!m.blocksize.is_multiple_of(NF4_SCALE_COLS) || !first.is_multiple_of(NF4_SCALE_COLS)).then(|| {
                format!(
                    "{name}'s blocks of {} elements, a streamed row starting at element {first}: the stream takes an \
                     absmax per {NF4_SCALE_COLS} columns",
                    m.blocksize
                )
            })
        }
    }
}

/// The scale of the group of `m`'s row `r` that starts at column `c` (`groups_refusal` holds).
fn group_scale(m: &Coded, r: usize, c: usize) -> f32 {
    match m {
        Coded::Fp8(m) => m.scale(r, c),
        Coded::Nf4(m) => m.scale(r * m.cols + c),
    }
}

/// The packed matrix `packing` describes, from `layer`'s codes and scales (all of `format`): its codes
/// in the packing's order, then each packed row's scales; or why it cannot be (a weight stored
/// unquantised, or scales that do not hold for whole groups of the format's columns). `narrow`: as for
/// `pair_tiled`.
pub fn pack<F: Fn(usize) -> (Tensor, usize)>(
    format: Format,
    narrow: bool,
    packing: &Packing<F>,
    layer: &CodedLayer,
) -> Result<Vec<u8>, String> {
    let (rows, cols) = (packing.rows, packing.cols);
    if !format.code_bytes(cols).is_multiple_of(16) {
        return Err(format!("rows of {cols} columns: the stream's bulk copies need a multiple of 16 bytes"));
    }
    let scale_cols = format.scale_cols();
    let mut bytes = Vec::with_capacity(format.packed_bytes(rows, cols));
    let mut scales = Vec::with_capacity(rows * cols.div_ceil(scale_cols));
    for p in 0..rows {
        let (t, at) = (packing.start)(p);
        let m = layer.get(t).as_ref().ok_or_else(|| format!("{} is stored unquantised", t.name()))?;
        let m_cols = match m {
            Coded::Fp8(m) => m.cols,
            Coded::Nf4(m) => m.cols,
        };
        let (r, c0) = (at / m_cols, at % m_cols);
        if let Some(why) = groups_refusal(m, t.name(), r, c0) {
            return Err(why);
        }
        push_codes(m, r, c0, cols, &mut bytes);
        scales.extend((0..cols.div_ceil(scale_cols)).map(|k| group_scale(m, r, c0 + k * scale_cols)));
    }
    if pair_tiled(format, narrow, rows, cols) {
        (bytes, scales) = tile_pairs(&bytes, &scales, rows, cols, true);
    }
    bytes.extend(scales.iter().flat_map(|s| s.to_le_bytes()));
    Ok(bytes)
}

/// The weights of a packed matrix of `rows` rows of `cols` (`pack`), in bf16, as the loader makes each
/// one from a checkpoint stored in bf16 (the CPU executor's reading of it). `narrow`: as for `pair_tiled`.
pub fn unpack(format: Format, narrow: bool, bytes: &[u8], rows: usize, cols: usize) -> Vec<bf16> {
    assert_eq!(bytes.len(), format.packed_bytes(rows, cols), "a packed {} matrix of {rows} x {cols}", format.name());
    let (codes, scale_bytes) = bytes.split_at(rows * format.code_bytes(cols));
    let scales: Vec<f32> =
        scale_bytes.chunks_exact(4).map(|s| f32::from_le_bytes(s.try_into().expect("four bytes"))).collect();
    let (codes, scales): (Cow<[u8]>, Vec<f32>) = if pair_tiled(format, narrow, rows, cols) {
        let (codes, scales) = tile_pairs(codes, &scales, rows, cols, false);
        (Cow::Owned(codes), scales)
    } else {
        (Cow::Borrowed(codes), scales)
    };
    let groups = cols.div_ceil(format.scale_cols());
    let scale = |r: usize, c: usize| scales[r * groups + c / format.scale_cols()];
    (0..rows * cols)
        .map(|i| {
            let s = scale(i / cols, i % cols);
            match format {
                Format::Fp8 => weight(codes[i], s),
                Format::Nf4 => {
                    let code = (codes[i / 2] >> (4 * (i % 2))) & 0xF;
                    bf16::from_f32(NF4_VALUES[code as usize] * s)
                }
            }
        })
        .collect()
}

/// One layer's coded matrices for its decode step: each slot that streams codes with its packed matrix
/// (the other slots keep the bf16 program's).
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct CodedMatrices {
    pub matrices: Vec<(Slot, Vec<u8>)>,
    /// Bytes a decode step of this layer streams less than in bf16.
    pub saved: u64,
}

/// `table` (the bf16 program's, for one layer) with each slot of `placed` (a slot of `CodedMatrices` and
/// where its matrix was put) in its place.
pub fn table(mut table: [i64; LAYER_WORDS], placed: &[(Slot, u64)]) -> [i64; LAYER_WORDS] {
    for &(slot, at) in placed {
        table[slot as usize] = at as i64;
    }
    table
}

/// A packing's (rows, columns).
fn shape<F: Fn(usize) -> (Tensor, usize)>(p: &Packing<F>) -> (usize, usize) {
    (p.rows, p.cols)
}

/// GateUp's rows of MLP part `k` of `parts` (its gate/up pairs of `mlp_part`), as one packing.
fn gateup_part(cfg: &Config, parts: usize, k: usize) -> Packing<impl Fn(usize) -> (Tensor, usize) + '_> {
    let f = mlp_part(cfg, parts, k);
    let all = pack::gateup(cfg);
    Packing { rows: 2 * f.len(), cols: cfg.d, start: move |p| (all.start)(2 * f.start + p) }
}

/// Where GateUp's part `k` starts in its coded allocation: after the parts before it, each `pack`ed whole.
fn gateup_part_offset(format: Format, cfg: &Config, parts: usize, k: usize) -> usize {
    (0..k).map(|j| format.packed_bytes(2 * mlp_part(cfg, parts, j).len(), cfg.d)).sum()
}

/// One layer's coded matrices under `plan`, packed (`pack`): every GEMV that streams codes
/// (`streams_codes`). Fails as `pack` fails.
pub fn layer_matrices(format: Format, cfg: &Config, plan: Plan, layer: &CodedLayer) -> Result<CodedMatrices, String> {
    let mut out = CodedMatrices::default();
    let mut put = |slot: Slot, bytes: Vec<u8>, rows: usize, cols: usize| {
        out.saved += (2 * rows * cols - format.packed_bytes(rows, cols)) as u64;
        out.matrices.push((slot, bytes));
    };
    let (halves, narrow) = (plan.halves(cfg), has_narrow_rows(cfg));
    for (h, &g) in halves.iter().enumerate() {
        let qkv = pack::qkv(cfg, g);
        if streams_codes(format, narrow, qkv.rows, qkv.cols) {
            put([Slot::WQkv0, Slot::WQkv1][h], pack(format, narrow, &qkv, layer)?, qkv.rows, qkv.cols);
        }
        let o = pack::oproj(cfg, g);
        if streams_codes(format, narrow, o.rows, o.cols) {
            put([Slot::WO0, Slot::WO1][h], pack(format, narrow, &o, layer)?, o.rows, o.cols);
        }
    }
    let parts = plan.mlp_parts;
    if gateup_streams_codes(format, cfg, parts) {
        let mut bytes = Vec::new();
        for k in 0..parts {
            debug_assert_eq!(bytes.len(), gateup_part_offset(format, cfg, parts, k));
            bytes.extend(pack(format, narrow, &gateup_part(cfg, parts, k), layer)?);
        }
        put(Slot::WGateUp, bytes, 2 * cfg.ffn, cfg.d);
    }
    for k in 0..parts {
        let down = pack::down(cfg, parts, k);
        if streams_codes(format, narrow, down.rows, down.cols) {
            put(
                [Slot::WDown0, Slot::WDown1, Slot::WDown2][k],
                pack(format, narrow, &down, layer)?,
                down.rows,
                down.cols,
            );
        }
    }
    Ok(out)
}

/// The decode program's rows from the bf16 program's `rows` (compiled under `plan`): where GateUp
/// streams codes, each GateUp row names its part's matrix in the coded allocation (`layer_matrices`);
/// every other word is the bf16 program's.
pub fn decode_rows(format: Format, cfg: &Config, plan: Plan, rows: &[Row]) -> Vec<Row> {
    let mut part = 0;
    rows.iter()
        .map(|&r| {
            let mut r = r;
            if r[0] == Op::GateUp as i64 && gateup_streams_codes(format, cfg, plan.mlp_parts) {
                let offset = gateup_part_offset(format, cfg, plan.mlp_parts, part);
                r[gateup::W as usize] = program::layer_ref(Slot::WGateUp, offset as u64);
                part += 1;
            }
            r
        })
        .collect()
}

/// The format a model whose layers are `layers` streams its codes in, in its decode steps (each
/// layer's matrices then packed by `layer_matrices`, which may still fail as `pack` does); or why it
/// cannot: it is not a quantised checkpoint, its layers have q/k norms (the q/k-norm instance streams
/// bf16), it streams in place (no packed copies), no GEMV streams codes, or the parts of one GEMV would
/// not all be in pair tiles or all not.
pub fn stream_format(
    cfg: &Config,
    plan: Plan,
    layers: &[CodedLayer],
    qk_norm: bool,
    in_place: bool,
) -> Result<Format, String> {
    let Some(format) = format_of(layers) else {
        return Err("not a quantised checkpoint whose matrices keep their codes".into());
    };
    let name = format.name();
    if qk_norm {
        return Err(format!("layers with q/k norms stream bf16 (the {name} instances have none)"));
    }
    if in_place {
        return Err(format!("the stack streams in place, without the packed copies the {name} stream reads"));
    }
    // Each GEMV's matrices (a plan's halves or parts) as (rows, columns), as `layer_matrices` packs them.
    let (halves, parts) = (plan.halves(cfg), plan.mlp_parts);
    let qkv: Vec<_> = halves.iter().map(|&g| shape(&pack::qkv(cfg, g))).collect();
    let o: Vec<_> = halves.iter().map(|&g| shape(&pack::oproj(cfg, g))).collect();
    let gateup: Vec<_> = (0..parts).map(|k| shape(&gateup_part(cfg, parts, k))).collect();
    let down: Vec<_> = (0..parts).map(|k| shape(&pack::down(cfg, parts, k))).collect();
    // The O projection's halves and Down's parts add each other's partials on the same blocks' rows, which
    // a block takes in whole tiles where they are in pair tiles: all of them are, or none. GateUp's parts
    // are one allocation, codes throughout or bf16.
    let narrow = has_narrow_rows(cfg);
    let tiled = |&(r, c): &(usize, usize)| pair_tiled(format, narrow, r, c);
    let coded = |&(r, c): &(usize, usize)| streams_codes(format, narrow, r, c);
    for (gemv, matrices, all_coded) in
        [("the O projection", &o, false), ("GateUp", &gateup, true), ("Down", &down, false)]
    {
        let agree = if all_coded { matrices.iter().all(coded) } else { matrices.iter().all(tiled) };
        if matrices.iter().any(tiled) && !agree {
            return Err(format!(
                "{gemv}'s parts of (rows, columns) {matrices:?}: some in {name} pair tiles and some not, which the \
                 kernel cannot run together"
            ));
        }
    }
    let all = [qkv, o, gateup, down].concat();
    // The batch step, one instance for every model, takes nf4 rows of 2048 in whole tiles for pair tiles
    // (the kernel's NARROW), where a model without narrow rows packs them unpaired: it must have none
    // (Plan::choose gives none but a layer of d >= 8192 whose O halves or Down's parts are 2048 wide).
    if let Some(&(r, c)) = all.iter().find(|&&(r, c)| !narrow && pair_tiled(format, true, r, c) && !tiled(&(r, c))) {
        return Err(format!(
            "a GEMV of {r} rows of {c} columns in a layer without narrow rows: the {name} batch step would read \
             them as pair tiles"
        ));
    }
    let streamed: Vec<usize> = all.iter().filter(|&&p| coded(&p)).map(|&(_, c)| c).collect();
    if streamed.is_empty() {
        return Err(format!(
            "no GEMV has rows wider than {SLICED_MAX_COLS} columns or in {name} pair tiles (narrower rows stream bf16 \
             in slices)"
        ));
    }
    let multiple = format.cols_multiple();
    if let Some(c) = streamed.iter().find(|c| !c.is_multiple_of(multiple)) {
        return Err(format!(
            "rows of {c} columns: the stream copies a stage's scales in 16-byte pieces, which needs a multiple of \
             {multiple} columns"
        ));
    }
    Ok(format)
}

#[cfg(test)]
mod tests {
    use reference::golden::{self, KvCache, Weights};
    use spec::rng::{bits, stream_key};

    use super::*;
    use crate::cpu::{CpuStack, checks};
    use crate::kernels::{RING_BYTES, WARPS};
    use crate::model::quantized::fp8::Fp8Matrix;
    use crate::model::quantized::nf4::Nf4Matrix;
    use crate::pack::Groups;
    use crate::program::{Forced, Split};

    /// A random fp8 weight of `rows` x `cols` in blocks of `block` from `key`: codes over every value
    /// but NaN's (both signs, subnormals included), scales across a few orders of magnitude.
    fn random_fp8(key: u64, rows: usize, cols: usize, block: [usize; 2]) -> Coded {
        let codes = (0..rows * cols)
            .map(|i| (bits(key, i as u64) % 256) as u8)
            .map(|c| if c & 0x7F == 0x7F { c - 1 } else { c });
        let grid = rows.div_ceil(block[0]) * cols.div_ceil(block[1]);
        Coded::Fp8(Fp8Matrix { rows, cols, codes: codes.collect(), block, scales: scales(key, grid) })
    }

    /// A random nf4 weight of `rows` x `cols` in blocks of `blocksize` elements from `key`: every code,
    /// bitsandbytes' values, absmax across a few orders of magnitude.
    fn random_nf4(key: u64, rows: usize, cols: usize, blocksize: usize) -> Coded {
        let codes = (0..rows * cols / 2).map(|i| (bits(key, i as u64) % 256) as u8).collect();
        let absmax = scales(key, (rows * cols).div_ceil(blocksize));
        Coded::Nf4(Nf4Matrix { rows, cols, codes, blocksize, absmax, quant_map: NF4_VALUES.to_vec() })
    }

    /// `n` scales from `key`, across a few orders of magnitude.
    fn scales(key: u64, n: usize) -> Vec<f32> {
        (0..n as u64)
            .map(|k| bits(key ^ 0x5CA1E, k))
            .map(|b| (1.0 + (b % 1024) as f32 / 1024.0) * 2f32.powi(-10 - (b >> 20) as i32 % 8))
            .collect()
    }

    /// The loader's bf16 weights of `m` (as a bf16 checkpoint's would be made).
    fn dequantized(m: &Coded) -> Vec<bf16> {
        match m {
            Coded::Fp8(m) => m.dequantize(),
            Coded::Nf4(m) => m.dequantize(),
        }
    }

    /// Layers of random matrices made by `random(key, rows, cols)` (the norms and caches the golden
    /// model's own), and the same layers as the loader reads them: every matrix dequantised.
    fn coded_layers(
        cfg: &Config,
        random: impl Fn(u64, usize, usize) -> Coded,
    ) -> (Vec<(Weights, KvCache)>, Vec<CodedLayer>) {
        (0..cfg.layers)
            .map(|l| {
                let seed = spec::data::layer_seed(0xF8 ^ cfg.d as u64, l);
                let coded = CodedLayer::try_from_fn(|t| {
                    let shape = t.shape(cfg);
                    Ok::<_, std::convert::Infallible>(
                        (shape.len() == 2).then(|| random(stream_key(seed, t as u64), shape[0], shape[1])),
                    )
                })
                .unwrap_or_else(|e| match e {});
                let mut w = golden::generate_weights(cfg, seed);
                for &t in Tensor::WEIGHTS {
                    if let Some(m) = coded.get(t) {
                        *w.get_mut(t) = dequantized(m);
                    }
                }
                ((w, KvCache::generate(cfg, seed)), coded)
            })
            .unzip()
    }

    fn fp8_layers(cfg: &Config, block: [usize; 2]) -> (Vec<(Weights, KvCache)>, Vec<CodedLayer>) {
        coded_layers(cfg, |key, rows, cols| random_fp8(key, rows, cols, block))
    }

    fn nf4_layers(cfg: &Config, blocksize: usize) -> (Vec<(Weights, KvCache)>, Vec<CodedLayer>) {
        coded_layers(cfg, |key, rows, cols| random_nf4(key, rows, cols, blocksize))
    }

    /// The packed matrix `packing` describes, from bf16 weights (what the bf16 program streams).
    fn copied<F: Fn(usize) -> (Tensor, usize)>(w: &Weights, packing: &Packing<F>) -> Vec<bf16> {
        (0..packing.rows)
            .flat_map(|p| {
                let (t, at) = (packing.start)(p);
                w.get(t)[at..at + packing.cols].to_vec()
            })
            .collect()
    }

    /// The kernel reads a scale per FP8_SCALE_COLS (NF4_SCALE_COLS) columns, as the packing writes them,
    /// keeps the formats' tails of shared memory as `tail_bytes` sizes them, looks nf4 codes up in
    /// NF4_VALUES, and streams codes where it streams rows of more than SLICED_MAX_COLS columns outside
    /// slices, and nf4's rows of 2048 in pair tiles.
    #[test]
    fn the_code_streams_constants_mirror_the_kernel() {
        let cu = crate::kernels::DEVICE_SOURCE;
        assert!(cu.contains(&format!("constexpr uint32_t FP8_SCALE_COLS = {FP8_SCALE_COLS};")));
        assert!(cu.contains(&format!("constexpr uint32_t NF4_SCALE_COLS = {NF4_SCALE_COLS};")));
        assert!(cu.contains(&format!("constexpr uint32_t NF4_PAIR_COLS = {NF4_PAIR_COLS};")));
        assert!(cu.contains(&format!("constexpr uint32_t NF4_TILE_ROWS = {NF4_TILE_ROWS};")));
        assert!(cu.contains(
            "return (cols == NF4_PAIR_COLS || (NARROW && cols == NF4_PAIR_COLS / 2)) && rows % NF4_TILE_ROWS == 0;"
        ));
        assert!(cu.contains("return CODES == NF4_CODES && pair_tiled_shape<NARROW>(g.rows, g.cols);"));
        assert!(cu.contains("constexpr uint32_t FP8_SCALE_SLOT_BYTES = STAGE_BYTES / FP8_SCALE_COLS * 4;"));
        assert!(cu.contains("constexpr uint32_t FP8_SCALE_SLOTS_BYTES = STAGES * FP8_SCALE_SLOT_BYTES;"));
        assert!(cu.contains("return VEC_BYTES == NF4_CODES ? STAGE_BYTES / 2 : STAGE_BYTES;"));
        assert!(cu.contains(
            "constexpr uint32_t NF4_SCALE_SLOT_BYTES = stage_code_bytes<NF4_CODES>() * 2 / NF4_SCALE_COLS * 4;"
        ));
        assert!(cu.contains("constexpr uint32_t NF4_BOOK_BYTES = 16 * 4;"));
        assert!(cu.contains("constexpr uint32_t NF4_TAIL_BYTES = STAGES * NF4_SCALE_SLOT_BYTES + NF4_BOOK_BYTES;"));
        assert!(cu.contains("return VEC_BYTES == NF4_CODES ? NF4_TAIL_BYTES : FP8_SCALE_SLOTS_BYTES;"));
        assert_eq!((Format::Fp8.tail_bytes(), Format::Nf4.tail_bytes()), (6144, 3 * 4096 + 64));
        assert!(cu.contains("__device__ inline bool streams_codes(const Gemv& g) { return !in_slices(g.cols); }"));
        assert!(streams_codes(Format::Fp8, true, 8, SLICED_MAX_COLS + 16));
        assert!(!streams_codes(Format::Fp8, true, 16, SLICED_MAX_COLS));
        assert!(
            streams_codes(Format::Nf4, true, 16, SLICED_MAX_COLS)
                && !streams_codes(Format::Nf4, true, 8, SLICED_MAX_COLS)
        );
        assert!(!streams_codes(Format::Nf4, true, 16, SLICED_MAX_COLS / 2));
        // A wide model's rows of 2048 (Llama-3.1-8B's O projection in two roles' halves) run in the
        // instance for wide rows, which streams them bf16.
        let llama8b = Config { d: 4096, ffn: 14336, n_q: 32, n_kv: 8, hd: 128, ..Config::graded() };
        assert!(!has_narrow_rows(&llama8b) && !streams_codes(Format::Nf4, false, 4096, SLICED_MAX_COLS));
        let table = cu.split("__constant__ float NF4_VALUES[16] = {").nth(1).and_then(|t| t.split('}').next()).unwrap();
        let values: Vec<f32> = table.split(',').map(|v| v.trim().trim_end_matches('f').parse().unwrap()).collect();
        assert_eq!(values.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), NF4_VALUES.map(f32::to_bits).to_vec());
    }

    /// The nf4 codebook's address is NF4_BOOK_ALIGN-aligned, as `nf4_values8` needs (it ORs 4 x code
    /// into the address's low byte; `fill_codebook` traps otherwise): the codebook ends the dynamic
    /// shared memory, which starts 128-aligned and which the launchers size from the ring, rows of
    /// partials and the tail, each a multiple of the alignment.
    #[test]
    fn the_nf4_codebook_lands_aligned() {
        const NF4_BOOK_ALIGN: usize = 64;
        let cu = crate::kernels::DEVICE_SOURCE;
        assert!(cu.contains(&format!("constexpr uint32_t NF4_BOOK_ALIGN = {NF4_BOOK_ALIGN};")));
        assert!(cu.contains("extern __shared__ __align__(128) uint4 smem[];"));
        for part in [RING_BYTES as usize, WARPS as usize * 4, Format::Nf4.tail_bytes()] {
            assert_eq!(part % NF4_BOOK_ALIGN, 0, "{part} bytes");
        }
    }

    /// nf4's codes repacked as the kernel reads them: code e of each 8 columns at bits 4e of their
    /// little-endian word, so a byte holds two codes, the first in its low nibble (the checkpoint's
    /// holds the first in its high nibble).
    #[test]
    fn nf4_codes_are_repacked_low_nibble_first() {
        let m = Nf4Matrix {
            rows: 1,
            cols: 64,
            codes: (0..32).map(|k| (((2 * k % 16) << 4) | ((2 * k + 1) % 16)) as u8).collect(),
            blocksize: 64,
            absmax: vec![1.0],
            quant_map: NF4_VALUES.to_vec(),
        };
        let mut out = Vec::new();
        push_codes(&Coded::Nf4(m), 0, 0, 64, &mut out);
        let word = u32::from_le_bytes(out[..4].try_into().unwrap());
        assert_eq!((0..8).map(|e| (word >> (4 * e)) & 0xF).collect::<Vec<_>>(), (0..8).collect::<Vec<_>>());
    }

    /// Every packing of a layer, in one and two halves and one to three MLP parts: its bytes read as
    /// the kernel reads them are the loader's weights packed as the bf16 program packs them, bit for
    /// bit: fp8 with scales of 128 x 128 blocks or one for the whole weight, nf4 in blocks of 64 and 256,
    /// and nf4 whose Qkv and GateUp rows have NF4_PAIR_COLS columns, or half as many (pair tiles; and a
    /// Down of rows of 2048).
    #[test]
    fn a_packed_matrix_reads_as_the_loaders_weights_packed() {
        let cfg = Config { d: 384, ffn: 768, n_q: 4, n_kv: 2, hd: 64, layers: 1, ..Config::tiny() };
        let wide = Config { d: NF4_PAIR_COLS, ffn: 384, ..cfg.clone() };
        let narrow = Config { d: NF4_PAIR_COLS / 2, ffn: 1536, ..cfg.clone() };
        for c in [&wide, &narrow] {
            let q = pack::qkv(c, Groups::all(c));
            assert!(pair_tiled(Format::Nf4, true, q.rows, q.cols) && pair_tiled(Format::Nf4, true, 2 * c.ffn, c.d));
        }
        let narrow_down = Config { ffn: NF4_PAIR_COLS / 2, ..narrow.clone() };
        let (layers, coded) = nf4_layers(&narrow_down, 64);
        let down = pack::down(&narrow_down, 1, 0);
        assert!(pair_tiled(Format::Nf4, true, down.rows, down.cols));
        assert!(
            unpack(Format::Nf4, true, &pack(Format::Nf4, true, &down, &coded[0]).unwrap(), down.rows, down.cols)
                == copied(&layers[0].0, &down)
        );
        let cases = [
            ("fp8 128", &cfg, Format::Fp8, fp8_layers(&cfg, [128, 128])),
            ("fp8 whole", &cfg, Format::Fp8, fp8_layers(&cfg, [1 << 20, 1 << 20])),
            ("nf4 64", &cfg, Format::Nf4, nf4_layers(&cfg, 64)),
            ("nf4 256", &cfg, Format::Nf4, nf4_layers(&cfg, 256)),
            ("nf4 64 in pair tiles", &wide, Format::Nf4, nf4_layers(&wide, 64)),
            ("nf4 64 in narrow pair tiles", &narrow, Format::Nf4, nf4_layers(&narrow, 64)),
        ];
        for (what, cfg, format, (layers, coded)) in &cases {
            let cfg = *cfg;
            let (w, layer) = (&layers[0].0, &coded[0]);
            let same = |rows: usize, cols: usize, packed: Vec<u8>, copied: Vec<bf16>| {
                assert!(unpack(*format, has_narrow_rows(cfg), &packed, rows, cols) == copied, "{what}");
            };
            let halves = [Groups { kv0: 0, n_kv: 1 }, Groups { kv0: 1, n_kv: 1 }];
            for g in [Groups::all(cfg)].into_iter().chain(halves) {
                let q = pack::qkv(cfg, g);
                same(q.rows, q.cols, pack(*format, has_narrow_rows(cfg), &q, layer).unwrap(), copied(w, &q));
                let o = pack::oproj(cfg, g);
                same(o.rows, o.cols, pack(*format, has_narrow_rows(cfg), &o, layer).unwrap(), copied(w, &o));
            }
            for parts in 1..=3 {
                for k in 0..parts {
                    let gu = gateup_part(cfg, parts, k);
                    same(gu.rows, gu.cols, pack(*format, has_narrow_rows(cfg), &gu, layer).unwrap(), copied(w, &gu));
                    let down = pack::down(cfg, parts, k);
                    same(
                        down.rows,
                        down.cols,
                        pack(*format, has_narrow_rows(cfg), &down, layer).unwrap(),
                        copied(w, &down),
                    );
                }
            }
        }
    }

    /// A pair tile holds, at lane l's register r of k-step m of warp w's group j, the byte of codes whose
    /// two columns the bf16 mma's A fragment gives that register (PTX's m16n8k16 layout: row g + 8 (r %
    /// 2), columns 2q + 8 (r / 2) and the next of the k-step; g = l / 4, q = l % 4), every byte of a tile
    /// once; and a lane's two rows' scales of a group side by side, row g's first. In rows of either
    /// width: a tile of the narrow rows is the wide one's first eight warps'.
    #[test]
    fn pair_tiles_hold_each_lanes_mma_fragment() {
        for cols in [NF4_PAIR_COLS, NF4_PAIR_COLS / 2] {
            let (groups, warps) = (cols / NF4_SCALE_COLS, cols / (NF4_PAIR_COLS / WARPS as usize));
            let mut seen = vec![false; NF4_TILE_ROWS * cols / 2];
            for w in 0..warps {
                for j in 0..NF4_PAIR_COLS / WARPS as usize / NF4_SCALE_COLS {
                    for l in 0..32 {
                        for (m, r) in (0..4).flat_map(|m| (0..4).map(move |r| (m, r))) {
                            let row = l / 4 + 8 * (r % 2);
                            let col = NF4_PAIR_COLS / WARPS as usize * w
                                + NF4_SCALE_COLS * j
                                + 16 * m
                                + 2 * (l % 4)
                                + 8 * (r / 2);
                            let at = pair_code_index(row, col / 2);
                            assert_eq!(at, (((w * 4 + j) * 32 + l) * 4 + m) * 4 + r, "row {row}, column {col}");
                            assert!(!std::mem::replace(&mut seen[at], true), "row {row}, column {col}: a byte twice");
                        }
                    }
                }
            }
            assert!(seen.iter().all(|&s| s), "{cols} columns");
            let mut scales: Vec<usize> =
                (0..NF4_TILE_ROWS).flat_map(|r| (0..groups).map(move |g| pair_scale_index(r, g))).collect();
            for (g, group) in (0..8).flat_map(|g| (0..groups).map(move |group| (g, group))) {
                assert_eq!(pair_scale_index(g + 8, group), pair_scale_index(g, group) + 1);
                assert_eq!(pair_scale_index(g, group) % 2, 0);
            }
            scales.sort_unstable();
            assert_eq!(scales, (0..NF4_TILE_ROWS * groups).collect::<Vec<_>>(), "{cols} columns");
        }
    }

    /// What the stream cannot take is refused naming the weight and why: a weight stored unquantised,
    /// scales in blocks that are not whole groups of the format's columns, a packed row starting inside
    /// a group, an nf4 codebook other than bitsandbytes'.
    #[test]
    fn what_a_code_stream_cannot_take_is_refused_naming_it() {
        let cfg = Config { d: 384, ffn: 768, n_q: 4, n_kv: 2, hd: 64, layers: 1, ..Config::tiny() };
        let (_, mut fp8) = fp8_layers(&cfg, [64, 64]);
        let why = pack(Format::Fp8, true, &pack::qkv(&cfg, Groups::all(&cfg)), &fp8[0]).unwrap_err();
        assert!(why.contains("q's blocks of 64 columns") && why.contains("a scale per 128"), "{why}");
        let (_, fp8_128) = fp8_layers(&cfg, [128, 128]);
        // Three parts of 768 start at columns 256 and 512: whole groups; two halves of the O projection's
        // 256 columns start at 128. An ffn of 800 in two parts starts its second at 384 + 16.
        assert!(pack(Format::Fp8, true, &pack::down(&cfg, 3, 1), &fp8_128[0]).is_ok());
        assert!(pack(Format::Fp8, true, &pack::oproj(&cfg, Groups { kv0: 1, n_kv: 1 }), &fp8_128[0]).is_ok());
        let odd = Config { ffn: 800, ..cfg.clone() };
        let (_, fp8_odd) = fp8_layers(&odd, [128, 128]);
        let why = pack(Format::Fp8, true, &pack::down(&odd, 2, 1), &fp8_odd[0]).unwrap_err();
        assert!(why.contains("from column 400"), "{why}");
        fp8[0].gate = None;
        let why = pack(Format::Fp8, true, &gateup_part(&cfg, 1, 0), &fp8[0]).unwrap_err();
        assert!(why.contains("stored unquantised"), "{why}");
        // nf4: blocks of 32 elements; the second Down part of an ffn of 832 in two, its rows from column
        // 416 (half a block of 64 in); a quant_map that is not NF4's.
        let (_, nf4_32) = nf4_layers(&cfg, 32);
        let why = pack(Format::Nf4, true, &pack::qkv(&cfg, Groups::all(&cfg)), &nf4_32[0]).unwrap_err();
        assert!(why.contains("q's blocks of 32 elements") && why.contains("an absmax per 64"), "{why}");
        let nf4_odd_cfg = Config { ffn: 832, ..cfg.clone() };
        let (_, nf4_odd) = nf4_layers(&nf4_odd_cfg, 64);
        assert!(pack(Format::Nf4, true, &pack::down(&nf4_odd_cfg, 2, 0), &nf4_odd[0]).is_ok());
        let why = pack(Format::Nf4, true, &pack::down(&nf4_odd_cfg, 2, 1), &nf4_odd[0]).unwrap_err();
        assert!(why.contains("down's blocks of 64 elements, a streamed row starting at element 416"), "{why}");
        let (_, mut nf4) = nf4_layers(&cfg, 64);
        if let Some(Coded::Nf4(m)) = nf4[0].up.as_mut() {
            m.quant_map[3] = 0.25;
        }
        let why = pack(Format::Nf4, true, &gateup_part(&cfg, 1, 0), &nf4[0]).unwrap_err();
        assert!(why.contains("up's quant_map is not bitsandbytes' NF4 values"), "{why}");
    }

    /// The decode program's GateUp rows name their part's matrix in the coded allocation; every other
    /// word is the bf16 program's. A model whose d runs in slices keeps GateUp's rows as they were in fp8,
    /// and in nf4 (d of 2048: pair tiles) moves them too.
    #[test]
    fn decode_rows_move_only_gateups_weights() {
        let buffers = program::test_buffers();
        let narrow = Config { d: 2048, ffn: 8192, n_q: 32, n_kv: 8, hd: 64, ..Config::graded() };
        for format in [Format::Fp8, Format::Nf4] {
            let shapes = [
                (Config::graded(), 2, true),
                (Config { d: 2304, ffn: 6144, ..Config::graded() }, 3, true),
                (narrow.clone(), 1, format == Format::Nf4),
            ];
            for (cfg, parts, moved) in shapes {
                let plan = Plan::with(&cfg, 132, Forced { roles: None, mlp_parts: Some(parts) }).unwrap();
                let rows = program::compile(&cfg, &buffers, 132, plan, Split::None);
                let decode = decode_rows(format, &cfg, plan, &rows);
                if !moved {
                    assert_eq!(decode, rows, "{format:?} d {}", cfg.d);
                    continue;
                }
                let mut k = 0;
                for (r, d) in rows.iter().zip(&decode) {
                    if r[0] != Op::GateUp as i64 {
                        assert_eq!(r, d);
                        continue;
                    }
                    let offset = gateup_part_offset(format, &cfg, parts, k);
                    assert_eq!(d[gateup::W as usize], program::layer_ref(Slot::WGateUp, offset as u64));
                    assert_eq!((&r[..1], &r[2..]), (&d[..1], &d[2..]));
                    k += 1;
                }
                assert_eq!(k, parts);
            }
        }
    }

    /// A block of a phase in pair tiles takes whole tiles: Llama-3.1-8B's GateUp (28672 rows of 4096 over
    /// the grid of 132 its plan gives it) up to 224 rows, where the bf16 program's pairs give 218; its
    /// Qkv and O as many tiles as that grid's share; Llama-3.2-1B's GateUp (16384 rows of 2048) 128, as
    /// in pairs; fp8 none.
    #[test]
    fn a_block_of_pair_tiles_takes_whole_tiles() {
        let buffers = program::test_buffers();
        let llama8b = Config { d: 4096, ffn: 14336, n_q: 32, n_kv: 8, hd: 128, ..Config::graded() };
        let plan = Plan::with(&llama8b, 132, Forced { roles: None, mlp_parts: Some(1) }).unwrap();
        let rows =
            decode_rows(Format::Nf4, &llama8b, plan, &program::compile(&llama8b, &buffers, 132, plan, Split::None));
        let (gateup, blocks) = rows
            .iter()
            .find(|r| r[0] == Op::GateUp as i64)
            .map(|r| (program::gemv_rows(r).unwrap(), program::Blocks::of(r).count as usize))
            .unwrap();
        assert_eq!((gateup, blocks), (28672, 132));
        assert_eq!(pair_block_rows(Format::Nf4, false, &rows), 224);
        assert_eq!(2 * (gateup / 2).div_ceil(blocks), 218);
        assert_eq!(pair_block_rows(Format::Fp8, false, &rows), 0);
        let narrow = Config { d: 2048, ffn: 8192, n_q: 32, n_kv: 8, hd: 64, ..Config::graded() };
        let plan = Plan::with(&narrow, 132, Forced { roles: None, mlp_parts: Some(1) }).unwrap();
        let rows = program::compile(&narrow, &buffers, 132, plan, Split::None);
        let blocks = rows.iter().find(|r| r[0] == Op::GateUp as i64).map(|r| program::Blocks::of(r).count).unwrap();
        assert_eq!((blocks, pair_block_rows(Format::Nf4, true, &rows)), (132, 128));
        assert_eq!(pair_block_rows(Format::Fp8, true, &rows), 0);
    }

    /// The decode program of the coded instances, run by the CPU executor reading each coded matrix as
    /// the kernel does: the golden model's step over the loader's weights, bit for bit, caches
    /// included, in one role and one MLP part (every GEMV coded) and in two roles and two parts (the O
    /// projection's halves narrow enough for slices, so bf16; GateUp's two parts in one allocation),
    /// for fp8 and nf4. With the second part's row naming the first's matrix, the step differs.
    #[test]
    fn the_coded_decode_program_is_the_golden_step_over_the_loaders_weights() {
        let cfg = Config { d: 2560, ffn: 5120, n_q: 20, n_kv: 2, hd: 128, layers: 2, ..Config::tiny() };
        for (format, (layers, coded)) in
            [(Format::Fp8, fp8_layers(&cfg, [128, 128])), (Format::Nf4, nf4_layers(&cfg, 64))]
        {
            for (roles, parts, slots) in [
                (1, 1, vec![Slot::WQkv0, Slot::WO0, Slot::WGateUp, Slot::WDown0]),
                (2, 2, vec![Slot::WQkv0, Slot::WQkv1, Slot::WGateUp, Slot::WDown0, Slot::WDown1]),
            ] {
                let plan = Plan::with(&cfg, 132, Forced { roles: Some(roles), mlp_parts: Some(parts) }).unwrap();
                assert_eq!(stream_format(&cfg, plan, &coded, false, false), Ok(format));
                let packed = layer_matrices(format, &cfg, plan, &coded[0]).unwrap();
                assert_eq!(packed.matrices.iter().map(|m| m.0).collect::<Vec<_>>(), slots, "{roles} role(s)");
                let mut stack = CpuStack::build(&cfg, &layers, 132, plan, false, Split::None);
                stack.stream_codes(format, plan, &coded).unwrap();
                let caches = checks::against_golden(&cfg, &layers, 2, |x, pos, _| Ok(stack.step(x, pos)))
                    .unwrap_or_else(|e| panic!("{format:?}, {roles} role(s), {parts} part(s): {e}"));
                for (l, cache) in caches.iter().enumerate() {
                    assert_eq!(&stack.cache(l), cache, "layer {l}'s caches");
                }
                if parts == 2 {
                    let gateup: Vec<usize> =
                        (0..stack.program.len()).filter(|&i| stack.program[i][0] == Op::GateUp as i64).collect();
                    stack.program[gateup[1]][gateup::W as usize] = stack.program[gateup[0]][gateup::W as usize];
                    assert!(checks::against_golden(&cfg, &layers, 1, |x, pos, _| Ok(stack.step(x, pos))).is_err());
                }
            }
        }
    }

    /// Why a model streams bf16 instead: not quantised, q/k norms, streaming in place, no rows wide
    /// enough, rows whose scales a stage cannot copy whole.
    #[test]
    fn a_model_that_cannot_stream_codes_says_why() {
        let narrow = Config { d: 960, ffn: 1536, n_q: 15, n_kv: 5, hd: 64, layers: 1, ..Config::tiny() };
        let (_, fp8) = fp8_layers(&narrow, [128, 128]);
        let plan = Plan::choose(&narrow, 132);
        assert!(stream_format(&narrow, plan, &[], false, false).unwrap_err().contains("not a quantised checkpoint"));
        assert!(stream_format(&narrow, plan, &fp8, true, false).unwrap_err().contains("q/k norms"));
        assert!(stream_format(&narrow, plan, &fp8, false, true).unwrap_err().contains("in place"));
        assert!(stream_format(&narrow, plan, &fp8, false, false).unwrap_err().contains("wider than 2048"));
        // Rows of 2304 columns: 18 fp8 scales a row, a stage's not whole 16-byte pieces; 36 nf4 absmax,
        // whole pieces. Rows of 2112: 33 nf4 absmax.
        let odd = Config { d: 2304, ffn: 4608, n_q: 18, n_kv: 2, hd: 128, layers: 1, ..Config::tiny() };
        let (_, fp8) = fp8_layers(&odd, [128, 128]);
        let why = stream_format(&odd, Plan::choose(&odd, 132), &fp8, false, false).unwrap_err();
        assert!(why.contains("rows of 2304 columns") && why.contains("multiple of 512"), "{why}");
        let (_, nf4) = nf4_layers(&odd, 64);
        assert_eq!(stream_format(&odd, Plan::choose(&odd, 132), &nf4, false, false), Ok(Format::Nf4));
        let odder = Config { d: 2112, ffn: 4224, n_q: 33, n_kv: 3, hd: 64, layers: 1, ..Config::tiny() };
        let (_, nf4) = nf4_layers(&odder, 64);
        let why = stream_format(&odder, Plan::choose(&odder, 132), &nf4, false, false).unwrap_err();
        assert!(why.contains("rows of 2112 columns") && why.contains("multiple of 256"), "{why}");
        // nf4 rows of 2048 in pair tiles stream codes; Down's two parts of an ffn of 4104, 2048 columns
        // (pair tiles) and 2056 (the fused form), would take their rows in different units.
        let (_, nf4) = nf4_layers(&narrow, 64);
        assert!(stream_format(&narrow, plan, &nf4, false, false).unwrap_err().contains("or in nf4 pair tiles"));
        let tiled = Config { d: 2048, ffn: 2048, n_q: 16, n_kv: 4, hd: 128, layers: 1, ..Config::tiny() };
        let (_, nf4) = nf4_layers(&tiled, 64);
        assert_eq!(stream_format(&tiled, Plan::choose(&tiled, 132), &nf4, false, false), Ok(Format::Nf4));
        let mixed = Config { ffn: 4104, ..tiled };
        let (_, nf4) = nf4_layers(&mixed, 64);
        let two = Plan::with(&mixed, 132, Forced { roles: None, mlp_parts: Some(2) }).unwrap();
        let why = stream_format(&mixed, two, &nf4, false, false).unwrap_err();
        assert!(why.contains("Down's parts") && why.contains("(2048, 2048), (2048, 2056)"), "{why}");
        // A layer of d 8192 with 32 query heads of 128 (two roles: O projection halves of 2048 columns)
        // has no narrow rows, so its halves would stream bf16 in the decode step and as tiles in the batch
        // step (only the format of the codes is read from the layers).
        let halves = Config { d: 8192, ffn: 8192, n_q: 32, n_kv: 8, hd: 128, layers: 1, ..Config::tiny() };
        let plan = Plan::choose(&halves, 132);
        assert_eq!((plan.roles, has_narrow_rows(&halves)), (2, false));
        let why = stream_format(&halves, plan, &nf4, false, false).unwrap_err();
        assert!(why.contains("8192 rows of 2048 columns") && why.contains("batch step"), "{why}");
    }
}
