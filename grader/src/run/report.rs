//! The run's report: one JSON document for machines (schema versioned, with a `meta` block) and a
//! table for people.

use std::fmt::Write as _;

use cuda::DeviceFacts;
use serde::Serialize;
use spec::{ByteModel, Config};

use super::append::Faulty;
use super::gates::{CacheCheck, Gate, Integrity, Source, StepCheck};
use super::isolate::Failure;
use super::load::{HostLoad, Moment};
use super::protocol::{Audit, Coverage};
use super::watch::Watched;
use crate::bandwidth::Bandwidth;
use crate::cupti::{Record, StepLaunches, kernel_bounds};
use crate::stats::Summary;

/// Bumped whenever a field changes meaning or goes away (3: `audit` is the judge's own sampling,
/// `runner_audit` the runner's range profiler, `appends` every call's K/V slot, coverage `lost`;
/// 4: the back-to-back phase's attempts; 5: the coverage rule its own gate, `record_coverage`, and
/// the status `host_busy`; 6: `host_busy` also from the read after the run, `performance.host_after`,
/// and `watched.leftovers`).
pub const SCHEMA_VERSION: u32 = 6;

/// The seeds of a run: the weights' is public; the inputs' is drawn fresh and disclosed afterwards.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Seeds {
    pub weights: u64,
    pub inputs: u64,
}

#[derive(Debug, Clone, Serialize)]
pub struct Meta {
    pub schema_version: u32,
    pub grader_version: &'static str,
    pub git_revision: &'static str,
    pub argv: Vec<String>,
    pub device: DeviceFacts,
    pub config: Config,
    pub seeds: Seeds,
    pub submission: String,
}

impl Meta {
    fn new(config: Config, device: DeviceFacts, seeds: Seeds, submission: &str) -> Self {
        Self {
            schema_version: SCHEMA_VERSION,
            grader_version: env!("CARGO_PKG_VERSION"),
            git_revision: env!("GRADER_GIT_REVISION"),
            argv: std::env::args().collect(),
            device,
            config,
            seeds,
            submission: submission.into(),
        }
    }
}

/// The speed figures, all on the judge's clock.
#[derive(Debug, Clone, Serialize)]
pub struct Performance {
    pub tokens_per_s: f64,
    /// Median of the timed calls, each run alone with the device idle and L2 flushed before it.
    pub us_per_call: f64,
    pub floor_us: f64,
    pub x_floor: f64,
    pub achieved_tbps: f64,
    /// The back-to-back phase (each call's input the previous call's output, no flush, no
    /// synchronisation between calls): the time per call of its judged attempt, the first whose
    /// window the record covers.
    pub throughput_us_per_call: f64,
    /// Every attempt of the back-to-back phase, its time per call, in order.
    pub attempts_us_per_call: Vec<f64>,
    /// Which of them is `throughput_us_per_call` (from 0).
    pub judged_attempt: usize,
    pub step_us: Summary,
    /// A no-op command's round trip between the judge and the runner: the clock's own cost.
    pub signal_round_trip_us: Summary,
    /// The judge's time of a timed call less the runner's own clock over the same call.
    pub pacing_overhead_us: Option<Summary>,
    /// The eager reference's median on the same calls, for scale.
    pub reference_us_per_call: Option<f64>,
    /// The fastest plausible call: the byte model at the read-only ceiling, less its margin.
    pub read_bound_us: f64,
    pub bandwidth: Bandwidth,
    pub bytes: ByteModel,
    pub build_s: f64,
    /// What each timed call spent beside its kernels; `None` when no timed call recorded a kernel.
    pub host: Option<HostShare>,
    /// The host's runnable threads before the submission started (the judge's own read); `None`
    /// where it cannot be read.
    pub host_before: Option<HostLoad>,
    /// The same read after the run, the runner and all it left behind ended; taken only where
    /// `record_coverage` failed, `None` elsewhere.
    pub host_after: Option<HostLoad>,
}

impl Performance {
    /// What the judge saw of a busy host, before the run or else after it; `None` on a quiet host.
    pub fn busy_host(&self) -> Option<String> {
        let busy = |h: Option<HostLoad>, when| h.filter(HostLoad::busy).map(|h| h.said(when));
        busy(self.host_before, Moment::Before).or_else(|| busy(self.host_after, Moment::After))
    }
}

