// The latent KV cache: this forward's latents into it, and the in-order DDTree compaction.
// Layout: per layer l, c_kv at cache_ckv + l * S_cap * C ([S_cap, C]) and k_pe at
// cache_kpe + l * S_cap * R ([S_cap, R]); rows 0 .. len-1 valid.
//   mla_latent_kernel: from one row of the fused q_a/kv_a output qkv [T, Q + C + R]:
//                      c_q = rms_norm(qkv[:Q], w_q) -> cq [T, Q];
//                      c_kv = rms_norm(qkv[Q:Q+C], w_kv) -> lat [T, C] and cache row meta[0] + t;
//                      k_pe = rope(qkv[Q+C:]) (never normed) -> in place (the k_pe tap) and the cache row.
//                      One launch for both latent norms, the key's rope and the append.
//                      Launch grid (T), block BLOCK_THREADS.
//   kv_compact_kernel: rows start + keep[i] -> start + i for i = 0 .. n-1, every layer.
//                      keep is strictly increasing (an accepted DDTree path), so keep[i] >= i and a row
//                      is read before it is overwritten when rows move one after another in order
//                      (row i is never a later source: keep[i'] >= i' > i); one block per layer walks
//                      the rows sequentially (__syncthreads between rows),
//                      threads copy the columns. Launch grid (L), block BLOCK_THREADS.
#include "common.cuh"
#include "rope.cuh"

extern "C" __global__ void __launch_bounds__(BLOCK_THREADS, MIN_BLOCKS_PER_SM)
mla_latent_kernel(float* __restrict__ qkv, int Q, int C, int R, const float* __restrict__ w_q,
                  const float* __restrict__ w_kv, float eps, float* __restrict__ cq, float* __restrict__ lat,
                  float* __restrict__ ckv_layer, float* __restrict__ kpe_layer, const int* __restrict__ meta,
                  const int* __restrict__ positions, const double* __restrict__ inv_freq, double attn_factor) {
    __shared__ float buf[BLOCK_THREADS];
    const int t = blockIdx.x;
    const size_t row = (size_t)meta[0] + t;
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
        ckv_layer[row * C + i] = v;
    }
    float* k = x + Q + C;
    for (int i = threadIdx.x; i < R / 2; i += blockDim.x) {
        float y0, y1;
        rope_pair(k[2 * i], k[2 * i + 1], (double)positions[t], inv_freq[i], attn_factor, &y0, &y1);
        k[2 * i] = kpe_layer[row * R + 2 * i] = y0;
        k[2 * i + 1] = kpe_layer[row * R + 2 * i + 1] = y1;
    }
}

extern "C" __global__ void __launch_bounds__(BLOCK_THREADS, MIN_BLOCKS_PER_SM)
kv_compact_kernel(float* cache_ckv, float* cache_kpe, const int* __restrict__ keep, int n, int start,
                  int S_cap, int C, int R) {
    float* ckv = cache_ckv + (size_t)blockIdx.x * S_cap * C;
    float* kpe = cache_kpe + (size_t)blockIdx.x * S_cap * R;
    for (int i = 0; i < n; ++i) {
        const size_t src = (size_t)start + keep[i], dst = (size_t)start + i;
        // a thread reads and writes the same columns, and dst <= src: no other thread touches them
        for (int c = threadIdx.x; c < C; c += blockDim.x) ckv[dst * C + c] = ckv[src * C + c];
        for (int r = threadIdx.x; r < R; r += blockDim.x) kpe[dst * R + r] = kpe[src * R + r];
        __syncthreads();
    }
}
