//! Gate 1, correctness, from what the judge read itself: every call's output against the
//! reference's (in a stack, every layer's output against the reference's layer on the same input),
//! every call's appended K and V rows in every layer (`run::append`), the caches after the run, and
//! the read-only buffers.

use serde::Serialize;
use spec::{Call, Gates};

use super::{Gate, Source};
use crate::metrics::rel_err;
use crate::run::append::Faulty;

/// Faulty appended rows named in a failed gate's detail; the report lists them all.
const APPENDS_NAMED: usize = 3;

/// How one call's output compares with the reference's; in a stack, its worst layer's on each
/// measure. Each layer is compared with the reference layer on the submission's own input to it (the
/// layer before's output), which tells a slip in one layer from the drift that honest rounding
/// accumulates over depth (`docs/depth.md`).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct StepCheck {
    pub call: Call,
    /// The layer of the worst `rel_err` (0 for one layer).
    pub layer: usize,
    /// `||out - ref|| / ||ref||`; `None` when the output holds NaN or Inf.
    pub rel_err: Option<f64>,
    /// `||out - ref|| / ||ref - x||`: the error on what the layer adds to the residual stream, so a
    /// pass-through that leaves `x_out ~ x` shows up as an error near 1.
    pub contribution_err: Option<f64>,
    /// The layer of the worst `contribution_err`.
    pub update_layer: usize,
}

impl StepCheck {
    pub fn of(call: Call, layer: usize, out: &[f32], reference: &[f32], x: &[f32]) -> Self {
        let contribution: Vec<f32> = reference.iter().zip(x).map(|(r, x)| r - x).collect();
        let contribution_err = rel_err(out, reference).map(|_| {
            let num: f64 = out.iter().zip(reference).map(|(&o, &r)| (o as f64 - r as f64).powi(2)).sum();
            let den: f64 = contribution.iter().map(|&c| (c as f64).powi(2)).sum();
            (num / den).sqrt()
        });
        Self { call, layer, rel_err: rel_err(out, reference), contribution_err, update_layer: layer }
    }

