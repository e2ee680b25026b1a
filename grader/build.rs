//! Puts the CUDA library folders on the binary's run path (`cuda_build::link_cuda_run_path`) and
//! records the git revision for reports. The judge's kernels are the root package's
//! (`kernels/grader/`).

use std::path::Path;
use std::process::Command;

fn main() {
    // The revision the report names; "unknown" outside a git checkout.
    let rev = git(&["rev-parse", "--short=12", "HEAD"]).unwrap_or_else(|| "unknown".into());
    println!("cargo:rustc-env=GRADER_GIT_REVISION={rev}");
    // Rerun when HEAD moves: HEAD itself (a checkout) and the branch it names (a commit). The paths
    // come from git because in a worktree `.git` is a file and they live elsewhere, and a path that
    // does not exist would make cargo rebuild the grader on every build.
    let head = git(&["rev-parse", "--git-path", "HEAD"]);
    let branch = git(&["symbolic-ref", "-q", "HEAD"]).and_then(|r| git(&["rev-parse", "--git-path", &r]));
    println!("cargo:rerun-if-changed=build.rs");
    for path in [head, branch].into_iter().flatten().filter(|p| Path::new(p).exists()) {
        println!("cargo:rerun-if-changed={path}");
    }
    cuda_build::link_cuda_run_path();
}

/// `git ARGS`' output, trimmed; `None` when git is missing or fails.
fn git(args: &[&str]) -> Option<String> {
    let out = Command::new("git").args(args).output().ok().filter(|o| o.status.success())?;
    Some(String::from_utf8_lossy(&out.stdout).trim().to_string())
}
