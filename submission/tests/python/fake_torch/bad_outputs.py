"""Step p returns the p-th wrong x_out (then a right fp32 one), for the contract checks."""
import torch


def build_layer(weights, kv_cache, cfg, max_seq_len):
    return None


def layer_step(handle, x, pos):
    b, d = x.shape
    at = x.data_ptr()
    wrong = [
        torch.Tensor(at, (b, d), device=-1),
        torch.Tensor(at, (d,)),
        torch.Tensor(at, (b, d), dtype=torch.float16),
        torch.Tensor(at, (b, d), contiguous=False),
        torch.Tensor(at, (b, d), device=1),
        [x],
    ]
    return wrong[pos] if pos < len(wrong) else torch.Tensor(at, (b, d), dtype=torch.float32)
