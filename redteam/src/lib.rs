//! The red team: adversarial submissions that try to fool the grader, each of which it must catch;
//! the native ones here, with their kernels (`kernels/`), the Python ones in `python/` ([`python`]).
//!
//! Every adversary is a small [`Submission`] that wraps an honest one (usually the eager reference,
//! which is correct and simple; the megakernel where the timing must otherwise pass) and misbehaves
//! in exactly one way. [`ALL`] lists them with what the grader must conclude ([`Expect`]); the grader
//! runs each through `grader run` in a child process and checks that conclusion.
//!
//! Shared pieces: [`honest`] (the eager step and the wrapper that adds one twist to it), [`raw`]
//! (device writes a well-behaved submission never makes: into read-only buffers, into cache slots),
//! [`int8`] (the down projection as int8 rows with exact outliers, and the step that streams it),
//! [`region`] (the buffers of later calls, next to a call's own), [`recording`] (the runner's CUPTI
//! kernel records switched off from inside), [`CallCount`],
//! [`quantize`] (lossy weight formats, simulated on the host).

mod abort;
mod audit_off;
mod background;
mod batcher;
mod between_calls;
mod build_kernel;
mod corrupt_prefix;
mod crash;
mod defer_to_teardown;
mod device_launch;
mod forged_ack;
pub mod forged_audit;
mod forged_report;
mod graph_of_kernels;
mod hang;
mod helper_process;
mod honest;
mod int8;
mod int8_down;
mod int8_down_padded;
pub mod kernels;
mod lingerer;
mod lookahead;
mod lossy_weights;
mod memset_cover;
mod modify_input;
mod modify_weights;
mod nan_output;
mod no_kv_write;
mod pass_through;
mod persisting_l2;
mod phase_aware;
mod pure_read;
pub mod python;
pub mod quantize;
mod raw;
mod recording;
mod recording_off;
mod recording_off_waiter;
mod region;
mod replay_by_pointer;
mod replay_by_position;
mod short_attention;
mod side_stream;
mod skip_a_layer;
mod skip_timed_append;
mod spawn_in_step;
mod wrong_slot;

pub use forged_report::{REPORT_FD, forged_line};
pub use region::buffer_stride;

use cuda::cudarc::driver::LaunchConfig;

use submission::{Submission, SubmissionError};

/// What the grader must conclude for an adversary.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Expect {
    /// The named gate fails, and its detail contains `word`.
    GateFails { gate: &'static str, word: &'static str },
    /// The run ends with status `crashed` (the submission process died or reported a CUDA error).
    Crashed,
    /// The run ends with status `crashed` for the reason its message names (contains `word`).
    CrashedFor { word: &'static str },
    /// The run ends with status `timeout` (the watchdog killed the submission process).
    Timeout,
    /// Nothing fails, but the measured step time includes the hidden work: at least `min_us` per step.
    TimedHonestly { min_us: f64 },
    /// The layer is correct, and the report names `count` processes the submission left running after
    /// its runner exited, each killed by the judge and gone.
    LeftBehind { count: usize },
}

// The only float, `min_us`, is always a finite constant (a test checks it), so equality is total.
impl Eq for Expect {}

/// One adversary: its name (what `grader run` is given), the exploit in one line, the verdict the
/// grader must reach, and a constructor.
#[derive(Debug, Clone, Copy)]
pub struct Adversary {
    pub name: &'static str,
    pub what: &'static str,
    pub expect: Expect,
    pub make: fn() -> Box<dyn Submission>,
}

/// The gates of `grader/src/run/gates/`, by the names their verdicts carry.
pub const GATES: [&str; 9] = [
    "correctness",
    "kernels_per_step",
    "dominant_share",
    "launch_record",
    "record_coverage",
    "exclusive_gpu",
    "bytes_read",
    "l2_persisting",
    "plausible_timing",
];

const fn correctness(word: &'static str) -> Expect {
    Expect::GateFails { gate: "correctness", word }
}

const fn kernels(word: &'static str) -> Expect {
    Expect::GateFails { gate: "kernels_per_step", word }
}

