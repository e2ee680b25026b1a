#!/usr/bin/env python3
"""The megakernel's model (CPU and GPU) against transformers, on checkpoints transformers writes.

For each shape below: `LlamaForCausalLM(config)` (or `Qwen3ForCausalLM`) with random weights saved in
bf16 by `save_pretrained`, with a byte-level BPE tokenizer trained here on the repository's docs (no
downloads). Then, over teacher-forced random tokens: transformers' logits in bf16 with eager and
with sdpa attention (their spread is what "agreeing with transformers" can mean), and the logits of
`megakernel logits` on the CPU and on the GPU (one launch per position); printed per shape as the
relative error of each against transformers' eager path and how often the greedy tokens agree.
Then `megakernel check` (the GPU against the CPU model) and `megakernel generate` on each checkpoint.

    python3 scripts/hf-agreement.py [PATH_TO_megakernel] [--out DIR] [--shapes a,b]

Needs torch, transformers and tokenizers (the GPU machine has them) and an H100/H200.
"""
import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from hf_checkpoints import LLAMA3_ROPE, make_tokenizer, model_config, save
SHAPES = {
    # name: (hidden, intermediate, layers, heads, kv heads, vocab, tied, rope theta, rope scaling)
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
TOKENS = 24


def rel(a, b):
    return float((a - b).norm() / b.norm())


def make_checkpoint(name, shape, out):
    torch.manual_seed(len(name))
    model = AutoModelForCausalLM.from_config(model_config(name, shape, 256)).to(torch.bfloat16)
    with torch.no_grad():
        for w in model.parameters():  # 0.08 at d = 256 (larger than the init's 0.02, so the layers matter)
            w.normal_(0.0, 1.28 / shape[0] ** 0.5)
    save(model, out)
    make_tokenizer(shape[5], out / "tokenizer.json")
    return shape[5]


def megakernel(binary, *args):
    run = subprocess.run([binary, *args], capture_output=True, text=True)
    return run.returncode, run.stdout, run.stderr


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("binary", nargs="?", default="target/release/megakernel")
    p.add_argument("--out", default=None, help="where to write the checkpoints (default: a temporary folder)")
    p.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated names of SHAPES")
    args = p.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    root = Path(args.out or tempfile.mkdtemp(prefix="hf-agreement-"))
    names = args.shapes.split(",")
    print(f"{'shape':<20} {'cpu vs eager':>13} {'gpu vs eager':>13} {'sdpa vs eager':>14} {'argmax cpu/gpu/sdpa = eager':>28}")
    worst_ratio, failures, reports = 0.0, 0, []
    for name in names:
        out = root / name
        vocab = make_checkpoint(name, SHAPES[name], out)
        tokens = torch.randint(3, vocab, (1, TOKENS))
        logits = {}
        for impl in ("eager", "sdpa"):
            m = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16, attn_implementation=impl).to(device)
            with torch.no_grad():
                logits[impl] = m(tokens.to(device)).logits[0].float().cpu()
            del m
        ours = {}
        for on in ("cpu", "gpu"):
            rc, stdout, stderr = megakernel(args.binary, "logits", "--model", str(out), "--on", on,
                                            "--tokens", ",".join(map(str, tokens[0].tolist())))
            if rc != 0:
                print(f"{name}: megakernel logits --on {on} failed: {stderr.strip()}")
                sys.exit(1)
            ours[on] = torch.tensor(json.loads(stdout)["logits"])
        e, s = logits["eager"], logits["sdpa"]
        agree = [f"{float((x.argmax(-1) == e.argmax(-1)).float().mean()):.3f}" for x in (ours["cpu"], ours["gpu"], s)]
        for x in ours.values():
            worst_ratio = max(worst_ratio, rel(x, e) / max(rel(s, e), 1e-12))
        print(f"{name:<20} {rel(ours['cpu'], e):>13.3e} {rel(ours['gpu'], e):>13.3e} {rel(s, e):>14.3e} {'/'.join(agree):>28}")
        rc, stdout, stderr = megakernel(args.binary, "check", "--model", str(out), "--positions", "48")
        failures += rc != 0
        reports.append(f"== megakernel check --model {name} --positions 48 (rc {rc})\n{stdout}{stderr}")
        rc, stdout, stderr = megakernel(args.binary, "generate", "--model", str(out), "--max-new", "40",
                                        "The megakernel")
        failures += rc != 0
        reports.append(f"== megakernel generate --model {name} --max-new 40 'The megakernel' (rc {rc})\n{stdout}{stderr}")
    print(f"ours vs eager over sdpa vs eager, worst shape and side: {worst_ratio:.2f}x")
    print("\n".join(reports))
    print(f"{failures} command(s) failed")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
