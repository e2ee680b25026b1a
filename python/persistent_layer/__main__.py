"""``python -m persistent_layer``: generates text from a prompt, greedily, in one launch, and prints it
with the speed (the ``persistent-layer-generate`` command after ``pip install ./python``)."""

from __future__ import annotations

import argparse
import sys
import time
from typing import List, Optional

from . import MegakernelError, MegaModel


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m persistent_layer",
        description="Generate text greedily from a prompt with the megakernel: the prompt and every new "
        "token in one launch of the model kernel. Prints the text, then the tokens and the speed.",
    )
    p.add_argument("prompt", help="the prompt, as text (the checkpoint's tokenizer.json adds its special tokens)")
    p.add_argument("--model", required=True, help="the checkpoint's folder: config.json, *.safetensors, tokenizer.json")
    p.add_argument("--max-new", type=int, default=64, help="new tokens at most (default: 64)")
    p.add_argument("--max-seq", type=int, default=4096, help="the KV caches' positions (default: 4096)")
    p.add_argument("--device", type=int, default=0, help="the CUDA device (default: 0)")
    p.add_argument("--on", choices=["gpu", "cpu"], default="gpu", help="where to decode (default: gpu)")
    args = p.parse_args(argv)
    if args.max_new < 1:
        p.error(f"--max-new {args.max_new}: one new token at least")
    try:
        model = MegaModel.from_pretrained(args.model, max_seq=args.max_seq, device=args.device, on=args.on)
        prompt = model.encode(args.prompt)
        start = time.perf_counter()
        tokens = model.generate(prompt, max_new=args.max_new)
        seconds = time.perf_counter() - start
        print(args.prompt + model.decode(tokens))
    except (MegakernelError, ValueError) as e:
        print(f"persistent_layer: error: {e}", file=sys.stderr)
        return 2
    n = len(tokens)
    line = f"{n} new tokens after a prompt of {len(prompt)} ({model.last_stop}): {n / seconds:.1f} tokens/s from Python"
    if model.last_kernel_ms is not None:
        line += f", {n / model.last_kernel_ms * 1e3:.1f} in the kernel ({model.last_kernel_ms:.2f} ms, one launch)"
    print(line, file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
