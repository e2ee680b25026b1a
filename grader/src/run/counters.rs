//! The judge's own eyes on the hardware: the device-wide PM sampling of `audit::sampling`, run in the
//! judge's process, turned into each call's DRAM bytes and thread blocks.
//!
//! The judge probes the counters before the runner exists ([`JudgeCounters::probe`]): if they work
//! then, the run is audited, and an audit that stops, fails or goes missing later is a failure
//! (`Coverage::Lost`), whatever stopped it. If they do not (no counters on this device, restricted
//! to root), or the user said `--no-audit`, the run is `Coverage::Unaudited` from the start, and its
//! verdict `UNAUDITED`, never a pass.
//!
//! Each command of calls is a window on CUPTI's clock, from the judge's "go" to its sight of the
//! runner's acknowledgement (the runner synchronised the device before it); the judge leaves the
//! device quiet for a few sampling intervals before each "go" ([`JudgeCounters::quiet`]) and drains
//! the samples after each command, all outside the timed window.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::audit::sampling::{self, DeviceSampler, QUIET_INTERVALS, SAMPLING_INTERVAL_NS, Sample};
use crate::audit::{AUDIT_METRICS, CTAS_LAUNCHED, DRAM_BYTES_READ, DRAM_BYTES_WRITE};
use cuda::Device;

use super::isolate::Stamps;
use super::protocol::{Audit, Batch, Counters, Coverage};

/// How often the drain thread decodes the hardware's samples while no call runs: often enough that
/// the counter data image never fills during a long build (the samples of 10 ms, 100).
const DRAIN_PERIOD: Duration = Duration::from_millis(10);
/// How long after the last command of calls the device counts as idle, for the drain thread (calls
/// follow each other within a few milliseconds; a build or a long read-back takes longer).
const CALLS_APART: Duration = Duration::from_millis(50);
/// How long a command of calls runs before the drain thread drains beside it: no call of the graded
/// layer or a family member runs this long, and the counter data image holds 10 s of samples.
const DRAIN_IN_WINDOW_AFTER: Duration = Duration::from_millis(500);
/// How long the judge waits, after a command, for the samples that cover its end to be decoded.
const COVERED_WAIT: Duration = Duration::from_secs(1);

/// A point read on both clocks, so the judge's `Instant`s convert to CUPTI's nanoseconds.
#[derive(Debug, Clone, Copy)]
struct Anchor {
    instant: Instant,
    cupti_ns: u64,
}

/// Reads of both clocks for one anchor; the tightest pair is kept.
const ANCHOR_TRIES: usize = 8;

impl Anchor {
    /// Both clocks now: CUPTI's read between two `Instant`s, the tightest of [`ANCHOR_TRIES`], its
    /// instant the midpoint. A thread descheduled between two reads (a busy host: seen with 16 busy
    /// threads on 16 cores) would otherwise shift every window of the command by the stall, onto the
    /// runner's L2 eviction before it (thread blocks no call launched) or off the call's own end.
    fn now() -> Result<Anchor, crate::audit::AuditError> {
        let mut best: Option<(Duration, Anchor)> = None;
        for _ in 0..ANCHOR_TRIES {
            let before = Instant::now();
            let cupti_ns = sampling::now_ns()?;
            let gap = before.elapsed();
            if best.is_none_or(|(tightest, _)| gap < tightest) {
                best = Some((gap, Anchor { instant: before + gap / 2, cupti_ns }));
            }
        }
        Ok(best.expect("at least one try").1)
    }

    fn ns(&self, t: Instant) -> u64 {
        match t.checked_duration_since(self.instant) {
            Some(after) => self.cupti_ns + after.as_nanos() as u64,
            None => self.cupti_ns.saturating_sub(self.instant.duration_since(t).as_nanos() as u64),
        }
    }
}

/// What the drain thread and the judge's thread share. The samples kept are those since the last
/// mark, while a command of calls is pending; all others are dropped as they are decoded.
struct Sampling {
    sampler: Option<DeviceSampler>,
    samples: Vec<Sample>,
    /// From this CUPTI time on, samples are kept (a command of calls is pending).
    keep_from: Option<u64>,
    /// Why sampling stopped, once it did.
    stopped: Option<String>,
}

impl Sampling {
    /// Decodes what the hardware completed, keeping only what a pending window may need. A sampler
    /// that fails is dropped (its object disabled) and the reason kept.
    fn drain(&mut self) {
        let Some(sampler) = self.sampler.as_mut() else { return };
        if let Err(e) = sampler.drain(self.keep_from) {
            self.stopped = Some(e.to_string());
            self.sampler = None;
            return;
        }
        self.samples.extend(sampler.take());
    }
}

