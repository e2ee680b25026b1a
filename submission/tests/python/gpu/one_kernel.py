"""One kernel per step (x + x), for the selftest that shows the runner's copy of x_out is never
counted as the submission's: every call must record exactly one kernel and no copy."""
import torch


def build_layer(weights, kv_cache, cfg, max_seq_len):
    x = torch.zeros(cfg["batch"], cfg["d"], dtype=torch.bfloat16, device=weights["layers"][0]["q"].device)
    torch.add(x, x)
    torch.cuda.synchronize()
    return None


def layer_step(handle, x, pos):
    return torch.add(x, x)
