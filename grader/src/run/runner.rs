//! The runner: the child process in which a submission runs (`grader runner`, started by the judge;
//! not for people).
//!
//! It owns nothing the verdict rests on. The judge allocated every buffer (mapped here from its
//! region), writes each input just before its call, reads each output itself, and keeps the clock;
//! the runner only obeys the judge's commands on the control page, and records what only a process
//! inside the submission's can: the CUPTI record of every call (kernels, copies, modules), the DRAM
//! audit's counters, and the state of the persisting L2. Those travel in its one report, labelled
//! as the runner's word.
//!
//! Order matters: the recording and the audit are switched on, and `CAP_SYS_PTRACE` is dropped,
//! before the submission's library is loaded, so no code of the submission ever runs unobserved or
//! able to read the judge; process creation is forbidden once `build_layer` has returned.
//!
//! Between commands, after the acknowledgement and before the runner says it is ready, it closes
//! the audit range of the last command, evicts L2 (a real model's other layers would have), and
//! opens the next range: the profiler's own work at a range boundary (it waits on the GPU for a
//! millisecond) never falls inside a call the judge times, every command of calls runs in a range
//! of its own, and the flush runs in this process's context, so no switch between the judge's
//! context and this one lands inside a timed call. Whether the flush ran is the runner's word; that
//! skipping it would not pay is the audit's to show (a call that reads its weights from L2 reads
//! fewer bytes from DRAM).

use std::io::BufRead;
use std::time::{Duration, Instant};

use cuda::cudarc::driver::sys::{self as driver, CUlimit};
use cuda::{Context, Device};
use reference::gpu::DeviceWeights;
use spec::{Call, Config, Tensor, schedule};
use submission::{Submission, SubmissionError};

use crate::builtins::Chosen;

use super::channel;
use super::check;
use super::control::{Command, Control, Posted, Status};
use super::protocol::{Audit, Batch, CONTROL_FD, CommandTime, Counters, Coverage, Finished, Job, Message, REPORT_FD};
use super::sandbox;
use super::shared::SharedData;
use crate::audit::sampling::{QUIET_INTERVALS, SAMPLING_INTERVAL_NS};
use crate::audit::{AUDIT_METRICS, CTAS_LAUNCHED, DRAM_BYTES_READ, DRAM_BYTES_WRITE, RangeAudit};
use crate::bandwidth::L2Eviction;
use crate::cupti::{self, CallWindow, OwnWork, Recording, Tag};
use crate::error::{GraderError, Outcome};

/// The eviction before every command of calls reads this many times L2: enough to replace every
/// line the last call left.
const EVICTION_L2_MULTIPLE: usize = 2;
/// The longest wait for the judge to be done after a command of calls: past it the runner goes on
/// (a judge that died is found by its watchdog, not here).
const STAGED_WAIT: std::time::Duration = std::time::Duration::from_secs(30);

/// `grader runner`: reads the job, obeys the control page, and always ends with one report.
pub fn command() -> Result<Outcome, GraderError> {
    // SAFETY: the judge starts the runner with these two descriptors open and owned by nobody else.
    let (report, control) = unsafe { (channel::inherit(REPORT_FD), channel::inherit(CONTROL_FD)) };
    let report = report.map_err(|e| GraderError::Runner(format!("no report channel on fd {REPORT_FD}: {e}")))?;
    let control = control
        .and_then(Control::from_fd)
        .map_err(|e| GraderError::Runner(format!("no control page on fd {CONTROL_FD}: {e}")))?;
    let mut line = String::new();
    std::io::stdin().lock().read_line(&mut line).map_err(|e| GraderError::Runner(format!("reading the job: {e}")))?;
    let job: Job =
        serde_json::from_str(&line).map_err(|e| GraderError::Runner(format!("the job is not valid JSON: {e}")))?;
    let mut state = State::default();
    let message = match serve(&job, &control, &mut state) {
        Ok(finished) => Message::Finished(Box::new(finished)),
        // build_layer declined the config: its reason, judged `unsupported`, not a crash.
        Err(GraderError::Submission(SubmissionError::Unsupported(why))) => Message::Unsupported { message: why },
        Err(e) => Message::Failed { message: e.to_string() },
    };
    let failed = !matches!(message, Message::Finished(_));
    channel::send(report, &message).map_err(|e| GraderError::Runner(format!("writing the report: {e}")))?;
    if let Some(seq) = state.pending {
        control.ack(seq, if failed { Status::Failed } else { Status::Ok });
    }
    if matches!(job.submission, Chosen::Python(_)) {
        // The report is out. An embedded Python is never finalised, and libtorch's static
        // destructors at exit() would run against it and the driver's teardown: leave without them.
        // SAFETY: ends the process at once; nothing of this process is needed any more.
        unsafe { libc::_exit(i32::from(failed)) };
    }
    Ok(if failed { Outcome::Fail } else { Outcome::Pass })
}

