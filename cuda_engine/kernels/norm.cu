// RMSNorm, alone and fused with the residual add.
//   rms_norm_kernel:      y[t] = w * (x[t] / sqrt(mean(x[t]^2) + eps))
//   add_rms_norm_kernel:  h_out[t] = h[t] + a[t];  y[t] = rms_norm(h_out[t])
// Contract: float32 rows of n elements; x/y rows may be strided (x_stride, y_stride elements) so the
// latent norm can read c_kv straight out of the [T, C + R] kv_a output. w float32 [n].
// Launch: grid (T), block BLOCK_THREADS. The sum of squares is a fixed-order block reduction, so the
// result is bitwise reproducible. 1/sqrtf (not rsqrtf: 2 ulp) keeps the oracle's rounding close.
// A row is one block, so at K2.6's 7168 (28 elements a thread) the loop was a chain of dependent loads: 10.8 us
// for one row on the H200 (bench/profile_forward.py --k26). Each thread now loads NORM_BATCH of its elements
// before it adds them, in the same order (each thread's sum runs over i = tid, tid + 256, ... as before: the
// same bits).
#define NORM_BATCH 8
#include "common.cuh"

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

extern "C" __global__ void __launch_bounds__(BLOCK_THREADS, MIN_BLOCKS_PER_SM)
rms_norm_kernel(const float* __restrict__ x, int x_stride, const float* __restrict__ w,
                float* __restrict__ y, int y_stride, int n, float eps) {
    AFTER_PREVIOUS_GRID();
    __shared__ float buf[BLOCK_THREADS];
    const float* xr = x + (size_t)blockIdx.x * x_stride;
    float* yr = y + (size_t)blockIdx.x * y_stride;
    const float ss = thread_sum_squares(n, [&](int i) { return xr[i]; }, [](int, float) {});
    const float inv = 1.0f / sqrtf(block_sum(ss, buf) / (float)n + eps);
#pragma unroll 4
    for (int i = threadIdx.x; i < n; i += blockDim.x) yr[i] = w[i] * (xr[i] * inv);
}

extern "C" __global__ void __launch_bounds__(BLOCK_THREADS, MIN_BLOCKS_PER_SM)
add_rms_norm_kernel(const float* __restrict__ h, const float* __restrict__ a, float* __restrict__ h_out,
                    const float* __restrict__ w, float* __restrict__ y, int n, float eps) {
    AFTER_PREVIOUS_GRID();
    __shared__ float buf[BLOCK_THREADS];
    const size_t row = (size_t)blockIdx.x * n;
    const float ss = thread_sum_squares(n, [&](int i) { return h[row + i] + a[row + i]; },
                                        [&](int i, float v) { h_out[row + i] = v; });   // re-read below by this thread only
    const float inv = 1.0f / sqrtf(block_sum(ss, buf) / (float)n + eps);
#pragma unroll 4
    for (int i = threadIdx.x; i < n; i += blockDim.x) y[row + i] = w[i] * (h_out[row + i] * inv);
}
