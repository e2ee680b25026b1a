//! What the runner's process may not do, enforced by the kernel rather than asked of the submission.
//!
//! - Read the judge's memory (where the input seed lives): the judge makes itself non-dumpable and
//!   the runner drops `CAP_SYS_PTRACE` for good before the submission's library is loaded, so
//!   `/proc/<judge>/mem`, `ptrace` and `process_vm_readv` on the judge are refused even to root.
//! - Start processes once the calls begin: a seccomp filter (installed on every thread after
//!   `build_layer`, so a JIT compiler may still run its tools there) kills the runner on `fork`,
//!   `vfork`, `execve`, `execveat` and a `clone` that makes a process rather than a thread; `clone3`
//!   answers ENOSYS so the C library falls back to `clone`, whose flags can be inspected. The judge
//!   reads the death by `SIGSYS` as "started a process during the calls".

use std::collections::BTreeMap;

use seccompiler::{
    BpfProgram, SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompFilter, SeccompRule,
};

/// The signal a seccomp kill delivers: how the judge recognises it.
pub const SECCOMP_KILL_SIGNAL: i32 = libc::SIGSYS;

/// `CAP_SYS_PTRACE` (linux/capability.h).
const CAP_SYS_PTRACE: u32 = 19;
/// `_LINUX_CAPABILITY_VERSION_3`: two 32-bit words per set.
const CAPABILITY_VERSION_3: u32 = 0x2008_0522;

