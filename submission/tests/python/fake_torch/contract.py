"""A contract-abiding module for the CI tests: build_layer checks what it is given against the cfg
dict, and step p returns a (B, d) tensor at the address of the p-th tensor it was given (in the
order in_norm, post_norm, q, k, v, o, gate, up, down, k_cache, v_cache), then x's itself."""
import torch

NAMES = ["in_norm", "post_norm", "q", "k", "v", "o", "gate", "up", "down"]


def build_layer(weights, kv_cache, cfg, max_seq_len):
    assert list(weights) == ["layers"] and len(weights["layers"]) == cfg["layers"] == 1, weights
    layer = weights["layers"][0]
    assert sorted(layer) == sorted(NAMES), sorted(layer)
    d, ffn, q, kv = cfg["d"], cfg["ffn"], cfg["n_q"] * cfg["hd"], cfg["n_kv"] * cfg["hd"]
    shapes = {"in_norm": (d,), "post_norm": (d,), "q": (q, d), "k": (kv, d), "v": (kv, d), "o": (d, q),
              "gate": (ffn, d), "up": (ffn, d), "down": (d, ffn)}
    for name, tensor in layer.items():
        assert type(tensor) is torch.Tensor and tensor.dtype is torch.bfloat16 is cfg["wdtype"], name
        assert tuple(tensor.shape) == shapes[name], (name, tuple(tensor.shape), shapes[name])
    (k, v), = kv_cache
    for t in (k, v):
        assert tuple(t.shape) == (cfg["batch"], cfg["n_kv"], max_seq_len, cfg["hd"]), tuple(t.shape)
    assert isinstance(max_seq_len, int) and isinstance(cfg["eps"], float) and isinstance(cfg["theta"], float)
    assert 0 < cfg["eps"] < 1e-3 and cfg["theta"] > 1000, cfg
    return {"given": [layer[n] for n in NAMES] + [k, v], "d": d}


def layer_step(handle, x, pos):
    given = handle["given"]
    source = given[pos] if pos < len(given) else x
    return torch.Tensor(source.data_ptr(), tuple(x.shape))
