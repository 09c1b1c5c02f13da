// Greedy sampling and the decode-step bookkeeping a replayed CUDA graph needs.
//   argmax_kernel:        out[t] = argmax(logits[t, :]), the lowest index on an exact tie (np.argmax).
//                         Launch grid (T), block BLOCK_THREADS; strided scan + fixed shared-memory tree.
//   decode_advance_kernel: after a captured decode step: meta[0] (cached rows) += 1, positions[0] += 1,
//                         so the next replay decodes the token argmax_kernel wrote into ids[0].
//                         Launch grid (1), block (1).
#include "common.cuh"

extern "C" __global__ void __launch_bounds__(BLOCK_THREADS, MIN_BLOCKS_PER_SM)
argmax_kernel(const float* __restrict__ logits, int V, int* __restrict__ out) {
    AFTER_PREVIOUS_GRID();
    __shared__ float bv[BLOCK_THREADS];
    __shared__ int bi[BLOCK_THREADS];
    const float* row = logits + (size_t)blockIdx.x * V;
    float best = -INFINITY;
    int idx = -1;
    for (int v = threadIdx.x; v < V; v += blockDim.x)
        if (idx < 0 || row[v] > best) { best = row[v]; idx = v; }
    bv[threadIdx.x] = best;
    bi[threadIdx.x] = idx;
    __syncthreads();
    for (int half = BLOCK_THREADS / 2; half > 0; half >>= 1) {
        if (threadIdx.x < half) {
            const float ov = bv[threadIdx.x + half];
            const int oi = bi[threadIdx.x + half];
            const bool take = oi >= 0 && (bi[threadIdx.x] < 0 || ov > bv[threadIdx.x] ||
                                          (ov == bv[threadIdx.x] && oi < bi[threadIdx.x]));
            if (take) { bv[threadIdx.x] = ov; bi[threadIdx.x] = oi; }
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) out[blockIdx.x] = bi[0];
}

extern "C" __global__ void decode_advance_kernel(int* meta, int* positions) {
    AFTER_PREVIOUS_GRID();
    meta[0] += 1;
    positions[0] += 1;
}
