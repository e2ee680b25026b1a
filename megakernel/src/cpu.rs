//! The CPU executor of a megakernel program: the same table, interpreted on the host over an arena
//! whose addresses stand in for device pointers, each op done by the golden model's functions. It
//! checks the compiler and the packing (every pointer, size and layout the table names) without a
//! GPU: its output must equal the golden model's step bit for bit, layer after layer in a stack.

use std::ops::Range;

use half::bf16;
use reference::golden::{self, KvCache, RopeTable, Weights};
use spec::{Config, Tensor};

#[cfg(feature = "model")]
use super::model::code_stream::{self, Format};
/// Without the model feature there are no code formats, and no stack streams codes.
#[cfg(not(feature = "model"))]
type Format = std::convert::Infallible;
use super::pack::{self, Groups, Packing, qkv_source};
use super::program::{self, Buffers, LayerBuffers, Op, Plan, Row, Split, attn, down, gateup, oproj, qkv};

/// Host buffers addressed like device memory: region `i` starts at `(i + 1) << REGION_SHIFT`.
#[derive(Default)]
pub struct Arena {
    regions: Vec<Vec<u8>>,
}

/// Room for regions of up to 1 TiB each.
const REGION_SHIFT: u32 = 40;

impl Arena {
    pub fn alloc(&mut self, bytes: &[u8]) -> u64 {
        self.regions.push(bytes.to_vec());
        (self.regions.len() as u64) << REGION_SHIFT
    }

    pub fn alloc_bf16(&mut self, v: &[bf16]) -> u64 {
        self.alloc(&v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>())
    }

    pub fn alloc_f32(&mut self, v: &[f32]) -> u64 {
        self.alloc(&v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>())
    }

    fn bytes(&self, addr: u64, len: usize) -> &[u8] {
        let (region, offset) = ((addr >> REGION_SHIFT) as usize - 1, (addr & ((1 << REGION_SHIFT) - 1)) as usize);
        &self.regions[region][offset..offset + len]
    }

    fn bytes_mut(&mut self, addr: u64, len: usize) -> &mut [u8] {
        let (region, offset) = ((addr >> REGION_SHIFT) as usize - 1, (addr & ((1 << REGION_SHIFT) - 1)) as usize);
        &mut self.regions[region][offset..offset + len]
    }

    pub fn bf16(&self, addr: i64, n: usize) -> Vec<bf16> {
        self.bytes(addr as u64, 2 * n).chunks(2).map(|b| bf16::from_le_bytes([b[0], b[1]])).collect()
    }

