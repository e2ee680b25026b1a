//! No other process on the GPU: while the submission runs, the judge polls NVML's list of processes
//! holding a context on the device and notes any that is neither the judge nor its runner.
//!
//! This is measured outside the submission's reach (in the judge, through the driver's own view):
//! a helper process that computes the layer for the runner must hold a context on the device for as
//! long as it works, so it shows in the list. The poll interval is far shorter than any call.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use nvml_wrapper::Nvml;
use serde::Serialize;
use submission::child::{Left, Leftovers};

/// How often the list is read: a graded call lasts ~0.4 ms, a phase tens of ms, a build seconds;
/// a helper doing the work holds its context throughout.
const POLL_INTERVAL: Duration = Duration::from_millis(2);

/// A process found on the device that had no business there.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Intruder {
    pub pid: u32,
    /// Its command name (`/proc/<pid>/comm`), when it could still be read.
    pub name: String,
    /// When it was first seen, in ms since the watch started.
    pub first_seen_ms: u64,
}

/// What the watch saw.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Watched {
    /// `None` when it ran; the reason when NVML could not be used.
    pub unavailable: Option<String>,
    pub polls: u64,
    pub intruders: Vec<Intruder>,
    /// The processes the submission left running after its runner exited, which the judge then
    /// killed (`submission::child`): its own to start in `build_layer`, never to leave behind.
    pub leftovers: Leftovers,
}

/// A running watch; [`ProcessWatch::stop`] ends it.
pub struct ProcessWatch {
    stop: Arc<AtomicBool>,
    thread: JoinHandle<Watched>,
}

impl ProcessWatch {
    /// Starts watching the device at PCI bus id `pci_bus_id`; `allowed` are the judge and its runner.
    pub fn start(pci_bus_id: String, allowed: Vec<u32>) -> ProcessWatch {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let thread = std::thread::spawn(move || watch(&pci_bus_id, &allowed, &flag));
        ProcessWatch { stop, thread }
    }

    pub fn stop(self) -> Watched {
        self.stop.store(true, Ordering::Release);
        self.thread.join().unwrap_or_else(|_| Watched {
            unavailable: Some("the watch thread panicked".into()),
            polls: 0,
            intruders: Vec::new(),
            leftovers: Leftovers::default(),
        })
    }
}

fn watch(pci_bus_id: &str, allowed: &[u32], stop: &AtomicBool) -> Watched {
    let mut w = Watched { unavailable: None, polls: 0, intruders: Vec::new(), leftovers: Leftovers::default() };
    let nvml = match Nvml::init() {
        Ok(n) => n,
        Err(e) => {
            w.unavailable = Some(format!("NVML (libnvidia-ml.so) could not be initialised: {e}"));
            return w;
        }
    };
    let device = match nvml.device_by_pci_bus_id(pci_bus_id) {
        Ok(d) => d,
        Err(e) => {
            w.unavailable = Some(format!("NVML does not know the device at {pci_bus_id}: {e}"));
            return w;
        }
    };
    let start = Instant::now();
    while !stop.load(Ordering::Acquire) {
        let listed = device.running_compute_processes().and_then(|mut c| {
            c.extend(device.running_graphics_processes()?);
            Ok(c)
        });
        match listed {
            Ok(procs) => {
                w.polls += 1;
                for p in procs {
                    if !allowed.contains(&p.pid) && !w.intruders.iter().any(|i| i.pid == p.pid) {
                        w.intruders.push(Intruder {
                            pid: p.pid,
                            name: command_name(p.pid),
                            first_seen_ms: start.elapsed().as_millis() as u64,
                        });
                    }
                }
            }
            Err(e) => {
                w.unavailable = Some(format!("NVML could not list the device's processes: {e}"));
                return w;
            }
        }
        std::thread::sleep(POLL_INTERVAL);
    }
    w
}

fn command_name(pid: u32) -> String {
    std::fs::read_to_string(format!("/proc/{pid}/comm")).map(|s| s.trim().to_string()).unwrap_or_else(|_| "?".into())
}

impl Watched {
    /// One sentence for the report when the submission left processes behind.
    pub fn describe_leftovers(&self) -> Option<String> {
        let Leftovers { killed, surviving } = &self.leftovers;
        if killed.is_empty() {
            return None;
        }
        let list = |l: &[Left]| l.iter().map(Left::to_string).collect::<Vec<_>>().join(", ");
        let mut said = format!(
            "the submission left {} process(es) running after its runner exited ({}): the judge killed them",
            killed.len(),
            list(killed)
        );
        if !surviving.is_empty() {
            said += &format!("; still there after {} s: {}", submission::child::END_LIMIT.as_secs(), list(surviving));
        }
        Some(said)
    }

    /// One sentence for the verdict when something was found.
    pub fn describe_intruders(&self) -> Option<String> {
        let first = self.intruders.first()?;
        Some(format!(
            "{} other process(es) held the GPU while the submission ran (first: pid {} '{}', {} ms in): the work must run in the runner",
            self.intruders.len(),
            first.pid,
            first.name,
            first.first_seen_ms
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn without_nvml_the_watch_says_why_and_finds_nobody() {
        let w = ProcessWatch::start("00000000:00:00.0".into(), vec![std::process::id()]).stop();
        // On a machine with a GPU this may run for real; either way no intruder is invented.
        assert!(w.intruders.is_empty());
        if w.polls == 0 {
            assert!(w.unavailable.is_some());
        }
    }

    #[test]
    fn intruders_are_described_with_the_first_one() {
        let w = Watched {
            unavailable: None,
            polls: 10,
            intruders: vec![Intruder { pid: 42, name: "helper".into(), first_seen_ms: 7 }],
            leftovers: Leftovers::default(),
        };
        let s = w.describe_intruders().unwrap();
        assert!(s.contains("pid 42 'helper'") && s.contains("1 other process"), "{s}");
    }
}
