//! The machinery **int8-down** and **int8-down-padded** share: the down projection repacked in
//! `build_layer` as int8 rows with its outliers kept exact, and the eager step that streams it.
//!
//! Each row of `down` (`d` rows of `ffn`) is split in two. Its outliers, every element over
//! [`OUTLIER_SIGMAS`] times the row's typical spread, stay exact in bf16 in a per-row sparse list as
//! long as the data makes it (real weights carry outlier channels; a fixed count per row would miss
//! some). The spread is robust (the median magnitude, scaled to a normal's standard deviation), so
//! the outliers themselves cannot widen it.
//! The rest become int8 with one f32 scale per row, set by the largest of them, so an outlier never
//! coarsens its row's grid. The GEMV over that form (`gemv_i8_outliers_bf16` of `kernels/redteam/redteam.cu`)
//! reads a little over half the bytes of the bf16 matrix; every other op is the eager reference's.

use crate::kernels::REDTEAM;
use cuda::cudarc::driver::{CudaFunction, CudaSlice, DeviceRepr, LaunchConfig, PushKernelArg};
use cuda::{Context, CudaError, Device};
use half::bf16;
use reference::gpu::Eager;
use spec::Config;
use submission::{Layer, SubmissionError};

use super::honest::Twist;
use super::not_built;

/// The GEMV kernel of `kernels/redteam/redteam.cu`.
pub const KERNEL: &str = "gemv_i8_outliers_bf16";

/// An element more than this many typical spreads from zero is an outlier. Four keeps the int8 grid
/// of a row at most 4/127 of its spread and sends the tail beyond to the list at six bytes an
/// element: under 0.01% of a normal row, plus the data's outlier channels.
pub const OUTLIER_SIGMAS: f64 = 4.0;
/// A normal distribution's median magnitude over its standard deviation.
const MEDIAN_ABS_PER_SIGMA: f64 = 0.674_489_75;
/// The int8 grid's largest step count either side of zero.
const Q_MAX: f64 = 127.0;
/// int8 per 16-byte load of the kernel: a row's length must be a multiple of it.
const I8_PER_VEC: usize = 16;
/// Rows per block of the GEMV, one warp each.
const GEMV_WARPS: u32 = 8;
/// Threads per warp.
const WARP: u32 = 32;

/// A matrix `(rows, cols)` as int8 rows plus exact outliers: `w[r, c] = scale[r] * q[r, c]`, except
/// at the row's outliers, where `q` is 0 and the value is in the list.
#[derive(Debug)]
pub struct Int8Rows {
    pub rows: usize,
    pub cols: usize,
    /// `(rows, cols)`: `round(w / scale)` in `[-127, 127]`; 0 where an outlier is.
    pub q: Vec<i8>,
    /// `(rows)`: the row's largest non-outlier magnitude over 127 (0 for a row of zeros).
    pub scale: Vec<f32>,
    /// `(rows + 1)`: row `r`'s outliers are entries `row_start[r]..row_start[r + 1]` of the list.
    pub row_start: Vec<u32>,
    /// `(outliers)`: their columns, ascending within a row.
    pub outlier_col: Vec<u32>,
    /// `(outliers)`: their values, exact.
    pub outlier_val: Vec<bf16>,
}

