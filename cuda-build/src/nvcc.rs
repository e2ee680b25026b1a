//! Finds the nvcc that every crate's kernels are compiled with, and installs the pinned one when there is
//! none, so that a fresh machine with only Rust, Python 3 and a C compiler builds with plain `cargo`.
//!
//! Order: `$NVCC`, `$CUDA_HOME/bin/nvcc`, `$CUDA_PATH/bin/nvcc`, `nvcc` on PATH, then the pinned pip
//! wheels of `cuda-build/nvcc-requirements.txt` in `.cuda-venv/`, installed on first use. An install is
//! trusted once its marker file holds the very pins it was made from, so changing a pin reinstalls.
//! Errors are one sentence that says what to do; the build script reports them without a panic. PYTHON names
//! the interpreter to make the venv with (default `python3`).

use std::env;
use std::path::{Path, PathBuf};
use std::process::Command;

/// The pins, relative to the workspace root.
const REQUIREMENTS: &str = "cuda-build/nvcc-requirements.txt";
/// Where the pinned wheels go, relative to the workspace root (ignored by git).
const VENV: &str = ".cuda-venv";
/// Written into the venv after a complete install, holding the requirements it was made from.
const MARKER: &str = "installed-requirements.txt";
/// nvcc inside the wheels, relative to the venv's `site-packages`.
const WHEEL_NVCC: &str = "nvidia/cu13/bin/nvcc";
/// Environment variables naming a CUDA toolkit's root.
const TOOLKIT_VARS: [&str; 2] = ["CUDA_HOME", "CUDA_PATH"];
/// What every "no compiler" message offers instead of the install.
const ALTERNATIVE: &str = "or set NVCC to an nvcc 13.0 (or CUDA_HOME to a CUDA 13.0 toolkit)";

/// The rerun triggers of the search: the variables it reads and the pins.
pub fn rerun_triggers(root: &Path) {
    for var in ["NVCC"].iter().chain(&TOOLKIT_VARS) {
        println!("cargo:rerun-if-env-changed={var}");
    }
    println!("cargo:rerun-if-changed={}", root.join(REQUIREMENTS).display());
}

/// The nvcc to use, installing the pinned wheels when no other is found.
pub fn find_or_install(root: &Path) -> Result<PathBuf, String> {
    if let Some(nvcc) = env::var_os("NVCC") {
        let nvcc = PathBuf::from(nvcc);
        return if nvcc.is_file() {
            Ok(nvcc)
        } else {
            Err(format!("NVCC={} is not a file: point it at an nvcc 13.0, or unset it", nvcc.display()))
        };
    }
    let named = TOOLKIT_VARS.iter().filter_map(env::var_os).map(|home| PathBuf::from(home).join("bin/nvcc"));
    let on_path = env::var_os("PATH").into_iter().flat_map(|p| env::split_paths(&p).collect::<Vec<_>>());
    if let Some(nvcc) = named.chain(on_path.map(|dir| dir.join("nvcc"))).find(|p| p.is_file()) {
        return Ok(nvcc);
    }
    let requirements = std::fs::read_to_string(root.join(REQUIREMENTS))
        .map_err(|e| format!("cannot read {REQUIREMENTS}: {e}; restore it from git"))?;
    let venv = root.join(VENV);
    if let Some(nvcc) = venv_nvcc(&venv)
        && std::fs::read_to_string(venv.join(MARKER)).is_ok_and(|installed| installed == requirements)
    {
        return Ok(nvcc);
    }
    install(root, &venv, &requirements)
}

/// Whether `path` lies in the pinned install, whose files change only with the pins.
pub fn is_pinned_install(root: &Path, path: &Path) -> bool {
    path.starts_with(root.join(VENV))
}

/// Says on the terminal, when there is one, what a long install is doing. Cargo keeps a build
/// script's output to itself, and would replay a `cargo:warning` on every later build.
fn tell(line: &str) {
    use std::io::Write as _;
    if let Ok(mut tty) = std::fs::OpenOptions::new().write(true).open("/dev/tty") {
        let _ = writeln!(tty, "{line}");
    }
}

/// Installs the pinned wheels into `venv` (creating it if needed; pip leaves satisfied pins alone)
/// and marks the install complete.
fn install(root: &Path, venv: &Path, requirements: &str) -> Result<PathBuf, String> {
    let python = env::var_os("PYTHON").map_or_else(|| PathBuf::from("python3"), PathBuf::from);
    tell(&format!(
        "   Installing the pinned CUDA 13.0 compiler (no nvcc found; {REQUIREMENTS}, about 300 MB, once) into {}",
        venv.display()
    ));
    run(Command::new(&python).arg("-m").arg("venv").arg(venv)).map_err(|why| {
        format!(
            "no nvcc found, and `{} -m venv {VENV}` failed ({why}): install Python 3 with its venv module \
             (Debian: python3-venv), {ALTERNATIVE}",
            python.display()
        )
    })?;
    run(Command::new(venv.join("bin/python"))
        .args(["-m", "pip", "install", "--quiet", "--disable-pip-version-check", "-r"])
        .arg(root.join(REQUIREMENTS)))
    .map_err(|why| {
        format!(
            "no nvcc found, and pip could not install the pinned wheels of {REQUIREMENTS} ({why}): check the \
             network and build again, {ALTERNATIVE}"
        )
    })?;
    let nvcc = venv_nvcc(venv).ok_or_else(|| {
        format!("the wheels of {REQUIREMENTS} installed no {WHEEL_NVCC}: check the pins, {ALTERNATIVE}")
    })?;
    std::fs::write(venv.join(MARKER), requirements)
        .map_err(|e| format!("cannot write {}: {e}", venv.join(MARKER).display()))?;
    Ok(nvcc)
}

/// Runs `cmd`; on failure, the last line it printed on stderr (or how it ended).
fn run(cmd: &mut Command) -> Result<(), String> {
    let out = cmd.output().map_err(|e| format!("cannot run {}: {e}", cmd.get_program().to_string_lossy()))?;
    if out.status.success() {
        return Ok(());
    }
    let stderr = String::from_utf8_lossy(&out.stderr);
    Err(stderr.lines().rev().find(|l| !l.trim().is_empty()).map_or_else(|| out.status.to_string(), str::to_string))
}

/// nvcc inside the venv's wheels, whatever the venv's Python version.
fn venv_nvcc(venv: &Path) -> Option<PathBuf> {
    std::fs::read_dir(venv.join("lib"))
        .ok()?
        .filter_map(|e| e.ok())
        .map(|e| e.path().join("site-packages").join(WHEEL_NVCC))
        .find(|p| p.is_file())
}
