#!/usr/bin/env python3
"""The megakernel's model (CPU and GPU) against transformers, on checkpoints transformers writes.

For each shape below: `LlamaForCausalLM(config)` (or `Qwen3ForCausalLM`) with random weights saved in
bf16 by `save_pretrained`, with a byte-level BPE tokenizer trained here on the repository's docs (no
downloads). Then, over teacher-forced random tokens: transformers' logits in bf16 with eager and
with sdpa attention (their spread is what "agreeing with transformers" can mean), and the logits of
`megakernel logits` on the CPU and on the GPU (one launch per position); printed per shape as the
relative error of each against transformers' eager path and how often the greedy tokens agree.
Then `megakernel check` (the GPU against the CPU model) and `megakernel generate` on each checkpoint.
With --nf4 every checkpoint is first loaded by transformers with bitsandbytes nf4 and saved again, and
both sides run that one (transformers computing through bitsandbytes). With --fp8 every checkpoint is
quantised by transformers to fine-grained fp8 and saved again, and both sides run that one
(transformers reading it dequantised to bf16, as it does without a GPU: its fp8 matmul is a kernel
fetched from the Hub).

    python3 scripts/hf-agreement.py [PATH_TO_megakernel] [--out DIR] [--shapes a,b] [--nf4 | --fp8]

Needs torch, transformers and tokenizers (the GPU machine has them), bitsandbytes for --nf4 (the GPU
machine lacks it: install its wheel first) and an H100/H200.
"""
import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from hf_checkpoints import FP8_DEQUANTIZED, SHAPES, agreement_checkpoint, fp8_block, fp8_checkpoint, nf4_checkpoint

TOKENS = 24


def rel(a, b):
    return float((a - b).norm() / b.norm())


def megakernel(binary, *args):
    run = subprocess.run([binary, *args], capture_output=True, text=True)
    return run.returncode, run.stdout, run.stderr


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("binary", nargs="?", default="target/release/megakernel")
    p.add_argument("--out", default=None, help="where to write the checkpoints (default: a temporary folder)")
    p.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated names of SHAPES")
    quant = p.add_mutually_exclusive_group()
    quant.add_argument("--nf4", action="store_true", help="each checkpoint saved again in bitsandbytes nf4, and run so")
    quant.add_argument("--fp8", action="store_true", help="each checkpoint saved again in fine-grained fp8, and run so")
    args = p.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    root = Path(args.out or tempfile.mkdtemp(prefix="hf-agreement-"))
    names = args.shapes.split(",")
    print(f"{'shape':<20} {'cpu vs eager':>13} {'gpu vs eager':>13} {'sdpa vs eager':>14} {'argmax cpu/gpu/sdpa = eager':>28}")
    worst_ratio, failures, reports = 0.0, 0, []
    for name in names:
        out = root / name
        vocab = agreement_checkpoint(name, out)
        place = {}
        if args.nf4:
            out, dense = root / f"{name}-nf4", out
            nf4_checkpoint(dense, out, device)
            # A 4-bit model cannot be moved once loaded: it is loaded onto the device.
            place = {"device_map": {"": device}}
        elif args.fp8:
            out, dense = root / f"{name}-fp8", out
            fp8_checkpoint(dense, out, fp8_block(SHAPES[name]))
            place = {"quantization_config": FP8_DEQUANTIZED}
        tokens = torch.randint(3, vocab, (1, TOKENS))
        logits = {}
        for impl in ("eager", "sdpa"):
            m = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16, attn_implementation=impl, **place)
            m = m if args.nf4 else m.to(device)
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