/// Where a timed call's time went beside its kernels, from the runner's stamps around the call and
/// CUPTI's kernel records: both the runner's word, so reported and never judged. With the judge's
/// signalling (`pacing_overhead_us`) they make up the difference between the judge's figure and the
/// kernels' own time.
#[derive(Debug, Clone, Serialize)]
pub struct HostShare {
    /// From the runner entering `layer_step` to the first kernel's start: the launch path (the API
    /// call, the driver, the recording) and the GPU picking the work up.
    pub launch_us: Summary,
    /// From the last kernel's end to the runner's device synchronisation returning.
    pub completion_us: Summary,
}

impl HostShare {
    /// Over the record's calls `calls`; `None` when none of them has a window and a kernel.
    pub fn of(record: &Record, calls: impl IntoIterator<Item = usize>) -> Option<HostShare> {
        let (mut launch, mut completion) = (Vec::new(), Vec::new());
        for i in calls {
            let (Some(window), Some((first, last))) =
                (record.windows.get(i), record.activities.get(i).and_then(|a| kernel_bounds(a)))
            else {
                continue;
            };
            launch.push(us_between(window.start_ns, first));
            completion.push(us_between(last, window.end_ns));
        }
        Some(HostShare { launch_us: Summary::of(&launch)?, completion_us: Summary::of(&completion)? })
    }
}

/// Microseconds from `earlier` to `later` (ns stamps), negative if `later` is earlier.
fn us_between(earlier: u64, later: u64) -> f64 {
    // Through i64: the stamps are near 2^61, where an f64 no longer holds whole nanoseconds.
    later.wrapping_sub(earlier) as i64 as f64 / 1e3
}

/// How a run ended: judged (pass or fail by the gates), or cut short by the submission.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Status {
    Pass,
    Fail,
    /// The submission's process died or reported an error: nothing could be judged.
    Crashed,
    /// The submission went quiet and the watchdog killed it.
    Timeout,
    /// The submission's `build_layer` declined the config as one it does not implement (an honest
    /// refusal, with its reason): nothing could be judged, and the run does not pass.
    Unsupported,
    /// Every gate passed but the hardware counters, which could not be read from the start (the
    /// device allows none here, or `--no-audit`): not a pass.
    Unaudited,
    /// Every gate passed but `record_coverage`, on a host the judge saw busy before the submission
    /// started or after the run: its stalls make windows short of recorded work as hidden work does, so the run is not
    /// judged, and it is never a pass (a submission can starve its own runner).
    HostBusy,
}

#[derive(Debug, Clone, Serialize)]
pub struct Verdict {
    pub status: Status,
    pub passed: bool,
    pub failed_gates: Vec<&'static str>,
    /// Why a run was cut short (crashed, timeout, unsupported) or not judged (host busy).
    pub reason: Option<String>,
    /// Why the hardware counters were not read, when they were not from the start.
    pub unaudited: Option<String>,
}

#[derive(Debug, Clone, Serialize)]
pub struct Launches {
    pub submission: Vec<StepLaunches>,
    pub reference: Vec<StepLaunches>,
}

/// The report. A run cut short has a verdict, the meta block and the process watch, and nothing
/// measured.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub meta: Meta,
    pub verdict: Verdict,
    pub gates: Vec<Gate>,
    pub performance: Option<Performance>,
    pub launches: Launches,
    pub steps: Vec<StepCheck>,
    pub cache: Option<CacheCheck>,
    /// Every appended K/V row that was not as the reference's, by call, layer and tensor.
    pub appends: Vec<Faulty>,
    pub integrity: Option<Integrity>,
    /// The judge's audit: the hardware's counters per call (its own PM sampling), or why there are
    /// none.
    pub audit: Option<Audit>,
    /// The runner's range profiler over the same calls (the runner's word), or why it measured
    /// nothing: a cross-check of the judge's.
    pub runner_audit: Option<Audit>,
    /// The judge's watch of the device's processes.
    pub watched: Watched,
    /// The runner's record of every call's GPU work (the runner's word), activities included.
    pub record: Option<Record>,
    /// Every call's time on the judge's clock in microseconds (null for the back-to-back calls).
    pub raw_call_us: Vec<Option<f64>>,
}

