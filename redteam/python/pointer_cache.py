"""Memoises outputs by x's device address, as if a caller that passes the same buffer asked the
same question; on a miss it replays the latest output (betting the caller only reallocated). Every
call gets a fresh buffer with fresh contents, so it computes its first call only, and fails."""
from _honest import build_layer, layer_step as honest_step  # noqa: F401

memo = {}


def layer_step(state, x, pos):
    key = x.data_ptr()
    if key not in memo and not memo:
        memo[key] = honest_step(state, x, pos).clone()
    return memo.get(key, next(reversed(memo.values())))
