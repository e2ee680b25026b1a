#!/usr/bin/env python3
"""The model through its Python API (the persistent_layer package) against the `megakernel` command and
against transformers, on checkpoints transformers writes (scripts/hf_checkpoints.py; no downloads).

For each family shape (SHAPES): the checkpoint loaded twice through the API, from its folder and from
the transformers model loaded on the GPU (its tensors through DLPack); over 24 teacher-forced random
tokens each one's `decode_step` logits against `megakernel logits --on gpu` bit for bit, and against
transformers' eager logits (relative error, greedy agreement); `generate` against `megakernel
generate` (the same text) and against transformers' greedy generation (tokens agreeing);
`generate_batch` against each prompt's `generate`; one `decode_step_timed`'s phases. With --nf4 each
checkpoint is first loaded by transformers with bitsandbytes nf4 and saved again: transformers' logits
and generation are its bitsandbytes path's, and the API loads the folder only (a model loaded in 4 bits
is refused by design: its tensors would come through DLPack as bf16).

Then for each size (SIZES, --sizes): ms per token of the megakernel from the command (`megakernel bench`)
and from Python (`generate`'s kernel time, the same one launch; a `decode_step` per token with the
greedy token taken on the GPU), beside transformers' static-cache generate, eager and compiled.

    python3 scripts/hf-python.py [PATH_TO_megakernel] [--shapes a,b] [--sizes llama-3.2-1b] [--tokens 128] [--no-compile] [--out DIR]
    python3 scripts/hf-python.py [PATH_TO_megakernel] --nf4 [--shapes a,b] [--out DIR]

Needs the persistent_layer package (pip install ./python, or PYTHONPATH to a folder holding it),
torch, transformers and tokenizers, and an H100/H200, and bitsandbytes for --nf4. Exits 1 when any
check fails.
"""
import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM

from hf_checkpoints import SHAPES, SIZES, agreement_checkpoint, nf4_checkpoint, speed_checkpoint, time_generate
from persistent_layer import MegaModel

TOKENS = 24
PROMPT = "The megakernel"
MAX_NEW = 40


def command(binary, *args):
    run = subprocess.run([binary, *args], capture_output=True, text=True)
    if run.returncode != 0:
        raise RuntimeError(f"megakernel {' '.join(args)} failed: {run.stderr.strip()}")
    return run.stdout


def bits(t):
    return t.float().contiguous().view(torch.int32)


def rel(a, b):
    return float((a - b).norm() / b.norm())


