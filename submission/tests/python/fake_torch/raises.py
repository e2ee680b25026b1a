def build_layer(weights, kv_cache, cfg, max_seq_len):
    return {"calls": 0}


def layer_step(handle, x, pos):
    return divide(x, pos)


def divide(x, pos):
    return x if pos else 1 / 0
