//! The verdict as pure code: the schedule of calls, per-step errors, and each gate from what was
//! measured. Nothing here touches the GPU, so every rule is tested on synthetic data.

use serde::Serialize;
use spec::Gates;

use crate::cupti::StepLaunches;
use crate::metrics::rel_err;

pub use spec::{Call, Phase, schedule};

/// How one call's output compares with the reference's.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct StepCheck {
    pub call: Call,
    /// `||out - ref|| / ||ref||`; `None` when the output holds NaN or Inf.
    pub rel_err: Option<f64>,
    /// `||out - ref|| / ||ref - x||`: the error on what the layer adds to the residual stream, so a
    /// pass-through that leaves `x_out ~ x` shows up as an error near 1.
    pub contribution_err: Option<f64>,
}

impl StepCheck {
    pub fn of(call: Call, out: &[f32], reference: &[f32], x: &[f32]) -> Self {
        let contribution: Vec<f32> = reference.iter().zip(x).map(|(r, x)| r - x).collect();
        let contribution_err = rel_err(out, reference).map(|_| {
            let num: f64 = out.iter().zip(reference).map(|(&o, &r)| (o as f64 - r as f64).powi(2)).sum();
            let den: f64 = contribution.iter().map(|&c| (c as f64).powi(2)).sum();
            (num / den).sqrt()
        });
        Self { call, rel_err: rel_err(out, reference), contribution_err }
    }
}

/// The KV cache after the run against the reference's.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct CacheCheck {
    /// Prefix elements (slots `[0, prefill)`) that differ from the generated prefix in any bit.
    pub prefix_differing: usize,
    /// Elements of slots no call writes that are not zero.
    pub unused_differing: usize,
    /// Relative error of the written slots against the reference's; `None` on NaN/Inf.
    pub written_rel_err: Option<f64>,
}

/// Read-only buffers after the run: any element changed is a broken contract.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, serde::Deserialize)]
pub struct Integrity {
    /// 16-byte vectors of the weights that differ from the judge's pristine copy.
    pub weight_vectors_changed: u64,
    /// Inputs `x` (one per call) that differ from the judge's copy.
    pub inputs_changed: usize,
}

/// One gate's verdict and why.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Gate {
    pub name: &'static str,
    pub passed: bool,
    /// What was measured (its meaning depends on the gate).
    pub value: f64,
    /// The limit it was held to.
    pub limit: f64,
    /// One sentence a person reads.
    pub detail: String,
}

/// Gate 1: every step within tolerance and finite, the cache as the reference's, inputs and weights
/// untouched.
pub fn correctness_gate(steps: &[StepCheck], cache: &CacheCheck, integrity: &Integrity, gates: &Gates) -> Gate {
    let tol = gates.rel_err_tol;
    let non_finite: Vec<usize> = steps.iter().filter(|s| s.rel_err.is_none()).map(|s| s.call.index).collect();
    let worst = steps.iter().filter_map(|s| s.rel_err.map(|e| (e, s.call))).max_by(|a, b| a.0.total_cmp(&b.0));
    let over = steps.iter().filter(|s| s.rel_err.is_some_and(|e| e > tol)).count();
    let value = if non_finite.is_empty() { worst.map_or(f64::INFINITY, |w| w.0) } else { f64::INFINITY };
    let mut problems = Vec::new();
    if steps.is_empty() {
        problems.push("no step was compared".to_string());
    }
    if !non_finite.is_empty() {
        problems.push(format!("{} step(s) returned NaN or Inf (first: call {})", non_finite.len(), non_finite[0]));
    }
    if over > 0 {
        let (e, c) = worst.unwrap();
        problems.push(format!(
            "{over} of {} steps over the tolerance; worst {e:.3e} at call {} (pos {}, {:?})",
            steps.len(),
            c.index,
            c.pos,
            c.phase
        ));
    }
    if cache.prefix_differing > 0 {
        problems.push(format!("{} element(s) of the cached prefix were modified", cache.prefix_differing));
    }
    if cache.unused_differing > 0 {
        problems.push(format!("{} element(s) of cache slots no step owns were written", cache.unused_differing));
    }
    match cache.written_rel_err {
        None => problems.push("the appended K/V rows hold NaN or Inf".into()),
        Some(e) if e > tol => problems.push(format!("the appended K/V rows differ from the reference's by {e:.3e}")),
        Some(_) => {}
    }
    if integrity.weight_vectors_changed > 0 {
        problems
            .push(format!("the weights were modified ({} 16-byte vectors changed)", integrity.weight_vectors_changed));
    }
    if integrity.inputs_changed > 0 {
        problems.push(format!("{} input x buffer(s) were modified", integrity.inputs_changed));
    }
    let passed = problems.is_empty();
    let detail = if passed {
        let (e, c) = worst.unwrap();
        format!(
            "{} steps within {tol:.1e}; worst {e:.3e} at call {}; cache and read-only inputs intact",
            steps.len(),
            c.index
        )
    } else {
        problems.join("; ")
    };
    Gate { name: "correctness", passed, value, limit: tol, detail }
}

