"""A checkpoint written by transformers, generated from by the megakernel and by transformers itself.

    python3 python/examples/generate_hf.py [--model DIR] [--prompt TEXT] [--max-new N]

With --model, a folder that transformers' save_pretrained wrote (config.json, safetensors and, for
text, tokenizer.json); without it, a small random Llama that transformers writes first (token ids
then stand in for text). Prints both greedy generations, whether they agree, and the speed of each.
Needs the persistent_layer package (pip install ./python), torch and transformers, and a GPU.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
import transformers

from persistent_layer import MegaModel


def random_llama(folder: Path) -> None:
    """A 4-layer Llama with random bf16 weights, saved as transformers saves any checkpoint."""
    config = transformers.LlamaConfig(
        hidden_size=512, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=4, vocab_size=4096, max_position_embeddings=1024, tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(folder)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, help="a transformers checkpoint folder (default: a random Llama)")
    p.add_argument("--prompt", default="The megakernel runs a whole model in one launch")
    p.add_argument("--max-new", type=int, default=32)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = args.model
        if folder is None:
            folder = Path(tmp) / "llama"
            random_llama(folder)
        model = MegaModel.from_pretrained(folder, max_seq=1024)
        has_text = (folder / "tokenizer.json").is_file()
        prompt = model.encode(args.prompt) if has_text else [1, 100, 200, 300]
        start = time.perf_counter()
        ours = model.generate(prompt, max_new=args.max_new, eos=[])
        ours_s = time.perf_counter() - start

        hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).cuda().eval()
        ids = torch.tensor([prompt], device="cuda")
        with torch.no_grad():
            hf.generate(ids, max_new_tokens=2, do_sample=False)  # warm-up
            torch.cuda.synchronize()
            start = time.perf_counter()
            theirs = hf.generate(ids, max_new_tokens=args.max_new, min_new_tokens=args.max_new, do_sample=False)
            torch.cuda.synchronize()
            theirs_s = time.perf_counter() - start
        theirs = theirs[0, len(prompt):].tolist()

    same = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), len(ours))
    show = model.decode if has_text else str
    print(f"megakernel:   {show(ours)}")
    print(f"transformers: {show(theirs)}")
    print(f"the first {same} of {len(ours)} tokens agree")
    n = len(ours)
    print(f"megakernel {n / ours_s:.1f} tokens/s ({model.last_kernel_ms:.2f} ms in its one launch); transformers eager {n / theirs_s:.1f}")


if __name__ == "__main__":
    main()
