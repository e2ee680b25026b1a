"""The megakernel's model from Python: a Llama-family checkpoint decoded by one persistent kernel.

    from persistent_layer import MegaModel
    model = MegaModel.from_pretrained("path/to/checkpoint")
    ids = model.encode("The megakernel")
    print(model.decode(model.generate(ids, max_new=32)))

A model runs on the GPU (``on="gpu"``, the default: one launch of the model kernel per decode step,
one launch per whole generation) or on the CPU (``on="cpu"``: the golden arithmetic the GPU's logits
are checked against; slow, for checks). ``from_pretrained`` takes a checkpoint folder or a loaded
transformers model (its tensors taken through DLPack, no detour through disk). Logits are f32: on the
GPU a ``torch.Tensor`` there (through DLPack, no copy through the host) where torch with CUDA is
installed; otherwise on the host, a ``torch.Tensor`` where torch is installed, else a
``numpy.ndarray``, else an ``array.array("f")``. Whatever the ``megakernel`` command refuses (a
config.json field it does not take, no CUDA device, a token outside the vocabulary, ...) raises
``MegakernelError`` with the same sentence.
"""

from __future__ import annotations

import array
import os
import sys
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ._native import MegakernelError
from ._native import Model as _Model

__all__ = ["MegaModel", "MegakernelError"]


def _torch_has_cuda() -> bool:
    """Whether torch is installed and sees a GPU (the GPU's logits are then handed over on the GPU)."""
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def _logits(raw: Any) -> Any:
    """A DLPack capsule of logits on the GPU as a torch tensor there; f32 little-endian bytes as a torch
    tensor, else a numpy array, else an ``array.array("f")``."""
    if not isinstance(raw, bytes):
        import torch

        return torch.from_dlpack(raw)
    try:
        import torch
    except ImportError:
        pass
    else:
        return torch.frombuffer(bytearray(raw), dtype=torch.float32)
    try:
        import numpy
    except ImportError:
        return array.array("f", raw)
    return numpy.frombuffer(raw, dtype=numpy.float32).copy()


def _tokenizer_json(tokenizer: Any) -> Optional[str]:
    """A loaded tokenizer's tokenizer.json: a ``tokenizers.Tokenizer`` or a transformers fast tokenizer."""
    if tokenizer is None:
        return None
    backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
    if not callable(getattr(backend, "to_str", None)):
        raise TypeError(
            f"tokenizer= takes a tokenizers.Tokenizer or a transformers fast tokenizer, not a {type(tokenizer).__name__}"
        )
    return backend.to_str()


def _is_loaded_model(obj: Any) -> bool:
    """A transformers model (or anything shaped like one): a ``config`` and a ``state_dict()``."""
    return hasattr(obj, "config") and callable(getattr(obj, "state_dict", None))


