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
from typing import Callable

import checkpoint
import dlpack_producer as dl
from persistent_layer import MegakernelError, MegaModel

MEGAKERNEL = os.environ.get("PL_MEGAKERNEL", "megakernel")
TOKENS = [5, 17, 96, 40, 2]
# transformers-written checkpoints of the loader's tests (megakernel/tests/fixtures).
FIXTURES = Path(__file__).resolve().parents[2] / "megakernel/tests/fixtures"


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

    def gpu_model(self, **options) -> MegaModel:
        try:
            return MegaModel.from_pretrained(self.dir, on="gpu", **options)
        except MegakernelError as e:
            self.skipTest(f"no GPU here: {e}")

    def test_gpu_logits_stay_on_the_gpu_where_torch_takes_them(self) -> None:
        model = self.gpu_model(max_seq=8)
        logits = model.decode_step(TOKENS[0], 0)
        try:
            import torch
        except ImportError:
            self.assertNotIn("torch", type(logits).__module__)
            return
        self.assertEqual(logits.device.type, "cuda" if torch.cuda.is_available() else "cpu")
        self.assertEqual((logits.dtype, tuple(logits.shape)), (torch.float32, (model.vocab,)))
        # Each step's logits are a tensor of their own: the next step does not overwrite them.
        kept = logits.clone()
        model.decode_step(TOKENS[1], 1)
        self.assertTrue(torch.equal(logits, kept))

    def test_a_timed_step_is_the_steps_bits_and_names_its_phases(self) -> None:
        plain, timed = self.gpu_model(max_seq=8), self.gpu_model(max_seq=8)
        for pos, token in enumerate(TOKENS[:-1]):
            plain.decode_step(token, pos)
            timed.decode_step(token, pos)
        want = plain.decode_step(TOKENS[-1], len(TOKENS) - 1)
        got, phases = timed.decode_step_timed(TOKENS[-1], len(TOKENS) - 1)
        self.assertEqual(f32_bits(got), f32_bits(want), f"seed {self.seed}")
        self.assertEqual(list(phases)[-1], "Head")
        self.assertLessEqual({"Qkv", "Attention", "Down"}, set(phases))
        self.assertTrue(all(ms > 0 for ms in phases.values()), phases)
        # The phases' critical path lies inside the traced launch.
        self.assertLess(sum(phases.values()), timed.last_kernel_ms)

    def assert_reset_forgets_every_sequence(self, model: Callable[[], MegaModel]) -> None:
        want = model().decode_step(TOKENS[1], 1)  # attends over position 0's zeroed cache
        used = model()
        for pos, token in enumerate(TOKENS):
            used.decode_step(token, pos)
        self.assertNotEqual(f32_bits(used.decode_step(TOKENS[1], 1)), f32_bits(want), "the cache is in use")
        used.reset()
        self.assertEqual(f32_bits(used.decode_step(TOKENS[1], 1)), f32_bits(want), f"seed {self.seed}")

    def test_reset_forgets_every_sequence_on_the_cpu(self) -> None:
        self.assert_reset_forgets_every_sequence(lambda: MegaModel.from_pretrained(self.dir, max_seq=8, on="cpu"))

    def test_reset_forgets_every_sequence_on_the_gpu(self) -> None:
        self.assert_reset_forgets_every_sequence(lambda: self.gpu_model(max_seq=8))

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

    def test_a_loaded_models_tensors_give_the_folders_bits(self) -> None:
        want = self.prefix_logits()
        tensors = dl.read_safetensors(self.dir / "model.safetensors")
        # What a transformers state_dict also holds and the loader does not read.
        extra = dl.HostTensor(b"\0" * 8, dl.KDL_FLOAT, 32, [2])
        model = MegaModel.from_pretrained(dl.LoadedModel(self.dir, {**tensors, "model.rotary_emb.inv_freq": extra}),
                                          max_seq=16, on="cpu")
        got = [model.decode_step(t, pos) for pos, t in enumerate(TOKENS)][-1]
        self.assertEqual(f32_bits(got), f32_bits(want), f"seed {self.seed}")
        self.assertEqual({(t.exported, t.deleted) for t in tensors.values()}, {(1, 1)}, "each taken once, deleted once")
        self.assertEqual((extra.exported, extra.deleted), (0, 0))
        # f32 tensors of the same values are read into the same bf16.
        wide = MegaModel.from_pretrained(dl.LoadedModel(self.dir, {n: dl.widened(t) for n, t in tensors.items()}),
                                         max_seq=16, on="cpu")
        got = [wide.decode_step(t, pos) for pos, t in enumerate(TOKENS)][-1]
        self.assertEqual(f32_bits(got), f32_bits(want), f"seed {self.seed}")

    def test_a_loaded_models_tensors_on_the_gpu_give_the_folders_bits(self) -> None:
        try:
            import torch
        except ImportError:
            self.skipTest("no torch here")
        if not torch.cuda.is_available():
            self.skipTest("torch sees no GPU here")
        folder = self.gpu_model(max_seq=16)
        want = [folder.decode_step(t, pos) for pos, t in enumerate(TOKENS)][-1]
        on_gpu = {
            name: torch.frombuffer(bytearray(t._buffer.raw), dtype=torch.bfloat16).reshape(t.shape).cuda()
            for name, t in dl.read_safetensors(self.dir / "model.safetensors").items()
        }
        model = MegaModel.from_pretrained(dl.LoadedModel(self.dir, on_gpu), max_seq=16)
        got = [model.decode_step(t, pos) for pos, t in enumerate(TOKENS)][-1]
        self.assertEqual(f32_bits(got), f32_bits(want), f"seed {self.seed}")

    def test_a_loaded_models_tensors_are_refused_naming_them(self) -> None:
        tensors = dl.read_safetensors(self.dir / "model.safetensors")
        norm = "model.norm.weight"
        d = checkpoint.LLAMA["hidden_size"]
        half = dl.HostTensor(b"\0" * d, dl.KDL_BFLOAT, 16, [d // 2])
        strided = dl.HostTensor(b"\0" * 4 * d, dl.KDL_BFLOAT, 16, [d], strides=[2])
        ints = dl.HostTensor(b"\0" * d, dl.KDL_INT, 8, [d])
        for replace, why in [
            (None, "missing"),
            ("a string", "a str, not a tensor (no __dlpack__)"),
            (half, f"shape [{d // 2}], expected [{d}]"),
            (strided, f"strides [2] of shape [{d}]: not compact row-major (take .contiguous())"),
            (ints, "DLPack dtype code 0, 8 bits, 1 lanes: the loader reads bf16, f16 and f32"),
        ]:
            given = {n: t for n, t in tensors.items() if n != norm}
            if replace is not None:
                given[norm] = replace
            with self.assertRaises(MegakernelError) as caught:
                MegaModel.from_pretrained(dl.LoadedModel(self.dir, given), on="cpu")
            self.assertEqual(str(caught.exception), f"state_dict: tensor '{norm}': {why}")
            if isinstance(replace, dl.HostTensor):
                self.assertEqual((replace.exported, replace.deleted), (1, 1), "a refused tensor is deleted too")

    def test_a_loaded_model_reads_its_tokenizer_from_the_object_given(self) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            checkpoint.write_tokenizer(Path(tmp), checkpoint.LLAMA["vocab_size"])

            class Tokenizer:  # a tokenizers.Tokenizer's one method the loader calls
                def to_str(self) -> str:
                    return (Path(tmp) / "tokenizer.json").read_text()

            model = MegaModel.from_pretrained(dl.LoadedModel(self.dir), max_seq=8, on="cpu", tokenizer=Tokenizer())
            self.assertEqual(model.encode("t5 t17"), [1, 5, 17])
        bare = MegaModel.from_pretrained(dl.LoadedModel(self.dir), max_seq=8, on="cpu")
        with self.assertRaises(MegakernelError) as caught:
            bare.encode("t5")
        self.assertIn("pass a loaded one to from_pretrained (tokenizer=)", str(caught.exception))
        with self.assertRaises(TypeError):
            MegaModel.from_pretrained(self.dir, on="cpu", tokenizer=object())

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
        cases.append((lambda: model.decode_step_timed(1, 0),
                      "decode_step_timed times the model kernel's phases: this model runs on the CPU"))
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

    def test_quantised_checkpoints_give_the_commands_logits(self) -> None:
        # transformers' saves of models quantised to nf4 and to fp8 (megakernel/tests/fixtures, written by
        # scripts/nf4_fixture.py and scripts/fp8_fixture.py).
        for variant in ("nf4-double", "fp8-ue8m0"):
            fixture = FIXTURES / variant / "checkpoint"
            tokens = [1, 5, 9, 3, 7, 30, 12]
            run = cli("logits", "--model", str(fixture), "--tokens", ",".join(map(str, tokens)), "--on", "cpu")
            self.assertEqual(run.returncode, 0, run.stderr)
            want = json.loads(run.stdout)["logits"]
            model = MegaModel.from_pretrained(fixture, max_seq=len(tokens), on="cpu")
            for pos, token in enumerate(tokens):
                self.assertEqual(f32_bits(model.decode_step(token, pos)), f32_bits(want[pos]), f"{variant}: position {pos}")

    def test_a_loaded_quantised_model_is_sent_to_its_folder(self) -> None:
        for variant, words in (("nf4", "a model loaded in bitsandbytes nf4"), ("fp8", "a model loaded in fine-grained fp8")):
            with self.assertRaises(MegakernelError) as caught:
                MegaModel.from_pretrained(dl.LoadedModel(FIXTURES / variant / "checkpoint", {}), on="cpu")
            self.assertIn("field 'quantization_config'", str(caught.exception))
            self.assertIn(words, str(caught.exception))
            self.assertIn("model.save_pretrained(DIR), then from_pretrained(DIR)", str(caught.exception))

    def test_bad_arguments_are_refused_before_any_work(self) -> None:
        with self.assertRaises(ValueError):
            MegaModel.from_pretrained("/nonexistent", on="tpu")
        with self.assertRaises(ValueError):
            MegaModel.from_pretrained("/nonexistent", max_seq=0, on="cpu")
        with self.assertRaises(ValueError):
            MegaModel.from_pretrained("/nonexistent", max_batch=9, on="cpu")
        with self.assertRaises(TypeError) as caught:
            MegaModel.from_pretrained(object())  # neither a folder nor a loaded model
        self.assertIn("a checkpoint folder's path or a loaded transformers model, not a object", str(caught.exception))


if __name__ == "__main__":
    unittest.main()
