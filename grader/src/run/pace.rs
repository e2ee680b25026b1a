//! The judge's clock over the schedule: it hands each input over, starts each call, stamps it, and
//! reads its output back, itself.
//!
//! What the runner could know in advance: nothing. A call's input is written into its buffer by the
//! judge itself, from its own context, only after the previous call has finished and its output has
//! been read: so the input exists in the runner's reach only on the device, never on a page of its
//! memory, and only between calls, when the submission may queue no GPU work (the launch record
//! sees any that it does, from any thread, under any tag). The judge writes it while the runner does
//! its bookkeeping, and says so; the runner waits for that before its own GPU work, so the device
//! switches back from the judge's context there, not inside the next timed call (written after the
//! runner said it was ready, each timed call of the graded layer started 280 us late). The write
//! also leaves the GPU's address translations cold for the call (docs/perf.md, measured: 4-5 us of
//! the graded layer's kernel), as a real model's other layers would have left them. The input
//! seed never leaves the judge; in the back-to-back phase each input is the previous call's output,
//! so no call can be computed before its predecessor, and each attempt of the phase starts from a
//! fresh input, handed over only after the attempt before it has ended and been read. What is
//! timed: from the judge's "go" on the control page to the runner's "done" after it synchronised the
//! device, on the judge's own clock. The signalling's own cost (a no-op round trip) is measured and
//! reported beside it.

use cuda::Device;
use half::bf16;
use spec::{Call, Config, Input, Phase};

use super::Progress;
use super::append::{Slot, read_slot};
use super::control::Command;
use super::counters::JudgeCounters;
use super::isolate::{BUILD_TIMEOUT, CALL_TIMEOUT, Failure, Runner, START_TIMEOUT};
use super::protocol::CommandTime;
use super::sandbox;
use super::shared::SharedData;
use crate::error::GraderError;
use crate::stats::Summary;

/// No-op round trips timed to state the signalling overhead.
const PINGS: usize = 64;

/// What the judge measured and read while the calls ran.
#[derive(Debug, Clone)]
pub struct Paced {
    /// `build_layer` (or `build_stack`) on the judge's clock, in seconds.
    pub build_s: f64,
    /// Each call's time when it ran alone (correctness and timed phases), in microseconds.
    pub call_us: Vec<Option<f64>>,
    /// Each attempt of the back-to-back phase on the judge's clock: its first call, its count of
    /// calls, and their total time.
    pub batches: Vec<CommandTime>,
    /// A no-op command's round trip, in microseconds: the clock's own overhead.
    pub ping_us: Summary,
    /// Each call's input, as handed over (fresh) or as read (an earlier call's output).
    pub inputs: Vec<Vec<bf16>>,
    /// Each call's output, as the judge read it right after the call.
    pub outputs: Vec<Vec<bf16>>,
    /// Each call's hidden states (a stack's layers' outputs but the last), read with its output; empty
    /// for one layer.
    pub hidden: Vec<Vec<bf16>>,
    /// Each call's appended slot in every layer, read with its output (`append`).
    pub appended: Vec<Vec<Slot>>,
}

/// What the judge runs: the calls of a configuration, their inputs drawn from a seed only it holds.
pub struct Schedule<'a> {
    pub cfg: &'a Config,
    pub calls: &'a [Call],
    pub input_seed: u64,
}