def agreement(binary, name, out, nf4):
    """The checks of one family shape (saved again in nf4 with `nf4`); returns (printed row, failures)."""
    vocab = agreement_checkpoint(name, out)
    place = {}
    if nf4:
        out, dense = out.parent / f"{name}-nf4", out
        nf4_checkpoint(dense, out, "cuda")
        torch.cuda.empty_cache()
        # A 4-bit model cannot be moved once loaded: it is loaded onto the GPU.
        place = {"device_map": {"": "cuda"}}
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16, attn_implementation="eager", **place)
    hf = (hf if nf4 else hf.cuda()).eval()
    tokens = torch.randint(3, vocab, (TOKENS,)).tolist()
    with torch.no_grad():
        eager = hf(torch.tensor([tokens], device="cuda")).logits[0].float()
    cli = torch.tensor(json.loads(command(binary, "logits", "--model", str(out), "--on", "gpu",
                                          "--tokens", ",".join(map(str, tokens))))["logits"], device="cuda")
    failures = []
    # Caches as deep as the command's `logits` makes them (the plan may depend on their depth).
    models = {"folder": MegaModel.from_pretrained(out, max_seq=TOKENS)}
    if not nf4:
        models["loaded"] = MegaModel.from_pretrained(hf, max_seq=TOKENS)
    errors = {}
    for how, model in models.items():
        logits = torch.stack([model.decode_step(t, pos) for pos, t in enumerate(tokens)])
        if logits.device.type != "cuda":
            failures.append(f"{how}: logits on {logits.device}, not the GPU")
        if not torch.equal(bits(logits.cuda()), bits(cli)):
            failures.append(f"{how}: decode_step's logits differ from `megakernel logits --on gpu`'s")
        agree = float((logits.argmax(-1) == eager.argmax(-1)).float().mean())
        errors[how] = (rel(logits, eager), agree)
    del models
    # The command's `generate` caches: --context's default, at most the model's own.
    model = MegaModel.from_pretrained(out if nf4 else hf, tokenizer=_tokenizer(out))
    ids = model.encode(PROMPT)
    ours = model.generate(ids, max_new=MAX_NEW)
    said = command(binary, "generate", "--model", str(out), "--max-new", str(MAX_NEW), PROMPT)
    if said != PROMPT + model.decode(ours) + "\n":
        failures.append(f"generate's text differs from the command's: {said!r} against {PROMPT + model.decode(ours)!r}")
    with torch.no_grad():
        theirs = hf.generate(torch.tensor([ids], device="cuda"), max_new_tokens=len(ours), min_new_tokens=len(ours),
                             do_sample=False, pad_token_id=0)[0, len(ids):].tolist()
    same = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), len(ours))
    prompts = [ids, tokens[:5], tokens[:1]]
    if model.generate_batch(prompts, max_new=8, eos=[]) != [model.generate(p, max_new=8, eos=[]) for p in prompts]:
        failures.append("generate_batch differs from each prompt's generate")
    model.decode_step_timed(tokens[0], 0)  # the traced instance's first launch loads it
    _, phases = model.decode_step_timed(tokens[1], 1)
    timed = " ".join(f"{k} {v * 1e3:.0f}" for k, v in phases.items())
    loaded = f"{errors['loaded'][0]:>10.3e}" if "loaded" in errors else f"{'-':>10}"
    row = (f"{out.name:<20} {errors['folder'][0]:>10.3e} {loaded} {errors['folder'][1]:>7.3f} "
           f"{same:>4}/{len(ours):<4} {'ok' if not failures else 'FAIL':>5}   {timed} us ({model.last_kernel_ms * 1e3:.0f} us traced)")
    del hf, model
    torch.cuda.empty_cache()
    return row, failures


def _tokenizer(folder):
    from tokenizers import Tokenizer
    return Tokenizer.from_file(str(folder / "tokenizer.json"))


def bench_line(stdout, what):
    """ms/token of `megakernel bench`'s row that starts with `what` (ms/token, tokens/s, x floor last)."""
    for line in stdout.splitlines():
        if line.startswith(what):
            return float(line.split()[-3])
    raise RuntimeError(f"megakernel bench printed no row '{what}':\n{stdout}")


def speed(binary, name, out, tokens, compile_too, rounds=3, reps=3):
    """ms per token: the command's and Python's, one launch and a launch per token, measured in turns
    (`rounds` of the command's bench and Python's, each the median of `reps`, so that the card's drift
    falls on both); transformers'."""
    hf = speed_checkpoint(name, out).eval()
    model = MegaModel.from_pretrained(hf)  # the command's caches: --context's default
    start = [1]
    model.generate(start, max_new=tokens, eos=[])  # warm-up
    cli_one, cli_each, one, wall, each = [], [], [], [], []
    med = statistics.median
    for _ in range(rounds):
        stdout = command(binary, "bench", "--model", str(out), "--tokens", str(tokens), "--batch", "1", "--reps", str(reps))
        cli_one.append(bench_line(stdout, "one launch for"))
        cli_each.append(bench_line(stdout, "a launch per token"))
        launch, host, steps = [], [], []
        for _ in range(reps):
            t = time.perf_counter()
            got = model.generate(start, max_new=tokens, eos=[])
            host.append((time.perf_counter() - t) * 1e3 / tokens)
            launch.append(model.last_kernel_ms / (len(start) + len(got) - 1))
        for _ in range(reps):
            torch.cuda.synchronize()
            t = time.perf_counter()
            token = start[0]
            for pos in range(tokens):
                token = int(model.decode_step(token, pos).argmax())
            steps.append((time.perf_counter() - t) * 1e3 / tokens)
        one.append(med(launch))
        wall.append(med(host))
        each.append(med(steps))
    del model
    eager = time_generate(hf, tokens, compiled=False)
    compiled = None
    if compile_too:
        try:
            compiled = time_generate(hf, tokens, compiled=True)
        except Exception as e:  # report and go on: the other figures still stand
            print(f"{name}: compiled generate failed: {type(e).__name__}: {e}")
    del hf
    torch.cuda.empty_cache()
    print(f"{name}: one launch, command / Python by round: "
          + ", ".join(f"{c:.3f} / {p:.3f}" for c, p in zip(cli_one, one)), flush=True)
    return [name, med(cli_one), med(one), med(wall), med(cli_each), med(each), eager, compiled]


