//! Doing less work must not pay: every call reads (nearly) the bytes its layer needs from DRAM, and
//! no call runs faster than the device can read those bytes.
//!
//! - `bytes_read`: the hardware's count of DRAM bytes each call read (the judge's own PM sampling of
//!   the device, `run::counters`) against the bytes that call must read: its byte model (weights
//!   plus the KV rows it attends), less one L2's worth for a back-to-back call chained to its
//!   predecessor with no flush between (what the previous call left in L2, as in a real decode). An
//!   8-bit copy of a weight, or weights kept in L2 across calls, read fewer bytes. Where the
//!   counters could not be read from the start the gate is `unaudited` and the verdict UNAUDITED;
//!   an audit that stopped during the run fails. The runner's range profiler, where it could run
//!   beside the judge's, is held against the judge's figures call by call.
//! - `plausible_timing`: each call on the judge's clock against the time the read-only stream
//!   measured in this same run needs for the bytes it must read; and the runner's own clock, which
//!   must lie inside the judge's (a call the runner's clock ends after the judge saw it acknowledged
//!   was acknowledged before its work was done: a forged acknowledgement).

use spec::{Call, Gates, Input, Phase};

use super::{Gate, Source};
use crate::run::pace::Paced;
use crate::run::protocol::{Audit, CommandTime, Coverage};
use crate::stats::Summary;

/// The runner's interval lies inside the judge's; this much disagreement is clock granularity.
const CLOCK_GRANULARITY_US: f64 = 2.0;
/// How much longer than the runner's clock the judge's usually runs: the signalling, and the sleep
/// between looks once a wait outlasts the spin (a small share of a long command). A longer wait (a
/// host stall before the runner saw the command) is noted, never failed: the figures use the
/// judge's clock, so a longer one only makes the submission look slower.
const CLOCK_SLACK_US: f64 = 200.0;
const CLOCK_SLACK_SHARE: f64 = 0.01;

/// Whether `call` is chained to its predecessor with no L2 flush between: a back-to-back call other
/// than the first of its batch (the runner flushes L2 after every command of calls, so the batch's
/// first call, and every call run alone, starts with nothing of the layer in L2).
fn chained(call: &Call) -> bool {
    call.phase == Phase::Throughput && matches!(call.input, Input::OutputOf(_))
}

/// The DRAM bytes each call must read: its byte model, less `l2_bytes` for a call chained to its
/// predecessor (whatever the previous call left in L2, the KV rows both attend say, need not come
/// from DRAM again; no more than the L2 holds can). Every call is held to it; a batch must read the
/// sum over its calls, its byte model less (calls - 1) L2s.
pub fn required_bytes(calls: &[Call], model: &[u64], l2_bytes: u64) -> Vec<u64> {
    calls.iter().map(|c| if chained(c) { model[c.index].saturating_sub(l2_bytes) } else { model[c.index] }).collect()
}

/// A command of calls as a reader names it: one call, or a back-to-back batch.
fn command_name(first: usize, count: usize) -> String {
    if count == 1 { format!("call {first}") } else { format!("the back-to-back calls {first}..{}", first + count - 1) }
}

fn gb(bytes: f64) -> String {
    format!("{:.3} GB", bytes / 1e9)
}

/// "60 MiB".
fn mib(bytes: u64) -> String {
    format!("{:.0} MiB", bytes as f64 / f64::from(1u32 << 20))
}

