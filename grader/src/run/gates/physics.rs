//! Doing less work must not pay: every call reads (nearly) the bytes its layer needs from DRAM, and
//! no call runs faster than the device can read those bytes.
//!
//! - `bytes_read`: the hardware's count of DRAM bytes each call read (CUPTI's range profiler in the
//!   runner) against the byte model of that call (weights plus the KV rows it attends). An 8-bit
//!   copy of a weight, or weights kept in L2, read fewer bytes. Where the counters cannot be read
//!   the run is `unaudited`, visibly, and `--require-audit` makes that a failure.
//! - `plausible_timing`: each call on the judge's clock against the time the read-only stream
//!   measured in this same run needs for its bytes; and the runner's own clock, which must agree
//!   with the judge's (a report whose clock disagrees was tampered with).

use spec::{Call, Gates, Phase};

use super::{Gate, Source};
use crate::run::pace::Paced;
use crate::run::runner::Audit;
use crate::stats::Summary;

/// The runner's interval lies inside the judge's; this much disagreement is clock granularity.
const CLOCK_GRANULARITY_US: f64 = 2.0;
/// How much longer than the runner's clock the judge's may run: the signalling, and the sleep
/// between looks once a wait outlasts the spin (a small share of a long command).
const CLOCK_SLACK_US: f64 = 200.0;
const CLOCK_SLACK_SHARE: f64 = 0.01;

/// Whether a call is held to the byte model: every call timed alone (L2 flushed before it), and the
/// back-to-back calls when their bytes are far larger than L2 (smaller layers stay in L2 between
/// back-to-back calls, as they would in a real model of that size).
pub fn held_to_model(calls: &[Call], model: &[u64], l2_bytes: u64) -> Vec<bool> {
    const L2_MULTIPLE: u64 = 4;
    calls.iter().map(|c| c.phase != Phase::Throughput || model[c.index] >= L2_MULTIPLE * l2_bytes).collect()
}

/// What each call read against its byte model (bytes, per call of the schedule); `held` says which
/// calls the gate holds to it.
pub fn bytes_read_gate(
    audit: &Audit,
    model: &[u64],
    held: &[bool],
    paced: &Paced,
    require_audit: bool,
    gates: &Gates,
) -> Gate {
    let limit = gates.min_bytes_read;
    if let Some(reason) = &audit.unavailable {
        let consequence = if require_audit { " (--require-audit: a failure)" } else { "" };
        return Gate {
            name: "bytes_read",
            source: Source::Hardware,
            passed: !require_audit,
            value: f64::NAN,
            limit,
            detail: format!("unaudited: {reason}{consequence}"),
        };
    }
    // Calls run alone have their own range; back-to-back calls share their batch's.
    let in_batch = |i: usize| audit.batches.iter().any(|b| (b.first..b.first + b.count).contains(&i));
    let missing: Vec<usize> = (0..audit.calls.len()).filter(|&i| audit.calls[i].is_none() && !in_batch(i)).collect();
    let mut ratios: Vec<(String, f64, f64, u64)> = audit
        .calls
        .iter()
        .zip(model)
        .enumerate()
        .filter(|(i, _)| held[*i])
        .filter_map(|(i, (c, &m))| c.as_ref().map(|c| (format!("call {i}"), c.bytes_read, c.bytes_read / m as f64, m)))
        .collect();
    for b in &audit.batches {
        let span = b.first..b.first + b.count;
        if span.clone().all(|i| held.get(i) == Some(&true)) {
            let m: u64 = model[span].iter().sum();
            let what = format!("the back-to-back calls {}..{}", b.first, b.first + b.count - 1);
            ratios.push((what, b.counters.bytes_read, b.counters.bytes_read / m as f64, m));
        }
    }
    let Some((what, wbytes, worst, wmodel)) = ratios.iter().min_by(|a, b| a.2.total_cmp(&b.2)).cloned() else {
        return Gate {
            name: "bytes_read",
            source: Source::Hardware,
            passed: false,
            value: f64::NAN,
            limit,
            detail: "the audit ran but no call held to the byte model was measured".into(),
        };
    };
    let singles: Vec<f64> = audit.calls.iter().flatten().map(|c| c.bytes_read).collect();
    let read = Summary::of(&singles);
    let tbps = Summary::of(
        &paced
            .call_us
            .iter()
            .zip(&audit.calls)
            .filter_map(|(us, c)| Some(c.as_ref()?.bytes_read / (us.as_ref()? * 1e-6) / 1e12))
            .collect::<Vec<_>>(),
    );
    let mut problems = Vec::new();
    if worst < limit {
        problems.push(format!(
            "{what} read {:.3} GB from DRAM, {worst:.3}x of the {:.3} GB byte model: fewer bytes than the layer needs",
            wbytes / 1e9,
            wmodel as f64 / 1e9
        ));
    }
    if let Some(first) = missing.first() {
        problems.push(format!("{} call(s) were not audited (first: call {first})", missing.len()));
    }
    let detail = if problems.is_empty() {
        format!(
            "every call read at least {worst:.3}x of its byte model{}{}",
            read.map_or(String::new(), |r| format!(" (min {:.3} GB, median {:.3} GB)", r.min / 1e9, r.median / 1e9)),
            tbps.map_or(String::new(), |t| format!("; {:.2} TB/s DRAM read at the median call", t.median))
        )
    } else {
        problems.join("; ")
    };
    Gate { name: "bytes_read", source: Source::Hardware, passed: problems.is_empty(), value: worst, limit, detail }
}

