// Embedding gather: out[t, :] = table[ids[t], :].
// Contract: ids int32 [T] (validated on the host to lie in [0, V)), table float32 [V, D] row-major,
// out float32 [T, D]. Launch: grid (T), block BLOCK_THREADS; threads stride over D (coalesced).
// ids live on the device so a captured decode graph can be replayed with a new token.
#include "common.cuh"

extern "C" __global__ void __launch_bounds__(BLOCK_THREADS)
embedding_kernel(const int* __restrict__ ids, const float* __restrict__ table, float* __restrict__ out, int D) {
    const int t = blockIdx.x;
    const float* row = table + (size_t)ids[t] * D;
    for (int d = threadIdx.x; d < D; d += blockDim.x) out[(size_t)t * D + d] = row[d];
}
