//! The binary as a user meets it: help, the spec, the list of submissions, and every bad input
//! refused with one sentence and exit code 2 before any device opens (so these run in CI without a
//! GPU and mean the same on a GPU machine), and a clean refusal, never a panic, without a GPU.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// The exit code of "the grader could not judge".
const EXIT_ERROR: i32 = 2;

fn grader_in(dir: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_grader")).args(args).current_dir(dir).output().expect("the grader binary runs")
}

fn grader(args: &[&str]) -> Output {
    grader_in(Path::new(env!("CARGO_MANIFEST_DIR")), args)
}

fn text(out: &Output) -> (String, String) {
    (String::from_utf8_lossy(&out.stdout).into_owned(), String::from_utf8_lossy(&out.stderr).into_owned())
}

fn has_gpu() -> bool {
    cuda::Device::open(0).is_ok()
}

/// A fresh folder of this test process.
fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("grader-cli-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Asserts that `args`, run in `dir`, are refused before any device work: exit 2, nothing on
/// stdout, one line on stderr. Returns that line.
fn refused_in(dir: &Path, args: &[&str]) -> String {
    let out = grader_in(dir, args);
    let (stdout, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(EXIT_ERROR), "{args:?}: {stderr}");
    assert!(stdout.is_empty(), "{args:?} printed {stdout}");
    let line = stderr.trim_end();
    assert_eq!(line.lines().count(), 1, "{args:?}: not one line:\n{stderr}");
    assert!(line.starts_with("grader: "), "{args:?}: {line}");
    assert!(!line.contains("panicked"), "{args:?}: {line}");
    // Refused on the arguments, not by the device: the same answer with or without a GPU.
    assert!(!line.contains("no CUDA device"), "{args:?} reached the device: {line}");
    line.to_string()
}

fn refused(args: &[&str]) -> String {
    refused_in(Path::new(env!("CARGO_MANIFEST_DIR")), args)
}

/// Writes `cfg` as a config file into a scratch folder and returns its path.
fn config_file(name: &str, cfg: &serde_json::Value) -> PathBuf {
    let path = scratch(name).join("config.json");
    std::fs::write(&path, cfg.to_string()).unwrap();
    path
}

fn tiny_with(field: &str, value: serde_json::Value) -> serde_json::Value {
    let mut cfg = serde_json::to_value(spec::Config::tiny()).unwrap();
    cfg[field] = value;
    cfg
}

#[test]
fn help_lists_every_subcommand_and_points_at_the_list() {
    let out = grader(&["--help"]);
    assert!(out.status.success());
    let (stdout, _) = text(&out);
    for sub in ["run", "bandwidth", "launches", "profile", "spec", "list", "selftest"] {
        assert!(stdout.lines().any(|l| l.trim_start().starts_with(sub)), "--help lacks {sub}:\n{stdout}");
    }
    assert!(stdout.contains("Exit codes") && stdout.contains("docs/task.md"), "{stdout}");
    let (run_help, _) = text(&grader(&["run", "--help"]));
    assert!(run_help.contains("grader list") && run_help.contains("--no-audit"), "{run_help}");
}

#[test]
fn list_names_every_builtin_and_adversary_once() {
    let out = grader(&["list"]);
    assert!(out.status.success());
    let (stdout, _) = text(&out);
    let names = grader::builtins::BUILTIN.iter().map(|b| (b.name, b.what));
    let python = redteam::python::ALL.iter().map(|a| (a.file, a.what));
    for (name, what) in names.chain(redteam::ALL.iter().map(|a| (a.name, a.what))).chain(python) {
        let lines: Vec<&str> = stdout.lines().filter(|l| l.split_whitespace().next() == Some(name)).collect();
        assert_eq!(lines.len(), 1, "'{name}' is not listed once:\n{stdout}");
        assert!(lines[0].ends_with(what), "{}", lines[0]);
    }
}

#[test]
fn spec_json_is_a_config_that_config_takes_back() {
    let out = grader(&["spec", "--config", "tiny", "--json"]);
    assert!(out.status.success());
    let cfg: spec::Config = serde_json::from_slice(&out.stdout).expect("spec --json is a config");
    assert_eq!(cfg, spec::Config::tiny());
    let path = scratch("round-trip").join("tiny.json");
    std::fs::write(&path, &out.stdout).unwrap();
    let again = grader(&["spec", "--config", path.to_str().unwrap(), "--json"]);
    assert!(again.status.success(), "{}", text(&again).1);
    assert_eq!(again.stdout, out.stdout);
}

#[test]
fn spec_shows_the_whole_schedule() {
    let out = grader(&["spec", "--config", "tiny"]);
    assert!(out.status.success());
    let (stdout, _) = text(&out);
    let cfg = spec::Config::tiny();
    assert!(stdout.contains("config 'tiny'") && stdout.contains("d 256"), "{stdout}");
    assert!(stdout.contains(&format!("{} calls of layer_step", spec::schedule(&cfg).len())), "{stdout}");
    for phase in spec::Phase::ALL {
        let name = format!("{phase:?}").to_lowercase();
        assert!(stdout.lines().any(|l| l.trim_start().starts_with(&name)), "no phase {name}:\n{stdout}");
    }
}

/// A named stack is described by `grader spec` and refused, with the reason, by every command that
/// judges or runs one layer per call; a file may not ask for more layers than a model has.
#[test]
fn stacks_are_described_and_refused_where_one_layer_is_studied() {
    let out = grader(&["spec", "--config", "stack-1b"]);
    assert!(out.status.success(), "{}", text(&out).1);
    let (stdout, _) = text(&out);
    assert!(stdout.starts_with("persistent-layer: a stack of 16 Llama-style decoder layers"), "{stdout}");
    let dump = scratch("stack-dump");
    for args in [
        vec!["launches", "--config", "stack-1b", "--submission", "megakernel"],
        vec!["run", "--config", "stack-1b", "--submission", "megakernel", "--dump", dump.to_str().unwrap()],
    ] {
        let line = refused(&args);
        assert!(line.contains("a stack of 16 layers") && line.contains("works on one layer"), "{args:?}: {line}");
    }
    // `grader profile` takes a stack as a whole; what studies one layer's plan is refused.
    for flag in [["--roles", "1"], ["--mlp-parts", "1"], ["--svg", "x.svg"]] {
        let line = refused(&["profile", "--config", "stack-1b", flag[0], flag[1]]);
        assert!(line.contains(&format!("{} studies one layer", flag[0])) && line.contains("16 layers"), "{line}");
    }
    let path = config_file("deep", &tiny_with("layers", 129.into()));
    let line = refused(&["spec", "--config", path.to_str().unwrap()]);
    assert!(line.contains("field 'layers'") && line.contains("128"), "{line}");
}

#[test]
fn bad_config_file_names_the_field() {
    let path = config_file("n-kv", &tiny_with("n_kv", 3.into()));
    let line = refused(&["spec", "--config", path.to_str().unwrap()]);
    assert!(line.contains("field 'n_q'"), "{line}");
}

#[test]
fn a_config_value_of_the_wrong_type_names_its_field() {
    let path = config_file("d-negative", &tiny_with("d", (-256).into()));
    let line = refused(&["run", "--submission", "megakernel", "--config", path.to_str().unwrap()]);
    assert!(line.contains("field 'd': invalid value: integer `-256`"), "{line}");
}

#[test]
fn config_sizes_are_bounded_before_any_arithmetic() {
    // 10^9 fits an int32 but not a device: 5.9 TB of weights.
    let path = config_file("d-1e9", &tiny_with("d", 1_000_000_000u64.into()));
    let line = refused(&["spec", "--config", path.to_str().unwrap()]);
    assert!(line.contains("TB") && line.contains("use smaller sizes"), "{line}");
    // Past int32: refused by field (it used to wrap in release and overflow in debug).
    let mut huge = tiny_with("d", 1_000_000_000_000u64.into());
    huge["ffn"] = 1_000_000_000_000u64.into();
    let path = config_file("d-ffn-1e12", &huge);
    let line = refused(&["spec", "--config", path.to_str().unwrap()]);
    assert!(line.contains("field 'd'") && line.contains("int32"), "{line}");
    let path = config_file("seq-1e15", &tiny_with("max_seq_len", 1_000_000_000_000_000u64.into()));
    let line = refused(&["run", "--submission", "megakernel", "--config", path.to_str().unwrap()]);
    assert!(line.contains("field 'max_seq_len'"), "{line}");
}

#[test]
fn a_config_file_cannot_pass_for_a_builtin_one() {
    let path = config_file("named-graded", &tiny_with("name", "graded".into()));
    let line = refused(&["spec", "--config", path.to_str().unwrap()]);
    assert!(line.contains("named 'graded'") && line.contains("name of its own"), "{line}");
}

#[test]
fn submissions_are_checked_before_the_device() {
    let dir = scratch("submissions");
    // Not a name, not a file.
    let line = refused_in(&dir, &["run", "--submission", "./missing.so"]);
    assert!(line.contains("neither a file nor a built-in name") && line.contains("grader list"), "{line}");
    // A folder.
    let line = refused_in(&dir, &["run", "--submission", "."]);
    assert!(line.ends_with("is a directory, not a submission library"), "{line}");
    // Any file in the current folder is a path, whatever its name, with dlopen's own reason.
    std::fs::write(dir.join("README.md"), "# not a library\n").unwrap();
    let line = refused_in(&dir, &["run", "--submission", "README.md"]);
    assert!(line.contains("dlopen: ") && line.contains("README.md"), "{line}");
    // A real library without the ABI, named like a system one.
    let libz = ["/lib/x86_64-linux-gnu", "/usr/lib/x86_64-linux-gnu", "/lib64", "/usr/lib64", "/lib/aarch64-linux-gnu"]
        .iter()
        .map(|d| Path::new(d).join("libz.so.1"))
        .find(|p| p.is_file())
        .expect("no libz.so.1 in the usual folders to test with");
    std::fs::copy(&libz, dir.join("libz.so.1")).unwrap();
    let line = refused_in(&dir, &["run", "--submission", "libz.so.1"]);
    assert!(line.contains("no symbol pl_abi_version"), "{line}");
    // launches checks the same way, with the same words.
    assert_eq!(refused_in(&dir, &["launches", "--submission", "libz.so.1"]), line);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn output_paths_are_checked_before_the_device() {
    let folder = std::env::temp_dir();
    let line = refused(&["run", "--submission", "megakernel", "--json", folder.to_str().unwrap()]);
    assert!(line.contains("--json") && line.contains("it is a folder"), "{line}");
    let line = refused(&["run", "--submission", "megakernel", "--dump", "/proc/x"]);
    assert!(line.contains("cannot write --dump /proc/x"), "{line}");
    let line = refused(&["run", "--submission", "megakernel", "--json", "/no/such/folder/report.json"]);
    assert!(line.contains("does not exist"), "{line}");
    for (cmd, flag) in [("bandwidth", "--json"), ("profile", "--svg"), ("selftest", "--log")] {
        let line = refused(&[cmd, flag, folder.to_str().unwrap()]);
        assert!(line.contains(flag) && line.contains("it is a folder"), "{cmd}: {line}");
    }
}

#[test]
fn the_report_and_the_dump_are_kept_apart_before_the_device() {
    let dir = scratch("report-and-dump");
    let dump = dir.join("dump");
    let (dump_arg, manifest) = (dump.to_str().unwrap(), dump.join("manifest.json"));
    for (json, words) in [
        (dump_arg, "the dump's folder would be made at or inside the report's path"),
        (manifest.to_str().unwrap(), "the dump writes its manifest.json there"),
    ] {
        let line = refused(&["run", "--submission", "megakernel", "--json", json, "--dump", dump_arg]);
        assert!(line.contains(words) && line.contains("give the report a path of its own"), "{line}");
    }
    // Beside the dump's files, in the folder the dump will make: as far as the device.
    if !has_gpu() {
        let report = dump.join("report.json");
        let out =
            grader(&["run", "--submission", "megakernel", "--json", report.to_str().unwrap(), "--dump", dump_arg]);
        assert!(text(&out).1.starts_with("grader: no CUDA device"), "{}", text(&out).1);
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The table goes to stderr; the JSON report only where --json says, stdout for '-'.
#[test]
fn run_writes_json_only_when_asked() {
    let (help, _) = text(&grader(&["run", "--help"]));
    assert!(help.contains("Also write the JSON report to this file ('-' for stdout)"), "{help}");
    if !has_gpu() {
        return; // nothing is judged without one: output_paths_are_checked_before_the_device covers --json
    }
    let out = grader(&["run", "--submission", "megakernel", "--config", "tiny", "--quiet"]);
    let (stdout, stderr) = text(&out);
    assert!(matches!(out.status.code(), Some(0 | 1)), "{stderr}");
    assert!(stdout.is_empty(), "a run without --json printed {stdout}");
    let out = grader(&["run", "--submission", "megakernel", "--config", "tiny", "--quiet", "--json", "-"]);
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).expect("--json - prints the report");
    assert!(report["verdict"]["passed"].is_boolean(), "{report}");
}

#[test]
fn selftest_lists_its_checks_without_a_device() {
    let out = grader(&["selftest", "--list"]);
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stderr}");
    assert!(stdout.lines().any(|l| l == "rng: fill equals CPU bitwise"), "{stdout}");
    assert!(stdout.lines().count() > 10, "{stdout}");
    // --filter picks from the same names, in any case.
    let (rng, _) = text(&grader(&["selftest", "--list", "--filter", "RNG"]));
    assert!(rng.lines().count() >= 3 && rng.lines().all(|l| l.starts_with("rng: ")), "{rng}");
    let line = refused(&["selftest", "--list", "--filter", "no such check"]);
    assert!(line.contains("`grader selftest --list` names them all"), "{line}");
    let line = refused(&["selftest", "--list", "--log", "x.log"]);
    assert!(line.contains("cannot be used with"), "{line}");
}

#[test]
fn each_subcommand_takes_only_its_options() {
    for args in [
        &["launches", "--submission", "megakernel", "--json", "x.json"][..],
        &["launches", "--submission", "megakernel", "--dump", "x"],
        &["profile", "--dump", "x"],
        &["profile", "--submission", "megakernel"],
        &["spec", "--device", "1"],
        &["spec", "--seed", "1"],
        &["list", "--config", "tiny"],
    ] {
        let line = refused(args);
        assert!(line.contains("unexpected argument") && line.contains("--help"), "{args:?}: {line}");
    }
}

#[test]
fn bad_values_are_refused_with_a_reason() {
    for (args, words) in [
        (&["bandwidth", "--gib", "0"][..], "out of range"),
        (&["bandwidth", "--reps", "1"], "3..=10000"),
        (&["spec", "--config", "huge"], "neither a file nor one of graded"),
        (&["run", "--submission", "megakernel", "--seed", "-1"], "a seed is a whole number from 0"),
        (&["run"], "--submission"),
        (&["run", "--submission", "fastest"], "grader list"),
        (&["selftest", "--filter", "no such check"], "no selftest check matches"),
        (&["run", "--submission", "megakernel", "--device", "-1"], "a device is a CUDA ordinal: 0, 1, 2, ..."),
        (&["bandwidth", "--device", "gpu1"], "a device is a CUDA ordinal: 0, 1, 2, ..."),
        (&["lsit"], "tip: a similar subcommand exists: 'list'"),
    ] {
        let line = refused(args);
        assert!(line.contains(words), "{args:?}: {line}");
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
    for args in [&["selftest"][..], &["bandwidth"], &["run", "--submission", "megakernel"], &["profile"]] {
        let out = grader(args);
        assert_eq!(out.status.code(), Some(EXIT_ERROR), "{args:?}");
        let (stdout, stderr) = text(&out);
        assert!(stdout.is_empty(), "{args:?}: {stdout}");
        assert!(stderr.starts_with("grader: no CUDA device"), "{args:?}: {stderr}");
        assert_eq!(stderr.trim_end().lines().count(), 1, "{args:?}: {stderr}");
    }
}

/// A library that speaks the ABI passes every check and gets as far as the device.
#[test]
fn a_library_with_the_abi_passes_the_checks() {
    if has_gpu() {
        return; // there it would be judged in full: `grader selftest` covers that path
    }
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    let built = Command::new(root.join("scripts/build-example")).current_dir(root).output().unwrap();
    assert!(built.status.success(), "scripts/build-example: {}", text(&built).1);
    let library = root.join(String::from_utf8_lossy(&built.stdout).trim());
    let out = grader(&["run", "--submission", library.to_str().unwrap(), "--config", "tiny"]);
    let (_, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(EXIT_ERROR), "{stderr}");
    assert!(stderr.starts_with("grader: no CUDA device"), "{stderr}");
}

/// A Python submission's interpreter is probed and its module checked before the device: each
/// problem is one sentence, the same for `run` and `launches`.
#[test]
fn python_submissions_are_checked_before_the_device() {
    let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("../submission/tests/python");
    let module = |name: &str| fixtures.join(name).to_str().unwrap().to_string();
    let plain = module("plain.py");
    for cmd in ["run", "launches"] {
        let line = refused(&[cmd, "--submission", &plain, "--python", "/nonexistent/python3"]);
        assert!(line.contains("no Python interpreter /nonexistent/python3") && line.contains("--python"), "{line}");
        let line = refused(&[cmd, "--submission", &module("syntax_error.py")]);
        assert!(line.ends_with("syntax_error.py:3: SyntaxError: expected ':'"), "{line}");
        let line = refused(&[cmd, "--submission", &module("no_build_layer.py")]);
        assert!(line.contains("defines no build_layer at its top level"), "{line}");
        let line = refused(&[cmd, "--submission", &module("fake_torch/not_callable.py")]);
        assert!(line.contains("not_callable.py:1: build_layer must be a function, not a value of type"), "{line}");
        let folder = std::env::temp_dir();
        let line = refused(&[cmd, "--submission", &plain, "--python", folder.to_str().unwrap()]);
        assert!(line.contains("is a directory, not an interpreter"), "{line}");
        // --python is for .py submissions only.
        let line = refused(&[cmd, "--submission", "megakernel", "--python", "/usr/bin/python3"]);
        assert!(line.contains("--python /usr/bin/python3 applies only to a .py submission"), "{line}");
    }
    // $PYTHON names the interpreter when --python does not.
    let out = Command::new(env!("CARGO_BIN_EXE_grader"))
        .args(["run", "--submission", &plain])
        .env("PYTHON", "/nonexistent/python-from-env")
        .output()
        .unwrap();
    assert!(text(&out).1.contains("no Python interpreter /nonexistent/python-from-env"), "{}", text(&out).1);
}

/// A module whose interpreter finds torch (here the CI's stand-in next to it) passes every check
/// and gets as far as the device.
#[test]
fn a_python_module_with_torch_passes_the_checks() {
    if has_gpu() {
        return; // there it would be judged in full: `grader selftest --filter python:` covers that path
    }
    let module = Path::new(env!("CARGO_MANIFEST_DIR")).join("../submission/tests/python/fake_torch/contract.py");
    let out = grader(&["run", "--submission", module.to_str().unwrap(), "--config", "tiny"]);
    let (_, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(EXIT_ERROR), "{stderr}");
    assert!(stderr.starts_with("grader: no CUDA device"), "{stderr}");
}
