//! The Python red team: modules under `redteam/python/` that try to fool the
//! grader, or break the contract, each with the verdict the grader must reach (`grader selftest
//! --filter python:` judges every one).

use crate::Expect;

/// Where the Python red team lives, relative to the workspace.
pub const FOLDER: &str = "redteam/python";

/// One Python adversary: its file in [`FOLDER`], what it does, and the verdict it must get.
#[derive(Debug, Clone, Copy)]
pub struct PyAdversary {
    pub file: &'static str,
    pub what: &'static str,
    pub expect: Expect,
}

const fn correctness(word: &'static str) -> Expect {
    Expect::GateFails { gate: "correctness", word }
}

/// The check of `layer_step`'s result: refused before any of its bytes are read.
const REFUSED_TYPE: Expect = Expect::CrashedFor { word: "not a plain torch.Tensor" };

pub const ALL: &[PyAdversary] = &[
    PyAdversary {
        file: "subclass_output.py",
        what: "returns a torch.Tensor subclass that would compute the layer when the grader touches it",
        expect: REFUSED_TYPE,
    },
    PyAdversary {
        file: "lazy_output.py",
        what: "returns a lazy object with __dlpack__, __cuda_array_interface__ and data_ptr, computed on access",
        expect: REFUSED_TYPE,
    },
    PyAdversary {
        file: "gc_walker.py",
        what: "walks gc for the runner's (B, d) buffers, writes the true output there and returns zeros",
        expect: correctness("over the tolerance"),
    },
    PyAdversary {
        file: "patches_timing.py",
        what: "patches torch.cuda.synchronize, Tensor.data_ptr, CUDA events and the time module, then waits 20 ms per step",
        expect: Expect::TimedHonestly { min_us: 20_000.0 },
    },
    PyAdversary {
        file: "pointer_cache.py",
        what: "memoises outputs by x.data_ptr(), replaying the latest one on a miss",
        expect: correctness("over the tolerance"),
    },
    PyAdversary {
        file: "side_stream.py",
        what: "computes on a side stream plus a 10 ms GPU sleep there, and returns without joining it",
        expect: Expect::TimedHonestly { min_us: 5_000.0 },
    },
    PyAdversary {
        file: "modifies_input.py",
        what: "computes correctly, then adds 1 to x[0, 0] (read-only)",
        expect: correctness("input x buffer"),
    },
    PyAdversary {
        file: "cpu_output.py",
        what: "returns x_out on the CPU",
        expect: Expect::CrashedFor { word: "the CPU" },
    },
    PyAdversary {
        file: "wrong_shape.py",
        what: "returns x_out of shape (d,)",
        expect: Expect::CrashedFor { word: "shape" },
    },
    PyAdversary {
        file: "raises.py",
        what: "raises ZeroDivisionError in its third call of layer_step",
        expect: Expect::CrashedFor { word: "ZeroDivisionError" },
    },
    PyAdversary { file: "hangs.py", what: "loops forever in its third call of layer_step", expect: Expect::Timeout },
    PyAdversary {
        file: "aborts.py",
        what: "calls os.abort() in its third call of layer_step",
        expect: Expect::Crashed,
    },
    PyAdversary {
        file: "segfaults.py",
        what: "reads address 0 through ctypes in its third call of layer_step",
        expect: Expect::Crashed,
    },
    PyAdversary {
        file: "spawns.py",
        what: "runs a subprocess in its third call of layer_step",
        expect: Expect::CrashedFor { word: "start a process" },
    },
];

#[cfg(test)]
mod tests {
    use std::collections::HashSet;
    use std::path::Path;

    use super::*;

    /// Every listed file exists, every file is listed, and each passes the probe's checks of the
    /// module (syntax, contract); the probe may then find no torch, as on CI.
    #[test]
    fn every_adversary_file_is_listed_and_well_formed() {
        let folder = Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join(FOLDER);
        let on_disk: HashSet<String> = std::fs::read_dir(&folder)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.ends_with(".py") && !n.starts_with('_'))
            .collect();
        let listed: HashSet<String> = ALL.iter().map(|a| a.file.to_string()).collect();
        assert_eq!(on_disk, listed);
        assert_eq!(listed.len(), ALL.len(), "a file is listed twice");
        // The interpreter a user's run would pick: `$PYTHON` or `python3`.
        let python = submission::python::interpreter(None);
        // Where `_honest.py` imports the eager example from: the probe does not run the import.
        let honest = std::fs::read_to_string(folder.join("_honest.py")).unwrap();
        let examples = ["..", "..", "submission", "examples", "python"];
        let quoted: Vec<String> = examples.iter().map(|p| format!("{p:?}")).collect();
        assert!(honest.contains(&quoted.join(", ")), "_honest.py no longer names {examples:?}");
        assert!(examples.iter().fold(folder.clone(), |f, p| f.join(p)).join("eager_layer.py").is_file());
        for a in ALL {
            assert!(!a.what.is_empty(), "{}", a.file);
            if let Err(e) = submission::python::probe(&python, &folder.join(a.file)) {
                assert!(e.to_string().contains("has no torch"), "{}: {e}", a.file);
            }
        }
    }
}
