// Row operations that more than one kernel runs, each in one fixed order so that every kernel that runs it gives
// the same bits (a fused kernel and the two it replaces, tests/test_cuda_kernels.py):
//   warp_dot:            a warp's dot product of a float32 row with a weight row (float32 or bf16 bits): lane l
//                        adds x[i] w[i] for i = l, l + 32, ... in order (a multiply-add each), then the warp's
//                        butterfly. linear_kernel's output element, and the router's logit when it makes them itself.
//   thread_sum_squares:  a thread's part of a row's sum of squares (norm.cu's kernels).
//   add_rms_norm_row:    h_out = h + a, y = w * (h_out / sqrt(mean(h_out^2) + eps)) for one row by one block:
//                        add_rms_norm_kernel's row, and the row the last block of an o_proj GEMV finishes with
//                        (linear_add_norm kernels, linear.cu).
#pragma once
#include "common.cuh"

template <typename WT>
__device__ __forceinline__ float warp_dot(const float* __restrict__ xr, const WT* __restrict__ wr, int n) {
    float acc = 0.0f;
#pragma unroll 8
    for (int i = threadIdx.x % WARP_SIZE; i < n; i += WARP_SIZE) acc += xr[i] * wval(wr[i]);   // 8 loads in flight,
    return warp_sum(acc);                                                                    // sums in order
}

// A row is one block, so at K2.6's 7168 (28 elements a thread) the loop was a chain of dependent loads: 10.8 us
// for one row on the H200 (bench/profile_forward.py --k26). Each thread loads NORM_BATCH of its elements before it
// adds them, in the same order (each thread's sum runs over i = tid, tid + 256, ...: the same bits as one at a time).
#define NORM_BATCH 8

// This thread's sum of squares of row elements i = tid, tid + blockDim.x, ... < n, in that order: value(i) gives
// element i, NORM_BATCH of them loaded before any is added; keep(i, v) sees each element once as it is added.
template <typename Value, typename Keep>
__device__ __forceinline__ float thread_sum_squares(int n, Value value, Keep keep) {
    float ss = 0.0f;
    for (int i0 = threadIdx.x; i0 < n; i0 += NORM_BATCH * blockDim.x) {
        float v[NORM_BATCH];
#pragma unroll
        for (int j = 0; j < NORM_BATCH; ++j) {
            const int i = i0 + j * blockDim.x;
            v[j] = i < n ? value(i) : 0.0f;
        }
#pragma unroll
        for (int j = 0; j < NORM_BATCH; ++j) {
            const int i = i0 + j * blockDim.x;
            if (i < n) {
                keep(i, v[j]);
                ss += v[j] * v[j];
            }
        }
    }
    return ss;
}

// One row by the whole block (BLOCK_THREADS threads; buf [BLOCK_THREADS] shared): a(i) gives element i of the
// addend (a loader, so that a kernel that wrote it in other blocks reads it from L2). The sum of squares is a
// fixed-order block reduction; 1/sqrtf (not rsqrtf: 2 ulp) keeps the oracle's rounding close.
template <typename Addend>
__device__ __forceinline__ void add_rms_norm_row(const float* __restrict__ h, Addend a, float* __restrict__ h_out,
                                                 const float* __restrict__ w, float* __restrict__ y, int n, float eps,
                                                 float* buf) {
    const float ss = thread_sum_squares(n, [&](int i) { return h[i] + a(i); },
                                        [&](int i, float v) { h_out[i] = v; });   // re-read below by this thread only
    const float inv = 1.0f / sqrtf(block_sum(ss, buf) / (float)n + eps);
#pragma unroll 4
    for (int i = threadIdx.x; i < n; i += blockDim.x) y[i] = w[i] * (h_out[i] * inv);
}