/// Gate 2: mean kernels per profiled step.
pub fn kernels_gate(steps: &[StepLaunches], gates: &Gates) -> Gate {
    let limit = gates.max_kernels_per_step;
    if steps.is_empty() {
        return Gate {
            name: "kernels_per_step",
            passed: false,
            value: f64::NAN,
            limit,
            detail: "no step was profiled".into(),
        };
    }
    let mean = steps.iter().map(|s| s.kernels as f64).sum::<f64>() / steps.len() as f64;
    let mut notes = vec![format!("{mean:.2} kernels per step over {} profiled steps", steps.len())];
    let sum = |f: fn(&StepLaunches) -> usize| steps.iter().map(f).sum::<usize>();
    for (what, n) in [
        ("kernel(s) replayed from a CUDA graph", sum(|s| s.graph_kernels)),
        ("kernel(s) launched from the device", sum(|s| s.device_launched)),
        ("memcpy record(s)", sum(|s| s.memcpys)),
        ("memset record(s)", sum(|s| s.memsets)),
    ] {
        if n > 0 {
            notes.push(format!("{n} {what} inside the steps"));
        }
    }
    let passed = mean <= limit && steps.iter().all(|s| s.kernels > 0);
    if steps.iter().any(|s| s.kernels == 0) {
        notes.push("a profiled step launched no kernel".into());
    }
    Gate { name: "kernels_per_step", passed, value: mean, limit, detail: notes.join("; ") }
}

/// Gate 3: the largest kernel's share of each profiled step's kernel time; the worst step counts.
pub fn share_gate(steps: &[StepLaunches], gates: &Gates) -> Gate {
    let limit = gates.min_dominant_share;
    let worst = steps.iter().min_by(|a, b| a.dominant_share.total_cmp(&b.dominant_share));
    match worst {
        None => Gate {
            name: "dominant_share",
            passed: false,
            value: f64::NAN,
            limit,
            detail: "no step was profiled".into(),
        },
        Some(w) => Gate {
            name: "dominant_share",
            passed: w.dominant_share >= limit,
            value: w.dominant_share,
            limit,
            detail: format!(
                "largest kernel {} takes {:.3} of its step's kernel time (worst step)",
                w.largest_kernel, w.dominant_share
            ),
        },
    }
}

/// What the timing guard looks at.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Timing {
    pub x_floor: f64,
    /// The largest kernel busy time of a profiled step (CUPTI).
    pub profiled_kernel_us: f64,
    pub timed_median_us: f64,
    /// The runner's timed steps added up.
    pub timed_sum_us: f64,
    /// The judge's own clock over the same timed phase (0 when not measured).
    pub judge_wall_us: f64,
}

