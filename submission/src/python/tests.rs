//! The shim and the embedding, without a GPU or torch: the modules of `tests/python/fake_torch/`
//! run in the embedded interpreter of the test process against a stand-in torch, on made-up device
//! addresses (nothing dereferences them).

use std::path::{Path, PathBuf};
use std::sync::Mutex;

use spec::{Config, Tensor};

use super::probe::tests::test_python;
use super::*;

/// One test at a time: the modules share the interpreter, and some patch the stand-in torch.
static SERIAL: Mutex<()> = Mutex::new(());

/// A made-up device address per tensor, 1 MiB apart.
const BASE: u64 = 0x7f00_0000_0000;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/python/fake_torch").join(name)
}

fn load(module: &str) -> Result<Shim, String> {
    let info = probe(&test_python(), &fixture(module)).map_err(|e| e.to_string())?;
    Shim::load(&info, 0)
}

/// Each of `cfg.layers` layers' tensors, layer by layer, each tensor at its own address.
fn layers(cfg: &Config) -> Vec<Vec<DeviceTensor<'static>>> {
    let per_layer = Tensor::ALL.len();
    (0..cfg.layers)
        .map(|l| {
            let address = |i: usize| BASE + (((l * per_layer + i) as u64) << 20);
            let tensors = Tensor::ALL.iter().enumerate();
            tensors.map(|(i, &t)| DeviceTensor { name: t.name(), address: address(i), shape: t.shape(cfg) }).collect()
        })
        .collect()
}

fn built(module: &str, cfg: &Config) -> Shim {
    let shim = load(module).unwrap();
    shim.build(cfg, &layers(cfg)).unwrap();
    shim
}

const X: u64 = BASE + (64 << 20);
/// A stack's hidden states.
const HIDDEN: u64 = BASE + (96 << 20);

/// Names, shapes, dtypes and the cfg dict reach build_layer as the task states them (the module
/// asserts them), and each tensor aliases the address it was made from.
#[test]
fn the_module_gets_the_contracts_tensors_and_cfg() {
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let cfg = Config::tiny();
    let shim = built("contract.py", &cfg);
    for (pos, t) in layers(&cfg)[0].iter().enumerate() {
        let out = shim.step(X, pos, cfg.batch, cfg.d, None).unwrap();
        assert_eq!(out, Output { address: t.address, dtype: Dtype::Bf16 }, "{}", t.name);
    }
    let x = shim.step(X, Tensor::ALL.len(), cfg.batch, cfg.d, None).unwrap();
    assert_eq!(x.address, X, "x aliases its buffer");
    shim.teardown().unwrap();
}

/// A stack's every layer reaches build_layer in order, `cfg["layers"]` its depth (the module asserts
/// them); its steps get the `(layers - 1, B, d)` hidden states as a fourth argument, aliasing their
/// buffer, and one without them breaks the module's contract.
#[test]
fn a_stack_carries_every_layer_and_the_hidden_states() {
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let cfg = Config { layers: 3, ..Config::tiny() };
    let shim = built("contract.py", &cfg);
    let hidden = Some((HIDDEN, cfg.layers - 1));
    let given: Vec<u64> = layers(&cfg).iter().flatten().map(|t| t.address).collect();
    assert_eq!(given.len(), 3 * Tensor::ALL.len());
    for (pos, &address) in given.iter().enumerate() {
        assert_eq!(shim.step(X, pos, cfg.batch, cfg.d, hidden).unwrap().address, address, "tensor {pos}");
    }
    assert_eq!(shim.step(X, given.len(), cfg.batch, cfg.d, hidden).unwrap().address, X);
    assert_eq!(shim.step(X, given.len() + 1, cfg.batch, cfg.d, hidden).unwrap().address, HIDDEN);
    let msg = shim.step(X, 0, cfg.batch, cfg.d, None).unwrap_err();
    assert!(msg.contains("layer_step raised AssertionError: 0 hidden-state arguments for 3 layers"), "{msg}");
    shim.teardown().unwrap();
}

/// Every wrong x_out is one sentence naming what is wrong; an fp32 one is accepted.
#[test]
fn wrong_outputs_are_refused_with_what_is_wrong() {
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let cfg = Config::tiny();
    let shim = built("bad_outputs.py", &cfg);
    let expected = [
        "on the CPU, not on cuda:0".to_string(),
        format!("of shape ({},), not (B, d) = ({}, {})", cfg.d, cfg.batch, cfg.d),
        "a torch.float16 tensor: x_out is torch.bfloat16 or torch.float32".into(),
        "non-contiguous".into(),
        "on cuda:1, not on cuda:0".into(),
        "returned a builtins.list, not a plain torch.Tensor".into(),
    ];
    for (pos, words) in expected.iter().enumerate() {
        let msg = shim.step(X, pos, cfg.batch, cfg.d, None).unwrap_err();
        assert!(msg.contains(words.as_str()), "step {pos}: {msg}");
    }
    assert_eq!(shim.step(X, expected.len(), cfg.batch, cfg.d, None).unwrap(), Output { address: X, dtype: Dtype::F32 });
}