/// The command being served when the runner stopped, acknowledged after the report is written.
#[derive(Default)]
struct State {
    pending: Option<u64>,
}

/// The submission and what observes it. Fields drop in order: the submission before the audit and
/// the recording that watch it, and all of them before the shared buffers they point into.
struct Session<'a> {
    sub: Option<Box<dyn Submission>>,
    /// The range profiler, or the coverage it ended with (unaudited from the start, or lost).
    audit: Result<RangeAudit, Coverage>,
    recording: Recording,
    flush: L2Eviction,
    /// The call the next command of calls starts with.
    next: usize,
    /// The submission's weights for one layer: this process's own copy of the shared ones (see
    /// `shared`); `None` for a stack, which reads the shared ones in place.
    weights: Option<DeviceWeights>,
    shared: SharedData,
    dev: &'a Device,
    cfg: &'a Config,
    calls: Vec<Call>,
    windows: Vec<CallWindow>,
    tampering: Vec<String>,
    /// The calls each audit range held (`None`: build, or no calls), by range number.
    ranges: Vec<Option<(usize, usize)>>,
    runner_us: Vec<CommandTime>,
    l2: Vec<String>,
    build_s: f64,
    name: String,
    /// The GPU work the runner asked for itself, which its tag may cover.
    own: OwnWork,
}

fn serve(job: &Job, control: &Control, state: &mut State) -> Result<Finished, GraderError> {
    let dev = Device::open(job.device)?;
    let calls = schedule(&job.config);
    let shared = SharedData::open(&dev, &job.config, calls.len(), &job.region)?;
    let weights = match shared.layers.as_slice() {
        [one] => Some(
            DeviceWeights::try_from_fn(|t| dev.stream().clone_dtod(one.weights.get(t)))
                .context("copying the weights into the runner's own memory")?,
        ),
        _ => None,
    };
    // Before any code of the submission runs: it may not read the judge's memory.
    sandbox::drop_ptrace().map_err(|e| GraderError::Runner(format!("dropping CAP_SYS_PTRACE: {e}")))?;
    // The runner's own buffers are made before the recording starts: between calls, under its tag,
    // the runner asks the GPU for nothing but its eviction kernel.
    let flush = L2Eviction::new(&dev, EVICTION_L2_MULTIPLE)?;
    dev.synchronize()?;
    let recording = Recording::start()?;
    // A context can start with a persisting-L2 set-aside (seen: 11.25 MiB once the profiler is
    // enabled); the submission starts with none, and any it sets is found at the next command.
    reset_persisting_l2()?;
    // A range for build, one per command of calls, one for teardown.
    let audit = if job.judge_samples {
        Err(Coverage::Unaudited("the judge's own sampling holds the device's monitors".into()))
    } else {
        RangeAudit::enable(dev.ctx(), &AUDIT_METRICS, calls.len() + 3).map_err(|e| Coverage::Unaudited(e.to_string()))
    };
    let mut s = Session {
        dev: &dev,
        cfg: &job.config,
        windows: vec![CallWindow { start_ns: 0, end_ns: 0 }; calls.len()],
        calls,
        shared,
        recording,
        flush,
        next: 0,
        weights,
        audit,
        sub: None,
        tampering: Vec::new(),
        ranges: Vec::new(),
        runner_us: Vec::new(),
        l2: Vec::new(),
        build_s: 0.0,
        name: job.submission.label(),
        own: OwnWork::default(),
    };
    let mut last = 0;
    loop {
        let Posted { seq, kind, arg0, arg1 } = control.next_command(last);
        last = seq;
        state.pending = Some(seq);
        match kind {
            Some(Command::Ping) => {}
            Some(Command::Build) => s.build(&job.submission)?,
            Some(Command::Calls) => s.calls(arg0 as usize, arg1 as usize)?,
            Some(Command::Teardown) => s.teardown()?,
            Some(Command::Report) => return s.finish(arg0),
            None => return Err(GraderError::Runner("the judge posted an unknown command".into())),
        }
        state.pending = None;
        control.ack(seq, Status::Ok);
        // Bookkeeping after the ack, outside the judge's clock, which waits for `ready`.
        if kind == Some(Command::Calls) {
            // The judge reads the outputs and writes the next input, if any, then says so: its context
            // is to be done before the runner's, and the judge's window ends where the judge saw the
            // ack, which on a busy host can be long after it was written (seen: the eviction after
            // the run's last command, 300 us after the ack, inside the judge's window of it).
            let start = Instant::now();
            control.wait_staged(seq, || start.elapsed() > STAGED_WAIT);
            if job.judge_samples {
                // The device stays idle until the sample that holds the window's end is over.
                std::thread::sleep(Duration::from_nanos(QUIET_INTERVALS * SAMPLING_INTERVAL_NS));
            }
        }
        s.after_command(kind)?;
        control.ready(seq);
    }
}

