//! A thread an adversary starts in `build_layer` and stops in `teardown`: code of the submission
//! that runs while the runner does the judge's bidding between calls.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;

/// The running thread and the flag that stops it.
pub struct Background {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Background {
    /// Runs `body` once per turn of the thread's loop until stopped.
    pub fn start(mut body: impl FnMut() + Send + 'static) -> Background {
        let stop = Arc::new(AtomicBool::new(false));
        let seen = Arc::clone(&stop);
        // Relaxed: the flag carries no data; the join in `stop` orders everything else.
        let thread = std::thread::spawn(move || {
            while !seen.load(Ordering::Relaxed) {
                body();
            }
        });
        Background { stop, thread: Some(thread) }
    }

    pub fn stop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for Background {
    fn drop(&mut self) {
        self.stop();
    }
}
