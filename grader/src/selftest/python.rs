//! Python submissions on the GPU, through the whole isolated flow (checks named `python: ...`): the
//! two examples, the proof that the runner's copy of `x_out` is not counted as the submission's,
//! and the Python red team of `redteam::python`, each with the verdict it must get. The
//! interpreter is `$PYTHON`, else `python3`, as for `grader run`; paths are from the workspace root.

use redteam::python;
use spec::Config;

use crate::builtins::Chosen;

use super::flow::{eager_verdict, gate};
use super::isolation::every_one_caught;
use super::{Check, CheckResult, Ctx, Failure, ensure, judged};

const EAGER: &str = "submission/examples/python/eager_layer.py";
const TRITON: &str = "submission/examples/python/triton_layer.py";
/// One `x + x` kernel per step.
const ONE_KERNEL: &str = "submission/tests/python/gpu/one_kernel.py";

pub fn checks() -> Vec<Check> {
    vec![
        Check { name: "python: eager example fails launch gates", run: eager_example },
        Check { name: "python: triton example is judged", run: triton_example },
        Check { name: "python: x_out copy is the runner's", run: output_copy },
        Check { name: "python: red team is caught", run: red_team },
    ]
}

/// A module probed with the interpreter `grader run` would use.
fn module(path: &str) -> Result<Chosen, Failure> {
    crate::preflight::submission(path, None).map_err(|e| Failure(e.to_string()))
}

fn eager_example(ctx: &mut Ctx) -> CheckResult {
    eager_verdict(&judged(ctx, &module(EAGER)?, &Config::graded(), None)?)
}

fn triton_example(ctx: &mut Ctx) -> CheckResult {
    let r = judged(ctx, &module(TRITON)?, &Config::graded(), None)?;
    let (c, k) = (gate(&r, "correctness")?, gate(&r, "kernels_per_step")?);
    ensure(c.passed, || format!("correctness failed: {}", c.detail))?;
    ensure(!k.passed && k.value > 2.0, || format!("kernel gate should fail, the attention is eager: {}", k.detail))?;
    let p = r.performance.as_ref().ok_or_else(|| Failure("no performance figures".into()))?;
    Ok(format!(
        "correctness {:.1e}; {:.0} kernels/step; {:.0} tokens/s, {:.2}x floor ({:.0} us/call)",
        c.value, k.value, p.tokens_per_s, p.x_floor, p.us_per_call
    ))
}

/// The module launches one kernel per step and the runner copies its output into the judge's
/// buffer inside each call: every call's record must hold that one kernel and no copy.
fn output_copy(ctx: &mut Ctx) -> CheckResult {
    let r = judged(ctx, &module(ONE_KERNEL)?, &Config::small(), None)?;
    gate(&r, "kernels_per_step")?;
    let calls = &r.launches.submission;
    let wrong: Vec<String> = calls
        .iter()
        .enumerate()
        .filter(|(_, l)| l.kernels != 1 || l.memcpys != 0)
        .map(|(i, l)| format!("call {i}: {} kernel(s), {} copies", l.kernels, l.memcpys))
        .collect();
    ensure(!calls.is_empty() && wrong.is_empty(), || {
        format!("expected 1 kernel and no copy per call: {}", wrong.join("; "))
    })?;
    Ok(format!("{} calls, each 1 kernel and no copy recorded as the submission's", calls.len()))
}

fn red_team(ctx: &mut Ctx) -> CheckResult {
    let adversaries = python::ALL
        .iter()
        .map(|a| Ok((a.file.to_string(), module(&format!("{}/{}", python::FOLDER, a.file))?, a.expect)))
        .collect::<Result<_, Failure>>()?;
    every_one_caught(ctx, &Config::small(), adversaries)
}
