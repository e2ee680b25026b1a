//! How busy the host was: the judge's own reads of the kernel's count of runnable threads, taken
//! before the runner exists and, where the coverage rule failed, after the runner and every process
//! it left behind have been ended (`submission::child`), so that no thread of the submission's is in
//! either.
//!
//! A host whose cores are all taken stalls the runner's thread between its launches and the judge's
//! between its clock reads; `record_coverage` then sees windows short of recorded work, which is
//! also what hidden work looks like, so it may fail honest work (docs/perf.md, "A busy host"). A
//! submission can starve its own runner too, so a busy host never excuses a gate: the judge says
//! what it saw, before the run and beside a failure, a run failing only that gate on a busy host is
//! `HOST BUSY` (not judged, not a pass), and the user judges again on a quiet host. The read after
//! the run sees a host that turned busy during it and stayed so (another job started); the
//! submission cannot make it busy then, since nothing of it is left.

use serde::Serialize;

/// Reads of the count taken, and the time between them: the median of a short series, so that one
/// burst of another program does not decide.
const SAMPLES: usize = 9;
const SAMPLE_GAP: std::time::Duration = std::time::Duration::from_millis(20);

/// Runnable threads on the host besides the judge's own, against its online CPUs: both host-wide,
/// as `/proc/stat` gives them (a process's own CPU set or quota is no measure of what the host's
/// other threads take).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct HostLoad {
    pub runnable: u32,
    pub cpus: u32,
}

impl HostLoad {
    /// The median of [`SAMPLES`] reads of `/proc/stat`'s `procs_running`, less the judge's own thread;
    /// `None` where it cannot be read (not Linux).
    pub fn sample() -> Option<HostLoad> {
        let mut reads = Vec::with_capacity(SAMPLES);
        for k in 0..SAMPLES {
            if k > 0 {
                std::thread::sleep(SAMPLE_GAP);
            }
            reads.push(HostLoad::of(&std::fs::read_to_string("/proc/stat").ok()?)?);
        }
        reads.sort_unstable_by_key(|r| r.runnable);
        let median = reads[SAMPLES / 2];
        Some(HostLoad { runnable: median.runnable.saturating_sub(1), ..median })
    }

    /// One read of `/proc/stat`: its `procs_running` line and its `cpuN` lines.
    fn of(stat: &str) -> Option<HostLoad> {
        let runnable =
            stat.lines().find_map(|l| l.strip_prefix("procs_running ")).and_then(|n| n.trim().parse().ok())?;
        let is_cpu = |l: &&str| l.strip_prefix("cpu").is_some_and(|n| n.starts_with(|c: char| c.is_ascii_digit()));
        let cpus = stat.lines().filter(is_cpu).count() as u32;
        (cpus > 0).then_some(HostLoad { runnable, cpus })
    }

    /// Three quarters of the CPUs or more taken by other threads: the runner will lose its core.
    pub fn busy(&self) -> bool {
        4 * self.runnable >= 3 * self.cpus
    }

    /// What the judge saw, and when, in a clause.
    pub fn said(&self, when: Moment) -> String {
        let when = match when {
            Moment::Before => "before the submission started",
            Moment::After => "after the run, every process of the submission's gone",
        };
        format!(
            "the host was busy {when} ({} runnable threads besides the judge on {} CPUs): a busy host stalls the runner \
             and the judge, and a stall leaves a window short of recorded work; judge again on a quiet host",
            self.runnable, self.cpus
        )
    }
}

/// When the judge read the host: before the runner existed, or after it and everything it left
/// behind had been ended (so in neither read is a thread of the submission's).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Moment {
    Before,
    After,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_count_is_read_from_proc_stat_and_a_host_is_busy_from_three_quarters_of_its_cpus() {
        let stat = "cpu  1 2 3 4\ncpu0 1 2 3 4\ncpu1 1 2 3 4\nintr 5 6\nctxt 7\nprocs_running 17\nprocs_blocked 0\n";
        assert_eq!(HostLoad::of(stat), Some(HostLoad { runnable: 17, cpus: 2 }));
        assert_eq!(HostLoad::of("cpu 1 2 3\ncpu0 1 2 3\n"), None, "no procs_running");
        assert_eq!(HostLoad::of("cpu 1 2 3\nprocs_running 3\n"), None, "no cpuN line");
        assert!(HostLoad { runnable: 16, cpus: 16 }.busy());
        assert!(HostLoad { runnable: 12, cpus: 16 }.busy());
        assert!(!HostLoad { runnable: 11, cpus: 16 }.busy());
        assert!(!HostLoad { runnable: 0, cpus: 2 }.busy());
        let said = HostLoad { runnable: 16, cpus: 16 }.said(Moment::Before);
        assert!(
            said.contains("busy before the submission started (16 runnable threads besides the judge on 16 CPUs)"),
            "{said}"
        );
        let said = HostLoad { runnable: 13, cpus: 16 }.said(Moment::After);
        assert!(said.contains("busy after the run, every process of the submission's gone (13 runnable"), "{said}");
        // This machine's own count reads, whatever it is.
        if std::path::Path::new("/proc/stat").exists() {
            let here = HostLoad::sample().expect("a Linux host's count");
            assert!(here.cpus >= 1, "{here:?}");
        }
    }
}