#[repr(C)]
struct CapHeader {
    version: u32,
    pid: i32,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
struct CapData {
    effective: u32,
    permitted: u32,
    inheritable: u32,
}

/// Makes this process (the judge) non-dumpable: same-user processes without `CAP_SYS_PTRACE`
/// cannot read its memory.
pub fn hide_judge_memory() -> std::io::Result<()> {
    // SAFETY: prctl with two integer arguments.
    if unsafe { libc::prctl(libc::PR_SET_DUMPABLE, 0, 0, 0, 0) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Drops `CAP_SYS_PTRACE` from this process (the runner) for good: from the bounding set (so no
/// exec can regain it) and from the effective, permitted and inheritable sets.
pub fn drop_ptrace() -> std::io::Result<()> {
    // SAFETY: prctl with integer arguments. EPERM (no CAP_SETPCAP: an unprivileged runner) is fine,
    // such a process has no CAP_SYS_PTRACE to drop from the bounding set that matters.
    let _ = unsafe { libc::prctl(libc::PR_CAPBSET_DROP, CAP_SYS_PTRACE as libc::c_ulong, 0, 0, 0) };
    let mut header = CapHeader { version: CAPABILITY_VERSION_3, pid: 0 };
    let mut data = [CapData::default(); 2];
    // SAFETY: capget writes two CapData through a valid pointer for version 3.
    if unsafe { libc::syscall(libc::SYS_capget, &mut header, data.as_mut_ptr()) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    let (word, bit) = ((CAP_SYS_PTRACE / 32) as usize, 1u32 << (CAP_SYS_PTRACE % 32));
    data[word].effective &= !bit;
    data[word].permitted &= !bit;
    data[word].inheritable &= !bit;
    // SAFETY: capset reads two CapData for version 3; dropping a capability is always allowed.
    if unsafe { libc::syscall(libc::SYS_capset, &mut header, data.as_ptr()) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Forbids creating processes from now on, on every thread of this process.
pub fn forbid_processes() -> Result<(), String> {
    let arch = std::env::consts::ARCH.try_into().map_err(|e| format!("seccomp: {e:?}"))?;
    let killing = process_rules().map_err(|e| format!("seccomp rules: {e}"))?;
    let kill = SeccompFilter::new(killing, SeccompAction::Allow, SeccompAction::KillProcess, arch)
        .map_err(|e| format!("seccomp filter: {e}"))?;
    let mut clone3 = BTreeMap::new();
    clone3.insert(libc::SYS_clone3, Vec::new());
    let nosys = SeccompFilter::new(clone3, SeccompAction::Allow, SeccompAction::Errno(libc::ENOSYS as u32), arch)
        .map_err(|e| format!("seccomp filter: {e}"))?;
    for filter in [kill, nosys] {
        let program: BpfProgram = filter.try_into().map_err(|e| format!("seccomp program: {e:?}"))?;
        seccompiler::apply_filter_all_threads(&program).map_err(|e| format!("installing the seccomp filter: {e}"))?;
    }
    Ok(())
}

/// The system calls that make a process: unconditionally, or `clone` without `CLONE_THREAD`.
fn process_rules() -> Result<BTreeMap<i64, Vec<SeccompRule>>, seccompiler::BackendError> {
    let mut rules = BTreeMap::new();
    for call in [libc::SYS_execve, libc::SYS_execveat] {
        rules.insert(call, Vec::new());
    }
    #[cfg(target_arch = "x86_64")]
    for call in [libc::SYS_fork, libc::SYS_vfork] {
        rules.insert(call, Vec::new());
    }
    let no_thread_flag =
        SeccompCondition::new(0, SeccompCmpArgLen::Qword, SeccompCmpOp::MaskedEq(libc::CLONE_THREAD as u64), 0)?;
    rules.insert(libc::SYS_clone, vec![SeccompRule::new(vec![no_thread_flag])?]);
    Ok(rules)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_process_rules_compile_to_bpf() {
        let arch = std::env::consts::ARCH.try_into().unwrap();
        let filter =
            SeccompFilter::new(process_rules().unwrap(), SeccompAction::Allow, SeccompAction::KillProcess, arch)
                .unwrap();
        let program: BpfProgram = filter.try_into().unwrap();
        assert!(program.len() > 8, "a filter of {} instructions", program.len());
    }

    /// Set in the copy of this test binary that a test starts to run the restricted part alone.
    const CHILD: &str = "PERSISTENT_LAYER_SANDBOX_CHILD";

    /// Runs test `name` again in a child process with `CHILD` set; returns how it ended.
    fn in_child(name: &str) -> std::process::ExitStatus {
        std::process::Command::new(std::env::current_exe().unwrap())
            .args(["--exact", name, "--test-threads=1", "--nocapture"])
            .env(CHILD, "1")
            .stdout(std::process::Stdio::null())
            .status()
            .unwrap()
    }

    /// Threads still start under the filter; a process does not, and the attempt kills the caller
    /// with SIGSYS.
    #[test]
    fn a_filtered_process_may_start_threads_but_not_processes() {
        use std::os::unix::process::ExitStatusExt;
        if std::env::var_os(CHILD).is_some() {
            forbid_processes().unwrap();
            assert_eq!(std::thread::spawn(|| 7).join().unwrap(), 7);
            let _ = std::process::Command::new("true").status();
            std::process::exit(5);
        }
        let status = in_child("run::sandbox::tests::a_filtered_process_may_start_threads_but_not_processes");
        assert_eq!(status.signal(), Some(SECCOMP_KILL_SIGNAL), "the child ended with {status:?}");
    }

    #[test]
    fn dropping_ptrace_is_allowed_and_sticks() {
        if std::env::var_os(CHILD).is_some() {
            drop_ptrace().unwrap();
            let mut header = CapHeader { version: CAPABILITY_VERSION_3, pid: 0 };
            let mut data = [CapData::default(); 2];
            // SAFETY: capget writes two CapData through a valid pointer for version 3.
            assert_eq!(unsafe { libc::syscall(libc::SYS_capget, &mut header, data.as_mut_ptr()) }, 0);
            let bit = 1 << CAP_SYS_PTRACE;
            assert_eq!((data[0].effective & bit, data[0].permitted & bit), (0, 0));
            return;
        }
        let status = in_child("run::sandbox::tests::dropping_ptrace_is_allowed_and_sticks");
        assert!(status.success(), "the child ended with {status:?}");
    }
}