class MegaModel:
    """A checkpoint loaded for decoding, with KV caches of ``context`` positions.

    Positions are explicit: ``decode_step(token, pos)`` writes the token's K and V at ``pos`` and attends
    over positions ``0..pos``, so a new sequence starts by decoding (or prefilling) from position 0.
    """

    def __init__(self, native: _Model) -> None:
        self._m = native
        # Logits stay on the GPU where the model runs there and torch can take them.
        self._on_device = native.on == "gpu" and _torch_has_cuda()
        #: Why the last ``generate`` stopped: ``"eos"``, ``"max_new"`` or ``"context"``.
        self.last_stop: Optional[str] = None
        #: The last ``generate``'s (or ``decode_step_timed``'s) kernel time in ms, by events around its
        #: one launch; None on the CPU.
        self.last_kernel_ms: Optional[float] = None
        #: Why each of the last ``generate_batch``'s generations stopped.
        self.last_stops: List[str] = []

    @classmethod
    def from_pretrained(
        cls,
        path_or_model: Any,
        *,
        max_seq: int = 4096,
        max_batch: int = 8,
        device: int = 0,
        on: str = "gpu",
        tokenizer: Any = None,
    ) -> "MegaModel":
        """Loads a checkpoint and uploads it to GPU ``device`` with caches of ``max_seq`` positions (at
        most the model's own context) for ``max_batch`` sequences, compiling its layers into the
        megakernel's program; ``on="cpu"`` keeps it on the CPU instead.

        ``path_or_model`` is a checkpoint folder (config.json, model.safetensors or its shards and index,
        tokenizer.json for text) or a loaded transformers model: its ``config`` as ``save_pretrained``
        would write it and its ``state_dict()``'s tensors taken through DLPack (on the host or a GPU,
        bf16, f16 or f32), each read once into the model's bf16 as the folder's loader reads them; no
        file is written. ``tokenizer`` (a transformers fast tokenizer or a ``tokenizers.Tokenizer``)
        gives ``encode`` and ``decode`` their vocabulary, in place of the folder's tokenizer.json.

        Raises ``MegakernelError`` with the loader's sentence for what it does not take, ``ValueError``
        for bad arguments, ``TypeError`` for anything but a folder or a model.
        """
        options = dict(max_seq=max_seq, max_batch=max_batch, device=device, on=on, tokenizer_json=_tokenizer_json(tokenizer))
        if isinstance(path_or_model, (str, os.PathLike)):
            return cls(_Model(os.fspath(path_or_model), **options))
        if not _is_loaded_model(path_or_model):
            raise TypeError(
                f"from_pretrained takes a checkpoint folder's path or a loaded transformers model, not a "
                f"{type(path_or_model).__name__}"
            )
        config = path_or_model.config
        name = getattr(config, "name_or_path", "") or type(path_or_model).__name__
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_available():
            torch.cuda.synchronize()  # the tensors' last writes, on whatever stream made them
        loaded = (os.path.basename(str(name)) or str(name), config.to_json_string(), path_or_model.state_dict())
        return cls(_Model(loaded, **options))

    @property
    def on(self) -> str:
        """``"gpu"`` or ``"cpu"``."""
        return self._m.on

    @property
    def vocab(self) -> int:
        """The vocabulary's size: the length of every logits vector."""
        return self._m.vocab

    @property
    def context(self) -> int:
        """The caches' depth in positions."""
        return self._m.context

    @property
    def eos(self) -> List[int]:
        """The checkpoint's end-of-sequence tokens (config.json's ``eos_token_id``)."""
        return self._m.eos

    @property
    def bos(self) -> Optional[int]:
        """The checkpoint's beginning-of-sequence token, if it names one."""
        return self._m.bos

    def describe(self) -> str:
        """The compiled program in words (how the layer's phases are planned on the GPU, and for a
        quantised checkpoint what its decode steps stream)."""
        return self._m.describe()

    def decode_step(self, token: int, pos: int) -> Any:
        """The f32 logits after ``token`` at position ``pos``, its K and V appended to every layer's
        cache at ``pos``; on the GPU in one launch."""
        return _logits(self._m.decode_step(token, pos, self._on_device))

    def decode_step_timed(self, token: int, pos: int) -> Tuple[Any, Dict[str, float]]:
        """``decode_step`` in the model kernel's traced instance (GPU only): its logits, and each kind of
        phase's ms on the step's critical path, summed over the layers (``Qkv``, ``Attention``,
        ``OProj``, ``GateUp``, ``Down`` as the compiled plan has them; ``Head`` last).
        ``last_kernel_ms`` is the traced launch's time. Every block stamps the clock around each phase,
        so the traced step is a little slower than ``decode_step``; its logits are the same bits."""
        raw, phases, kernel_ms = self._m.decode_step_timed(token, pos, self._on_device)
        self.last_kernel_ms = kernel_ms
        return _logits(raw), dict(phases)

    def prefill(self, ids: Sequence[int]) -> Any:
        """Decodes ``ids`` from position 0 (on the GPU in one launch) and returns the logits of the last
        position; the next ``decode_step`` is at ``len(ids)``."""
        return _logits(self._m.prefill(list(ids), self._on_device))

    def reset(self) -> None:
        """Forgets every sequence: the caches are zeroed, as a new model's are. (Positions are explicit,
        so a new sequence may also just start again at position 0.)"""
        self._m.reset()

    def generate(self, prompt_ids: Sequence[int], max_new: int = 64, eos: Optional[Sequence[int]] = None) -> List[int]:
        """``prompt_ids`` from position 0, then up to ``max_new`` greedy tokens, in one launch on the GPU.

        Stops after an end-of-sequence token (``eos``; the checkpoint's when None, none when empty, at
        most 4), after ``max_new`` tokens, or where the caches end. Returns the generated tokens (an
        end-of-sequence token included); ``last_stop`` says why it stopped.
        """
        stop_at = self.eos if eos is None else list(eos)
        tokens, stop, kernel_ms = self._m.generate(list(prompt_ids), max_new, stop_at)
        self.last_stop, self.last_kernel_ms = stop, kernel_ms
        return tokens

    def generate_batch(
        self, prompts: Sequence[Sequence[int]], max_new: int = 64, eos: Optional[Sequence[int]] = None
    ) -> List[List[int]]:
        """Each prompt's ``generate``, for up to ``max_batch`` prompts at once: on the GPU one batch step
        per position for all of them (the weights streamed once a step; each sequence's tokens those of
        its own generation), on the CPU one after another. ``last_stops`` says why each stopped."""
        stop_at = self.eos if eos is None else list(eos)
        done = self._m.generate_batch([list(p) for p in prompts], max_new, stop_at)
        self.last_stops = [stop for _, stop in done]
        return [tokens for tokens, _ in done]

    def encode(self, text: str) -> List[int]:
        """The tokens of ``text`` with the model's special tokens (the checkpoint's tokenizer.json)."""
        return self._m.encode(text)

    def decode(self, tokens: Sequence[int]) -> str:
        """The text of ``tokens``, special tokens left out."""
        return self._m.decode(list(tokens))