/// Not a gate of TASK.md but a guard of the grader itself. The measurement was fooled when a step is
/// faster than physics allows (under `implausible_x_floor` of the floor), when profiled steps kept
/// the GPU busy longer than a timed step took (the timed calls skipped the work), or when the
/// runner's step times disagree with the judge's clock around them (a patched timer).
pub fn plausibility_gate(t: &Timing, gates: &Gates) -> Gate {
    // Kernel durations under CUPTI are accurate (its overhead falls between kernels, not inside
    // them), so the busy time of a profiled step may exceed the timed median by noise only.
    const BUSY_SLACK: f64 = 1.25;
    const BUSY_ALLOWANCE_US: f64 = 20.0;
    // The timed steps fill the judge's window but for loop and pipe overheads: at least this share.
    const CLOCK_SHARE: f64 = 0.5;
    const CLOCK_ALLOWANCE_US: f64 = 2000.0;
    let limit = gates.implausible_x_floor;
    let busy_ok = t.profiled_kernel_us <= BUSY_SLACK * t.timed_median_us + BUSY_ALLOWANCE_US;
    let clocks_ok = t.judge_wall_us == 0.0
        || (t.timed_sum_us <= t.judge_wall_us + CLOCK_ALLOWANCE_US
            && t.timed_sum_us + CLOCK_ALLOWANCE_US >= CLOCK_SHARE * t.judge_wall_us);
    let detail = if t.x_floor < limit {
        format!("{:.3}x floor is physically implausible (under {limit}x): the timing was fooled", t.x_floor)
    } else if !busy_ok {
        format!(
            "profiled steps ran {:.1} us of kernels but timed steps took only {:.1} us: the timed calls did not do the work",
            t.profiled_kernel_us, t.timed_median_us
        )
    } else if !clocks_ok {
        format!(
            "the runner's timed steps add up to {:.1} us but the judge's clock saw {:.1} us: the timer was tampered with",
            t.timed_sum_us, t.judge_wall_us
        )
    } else {
        format!(
            "{:.3}x floor; profiled kernel time {:.1} us vs timed {:.1} us; steps sum {:.0} us in a {:.0} us window",
            t.x_floor, t.profiled_kernel_us, t.timed_median_us, t.timed_sum_us, t.judge_wall_us
        )
    };
    Gate {
        name: "plausible_timing",
        passed: t.x_floor >= limit && busy_ok && clocks_ok,
        value: t.x_floor,
        limit,
        detail,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn launches(kernels: &[(u64, &str)]) -> StepLaunches {
        use crate::cupti::{Activity, ActivityKind};
        let mut t = 0;
        let acts: Vec<Activity> = kernels
            .iter()
            .map(|&(ns, name)| {
                t += ns + 1;
                Activity::synthetic(ActivityKind::Kernel, name, t - ns, t)
            })
            .collect();
        StepLaunches::of(&acts)
    }

    fn call(i: usize) -> Call {
        Call { index: i, phase: Phase::Timed, pos: 4096 + i, input: spec::Input::Fresh }
    }

    const CLEAN_CACHE: CacheCheck =
        CacheCheck { prefix_differing: 0, unused_differing: 0, written_rel_err: Some(1e-3) };
    const INTACT: Integrity = Integrity { weight_vectors_changed: 0, inputs_changed: 0 };

    #[test]
    fn two_kernels_at_share_096_pass_and_a_split_at_082_fails() {
        let g = Gates::TASK;
        let fused = vec![launches(&[(960, "mega"), (40, "zero_flag")]); 4];
        assert!(kernels_gate(&fused, &g).passed);
        let s = share_gate(&fused, &g);
        assert!(s.passed && (s.value - 0.96).abs() < 1e-3, "{s:?}");
        let split = vec![launches(&[(180, "attention"), (820, "mlp")]); 4];
        assert!(kernels_gate(&split, &g).passed, "two kernels pass gate 2");
        let s = share_gate(&split, &g);
        assert!(!s.passed && (s.value - 0.82).abs() < 1e-3, "{s:?}");
        let eager = vec![launches(&[(10, "k"); 21]); 4];
        let k = kernels_gate(&eager, &g);
        assert!(!k.passed && k.value == 21.0, "{k:?}");
    }

    #[test]
    fn one_bad_step_fails_the_share_gate_and_no_profile_fails_both() {
        let g = Gates::TASK;
        let mut steps = vec![launches(&[(1000, "mega")]); 3];
        steps.push(launches(&[(500, "a"), (500, "b")]));
        assert!(!share_gate(&steps, &g).passed);
        assert!(!kernels_gate(&[], &g).passed);
        assert!(!share_gate(&[], &g).passed);
        let empty = vec![launches(&[]); 4];
        assert!(!kernels_gate(&empty, &g).passed, "steps with no kernel did no GPU work");
    }

    #[test]
    fn graph_and_memcpy_records_are_reported() {
        use crate::cupti::{Activity, ActivityKind};
        let mut acts = vec![Activity::synthetic(ActivityKind::Kernel, "k", 0, 100)];
        acts.push(Activity::synthetic(ActivityKind::Memcpy, "memcpy DtoD", 100, 110));
        let mut graph = Activity::synthetic(ActivityKind::Kernel, "node", 110, 120);
        graph.graph_id = 7;
        acts.push(graph);
        let gate = kernels_gate(&[StepLaunches::of(&acts)], &Gates::TASK);
        assert!(gate.detail.contains("memcpy") && gate.detail.contains("graph"), "{}", gate.detail);
    }

    #[test]
    fn correctness_gate_rules() {
        let g = Gates::TASK;
        let reference = [1.0f32, 2.0, 3.0, 4.0];
        let x = [0.5f32, 1.5, 2.5, 3.5];
        let good = StepCheck::of(call(0), &[1.0, 2.0, 3.0, 4.01], &reference, &x);
        assert!(correctness_gate(std::slice::from_ref(&good), &CLEAN_CACHE, &INTACT, &g).passed);
        // A pass-through is close in relative terms but its contribution error is 1.
        let pass_through = StepCheck::of(call(1), &x, &reference, &x);
        assert!((pass_through.contribution_err.unwrap() - 1.0).abs() < 1e-9);
        assert!(!correctness_gate(&[good.clone(), pass_through], &CLEAN_CACHE, &INTACT, &g).passed);
        let nan = StepCheck::of(call(2), &[f32::NAN, 2.0, 3.0, 4.0], &reference, &x);
        assert_eq!(nan.rel_err, None);
        let gate = correctness_gate(&[good.clone(), nan], &CLEAN_CACHE, &INTACT, &g);
        assert!(!gate.passed && gate.detail.contains("NaN"), "{}", gate.detail);
        assert!(!correctness_gate(&[], &CLEAN_CACHE, &INTACT, &g).passed);
    }

    #[test]
    fn cache_and_read_only_violations_fail_correctness() {
        let g = Gates::TASK;
        let steps = [StepCheck::of(call(0), &[1.0], &[1.0], &[0.0])];
        let cases = [
            (CacheCheck { prefix_differing: 3, ..CLEAN_CACHE }, INTACT, "prefix"),
            (CacheCheck { unused_differing: 1, ..CLEAN_CACHE }, INTACT, "no step owns"),
            (CacheCheck { written_rel_err: None, ..CLEAN_CACHE }, INTACT, "NaN"),
            (CacheCheck { written_rel_err: Some(0.5), ..CLEAN_CACHE }, INTACT, "appended"),
            (CLEAN_CACHE, Integrity { weight_vectors_changed: 1, inputs_changed: 0 }, "weights"),
            (CLEAN_CACHE, Integrity { weight_vectors_changed: 0, inputs_changed: 2 }, "input"),
        ];
        for (cache, integrity, word) in cases {
            let gate = correctness_gate(&steps, &cache, &integrity, &g);
            assert!(!gate.passed && gate.detail.contains(word), "{word}: {}", gate.detail);
        }
    }

    #[test]
    fn implausible_timings_are_flagged() {
        let g = Gates::TASK;
        let honest = Timing {
            x_floor: 1.02,
            profiled_kernel_us: 410.0,
            timed_median_us: 420.0,
            timed_sum_us: 13_440.0,
            judge_wall_us: 13_600.0,
        };
        assert!(plausibility_gate(&honest, &g).passed);
        assert!(!plausibility_gate(&Timing { x_floor: 0.5, ..honest }, &g).passed);
        // Kernels worth 800 us in profiled steps, timed steps of 100 us: the timed calls skipped work.
        let skipped = Timing { profiled_kernel_us: 800.0, timed_median_us: 100.0, ..honest };
        assert!(plausibility_gate(&skipped, &g).detail.contains("did not do the work"));
        // A patched timer: steps claim 3 ms in total while the judge waited 13.6 ms.
        let patched = Timing { timed_sum_us: 3_000.0, ..honest };
        let gate = plausibility_gate(&patched, &g);
        assert!(!gate.passed && gate.detail.contains("tampered"), "{}", gate.detail);
        // More time than the judge's window is just as impossible.
        assert!(!plausibility_gate(&Timing { timed_sum_us: 30_000.0, ..honest }, &g).passed);
    }
}
