//! An fp8 checkpoint's weights as the model kernel's fp8 instances stream them
//! (`kernels/megakernel/model/model_fp8.cu`): a decode step streams each GEMV whose rows are too wide
//! for slices as its e4m3 codes and scales, half of bf16's bytes, each vector of 8 codes dotted with x
//! in f32 and the sum times its scale (the fused form: no weight rounded to bf16, so its outputs part
//! from the bf16 stream of the loader's weights by those roundings); the batch step streams the same
//! codes in the same arithmetic (`model_fp8_batch.cu`), so its lanes stay the bits of their decode
//! steps. Narrower rows, the LM head and the norms stream bf16 as before.
//!
//! A packed fp8 matrix is the bf16 packing's rows in the same order (`pack`), each `cols` codes, then
//! every row's scales, one f32 for each `FP8_SCALE_COLS` columns (its source block's), in one allocation:
//! the kernel finds the scales after the codes of the phase's `rows` rows. GateUp's MLP parts are each
//! such a matrix, one after the other, so the decode program's GateUp rows name their part's offset
//! (`decode_rows`); every other fp8 matrix has a slot of its own. A checkpoint that cannot stream this
//! way streams bf16, and says why (`refusal`, `pack`).

use half::bf16;
use spec::data::LayerWeights;
use spec::{Config, Tensor};

use super::quantized::fp8::{Fp8Matrix, weight};
use crate::kernels::SLICED_MAX_COLS;
use crate::pack::{self, Packing, mlp_part};
use crate::program::{self, LAYER_WORDS, Op, Plan, Row, Slot, gateup};

/// Columns of a packed row one scale covers (the kernel's `FP8_SCALE_COLS`): the checkpoints' usual
/// block of 128 x 128 (transformers' `FineGrainedFP8Config`, Qwen3's and DeepSeek's FP8 releases).
pub const FP8_SCALE_COLS: usize = 128;

/// Bytes of shared memory the fp8 instances keep for their stages' scales (the kernel's
/// `FP8_SCALE_SLOTS_BYTES`: a slot per ring stage, a stage's codes' scales each), at the end of their
/// dynamic shared memory, where the partials then stop short.
pub const FP8_SCALE_SLOTS_BYTES: usize = crate::kernels::RING_BYTES as usize / FP8_SCALE_COLS * 4;

/// Columns of a streamed row must be a multiple of this: a stage's scales are then whole 16-byte pieces
/// that a bulk copy takes (a multiple of 4 scales a row).
pub const FP8_COLS_MULTIPLE: usize = 4 * FP8_SCALE_COLS;

/// Whether the fp8 instances stream rows of `cols` columns as codes (the kernel's `streams_fp8`): those
/// too wide for slices.
pub fn streams_fp8(cols: usize) -> bool {
    cols > SLICED_MAX_COLS
}

/// Scales a packed row of `cols` columns has.
fn groups(cols: usize) -> usize {
    cols.div_ceil(FP8_SCALE_COLS)
}

/// Bytes of a packed fp8 matrix of `rows` rows of `cols`: its codes, then its scales.
pub fn packed_bytes(rows: usize, cols: usize) -> usize {
    rows * cols + 4 * rows * groups(cols)
}

/// One layer's weights as an fp8 checkpoint stores them (`ModelWeights::fp8`).
pub type Fp8Layer = LayerWeights<Option<Fp8Matrix>>;

