//! The judge's side of isolation: starts the runner (this same binary, `grader runner`) as a child
//! process, hands it the job on stdin, and listens to its events with a watchdog. A child that dies,
//! reports a failure, or goes quiet for too long ends the run with status `crashed` or `timeout`; the
//! judge itself, and the GPU, stay usable (the driver tears the child's context down with it).

use std::io::{BufRead, BufReader, Read, Write};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::thread;
use std::time::{Duration, Instant};

use half::bf16;
use serde::Serialize;
use spec::Config;

use super::Progress;
use super::runner::{Event, Finished, Job};
use super::verdict::Phase;
use crate::error::GraderError;

/// Longest wait for the runner to generate the data and build the submission.
const BUILD_TIMEOUT: Duration = Duration::from_secs(180);
/// Longest silence between two events once the calls have started (a graded step takes
/// milliseconds; a phase of them well under a second).
const EVENT_TIMEOUT: Duration = Duration::from_secs(30);
/// Lines of the runner's stderr kept for a crash report.
const STDERR_TAIL_LINES: usize = 12;

/// How an isolated run ended when it did not finish.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case", tag = "status", content = "reason")]
pub enum Failure {
    /// The runner died, or reported an error from the submission or the device.
    Crashed(String),
    /// The runner went quiet and was killed.
    Timeout(String),
}

/// A finished isolated run: the runner's report and what it left in the results file.
pub struct Completed {
    pub finished: Finished,
    pub outputs: Vec<Vec<bf16>>,
    pub cache_k: Vec<bf16>,
    pub cache_v: Vec<bf16>,
    /// The judge's own clock over the timed phase: from its start event to the next phase's.
    pub timed_wall_us: f64,
}

/// Runs `job` in a child process under the watchdog.
pub fn run(job: &Job, progress: &Progress) -> Result<Result<Completed, Failure>, GraderError> {
    let exe =
        std::env::current_exe().map_err(|e| GraderError::Runner(format!("cannot find the grader binary: {e}")))?;
    let mut child = Command::new(exe)
        .arg("runner")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| GraderError::Runner(format!("cannot start the runner process: {e}")))?;
    let job_line = serde_json::to_string(job).expect("the job serialises") + "\n";
    {
        let mut stdin = child.stdin.take().expect("piped");
        // A runner that died at once cannot read its job; its exit is reported below.
        let _ = stdin.write_all(job_line.as_bytes());
    }
    let (tx, rx) = mpsc::channel();
    let stdout = child.stdout.take().expect("piped");
    thread::spawn(move || {
        // Each line is stamped as it arrives, so the judge's clock over a phase does not depend on
        // when the main thread gets to it.
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if tx.send((Instant::now(), line)).is_err() {
                break;
            }
        }
    });
    let mut stderr = child.stderr.take().expect("piped");
    let stderr_reader = thread::spawn(move || {
        let mut text = String::new();
        let _ = stderr.read_to_string(&mut text);
        text
    });

    let mut deadline = BUILD_TIMEOUT;
    let mut last = "start".to_string();
    let mut timed_start: Option<Instant> = None;
    let mut timed_wall_us = 0.0;
    let outcome = loop {
        match rx.recv_timeout(deadline) {
            Err(RecvTimeoutError::Timeout) => {
                kill(&mut child);
                break Err(Failure::Timeout(format!(
                    "no word from the submission for {} s after {last}: the runner was killed",
                    deadline.as_secs()
                )));
            }
            Err(RecvTimeoutError::Disconnected) => {
                let status = child.wait().map(|s| s.to_string()).unwrap_or_else(|e| e.to_string());
                let tail = tail(&stderr_reader.join().unwrap_or_default());
                return Ok(Err(Failure::Crashed(format!("the runner died ({status}) after {last}{tail}"))));
            }
            Ok((arrived, line)) => match serde_json::from_str::<Event>(&line) {
                Err(_) => last = format!("an unreadable line from the runner: {line:.120}"),
                Ok(Event::Generated) => {
                    progress.say("runner: data generated, build_layer");
                    last = "data generation".into();
                }
                Ok(Event::Built { build_s }) => {
                    progress.say(&format!("runner: build_layer took {build_s:.2} s"));
                    last = "build_layer".into();
                    deadline = EVENT_TIMEOUT;
                }
                Ok(Event::Phase { phase, calls }) => {
                    if let Some(start) = timed_start.take() {
                        timed_wall_us = arrived.duration_since(start).as_secs_f64() * 1e6;
                    }
                    if phase == Phase::Timed {
                        timed_start = Some(arrived);
                    }
                    progress.say(&format!("{}: {calls} {phase:?} steps", job.submission));
                    last = format!("the start of the {phase:?} phase");
                }
                Ok(Event::Failed { message }) => {
                    let _ = child.wait();
                    break Err(Failure::Crashed(message));
                }
                Ok(Event::Done(finished)) => {
                    let _ = child.wait();
                    break Ok(finished);
                }
            },
        }
    };
    let finished = match outcome {
        Ok(f) => f,
        Err(failure) => return Ok(Err(failure)),
    };
    let bytes = std::fs::read(&job.results)
        .map_err(|e| GraderError::Runner(format!("reading the runner's results {}: {e}", job.results.display())))?;
    let _ = std::fs::remove_file(&job.results);
    let (outputs, cache_k, cache_v) = split_results(&job.config, &bytes)?;
    Ok(Ok(Completed { finished, outputs, cache_k, cache_v, timed_wall_us }))
}

fn kill(child: &mut Child) {
    // Already gone is fine; anything else is the OS refusing, reported by wait() below.
    let _ = child.kill();
    let _ = child.wait();
}

/// The last lines of the runner's stderr, as a suffix for a crash report.
fn tail(stderr: &str) -> String {
    let lines: Vec<&str> = stderr.lines().filter(|l| !l.trim().is_empty()).collect();
    if lines.is_empty() {
        return String::new();
    }
    format!("; its stderr ends: {}", lines[lines.len().saturating_sub(STDERR_TAIL_LINES)..].join(" | "))
}

/// The results file: every call's output, then K, then V, raw little-endian bf16.
type Results = (Vec<Vec<bf16>>, Vec<bf16>, Vec<bf16>);

fn split_results(cfg: &Config, bytes: &[u8]) -> Result<Results, GraderError> {
    let calls = super::verdict::schedule(cfg).len();
    let (row, cache) = (cfg.batch * cfg.d, cfg.cache_elems());
    let want = 2 * (calls * row + 2 * cache);
    if bytes.len() != want {
        return Err(GraderError::Runner(format!("the runner's results hold {} bytes, not {want}", bytes.len())));
    }
    let values: Vec<bf16> = bytes.chunks_exact(2).map(|b| bf16::from_le_bytes([b[0], b[1]])).collect();
    let (outs, caches) = values.split_at(calls * row);
    let (k, v) = caches.split_at(cache);
    Ok((outs.chunks(row).map(<[bf16]>::to_vec).collect(), k.to_vec(), v.to_vec()))
}
