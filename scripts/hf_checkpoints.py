"""Random-weight Llama-family checkpoints as transformers writes them, for scripts/hf-agreement.py,
scripts/hf-speed.py and scripts/hf-python.py (no downloads): the shapes they run, the config, the
model, a byte-level BPE tokenizer trained on the repository's docs, and transformers' own decode
speed."""
import json
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, BitsAndBytesConfig, FineGrainedFP8Config, LlamaConfig, Qwen3Config
from transformers.quantizers.quantizer_finegrained_fp8 import FineGrainedFP8HfQuantizer

ROOT = Path(__file__).resolve().parent.parent
BOS, EOS = 1, 2
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}

# The agreement checks' shapes, one per family the loader takes: small, so that the CPU model runs
# them too. name: (hidden, intermediate, layers, heads, kv heads, vocab, tied, rope theta, rope
# scaling[, head size])
SHAPES = {
    "llama-tiny-gqa": (256, 512, 3, 8, 2, 1000, False, 500000.0, None),
    "llama-tiny-tied-mha": (192, 384, 2, 6, 6, 777, True, 10000.0, None),
    "llama-hd128": (512, 1024, 2, 4, 2, 2048, False, 500000.0, None),
    # SmolLM2-360M's layer (15 heads of 64, 5 KV heads), 4 of its 32 layers, a smaller vocabulary.
    "smollm2-360m-4l": (960, 2560, 4, 15, 5, 4096, True, 100000.0, None),
    # Llama-3.2-1B's layer, RoPE scaling and vocabulary, 4 of its 16 layers.
    "llama-3.2-1b-4l": (2048, 8192, 4, 32, 8, 128256, True, 500000.0, LLAMA3_ROPE),
    # Qwen3-0.6B's layer (16 heads of 128 over d 1024, 8 KV heads, q/k norms), 3 layers.
    "qwen3-0.6b-3l": (1024, 3072, 3, 16, 8, 4096, True, 1000000.0, None, 128),
}

# The speed comparisons' shapes: real models' whole depth and vocabulary.
SIZES = {
    "smollm2-360m": (960, 2560, 32, 15, 5, 49152, True, 100000.0, None),
    "llama-3.2-1b": (2048, 8192, 16, 32, 8, 128256, True, 500000.0, LLAMA3_ROPE),
    "tinyllama-1.1b": (2048, 5632, 22, 32, 4, 32000, False, 10000.0, None),
    "llama-3.1-8b": (4096, 14336, 32, 32, 8, 128256, False, 500000.0, LLAMA3_ROPE),
    "qwen3-0.6b": (1024, 3072, 28, 16, 8, 151936, True, 1000000.0, None, 128),
    # Llama-3.2-1B's 16 layers and heads (32 query heads of 64, 8 KV heads) over hidden 256 and
    # intermediate 512: about 3 MB of weights a layer, so a layer's time is its chain of dependent
    # steps, what it costs beyond its bytes (docs/perf.md, the eleventh session).
    "chain-1b": (256, 512, 16, 32, 8, 1024, True, 500000.0, None, 64),
}


def model_config(name, shape, context):
    """The config of shape (hidden, intermediate, layers, heads, kv heads, vocab, tied, rope theta, rope
    scaling or None[, head size]): a Qwen3Config (with the head size, its q/k norms) for a name that
    starts with "qwen3", else a LlamaConfig (with the head size where given, else hidden / heads)."""
    d, ffn, layers, heads, kv, vocab, tied, theta, scaling, *head_dim = shape
    if scaling is not None:  # transformers wants the scaled context above the original
        context = max(context, 4 * scaling["original_max_position_embeddings"])
    # transformers 5 takes the base and the scaling together as rope_parameters; 4 as rope_theta and
    # rope_scaling.
    v5 = "rope_parameters" in LlamaConfig().to_dict()
    rope = {"rope_parameters": dict(scaling or {"rope_type": "default"}, rope_theta=theta)} if v5 else \
        {"rope_theta": theta, "rope_scaling": scaling}
    common = dict(hidden_size=d, intermediate_size=ffn, num_hidden_layers=layers, num_attention_heads=heads,
                  num_key_value_heads=kv, vocab_size=vocab, tie_word_embeddings=tied,
                  max_position_embeddings=context, rms_norm_eps=1e-5, bos_token_id=BOS, eos_token_id=EOS, **rope)
    if name.startswith("qwen3"):
        return Qwen3Config(head_dim=head_dim[0], use_sliding_window=False, **common)
    return LlamaConfig(**({"head_dim": head_dim[0]} if head_dim else {}), **common)