/// Drives every call of the schedule through `runner`. `Ok(Err(_))`: the runner failed (a verdict);
/// `Err(_)`: the judge could not go on (no verdict).
pub fn pace(
    runner: &mut Runner,
    dev: &Device,
    shared: &mut SharedData,
    schedule: &Schedule,
    counters: &mut JudgeCounters,
    progress: &Progress,
) -> Result<Result<Paced, Failure>, GraderError> {
    let Schedule { cfg, calls, input_seed } = *schedule;
    (|| -> Result<Result<Paced, Failure>, GraderError> {
        macro_rules! obey {
            ($e:expr) => {
                match $e {
                    Ok(v) => v,
                    Err(failure) => return Ok(Err(failure)),
                }
            };
        }
        obey!(runner.command(Command::Ping, 0, 0, START_TIMEOUT));
        // The runner has mapped the region; from here on the submission's code may run, and it may
        // not read the judge's memory, where the input seed is.
        sandbox::hide_judge_memory().map_err(|e| GraderError::Runner(format!("making the judge non-dumpable: {e}")))?;
        // What the contract calls the untimed build, one layer or a stack.
        let build = if cfg.layers > 1 { "build_stack" } else { "build_layer" };
        progress.say(&format!("runner ready; {build}"));
        let build_s = obey!(runner.command(Command::Build, 0, 0, BUILD_TIMEOUT)).us() / 1e6;
        progress.say(&format!("{build} took {build_s:.2} s"));
        let mut pings = Vec::with_capacity(PINGS);
        for _ in 0..PINGS {
            pings.push(obey!(runner.command(Command::Ping, 0, 0, CALL_TIMEOUT)).us());
        }
        let row = cfg.batch * cfg.d;
        let mut p = Paced {
            build_s,
            call_us: vec![None; calls.len()],
            batches: Vec::new(),
            ping_us: Summary::of(&pings).expect("finite round trips"),
            inputs: vec![Vec::new(); calls.len()],
            outputs: vec![vec![bf16::NAN; row]; calls.len()],
            hidden: vec![Vec::new(); calls.len()],
            appended: vec![Vec::new(); calls.len()],
        };
        for phase in calls.chunk_by(|a, b| a.phase == b.phase) {
            progress.say(&format!("{} {:?} calls", phase.len(), phase[0].phase));
            // A command is one call, or one attempt of the back-to-back phase.
            for command in spec::commands(phase) {
                let command = &calls[command];
                let first = command[0];
                hand_over(dev, shared, cfg, &first, input_seed, &mut p)?;
                runner.staged();
                obey!(settle(runner, counters));
                let (index, count) = (first.index, command.len());
                let stamps = obey!(runner.command(Command::Calls, index as u64, count as u64, CALL_TIMEOUT));
                counters.record(index, count, &stamps);
                if first.phase == Phase::Throughput {
                    p.batches.push(CommandTime { first: index, count, us: stamps.us() });
                } else {
                    p.call_us[index] = Some(stamps.us());
                }
                for c in command {
                    read_back(dev, shared, cfg, c, &mut p)?;
                    if let Input::OutputOf(j) = c.input {
                        p.inputs[c.index] = p.outputs[j].clone();
                    }
                }
            }
        }
        // Nothing to write after the last command: its outputs are read.
        runner.staged();
        obey!(runner.command(Command::Teardown, 0, 0, CALL_TIMEOUT));
        Ok(Ok(p))
    })()
}

/// Before a command of calls, untimed: waits until the runner is ready (its eviction done, the device
/// idle), leaves the device quiet as long as the judge's counters need, and reads both their clocks.
fn settle(runner: &mut Runner, counters: &mut JudgeCounters) -> Result<(), Failure> {
    runner.wait_ready(CALL_TIMEOUT)?;
    let quiet = std::time::Instant::now();
    while quiet.elapsed() < counters.quiet() {
        std::hint::spin_loop();
    }
    counters.mark();
    Ok(())
}

/// Reads what `call` left, untimed, right after it: its output, its hidden states and every layer's
/// appended slot.
fn read_back(dev: &Device, shared: &SharedData, cfg: &Config, call: &Call, p: &mut Paced) -> Result<(), GraderError> {
    p.outputs[call.index] = shared.read_output(dev, call.index)?;
    p.hidden[call.index] = shared.read_hidden(dev, call.index)?;
    p.appended[call.index] =
        shared.layers.iter().map(|l| read_slot(dev, cfg, &l.cache, call.pos)).collect::<Result<_, _>>()?;
    Ok(())
}

/// Hands `call`'s fresh input over, untimed: drawn now and written into its buffer by the judge,
/// right after the previous call's output was read.
fn hand_over(
    dev: &Device,
    shared: &mut SharedData,
    cfg: &Config,
    call: &Call,
    input_seed: u64,
    p: &mut Paced,
) -> Result<(), GraderError> {
    let x = spec::data::input(cfg, input_seed, call.index);
    shared.write_input(dev, call.index, &x)?;
    p.inputs[call.index] = x;
    Ok(())
}
