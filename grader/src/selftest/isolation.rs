//! The grader against people trying to fool it, on the GPU: every red-team adversary of
//! `redteam` is judged through the whole isolated flow and must end with the status and
//! message its entry expects; and the example external submission (a C ABI library) must pass
//! correctness.

use redteam::{self, Expect};
use spec::Config;

use super::flow::gate;
use super::{Check, CheckResult, Ctx, ensure, judged, named};
use crate::builtins::Chosen;
use crate::run::report::{Report, Status};

/// Where `scripts/build-example` leaves the example external submission.
pub const EXAMPLE_LIBRARY: &str = "target/examples/libexternal_eager.so";

pub fn checks() -> Vec<Check> {
    vec![
        Check { name: "red team: every adversary is caught", run: red_team },
        Check { name: "red team at a second shape (llama-3.2-1b)", run: red_team_second_shape },
        Check { name: "red team over a stack: the stack-taking adversaries", run: red_team_stack },
        Check { name: "external example passes correctness", run: external_example },
    ]
}

/// Whether a report shows what the adversary's entry expects; `Err` says what it showed instead.
fn caught(r: &Report, expect: Expect) -> Result<String, String> {
    let v = &r.verdict;
    let shown = || match &v.reason {
        Some(reason) => format!("{:?}: {reason}", v.status),
        None => format!(
            "{:?}: {}",
            v.status,
            r.gates.iter().map(|g| format!("{} {}", g.name, g.detail)).collect::<Vec<_>>().join("; ")
        ),
    };
    match expect {
        Expect::Crashed if v.status == Status::Crashed => Ok("crashed".into()),
        Expect::CrashedFor { word }
            if v.status == Status::Crashed && v.reason.as_deref().is_some_and(|r| r.contains(word)) =>
        {
            Ok(format!("crashed: {}", v.reason.as_deref().unwrap_or_default()))
        }
        Expect::Timeout if v.status == Status::Timeout => Ok("timeout".into()),
        Expect::GateFails { gate, word } => match r.gates.iter().find(|g| g.name == gate) {
            Some(g) if !g.passed && g.detail.contains(word) => Ok(format!("{gate}: {}", g.detail)),
            _ => Err(shown()),
        },
        Expect::LeftBehind { count } => {
            let left = &r.watched.leftovers;
            let correct = r.gates.iter().any(|g| g.name == "correctness" && g.passed);
            let alive: Vec<u32> = left.killed.iter().map(|k| k.pid).filter(|&p| submission::child::runs(p)).collect();
            if correct && left.killed.len() == count && left.surviving.is_empty() && alive.is_empty() {
                Ok(format!("correct; killed after the run: {}", r.watched.describe_leftovers().unwrap_or_default()))
            } else {
                Err(format!("{}; left behind {:?}, of them still running {alive:?}", shown(), left))
            }
        }
        Expect::TimedHonestly { min_us } => match (&r.performance, r.gates.iter().find(|g| g.name == "correctness")) {
            (Some(p), Some(c)) if c.passed && p.us_per_call >= min_us => {
                Ok(format!("{:.0} us/step counted", p.us_per_call))
            }
            _ => Err(shown()),
        },
        _ => Err(shown()),
    }
}

fn red_team(ctx: &mut Ctx) -> CheckResult {
    every_one_caught(ctx, &Config::small(), every_adversary())
}

/// The red team again at a real model's shape (hd 64, 4k context), so no verdict rests on the
/// small config's proportions.
fn red_team_second_shape(ctx: &mut Ctx) -> CheckResult {
    let cfg = spec::family::find("llama-3.2-1b").expect("a family member").config();
    every_one_caught(ctx, &cfg, every_adversary())
}

/// The adversaries that take a stack, over four layers of `small`: each caught there too, by layer.
fn red_team_stack(ctx: &mut Ctx) -> CheckResult {
    let cfg = Config { name: "small-x4".into(), layers: 4, ..Config::small() };
    let takes_stacks = ["skip-a-layer", "skip-k-when-timed", "skip-v-when-timed", "skip-layer-append-when-timed"];
    let chosen = redteam::ALL.iter().filter(|a| takes_stacks.contains(&a.name));
    every_one_caught(ctx, &cfg, chosen.map(|a| (a.name.to_string(), named(a.name), a.expect)).collect())
}

fn every_adversary() -> Vec<(String, Chosen, Expect)> {
    redteam::ALL.iter().map(|a| (a.name.to_string(), named(a.name), a.expect)).collect()
}

/// Judges each `(label, submission, expected verdict)` at `cfg`; every one must end as expected.
/// The judge and the GPU must still work after each one: the next one shows it.
pub fn every_one_caught(ctx: &Ctx, cfg: &Config, adversaries: Vec<(String, Chosen, Expect)>) -> CheckResult {
    let mut missed = Vec::new();
    for (i, (label, chosen, expect)) in adversaries.iter().enumerate() {
        let start = std::time::Instant::now();
        let r = judged(ctx, chosen, cfg, None)?;
        let outcome = caught(&r, *expect);
        // One line per adversary as it is judged: the check takes minutes, and a line that names
        // the last one judged tells where a hang or a lost machine stopped it.
        let secs = start.elapsed().as_secs_f64();
        let shown = outcome.as_ref().map_or_else(|s| format!("MISSED: {s}"), |s| format!("caught: {s}"));
        eprintln!("  [{}/{}] {label} at '{}' {secs:.1}s {shown}", i + 1, adversaries.len(), cfg.name);
        if let Err(shown) = outcome {
            missed.push(format!("{label} (expected {expect:?}, got {shown})"));
        }
    }
    ensure(missed.is_empty(), || {
        format!("{} of {} not caught: {}", missed.len(), adversaries.len(), missed.join(" | "))
    })?;
    Ok(format!(
        "{} adversaries at '{}', each caught as expected; the judge and GPU stayed usable",
        adversaries.len(),
        cfg.name
    ))
}

fn external_example(ctx: &mut Ctx) -> CheckResult {
    ensure(std::path::Path::new(EXAMPLE_LIBRARY).exists(), || {
        format!("{EXAMPLE_LIBRARY} is missing: build it with scripts/build-example")
    })?;
    let r = judged(ctx, &named(EXAMPLE_LIBRARY), &Config::graded(), None)?;
    let c = gate(&r, "correctness")?;
    ensure(c.passed, || format!("correctness failed: {}", c.detail))?;
    Ok(format!("graded config through the C ABI: {}", c.detail))
}
