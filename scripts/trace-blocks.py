#!/usr/bin/env python3
"""Where the later blocks' time comes from, read from `megakernel bench --trace --trace-stamps F.npy`.

  scripts/trace-blocks.py F.npy ROWS

ROWS: the program's phases of a layer in order, comma-separated, as the bench's trace table names them
(Qkv,Attention,OProj,GateUp,Down where the program line says "one role"). Needs numpy (the device
machine's python has it). For each kind of phase: the last block's lead over the median block's end
(the trace table's "later blocks"), split into the last block's late start and its longer work (input /
stream / tail); how much of each block's lateness is the block's own (the same every instance: an
imbalance an even share of rows cannot absorb) and what the lead would be with each block's own mean
lateness taken out; the latest blocks on average with the SMs they ran on, and each block's mean
stream; and whether a block's stream measures its SM's rate: its correlation with the block's end
lateness and with its wait since its previous phase, during which its ring fills (docs/perf.md, "SM
weights calibrated, run on an H100"). docs/perf.md, "Where the later blocks' time comes from", reads its
output.
"""
import sys
import warnings

import numpy as np

# A block that never runs a kind of phase has no mean over it: nan, and numpy's warning says so.
warnings.simplefilter("ignore", RuntimeWarning)

if len(sys.argv) != 3:
    sys.exit(__doc__)
S = np.load(sys.argv[1]).astype(np.int64)  # (positions, grid, phases, stamps): start, input, streamed, end, SM
rows = sys.argv[2].split(",")
P, G, F, _ = S.shape
R = len(rows)
L = (F - 1) // R
print(f"{P} positions, {G} blocks, {L} layers of {R} phases + head")
# The SM each block ran on (a block keeps its SM all launch), from the head's phase, which every block runs.
SMID = S[P - 1, :, F - 1, 4]
print("SM by block: " + " ".join(str(int(x)) for x in SMID))


def name_of(b):
    return f"{b} (SM {int(SMID[b])})"


for r, name in enumerate(rows):
    late, start_lag, work_x, parts_x = [], [], [], []
    per_block = []  # per instance: each block's end minus the median end (nan where it did not run)
    parts_all = []
    # Per block and instance: its stream over the median block's, its wait since its previous phase's end
    # less the median block's, and its end less the median end.
    ratio, wait, end_late = [], [], []
    for p in range(1, P):
        for l in range(L):
            s = S[p, :, l * R + r, :]
            ran = (s[:, 0] != 0) & (s[:, 3] != 0)
            if ran.sum() < 2:
                continue
            st, en = s[:, 0].astype(float), s[:, 3].astype(float)
            st[~ran] = np.nan
            en[~ran] = np.nan
            med_end, med_st = np.nanmedian(en), np.nanmedian(st)
            work = en - st
            last = int(np.nanargmax(en))
            late.append(np.nanmax(en) - med_end)
            start_lag.append(st[last] - med_st)
            work_x.append(work[last] - np.nanmedian(work))
            per_block.append(en - med_end)
            if (s[ran, 1] != 0).all() and (s[ran, 2] != 0).all():
                inp = s[:, 1] - s[:, 0]
                stream = s[:, 2] - s[:, 1]
                tail = s[:, 3] - s[:, 2]
                med = [np.median(x[ran]) for x in (inp, stream, tail)]
                parts_x.append([inp[last] - med[0], stream[last] - med[1], tail[last] - med[2]])
                pa = np.full((G, 3), np.nan)
                pa[ran] = np.stack([inp[ran], stream[ran], tail[ran]], 1)
                parts_all.append(pa)
                # Each block's previous phase's end: at this position, or the position before's head.
                f = l * R + r
                before = S[p, :, :f, 3].max(1) if f > 0 else S[p - 1, :, F - 1, 3]
                had = ran & (before != 0) & (stream > 0)
                if had.sum() > 1:
                    gap = s[had, 0] - before[had]
                    ratio.extend(stream[had] / np.median(stream[had]))
                    wait.extend(gap - np.median(gap))
                    end_late.extend(s[had, 3] - np.median(s[had, 3]))
    if not late:
        continue
    n = len(late)
    pb = np.array(per_block)  # (instances, G)
    own = np.nanmean(pb, 0)  # each block's mean lateness
    inst_var = np.nanmean(np.nanvar(pb, 1))
    own_var = np.nanvar(own)
    # The lead with each block's own mean lateness taken out (a static rebalance's bound).
    resid = pb - own
    resid_late = np.nanmean(np.nanmax(resid, 1) - np.nanmedian(resid, 1))
    print(f"\n{name}: {n} instances; the last block's lead over the median end {np.mean(late)/1e3:.2f} us "
          f"(start lag {np.mean(start_lag)/1e3:.2f}, longer work {np.mean(work_x)/1e3:.2f})")
    if parts_x:
        px = np.mean(parts_x, 0) / 1e3
        print(f"  the last block's work past the median: input {px[0]:.2f} / stream {px[1]:.2f} / tail {px[2]:.2f} us")
    print(f"  blocks' own share of the lateness variance {own_var / inst_var:.2f} (1/{n} if none is a block's own); "
          f"with each block's own mean taken out the lead is {resid_late/1e3:.2f} us")
    ran_blocks = np.where(~np.isnan(own))[0]
    order = ran_blocks[np.argsort(own[ran_blocks])]
    lasts = np.nanargmax(pb, 1)
    count = np.bincount(lasts, minlength=G)
    print("  latest blocks on average (block: mean lateness us, times last): " +
          ", ".join(f"{name_of(b)}: {own[b]/1e3:.2f}, {count[b]}" for b in order[::-1][:16]))
    print("  earliest: " + ", ".join(f"{b}: {own[b]/1e3:.2f}" for b in order[:6]))
    if parts_all:
        pa = np.nanmean(np.array(parts_all), 0) / 1e3  # (G, 3)
        for k, what in enumerate(("input", "stream", "tail")):
            v = pa[ran_blocks, k]
            print(f"  per block mean {what}: median {np.median(v):.2f}, min {v.min():.2f} (block {ran_blocks[v.argmin()]}), "
                  f"max {v.max():.2f} (block {ran_blocks[v.argmax()]})")
        v = pa[:, 1]
        print("  stream by block (us, blocks 0..): " + " ".join("-" if np.isnan(x) else f"{x:.1f}" for x in v))
    if len(ratio) > 2:
        with_end, with_wait = np.corrcoef(ratio, end_late)[0, 1], np.corrcoef(ratio, wait)[0, 1]
        print(f"  a block's stream over the median's: correlation {with_end:.2f} with its end's lateness, "
              f"{with_wait:.2f} with its wait since its previous phase")