/// The judge's counters over a run: PM sampling drained by a thread of the judge's, between calls.
pub struct JudgeCounters {
    sampling: Option<Arc<Mutex<Sampling>>>,
    /// While a command of calls runs, when it began (ns after `epoch`; 0: none runs): the drain thread
    /// leaves the CPU and CUPTI alone then, until the command has run [`DRAIN_IN_WINDOW_AFTER`].
    in_window: Arc<AtomicU64>,
    epoch: Instant,
    stop: Arc<AtomicBool>,
    drainer: Option<JoinHandle<()>>,
    /// Measured while sampling runs; otherwise why not.
    coverage: Coverage,
    windows: Vec<Window>,
    anchor: Option<Anchor>,
    /// When the last command of calls was marked (ns after `epoch`).
    last_mark: Arc<AtomicU64>,
}

/// One command of calls as a window on CUPTI's clock (ns).
#[derive(Debug, Clone, Copy, PartialEq)]
struct Window {
    first: usize,
    count: usize,
    start_ns: u64,
    end_ns: u64,
}

impl JudgeCounters {
    /// Starts the device's PM sampling before the submission exists, unless `declined`
    /// (`--no-audit`), and the thread that drains it.
    pub fn probe(dev: &Device, declined: bool) -> JudgeCounters {
        let mut counters = JudgeCounters {
            sampling: None,
            in_window: Arc::new(AtomicU64::new(0)),
            epoch: Instant::now(),
            stop: Arc::new(AtomicBool::new(false)),
            drainer: None,
            coverage: Coverage::Measured,
            windows: Vec::new(),
            anchor: None,
            last_mark: Arc::new(AtomicU64::new(0)),
        };
        if declined {
            counters.coverage = Coverage::Unaudited("the user asked for no audit (--no-audit)".into());
            return counters;
        }
        match DeviceSampler::start(dev.facts().ordinal, dev.ctx().cu_device(), &AUDIT_METRICS) {
            Ok(sampler) => {
                let sampling = Arc::new(Mutex::new(Sampling {
                    sampler: Some(sampler),
                    samples: Vec::new(),
                    keep_from: None,
                    stopped: None,
                }));
                let (shared, in_window, stop) = (sampling.clone(), counters.in_window.clone(), counters.stop.clone());
                let (epoch, last_mark) = (counters.epoch, counters.last_mark.clone());
                counters.drainer = Some(std::thread::spawn(move || {
                    while !stop.load(Ordering::Acquire) {
                        std::thread::sleep(DRAIN_PERIOD);
                        let since = |at: &AtomicU64| {
                            epoch.elapsed().saturating_sub(Duration::from_nanos(at.load(Ordering::Acquire)))
                        };
                        let began = in_window.load(Ordering::Acquire);
                        let idle = began == 0 && since(&last_mark) > CALLS_APART;
                        if idle || (began != 0 && since(&in_window) > DRAIN_IN_WINDOW_AFTER) {
                            lock(&shared).drain();
                        }
                    }
                }));
                counters.sampling = Some(sampling);
            }
            Err(e) => counters.coverage = Coverage::Unaudited(format!("this device's counters cannot be read: {e}")),
        }
        counters
    }

    /// Why nothing will be measured, when nothing will.
    pub fn unaudited(&self) -> Option<&str> {
        match &self.coverage {
            Coverage::Unaudited(why) => Some(why),
            _ => None,
        }
    }

    /// Whether the judge's sampling holds the device's monitors (the runner's range profiler cannot
    /// then have them).
    pub fn sampling(&self) -> bool {
        self.sampling.is_some()
    }

    /// How long the device stays quiet before each "go" while sampling.
    pub fn quiet(&self) -> Duration {
        match self.sampling {
            Some(_) => Duration::from_nanos(QUIET_INTERVALS * SAMPLING_INTERVAL_NS),
            None => Duration::ZERO,
        }
    }

    /// Reads both clocks just before a command of calls; the samples from the first such mark on are
    /// kept. Nothing is decoded here: a decode just before a call was measured to delay it (the
    /// graded layer's timed call by some 200 us), so while calls follow each other the samples wait
    /// in the hardware buffer, and the drain thread decodes them only in long idle stretches.
    pub fn mark(&mut self) {
        let Some(sampling) = self.sampling.clone() else { return };
        match Anchor::now() {
            Ok(anchor) => {
                self.anchor = Some(anchor);
                lock(&sampling).keep_from.get_or_insert(anchor.cupti_ns);
                self.in_window.store(self.epoch.elapsed().as_nanos().max(1) as u64, Ordering::Release);
                self.last_mark.store(self.epoch.elapsed().as_nanos() as u64, Ordering::Release);
            }
            Err(e) => self.lose(format!("the judge's clock for the counters failed: {e}")),
        }
    }

