"""Random-weight Llama-family checkpoints as transformers writes them, for scripts/hf-agreement.py and
scripts/hf-speed.py (no downloads): the config, the model, and a byte-level BPE tokenizer trained on
the repository's docs."""
import json
import sys
from pathlib import Path

from transformers import LlamaConfig, Qwen3Config

ROOT = Path(__file__).resolve().parent.parent
BOS, EOS = 1, 2
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}


def model_config(name, shape, context):
    """The config of shape (hidden, intermediate, layers, heads, kv heads, vocab, tied, rope theta, rope
    scaling or None[, head size]): a Qwen3Config (with the head size, its q/k norms) for a name that
    starts with "qwen3", else a LlamaConfig (with the head size where given, else hidden / heads)."""
    d, ffn, layers, heads, kv, vocab, tied, theta, scaling, *head_dim = shape
    if scaling is not None:  # transformers wants the scaled context above the original
        context = max(context, 4 * scaling["original_max_position_embeddings"])
    # transformers 5 takes the base and the scaling together as rope_parameters; 4 as rope_theta and
    # rope_scaling.
    v5 = "rope_parameters" in LlamaConfig().to_dict()
    rope = {"rope_parameters": dict(scaling or {"rope_type": "default"}, rope_theta=theta)} if v5 else \
        {"rope_theta": theta, "rope_scaling": scaling}
    common = dict(hidden_size=d, intermediate_size=ffn, num_hidden_layers=layers, num_attention_heads=heads,
                  num_key_value_heads=kv, vocab_size=vocab, tie_word_embeddings=tied,
                  max_position_embeddings=context, rms_norm_eps=1e-5, bos_token_id=BOS, eos_token_id=EOS, **rope)
    if name.startswith("qwen3"):
        return Qwen3Config(head_dim=head_dim[0], use_sliding_window=False, **common)
    return LlamaConfig(**({"head_dim": head_dim[0]} if head_dim else {}), **common)


def save(model, out):
    """save_pretrained, then the RoPE fields config.json holds, to stderr."""
    model.save_pretrained(out)
    written = json.loads((out / "config.json").read_text())
    print(f"{out.name}: config.json's RoPE: " + ", ".join(f"{k}={written[k]}" for k in
          ("rope_theta", "rope_scaling", "rope_parameters") if k in written), file=sys.stderr)


def make_tokenizer(vocab, path):
    """A byte-level BPE of at most `vocab` tokens trained on the repository's docs: <unk> 0, <s> 1 (added
    in front of every text), </s> 2."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    lines = [line for doc in sorted((ROOT / "docs").glob("*.md")) for line in doc.read_text().splitlines()]
    tok.train_from_iterator(lines, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", BOS)])
    tok.save(str(path))
