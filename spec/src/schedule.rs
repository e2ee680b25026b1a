//! The schedule of a run: every call of `layer_step` the grader makes, in order, with its phase,
//! position and where its input comes from.
//!
//! Every call is recorded (kernels, copies, DRAM bytes) and compared with the reference, whatever its
//! phase: no call is "the one that is watched", so nothing a submission can tell about a call (its
//! index, its phase) changes how it is judged. The phases differ only in what the judge's clock does.

use serde::{Deserialize, Serialize};

use crate::Config;

/// How many times the judge runs the back-to-back phase's chain, each from a fresh input. One host
/// stall inside a chain's single window leaves that window short of recorded GPU work, which is what
/// hidden work looks like; a stall is chance, and the phase passes when one attempt's window is
/// whole (Llama-3.2-1B under 16 busy threads on 16 cores: one window failed one run in two, three
/// failed together in one run of seven; docs/perf.md).
pub const BACK_TO_BACK_ATTEMPTS: usize = 3;
// `Phase::describe` and docs/task.md say "three attempts".
const _: () = assert!(BACK_TO_BACK_ATTEMPTS == 3, "Phase::describe names three attempts");

/// The phases of a run, in order. Every phase starts again at position `prefill`, so each attends
/// over the same cache depth; so does each attempt of the back-to-back phase.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    /// Untimed, first: also the warm-up.
    Correctness,
    /// Timed one by one by the judge, L2 flushed and the device idle before each: the score.
    Timed,
    /// Timed back to back by the judge: each call's input is the previous call's output, the data
    /// dependency of a real decode, so no call can start before its predecessor has finished. The
    /// chain runs [`BACK_TO_BACK_ATTEMPTS`] times, each attempt from a fresh input.
    Throughput,
}

impl Phase {
    pub const ALL: [Phase; 3] = [Phase::Correctness, Phase::Timed, Phase::Throughput];

    /// Calls of this phase at `cfg`.
    pub fn calls(self, cfg: &Config) -> usize {
        match self {
            Phase::Correctness => cfg.correctness_steps,
            Phase::Timed => cfg.timed_steps,
            Phase::Throughput => cfg.timed_steps * BACK_TO_BACK_ATTEMPTS,
        }
    }

    /// What the judge does around the calls of this phase, in one line.
    pub fn describe(self) -> &'static str {
        match self {
            Phase::Correctness => "untimed, one call at a time, fresh input each",
            Phase::Timed => "timed one call at a time by the judge, fresh input each, L2 flushed before each",
            Phase::Throughput => {
                "timed back to back by the judge, each input the previous call's output; three attempts, each from a fresh input"
            }
        }
    }
}

/// Where a call's input `x` comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Input {
    /// Drawn by the judge from its secret input seed and handed over just before the call.
    Fresh,
    /// The output of call `index` (the previous call of the same attempt of the back-to-back phase).
    OutputOf(usize),
}

/// One call of `layer_step`: its index in the run, phase, position and input.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Call {
    pub index: usize,
    pub phase: Phase,
    pub pos: usize,
    pub input: Input,
}

/// How many calls a run at `cfg` makes, over every phase; `None` if that overflows.
pub fn call_count(cfg: &Config) -> Option<usize> {
    Phase::ALL.iter().try_fold(0usize, |n, phase| n.checked_add(phase.calls(cfg)))
}

/// Every call of a run at `cfg`, in order.
pub fn schedule(cfg: &Config) -> Vec<Call> {
    let mut calls = Vec::new();
    for phase in Phase::ALL {
        for s in 0..phase.calls(cfg) {
            let index = calls.len();
            // Each attempt of the back-to-back phase is a chain over the timed phase's positions.
            let step = s % cfg.timed_steps.max(1);
            let chained = phase == Phase::Throughput && step > 0;
            let input = if chained { Input::OutputOf(index - 1) } else { Input::Fresh };
            let pos = cfg.prefill + if phase == Phase::Throughput { step } else { s };
            calls.push(Call { index, phase, pos, input });
        }
    }
    calls
}

/// The judge's commands of calls, as ranges of call indices in order: each call on its own, but each
/// attempt of the back-to-back phase (a fresh input and the calls chained to it) as one command.
pub fn commands(calls: &[Call]) -> Vec<std::ops::Range<usize>> {
    calls.chunk_by(|a, b| b.input == Input::OutputOf(a.index)).map(|c| c[0].index..c[0].index + c.len()).collect()
}

/// The back-to-back phase's attempts, as ranges of call indices in order.
pub fn back_to_back(calls: &[Call]) -> Vec<std::ops::Range<usize>> {
    commands(calls).into_iter().filter(|r| calls[r.start].phase == Phase::Throughput).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn phases_restart_at_prefill_and_throughput_chains() {
        let cfg = Config::graded();
        let calls = schedule(&cfg);
        assert_eq!(calls.len(), 8 + 32 + 3 * 32);
        assert_eq!(call_count(&cfg), Some(calls.len()));
        assert!(calls.iter().enumerate().all(|(i, c)| c.index == i));
        let timed: Vec<usize> = calls.iter().filter(|c| c.phase == Phase::Timed).map(|c| c.pos).collect();
        assert_eq!(timed, (4096..4128).collect::<Vec<_>>());
        assert!(calls.iter().all(|c| c.pos < cfg.max_seq_len));
        let attempts = back_to_back(&calls);
        assert_eq!(attempts, vec![40..72, 72..104, 104..136]);
        for a in &attempts {
            let chain = &calls[a.clone()];
            assert!(chain.iter().all(|c| c.phase == Phase::Throughput));
            assert_eq!(chain[0].input, Input::Fresh);
            assert_eq!(chain.iter().map(|c| c.pos).collect::<Vec<_>>(), timed);
            for w in chain.windows(2) {
                assert_eq!(w[1].input, Input::OutputOf(w[0].index));
            }
        }
        assert!(calls.iter().filter(|c| c.phase != Phase::Throughput).all(|c| c.input == Input::Fresh));
        // Every other call is a command of its own.
        let commands = commands(&calls);
        assert_eq!(commands.len(), 40 + 3);
        assert!(commands[..40].iter().enumerate().all(|(i, r)| *r == (i..i + 1)));
    }
}
