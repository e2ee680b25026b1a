//! The first piece of batched decode and chunked prefill: several input vectors dotted with each weight
//! row of one stream (`RowStream::run_group` in `kernels/megakernel/vm_stream.cuh`), so that the weights are read
//! once for up to [`MAX_BATCH`] sequences (or a prompt chunk's positions), while each vector's sums
//! keep the bits they have streamed alone (`RowStream::run`, what every phase of a decode step runs).
//!
//! [`BatchGemv::run`] checks that on the GPU, on fresh random weights and inputs: the grouped result
//! bitwise equal to each vector's solo stream, both near an f64 product on the CPU, and times both.
//! `megakernel batch-gemv` prints the table.

use cuda::cudarc::driver::sys::CUfunction_attribute;
use cuda::cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};
use cuda::{Context, CudaError, Device};
use half::bf16;
use reference::gpu::data::fill_normal;
use spec::rng::{scale_for_std, stream_key};

use crate::kernels::MEGAKERNEL;
use crate::kernels::{RING_BYTES, THREADS, WARPS};
use crate::stack::partial_rows_room;

pub use crate::MAX_BATCH;
/// The longest row the stream takes: `MAX_VPT` 16-byte vectors per thread (the kernel's).
pub const MAX_COLS: usize = 7 * THREADS as usize * 8;
/// The kernel.
const KERNEL: &str = "megakernel_batch_gemv_bf16";
/// Rows checked against the CPU's f64 products per shape.
const CPU_ROWS: usize = 64;
/// Relative error of the GPU's f32 sums against f64 products that the check accepts: the products are
/// exact in f32, so only the sums' rounding parts them (about 1e-7 at these lengths).
const CPU_TOL: f64 = 1e-5;

/// One shape: `vectors` inputs of `cols` against a random `rows` x `cols` matrix.
#[derive(Debug, Clone, Copy)]
pub struct BatchGemv {
    pub rows: usize,
    pub cols: usize,
    pub vectors: usize,
}

/// What [`BatchGemv::run`] saw.
#[derive(Debug, Clone)]
pub struct BatchReport {
    /// Outputs whose bits differ between the grouped stream and the solo ones.
    pub mismatches: usize,
    /// Grouped outputs that are not finite: left poisoned (unwritten), or NaN.
    pub not_finite: usize,
    /// The grouped outputs' relative error against f64 products over [`CPU_ROWS`] rows of each vector;
    /// `None` when one was not finite.
    pub cpu_rel_err: Option<f64>,
    /// Kernel time of each timed launch, us: the grouped stream, and one solo stream per vector.
    pub grouped_us: Vec<f64>,
    pub solo_us: Vec<f64>,
    /// Passes over the weights the grouped kernel makes (vectors over the group its rows allow).
    pub passes: usize,
}

impl BatchReport {
    pub fn passed(&self) -> bool {
        self.mismatches == 0 && self.not_finite == 0 && self.cpu_rel_err.is_some_and(|e| e <= CPU_TOL)
    }
}

#[derive(Debug, thiserror::Error)]
pub enum BatchError {
    #[error(transparent)]
    Cuda(#[from] CudaError),
    #[error("{0}")]
    Refused(String),
}

/// Vectors the kernel holds at once for rows of `cols` (its `group_of`): a group's inputs take
/// [`MAX_BATCH`] 16-byte vectors per thread (64 registers once widened to f32).
pub fn group_of(cols: usize) -> usize {
    let vpt = (cols / 8).div_ceil(THREADS as usize);
    (MAX_BATCH / vpt).max(1)
}

impl BatchGemv {
    /// Refuses what the kernel cannot run, naming the value.
    pub fn validate(&self) -> Result<(), BatchError> {
        let refuse = |why: String| Err(BatchError::Refused(why));
        if self.cols == 0 || !self.cols.is_multiple_of(8) || self.cols > MAX_COLS {
            return refuse(format!("cols {}: a multiple of 8 from 8 to {MAX_COLS}", self.cols));
        }
        if self.vectors == 0 || self.vectors > MAX_BATCH {
            return refuse(format!("{} vectors: 1 to {MAX_BATCH}", self.vectors));
        }
        if self.rows == 0 || self.rows > u32::MAX as usize {
            return refuse(format!("rows {}: 1 to {}", self.rows, u32::MAX));
        }
        Ok(())
    }