/// The DRAM-traffic audit's verdict on a step that read under 0.98 of the byte model, as in "call 9
/// read 1.50 GB, 0.87x of the 1.73 GB byte model".
const READ_TOO_LITTLE: Expect = Expect::GateFails { gate: "bytes_read", word: "byte model" };

/// The launch record's verdict on a step whose launches left no GPU record, as in "20 kernel
/// launch(es) (first: cuLaunchKernel in call 0) left no GPU record: the activity recording was switched off".
const NO_GPU_RECORD: Expect = Expect::GateFails { gate: "launch_record", word: "left no GPU record" };

/// Every adversary, in the order a report lists them.
pub const ALL: &[Adversary] = &[
    Adversary {
        name: pass_through::NAME,
        what: "copies x to out with one memcpy: no layer at all",
        expect: correctness("over the tolerance"),
        make: pass_through::make,
    },
    Adversary {
        name: skip_a_layer::NAME,
        what: "in a stack, the last layer passes its input through (its cache written); one layer: a pass-through",
        expect: correctness("over the tolerance"),
        make: skip_a_layer::make,
    },
    Adversary {
        name: short_attention::SKIP,
        what: "the eager layer with attention skipped (attends over no slot)",
        expect: correctness("over the tolerance"),
        make: short_attention::make_skip,
    },
    Adversary {
        name: short_attention::RECENT_QUARTER,
        what: "the eager layer attending only over the most recent quarter of the cache",
        expect: correctness("over the tolerance"),
        make: short_attention::make_recent_quarter,
    },
    Adversary {
        name: no_kv_write::NAME,
        what: "computes correctly, then restores cache slot pos to what it held before the step",
        expect: correctness("appended K/V rows differ"),
        make: no_kv_write::make,
    },
    Adversary {
        name: skip_timed_append::SKIP_K,
        what: "the eager layer, its K append skipped (the slot put back as it was) in the timed calls only",
        expect: correctness("was not appended"),
        make: skip_timed_append::skip_k,
    },
    Adversary {
        name: skip_timed_append::SKIP_V,
        what: "the eager layer, its V append skipped (the slot put back as it was) in the timed calls only",
        expect: correctness("was not appended"),
        make: skip_timed_append::skip_v,
    },
    Adversary {
        name: skip_timed_append::SKIP_LAYER,
        what: "the eager stack, the middle layer's K and V appends skipped in the timed calls only",
        expect: correctness("was not appended"),
        make: skip_timed_append::skip_layer,
    },
    Adversary {
        name: wrong_slot::NAME,
        what: "computes correctly, then moves the K/V rows of slot pos to slot pos + 1",
        expect: correctness("appended K/V rows differ"),
        make: wrong_slot::make,
    },
    Adversary {
        name: corrupt_prefix::NAME,
        what: "computes correctly, and on its first call flips one bit of the cached prefix (K, slot 0)",
        expect: correctness("prefix were modified"),
        make: corrupt_prefix::make,
    },
    Adversary {
        name: replay_by_position::NAME,
        what: "remembers its output per position and replays it when a position comes again",
        expect: correctness("over the tolerance"),
        make: replay_by_position::make,
    },
    Adversary {
        name: replay_by_pointer::NAME,
        what: "memoises outputs by the x buffer's address, replaying the latest one on a miss",
        expect: correctness("over the tolerance"),
        make: replay_by_pointer::make,
    },
    Adversary {
        name: side_stream::NAME,
        what: "the megakernel, plus a 4 GiB copy per step on a stream of its own that it never joins",
        expect: Expect::TimedHonestly { min_us: side_stream::MIN_STEP_US },
        make: side_stream::make,
    },
    Adversary {
        name: between_calls::NAME,
        what: "the megakernel, plus a thread that queues small copies on its own stream, between calls too",
        expect: Expect::GateFails { gate: "launch_record", word: "request(s) for GPU work" },
        make: between_calls::make,
    },
    Adversary {
        name: forged_ack::NAME,
        what: "the megakernel, plus a thread that writes the runner's acknowledgement as soon as a call is posted",
        expect: Expect::GateFails { gate: "plausible_timing", word: "forged" },
        make: forged_ack::make,
    },
    Adversary {
        name: build_kernel::NAME,
        what: "a persistent server kernel launched in build_layer; steps only post requests by memcpy",
        expect: kernels("launched no kernel"),
        make: build_kernel::make,
    },
    Adversary {
        name: graph_of_kernels::NAME,
        what: "the eager layer's 21 launches captured into a CUDA graph and launched as one",
        expect: kernels("graph"),
        make: graph_of_kernels::make,
    },
    Adversary {
        name: defer_to_teardown::NAME,
        what: "steps only snapshot x; teardown computes every output in call order before the check",
        expect: correctness("NaN or Inf"),
        make: defer_to_teardown::make,
    },
    Adversary {
        name: modify_weights::NAME,
        what: "computes correctly, and on its first call flips one bit of w.o (read-only)",
        expect: correctness("weights were modified"),
        make: modify_weights::make,
    },
    Adversary {
        name: modify_input::NAME,
        what: "computes correctly, then flips one bit of its input x (read-only)",
        expect: correctness("input x buffer"),
        make: modify_input::make,
    },
    Adversary {
        name: nan_output::NAME,
        what: "computes correctly, then writes a NaN into out[0]",
        expect: correctness("NaN or Inf"),
        make: nan_output::make,
    },
    Adversary {
        name: crash::NAME,
        what: "computes correctly, then launches a kernel that stores to an unmapped address",
        expect: Expect::Crashed,
        make: crash::make,
    },
    Adversary {
        name: hang::NAME,
        what: "computes correctly, then launches a kernel that waits for a flag nobody sets",
        expect: Expect::Timeout,
        make: hang::make,
    },
    Adversary {
        name: abort::NAME,
        what: "computes correctly, and aborts the process on its third call",
        expect: Expect::Crashed,
        make: abort::make,
    },
    Adversary {
        name: int8_down::NAME,
        what: "the eager layer with the down projection streamed as int8 rows, outliers kept exact",
        expect: READ_TOO_LITTLE,
        make: int8_down::make,
    },
    Adversary {
        name: audit_off::NAME,
        what: "int8-down, stopping the audit from inside: the profiler torn down, the device's monitors grabbed",
        expect: READ_TOO_LITTLE,
        make: audit_off::make,
    },
    Adversary {
        name: int8_down_padded::NAME,
        what: "int8-down, each step padded by a spin kernel to its byte model's time at 4.6 TB/s",
        expect: READ_TOO_LITTLE,
        make: int8_down_padded::make,
    },
    Adversary {
        name: persisting_l2::NAME,
        what: "the megakernel with the largest persisting-L2 set-aside and a window pinning w_o there",
        expect: Expect::GateFails { gate: "l2_persisting", word: "persisting" },
        make: persisting_l2::make,
    },
    Adversary {
        name: pure_read::NAME,
        what: "computes nothing: one kernel reads every weight and attended K/V row once, out = x",
        expect: correctness("over the tolerance"),
        make: pure_read::make,
    },
    Adversary {
        name: device_launch::NAME,
        what: "the megakernel, plus a one-thread parent per step that launches child kernels from the device",
        expect: Expect::GateFails { gate: "launch_record", word: "device-side launch" },
        make: device_launch::make,
    },
    Adversary {
        name: memset_cover::NAME,
        what: "the megakernel, plus a parent launching child kernels from the device, covered by one-byte memsets",
        expect: Expect::GateFails { gate: "launch_record", word: "escaped the record" },
        make: memset_cover::make,
    },
    Adversary {
        name: phase_aware::NAME,
        what: "the megakernel on the run's last 4 calls (once the only ones profiled), the eager layer on the rest",
        expect: kernels("at most 21"),
        make: phase_aware::make,
    },
    Adversary {
        name: recording_off::NAME,
        what: "the eager layer with CUPTI's kernel records switched off after each step's first launch",
        expect: NO_GPU_RECORD,
        make: recording_off::make,
    },
    Adversary {
        name: recording_off_waiter::NAME,
        what: "recording-off, plus a recorded waiter kernel on a side stream spinning until the hidden work is done",
        expect: NO_GPU_RECORD,
        make: recording_off_waiter::make,
    },
    Adversary {
        name: helper_process::NAME,
        what: "the megakernel, plus a helper process holding a GPU context of its own from build_layer to teardown",
        expect: Expect::GateFails { gate: "exclusive_gpu", word: "other process" },
        make: helper_process::make,
    },
    Adversary {
        name: spawn_in_step::NAME,
        what: "the megakernel, and on its third call it starts a process",
        expect: Expect::CrashedFor { word: "start a process" },
        make: spawn_in_step::make,
    },
    Adversary {
        name: lingerer::NAME,
        what: "the megakernel, plus two processes started in build_layer and left running, one detached into a session of its own",
        expect: Expect::LeftBehind { count: lingerer::LEFT },
        make: lingerer::make,
    },
    Adversary {
        name: forged_report::NAME,
        what: "the eager layer, and in teardown a forged report of one kernel per call on the runner's report channel",
        expect: Expect::CrashedFor { word: "report channel" },
        make: forged_report::make,
    },
    Adversary {
        name: forged_audit::NAME,
        what: "int8-down, and a forged report carrying the judge's nonce: one kernel a call, each call's byte model read",
        expect: READ_TOO_LITTLE,
        make: forged_audit::make,
    },
    Adversary {
        name: lookahead::NAME,
        what: "tries to read the judge's memory; answers each call from its input's buffer, read a call ahead",
        expect: correctness("NaN or Inf"),
        make: lookahead::make,
    },
    Adversary {
        name: batcher::NAME,
        what: "computes the whole back-to-back phase at its first call, from the buffers where its inputs will be",
        expect: correctness("NaN or Inf"),
        make: batcher::make,
    },
    Adversary {
        name: lossy_weights::INT8_ROWS_DOWN,
        what: "the eager layer with Wdown stored as int8, one scale per row",
        expect: correctness("over the tolerance"),
        make: lossy_weights::make_int8_rows_down,
    },
    Adversary {
        name: lossy_weights::INT8_GROUPS_GATE,
        what: "the eager layer with Wgate stored as int8, one scale per group of 128 columns",
        expect: correctness("over the tolerance"),
        make: lossy_weights::make_int8_groups_gate,
    },
    Adversary {
        name: lossy_weights::FP8_UP,
        what: "the eager layer with Wup stored as fp8 e4m3, one scale per row",
        expect: correctness("over the tolerance"),
        make: lossy_weights::make_fp8_up,
    },
];