/// The packed fp8 matrix `packing` describes, from `layer`'s codes and scales: its codes in the
/// packing's order, then each packed row's scales; or why it cannot be (a weight stored unquantised,
/// or scales that do not hold for whole groups of `FP8_SCALE_COLS` of its columns).
pub fn pack<F: Fn(usize) -> (Tensor, usize)>(packing: &Packing<F>, layer: &Fp8Layer) -> Result<Vec<u8>, String> {
    let (rows, cols) = (packing.rows, packing.cols);
    if !cols.is_multiple_of(16) {
        return Err(format!("rows of {cols} columns: the stream's bulk copies need a multiple of 16 bytes"));
    }
    let mut bytes = Vec::with_capacity(packed_bytes(rows, cols));
    let mut scales = Vec::with_capacity(rows * groups(cols));
    for p in 0..rows {
        let (t, at) = (packing.start)(p);
        let m = layer.get(t).as_ref().ok_or_else(|| format!("{} is stored unquantised", t.name()))?;
        let (r, c0) = (at / m.cols, at % m.cols);
        // A group of the packed row must lie in one block of the source: blocks of whole groups, the
        // row starting at a group's edge; or one block across the whole row.
        let whole_row = m.block[1] >= m.cols;
        if !whole_row && (!m.block[1].is_multiple_of(FP8_SCALE_COLS) || !c0.is_multiple_of(FP8_SCALE_COLS)) {
            return Err(format!(
                "{}'s blocks of {} columns, its rows streamed from column {c0}: the stream takes a scale per {FP8_SCALE_COLS} \
                 columns",
                t.name(),
                m.block[1]
            ));
        }
        bytes.extend_from_slice(&m.codes[at..at + cols]);
        scales.extend((0..groups(cols)).map(|k| m.scale(r, c0 + k * FP8_SCALE_COLS)));
    }
    bytes.extend(scales.iter().flat_map(|s| s.to_le_bytes()));
    Ok(bytes)
}

/// The weights of a packed fp8 matrix of `rows` rows of `cols` (`pack`), in bf16, as the loader makes
/// each one (the CPU executor's reading of it).
pub fn unpack(bytes: &[u8], rows: usize, cols: usize) -> Vec<bf16> {
    assert_eq!(bytes.len(), packed_bytes(rows, cols), "a packed fp8 matrix of {rows} x {cols}");
    let (codes, scales) = bytes.split_at(rows * cols);
    let scale = |r: usize, c: usize| {
        let at = 4 * (r * groups(cols) + c / FP8_SCALE_COLS);
        f32::from_le_bytes(scales[at..at + 4].try_into().expect("four bytes"))
    };
    (0..rows * cols).map(|i| weight(codes[i], scale(i / cols, i % cols))).collect()
}

/// One layer's fp8 matrices for its decode step: each slot that streams fp8 with its packed matrix (the
/// other slots keep the bf16 program's).
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Fp8Matrices {
    pub matrices: Vec<(Slot, Vec<u8>)>,
    /// Bytes a decode step of this layer streams less than in bf16.
    pub saved: u64,
}

/// `table` (the bf16 program's, for one layer) with each slot of `placed` (a slot of `Fp8Matrices` and
/// where its matrix was put) in its place.
pub fn table(mut table: [i64; LAYER_WORDS], placed: &[(Slot, u64)]) -> [i64; LAYER_WORDS] {
    for &(slot, at) in placed {
        table[slot as usize] = at as i64;
    }
    table
}

/// GateUp's rows of MLP part `k` of `parts` (its gate/up pairs of `mlp_part`), as one packing.
fn gateup_part(cfg: &Config, parts: usize, k: usize) -> Packing<impl Fn(usize) -> (Tensor, usize) + '_> {
    let f = mlp_part(cfg, parts, k);
    let all = pack::gateup(cfg);
    Packing { rows: 2 * f.len(), cols: cfg.d, start: move |p| (all.start)(2 * f.start + p) }
}

/// Where GateUp's part `k` starts in its fp8 allocation: after the parts before it, each `pack`ed whole.
fn gateup_part_offset(cfg: &Config, parts: usize, k: usize) -> usize {
    (0..k).map(|j| packed_bytes(2 * mlp_part(cfg, parts, j).len(), cfg.d)).sum()
}

