"""A contract-abiding module for the CI tests: build_layer checks what it is given against the cfg
dict, for one layer or a stack, and step p returns a (B, d) tensor at the address of the p-th tensor
it was given (layer by layer, each in the order in_norm, post_norm, q, k, v, o, gate, up, down,
k_cache, v_cache), then x's itself, then (a stack's) the hidden states'."""
import torch

NAMES = ["in_norm", "post_norm", "q", "k", "v", "o", "gate", "up", "down"]


def build_layer(weights, kv_cache, cfg, max_seq_len):
    assert list(weights) == ["layers"] and len(weights["layers"]) == len(kv_cache) == cfg["layers"], weights
    d, ffn, q, kv = cfg["d"], cfg["ffn"], cfg["n_q"] * cfg["hd"], cfg["n_kv"] * cfg["hd"]
    shapes = {"in_norm": (d,), "post_norm": (d,), "q": (q, d), "k": (kv, d), "v": (kv, d), "o": (d, q),
              "gate": (ffn, d), "up": (ffn, d), "down": (d, ffn)}
    given = []
    for layer, (k, v) in zip(weights["layers"], kv_cache):
        assert sorted(layer) == sorted(NAMES), sorted(layer)
        for name, tensor in layer.items():
            assert type(tensor) is torch.Tensor and tensor.dtype is torch.bfloat16 is cfg["wdtype"], name
            assert tuple(tensor.shape) == shapes[name], (name, tuple(tensor.shape), shapes[name])
        for t in (k, v):
            assert tuple(t.shape) == (cfg["batch"], cfg["n_kv"], max_seq_len, cfg["hd"]), tuple(t.shape)
        given += [layer[n] for n in NAMES] + [k, v]
    assert isinstance(max_seq_len, int) and isinstance(cfg["eps"], float) and isinstance(cfg["theta"], float)
    assert 0 < cfg["eps"] < 1e-3 and cfg["theta"] > 1000, cfg
    return {"given": given, "layers": cfg["layers"]}


def layer_step(handle, x, pos, *hidden):
    # One layer's step is called without hidden states, a stack's with them.
    assert len(hidden) == (handle["layers"] > 1), f"{len(hidden)} hidden-state arguments for {handle['layers']} layers"
    for h in hidden:
        assert type(h) is torch.Tensor and h.dtype is torch.bfloat16, h
        assert tuple(h.shape) == (handle["layers"] - 1, *tuple(x.shape)), tuple(h.shape)
    sources = handle["given"] + [x, *hidden]
    source = sources[min(pos, len(sources) - 1)]
    return torch.Tensor(source.data_ptr(), tuple(x.shape))
