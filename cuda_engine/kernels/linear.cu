// fp32 GEMV/GEMM for every projection: y[b, t, o] = sum_i x[b, t, i] * W[b, o, i]   (nn.Linear, W [O, I]).
// Contract: float32 x and y; W float32 (linear_kernel) or bf16 bits (linear_bf16_kernel, widened exactly: the same
// bits as linear_kernel on the widened W), W rows contiguous (row length I). x row t of batch b starts at
// x + b * x_bstride + t * x_stride; y likewise; W of batch b at W + b * w_bstride. The batch axis serves
// the per-head absorbed-MLA products (q_nope @ W_uk, o_lat @ W_uv^T) with no extra kernel.
// Launch: grid (ceil(O / WARPS_PER_BLOCK), T, B), block BLOCK_THREADS; one warp per output element.
// Why a warp per output: at decode (T = 1) the product is a GEMV that only streams W; lanes read
// consecutive floats of one W row (128-byte coalesced loads), accumulate a strided partial sum in a
// fixed order and finish with a butterfly, so the result is deterministic. Simple first: no smem tiling
// (prefill shapes of the golden model are tiny).
#include "common.cuh"

template <typename WT>
__device__ __forceinline__ void linear_body(const float* __restrict__ x, const WT* __restrict__ W, float* __restrict__ y,
                                            int I, int O, int x_stride, int y_stride, long long x_bstride,
                                            long long w_bstride, long long y_bstride) {
    const int lane = threadIdx.x % WARP_SIZE;
    const int o = blockIdx.x * WARPS_PER_BLOCK + threadIdx.x / WARP_SIZE;
    if (o >= O) return;                                     // whole warp exits together
    const int t = blockIdx.y, b = blockIdx.z;
    const float* xr = x + b * x_bstride + (size_t)t * x_stride;
    const WT* wr = W + b * w_bstride + (size_t)o * I;
    float acc = 0.0f;
#pragma unroll 8
    for (int i = lane; i < I; i += WARP_SIZE) acc += xr[i] * wval(wr[i]);   // unrolled: 8 loads in flight, sums in order
    acc = warp_sum(acc);
    if (lane == 0) y[b * y_bstride + (size_t)t * y_stride + o] = acc;
}

#define LINEAR_ARGS(WT) const float* __restrict__ x, const WT* __restrict__ W, float* __restrict__ y, int I, int O, \
    int x_stride, int y_stride, long long x_bstride, long long w_bstride, long long y_bstride
extern "C" __global__ void __launch_bounds__(BLOCK_THREADS, MIN_BLOCKS_PER_SM) linear_kernel(LINEAR_ARGS(float)) {
    linear_body(x, W, y, I, O, x_stride, y_stride, x_bstride, w_bstride, y_bstride);
}
extern "C" __global__ void __launch_bounds__(BLOCK_THREADS, MIN_BLOCKS_PER_SM) linear_bf16_kernel(LINEAR_ARGS(bf16_t)) {
    linear_body(x, W, y, I, O, x_stride, y_stride, x_bstride, w_bstride, y_bstride);
}

// linear_rows_kernel: the same product for T >= 2 rows (prefill, a tree verify, the drafter's block), where
// linear_kernel would stream W once per row. The warp of output o computes LINEAR_ROWS consecutive rows,
// reading each W element once for all of them: W's bytes fall by up to LINEAR_ROWS x (at K2.6 widths the
// projections' weights, far over L2, were read once per row of a 33-row verify). Each row's sum runs in
// exactly linear_kernel's order (lane-strided i, the same multiply-add, then the butterfly), so every y is
// the bits linear_kernel gives for that row (tests/test_cuda_kernels.py: bit for bit, row by row).
// Launch: grid (ceil(O / WARPS_PER_BLOCK), ceil(T / LINEAR_ROWS), B), block BLOCK_THREADS.
#define LINEAR_ROWS 8

template <typename WT>
__device__ __forceinline__ void linear_rows_body(const float* __restrict__ x, const WT* __restrict__ W,
                                                 float* __restrict__ y, int T, int I, int O, int x_stride, int y_stride,
                                                 long long x_bstride, long long w_bstride, long long y_bstride) {
    const int lane = threadIdx.x % WARP_SIZE;
    const int o = blockIdx.x * WARPS_PER_BLOCK + threadIdx.x / WARP_SIZE;
    if (o >= O) return;                                     // whole warp exits together
    const int t0 = blockIdx.y * LINEAR_ROWS, b = blockIdx.z;
    const int n = min(LINEAR_ROWS, T - t0);                 // rows of this block (the last may hold fewer)
    const float* xb = x + b * x_bstride + (size_t)t0 * x_stride;
    const WT* wr = W + b * w_bstride + (size_t)o * I;
    float acc[LINEAR_ROWS];
#pragma unroll
    for (int r = 0; r < LINEAR_ROWS; ++r) acc[r] = 0.0f;
#pragma unroll 4
    for (int i = lane; i < I; i += WARP_SIZE) {               // unrolled: loads in flight, each row's sum in order
        const float w = wval(wr[i]);
#pragma unroll
        for (int r = 0; r < LINEAR_ROWS; ++r)
            if (r < n) acc[r] += xb[(size_t)r * x_stride + i] * w;
    }
#pragma unroll
    for (int r = 0; r < LINEAR_ROWS; ++r) {
        const float s = warp_sum(acc[r]);                   // the whole warp shuffles, for every r
        if (lane == 0 && r < n) y[b * y_bstride + (size_t)(t0 + r) * y_stride + o] = s;
    }
}

#define LINEAR_ROWS_ARGS(WT) const float* __restrict__ x, const WT* __restrict__ W, float* __restrict__ y, int T, int I, \
    int O, int x_stride, int y_stride, long long x_bstride, long long w_bstride, long long y_bstride
extern "C" __global__ void __launch_bounds__(BLOCK_THREADS, MIN_BLOCKS_PER_SM) linear_rows_kernel(LINEAR_ROWS_ARGS(float)) {
    linear_rows_body(x, W, y, T, I, O, x_stride, y_stride, x_bstride, w_bstride, y_bstride);
}
extern "C" __global__ void __launch_bounds__(BLOCK_THREADS, MIN_BLOCKS_PER_SM)
linear_rows_bf16_kernel(LINEAR_ROWS_ARGS(bf16_t)) {
    linear_rows_body(x, W, y, T, I, O, x_stride, y_stride, x_bstride, w_bstride, y_bstride);
}
