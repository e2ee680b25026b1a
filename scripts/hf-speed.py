#!/usr/bin/env python3
"""Decode speed, ms per token: the megakernel (`megakernel bench`, a whole generation in one launch)
against transformers' `generate` with a static cache, eager and under `torch.compile`, on random-weight
checkpoints of real models' shapes written by `save_pretrained` (no downloads).

transformers' figure is (T(1 + N tokens) - T(1 token)) / N over greedy generations forced to their
length, the median of three after warm-up: the decode steps alone, its prefill and set-up left out;
"compiled" is `generate`'s own torch.compile of the forward, which a static cache turns on.

    python3 scripts/hf-speed.py [PATH_TO_megakernel] [--sizes llama-3.2-1b,llama-3.1-8b] [--tokens 128] [--out DIR]

Needs torch and transformers and an H100/H200.
"""
import argparse
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from hf_checkpoints import LLAMA3_ROPE, model_config, save

SIZES = {
    # name: (hidden, intermediate, layers, heads, kv heads, vocab, tied, rope theta, rope scaling)
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


def make_checkpoint(name, shape, out):
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(model_config(name, shape, 8192)).to(torch.bfloat16)
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


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("binary", nargs="?", default="target/release/megakernel")
    p.add_argument("--sizes", default="llama-3.2-1b", help="comma-separated, of: " + ", ".join(SIZES))
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--out", default=None)
    p.add_argument("--no-compile", action="store_true", help="skip the compiled figure (compiling takes minutes)")
    p.add_argument("--megakernel-only", action="store_true", help="write the checkpoints and bench only the megakernel")
    args = p.parse_args()
    unknown = [n for n in args.sizes.split(",") if n not in SIZES]
    if unknown:
        p.error(f"unknown size {', '.join(unknown)}; the sizes are {', '.join(SIZES)}")
    root = Path(args.out or tempfile.mkdtemp(prefix="hf-speed-"))
    rows = []
    for name in args.sizes.split(","):
        out = root / name
        model = make_checkpoint(name, SIZES[name], out)
        run = subprocess.run([args.binary, "bench", "--model", str(out), "--tokens", str(args.tokens)],
                             capture_output=True, text=True)
        print(f"== megakernel bench --model {name} --tokens {args.tokens} (rc {run.returncode})\n{run.stdout}{run.stderr}",
              flush=True)
        if not args.megakernel_only:
            eager = time_generate(model, args.tokens, compiled=False)
            compiled = None
            if not args.no_compile:
                try:
                    compiled = time_generate(model, args.tokens, compiled=True)
                except Exception as e:  # report and go on: the other figures still stand
                    print(f"{name}: compiled generate failed: {type(e).__name__}: {e}")
            rows.append((name, eager, compiled))
            print(f"{name}: transformers static cache {eager:.3f} ms/token, compiled "
                  f"{'-' if compiled is None else f'{compiled:.3f}'} ms/token", flush=True)
        del model
        torch.cuda.empty_cache()
    print(f"{'model':<16} {'transformers static':>20} {'+ torch.compile':>16}")
    for name, eager, compiled in rows:
        print(f"{name:<16} {eager:>20.3f} {'-' if compiled is None else f'{compiled:.3f}':>16}")


if __name__ == "__main__":
    main()