impl Int8Rows {
    /// Quantises the row-major `w (rows, cols)`.
    pub fn quantise(w: &[bf16], rows: usize, cols: usize) -> Self {
        assert_eq!(w.len(), rows * cols, "quantise: a matrix of the wrong size");
        let mut m = Self {
            rows,
            cols,
            q: Vec::with_capacity(w.len()),
            scale: Vec::with_capacity(rows),
            row_start: vec![0],
            outlier_col: Vec::new(),
            outlier_val: Vec::new(),
        };
        for row in w.chunks_exact(cols) {
            let sigma = robust_sigma(row);
            let is_outlier = |v: bf16| v.to_f64().abs() > OUTLIER_SIGMAS * sigma;
            let largest = row.iter().filter(|&&v| !is_outlier(v)).fold(0.0f64, |m, v| m.max(v.to_f64().abs()));
            let scale = (largest / Q_MAX) as f32;
            for (c, &v) in row.iter().enumerate() {
                if is_outlier(v) {
                    m.outlier_col.push(c as u32);
                    m.outlier_val.push(v);
                    m.q.push(0);
                } else if scale == 0.0 {
                    m.q.push(0);
                } else {
                    m.q.push((v.to_f64() / f64::from(scale)).round().clamp(-Q_MAX, Q_MAX) as i8);
                }
            }
            m.scale.push(scale);
            let end = u32::try_from(m.outlier_col.len()).expect("more outliers than 32-bit offsets hold");
            m.row_start.push(end);
        }
        m
    }
}

/// The standard deviation a normal row with `row`'s median magnitude would have: its outliers
/// cannot inflate it, as they inflate the RMS.
fn robust_sigma(row: &[bf16]) -> f64 {
    let mut mags: Vec<f64> = row.iter().map(|v| v.to_f64().abs()).collect();
    let mid = mags.len() / 2;
    mags.select_nth_unstable_by(mid, f64::total_cmp);
    mags[mid] / MEDIAN_ABS_PER_SIGMA
}

/// [`Int8Rows`] on the GPU, with the kernel that multiplies by it.
struct DeviceInt8 {
    q: CudaSlice<i8>,
    scale: CudaSlice<f32>,
    row_start: CudaSlice<u32>,
    outlier_col: CudaSlice<u32>,
    outlier_val: CudaSlice<bf16>,
    rows: u32,
    cols: u32,
    gemv: CudaFunction,
}

/// `v` on the device; an empty `v` becomes one `T::default()`, which nothing reads: the driver refuses
/// allocations of zero bytes, and a matrix may have no outlier at all.
fn upload<T: DeviceRepr + Default + Clone>(dev: &Device, v: &[T], what: &str) -> Result<CudaSlice<T>, CudaError> {
    let one = [T::default()];
    dev.stream().clone_htod(if v.is_empty() { &one[..] } else { v }).context(format!("uploading {what}"))
}

impl DeviceInt8 {
    fn new(dev: &Device, m: &Int8Rows) -> Result<Self, SubmissionError> {
        let size = |n: usize| u32::try_from(n).map_err(|_| SubmissionError::Refused(format!("{n} is over 32 bits")));
        Ok(Self {
            q: upload(dev, &m.q, "the int8 rows")?,
            scale: upload(dev, &m.scale, "the row scales")?,
            row_start: upload(dev, &m.row_start, "the outlier offsets")?,
            outlier_col: upload(dev, &m.outlier_col, "the outlier columns")?,
            outlier_val: upload(dev, &m.outlier_val, "the outlier values")?,
            rows: size(m.rows)?,
            cols: size(m.cols)?,
            gemv: dev.function(&REDTEAM, KERNEL)?,
        })
    }

    /// `y = W h` on the device's stream, `h` of `cols` elements and `y` of `rows`.
    fn gemv(&self, dev: &Device, h: &CudaSlice<bf16>, y: &mut CudaSlice<bf16>) -> Result<(), CudaError> {
        assert_eq!((h.len(), y.len()), (self.cols as usize, self.rows as usize), "int8 gemv: wrong vector sizes");
        let grid = self.rows.div_ceil(GEMV_WARPS);
        let cfg = LaunchConfig { grid_dim: (grid, 1, 1), block_dim: (GEMV_WARPS * WARP, 1, 1), shared_mem_bytes: 0 };
        let mut args = dev.stream().launch_builder(&self.gemv);
        args.arg(y).arg(&self.q).arg(&self.scale).arg(&self.row_start);
        args.arg(&self.outlier_col).arg(&self.outlier_val).arg(h).arg(&self.rows).arg(&self.cols);
        // SAFETY: gemv_i8_outliers_bf16(y (rows), q (rows, cols), scale (rows), row_start (rows + 1),
        // outlier_col, outlier_val (outliers), h (cols), rows: u32, cols: u32), in that order; the
        // buffers were uploaded from one Int8Rows of rows x cols, whose row_start indexes only its
        // outliers; cols is a multiple of 16 (checked in build) and every buffer an allocation's base,
        // so the 16-byte loads are aligned.
        unsafe { args.launch(cfg) }.context("launching gemv_i8_outliers_bf16")?;
        Ok(())
    }
}

