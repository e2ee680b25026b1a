//! The interpreter a Python submission runs in, asked before any GPU work: the judge runs it once on
//! a small script (`probe.py`) that reports what the runner needs to embed the same interpreter
//! (its shared libpython, home, `sys.path`, prefixes) and checks the module as far as it can without
//! importing it (readable, valid syntax, `build_layer` and `layer_step` defined and not bound to
//! plain values, torch installed). An interpreter that does not answer in time is stopped.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::thread::JoinHandle;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::SubmissionError;

/// The probe script, run with `python -c`.
const PROBE: &str = include_str!("probe.py");

/// Longest wait for the probe's answer: a Python interpreter starts and answers in well under a
/// second, even a cold one on a network file system in a few; a `--python` that is some program
/// which never exits must not hang the grader.
pub const PROBE_TIMEOUT: Duration = Duration::from_secs(60);

/// The interpreter used when neither `--python` nor `$PYTHON` names one.
pub const DEFAULT_INTERPRETER: &str = "python3";

/// What the runner needs to embed the interpreter that a Python submission was probed with.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PythonInfo {
    /// The submission's module, an absolute path.
    pub module: PathBuf,
    /// The interpreter, as `sys.executable` names it.
    pub executable: String,
    pub version: String,
    /// Its shared libpython.
    pub library: PathBuf,
    /// `sys.base_prefix` (and `:sys.base_exec_prefix` where it differs): where its standard library is.
    pub home: String,
    /// `sys.prefix` and `sys.exec_prefix`: a virtual environment's own folder.
    pub prefix: String,
    pub exec_prefix: String,
    /// `sys.path` as the interpreter has it, the module's folder first.
    pub path: Vec<String>,
}

/// The interpreter to probe: `flag` (`--python`), else `$PYTHON`, else `python3` on `PATH`.
pub fn interpreter(flag: Option<&Path>) -> PathBuf {
    flag.map(Path::to_path_buf)
        .or_else(|| std::env::var_os("PYTHON").filter(|v| !v.is_empty()).map(PathBuf::from))
        .unwrap_or_else(|| PathBuf::from(DEFAULT_INTERPRETER))
}

/// Whether `path` names a Python submission (by its suffix).
pub fn is_python_module(path: &Path) -> bool {
    path.extension().is_some_and(|e| e == "py")
}

/// Runs `python` on the probe for `module`; any problem is one sentence.
pub fn probe(python: &Path, module: &Path) -> Result<PythonInfo, SubmissionError> {
    probe_within(python, module, PROBE_TIMEOUT)
}

/// [`probe`], waiting at most `timeout` for the interpreter's answer.
fn probe_within(python: &Path, module: &Path, timeout: Duration) -> Result<PythonInfo, SubmissionError> {
    let refuse = |m: String| SubmissionError::Python(m);
    if !module.is_file() {
        return Err(refuse(format!("no Python submission at {}", module.display())));
    }
    let output = run(python, module, timeout)?;
    let stdout = String::from_utf8_lossy(&output.stdout);
    let last = stdout.lines().rev().find(|l| l.starts_with('{'));
    let reply: serde_json::Value = match last.map(serde_json::from_str) {
        Some(Ok(v)) => v,
        _ => {
            let stderr = String::from_utf8_lossy(&output.stderr);
            let tail = stderr.lines().rev().find(|l| !l.trim().is_empty()).unwrap_or("no output");
            return Err(refuse(format!(
                "{} did not answer the grader's probe ({}): {tail}",
                python.display(),
                output.status
            )));
        }
    };
    if let Some(error) = reply.get("error").and_then(|e| e.as_str()) {
        return Err(refuse(error.to_string()));
    }
    serde_json::from_value(reply).map_err(|e| refuse(format!("{} answered the probe oddly: {e}", python.display())))
}