/// What a judged run hands the report.
pub struct Judged {
    pub config: Config,
    pub device: DeviceFacts,
    pub seeds: Seeds,
    pub submission: String,
    pub gates: Vec<Gate>,
    pub performance: Performance,
    pub steps: Vec<StepCheck>,
    pub cache: CacheCheck,
    pub appends: Vec<Faulty>,
    pub integrity: Integrity,
    pub launches: Launches,
    pub audit: Audit,
    pub runner_audit: Audit,
    pub watched: Watched,
    pub record: Record,
    pub call_us: Vec<Option<f64>>,
}

impl Report {
    pub fn judged(j: Judged) -> Self {
        let failed_gates: Vec<&'static str> = j.gates.iter().filter(|g| !g.passed).map(|g| g.name).collect();
        let passed = failed_gates.is_empty();
        let unaudited = match &j.audit.coverage {
            Coverage::Unaudited(why) => Some(why.clone()),
            _ => None,
        };
        // Unaudited from the start, and nothing else wrong: the counters' gate is the only one failed.
        // Only the rule a host's stalls can fail failed, on a host seen busy before or after the run:
        // not judged.
        let busy = j.performance.busy_host();
        let (status, reason) = match (passed, &unaudited, busy) {
            (true, _, _) => (Status::Pass, None),
            (false, Some(_), _) if failed_gates == ["bytes_read"] => (Status::Unaudited, None),
            (false, _, Some(busy)) if failed_gates == ["record_coverage"] => (Status::HostBusy, Some(busy)),
            (false, _, _) => (Status::Fail, None),
        };
        Self {
            meta: Meta::new(j.config, j.device, j.seeds, &j.submission),
            verdict: Verdict { status, passed, failed_gates, reason, unaudited },
            gates: j.gates,
            performance: Some(j.performance),
            launches: j.launches,
            steps: j.steps,
            cache: Some(j.cache),
            appends: j.appends,
            integrity: Some(j.integrity),
            audit: Some(j.audit),
            runner_audit: Some(j.runner_audit),
            watched: j.watched,
            record: Some(j.record),
            raw_call_us: j.call_us,
        }
    }

    /// The report of a run the submission cut short.
    pub fn not_finished(
        config: Config,
        device: DeviceFacts,
        seeds: Seeds,
        submission: &str,
        failure: Failure,
        watched: Watched,
    ) -> Self {
        let (status, reason) = match failure {
            Failure::Crashed(r) => (Status::Crashed, r),
            Failure::Timeout(r) => (Status::Timeout, r),
            Failure::Unsupported(r) => (Status::Unsupported, r),
        };
        Self {
            meta: Meta::new(config, device, seeds, submission),
            verdict: Verdict { status, passed: false, failed_gates: Vec::new(), reason: Some(reason), unaudited: None },
            gates: Vec::new(),
            performance: None,
            launches: Launches { submission: Vec::new(), reference: Vec::new() },
            steps: Vec::new(),
            cache: None,
            appends: Vec::new(),
            integrity: None,
            audit: None,
            runner_audit: None,
            watched,
            record: None,
            raw_call_us: Vec::new(),
        }
    }

    /// The last line of the table, alone with `--quiet`.
    pub fn verdict_line(&self) -> String {
        let v = &self.verdict;
        let reason = v.reason.as_deref().unwrap_or("");
        match (v.status, &self.performance) {
            (Status::Pass, Some(p)) => {
                format!("VERDICT: PASS  {:.1} tokens/s, {:.3}x floor\n", p.tokens_per_s, p.x_floor)
            }
            (Status::Unaudited, Some(p)) => format!(
                "VERDICT: UNAUDITED  {:.1} tokens/s, {:.3}x floor, not a pass: {}\n",
                p.tokens_per_s,
                p.x_floor,
                v.unaudited.as_deref().unwrap_or("the counters were not read")
            ),
            (Status::Crashed, _) => format!("VERDICT: CRASHED  {reason}\n"),
            (Status::Timeout, _) => format!("VERDICT: TIMEOUT  {reason}\n"),
            (Status::Unsupported, _) => format!("VERDICT: UNSUPPORTED  {reason}\n"),
            (Status::HostBusy, _) => format!("VERDICT: HOST BUSY  not judged, not a pass: {reason}\n"),
            _ => format!("VERDICT: FAIL  ({})\n", v.failed_gates.join(", ")),
        }
    }

