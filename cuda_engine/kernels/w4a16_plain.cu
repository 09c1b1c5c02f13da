// Plain W4A16 expert GEMVs: float32 activations x packed INT4 weights x bf16 group scales, exactly as
// the bundle stores them (no repacking), float32 accumulation. The oracle kernel: short, obviously right.
//   w4a16_gate_up_kernel: act[t, k] = silu(Wg[e] x[t]) * (Wu[e] x[t]),  e = slot_ids[t, k]   [T * S, I]
//   w4a16_down_kernel:    y[t, k] = Wd[e] act[t, k]                                           [T * S, D]
// with W[o, c] = (nibble(o, c) - 8) * scale[o, c / g] computed exactly in float32 (4 x 8 significant bits),
// so the result equals the dense float32 path on the dequantized weights up to summation order.
// Layout (docs/int4.md, kdtr_format/int4.py): per expert, qw int32 [out, in/8], word j holds input columns
// 8j..8j+7, column 8j+i in bits 4i..4i+3 (column 8j the least significant nibble); sc uint16 [out, in/g]
// raw bfloat16 bits. Stacked over experts: [E', out, in/8] and [E', out, in/g].
// Slots: only slots k0 .. k0+nk-1 of each token's S slots run here (the routed experts, when the shared
// expert stays dense); expert index = slot_ids[t, k] - e_base. g must be a multiple of 8 (a word never
// straddles two groups). Launch: grid (ceil(out / WARPS_PER_BLOCK), T * nk), block BLOCK_THREADS; one warp
// per output, lanes over packed words (one 32-bit load = 8 weights), fixed butterfly: deterministic.
#include "common.cuh"

__device__ __forceinline__ float bf16_to_float(unsigned short bits) {
    return __uint_as_float((unsigned)bits << 16);
}

// sum_c x[c] * W[c] over one packed row of `in` columns
__device__ __forceinline__ float w4a16_row_dot(const float* __restrict__ x, const int* __restrict__ qrow,
                                               const unsigned short* __restrict__ srow, int in, int g, int lane) {
    float acc = 0.0f;
    for (int j = lane; j < in / 8; j += WARP_SIZE) {
        const unsigned word = (unsigned)qrow[j];
        const float s = bf16_to_float(srow[(8 * j) / g]);
        for (int i = 0; i < 8; ++i) {
            const float w = (float)((int)((word >> (4 * i)) & 0xFu) - 8) * s;   // exact
            acc += x[8 * j + i] * w;
        }
    }
    return warp_sum(acc);
}

extern "C" __global__ void __launch_bounds__(BLOCK_THREADS, MIN_BLOCKS_PER_SM)
w4a16_gate_up_kernel(const float* __restrict__ x, const int* __restrict__ qg, const unsigned short* __restrict__ sg,
                     const int* __restrict__ qu, const unsigned short* __restrict__ su,
                     const int* __restrict__ slot_ids, float* __restrict__ act, int D, int I, int S, int k0, int nk,
                     int e_base, int g) {
    AFTER_PREVIOUS_GRID();
    const int lane = threadIdx.x % WARP_SIZE;
    const int i = blockIdx.x * WARPS_PER_BLOCK + threadIdx.x / WARP_SIZE;
    if (i >= I) return;
    const int t = blockIdx.y / nk, ts = t * S + k0 + blockIdx.y % nk;
    const size_t row = (size_t)(slot_ids[ts] - e_base) * I + i;
    const float* xr = x + (size_t)t * D;
    const float a = w4a16_row_dot(xr, qg + row * (D / 8), sg + row * (D / g), D, g, lane);
    const float b = w4a16_row_dot(xr, qu + row * (D / 8), su + row * (D / g), D, g, lane);
    if (lane == 0) act[(size_t)ts * I + i] = silu(a) * b;
}

extern "C" __global__ void __launch_bounds__(BLOCK_THREADS, MIN_BLOCKS_PER_SM)
w4a16_down_kernel(const float* __restrict__ act, const int* __restrict__ qd, const unsigned short* __restrict__ sd,
                  const int* __restrict__ slot_ids, float* __restrict__ y, int I, int D, int S, int k0, int nk,
                  int e_base, int g) {
    AFTER_PREVIOUS_GRID();
    const int lane = threadIdx.x % WARP_SIZE;
    const int d = blockIdx.x * WARPS_PER_BLOCK + threadIdx.x / WARP_SIZE;
    if (d >= D) return;
    const int ts = (blockIdx.y / nk) * S + k0 + blockIdx.y % nk;
    const size_t row = (size_t)(slot_ids[ts] - e_base) * D + d;
    const float acc = w4a16_row_dot(act + (size_t)ts * I, qd + row * (I / 8), sd + row * (I / g), I, g, lane);
    if (lane == 0) y[(size_t)ts * D + d] = acc;
}
