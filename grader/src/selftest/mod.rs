//! `grader selftest`: the grader's own GPU code checked against the CPU, one named check at a time.
//! Each check prints one `Pass:` or `FAIL:` line; the last line is `N passed, M failed`.

mod audit;
mod data;
mod ensemble;
mod flow;
mod isolation;
mod megakernel;
mod python;
mod recording;
mod reference;

use std::fmt::Write as _;
use std::time::Instant;

use cuda::{CudaError, Device};
use spec::{Config, DEFAULT_SEED};

use crate::builtins::Chosen;
use crate::cli::SelftestArgs;
use crate::error::{GraderError, Outcome};
use crate::run::report::{Report, Seeds};
use crate::run::{Policy, Progress, judge};

/// What every check gets: the device and the public seed.
pub struct Ctx {
    pub dev: Device,
    pub seed: u64,
}

/// A check's failure: what was expected and what was seen.
#[derive(Debug)]
pub struct Failure(pub String);

impl From<CudaError> for Failure {
    fn from(e: CudaError) -> Self {
        Failure(e.to_string())
    }
}

impl From<submission::SubmissionError> for Failure {
    fn from(e: submission::SubmissionError) -> Self {
        Failure(e.to_string())
    }
}

impl From<crate::audit::AuditError> for Failure {
    fn from(e: crate::audit::AuditError) -> Self {
        Failure(e.to_string())
    }
}

impl From<crate::cupti::CuptiError> for Failure {
    fn from(e: crate::cupti::CuptiError) -> Self {
        Failure(e.to_string())
    }
}

/// `Ok(detail)` on a pass, with the figures that show it passed.
pub type CheckResult = Result<String, Failure>;

pub struct Check {
    pub name: &'static str,
    pub run: fn(&mut Ctx) -> CheckResult,
}

/// Fails with `msg` unless `cond`.
pub fn ensure(cond: bool, msg: impl FnOnce() -> String) -> Result<(), Failure> {
    if cond { Ok(()) } else { Err(Failure(msg())) }
}

/// `chosen` judged through the whole isolated flow (`grader run`), with a fresh input seed.
pub fn judged(ctx: &Ctx, chosen: &Chosen, cfg: &Config, dump: Option<&std::path::Path>) -> Result<Report, Failure> {
    judged_with(ctx, chosen, cfg, Policy { no_audit: false }, dump)
}

/// [`judged`], under `policy`.
pub fn judged_with(
    ctx: &Ctx,
    chosen: &Chosen,
    cfg: &Config,
    policy: Policy,
    dump: Option<&std::path::Path>,
) -> Result<Report, Failure> {
    let seeds = Seeds { weights: DEFAULT_SEED, inputs: rand::random() };
    judge(&ctx.dev, chosen, cfg, seeds, policy, &Progress::new(true), dump).map_err(|e| Failure(e.to_string()))
}

/// A built-in submission (or adversary) by name.
pub fn named(name: &str) -> Chosen {
    Chosen::Native(name.to_string())
}

/// Every check, in the order they run: cheap and foundational first.
fn checks() -> Vec<Check> {
    let mut all = data::checks();
    all.extend(reference::checks());
    all.extend(ensemble::checks());
    all.extend(megakernel::checks());
    all.extend(recording::checks());
    all.extend(audit::checks());
    all.extend(flow::checks());
    all.extend(isolation::checks());
    all.extend(python::checks());
    all
}

/// The checks whose name contains `filter` in any case (all of them without one): names are
/// lower case, and `--filter RNG` means the RNG checks.
fn selected(filter: Option<&str>) -> Result<Vec<Check>, GraderError> {
    let filter = filter.map(str::to_lowercase);
    let selected: Vec<Check> =
        checks().into_iter().filter(|c| filter.as_deref().is_none_or(|t| c.name.to_lowercase().contains(t))).collect();
    if selected.is_empty() {
        return Err(GraderError::Usage(format!(
            "no selftest check matches --filter {:?}: `grader selftest --list` names them all",
            filter.unwrap_or_default()
        )));
    }
    Ok(selected)
}

pub fn command(device: usize, args: &SelftestArgs) -> Result<Outcome, GraderError> {
    let selected = selected(args.filter.as_deref())?;
    if args.list {
        // Names only: no device is needed to learn what --filter can pick.
        selected.iter().for_each(|c| println!("{}", c.name));
        return Ok(Outcome::Pass);
    }
    if let Some(path) = &args.log {
        crate::preflight::output_file("--log", path)?;
    }
    let dev = Device::open(device)?;
    let f = dev.facts();
    eprintln!("grader selftest on {} (sm_{}{}, {} SMs)", f.name, f.compute_capability.0, f.compute_capability.1, f.sms);
    let mut ctx = Ctx { dev, seed: args.seed };
    // A log file is rewritten after every check, so a run cut short (a timeout, a lost machine)
    // still leaves the lines of the checks it finished; `-` (stdout) gets the log once, at the end.
    let stdout = std::path::Path::new("-");
    let log_file = args.log.as_deref().filter(|p| *p != stdout);
    let (mut passed, mut failed, mut log) = (0, 0, String::new());
    for check in &selected {
        let start = Instant::now();
        let result = (check.run)(&mut ctx);
        let secs = start.elapsed().as_secs_f64();
        let line = match &result {
            Ok(detail) => format!("Pass: {:<36} {:>6.2}s  {detail}", check.name, secs),
            Err(Failure(why)) => format!("FAIL: {:<36} {:>6.2}s  {why}", check.name, secs),
        };
        eprintln!("{line}");
        let _ = writeln!(log, "{line}");
        if result.is_ok() {
            passed += 1
        } else {
            failed += 1
        }
        if let Some(path) = log_file {
            crate::output::write_output(path, &log)?;
        }
    }
    if args.log.as_deref() == Some(stdout) {
        crate::output::write_output(stdout, &log)?;
    }
    // The closing line CI and people read: counts only.
    println!("{passed} passed, {failed} failed");
    Ok(if failed == 0 { Outcome::Pass } else { Outcome::Fail })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn filters_ignore_case_and_name_the_list_when_nothing_matches() {
        let names = |filter| selected(Some(filter)).unwrap().iter().map(|c| c.name).collect::<Vec<_>>();
        assert!(!names("rng").is_empty() && names("rng").iter().all(|n| n.starts_with("rng: ")));
        assert_eq!(names("RNG"), names("rng"));
        let msg = selected(Some("no such check")).err().expect("nothing matches").to_string();
        assert!(msg.contains("grader selftest --list"), "{msg}");
    }
}
