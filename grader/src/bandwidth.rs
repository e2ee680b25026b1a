//! HBM bandwidth, the denominator of the roofline floor: a 16-byte stream copy (bytes read plus bytes
//! written), the driver's device-to-device copy as a cross-check, and the read-only ceiling that judges
//! a timing plausible: a 16-byte read stream and, on Hopper, a read by bulk copies into shared memory
//! (the way the megakernel streams weights), the faster of the two. All over buffers far larger than L2,
//! warmed up and repeated.

use std::sync::Arc;

use cuda::cudarc::driver::{CudaFunction, CudaSlice, CudaStream, CudaView, DeviceSlice, LaunchConfig, PushKernelArg};
use cuda::{Context, CudaError, Device};
use half::bf16;
use serde::Serialize;

use crate::cli::BandwidthArgs;
use crate::error::{GraderError, Outcome};
use crate::kernels::BANDWIDTH;
use crate::stats::Summary;

/// Threads per block of the stream kernels.
const STREAM_BLOCK: u32 = 512;
/// Untimed repetitions before timing.
const WARMUP: usize = 3;
/// The driver's copy may differ from the kernel's by this much before the report warns.
const AGREEMENT: f64 = 0.10;

#[derive(Debug, Clone, Serialize)]
pub struct Bandwidth {
    /// Bytes of each of the two buffers.
    pub buffer_bytes: u64,
    /// The 16-byte copy kernel, TB/s counting bytes read plus bytes written.
    pub copy_tbps: Summary,
    /// The read-only stream of 16-byte loads, TB/s of bytes read.
    pub read_tbps: Summary,
    /// The read-only stream by bulk copies into shared memory, TB/s of bytes read (Hopper only).
    pub read_bulk_tbps: Option<Summary>,
    /// The read-only ceiling: the faster of the two reads' medians, so that a read slower than what
    /// honest code reaches can never make the plausibility bound fail honest work.
    pub read_ceiling_tbps: f64,
    /// The driver's device-to-device copy, TB/s counting read plus written.
    pub driver_copy_tbps: Summary,
    /// The floor's denominator: the faster of the two copies' medians, so a slow copy can never make
    /// the floor lenient.
    pub floor_tbps: f64,
}

impl Bandwidth {
    /// The copy bandwidth in bytes per second that the floor divides by.
    pub fn floor_bytes_per_s(&self) -> f64 {
        self.floor_tbps * 1e12
    }

    /// Relative difference of the driver's copy from the kernel's.
    pub fn driver_disagreement(&self) -> f64 {
        (self.driver_copy_tbps.median / self.copy_tbps.median - 1.0).abs()
    }
}

/// Measures the three streams over two buffers of `buffer_bytes` each.
pub fn measure(dev: &Device, buffer_bytes: u64, reps: usize) -> Result<Bandwidth, CudaError> {
    let vectors = (buffer_bytes / 16) as usize;
    let bytes = vectors as u64 * 16;
    dev.require_free(2 * bytes + (64 << 20), "the bandwidth buffers")?;
    // Random source data: never measure on zeros.
    let src = reference::gpu::data::fill_normal(dev, vectors * 8, 0xB4_4D, 0.0, 1.0)?;
    // SAFETY: written by the first copy before anything reads it.
    let mut dst = unsafe { dev.stream().alloc::<bf16>(vectors * 8) }.context("allocating the copy destination")?;
    let kernels = StreamKernels::load(dev)?;
    let cfg = kernels.wave;
    let mut sink = dev.stream().alloc_zeros::<u32>(cfg.grid_dim.0 as usize).context("allocating the sink")?;

    let copy_tbps = timed(dev, reps, 2 * bytes, || kernels.copy(dev, &mut dst, &src.as_view(), cfg))?;
    check_copy(dev, &src, &dst)?;
    let read_tbps = timed(dev, reps, bytes, || kernels.read(dev, &mut sink, &src.as_view(), cfg))?;
    // One block per SM: the wave's sink has room for them.
    let read_bulk_tbps = match cuda::kernels::read_bulk(dev)? {
        Some((func, bulk)) => Some(timed(dev, reps, bytes, || read_bulk(dev, &func, bulk, &mut sink, &src.as_view()))?),
        None => None,
    };
    let read_ceiling_tbps = read_tbps.median.max(read_bulk_tbps.as_ref().map_or(0.0, |s| s.median));
    let driver_copy_tbps = timed(dev, reps, 2 * bytes, || {
        dev.stream().memcpy_dtod(&src, &mut dst).context("driver device-to-device copy")
    })?;
    let floor_tbps = copy_tbps.median.max(driver_copy_tbps.median);
    Ok(Bandwidth {
        buffer_bytes: bytes,
        copy_tbps,
        read_tbps,
        read_bulk_tbps,
        read_ceiling_tbps,
        driver_copy_tbps,
        floor_tbps,
    })
}