def save(model, out):
    """save_pretrained, then the RoPE fields config.json holds, to stderr."""
    model.save_pretrained(out)
    written = json.loads((out / "config.json").read_text())
    print(f"{out.name}: config.json's RoPE: " + ", ".join(f"{k}={written[k]}" for k in
          ("rope_theta", "rope_scaling", "rope_parameters") if k in written), file=sys.stderr)


def make_tokenizer(vocab, path):
    """A byte-level BPE of at most `vocab` tokens trained on the repository's docs: <unk> 0, <s> 1 (added
    in front of every text), </s> 2."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    lines = [line for doc in sorted((ROOT / "docs").glob("*.md")) for line in doc.read_text().splitlines()]
    tok.train_from_iterator(lines, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", BOS)])
    tok.save(str(path))


def agreement_checkpoint(name, out):
    """SHAPES[name] with random weights of 1.28 / sqrt(hidden) (larger than the init's 0.02, so the
    layers matter), saved in bf16 with a tokenizer into `out`; returns the vocabulary's size."""
    shape = SHAPES[name]
    torch.manual_seed(len(name))
    model = AutoModelForCausalLM.from_config(model_config(name, shape, 256)).to(torch.bfloat16)
    with torch.no_grad():
        for w in model.parameters():
            w.normal_(0.0, 1.28 / shape[0] ** 0.5)
    save(model, out)
    make_tokenizer(shape[5], out / "tokenizer.json")
    return shape[5]


def nf4_checkpoint(dense, out, device):
    """The bf16 checkpoint `dense` loaded by transformers with bitsandbytes nf4 (double quantisation:
    both kinds of scale are read) onto `device` and saved into `out` with its tokenizer, as a user
    saves a model loaded in 4 bits; returns the loaded model."""
    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                               bnb_4bit_compute_dtype=torch.bfloat16)
    model = AutoModelForCausalLM.from_pretrained(dense, dtype=torch.bfloat16, quantization_config=quant,
                                                 device_map={"": device})
    model.save_pretrained(out)
    if (dense / "tokenizer.json").exists():
        shutil.copy(dense / "tokenizer.json", out / "tokenizer.json")
    return model


# bitsandbytes' 16 nf4 values (each checkpoint's `quant_map`), its block of 64 elements a scale, and the
# projections its 4-bit loading quantises (every Linear but the LM head).
NF4_VALUES = (-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
              -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
              0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
              0.7229568362236023, 1.0)