    /// Weight bytes one pass streams.
    pub fn weight_bytes(&self) -> u64 {
        2 * self.rows as u64 * self.cols as u64
    }

    /// Runs the shape on fresh random data (`seed`), `reps` timed launches of each kind.
    pub fn run(&self, dev: &Device, seed: u64, reps: usize) -> Result<BatchReport, BatchError> {
        self.validate()?;
        let (rows, cols, vectors) = (self.rows, self.cols, self.vectors);
        let s = dev.stream();
        dev.require_free(self.weight_bytes() + 8 * (rows * vectors) as u64, "the batch GEMV's matrix and outputs")?;
        // Inputs of rms 1 and weights of 1/sqrt(cols): sums of order 1, as a layer's. Drawn on the GPU
        // (the CPU's `spec::rng` values, bitwise); the CPU check reads back the inputs and its rows.
        let random = |n: usize, stream: u64, std: f64| {
            fill_normal(dev, n, stream_key(seed, stream), 0.0, scale_for_std(std)).map_err(BatchError::from)
        };
        let w = random(rows * cols, 0, 1.0 / (cols as f64).sqrt())?;
        let x = random(vectors * cols, 1, 1.0)?;

        let grid = dev.facts().sms as u32;
        // Partials for the block's whole share of rows for every vector of a group, or what fits.
        let red_rows = (rows.div_ceil(grid as usize) * MAX_BATCH).min(partial_rows_room(dev));
        if red_rows < MAX_BATCH {
            return Err(BatchError::Refused(format!(
                "this card's shared memory leaves partials for {red_rows} rows; a group needs {MAX_BATCH}"
            )));
        }
        let smem = RING_BYTES + red_rows as u32 * WARPS * 4;
        let func = dev.function(&MEGAKERNEL, KERNEL)?;
        func.set_attribute(CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem as i32)
            .context("raising the batch GEMV's shared memory limit")?;
        let cfg = LaunchConfig { grid_dim: (grid, 1, 1), block_dim: (THREADS, 1, 1), shared_mem_bytes: smem };

        let launch_into = |y: &mut CudaSlice<f32>, grouped: bool| -> Result<f32, BatchError> {
            let (rows32, cols32, vectors32, grouped32, red32) =
                (rows as u32, cols as u32, vectors as u32, grouped as u32, red_rows as u32);
            let mut l = s.launch_builder(&func);
            l.arg(&w).arg(&rows32).arg(&cols32).arg(&x).arg(&vectors32).arg(&grouped32).arg(y).arg(&red32);
            // SAFETY: megakernel_batch_gemv_bf16(w: (rows, cols) bf16, rows, cols, x: (vectors, cols) bf16,
            // vectors, grouped, y: (vectors, rows) f32, red_rows), as allocated above; cols a multiple
            // of 8 up to MAX_COLS and 1 <= vectors <= MAX_BATCH (validate); smem holds the ring and
            // red_rows partial rows, at least a group's (checked above).
            dev.time_ms(|| unsafe { l.launch(cfg) }.map(drop).context("launching the batch GEMV"))
                .map_err(BatchError::from)
        };
        let poisoned = || s.clone_htod(&vec![f32::NAN; rows * vectors]).context("allocating the outputs");
        let (mut grouped, mut solo) = (poisoned()?, poisoned()?);
        let (mut grouped_us, mut solo_us) = (Vec::with_capacity(reps), Vec::with_capacity(reps));
        // Every launch writes every output (the first over the NaN poison: an output left unwritten
        // stays NaN and fails the check); the later ones rewrite the same values.
        for _ in 0..reps.max(1) {
            grouped_us.push(launch_into(&mut grouped, true)? as f64 * 1e3);
            solo_us.push(launch_into(&mut solo, false)? as f64 * 1e3);
        }
        let grouped = s.clone_dtoh(&grouped).context("reading the grouped outputs")?;
        let solo = s.clone_dtoh(&solo).context("reading the solo outputs")?;
        let mismatches = grouped.iter().zip(&solo).filter(|(a, b)| a.to_bits() != b.to_bits()).count();
        let x_host = s.clone_dtoh(&x).context("reading the inputs")?;
        let checked = (0..CPU_ROWS.min(rows))
            .map(|k| {
                let r = k * rows / CPU_ROWS.min(rows);
                let row = s.clone_dtoh(&w.slice(r * cols..(r + 1) * cols)).context("reading a row of the matrix")?;
                Ok((r, row))
            })
            .collect::<Result<Vec<_>, CudaError>>()?;
        Ok(BatchReport {
            mismatches,
            not_finite: grouped.iter().filter(|v| !v.is_finite()).count(),
            cpu_rel_err: cpu_rel_err(&checked, &x_host, &grouped, *self),
            grouped_us,
            solo_us,
            passes: vectors.div_ceil(group_of(cols)),
        })
    }
}

/// The relative error of `y` against f64 products over the `checked` rows (index, elements) of the
/// matrix, for every vector.
fn cpu_rel_err(checked: &[(usize, Vec<bf16>)], x: &[bf16], y: &[f32], shape: BatchGemv) -> Option<f64> {
    let BatchGemv { rows, cols, vectors } = shape;
    let (mut got, mut want) = (Vec::new(), Vec::new());
    for (r, row) in checked {
        for b in 0..vectors {
            let input = &x[b * cols..(b + 1) * cols];
            want.push(row.iter().zip(input).map(|(a, c)| a.to_f64() * c.to_f64()).sum::<f64>() as f32);
            got.push(y[b * rows + *r]);
        }
    }
    spec::gates::rel_err(&got, &want)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_group_mirrors_the_kernel() {
        use crate::kernels::DEVICE_SOURCE as CU;
        assert!(CU.contains(&format!("constexpr uint32_t MAX_BATCH = {MAX_BATCH};")));
        assert!(CU.contains("return VPT >= MAX_BATCH ? 1 : MAX_BATCH / VPT;"));
        assert!(CU.contains("constexpr uint32_t MAX_VPT = 7;"));
        // One 16-byte vector per thread up to 4096 columns: the whole batch in one pass.
        assert_eq!((group_of(2048), group_of(4096), group_of(4104)), (8, 8, 4));
        assert_eq!((group_of(8192), group_of(14336), group_of(MAX_COLS)), (4, 2, 1));
    }

    #[test]
    fn bad_shapes_are_refused_by_name() {
        let ok = BatchGemv { rows: 16, cols: 64, vectors: 8 };
        assert!(ok.validate().is_ok());
        for (shape, needle) in [
            (BatchGemv { cols: 60, ..ok }, "cols 60"),
            (BatchGemv { cols: MAX_COLS + 8, ..ok }, "cols"),
            (BatchGemv { vectors: 9, ..ok }, "9 vectors"),
            (BatchGemv { vectors: 0, ..ok }, "0 vectors"),
            (BatchGemv { rows: 0, ..ok }, "rows 0"),
        ] {
            let e = shape.validate().unwrap_err().to_string();
            assert!(e.contains(needle), "{e}");
        }
    }

    #[test]
    fn the_cpu_check_sees_a_wrong_sum() {
        let shape = BatchGemv { rows: 4, cols: 8, vectors: 2 };
        let w: Vec<bf16> = (0..32).map(|i| bf16::from_f32(i as f32 / 8.0 - 2.0)).collect();
        let x: Vec<bf16> = (0..16).map(|i| bf16::from_f32(1.0 - i as f32 / 16.0)).collect();
        let mut y: Vec<f32> = (0..8)
            .map(|i| {
                let (b, r) = (i / 4, i % 4);
                (0..8).map(|c| w[r * 8 + c].to_f32() * x[b * 8 + c].to_f32()).sum()
            })
            .collect();
        let checked: Vec<_> = (0..4).map(|r| (r, w[r * 8..(r + 1) * 8].to_vec())).collect();
        assert!(cpu_rel_err(&checked, &x, &y, shape).unwrap() <= CPU_TOL);
        y[5] += 0.5;
        assert!(cpu_rel_err(&checked, &x, &y, shape).unwrap() > CPU_TOL);
        y[5] = f32::NAN;
        assert_eq!(cpu_rel_err(&checked, &x, &y, shape), None);
    }
}