/// An adversary by name.
pub fn find(name: &str) -> Option<&'static Adversary> {
    ALL.iter().find(|a| a.name == name)
}

/// Names of every adversary, in [`ALL`]'s order.
pub fn names() -> impl Iterator<Item = &'static str> {
    ALL.iter().map(|a| a.name)
}

/// A launch of one block of one thread.
const ONE_THREAD: LaunchConfig = LaunchConfig { grid_dim: (1, 1, 1), block_dim: (1, 1, 1), shared_mem_bytes: 0 };

/// Counts the calls of `layer_step` a submission has had.
#[derive(Debug, Default)]
struct CallCount(usize);

impl CallCount {
    /// The index, from 0, of the call being made now; counts it.
    fn next(&mut self) -> usize {
        self.0 += 1;
        self.0 - 1
    }

    /// How many calls were counted.
    fn made(&self) -> usize {
        self.0
    }
}

/// The error of a step called before `build_layer`.
fn not_built() -> SubmissionError {
    SubmissionError::Refused("layer_step before build_layer".into())
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use super::*;

    fn is_kebab(name: &str) -> bool {
        !name.is_empty()
            && !name.starts_with('-')
            && !name.ends_with('-')
            && !name.contains("--")
            && name.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
    }

    #[test]
    fn names_are_unique_and_kebab_case() {
        assert!(ALL.len() >= 12, "only {} adversaries", ALL.len());
        let mut seen = HashSet::new();
        for a in ALL {
            assert!(is_kebab(a.name), "'{}' is not kebab-case", a.name);
            assert!(seen.insert(a.name), "'{}' is listed twice", a.name);
            assert!(!a.what.is_empty(), "{}: no description", a.name);
        }
    }

    #[test]
    fn expectations_name_real_gates() {
        for a in ALL {
            match a.expect {
                Expect::GateFails { gate, word } => {
                    assert!(GATES.contains(&gate), "{}: no gate '{gate}'", a.name);
                    assert!(!word.trim().is_empty(), "{}: empty word", a.name);
                }
                Expect::TimedHonestly { min_us } => assert!(min_us.is_finite() && min_us > 0.0, "{}", a.name),
                Expect::Crashed | Expect::Timeout => {}
                Expect::CrashedFor { word } => assert!(!word.trim().is_empty(), "{}: empty word", a.name),
                Expect::LeftBehind { count } => assert!(count > 0, "{}", a.name),
            }
        }
        // Every kind of conclusion is exercised, and the correctness, kernel, DRAM-traffic and L2
        // gates by at least one adversary. The share gate is the honest split's to fail (the
        // verdict's unit tests), and the timing guard is a backstop: deferring work past a step's
        // synchronisation, the one way to look faster than the floor, is caught first by
        // correctness (defer-to-teardown), and reading too little by the audit (int8-down-padded).
        let gates: HashSet<&str> = ALL
            .iter()
            .filter_map(|a| match a.expect {
                Expect::GateFails { gate, .. } => Some(gate),
                _ => None,
            })
            .collect();
        for gate in ["correctness", "kernels_per_step", "bytes_read", "l2_persisting"] {
            assert!(gates.contains(gate), "no adversary targets {gate}");
        }
        for kind in [Expect::Crashed, Expect::Timeout] {
            assert!(ALL.iter().any(|a| a.expect == kind), "no adversary expects {kind:?}");
        }
        assert!(ALL.iter().any(|a| matches!(a.expect, Expect::TimedHonestly { .. })));
    }

    #[test]
    fn find_returns_each_adversary_and_nothing_else() {
        for a in ALL {
            assert_eq!(find(a.name).map(|f| f.name), Some(a.name));
        }
        assert!(find("honest").is_none());
        assert!(find("").is_none());
        assert_eq!(names().count(), ALL.len());
    }

    /// Construction touches no GPU; each submission reports the name it is listed under.
    #[test]
    fn each_submission_reports_its_own_name() {
        for a in ALL {
            assert_eq!((a.make)().name(), a.name);
        }
    }

    /// The mailbox layout of the server kernel matches `kernels/redteam/redteam.cu`.
    #[test]
    fn server_mailbox_mirrors_the_kernel() {
        let cu = include_str!("../../kernels/redteam/redteam.cu");
        for (word, index) in build_kernel::MAILBOX_WORDS {
            let line = format!("constexpr int MAILBOX_{word} = {index};");
            assert!(cu.contains(&line), "kernels/redteam/redteam.cu must define {line}");
        }
    }

    /// Every kernel the red team launches exists in its kernel file by that exact name.
    #[test]
    fn launched_kernels_exist() {
        let redteam = ("kernels/redteam/redteam.cu", include_str!("../../kernels/redteam/redteam.cu"));
        let cdp = ("kernels/redteam/redteam_cdp.cu", include_str!("../../kernels/redteam/redteam_cdp.cu"));
        for ((file, cu), name) in [
            (redteam, crash::KERNEL),
            (redteam, hang::KERNEL),
            (redteam, build_kernel::KERNEL),
            (redteam, int8::KERNEL),
            (redteam, int8_down_padded::STAMP),
            (redteam, int8_down_padded::SPIN),
            (cdp, device_launch::KERNEL),
        ] {
            assert!(cu.contains(&format!("__global__ void {name}(")), "no kernel {name} in {file}");
        }
    }

    /// The device-launch adversary's verdict comes from the scanner's own words, on its own module.
    #[test]
    fn the_device_launch_module_is_what_the_scanner_catches() {
        let Some(Adversary { expect: Expect::GateFails { word, .. }, .. }) = find(device_launch::NAME) else {
            panic!("{} must expect a gate to fail", device_launch::NAME);
        };
        let findings = submission::device_code::scan(crate::kernels::REDTEAM_CDP.fatbin);
        assert!(!findings.is_empty() && findings.iter().all(|f| f.to_string().contains(word)));
    }
}
