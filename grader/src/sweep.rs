//! `grader sweep`: the family check. Judges honest submissions (the megakernel and the eager
//! reference by default) over the Llama family of `spec::family`, each run exactly as `grader run`
//! judges it, and checks that honest work is never failed: the megakernel passes every gate or says
//! `unsupported`; the eager reference passes every gate but the two launch gates it fails by design
//! (21 kernels per call). A verdict that fails honest work anywhere in the family is a bug of the
//! grader's, and this is where it shows. Before a member's runs, the honest ensemble (the CPU
//! variants of `crate::ensemble`) at that shape over a few fresh seeds: the data itself must leave
//! honest arithmetic within half the tolerance there. Ends with `N passed, M failed` over the runs
//! and the ensembles.

use std::fmt::Write as _;

use cuda::Device;
use spec::family::{FAMILY, Member};

use crate::builtins::Chosen;
use crate::cli::SweepArgs;
use crate::ensemble;
use crate::error::{GraderError, Outcome};
use crate::run::report::{Report, Seeds, Status};
use crate::run::{Policy, Progress, judge};

/// The gates the eager reference fails on purpose: one launch per op, and no dominant kernel.
const LAUNCH_GATES: [&str; 2] = ["kernels_per_step", "dominant_share"];

/// What an honest run of `submission` may end as.
fn honest_outcome(submission: &str, r: &Report) -> Result<(), String> {
    let v = &r.verdict;
    let allowed: &[&str] = if submission == "reference" { &LAUNCH_GATES } else { &[] };
    match v.status {
        Status::Pass | Status::Unsupported => Ok(()),
        Status::Fail if v.failed_gates.iter().all(|g| allowed.contains(g)) => Ok(()),
        Status::Fail => {
            let details: Vec<String> = r
                .gates
                .iter()
                .filter(|g| !g.passed && !allowed.contains(&g.name))
                .map(|g| format!("{}: {}", g.name, g.detail))
                .collect();
            Err(details.join("; "))
        }
        Status::Crashed | Status::Timeout => Err(format!("{:?}: {}", v.status, v.reason.as_deref().unwrap_or(""))),
        // Not a false failure of the gates, but no verdict either: the counters were not read, or the
        // host was too busy to tell its stalls from hidden work.
        Status::Unaudited => Err(format!("unaudited: {}", v.unaudited.as_deref().unwrap_or(""))),
        Status::HostBusy => Err(format!("not judged: {}", v.reason.as_deref().unwrap_or(""))),
    }
}

/// A line of the table: the eight columns, then the verdict (or what stands in its place).
fn columns(cells: [&str; 8], last: &str) -> String {
    let [config, submission, run, x, us, err, bytes, honest] = cells;
    format!("{config:<14} {submission:<11} {run:>3} {x:>8} {us:>9} {err:>9} {bytes:>7} {honest:<5} {last}")
}

/// What a honest outcome's column says.
fn honesty(honest: &Result<(), String>) -> &'static str {
    if honest.is_ok() { "ok" } else { "FALSE FAILURE" }
}

/// One row of the table: the run's verdict and figures.
fn row(member: &Member, submission: &str, run: usize, r: &Report, honest: &Result<(), String>) -> String {
    let v = &r.verdict;
    let verdict = match v.status {
        Status::Fail => format!("FAIL ({})", v.failed_gates.join(", ")),
        Status::HostBusy => "HOST BUSY".into(),
        s => format!("{s:?}").to_uppercase(),
    };
    let (x, us) = r.performance.as_ref().map_or((String::from("-"), String::from("-")), |p| {
        (format!("{:.3}", p.x_floor), format!("{:.1}", p.us_per_call))
    });
    let err = r.steps.iter().filter_map(|s| s.rel_err).fold(None, |m: Option<f64>, e| Some(m.map_or(e, |m| m.max(e))));
    let err = err.map_or("-".into(), |e| format!("{e:.2e}"));
    let bytes = r.gates.iter().find(|g| g.name == "bytes_read").map_or(f64::NAN, |g| g.value);
    columns(
        [member.name, submission, &run.to_string(), &x, &us, &err, &format!("{bytes:.3}"), honesty(honest)],
        &verdict,
    )
}

/// The ensemble's row at `member`, seeds from `first`.
fn ensemble_row(member: &Member, m: &ensemble::Margins, first: u64, honest: &Result<(), String>) -> String {
    let worst = format!("{:.2e}", m.worst.iter().copied().fold(0.0, f64::max));
    let last = format!("least margin {:.2}x (seeds {first}..)", m.least());
    columns([member.name, "ensemble", "-", "-", "-", &worst, "-", honesty(honest)], &last)
}

