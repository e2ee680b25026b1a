//! `grader run`: judges one submission end to end, as DESIGN.md's eight steps: device facts,
//! measured bandwidth, seeded data, untimed build, inputs from a fresh secret seed, the calls of
//! every phase (each output in its own buffer), the reference's replay of the very same calls, and
//! the gates.

mod check;
mod dump;
pub mod report;
pub mod verdict;

use std::time::Instant;

use cuda::cudarc::driver::CudaSlice;
use cuda::{Context, CudaError, Device, DeviceFacts};
use half::bf16;
use reference::gpu::data::{bytes_needed, generate_input};
use reference::gpu::{DeviceCache, DeviceWeights, Eager};
use spec::{ByteModel, Config, Gates};
use submission::{Layer, Submission};

use crate::bandwidth::{self, Bandwidth};
use crate::cli::SubmissionArgs;
use crate::cupti::{Recorder, StepLaunches};
use crate::error::{GraderError, Outcome};
use crate::metrics::to_f32;
use crate::stats::Summary;
use report::{Performance, Report, Seeds};
use verdict::{Call, Phase, StepCheck};

/// Bandwidth buffers of a run: 2 GiB each is 34x the H200's L2; 20 repetitions keep the median's
/// spread under a percent (1 GiB x 10 moved the floor by 1-2% between runs).
const RUN_BANDWIDTH_BYTES: u64 = 2 << 30;
const RUN_BANDWIDTH_REPS: usize = 20;

/// Progress lines on stderr for every stage that takes more than a moment.
pub struct Progress {
    quiet: bool,
    start: Instant,
}

impl Progress {
    pub fn new(quiet: bool) -> Self {
        Self { quiet, start: Instant::now() }
    }

    pub fn say(&self, what: &str) {
        if !self.quiet {
            eprintln!("[{:>6.2}s] {what}", self.start.elapsed().as_secs_f64());
        }
    }
}

pub fn command(device: usize, args: &SubmissionArgs) -> Result<Outcome, GraderError> {
    let cfg = Config::load(&args.config.config)?;
    let mut sub = submission::builtin(&args.submission)?;
    let dev = Device::open(device)?;
    let progress = Progress::new(args.quiet);
    let seeds = Seeds { weights: args.seed, inputs: rand::random() };
    let report = judge(&dev, sub.as_mut(), &cfg, seeds, &progress, args.dump.as_deref())?;
    eprint!("{}", if args.quiet { report.verdict_line() } else { report.table() });
    let json = serde_json::to_string_pretty(&report).expect("the report serialises") + "\n";
    match &args.json {
        Some(path) => crate::write_output(path, &json)?,
        None => print!("{json}"),
    }
    Ok(if report.verdict.passed { Outcome::Pass } else { Outcome::Fail })
}

/// Everything the submission touches, and the judge's own copies it never sees.
struct RunData {
    weights: DeviceWeights,
    cache: DeviceCache,
    inputs: Vec<CudaSlice<bf16>>,
    outputs: Vec<CudaSlice<bf16>>,
    pristine: DeviceWeights,
    judge_cache: DeviceCache,
    judge_inputs: Vec<CudaSlice<bf16>>,
    judge_outputs: Vec<CudaSlice<bf16>>,
}

impl RunData {
    fn generate(dev: &Device, cfg: &Config, seeds: &Seeds, calls: usize) -> Result<Self, CudaError> {
        // Two copies of everything: the submission's and the judge's.
        dev.require_free(2 * bytes_needed(cfg, calls), "the run's weights, caches, inputs and outputs")?;
        let inputs = |dev| (0..calls).map(|c| generate_input(dev, cfg, seeds.inputs, c)).collect::<Result<Vec<_>, _>>();
        Ok(Self {
            weights: reference::gpu::generate_weights(dev, cfg, seeds.weights)?,
            cache: DeviceCache::generate(dev, cfg, seeds.weights)?,
            inputs: inputs(dev)?,
            outputs: poisoned_outputs(dev, cfg, calls)?,
            pristine: reference::gpu::generate_weights(dev, cfg, seeds.weights)?,
            judge_cache: DeviceCache::generate(dev, cfg, seeds.weights)?,
            judge_inputs: inputs(dev)?,
            judge_outputs: poisoned_outputs(dev, cfg, calls)?,
        })
    }
}

/// One output buffer per call, full of NaN: an output never written cannot pass.
fn poisoned_outputs(dev: &Device, cfg: &Config, calls: usize) -> Result<Vec<CudaSlice<bf16>>, CudaError> {
    let nan = vec![bf16::NAN; cfg.batch * cfg.d];
    (0..calls).map(|_| dev.stream().clone_htod(&nan).context("allocating an output")).collect()
}

/// What the calls of one side (the submission or the reference) measured.
#[derive(Default)]
struct Measured {
    step_us: Vec<f64>,
    throughput_us_per_call: f64,
    launches: Vec<StepLaunches>,
}

