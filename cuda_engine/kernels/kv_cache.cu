// The latent KV cache: append this forward's rows, and the in-order DDTree compaction.
// Layout: per layer l, c_kv at cache_ckv + l * S_cap * C ([S_cap, C]) and k_pe at
// cache_kpe + l * S_cap * R ([S_cap, R]); rows 0 .. len-1 valid.
//   kv_append_kernel:  rows meta[0] + t <- (c_kv_new[t], kv[t, C:C+R])   (kv: the [T, C + R] kv_a output
//                      whose rope part was rotated in place). Launch grid (T), block BLOCK_THREADS.
//   kv_compact_kernel: rows start + keep[i] -> start + i for i = 0 .. n-1, every layer.
//                      keep is strictly increasing (an accepted DDTree path), so keep[i] >= i and a row
//                      is read before it is overwritten when rows move one after another in order
//                      (row i is never a later source: keep[i'] >= i' > i); one block per layer walks
//                      the rows sequentially (__syncthreads between rows),
//                      threads copy the columns. Launch grid (L), block BLOCK_THREADS.
#include "common.cuh"

extern "C" __global__ void __launch_bounds__(BLOCK_THREADS)
kv_append_kernel(const float* __restrict__ c_kv_new, const float* __restrict__ kv,
                 float* __restrict__ ckv_layer, float* __restrict__ kpe_layer, const int* __restrict__ meta,
                 int C, int R) {
    const int t = blockIdx.x, row = meta[0] + t;
    for (int i = threadIdx.x; i < C; i += blockDim.x) ckv_layer[(size_t)row * C + i] = c_kv_new[(size_t)t * C + i];
    for (int i = threadIdx.x; i < R; i += blockDim.x) kpe_layer[(size_t)row * R + i] = kv[(size_t)t * (C + R) + C + i];
}

extern "C" __global__ void __launch_bounds__(BLOCK_THREADS)
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
