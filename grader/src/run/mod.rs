//! `grader run`: judges one submission end to end, as DESIGN.md's eight steps: device facts,
//! measured bandwidth, seeded data, untimed build, inputs from a fresh secret seed, the calls of
//! every phase (each output in its own buffer), the reference's replay of the very same calls, and
//! the gates.
//!
//! The submission runs in a child process (`runner`, under `isolate`'s watchdog) with its own copy of
//! the data; this process, the judge, keeps the seeds, runs the eager reference on its own copy, and
//! decides. A crash or a hang of the submission ends as a report, never as a crash of the judge.

mod check;
mod dump;
mod isolate;
pub mod report;
pub mod runner;
pub mod verdict;

use std::time::Instant;

use cuda::{Context, Device, DeviceFacts};
use reference::gpu::{DeviceCache, Eager, generate_weights};
use spec::{ByteModel, Config, Gates};

use crate::bandwidth;
use crate::cli::RunArgs;
use crate::error::{GraderError, Outcome};
use crate::metrics::to_f32;
use crate::stats::Summary;
use report::{Performance, Report, Seeds};
use runner::{Job, drive, inputs, poisoned_outputs};
use verdict::StepCheck;

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

/// Bytes of one copy of the weights.
pub fn weight_bytes(cfg: &Config) -> u64 {
    let b = ByteModel::of(cfg);
    b.matrices + b.norms
}

pub fn command(device: usize, args: &RunArgs) -> Result<Outcome, GraderError> {
    // Every argument is checked before the device opens: a typo costs a second and one sentence,
    // not a GPU start-up, and no judgement is lost to an output path that cannot be written.
    let cfg = Config::load(&args.config.config)?;
    let submission = crate::preflight::submission(&args.submission)?;
    if let Some(path) = &args.json {
        crate::preflight::output_file("--json", path)?;
    }
    if let Some(dir) = &args.dump {
        crate::preflight::output_dir("--dump", dir)?;
    }
    let dev = Device::open(device)?;
    let progress = Progress::new(args.quiet);
    let seeds = Seeds { weights: args.seed, inputs: rand::random() };
    let report = judge(&dev, &submission, &cfg, seeds, &progress, args.dump.as_deref())?;
    eprint!("{}", if args.quiet { report.verdict_line() } else { report.table() });
    let json = serde_json::to_string_pretty(&report).expect("the report serialises") + "\n";
    match &args.json {
        Some(path) => crate::write_output(path, &json)?,
        None => print!("{json}"),
    }
    Ok(if report.verdict.passed { Outcome::Pass } else { Outcome::Fail })
}

