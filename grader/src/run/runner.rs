//! The runner: the child process in which a submission runs (`grader runner`, started by the judge;
//! not for people). It reads its job from stdin (the input seed stays off the command line),
//! generates its own copy of the data from the seeds, builds the submission, drives every call of
//! the schedule with timing and CUPTI, checks the read-only buffers, writes the outputs and the final
//! cache to the results file and reports one JSON line per event on stdout. A submission that
//! crashes, hangs or corrupts memory takes only this process down; the judge keeps the verdict.

use std::io::{BufRead, Write};
use std::path::PathBuf;
use std::time::Instant;

use cuda::cudarc::driver::CudaSlice;
use cuda::{Context, CudaError, Device};
use half::bf16;
use reference::gpu::data::{bytes_needed, generate_input};
use reference::gpu::{DeviceCache, DeviceWeights, generate_weights};
use serde::{Deserialize, Serialize};
use spec::Config;
use submission::Layer;

use super::check;
use super::verdict::{Call, Integrity, Phase, schedule};
use crate::cupti::{Recorder, StepLaunches};
use crate::error::{GraderError, Outcome};

/// What the judge asks of the runner, as the first line of its stdin.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Job {
    pub device: usize,
    pub submission: String,
    pub config: Config,
    pub weights_seed: u64,
    pub input_seed: u64,
    /// Where the runner writes the outputs of every call, then the final K and V cache, raw bf16.
    pub results: PathBuf,
}

/// What the calls of one side measured.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Measured {
    pub step_us: Vec<f64>,
    pub throughput_us_per_call: f64,
    pub launches: Vec<StepLaunches>,
}

/// The runner's last word on success.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Finished {
    pub name: String,
    pub build_s: f64,
    pub measured: Measured,
    pub integrity: Integrity,
}

/// One line of the runner's stdout.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "event")]
pub enum Event {
    /// The data exists on the device; build_layer starts.
    Generated,
    Built {
        build_s: f64,
    },
    /// A phase of the schedule starts.
    Phase {
        phase: Phase,
        calls: usize,
    },
    Done(Finished),
    /// The submission or the device failed; the process exits after this line.
    Failed {
        message: String,
    },
}

fn say(event: &Event) {
    let mut out = std::io::stdout().lock();
    // A judge that went away cannot be told anything more; the process ends on its own then.
    let _ = writeln!(out, "{}", serde_json::to_string(event).expect("events serialise"));
    let _ = out.flush();
}