    /// The table for people.
    pub fn table(&self) -> String {
        let m = &self.meta;
        let left = self.watched.describe_leftovers().map(|l| format!("  warning   {l}\n")).unwrap_or_default();
        let Some(p) = &self.performance else {
            return format!(
                "\npersistent-layer: submission '{}' on {}, config '{}'\n",
                m.submission, m.device.name, m.config.name
            ) + &left
                + &self.verdict_line();
        };
        let mut s = String::new();
        let _ = writeln!(
            s,
            "\npersistent-layer: submission '{}' on {}, config '{}'",
            m.submission, m.device.name, m.config.name
        );
        let _ = writeln!(s, "  {:<17} {:>10} {:>10}  {:<6} {:<8} detail", "gate", "measured", "limit", "status", "by");
        for g in &self.gates {
            let status = if g.passed { "PASS" } else { "FAIL" };
            let by = match g.source {
                Source::Judge => "judge",
                Source::Runner => "runner",
                Source::Hardware => "counters",
            };
            let _ = writeln!(
                s,
                "  {:<17} {:>10} {:>10}  {:<6} {by:<8} {}",
                g.name,
                num(g.value),
                num(g.limit),
                status,
                g.detail
            );
        }
        let st = &p.step_us;
        let _ = writeln!(
            s,
            "  speed     {:.1} tokens/s = {:.1} us/call (median of {}, p10 {:.1}, p90 {:.1}, 95% CI {:.1}..{:.1})",
            p.tokens_per_s, p.us_per_call, st.n, st.p10, st.p90, st.median_ci95.0, st.median_ci95.1
        );
        let _ = writeln!(
            s,
            "  floor     {:.1} us = {} bytes / {:.3} TB/s measured copy  ->  {:.3}x floor, {:.2} TB/s achieved",
            p.floor_us, p.bytes.total, p.bandwidth.floor_tbps, p.x_floor, p.achieved_tbps
        );
        let attempts = match p.attempts_us_per_call.as_slice() {
            [] | [_] => String::new(),
            all => format!(
                ", attempt {} of {} ({} us)",
                p.judged_attempt + 1,
                all.len(),
                all.iter().map(|us| format!("{us:.1}")).collect::<Vec<_>>().join(", ")
            ),
        };
        let _ = writeln!(
            s,
            "  back-to-back {:.1} us/call (chained inputs, no flush{attempts}); read-only bound {:.1} us; build_layer \
             {:.2} s",
            p.throughput_us_per_call, p.read_bound_us, p.build_s
        );
        let _ = writeln!(
            s,
            "  clock     judge's own; signal round trip {:.1} us (median){}",
            p.signal_round_trip_us.median,
            p.pacing_overhead_us.as_ref().map_or(String::new(), |o| format!(
                "; judge minus runner clock {:.1} us per timed call (median)",
                o.median
            ))
        );
        if let Some(h) = &p.host {
            let _ = writeln!(
                s,
                "  host      per timed call beside its kernels: {:.1} us from entering layer_step to the first kernel, \
                 {:.1} us from the last kernel to synchronised (medians; the runner's stamps and CUPTI's)",
                h.launch_us.median, h.completion_us.median
            );
        }
        if let Some(busy) = p.busy_host() {
            let _ = writeln!(s, "  warning   {busy}");
        }
        s += &left;
        let mean =
            |l: &[StepLaunches], f: fn(&StepLaunches) -> f64| l.iter().map(f).sum::<f64>() / l.len().max(1) as f64;
        let (mine, theirs) = (&self.launches.submission, &self.launches.reference);
        let _ = writeln!(
            s,
            "  launches  submission {:.1} kernels/call (share {:.3}) | eager reference {:.1} kernels/call (share {:.3}, {})",
            mean(mine, |l| l.kernels as f64),
            mean(mine, |l| l.dominant_share),
            mean(theirs, |l| l.kernels as f64),
            mean(theirs, |l| l.dominant_share),
            p.reference_us_per_call.map_or("untimed".into(), |us| format!("{us:.1} us/call")),
        );
        s + &self.verdict_line()
    }
}

/// A figure in the table: scientific for small values, plain otherwise.
fn num(v: f64) -> String {
    if !v.is_finite() {
        format!("{v}")
    } else if v != 0.0 && v.abs() < 0.01 {
        format!("{v:.2e}")
    } else {
        format!("{v:.3}")
    }
}

#[cfg(test)]
mod tests {
    use spec::{Call, Phase};

    use super::*;