/// The whole judgement of one submission (a built-in name or a library path).
pub fn judge(
    dev: &Device,
    submission: &str,
    cfg: &Config,
    seeds: Seeds,
    progress: &Progress,
    dump_dir: Option<&std::path::Path>,
) -> Result<Report, GraderError> {
    let facts: DeviceFacts = dev.facts().clone();
    progress.say(&format!("{} ({} SMs), config '{}', submission '{submission}'", facts.name, facts.sms, cfg.name));
    progress.say("measuring the copy bandwidth (the floor's denominator)");
    let bw = bandwidth::measure(dev, RUN_BANDWIDTH_BYTES, RUN_BANDWIDTH_REPS)?;
    let calls = verdict::schedule(cfg);

    progress.say("starting the submission in its own process");
    let results =
        std::env::temp_dir().join(format!("grader-results-{}-{:016x}.bin", std::process::id(), rand::random::<u64>()));
    let job = Job {
        device: facts.ordinal,
        submission: submission.to_string(),
        config: cfg.clone(),
        weights_seed: seeds.weights,
        input_seed: seeds.inputs,
        results,
    };
    let done = match isolate::run(&job, progress)? {
        Ok(done) => done,
        Err(failure) => return Ok(Report::not_finished(cfg.clone(), facts, seeds, submission, failure)),
    };

    // The reference replays the very same calls on the judge's own copies, after the submission's
    // process is gone, so the two never share the GPU while one is timed.
    progress.say("generating the judge's copy of the data");
    dev.require_free(reference::gpu::data::bytes_needed(cfg, calls.len()), "the judge's copy of the data")?;
    let weights = generate_weights(dev, cfg, seeds.weights)?;
    let mut cache = DeviceCache::generate(dev, cfg, seeds.weights)?;
    let xs = inputs(dev, cfg, seeds.inputs, calls.len())?;
    let mut outs = poisoned_outputs(dev, cfg, calls.len())?;
    let mut eager = Eager::new(dev, cfg)?;
    let theirs = drive(
        dev,
        &calls,
        |phase, n| progress.say(&format!("reference: {n} {phase:?} steps")),
        |c| Ok(eager.step(dev, &weights, &mut cache, &xs[c.index], c.pos, &mut outs[c.index])?),
        |_| Ok(()),
    )?;

    progress.say("comparing every step and the cache");
    let read = |v| dev.stream().clone_dtoh(v).context("reading a reference tensor");
    let mut judge_xs = Vec::with_capacity(calls.len());
    let mut judge_outs = Vec::with_capacity(calls.len());
    let mut steps = Vec::with_capacity(calls.len());
    for c in &calls {
        let (x, want) = (read(&xs[c.index])?, read(&outs[c.index])?);
        steps.push(StepCheck::of(*c, &to_f32(&done.outputs[c.index]), &to_f32(&want), &to_f32(&x)));
        judge_xs.push(x);
        judge_outs.push(want);
    }
    let cache_check = check::cache(cfg, (&done.cache_k, &done.cache_v), (&read(&cache.k)?, &read(&cache.v)?));

    let f = &done.finished;
    let bytes = ByteModel::of(cfg);
    let step_us =
        Summary::of(&f.measured.step_us).ok_or_else(|| GraderError::Runner("it reported no timed step".into()))?;
    let floor_us = bytes.floor_us(bw.floor_bytes_per_s());
    let performance = Performance {
        tokens_per_s: 1e6 / step_us.median,
        us_per_call: step_us.median,
        floor_us,
        x_floor: step_us.median / floor_us,
        achieved_tbps: bytes.total as f64 / (step_us.median * 1e-6) / 1e12,
        throughput_us_per_call: f.measured.throughput_us_per_call,
        step_us,
        reference_us_per_call: Summary::of(&theirs.step_us).map(|s| s.median),
        bandwidth: bw,
        bytes,
        build_s: f.build_s,
        timed_wall_us: done.timed_wall_us,
    };
    let gates = Gates::TASK;
    let profiled_kernel_us = f.measured.launches.iter().map(|l| l.kernel_ns as f64 / 1e3).fold(0.0, f64::max);
    let timed_sum_us: f64 = f.measured.step_us.iter().sum();
    let gate_list = vec![
        verdict::correctness_gate(&steps, &cache_check, &f.integrity, &gates),
        verdict::kernels_gate(&f.measured.launches, &gates),
        verdict::share_gate(&f.measured.launches, &gates),
        verdict::plausibility_gate(
            &verdict::Timing {
                x_floor: performance.x_floor,
                profiled_kernel_us,
                timed_median_us: performance.us_per_call,
                timed_sum_us,
                judge_wall_us: done.timed_wall_us,
            },
            &gates,
        ),
    ];
    let report = Report::new(
        cfg.clone(),
        facts,
        seeds,
        &f.name,
        gate_list,
        performance,
        steps,
        cache_check,
        f.integrity,
        f.measured.launches.clone(),
        theirs.launches,
        f.measured.step_us.clone(),
    );
    if let Some(dir) = dump_dir {
        progress.say(&format!("dumping weights, prefix, inputs and outputs to {}", dir.display()));
        let data = dump::DumpData {
            pristine: &weights,
            inputs: &judge_xs,
            outputs: &done.outputs,
            reference_outputs: &judge_outs,
        };
        dump::dump(dir, dev, cfg, seeds, &calls, data, report.verdict.passed, &report.verdict.failed_gates)?;
    }
    Ok(report)
}
