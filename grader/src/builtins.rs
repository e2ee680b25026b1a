//! The names `--submission` takes: the built-in submissions (the eager reference, the megakernel in
//! its two modes) and the red team's adversaries, constructed by name; anything else is a path, to a
//! shared library or a Python module, which the `submission` crate's loaders open.

use std::path::{Path, PathBuf};

use megakernel::{Megakernel, Mode};
use serde::{Deserialize, Serialize};
use submission::{EagerSubmission, Submission, SubmissionError, external, python};

/// A built-in submission: the name `--submission` takes and what it is, in one line.
#[derive(Debug, Clone, Copy)]
pub struct Builtin {
    pub name: &'static str,
    pub what: &'static str,
}

/// The built-in submissions (the red team's adversaries are listed in [`redteam::ALL`]).
pub const BUILTIN: &[Builtin] = &[
    Builtin {
        name: "reference",
        what: "the eager reference: correct, 21 launches per step, so it fails the launch gates on purpose",
    },
    Builtin {
        name: "megakernel",
        what: "the reference submission: the layer as a table of phases that one persistent kernel runs, one launch per step",
    },
    Builtin {
        name: "megakernel-phases",
        what: "the megakernel's code with one launch per phase, for profiling: fails the launch gates",
    },
];

/// What `--submission` names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Choice {
    /// A built-in submission or a red-team adversary.
    Named(&'static str),
    /// A file: a shared library that should speak the C ABI of `submission/include/persistent_layer.h`.
    Library(PathBuf),
    /// A `.py` file: a Python module with the task's contract (see [`python`]).
    Python(PathBuf),
}

/// What `--submission` names. Names come first, so the crate folder `reference/` never hides the
/// built-in `reference` (a file named like a built-in is given as `./NAME`); anything else that
/// exists on disk is a path, whatever its name, and what it holds is checked when it is loaded.
pub fn resolve(name_or_path: &str) -> Result<Choice, SubmissionError> {
    let named = BUILTIN.iter().map(|b| b.name).chain(redteam::names()).find(|&n| n == name_or_path);
    match named {
        Some(name) => Ok(Choice::Named(name)),
        None if python::is_python_module(Path::new(name_or_path)) && Path::new(name_or_path).is_file() => {
            Ok(Choice::Python(name_or_path.into()))
        }
        None if Path::new(name_or_path).exists() => Ok(Choice::Library(name_or_path.into())),
        None => Err(SubmissionError::Unknown { name: name_or_path.into() }),
    }
}

/// A submission checked and ready to be loaded where it will run: a built-in name or a library's
/// path, or a Python module with the interpreter it was probed with.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum Chosen {
    Native(String),
    Python(python::PythonInfo),
}

impl Chosen {
    /// What reports call it before it is loaded: the name or path given.
    pub fn label(&self) -> String {
        match self {
            Chosen::Native(name) => name.clone(),
            Chosen::Python(info) => info.module.display().to_string(),
        }
    }

    /// Constructs the submission; a library is loaded and its ABI checked, a Python module is
    /// imported (with torch) in the embedded interpreter, on CUDA device `ordinal`, its output copy
    /// made inside `runner_scope`.
    pub fn load(
        &self,
        ordinal: usize,
        runner_scope: python::RunnerScope,
    ) -> Result<Box<dyn Submission>, SubmissionError> {
        match self {
            Chosen::Native(name) => load(name),
            Chosen::Python(info) => python::load(info, ordinal, runner_scope),
        }
    }
}

/// The native submission `--submission` names (see [`resolve`]), constructed; a library is loaded
/// and its ABI checked. A Python module needs its interpreter: see [`Chosen`].
pub fn load(name_or_path: &str) -> Result<Box<dyn Submission>, SubmissionError> {
    match resolve(name_or_path)? {
        Choice::Named(name) => builtin(name),
        Choice::Library(path) => external::load(&path),
        Choice::Python(path) => Err(SubmissionError::Python(format!(
            "{} is a Python module: it is loaded with the interpreter the judge probed (grader run --submission {0})",
            path.display()
        ))),
    }
}

/// A built-in submission, or a red-team adversary, by name.
pub fn builtin(name: &str) -> Result<Box<dyn Submission>, SubmissionError> {
    match name {
        "reference" => Ok(Box::new(EagerSubmission::default())),
        "megakernel" => Ok(Box::new(Megakernel::new(Mode::Fused))),
        "megakernel-phases" => Ok(Box::new(Megakernel::new(Mode::PerPhase))),
        _ => match redteam::find(name) {
            Some(adversary) => Ok((adversary.make)()),
            None => Err(SubmissionError::Unknown { name: name.into() }),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unknown_names_point_at_the_list() {
        let msg = builtin("fastest").err().unwrap().to_string();
        assert!(msg.contains("'fastest'") && msg.contains("grader list"), "{msg}");
        assert_eq!(builtin("reference").unwrap().name(), "reference");
    }

    #[test]
    fn every_builtin_constructs_under_its_name() {
        for b in BUILTIN {
            assert_eq!(builtin(b.name).unwrap().name(), b.name);
            assert!(!b.what.is_empty(), "{}: no description", b.name);
            // The red team never shadows a built-in submission.
            assert!(redteam::find(b.name).is_none(), "'{}' is both a built-in and an adversary", b.name);
        }
    }

    #[test]
    fn names_win_then_anything_on_disk_is_a_path() {
        // The crate folder `reference/` sits beside the built-in of that name: the name wins.
        let crate_dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../reference");
        assert!(Path::new(crate_dir).is_dir());
        assert_eq!(resolve("reference").unwrap(), Choice::Named("reference"));
        assert_eq!(resolve("pass-through").unwrap(), Choice::Named("pass-through"));
        // Any existing file is a path, whatever its suffix; what it holds is the loader's to judge.
        let header = concat!(env!("CARGO_MANIFEST_DIR"), "/../submission/include/persistent_layer.h");
        assert_eq!(resolve(header).unwrap(), Choice::Library(header.into()));
        // A .py file is a Python module.
        let module = concat!(env!("CARGO_MANIFEST_DIR"), "/../submission/tests/python/plain.py");
        assert_eq!(resolve(module).unwrap(), Choice::Python(module.into()));
        assert!(matches!(resolve("libz.so.1.nowhere"), Err(SubmissionError::Unknown { .. })));
    }
}