    pub fn f32(&self, addr: i64, n: usize) -> Vec<f32> {
        self.bytes(addr as u64, 4 * n).chunks(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect()
    }

    pub fn write_f32(&mut self, addr: i64, v: &[f32]) {
        self.write_words(addr, v.iter().map(|x| x.to_le_bytes()));
    }

    pub fn write_bf16(&mut self, addr: i64, v: &[bf16]) {
        self.write_words(addr, v.iter().map(|x| x.to_le_bytes()));
    }

    /// Little-endian words of N bytes from `addr` on.
    fn write_words<const N: usize>(&mut self, addr: i64, words: impl ExactSizeIterator<Item = [u8; N]>) {
        let dst = self.bytes_mut(addr as u64, N * words.len());
        for (d, w) in dst.chunks_mut(N).zip(words) {
            d.copy_from_slice(&w);
        }
    }
}

/// A stack built for the CPU executor: each layer's packed weights and cache, the tables and the
/// scratch in an arena, and the program.
pub struct CpuStack {
    pub cfg: Config,
    pub arena: Arena,
    pub buffers: Buffers,
    pub layers: Vec<LayerBuffers>,
    pub program: Vec<Row>,
    /// The parts so far of a GEMV split by columns, waiting for its last: the O projection's, then
    /// Down's; and, split over GPUs, the partials its last part left for a Reduce row (0: none yet).
    parts_so_far: Vec<Part>,
    partials_left: i64,
    /// The decode program's tables where its wide GEMVs stream codes (`stream_codes`), and their
    /// format, as the model kernel's coded instances read them; None: the layers' own.
    coded: Option<(Format, Vec<[i64; program::LAYER_WORDS]>)>,
}

/// One part of a GEMV split by columns: its weights' and its input's addresses, and its columns.
pub(crate) type Part = (i64, i64, usize);

/// What one row of the program left for its caller.
pub(crate) enum Ran {
    Done,
    /// The layer's output: Down's last part, on one GPU.
    Output(Vec<bf16>),
    /// A Reduce row (resolved), which needs every GPU's parts (`split::SplitCpu`).
    Reduce(Row),
}

/// Runs the phases of a step of `layers` layers of `program` in `order` (phase f is row f % rows of layer
/// f / rows) through `run(layer, row, its input)`, which returns the layer's output where the row wrote
/// it; each layer's input is `x` for the first and the layer before's output for the others. Each
/// layer's output, or where a phase read a layer's input that no phase before it had written (a
/// dependency the program lacks).
pub(crate) fn walk_order(
    program: &[Row],
    layers: usize,
    order: &[usize],
    x: &[bf16],
    mut run: impl FnMut(usize, &Row, &[bf16]) -> Option<Vec<bf16>>,
) -> Result<Vec<Vec<bf16>>, String> {
    let n = program.len();
    assert!(order.len() == n * layers, "an order names every phase once");
    let mut outs: Vec<Option<Vec<bf16>>> = vec![None; layers];
    for &f in order {
        let (l, row) = (f / n, &program[f % n]);
        let input = match l {
            0 => Some(x),
            _ => outs[l - 1].as_deref(),
        };
        let x_l = match input {
            Some(v) => v,
            None if program::reads_layer_input(row) => {
                return Err(format!("phase {f} (layer {l}) read its input before layer {} wrote it", l - 1));
            }
            None => &[],
        };
        if let Some(o) = run(l, row, x_l) {
            outs[l] = Some(o);
        }
    }
    outs.into_iter().enumerate().map(|(l, o)| o.ok_or_else(|| format!("layer {l} wrote no output"))).collect()
}

/// Rows `rows` of the product of the parts' columns side by side, in order, each part read from its
/// arena, with the golden model's rounding: the GEMV from its packed column parts (which checks every
/// packing).
pub(crate) fn product(parts: &[(&Arena, Part)], rows: Range<usize>) -> Vec<bf16> {
    let bf16_rows = |a: &Arena, w: i64, rows: &Range<usize>, cols: usize| {
        a.bf16(w + (2 * rows.start * cols) as i64, rows.len() * cols)
    };
    product_read(parts, rows, bf16_rows)
}

/// `product` with each part's rows read by `read(arena, weights, rows, cols)`.
fn product_read(
    parts: &[(&Arena, Part)],
    rows: Range<usize>,
    read: impl Fn(&Arena, i64, &Range<usize>, usize) -> Vec<bf16>,
) -> Vec<bf16> {
    let matrices: Vec<Vec<bf16>> = parts.iter().map(|&(a, (w, _, cols))| read(a, w, &rows, cols)).collect();
    let weights: Vec<bf16> = (0..rows.len())
        .flat_map(|i| {
            parts.iter().zip(&matrices).flat_map(move |(&(_, (_, _, c)), m)| m[i * c..(i + 1) * c].iter().copied())
        })
        .collect();
    let v: Vec<bf16> = parts.iter().flat_map(|&(a, (_, v, cols))| a.bf16(v, cols)).collect();
    golden::gemv(&weights, rows.len(), v.len(), &v)
}

/// The packed matrix `packing` describes, copied from the host weights.
fn copy_packed<F: Fn(usize) -> (Tensor, usize)>(w: &Weights, packing: Packing<F>) -> Vec<bf16> {
    let Packing { rows, cols, start } = packing;
    (0..rows)
        .flat_map(|p| {
            let (t, at) = start(p);
            w.get(t)[at..at + cols].iter().copied()
        })
        .collect()
}

/// A matrix the program streams in `N` parts of columns or fewer (`parts`): each copied into the
/// arena, their addresses (0 past the last); or, with one part, the weight `whole` as it is (the GPU's
/// `column_parts`).
fn column_parts<const N: usize, F: Fn(usize) -> (Tensor, usize)>(
    a: &mut Arena,
    w: &Weights,
    parts: Vec<Packing<F>>,
    whole: Tensor,
) -> [u64; N] {
    let mut at = [0u64; N];
    if parts.len() == 1 {
        at[0] = a.alloc_bf16(w.get(whole));
    } else {
        for (slot, p) in at.iter_mut().zip(parts) {
            *slot = a.alloc_bf16(&copy_packed(w, p));
        }
    }
    at
}

/// The layer with only the query and KV heads a phase row names (its operands point at the first).
pub(crate) fn sub_config(cfg: &Config, n_q: usize, n_kv: usize) -> Config {
    Config { n_q, n_kv, ..cfg.clone() }
}

/// One layer's weights as handed over and its cache, in the arena, for streaming in place (the GPU's
/// `handed_buffers`).
fn handed_buffers(a: &mut Arena, w: &Weights, cache: &KvCache) -> LayerBuffers {
    let mut at = |t: Tensor| a.alloc_bf16(w.get(t));
    let (wq, wk, wv, wo, wg, wu, wd) = (
        at(Tensor::Wq),
        at(Tensor::Wk),
        at(Tensor::Wv),
        at(Tensor::Wo),
        at(Tensor::Wgate),
        at(Tensor::Wup),
        at(Tensor::Wdown),
    );
    LayerBuffers {
        w_qkv: [wq, 0],
        in_norm: a.alloc_bf16(&w.in_norm),
        k_cache: a.alloc_bf16(&cache.k),
        v_cache: a.alloc_bf16(&cache.v),
        w_o: [wo, 0],
        w_gateup: wg,
        post_norm: a.alloc_bf16(&w.post_norm),
        w_down: [wd, 0, 0],
        in_place: Some([wk, wv, wu]),
    }
}

/// One layer's weights packed and its cache copied into the arena, as the GPU's `build_stack` does.
fn layer_buffers(a: &mut Arena, cfg: &Config, w: &Weights, cache: &KvCache, plan: Plan) -> LayerBuffers {
    let groups = plan.halves(cfg);
    let parts = plan.mlp_parts;
    let mut qkv_of = |g: Groups| a.alloc_bf16(&copy_packed(w, pack::qkv(cfg, g)));
    let w_qkv = [qkv_of(groups[0]), groups.get(1).map_or(0, |&g| qkv_of(g))];
    let w_o = column_parts(a, w, groups.iter().map(|&g| pack::oproj(cfg, g)).collect(), Tensor::Wo);
    LayerBuffers {
        w_qkv,
        in_norm: a.alloc_bf16(&w.in_norm),
        k_cache: a.alloc_bf16(&cache.k),
        v_cache: a.alloc_bf16(&cache.v),
        w_o,
        w_gateup: a.alloc_bf16(&copy_packed(w, pack::gateup(cfg))),
        post_norm: a.alloc_bf16(&w.post_norm),
        w_down: column_parts(a, w, (0..parts).map(|k| pack::down(cfg, parts, k)).collect(), Tensor::Wdown),
        in_place: None,
    }
}

impl CpuStack {
    /// Packs (or, `in_place`, leaves as handed over) and compiles exactly as the GPU `build_stack` does
    /// for a grid of `grid` blocks laid out as `plan` says, over host buffers: one layer per `(weights,
    /// cache)`; split over GPUs (`split`), `cfg` and the layers are one GPU's share.
    pub fn build(
        cfg: &Config,
        layers: &[(Weights, KvCache)],
        grid: u32,
        plan: Plan,
        in_place: bool,
        split: Split,
    ) -> Self {
        assert!(
            !in_place || plan == Plan { roles: 1, mlp_parts: 1 },
            "streaming in place runs one role and one MLP part"
        );
        let mut a = Arena::default();
        let rope = RopeTable::new(cfg);
        let zeros = |n: usize| vec![0u8; n];
        let chunks = program::max_splits(cfg) * cfg.n_kv * cfg.group();
        let tables: Vec<LayerBuffers> = layers
            .iter()
            .map(|(w, c)| if in_place { handed_buffers(&mut a, w, c) } else { layer_buffers(&mut a, cfg, w, c, plan) })
            .collect();
        let buffers = Buffers {
            q: a.alloc(&zeros(2 * cfg.q_dim())),
            cos: a.alloc_f32(&rope.cos),
            sin: a.alloc_f32(&rope.sin),
            part_o: a.alloc(&zeros(4 * chunks * cfg.hd)),
            part_ml: a.alloc(&zeros(4 * chunks * 2)),
            counters: a.alloc(&zeros(4 * 2 * cfg.n_kv)),
            a: a.alloc(&zeros(2 * cfg.q_dim())),
            x1_part: a.alloc(&zeros(4 * cfg.d)),
            x1: a.alloc(&zeros(2 * cfg.d)),
            act: a.alloc(&zeros(2 * cfg.ffn)),
            down_part: a.alloc(&zeros(4 * cfg.d)),
        };
        let program = program::compile(cfg, &buffers, grid, plan, split);
        Self {
            cfg: cfg.clone(),
            arena: a,
            buffers,
            layers: tables,
            program,
            parts_so_far: Vec::new(),
            partials_left: 0,
            coded: None,
        }
    }

