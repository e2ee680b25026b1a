//! **forged-ack**: the megakernel, plus a thread started in `build_layer` that finds the runner's
//! control page in `/proc/self/maps` and, the moment the judge posts a command of calls, writes its
//! acknowledgement itself, long before the call has finished: the judge's clock would stop at once.
//!
//! Caught by plausible_timing: the runner's own clock over the call runs past the moment the judge
//! saw it acknowledged, which an honest acknowledgement (written after the device synchronised)
//! never does. (The judge also reads the output at once, often before it is written.)

use std::sync::atomic::{AtomicU64, Ordering};

use cuda::Device;
use spec::Config;
use submission::{Layer, Submission, SubmissionError};

use super::background::Background;
use super::honest::{Extra, WithExtra};

pub const NAME: &str = "forged-ack";

/// The control page's name (`memfd:` in the maps), and its words as the runner lays them out: the
/// judge's command word `(sequence << 8) | kind` first, the runner's acknowledgement on the next
/// cache line.
const PAGE_NAME: &str = "persistent-layer-control";
const ACK_WORD: usize = 8;
const CALLS_KIND: u64 = 3;

pub fn make() -> Box<dyn Submission> {
    WithExtra::boxed(NAME, ForgedAck { forger: None })
}

struct ForgedAck {
    forger: Option<Background>,
}

/// The address of the control page in this process, from its mapping's line in the maps.
fn control_page() -> Result<usize, SubmissionError> {
    let maps = std::fs::read_to_string("/proc/self/maps")
        .map_err(|e| SubmissionError::Refused(format!("cannot read /proc/self/maps: {e}")))?;
    let line = maps
        .lines()
        .find(|l| l.contains(PAGE_NAME))
        .ok_or_else(|| SubmissionError::Refused("no control page mapped (not run by the grader's runner?)".into()))?;
    let start = line.split('-').next().unwrap_or_default();
    usize::from_str_radix(start, 16).map_err(|e| SubmissionError::Refused(format!("a maps line without address: {e}")))
}

impl Extra for ForgedAck {
    fn build(&mut self, _dev: &Device, _layer: &Layer<'_>, _cfg: &Config) -> Result<(), SubmissionError> {
        let page = control_page()?;
        let mut last = 0;
        self.forger = Some(Background::start(move || {
            // SAFETY: the page is mapped for the runner's life, and
            // its words are atomics of the runner's layout, which this thread may race with.
            let (command, ack) = unsafe {
                let base = page as *const AtomicU64;
                (&*base, &*base.add(ACK_WORD))
            };
            let word = command.load(Ordering::Acquire);
            let seq = word >> 8;
            if seq != last {
                last = seq;
                if word & 0xff == CALLS_KIND {
                    ack.store(seq, Ordering::Release);
                }
            }
            std::hint::spin_loop();
        }));
        Ok(())
    }

    fn teardown(&mut self) {
        self.forger = None;
    }
}