    fn facts() -> DeviceFacts {
        DeviceFacts {
            ordinal: 0,
            name: "test card".into(),
            compute_capability: (9, 0),
            sms: 132,
            l2_bytes: 60 << 20,
            total_mem_bytes: 1 << 37,
            free_mem_bytes_at_open: 1 << 37,
            sm_clock_mhz: 1980,
            mem_clock_mhz: 3201,
            mem_bus_bits: 6144,
            max_smem_optin_bytes: 232_448,
            cooperative_launch: true,
            driver_cuda_version: 13000,
            pci_bus_id: "00000000:19:00.0".into(),
        }
    }

    fn summary(v: f64) -> Summary {
        Summary::of(&[v, v * 1.01, v * 0.99]).unwrap()
    }

    fn watched() -> Watched {
        Watched { unavailable: None, polls: 100, intruders: vec![], leftovers: Default::default() }
    }

    fn gate(name: &'static str, passed: bool, value: f64) -> Gate {
        Gate { name, source: Source::Runner, passed, value, limit: 2.0, detail: format!("{value}") }
    }

    /// A judged run of the tiny config with these gates, the host as the judge saw it before.
    fn judged(gates: Vec<Gate>, host_before: Option<HostLoad>) -> Report {
        judged_with(gates, host_before, None, watched())
    }

    /// [`judged`], with the host as the judge saw it after the run and what its watch saw.
    fn judged_with(
        gates: Vec<Gate>,
        host_before: Option<HostLoad>,
        host_after: Option<HostLoad>,
        watched: Watched,
    ) -> Report {
        let cfg = Config::tiny();
        let bw = Bandwidth {
            buffer_bytes: 1 << 31,
            copy_tbps: summary(3.9),
            read_tbps: summary(4.5),
            read_bulk_tbps: Some(summary(4.55)),
            read_ceiling_tbps: 4.55,
            driver_copy_tbps: summary(4.26),
            floor_tbps: 4.26,
        };
        let performance = Performance {
            tokens_per_s: 2000.0,
            us_per_call: 500.0,
            floor_us: 400.0,
            x_floor: 1.25,
            achieved_tbps: 3.4,
            throughput_us_per_call: 490.0,
            attempts_us_per_call: vec![1490.0, 490.0, 491.0],
            judged_attempt: 1,
            step_us: summary(500.0),
            signal_round_trip_us: summary(0.5),
            pacing_overhead_us: Some(summary(4.0)),
            reference_us_per_call: Some(630.0),
            read_bound_us: 380.0,
            bandwidth: bw,
            bytes: ByteModel::of(&cfg),
            build_s: 0.1,
            host: None,
            host_before,
            host_after,
        };
        let call = Call { index: 0, phase: Phase::Timed, pos: cfg.prefill, input: spec::Input::Fresh };
        Report::judged(Judged {
            config: cfg,
            device: facts(),
            seeds: Seeds { weights: 1, inputs: 2 },
            submission: "reference".into(),
            gates,
            performance,
            steps: vec![StepCheck {
                call,
                layer: 0,
                rel_err: Some(1e-3),
                contribution_err: Some(3e-3),
                update_layer: 0,
            }],
            cache: CacheCheck { prefix_differing: 0, unused_differing: 0, written_rel_err: Some(1e-3) },
            appends: vec![],
            integrity: Integrity { weight_vectors_changed: 0, inputs_changed: 0 },
            launches: Launches { submission: vec![], reference: vec![] },
            audit: Audit::without(Coverage::Unaudited("no counters".into()), 1),
            runner_audit: Audit::without(Coverage::Unaudited("no counters".into()), 1),
            watched,
            record: Record {
                build: StepLaunches::of(&[]),
                calls: vec![],
                activities: vec![],
                api_launches: vec![],
                modules: 0,
                profiler_kernels: 0,
                runner_copies: vec![],
                problems: vec![],
                windows: vec![],
            },
            call_us: vec![Some(500.0)],
        })
    }

    const BUSY: Option<HostLoad> = Some(HostLoad { runnable: 16, cpus: 16 });