    /// From here on, the decode program of the model kernel's instances for `format`'s codes: each
    /// layer's wide GEMVs from its codes and scales (`layers`, whose dequantised weights this stack was
    /// built from), packed by `code_stream`, each weight read as the loader's (`code_stream::unpack`): a
    /// check of the packing and the program, whose sums part from the kernel's fused products by the
    /// weights' rounding to bf16. Fails as `code_stream::layer_matrices` fails.
    #[cfg(feature = "model")]
    pub fn stream_codes(
        &mut self,
        format: Format,
        plan: Plan,
        layers: &[code_stream::CodedLayer],
    ) -> Result<(), String> {
        let mut tables = Vec::with_capacity(layers.len());
        for (buffers, layer) in self.layers.iter().zip(layers) {
            let packed = code_stream::layer_matrices(format, &self.cfg, plan, layer)?;
            let placed: Vec<_> = packed.matrices.iter().map(|(slot, bytes)| (*slot, self.arena.alloc(bytes))).collect();
            tables.push(code_stream::table(buffers.table(), &placed));
        }
        self.program = code_stream::decode_rows(format, &self.cfg, plan, &self.program);
        self.coded = Some((format, tables));
        Ok(())
    }

    /// `rows` rows of `cols` weights from `w`: codes where the decode program streams them
    /// (`stream_codes`), bf16 otherwise.
    fn weights(&self, w: i64, rows: usize, cols: usize) -> Vec<bf16> {
        #[cfg(feature = "model")]
        if let Some((format, _)) = self.coded {
            let narrow = crate::kernels::has_narrow_rows(&self.cfg);
            if code_stream::streams_codes(format, narrow, rows, cols) {
                let bytes = self.arena.bytes(w as u64, format.packed_bytes(rows, cols));
                return code_stream::unpack(format, narrow, bytes, rows, cols);
            }
        }
        self.arena.bf16(w, rows * cols)
    }

