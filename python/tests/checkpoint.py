"""A small Llama-family checkpoint written by hand in the layout Hugging Face writes (config.json and
one model.safetensors of bf16 tensors), with no torch, numpy or safetensors package: what the tests
load through the binding and through the ``megakernel`` command."""

from __future__ import annotations

import json
import random
import struct
from pathlib import Path
from typing import Dict, List, Tuple

# Two layers of a tiny Llama (hidden 64, 4 query heads and 2 KV heads of 16), 97 tokens.
LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 96,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 97,
    "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "hidden_act": "silu", "tie_word_embeddings": False,
    "max_position_embeddings": 256, "bos_token_id": 1, "eos_token_id": [2, 3], "torch_dtype": "bfloat16",
    "rope_scaling": None, "attention_bias": False, "mlp_bias": False,
}


def shapes(config: dict) -> List[Tuple[str, List[int]]]:
    """Every tensor of ``config``'s model, Hugging Face's names, in order."""
    d, ffn, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    hd = d // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * hd, config["num_key_value_heads"] * hd
    out = [("model.embed_tokens.weight", [vocab, d])]
    for i in range(config["num_hidden_layers"]):
        for name, shape in [
            ("input_layernorm.weight", [d]), ("post_attention_layernorm.weight", [d]),
            ("self_attn.q_proj.weight", [q, d]), ("self_attn.k_proj.weight", [kv, d]),
            ("self_attn.v_proj.weight", [kv, d]), ("self_attn.o_proj.weight", [d, q]),
            ("mlp.gate_proj.weight", [ffn, d]), ("mlp.up_proj.weight", [ffn, d]),
            ("mlp.down_proj.weight", [d, ffn]),
        ]:
            out.append((f"model.layers.{i}.{name}", shape))
    out.append(("model.norm.weight", [d]))
    if not config["tie_word_embeddings"]:
        out.append(("lm_head.weight", [vocab, d]))
    return out


def bf16(x: float) -> bytes:
    """x rounded to bf16 (to nearest, ties to even), little-endian."""
    bits = struct.unpack("<I", struct.pack("<f", x))[0]
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return struct.pack("<H", bits)


def write(folder: Path, config: dict, seed: int) -> None:
    """``config`` and its tensors drawn from ``seed`` (uniform in [-0.1, 0.1)) into ``folder``."""
    rng = random.Random(seed)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    header: Dict[str, dict] = {}
    data = bytearray()
    for name, shape in shapes(config):
        n = 1
        for s in shape:
            n *= s
        start = len(data)
        data += b"".join(bf16(rng.uniform(-0.1, 0.1)) for _ in range(n))
        header[name] = {"dtype": "BF16", "shape": shape, "data_offsets": [start, len(data)]}
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    (folder / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(data))


def write_tokenizer(folder: Path, vocab: int) -> None:
    """A word-level tokenizer.json over ``vocab`` ids: ``<unk>`` 0, ``<s>`` 1 (added in front of every
    text, as Llama's post-processor adds its start token), and the word ``t{i}`` for each id i >= 2."""
    words = {"<unk>": 0, "<s>": 1, **{f"t{i}": i for i in range(2, vocab)}}
    (folder / "tokenizer.json").write_text(json.dumps({
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": [{"id": 1, "content": "<s>", "single_word": False, "lstrip": False, "rstrip": False,
                          "normalized": False, "special": True}],
        "normalizer": None, "pre_tokenizer": {"type": "Whitespace"},
        "post_processor": {"type": "TemplateProcessing",
                           "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
                           "pair": [{"Sequence": {"id": "A", "type_id": 0}}],
                           "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}}},
        "decoder": None,
        "model": {"type": "WordLevel", "vocab": words, "unk_token": "<unk>"},
    }))
