//! The run's report: one JSON document for machines (schema versioned, with a `meta` block) and a
//! table for people.

use std::fmt::Write as _;

use cuda::DeviceFacts;
use serde::Serialize;
use spec::{ByteModel, Config};

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
}

#[derive(Debug, Clone, Serialize)]
pub struct Verdict {
    pub passed: bool,
    pub failed_gates: Vec<&'static str>,
}

#[derive(Debug, Clone, Serialize)]
pub struct Launches {
    pub submission: Vec<StepLaunches>,
    pub reference: Vec<StepLaunches>,
}

#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub meta: Meta,
    pub verdict: Verdict,
    pub gates: Vec<Gate>,
    pub performance: Performance,
    pub launches: Launches,
    pub steps: Vec<StepCheck>,
    pub cache: CacheCheck,
    pub integrity: Integrity,
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
        Self {
            meta: Meta {
                schema_version: SCHEMA_VERSION,
                grader_version: env!("CARGO_PKG_VERSION"),
                git_revision: env!("GRADER_GIT_REVISION"),
                argv: std::env::args().collect(),
                device,
                config,
                seeds,
                submission: submission.into(),
            },
            verdict: Verdict { passed: failed_gates.is_empty(), failed_gates },
            gates,
            performance,
            launches: Launches { submission: mine, reference },
            steps,
            cache,
            integrity,
            raw_step_us,
        }
    }

    /// The last line of the table, alone with `--quiet`.
    pub fn verdict_line(&self) -> String {
        if self.verdict.passed {
            format!(
                "VERDICT: PASS  {:.1} tokens/s, {:.3}x floor\n",
                self.performance.tokens_per_s, self.performance.x_floor
            )
        } else {
            format!("VERDICT: FAIL  ({})\n", self.verdict.failed_gates.join(", "))
        }
    }

    /// The table for people.
    pub fn table(&self) -> String {
        let (m, p) = (&self.meta, &self.performance);
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
