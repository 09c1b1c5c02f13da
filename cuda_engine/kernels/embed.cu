// Embedding gather fused with the first layer's input RMSNorm:
//   out[t, :] = table[ids[t], :];  y[t] = rms_norm(out[t], w)   (one launch instead of two)
// Contract: ids int32 [T] (validated on the host to lie in [0, V)), table float32 (embedding_kernel) or bf16 bits
// (embedding_bf16_kernel, widened exactly) [V, D] row-major,
// out, y float32 [T, D], w float32 [D]. Launch: grid (T), block BLOCK_THREADS; threads stride over D.
// ids live on the device so a captured decode graph can be replayed with a new token.
#include "common.cuh"

template <typename WT>
__device__ __forceinline__ void embedding_body(const int* __restrict__ ids, const WT* __restrict__ table,
                                               float* __restrict__ out, int D, const float* __restrict__ w,
                                               float* __restrict__ y, float eps) {
    __shared__ float buf[BLOCK_THREADS];
    const int t = blockIdx.x;
    const WT* src = table + (size_t)ids[t] * D;
    float* dst = out + (size_t)t * D;
    float ss = 0.0f;
    for (int d = threadIdx.x; d < D; d += blockDim.x) {
        const float v = wval(src[d]);
        dst[d] = v;
        ss += v * v;
    }
    const float inv = 1.0f / sqrtf(block_sum(ss, buf) / (float)D + eps);
    for (int d = threadIdx.x; d < D; d += blockDim.x) y[(size_t)t * D + d] = w[d] * (dst[d] * inv);
}

#define EMBEDDING_ARGS(WT) const int* __restrict__ ids, const WT* __restrict__ table, float* __restrict__ out, int D, \
    const float* __restrict__ w, float* __restrict__ y, float eps
extern "C" __global__ void __launch_bounds__(BLOCK_THREADS, MIN_BLOCKS_PER_SM) embedding_kernel(EMBEDDING_ARGS(float)) {
    AFTER_PREVIOUS_GRID();
    embedding_body(ids, table, out, D, w, y, eps);
}
extern "C" __global__ void __launch_bounds__(BLOCK_THREADS, MIN_BLOCKS_PER_SM) embedding_bf16_kernel(EMBEDDING_ARGS(bf16_t)) {
    AFTER_PREVIOUS_GRID();
    embedding_body(ids, table, out, D, w, y, eps);
}