/// One layer's fp8 matrices under `plan`, packed (`pack`): every GEMV that streams fp8 (`streams_fp8`).
/// Fails as `pack` fails.
pub fn layer_matrices(cfg: &Config, plan: Plan, layer: &Fp8Layer) -> Result<Fp8Matrices, String> {
    let mut out = Fp8Matrices::default();
    let mut put = |slot: Slot, bytes: Vec<u8>, rows: usize, cols: usize| {
        out.saved += (2 * rows * cols - packed_bytes(rows, cols)) as u64;
        out.matrices.push((slot, bytes));
    };
    let halves = plan.halves(cfg);
    for (h, &g) in halves.iter().enumerate() {
        let qkv = pack::qkv(cfg, g);
        if streams_fp8(qkv.cols) {
            put([Slot::WQkv0, Slot::WQkv1][h], pack(&qkv, layer)?, qkv.rows, qkv.cols);
        }
        let o = pack::oproj(cfg, g);
        if streams_fp8(o.cols) {
            put([Slot::WO0, Slot::WO1][h], pack(&o, layer)?, o.rows, o.cols);
        }
    }
    let parts = plan.mlp_parts;
    if streams_fp8(cfg.d) {
        let mut bytes = Vec::new();
        for k in 0..parts {
            debug_assert_eq!(bytes.len(), gateup_part_offset(cfg, parts, k));
            bytes.extend(pack(&gateup_part(cfg, parts, k), layer)?);
        }
        put(Slot::WGateUp, bytes, 2 * cfg.ffn, cfg.d);
    }
    for k in 0..parts {
        let down = pack::down(cfg, parts, k);
        if streams_fp8(down.cols) {
            put([Slot::WDown0, Slot::WDown1, Slot::WDown2][k], pack(&down, layer)?, down.rows, down.cols);
        }
    }
    Ok(out)
}

/// The decode program's rows from the bf16 program's `rows` (compiled under `plan`): where GateUp
/// streams fp8, each GateUp row names its part's matrix in the fp8 allocation (`layer_matrices`); every
/// other word is the bf16 program's.
pub fn decode_rows(cfg: &Config, plan: Plan, rows: &[Row]) -> Vec<Row> {
    let mut part = 0;
    rows.iter()
        .map(|&r| {
            let mut r = r;
            if r[0] == Op::GateUp as i64 && streams_fp8(cfg.d) {
                let offset = gateup_part_offset(cfg, plan.mlp_parts, part);
                r[gateup::W as usize] = program::layer_ref(Slot::WGateUp, offset as u64);
                part += 1;
            }
            r
        })
        .collect()
}

/// Why a model whose layers are `layers` cannot stream fp8 in its decode steps, or None where it can
/// (each layer's matrices then packed by `layer_matrices`, which may still fail as `pack` does): it is
/// not an fp8 checkpoint, its layers have q/k norms (the q/k-norm instance streams bf16), it streams
/// in place (no packed copies), or no GEMV has rows too wide for slices.
pub fn refusal(cfg: &Config, plan: Plan, layers: &[Fp8Layer], qk_norm: bool, in_place: bool) -> Option<String> {
    if layers.is_empty() {
        return Some("not an fp8 checkpoint".into());
    }
    if qk_norm {
        return Some("layers with q/k norms stream bf16 (the fp8 instances have none)".into());
    }
    if in_place {
        return Some("the stack streams in place, without the packed copies the fp8 stream reads".into());
    }
    let o = plan.halves(cfg).into_iter().map(|g| g.n_q(cfg) * cfg.hd);
    let down = (0..plan.mlp_parts).map(|k| mlp_part(cfg, plan.mlp_parts, k).len());
    let streamed: Vec<usize> = o.chain([cfg.d]).chain(down).filter(|&c| streams_fp8(c)).collect();
    if streamed.is_empty() {
        return Some(format!(
            "no GEMV has rows wider than {SLICED_MAX_COLS} columns (narrower rows stream bf16 in slices)"
        ));
    }
    if let Some(c) = streamed.iter().find(|c| !c.is_multiple_of(FP8_COLS_MULTIPLE)) {
        return Some(format!(
            "rows of {c} columns: the stream copies a stage's scales in 16-byte pieces, which needs a multiple of \
             {FP8_COLS_MULTIPLE} columns"
        ));
    }
    None
}