/// Runs every call of `calls` through `step`, phase by phase, timing and profiling as each phase says.
fn drive(
    dev: &Device,
    calls: &[Call],
    progress: &Progress,
    who: &str,
    mut step: impl FnMut(&Call) -> Result<(), GraderError>,
) -> Result<Measured, GraderError> {
    let mut m = Measured::default();
    for phase in calls.chunk_by(|a, b| a.phase == b.phase) {
        progress.say(&format!("{who}: {} {:?} steps", phase.len(), phase[0].phase));
        match phase[0].phase {
            Phase::Correctness => {
                for call in phase {
                    step(call)?;
                    dev.synchronize()?;
                }
            }
            Phase::Timed => {
                for call in phase {
                    // Device-wide synchronisation on both sides: work left on any stream is counted.
                    dev.synchronize()?;
                    let t = Instant::now();
                    step(call)?;
                    dev.synchronize()?;
                    m.step_us.push(t.elapsed().as_secs_f64() * 1e6);
                }
            }
            Phase::Throughput => {
                dev.synchronize()?;
                let t = Instant::now();
                for call in phase {
                    step(call)?;
                }
                dev.synchronize()?;
                m.throughput_us_per_call = t.elapsed().as_secs_f64() * 1e6 / phase.len() as f64;
            }
            Phase::Profiled => {
                for call in phase {
                    dev.synchronize()?;
                    let recorder = Recorder::start()?;
                    step(call)?;
                    dev.synchronize()?;
                    m.launches.push(StepLaunches::of(&recorder.stop()?));
                }
            }
        }
    }
    Ok(m)
}

/// The whole judgement of one submission.
pub fn judge(
    dev: &Device,
    sub: &mut dyn Submission,
    cfg: &Config,
    seeds: Seeds,
    progress: &Progress,
    dump_dir: Option<&std::path::Path>,
) -> Result<Report, GraderError> {
    let facts: DeviceFacts = dev.facts().clone();
    progress.say(&format!("{} ({} SMs), config '{}', submission '{}'", facts.name, facts.sms, cfg.name, sub.name()));
    progress.say("measuring the copy bandwidth (the floor's denominator)");
    let bw: Bandwidth = bandwidth::measure(dev, RUN_BANDWIDTH_BYTES, RUN_BANDWIDTH_REPS)?;
    let calls = verdict::schedule(cfg);
    progress.say(&format!("generating weights, KV prefix and {} inputs on the GPU", calls.len()));
    let mut d = RunData::generate(dev, cfg, &seeds, calls.len())?;
    dev.synchronize()?;

    progress.say("build_layer (untimed)");
    let t = Instant::now();
    sub.build_layer(dev, Layer { weights: &d.weights, cache: &mut d.cache }, cfg)?;
    dev.synchronize()?;
    let build_s = t.elapsed().as_secs_f64();

    let name = sub.name().to_string();
    let mine = drive(dev, &calls, progress, &name, |c| {
        let layer = Layer { weights: &d.weights, cache: &mut d.cache };
        sub.layer_step(dev, layer, &d.inputs[c.index], c.pos, &mut d.outputs[c.index])?;
        Ok(())
    })?;
    sub.teardown();

    // The reference replays the very same calls on the judge's own copies.
    let mut eager = Eager::new(dev, cfg)?;
    let theirs = drive(dev, &calls, progress, "reference", |c| {
        let x = &d.judge_inputs[c.index];
        eager.step(dev, &d.pristine, &mut d.judge_cache, x, c.pos, &mut d.judge_outputs[c.index])?;
        Ok(())
    })?;

    progress.say("comparing every step, the cache and the read-only buffers");
    let mut steps = Vec::with_capacity(calls.len());
    for c in &calls {
        let read = |v: &CudaSlice<bf16>| dev.stream().clone_dtoh(v).context("reading an output").map(|v| to_f32(&v));
        let (out, want, x) =
            (read(&d.outputs[c.index])?, read(&d.judge_outputs[c.index])?, read(&d.judge_inputs[c.index])?);
        steps.push(StepCheck::of(*c, &out, &want, &x));
    }
    let cache = check::cache(dev, cfg, &d.cache, &d.judge_cache)?;
    let integrity = check::integrity(dev, &d.weights, &d.pristine, &d.inputs, &d.judge_inputs)?;

    let bytes = ByteModel::of(cfg);
    let step_us = Summary::of(&mine.step_us).ok_or_else(|| GraderError::Usage("no timed step".into()))?;
    let floor_us = bytes.floor_us(bw.floor_bytes_per_s());
    let performance = Performance {
        tokens_per_s: 1e6 / step_us.median,
        us_per_call: step_us.median,
        floor_us,
        x_floor: step_us.median / floor_us,
        achieved_tbps: bytes.total as f64 / (step_us.median * 1e-6) / 1e12,
        throughput_us_per_call: mine.throughput_us_per_call,
        step_us,
        reference_us_per_call: Summary::of(&theirs.step_us).map(|s| s.median),
        bandwidth: bw,
        bytes,
        build_s,
    };
    let gates = Gates::TASK;
    let profiled_kernel_us = mine.launches.iter().map(|l| l.kernel_ns as f64 / 1e3).fold(0.0, f64::max);
    let gate_list = vec![
        verdict::correctness_gate(&steps, &cache, &integrity, &gates),
        verdict::kernels_gate(&mine.launches, &gates),
        verdict::share_gate(&mine.launches, &gates),
        verdict::plausibility_gate(performance.x_floor, profiled_kernel_us, performance.us_per_call, &gates),
    ];
    let report = Report::new(
        cfg.clone(),
        facts,
        seeds,
        &name,
        gate_list,
        performance,
        steps,
        cache,
        integrity,
        mine.launches,
        theirs.launches,
        mine.step_us,
    );
    if let Some(dir) = dump_dir {
        progress.say(&format!("dumping weights, prefix, inputs and outputs to {}", dir.display()));
        let data = dump::DumpData {
            pristine: &d.pristine,
            inputs: &d.judge_inputs,
            outputs: &d.outputs,
            reference_outputs: &d.judge_outputs,
        };
        dump::dump(dir, dev, cfg, seeds, &calls, data, report.verdict.passed, &report.verdict.failed_gates)?;
    }
    Ok(report)
}