/// Runs every call of `calls` through `step`, phase by phase, timing and profiling as each phase says.
/// `on_phase` hears of each phase before it starts; `settled` hears of each call once the device has
/// synchronised after it (outside any timed region): each call of a step-by-step phase at once, the
/// calls of the back-to-back phase at its end. What a call has not finished by then it never will.
pub fn drive(
    dev: &Device,
    calls: &[Call],
    mut on_phase: impl FnMut(Phase, usize),
    mut step: impl FnMut(&Call) -> Result<(), GraderError>,
    mut settled: impl FnMut(&Call) -> Result<(), GraderError>,
) -> Result<Measured, GraderError> {
    let mut m = Measured::default();
    for phase in calls.chunk_by(|a, b| a.phase == b.phase) {
        on_phase(phase[0].phase, phase.len());
        match phase[0].phase {
            Phase::Correctness => {
                for call in phase {
                    dev.synchronize()?;
                    let recorder = Recorder::start()?;
                    step(call)?;
                    dev.synchronize()?;
                    m.launches.push(StepLaunches::of(&recorder.stop()?));
                    settled(call)?;
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
                    settled(call)?;
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
                phase.iter().try_for_each(&mut settled)?;
            }
        }
    }
    Ok(m)
}

/// One output buffer per call, full of NaN: an output never written cannot pass.
pub fn poisoned_outputs(dev: &Device, cfg: &Config, calls: usize) -> Result<Vec<CudaSlice<bf16>>, CudaError> {
    let nan = vec![bf16::NAN; cfg.batch * cfg.d];
    (0..calls).map(|_| dev.stream().clone_htod(&nan).context("allocating an output")).collect()
}

/// The inputs of every call, from the input seed.
pub fn inputs(dev: &Device, cfg: &Config, input_seed: u64, calls: usize) -> Result<Vec<CudaSlice<bf16>>, CudaError> {
    (0..calls).map(|c| generate_input(dev, cfg, input_seed, c)).collect()
}

/// `grader runner`: reads the job, runs it, and always ends with a `done` or `failed` line.
pub fn command() -> Result<Outcome, GraderError> {
    let mut line = String::new();
    std::io::stdin().lock().read_line(&mut line).map_err(|e| GraderError::Runner(format!("reading the job: {e}")))?;
    let job: Job =
        serde_json::from_str(&line).map_err(|e| GraderError::Runner(format!("the job is not valid JSON: {e}")))?;
    match run(&job) {
        Ok(finished) => {
            say(&Event::Done(finished));
            Ok(Outcome::Pass)
        }
        Err(e) => {
            say(&Event::Failed { message: e.to_string() });
            Ok(Outcome::Fail)
        }
    }
}

fn run(job: &Job) -> Result<Finished, GraderError> {
    let cfg = &job.config;
    let mut sub = submission::load(&job.submission)?;
    let dev = Device::open(job.device)?;
    let calls = schedule(cfg);
    // The submission's data, and a pristine copy of the weights to check them against afterwards.
    dev.require_free(bytes_needed(cfg, calls.len()) + crate::run::weight_bytes(cfg), "the submission's data")?;
    let weights: DeviceWeights = generate_weights(&dev, cfg, job.weights_seed)?;
    let pristine = generate_weights(&dev, cfg, job.weights_seed)?;
    let mut cache = DeviceCache::generate(&dev, cfg, job.weights_seed)?;
    let xs = inputs(&dev, cfg, job.input_seed, calls.len())?;
    // Shared by the step (which writes an output) and the settling (which copies it away).
    let outs = std::cell::RefCell::new(poisoned_outputs(&dev, cfg, calls.len())?);
    dev.synchronize()?;
    say(&Event::Generated);

    let t = Instant::now();
    sub.build_layer(&dev, Layer { weights: &weights, cache: &mut cache }, cfg)?;
    dev.synchronize()?;
    let build_s = t.elapsed().as_secs_f64();
    say(&Event::Built { build_s });

    // Each output is copied away as soon as its call has settled, and the cache is read before
    // teardown: work deferred to a later call, or to teardown, does not count as done in time.
    let mut snapshots = poisoned_outputs(&dev, cfg, calls.len())?;
    let measured = drive(
        &dev,
        &calls,
        |phase, n| say(&Event::Phase { phase, calls: n }),
        |c| {
            let layer = Layer { weights: &weights, cache: &mut cache };
            sub.layer_step(&dev, layer, &xs[c.index], c.pos, &mut outs.borrow_mut()[c.index])?;
            Ok(())
        },
        |c| {
            dev.stream()
                .memcpy_dtod(&outs.borrow()[c.index], &mut snapshots[c.index])
                .context("copying an output away")?;
            Ok(())
        },
    )?;
    dev.synchronize()?;
    let mut bytes = Vec::with_capacity(2 * (calls.len() * cfg.d + 2 * cfg.cache_elems()));
    for buf in snapshots.iter().chain([&cache.k, &cache.v]) {
        bytes.extend(dev.stream().clone_dtoh(buf).context("reading results")?.iter().flat_map(|v| v.to_le_bytes()));
    }
    let name = sub.name().to_string();
    sub.teardown();
    drop(sub);
    dev.synchronize()?;

    let judge_inputs = inputs(&dev, cfg, job.input_seed, calls.len())?;
    let integrity = check::integrity(&dev, &weights, &pristine, &xs, &judge_inputs)?;
    std::fs::write(&job.results, bytes)
        .map_err(|source| GraderError::Write { path: job.results.display().to_string(), source })?;
    Ok(Finished { name, build_s, measured, integrity })
}
