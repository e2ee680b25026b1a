//! `grader run`: judges one submission end to end, as a pipeline of named stages:
//!
//! 1. **measure**: device facts and the bandwidths (copy for the floor, read-only for the timing
//!    bound), before anything else touches the GPU;
//! 2. **prepare**: every layer's weights and prefilled cache from the public seed, in a region of
//!    device memory the judge owns and shares with the runner (`shared`);
//! 3. **pace**: the runner (a child process, under a watchdog, watched on the device) builds the
//!    submission; the judge hands each input over just in time, times each call on its own clock
//!    and reads each output itself (`pace`); the runner reports what only it can record;
//! 4. **replay and compare**: layer by layer, the weights and cache regenerated into the judge's
//!    scratch and checked against the shared ones, and the eager reference over the very same calls,
//!    each layer on the submission's own input to it (`replay`);
//! 5. **decide**: every output, the caches and the read-only buffers, then every gate (`gates`),
//!    labelled with who measured what it rests on.
//!
//! The input seed never leaves the judge; the runner's word (CUPTI counts, hardware counters, the
//! L2 state) is cross-checked against the judge's clock and the hardware, and said to be its word.

pub(crate) mod append;
mod channel;
mod check;
mod control;
mod counters;
pub(crate) mod dump;
pub mod gates;
mod isolate;
mod load;
mod memfd;
pub mod pace;
pub mod protocol;
mod replay;
pub mod report;
pub mod runner;
mod sandbox;
mod shared;
pub mod watch;

use std::time::Instant;

use cuda::{Device, DeviceFacts};
use reference::gpu::{DeviceCache, generate_weights};
use spec::{ByteModel, Call, Config, Gates, Phase};

use gates::launches::LaunchAllowance;

use crate::bandwidth::{self, Bandwidth};
use crate::builtins::Chosen;
use crate::cli::RunArgs;
use crate::error::{GraderError, Outcome};
use crate::stats::Summary;
use gates::{Integrity, correctness_gate};
use isolate::Runner;
use pace::Paced;
use protocol::{Finished, Job};
use replay::Replayed;
use report::{HostShare, Performance, Report, Seeds};
use shared::SharedData;

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

/// What the judge needs to know about how a run is to be judged.
#[derive(Debug, Clone, Copy)]
pub struct Policy {
    /// Judge without the hardware counters (`--no-audit`): the verdict is then UNAUDITED.
    pub no_audit: bool,
}

pub fn command(device: usize, args: &RunArgs) -> Result<Outcome, GraderError> {
    // Every argument is checked before the device opens: a typo costs a second and one sentence,
    // not a GPU start-up, and no judgement is lost to an output path that cannot be written.
    let cfg = Config::load(&args.config.config)?;
    let submission = crate::preflight::submission(&args.submission.name, args.submission.python.as_deref())?;
    if let Some(dir) = &args.dump {
        cfg.require_one_layer("`--dump`")?;
        crate::preflight::output_dir("--dump", dir)?;
    }
    if let Some(path) = &args.json {
        dump::report_file(path, args.dump.as_deref())?;
    }
    let dev = Device::open(device)?;
    let progress = Progress::new(args.quiet);
    let seeds = Seeds { weights: args.seed, inputs: rand::random() };
    let policy = Policy { no_audit: args.no_audit };
    let report = judge(&dev, &submission, &cfg, seeds, policy, &progress, args.dump.as_deref())?;
    eprint!("{}", if args.quiet { report.verdict_line() } else { report.table() });
    if let Some(path) = &args.json {
        crate::output::write_output(
            path,
            &(serde_json::to_string_pretty(&report).expect("the report serialises") + "\n"),
        )?;
    }
    Ok(if report.verdict.passed { Outcome::Pass } else { Outcome::Fail })
}