/// The eager step with its down projection streamed from int8 rows, which `build` makes.
#[derive(Default)]
pub struct Int8Down {
    down: Option<DeviceInt8>,
}

impl Twist for Int8Down {
    fn build(&mut self, dev: &Device, layer: &mut Layer<'_>, cfg: &Config) -> Result<(), SubmissionError> {
        if !cfg.ffn.is_multiple_of(I8_PER_VEC) {
            return Err(SubmissionError::Refused(format!("ffn {} is not whole 16-byte int8 vectors", cfg.ffn)));
        }
        let down = dev.stream().clone_dtoh(&layer.weights.down).context("reading the down projection back")?;
        self.down = Some(DeviceInt8::new(dev, &Int8Rows::quantise(&down, cfg.d, cfg.ffn))?);
        Ok(())
    }

    fn step(
        &mut self,
        eager: &mut Eager,
        dev: &Device,
        layer: &mut Layer<'_>,
        x: &CudaSlice<bf16>,
        pos: usize,
        out: &mut CudaSlice<bf16>,
    ) -> Result<(), SubmissionError> {
        let down = self.down.as_ref().ok_or_else(not_built)?;
        let (w, cache) = (layer.weights, &mut *layer.cache);
        Ok(eager.step_with_down(dev, w, cache, x, pos, out, |act, y| down.gemv(dev, act, y))?)
    }

    fn teardown(&mut self) {
        self.down = None;
    }
}

#[cfg(test)]
mod tests {
    use reference::golden::{self, KvCache, RopeTable, Weights};
    use spec::{ByteModel, Gates};

    use super::*;

    impl Int8Rows {
        fn outliers(&self) -> usize {
            self.outlier_col.len()
        }

        /// Bytes one GEMV reads of this form, the vector it multiplies aside.
        fn bytes(&self) -> u64 {
            let list = size_of::<u32>() + size_of::<bf16>();
            let per_row = size_of::<f32>() + size_of::<u32>();
            (self.q.len() + per_row * self.rows + size_of::<u32>() + list * self.outliers()) as u64
        }
    }

    /// The kernel's arithmetic on the CPU: each row's int8 and outlier sums (f64 here, f32 there),
    /// combined as `scale * dense + sparse` in f32 and stored as bf16.
    fn gemv(m: &Int8Rows, h: &[bf16]) -> Vec<bf16> {
        let h: Vec<f64> = h.iter().map(|v| v.to_f64()).collect();
        (0..m.rows)
            .map(|r| {
                let q = &m.q[r * m.cols..(r + 1) * m.cols];
                let dense: f64 = q.iter().zip(&h).map(|(&q, h)| f64::from(q) * h).sum();
                let list = m.row_start[r] as usize..m.row_start[r + 1] as usize;
                let sparse: f64 = list.map(|i| m.outlier_val[i].to_f64() * h[m.outlier_col[i] as usize]).sum();
                bf16::from_f32((f64::from(m.scale[r]) * dense + sparse) as f32)
            })
            .collect()
    }

