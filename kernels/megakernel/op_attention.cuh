// Task kind Attention: each (KV head, split of its cached chunks) on a team of half a block, the chunk
// loaded once for all of its query heads, scored on the tensor cores with a running max and sum
// (flash-decoding); the splits of a head combined in split order.
#pragma once
#include <math_constants.h>
#include "vm_gemv.cuh"

// A team of TEAM_THREADS threads of the block, synchronised by its own named barrier.
struct Team {
    uint32_t id, t, lane, warp;  // team index; thread, lane and warp within the team
    __device__ Team() : id(threadIdx.x / TEAM_THREADS), t(threadIdx.x % TEAM_THREADS), lane(threadIdx.x % WARP), warp(threadIdx.x % TEAM_THREADS / WARP) {}
    // Barrier 0 is __syncthreads; team i uses barrier 1 + i, counting only its own threads.
    __device__ void sync() const { asm volatile("bar.sync %0, %1;\n" ::"r"(1 + id), "n"(TEAM_THREADS) : "memory"); }
};

// Outputs [lo, hi) of KV head kv's attention (query head i / hd, dimension i % hd, over the group):
// a = sum_s o_s e^(m_s - M) / sum_s l_s e^(m_s - M) over the head's n_splits partials in order
// (deterministic, whichever team and share computes it). lo and hi are multiples of 4. Every split's
// scale is computed once into shared memory, so the sums below are streams of independent loads. The
// caller has made the head's partials visible (acquire). `scratch` is the team's shared memory, free.
__device__ void combine(const Team& team, uint32_t kv, uint32_t n_splits, uint32_t max_splits, uint32_t group, uint32_t hd,
                        uint32_t lo, uint32_t hi, const float* part_o, const float* part_ml, bf16* a_out, float* scratch) {
    const float* pm = part_ml + (size_t)kv * max_splits * group * 2;  // (n_splits, group, 2)
    const float* po = part_o + (size_t)kv * max_splits * group * hd;  // (n_splits, group, hd)
    float* scale = scratch;                                           // (ATTN_MAX_SPLITS, ATTN_MAX_GROUP)
    float* stage = scratch + COMBINE_SCALES;                          // (COMBINE_STAGE_FLOATS)
    // The outputs go a window of COMBINE_WINDOW at a time (thread t sums outputs t, t + TEAM_THREADS,
    // ... of the window, each over the splits in order); the window's share of each split's partials
    // passes through shared memory as many splits at a time as fit: every thread's copies are in
    // flight together, so a pass costs one round trip, and the first pass's copies start before the
    // scales' loads, which do not depend on them, so the two overlap.
    const uint32_t per_split = group * hd;
    const auto load_pass = [&](uint32_t w0, uint32_t width, uint32_t s0, uint32_t sn) {
        for (uint32_t i = team.t; i < sn * width / 4; i += TEAM_THREADS) {
            const uint32_t s = 4 * i / width, off = 4 * i % width;
            cp_async16(stage + 4 * i, po + (size_t)(s0 + s) * per_split + w0 + off);
        }
    };
    for (uint32_t w0 = lo; w0 < hi; w0 += COMBINE_WINDOW) {
        const uint32_t width = min(COMBINE_WINDOW, hi - w0), per_pass = COMBINE_STAGE_FLOATS / width;
        if (w0 > lo) team.sync();  // every thread is done with the previous window's last pass
        load_pass(w0, width, 0, min(per_pass, n_splits));
        if (w0 == lo) {
            // Each lane loads the running max and sum of its splits once (lane, lane + WARP, ...).
            for (uint32_t g = team.warp; g < group; g += TEAM_WARPS) {
                float sm[COMBINE_SPLITS_PER_LANE], sl[COMBINE_SPLITS_PER_LANE];
                float m = -CUDART_INF_F;
#pragma unroll
                for (uint32_t k = 0; k < COMBINE_SPLITS_PER_LANE; ++k) {
                    const uint32_t s = team.lane + k * WARP;
                    sm[k] = s < n_splits ? __ldcg(pm + (s * group + g) * 2) : -CUDART_INF_F;
                    sl[k] = s < n_splits ? __ldcg(pm + (s * group + g) * 2 + 1) : 0.0f;
                    m = fmaxf(m, sm[k]);
                }
                m = warp_reduce(m, Max{});
                float l = 0.0f;
#pragma unroll
                for (uint32_t k = 0; k < COMBINE_SPLITS_PER_LANE; ++k) {
                    const uint32_t s = team.lane + k * WARP;
                    if (s < n_splits) {
                        sm[k] = expf(__fsub_rn(sm[k], m));
                        l = fmaf(sl[k], sm[k], l);
                    }
                }
                l = warp_reduce(l, Add{});
#pragma unroll
                for (uint32_t k = 0; k < COMBINE_SPLITS_PER_LANE; ++k) {
                    const uint32_t s = team.lane + k * WARP;
                    if (s < n_splits) scale[s * ATTN_MAX_GROUP + g] = __fdiv_rn(sm[k], l);
                }
            }
        }
        float o[COMBINE_OUTPUTS] = {};
        for (uint32_t s0 = 0; s0 < n_splits; s0 += per_pass) {
            const uint32_t sn = min(per_pass, n_splits - s0);
            if (s0 > 0) {
                team.sync();  // every thread is done with the previous pass before this one overwrites it
                load_pass(w0, width, s0, sn);
            }
            cp_async_wait_all();
            team.sync();  // the pass's partials (and, on the first, every split's scale) are in shared memory
#pragma unroll
            for (uint32_t k = 0; k < COMBINE_OUTPUTS; ++k) {
                const uint32_t i = team.t + k * TEAM_THREADS;
                if (i >= width) break;
                for (uint32_t s = 0; s < sn; ++s) o[k] = fmaf(stage[s * width + i], scale[(s0 + s) * ATTN_MAX_GROUP + (w0 + i) / hd], o[k]);
            }
        }
#pragma unroll
        for (uint32_t k = 0; k < COMBINE_OUTPUTS; ++k) {
            const uint32_t i = team.t + k * TEAM_THREADS;
            if (i < width) a_out[(size_t)kv * per_split + w0 + i] = __float2bfloat16_rn(o[k]);
        }
    }
}

