//! Gates 2 and 3 (at most 2 kernels in every call, the largest with at least 0.95 of its kernel
//! time) over every call of the run, and the two gates that say the record they read is whole.
//!
//! The counts come from CUPTI inside the runner, and are checked against what the submission cannot
//! reach. `launch_record`: the hardware's count of thread blocks launched (every block must belong to
//! a recorded kernel, or to a recorded copy or set, as many as the driver runs for its size), with the
//! record's own findings (launches seen by one view only, recording switched off, kernels from
//! elsewhere running during a call, device-side launch modules). `record_coverage`: the judge's clock
//! (the recorded GPU work must cover most of each timed call, and one attempt of the back-to-back
//! phase), the one rule a stall of the host can also fail.

use spec::{Call, Gates, Phase};

use super::{Gate, Source};
use crate::cupti::{Record, StepLaunches};
use crate::run::pace::Paced;
use crate::run::protocol::{Audit, Coverage};

/// Host time per recorded launch (and one more for the call itself) that a call may spend outside
/// recorded GPU work before the shortfall counts: launching, synchronising, a small-config layer
/// bound by launch overhead (the eager reference at `small`: 21 kernels, ~110 us of 160 us not on
/// the GPU). A Python submission's every launch also passes through the interpreter: the task's eager
/// layer in torch at `small` spent about 33 us per launch, 1.84 ms of a 2.03 ms call, off the GPU.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LaunchAllowance {
    pub us_per_launch: f64,
}

impl LaunchAllowance {
    pub const NATIVE: LaunchAllowance = LaunchAllowance { us_per_launch: 10.0 };
    pub const PYTHON: LaunchAllowance = LaunchAllowance { us_per_launch: 50.0 };
}

/// Gate 2: the most kernels any call ran.
pub fn kernels_gate(calls: &[Call], launches: &[StepLaunches], gates: &Gates) -> Gate {
    let limit = gates.max_kernels_per_step;
    let Some((worst, w)) = launches.iter().enumerate().max_by_key(|(_, l)| l.kernels) else {
        return Gate {
            name: "kernels_per_step",
            source: Source::Runner,
            passed: false,
            value: f64::NAN,
            limit,
            detail: "no call was recorded".into(),
        };
    };
    let mut notes = vec![format!(
        "at most {} kernels in a call (call {worst}); {} over all {} calls",
        w.kernels,
        per_phase(calls, launches),
        launches.len()
    )];
    let sum = |f: fn(&StepLaunches) -> usize| launches.iter().map(f).sum::<usize>();
    for (what, n) in [
        ("kernel(s) replayed from a CUDA graph", sum(|s| s.graph_kernels)),
        ("kernel(s) launched from the device", sum(|s| s.device_launched)),
        ("memcpy record(s)", sum(|s| s.memcpys)),
        ("memset record(s)", sum(|s| s.memsets)),
    ] {
        if n > 0 {
            notes.push(format!("{n} {what} inside the calls"));
        }
    }
    let idle: Vec<usize> = launches.iter().enumerate().filter(|(_, l)| l.kernels == 0).map(|(i, _)| i).collect();
    if let Some(first) = idle.first() {
        notes.push(format!("{} call(s) launched no kernel (first: call {first})", idle.len()));
    }
    Gate {
        name: "kernels_per_step",
        source: Source::Runner,
        passed: w.kernels as f64 <= limit && idle.is_empty(),
        value: w.kernels as f64,
        limit,
        detail: notes.join("; "),
    }
}

