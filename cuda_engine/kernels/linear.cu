// Every dense projection: y[b, t, o] = sum_i x[b, t, i] * W[b, o, i]   (nn.Linear, W [O, I]), three kernels:
//   linear_kernel / linear_bf16_kernel: one row (T = 1, the decode step's GEMV), float32 or bf16 W;
//   linear_rows_kernel: T >= 2 rows with float32 W (CudaEngine(dense="float32")), 8 rows per warp, each row the
//     bits linear_kernel gives it;
//   linear_mma_bf16_kernel: T >= 2 rows with bf16 W (the engine's default for weights a bundle stores as bf16),
//     on the tensor cores, FP32-faithful (below).
// Contract: float32 x and y; W float32 or bf16 bits (widened exactly, common.cuh wval), W rows contiguous (row
// length I). x row t of batch b starts at x + b * x_bstride + t * x_stride; y likewise; W of batch b at
// W + b * w_bstride. The batch axis serves per-head products with no extra kernel.
// linear_kernel: grid (ceil(O / WARPS_PER_BLOCK), T, B), block BLOCK_THREADS; one warp per output element.
// Why a warp per output: at decode (T = 1) the product is a GEMV that only streams W; lanes read
// consecutive elements of one W row (coalesced loads), accumulate a strided partial sum in a fixed order and
// finish with a butterfly, so the result is deterministic.
#include "common.cuh"
#include "tensor_core.cuh"

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
    AFTER_PREVIOUS_GRID();
    linear_body(x, W, y, I, O, x_stride, y_stride, x_bstride, w_bstride, y_bstride);
}
extern "C" __global__ void __launch_bounds__(BLOCK_THREADS, MIN_BLOCKS_PER_SM) linear_bf16_kernel(LINEAR_ARGS(bf16_t)) {
    AFTER_PREVIOUS_GRID();
    linear_body(x, W, y, I, O, x_stride, y_stride, x_bstride, w_bstride, y_bstride);
}

// linear_rows_kernel: the same product for T >= 2 rows with float32 weights (bf16 ones: linear_mma_bf16_kernel;
// the body stays a template over WT, one instance) (prefill, a tree verify, the drafter's block), where
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
    AFTER_PREVIOUS_GRID();
    linear_rows_body(x, W, y, T, I, O, x_stride, y_stride, x_bstride, w_bstride, y_bstride);
}

// linear_mma_bf16_kernel: the product for T >= 2 rows with bf16 weights (K2.6's dense weights as stored), on the
// tensor cores, FP32-faithful: each x element is split exactly into three bf16 terms (tensor_core.cuh, split3) and
// W (exact in bf16) multiplies each, so every product W x_j is exact in float32 and summed in float32; nothing
// is dropped. Why: linear_rows_kernel is bound by issuing a float32 load and multiply-add per (row, element):
// at K2.6's o_proj (8192 -> 7168) a 5-row verify took 4x the one-row GEMV, a 33-row one 19x.
// Roles: M = outputs (W rows, the mma's A, row-major), N = x rows (the mma's B: x [row][k] is B column-major).
// Block (256 threads): 32 outputs (two m16 tiles) x 16 rows (two n8 tiles); its 8 warps split the k steps of
// 32 into 8 contiguous ranges and the block adds their results in warp order (shared memory).
// Lane (g, c) = (lane / 4, lane % 4) loads 8 consecutive k (16 bytes of W, 32 of x) at 32 s + 8 c of rows g and
// g + 8: the mma's k slots 2c, 2c+1 / 2c+8, 2c+9 take physical k 8c + {0,1} / {2,3} in the first mma of the
// step and 8c + {4,5} / {6,7} in the second; A and B use the same map, so the sum is over every k once.
// Per 32 k: hi (x0 W) starts afresh and is added to tot (rounded); lo (x1 W + x2 W) runs; the warp's result is
// tot + lo (tensor_core.cuh says why). Fixed order throughout: the same bits every run.
// Launch: grid (ceil(O / 32), ceil(T / 16), B), block BLOCK_THREADS.
#define LMMA_OUT 32                            // outputs per block
#define LMMA_ROWS 16                           // x rows per block
static_assert(LMMA_OUT == 32 && LMMA_ROWS == 16 && WARPS_PER_BLOCK == 8,
              "linear_mma_bf16_kernel's two m16 tiles, two n8 tiles and 8-warp k split assume these (ops.py too)");

__device__ __forceinline__ void lmma_load_w(const bf16_t* __restrict__ row, int k, int I, bool ok, unsigned (&w)[4]) {
    if (ok && k + 8 <= I && ((reinterpret_cast<size_t>(row + k) & 15) == 0)) {
        const uint4 v = __ldg(reinterpret_cast<const uint4*>(row + k));
        w[0] = v.x; w[1] = v.y; w[2] = v.z; w[3] = v.w;
        return;
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        const unsigned lo = (ok && k + 2 * j < I) ? row[k + 2 * j] : 0u;
        const unsigned hi = (ok && k + 2 * j + 1 < I) ? row[k + 2 * j + 1] : 0u;
        w[j] = lo | (hi << 16);
    }
}