    /// Layer `l`'s cache as the program left it.
    pub fn cache(&self, l: usize) -> KvCache {
        let n = self.cfg.cache_elems();
        KvCache {
            k: self.arena.bf16(self.layers[l].k_cache as i64, n),
            v: self.arena.bf16(self.layers[l].v_cache as i64, n),
        }
    }

    /// One step: every row of the program in order, for each layer in turn, each row resolved for its
    /// layer; returns each layer's output (the last one is the step's).
    pub fn step(&mut self, x: &[bf16], pos: usize) -> Vec<Vec<bf16>> {
        let order: Vec<usize> = (0..self.program.len() * self.layers.len()).collect();
        self.step_in_order(x, pos, &order).unwrap_or_else(|e| panic!("{e}"))
    }

    /// One step with its phases run in `order` (each once, numbered over every layer as
    /// `program::dependencies` numbers them); each layer's output, or where a phase read a layer's
    /// input that no phase before it had written.
    pub fn step_in_order(&mut self, x: &[bf16], pos: usize, order: &[usize]) -> Result<Vec<Vec<bf16>>, String> {
        let (program, layers) = (self.program.clone(), self.layers.len());
        walk_order(&program, layers, order, x, |l, row, x_l| match self.run_row(l, row, x_l, pos) {
            Ran::Done => None,
            Ran::Output(o) => Some(o),
            Ran::Reduce(_) => panic!("a Reduce row needs every GPU's share of the layer (split::SplitCpu)"),
        })
    }

    /// Row `row` of layer `l`, whose input is `x`.
    pub(crate) fn run_row(&mut self, l: usize, row: &Row, x: &[bf16], pos: usize) -> Ran {
        let table = self.coded.as_ref().map_or_else(|| self.layers[l].table(), |(_, t)| t[l]);
        let row = program::resolve_row(row, &table);
        let in_place = self.layers[l].in_place;
        match Op::from_word(row[0]).unwrap_or_else(|| panic!("unknown opcode {}", row[0])) {
            Op::Nop => {}
            Op::Qkv => self.qkv(&row, x, pos, in_place),
            Op::Attention => self.attention(&row, pos),
            Op::OProj => self.oproj(&row, x),
            Op::GateUp => self.gateup(&row, in_place),
            Op::Down => {
                if let Some(o) = self.down(&row) {
                    return Ran::Output(o);
                }
            }
            Op::Reduce => return Ran::Reduce(row),
        }
        Ran::Done
    }

    /// The parts of the GEMV whose last part left its partials at `partials`, for a Reduce row.
    pub(crate) fn take_parts(&mut self, partials: i64) -> Vec<Part> {
        assert!(
            partials != 0 && self.partials_left == partials,
            "a Reduce row must read the partials the last part left"
        );
        self.partials_left = 0;
        std::mem::take(&mut self.parts_so_far)
    }

    /// The packed matrix of `rows` rows of `d` from `source(p)` (weight address, row) of each packed row
    /// `p`: what the kernel's in-place stream gathers stage by stage.
    fn gathered(&self, rows: usize, d: usize, source: impl Fn(usize) -> (u64, usize)) -> Vec<bf16> {
        (0..rows)
            .flat_map(|p| {
                let (w, r) = source(p);
                self.arena.bf16(w as i64 + (2 * r * d) as i64, d)
            })
            .collect()
    }

