#!/usr/bin/env python3
"""Decode speed, ms per token: the megakernel (`megakernel bench`, a whole generation in one launch)
against transformers' `generate` with a static cache, eager and under `torch.compile`, on random-weight
checkpoints of real models' shapes written by `save_pretrained` (no downloads).

transformers' figure is (T(1 + N tokens) - T(1 token)) / N over greedy generations forced to their
length, the median of three after warm-up: the decode steps alone, its prefill and set-up left out;
"compiled" is `generate`'s own torch.compile of the forward, which a static cache turns on. With --nf4
each checkpoint is loaded by transformers with bitsandbytes nf4 and saved again: transformers decodes
through bitsandbytes, and the megakernel reads the saved folder, its decode steps streaming the nf4
codes where rows are wide, and is benched once more with --bf16-stream (the loader's bf16 weights).
With --fp8 each checkpoint is quantised by transformers to fine-grained
fp8 (blocks of 128 x 128) and saved again: the megakernel's decode steps stream its codes where rows
are wide, and it is benched once more with --bf16-stream (the same checkpoint streamed as bf16);
transformers reads it dequantised to bf16 (its fp8 matmul is a kernel fetched from the Hub, which the
GPU machine cannot reach), so its figure is bf16's.

    python3 scripts/hf-speed.py [PATH_TO_megakernel] [--sizes llama-3.2-1b,llama-3.1-8b] [--tokens 128] [--out DIR] [--nf4 | --fp8]

Needs torch and transformers and an H100/H200, and bitsandbytes for --nf4.
"""
import argparse
import subprocess
import tempfile
from pathlib import Path

import torch

from transformers import AutoModelForCausalLM

from hf_checkpoints import FP8_DEQUANTIZED, SIZES, fp8_checkpoint, nf4_checkpoint, speed_checkpoint, time_generate


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("binary", nargs="?", default="target/release/megakernel")
    p.add_argument("--sizes", default="llama-3.2-1b", help="comma-separated, of: " + ", ".join(SIZES))
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--out", default=None)
    p.add_argument("--no-compile", action="store_true", help="skip the compiled figure (compiling takes minutes)")
    p.add_argument("--megakernel-only", action="store_true", help="write the checkpoints and bench only the megakernel")
    quant = p.add_mutually_exclusive_group()
    quant.add_argument("--nf4", action="store_true",
                       help="each checkpoint in bitsandbytes nf4, on both sides; the megakernel streams its codes, and bf16 (--bf16-stream)")
    quant.add_argument("--fp8", action="store_true",
                       help="each checkpoint in fine-grained fp8; the megakernel streams its codes, and bf16 (--bf16-stream)")
    args = p.parse_args()
    unknown = [n for n in args.sizes.split(",") if n not in SIZES]
    if unknown:
        p.error(f"unknown size {', '.join(unknown)}; the sizes are {', '.join(SIZES)}")
    root = Path(args.out or tempfile.mkdtemp(prefix="hf-speed-"))
    rows = []
    for name in args.sizes.split(","):
        label = f"{name}-nf4" if args.nf4 else f"{name}-fp8" if args.fp8 else name
        out = root / name
        model = speed_checkpoint(name, out)
        if args.nf4 or args.fp8:
            del model
            torch.cuda.empty_cache()
            out, dense = root / label, out
        if args.nf4:
            model = nf4_checkpoint(dense, out, "cuda")
        if args.fp8:
            fp8_checkpoint(dense, out, (128, 128), device="cuda")
            model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16, quantization_config=FP8_DEQUANTIZED,
                                                         device_map={"": "cuda"})
        for extra in [[]] + ([["--bf16-stream"]] if args.fp8 or args.nf4 else []):
            run = subprocess.run([args.binary, "bench", "--model", str(out), "--tokens", str(args.tokens), *extra],
                                 capture_output=True, text=True)
            print(f"== megakernel bench --model {label} --tokens {args.tokens} {' '.join(extra)} (rc {run.returncode})\n"
                  f"{run.stdout}{run.stderr}", flush=True)
        if not args.megakernel_only:
            eager = time_generate(model, args.tokens, compiled=False)
            compiled = None
            if not args.no_compile:
                try:
                    compiled = time_generate(model, args.tokens, compiled=True)
                except Exception as e:  # report and go on: the other figures still stand
                    print(f"{label}: compiled generate failed: {type(e).__name__}: {e}")
            rows.append((label, eager, compiled))
            print(f"{label}: transformers static cache {eager:.3f} ms/token, compiled "
                  f"{'-' if compiled is None else f'{compiled:.3f}'} ms/token", flush=True)
        del model
        torch.cuda.empty_cache()
    print(f"{'model':<20} {'transformers static':>20} {'+ torch.compile':>16}")
    for label, eager, compiled in rows:
        print(f"{label:<20} {eager:>20.3f} {'-' if compiled is None else f'{compiled:.3f}':>16}")


if __name__ == "__main__":
    main()