/// The fastest a call with `bytes` can be, at the read-only ceiling less the margin, in us.
pub fn bound_us(bytes: u64, read_tbps: f64, gates: &Gates) -> f64 {
    bytes as f64 / (read_tbps * 1e12) * 1e6 * (1.0 - gates.read_ceiling_margin)
}

/// No call faster than reading its bytes allows; the runner's clock in step with the judge's.
pub fn plausible_timing_gate(
    calls: &[Call],
    paced: &Paced,
    runner_us: &[(usize, usize, f64)],
    model: &[u64],
    held: &[bool],
    read_tbps: f64, // the read-only ceiling (`Bandwidth::read_ceiling_tbps`)
    gates: &Gates,
) -> Gate {
    let mut problems = Vec::new();
    // Each timed call, and the back-to-back phase per call, over its bound.
    let mut ratios: Vec<(String, f64, f64)> = calls
        .iter()
        .filter(|c| c.phase == Phase::Timed)
        .filter_map(|c| {
            paced.call_us[c.index]
                .map(|us| (format!("call {}", c.index), us, bound_us(model[c.index], read_tbps, gates)))
        })
        .collect();
    let batch: Vec<&Call> = calls.iter().filter(|c| c.phase == Phase::Throughput).collect();
    if paced.batch_calls > 0 && batch.iter().all(|c| held[c.index]) {
        let per_call = paced.batch_us / paced.batch_calls as f64;
        let bytes = batch.iter().map(|c| model[c.index]).sum::<u64>() / batch.len().max(1) as u64;
        ratios.push(("the back-to-back phase".into(), per_call, bound_us(bytes, read_tbps, gates)));
    }
    let fastest = ratios.iter().min_by(|a, b| (a.1 / a.2).total_cmp(&(b.1 / b.2)));
    if let Some((what, us, bound)) = fastest
        && us < bound
    {
        problems.push(format!(
            "{what} took {us:.1} us, under the {bound:.1} us that reading its bytes at the read-only ceiling \
             ({read_tbps:.2} TB/s, measured in this run) allows: the timing was fooled"
        ));
    }
    // The runner's clock over each command of calls, against the judge's.
    let mut worst_gap: f64 = 0.0;
    for &(first, count, runner) in runner_us {
        let judge = if count == 1 { paced.call_us.get(first).copied().flatten() } else { Some(paced.batch_us) };
        let Some(judge) = judge else {
            problems.push(format!("the runner reports a command (calls {first}..+{count}) the judge never timed"));
            continue;
        };
        let gap = judge - runner;
        worst_gap = worst_gap.max(gap);
        if gap < -CLOCK_GRANULARITY_US || gap > CLOCK_SLACK_US + CLOCK_SLACK_SHARE * judge {
            problems.push(format!(
                "for calls {first}..+{count} the runner's clock says {runner:.1} us and the judge's {judge:.1} us: the \
                 runner's report was tampered with"
            ));
            break;
        }
    }
    let timed_commands =
        calls.iter().filter(|c| c.phase != Phase::Throughput).count() + usize::from(paced.batch_calls > 0);
    if runner_us.len() != timed_commands {
        problems
            .push(format!("the runner reports {} commands of calls, the judge made {timed_commands}", runner_us.len()));
    }
    let value = fastest.map_or(f64::NAN, |f| f.1 / f.2);
    let detail = if problems.is_empty() {
        format!(
            "fastest {} at {value:.3}x the read-only bound ({read_tbps:.2} TB/s less {:.0}%); runner and judge clocks \
             agree within {worst_gap:.1} us",
            fastest.map_or("call", |f| f.0.as_str()),
            gates.read_ceiling_margin * 100.0
        )
    } else {
        problems.join("; ")
    };
    Gate { name: "plausible_timing", source: Source::Judge, passed: problems.is_empty(), value, limit: 1.0, detail }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::run::runner::{Batch, Counters};

    const MODEL: u64 = 1_728_000_000;

    fn schedule() -> Vec<Call> {
        let mut cfg = spec::Config::graded();
        (cfg.correctness_steps, cfg.timed_steps) = (1, 2);
        spec::schedule(&cfg)
    }

    fn paced(call_us: f64, batch_us: f64) -> Paced {
        let calls = schedule();
        let timed: Vec<Option<f64>> = calls.iter().map(|c| (c.phase != Phase::Throughput).then_some(call_us)).collect();
        Paced {
            build_s: 0.1,
            call_us: timed,
            batch_us,
            batch_calls: 2,
            ping_us: Summary::of(&[1.0]).unwrap(),
            inputs: vec![],
            outputs: vec![],
        }
    }

    fn audit(bytes: f64) -> Audit {
        let c = Counters { bytes_read: bytes, bytes_written: 1e6, ctas: 132.0 };
        let batch = Batch { first: 3, count: 2, counters: Counters { bytes_read: 2.0 * bytes, ..c.clone() } };
        Audit {
            unavailable: None,
            calls: vec![Some(c.clone()), Some(c.clone()), Some(c), None, None],
            batches: vec![batch],
        }
    }

    #[test]
    fn reading_the_model_passes_and_reading_less_fails() {
        let g = Gates::TASK;
        let model = vec![MODEL; 5];
        let ok = bytes_read_gate(&audit(1.74e9), &model, &[true; 5], &paced(440.0, 880.0), false, &g);
        assert!(ok.passed && ok.detail.contains("TB/s"), "{ok:?}");
        let int8 = bytes_read_gate(&audit(1.5e9), &model, &[true; 5], &paced(440.0, 880.0), false, &g);
        let mut batch_only = audit(1.74e9);
        batch_only.batches[0].counters.bytes_read = 2.6e9;
        let cheap_batch = bytes_read_gate(&batch_only, &model, &[true; 5], &paced(440.0, 880.0), false, &g);
        assert!(!cheap_batch.passed && cheap_batch.detail.contains("back-to-back calls 3..4"), "{cheap_batch:?}");
        let not_held = bytes_read_gate(&audit(1.5e9), &model, &[false; 5], &paced(440.0, 880.0), false, &g);
        assert!(!not_held.passed && not_held.detail.contains("no call held"), "{not_held:?}");
        assert!(!int8.passed && int8.detail.contains("byte model"), "{int8:?}");
    }

    #[test]
    fn unaudited_runs_say_so_and_fail_only_when_required() {
        let g = Gates::TASK;
        let none = Audit { unavailable: Some("counters restricted".into()), calls: vec![None; 5], batches: vec![] };
        let gate = bytes_read_gate(&none, &[MODEL; 5], &[true; 5], &paced(440.0, 880.0), false, &g);
        assert!(gate.passed && gate.detail.starts_with("unaudited: counters restricted"), "{gate:?}");
        let gate = bytes_read_gate(&none, &[MODEL; 5], &[true; 5], &paced(440.0, 880.0), true, &g);
        assert!(!gate.passed && gate.detail.contains("--require-audit"), "{gate:?}");
    }

    fn runner_clock(us: f64, batch: f64) -> Vec<(usize, usize, f64)> {
        vec![(0, 1, us), (1, 1, us), (2, 1, us), (3, 2, batch)]
    }

    #[test]
    fn calls_faster_than_the_read_ceiling_are_implausible() {
        let g = Gates::TASK;
        let calls = schedule();
        let model = vec![MODEL; calls.len()];
        // 1.728 GB at 4.5 TB/s is 384 us; less 3% is 372.5 us.
        let honest = plausible_timing_gate(
            &calls,
            &paced(440.0, 860.0),
            &runner_clock(435.0, 855.0),
            &model,
            &[true; 5],
            4.5,
            &g,
        );
        assert!(honest.passed, "{honest:?}");
        let fast = plausible_timing_gate(
            &calls,
            &paced(300.0, 860.0),
            &runner_clock(295.0, 855.0),
            &model,
            &[true; 5],
            4.5,
            &g,
        );
        assert!(!fast.passed && fast.detail.contains("read-only ceiling"), "{fast:?}");
    }

    #[test]
    fn a_runner_clock_out_of_step_with_the_judge_is_tampering() {
        let g = Gates::TASK;
        let calls = schedule();
        let model = vec![MODEL; calls.len()];
        // The runner claims 390 us where the judge waited 1038 us.
        let forged = plausible_timing_gate(
            &calls,
            &paced(1038.0, 2000.0),
            &runner_clock(390.0, 1990.0),
            &model,
            &[true; 5],
            4.5,
            &g,
        );
        assert!(!forged.passed && forged.detail.contains("tampered"), "{forged:?}");
        let missing = plausible_timing_gate(
            &calls,
            &paced(440.0, 860.0),
            &runner_clock(435.0, 855.0)[..2],
            &model,
            &[true; 5],
            4.5,
            &g,
        );
        assert!(!missing.passed && missing.detail.contains("commands"), "{missing:?}");
    }
}