    fn qkv(&mut self, r: &Row, x: &[bf16], pos: usize, in_place: Option<[u64; 3]>) {
        let w = |i: qkv::Word| r[i as usize];
        let dim = |i: qkv::Word| r[i as usize] as usize;
        let (d, n_q, n_kv, hd, max_seq) = (dim(qkv::D), dim(qkv::NQ), dim(qkv::NKv), dim(qkv::Hd), dim(qkv::MaxSeq));
        assert_eq!((d, hd, max_seq), (self.cfg.d, self.cfg.hd, self.cfg.max_seq_len));
        assert_eq!(n_q * self.cfg.n_kv, n_kv * self.cfg.n_q, "a row's heads must be whole KV groups");
        let cfg = &sub_config(&self.cfg, n_q, n_kv);
        let eps = f32::from_bits(w(qkv::EpsBits) as u32);
        let h = golden::rmsnorm(x, &self.arena.bf16(w(qkv::Norm), d), eps);
        let rows = (n_q + 2 * n_kv) * hd;
        let matrix = match in_place {
            None => self.weights(w(qkv::W), rows, d),
            Some([wk, wv, _]) => self.gathered(rows, d, |p| {
                let (t, row) = qkv_source(cfg, Groups::all(cfg), p);
                (
                    match t {
                        Tensor::Wq => w(qkv::W) as u64,
                        Tensor::Wk => wk,
                        _ => wv,
                    },
                    row,
                )
            }),
        };
        let y = golden::gemv(&matrix, rows, d, &h);
        // Unpack the pairs into q, k and v in their natural order.
        let (mut q, mut k, mut v) =
            (vec![bf16::ZERO; n_q * hd], vec![bf16::ZERO; n_kv * hd], vec![bf16::ZERO; n_kv * hd]);
        for (p, &value) in y.iter().enumerate() {
            let (t, row) = qkv_source(cfg, Groups::all(cfg), p);
            match t {
                Tensor::Wq => q[row] = value,
                Tensor::Wk => k[row] = value,
                _ => v[row] = value,
            }
        }
        let half = hd / 2;
        let table = RopeTable {
            cos: self.arena.f32(w(qkv::Cos), max_seq * half),
            sin: self.arena.f32(w(qkv::Sin), max_seq * half),
            half,
        };
        golden::rope(&mut q, n_q, hd, &table, pos);
        golden::rope(&mut k, n_kv, hd, &table, pos);
        self.arena.write_bf16(w(qkv::QOut), &q);
        for head in 0..n_kv {
            let slot = 2 * ((head * max_seq + pos) * hd) as i64;
            self.arena.write_bf16(w(qkv::KCache) + slot, &k[head * hd..(head + 1) * hd]);
            self.arena.write_bf16(w(qkv::VCache) + slot, &v[head * hd..(head + 1) * hd]);
        }
    }

    fn attention(&mut self, r: &Row, pos: usize) {
        let w = |i: attn::Word| r[i as usize];
        let cfg = &sub_config(&self.cfg, w(attn::NQ) as usize, w(attn::NKv) as usize);
        assert_eq!(w(attn::Chunk) as usize, program::chunk(&self.cfg));
        let n = cfg.cache_elems();
        let cache = KvCache { k: self.arena.bf16(w(attn::KCache), n), v: self.arena.bf16(w(attn::VCache), n) };
        let a = golden::attention(cfg, &self.arena.bf16(w(attn::Q), cfg.q_dim()), &cache, pos);
        self.arena.write_bf16(w(attn::AOut), &a);
    }

    /// `W v`, or one of its parts of columns: every part but the last names the partials it writes
    /// (`part_out`), every part but the first those it adds (`part_in`); both must be `partials`. The
    /// executor keeps each part's operands and computes the whole product when the last comes (`None`
    /// until then), with the golden model's rounding, from the parts' packed columns (`product`). Split
    /// over GPUs, the last part leaves partials too, for a Reduce row (`take_parts`).
    fn split_gemv(&mut self, part: Part, rows: usize, part_in: i64, part_out: i64, partials: u64) -> Option<Vec<bf16>> {
        assert!([0, partials as i64].contains(&part_in) && [0, partials as i64].contains(&part_out));
        assert_eq!(part_in != 0, !self.parts_so_far.is_empty(), "a part adds partials exactly when parts came before");
        self.parts_so_far.push(part);
        if part_out != 0 {
            self.partials_left = part_out;
            return None;
        }
        let parts = std::mem::take(&mut self.parts_so_far);
        let arena = &self.arena;
        // Every part's whole rows: its own matrix of `rows` rows.
        let read = |_: &Arena, w: i64, _: &Range<usize>, cols: usize| self.weights(w, rows, cols);
        Some(product_read(&parts.iter().map(|&p| (arena, p)).collect::<Vec<_>>(), 0..rows, read))
    }

