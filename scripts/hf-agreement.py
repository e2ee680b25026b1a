#!/usr/bin/env python3
"""The CPU model decode of megakernel::model against transformers, on checkpoints transformers writes.

For each shape below: `LlamaForCausalLM(config)` with random weights saved in bf16 by
`save_pretrained`; transformers' logits over teacher-forced tokens in bf16 with eager and with sdpa
attention (their spread is what "agreeing with transformers" can mean), and the logits of
`megakernel/examples/model_logits` (the Rust CPU model) over the same tokens. Prints, per shape, the
relative error of each against transformers' eager path and how often the greedy tokens agree.

    python3 scripts/hf-agreement.py [PATH_TO_model_logits] [--out DIR]

Needs torch and transformers (the GPU machine has both); runs on the GPU when there is one.
"""
import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

SHAPES = {
    # name: (hidden, intermediate, layers, heads, kv heads, vocab, tied, rope theta)
    "llama-tiny-gqa": (256, 512, 3, 8, 2, 1000, False, 500000.0),
    "llama-tiny-tied-mha": (192, 384, 2, 6, 6, 777, True, 10000.0),
    "llama-hd128": (512, 1024, 2, 4, 2, 2048, False, 500000.0),
}
TOKENS = 24


def rel(a, b):
    return float((a - b).norm() / b.norm())


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("binary", nargs="?", default="target/release/examples/model_logits")
    p.add_argument("--out", default=None, help="where to write the checkpoints (default: a temporary folder)")
    args = p.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    root = Path(args.out or tempfile.mkdtemp(prefix="hf-agreement-"))
    print(f"{'shape':<22} {'ours vs eager':>14} {'sdpa vs eager':>14} {'argmax ours=eager':>18} {'sdpa=eager':>11}")
    worst_ratio = 0.0
    for name, (d, ffn, layers, heads, kv, vocab, tied, theta) in SHAPES.items():
        torch.manual_seed(len(name))
        config = LlamaConfig(hidden_size=d, intermediate_size=ffn, num_hidden_layers=layers,
                             num_attention_heads=heads, num_key_value_heads=kv, vocab_size=vocab,
                             tie_word_embeddings=tied, rope_theta=theta, max_position_embeddings=256,
                             rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2)
        model = LlamaForCausalLM(config).to(torch.bfloat16)
        with torch.no_grad():
            for w in model.parameters():  # larger than the init's 0.02 so the layers matter
                w.normal_(0.0, 0.08)
        out = root / name
        model.save_pretrained(out)
        tokens = torch.randint(3, vocab, (1, TOKENS))
        logits = {}
        for impl in ("eager", "sdpa"):
            m = LlamaForCausalLM.from_pretrained(out, dtype=torch.bfloat16, attn_implementation=impl).to(device)
            with torch.no_grad():
                logits[impl] = m(tokens.to(device)).logits[0].float().cpu()
        run = subprocess.run([args.binary, str(out), ",".join(map(str, tokens[0].tolist()))],
                             capture_output=True, text=True)
        if run.returncode != 0:
            print(f"{name}: model_logits failed: {run.stderr.strip()}")
            sys.exit(1)
        ours = torch.tensor(json.loads(run.stdout)["logits"])
        e, s = logits["eager"], logits["sdpa"]
        agree = float((ours.argmax(-1) == e.argmax(-1)).float().mean())
        agree_sdpa = float((s.argmax(-1) == e.argmax(-1)).float().mean())
        ratio = rel(ours, e) / max(rel(s, e), 1e-12)
        worst_ratio = max(worst_ratio, ratio)
        print(f"{name:<22} {rel(ours, e):>14.3e} {rel(s, e):>14.3e} {agree:>18.3f} {agree_sdpa:>11.3f}")
    print(f"ours vs eager over sdpa vs eager, worst shape: {worst_ratio:.2f}x")


if __name__ == "__main__":
    main()
