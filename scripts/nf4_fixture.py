"""Writes the nf4 loader's fixtures (megakernel/tests/fixtures/nf4 and nf4-double): a one-layer Llama
with random weights, saved by transformers after loading it with bitsandbytes nf4 (without and with
double quantisation), and beside each checkpoint bitsandbytes' own dequantisation of every quantised
weight, which the loader must equal bit for bit. Needs torch, transformers and bitsandbytes (its CPU
backend is enough):

    python3 scripts/nf4_fixture.py megakernel/tests/fixtures
"""
import shutil
import sys
import tempfile
from pathlib import Path

import bitsandbytes.functional as F
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, BitsAndBytesConfig, LlamaConfig

STATE = ".quant_state.bitsandbytes__nf4"


def bnb_dequantized(checkpoint):
    """Every quantised weight of the checkpoint as bitsandbytes dequantises it."""
    f = safe_open(str(checkpoint / "model.safetensors"), "pt")
    out = {}
    for key in f.keys():
        if key.endswith(STATE):
            w = key[: -len(STATE)]
            parts = {k[len(w) + 1:]: f.get_tensor(k) for k in f.keys() if k.startswith(w + ".")}
            out[w] = F.dequantize_4bit(f.get_tensor(w), F.QuantState.from_dict(parts, device="cpu")).contiguous()
    return out


def main(root):
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, vocab_size=32, tie_word_embeddings=False, max_position_embeddings=64,
                      bos_token_id=1, eos_token_id=2)
    with tempfile.TemporaryDirectory() as tmp:
        dense = Path(tmp) / "bf16"
        AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16).save_pretrained(dense)
        for name, double in (("nf4", False), ("nf4-double", True)):
            quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=double,
                                       bnb_4bit_compute_dtype=torch.bfloat16)
            model = AutoModelForCausalLM.from_pretrained(dense, device_map="cpu", dtype=torch.bfloat16,
                                                         quantization_config=quant)
            saved = Path(tmp) / name
            model.save_pretrained(saved)
            checkpoint = root / name / "checkpoint"
            shutil.rmtree(root / name, ignore_errors=True)
            checkpoint.mkdir(parents=True)
            for file in ("config.json", "model.safetensors"):
                shutil.copy(saved / file, checkpoint / file)
            expected = bnb_dequantized(checkpoint)
            save_file(expected, str(root / name / "bnb-dequantized.safetensors"))
            print(f"{root / name}: {len(expected)} quantised weights")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
