def build_layer(weights, kv_cache, cfg, max_seq_len):
    return None
def layer_step(handle, x, pos)
    return x