/// "mean 1.00 (correctness 1.00, timed 1.00, throughput 1.00)".
fn per_phase(calls: &[Call], launches: &[StepLaunches]) -> String {
    let mean = |f: &dyn Fn(&Call) -> bool| {
        let ks: Vec<f64> = calls.iter().zip(launches).filter(|(c, _)| f(c)).map(|(_, l)| l.kernels as f64).collect();
        ks.iter().sum::<f64>() / ks.len().max(1) as f64
    };
    let phases: Vec<String> = Phase::ALL
        .iter()
        .filter(|&&p| calls.iter().any(|c| c.phase == p))
        .map(|&p| format!("{} {:.2}", format!("{p:?}").to_lowercase(), mean(&|c| c.phase == p)))
        .collect();
    format!("mean {:.2} ({})", mean(&|_| true), phases.join(", "))
}

/// Gate 3: the largest kernel's share of each call's kernel time; the worst call counts.
pub fn share_gate(launches: &[StepLaunches], gates: &Gates) -> Gate {
    let limit = gates.min_dominant_share;
    match launches.iter().enumerate().min_by(|a, b| a.1.dominant_share.total_cmp(&b.1.dominant_share)) {
        None => Gate {
            name: "dominant_share",
            source: Source::Runner,
            passed: false,
            value: f64::NAN,
            limit,
            detail: "no call was recorded".into(),
        },
        Some((i, w)) => Gate {
            name: "dominant_share",
            source: Source::Runner,
            passed: w.dominant_share >= limit,
            value: w.dominant_share,
            limit,
            detail: format!(
                "largest kernel {} takes {:.3} of its call's kernel time (worst call: {i})",
                w.largest_kernel, w.dominant_share
            ),
        },
    }
}

/// A window on the judge's clock against the GPU work the record holds inside it: one call timed
/// alone, or one attempt of the back-to-back phase.
#[derive(Debug, Clone, PartialEq)]
pub struct Window {
    pub what: String,
    /// The recorded GPU work, in us.
    pub busy_us: f64,
    /// The judge's clock, in us.
    pub judge_us: f64,
    /// The recorded launches, and one more for each call itself.
    pub launches: usize,
}

impl Window {
    fn of(what: String, calls: std::ops::Range<usize>, judge_us: f64, record: &Record) -> Window {
        let steps = record.calls.get(calls).unwrap_or_default();
        Window {
            what,
            busy_us: steps.iter().map(|l| l.busy_ns as f64 / 1e3).sum(),
            judge_us,
            launches: steps.iter().map(|l| l.kernels + l.memcpys + l.memsets + 1).sum(),
        }
    }

    /// Short of recorded work: under `min_coverage` of the judge's clock, and by more than the
    /// allowance for every launch.
    pub fn short(&self, gates: &Gates, allowance: LaunchAllowance) -> bool {
        self.busy_us < gates.min_coverage * self.judge_us
            && self.judge_us - self.busy_us > allowance.us_per_launch * self.launches as f64
    }

    fn say_short(&self, allowance: LaunchAllowance) -> String {
        format!(
            "in {} the judge's clock ran {:.1} us but the record holds {:.1} us of GPU work ({:.2}, more than {:.0} \
             us per launch off the GPU)",
            self.what,
            self.judge_us,
            self.busy_us,
            self.busy_us / self.judge_us,
            allowance.us_per_launch
        )
    }
}

/// Each attempt of the back-to-back phase as a window, in order.
pub fn attempt_windows(record: &Record, paced: &Paced) -> Vec<Window> {
    paced
        .batches
        .iter()
        .map(|b| {
            let what = format!("the back-to-back calls {}..{}", b.first, b.first + b.count - 1);
            Window::of(what, b.first..b.first + b.count, b.us, record)
        })
        .collect()
}

/// The attempt of the back-to-back phase whose figure the report gives: the first whose window the
/// record covers (a stalled attempt's time is the host's, not the submission's), else the first.
pub fn judged_attempt(windows: &[Window], gates: &Gates, allowance: LaunchAllowance) -> usize {
    windows.iter().position(|w| !w.short(gates, allowance)).unwrap_or(0)
}

