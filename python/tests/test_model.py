"""The binding on a checkpoint written here: its refusals, and its logits and tokens against the
``megakernel`` command's, bit for bit. On the CPU everywhere; on the GPU where there is one (without one,
the binding must refuse in the command's words). ``run.py`` sets the package and the command up."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import tempfile
import unittest
from pathlib import Path

import checkpoint
from persistent_layer import MegakernelError, MegaModel

MEGAKERNEL = os.environ.get("PL_MEGAKERNEL", "megakernel")
TOKENS = [5, 17, 96, 40, 2]


def f32_bits(values) -> list:
    """Each value's f32 bit pattern (so that equal means bitwise equal, NaN included)."""
    return [struct.unpack("<I", struct.pack("<f", float(v)))[0] for v in values]


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([MEGAKERNEL, *args], capture_output=True, text=True, timeout=600)


class Checkpoint(unittest.TestCase):
    @classmethod
    def setUpClass(cls) -> None:
        cls.tmp = tempfile.TemporaryDirectory()
        cls.dir = Path(cls.tmp.name) / "llama"
        # A fresh draw each run: the seed is printed should a comparison fail.
        cls.seed = int.from_bytes(os.urandom(4), "little")
        checkpoint.write(cls.dir, checkpoint.LLAMA, cls.seed)

    @classmethod
    def tearDownClass(cls) -> None:
        cls.tmp.cleanup()

    def cli_logits(self, on: str) -> subprocess.CompletedProcess:
        return cli("logits", "--model", str(self.dir), "--tokens", ",".join(map(str, TOKENS)), "--on", on)

    def assert_logits_are_the_commands(self, on: str, out: str) -> None:
        want = json.loads(out)["logits"]
        model = MegaModel.from_pretrained(self.dir, max_seq=len(TOKENS), on=on)
        for pos, token in enumerate(TOKENS):
            got = model.decode_step(token, pos)
            self.assertEqual(len(got), model.vocab)
            self.assertEqual(f32_bits(got), f32_bits(want[pos]), f"{on}, position {pos}, seed {self.seed}")

    def test_cpu_logits_are_the_commands_bit_for_bit(self) -> None:
        run = self.cli_logits("cpu")
        self.assertEqual(run.returncode, 0, run.stderr)
        self.assert_logits_are_the_commands("cpu", run.stdout)

    def test_gpu_logits_are_the_commands_or_refused_in_its_words(self) -> None:
        run = self.cli_logits("gpu")
        if run.returncode == 0:
            self.assert_logits_are_the_commands("gpu", run.stdout)
            return
        sentence = run.stderr.strip().splitlines()[-1].removeprefix("megakernel: error: ")
        with self.assertRaises(MegakernelError) as caught:
            MegaModel.from_pretrained(self.dir, max_seq=len(TOKENS), on="gpu")
        self.assertEqual(str(caught.exception), sentence)

    def test_gpu_generations_together_are_each_their_own(self) -> None:
        try:
            model = MegaModel.from_pretrained(self.dir, max_seq=16, max_batch=3, on="gpu")
        except MegakernelError as e:
            self.skipTest(f"no GPU here: {e}")
        prompts = [TOKENS, [40], [7, 8, 9, 10, 11, 12]]
        alone = [model.generate(p, max_new=5, eos=[]) for p in prompts]
        self.assertEqual(model.generate_batch(prompts, max_new=5, eos=[]), alone, f"seed {self.seed}")

    def test_a_generation_is_the_greedy_chain_of_decode_steps(self) -> None:
        steps = MegaModel.from_pretrained(self.dir, max_seq=16, on="cpu")
        logits = [steps.decode_step(t, pos) for pos, t in enumerate(TOKENS)][-1]
        greedy = []
        for pos in range(len(TOKENS), len(TOKENS) + 4):
            values = [float(v) for v in logits]  # a torch tensor's, a numpy array's or an array's
            greedy.append(values.index(max(values)))  # the lowest index among equal ones, as the kernel's
            logits = steps.decode_step(greedy[-1], pos)
        model = MegaModel.from_pretrained(self.dir, max_seq=16, on="cpu")
        self.assertEqual(model.generate(TOKENS, max_new=4, eos=[]), greedy, f"seed {self.seed}")
        self.assertEqual((model.last_stop, model.last_kernel_ms), ("max_new", None))
        self.assertEqual(model.generate(TOKENS, max_new=4, eos=[greedy[1]])[-1], greedy[1])
        self.assertEqual(model.last_stop, "eos")
        # Five prompt tokens and eleven new ones fill the 16 positions' caches: the twelfth has no room.
        self.assertEqual(len(model.generate(TOKENS, max_new=100, eos=[])), 16 - len(TOKENS) + 1)
        self.assertEqual(model.last_stop, "context")
        last = model.prefill(TOKENS)
        self.assertEqual(f32_bits(last), f32_bits(list(self.prefix_logits())))

    def test_prompts_generated_together_are_each_their_own_generation(self) -> None:
        prompts = [TOKENS, [40], [7, 8, 9, 10, 11, 12]]
        model = MegaModel.from_pretrained(self.dir, max_seq=16, max_batch=3, on="cpu")
        alone = [model.generate(p, max_new=5, eos=[]) for p in prompts]
        self.assertEqual(model.generate_batch(prompts, max_new=5, eos=[]), alone, f"seed {self.seed}")
        self.assertEqual(model.last_stops, ["max_new"] * 3)
        with self.assertRaises(MegakernelError) as caught:
            model.generate_batch(prompts + [[1]], max_new=5)
        self.assertEqual(str(caught.exception), "4 prompts: 1 to 3 (the sequences the model was loaded for)")
        with self.assertRaises(MegakernelError) as caught:
            model.generate_batch([[1], [1] * 17], max_new=5)
        self.assertEqual(str(caught.exception), "prompt 1: a prompt of 17 tokens is longer than the caches' 16 positions")

    def prefix_logits(self):
        model = MegaModel.from_pretrained(self.dir, max_seq=16, on="cpu")
        return [model.decode_step(t, pos) for pos, t in enumerate(TOKENS)][-1]

    def test_requests_outside_the_model_are_refused_in_the_commands_words(self) -> None:
        model = MegaModel.from_pretrained(self.dir, max_seq=8, on="cpu")
        self.assertEqual((model.vocab, model.context, model.eos, model.bos, model.on), (97, 8, [2, 3], 1, "cpu"))
        cases = [
            (lambda: model.decode_step(97, 0), "token 97 is outside the vocabulary of 97"),
            (lambda: model.decode_step(1, 8), "position 8 is past the caches' 8"),
            (lambda: model.generate([], 4), "a generation needs a prompt and at least one new token"),
            (lambda: model.generate([1] * 9, 1), "a prompt of 9 tokens is longer than the caches' 8 positions"),
            (lambda: model.generate([1], 1, eos=[2] * 5), "5 end-of-sequence tokens; the kernel stops at 4"),
        ]
        for call, sentence in cases:
            with self.assertRaises(MegakernelError) as caught:
                call()
            self.assertEqual(str(caught.exception), sentence)
        with self.assertRaises(MegakernelError) as caught:
            model.encode("no tokenizer here")
        self.assertIn("tokenizer.json: not found", str(caught.exception))