/// Enqueues `read_bulk` (`func`, launched as `cfg`, both from `cuda::kernels::read_bulk`) over all of
/// `src` (a whole number of 16-byte vectors), one word per block of `sink`.
pub fn read_bulk<T>(
    dev: &Device,
    func: &CudaFunction,
    cfg: LaunchConfig,
    sink: &mut CudaSlice<u32>,
    src: &CudaView<'_, T>,
) -> Result<(), CudaError> {
    let n = vector_count(src.num_bytes());
    assert!(sink.len() >= cfg.grid_dim.0 as usize, "read_bulk: the sink has fewer words than the grid has blocks");
    let mut b = dev.stream().launch_builder(func);
    b.arg(sink).arg(src).arg(&n);
    // SAFETY: read_bulk(sink, src, n): src holds n 16-byte vectors, sink one word per block (asserted);
    // cfg and the raised shared memory limit are cuda::kernels::read_bulk's.
    unsafe { b.launch(cfg) }.map(drop).context("launching read_bulk")
}

/// The two stream kernels of kernels/grader/bandwidth.cu, and the launch shape that fills the card once.
pub struct StreamKernels {
    copy: CudaFunction,
    read: CudaFunction,
    /// One wave of resident [`STREAM_BLOCK`]-thread blocks: a second, partial wave would leave SMs
    /// idle at the end.
    pub wave: LaunchConfig,
}

/// The stream kernels move 16-byte vectors.
const VECTOR_BYTES: usize = 16;

impl StreamKernels {
    pub fn load(dev: &Device) -> Result<StreamKernels, CudaError> {
        let copy = dev.function(&BANDWIDTH, "copy_u4")?;
        let read = dev.function(&BANDWIDTH, "read_u4")?;
        let resident =
            copy.occupancy_max_active_blocks_per_multiprocessor(STREAM_BLOCK, 0, None).context("reading occupancy")?;
        let wave = LaunchConfig {
            grid_dim: (resident * dev.facts().sms as u32, 1, 1),
            block_dim: (STREAM_BLOCK, 1, 1),
            shared_mem_bytes: 0,
        };
        Ok(StreamKernels { copy, read, wave })
    }

    /// A launch of `blocks` [`STREAM_BLOCK`]-thread blocks.
    pub fn grid(blocks: u32) -> LaunchConfig {
        LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (STREAM_BLOCK, 1, 1), shared_mem_bytes: 0 }
    }

    /// Enqueues `dst = src` (all of `src`, a whole number of 16-byte vectors) on the device's stream.
    pub fn copy<T>(
        &self,
        dev: &Device,
        dst: &mut CudaSlice<T>,
        src: &CudaView<'_, T>,
        cfg: LaunchConfig,
    ) -> Result<(), CudaError> {
        let n = vector_count(src.num_bytes());
        assert!(dst.num_bytes() >= src.num_bytes(), "copy_u4: the destination is smaller than the source");
        let mut b = dev.stream().launch_builder(&self.copy);
        b.arg(dst).arg(src).arg(&n);
        // SAFETY: copy_u4(dst, src, n): both buffers hold at least n 16-byte vectors (asserted).
        unsafe { b.launch(cfg) }.map(drop).context("launching copy_u4")
    }

    /// Enqueues a read of all of `src` (a whole number of 16-byte vectors) on the device's stream,
    /// folded into one word per block of `sink`.
    pub fn read<T>(
        &self,
        dev: &Device,
        sink: &mut CudaSlice<u32>,
        src: &CudaView<'_, T>,
        cfg: LaunchConfig,
    ) -> Result<(), CudaError> {
        self.read_on(dev.stream(), sink, src, cfg)
    }

    /// [`StreamKernels::read`] on `stream`.
    pub fn read_on<T>(
        &self,
        stream: &Arc<CudaStream>,
        sink: &mut CudaSlice<u32>,
        src: &CudaView<'_, T>,
        cfg: LaunchConfig,
    ) -> Result<(), CudaError> {
        let n = vector_count(src.num_bytes());
        assert!(sink.len() >= cfg.grid_dim.0 as usize, "read_u4: the sink has fewer words than the grid has blocks");
        let mut b = stream.launch_builder(&self.read);
        b.arg(sink).arg(src).arg(&n);
        // SAFETY: read_u4(sink, src, n): src holds n 16-byte vectors, sink one word per block
        // (asserted).
        unsafe { b.launch(cfg) }.map(drop).context("launching read_u4")
    }
}

/// Evicts everything L2 holds by reading a buffer several times its size: reading (not writing)
/// leaves clean lines, so no write-back of the eviction spills into the work that follows.
pub struct L2Eviction {
    kernels: StreamKernels,
    buffer: CudaSlice<u8>,
    sink: CudaSlice<u32>,
}