    /// `x1 = x + Wo a`, in one or two parts of columns (`split_gemv`).
    fn oproj(&mut self, r: &Row, x: &[bf16]) {
        let w = |i: oproj::Word| r[i as usize];
        let part = (w(oproj::W), w(oproj::A), w(oproj::Cols) as usize);
        let rows = w(oproj::Rows) as usize;
        if let Some(y) = self.split_gemv(part, rows, w(oproj::PartIn), w(oproj::PartOut), self.buffers.x1_part) {
            self.arena.write_bf16(w(oproj::X1Out), &golden::add(x, &y));
        }
    }

    /// GateUp's rows of the part of act the row names (its rows of the packed matrix are those of that
    /// part's gate/up pairs).
    fn gateup(&mut self, r: &Row, in_place: Option<[u64; 3]>) {
        let w = |i: gateup::Word| r[i as usize];
        let (d, ffn) = (w(gateup::D) as usize, w(gateup::Ffn) as usize);
        let eps = f32::from_bits(w(gateup::EpsBits) as u32);
        let h2 = golden::rmsnorm(&self.arena.bf16(w(gateup::X1), d), &self.arena.bf16(w(gateup::Norm), d), eps);
        let matrix = match in_place {
            None => self.weights(w(gateup::W), 2 * ffn, d),
            Some([_, _, wup]) => self.gathered(2 * ffn, d, |p| {
                let (t, row) = pack::gateup_source(p);
                (if t == Tensor::Wgate { w(gateup::W) as u64 } else { wup }, row)
            }),
        };
        let y = golden::gemv(&matrix, 2 * ffn, d, &h2);
        let (gate, up): (Vec<bf16>, Vec<bf16>) = y.chunks(2).map(|p| (p[0], p[1])).unzip();
        self.arena.write_bf16(w(gateup::ActOut), &golden::silu_mul(&gate, &up));
    }

    /// `out = x1 + Wd act`, in one or two parts of columns (`split_gemv`); `None` after a first part.
    fn down(&mut self, r: &Row) -> Option<Vec<bf16>> {
        let w = |i: down::Word| r[i as usize];
        let part = (w(down::W), w(down::Act), w(down::Cols) as usize);
        let y =
            self.split_gemv(part, w(down::Rows) as usize, w(down::PartIn), w(down::PartOut), self.buffers.down_part)?;
        Some(golden::add(&self.arena.bf16(w(down::X1), w(down::Rows) as usize), &y))
    }
}

/// What the CPU executors' tests share: orders of a step's phases that its dependencies allow, and a
/// run beside the golden model.
#[cfg(test)]
pub(crate) mod checks {
    use half::bf16;
    use reference::golden::{self, KvCache, RopeTable, Weights};
    use spec::Config;

    use super::CpuStack;
    use crate::program::{Plan, Split};

    /// An order of a step's phases that keeps `after` (`program::dependencies`), each ready phase
    /// picked by a generator seeded with `seed`.
    pub fn order_from(after: &[Vec<usize>], seed: u64) -> Vec<usize> {
        let mut waiting: Vec<usize> = after.iter().map(Vec::len).collect();
        let mut followers = vec![Vec::new(); after.len()];
        for (f, before) in after.iter().enumerate() {
            for &b in before {
                followers[b].push(f);
            }
        }
        let mut ready: Vec<usize> = (0..after.len()).filter(|&f| waiting[f] == 0).collect();
        let (mut state, mut order) = (seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1, Vec::new());
        while !ready.is_empty() {
            // xorshift64: any spread will do.
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            let f = ready.swap_remove((state % ready.len() as u64) as usize);
            order.push(f);
            for &g in &followers[f] {
                waiting[g] -= 1;
                if waiting[g] == 0 {
                    ready.push(g);
                }
            }
        }
        assert_eq!(order.len(), after.len(), "the dependencies have a cycle");
        order
    }

    /// The stack of `cfg.layers` layers of seeded weights and caches, built for the executor.
    pub fn built(cfg: &Config, grid: u32, plan: Plan, in_place: bool) -> (CpuStack, Vec<(Weights, KvCache)>) {
        let seed: u64 = 0x5EED ^ cfg.d as u64;
        let layers: Vec<(Weights, KvCache)> = (0..cfg.layers)
            .map(|l| {
                let s = spec::data::layer_seed(seed, l);
                (golden::generate_weights(cfg, s), KvCache::generate(cfg, s))
            })
            .collect();
        (CpuStack::build(cfg, &layers, grid, plan, in_place, Split::None), layers)
    }

    /// Whether each layer's cache (`cache(l)`) is the golden model's (`golden`, from `against_golden`).
    pub fn same_caches(golden: &[KvCache], cache: impl Fn(usize) -> KvCache) -> Result<(), String> {
        match golden.iter().enumerate().find(|&(l, c)| &cache(l) != c) {
            Some((l, _)) => Err(format!("layer {l}'s caches differ")),
            None => Ok(()),
        }
    }