/// `python -c PROBE module`, killed if it has not exited within `timeout`.
fn run(python: &Path, module: &Path, timeout: Duration) -> Result<Output, SubmissionError> {
    let refuse = |m: String| SubmissionError::Python(m);
    let mut command = Command::new(python);
    command.arg("-c").arg(PROBE).arg(module).stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
    let mut child = crate::child::spawn_contained(&mut command).map_err(|e| {
        refuse(match e.kind() {
            std::io::ErrorKind::NotFound => format!(
                "no Python interpreter {}: a .py submission runs in one with torch; install it, or name one with \
                     --python PATH (or $PYTHON)",
                python.display()
            ),
            // Running a folder fails with "Permission denied", which hides the mistake.
            _ if python.is_dir() => format!(
                "the Python interpreter {} is a directory, not an interpreter: name its executable with \
                     --python PATH (or $PYTHON), e.g. {}",
                python.display(),
                python.join("bin/python3").display()
            ),
            _ => format!("cannot run the Python interpreter {}: {e}", python.display()),
        })
    })?;
    let stdout = drain(child.stdout.take().expect("piped"));
    let stderr = drain(child.stderr.take().expect("piped"));
    let waited = crate::child::wait_or_kill(&mut child, timeout);
    // What the module's import started dies with the probe, so no leftover holds the pipes open.
    crate::child::end_session(child.id());
    let status = match waited {
        Ok(Some(status)) => status,
        Ok(None) => {
            return Err(refuse(format!(
                "the Python interpreter {} did not answer the grader's probe within {} s and was stopped: name a \
                 Python interpreter with --python PATH (or $PYTHON)",
                python.display(),
                timeout.as_secs()
            )));
        }
        Err(e) => return Err(refuse(format!("cannot wait for the Python interpreter {}: {e}", python.display()))),
    };

    let (stdout, stderr) = (stdout.join().unwrap_or_default(), stderr.join().unwrap_or_default());
    Ok(Output { status, stdout, stderr })
}

/// Reads `pipe` to its end on a thread of its own, so that a long answer cannot block the
/// interpreter on a full pipe while it is waited for.
fn drain(mut pipe: impl Read + Send + 'static) -> JoinHandle<Vec<u8>> {
    std::thread::spawn(move || {
        let mut bytes = Vec::new();
        let _ = pipe.read_to_end(&mut bytes);
        bytes
    })
}

#[cfg(test)]
pub(crate) mod tests {
    use std::time::Instant;

    use super::*;

    /// The interpreter of the tests: `$PYTHON` or `python3`, as a user's run would pick it.
    pub fn test_python() -> PathBuf {
        interpreter(None)
    }

    fn fixture(name: &str) -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/python").join(name)
    }

    fn probe_err(python: &Path, module: &Path) -> String {
        match probe(python, module) {
            Ok(info) => panic!("{} probed fine: {info:?}", module.display()),
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn interpreter_flag_beats_the_environment() {
        assert_eq!(interpreter(Some(Path::new("/x/python"))), PathBuf::from("/x/python"));
        assert!(is_python_module(Path::new("a/layer.py")) && !is_python_module(Path::new("liblayer.so")));
    }

    #[test]
    fn a_missing_interpreter_is_one_sentence() {
        let msg = probe_err(Path::new("/nonexistent/python9"), &fixture("plain.py"));
        assert!(msg.contains("no Python interpreter /nonexistent/python9") && msg.contains("--python"), "{msg}");
    }

    #[test]
    fn a_directory_is_no_interpreter() {
        let dir = std::env::temp_dir();
        let msg = probe_err(&dir, &fixture("plain.py"));
        assert!(msg.contains("is a directory, not an interpreter") && msg.contains("--python"), "{msg}");
    }

    /// An executable that never answers is killed at the timeout, with one sentence.
    #[test]
    fn an_interpreter_that_never_answers_is_given_up_on() {
        use std::os::unix::fs::PermissionsExt;
        let dir = std::env::temp_dir().join(format!("probe-hangs-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let python = dir.join("python3");
        std::fs::write(&python, "#!/bin/sh\nexec sleep 600\n").unwrap();
        std::fs::set_permissions(&python, std::fs::Permissions::from_mode(0o755)).unwrap();
        let start = Instant::now();
        let msg = probe_within(&python, &fixture("plain.py"), Duration::from_secs(1)).unwrap_err().to_string();
        assert!(start.elapsed() < Duration::from_secs(30), "waited {:?}", start.elapsed());
        assert!(msg.contains("did not answer the grader's probe within 1 s") && msg.contains("--python"), "{msg}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn module_problems_are_found_before_any_import() {
        let python = test_python();
        let msg = probe_err(&python, &fixture("syntax_error.py"));
        assert!(msg.contains("syntax_error.py:3: SyntaxError"), "{msg}");
        let msg = probe_err(&python, &fixture("no_build_layer.py"));
        assert!(msg.contains("defines no build_layer at its top level"), "{msg}");
        let msg = probe_err(&python, &fixture("absent.py"));
        assert!(msg.contains("no Python submission at"), "{msg}");
    }

    /// The CI machine's interpreter has no torch: the probe says so, naming the way out.
    #[test]
    fn an_interpreter_without_torch_is_refused() {
        let python = test_python();
        let has_torch = Command::new(&python).args(["-c", "import torch"]).output().is_ok_and(|o| o.status.success());
        if has_torch {
            eprintln!("{} has torch: nothing to refuse", python.display());
            return;
        }
        let msg = probe_err(&python, &fixture("plain.py"));
        assert!(msg.contains("has no torch") && msg.contains("--python PATH"), "{msg}");
    }
}