    /// One step as the adversary runs it, on the CPU: the golden model's ops in the eager step's order,
    /// the down projection by `down_proj`.
    fn step(
        cfg: &Config,
        w: &Weights,
        cache: &mut KvCache,
        table: &RopeTable,
        x: &[bf16],
        pos: usize,
        down_proj: impl Fn(&[bf16]) -> Vec<bf16>,
    ) -> Vec<bf16> {
        let h = golden::rmsnorm(x, &w.in_norm, cfg.eps);
        let mut q = golden::gemv(&w.q, cfg.q_dim(), cfg.d, &h);
        let mut k = golden::gemv(&w.k, cfg.kv_dim(), cfg.d, &h);
        let v = golden::gemv(&w.v, cfg.kv_dim(), cfg.d, &h);
        golden::rope(&mut q, cfg.n_q, cfg.hd, table, pos);
        golden::rope(&mut k, cfg.n_kv, cfg.hd, table, pos);
        golden::append(cache, cfg, &k, &v, pos);
        let a = golden::attention(cfg, &q, cache, pos);
        let x1 = golden::add(x, &golden::gemv(&w.o, cfg.d, cfg.q_dim(), &a));
        let h2 = golden::rmsnorm(&x1, &w.post_norm, cfg.eps);
        let gate = golden::gemv(&w.gate, cfg.ffn, cfg.d, &h2);
        let up = golden::gemv(&w.up, cfg.ffn, cfg.d, &h2);
        golden::add(&x1, &down_proj(&golden::silu_mul(&gate, &up)))
    }

    /// `||out - reference|| / ||reference||`, the correctness gate's measure.
    fn rel_err(out: &[bf16], reference: &[bf16]) -> f64 {
        let (mut num, mut den) = (0.0, 0.0);
        for (o, r) in out.iter().zip(reference) {
            num += (o.to_f64() - r.to_f64()).powi(2);
            den += r.to_f64().powi(2);
        }
        (num / den).sqrt()
    }

    /// The worst error of the int8-down step against the golden model's over `steps` steps of each
    /// seed, with the run's own input draws; the model of the step is first checked to be the golden
    /// model's bit for bit when it keeps the bf16 down projection.
    fn worst_error(cfg: &Config, seeds: std::ops::Range<u64>, steps: usize) -> f64 {
        let table = RopeTable::new(cfg);
        let mut worst: f64 = 0.0;
        for seed in seeds {
            let w = golden::generate_weights(cfg, seed);
            let m = Int8Rows::quantise(&w.down, cfg.d, cfg.ffn);
            let (mut want_cache, mut bf16_cache) = (KvCache::generate(cfg, seed), KvCache::generate(cfg, seed));
            let mut int8_cache = want_cache.clone();
            let mut errors = Vec::new();
            for s in 0..steps {
                let (x, pos) = (spec::data::input(cfg, seed ^ 0x1A9, s), cfg.prefill + s);
                let want = golden::step(cfg, &w, &mut want_cache, &table, &x, pos);
                let bf16_down = |act: &[bf16]| golden::gemv(&w.down, cfg.d, cfg.ffn, act);
                assert_eq!(step(cfg, &w, &mut bf16_cache, &table, &x, pos, bf16_down), want, "the model drifted");
                let got = step(cfg, &w, &mut int8_cache, &table, &x, pos, |act| gemv(&m, act));
                errors.push(rel_err(&got, &want));
            }
            // The adversary writes the cache exactly as the reference: only the output differs.
            assert_eq!(int8_cache, want_cache);
            let seed_worst = errors.iter().copied().fold(0.0, f64::max);
            eprintln!(
                "int8-down {} seed {seed}: worst {seed_worst:.3e} over {steps} steps; {} outliers ({:.3}%), {:.4} of the bf16 bytes",
                cfg.name,
                m.outliers(),
                100.0 * m.outliers() as f64 / (cfg.d * cfg.ffn) as f64,
                m.bytes() as f64 / (2 * cfg.d * cfg.ffn) as f64,
            );
            worst = worst.max(seed_worst);
        }
        worst
    }

    /// The adversary must pass correctness, or it would test nothing: its error stays under half the
    /// tolerance, leaving the other half to the GPU's f32 summation order and to data with outliers.
    #[test]
    fn int8_down_is_within_the_tolerance_at_tiny_and_small() {
        let tol = Gates::TASK.rel_err_tol;
        for (cfg, seeds, steps) in [(Config::tiny(), 1..9, 4), (Config::small(), 1..5, 3)] {
            let worst = worst_error(&cfg, seeds, steps);
            assert!(worst > 0.0, "{}: the int8 step equals the reference: nothing was quantised", cfg.name);
            assert!(worst <= tol / 2.0, "{}: worst error {worst:.3e} is over half the tolerance {tol}", cfg.name);
        }
    }

