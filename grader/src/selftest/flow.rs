//! The whole `grader run` flow on the GPU at a small config, for the built-in submissions: the eager
//! reference must pass correctness and fail the launch gates with its measured count; the megakernel
//! must pass every gate; a dump must read back; over a small stack, the megakernel must pass every gate
//! and a stack that skips its last layer must fail correctness at that layer.

use safetensors::SafeTensors;
use spec::Config;

use super::{Check, CheckResult, Ctx, Failure, ensure, judged, named};
use crate::run::report::Report;

pub fn checks() -> Vec<Check> {
    vec![
        Check { name: "run flow: reference fails launch gates", run: reference_flow },
        Check { name: "run flow: megakernel passes, dump reads", run: megakernel_flow },
        Check { name: "run flow: a stack: megakernel passes, a skipped layer is named", run: stack_flow },
    ]
}

/// A gate of a judged report; an unjudged one (crashed, timeout) fails the check with its reason.
pub fn gate<'a>(r: &'a Report, name: &str) -> Result<&'a crate::run::gates::Gate, Failure> {
    r.gates.iter().find(|g| g.name == name).ok_or_else(|| {
        Failure(format!("not judged: {:?} {}", r.verdict.status, r.verdict.reason.as_deref().unwrap_or("")))
    })
}

fn reference_flow(ctx: &mut Ctx) -> CheckResult {
    eager_verdict(&judged(ctx, &named("reference"), &Config::small(), None)?)
}

/// An eager layer's verdict: correct, but failing the launch gates with its measured count.
pub fn eager_verdict(r: &Report) -> CheckResult {
    let (c, k, s) = (gate(r, "correctness")?, gate(r, "kernels_per_step")?, gate(r, "dominant_share")?);
    ensure(c.passed, || format!("correctness failed: {}", c.detail))?;
    ensure(!k.passed && k.value > 2.0, || format!("kernel gate should fail: {}", k.detail))?;
    ensure(!s.passed, || format!("share gate should fail: {}", s.detail))?;
    ensure(!r.verdict.passed, || "the verdict passed".into())?;
    Ok(format!("correctness {:.1e}; {:.0} kernels/step, share {:.3}: fails as it must", c.value, k.value, s.value))
}

fn megakernel_flow(ctx: &mut Ctx) -> CheckResult {
    let dir = std::env::temp_dir().join(format!("grader-selftest-dump-{}", std::process::id()));
    let cfg = Config::small();
    let r = judged(ctx, &named("megakernel"), &cfg, Some(&dir))?;
    for g in &r.gates {
        ensure(g.passed, || format!("{} failed: {}", g.name, g.detail))?;
    }
    let read = |f: &str| std::fs::read(dir.join(f)).map_err(|e| Failure(format!("{f}: {e}")));
    let steps = read("steps.safetensors")?;
    let st = SafeTensors::deserialize(&steps).map_err(|e| Failure(format!("steps.safetensors: {e}")))?;
    let calls = r.steps.len();
    for name in ["x", "out_submission", "out_reference"] {
        let t = st.tensor(name).map_err(|e| Failure(format!("{name}: {e}")))?;
        ensure(t.shape() == [calls, cfg.d], || format!("{name} has shape {:?}", t.shape()))?;
    }
    let weights = read("weights.safetensors")?;
    let wt = SafeTensors::deserialize(&weights).map_err(|e| Failure(format!("weights.safetensors: {e}")))?;
    ensure(wt.len() == 9, || format!("{} weight tensors", wt.len()))?;
    let manifest: serde_json::Value =
        serde_json::from_slice(&read("manifest.json")?).map_err(|e| Failure(format!("manifest.json: {e}")))?;
    ensure(manifest["calls"].as_array().map(|a| a.len()) == Some(calls), || "manifest calls".into())?;
    std::fs::remove_dir_all(&dir).map_err(|e| Failure(format!("removing {}: {e}", dir.display())))?;
    Ok(format!(
        "every gate passes: {} kernel/call, share {:.3}, correctness {:.1e}, bytes read {:.3}x; dump of {calls} calls reads back",
        gate(&r, "kernels_per_step")?.value,
        gate(&r, "dominant_share")?.value,
        gate(&r, "correctness")?.value,
        gate(&r, "bytes_read")?.value
    ))
}

/// Four layers of `small`: the megakernel passes every gate in one launch per call; the adversary that
/// passes layer 3's input through (`skip-a-layer`) fails correctness there, named by layer.
fn stack_flow(ctx: &mut Ctx) -> CheckResult {
    let cfg = Config { name: "small-x4".into(), layers: 4, ..Config::small() };
    let mk = judged(ctx, &named("megakernel"), &cfg, None)?;
    let c = gate(&mk, "correctness")?;
    ensure(mk.verdict.passed, || format!("the megakernel failed over a stack: {:?}", mk.verdict.failed_gates))?;
    let cheat = judged(ctx, &named("skip-a-layer"), &cfg, None)?;
    let caught = gate(&cheat, "correctness")?;
    ensure(!caught.passed && caught.detail.contains("layer 3"), || {
        format!("skipping layer 3 was not caught there: {}", caught.detail)
    })?;
    Ok(format!("megakernel: every gate passes over 4 layers (worst {:.1e}); skip-a-layer: {}", c.value, caught.detail))
}
