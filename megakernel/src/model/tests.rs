//! The loader and the CPU decode step on checkpoints written here, in the layout Hugging Face writes
//! (no download, no transformers: the agreement with transformers is checked on the GPU machine).

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use half::bf16;
use reference::golden::{self, KvCache, RopeTable};
use safetensors::Dtype;
use safetensors::tensor::TensorView;
use serde_json::json;
use spec::Config;
use spec::data::Tensor;

use super::code_stream::NF4_VALUES;
use super::hf::{ModelConfig, ModelError, ModelWeights};
use super::quantized::{Coded, Quantization};
use super::{CpuModel, Lane, Stop, Text, argmax, generate_together};

/// A layer's tensors by their Hugging Face names below `model.layers.{i}.` (less `.weight`): its two
/// norms, then its seven matrices.
const LAYER_TENSORS: [(Tensor, &str); 9] = [
    (Tensor::InNorm, "input_layernorm"),
    (Tensor::PostNorm, "post_attention_layernorm"),
    (Tensor::Wq, "self_attn.q_proj"),
    (Tensor::Wk, "self_attn.k_proj"),
    (Tensor::Wv, "self_attn.v_proj"),
    (Tensor::Wo, "self_attn.o_proj"),
    (Tensor::Wgate, "mlp.gate_proj"),
    (Tensor::Wup, "mlp.up_proj"),
    (Tensor::Wdown, "mlp.down_proj"),
];