class Text(unittest.TestCase):
    def test_the_command_line_generates_text_as_the_api_does(self) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            folder = Path(tmp) / "llama"
            checkpoint.write(folder, checkpoint.LLAMA, int.from_bytes(os.urandom(4), "little"))
            checkpoint.write_tokenizer(folder, checkpoint.LLAMA["vocab_size"])
            model = MegaModel.from_pretrained(folder, max_seq=32, on="cpu")
            prompt = model.encode("t5 t17 t96")
            self.assertEqual(prompt, [1, 5, 17, 96])
            self.assertEqual(model.decode(prompt), "t5 t17 t96", "the start token is left out")
            new = model.generate(prompt, max_new=6)
            run = subprocess.run(
                [sys.executable, "-m", "persistent_layer", "--model", str(folder), "--on", "cpu", "--max-new", "6", "t5 t17 t96"],
                capture_output=True, text=True, timeout=600,
            )
            self.assertEqual(run.returncode, 0, run.stderr)
            self.assertEqual(run.stdout, "t5 t17 t96" + model.decode(new) + "\n")
            self.assertIn(f"{len(new)} new tokens after a prompt of 4 ({model.last_stop})", run.stderr)


class Loader(unittest.TestCase):
    def test_what_the_loader_does_not_take_is_refused_naming_it(self) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            gelu = Path(tmp) / "gelu"
            checkpoint.write(gelu, {**checkpoint.LLAMA, "hidden_act": "gelu"}, 1)
            with self.assertRaises(MegakernelError) as caught:
                MegaModel.from_pretrained(gelu, on="cpu")
            self.assertIn("field 'hidden_act'", str(caught.exception))
            with self.assertRaises(MegakernelError) as caught:
                MegaModel.from_pretrained(Path(tmp) / "nothing", on="cpu")
            self.assertIn("config.json", str(caught.exception))

    def test_bad_arguments_are_refused_before_any_work(self) -> None:
        with self.assertRaises(ValueError):
            MegaModel.from_pretrained("/nonexistent", on="tpu")
        with self.assertRaises(ValueError):
            MegaModel.from_pretrained("/nonexistent", max_seq=0, on="cpu")
        with self.assertRaises(ValueError):
            MegaModel.from_pretrained("/nonexistent", max_batch=9, on="cpu")
        with self.assertRaises(TypeError) as caught:
            MegaModel.from_pretrained(object())  # a loaded model object, not a folder
        self.assertIn("save_pretrained", str(caught.exception))


if __name__ == "__main__":
    unittest.main()
