// MLA attention in the absorbed latent form over the latent cache, one (token, head) per block:
//   score[s] = (q_lat[t,h] . c_kv[s] + q_pe[t,h] . k_pe[s]) * scale + mask(t, s)
//   p = softmax(score);  o_lat[t,h] = sum_s p[s] c_kv[s]
// q_lat = q_nope @ W_uk and o = o_lat @ W_uv^T are batched linear_kernel launches (linear.cu).
// Contract (float32): q_lat [T, H, C]; q [T, H, A] with the rotated q_pe at offset N of each head;
// cache c_kv [S_cap, C], k_pe [S_cap, R] of this layer, rows 0 .. S-1 valid, S = meta[0] + T
// (meta[0] = rows cached before this forward, read on the device so a replayed graph follows the cache);
// mask: NULL = causal (token t sees rows s <= meta[0] + t), else additive float32 [T, mask_stride]
// (0 visible, -inf hidden: DDTree verification); scores: scratch [T * H, S_cap]; o_lat [T, H, C].
// Launch: grid (T * H), block BLOCK_THREADS, shared memory (C + R) floats + BLOCK_THREADS floats.
// Determinism: a warp owns whole rows s (lanes split C, fixed butterfly); max and sum are fixed block
// trees; each thread owns output columns c and sums over s in order. No atomics.
// Limits: C + R <= ATTN_MAX_QK (the query row lives in shared memory; K2.6: 512 + 64).
#include "common.cuh"

#define ATTN_MAX_QK 1024

extern "C" __global__ void __launch_bounds__(BLOCK_THREADS)
mla_attention_kernel(const float* __restrict__ q_lat, const float* __restrict__ q,
                     const float* __restrict__ c_kv, const float* __restrict__ k_pe,
                     const int* __restrict__ meta, const float* __restrict__ mask, int mask_stride,
                     float* __restrict__ scores, int S_cap, float* __restrict__ o_lat,
                     int H, int C, int R, int A, int N, float scale) {
    __shared__ float qs[ATTN_MAX_QK];
    __shared__ float buf[BLOCK_THREADS];
    const int th = blockIdx.x, t = th / H, h = th % H;
    const int T = gridDim.x / H, S0 = meta[0], S = S0 + T;
    const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
    for (int i = threadIdx.x; i < C; i += blockDim.x) qs[i] = q_lat[(size_t)th * C + i];
    for (int i = threadIdx.x; i < R; i += blockDim.x) qs[C + i] = q[(size_t)th * A + N + i];
    __syncthreads();
    float* sc = scores + (size_t)th * S_cap;

    for (int s = warp; s < S; s += WARPS_PER_BLOCK) {        // 1. scores, a warp per cached row
        float acc = 0.0f;
        for (int i = lane; i < C; i += WARP_SIZE) acc += qs[i] * c_kv[(size_t)s * C + i];
        float rope = 0.0f;
        for (int i = lane; i < R; i += WARP_SIZE) rope += qs[C + i] * k_pe[(size_t)s * R + i];
        acc = warp_sum(acc) + warp_sum(rope);
        float m = mask ? mask[(size_t)t * mask_stride + s] : (s <= S0 + t ? 0.0f : -INFINITY);
        if (lane == 0) sc[s] = acc * scale + m;
    }
    __syncthreads();

    float mx = -INFINITY;                                     // 2. softmax, fixed-order reductions
    for (int s = threadIdx.x; s < S; s += blockDim.x) mx = fmaxf(mx, sc[s]);
    mx = block_max(mx, buf);
    float sum = 0.0f;
    for (int s = threadIdx.x; s < S; s += blockDim.x) {
        const float e = (mx == -INFINITY) ? 0.0f : expf(sc[s] - mx);
        sc[s] = e;
        sum += e;
    }
    sum = block_sum(sum, buf);
    const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
    for (int s = threadIdx.x; s < S; s += blockDim.x) sc[s] = sc[s] * inv;
    __syncthreads();

    for (int c = threadIdx.x; c < C; c += blockDim.x) {      // 3. o_lat = p @ c_kv, s in order
        float acc = 0.0f;
        for (int s = 0; s < S; ++s) acc += sc[s] * c_kv[(size_t)s * C + c];
        o_lat[(size_t)th * C + c] = acc;
    }
}
