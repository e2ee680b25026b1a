//! The binary as a user meets it: help, the spec, clear errors for bad input, and a clean refusal
//! (never a panic) on a machine without a GPU.

use std::process::{Command, Output};

fn grader(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_grader")).args(args).output().expect("the grader binary runs")
}

fn text(out: &Output) -> (String, String) {
    (String::from_utf8_lossy(&out.stdout).into_owned(), String::from_utf8_lossy(&out.stderr).into_owned())
}

fn has_gpu() -> bool {
    cuda::Device::open(0).is_ok()
}

#[test]
fn help_lists_every_subcommand() {
    let out = grader(&["--help"]);
    assert!(out.status.success());
    let (stdout, _) = text(&out);
    for sub in ["run", "bandwidth", "launches", "profile", "spec", "selftest"] {
        assert!(stdout.lines().any(|l| l.trim_start().starts_with(sub)), "--help lacks {sub}:\n{stdout}");
    }
    assert!(stdout.contains("Exit codes"), "{stdout}");
}

#[test]
fn spec_json_has_the_graded_byte_model() {
    let out = grader(&["spec", "--json"]);
    assert!(out.status.success());
    let doc: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(doc["bytes"]["weights_plus_kv"], 1_728_184_320u64);
    assert_eq!(doc["config"]["d"], 8192);
    assert_eq!(doc["gates"]["rel_err_tol"], 0.015);
}

#[test]
fn spec_statement_for_tiny() {
    let out = grader(&["spec", "--config", "tiny"]);
    assert!(out.status.success());
    let (stdout, _) = text(&out);
    assert!(stdout.contains("config 'tiny'") && stdout.contains("d 256"), "{stdout}");
}

#[test]
fn bad_config_file_names_the_field() {
    let mut cfg: serde_json::Value = serde_json::to_value(spec::Config::tiny()).unwrap();
    cfg["n_kv"] = 3.into();
    let path = std::env::temp_dir().join(format!("grader-bad-config-{}.json", std::process::id()));
    std::fs::write(&path, cfg.to_string()).unwrap();
    let out = grader(&["spec", "--config", path.to_str().unwrap()]);
    std::fs::remove_file(&path).unwrap();
    assert_eq!(out.status.code(), Some(2));
    let (_, stderr) = text(&out);
    assert!(stderr.contains("field 'n_q'"), "{stderr}");
}

#[test]
fn bad_values_are_refused_with_a_reason() {
    for args in [&["bandwidth", "--gib", "0"][..], &["bandwidth", "--reps", "1"], &["spec", "--config", "huge"]] {
        let out = grader(args);
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        let (_, stderr) = text(&out);
        assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
        assert!(stderr.len() > 20, "{args:?}: no reason given: {stderr}");
    }
}

#[test]
fn gpu_commands_without_a_gpu_say_so_in_one_sentence() {
    if has_gpu() {
        // On a GPU machine the same commands must run and end in their closing line instead.
        let out = grader(&["selftest", "--filter", "rng: fill"]);
        let (stdout, _) = text(&out);
        assert!(stdout.trim_end().ends_with("1 passed, 0 failed"), "{stdout}");
        return;
    }
    for args in [&["selftest"][..], &["bandwidth"]] {
        let out = grader(args);
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        let (stdout, stderr) = text(&out);
        assert!(stdout.is_empty(), "{args:?}: {stdout}");
        assert!(stderr.starts_with("grader: no CUDA device"), "{args:?}: {stderr}");
        assert_eq!(stderr.trim_end().lines().count(), 1, "{args:?}: {stderr}");
    }
}