impl Session<'_> {
    fn build(&mut self, chosen: &Chosen) -> Result<(), GraderError> {
        cupti::set_current(Tag::Build);
        let t = Instant::now();
        // The library (or the module, with torch) is loaded only now: everything it does, its
        // initialisers included, is recorded, and it may still start processes.
        let mut sub = chosen.load(self.dev.facts().ordinal, as_runner)?;
        self.push_range(None);
        let (mut layers, _) = self.shared.split(self.weights.as_ref());
        sub.build_stack(self.dev, &mut layers, self.cfg)?;
        self.dev.synchronize()?;
        self.pop_range();
        self.build_s = t.elapsed().as_secs_f64();
        self.name = sub.name().to_string();
        self.sub = Some(sub);
        cupti::set_current(Tag::Outside);
        // From the first call on, no process may be started (build_layer may still run compilers).
        sandbox::forbid_processes().map_err(GraderError::Runner)
    }

    fn calls(&mut self, first: usize, count: usize) -> Result<(), GraderError> {
        let range = first..first.checked_add(count).filter(|&e| e <= self.calls.len()).ok_or_else(|| {
            GraderError::Runner(format!("the judge asked for calls {first}..+{count} of {}", self.calls.len()))
        })?;
        let sub = self.sub.as_mut().ok_or_else(|| GraderError::Runner("calls before build".into()))?;
        if let Some(open) = self.ranges.last_mut() {
            *open = Some((first, count));
        }
        self.next = range.end;
        // The layers are made once per command, before the runner's own stamps; each call only picks
        // its buffers.
        let (mut layers, mut io) = self.shared.split(self.weights.as_ref());
        let t = Instant::now();
        let start_ns = cupti::timestamp()?;
        for i in range.clone() {
            cupti::set_current(Tag::Call(i));
            let call = self.calls[i];
            let (x, hidden, out) = io.for_call(&call);
            sub.stack_step(self.dev, &mut layers, x, call.pos, hidden, out)?;
        }
        self.dev.synchronize()?;
        let end_ns = cupti::timestamp()?;
        self.runner_us.push(CommandTime { first, count, us: t.elapsed().as_secs_f64() * 1e6 });
        cupti::set_current(Tag::Outside);
        for w in &mut self.windows[range] {
            *w = CallWindow { start_ns, end_ns };
        }
        Ok(())
    }

    fn teardown(&mut self) -> Result<(), GraderError> {
        cupti::set_current(Tag::Teardown);
        if let Some(mut sub) = self.sub.take() {
            sub.teardown();
        }
        self.dev.synchronize()?;
        cupti::set_current(Tag::Outside);
        Ok(())
    }

    /// The work between commands: the recording still on, the persisting L2 still off, and the
    /// audit range of the last command of calls closed and the next one opened, with the device
    /// idle again afterwards. All of it under the runner's own tag, which covers only requests from
    /// this thread, and only the kernels counted in `own`.
    fn after_command(&mut self, kind: Option<Command>) -> Result<(), GraderError> {
        // Only commands that ran the submission's code can have changed anything to check.
        if !matches!(kind, Some(Command::Build | Command::Calls | Command::Teardown)) {
            return Ok(());
        }
        cupti::set_current(Tag::Runner);
        let done = self.bookkeeping(kind);
        cupti::set_current(Tag::Outside);
        done
    }

    fn bookkeeping(&mut self, kind: Option<Command>) -> Result<(), GraderError> {
        if matches!(kind, Some(Command::Calls | Command::Teardown)) {
            self.pop_range();
        }
        if matches!(kind, Some(Command::Build | Command::Calls)) {
            self.flush.enqueue(self.dev)?;
            self.own.kernels += 1;
            self.dev.synchronize()?;
            self.push_range(None);
        }
        self.dev.synchronize()?;
        let done = self.runner_us.len();
        for off in self.recording.reassert()? {
            self.tampering.push(format!("{off} callbacks were found switched off after command {done}"));
        }
        let mut limit = 0usize;
        // SAFETY: reads one limit of the current context through a valid out-pointer.
        unsafe { driver::cuCtxGetLimit(&mut limit, CUlimit::CU_LIMIT_PERSISTING_L2_CACHE_SIZE) }
            .result()
            .context("reading the persisting-L2 limit")?;
        if limit != 0 {
            self.l2.push(format!(
                "the persisting-L2 limit was {limit} bytes after {done} command(s) of calls: a set-aside keeps data in \
                 L2 across calls"
            ));
            reset_persisting_l2()?;
        }
        Ok(())
    }

    /// Opens the next audit range, which holds `calls` (filled in when a command of calls runs).
    /// An audit that fails here is over: the run goes on unaudited, with the reason.
    fn push_range(&mut self, calls: Option<(usize, usize)>) {
        let name = format!("range {}", self.ranges.len());
        self.ranges.push(calls);
        if let Ok(a) = self.audit.as_mut()
            && let Err(e) = a.push(&name)
        {
            self.audit = Err(Coverage::Lost(format!("the runner's audit stopped at {name}: {e}")));
        }
    }

    fn pop_range(&mut self) {
        if let Ok(a) = self.audit.as_mut()
            && let Err(e) = a.pop()
        {
            let range = self.ranges.len().saturating_sub(1);
            self.audit = Err(Coverage::Lost(format!("the runner's audit stopped closing range {range}: {e}")));
        }
    }

    fn finish(self, nonce: u64) -> Result<Finished, GraderError> {
        self.dev.synchronize()?;
        let n = self.calls.len();
        let audit = match self.audit {
            Err(coverage) => Audit::without(coverage, n),
            Ok(a) => match a.finish() {
                Err(e) => Audit::without(Coverage::Lost(format!("the runner's audit could not be read: {e}")), n),
                Ok(ranges) => {
                    let mut audit = Audit::without(Coverage::Measured, n);
                    for r in ranges {
                        let number = r.name.strip_prefix("range ").and_then(|k| k.parse::<usize>().ok());
                        let Some(Some((first, count))) = number.and_then(|k| self.ranges.get(k).copied()) else {
                            continue;
                        };
                        let value =
                            |metric| r.values[AUDIT_METRICS.iter().position(|m| *m == metric).expect("audited")];
                        let counters = Counters {
                            bytes_read: value(DRAM_BYTES_READ),
                            bytes_written: value(DRAM_BYTES_WRITE),
                            ctas: value(CTAS_LAUNCHED),
                        };
                        if count == 1 {
                            audit.calls[first] = Some(counters);
                        } else {
                            audit.batches.push(Batch { first, count, counters });
                        }
                    }
                    audit
                }
            },
        };
        let captured = self.recording.finish()?;
        // After the recording: the runner's own kernels are not the submission's.
        let mut weight_vectors_changed = 0;
        if let (Some(own), [shared]) = (&self.weights, self.shared.layers.as_slice()) {
            for &t in Tensor::WEIGHTS {
                weight_vectors_changed += check::vectors_differing(self.dev, own.get(t), shared.weights.get(t))?;
            }
        }
        let record = cupti::record::attribute(captured, &self.windows, self.own, scan_module, self.tampering);
        Ok(Finished {
            nonce,
            name: self.name,
            build_s: self.build_s,
            record,
            audit,
            runner_us: self.runner_us,
            l2: self.l2,
            weight_vectors_changed,
        })
    }
}

