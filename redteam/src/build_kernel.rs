//! **build-kernel**: launches a persistent "server" kernel in `build_layer`, on a stream of its own,
//! that polls a mailbox in device memory; each step launches nothing and only posts a request with
//! two host-to-device copies (the addresses of `x` and `out`, then a sequence number). The server's
//! answer is a copy of `x` into `out`: doing the whole layer inside a polling kernel is beside the
//! point, which is a step that launches no kernel at all.
//!
//! The exploit: per-step profiling counts kernels launched inside the step, and this one launches
//! none; event timing on the grader's stream sees only two tiny copies. Caught twice over. First, the
//! grader synchronises the whole device after `build_layer`, which waits for the server until it
//! leaves on its idle limit ([`IDLE_LIMIT_NS`]), so no step is ever served and every output stays
//! the grader's NaN poison. Second, and what the verdict names: the profiled steps launched no kernel
//! ("a profiled step launched no kernel" fails the kernels gate).
//!
//! The server also leaves when teardown sets its stop word, so it never outlives the run.

use std::sync::Arc;

use crate::kernels::REDTEAM;
use cuda::cudarc::driver::{CudaSlice, CudaStream, DevicePtr, LaunchConfig, PushKernelArg};
use cuda::{Context, Device};
use half::bf16;
use spec::Config;
use submission::{Layer, Submission, SubmissionError};

use super::not_built;

pub const NAME: &str = "build-kernel";
/// The server kernel of `kernels/redteam/redteam.cu`.
pub const KERNEL: &str = "serve_copies_u16";

/// The mailbox's words as `kernels/redteam/redteam.cu` names them (`MAILBOX_<name>`); a test checks them.
#[cfg(test)]
pub const MAILBOX_WORDS: [(&str, usize); 6] =
    [("SEQ", SEQ), ("SRC", SRC), ("DST", DST), ("LEN", LEN), ("STOP", STOP), ("DONE", DONE)];
const SEQ: usize = 0;
const SRC: usize = 1;
const DST: usize = 2;
const LEN: usize = 3;
const STOP: usize = 4;
const DONE: usize = 5;
// A request is posted as one copy of [src, dst, len] into SRC..=LEN.
const _: () = assert!(DST == SRC + 1 && LEN == SRC + 2);

/// The server leaves after 5 s without a request: far longer than the gap between a build and the
/// first step, or between two steps, of a grader that does not synchronise the device (microseconds),
/// and short enough that the device-wide synchronisation after `build_layer` costs the grader only
/// seconds, well inside any watchdog.
pub const IDLE_LIMIT_NS: u64 = 5_000_000_000;

/// One block: the copies are 16 KB, and one SM polling is all the server should hold.
const SERVER_THREADS: u32 = 256;

pub fn make() -> Box<dyn Submission> {
    Box::new(BuildKernel { server: None })
}

struct Server {
    /// The stream the server runs on: non-blocking, so the device's stream never waits for it.
    stream: Arc<CudaStream>,
    /// `(DONE + 1)` words, see the constants above.
    mailbox: CudaSlice<u64>,
    /// The last request posted.
    seq: u64,
}

struct BuildKernel {
    server: Option<Server>,
}

impl Submission for BuildKernel {
    fn name(&self) -> &str {
        NAME
    }

    fn build_layer(&mut self, dev: &Device, _layer: Layer<'_>, _cfg: &Config) -> Result<(), SubmissionError> {
        let serve = dev.function(&REDTEAM, KERNEL)?;
        let stream = dev.ctx().new_stream().context("creating the server's stream")?;
        // Zeroed on the server's stream, so before the server starts.
        let mut mailbox = stream.alloc_zeros::<u64>(DONE + 1).context("allocating the mailbox")?;
        let cfg = LaunchConfig { grid_dim: (1, 1, 1), block_dim: (SERVER_THREADS, 1, 1), shared_mem_bytes: 0 };
        let mut args = stream.launch_builder(&serve);
        args.arg(&mut mailbox).arg(&IDLE_LIMIT_NS);
        // SAFETY: serve_copies_u16(mailbox (6), idle_limit_ns: u64), one block of a multiple of 32
        // threads. It dereferences only the addresses the steps post: x and out of the call, each of
        // LEN elements.
        unsafe { args.launch(cfg) }.context("launching serve_copies_u16")?;
        self.server = Some(Server { stream, mailbox, seq: 0 });
        Ok(())
    }

    fn layer_step(
        &mut self,
        dev: &Device,
        _layer: Layer<'_>,
        x: &CudaSlice<bf16>,
        _pos: usize,
        out: &mut CudaSlice<bf16>,
    ) -> Result<(), SubmissionError> {
        let server = self.server.as_mut().ok_or_else(not_built)?;
        let s = dev.stream();
        let request = [x.device_ptr(s).0, out.device_ptr(s).0, x.len().min(out.len()) as u64];
        server.seq += 1;
        // Two copies on one stream land in order: the server sees the payload before the number.
        s.memcpy_htod(&request, &mut server.mailbox.slice_mut(SRC..LEN + 1)).context("posting a request")?;
        s.memcpy_htod(&[server.seq], &mut server.mailbox.slice_mut(SEQ..SEQ + 1)).context("posting a request")?;
        Ok(())
    }

    fn teardown(&mut self) {
        if let Some(mut server) = self.server.take() {
            // The stop word goes through the context's default stream: on the server's own stream
            // it would wait for the server to finish first. Teardown cannot fail; if the word cannot
            // be written the idle limit still ends the server, and the wait below returns when it has.
            let poster = server.stream.context().default_stream();
            let _ = poster.memcpy_htod(&[1u64], &mut server.mailbox.slice_mut(STOP..STOP + 1));
            let _ = server.stream.synchronize();
        }
    }
}