// The work items of an attention phase at one position: a KV head's chunks in `splits` runs of `span`
// consecutive chunks, item kv * splits + split, taken by the phase's teams in turn, the blocks' first
// teams before their second (item i by team i / count % TEAMS of the phase's block i % count): where
// the items are fewer than the teams, each runs on a block of its own, its chain not sharing the SM's
// issue slots and loads with a second team's. With fewer KV heads than teams, each head is
// split over as many teams as it can have (at most ATTN_MAX_SPLITS), so every team holds at most one
// item and the teams of a head then combine it together, each a share; with as many heads as teams or
// more, a head is one item (one split) and its team writes its output itself.
struct AttnItems {
    BlockSet set;
    uint32_t chunk, n_chunks, span, splits, count;
    // The team of the phase that takes item 0 (a batch step's later lanes run beside the first's).
    uint32_t base;
    __device__ AttnItems(const OpRow& op, uint32_t pos, uint32_t base_ = 0)
        : set(blocks_of(op)), chunk((uint32_t)op[attn::Chunk]), n_chunks(pos / chunk + 1), base(base_) {
        const uint32_t n_kv = (uint32_t)op[attn::NKv], teams = set.count * TEAMS;
        const uint32_t most = n_kv >= teams ? 1 : min(min(teams / n_kv, ATTN_MAX_SPLITS), n_chunks);
        span = (n_chunks + most - 1) / most;
        splits = (n_chunks + span - 1) / span;
        count = n_kv * splits;
    }
    // A team before `base` wraps to an item past count: it has none.
    __device__ uint32_t first(const Team& team) const { return team.id * set.count + rank(set) - base; }
    __device__ uint32_t stride() const { return set.count * TEAMS; }
    // The first slot of item i's split, and its chunks [chunk_begin, chunk_end).
    __device__ uint32_t chunk_begin(uint32_t i) const { return i % splits * span; }
    __device__ uint32_t chunk_end(uint32_t i) const { return min(chunk_begin(i) + span, n_chunks); }
};