    /// A fresh seed for each run's inputs, said in the message of any mismatch.
    pub fn input_seed() -> u64 {
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() as u64
    }

    /// `steps` steps of `step(x, pos, step index)` beside the golden model's over `layers`, from fresh
    /// inputs: the golden caches where every layer's output is the golden model's bit for bit; else
    /// where they first differ.
    pub fn against_golden(
        cfg: &Config,
        layers: &[(Weights, KvCache)],
        steps: usize,
        mut step: impl FnMut(&[bf16], usize, usize) -> Result<Vec<Vec<bf16>>, String>,
    ) -> Result<Vec<KvCache>, String> {
        let table = RopeTable::new(cfg);
        let mut caches: Vec<KvCache> = layers.iter().map(|(_, c)| c.clone()).collect();
        let seed = input_seed();
        for s in 0..steps {
            let x = spec::data::input(cfg, seed, s);
            let pos = cfg.prefill + s;
            let got = step(&x, pos, s)?;
            assert_eq!(got.len(), cfg.layers);
            let mut state = x;
            for (l, ((w, _), cache)) in layers.iter().zip(&mut caches).enumerate() {
                state = golden::step(cfg, w, cache, &table, &state, pos);
                assert!(state.iter().any(|v| v.to_f32() != 0.0));
                if got[l] != state {
                    return Err(format!("{} step {s} layer {l} differs (input seed {seed:#x})", cfg.name));
                }
            }
        }
        Ok(caches)
    }
}

#[cfg(test)]
mod tests {
    use super::checks::built;
    use super::*;

    /// The compiler's program for a grid of `grid` blocks (`phases` of them), run by the executor, is
    /// the golden model's step bit for bit, cache included.
    fn matches_golden(cfg: Config, grid: u32, phases: usize, steps: usize) {
        let plan = Plan::choose(&cfg, grid);
        matches_golden_with(cfg, grid, plan, phases, steps);
    }

    /// The same for the program laid out as `plan` says, with packed weights, over `cfg.layers` layers.
    fn matches_golden_with(cfg: Config, grid: u32, plan: Plan, phases: usize, steps: usize) {
        matches_golden_laid_out(cfg, grid, plan, false, phases, steps);
    }

    /// The same with the weights packed or, `in_place`, as handed over, over `cfg.layers` layers, each
    /// with its own weights and cache: every layer's output is the golden model's step on the layer
    /// before's.
    fn matches_golden_laid_out(cfg: Config, grid: u32, plan: Plan, in_place: bool, phases: usize, steps: usize) {
        let (mut stack, layers) = built(&cfg, grid, plan, in_place);
        assert_eq!(stack.program.len(), phases, "{} on {grid} blocks", cfg.name);
        let caches = checks::against_golden(&cfg, &layers, steps, |x, pos, _| Ok(stack.step(x, pos)))
            .unwrap_or_else(|e| panic!("{e}"));
        for (l, cache) in caches.iter().enumerate() {
            assert_eq!(&stack.cache(l), cache, "{}: layer {l}'s caches differ", cfg.name);
        }
    }

    /// `orders` steps of the stack, each in another order its dependencies allow: the golden step, and
    /// the golden caches at the end.
    fn matches_golden_in_any_order(cfg: &Config, plan: Plan, in_place: bool, orders: usize) {
        let (mut stack, layers) = built(cfg, 132, plan, in_place);
        let after = program::dependencies(&stack.program, cfg.layers);
        let caches = checks::against_golden(cfg, &layers, orders, |x, pos, s| {
            stack.step_in_order(x, pos, &checks::order_from(&after, s as u64))
        })
        .unwrap_or_else(|e| panic!("{plan:?}, in place {in_place}: {e}"));
        for (l, cache) in caches.iter().enumerate() {
            assert_eq!(&stack.cache(l), cache, "{}: layer {l}'s caches differ", cfg.name);
        }
    }

    /// Every order of a step's phases that their dependencies allow computes the golden step: one role
    /// and two, the MLP in one to three parts, packed and in place, over three layers (so the layers'
    /// phases interleave as far as their waits let them).
    #[test]
    fn every_order_the_dependencies_allow_computes_the_golden_step() {
        let cfg = Config { layers: 3, n_kv: 4, ..Config::tiny() };
        for (roles, parts) in [(1, 1), (1, 3), (2, 2), (2, 3)] {
            let plan = Plan::with(&cfg, 132, program::Forced { roles: Some(roles), mlp_parts: Some(parts) }).unwrap();
            matches_golden_in_any_order(&cfg, plan, false, 12);
        }
        matches_golden_in_any_order(&cfg, Plan { roles: 1, mlp_parts: 1 }, true, 12);
    }

