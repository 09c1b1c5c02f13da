// fp32 GEMV/GEMM for every projection: y[b, t, o] = sum_i x[b, t, i] * W[b, o, i]   (nn.Linear, W [O, I]).
// Contract: float32, W rows contiguous (row length I). x row t of batch b starts at
// x + b * x_bstride + t * x_stride; y likewise; W of batch b at W + b * w_bstride. The batch axis serves
// the per-head absorbed-MLA products (q_nope @ W_uk, o_lat @ W_uv^T) with no extra kernel.
// Launch: grid (ceil(O / WARPS_PER_BLOCK), T, B), block BLOCK_THREADS; one warp per output element.
// Why a warp per output: at decode (T = 1) the product is a GEMV that only streams W; lanes read
// consecutive floats of one W row (128-byte coalesced loads), accumulate a strided partial sum in a
// fixed order and finish with a butterfly, so the result is deterministic. Simple first: no smem tiling
// (prefill shapes of the golden model are tiny).
#include "common.cuh"

extern "C" __global__ void __launch_bounds__(BLOCK_THREADS, MIN_BLOCKS_PER_SM)
linear_kernel(const float* __restrict__ x, const float* __restrict__ W, float* __restrict__ y,
              int I, int O, int x_stride, int y_stride, long long x_bstride, long long w_bstride,
              long long y_bstride) {
    const int lane = threadIdx.x % WARP_SIZE;
    const int o = blockIdx.x * WARPS_PER_BLOCK + threadIdx.x / WARP_SIZE;
    if (o >= O) return;                                     // whole warp exits together
    const int t = blockIdx.y, b = blockIdx.z;
    const float* xr = x + b * x_bstride + (size_t)t * x_stride;
    const float* wr = W + b * w_bstride + (size_t)o * I;
    float acc = 0.0f;
    for (int i = lane; i < I; i += WARP_SIZE) acc += xr[i] * wr[i];
    acc = warp_sum(acc);
    if (lane == 0) y[b * y_bstride + (size_t)t * y_stride + o] = acc;
}