/// Runs `work` as the runner's own (a Python submission's output copy, inside its call), then
/// restores the tag of the call: the launch record never counts it as the submission's, and ties it to
/// the call it ran in.
pub fn as_runner(work: &mut dyn FnMut() -> Result<(), SubmissionError>) -> Result<(), SubmissionError> {
    let call = cupti::current();
    cupti::set_current(match call {
        Tag::Call(i) => Tag::RunnerIn(i),
        _ => Tag::Runner,
    });
    let done = work();
    cupti::set_current(call);
    done
}

/// Sets the context's persisting-L2 set-aside to zero and demotes any persisting lines.
fn reset_persisting_l2() -> Result<(), GraderError> {
    // SAFETY: sets one limit of the current context and resets its persisting lines.
    unsafe {
        driver::cuCtxSetLimit(CUlimit::CU_LIMIT_PERSISTING_L2_CACHE_SIZE, 0)
            .result()
            .context("resetting the persisting-L2 limit")?;
        driver::cuCtxResetPersistingL2Cache().result().context("resetting persisting L2 lines")?;
    }
    Ok(())
}

/// What a loaded module may not hold: device-side launches.
fn scan_module(image: &[u8]) -> Vec<String> {
    submission::device_code::scan(image).iter().map(ToString::to_string).collect()
}
