//! The DRAM-traffic audit against kernels whose traffic is known, on the GPU: CUPTI's range
//! profiler must count the bytes a read or copy stream moves, the CTAs a grid launches, ranges
//! pushed back to back without synchronisation, and nothing another context does meanwhile; and
//! what a range costs is measured. The activity and callback APIs run alongside, as in the grader.
//!
//! Before each measured range, a read of a scratch buffer several times the size of L2 leaves L2
//! holding clean scratch lines only, so a range's DRAM traffic is its own kernels'. Each check
//! enables its own audit, as the runner does once per process.

use std::time::Instant;

use cuda::cudarc::driver::{CudaContext, CudaSlice, CudaView};
use cuda::{Context, Device};
use half::bf16;

use super::{Check, CheckResult, Ctx, Failure, ensure};
use crate::audit::sampling::{self, DeviceSampler, SAMPLING_INTERVAL_NS};
use crate::audit::{AUDIT_METRICS, CTAS_LAUNCHED, DRAM_BYTES_READ, DRAM_BYTES_WRITE, RangeAudit, RangeValues};
use crate::bandwidth::{L2Eviction, StreamKernels};
use crate::cupti::{self as recording, Activity, ActivityKind, CallWindow, Recording, Tag};
use crate::run::Policy;

const MIB: usize = 1 << 20;
const GIB: usize = 1 << 30;
/// The read-only stream: far beyond L2 (50 MiB on an H200).
const READ_BYTES: usize = 2 * GIB;
/// Each buffer of the copy stream.
const COPY_BYTES: usize = GIB;
/// How close a range's DRAM bytes must come to the bytes its kernels move.
const BYTES_TOLERANCE: f64 = 0.02;
/// The scratch buffer that evicts L2 is this many times L2.
const EVICT_L2_TIMES: usize = 4;
/// The second grid of the CTA check: not a multiple of any SM count.
const ODD_GRID: u32 = 1000;
/// Each buffer of the CTA check.
const CTA_BYTES: usize = 256 * MIB;
/// Ranges pushed back to back; range `i` reads `(i + 1) * STEP_BYTES` with `(i + 1) * STEP_BLOCKS`
/// blocks, so each has its own bytes and its own CTA count.
const BACK_TO_BACK: usize = 8;
const STEP_BYTES: usize = 64 * MIB;
const STEP_BLOCKS: u32 = 64;
/// Repetitions of the overhead measurement, and the buffers of its copies.
const OVERHEAD_REPS: usize = 50;
const OVERHEAD_COPY_BYTES: usize = 64 * MIB;
/// The other context's copy inside the range: large enough to show if it were counted.
const OTHER_COPY_BYTES: usize = GIB;
/// Key of the random fill of the source buffers.
const FILL_KEY: u64 = 0xA0D1;

pub fn checks() -> Vec<Check> {
    vec![
        Check { name: "audit: a read stream's DRAM bytes", run: read_stream },
        Check { name: "audit: a copy's bytes read and written", run: copy_stream },
        Check { name: "audit: CTAs launched per range", run: ctas_per_range },
        Check { name: "audit: back-to-back ranges", run: back_to_back },
        Check { name: "audit: another context stays out", run: other_context },
        Check { name: "audit: overhead of a range", run: overhead },
        Check { name: "audit: the judge's PM sampling counts each window", run: sampled_windows },
        Check { name: "audit: the judge's sampling agrees with the runner's ranges, call by call", run: views_agree },
    ]
}

/// The stream kernels, an L2-sized scratch buffer and a sink for every grid the checks launch.
struct Bench<'a> {
    dev: &'a Device,
    kernels: StreamKernels,
    eviction: L2Eviction,
    sink: CudaSlice<u32>,
}

