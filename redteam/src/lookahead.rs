//! **lookahead**: tries to know the future, two ways.
//!
//! 1. In `build_layer` it tries to read the judge's memory, where the input seed lives: a byte of
//!    `/proc/<parent>/mem` at the first address `/proc/<parent>/maps` lists. The attempt must fail
//!    (the judge is non-dumpable and the runner has dropped `CAP_SYS_PTRACE` before loading the
//!    submission); its outcome goes to stderr, and the adversary goes on either way.
//! 2. Each call computes the next call's output ahead of time, with the eager reference, from the
//!    buffer where the judge will put the next input (one stride after its own `x`, see
//!    [`region`](super::region)) into a scratch row, and returns as this call's output the answer it
//!    computed at the previous call (zeros at the first).
//!
//! The exploit: a submission that knew its next input could finish a call before it is timed. Caught
//! by correctness: the judge writes each input only after the previous call has returned, so every
//! input it reads ahead is still the judge's NaN poison, and its answers are NaN ("returned NaN or
//! Inf"); the cache rows it appends are NaN too.

use std::fs::File;
use std::os::unix::fs::FileExt;

use cuda::cudarc::driver::CudaSlice;
use cuda::{Context, Device};
use half::bf16;
use reference::gpu::Eager;
use spec::{Call, Config};
use submission::{Layer, Submission, SubmissionError};

use super::honest::{Twist, Twisted, honest_step};
use super::region::{buffer_after, buffer_stride};
use super::{CallCount, not_built};

pub const NAME: &str = "lookahead";

pub fn make() -> Box<dyn Submission> {
    Twisted::boxed(NAME, Lookahead { calls: CallCount::default(), ahead: None })
}

/// One byte of the judge's memory (the runner's parent) and its address.
fn peek_at_judge() -> std::io::Result<(u64, u8)> {
    let judge = std::os::unix::process::parent_id();
    let maps = std::fs::read_to_string(format!("/proc/{judge}/maps"))?;
    let first = maps.lines().next().and_then(|line| line.split('-').next());
    let addr = first
        .and_then(|a| u64::from_str_radix(a, 16).ok())
        .ok_or_else(|| std::io::Error::other("the judge's memory map lists no mapping"))?;
    let mut byte = [0u8];
    File::open(format!("/proc/{judge}/mem"))?.read_exact_at(&mut byte, addr)?;
    Ok((addr, byte[0]))
}

struct Ahead {
    schedule: Vec<Call>,
    stride: usize,
    /// `(d)`: the answer computed ahead for the next call.
    answer: CudaSlice<bf16>,
}

struct Lookahead {
    calls: CallCount,
    ahead: Option<Ahead>,
}

impl Twist for Lookahead {
    fn build(&mut self, dev: &Device, _layer: &mut Layer<'_>, cfg: &Config) -> Result<(), SubmissionError> {
        match peek_at_judge() {
            Ok((addr, byte)) => eprintln!("{NAME}: read byte {byte:#04x} of the judge's memory at {addr:#x}"),
            Err(e) => eprintln!("{NAME}: the judge's memory is out of reach: {e}"),
        }
        let answer = dev.stream().alloc_zeros(cfg.batch * cfg.d).context("allocating the answer ahead")?;
        self.ahead = Some(Ahead { schedule: spec::schedule(cfg), stride: buffer_stride(cfg), answer });
        Ok(())
    }

    fn step(
        &mut self,
        eager: &mut Eager,
        dev: &Device,
        layer: &mut Layer<'_>,
        x: &CudaSlice<bf16>,
        _pos: usize,
        out: &mut CudaSlice<bf16>,
    ) -> Result<(), SubmissionError> {
        let a = self.ahead.as_mut().ok_or_else(not_built)?;
        let call = self.calls.next();
        // In stream order: this call's answer leaves the scratch before the next one is computed into it.
        dev.stream().memcpy_dtod(&a.answer, out).context("returning the answer computed ahead")?;
        if let Some(next) = a.schedule.get(call + 1) {
            let next_x = buffer_after(dev, x, 1, a.stride)?;
            honest_step(eager, dev, layer, &next_x, next.pos, &mut a.answer)?;
        }
        Ok(())
    }

    fn teardown(&mut self) {
        self.ahead = None;
    }
}