#[cfg(test)]
mod tests {
    use reference::golden::{self, KvCache, Weights};
    use spec::rng::{bits, stream_key};

    use super::*;
    use crate::cpu::{CpuStack, checks};
    use crate::pack::Groups;
    use crate::program::{Forced, Split};

    /// A random fp8 weight of `rows` x `cols` in blocks of `block` from `key`: codes over every value
    /// but NaN's (both signs, subnormals included), scales across a few orders of magnitude.
    fn random_matrix(key: u64, rows: usize, cols: usize, block: [usize; 2]) -> Fp8Matrix {
        let codes = (0..rows * cols)
            .map(|i| (bits(key, i as u64) % 256) as u8)
            .map(|c| if c & 0x7F == 0x7F { c - 1 } else { c });
        let grid = rows.div_ceil(block[0]) * cols.div_ceil(block[1]);
        let scales = (0..grid as u64)
            .map(|k| bits(key ^ 0x5CA1E, k))
            .map(|b| (1.0 + (b % 1024) as f32 / 1024.0) * 2f32.powi(-10 - (b >> 20) as i32 % 8))
            .collect();
        Fp8Matrix { rows, cols, codes: codes.collect(), block, scales }
    }

    /// Layers of random fp8 matrices in blocks of `block` (the norms and caches the golden model's
    /// own), and the same layers as the loader reads them: every matrix dequantised.
    fn fp8_layers(cfg: &Config, block: [usize; 2]) -> (Vec<(Weights, KvCache)>, Vec<Fp8Layer>) {
        (0..cfg.layers)
            .map(|l| {
                let seed = spec::data::layer_seed(0xF8 ^ cfg.d as u64, l);
                let fp8 = Fp8Layer::try_from_fn(|t| {
                    let shape = t.shape(cfg);
                    Ok::<_, std::convert::Infallible>(
                        (shape.len() == 2)
                            .then(|| random_matrix(stream_key(seed, t as u64), shape[0], shape[1], block)),
                    )
                })
                .unwrap_or_else(|e| match e {});
                let mut w = golden::generate_weights(cfg, seed);
                for &t in Tensor::WEIGHTS {
                    if let Some(m) = fp8.get(t) {
                        *w.get_mut(t) = m.dequantize();
                    }
                }
                ((w, KvCache::generate(cfg, seed)), fp8)
            })
            .unzip()
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

    /// The kernel reads a scale per FP8_SCALE_COLS columns, as the packing writes them, and streams
    /// codes where it streams rows of more than SLICED_MAX_COLS columns outside slices.
    #[test]
    fn the_fp8_streams_constants_mirror_the_kernel() {
        let cu = crate::kernels::DEVICE_SOURCE;
        assert!(cu.contains(&format!("constexpr uint32_t FP8_SCALE_COLS = {FP8_SCALE_COLS};")));
        assert!(cu.contains("constexpr uint32_t FP8_SCALE_SLOT_BYTES = STAGE_BYTES / FP8_SCALE_COLS * 4;"));
        assert!(cu.contains("constexpr uint32_t FP8_SCALE_SLOTS_BYTES = STAGES * FP8_SCALE_SLOT_BYTES;"));
        assert!(cu.contains("__device__ inline bool streams_fp8(const Gemv& g) { return !in_slices(g.cols); }"));
        assert!(streams_fp8(SLICED_MAX_COLS + 16) && !streams_fp8(SLICED_MAX_COLS));
    }

    /// Every packing of a layer, in one and two halves and one to three MLP parts: its fp8 bytes read as
    /// the kernel reads them are the loader's weights packed as the bf16 program packs them, bit for
    /// bit, with scales of 128 x 128 blocks or one for the whole weight.
    #[test]
    fn a_packed_fp8_matrix_reads_as_the_loaders_weights_packed() {
        let cfg = Config { d: 384, ffn: 768, n_q: 4, n_kv: 2, hd: 64, layers: 1, ..Config::tiny() };
        for block in [[128, 128], [1 << 20, 1 << 20]] {
            let (layers, fp8) = fp8_layers(&cfg, block);
            let (w, layer) = (&layers[0].0, &fp8[0]);
            fn same<F: Fn(usize) -> (Tensor, usize)>(w: &Weights, layer: &Fp8Layer, packing: &Packing<F>) -> bool {
                unpack(&pack(packing, layer).unwrap(), packing.rows, packing.cols) == copied(w, packing)
            }
            let check = |ok: bool| assert!(ok, "blocks of {block:?}");
            let halves = [Groups { kv0: 0, n_kv: 1 }, Groups { kv0: 1, n_kv: 1 }];
            for g in [Groups::all(&cfg)].into_iter().chain(halves) {
                check(same(w, layer, &pack::qkv(&cfg, g)));
                check(same(w, layer, &pack::oproj(&cfg, g)));
            }
            for parts in 1..=3 {
                for k in 0..parts {
                    check(same(w, layer, &gateup_part(&cfg, parts, k)));
                    check(same(w, layer, &pack::down(&cfg, parts, k)));
                }
            }
        }
    }

    /// What the stream cannot take is refused naming the weight and why: a weight stored unquantised,
    /// scales in blocks that are not whole groups of 128 columns, a packed row starting inside a group.
    #[test]
    fn what_the_fp8_stream_cannot_take_is_refused_naming_it() {
        let cfg = Config { d: 384, ffn: 768, n_q: 4, n_kv: 2, hd: 64, layers: 1, ..Config::tiny() };
        let (_, mut fp8) = fp8_layers(&cfg, [64, 64]);
        let why = pack(&pack::qkv(&cfg, Groups::all(&cfg)), &fp8[0]).unwrap_err();
        assert!(why.contains("q's blocks of 64 columns") && why.contains("a scale per 128"), "{why}");
        let (_, fp8_128) = fp8_layers(&cfg, [128, 128]);
        // Three parts of 768 start at columns 256 and 512: whole groups; two halves of the O projection's
        // 256 columns start at 128. An ffn of 800 in two parts starts its second at 384 + 16.
        assert!(pack(&pack::down(&cfg, 3, 1), &fp8_128[0]).is_ok());
        assert!(pack(&pack::oproj(&cfg, Groups { kv0: 1, n_kv: 1 }), &fp8_128[0]).is_ok());
        let odd = Config { ffn: 800, ..cfg.clone() };
        let (_, fp8_odd) = fp8_layers(&odd, [128, 128]);
        let why = pack(&pack::down(&odd, 2, 1), &fp8_odd[0]).unwrap_err();
        assert!(why.contains("from column 400"), "{why}");
        fp8[0].gate = None;
        let why = pack(&gateup_part(&cfg, 1, 0), &fp8[0]).unwrap_err();
        assert!(why.contains("stored unquantised"), "{why}");
    }

    /// The decode program's GateUp rows name their part's matrix in the fp8 allocation; every other
    /// word is the bf16 program's, and a model whose d runs in slices keeps GateUp's rows as they were.
    #[test]
    fn decode_rows_move_only_gateups_weights() {
        let buffers = program::test_buffers();
        for (cfg, parts) in [(Config::graded(), 2), (Config { d: 2304, ffn: 6144, ..Config::graded() }, 3)] {
            let plan = Plan::with(&cfg, 132, Forced { roles: None, mlp_parts: Some(parts) }).unwrap();
            let rows = program::compile(&cfg, &buffers, 132, plan, Split::None);
            let decode = decode_rows(&cfg, plan, &rows);
            let mut k = 0;
            for (r, d) in rows.iter().zip(&decode) {
                if r[0] != Op::GateUp as i64 {
                    assert_eq!(r, d);
                    continue;
                }
                let offset = gateup_part_offset(&cfg, parts, k);
                assert_eq!(d[gateup::W as usize], program::layer_ref(Slot::WGateUp, offset as u64));
                assert_eq!((&r[..1], &r[2..]), (&d[..1], &d[2..]));
                k += 1;
            }
            assert_eq!(k, parts);
        }
        let narrow = Config { d: 2048, ffn: 8192, n_q: 32, n_kv: 8, hd: 64, ..Config::graded() };
        let plan = Plan::choose(&narrow, 132);
        let rows = program::compile(&narrow, &buffers, 132, plan, Split::None);
        assert_eq!(decode_rows(&narrow, plan, &rows), rows);
    }

    /// The decode program of the fp8 instances, run by the CPU executor reading each fp8 matrix as the
    /// kernel does: the golden model's step over the loader's weights, bit for bit, caches included, in
    /// one role and one MLP part (every GEMV fp8) and in two roles and two parts (the O projection's
    /// halves narrow enough for slices, so bf16; GateUp's two parts in one allocation). With the second
    /// part's row naming the first's matrix, the step differs.
    #[test]
    fn the_fp8_decode_program_is_the_golden_step_over_the_loaders_weights() {
        let cfg = Config { d: 2560, ffn: 5120, n_q: 20, n_kv: 2, hd: 128, layers: 2, ..Config::tiny() };
        let (layers, fp8) = fp8_layers(&cfg, [128, 128]);
        for (roles, parts, slots) in [
            (1, 1, vec![Slot::WQkv0, Slot::WO0, Slot::WGateUp, Slot::WDown0]),
            (2, 2, vec![Slot::WQkv0, Slot::WQkv1, Slot::WGateUp, Slot::WDown0, Slot::WDown1]),
        ] {
            let plan = Plan::with(&cfg, 132, Forced { roles: Some(roles), mlp_parts: Some(parts) }).unwrap();
            assert_eq!(refusal(&cfg, plan, &fp8, false, false), None);
            let packed = layer_matrices(&cfg, plan, &fp8[0]).unwrap();
            assert_eq!(packed.matrices.iter().map(|m| m.0).collect::<Vec<_>>(), slots, "{roles} role(s)");
            let mut stack = CpuStack::build(&cfg, &layers, 132, plan, false, Split::None);
            stack.stream_fp8(plan, &fp8).unwrap();
            let caches = checks::against_golden(&cfg, &layers, 2, |x, pos, _| Ok(stack.step(x, pos)))
                .unwrap_or_else(|e| panic!("{roles} role(s), {parts} part(s): {e}"));
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

    /// Why a model streams bf16 instead: not fp8, q/k norms, streaming in place, no rows wide enough,
    /// rows whose scales a stage cannot copy whole.
    #[test]
    fn a_model_that_cannot_stream_fp8_says_why() {
        let narrow = Config { d: 960, ffn: 1536, n_q: 15, n_kv: 5, hd: 64, layers: 1, ..Config::tiny() };
        let (_, fp8) = fp8_layers(&narrow, [128, 128]);
        let plan = Plan::choose(&narrow, 132);
        assert!(refusal(&narrow, plan, &[], false, false).unwrap().contains("not an fp8 checkpoint"));
        assert!(refusal(&narrow, plan, &fp8, true, false).unwrap().contains("q/k norms"));
        assert!(refusal(&narrow, plan, &fp8, false, true).unwrap().contains("in place"));
        assert!(refusal(&narrow, plan, &fp8, false, false).unwrap().contains("wider than 2048"));
        // Rows of 2304 columns: 18 scales a row, a stage's not whole 16-byte pieces.
        let odd = Config { d: 2304, ffn: 4608, n_q: 18, n_kv: 2, hd: 128, layers: 1, ..Config::tiny() };
        let (_, fp8) = fp8_layers(&odd, [128, 128]);
        let why = refusal(&odd, Plan::choose(&odd, 132), &fp8, false, false).unwrap();
        assert!(why.contains("rows of 2304 columns") && why.contains("multiple of 512"), "{why}");
    }
}
