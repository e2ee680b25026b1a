//! Checks of the arguments that need the file system, made before any device opens: a typo then
//! costs a second and one sentence, not a GPU start-up or a whole judgement that cannot be written
//! at the end. The submission (a name, a library whose ABI a child process checks, or a Python
//! module whose interpreter is probed) and every file or folder a command will write are checked
//! here; the config is checked by `Config::load`.

use std::fs::{File, OpenOptions};
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use submission::external::ExternalSubmission;

use crate::builtins::{Choice, Chosen};
use crate::error::{GraderError, Outcome};

/// Longest wait for a library to load in the checking process: its initialisers are the library's
/// own code, and one that hangs must not hang the grader.
const LIBRARY_CHECK_TIMEOUT: Duration = Duration::from_secs(30);
/// The hidden subcommand that loads a library in a process of its own (see `cli::Command`).
const CHECK_LIBRARY: &str = "check-library";

/// `--submission` checked: a built-in or red-team name as it is, a library by its absolute path
/// once a child process has loaded it and checked its ABI, a Python module with what its
/// interpreter (`python`: `--python`, else `$PYTHON`, else `python3`) reported. Paths are absolute
/// so that the runner process finds the same file whatever its working folder.
pub fn submission(name_or_path: &str, python: Option<&Path>) -> Result<Chosen, GraderError> {
    let choice = crate::builtins::resolve(name_or_path)?;
    // An interpreter given for a submission that runs in none is a mistake, not a detail to drop.
    if let (Some(python), Choice::Named(_) | Choice::Library(_)) = (python, &choice) {
        return Err(usage(format!(
            "--python {} applies only to a .py submission, and {name_or_path} is not one: drop --python",
            python.display()
        )));
    }
    match choice {
        Choice::Named(name) => Ok(Chosen::Native(name.to_string())),
        Choice::Library(path) => {
            let path = std::path::absolute(&path).map_err(|e| usage(format!("{}: {e}", path.display())))?;
            check_library(&path)?;
            path.to_str().map(|p| Chosen::Native(p.to_string())).ok_or_else(|| {
                usage(format!("the path {} is not valid UTF-8: rename or move the library", path.display()))
            })
        }
        Choice::Python(path) => {
            let info = submission::python::probe(&submission::python::interpreter(python), &path)?;
            Ok(Chosen::Python(info))
        }
    }
}

/// Loads the library at `path` in a child process (`grader check-library`), so that its
/// initialisers never run inside the judge, and passes on the child's one-line reason.
fn check_library(path: &Path) -> Result<(), GraderError> {
    let exe = std::env::current_exe().map_err(|e| usage(format!("cannot find the grader binary: {e}")))?;
    let mut command = Command::new(exe);
    command.arg(CHECK_LIBRARY).arg(path).stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::piped());
    let mut child = submission::child::spawn_contained(&mut command)
        .map_err(|e| usage(format!("cannot start a process to check {}: {e}", path.display())))?;
    let mut stderr = child.stderr.take().expect("piped");
    // Read while waiting, so a chatty initialiser cannot block on a full pipe.
    let reader = std::thread::spawn(move || {
        let mut text = String::new();
        let _ = stderr.read_to_string(&mut text);
        text
    });
    let waited = submission::child::wait_or_kill(&mut child, LIBRARY_CHECK_TIMEOUT);
    // What the initialisers started dies with the check, so no leftover holds its stderr open.
    submission::child::end_session(child.id());
    let status = match waited {
        Ok(Some(status)) => status,
        Ok(None) => {
            return Err(usage(format!(
                "loading {} did not finish within {} s: its initialisers hang",
                path.display(),
                LIBRARY_CHECK_TIMEOUT.as_secs()
            )));
        }
        Err(e) => return Err(usage(format!("cannot wait for the check of {}: {e}", path.display()))),
    };

    let text = reader.join().unwrap_or_default();
    if status.success() {
        return Ok(());
    }
    // The child's last line is its `grader: ...` error; anything before it is the library's own output.
    match text.lines().rev().find_map(|l| l.strip_prefix("grader: ")) {
        Some(reason) => Err(usage(reason.to_string())),
        None => Err(usage(format!("loading {} killed the checking process ({status})", path.display()))),
    }
}