/// The recorded GPU work covers the judge's clock: in most timed calls, and in an attempt of the
/// back-to-back phase. A window short of recorded work is what work hidden from the record looks
/// like, and also what a stall of the host's makes, which is why the rule asks for most calls and one
/// attempt, and why a run failing only this gate on a host the judge saw busy is not judged
/// (`Status::HostBusy`, never a pass).
pub fn record_coverage_gate(
    calls: &[Call],
    record: &Record,
    paced: &Paced,
    gates: &Gates,
    allowance: LaunchAllowance,
) -> Gate {
    let mut problems = Vec::new();
    let timed: Vec<Window> = calls
        .iter()
        .filter(|c| c.phase == Phase::Timed)
        .filter_map(|c| {
            Some(Window::of(format!("call {}", c.index), c.index..c.index + 1, paced.call_us[c.index]?, record))
        })
        .collect();
    // One timed call stalled on the host (seen: 827 us for a 290 us call) is no evidence: hidden work
    // that pays must be in the calls that set the median figure, so the gate fails when over half the
    // timed calls are short of recorded work, and otherwise says how many were.
    let short_calls: Vec<&Window> = timed.iter().filter(|w| w.short(gates, allowance)).collect();
    let mut ratios: Vec<f64> = timed.iter().map(|w| w.busy_us / w.judge_us).collect();
    ratios.sort_by(f64::total_cmp);
    let coverage = ratios.get(ratios.len() / 2).copied().unwrap_or(f64::NAN);
    let mut note = String::new();
    if short_calls.len() * 2 > timed.len() {
        problems.push(format!(
            "{} of {} timed calls hold less recorded GPU work than their time (first: {}): work the record does not \
             show",
            short_calls.len(),
            timed.len(),
            short_calls[0].say_short(allowance)
        ));
    } else if let Some(first) = short_calls.first() {
        note = format!(
            " ({} of {} timed calls short of recorded work, as a host stall makes one, the median not: {})",
            short_calls.len(),
            timed.len(),
            first.say_short(allowance)
        );
    }
    // The back-to-back phase has one window an attempt, where a single host stall leaves the window
    // short: so it fails only when every attempt is short. Each attempt starts from a fresh input,
    // handed over after the attempt before it ended, so no attempt can prepare another's work; the
    // one a stall spared is whole, and its figure is the one reported.
    let attempts = attempt_windows(record, paced);
    let short_attempts: Vec<&Window> = attempts.iter().filter(|w| w.short(gates, allowance)).collect();
    if !attempts.is_empty() && short_attempts.len() == attempts.len() {
        problems.push(format!(
            "every attempt of the back-to-back phase holds less recorded GPU work than its time (first: {}): work \
             the record does not show",
            short_attempts[0].say_short(allowance)
        ));
    } else if let Some(first) = short_attempts.first() {
        note += &format!(
            " ({} of {} attempts of the back-to-back phase short of recorded work, as a host stall makes one; the \
             figure is the first whole attempt's: {})",
            short_attempts.len(),
            attempts.len(),
            first.say_short(allowance)
        );
    }
    let detail = if problems.is_empty() {
        format!("recorded GPU work covers {coverage:.2} of the median timed call's time{note}")
    } else {
        problems.join("; ")
    };
    Gate {
        name: "record_coverage",
        source: Source::Runner,
        passed: problems.is_empty(),
        value: coverage,
        limit: gates.min_coverage,
        detail,
    }
}

