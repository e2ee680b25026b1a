//! The schedule of a run: every call of `layer_step` the grader makes, in order, with its phase,
//! position and where its input comes from.
//!
//! Every call is recorded (kernels, copies, DRAM bytes) and compared with the reference, whatever its
//! phase: no call is "the one that is watched", so nothing a submission can tell about a call (its
//! index, its phase) changes how it is judged. The phases differ only in what the judge's clock does.

use serde::{Deserialize, Serialize};

use crate::Config;

/// The phases of a run, in order. Every phase starts again at position `prefill`, so each attends
/// over the same cache depth.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    /// Untimed, first: also the warm-up.
    Correctness,
    /// Timed one by one by the judge, L2 flushed and the device idle before each: the score.
    Timed,
    /// Timed back to back by the judge: each call's input is the previous call's output, the data
    /// dependency of a real decode, so no call can start before its predecessor has finished.
    Throughput,
}

impl Phase {
    pub const ALL: [Phase; 3] = [Phase::Correctness, Phase::Timed, Phase::Throughput];

    /// Calls of this phase at `cfg`.
    pub fn calls(self, cfg: &Config) -> usize {
        match self {
            Phase::Correctness => cfg.correctness_steps,
            Phase::Timed | Phase::Throughput => cfg.timed_steps,
        }
    }

    /// What the judge does around the calls of this phase, in one line.
    pub fn describe(self) -> &'static str {
        match self {
            Phase::Correctness => "untimed, one call at a time, fresh input each",
            Phase::Timed => "timed one call at a time by the judge, fresh input each, L2 flushed before each",
            Phase::Throughput => "timed back to back by the judge, each input the previous call's output",
        }
    }
}

/// Where a call's input `x` comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Input {
    /// Drawn by the judge from its secret input seed and handed over just before the call.
    Fresh,
    /// The output of call `index` (the previous call of the same phase).
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
            let input = if phase == Phase::Throughput && s > 0 { Input::OutputOf(index - 1) } else { Input::Fresh };
            calls.push(Call { index, phase, pos: cfg.prefill + s, input });
        }
    }
    calls
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn phases_restart_at_prefill_and_throughput_chains() {
        let cfg = Config::graded();
        let calls = schedule(&cfg);
        assert_eq!(calls.len(), 8 + 32 + 32);
        assert_eq!(call_count(&cfg), Some(calls.len()));
        assert!(calls.iter().enumerate().all(|(i, c)| c.index == i));
        let timed: Vec<usize> = calls.iter().filter(|c| c.phase == Phase::Timed).map(|c| c.pos).collect();
        assert_eq!(timed, (4096..4128).collect::<Vec<_>>());
        assert!(calls.iter().all(|c| c.pos < cfg.max_seq_len));
        let throughput: Vec<&Call> = calls.iter().filter(|c| c.phase == Phase::Throughput).collect();
        assert_eq!(throughput[0].input, Input::Fresh);
        for w in throughput.windows(2) {
            assert_eq!(w[1].input, Input::OutputOf(w[0].index));
        }
        assert!(calls.iter().filter(|c| c.phase != Phase::Throughput).all(|c| c.input == Input::Fresh));
    }
}