// A team's chunk buffers, Q rows, scores and per-head running statistics in shared memory (its share of
// the ring, laid out as attn_smem_bytes sums it).
struct AttnSmem {
    bf16* base;                      // buffer b's K rows at base + b * 2 * rows, its V rows after them
    uint32_t rows;                   // chunk * (hd + KS_PAD)
    bf16* qs;                        // (ATTN_MAX_GROUP, hd + KS_PAD)
    float* ps;                       // (ATTN_MAX_GROUP, chunk + PS_PAD)
    float *run_m, *run_l, *rescale;  // (ATTN_MAX_GROUP) each
    bf16* pb;                        // (ATTN_MAX_GROUP, chunk + PB_PAD)
    __device__ AttnSmem(uint4* smem, const Team& team, uint32_t chunk, uint32_t hd) {
        base = reinterpret_cast<bf16*>(reinterpret_cast<char*>(smem) + team.id * TEAM_SMEM_BYTES);
        rows = chunk * (hd + KS_PAD);
        qs = base + ATTN_BUFFERS * 2 * rows;
        ps = reinterpret_cast<float*>(qs + ATTN_MAX_GROUP * (hd + KS_PAD));
        run_m = ps + ATTN_MAX_GROUP * (chunk + PS_PAD);
        run_l = run_m + ATTN_MAX_GROUP;
        rescale = run_l + ATTN_MAX_GROUP;
        pb = reinterpret_cast<bf16*>(rescale + ATTN_MAX_GROUP);
    }
    __device__ bf16* ks(uint32_t b) const { return base + b * 2 * rows; }
    __device__ bf16* vs(uint32_t b) const { return base + b * 2 * rows + rows; }
};

// The slots of a chunk holding len cached rows that its tensor-core tiles cover: len rounded up to a
// tile's 16. The scores, weights and P V product stop there; the slots past it would add exact zeros.
__device__ inline uint32_t live_slots(uint32_t len) { return (len + 15) / 16 * 16; }

// Starts loading chunk c of KV head kv (slots first + r for r < len) into buffer b: rows under len but
// `skip` by asynchronous copies of every thread of the team, committed as one group per thread;
// rows from len to the last tile's end zeroed, so the P V product may run over whole tiles (a zero
// weight times a stale row could be NaN). The buffer's previous contents must be dead: the callers
// reach this only after a team.sync that follows every read of them.
constexpr uint32_t NO_ROW = UINT32_MAX;
__device__ void load_chunk(const Team& team, const OpRow& op, const AttnSmem& sm, uint32_t b, uint32_t kv, uint32_t first,
                           uint32_t len, uint32_t skip) {
    const bf16* k_cache = cache_ptr<const bf16>(op, attn::KCache);
    const bf16* v_cache = cache_ptr<const bf16>(op, attn::VCache);
    const uint32_t hd = (uint32_t)op[attn::Hd], row_vecs = hd / VEC, row = hd + KS_PAD;
    const size_t at = ((size_t)kv * (uint32_t)op[attn::MaxSeq] + first) * hd;
    for (uint32_t i = team.t; i < live_slots(len) * row_vecs; i += TEAM_THREADS) {
        const uint32_t r = i / row_vecs, col = i % row_vecs;
        uint4* kd = reinterpret_cast<uint4*>(sm.ks(b) + r * row) + col;
        uint4* vd = reinterpret_cast<uint4*>(sm.vs(b) + r * row) + col;
        if (r >= len) {
            *kd = make_uint4(0, 0, 0, 0);
            *vd = make_uint4(0, 0, 0, 0);
        } else if (r != skip) {
            cp_async16(kd, reinterpret_cast<const uint4*>(k_cache + at) + i);
            cp_async16(vd, reinterpret_cast<const uint4*>(v_cache + at) + i);
        }
    }
    cp_async_commit();
}