/// `grader check-library PATH`: loads the library, checks its ABI and unloads it.
pub fn check_library_command(path: &Path) -> Result<Outcome, GraderError> {
    drop(ExternalSubmission::open(path)?);
    Ok(Outcome::Pass)
}

/// A file the command will write (`--json`, `--svg`, `--log`); `-` is stdout. The file is opened
/// for appending if it exists (nothing is changed), or created and removed again if it does not.
pub fn output_file(flag: &str, path: &Path) -> Result<(), GraderError> {
    if path == Path::new("-") {
        return Ok(());
    }
    let cannot = |why: String| usage(format!("cannot write {flag} {}: {why}", path.display()));
    if path.is_dir() {
        return Err(cannot("it is a folder; give the path of a file".into()));
    }
    if path.exists() {
        return OpenOptions::new().append(true).open(path).map(drop).map_err(|e| cannot(e.to_string()));
    }
    let folder = parent(path);
    if !folder.is_dir() {
        return Err(cannot(format!("the folder {} does not exist", folder.display())));
    }
    File::create_new(path).map_err(|e| cannot(e.to_string()))?;
    std::fs::remove_file(path).map_err(|e| cannot(e.to_string()))
}

/// A folder the command will create if needed and fill (`--dump`): its nearest existing ancestor
/// must be a folder in which a file can be created.
pub fn output_dir(flag: &str, path: &Path) -> Result<(), GraderError> {
    let cannot = |why: String| usage(format!("cannot write {flag} {}: {why}", path.display()));
    let existing = path.ancestors().find(|a| a.exists()).map_or_else(|| PathBuf::from("."), Path::to_path_buf);
    if !existing.is_dir() {
        return Err(cannot(format!("{} is a file, not a folder", existing.display())));
    }
    let probe = existing.join(format!(".grader-write-check-{}", std::process::id()));
    File::create_new(&probe).map_err(|e| cannot(format!("creating a file in {} failed: {e}", existing.display())))?;
    std::fs::remove_file(&probe).map_err(|e| cannot(e.to_string()))
}

/// The folder holding `path` (`.` for a bare file name).
fn parent(path: &Path) -> &Path {
    match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    }
}

fn usage(message: String) -> GraderError {
    GraderError::Usage(message)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    pub(crate) fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("grader-preflight-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn output_files_must_be_writable_files_and_are_left_as_found() {
        let dir = scratch("file");
        let new = dir.join("report.json");
        output_file("--json", &new).unwrap();
        assert!(!new.exists(), "the check left its file behind");
        std::fs::write(&new, "kept").unwrap();
        output_file("--json", &new).unwrap();
        assert_eq!(std::fs::read_to_string(&new).unwrap(), "kept");
        output_file("--json", Path::new("-")).unwrap();
        let msg = output_file("--json", &dir).unwrap_err().to_string();
        assert!(msg.contains("it is a folder"), "{msg}");
        let msg = output_file("--json", &dir.join("no/such/report.json")).unwrap_err().to_string();
        assert!(msg.contains("does not exist"), "{msg}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn python_is_refused_for_a_submission_that_runs_in_none() {
        let msg = submission("megakernel", Some(Path::new("/usr/bin/python3"))).unwrap_err().to_string();
        assert!(msg.contains("applies only to a .py submission") && msg.contains("megakernel is not one"), "{msg}");
    }

    #[test]
    fn output_dirs_need_a_folder_to_grow_from() {
        let dir = scratch("dir");
        output_dir("--dump", &dir.join("a/b/c")).unwrap();
        assert!(!dir.join("a").exists(), "the check created folders");
        let file = dir.join("file");
        std::fs::write(&file, "").unwrap();
        let msg = output_dir("--dump", &file.join("sub")).unwrap_err().to_string();
        assert!(msg.contains("is a file, not a folder"), "{msg}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