/// A subclass is refused without any of its code running; a plain tensor is read through torch's
/// own descriptors, whatever the module patched on `torch.Tensor`.
#[test]
fn reading_the_output_runs_none_of_the_modules_code() {
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let cfg = Config::tiny();
    let shim = built("sneaky_outputs.py", &cfg);
    let msg = shim.step(X, 0, cfg.batch, cfg.d, None).unwrap_err();
    assert!(msg.contains("returned a sneaky_outputs.Lazy, not a plain torch.Tensor"), "{msg}");
    // Step 1 raises if anything of the subclass ran, then patches torch.Tensor's accessors.
    assert_eq!(shim.step(X, 1, cfg.batch, cfg.d, None), Ok(Output { address: X, dtype: Dtype::Bf16 }));
    shim.step(X, 2, cfg.batch, cfg.d, None).unwrap();
}

/// An exception is named with a shortened traceback through the module's own frames.
#[test]
fn exceptions_come_back_with_their_traceback() {
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let cfg = Config::tiny();
    let shim = built("raises.py", &cfg);
    let msg = shim.step(X, 0, cfg.batch, cfg.d, None).unwrap_err();
    assert!(msg.starts_with("layer_step raised ZeroDivisionError: division by zero"), "{msg}");
    assert!(msg.contains("raises.py:6 in layer_step | raises.py:10 in divide"), "{msg}");
    assert!(!msg.contains("grader shim"), "the shim's own frames are left out: {msg}");
}

#[test]
fn modules_that_cannot_be_imported_say_why() {
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let msg = load("import_error.py").err().unwrap();
    assert!(msg.contains("importing the submission raised ModuleNotFoundError"), "{msg}");
    assert!(msg.contains("no_such_module_anywhere"), "{msg}");
    // The probe refuses a name bound to a plain value without importing the module...
    let msg = load("not_callable.py").err().unwrap();
    assert!(msg.contains("not_callable.py:1: build_layer must be a function, not a value of type NoneType"), "{msg}");
    // ...and the shim refuses what only the import shows (here the same module, unprobed).
    let mut info = probe(&test_python(), &fixture("contract.py")).unwrap();
    info.module = fixture("not_callable.py");
    let msg = Shim::load(&info, 0).err().unwrap();
    assert!(msg.contains("has no function build_layer once imported"), "{msg}");
}

/// `NotImplementedError` from build_layer declines the config with the exception's own text (no
/// traceback); any other exception, and `NotImplementedError` from layer_step, is a failure.
#[test]
fn not_implemented_in_build_layer_declines_the_config() {
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let dir = std::env::temp_dir().join(format!("pl-declines-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let module = dir.join("declines_config.py");
    std::fs::write(
        &module,
        "CALLS = []\n\n\n\
         class Limit(NotImplementedError):\n    pass\n\n\n\
         def build_layer(weights, kv_cache, cfg, max_seq_len):\n\
         \x20   CALLS.append(1)\n\
         \x20   if len(CALLS) == 1:\n\
         \x20       raise NotImplementedError(f\"hd = {cfg['hd']} is over this module's 16\")\n\
         \x20   if len(CALLS) == 2:\n\
         \x20       raise NotImplementedError\n\
         \x20   if len(CALLS) == 3:\n\
         \x20       raise Limit(\"ffn over 512\")\n\
         \x20   if len(CALLS) == 4:\n\
         \x20       raise ValueError(\"not a refusal\")\n\
         \x20   return {}\n\n\n\
         def layer_step(handle, x, pos):\n\
         \x20   raise NotImplementedError(\"no steps\")\n",
    )
    .unwrap();
    // Probed next to the stand-in torch, so the module's folder is only where its file is.
    let mut info = probe(&test_python(), &fixture("contract.py")).unwrap();
    info.module = module;
    let shim = Shim::load(&info, 0).unwrap();
    let cfg = Config::tiny();
    let build = || shim.build(&cfg, &layers(&cfg));
    assert_eq!(build(), Err(BuildError::Unsupported("hd = 32 is over this module's 16".into())));
    assert_eq!(
        build(),
        Err(BuildError::Unsupported("build_layer raised NotImplementedError without saying why".into()))
    );
    assert_eq!(build(), Err(BuildError::Unsupported("ffn over 512".into())));
    match build() {
        Err(BuildError::Failed(msg)) => {
            assert!(msg.starts_with("build_layer raised ValueError: not a refusal"), "{msg}")
        }
        other => panic!("{other:?}"),
    }
    build().unwrap();
    let msg = shim.step(X, 0, cfg.batch, cfg.d, None).unwrap_err();
    assert!(msg.starts_with("layer_step raised NotImplementedError: no steps"), "{msg}");
    // As the submission's error, what the runner reports.
    let declined = SubmissionError::from(BuildError::Unsupported("hd = 32 is over this module's 16".into()));
    assert!(matches!(&declined, SubmissionError::Unsupported(m) if m == "hd = 32 is over this module's 16"));
    assert!(matches!(SubmissionError::from(BuildError::Failed("x".into())), SubmissionError::Python(_)));
    let _ = std::fs::remove_dir_all(&dir);
}