    /// The JSON a failed run writes reads back with the fields people and scripts rely on.
    #[test]
    fn json_round_trip_of_a_failed_run() {
        let r = judged(vec![gate("correctness", true, 1e-3), gate("kernels_per_step", false, 21.0)], BUSY);
        let doc: serde_json::Value = serde_json::from_str(&serde_json::to_string(&r).unwrap()).unwrap();
        assert_eq!(doc["meta"]["schema_version"], SCHEMA_VERSION);
        assert_eq!(doc["meta"]["seeds"]["inputs"], 2);
        assert_eq!(doc["verdict"]["status"], "fail");
        assert_eq!(doc["verdict"]["failed_gates"][0], "kernels_per_step");
        assert_eq!(doc["verdict"]["unaudited"], "no counters");
        assert_eq!(doc["gates"][1]["value"], 21.0);
        assert_eq!(doc["gates"][1]["source"], "runner");
        assert_eq!(doc["performance"]["x_floor"], 1.25);
        assert_eq!(doc["steps"][0]["call"]["phase"], "timed");
        assert!(r.verdict_line().starts_with("VERDICT: FAIL"));
        assert!(r.table().contains("runner"), "the table says who measured each gate");
        assert!(r.table().contains("attempt 2 of 3 (1490.0, 490.0, 491.0 us)"), "{}", r.table());
        assert!(r.table().contains("warning   the host was busy before the submission started"), "{}", r.table());
        assert_eq!(doc["performance"]["host_before"]["runnable"], 16);
    }

    /// Only the coverage rule failed, on a host the judge saw busy before the run: not judged, and
    /// not a pass; on a quiet host, or beside any other failure, a fail as ever.
    #[test]
    fn a_busy_host_failing_only_coverage_is_not_judged_and_never_passes() {
        let covered = |passed| vec![gate("correctness", true, 1e-3), gate("record_coverage", passed, 0.2)];
        let r = judged(covered(false), BUSY);
        assert!(r.verdict.status == Status::HostBusy && !r.verdict.passed, "{:?}", r.verdict);
        let line = r.verdict_line();
        assert!(line.starts_with("VERDICT: HOST BUSY  not judged, not a pass: the host was busy"), "{line}");
        assert!(line.contains("16 runnable threads besides the judge on 16 CPUs"), "{line}");
        let doc = serde_json::to_value(&r).unwrap();
        assert_eq!(doc["verdict"]["status"], "host_busy");
        assert_eq!(doc["verdict"]["failed_gates"][0], "record_coverage");
        assert_eq!(judged(covered(true), BUSY).verdict.status, Status::Pass);
        let quiet = Some(HostLoad { runnable: 2, cpus: 16 });
        for host in [quiet, None] {
            assert_eq!(judged(covered(false), host).verdict.status, Status::Fail, "{host:?}");
        }
        let mut also = covered(false);
        also.push(gate("bytes_read", false, 0.5));
        let r = judged(also, BUSY);
        assert!(r.verdict.status == Status::Fail && r.verdict_line().starts_with("VERDICT: FAIL"), "{:?}", r.verdict);
    }

    /// A host quiet before the run and busy after it (the submission's processes all ended) is as
    /// busy for the verdict, and said as seen after; quiet both times, the failure stands.
    #[test]
    fn a_host_busy_after_the_run_is_not_judged_either() {
        let covered = vec![gate("correctness", true, 1e-3), gate("record_coverage", false, 0.2)];
        let quiet = Some(HostLoad { runnable: 1, cpus: 16 });
        let r = judged_with(covered.clone(), quiet, BUSY, watched());
        assert_eq!(r.verdict.status, Status::HostBusy, "{:?}", r.verdict);
        assert!(
            r.verdict_line().contains("busy after the run, every process of the submission's gone"),
            "{}",
            r.verdict_line()
        );
        assert_eq!(serde_json::to_value(&r).unwrap()["performance"]["host_after"]["runnable"], 16);
        assert_eq!(judged_with(covered, quiet, quiet, watched()).verdict.status, Status::Fail);
    }

    /// Processes the submission left behind are named in a warning line, the verdict untouched.
    #[test]
    fn leftovers_are_said_beside_the_verdict() {
        let mut w = watched();
        let left = |pid, name: &str| submission::child::Left { pid, name: name.into() };
        w.leftovers.killed = vec![left(41, "sleep"), left(42, "spin")];
        let r = judged_with(vec![gate("correctness", true, 1e-3)], None, None, w);
        assert_eq!(r.verdict.status, Status::Pass);
        let table = r.table();
        assert!(
            table.contains("warning   the submission left 2 process(es) running after its runner exited (sleep (41), spin (42)): the judge killed them"),
            "{table}"
        );
        assert_eq!(serde_json::to_value(&r).unwrap()["watched"]["leftovers"]["killed"][1]["pid"], 42);
        assert!(!judged(vec![gate("correctness", true, 1e-3)], None).table().contains("left"), "none, none said");
    }