/// Refuses, before any work, a config whose one copy of the data (every layer's weights and caches, every
/// call's input and output) is more than the GPU holds, naming how many GPUs of this size the split over
/// GPUs would need (`spec::parallel`, docs/parallel.md), which the grader does not run yet (`grader
/// profile` asks it too, for the weights and caches alone: `calls` 0).
pub(crate) fn fits_one_gpu(cfg: &Config, calls: usize, device_bytes: u64) -> Result<(), GraderError> {
    let need = spec::bytes::data_bytes(cfg, calls).unwrap_or(u64::MAX);
    if need <= device_bytes {
        return Ok(());
    }
    let split = match spec::parallel::fewest_gpus(cfg, device_bytes, calls) {
        Some(n) => format!("split over GPUs it would need {n} of them (docs/parallel.md)"),
        None => format!("no split of it over up to {} GPUs of this size holds it", spec::parallel::MAX_GPUS),
    };
    Err(GraderError::Usage(format!(
        "{} needs {} of device memory for one copy of its weights, caches and calls, more than this GPU's {}: {split}, \
         and the grader runs one GPU for now",
        cfg.name,
        spec::human_bytes(need),
        spec::human_bytes(device_bytes)
    )))
}

/// The whole judgement of one submission, checked by `preflight::submission`.
pub fn judge(
    dev: &Device,
    chosen: &Chosen,
    cfg: &Config,
    seeds: Seeds,
    policy: Policy,
    progress: &Progress,
    dump_dir: Option<&std::path::Path>,
) -> Result<Report, GraderError> {
    let facts: DeviceFacts = dev.facts().clone();
    let calls = spec::schedule(cfg);
    fits_one_gpu(cfg, calls.len(), facts.total_mem_bytes as u64)?;
    let submission = &chosen.label();
    progress.say(&format!("{} ({} SMs), config '{}', submission '{submission}'", facts.name, facts.sms, cfg.name));
    // Before the submission exists, so that none of its threads is counted.
    let host_before = load::HostLoad::sample();
    if let Some(busy) = host_before.filter(load::HostLoad::busy) {
        progress.say(&format!("warning: {}", busy.said(load::Moment::Before)));
    }
    progress.say("measuring the copy and read-only bandwidths (the floor and the timing bound)");
    let bw = bandwidth::measure(dev, RUN_BANDWIDTH_BYTES, RUN_BANDWIDTH_REPS)?;

    progress.say(&match cfg.layers {
        1 => "generating the weights and the prefilled cache".to_string(),
        l => format!("generating the weights and the prefilled caches of {l} layers"),
    });
    let mut shared = SharedData::create(dev, cfg, calls.len(), |l| {
        if l > 0 && l % 10 == 0 {
            progress.say(&format!("generated {l} of {} layers", cfg.layers));
        }
        let seed = spec::data::layer_seed(seeds.weights, l);
        Ok((generate_weights(dev, cfg, seed)?, DeviceCache::generate(dev, cfg, seed)?))
    })?;

    // Before the submission exists: whether the counters work on this device decides whether a
    // missing audit later is a failure (it is) or the run is unaudited from the start.
    let mut counters = counters::JudgeCounters::probe(dev, policy.no_audit);
    if let Some(why) = counters.unaudited() {
        progress.say(&format!("unaudited: {why}"));
    }
    progress.say("starting the submission in its own process");
    let job = Job {
        device: facts.ordinal,
        submission: chosen.clone(),
        config: cfg.clone(),
        region: shared.handle()?,
        judge_samples: counters.sampling(),
    };
    let mut runner = Runner::start(&job, &facts.pci_bus_id)?;
    let schedule = pace::Schedule { cfg, calls: &calls, input_seed: seeds.inputs };
    let (paced, finished, watched) =
        match pace::pace(&mut runner, dev, &mut shared, &schedule, &mut counters, progress)? {
            Err(failure) => {
                let watched = runner.abandon();
                return Ok(Report::not_finished(cfg.clone(), facts, seeds, submission, failure, watched));
            }
            Ok(paced) => match runner.finish(rand::random()) {
                (Ok(finished), watched) => (paced, finished, watched),
                (Err(failure), watched) => {
                    return Ok(Report::not_finished(cfg.clone(), facts, seeds, submission, failure, watched));
                }
            },
        };

    // The judge's audit ends before its own replay runs on the device.
    let audit = counters.finish(calls.len());
    let replayed = replay::replay(dev, cfg, seeds.weights, &calls, &paced, &shared, progress)?;
    progress.say("comparing the inputs and deciding");
    let steps = replayed.steps.clone();
    let cache_check = replayed.cache;
    let appends = append::check(&calls, &paced.appended, &replayed.appended, Gates::TASK.rel_err_tol);
    let integrity = Integrity {
        // The shared weights against the regenerated ones (the replay's), and for one layer the
        // runner's own copy against the shared one after teardown (its word).
        weight_vectors_changed: replayed.weight_vectors_changed + finished.weight_vectors_changed,
        inputs_changed: check::inputs_changed(dev, &shared, &calls, &paced.inputs)?,
    };

    let gates = Gates::TASK;
    let model: Vec<u64> = calls.iter().map(|c| ByteModel::stack_at(cfg, c.pos).total).collect();
    let l2_bytes = facts.l2_bytes as u64;
    let required = gates::physics::required_bytes(&calls, &model, l2_bytes);
    let f = &finished;
    let allowance = match chosen {
        Chosen::Native(_) => LaunchAllowance::NATIVE,
        Chosen::Python(_) => LaunchAllowance::PYTHON,
    };
    let mut gate_list = vec![
        correctness_gate(&steps, cfg.layers > 1, &cache_check, &appends, &integrity, &gates),
        gates::launches::kernels_gate(&calls, &f.record.calls, &gates),
        gates::launches::share_gate(&f.record.calls, &gates),
        gates::launches::launch_record_gate(&f.record, &audit),
        gates::launches::record_coverage_gate(&calls, &f.record, &paced, &gates, allowance),
        gates::environment::exclusive_gpu_gate(&watched),
        gates::physics::bytes_read_gate(&audit, &model, &required, l2_bytes, &paced, &gates),
        gates::environment::l2_gate(&f.l2),
        gates::physics::plausible_timing_gate(&calls, &paced, &f.runner_us, &required, bw.read_ceiling_tbps, &gates),
    ];
    let windows = gates::launches::attempt_windows(&f.record, &paced);
    let judged = gates::launches::judged_attempt(&windows, &gates, allowance);
    let mut performance = performance(cfg, &calls, &paced, judged, f, &replayed, bw)?;
    // A busy host never excuses a gate (a submission can starve its own runner); beside a failure of
    // the coverage rule it says what the judge saw before the submission started or after the run
    // (the runner and all it left behind are ended by now), and where that is the only failure the
    // verdict is HOST BUSY, not a pass (`Report::judged`).
    let coverage_failed = gate_list.iter().any(|g| g.name == "record_coverage" && !g.passed);
    performance.host_before = host_before;
    performance.host_after = if coverage_failed { load::HostLoad::sample() } else { None };
    if let Some(busy) = performance.busy_host() {
        for g in gate_list.iter_mut().filter(|g| g.name == "record_coverage" && !g.passed) {
            g.detail += &format!("; {busy}");
        }
    }
    let report = Report::judged(report::Judged {
        config: cfg.clone(),
        device: facts,
        seeds,
        submission: f.name.clone(),
        gates: gate_list,
        performance,
        steps,
        cache: cache_check,
        appends,
        integrity,
        launches: report::Launches { submission: f.record.calls.clone(), reference: replayed.launches.clone() },
        audit,
        runner_audit: f.audit.clone(),
        watched,
        record: f.record.clone(),
        call_us: paced.call_us.clone(),
    });
    if let Some(dir) = dump_dir {
        progress.say(&format!("dumping weights, prefix, inputs and outputs to {}", dir.display()));
        let pristine = generate_weights(dev, cfg, seeds.weights)?;
        let data = dump::DumpData {
            pristine: &pristine,
            inputs: &paced.inputs,
            outputs: &paced.outputs,
            reference_outputs: &replayed.outputs,
        };
        dump::dump(dir, dev, cfg, seeds, &calls, data, report.verdict.passed, &report.verdict.failed_gates)?;
    }
    Ok(report)
}

