//! The CPU decode of a Hugging Face Llama checkpoint, teacher-forced over given tokens: prints, as
//! JSON, the f32 logits after each token (`{"logits": [[...], ...], "argmax": [...]}`), for comparing
//! with transformers (`scripts/hf-agreement.py`).
//!
//!   cargo run --release -p megakernel --example model_logits -- DIR 1,15,27,...

use std::path::PathBuf;

use megakernel::model::{CpuModel, ModelConfig, ModelWeights, argmax};

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [dir, tokens] = args.as_slice() else {
        eprintln!("usage: model_logits DIR TOKEN,TOKEN,...");
        std::process::exit(2);
    };
    let dir = PathBuf::from(dir);
    let fail = |e: &dyn std::fmt::Display| -> ! {
        eprintln!("model_logits: {e}");
        std::process::exit(1);
    };
    let tokens: Vec<u32> = tokens.split(',').map(|t| t.trim().parse().unwrap_or_else(|e| fail(&e))).collect();
    let cfg = ModelConfig::read(&dir).unwrap_or_else(|e| fail(&e));
    let weights = ModelWeights::read(&dir, &cfg).unwrap_or_else(|e| fail(&e));
    let mut model = CpuModel::new(cfg, weights, tokens.len());
    let logits: Vec<Vec<f32>> = tokens.iter().enumerate().map(|(pos, &t)| model.decode_step(t, pos)).collect();
    let chosen: Vec<Option<usize>> = logits.iter().map(|l| argmax(l)).collect();
    println!("{}", serde_json::json!({ "logits": logits, "argmax": chosen }));
}
