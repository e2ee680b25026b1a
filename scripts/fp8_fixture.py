"""Writes the fp8 loader's fixtures (megakernel/tests/fixtures/fp8 and fp8-ue8m0): a one-layer Llama
and a one-layer Qwen3 with random weights, saved by transformers after quantising them with
FineGrainedFP8Config (f32 scales over blocks of 32 x 64; e8m0 scales over blocks of 32 x 32), and beside
each checkpoint every weight as transformers reads the checkpoint back in bf16 (on a machine without a
GPU it dequantises on load), which the loader must equal bit for bit. Every weight's shape is a whole
number of blocks: transformers 5.25 leaves a weight its block does not divide in bf16 but saves an
uninitialised scale beside it, which its own loader then multiplies in (the loader refuses such a
weight; megakernel/src/model/tests.rs builds one). Needs torch, transformers and accelerate:

    python3 scripts/fp8_fixture.py megakernel/tests/fixtures
"""
import shutil
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

from hf_checkpoints import fp8_checkpoint

SHAPE = dict(hidden_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, vocab_size=32,
             tie_word_embeddings=False, max_position_embeddings=64, bos_token_id=1, eos_token_id=2)
VARIANTS = (
    ("fp8", LlamaConfig(**SHAPE, intermediate_size=128), (32, 64), "float"),
    ("fp8-ue8m0", Qwen3Config(**SHAPE, intermediate_size=96, head_dim=16), (32, 32), "ue8m0"),
)


def main(root):
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        for name, cfg, block, scale_fmt in VARIANTS:
            dense = Path(tmp) / f"{name}-bf16"
            AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16).save_pretrained(dense)
            saved = Path(tmp) / name
            fp8_checkpoint(dense, saved, block, scale_fmt)
            checkpoint = root / name / "checkpoint"
            shutil.rmtree(root / name, ignore_errors=True)
            checkpoint.mkdir(parents=True)
            for file in ("config.json", "model.safetensors"):
                shutil.copy(saved / file, checkpoint / file)
            # Read back as a user without a GPU reads it: transformers dequantises every fp8 weight.
            model = AutoModelForCausalLM.from_pretrained(checkpoint, device_map="cpu", dtype=torch.bfloat16)
            expected = {k: v.contiguous() for k, v in model.state_dict().items()}
            assert all(v.dtype == torch.bfloat16 for v in expected.values())
            save_file(expected, str(root / name / "transformers-dequantized.safetensors"))
            print(f"{root / name}: {len(expected)} tensors")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
