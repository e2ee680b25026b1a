// A miscompilation of nvcc 13.0 (V13.0.88, -O3, sm_90a) that dropped the fp8 batch step's whole
// stream (docs/perf.md, "The fp8 batch step's fault, bisected"): a struct whose base has default
// member initializers and tail padding, made by constructing it and then assigning the base from
// another (`static_cast<Base&>(sub) = *this`), comes out with every field undefined, and the compiler
// deletes whatever reads them. Here `k8`'s loop over its stream's stages vanishes (no FMA in its PTX)
// where `k16`, whose base is empty, keeps it; with the base's members assigned one by one, without
// the initializers, or with the padding filled by a member, `k8` keeps it too. No kernel of
// kernels/megakernel/ assigns a base so; a stream that takes another's scales copies them one by one.
// Needs no GPU, only the compiler:
//   nvcc -O3 -std=c++17 -arch=sm_90a -ptx -o base_assign.ptx scripts/probes/base_assign.cu &&
//   for k in k16 k8; do echo "$k: $(awk "/entry $k/,/^}/" base_assign.ptx | grep -c fma.rn.f32) FMAs"; done
// A compiler that compiles it right prints a nonzero count for both.
#include <cstdint>

// The base: nothing for 16, a pointer and a count for 8 (12 bytes of members in 16: 4 of padding).
template <uint32_t B>
struct Extra {};
template <>
struct Extra<8> { const float* scales = nullptr; uint32_t groups = 0; };

// A stream of rows [r0, r0 + n) in stages of 16.
template <uint32_t B>
struct Stream : Extra<B> {
    const float* w;
    uint32_t r0, n, nstages;
    __device__ Stream(const float* w_, uint32_t r0_, uint32_t r1_) : w(w_), r0(r0_), n(r1_ - r0_), nstages((r1_ - r0_ + 15) / 16) {}

    // Rows [c0, c1) of the same stream, the base's members too: the assignment that goes wrong.
    __device__ Stream rows(uint32_t c0, uint32_t c1) const {
        Stream sub(w, c0, c1);
        static_cast<Extra<B>&>(sub) = *this;
        return sub;
    }

    __device__ float run(const float* x) const {
        float acc = 0.0f;
        for (uint32_t st = 0; st < nstages; ++st) {
            const uint32_t row = r0 + st * 16 + threadIdx.x % 16;
            float scale = 1.0f;
            if constexpr (B == 8) scale = this->scales[row * this->groups];
            acc = fmaf(w[row] * scale, x[threadIdx.x], acc);
        }
        return acc;
    }
};

// The stream's rows in chunks of 64, each chunk's stream made by rows().
template <uint32_t B>
__device__ void chunks(const float* w, const float* scales, uint32_t groups, const float* x, float* out, uint32_t r1) {
    Stream<B> all(w, 0, r1);
    if constexpr (B == 8) {
        all.scales = scales;
        all.groups = groups;
    }
    float total = 0.0f;
    for (uint32_t c0 = 0; c0 < r1; c0 += 64) total += all.rows(c0, min(c0 + 64, r1)).run(x);
    out[threadIdx.x] = total;
}

extern "C" __global__ void k16(const float* w, const float* x, float* out, uint32_t r1) { chunks<16>(w, nullptr, 0, x, out, r1); }
extern "C" __global__ void k8(const float* w, const float* scales, uint32_t groups, const float* x, float* out, uint32_t r1) {
    chunks<8>(w, scales, groups, x, out, r1);
}