// Loads of an item's first chunks issued before any is scored: one per buffer.
__device__ inline uint32_t head_start(const AttnItems& items, uint32_t item) {
    return min(items.chunk_end(item) - items.chunk_begin(item), ATTN_BUFFERS);
}

// Before the wait in front of attention: each team starts loading its first item's first chunks, all
// but the slot at pos, which this launch's Qkv phase writes. They do not depend on this step, so HBM
// streams them while the block waits for the Qkv phase it depends on; the phase then loads only the
// queries and the row at pos.
__device__ void prime_attention(const OpRow& op, uint32_t pos, uint4* smem) {
    const Team team;
    const AttnItems items(op, pos);
    const uint32_t item = items.first(team);
    if (item >= items.count) return;
    const AttnSmem sm(smem, team, items.chunk, (uint32_t)op[attn::Hd]);
    const uint32_t c0 = items.chunk_begin(item);
    for (uint32_t c = c0; c < c0 + head_start(items, item); ++c) {
        const uint32_t first = c * items.chunk;
        load_chunk(team, op, sm, c - c0, item / items.splits, first, min(items.chunk, pos + 1 - first), pos - first);
    }
}


// Attention: work item (KV head, split of its chunks) -> for each query head of the group, the
// softmax numerator over the split's slots and its max and sum, kept running across the split's
// chunks (flash-decoding); then, with one split per head, the output, and with several, the combine
// of the head's partials into a (see AttnItems). Each KV chunk is loaded once for all of its query
// heads, the next chunk's copies in flight while this one is scored (chunk c0 + i of an item in buffer
// i % ATTN_BUFFERS). Where the block ran prime_attention for this phase and lane (`primed`: always but for
// a batch step's later lanes), each team's first item's first chunks lack only the row at pos.
// TRACED: thread 0 stamps when its team's first chunk has landed (TRACE_INPUT) and when its item's
// last chunk is summed (TRACE_STREAMED).
template <bool TRACED = false>
__device__ void phase_attention(const OpRow& op, uint32_t pos, uint4* smem, bool primed_first, uint32_t team_base = 0) {
    const bf16* q = act_ptr<const bf16>(op, attn::Q);
    float* part_o = act_ptr<float>(op, attn::PartO);
    float* part_ml = act_ptr<float>(op, attn::PartMl);
    unsigned* counters = act_ptr<unsigned>(op, attn::Counters);
    bf16* a_out = act_ptr<bf16>(op, attn::AOut);
    const uint32_t n_q = (uint32_t)op[attn::NQ], n_kv = (uint32_t)op[attn::NKv], hd = (uint32_t)op[attn::Hd];
    const uint32_t max_seq = (uint32_t)op[attn::MaxSeq], group = n_q / n_kv, per_head = group * hd;
    const AttnItems items(op, pos, team_base);
    const uint32_t chunk = items.chunk, splits = items.splits;
    // The partials' room per head: as many splits as the deepest slot can need (lib.rs allocates it).
    const uint32_t max_splits = min((max_seq + chunk - 1) / chunk, ATTN_MAX_SPLITS);
    unsigned* arrivals = counters;           // (n_kv) splits of each head whose partials are written
    unsigned* departures = counters + n_kv;  // (n_kv) teams done with the shared combine
    const float inv_sqrt_hd = __fdiv_rn(1.0f, __fsqrt_rn((float)hd));
    const Team team;
    const uint32_t t = team.t, lane = team.lane, warp = team.warp;
    const uint32_t row_vecs = hd / VEC, row = hd + KS_PAD, ps_row = chunk + PS_PAD;  // strides
    // Fragment coordinates of this lane: its group of the tiles' rows and columns, its quad position.
    const uint32_t g = lane / 4, quad = lane % 4;
    const uint32_t n_tiles = (group + 7) / 8, pb_row = chunk + PB_PAD;  // head tiles of 8; weights' stride
    const AttnSmem sm(smem, team, chunk, hd);
    float* ps = sm.ps;

    for (uint32_t item = items.first(team); item < items.count; item += items.stride()) {
        const uint32_t kv = item / splits, split = item % splits;
        const uint32_t c0 = items.chunk_begin(item), c1 = items.chunk_end(item);
        const bool primed = primed_first && item == items.first(team);
        // The queries (and, primed, the row at pos) join the chunk loads' groups: the first chunk's
        // wait is for all of them.
        for (uint32_t i = t; i < group * row_vecs; i += TEAM_THREADS) {
            cp_async16(reinterpret_cast<uint4*>(sm.qs + (i / row_vecs) * row) + i % row_vecs, reinterpret_cast<const uint4*>(q + (size_t)kv * group * hd) + i);
        }
        for (uint32_t h = t; h < group; h += TEAM_THREADS) {
            sm.run_m[h] = -CUDART_INF_F;
            sm.run_l[h] = 0.0f;
        }
        if (primed) {
            // The primed chunks lack the row this step's Qkv phase wrote (the block has waited for it).
            for (uint32_t c = c0; c < c0 + head_start(items, item); ++c) {
                const uint32_t first = c * chunk, r = pos - first;
                if (r >= min(chunk, pos + 1 - first)) continue;
                const size_t at = ((size_t)kv * max_seq + pos) * row_vecs;
                for (uint32_t i = t; i < row_vecs; i += TEAM_THREADS) {
                    cp_async16(reinterpret_cast<uint4*>(sm.ks(c - c0) + r * row) + i, cache_ptr<const uint4>(op, attn::KCache) + at + i);
                    cp_async16(reinterpret_cast<uint4*>(sm.vs(c - c0) + r * row) + i, cache_ptr<const uint4>(op, attn::VCache) + at + i);
                }
            }
            cp_async_commit();
        } else {
            for (uint32_t c = c0; c < c0 + head_start(items, item); ++c) {
                load_chunk(team, op, sm, c - c0, kv, c * chunk, min(chunk, pos + 1 - c * chunk), NO_ROW);
            }
        }
        // The numerator O^T (head dimension x heads) of this lane's tiles, across the split's chunks:
        // column tiles warp, warp + TEAM_WARPS, ... of 16, head tiles of 8 (see the P V product).
        float acc[PV_M][PV_N][4] = {};
        for (uint32_t c = c0; c < c1; ++c) {
            const uint32_t first = c * chunk, len = min(chunk, pos + 1 - first), live = live_slots(len), b = (c - c0) % ATTN_BUFFERS;
            const bf16 *ks = sm.ks(b), *vs = sm.vs(b);
            // This chunk's group has landed once at most the groups issued after it are in flight: the
            // next chunk's, when it is issued and nothing but chunk loads came after this one (a first
            // chunk waits for the queries' group, issued after the primed chunks).
            if (c + 1 < c1 && !(primed && c == c0)) cp_async_wait_group<1>();
            else cp_async_wait_group<0>();
            team.sync();  // the chunk, the queries and the running statistics are in shared memory
            if (TRACED && c == c0) stamp(TRACE_INPUT);
            // Scores S^T = K Q^T on the tensor cores: A = K (16 slots x 16 of the head dimension, by
            // ldmatrix), B = Q^T (16 x 8 query heads; heads past the group zero). Warp w takes the
            // (slot tile, head tile) units w, w + TEAM_WARPS, ...; the even and odd steps along the head
            // accumulate apart, so two chains of products are in flight. Lane (g, quad) ends with slots
            // g and g + 8's scores of heads 2 quad + {0, 1}.
            for (uint32_t u = warp; u < live / 16 * n_tiles; u += TEAM_WARPS) {
                const uint32_t st = u / n_tiles, head = u % n_tiles * 8 + g;
                const bf16* a_row = ks + (st * 16 + lane % 8 + 8 * (lane / 8 % 2)) * row + 8 * (lane / 16);
                const bf16* q_row = sm.qs + head * row + 2 * quad;
                float d[4] = {0.0f, 0.0f, 0.0f, 0.0f}, e[4] = {0.0f, 0.0f, 0.0f, 0.0f};
                for (uint32_t k0 = 0; k0 < hd; k0 += 16) {
                    uint32_t a[4];
                    ldmatrix_x4(a, a_row + k0);
                    const uint32_t bq[2] = {head < group ? pair_at(q_row + k0) : 0u, head < group ? pair_at(q_row + k0 + 8) : 0u};
                    if (k0 / 16 % 2) mma_bf16_m16n8k16(e, a, bq);
                    else mma_bf16_m16n8k16(d, a, bq);
                }
                const uint32_t s = st * 16 + g, h = u % n_tiles * 8 + 2 * quad;
#pragma unroll
                for (uint32_t i = 0; i < 4; ++i) {
                    const uint32_t slot = s + 8 * (i / 2), hi = h + i % 2;
                    if (hi < group && slot < len) ps[hi * ps_row + slot] = __fmul_rn(__fadd_rn(d[i], e[i]), inv_sqrt_hd);
                }
            }
            team.sync();  // every score is in ps

            // Softmax of each query head over the chunk, against the running max: warp h. Weights past
            // len are zero; each is rounded to bf16 for the P V product, and the sum is of the rounded
            // weights, so the output's weights sum to 1. The running sum and the numerator are
            // rescaled by e^(old max - new max), which is 0 on a split's first chunk (the max was
            // -inf), so a one-chunk split's figures are the chunk's own.
            const bool last_chunk = c + 1 == items.chunk_end(item);
            float* ml = part_ml + (((size_t)kv * max_splits + split) * group) * 2;
            for (uint32_t h = warp; h < group; h += TEAM_WARPS) {
                float m = -CUDART_INF_F;
                for (uint32_t j = lane; j < len; j += WARP) m = fmaxf(m, ps[h * ps_row + j]);
                const float old_m = sm.run_m[h];
                m = fmaxf(old_m, warp_reduce(m, Max{}));
                float l = 0.0f;
                for (uint32_t j = lane; j < live; j += WARP) {
                    const bf16 e = __float2bfloat16_rn(j < len ? expf(__fsub_rn(ps[h * ps_row + j], m)) : 0.0f);
                    sm.pb[h * pb_row + j] = e;
                    l += __bfloat162float(e);
                }
                const float alpha = expf(__fsub_rn(old_m, m));
                l = fmaf(sm.run_l[h], alpha, warp_reduce(l, Add{}));
                __syncwarp();  // every lane has read run_m and run_l before lane 0 replaces them
                if (lane == 0) {
                    sm.run_m[h] = m;
                    sm.run_l[h] = l;
                    sm.rescale[h] = alpha;
                    if (last_chunk && splits > 1) {
                        ml[h * 2] = m;
                        ml[h * 2 + 1] = l;
                    }
                }
            }
            team.sync();  // the weights, the running statistics and the rescales are in shared memory

            // Numerator O^T = O^T e^(old max - new max) + V^T P^T on the tensor cores: A = V^T (16 of the
            // head dimension x 16 slots, by transposing ldmatrix), B = P^T (16 slots x 8 heads, the bf16
            // weights). Lane (g, quad) holds dimensions g and g + 8 of its column tile for heads
            // 2 quad + {0, 1} of its head tile.
#pragma unroll
            for (uint32_t nt = 0; nt < PV_N; ++nt) {
                const uint32_t h = nt * 8 + 2 * quad;
                const float r0 = h < group ? sm.rescale[h] : 0.0f, r1 = h + 1 < group ? sm.rescale[h + 1] : 0.0f;
#pragma unroll
                for (uint32_t mi = 0; mi < PV_M; ++mi) {
                    acc[mi][nt][0] *= r0;
                    acc[mi][nt][1] *= r1;
                    acc[mi][nt][2] *= r0;
                    acc[mi][nt][3] *= r1;
                }
            }
            for (uint32_t s0 = 0; s0 < live; s0 += 16) {
                uint32_t bp[PV_N][2];
#pragma unroll
                for (uint32_t nt = 0; nt < PV_N; ++nt) {
                    const uint32_t head = nt * 8 + g;
                    bp[nt][0] = head < group ? pair_at(sm.pb + head * pb_row + s0 + 2 * quad) : 0u;
                    bp[nt][1] = head < group ? pair_at(sm.pb + head * pb_row + s0 + 8 + 2 * quad) : 0u;
                }
#pragma unroll
                for (uint32_t mi = 0; mi < PV_M; ++mi) {
                    const uint32_t mt = warp + mi * TEAM_WARPS;
                    if (mt >= hd / 16) break;
                    uint32_t a[4];
                    ldmatrix_x4_trans(a, vs + (s0 + lane % 8 + 8 * (lane / 16)) * row + mt * 16 + 8 * (lane / 8 % 2));
#pragma unroll
                    for (uint32_t nt = 0; nt < PV_N; ++nt) {
                        if (nt < n_tiles) mma_bf16_m16n8k16(acc[mi][nt], a, bp[nt]);
                    }
                }
            }
            // The chunk's buffer is free once every thread is past its P V: it takes chunk c + ATTN_BUFFERS.
            if (c + ATTN_BUFFERS < c1) {
                team.sync();
                const uint32_t next = (c + ATTN_BUFFERS) * chunk;
                load_chunk(team, op, sm, b, kv, next, min(chunk, pos + 1 - next), NO_ROW);
            }
        }

        if (TRACED) stamp(TRACE_STREAMED);
        // Calls f(head, dimension, value) for each element of the numerator this lane holds.
        const auto each_output = [&](auto f) {
#pragma unroll
            for (uint32_t mi = 0; mi < PV_M; ++mi) {
                const uint32_t mt = warp + mi * TEAM_WARPS;
                if (mt >= hd / 16) break;
#pragma unroll
                for (uint32_t nt = 0; nt < PV_N; ++nt) {
#pragma unroll
                    for (uint32_t i = 0; i < 4; ++i) {
                        const uint32_t h = nt * 8 + 2 * quad + i % 2, dim = mt * 16 + g + 8 * (i / 2);
                        if (h < group) f(h, dim, acc[mi][nt][i]);
                    }
                }
            }
        };
        if (splits == 1) {
            // The head is this item: a = O / l, rounded as the combine of one split rounds it.
            bf16* a_head = a_out + (size_t)kv * per_head;
            each_output([&](uint32_t h, uint32_t dim, float o) {
                a_head[h * hd + dim] = __float2bfloat16_rn(fmaf(o, __fdiv_rn(1.0f, sm.run_l[h]), 0.0f));
            });
            team.sync();  // the team's shared memory is free for its next item
            continue;
        }

        float* po = part_o + (((size_t)kv * max_splits + split) * group) * hd;
        each_output([&](uint32_t h, uint32_t dim, float o) { po[h * hd + dim] = o; });
        team.sync();  // all of this team's partials are written (and its shared memory is free again)

        // Several splits: every team holds one item (AttnItems), so every split of the head arrives.
        unsigned departed = 0;  // thread 0: teams of the head past their wait before this one
        if (t == 0) {
            // Count this split in (release: its partials first) and wait for the rest (acquire: the
            // head's partials are read only after every arrival was seen).
            red_release_add(&arrivals[kv], 1);
            while (ld_acquire(&arrivals[kv]) < splits) __nanosleep(32);
            // Counted out as soon as it is past the wait; the count is read only after the combine,
            // so the atomic's round trip overlaps it.
            departed = atomicAdd(&departures[kv], 1u);
        }
        team.sync();  // every thread of the team sees every arrival
        // Split s's team combines outputs [s share, (s + 1) share) of the head.
        const uint32_t share = ((per_head + splits - 1) / splits + 3) & ~3u;
        const uint32_t lo = min(split * share, per_head), hi = min(lo + share, per_head);
        if (lo < hi) combine(team, kv, splits, max_splits, group, hd, lo, hi, part_o, part_ml, a_out, reinterpret_cast<float*>(sm.base));
        if (t == 0 && departed == splits - 1) {
            // Every team of the head is past its wait: reset both for the next step (the launch
            // boundary orders this before any later arrival: a step runs each attention phase once).
            arrivals[kv] = 0;
            departures[kv] = 0;
        }
        team.sync();  // the team's shared memory is free for its next item
    }
}