/// A fresh folder of this test process.
fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("megakernel-model-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// A small Llama: 2 layers of a `tiny`-like layer, 97 tokens.
fn llama_json(tied: bool) -> serde_json::Value {
    json!({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 96,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 97,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "hidden_act": "silu", "tie_word_embeddings": tied,
        "max_position_embeddings": 256, "bos_token_id": 1, "eos_token_id": [2, 3], "torch_dtype": "bfloat16",
        "rope_scaling": null, "attention_bias": false, "mlp_bias": false
    })
}

/// Random bf16 values of `n`, seeded.
fn values(n: usize, seed: u64) -> Vec<bf16> {
    let mut s = seed;
    (0..n)
        .map(|_| {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            bf16::from_f32(((s >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.2)
        })
        .collect()
}

/// Every tensor of the model `cfg` describes, Hugging Face's names, filled from `seed`.
fn tensors(cfg: &ModelConfig, seed: u64) -> Vec<(String, Vec<usize>, Vec<bf16>)> {
    let l = &cfg.layer;
    let mut all = vec![("model.embed_tokens.weight".to_string(), vec![cfg.vocab, l.d])];
    for i in 0..l.layers {
        for (name, shape) in [
            ("input_layernorm.weight", vec![l.d]),
            ("post_attention_layernorm.weight", vec![l.d]),
            ("self_attn.q_proj.weight", vec![l.n_q * l.hd, l.d]),
            ("self_attn.k_proj.weight", vec![l.n_kv * l.hd, l.d]),
            ("self_attn.v_proj.weight", vec![l.n_kv * l.hd, l.d]),
            ("self_attn.o_proj.weight", vec![l.d, l.n_q * l.hd]),
            ("mlp.gate_proj.weight", vec![l.ffn, l.d]),
            ("mlp.up_proj.weight", vec![l.ffn, l.d]),
            ("mlp.down_proj.weight", vec![l.d, l.ffn]),
        ] {
            all.push((format!("model.layers.{i}.{name}"), shape));
        }
    }
    if cfg.qk_norm {
        for i in 0..l.layers {
            all.extend(["q_norm", "k_norm"].map(|n| (format!("model.layers.{i}.self_attn.{n}.weight"), vec![l.hd])));
        }
    }
    all.push(("model.norm.weight".into(), vec![l.d]));
    if !cfg.tied {
        all.push(("lm_head.weight".into(), vec![cfg.vocab, l.d]));
    }
    all.into_iter()
        .enumerate()
        .map(|(k, (name, shape))| {
            let n = shape.iter().product();
            (name, shape, values(n, seed + k as u64))
        })
        .collect()
}

fn bytes(v: &[bf16]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// Writes `config` and the tensors into `dir`: one `model.safetensors`, or `shards` files and the
/// index that names them.
fn write(dir: &Path, config: &serde_json::Value, tensors: &[(String, Vec<usize>, Vec<bf16>)], shards: usize) {
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    let data: Vec<(String, Vec<usize>, Vec<u8>)> =
        tensors.iter().map(|(n, s, v)| (n.clone(), s.clone(), bytes(v))).collect();
    let mut weight_map = serde_json::Map::new();
    for shard in 0..shards {
        let file = if shards == 1 {
            "model.safetensors".to_string()
        } else {
            format!("model-{shard:05}-of-{shards:05}.safetensors")
        };
        let views: Vec<(String, TensorView<'_>)> = data
            .iter()
            .enumerate()
            .filter(|(k, _)| k % shards == shard)
            .map(|(_, (n, s, b))| (n.clone(), TensorView::new(Dtype::BF16, s.clone(), b).unwrap()))
            .collect();
        for (n, _) in &views {
            weight_map.insert(n.clone(), json!(file));
        }
        std::fs::write(dir.join(&file), safetensors::serialize(views, None::<HashMap<String, String>>).unwrap())
            .unwrap();
    }
    if shards > 1 {
        std::fs::write(dir.join("model.safetensors.index.json"), json!({ "weight_map": weight_map }).to_string())
            .unwrap();
    }
}

/// The config read from `config`, written alone into a fresh folder.
fn config_of(name: &str, config: serde_json::Value) -> Result<ModelConfig, ModelError> {
    config_in(name, &config).1
}

/// A fresh folder holding `config` alone, and the config read from it.
fn config_in(name: &str, config: &serde_json::Value) -> (PathBuf, Result<ModelConfig, ModelError>) {
    let dir = scratch(name);
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    let cfg = ModelConfig::read(&dir);
    (dir, cfg)
}

#[test]
fn a_llama_config_reads_into_the_layers_shape() {
    let cfg = config_of("config", llama_json(false)).unwrap();
    let l = &cfg.layer;
    assert_eq!((l.layers, l.d, l.ffn, l.n_q, l.n_kv, l.hd), (2, 64, 96, 4, 2, 16));
    assert_eq!((l.eps, l.theta, l.max_seq_len), (1e-5, 10_000.0, 256));
    assert_eq!((cfg.vocab, cfg.tied, cfg.bos, cfg.eos.clone(), cfg.quantized), (97, false, Some(1), vec![2, 3], None));
    // Defaults where the fields are missing: as many KV heads as query heads, hd = d / heads.
    let mut sparse = llama_json(true);
    for field in ["num_key_value_heads", "rope_theta", "eos_token_id", "rope_scaling"] {
        sparse.as_object_mut().unwrap().remove(field);
    }
    let cfg = config_of("sparse", sparse).unwrap();
    assert_eq!((cfg.layer.n_kv, cfg.layer.hd, cfg.layer.theta, cfg.tied), (4, 16, 10_000.0, true));
    assert!(cfg.eos.is_empty());
}

#[test]
fn what_the_loader_does_not_implement_is_refused_naming_the_field() {
    let with = |field: &str, value: serde_json::Value| {
        let mut c = llama_json(false);
        c[field] = value;
        c
    };
    for (config, field, words) in [
        (with("use_sliding_window", json!(true)), "use_sliding_window", "whole cache"),
        (with("model_type", json!("gpt2")), "model_type", "'gpt2'"),
        (with("rope_scaling", json!({"rope_type": "llama3", "factor": 8.0})), "rope_scaling", "'low_freq_factor'"),
        (with("rope_scaling", json!({"rope_type": "yarn", "factor": 8.0})), "rope_scaling", "'yarn'"),
        (with("rope_parameters", json!({"rope_type": "linear", "rope_theta": 1e4})), "rope_parameters", "'linear'"),
        (with("hidden_act", json!("gelu")), "hidden_act", "'gelu'"),
        (with("attention_bias", json!(true)), "attention_bias", "no bias"),
        (with("num_key_value_heads", json!(3)), "num_key_value_heads", "does not divide"),
        (with("eos_token_id", json!("eos")), "eos_token_id", "not a token id"),
    ] {
        match config_of(field, config) {
            Err(e @ ModelError::Unsupported { .. }) => {
                let text = e.to_string();
                assert!(text.contains(&format!("field '{field}'")) && text.contains(words), "{text}");
            }
            other => panic!("{field}: {other:?}"),
        }
    }
}

/// Written in one file or in shards, tied or not: every tensor reads back bit for bit into its
/// field (each tensor has its own values, so a name read into the wrong field shows).
#[test]
fn a_checkpoint_reads_back_bit_for_bit_into_its_fields() {
    for (tied, shards) in [(false, 1), (true, 1), (false, 3)] {
        let config = llama_json(tied);
        let (dir, cfg) = config_in(&format!("weights-{tied}-{shards}"), &config);
        let cfg = cfg.unwrap();
        let written = tensors(&cfg, 7);
        write(&dir, &config, &written, shards);
        let w = ModelWeights::read(&dir, &cfg).unwrap();
        let by_name: HashMap<&str, &Vec<bf16>> = written.iter().map(|(n, _, v)| (n.as_str(), v)).collect();
        assert_eq!(&w.embed, by_name["model.embed_tokens.weight"]);
        assert_eq!(&w.norm, by_name["model.norm.weight"]);
        assert_eq!(w.head(), if tied { &w.embed[..] } else { &by_name["lm_head.weight"][..] });
        for (i, layer) in w.layers.iter().enumerate() {
            for (t, name) in LAYER_TENSORS {
                assert_eq!(layer.get(t), by_name[format!("model.layers.{i}.{name}.weight").as_str()], "{i} {name}");
            }
        }
    }
}

/// A loaded model's config and tensors (the Python binding's path, no folder): the config's text reads
/// as the file does, the tensors are asked for by name and shape, each once, and assemble into the
/// folder's weights; a refusal from the source stops the load with its words.
#[test]
fn a_config_and_tensors_from_memory_are_the_folders_model() {
    let config = llama_json(false);
    let (dir, cfg) = config_in("from-memory", &config);
    let cfg = cfg.unwrap();
    let name = cfg.layer.name.clone();
    assert_eq!(ModelConfig::parse(&name, Path::new("given"), &config.to_string()).unwrap(), cfg);
    let e = ModelConfig::parse("x", Path::new("the model's config"), "{").unwrap_err().to_string();
    assert!(e.starts_with("the model's config: "), "{e}");
    let written = tensors(&cfg, 11);
    write(&dir, &config, &written, 1);
    let by_name: HashMap<&str, (&Vec<usize>, &Vec<bf16>)> =
        written.iter().map(|(n, s, v)| (n.as_str(), (s, v))).collect();
    let mut asked = Vec::new();
    let w = ModelWeights::from_tensors(&cfg, |name, shape| {
        asked.push(name.to_string());
        let (want, values) = by_name[name];
        assert_eq!(shape, want.as_slice(), "{name}");
        Ok(values.clone())
    })
    .unwrap();
    assert_eq!(w, ModelWeights::read(&dir, &cfg).unwrap());
    asked.sort();
    let mut names: Vec<String> = written.iter().map(|(n, _, _)| n.clone()).collect();
    names.sort();
    assert_eq!(asked, names, "each tensor asked for once");
    let e = ModelWeights::from_tensors(&cfg, |name, _| {
        Err(ModelError::Tensor { path: "state_dict".into(), name: name.into(), why: "missing".into() })
    })
    .unwrap_err()
    .to_string();
    assert_eq!(e, "state_dict: tensor 'model.embed_tokens.weight': missing");
}

#[test]
fn missing_misshapen_and_foreign_tensors_are_refused_by_name() {
    let config = llama_json(false);
    let cfg = config_in("cfg-only", &config).1.unwrap();
    let all = tensors(&cfg, 3);
    let refused = |name: &str, tensors: Vec<(String, Vec<usize>, Vec<bf16>)>| {
        let dir = scratch(name);
        write(&dir, &config, &tensors, 1);
        match ModelWeights::read(&dir, &cfg) {
            Err(e) => e.to_string(),
            Ok(_) => panic!("{name}: read without complaint"),
        }
    };
    let missing: Vec<_> = all.iter().filter(|(n, _, _)| n != "model.layers.1.mlp.up_proj.weight").cloned().collect();
    let text = refused("missing", missing);
    assert!(text.contains("model.layers.1.mlp.up_proj.weight") && text.contains("missing"), "{text}");
    let mut misshapen = all.clone();
    let k = misshapen.iter().position(|(n, _, _)| n == "model.layers.0.self_attn.k_proj.weight").unwrap();
    misshapen[k].1.reverse();
    let text = refused("misshapen", misshapen);
    assert!(text.contains("model.layers.0.self_attn.k_proj.weight") && text.contains("expected [32, 64]"), "{text}");
    let empty = scratch("empty");
    std::fs::write(empty.join("config.json"), config.to_string()).unwrap();
    let text = ModelWeights::read(&empty, &cfg).map(|_| ()).unwrap_err().to_string();
    assert!(text.contains("no *.safetensors file"), "{text}");
}

/// f32 and f16 tensors are read as bf16, each value rounded once to nearest even.
#[test]
fn f32_and_f16_tensors_round_to_bf16_on_load() {
    let config = json!({"model_type": "llama", "hidden_size": 2, "intermediate_size": 2, "num_hidden_layers": 0,
        "num_attention_heads": 1, "vocab_size": 2, "rms_norm_eps": 1e-5, "tie_word_embeddings": true});
    let (dir, cfg) = config_in("dtypes", &config);
    let cfg = cfg.unwrap();
    let f32s = [1.0f32 + 1.0 / 256.0 + 1.0 / 65536.0, -3.5, 0.1, 7.0];
    let f32_bytes: Vec<u8> = f32s.iter().flat_map(|v| v.to_le_bytes()).collect();
    let f16s = [half::f16::from_f32(0.333), half::f16::from_f32(-2.0)];
    let f16_bytes: Vec<u8> = f16s.iter().flat_map(|v| v.to_le_bytes()).collect();
    let views = vec![
        ("model.embed_tokens.weight".to_string(), TensorView::new(Dtype::F32, vec![2, 2], &f32_bytes).unwrap()),
        ("model.norm.weight".to_string(), TensorView::new(Dtype::F16, vec![2], &f16_bytes).unwrap()),
    ];
    std::fs::write(
        dir.join("model.safetensors"),
        safetensors::serialize(views, None::<HashMap<String, String>>).unwrap(),
    )
    .unwrap();
    let w = ModelWeights::read(&dir, &cfg).unwrap();
    assert_eq!(w.embed, f32s.map(bf16::from_f32).to_vec());
    assert_eq!(w.norm, f16s.map(|v| bf16::from_f32(v.to_f32())).to_vec());
    assert_eq!(w.embed[0], bf16::from_f32(1.0 + 1.0 / 128.0), "1 + 2^-8 + 2^-16 rounds up once, not to even twice");
}

/// A decode step is the embedding row through every layer's golden step (each layer's cache
/// advancing), the final norm and the f32 head; the caches carry from step to step.
#[test]
fn decode_steps_chain_the_golden_layers_and_their_caches() {
    decode_steps_chain(llama_json(false), "decode");
}

/// Qwen3: a Llama with each layer's q and k heads normalised before RoPE; `head_dim` given.
fn qwen3_json() -> serde_json::Value {
    let mut c = llama_json(false);
    (c["model_type"], c["head_dim"], c["use_sliding_window"]) = (json!("qwen3"), json!(32), json!(false));
    c
}

#[test]
fn qwen3_reads_its_q_and_k_norms_and_its_decode_steps_chain_golden_layers_with_them() {
    let cfg = config_of("qwen3-config", qwen3_json()).unwrap();
    assert!(cfg.qk_norm && !config_of("llama-config", llama_json(false)).unwrap().qk_norm);
    assert_eq!((cfg.layer.hd, cfg.layer.q_dim(), cfg.layer.d), (32, 128, 64), "head_dim is taken as given");
    let dir = scratch("qwen3-weights");
    let written = tensors(&cfg, 13);
    write(&dir, &qwen3_json(), &written, 2);
    let w = ModelWeights::read(&dir, &cfg).unwrap();
    let by_name: HashMap<&str, &Vec<bf16>> = written.iter().map(|(n, _, v)| (n.as_str(), v)).collect();
    assert_eq!(w.qk_norms.len(), 2);
    for (i, [q, k]) in w.qk_norms.iter().enumerate() {
        assert_eq!(q, by_name[format!("model.layers.{i}.self_attn.q_norm.weight").as_str()]);
        assert_eq!(k, by_name[format!("model.layers.{i}.self_attn.k_norm.weight").as_str()]);
    }
    let missing: Vec<_> = written.iter().filter(|(n, ..)| !n.ends_with("1.self_attn.k_norm.weight")).cloned().collect();
    let dir = scratch("qwen3-missing");
    write(&dir, &qwen3_json(), &missing, 1);
    let e = ModelWeights::read(&dir, &cfg).expect_err("a missing k_norm").to_string();
    assert!(e.contains("model.layers.1.self_attn.k_norm.weight"), "{e}");
    decode_steps_chain(qwen3_json(), "qwen3-decode");
}

/// `config`'s model with weights drawn from `seed`, written into a fresh folder `name` and read back.
fn written(name: &str, config: serde_json::Value, seed: u64) -> (ModelConfig, ModelWeights) {
    let (dir, cfg) = config_in(name, &config);
    let cfg = cfg.unwrap();
    write(&dir, &config, &tensors(&cfg, seed), 1);
    let w = ModelWeights::read(&dir, &cfg).unwrap();
    (cfg, w)
}

/// `config`'s model written with random weights decodes, position by position, as the golden layers
/// chained with their caches (with the q/k norms where the model has them), the final norm and the
/// head summed in f64.
fn decode_steps_chain(config: serde_json::Value, name: &str) {
    let (cfg, w) = written(name, config, 11);
    let mut model = CpuModel::new(cfg.clone(), w.clone(), 16);
    assert_eq!(model.context(), 16);
    let layer = Config { max_seq_len: 16, ..cfg.layer.clone() };
    let n = layer.cache_elems();
    let mut caches: Vec<KvCache> =
        (0..layer.layers).map(|_| KvCache { k: vec![bf16::ZERO; n], v: vec![bf16::ZERO; n] }).collect();
    let rope = RopeTable::new(&layer);
    for (pos, token) in [5u32, 17, 96].into_iter().enumerate() {
        let logits = model.decode_step(token, pos);
        let d = layer.d;
        let mut x = w.embed[token as usize * d..(token as usize + 1) * d].to_vec();
        for (l, (lw, cache)) in w.layers.iter().zip(&mut caches).enumerate() {
            x = match w.qk_norms.get(l) {
                Some([q, k]) => golden::step_qk_norm(&layer, lw, golden::QkNorm { q, k }, cache, &rope, &x, pos),
                None => golden::step(&layer, lw, cache, &rope, &x, pos),
            };
        }
        let h = golden::rmsnorm(&x, &w.norm, layer.eps);
        let head = w.lm_head.as_ref().unwrap();
        let want: Vec<f32> = (0..cfg.vocab)
            .map(|r| {
                head[r * d..(r + 1) * d]
                    .iter()
                    .zip(&h)
                    .map(|(a, b)| f64::from(a.to_f32()) * f64::from(b.to_f32()))
                    .sum::<f64>() as f32
            })
            .collect();
        assert_eq!(logits, want, "pos {pos}");
        assert!(logits.iter().all(|v| v.is_finite()) && logits.iter().any(|&v| v != 0.0));
    }
}

#[test]
fn argmax_takes_the_lowest_index_of_the_largest_and_never_nan() {
    assert_eq!(argmax(&[0.5, 2.0, -1.0, 2.0]), Some(1));
    assert_eq!(argmax(&[f32::NAN, -3.0, -3.0]), Some(1));
    assert_eq!(argmax(&[-0.0, 0.0]), Some(0), "equal values: the first");
    assert_eq!(argmax(&[f32::NAN]), None);
    assert_eq!(argmax(&[]), None);
}

/// A word-level tokenizer in `tokenizer.json`'s format: whitespace-split words, `<s>` added in front.
fn tokenizer_json() -> serde_json::Value {
    json!({
        "version": "1.0", "truncation": null, "padding": null,
        "added_tokens": [{"id": 1, "content": "<s>", "single_word": false, "lstrip": false, "rstrip": false,
                          "normalized": false, "special": true}],
        "normalizer": null, "pre_tokenizer": {"type": "Whitespace"},
        "post_processor": {"type": "TemplateProcessing", "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}},
                           {"Sequence": {"id": "A", "type_id": 0}}], "pair": [{"Sequence": {"id": "A", "type_id": 0}}],
                           "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}}},
        "decoder": null,
        "model": {"type": "WordLevel", "vocab": {"<unk>": 0, "<s>": 1, "hello": 2, "kernel": 3, "world": 4},
                  "unk_token": "<unk>"}
    })
}

#[test]
fn the_tokenizer_adds_the_start_token_and_decodes_without_it() {
    let dir = scratch("tokenizer");
    std::fs::write(dir.join("tokenizer.json"), tokenizer_json().to_string()).unwrap();
    let text = Text::read(&dir).unwrap();
    let tokens = text.encode("hello kernel world").unwrap();
    assert_eq!(tokens, [1, 2, 3, 4]);
    assert_eq!(text.decode(&tokens).unwrap(), "hello kernel world");
    assert_eq!(text.encode("hello gpu").unwrap(), [1, 2, 0], "an unknown word is <unk>");
}

#[test]
fn a_tokenizer_from_its_text_is_the_files() {
    let text = Text::parse(Path::new("given"), &tokenizer_json().to_string()).unwrap();
    assert_eq!(text.encode("hello world").unwrap(), [1, 2, 4]);
    let e = Text::parse(Path::new("the tokenizer given"), "{\"model\": 7}").err().expect("broken").to_string();
    assert!(e.starts_with("the tokenizer given: "), "{e}");
}

#[test]
fn a_missing_or_broken_tokenizer_is_refused_naming_the_file() {
    let dir = scratch("no-tokenizer");
    let e = Text::read(&dir).err().expect("no tokenizer.json").to_string();
    assert!(e.contains("tokenizer.json") && e.contains("not found"), "{e}");
    std::fs::write(dir.join("tokenizer.json"), "{\"model\": 7}").unwrap();
    let e = Text::read(&dir).err().expect("a broken tokenizer.json").to_string();
    assert!(e.contains("tokenizer.json"), "{e}");
}

/// Llama-3.2-1B's scaling (theta 5e5, hd 64, factor 32, frequency factors 1 and 4, original context
/// 8192): wavelengths under 2048 positions keep their frequency, those over 8192 are divided by 32,
/// those between are interpolated; from `rope_scaling` or transformers 5's `rope_parameters` alike.
#[test]
fn llama3_rope_scaling_divides_the_low_frequencies_and_interpolates_the_middle() {
    let scaling = json!({"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192});
    let mut legacy = llama_json(false);
    (legacy["hidden_size"], legacy["num_attention_heads"], legacy["num_key_value_heads"]) =
        (json!(256), json!(4), json!(2));
    legacy["rope_theta"] = json!(500000.0);
    legacy["rope_scaling"] = scaling.clone();
    let mut v5 = legacy.clone();
    v5.as_object_mut().unwrap().remove("rope_theta");
    v5["rope_scaling"] = json!(null);
    v5["rope_parameters"] = json!({"rope_theta": 500000.0});
    for (k, v) in scaling.as_object().unwrap() {
        v5["rope_parameters"][k] = v.clone();
    }
    for config in [legacy, v5] {
        let cfg = config_of("llama3", config).unwrap();
        assert_eq!(cfg.layer.theta, 500_000.0);
        let (scaled, plain) = (cfg.inv_freq(), golden::inv_freq(&cfg.layer));
        assert_eq!(scaled.len(), 32);
        let wavelen = |f: f64| 2.0 * std::f64::consts::PI / f;
        let (mut kept, mut divided, mut between) = (0, 0, 0);
        for (&s, &p) in scaled.iter().zip(&plain) {
            if wavelen(p) < 2048.0 {
                assert_eq!(s, p);
                kept += 1;
            } else if wavelen(p) > 8192.0 {
                assert_eq!(s, p / 32.0);
                divided += 1;
            } else {
                assert!(s < p && s > p / 32.0, "interpolated: {s} between {} and {p}", p / 32.0);
                between += 1;
            }
        }
        assert!(kept > 0 && divided > 0 && between > 0, "{kept} kept, {divided} divided, {between} between");
        let table = cfg.rope_table(3);
        assert_eq!(table.cos[2 * 32 + 31], (2.0 * scaled[31]).cos() as f32, "the table rotates by the scaled angles");
    }
}

/// The CPU's generation is its decode steps chained greedily from position 0, stopping where the
/// GPU's launch would: at an end-of-sequence token, after `max_new` tokens, or at the caches' end.
#[test]
fn a_cpu_generation_chains_greedy_decode_steps_and_stops_where_the_kernel_would() {
    let (cfg, w) = written("generate", llama_json(false), 21);
    let prompt = [5u32, 17, 96];
    let mut steps = CpuModel::new(cfg.clone(), w.clone(), 8);
    let mut logits = prompt.iter().enumerate().map(|(p, &t)| steps.decode_step(t, p)).last().unwrap();
    let mut greedy = Vec::new();
    for pos in prompt.len()..=8 {
        let next = argmax(&logits).unwrap() as u32;
        greedy.push(next);
        if pos == 8 {
            break;
        }
        logits = steps.decode_step(next, pos);
    }
    // The caches hold 8 positions: the prompt's 3 and 5 more, so 6 tokens at most.
    let mut model = CpuModel::new(cfg.clone(), w.clone(), 8);
    let (tokens, stop) = model.generate(&prompt, 100, &[]).unwrap();
    assert_eq!((tokens.as_slice(), stop), (&greedy[..6], Stop::Context));
    let mut model = CpuModel::new(cfg.clone(), w.clone(), 8);
    let (tokens, stop) = model.generate(&prompt, 2, &[]).unwrap();
    assert_eq!((tokens.as_slice(), stop), (&greedy[..2], Stop::MaxNew));
    let last = model.prefill(&prompt).unwrap();
    assert_eq!(argmax(&last), Some(greedy[0] as usize), "the prompt's last logits choose the first token");
    let mut model = CpuModel::new(cfg.clone(), w.clone(), 8);
    let (tokens, stop) = model.generate(&prompt, 100, &[greedy[3]]).unwrap();
    let first = greedy.iter().position(|&t| t == greedy[3]).unwrap();
    assert_eq!((tokens.as_slice(), stop), (&greedy[..=first], Stop::Eos));
    let mut model = CpuModel::new(cfg, w, 8);
    assert_eq!(model.checked_step(97, 0).unwrap_err(), "token 97 is outside the vocabulary of 97");
    assert_eq!(model.checked_step(1, 8).unwrap_err(), "position 8 is past the caches' 8");
    assert!(model.generate(&[1; 9], 1, &[]).unwrap_err().contains("longer than the caches' 8"));
}

/// Prompts generated together, one lane a sequence a step, give each prompt's own generation: here the
/// steps run on one CPU model per sequence, as the GPU's batch step runs each lane bitwise as its own
/// decode step.
#[test]
fn prompts_generated_together_are_each_their_own_generation() {
    let (cfg, w) = written("together", llama_json(false), 31);
    let prompts: Vec<Vec<u32>> = vec![vec![5, 17, 96], vec![40], vec![7, 8, 9, 10, 11, 12]];
    let alone: Vec<(Vec<u32>, Stop)> =
        prompts.iter().map(|p| CpuModel::new(cfg.clone(), w.clone(), 12).generate(p, 5, &[]).unwrap()).collect();
    let mut models: Vec<CpuModel> = (0..3).map(|_| CpuModel::new(cfg.clone(), w.clone(), 12)).collect();
    let limits = models[0].limits();
    let mut steps = 0;
    let together = generate_together::<String>(limits, 3, &prompts, 5, &[], |lanes| {
        steps += 1;
        Ok(lanes.iter().map(|l| argmax(&models[l.seq].decode_step(l.token, l.pos)).map(|t| t as u32)).collect())
    })
    .unwrap();
    assert_eq!(together, alone);
    // The six-token prompt and its five new tokens: 10 positions, one step each.
    assert_eq!(steps, 10);
    assert!(alone.iter().all(|(t, s)| t.len() == 5 && *s == Stop::MaxNew));
    let never = |_: &[Lane]| -> Result<Vec<Option<u32>>, String> { panic!("a refused request ran a step") };
    let e = generate_together(limits, 2, &prompts, 5, &[], never).unwrap_err();
    assert_eq!(e, "3 prompts: 1 to 2 (the sequences the model was loaded for)");
    let e = generate_together(limits, 3, &[vec![1], vec![1; 13]], 5, &[], never).unwrap_err();
    assert_eq!(e, "prompt 1: a prompt of 13 tokens is longer than the caches' 12 positions");
}

/// A bf16 tensor's values.
fn bf16s(view: TensorView) -> Vec<bf16> {
    assert_eq!(view.dtype(), Dtype::BF16);
    view.data().chunks_exact(2).map(|b| bf16::from_le_bytes([b[0], b[1]])).collect()
}

/// A fixture of `tests/fixtures`: its checkpoint's folder and a file of its expected tensors, both read.
fn fixture(variant: &str, expected: &str) -> (PathBuf, Vec<u8>, Vec<u8>) {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(variant);
    let checkpoint = dir.join("checkpoint");
    let stored = std::fs::read(checkpoint.join("model.safetensors")).unwrap();
    (checkpoint, stored, std::fs::read(dir.join(expected)).unwrap())
}

/// A checkpoint transformers saved with bitsandbytes nf4, without and with double quantisation
/// (`tests/fixtures`, written by `scripts/nf4_fixture.py`): every quantised weight reads as bitsandbytes'
/// own dequantisation of it, bit for bit, and every other tensor as it is stored; each quantised
/// weight's codes are kept as stored, with bitsandbytes' NF4 values (the nf4 stream's codebook).
#[test]
fn nf4_checkpoints_read_as_bitsandbytes_dequantises_them() {
    for variant in ["nf4", "nf4-double"] {
        let (checkpoint, stored_bytes, expected_bytes) = fixture(variant, "bnb-dequantized.safetensors");
        let cfg = ModelConfig::read(&checkpoint).unwrap();
        assert_eq!(cfg.quantized, Some(Quantization::Nf4), "{variant}: its config names the quantisation");
        let weights = ModelWeights::read(&checkpoint, &cfg).unwrap();
        let expected = safetensors::SafeTensors::deserialize(&expected_bytes).unwrap();
        let stored = safetensors::SafeTensors::deserialize(&stored_bytes).unwrap();
        let (norms, matrices) = LAYER_TENSORS.split_at(2);
        assert_eq!(expected.names().len(), matrices.len(), "{variant}: a quantised weight the test does not name");
        for &(t, name) in matrices {
            let name = format!("model.layers.0.{name}.weight");
            assert_eq!(stored.tensor(&name).unwrap().dtype(), Dtype::U8, "{variant}: {name} is stored quantised");
            assert_eq!(weights.layers[0].get(t), &bf16s(expected.tensor(&name).unwrap()), "{variant}: {name}");
            let Some(Coded::Nf4(m)) = weights.coded[0].get(t) else { panic!("{variant}: {name}'s codes kept") };
            assert_eq!(m.codes, stored.tensor(&name).unwrap().data(), "{variant}: {name}'s codes");
            assert_eq!(m.quant_map, NF4_VALUES, "{variant}: {name}'s quant_map is the stream's codebook");
            assert_eq!(&m.dequantize(), weights.layers[0].get(t), "{variant}: {name}'s codes make its weights");
        }
        for &(t, name) in norms {
            let name = format!("model.layers.0.{name}.weight");
            assert_eq!(weights.layers[0].get(t), &bf16s(stored.tensor(&name).unwrap()), "{variant}: {name}");
        }
        assert_eq!(weights.embed, bf16s(stored.tensor("model.embed_tokens.weight").unwrap()));
        assert_eq!(weights.norm, bf16s(stored.tensor("model.norm.weight").unwrap()));
        assert_eq!(weights.lm_head.as_deref(), Some(bf16s(stored.tensor("lm_head.weight").unwrap()).as_slice()));
        assert!(
            norms.iter().all(|&(t, _)| weights.coded[0].get(t).is_none()),
            "{variant}: the norms are not quantised"
        );
    }
}

/// Checkpoints transformers saved with fp8 weights (`tests/fixtures`, written by
/// `scripts/fp8_fixture.py`): a Llama with f32 scales over blocks of 32 x 64 and a Qwen3 with e8m0
/// scales over blocks of 32 x 32. Every tensor reads as transformers reads the checkpoint back in bf16,
/// bit for bit, and every projection is stored in e4m3.
#[test]
fn fp8_checkpoints_read_as_transformers_dequantises_them() {
    for (variant, block, qk_norm) in [("fp8", [32, 64], false), ("fp8-ue8m0", [32, 32], true)] {
        let (checkpoint, stored_bytes, expected_bytes) = fixture(variant, "transformers-dequantized.safetensors");
        let cfg = ModelConfig::read(&checkpoint).unwrap();
        assert_eq!(cfg.quantized, Some(Quantization::Fp8 { block: Some(block) }), "{variant}");
        assert_eq!(cfg.qk_norm, qk_norm, "{variant}");
        let weights = ModelWeights::read(&checkpoint, &cfg).unwrap();
        let expected = safetensors::SafeTensors::deserialize(&expected_bytes).unwrap();
        let stored = safetensors::SafeTensors::deserialize(&stored_bytes).unwrap();
        let want = |name: &str| bf16s(expected.tensor(name).unwrap());
        for (t, name) in LAYER_TENSORS {
            let name = format!("model.layers.0.{name}.weight");
            assert_eq!(weights.layers[0].get(t), &want(&name), "{variant}: {name}");
            let quantised = stored.tensor(&name).unwrap().dtype() == Dtype::F8_E4M3;
            assert_eq!(
                quantised,
                !matches!(t, Tensor::InNorm | Tensor::PostNorm),
                "{variant}: {name} is stored in e4m3 where it is a projection"
            );
            // Kept for the fp8 stream as stored: the codes, and the weights they make.
            let kept = weights.coded[0].get(t).as_ref();
            assert_eq!(kept.is_some(), quantised, "{variant}: {name}'s codes kept where it is quantised");
            if let Some(Coded::Fp8(m)) = kept {
                assert_eq!(m.codes, stored.tensor(&name).unwrap().data(), "{variant}: {name}'s codes");
                assert_eq!(&m.dequantize(), weights.layers[0].get(t), "{variant}: {name}'s codes make its weights");
            }
        }
        assert_eq!(weights.coded.len(), cfg.layer.layers, "{variant}: every layer's codes");
        if qk_norm {
            assert_eq!(weights.qk_norms[0][0], want("model.layers.0.self_attn.q_norm.weight"));
            assert_eq!(weights.qk_norms[0][1], want("model.layers.0.self_attn.k_norm.weight"));
        }
        assert_eq!(weights.embed, want("model.embed_tokens.weight"));
        assert_eq!(weights.norm, want("model.norm.weight"));
        assert_eq!(weights.lm_head.as_deref(), Some(want("lm_head.weight").as_slice()));
    }
}

/// The fp8 fixture with one weight rewritten: k_proj in bf16 beside its scale (as transformers saves a
/// weight its block does not divide), an e4m3 tensor where the config names no quantisation, and an
/// e4m3 tensor in an nf4 checkpoint: each is refused naming the tensor and what it is.
#[test]
fn fp8_tensors_out_of_place_are_refused_naming_them() {
    let (checkpoint, stored_bytes, expected_bytes) = fixture("fp8", "transformers-dequantized.safetensors");
    let stored = safetensors::SafeTensors::deserialize(&stored_bytes).unwrap();
    let expected = safetensors::SafeTensors::deserialize(&expected_bytes).unwrap();
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(checkpoint.join("config.json")).unwrap()).unwrap();
    let k_proj = "model.layers.0.self_attn.k_proj.weight";
    // The checkpoint with `config`, k_proj replaced by its dequantised bf16 where `k_in_bf16`.
    let write = |name: &str, config: &serde_json::Value, k_in_bf16: bool| {
        let dir = scratch(name);
        std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
        let views: Vec<(String, TensorView<'_>)> = stored
            .tensors()
            .into_iter()
            .map(|(n, v)| if k_in_bf16 && n == k_proj { (n, expected.tensor(k_proj).unwrap()) } else { (n, v) })
            .collect();
        let file = safetensors::serialize(views, None::<HashMap<String, String>>).unwrap();
        std::fs::write(dir.join("model.safetensors"), file).unwrap();
        let cfg = ModelConfig::read(&dir).unwrap();
        ModelWeights::read(&dir, &cfg).unwrap_err().to_string()
    };
    let text = write("fp8-stray-scale", &config, true);
    assert!(
        text.contains(k_proj) && text.contains("beside a 'model.layers.0.self_attn.k_proj.weight_scale_inv'"),
        "{text}"
    );
    assert!(text.contains("quantise with a block that divides every weight"), "{text}");
    let mut plain = config.clone();
    plain.as_object_mut().unwrap().remove("quantization_config");
    let text = write("fp8-unnamed", &plain, false);
    assert!(text.contains("dtype F8_E4M3, but config.json names no quantisation"), "{text}");
    let mut nf4 = config.clone();
    nf4["quantization_config"] =
        json!({"quant_method": "bitsandbytes", "load_in_4bit": true, "bnb_4bit_quant_type": "nf4"});
    let text = write("fp8-as-nf4", &nf4, false);
    assert!(text.contains("dtype F8_E4M3: bitsandbytes nf4 stores its weights in U8"), "{text}");
}

/// Each quantised fixture in two shards that part weights from their parts both ways (q_proj's parts
/// in the second, down_proj's codes there and its parts in the first): it reads as the one file does.
#[test]
fn a_quantised_weights_parts_are_found_in_another_shard() {
    for (variant, q_parts) in [("nf4-double", "self_attn.q_proj.weight."), ("fp8", "self_attn.q_proj.weight_scale_inv")]
    {
        let checkpoint = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(variant).join("checkpoint");
        let bytes = std::fs::read(checkpoint.join("model.safetensors")).unwrap();
        let whole = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let second = |name: &str| name.contains(q_parts) || name == "model.layers.0.mlp.down_proj.weight";
        assert!(whole.names().iter().any(|n| n.contains(q_parts)), "{variant}: q_proj has parts");
        let dir = scratch(&format!("{variant}-shards"));
        std::fs::copy(checkpoint.join("config.json"), dir.join("config.json")).unwrap();
        let mut weight_map = serde_json::Map::new();
        for (file, in_second) in
            [("model-00001-of-00002.safetensors", false), ("model-00002-of-00002.safetensors", true)]
        {
            let views: Vec<(String, TensorView<'_>)> =
                whole.tensors().into_iter().filter(|(name, _)| second(name) == in_second).collect();
            for (name, _) in &views {
                weight_map.insert(name.clone(), json!(file));
            }
            std::fs::write(dir.join(file), safetensors::serialize(views, None::<HashMap<String, String>>).unwrap())
                .unwrap();
        }
        let index = json!({ "weight_map": weight_map }).to_string();
        std::fs::write(dir.join("model.safetensors.index.json"), index).unwrap();
        let cfg = ModelConfig::read(&checkpoint).unwrap();
        assert_eq!(
            ModelWeights::read(&dir, &cfg).unwrap(),
            ModelWeights::read(&checkpoint, &cfg).unwrap(),
            "{variant}"
        );
    }
}

/// A Llama config whose `quantization_config` is `base` with `changes` made.
fn quantized_config(base: &serde_json::Value, changes: serde_json::Value) -> serde_json::Value {
    let mut q = base.clone();
    for (k, v) in changes.as_object().unwrap() {
        q[k] = v.clone();
    }
    let mut c = llama_json(false);
    c["quantization_config"] = q;
    c
}

/// `config` is refused naming `quantization_config`, with `words` and what the loader reads.
fn assert_quantization_refused(name: &str, config: serde_json::Value, words: &str) {
    match config_of(name, config) {
        Err(e @ ModelError::Unsupported { .. }) => {
            let text = e.to_string();
            assert!(text.contains("field 'quantization_config'") && text.contains(words), "{name}: {text}");
            assert!(
                text.contains("bitsandbytes nf4") && text.contains("fp8 e4m3"),
                "{name}: says what it reads: {text}"
            );
        }
        other => panic!("{name}: {other:?}"),
    }
}

#[test]
fn quantisations_the_loader_does_not_read_are_refused_naming_them() {
    let nf4 = json!({"quant_method": "bitsandbytes", "load_in_4bit": true, "bnb_4bit_quant_type": "nf4",
                     "bnb_4bit_quant_storage": "uint8"});
    assert_eq!(config_of("nf4-config", quantized_config(&nf4, json!({}))).unwrap().quantized, Some(Quantization::Nf4));
    for (name, changes, words) in [
        ("gptq", json!({"quant_method": "gptq"}), "quant_method 'gptq'"),
        ("int8", json!({"load_in_8bit": true, "load_in_4bit": false}), "load_in_8bit"),
        ("fp4", json!({"bnb_4bit_quant_type": "fp4"}), "bnb_4bit_quant_type 'fp4'"),
        ("storage", json!({"bnb_4bit_quant_storage": "bfloat16"}), "'bfloat16'"),
        ("not-4bit", json!({"load_in_4bit": false}), "without load_in_4bit"),
    ] {
        assert_quantization_refused(name, quantized_config(&nf4, changes), words);
    }
}

#[test]
fn fp8_configs_read_their_block_and_what_the_loader_does_not_compute_is_refused() {
    let fp8 = json!({"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "scale_fmt": "float",
                     "weight_block_size": [128, 128], "dequantize": false, "modules_to_not_convert": null});
    for (name, changes, block) in [
        ("fp8-config", json!({}), Some([128, 128])),
        ("fp8-ue8m0", json!({"scale_fmt": "ue8m0", "weight_block_size": [1, 64]}), Some([1, 64])),
        ("fp8-per-weight", json!({"weight_block_size": null}), None),
    ] {
        let cfg = config_of(name, quantized_config(&fp8, changes)).unwrap();
        assert_eq!(cfg.quantized, Some(Quantization::Fp8 { block }), "{name}");
    }
    for (name, changes, words) in [
        ("e5m2", json!({"fmt": "e5m2"}), "fp8 fmt 'e5m2'"),
        ("static", json!({"activation_scheme": "static"}), "activation_scheme 'static'"),
        ("scale-fmt", json!({"scale_fmt": "ue4m3"}), "scale_fmt 'ue4m3'"),
        ("zero-block", json!({"weight_block_size": [0, 128]}), "weight_block_size [0,128]"),
        ("one-size", json!({"weight_block_size": [128]}), "weight_block_size [128]"),
    ] {
        assert_quantization_refused(name, quantized_config(&fp8, changes), words);
    }
}
