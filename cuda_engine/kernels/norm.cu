// RMSNorm, alone and fused with the residual add.
//   rms_norm_kernel:      y[t] = w * (x[t] / sqrt(mean(x[t]^2) + eps))
//   add_rms_norm_kernel:  h_out[t] = h[t] + a[t];  y[t] = rms_norm(h_out[t])
// Contract: float32 rows of n elements; x/y rows may be strided (x_stride, y_stride elements) so the
// latent norm can read c_kv straight out of the [T, C + R] kv_a output. w float32 [n].
// Launch: grid (T), block BLOCK_THREADS. The sum of squares is a fixed-order block reduction, so the
// result is bitwise reproducible. 1/sqrtf (not rsqrtf: 2 ulp) keeps the oracle's rounding close.
// The batched loop over a row, and the add + norm of one row: row_ops.cuh (the o_proj GEMV's last block runs the
// same row, linear.cu).
#include "row_ops.cuh"

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
    add_rms_norm_row(h + row, [&](int i) { return a[row + i]; }, h_out + row, w, y + row, n, eps, buf);
}