impl L2Eviction {
    /// A buffer of `l2_multiple` times the device's L2.
    pub fn new(dev: &Device, l2_multiple: usize) -> Result<L2Eviction, CudaError> {
        let kernels = StreamKernels::load(dev)?;
        let bytes = (l2_multiple * dev.facts().l2_bytes.max(1) as usize).next_multiple_of(VECTOR_BYTES);
        let buffer = dev.stream().alloc_zeros::<u8>(bytes).context("allocating the L2 eviction buffer")?;
        let sink = dev.stream().alloc_zeros::<u32>(kernels.wave.grid_dim.0 as usize).context("allocating a sink")?;
        Ok(L2Eviction { kernels, buffer, sink })
    }

    /// Bytes the eviction reads.
    pub fn bytes(&self) -> usize {
        self.buffer.num_bytes()
    }

    /// Enqueues the eviction on the device's stream.
    pub fn enqueue(&mut self, dev: &Device) -> Result<(), CudaError> {
        let wave = self.kernels.wave;
        self.kernels.read(dev, &mut self.sink, &self.buffer.as_view(), wave)
    }
}

/// 16-byte vectors in `bytes`, which must be a whole number of them.
fn vector_count(bytes: usize) -> u64 {
    assert!(bytes.is_multiple_of(VECTOR_BYTES), "the stream kernels move whole 16-byte vectors; {bytes} bytes is not");
    (bytes / VECTOR_BYTES) as u64
}

/// TB/s of `reps` timed runs of `f` after [`WARMUP`] untimed ones, each moving `bytes`.
pub fn timed(
    dev: &Device,
    reps: usize,
    bytes: u64,
    mut f: impl FnMut() -> Result<(), CudaError>,
) -> Result<Summary, CudaError> {
    for _ in 0..WARMUP {
        f()?;
    }
    let mut tbps = Vec::with_capacity(reps);
    for _ in 0..reps {
        let ms = dev.time_ms(&mut f)? as f64;
        tbps.push(bytes as f64 / (ms * 1e-3) / 1e12);
    }
    Ok(Summary::of(&tbps).expect("event timings are finite"))
}

/// The copy must have copied: compare the first and last MiB of the two buffers.
fn check_copy(dev: &Device, src: &CudaSlice<bf16>, dst: &CudaSlice<bf16>) -> Result<(), CudaError> {
    let window = (1 << 19).min(src.len());
    for start in [0, src.len() - window] {
        let a = dev.stream().clone_dtoh(&src.slice(start..start + window)).context("reading the copy source")?;
        let b = dev.stream().clone_dtoh(&dst.slice(start..start + window)).context("reading the copy")?;
        if a.iter().zip(&b).any(|(x, y)| x.to_bits() != y.to_bits()) {
            return Err(CudaError::WrongResult(format!("copy_u4 did not copy elements {start}..{}", start + window)));
        }
    }
    Ok(())
}

pub fn command(device: usize, args: &BandwidthArgs) -> Result<Outcome, GraderError> {
    if let Some(path) = &args.json {
        crate::preflight::output_file("--json", path)?;
    }
    let dev = Device::open(device)?;
    let f = dev.facts();
    eprintln!(
        "grader: {} ({} SMs, L2 {} MiB), measuring {:.2} GiB buffers x {} reps",
        f.name,
        f.sms,
        f.l2_bytes >> 20,
        args.gib,
        args.reps
    );
    let bw = measure(&dev, (args.gib * (1u64 << 30) as f64) as u64, args.reps as usize)?;
    eprintln!("{}", table(&bw));
    if bw.driver_disagreement() > AGREEMENT {
        eprintln!(
            "Warn: the driver's copy ({:.3} TB/s) differs from the copy kernel ({:.3} TB/s) by {:.0}%",
            bw.driver_copy_tbps.median,
            bw.copy_tbps.median,
            100.0 * bw.driver_disagreement()
        );
    }
    if let Some(path) = &args.json {
        crate::output::write_output(path, &(serde_json::to_string_pretty(&bw).expect("serialises") + "\n"))?;
    }
    Ok(Outcome::Pass)
}

/// The human table: one row per stream.
pub fn table(bw: &Bandwidth) -> String {
    let mut s = format!("{:<28} {:>8} {:>8} {:>8} {:>8}\n", "stream (TB/s)", "median", "p10", "p90", "spread");
    let rows = [
        ("copy kernel, read + write", Some(&bw.copy_tbps)),
        ("driver copy, read + write", Some(&bw.driver_copy_tbps)),
        ("read-only kernel", Some(&bw.read_tbps)),
        ("read-only, bulk copies", bw.read_bulk_tbps.as_ref()),
    ];
    for (name, sum) in rows.into_iter().filter_map(|(n, s)| Some((n, s?))) {
        s += &format!(
            "{name:<28} {:>8.3} {:>8.3} {:>8.3} {:>7.1}%\n",
            sum.median,
            sum.p10,
            sum.p90,
            100.0 * sum.spread()
        );
    }
    s + &format!(
        "floor bandwidth (faster copy): {:.3} TB/s\nread-only ceiling (faster read): {:.3} TB/s\n",
        bw.floor_tbps, bw.read_ceiling_tbps
    )
}