def main():
    transformers.utils.logging.disable_progress_bar()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("binary", nargs="?", default="target/release/megakernel")
    p.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated, of: " + ", ".join(SHAPES) + " (or none)")
    p.add_argument("--sizes", default=None,
                   help="comma-separated, of: " + ", ".join(SIZES) + " (or none; default llama-3.2-1b, none with --nf4)")
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--out", default=None, help="where to write the checkpoints (default: a temporary folder)")
    p.add_argument("--no-compile", action="store_true", help="skip transformers' compiled figure (compiling takes minutes)")
    p.add_argument("--nf4", action="store_true",
                   help="the shapes' checkpoints saved again in bitsandbytes nf4 and run so (needs bitsandbytes)")
    args = p.parse_args()
    if args.sizes is None:
        args.sizes = "none" if args.nf4 else "llama-3.2-1b"
    if args.nf4 and args.sizes != "none":
        p.error("--nf4 checks the shapes only; scripts/hf-speed.py --nf4 times nf4 checkpoints")
    shapes = [n for n in args.shapes.split(",") if n and n != "none"]
    sizes = [n for n in args.sizes.split(",") if n and n != "none"]
    unknown = [n for n in shapes if n not in SHAPES] + [n for n in sizes if n not in SIZES]
    if unknown:
        p.error(f"unknown shape or size {', '.join(unknown)}")
    if not torch.cuda.is_available():
        sys.exit("hf-python.py: torch sees no GPU: the API's GPU checks need one")
    root = Path(args.out or tempfile.mkdtemp(prefix="hf-python-"))
    failures = []
    if shapes:
        print(f"{'shape':<20} {'rel folder':>10} {'rel loaded':>10} {'argmax':>7} {'gen = hf':>9} {'check':>5}   "
              "one decode_step_timed (us a phase kind)")
    for name in shapes:
        row, failed = agreement(args.binary, name, root / name, args.nf4)
        print(row, flush=True)
        failures += [f"{name}: {f}" for f in failed]
    if sizes:
        rows = [speed(args.binary, name, root / name, args.tokens, not args.no_compile) for name in sizes]
        print(f"\nms per token over {args.tokens} tokens (medians of 3 rounds of 3): the megakernel from the command and from Python, "
              "transformers' static-cache generate")
        print(f"{'model':<16} {'cli launch':>10} {'py launch':>10} {'py wall':>8} {'cli/token':>10} {'py/token':>9} "
              f"{'py/cli':>7} {'hf eager':>9} {'compiled':>9}")
        for name, c1, p1, pw, ce, pe, eager, compiled in rows:
            c = "-" if compiled is None else f"{compiled:.3f}"
            print(f"{name:<16} {c1:>10.3f} {p1:>10.3f} {pw:>8.3f} {ce:>10.3f} {pe:>9.3f} {p1 / c1:>7.3f} {eager:>9.3f} {c:>9}")
    for f in failures:
        print(f"FAILED {f}")
    print(f"{len(failures)} check(s) failed")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
