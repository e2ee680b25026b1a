//! Compiles the judge's kernels (`kernels/*.cu`) with the workspace's nvcc. cudarc dlopens libcuda,
//! libnvrtc and libcupti by name at run time: adds the standard CUDA library folders to the binary's
//! run path so a default install is found without LD_LIBRARY_PATH (which still takes precedence).
//! Also records the git revision for reports.

use std::path::Path;
use std::process::Command;

/// Folders of a default CUDA install and of the driver in containers.
const CUDA_LIB_DIRS: [&str; 3] =
    ["/usr/local/cuda/lib64", "/usr/local/cuda/extras/CUPTI/lib64", "/usr/local/nvidia/lib64"];

fn main() {
    cuda_build::build(&cuda_build::Toolchain::from_cuda(), cuda_build::Files::default(), "");
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
    for dir in CUDA_LIB_DIRS {
        println!("cargo:rustc-link-arg-bins=-Wl,-rpath,{dir}");
    }
}

/// `git ARGS`' output, trimmed; `None` when git is missing or fails.
fn git(args: &[&str]) -> Option<String> {
    let out = Command::new("git").args(args).output().ok().filter(|o| o.status.success())?;
    Some(String::from_utf8_lossy(&out.stdout).trim().to_string())
}