/// The speed figures, all on the judge's clock; the back-to-back figure is attempt `judged`'s.
fn performance(
    cfg: &Config,
    calls: &[Call],
    paced: &Paced,
    judged: usize,
    f: &Finished,
    replayed: &Replayed,
    bw: Bandwidth,
) -> Result<Performance, GraderError> {
    let timed: Vec<f64> =
        calls.iter().filter(|c| c.phase == Phase::Timed).filter_map(|c| paced.call_us[c.index]).collect();
    let step_us = Summary::of(&timed).ok_or_else(|| GraderError::Runner("no call was timed".into()))?;
    // What the judge's clock adds to the runner's own for the same calls: signalling and pacing.
    let overhead: Vec<f64> = f
        .runner_us
        .iter()
        .filter(|t| t.count == 1 && calls[t.first].phase == Phase::Timed)
        .filter_map(|t| Some(paced.call_us[t.first]? - t.us))
        .collect();
    let bytes = ByteModel::stack(cfg);
    let floor_us = bytes.floor_us(bw.floor_bytes_per_s());
    let attempts: Vec<f64> = paced.batches.iter().map(|b| b.us / b.count.max(1) as f64).collect();
    let reference_timed: Vec<f64> =
        calls.iter().filter(|c| c.phase == Phase::Timed).map(|c| replayed.call_us[c.index]).collect();
    Ok(Performance {
        tokens_per_s: 1e6 / step_us.median,
        us_per_call: step_us.median,
        floor_us,
        x_floor: step_us.median / floor_us,
        achieved_tbps: bytes.total as f64 / (step_us.median * 1e-6) / 1e12,
        throughput_us_per_call: attempts.get(judged).copied().unwrap_or(0.0),
        attempts_us_per_call: attempts,
        judged_attempt: judged,
        step_us,
        signal_round_trip_us: paced.ping_us.clone(),
        pacing_overhead_us: Summary::of(&overhead),
        reference_us_per_call: Summary::of(&reference_timed).map(|s| s.median),
        read_bound_us: gates::physics::bound_us(bytes.total, bw.read_ceiling_tbps, &Gates::TASK),
        bandwidth: bw,
        bytes,
        build_s: paced.build_s,
        host: HostShare::of(&f.record, calls.iter().filter(|c| c.phase == Phase::Timed).map(|c| c.index)),
        host_before: None,
        host_after: None,
    })
}