    /// Two layers' checks of one call as one: on each measure the worse (a non-finite output first,
    /// then the larger error) and its layer.
    pub fn merge(self, other: StepCheck) -> StepCheck {
        let second = |a: Option<f64>, b: Option<f64>| match (a, b) {
            (None, _) => false,
            (_, None) => true,
            (Some(a), Some(b)) => b > a,
        };
        let (layer, rel_err) =
            if second(self.rel_err, other.rel_err) { (other.layer, other.rel_err) } else { (self.layer, self.rel_err) };
        let (update_layer, contribution_err) = if second(self.contribution_err, other.contribution_err) {
            (other.update_layer, other.contribution_err)
        } else {
            (self.update_layer, self.contribution_err)
        };
        StepCheck { call: self.call, layer, rel_err, contribution_err, update_layer }
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

impl CacheCheck {
    /// Two layers' checks as one: the differing elements summed, the written rows' error the worse.
    pub fn and(self, other: CacheCheck) -> CacheCheck {
        CacheCheck {
            prefix_differing: self.prefix_differing + other.prefix_differing,
            unused_differing: self.unused_differing + other.unused_differing,
            written_rel_err: self.written_rel_err.zip(other.written_rel_err).map(|(a, b)| a.max(b)),
        }
    }
}

/// Read-only buffers after the run: any element changed is a broken contract.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, serde::Deserialize)]
pub struct Integrity {
    /// 16-byte vectors of the weights that differ from the judge's pristine copy.
    pub weight_vectors_changed: u64,
    /// Inputs `x` (one per call) that differ from the judge's copy.
    pub inputs_changed: usize,
}

/// Gate 1: every step within tolerance and finite (in a stack, every layer's output and, within
/// `stack_update_tol`, its update), every call's appended rows as the reference's (`appends`: the
/// faulty ones), the cache as the reference's, inputs and weights untouched.
pub fn correctness_gate(
    steps: &[StepCheck],
    stack: bool,
    cache: &CacheCheck,
    appends: &[Faulty],
    integrity: &Integrity,
    gates: &Gates,
) -> Gate {
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
            "{over} of {} steps over the tolerance; worst {e:.3e} at call {}{} (pos {}, {:?})",
            steps.len(),
            c.index,
            layer_of(steps, stack, c),
            c.pos,
            c.phase
        ));
    }
    let update_tol = gates.stack_update_tol;
    let worst_update =
        steps.iter().filter_map(|s| s.contribution_err.map(|e| (e, s))).max_by(|a, b| a.0.total_cmp(&b.0));
    let updates_over = steps.iter().filter(|s| s.contribution_err.is_some_and(|e| e > update_tol)).count();
    if stack && updates_over > 0 {
        let (e, s) = worst_update.expect("an update over the tolerance");
        problems.push(format!(
            "{updates_over} of {} steps with a layer's update off by more than {update_tol}; worst {e:.3e} at call {}, layer {}",
            steps.len(),
            s.call.index,
            s.update_layer
        ));
    }
    if !appends.is_empty() {
        let named: Vec<String> = appends.iter().take(APPENDS_NAMED).map(ToString::to_string).collect();
        let more = appends.len().saturating_sub(APPENDS_NAMED);
        let more = if more > 0 { format!("; {more} more in the report") } else { String::new() };
        problems.push(format!(
            "{} appended K/V row(s) not as the reference's: {}{more}",
            appends.len(),
            named.join("; ")
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
        let updates = match worst_update {
            Some((u, s)) if stack => {
                format!(
                    "; every layer's update within {update_tol}, worst {u:.3e} (call {}, layer {})",
                    s.call.index, s.update_layer
                )
            }
            _ => String::new(),
        };
        format!(
            "{} steps within {tol:.1e}; worst {e:.3e} at call {}{}{updates}; every call's appends, the cache and \
             the read-only inputs intact",
            steps.len(),
            c.index,
            layer_of(steps, stack, c)
        )
    } else {
        problems.join("; ")
    };
    Gate { name: "correctness", source: Source::Judge, passed, value, limit: tol, detail }
}

/// ", layer l" for call `c`'s check in a stack, else nothing.
fn layer_of(steps: &[StepCheck], stack: bool, c: Call) -> String {
    match steps.iter().find(|s| s.call == c) {
        Some(s) if stack => format!(", layer {}", s.layer),
        _ => String::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use spec::Phase;

    fn call(i: usize) -> Call {
        Call { index: i, phase: Phase::Timed, pos: 4096 + i, input: spec::Input::Fresh }
    }

    const CLEAN_CACHE: CacheCheck =
        CacheCheck { prefix_differing: 0, unused_differing: 0, written_rel_err: Some(1e-3) };
    const INTACT: Integrity = Integrity { weight_vectors_changed: 0, inputs_changed: 0 };

    #[test]
    fn correctness_gate_rules() {
        let g = Gates::TASK;
        let reference = [1.0f32, 2.0, 3.0, 4.0];
        let x = [0.5f32, 1.5, 2.5, 3.5];
        let good = StepCheck::of(call(0), 0, &[1.0, 2.0, 3.0, 4.01], &reference, &x);
        assert!(correctness_gate(std::slice::from_ref(&good), false, &CLEAN_CACHE, &[], &INTACT, &g).passed);
        // A pass-through is close in relative terms but its contribution error is 1.
        let pass_through = StepCheck::of(call(1), 0, &x, &reference, &x);
        assert!((pass_through.contribution_err.unwrap() - 1.0).abs() < 1e-9);
        assert!(!correctness_gate(&[good.clone(), pass_through], false, &CLEAN_CACHE, &[], &INTACT, &g).passed);
        let nan = StepCheck::of(call(2), 0, &[f32::NAN, 2.0, 3.0, 4.0], &reference, &x);
        assert_eq!(nan.rel_err, None);
        let gate = correctness_gate(&[good.clone(), nan], false, &CLEAN_CACHE, &[], &INTACT, &g);
        assert!(!gate.passed && gate.detail.contains("NaN"), "{}", gate.detail);
        assert!(!correctness_gate(&[], false, &CLEAN_CACHE, &[], &INTACT, &g).passed);
    }

    /// In a stack, a layer whose output is within the tolerance but whose update is not (its input
    /// passed through at a depth where the residual dwarfs the update) fails correctness, naming the
    /// layer; the same check of one layer is judged on the output alone. A call's checks merge to the
    /// worst of each measure with its layer.
    #[test]
    fn a_stack_judges_every_layers_update() {
        let g = Gates::TASK;
        let x = [10.0f32, 10.0, 10.0, 10.0];
        let reference = [10.05f32, 10.0, 10.0, 10.0];
        let skipped = StepCheck::of(call(0), 3, &x, &reference, &x);
        assert!(skipped.rel_err.unwrap() < g.rel_err_tol && (skipped.contribution_err.unwrap() - 1.0).abs() < 1e-9);
        let honest = StepCheck::of(call(0), 1, &[2.03, 1.0, 1.0, 1.0], &[2.0, 1.0, 1.0, 1.0], &[1.0; 4]);
        assert!(honest.rel_err.unwrap() > skipped.rel_err.unwrap() && honest.contribution_err.unwrap() < 0.05);
        let merged = honest.clone().merge(skipped.clone());
        assert_eq!((merged.layer, merged.update_layer), (1, 3));
        let gate = correctness_gate(std::slice::from_ref(&merged), true, &CLEAN_CACHE, &[], &INTACT, &g);
        assert!(!gate.passed && gate.detail.contains("layer 3") && gate.detail.contains("update"), "{}", gate.detail);
        assert!(correctness_gate(&[merged], false, &CLEAN_CACHE, &[], &INTACT, &g).passed);
        let gate = correctness_gate(&[honest], true, &CLEAN_CACHE, &[], &INTACT, &g);
        assert!(gate.passed && gate.detail.contains("every layer's update within"), "{}", gate.detail);
    }

    #[test]
    fn cache_and_read_only_violations_fail_correctness() {
        let g = Gates::TASK;
        let steps = [StepCheck::of(call(0), 0, &[1.0], &[1.0], &[0.0])];
        let cases = [
            (CacheCheck { prefix_differing: 3, ..CLEAN_CACHE }, INTACT, "prefix"),
            (CacheCheck { unused_differing: 1, ..CLEAN_CACHE }, INTACT, "no step owns"),
            (CacheCheck { written_rel_err: None, ..CLEAN_CACHE }, INTACT, "NaN"),
            (CacheCheck { written_rel_err: Some(0.5), ..CLEAN_CACHE }, INTACT, "appended"),
            (CLEAN_CACHE, Integrity { weight_vectors_changed: 1, inputs_changed: 0 }, "weights"),
            (CLEAN_CACHE, Integrity { weight_vectors_changed: 0, inputs_changed: 2 }, "input"),
        ];
        for (cache, integrity, word) in cases {
            let gate = correctness_gate(&steps, false, &cache, &[], &integrity, &g);
            assert!(!gate.passed && gate.detail.contains(word), "{word}: {}", gate.detail);
        }
    }

    /// A call's skipped append fails correctness, naming it, even where every output is in
    /// tolerance.
    #[test]
    fn a_skipped_append_fails_correctness_by_name() {
        use crate::run::append::{Fault, Tensor};
        let g = Gates::TASK;
        let steps = [StepCheck::of(call(0), 0, &[1.0], &[1.0], &[0.0])];
        let skipped = |i| Faulty { call: call(i), layer: 2, tensor: Tensor::V, fault: Fault::Stale { since: 1 } };
        let faults: Vec<Faulty> = (3..8).map(skipped).collect();
        let gate = correctness_gate(&steps, true, &CLEAN_CACHE, &faults, &INTACT, &g);
        assert!(!gate.passed, "{}", gate.detail);
        assert!(
            gate.detail.contains("5 appended K/V row(s)")
                && gate.detail.contains("call 3 (Timed, pos 4099), layer 2: V")
        );
        assert!(gate.detail.contains("2 more in the report"), "{}", gate.detail);
    }
}