NF4_BLOCK = 64
NF4_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def nf4_speed_checkpoint(dense, out, device="cuda"):
    """The bf16 checkpoint `dense` in bitsandbytes' nf4 layout without bitsandbytes (whose CUDA build a
    machine may lack), for speed runs: each projection's codes the nearest of NF4_VALUES to its element
    over its block's absmax (bitsandbytes' own quantiser may pick the other value at a midpoint), f32
    absmax (no double quantisation), the tensors and config that a model loaded in 4 bits saves, so
    the loader reads it as it reads theirs (megakernel/src/model/quantized/nf4.rs)."""
    from safetensors.torch import load_file, save_file
    values = torch.tensor(NF4_VALUES, device=device)
    tensors = {}
    for f in sorted(Path(dense).glob("*.safetensors")):
        for name, w in load_file(f, device=device).items():
            if not (name.endswith(".weight") and name.split(".")[-2] in NF4_PROJECTIONS):
                tensors[name] = w
                continue
            blocks = w.float().reshape(-1, NF4_BLOCK)
            absmax = blocks.abs().amax(dim=1)
            scaled = blocks / absmax.clamp(min=torch.finfo(torch.float32).tiny)[:, None]
            codes = (scaled.reshape(-1, 1) - values).abs().argmin(dim=1).to(torch.uint8)
            state = {"quant_type": "nf4", "blocksize": NF4_BLOCK, "dtype": "bfloat16", "shape": list(w.shape)}
            tensors[name] = (codes[0::2] << 4 | codes[1::2]).reshape(-1, 1)  # the first code in the high nibble
            tensors[name + ".absmax"] = absmax
            tensors[name + ".quant_map"] = values.clone()
            tensors[name + ".quant_state.bitsandbytes__nf4"] = torch.tensor(list(json.dumps(state).encode()), dtype=torch.uint8)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous().cpu() for k, v in tensors.items()}, out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((Path(dense) / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "bitsandbytes", "load_in_4bit": True, "load_in_8bit": False, "bnb_4bit_quant_type": "nf4",
        "bnb_4bit_use_double_quant": False, "bnb_4bit_compute_dtype": "bfloat16", "bnb_4bit_quant_storage": "uint8"}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    if (Path(dense) / "tokenizer.json").exists():
        shutil.copy(Path(dense) / "tokenizer.json", out / "tokenizer.json")


def fp8_block(shape):
    """The largest square block of 128, 64 or 32 that tiles every projection of shape (SHAPES' form):
    a block that does not tile a weight leaves it unquantised with a stray scale, which the loader
    refuses (megakernel/src/model/quantized)."""
    d, ffn, _, heads, kv, *_, head_dim = shape
    head = head_dim if isinstance(head_dim, int) else d // heads
    sizes = (d, ffn, heads * head, kv * head)
    for b in (128, 64, 32):
        if all(n % b == 0 for n in sizes):
            return (b, b)
    raise ValueError(f"no block of 128, 64 or 32 tiles the projections {sizes}")


def fp8_checkpoint(dense, out, block, scale_fmt="float", device="cpu"):
    """The bf16 checkpoint `dense` quantised by transformers to fine-grained fp8 (e4m3 weights, a scale
    a block of `block`, f32 or e8m0 by `scale_fmt`) on `device` and saved into `out` with its tokenizer.
    Quantising is torch arithmetic that transformers' environment check keeps to GPUs of compute
    capability 8.9 and up: the check is skipped while it runs, so a CPU quantises too (an 8B model is
    quicker on the GPU)."""
    check = FineGrainedFP8HfQuantizer.validate_environment
    FineGrainedFP8HfQuantizer.validate_environment = lambda self, *args, **kwargs: None
    try:
        quant = FineGrainedFP8Config(weight_block_size=block, scale_fmt=scale_fmt)
        model = AutoModelForCausalLM.from_pretrained(dense, device_map=device, dtype=torch.bfloat16, quantization_config=quant)
        model.save_pretrained(out)
    finally:
        FineGrainedFP8HfQuantizer.validate_environment = check
    if (dense / "tokenizer.json").exists():
        shutil.copy(dense / "tokenizer.json", out / "tokenizer.json")


# Loads an fp8 checkpoint dequantised to bf16, the weights the megakernel's loader reads: transformers'
# fp8 matmul needs a kernel fetched from the Hub, which the GPU machine cannot reach.
FP8_DEQUANTIZED = FineGrainedFP8Config(dequantize=True)


def speed_checkpoint(name, out):
    """SIZES[name] with transformers' random init, in bf16 on the GPU, saved into `out`; returns the
    model."""
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(model_config(name, SIZES[name], 8192)).to(torch.bfloat16)
    save(model, out)
    return model


def time_generate(model, new, compiled, reps=3):
    """ms per decode step of greedy generation with a static cache: eager, or compiled by generate
    itself (transformers compiles the forward when the cache is static unless disable_compile)."""
    ids = torch.tensor([[1]], device="cuda")
    kw = dict(do_sample=False, cache_implementation="static", pad_token_id=0, disable_compile=not compiled)

    def once(n):
        torch.cuda.synchronize()
        t = time.perf_counter()
        model.generate(ids, max_new_tokens=n, min_new_tokens=n, **kw)
        torch.cuda.synchronize()
        return time.perf_counter() - t

    once(new), once(1)  # warm-up (and compilation)
    return statistics.median((once(1 + new) - once(1)) / new * 1e3 for _ in range(reps))