    /// The graded layer: minutes of CPU (856 M weights drawn, two steps per seed). Run with
    /// `cargo test --release -p redteam int8_down_is_within_the_tolerance_at_graded -- --ignored --nocapture`.
    #[test]
    #[ignore]
    fn int8_down_is_within_the_tolerance_at_graded() {
        let worst = worst_error(&Config::graded(), 1..3, 2);
        assert!(worst <= Gates::TASK.rel_err_tol / 2.0, "worst error {worst:.3e}");
    }

    #[test]
    fn outliers_are_exact_and_the_rest_within_half_a_step() {
        let cfg = Config::tiny();
        let mut w = golden::generate_weights(&cfg, 7).down;
        // Plant a huge entry, as in real down projections: it must not coarsen its row's grid.
        let sigma = robust_sigma(&w[..cfg.ffn]);
        w[5] = bf16::from_f64(100.0 * sigma);
        let m = Int8Rows::quantise(&w, cfg.d, cfg.ffn);
        assert_eq!(m.row_start.len(), cfg.d + 1);
        assert!(m.scale[0] <= (OUTLIER_SIGMAS * sigma / Q_MAX) as f32, "the outlier set row 0's scale");
        for r in 0..cfg.d {
            let row = &w[r * cfg.ffn..(r + 1) * cfg.ffn];
            let list = m.row_start[r] as usize..m.row_start[r + 1] as usize;
            let cols: Vec<usize> = m.outlier_col[list.clone()].iter().map(|&c| c as usize).collect();
            assert!(cols.windows(2).all(|p| p[0] < p[1]), "row {r}: columns not ascending");
            for (c, &v) in row.iter().enumerate() {
                let q = m.q[r * cfg.ffn + c];
                match cols.iter().position(|&o| o == c) {
                    Some(i) => assert_eq!((m.outlier_val[list.start + i], q), (v, 0), "row {r} col {c}"),
                    None => {
                        let back = f64::from(m.scale[r]) * f64::from(q);
                        let half_step = f64::from(m.scale[r]) / 2.0 * (1.0 + 1e-6);
                        assert!((back - v.to_f64()).abs() <= half_step, "row {r} col {c}: {v} became {back}");
                    }
                }
            }
        }
        assert!(m.row_start[1] >= 1 && m.outlier_col[..m.row_start[1] as usize].contains(&5));
        // A row of zeros quantises to zeros with no outlier and a zero scale.
        let zeros = Int8Rows::quantise(&[bf16::ZERO; 32], 2, 16);
        assert_eq!(zeros.outliers(), 0);
        assert_eq!((zeros.q, zeros.scale, zeros.row_start), (vec![0; 32], vec![0.0; 2], vec![0; 3]));
    }

    /// What the adversary saves: its form of the down projection is a little over half the bf16
    /// matrix, so a step reads about 0.87 of the byte model, far under the bytes_read gate's 0.98.
    #[test]
    fn int8_down_reads_far_less_than_the_byte_model() {
        let cfg = Config::small();
        let w = golden::generate_weights(&cfg, 3);
        let m = Int8Rows::quantise(&w.down, cfg.d, cfg.ffn);
        let bf16_bytes = (2 * cfg.d * cfg.ffn) as u64;
        let share = m.bytes() as f64 / bf16_bytes as f64;
        assert!((0.5..0.53).contains(&share), "the int8 form is {share:.4} of the bf16 matrix");
        let model = ByteModel::of(&cfg);
        let step = model.total - bf16_bytes + m.bytes();
        assert!((step as f64) < 0.9 * model.total as f64, "{step} of {} bytes", model.total);
    }
}