impl<'a> Bench<'a> {
    fn new(dev: &'a Device) -> Result<Bench<'a>, Failure> {
        let kernels = StreamKernels::load(dev)?;
        let eviction = L2Eviction::new(dev, EVICT_L2_TIMES)?;
        let blocks = [kernels.wave.grid_dim.0, ODD_GRID, BACK_TO_BACK as u32 * STEP_BLOCKS];
        let words = blocks.into_iter().max().unwrap_or_default() as usize;
        let sink = dev.stream().alloc_zeros::<u32>(words).context("allocating the sink")?;
        Ok(Bench { dev, kernels, eviction, sink })
    }

    /// `bytes` of random data (never measure on zeros).
    fn random(&self, bytes: usize) -> Result<CudaSlice<bf16>, Failure> {
        Ok(reference::gpu::data::fill_normal(self.dev, bytes / size_of::<bf16>(), FILL_KEY, 0.0, 1.0)?)
    }

    fn zeros(&self, bytes: usize) -> Result<CudaSlice<bf16>, Failure> {
        Ok(self.dev.stream().alloc_zeros::<bf16>(bytes / size_of::<bf16>()).context("allocating a buffer")?)
    }

    fn scratch_bytes(&self) -> usize {
        self.eviction.bytes()
    }

    /// Reads the scratch buffer and waits for it: afterwards L2 holds clean scratch lines only and
    /// the device is idle, as before the grader's synchronised calls.
    fn evict(&mut self) -> Result<(), Failure> {
        self.eviction.enqueue(self.dev)?;
        Ok(self.dev.synchronize()?)
    }

    fn read(&mut self, src: &CudaView<'_, bf16>, blocks: u32) -> Result<(), Failure> {
        Ok(self.kernels.read(self.dev, &mut self.sink, src, StreamKernels::grid(blocks))?)
    }

    fn copy(&self, dst: &mut CudaSlice<bf16>, src: &CudaSlice<bf16>, blocks: u32) -> Result<(), Failure> {
        Ok(self.kernels.copy(self.dev, dst, &src.as_view(), StreamKernels::grid(blocks))?)
    }

    fn wave(&self) -> u32 {
        self.kernels.wave.grid_dim.0
    }
}

/// The value of one of the [`AUDIT_METRICS`] in a range.
fn metric(range: &RangeValues, name: &str) -> f64 {
    range.values[AUDIT_METRICS.iter().position(|m| *m == name).expect("one of the audit metrics")]
}

fn within(seen: f64, expected: f64) -> bool {
    (seen / expected - 1.0).abs() <= BYTES_TOLERANCE
}

/// `seen` against `expected` bytes, e.g. `2.1475 GB (+0.12%)`.
fn gb(seen: f64, expected: f64) -> String {
    format!("{:.4} GB ({:+.2}%)", seen / 1e9, 100.0 * (seen / expected - 1.0))
}

/// Fails unless the range read `expected` bytes within the tolerance.
fn expect_read(range: &RangeValues, expected: usize) -> Result<(), Failure> {
    let read = metric(range, DRAM_BYTES_READ);
    ensure(within(read, expected as f64), || {
        format!("range {:?} read {} of DRAM for {expected} bytes streamed", range.name, gb(read, expected as f64))
    })
}

/// Thread blocks the activity records' kernels launched.
fn recorded_ctas(activities: &[Activity]) -> u64 {
    // The profiler's own kernel at a range boundary runs outside the range.
    let kernels = activities.iter().filter(|a| a.kind == ActivityKind::Kernel && a.name != "WaitNs");
    kernels.map(|k| k.grid.0 as u64 * k.grid.1 as u64 * k.grid.2 as u64).sum()
}

/// A read of [`READ_BYTES`] reads that many bytes from DRAM.
fn read_stream(ctx: &mut Ctx) -> CheckResult {
    let dev = &ctx.dev;
    let mut audit = RangeAudit::enable(dev.ctx(), &AUDIT_METRICS, 1)?;
    let mut bench = Bench::new(dev)?;
    let src = bench.random(READ_BYTES)?;
    bench.evict()?;
    audit.push("read")?;
    bench.read(&src.as_view(), bench.wave())?;
    audit.pop()?;
    let ranges = audit.finish()?;
    expect_read(&ranges[0], READ_BYTES)?;
    Ok(format!("{} read for {READ_BYTES} bytes streamed", gb(metric(&ranges[0], DRAM_BYTES_READ), READ_BYTES as f64)))
}

/// A copy of [`COPY_BYTES`] reads and writes that many bytes. The range ends with a scratch
/// read that evicts the copy's dirty lines, so their write-back falls inside the range too.
fn copy_stream(ctx: &mut Ctx) -> CheckResult {
    let dev = &ctx.dev;
    let mut audit = RangeAudit::enable(dev.ctx(), &AUDIT_METRICS, 1)?;
    let mut bench = Bench::new(dev)?;
    let src = bench.random(COPY_BYTES)?;
    let mut dst = bench.zeros(COPY_BYTES)?;
    bench.evict()?;
    audit.push("copy")?;
    bench.copy(&mut dst, &src, bench.wave())?;
    bench.evict()?;
    audit.pop()?;
    let ranges = audit.finish()?;
    let expected_read = COPY_BYTES + bench.scratch_bytes();
    expect_read(&ranges[0], expected_read)?;
    let written = metric(&ranges[0], DRAM_BYTES_WRITE);
    ensure(within(written, COPY_BYTES as f64), || {
        format!("the copy wrote {} of DRAM for {COPY_BYTES} bytes copied", gb(written, COPY_BYTES as f64))
    })?;
    Ok(format!(
        "read {} (copy + L2 flush), wrote {} for a {COPY_BYTES}-byte copy",
        gb(metric(&ranges[0], DRAM_BYTES_READ), expected_read as f64),
        gb(written, COPY_BYTES as f64)
    ))
}

/// Runs `work` in range `name` inside an activity recording, synchronised on both sides as the
/// grader's synchronised calls are; returns the activities recorded.
fn recorded(
    dev: &Device,
    audit: &mut RangeAudit,
    name: &str,
    work: impl FnOnce() -> Result<(), Failure>,
) -> Result<Vec<Activity>, Failure> {
    dev.synchronize()?;
    let recording = Recording::start()?;
    audit.push(name)?;
    work()?;
    audit.pop()?;
    dev.synchronize()?;
    Ok(recording.finish()?.activities)
}

/// `sm__ctas_launched.sum` is exactly the grid's block count, for two different grids, and
/// agrees with the activity records taken at the same time.
fn ctas_per_range(ctx: &mut Ctx) -> CheckResult {
    let dev = &ctx.dev;
    let mut audit = RangeAudit::enable(dev.ctx(), &AUDIT_METRICS, 2)?;
    let mut bench = Bench::new(dev)?;
    let src = bench.random(CTA_BYTES)?;
    let mut dst = bench.zeros(CTA_BYTES)?;
    let wave = bench.wave();
    let read = recorded(dev, &mut audit, "read", || bench.read(&src.as_view(), wave))?;
    let copy = recorded(dev, &mut audit, "copy", || bench.copy(&mut dst, &src, ODD_GRID))?;
    let ranges = audit.finish()?;
    let mut detail = Vec::new();
    for ((range, activities), grid) in ranges.iter().zip([read, copy]).zip([wave, ODD_GRID]) {
        let counted = metric(range, CTAS_LAUNCHED);
        let traced = recorded_ctas(&activities);
        ensure(counted == grid as f64 && traced == grid as u64, || {
            format!(
                "range {:?} launched {grid} CTAs: the counters saw {counted}, the activity records {traced}",
                range.name
            )
        })?;
        detail.push(format!("{}: {grid} CTAs launched, counted and recorded", range.name));
    }
    Ok(detail.join("; "))
}

/// Ranges pushed and popped back to back with no synchronisation between them come back in
/// order, each with its own bytes and CTAs, with the activity and callback APIs on throughout.
fn back_to_back(ctx: &mut Ctx) -> CheckResult {
    let dev = &ctx.dev;
    let mut audit = RangeAudit::enable(dev.ctx(), &AUDIT_METRICS, BACK_TO_BACK)?;
    let mut bench = Bench::new(dev)?;
    let steps: Vec<(usize, u32)> = (1..=BACK_TO_BACK).map(|k| (k * STEP_BYTES, k as u32 * STEP_BLOCKS)).collect();
    let total: usize = steps.iter().map(|(bytes, _)| bytes).sum();
    let src = bench.random(total)?;
    bench.evict()?;
    let recording = Recording::start()?;
    recording::set_current(Tag::Call(0));
    let start_ns = recording::timestamp()?;
    let mut offset = 0;
    for (i, &(bytes, blocks)) in steps.iter().enumerate() {
        let elements = bytes / size_of::<bf16>();
        audit.push(&format!("step {i}"))?;
        bench.read(&src.slice(offset..offset + elements), blocks)?;
        audit.pop()?;
        offset += elements;
    }
    dev.synchronize()?;
    let window = CallWindow { start_ns, end_ns: recording::timestamp()? };
    recording::set_current(Tag::Outside);
    let record = recording::record::attribute(
        recording.finish()?,
        &[window],
        recording::OwnWork::default(),
        |_| Vec::new(),
        Vec::new(),
    );
    let (activities, launches) = (&record.activities[0], record.api_launches[0]);
    let ranges = audit.finish()?;
    ensure(launches == BACK_TO_BACK, || format!("the callback API saw {launches} launches of {BACK_TO_BACK}"))?;
    let grids: Vec<u64> =
        activities.iter().filter(|a| a.kind == ActivityKind::Kernel).map(|k| k.grid.0 as u64).collect();
    let expected_grids: Vec<u64> = steps.iter().map(|&(_, blocks)| blocks as u64).collect();
    ensure(grids == expected_grids, || format!("the activity records show grids {grids:?}, not {expected_grids:?}"))?;
    for (i, (range, &(bytes, blocks))) in ranges.iter().zip(&steps).enumerate() {
        ensure(range.name == format!("step {i}"), || format!("range {i} came back as {:?}", range.name))?;
        expect_read(range, bytes)?;
        let ctas = metric(range, CTAS_LAUNCHED);
        ensure(ctas == blocks as f64, || format!("range {:?} counted {ctas} CTAs of {blocks}", range.name))?;
    }
    let worst = ranges
        .iter()
        .zip(&steps)
        .map(|(r, &(bytes, _))| (metric(r, DRAM_BYTES_READ) / bytes as f64 - 1.0).abs())
        .fold(0.0, f64::max);
    Ok(format!(
        "{BACK_TO_BACK} ranges in order, CTAs exact, bytes within {:.2}%; {launches} launches seen by the callback \
         API, {} kernels recorded",
        100.0 * worst,
        grids.len()
    ))
}

/// Work another context does while a range is open (as the judge's own reads and copies between
/// calls are, in its own process) stays out of the range's counters: contexts take turns on the
/// GPU, and the profiler counts its own context's turns only.
fn other_context(ctx: &mut Ctx) -> CheckResult {
    let dev = &ctx.dev;
    let mut audit = RangeAudit::enable(dev.ctx(), &AUDIT_METRICS, 1)?;
    let mut bench = Bench::new(dev)?;
    let src = bench.random(READ_BYTES)?;
    let other = CudaContext::new_non_primary(dev.facts().ordinal, 0).context("creating a second context")?;
    let other_stream = other.default_stream();
    let other_src = other_stream.alloc_zeros::<u8>(OTHER_COPY_BYTES).context("allocating in the second context")?;
    let mut other_dst = other_stream.alloc_zeros::<u8>(OTHER_COPY_BYTES).context("allocating in the second context")?;
    other_stream.synchronize().context("synchronising the second context")?;
    bench.evict()?;
    recorded(dev, &mut audit, "read, then another context's copy", || {
        bench.read(&src.as_view(), bench.wave())?;
        dev.synchronize()?;
        other_stream.memcpy_dtod(&other_src, &mut other_dst).context("copying in the second context")?;
        Ok(other_stream.synchronize().context("synchronising the second context")?)
    })?;
    let ranges = audit.finish()?;
    let read = metric(&ranges[0], DRAM_BYTES_READ);
    let seen = format!(
        "the range read {} with another context's {OTHER_COPY_BYTES}-byte copy inside it",
        gb(read, READ_BYTES as f64)
    );
    ensure(within(read, READ_BYTES as f64), || {
        format!(
            "{seen}: the counters include other contexts' traffic, so the judge must not touch the GPU while a range is open"
        )
    })?;
    Ok(seen)
}

/// What a range costs: empty push/pop pairs, and copies in ranges against the same copies
/// without, all back to back and timed on the host including the final synchronisation; and
/// whether merely enabling the profiler slows the copies down.
fn overhead(ctx: &mut Ctx) -> CheckResult {
    let dev = &ctx.dev;
    let bench = Bench::new(dev)?;
    let src = bench.random(OVERHEAD_COPY_BYTES)?;
    let mut dst = bench.zeros(OVERHEAD_COPY_BYTES)?;
    let wave = bench.wave();
    let timed = |f: &mut dyn FnMut(usize) -> Result<(), Failure>| -> Result<f64, Failure> {
        dev.synchronize()?;
        let start = Instant::now();
        for i in 0..OVERHEAD_REPS {
            f(i)?;
        }
        dev.synchronize()?;
        Ok(start.elapsed().as_secs_f64() * 1e6 / OVERHEAD_REPS as f64)
    };
    bench.copy(&mut dst, &src, wave)?; // warm-up
    let unprofiled_us = timed(&mut |_| bench.copy(&mut dst, &src, wave))?;
    let mut audit = RangeAudit::enable(dev.ctx(), &AUDIT_METRICS, 2 * OVERHEAD_REPS)?;
    let empty_us = timed(&mut |i| {
        audit.push(&format!("empty {i}"))?;
        Ok(audit.pop()?)
    })?;
    let plain_us = timed(&mut |_| bench.copy(&mut dst, &src, wave))?;
    let ranged_us = timed(&mut |i| {
        audit.push(&format!("copy {i}"))?;
        bench.copy(&mut dst, &src, wave)?;
        Ok(audit.pop()?)
    })?;
    let ranges = audit.finish()?;
    for range in ranges.iter().filter(|r| r.name.starts_with("copy")) {
        let ctas = metric(range, CTAS_LAUNCHED);
        ensure(ctas == wave as f64, || format!("range {:?} counted {ctas} CTAs of {wave}", range.name))?;
    }
    Ok(format!(
        "{:.1} us per range: a {plain_us:.1} us copy takes {ranged_us:.1} us in a range; empty push/pop \
         {empty_us:.1} us; the same copy took {unprofiled_us:.1} us before the profiler was enabled",
        ranged_us - plain_us
    ))
}

/// The judge's device-wide PM sampling, as `run::counters` uses it: two reads of known bytes and
/// grids, each in a window on CUPTI's clock with the device idle around it, sum to their bytes and
/// blocks; the idle time between them to nearly nothing.
fn sampled_windows(ctx: &mut Ctx) -> CheckResult {
    let dev = &ctx.dev;
    let mut sampler = DeviceSampler::start(dev.facts().ordinal, dev.ctx().cu_device(), &AUDIT_METRICS)?;
    let mut bench = Bench::new(dev)?;
    let src = bench.random(READ_BYTES)?;
    let idle = std::time::Duration::from_nanos(5 * SAMPLING_INTERVAL_NS);
    // (bytes, blocks, start ns, end ns) of each window.
    let mut windows = Vec::new();
    for (bytes, blocks) in [(READ_BYTES, bench.wave()), (READ_BYTES / 2, ODD_GRID)] {
        bench.evict()?;
        std::thread::sleep(idle);
        let start = sampling::now_ns()?;
        bench.read(&src.slice(..bytes / size_of::<bf16>()), blocks)?;
        dev.synchronize()?;
        let end = sampling::now_ns()?;
        std::thread::sleep(idle);
        windows.push((bytes, blocks, start, end));
        sampler.drain(Some(0))?;
    }
    let samples = sampler.finish(Some(0))?;
    let first = samples.first().map_or(0, |s| s.start_ns);
    let last = samples.last().map_or(0, |s| s.end_ns);
    let read = AUDIT_METRICS.iter().position(|m| *m == DRAM_BYTES_READ).expect("audited");
    let ctas = AUDIT_METRICS.iter().position(|m| *m == CTAS_LAUNCHED).expect("audited");
    let mut said = vec![format!(
        "{} samples over {}..{} ns on CUPTI's clock; windows {:?}",
        samples.len(),
        first,
        last,
        windows.iter().map(|w| (w.2, w.3)).collect::<Vec<_>>()
    )];
    for &(bytes, blocks, start, end) in &windows {
        let (got, covering) = sampling::window_sum(&samples, start, end, read);
        let (launched, _) = sampling::window_sum(&samples, start, end, ctas);
        said.push(format!(
            "window of {} us: {} in {covering} samples, {launched} blocks for {blocks}",
            (end - start) / 1000,
            gb(got, bytes as f64)
        ));
        ensure(within(got, bytes as f64) && launched == f64::from(blocks), || said.join("; "))?;
    }
    Ok(said.join("; "))
}

/// How far the judge's sampling and the runner's range profiler may differ over one call.
const VIEWS_AGREE: f64 = 0.02;

/// The judge's PM sampling against the runner's range profiler (the figures the grader judged by
/// before; the hardware takes one client, so they cannot run beside each other): the megakernel's
/// calls in two runs, once under each, at graded, at a family member and over a stack. Every call
/// run alone and every back-to-back batch reads the same bytes by both, within [`VIEWS_AGREE`].
fn views_agree(ctx: &mut Ctx) -> CheckResult {
    let family = spec::family::find("llama-3.2-1b").expect("a family member").config();
    let stack = spec::Config { name: "small-x4".into(), layers: 4, ..spec::Config::small() };
    let chosen = super::named("megakernel");
    let mut said = Vec::new();
    for cfg in [spec::Config::graded(), family, stack] {
        let by_judge = super::judged_with(ctx, &chosen, &cfg, Policy { no_audit: false }, None)?;
        let by_runner = super::judged_with(ctx, &chosen, &cfg, Policy { no_audit: true }, None)?;
        let (Some(judge), Some(runner)) = (by_judge.audit.as_ref(), by_runner.runner_audit.as_ref()) else {
            return Err(Failure(format!("{}: a run ended without its audits", cfg.name)));
        };
        ensure(judge.measured() && runner.measured(), || {
            format!("{}: the judge's {:?}, the runner's {:?}", cfg.name, judge.coverage, runner.coverage)
        })?;
        let singles = judge.calls.iter().zip(&runner.calls).enumerate();
        let mut pairs: Vec<(String, f64, f64)> = singles
            .filter_map(|(i, (j, r))| Some((format!("call {i}"), j.as_ref()?.bytes_read, r.as_ref()?.bytes_read)))
            .collect();
        pairs.extend(judge.batches.iter().zip(&runner.batches).map(|(j, r)| {
            (format!("calls {}..{}", j.first, j.first + j.count), j.counters.bytes_read, r.counters.bytes_read)
        }));
        let off = |&(_, j, r): &(String, f64, f64)| (r - j).abs() / j.max(1.0);
        let Some(worst) = pairs.iter().max_by(|a, b| off(a).total_cmp(&off(b))) else {
            return Err(Failure(format!("{}: no call measured by both views", cfg.name)));
        };
        let line = format!(
            "{}: {} commands, worst {:.2}% apart ({}: the judge's {:.4} GB, the runner's {:.4} GB)",
            cfg.name,
            pairs.len(),
            off(worst) * 100.0,
            worst.0,
            worst.1 / 1e9,
            worst.2 / 1e9
        );
        ensure(off(worst) <= VIEWS_AGREE, || line.clone())?;
        said.push(line);
    }
    Ok(said.join("; "))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Check (a) alone, for quick runs on a GPU machine:
    /// `cargo test --release -p grader read_stream_bytes -- --ignored --nocapture`.
    #[test]
    #[ignore = "needs an NVIDIA GPU with accessible hardware counters and CUPTI"]
    fn audit_counts_read_stream_bytes_on_the_gpu() {
        let mut ctx = Ctx { dev: Device::open(0).expect("a GPU"), seed: spec::DEFAULT_SEED };
        match read_stream(&mut ctx) {
            Ok(detail) => eprintln!("{detail}"),
            Err(Failure(why)) => panic!("{why}"),
        }
    }
}
