//! What else was on the GPU: no process but the judge and its runner held it (watched by the judge
//! through NVML), and no persisting-L2 set-aside kept data on chip across calls (checked by the
//! runner at every command; the judge also flushes L2 before every call it times alone).

use super::{Gate, Source};
use crate::run::watch::Watched;

pub fn exclusive_gpu_gate(watched: &Watched) -> Gate {
    let (passed, detail) = match (&watched.unavailable, watched.describe_intruders()) {
        (_, Some(intruders)) => (false, intruders),
        (Some(reason), None) => (false, format!("the device's processes could not be watched: {reason}")),
        (None, None) => (
            true,
            format!("only the judge and its runner held the GPU ({} looks at NVML's process list)", watched.polls),
        ),
    };
    Gate {
        name: "exclusive_gpu",
        source: Source::Judge,
        passed,
        value: watched.intruders.len() as f64,
        limit: 0.0,
        detail,
    }
}

pub fn l2_gate(found: &[String]) -> Gate {
    Gate {
        name: "l2_persisting",
        source: Source::Runner,
        passed: found.is_empty(),
        value: found.len() as f64,
        limit: 0.0,
        detail: if found.is_empty() {
            "the persisting-L2 limit stayed 0 after build_layer and every command of calls; L2 was evicted before each"
                .into()
        } else {
            found.join("; ")
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::run::watch::Intruder;

    #[test]
    fn intruders_and_an_unwatched_device_fail() {
        let clean = Watched { unavailable: None, polls: 500, intruders: vec![], leftovers: Default::default() };
        assert!(exclusive_gpu_gate(&clean).passed);
        let helper = Watched {
            unavailable: None,
            polls: 500,
            intruders: vec![Intruder { pid: 9, name: "helper".into(), first_seen_ms: 40 }],
            leftovers: Default::default(),
        };
        let g = exclusive_gpu_gate(&helper);
        assert!(!g.passed && g.detail.contains("helper"), "{g:?}");
        let blind =
            Watched { unavailable: Some("no NVML".into()), polls: 0, intruders: vec![], leftovers: Default::default() };
        assert!(!exclusive_gpu_gate(&blind).passed);
    }

    /// helper-process expects this gate to fail with a word of its sentence.
    #[test]
    fn the_helper_process_is_named_as_this_gate_names_it() {
        use redteam::{self, Expect};
        let Some(Expect::GateFails { gate, word }) = redteam::find("helper-process").map(|a| a.expect) else {
            panic!("helper-process must expect a gate to fail");
        };
        let helper = Watched {
            unavailable: None,
            polls: 500,
            intruders: vec![Intruder { pid: 9, name: "grader".into(), first_seen_ms: 40 }],
            leftovers: Default::default(),
        };
        let g = exclusive_gpu_gate(&helper);
        assert!(g.name == gate && !g.passed && g.detail.contains(word), "{g:?}");
    }

    #[test]
    fn a_persisting_limit_fails_with_its_sentence() {
        assert!(l2_gate(&[]).passed);
        let g = l2_gate(&["the persisting-L2 limit was 31457280 bytes after command 3".into()]);
        assert!(!g.passed && g.detail.contains("persisting"));
    }
}
