// The latent KV cache (layout: kv_layout.cuh, three bf16 term planes per layer): this forward's latents into it,
// and the in-order DDTree compaction.
//   mla_latent_kernel: from one row of the fused q_a/kv_a output qkv [T, Q + C + R]:
//                      c_q = rms_norm(qkv[:Q], w_q) -> cq [T, Q];
//                      c_kv = rms_norm(qkv[Q:Q+C], w_kv) -> lat [T, C] and cache row meta[0] + t (its terms);
//                      k_pe = rope(qkv[Q+C:]) (never normed) -> in place (the k_pe tap) and the cache row.
//                      One launch for both latent norms, the key's rope and the append; the row's padding
//                      columns are written 0. Launch grid (T), block BLOCK_THREADS.
//   kv_compact_kernel: rows start + keep[i] -> start + i for i = 0 .. n-1, every layer (kv_move_rows).
//                      Launch grid (L), block BLOCK_THREADS.
#include "common.cuh"
#include "kv_layout.cuh"
#include "rope.cuh"
#include "tensor_core.cuh"

extern "C" __global__ void __launch_bounds__(BLOCK_THREADS, MIN_BLOCKS_PER_SM)
mla_latent_kernel(float* __restrict__ qkv, int Q, int C, int R, const float* __restrict__ w_q,
                  const float* __restrict__ w_kv, float eps, float* __restrict__ cq, float* __restrict__ lat,
                  bf16_t* __restrict__ kv_layer, int kv_rows, const int* __restrict__ meta,
                  const int* __restrict__ positions, const double* __restrict__ inv_freq, double attn_factor) {
    AFTER_PREVIOUS_GRID();
    __shared__ float buf[BLOCK_THREADS];
    const int t = blockIdx.x, Kp = kv_pitch(C, R);
    const size_t plane = (size_t)kv_rows * Kp;
    bf16_t* dst = kv_layer + ((size_t)meta[0] + t) * Kp;
    float* x = qkv + (size_t)t * (Q + C + R);
    float ssq = 0.0f, sskv = 0.0f;
    for (int i = threadIdx.x; i < Q; i += blockDim.x) ssq += x[i] * x[i];
    for (int i = threadIdx.x; i < C; i += blockDim.x) sskv += x[Q + i] * x[Q + i];
    const float inv_q = 1.0f / sqrtf(block_sum(ssq, buf) / (float)Q + eps);
    const float inv_kv = 1.0f / sqrtf(block_sum(sskv, buf) / (float)C + eps);
    for (int i = threadIdx.x; i < Q; i += blockDim.x) cq[(size_t)t * Q + i] = w_q[i] * (x[i] * inv_q);
    for (int i = threadIdx.x; i < C; i += blockDim.x) {
        const float v = w_kv[i] * (x[Q + i] * inv_kv);
        lat[(size_t)t * C + i] = v;
        store_terms(dst + i, plane, v);
    }
    float* k = x + Q + C;
    for (int i = threadIdx.x; i < R / 2; i += blockDim.x) {
        float y0, y1;
        rope_pair(k[2 * i], k[2 * i + 1], (double)positions[t], inv_freq[i], attn_factor, &y0, &y1);
        k[2 * i] = y0;
        k[2 * i + 1] = y1;
        store_terms(dst + C + 2 * i, plane, y0);
        store_terms(dst + C + 2 * i + 1, plane, y1);
    }
    for (int i = C + R + threadIdx.x; i < Kp; i += blockDim.x) store_terms(dst + i, plane, 0.0f);
}

extern "C" __global__ void __launch_bounds__(BLOCK_THREADS, MIN_BLOCKS_PER_SM)
kv_compact_kernel(bf16_t* kv, const int* __restrict__ keep, int n, int start, int kv_rows, int Kp) {
    AFTER_PREVIOUS_GRID();
    kv_move_rows(kv + (size_t)blockIdx.x * 3 * kv_rows * Kp, keep, n, start, kv_rows, Kp);
}