/// The table, the log and the count, row by row.
#[derive(Default)]
struct Tally {
    passed: usize,
    failed: usize,
    table: Vec<String>,
    log: String,
}

impl Tally {
    /// A row, with `detail` for the log under it; a dishonest outcome is a failure said twice.
    fn add(&mut self, line: String, detail: &str, honest: Result<(), String>) {
        eprintln!("{line}");
        let _ = writeln!(self.log, "{line}\n{detail}");
        match honest {
            Ok(()) => self.passed += 1,
            Err(why) => {
                let _ = writeln!(self.log, "  false failure: {why}");
                eprintln!("  false failure: {why}");
                self.failed += 1;
            }
        }
        self.table.push(line);
    }
}

pub fn command(device: usize, args: &SweepArgs) -> Result<Outcome, GraderError> {
    let members: Vec<&Member> = match &args.configs {
        None => FAMILY.iter().collect(),
        Some(names) => names
            .iter()
            .map(|n| {
                spec::family::find(n).ok_or_else(|| {
                    GraderError::Usage(format!(
                        "--configs: '{n}' is no member of the family; the members are {}",
                        FAMILY.iter().map(|m| m.name).collect::<Vec<_>>().join(", ")
                    ))
                })
            })
            .collect::<Result<_, _>>()?,
    };
    let submissions: Vec<(String, Chosen)> = args
        .submissions
        .iter()
        .map(|s| Ok((s.clone(), crate::preflight::submission(s, None)?)))
        .collect::<Result<_, GraderError>>()?;
    if let Some(path) = &args.log {
        crate::preflight::output_file("--log", path)?;
    }
    let dev = Device::open(device)?;
    let progress = Progress::new(false);
    let header =
        columns(["config", "submission", "run", "x floor", "us/call", "worst err", "bytes", "honest"], "verdict");
    let mut tally = Tally { table: vec![header], ..Tally::default() };
    for member in &members {
        let cfg = member.config();
        if args.ensemble_seeds > 0 {
            let first = u64::from(rand::random::<u32>());
            progress.say(&format!("{} ({}), the honest ensemble", member.name, member.what));
            let m = ensemble::margins(&dev, &cfg, first..first + args.ensemble_seeds)?;
            let honest = m.failure().map_or(Ok(()), Err);
            tally.add(ensemble_row(member, &m, first, &honest), &format!("  {}", m.shown()), honest);
        }
        for (name, chosen) in &submissions {
            for run in 1..=args.runs as usize {
                progress.say(&format!("{} ({}), {name}, run {run} of {}", member.name, member.what, args.runs));
                let seeds = Seeds { weights: spec::DEFAULT_SEED, inputs: rand::random() };
                let r = judge(&dev, chosen, &cfg, seeds, Policy { no_audit: false }, &Progress::new(true), None)?;
                let honest = honest_outcome(name, &r);
                tally.add(row(member, name, run, &r, &honest), &r.table(), honest);
            }
        }
    }
    if let Some(path) = &args.log {
        crate::output::write_output(path, &tally.log)?;
    }
    eprintln!("\n{}", tally.table.join("\n"));
    println!("{} passed, {} failed", tally.passed, tally.failed);
    Ok(if tally.failed == 0 { Outcome::Pass } else { Outcome::Fail })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_ensemble_row_lines_up_with_the_header_and_says_a_false_failure() {
        let member = spec::family::find("graded").unwrap();
        let m = ensemble::Margins { seeds: 2, calls: 1, worst: [3e-3; reference::golden::HONEST.len()] };
        let header =
            columns(["config", "submission", "run", "x floor", "us/call", "worst err", "bytes", "honest"], "v");
        let ok = ensemble_row(member, &m, 7, &Ok(()));
        let bad = ensemble_row(member, &m, 7, &Err("over".into()));
        assert_eq!(header.find("honest"), ok.find(" ok ").map(|i| i + 1), "{header}\n{ok}");
        assert!(ok.ends_with("least margin 5.00x (seeds 7..)"), "{ok}");
        assert!(bad.contains("FALSE FAILURE"), "{bad}");
    }

    #[test]
    fn the_launch_gates_are_the_only_ones_the_reference_may_fail() {
        for g in LAUNCH_GATES {
            assert!(redteam::GATES.contains(&g), "{g} is a gate");
        }
    }
}
