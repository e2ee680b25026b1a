def layer_step(handle, x, pos):
    return x
