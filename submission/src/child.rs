//! Waiting for a helper process with a deadline: the grader's probes (a Python interpreter, a
//! library's initialisers) run code it does not control, which may never finish.

use std::process::{Child, ExitStatus};
use std::time::{Duration, Instant};

/// How often a waiting caller looks at the child.
const POLL: Duration = Duration::from_millis(10);

/// The child's exit status, or `None` when it was still running at `timeout` (it is then killed and
/// reaped).
pub fn wait_or_kill(child: &mut Child, timeout: Duration) -> std::io::Result<Option<ExitStatus>> {
    let deadline = Instant::now() + timeout;
    loop {
        match child.try_wait()? {
            Some(status) => return Ok(Some(status)),
            None if Instant::now() < deadline => std::thread::sleep(POLL),
            None => {
                let _ = child.kill();
                let _ = child.wait();
                return Ok(None);
            }
        }
    }
}