/// The record is whole: its own findings, and the hardware's thread blocks all in recorded kernels.
pub fn launch_record_gate(record: &Record, audit: &Audit) -> Gate {
    let mut problems = record.problems.clone();
    if let Coverage::Lost(why) = &audit.coverage {
        problems.push(format!("the hardware's thread blocks could not be held against the record: {why}"));
    }
    if audit.measured() {
        // Each window's hardware count against its calls' recorded kernels.
        let alone =
            audit.calls.iter().enumerate().filter_map(|(i, c)| Some((format!("call {i}"), c.as_ref()?, i..i + 1)));
        let batches = audit.batches.iter().map(|b| {
            (
                format!("the back-to-back calls {}..{}", b.first, b.first + b.count - 1),
                &b.counters,
                b.first..b.first + b.count,
            )
        });
        for (what, c, span) in alone.chain(batches) {
            let recorded: Vec<&StepLaunches> = record.calls.get(span.clone()).into_iter().flatten().collect();
            let ctas: u64 = recorded.iter().map(|l| l.ctas).sum();
            // The call's copies and sets, and the runner's own inside it, each allowed blocks by size.
            let copies = recorded.iter().map(|l| (l.memcpys + l.memsets) as u64).sum::<u64>();
            let runner = record.runner_copies.get(span).into_iter().flatten();
            let copy_blocks =
                recorded.iter().map(|l| l.copy_blocks).sum::<u64>() + runner.clone().map(|c| c.blocks).sum::<u64>();
            let copies = copies + runner.map(|c| c.copies as u64).sum::<u64>();
            let allowed = ctas.saturating_add(copy_blocks);
            if c.ctas > allowed as f64 {
                let sets = if copies > 0 {
                    format!(
                        " and its {copies} copies and sets may run {copy_blocks} more by their sizes (2 each and one \
                         per 64 bytes; a 2D copy or set of narrower rows runs one per row)"
                    )
                } else {
                    String::new()
                };
                problems.push(format!(
                    "in {what} the hardware launched {:.0} thread blocks but the recorded kernels hold {ctas}{sets}: \
                     kernels escaped the record (launched from the device, or recorded nowhere)",
                    c.ctas
                ));
                break;
            }
        }
    }
    let detail = if problems.is_empty() {
        let ctas = match &audit.coverage {
            Coverage::Measured => "; every hardware thread block in a recorded kernel".to_string(),
            Coverage::Unaudited(why) | Coverage::Lost(why) => {
                format!("; the hardware's thread blocks unaudited: {why}")
            }
        };
        format!(
            "both CUPTI views agree on every call; {} module(s) scanned, none launches from the device{ctas}",
            record.modules
        )
    } else {
        problems.join("; ")
    };
    Gate {
        name: "launch_record",
        source: Source::Runner,
        passed: problems.is_empty(),
        value: problems.len() as f64,
        limit: 0.0,
        detail,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cupti::{Activity, ActivityKind, RunnerCopies};
    use crate::run::protocol::{CommandTime, Counters};
    use crate::stats::Summary;

    fn launches(kernels: &[(u64, &str)]) -> StepLaunches {
        let mut t = 0;
        let acts: Vec<Activity> = kernels
            .iter()
            .map(|&(ns, name)| {
                t += ns + 1;
                Activity { grid: (10, 1, 1), ..Activity::synthetic(ActivityKind::Kernel, name, t - ns, t) }
            })
            .collect();
        StepLaunches::of(&acts)
    }

    fn calls(n: usize) -> Vec<Call> {
        (0..n).map(|i| Call { index: i, phase: Phase::Timed, pos: 4096 + i, input: spec::Input::Fresh }).collect()
    }

    #[test]
    fn two_kernels_at_share_096_pass_and_a_split_at_082_fails() {
        let g = Gates::TASK;
        let fused = vec![launches(&[(960, "mega"), (40, "zero_flag")]); 4];
        assert!(kernels_gate(&calls(4), &fused, &g).passed);
        let s = share_gate(&fused, &g);
        assert!(s.passed && (s.value - 0.96).abs() < 1e-3, "{s:?}");
        let split = vec![launches(&[(180, "attention"), (820, "mlp")]); 4];
        assert!(kernels_gate(&calls(4), &split, &g).passed, "two kernels pass gate 2");
        let s = share_gate(&split, &g);
        assert!(!s.passed && (s.value - 0.82).abs() < 1e-3, "{s:?}");
        let eager = vec![launches(&[(10, "k"); 21]); 4];
        let k = kernels_gate(&calls(4), &eager, &g);
        assert!(!k.passed && k.value == 21.0, "{k:?}");
    }

    /// One call with many kernels among many with one fails: no call is unobserved.
    #[test]
    fn the_worst_call_decides_and_idle_calls_fail() {
        let g = Gates::TASK;
        let mut steps = vec![launches(&[(1000, "mega")]); 40];
        steps[17] = launches(&[(100, "k"); 10]);
        let k = kernels_gate(&calls(40), &steps, &g);
        assert!(!k.passed && k.value == 10.0 && k.detail.contains("call 17"), "{k:?}");
        assert!(!share_gate(&steps, &g).passed);
        let mut idle = vec![launches(&[(1000, "mega")]); 4];
        idle[2] = launches(&[]);
        let k = kernels_gate(&calls(4), &idle, &g);
        assert!(!k.passed && k.detail.contains("launched no kernel"), "{k:?}");
        assert!(!kernels_gate(&[], &[], &g).passed);
        assert!(!share_gate(&[], &g).passed);
    }

    /// The gate and the word an adversary's entry expects.
    fn expected(name: &str) -> (&'static str, &'static str) {
        match redteam::find(name).map(|a| a.expect) {
            Some(redteam::Expect::GateFails { gate, word }) => (gate, word),
            other => panic!("{name} must expect a gate to fail, not {other:?}"),
        }
    }

    /// phase-aware: one call of the eager layer among one-kernel calls fails with the words it expects.
    #[test]
    fn phase_aware_is_caught_by_its_worst_call() {
        let (gate, word) = expected("phase-aware");
        let mut steps = vec![launches(&[(100, "k"); 21]); 8];
        steps[7] = launches(&[(1000, "mega")]);
        let k = kernels_gate(&calls(8), &steps, &Gates::TASK);
        assert!(k.name == gate && !k.passed && k.detail.contains(word), "{k:?}");
    }

    fn paced(call_us: Vec<Option<f64>>) -> Paced {
        Paced {
            build_s: 0.1,
            call_us,
            batches: vec![],
            ping_us: Summary::of(&[1.0]).unwrap(),
            inputs: vec![],
            outputs: vec![],
            hidden: vec![],
            appended: vec![],
        }
    }

    fn record(steps: Vec<StepLaunches>) -> Record {
        Record {
            build: launches(&[]),
            api_launches: steps.iter().map(|s| s.kernels).collect(),
            activities: vec![vec![]; steps.len()],
            calls: steps,
            modules: 1,
            profiler_kernels: 0,
            runner_copies: vec![],
            problems: vec![],
            windows: vec![],
        }
    }

    #[test]
    fn an_intact_record_passes_and_its_findings_fail() {
        let g = Gates::TASK;
        let r = record(vec![launches(&[(400_000, "mega")]); 2]);
        let audit = Audit {
            coverage: Coverage::Measured,
            calls: vec![Some(Counters { bytes_read: 1.0, bytes_written: 0.0, ctas: 10.0 }); 2],
            batches: vec![],
        };
        let gate = launch_record_gate(&r, &audit);
        assert!(gate.passed && gate.detail.contains("every hardware thread block in a recorded kernel"), "{gate:?}");
        let timing = paced(vec![Some(420.0), Some(430.0)]);
        let covered = record_coverage_gate(&calls(2), &r, &timing, &g, LaunchAllowance::NATIVE);
        assert!(covered.passed && covered.detail.contains("covers 0.95"), "{covered:?}");
        let mut bad = r.clone();
        bad.problems.push("3 kernel launch(es) left no GPU record".into());
        let gate = launch_record_gate(&bad, &audit);
        assert!(!gate.passed && gate.detail.contains("left no GPU record"), "{gate:?}");
    }

    /// A visible "waiter" kernel cannot hide a step's time, and hidden blocks show in the hardware count.
    #[test]
    fn uncovered_time_and_unrecorded_blocks_fail() {
        let g = Gates::TASK;
        let r = record(vec![launches(&[(100_000, "signal")]); 2]);
        let native = LaunchAllowance::NATIVE;
        let hidden = paced(vec![Some(1038.0), Some(1038.0)]);
        let gate = record_coverage_gate(&calls(2), &r, &hidden, &g, native);
        assert!(!gate.passed && gate.detail.contains("2 of 2") && gate.detail.contains("does not show"), "{gate:?}");
        // One call stalled on the host, the other covered: a note, not a failure.
        let stalled = paced(vec![Some(110.0), Some(1038.0)]);
        let gate = record_coverage_gate(&calls(2), &r, &stalled, &g, native);
        assert!(
            gate.passed && gate.detail.contains("1 of 2 timed calls short") && gate.detail.contains("call 1"),
            "{gate:?}"
        );
        // Through an interpreter a launch may take more host time, not unlimited: one kernel and a
        // 938 us gap is still work the record does not show.
        let python = LaunchAllowance::PYTHON;
        let gate = record_coverage_gate(&calls(2), &r, &hidden, &g, python);
        assert!(!gate.passed && gate.detail.contains("50 us per launch"), "{gate:?}");
        // 40 launches of 5 us in a 1.6 ms call: an eager layer in Python, host-bound, not hiding work.
        let eager = record(vec![launches(&[(5_000, "op"); 40]); 2]);
        let timing = paced(vec![Some(1600.0), Some(1600.0)]);
        assert!(!record_coverage_gate(&calls(2), &eager, &timing, &g, native).passed);
        assert!(record_coverage_gate(&calls(2), &eager, &timing, &g, python).passed);
        let waiter = record(vec![launches(&[(1_000_000, "waiter")]); 2]);
        let hw = Audit {
            coverage: Coverage::Measured,
            calls: vec![Some(Counters { bytes_read: 1.0, bytes_written: 0.0, ctas: 50_000.0 }); 2],
            batches: vec![],
        };
        let gate = launch_record_gate(&waiter, &hw);
        assert!(!gate.passed && gate.detail.contains("escaped the record"), "{gate:?}");
        assert!(record_coverage_gate(&calls(2), &waiter, &paced(vec![Some(1020.0), Some(1030.0)]), &g, native).passed);
        // The runner's own copy inside a call (a Python x_out) may run as blocks of the driver's.
        let copying = record(vec![launches(&[(400_000, "mega")]); 2]);
        let hw_copy = Audit {
            coverage: Coverage::Measured,
            calls: vec![Some(Counters { bytes_read: 1.0, bytes_written: 0.0, ctas: 148.0 }); 2],
            batches: vec![],
        };
        assert!(!launch_record_gate(&copying, &hw_copy).passed);
        // x_out of the graded layer: 16 KB device to device, 16 blocks on the H200.
        let x_out = RunnerCopies { copies: 1, blocks: crate::cupti::summary::copy_blocks_allowed(16 << 10) };
        let with_copies = Record { runner_copies: vec![x_out; 2], ..copying };
        let gate = launch_record_gate(&with_copies, &hw_copy);
        assert!(gate.passed, "{gate:?}");
    }

    /// A stall of the host inside one attempt of the back-to-back phase is noted and that attempt's
    /// figure passed over; hidden work, which must be in every attempt to pay, fails the phase.
    #[test]
    fn a_stalled_attempt_is_passed_over_and_only_every_attempt_short_fails() {
        let g = Gates::TASK;
        let native = LaunchAllowance::NATIVE;
        let mut cfg = spec::Config::graded();
        (cfg.correctness_steps, cfg.timed_steps) = (1, 2);
        let calls = spec::schedule(&cfg);
        // Every call holds 100 us of recorded work; the calls alone take 110 us on the judge's clock.
        let r = record(vec![launches(&[(100_000, "mega")]); calls.len()]);
        let attempts = |us: [f64; 3]| {
            let mut p = paced(calls.iter().map(|c| (c.phase != Phase::Throughput).then_some(110.0)).collect());
            p.batches = spec::back_to_back(&calls)
                .into_iter()
                .zip(us)
                .map(|(a, us)| CommandTime { first: a.start, count: a.len(), us })
                .collect();
            p
        };
        let judged = |p: &Paced| judged_attempt(&attempt_windows(&r, p), &g, native);
        let whole = attempts([205.0, 204.0, 206.0]);
        let gate = record_coverage_gate(&calls, &r, &whole, &g, native);
        assert!(gate.passed && !gate.detail.contains("attempts"), "{gate:?}");
        assert_eq!(judged(&whole), 0);
        // The first attempt stalled for 800 us: noted, and the second attempt's figure is the one.
        let stalled = attempts([1005.0, 204.0, 206.0]);
        let gate = record_coverage_gate(&calls, &r, &stalled, &g, native);
        assert!(gate.passed, "{gate:?}");
        assert!(
            gate.detail.contains("1 of 3 attempts of the back-to-back phase short")
                && gate.detail.contains("back-to-back calls 3..4 the judge's clock ran 1005.0 us"),
            "{gate:?}"
        );
        assert_eq!(judged(&stalled), 1);
        // Short in every attempt: work the record does not show.
        let hidden = attempts([1005.0, 1004.0, 1006.0]);
        let gate = record_coverage_gate(&calls, &r, &hidden, &g, native);
        assert!(!gate.passed && gate.detail.contains("every attempt of the back-to-back phase"), "{gate:?}");
        assert_eq!(judged(&hidden), 0);
    }

    fn with_sets(kernel_ns: u64, sets: &[u64]) -> StepLaunches {
        let mut acts =
            vec![Activity { grid: (132, 1, 1), ..Activity::synthetic(ActivityKind::Kernel, "mega", 1, 1 + kernel_ns) }];
        for (i, &bytes) in sets.iter().enumerate() {
            let t = 2 + kernel_ns + i as u64;
            acts.push(Activity {
                bytes,
                ..Activity::synthetic(ActivityKind::Memset, &format!("memset {bytes} bytes"), t, t + 1)
            });
        }
        StepLaunches::of(&acts)
    }

    /// A copy or a set is allowed the thread blocks the driver runs for its size: tiny sets no longer
    /// cover a hidden kernel's blocks, a large copy's own blocks still pass.
    #[test]
    fn copies_and_sets_cover_only_the_blocks_of_their_sizes() {
        let hw = |ctas: f64| Audit {
            coverage: Coverage::Measured,
            calls: vec![Some(Counters { bytes_read: 1.0, bytes_written: 0.0, ctas }); 2],
            batches: vec![],
        };
        // The megakernel (132 blocks) and 8 one-byte sets (3 blocks each), with a hidden 20-kernel
        // layer's 2640 blocks: once each set covered 4096 blocks.
        let tiny = record(vec![with_sets(400_000, &[1; 8]); 2]);
        let gate = launch_record_gate(&tiny, &hw(132.0 + 2640.0));
        assert!(!gate.passed && gate.detail.contains("escaped the record"), "{gate:?}");
        assert!(gate.detail.contains("its 8 copies and sets may run 24 more by their sizes"), "{gate:?}");
        // The same sets with only their own blocks (none below 8 KB) pass.
        assert!(launch_record_gate(&tiny, &hw(132.0)).passed);
        // A 256 MB set runs 32768 blocks of the driver's, a large copy 65,551: allowed by its size.
        let large = record(vec![with_sets(400_000, &[256 << 20]); 2]);
        let gate = launch_record_gate(&large, &hw(132.0 + 65_551.0));
        assert!(gate.passed, "{gate:?}");
    }
}