#[cfg(test)]
mod tests {
    use super::fits_one_gpu;
    use spec::family::find_stack;

    /// On an H200's 150.1 GB the named stacks up to 70B fit; the 405B stack is refused before any work,
    /// naming the GPUs the split would need.
    #[test]
    fn a_stack_over_one_gpus_memory_is_refused_naming_the_gpus_it_needs() {
        let h200 = 150_100_000_000;
        let calls = |cfg: &spec::Config| spec::call_count(cfg).unwrap();
        for name in ["stack-70b", "stack-8b", "stack-1b"] {
            let cfg = find_stack(name).unwrap().config();
            fits_one_gpu(&cfg, calls(&cfg), h200).unwrap_or_else(|e| panic!("{name}: {e}"));
        }
        let big = find_stack("stack-405b").unwrap().config();
        let said = fits_one_gpu(&big, calls(&big), h200).unwrap_err().to_string();
        assert!(said.contains("stack-405b needs 805.49 GB") && said.contains("150.10 GB"), "{said}");
        assert!(said.contains("it would need 8 of them"), "{said}");
        let said = fits_one_gpu(&big, calls(&big), 50_000_000_000).unwrap_err().to_string();
        assert!(said.contains("no split of it over up to 8 GPUs"), "{said}");
    }
}