    /// The check can fail: without GateUp's wait for the O projection, some order the remaining
    /// dependencies allow reads x1 before it is written.
    #[test]
    fn a_missing_wait_is_caught_by_some_order() {
        let cfg = Config { layers: 3, n_kv: 4, ..Config::tiny() };
        let (mut stack, layers) = built(&cfg, 132, Plan { roles: 1, mlp_parts: 1 }, false);
        let gateup = stack.program.iter().position(|r| r[0] == Op::GateUp as i64).unwrap();
        let oproj = stack.program.iter().position(|r| r[0] == Op::OProj as i64).unwrap();
        assert!(stack.program[gateup][program::WAITS_WORD] >> oproj & 1 == 1);
        stack.program[gateup][program::WAITS_WORD] &= !(1 << oproj);
        let after = program::dependencies(&stack.program, cfg.layers);
        let caught = checks::against_golden(&cfg, &layers, 64, |x, pos, s| {
            stack.step_in_order(x, pos, &checks::order_from(&after, s as u64))
        });
        assert!(caught.is_err(), "64 orders without GateUp's wait all computed the golden step");
    }

    /// A stack of three layers, in both roles: each layer reads its own weights and cache, and the
    /// layer before's output.
    #[test]
    fn executor_matches_golden_over_a_stack() {
        let cfg = Config { layers: 3, ..Config::tiny() };
        matches_golden(cfg.clone(), 132, 5, 2);
        let two = Plan::with(&cfg, 132, program::Forced { roles: Some(2), mlp_parts: Some(2) }).unwrap();
        matches_golden_with(cfg.clone(), 132, two, 10, 2);
        // Streamed in place: Qkv's and GateUp's rows gathered from the weights as handed over.
        let one = Plan { roles: 1, mlp_parts: 1 };
        matches_golden_laid_out(cfg, 132, one, true, 5, 2);
    }

    #[test]
    fn executor_matches_golden_at_tiny_in_two_roles() {
        let two = Plan::with(&Config::tiny(), 132, program::Forced { roles: Some(2), mlp_parts: Some(2) }).unwrap();
        matches_golden_with(Config::tiny(), 132, two, 10, 3);
    }

    #[test]
    fn executor_matches_golden_at_tiny_on_one_block() {
        matches_golden(Config::tiny(), 1, 5, 2);
    }

    #[test]
    fn executor_matches_golden_at_small() {
        matches_golden(Config::small(), 132, 5, 2);
    }

    /// The family's other shapes pack and compile as the golden model computes them, in two roles
    /// (the compiler's one-role plan for these narrow layers is checked in every plan below): hd 256,
    /// 16 and 1 query heads per KV head, and an `ffn` over two of the stream's rows, run in three parts
    /// whose middle one adds to the first's partials.
    #[test]
    fn executor_matches_golden_at_the_familys_other_shapes() {
        let tiny = Config::tiny();
        let two_roles = |cfg: Config, phases: usize| {
            let plan = Plan::with(&cfg, 132, program::Forced { roles: Some(2), mlp_parts: None }).unwrap();
            matches_golden_with(cfg, 132, plan, phases, 2);
        };
        two_roles(Config { name: "tiny-hd256".into(), hd: 256, n_q: 4, n_kv: 2, ..tiny.clone() }, 8);
        two_roles(Config { name: "tiny-g16".into(), n_q: 32, n_kv: 2, ..tiny.clone() }, 8);
        two_roles(Config { name: "tiny-mha".into(), n_q: 6, n_kv: 6, ..tiny.clone() }, 8);
        let wide = Config { name: "tiny-ffn3".into(), ffn: 2 * program::MAX_ROW + 64, ..tiny };
        assert_eq!(Plan::choose(&wide, 132).mlp_parts, 3);
        matches_golden(wide.clone(), 132, 9, 2);
        two_roles(wide, 12);
    }

    /// Every plan `Plan::with` admits computes the golden step: one role or two, the MLP in one to
    /// three parts, on a layer of several KV heads.
    #[test]
    fn executor_matches_golden_in_every_plan() {
        let cfg = Config::tiny();
        assert!(cfg.n_kv >= 2);
        for roles in 1..=2 {
            for mlp_parts in 1..=program::MAX_MLP_PARTS {
                let plan = Plan::with(&cfg, 132, program::Forced { roles: Some(roles), mlp_parts: Some(mlp_parts) })
                    .unwrap_or_else(|e| panic!("{roles} roles, {mlp_parts} parts: {e}"));
                let phases = if roles == 2 { 6 } else { 3 } + 2 * mlp_parts;
                matches_golden_with(cfg.clone(), 132, plan, phases, 2);
            }
        }
    }
}