// x[k .. k + 7] of one row as its three bf16 terms, packed in pairs (t[term][j] = k + 2j, k + 2j + 1)
__device__ __forceinline__ void lmma_load_x(const float* __restrict__ row, int k, int I, bool ok, unsigned (&t)[3][4]) {
    float v[8];
    load8(ok ? row + k : row, ok ? I - k : 0, v);
    uint4 u[3];
    split3_x8(v, u);
#pragma unroll
    for (int i = 0; i < 3; ++i) {
        t[i][0] = u[i].x;
        t[i][1] = u[i].y;
        t[i][2] = u[i].z;
        t[i][3] = u[i].w;
    }
}

extern "C" __global__ void __launch_bounds__(BLOCK_THREADS, MIN_BLOCKS_PER_SM)
linear_mma_bf16_kernel(const float* __restrict__ x, const bf16_t* __restrict__ W, float* __restrict__ y, int T, int I,
                       int O, int x_stride, int y_stride, long long x_bstride, long long w_bstride,
                       long long y_bstride) {
    AFTER_PREVIOUS_GRID();
    __shared__ float red[WARPS_PER_BLOCK][2][2][4][WARP_SIZE];   // [warp][m tile][n tile][element][lane]
    const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE, g = lane / 4, c = lane % 4;
    const int o0 = blockIdx.x * LMMA_OUT, t0 = blockIdx.y * LMMA_ROWS, b = blockIdx.z;
    const float* xb = x + b * x_bstride;
    const bf16_t* wb = W + b * w_bstride;
    const bf16_t* wrow[2][2];                                   // [m tile][row g, row g + 8]
    bool wok[2][2];
    const float* xrow[2];
    bool xok[2];
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int o = o0 + mt * 16 + h * 8 + g;
            wok[mt][h] = o < O;
            wrow[mt][h] = wb + (size_t)min(o, O - 1) * I;
        }
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
        const int t = t0 + nt * 8 + g;
        xok[nt] = t < T;
        xrow[nt] = xb + (size_t)min(t, T - 1) * x_stride;
    }
    const int steps = (I + 31) / 32, s_lo = warp * steps / WARPS_PER_BLOCK, s_hi = (warp + 1) * steps / WARPS_PER_BLOCK;
    float tot[2][2][4] = {}, lo[2][2][4] = {};
    for (int s = s_lo; s < s_hi; ++s) {
        const int k = s * 32 + 8 * c;
        unsigned w[2][2][4], xt[2][3][4];
#pragma unroll
        for (int mt = 0; mt < 2; ++mt)
#pragma unroll
            for (int h = 0; h < 2; ++h) lmma_load_w(wrow[mt][h], k, I, wok[mt][h], w[mt][h]);
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) lmma_load_x(xrow[nt], k, I, xok[nt], xt[nt]);
        float hi[2][2][4] = {};
#pragma unroll
        for (int half = 0; half < 2; ++half)                   // the step's two mma k slots: regs 2 half, +1
#pragma unroll
            for (int mt = 0; mt < 2; ++mt) {
                const unsigned a[4] = {w[mt][0][2 * half], w[mt][1][2 * half], w[mt][0][2 * half + 1],
                                       w[mt][1][2 * half + 1]};
#pragma unroll
                for (int nt = 0; nt < 2; ++nt) {
                    mma_bf16(lo[mt][nt], a, &xt[nt][2][2 * half]);
                    mma_bf16(lo[mt][nt], a, &xt[nt][1][2 * half]);
                    mma_bf16(hi[mt][nt], a, &xt[nt][0][2 * half]);
                }
            }
#pragma unroll
        for (int mt = 0; mt < 2; ++mt)
#pragma unroll
            for (int nt = 0; nt < 2; ++nt)
#pragma unroll
                for (int i = 0; i < 4; ++i) tot[mt][nt][i] += hi[mt][nt][i];
    }
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
#pragma unroll
            for (int i = 0; i < 4; ++i) red[warp][mt][nt][i][lane] = tot[mt][nt][i] + lo[mt][nt][i];
    __syncthreads();
    for (int e = threadIdx.x; e < 2 * 2 * 4 * WARP_SIZE; e += BLOCK_THREADS) {   // (mt, nt, i, lane) of the tile
        const int l = e % WARP_SIZE, i = (e / WARP_SIZE) % 4, nt = (e / (4 * WARP_SIZE)) % 2, mt = e / (8 * WARP_SIZE);
        float v = 0.0f;
#pragma unroll
        for (int w2 = 0; w2 < WARPS_PER_BLOCK; ++w2) v += red[w2][mt][nt][i][l];
        const int o = o0 + mt * 16 + l / 4 + (i / 2) * 8, t = t0 + nt * 8 + (l % 4) * 2 + i % 2;
        if (o < O && t < T) y[b * y_bstride + (size_t)t * y_stride + o] = v;
    }
}
