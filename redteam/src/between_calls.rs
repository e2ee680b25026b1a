//! **between-calls**: the megakernel, plus a thread started in `build_layer` that keeps queueing GPU
//! work on a stream of its own the whole time, between calls too, as one polling for the judge's
//! next input (or finishing work it hid from the calls) would: a small copy, then a wait on the
//! stream, over and over.
//!
//! The exploit it stands for: work done while the runner does the judge's bidding between calls
//! (once, staging an input) is on no call's clock. Caught by the launch record: between calls the
//! submission may queue nothing, and the runner's own tag covers only requests from the runner's
//! own thread, whatever a thread writes into the tag's word.

use std::time::Duration;

use cuda::{Context, Device};
use spec::Config;
use submission::{Layer, Submission, SubmissionError};

use super::background::Background;
use super::honest::{Extra, WithExtra};

pub const NAME: &str = "between-calls";

/// Bytes of each polling copy: one graded input row.
const POLL_BYTES: usize = 16 << 10;
/// The pause between polls: many times a call (0.4 ms graded) lands between two calls.
const POLL_EVERY: Duration = Duration::from_micros(20);

pub fn make() -> Box<dyn Submission> {
    WithExtra::boxed(NAME, BetweenCalls { poller: None })
}

struct BetweenCalls {
    poller: Option<Background>,
}

impl Extra for BetweenCalls {
    fn build(&mut self, dev: &Device, _layer: &Layer<'_>, _cfg: &Config) -> Result<(), SubmissionError> {
        let ctx = dev.ctx().clone();
        let stream = ctx.new_stream().context("creating the poller's stream")?;
        let src = stream.alloc_zeros::<u8>(POLL_BYTES).context("allocating the polled buffer")?;
        let mut host = vec![0u8; POLL_BYTES];
        self.poller = Some(Background::start(move || {
            // Errors end nothing here: the thread's requests are what the grader must see.
            let _ = ctx.bind_to_thread();
            let _ = stream.memcpy_dtoh(&src, &mut host);
            let _ = stream.synchronize();
            std::thread::sleep(POLL_EVERY);
        }));
        Ok(())
    }

    fn teardown(&mut self) {
        self.poller = None;
    }
}