    /// Calls `first..first + count` ran between `stamps`' "go" and acknowledgement.
    pub fn record(&mut self, first: usize, count: usize, stamps: &Stamps) {
        self.in_window.store(0, Ordering::Release);
        let Some(anchor) = self.anchor.take() else { return };
        self.windows.push(Window { first, count, start_ns: anchor.ns(stamps.posted), end_ns: anchor.ns(stamps.acked) });
    }

    /// Decodes until the samples reach past the last window's end, then sums each window.
    fn measure(&mut self, calls: usize) -> Result<Audit, String> {
        let Some(sampling) = self.sampling.clone() else { return Err("sampling stopped".into()) };
        let Some(last) = self.windows.last().copied() else { return Err("the judge's audit measured no call".into()) };
        let asked = Instant::now();
        let mut s = lock(&sampling);
        loop {
            s.drain();
            if let Some(why) = s.stopped.take() {
                return Err(format!("the judge's audit stopped: {why}"));
            }
            if s.samples.last().is_some_and(|x| x.end_ns >= last.end_ns) {
                break;
            }
            if asked.elapsed() > COVERED_WAIT {
                return Err(format!(
                    "no sample of the judge's audit covered the end of call {} within {} s: the counters stopped \
                     reporting",
                    last.first + last.count - 1,
                    COVERED_WAIT.as_secs()
                ));
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        let mut audit = Audit::without(Coverage::Measured, calls);
        for w in &self.windows {
            let Some(counters) = window_counters(&s.samples, w.start_ns, w.end_ns) else {
                return Err(format!(
                    "no sample of the judge's audit covers call {} (its window {}..{} ns on CUPTI's clock)",
                    w.first, w.start_ns, w.end_ns
                ));
            };
            if w.count == 1 {
                audit.calls[w.first] = Some(counters);
            } else {
                audit.batches.push(Batch { first: w.first, count: w.count, counters });
            }
        }
        Ok(audit)
    }

    fn lose(&mut self, reason: String) {
        self.halt();
        if self.coverage == Coverage::Measured {
            self.coverage = Coverage::Lost(format!(
                "{reason} (if another profiler started on this GPU during the run, run again without it)"
            ));
        }
    }

    /// Stops the drain thread and the sampling.
    fn halt(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(t) = self.drainer.take() {
            let _ = t.join();
        }
        self.sampling = None;
    }

    /// Ends sampling: each call's counters (each batch's, for back-to-back calls).
    pub fn finish(mut self, calls: usize) -> Audit {
        // The drain thread first, so that the last decode is this thread's alone.
        self.stop.store(true, Ordering::Release);
        if let Some(t) = self.drainer.take() {
            let _ = t.join();
        }
        if self.coverage == Coverage::Measured {
            match self.measure(calls) {
                Ok(audit) => {
                    self.halt();
                    return audit;
                }
                Err(reason) => self.lose(reason),
            }
        }
        Audit::without(self.coverage.clone(), calls)
    }
}

impl Drop for JudgeCounters {
    fn drop(&mut self) {
        self.halt();
    }
}

/// The drain thread never panics while holding the lock; a poisoned one still holds valid samples.
fn lock(m: &Mutex<Sampling>) -> MutexGuard<'_, Sampling> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// The sums of the samples overlapping a window, or `None` when none does.
fn window_counters(samples: &[Sample], start_ns: u64, end_ns: u64) -> Option<Counters> {
    let metric = |name: &str| AUDIT_METRICS.iter().position(|m| *m == name).expect("an audit metric");
    let sum = |name| sampling::window_sum(samples, start_ns, end_ns, metric(name));
    let (bytes_read, covering) = sum(DRAM_BYTES_READ);
    (covering > 0).then(|| Counters { bytes_read, bytes_written: sum(DRAM_BYTES_WRITE).0, ctas: sum(CTAS_LAUNCHED).0 })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_anchor_converts_instants_either_side_of_it() {
        let instant = Instant::now();
        let a = Anchor { instant, cupti_ns: 1_000_000 };
        assert_eq!(a.ns(instant + Duration::from_micros(5)), 1_005_000);
        assert_eq!(a.ns(instant), 1_000_000);
        if let Some(before) = instant.checked_sub(Duration::from_micros(3)) {
            assert_eq!(a.ns(before), 997_000);
        }
    }
}
