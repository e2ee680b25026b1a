//! The run's report: one JSON document for machines (schema versioned, with a `meta` block) and a
//! table for people.

use std::fmt::Write as _;

use cuda::DeviceFacts;
use serde::Serialize;
use spec::{ByteModel, Config};

use super::isolate::Failure;
use super::verdict::{CacheCheck, Gate, Integrity, StepCheck};
use crate::bandwidth::Bandwidth;
use crate::cupti::StepLaunches;
use crate::stats::Summary;

/// Bumped whenever a field changes meaning or goes away.
pub const SCHEMA_VERSION: u32 = 1;

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

#[derive(Debug, Clone, Serialize)]
pub struct Performance {
    pub tokens_per_s: f64,
    /// Median of the timed steps, each between two device-wide synchronisations.
    pub us_per_call: f64,
    pub floor_us: f64,
    pub x_floor: f64,
    pub achieved_tbps: f64,
    /// Back-to-back calls with one synchronisation at each end.
    pub throughput_us_per_call: f64,
    pub step_us: Summary,
    /// The eager reference's median on the same calls, for scale.
    pub reference_us_per_call: Option<f64>,
    pub bandwidth: Bandwidth,
    pub bytes: ByteModel,
    pub build_s: f64,
    /// The judge's own clock over the runner's timed phase, for the timing cross-check.
    pub timed_wall_us: f64,
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
}

#[derive(Debug, Clone, Serialize)]
pub struct Verdict {
    pub status: Status,
    pub passed: bool,
    pub failed_gates: Vec<&'static str>,
    /// Why a run was cut short (crashed, timeout).
    pub reason: Option<String>,
}

#[derive(Debug, Clone, Serialize)]
pub struct Launches {
    pub submission: Vec<StepLaunches>,
    pub reference: Vec<StepLaunches>,
}

/// The report. A run cut short has a verdict and the meta block, and nothing measured.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub meta: Meta,
    pub verdict: Verdict,
    pub gates: Vec<Gate>,
    pub performance: Option<Performance>,
    pub launches: Launches,
    pub steps: Vec<StepCheck>,
    pub cache: Option<CacheCheck>,
    pub integrity: Option<Integrity>,
    /// Every timed step's time in microseconds, in call order.
    pub raw_step_us: Vec<f64>,
}

impl Report {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        config: Config,
        device: DeviceFacts,
        seeds: Seeds,
        submission: &str,
        gates: Vec<Gate>,
        performance: Performance,
        steps: Vec<StepCheck>,
        cache: CacheCheck,
        integrity: Integrity,
        mine: Vec<StepLaunches>,
        reference: Vec<StepLaunches>,
        raw_step_us: Vec<f64>,
    ) -> Self {
        let failed_gates: Vec<&'static str> = gates.iter().filter(|g| !g.passed).map(|g| g.name).collect();
        let passed = failed_gates.is_empty();
        Self {
            meta: Meta::new(config, device, seeds, submission),
            verdict: Verdict {
                status: if passed { Status::Pass } else { Status::Fail },
                passed,
                failed_gates,
                reason: None,
            },
            gates,
            performance: Some(performance),
            launches: Launches { submission: mine, reference },
            steps,
            cache: Some(cache),
            integrity: Some(integrity),
            raw_step_us,
        }
    }

    /// The report of a run the submission cut short.
    pub fn not_finished(config: Config, device: DeviceFacts, seeds: Seeds, submission: &str, failure: Failure) -> Self {
        let (status, reason) = match failure {
            Failure::Crashed(r) => (Status::Crashed, r),
            Failure::Timeout(r) => (Status::Timeout, r),
        };
        Self {
            meta: Meta::new(config, device, seeds, submission),
            verdict: Verdict { status, passed: false, failed_gates: Vec::new(), reason: Some(reason) },
            gates: Vec::new(),
            performance: None,
            launches: Launches { submission: Vec::new(), reference: Vec::new() },
            steps: Vec::new(),
            cache: None,
            integrity: None,
            raw_step_us: Vec::new(),
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
            (Status::Crashed, _) => format!("VERDICT: CRASHED  {reason}\n"),
            (Status::Timeout, _) => format!("VERDICT: TIMEOUT  {reason}\n"),
            _ => format!("VERDICT: FAIL  ({})\n", v.failed_gates.join(", ")),
        }
    }

    /// The table for people.
    pub fn table(&self) -> String {
        let m = &self.meta;
        let Some(p) = &self.performance else {
            return format!(
                "\npersistent-layer: submission '{}' on {}, config '{}'\n",
                m.submission, m.device.name, m.config.name
            ) + &self.verdict_line();
        };
        let mut s = String::new();
        let _ = writeln!(
            s,
            "\npersistent-layer: submission '{}' on {}, config '{}'",
            m.submission, m.device.name, m.config.name
        );
        let _ = writeln!(s, "  {:<18} {:>10} {:>10}  {:<6} detail", "gate", "measured", "limit", "status");
        for g in &self.gates {
            let status = if g.passed { "PASS" } else { "FAIL" };
            let _ =
                writeln!(s, "  {:<18} {:>10} {:>10}  {:<6} {}", g.name, num(g.value), num(g.limit), status, g.detail);
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
        let _ = writeln!(s, "  back-to-back {:.1} us/call; build_layer {:.2} s", p.throughput_us_per_call, p.build_s);
        let mean =
            |l: &[StepLaunches], f: fn(&StepLaunches) -> f64| l.iter().map(f).sum::<f64>() / l.len().max(1) as f64;
        let (mine, theirs) = (&self.launches.submission, &self.launches.reference);
        let _ = writeln!(
            s,
            "  launches  submission {:.1} kernels/step (share {:.3}) | eager reference {:.1} kernels/step (share {:.3}, {})",
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
