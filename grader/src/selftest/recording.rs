//! The launch record on the GPU: both CUPTI views (the GPU's activity records and the host's API
//! callbacks) agree on a mix of kernels, a copy, a set, a side stream and a CUDA graph; switching
//! the activity view off behind the recording's back is found; and what recording costs per launch.

use std::time::Instant;

use cuda::cudarc::cupti::sys as cupti_sys;
use cuda::cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use cuda::{Context, Device};

use super::{Check, CheckResult, Ctx, Failure, ensure};
use crate::bandwidth::StreamKernels;
use crate::cupti::{self, CallWindow, Record, Recording, Tag};

/// Bytes each test kernel reads: small, so launch costs dominate the overhead check.
const SMALL_BYTES: usize = 1 << 20;
/// Launches timed with and without the recording.
const OVERHEAD_LAUNCHES: usize = 400;
/// Kernels captured into the graph.
const GRAPH_NODES: usize = 3;

pub fn checks() -> Vec<Check> {
    vec![
        Check { name: "recording: both views agree on a launch mix", run: launch_mix },
        Check { name: "recording: activity switched off is found", run: switched_off },
        Check { name: "recording: cost per launch", run: overhead },
    ]
}

/// The read kernel, a buffer to read and a sink, on the device's stream.
struct Work {
    kernels: StreamKernels,
    src: cuda::cudarc::driver::CudaSlice<u8>,
    sink: cuda::cudarc::driver::CudaSlice<u32>,
}

impl Work {
    fn new(dev: &Device) -> Result<Work, Failure> {
        let kernels = StreamKernels::load(dev)?;
        let src = reference::gpu::data::fill_normal(dev, SMALL_BYTES / 2, 0x5EC0, 0.0, 1.0)?;
        // SAFETY: the bf16 buffer is reinterpreted as its bytes, same length in bytes.
        let src = unsafe { dev.stream().upgrade_device_ptr::<u8>(src.leak(), SMALL_BYTES) };
        let sink = dev.stream().alloc_zeros::<u32>(kernels.wave.grid_dim.0 as usize).context("allocating a sink")?;
        Ok(Work { kernels, src, sink })
    }

    fn read(&mut self, dev: &Device) -> Result<(), Failure> {
        Ok(self.kernels.read(dev, &mut self.sink, &self.src.as_view(), StreamKernels::grid(8))?)
    }
}

/// Runs `body` as call 0 of a recording and attributes what it recorded.
fn recorded(dev: &Device, body: impl FnOnce() -> Result<(), Failure>) -> Result<Record, Failure> {
    dev.synchronize()?;
    let recording = Recording::start()?;
    cupti::set_current(Tag::Call(0));
    let start_ns = cupti::timestamp()?;
    let outcome = body();
    dev.synchronize()?;
    let window = CallWindow { start_ns, end_ns: cupti::timestamp()? };
    cupti::set_current(Tag::Outside);
    let record =
        cupti::record::attribute(recording.finish()?, &[window], cupti::OwnWork::default(), |_| Vec::new(), Vec::new());
    outcome.map(|()| record)
}

fn launch_mix(ctx: &mut Ctx) -> CheckResult {
    let dev = &ctx.dev;
    let mut work = Work::new(dev)?;
    let side = dev.ctx().new_stream().context("creating a side stream")?;
    let capture = dev.ctx().new_stream().context("creating a capture stream")?;
    let mut copy = dev.stream().alloc_zeros::<u8>(SMALL_BYTES).context("allocating a copy")?;
    // A graph of GRAPH_NODES reads, captured before the recording starts.
    capture.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL).context("capturing")?;
    for _ in 0..GRAPH_NODES {
        work.kernels.read_on(&capture, &mut work.sink, &work.src.as_view(), StreamKernels::grid(8))?;
    }
    let graph = capture
        .end_capture(CUgraphInstantiate_flags(0))
        .context("capturing")?
        .ok_or_else(|| Failure("the capture made no graph".into()))?;
    let record = recorded(dev, || {
        work.read(dev)?;
        work.read(dev)?;
        dev.stream().memcpy_dtod(&work.src, &mut copy).context("copying")?;
        dev.stream().memset_zeros(&mut copy).context("setting")?;
        work.kernels.read_on(&side, &mut work.sink, &work.src.as_view(), StreamKernels::grid(8))?;
        graph.launch().context("launching the graph")?;
        Ok(())
    })?;
    let c = &record.calls[0];
    ensure(record.problems.is_empty(), || format!("an honest mix shows problems: {}", record.problems.join("; ")))?;
    let kernels = 3 + GRAPH_NODES;
    ensure(c.kernels == kernels && c.graph_kernels == GRAPH_NODES && c.memcpys == 1 && c.memsets == 1, || {
        format!(
            "recorded {} kernels ({} from the graph), {} copies, {} sets; expected {kernels} ({GRAPH_NODES}), 1, 1",
            c.kernels, c.graph_kernels, c.memcpys, c.memsets
        )
    })?;
    Ok(format!(
        "{} kernels ({} graph nodes, 1 on a side stream), 1 copy, 1 set: every record tied to an API call, {} \
         launches seen by the callbacks",
        c.kernels, c.graph_kernels, record.api_launches[0]
    ))
}

/// A kernel launched while the activity view is off leaves a launch with no record.
fn switched_off(ctx: &mut Ctx) -> CheckResult {
    let dev = &ctx.dev;
    let mut work = Work::new(dev)?;
    let kind = cupti_sys::CUpti_ActivityKind::CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL;
    let record = recorded(dev, || {
        work.read(dev)?;
        // SAFETY: switches one activity kind off and on again, as a submission could.
        unsafe { cupti_sys::cuptiActivityDisable(kind) };
        work.read(dev)?;
        dev.synchronize()?;
        // SAFETY: as above.
        unsafe { cupti_sys::cuptiActivityEnable(kind) };
        Ok(())
    })?;
    let found = record.problems.iter().find(|p| p.contains("left no GPU record"));
    ensure(found.is_some(), || format!("not found; the record shows: {:?}", record.problems))?;
    Ok(found.cloned().unwrap_or_default())
}

/// Host time per launch with the recording on, against the same launches without it.
fn overhead(ctx: &mut Ctx) -> CheckResult {
    let dev = &ctx.dev;
    let mut work = Work::new(dev)?;
    let timed = |work: &mut Work| -> Result<f64, Failure> {
        dev.synchronize()?;
        let t = Instant::now();
        for _ in 0..OVERHEAD_LAUNCHES {
            work.read(dev)?;
        }
        dev.synchronize()?;
        Ok(t.elapsed().as_secs_f64() * 1e6 / OVERHEAD_LAUNCHES as f64)
    };
    timed(&mut work)?; // warm-up
    let plain = timed(&mut work)?;
    let mut on = 0.0;
    let record = recorded(dev, || {
        on = timed(&mut work)?;
        Ok(())
    })?;
    ensure(record.calls[0].kernels == OVERHEAD_LAUNCHES, || {
        format!("recorded {} of {OVERHEAD_LAUNCHES} launches", record.calls[0].kernels)
    })?;
    Ok(format!(
        "{:.2} us per launch recorded vs {plain:.2} us without: {:+.2} us per launch ({OVERHEAD_LAUNCHES} launches)",
        on,
        on - plain
    ))
}