/// What each call read against what it must read (bytes, per call of the schedule: `model`, the
/// byte model, and `required`, from [`required_bytes`] with the device's `l2_bytes`), by the judge's
/// `audit`: calls run alone have a window each; back-to-back calls share their batch's.
pub fn bytes_read_gate(
    audit: &Audit,
    model: &[u64],
    required: &[u64],
    l2_bytes: u64,
    paced: &Paced,
    gates: &Gates,
) -> Gate {
    let limit = gates.min_bytes_read;
    let unmeasured = |detail: String| Gate {
        name: "bytes_read",
        source: Source::Hardware,
        passed: false,
        value: f64::NAN,
        limit,
        detail,
    };
    match &audit.coverage {
        Coverage::Measured => {}
        Coverage::Unaudited(reason) => return unmeasured(format!("unaudited: {reason}")),
        Coverage::Lost(reason) => return unmeasured(format!("the audit was lost: {reason}")),
    }
    let in_batch = |i: usize| audit.batches.iter().any(|b| (b.first..b.first + b.count).contains(&i));
    let missing: Vec<usize> = (0..audit.calls.len()).filter(|&i| audit.calls[i].is_none() && !in_batch(i)).collect();
    // (what, bytes read, ratio to what it must read, its byte model, what it must read)
    let mut ratios: Vec<(String, f64, f64, u64, u64)> = audit
        .calls
        .iter()
        .enumerate()
        .filter_map(|(i, c)| Some((i, c.as_ref()?, *model.get(i)?, *required.get(i)?)))
        .filter(|&(.., r)| r > 0)
        .map(|(i, c, m, r)| (format!("call {i}"), c.bytes_read, c.bytes_read / r as f64, m, r))
        .collect();
    for b in &audit.batches {
        let span = b.first..b.first + b.count;
        let (Some(m), Some(r)) = (model.get(span.clone()), required.get(span)) else { continue };
        let (m, r) = (m.iter().sum::<u64>(), r.iter().sum::<u64>());
        if r > 0 {
            let what = command_name(b.first, b.count);
            ratios.push((what, b.counters.bytes_read, b.counters.bytes_read / r as f64, m, r));
        }
    }
    let allowance = format!("chained back-to-back calls allowed the L2's {} less", mib(l2_bytes));
    let Some((what, wbytes, worst, wmodel, wrequired)) = ratios.iter().min_by(|a, b| a.2.total_cmp(&b.2)).cloned()
    else {
        return unmeasured("the audit ran but no call was measured".into());
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
        let must = if wrequired == wmodel {
            format!("the {} byte model", gb(wmodel as f64))
        } else {
            format!("the {} they must read (a {} byte model; {allowance})", gb(wrequired as f64), gb(wmodel as f64))
        };
        problems.push(format!(
            "{what} read {} from DRAM, {worst:.3}x of {must}: fewer bytes than the layer needs",
            gb(wbytes)
        ));
    }
    if let Some(first) = missing.first() {
        problems.push(format!("{} call(s) were not audited (first: call {first})", missing.len()));
    }
    let detail = if problems.is_empty() {
        format!(
            "every call read at least {worst:.3}x of its byte model ({allowance}){}{}",
            read.map_or(String::new(), |r| format!(" (min {}, median {})", gb(r.min), gb(r.median))),
            tbps.map_or(String::new(), |t| format!("; {:.2} TB/s DRAM read at the median call", t.median)),
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

/// No call faster than reading the bytes it must read allows (`required`, from [`required_bytes`]);
/// the runner's clock inside the judge's on every command of calls.
pub fn plausible_timing_gate(
    calls: &[Call],
    paced: &Paced,
    runner_us: &[CommandTime],
    required: &[u64],
    read_tbps: f64, // the read-only ceiling (`Bandwidth::read_ceiling_tbps`)
    gates: &Gates,
) -> Gate {
    let mut problems = Vec::new();
    // Each timed call, and each attempt of the back-to-back phase per call, over its bound: a stall
    // only slows an attempt, so every one is held to it.
    let mut ratios: Vec<(String, f64, f64)> = calls
        .iter()
        .filter(|c| c.phase == Phase::Timed)
        .filter_map(|c| {
            paced.call_us[c.index]
                .map(|us| (format!("call {}", c.index), us, bound_us(required[c.index], read_tbps, gates)))
        })
        .collect();
    for b in paced.batches.iter().filter(|b| b.count > 0) {
        let per_call = b.us / b.count as f64;
        // Chained calls are allowed what the L2 holds less: an honest chained call is never under it.
        let Some(batch) = required.get(b.first..b.first + b.count) else { continue };
        let bytes = batch.iter().sum::<u64>() / b.count as u64;
        ratios.push((command_name(b.first, b.count), per_call, bound_us(bytes, read_tbps, gates)));
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
    // The runner's clock over each command of calls, against the judge's. The runner's interval lies
    // inside the judge's: the judge posts the command before the runner can see it and sees the
    // acknowledgement only after the runner wrote it. A runner's clock longer than the judge's means
    // the judge saw the command acknowledged before the runner's call had ended: the acknowledgement
    // (a word on a shared page any code in the runner process can write) was forged. A judge's clock
    // far longer than the runner's is a host stall before the runner saw the command: the judge's
    // clock, which the figures use, carries it, so it is information, never a failure.
    // Each command that waited on the host, with how long (`us`).
    let mut stalls: Vec<CommandTime> = Vec::new();
    for &CommandTime { first, count, us: runner } in runner_us {
        let judge = match paced.batches.iter().find(|b| b.first == first && b.count == count) {
            Some(b) => Some(b.us),
            None if count == 1 => paced.call_us.get(first).copied().flatten(),
            None => None,
        };
        let Some(judge) = judge else {
            problems.push(format!("the runner reports a command (calls {first}..+{count}) the judge never timed"));
            continue;
        };
        let lead = runner - judge;
        if lead > CLOCK_GRANULARITY_US {
            let which = command_name(first, count);
            problems.push(format!(
                "the judge saw {which} acknowledged {lead:.1} us before the runner's own clock ended it (judge \
                 {judge:.1} us, runner {runner:.1} us): the acknowledgement was forged from inside the runner process"
            ));
            break;
        }
        if -lead > CLOCK_SLACK_US + CLOCK_SLACK_SHARE * judge {
            stalls.push(CommandTime { first, count, us: -lead });
        }
    }
    let timed_commands = calls.iter().filter(|c| c.phase != Phase::Throughput).count() + paced.batches.len();
    if runner_us.len() != timed_commands {
        problems
            .push(format!("the runner reports {} commands of calls, the judge made {timed_commands}", runner_us.len()));
    }
    let carried = "the judge's clock, which the figures use, carries it: information, not a failure";
    let stall_note = match stalls.iter().max_by(|a, b| a.us.total_cmp(&b.us)) {
        None => String::new(),
        Some(&CommandTime { first, count, us: wait }) => {
            let which = command_name(first, count);
            let slack = CLOCK_SLACK_US;
            if stalls.len() == 1 {
                format!(
                    "; {which} waited {wait:.1} us on the host before the runner saw it (past the {slack:.0} us \
                     slack; {carried})"
                )
            } else {
                format!(
                    "; {} commands waited on the host past the {slack:.0} us slack before the runner saw them, \
                     the longest {wait:.1} us ({which}; {carried})",
                    stalls.len()
                )
            }
        }
    };
    let value = fastest.map_or(f64::NAN, |f| f.1 / f.2);
    let detail = if problems.is_empty() {
        format!(
            "fastest {} at {value:.3}x the read-only bound ({read_tbps:.2} TB/s less {:.0}%); the runner's clock \
             inside the judge's on every command (to the {CLOCK_GRANULARITY_US:.0} us granularity){stall_note}",
            fastest.map_or("call", |f| f.0.as_str()),
            gates.read_ceiling_margin * 100.0,
        )
    } else {
        problems.join("; ") + &stall_note
    };
    Gate { name: "plausible_timing", source: Source::Judge, passed: problems.is_empty(), value, limit: 1.0, detail }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::run::protocol::{Batch, Counters};

    const MODEL: u64 = 1_728_000_000;

    fn schedule() -> Vec<Call> {
        let mut cfg = spec::Config::graded();
        (cfg.correctness_steps, cfg.timed_steps) = (1, 2);
        spec::schedule(&cfg)
    }

    /// Every attempt of the back-to-back phase of `calls`, each taking `us`.
    fn batches(calls: &[Call], us: f64) -> Vec<CommandTime> {
        spec::back_to_back(calls).into_iter().map(|r| CommandTime { first: r.start, count: r.len(), us }).collect()
    }

    fn paced(call_us: f64, batch_us: f64) -> Paced {
        let calls = schedule();
        let timed: Vec<Option<f64>> = calls.iter().map(|c| (c.phase != Phase::Throughput).then_some(call_us)).collect();
        Paced {
            build_s: 0.1,
            call_us: timed,
            batches: batches(&calls, batch_us),
            ping_us: Summary::of(&[1.0]).unwrap(),
            inputs: vec![],
            outputs: vec![],
            hidden: vec![],
            appended: vec![],
        }
    }

    /// The calls of [`schedule`]: one correctness call, two timed, then three attempts of two.
    const CALLS: usize = 9;

    fn audit(bytes: f64) -> Audit {
        let calls = schedule();
        let c = Counters { bytes_read: bytes, bytes_written: 1e6, ctas: 132.0 };
        let batch = |r: std::ops::Range<usize>| Batch {
            first: r.start,
            count: r.len(),
            counters: Counters { bytes_read: r.len() as f64 * bytes, ..c.clone() },
        };
        Audit {
            coverage: Coverage::Measured,
            calls: calls.iter().map(|call| (call.phase != Phase::Throughput).then(|| c.clone())).collect(),
            batches: spec::back_to_back(&calls).into_iter().map(batch).collect(),
        }
    }

    /// The H200's L2, as the device reports it.
    const L2: u64 = 60 << 20;

    fn required(calls: &[Call], model: &[u64]) -> Vec<u64> {
        required_bytes(calls, model, L2)
    }

    #[test]
    fn reading_the_model_passes_and_reading_less_fails() {
        let g = Gates::TASK;
        let calls = schedule();
        let model = vec![MODEL; CALLS];
        let req = required(&calls, &model);
        // Calls run alone and each attempt's first call must read their whole byte model.
        let attempt = [MODEL, MODEL - L2];
        assert_eq!(req, [[MODEL; 3].as_slice(), &attempt, &attempt, &attempt].concat());
        let p = paced(440.0, 880.0);
        let ok = bytes_read_gate(&audit(1.74e9), &model, &req, L2, &p, &g);
        assert!(ok.passed && ok.detail.contains("TB/s") && ok.detail.contains("60 MiB less"), "{ok:?}");
        let int8 = bytes_read_gate(&audit(1.5e9), &model, &req, L2, &p, &g);
        assert!(!int8.passed && int8.detail.contains("call 0") && int8.detail.contains("byte model"), "{int8:?}");
        // Every attempt is held to its bytes, not only the one whose figure is reported.
        let mut batch_only = audit(1.74e9);
        batch_only.batches[1].counters.bytes_read = 2.6e9;
        let cheap_batch = bytes_read_gate(&batch_only, &model, &req, L2, &p, &g);
        assert!(!cheap_batch.passed && cheap_batch.detail.contains("back-to-back calls 5..6"), "{cheap_batch:?}");
        assert!(
            cheap_batch.detail.contains("byte model") && cheap_batch.detail.contains("60 MiB less"),
            "{cheap_batch:?}"
        );
        let nothing = Audit { coverage: Coverage::Measured, calls: vec![None; CALLS], batches: vec![] };
        let none = bytes_read_gate(&nothing, &model, &req, L2, &p, &g);
        assert!(!none.passed && none.detail.contains("no call was measured"), "{none:?}");
    }

    /// A Llama-3-8B-shaped layer (d 4096, ffn 14336, 32/8 heads) on an H200: 0.44 GB per call, of
    /// which 16.8 MB of KV rows. Back to back, each chained call finds its predecessor's KV rows in
    /// L2 and reads 0.96x of its byte model; every one of them is held, to its model less one L2.
    #[test]
    fn chained_calls_may_find_the_l2_warm_but_no_more() {
        let g = Gates::TASK;
        let mut cfg = spec::Config::graded();
        (cfg.correctness_steps, cfg.timed_steps) = (1, 32);
        let calls = spec::schedule(&cfg);
        let (model, kv) = (440_000_000u64, 16_800_000u64);
        let models = vec![model; calls.len()];
        let req = required(&calls, &models);
        let attempts = spec::back_to_back(&calls);
        let count = attempts[0].len();
        for a in &attempts {
            assert_eq!(req[a.start], model, "each attempt's first call follows a flush");
            assert!(a.clone().skip(1).all(|i| req[i] == model - L2));
        }
        let alone = Counters { bytes_read: model as f64 * 1.01, bytes_written: 1e6, ctas: 132.0 };
        let run = |chained_read: u64| {
            let read = model as f64 * 1.01 + (count - 1) as f64 * chained_read as f64;
            let counters = Counters { bytes_read: read, ..alone.clone() };
            Audit {
                coverage: Coverage::Measured,
                calls: calls.iter().map(|c| (c.phase != Phase::Throughput).then(|| alone.clone())).collect(),
                batches: attempts.iter().map(|a| Batch { first: a.start, count, counters: counters.clone() }).collect(),
            }
        };
        let p =
            Paced { call_us: vec![Some(110.0); calls.len()], batches: batches(&calls, 3500.0), ..paced(110.0, 0.0) };
        // Honest: the KV rows stay in L2 between chained calls (0.962x of the model each).
        let warm_kv = bytes_read_gate(&run(model - kv), &models, &req, L2, &p, &g);
        assert!(warm_kv.passed, "{warm_kv:?}");
        // Reading 10 MB more than the L2 holds less per chained call is not the L2's doing.
        let cached = bytes_read_gate(&run(model - L2 - 10_000_000), &models, &req, L2, &p, &g);
        assert!(
            !cached.passed && cached.detail.contains("back-to-back calls") && cached.detail.contains("byte model"),
            "{cached:?}"
        );
        // The timing bound of the back-to-back phase is the required bytes' too: an honest chained
        // call at the read ceiling is never under it.
        let bytes_per_call = (model + (count as u64 - 1) * (model - kv)) / count as u64;
        let honest_us = bytes_per_call as f64 / 4.5e12 * 1e6;
        let p = Paced { batches: batches(&calls, honest_us * count as f64), ..p };
        let runner: Vec<CommandTime> = calls
            .iter()
            .filter(|c| c.phase != Phase::Throughput)
            .map(|c| CommandTime { first: c.index, count: 1, us: 105.0 })
            .chain(batches(&calls, honest_us * count as f64 - 5.0))
            .collect();
        let timing = plausible_timing_gate(&calls, &p, &runner, &req, 4.5, &g);
        assert!(timing.passed, "{timing:?}");
    }

    /// A run unaudited from the start never passes the gate, and says why; a lost audit says it was
    /// lost.
    #[test]
    fn unaudited_and_lost_audits_never_pass() {
        let g = Gates::TASK;
        let req = required(&schedule(), &[MODEL; CALLS]);
        let p = paced(440.0, 880.0);
        let none = Audit::without(Coverage::Unaudited("counters restricted".into()), CALLS);
        let gate = bytes_read_gate(&none, &[MODEL; CALLS], &req, L2, &p, &g);
        assert!(!gate.passed && gate.detail.starts_with("unaudited: counters restricted"), "{gate:?}");
        let lost = Audit::without(Coverage::Lost("stopped after call 3".into()), CALLS);
        let gate = bytes_read_gate(&lost, &[MODEL; CALLS], &req, L2, &p, &g);
        assert!(!gate.passed && gate.detail.starts_with("the audit was lost: stopped after call 3"), "{gate:?}");
    }

    fn runner_clock(us: f64, batch: f64) -> Vec<CommandTime> {
        let one = |first| CommandTime { first, count: 1, us };
        [vec![one(0), one(1), one(2)], batches(&schedule(), batch)].concat()
    }

    #[test]
    fn calls_faster_than_the_read_ceiling_are_implausible() {
        let g = Gates::TASK;
        let calls = schedule();
        let req = required(&calls, &vec![MODEL; calls.len()]);
        // 1.728 GB at 4.5 TB/s is 384 us; less 3% is 372.5 us.
        let honest = plausible_timing_gate(&calls, &paced(440.0, 860.0), &runner_clock(435.0, 855.0), &req, 4.5, &g);
        assert!(honest.passed && honest.detail.contains("inside the judge's"), "{honest:?}");
        let fast = plausible_timing_gate(&calls, &paced(300.0, 860.0), &runner_clock(295.0, 855.0), &req, 4.5, &g);
        assert!(!fast.passed && fast.detail.contains("read-only ceiling"), "{fast:?}");
        // Each attempt of the back-to-back phase is held to its required bytes: 2 x 1.728 GB less one
        // L2, at 4.5 TB/s less 3%, is 731.4 us for the two calls; 700 us is under it, in any attempt.
        let mut one_fast = paced(440.0, 860.0);
        one_fast.batches[2].us = 700.0;
        let mut runner = runner_clock(435.0, 855.0);
        runner[5].us = 695.0;
        let fast_batch = plausible_timing_gate(&calls, &one_fast, &runner, &req, 4.5, &g);
        assert!(!fast_batch.passed && fast_batch.detail.contains("back-to-back calls 7..8 took"), "{fast_batch:?}");
    }

    #[test]
    fn a_judge_clock_longer_than_the_runners_is_a_stall_not_tampering() {
        let g = Gates::TASK;
        let calls = schedule();
        let req = required(&calls, &vec![MODEL; calls.len()]);
        // One call waited on the host: the judge's clock 551.9 us, the runner's 289.4 us (a
        // Qwen-32B-like run); the judge's clock is the one the figures use.
        let mut runner = runner_clock(435.0, 855.0);
        runner[1].us = 289.4;
        let mut timing = paced(440.0, 860.0);
        timing.call_us[1] = Some(551.9);
        let stalled = plausible_timing_gate(&calls, &timing, &runner, &req, 4.5, &g);
        assert!(stalled.passed && stalled.detail.contains("call 1 waited 262.5 us on the host"), "{stalled:?}");
        assert!(stalled.detail.contains("not a failure"), "{stalled:?}");
        // Every call stalled: counted, the longest named.
        let slow = plausible_timing_gate(&calls, &paced(1038.0, 2000.0), &runner_clock(390.0, 1990.0), &req, 4.5, &g);
        assert!(
            slow.passed && slow.detail.contains("3 commands waited") && slow.detail.contains("648.0 us"),
            "{slow:?}"
        );
        let missing =
            plausible_timing_gate(&calls, &paced(440.0, 860.0), &runner_clock(435.0, 855.0)[..2], &req, 4.5, &g);
        assert!(!missing.passed && missing.detail.contains("commands"), "{missing:?}");
    }

    /// The judge stops its clock when it sees the acknowledgement; a runner whose own clock ends the
    /// call later was acknowledged before the work was done.
    #[test]
    fn a_runner_clock_longer_than_the_judges_is_a_forged_acknowledgement() {
        let g = Gates::TASK;
        let calls = schedule();
        let req = required(&calls, &vec![MODEL; calls.len()]);
        let mut runner = runner_clock(435.0, 855.0);
        runner[2].us = 445.0;
        let forged = plausible_timing_gate(&calls, &paced(440.0, 860.0), &runner, &req, 4.5, &g);
        assert!(!forged.passed, "{forged:?}");
        assert!(
            forged.detail.contains("the judge saw call 2 acknowledged 5.0 us before the runner's own clock ended it")
                && forged.detail.contains("forged from inside the runner process"),
            "{forged:?}"
        );
        // Within the clocks' granularity is no evidence.
        runner[2].us = 441.5;
        assert!(plausible_timing_gate(&calls, &paced(440.0, 860.0), &runner, &req, 4.5, &g).passed);
        let batch = plausible_timing_gate(&calls, &paced(440.0, 860.0), &runner_clock(435.0, 900.0), &req, 4.5, &g);
        assert!(!batch.passed && batch.detail.contains("back-to-back calls 3..4 acknowledged 40.0 us"), "{batch:?}");
    }
}
