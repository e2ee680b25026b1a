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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::run::verdict::{Call, Phase};

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
        }
    }

    fn summary(v: f64) -> Summary {
        Summary::of(&[v, v * 1.01, v * 0.99]).unwrap()
    }

    /// The JSON a failed run writes reads back with the fields people and scripts rely on.
    #[test]
    fn json_round_trip_of_a_failed_run() {
        let cfg = Config::tiny();
        let bw = Bandwidth {
            buffer_bytes: 1 << 31,
            copy_tbps: summary(3.9),
            read_tbps: summary(4.5),
            driver_copy_tbps: summary(4.26),
            floor_tbps: 4.26,
        };
        let bytes = ByteModel::of(&cfg);
        let performance = Performance {
            tokens_per_s: 2000.0,
            us_per_call: 500.0,
            floor_us: 400.0,
            x_floor: 1.25,
            achieved_tbps: 3.4,
            throughput_us_per_call: 490.0,
            step_us: summary(500.0),
            reference_us_per_call: Some(630.0),
            bandwidth: bw,
            bytes,
            build_s: 0.1,
            timed_wall_us: 16_500.0,
        };
        let gates = vec![
            Gate { name: "correctness", passed: true, value: 1e-3, limit: 1.5e-2, detail: "ok".into() },
            Gate { name: "kernels_per_step", passed: false, value: 21.0, limit: 2.0, detail: "21 kernels".into() },
        ];
        let call = Call { index: 0, phase: Phase::Timed, pos: cfg.prefill, input: spec::Input::Fresh };
        let steps = vec![StepCheck { call, rel_err: Some(1e-3), contribution_err: Some(3e-3) }];
        let cache = CacheCheck { prefix_differing: 0, unused_differing: 0, written_rel_err: Some(1e-3) };
        let integrity = Integrity { weight_vectors_changed: 0, inputs_changed: 0 };
        let seeds = Seeds { weights: 1, inputs: 2 };
        let r = Report::new(
            cfg,
            facts(),
            seeds,
            "reference",
            gates,
            performance,
            steps,
            cache,
            integrity,
            vec![],
            vec![],
            vec![500.0],
        );
        let doc: serde_json::Value = serde_json::from_str(&serde_json::to_string(&r).unwrap()).unwrap();
        assert_eq!(doc["meta"]["schema_version"], SCHEMA_VERSION);
        assert_eq!(doc["meta"]["seeds"]["inputs"], 2);
        assert_eq!(doc["verdict"]["status"], "fail");
        assert_eq!(doc["verdict"]["failed_gates"][0], "kernels_per_step");
        assert_eq!(doc["gates"][1]["value"], 21.0);
        assert_eq!(doc["performance"]["x_floor"], 1.25);
        assert_eq!(doc["steps"][0]["call"]["phase"], "timed");
        assert!(r.verdict_line().starts_with("VERDICT: FAIL"));
    }

    /// A run the submission cut short says so, with its reason, and measures nothing.
    #[test]
    fn crashed_and_timed_out_runs_report_their_reason() {
        for (failure, status) in
            [(Failure::Crashed("illegal address".into()), "crashed"), (Failure::Timeout("quiet".into()), "timeout")]
        {
            let r = Report::not_finished(Config::tiny(), facts(), Seeds { weights: 1, inputs: 2 }, "x", failure);
            let doc: serde_json::Value = serde_json::to_value(&r).unwrap();
            assert_eq!(doc["verdict"]["status"], status);
            assert_eq!(doc["verdict"]["passed"], false);
            assert!(doc["performance"].is_null());
            assert!(r.verdict_line().contains(&status.to_uppercase()), "{}", r.verdict_line());
        }
    }
}