    /// The host's share is measured from the runner's window to the first kernel's start and from the
    /// last kernel's end, over the calls asked for; calls without a kernel count nowhere.
    #[test]
    fn host_share_splits_a_call_around_its_kernels() {
        use crate::cupti::{Activity, ActivityKind, CallWindow};
        let base = 1u64 << 61; // stamps as large as CUPTI's, where f64 loses nanoseconds
        let window = |start: u64, end: u64| CallWindow { start_ns: base + start, end_ns: base + end };
        let kernel = |start: u64, end: u64| Activity::synthetic(ActivityKind::Kernel, "k", base + start, base + end);
        let copy = Activity::synthetic(ActivityKind::Memcpy, "c", base, base + 1_000_000);
        let record = Record {
            build: StepLaunches::of(&[]),
            calls: vec![],
            activities: vec![
                vec![kernel(9_001, 400_000), kernel(400_500, 410_000), copy.clone()],
                vec![kernel(7_000, 407_000)],
                vec![copy],
                vec![kernel(1_000, 2_000)],
            ],
            api_launches: vec![],
            modules: 0,
            profiler_kernels: 0,
            runner_copies: vec![],
            problems: vec![],
            windows: vec![window(0, 413_000), window(0, 410_500), window(0, 500_000), window(0, 3_000)],
        };
        let h = HostShare::of(&record, [0, 1, 2]).unwrap();
        assert_eq!(h.launch_us.n, 2, "the call without a kernel is left out");
        assert_eq!((h.launch_us.min, h.launch_us.max), (7.0, 9.001));
        assert_eq!((h.completion_us.min, h.completion_us.max), (3.0, 3.5));
        assert!(HostShare::of(&record, [2]).is_none());
        assert!(HostShare::of(&record, [7]).is_none(), "a call past the record is no call");
    }

    /// A run the submission cut short says so, with its reason, and measures nothing.
    #[test]
    fn crashed_and_timed_out_runs_report_their_reason() {
        for (failure, status) in [
            (Failure::Crashed("illegal address".into()), "crashed"),
            (Failure::Timeout("quiet".into()), "timeout"),
            (Failure::Unsupported("ffn = 53248 is over the megakernel's 28672".into()), "unsupported"),
        ] {
            let r =
                Report::not_finished(Config::tiny(), facts(), Seeds { weights: 1, inputs: 2 }, "x", failure, watched());
            let doc: serde_json::Value = serde_json::to_value(&r).unwrap();
            assert_eq!(doc["verdict"]["status"], status);
            assert_eq!(doc["verdict"]["passed"], false);
            assert!(doc["performance"].is_null());
            assert!(r.verdict_line().contains(&status.to_uppercase()), "{}", r.verdict_line());
        }
    }

    /// A declined config is its own verdict, quoting the submission's reason, in the table, the
    /// quiet line and the JSON; it does not pass.
    #[test]
    fn an_unsupported_config_is_its_own_verdict_with_its_reason() {
        let why = "ffn = 53248 is over the megakernel's 28672";
        let failure = Failure::Unsupported(why.into());
        let seeds = Seeds { weights: 1, inputs: 2 };
        let r = Report::not_finished(Config::tiny(), facts(), seeds, "megakernel", failure, watched());
        assert_eq!(r.verdict_line(), format!("VERDICT: UNSUPPORTED  {why}\n"));
        assert!(r.table().ends_with(&format!("VERDICT: UNSUPPORTED  {why}\n")), "{}", r.table());
        assert!(r.table().contains("submission 'megakernel'"), "{}", r.table());
        assert!(!r.verdict.passed && r.verdict.status == Status::Unsupported);
        let doc: serde_json::Value = serde_json::from_str(&serde_json::to_string_pretty(&r).unwrap()).unwrap();
        assert_eq!(doc["verdict"]["status"], "unsupported");
        assert_eq!(doc["verdict"]["reason"], why);
        assert_eq!(doc["verdict"]["passed"], false);
        assert!(doc["gates"].as_array().unwrap().is_empty() && doc["performance"].is_null());
    }
}
