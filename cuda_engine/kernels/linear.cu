// Every dense projection: y[b, t, o] = sum_i x[b, t, i] * W[b, o, i]   (nn.Linear, W [O, I]), four kernels:
//   linear_kernel / linear_bf16_kernel: one row (T = 1, the decode step's GEMV), float32 or bf16 W;
//   linear_rows_kernel: T >= 2 rows with float32 W (CudaEngine(dense="float32")), 8 rows per warp, each row the
//     bits linear_kernel gives it;
//   linear_mma_bf16_kernel / linear_mma_bf16_few_kernel: T >= 9 / 2 .. 8 rows with bf16 W (the engine's default
//     for weights a bundle stores as bf16), on the tensor cores, FP32-faithful (below).
// Contract: float32 x and y; W float32 or bf16 bits (widened exactly, common.cuh wval), W rows contiguous (row
// length I), except the two mma kernels', which read W tiled (below). x row t of batch b starts at
// x + b * x_bstride + t * x_stride; y likewise; W of batch b at W + b * w_bstride. The batch axis serves per-head
// products with no extra kernel.
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

// linear_mma_bf16_kernel / linear_mma_bf16_few_kernel: the product for T >= 2 rows with bf16 weights (K2.6's
// dense weights as stored), on the tensor cores, FP32-faithful: each x element is split exactly into three bf16
// terms (tensor_core.cuh, split3) and W (exact in bf16) multiplies each, so every product W x_j is exact in
// float32 and summed in float32; nothing is dropped. Why: linear_rows_kernel is bound by issuing a float32 load
// and multiply-add per (row, element): at K2.6's o_proj (8192 -> 7168) a 5-row verify took 4x the one-row GEMV,
// a 33-row one 19x.
// Roles: M = outputs (W rows, the mma's A, row-major), N = x rows (the mma's B: x [row][k] is B column-major).
// Block (256 threads): MT m16 tiles of outputs x NT n8 tiles of rows; its 8 warps split the k steps of 32 into 8
// contiguous ranges and the block adds their results in warp order (shared memory). Two instances:
//   linear_mma_bf16_kernel (MT = 2, NT = 2: 32 outputs x 16 rows) from 9 rows on;
//   linear_mma_bf16_few_kernel (MT = 1, NT = 1: 16 outputs x 8 rows) for 2 .. 8 rows (a small tree's verify):
//     there W's bytes decide the time, so half the mma (no padding rows past 8) and twice the blocks (K2.6's
//     qkv_a, 2112 outputs, filled 66 of 132 SMs with 32-output blocks).
// Every output's sum is the same in both (per warp the same k range, the same mma sequence per 32 k, the warps
// added in the same order; an output element of an mma depends on its own row and column alone), so the two
// give the same bits for a row (tests/test_cuda_kernels.py).
// W comes tiled (ops.py, tile_bf16; the engine keeps it beside the row-major copy the one-row GEMV reads): per 16
// outputs (an m tile, zero rows past O) and per 32 k (a step, zeros past I) one 16 x 32 block, row-major, 1 KB,
// the steps of a tile consecutive: [ceil(O / 16)][ceil(I / 32)][16][32] bf16 per batch. Lane (g, c) = (lane / 4,
// lane % 4) loads 8 consecutive k (16 bytes of W, 32 of x) at 32 s + 8 c of rows g and g + 8: the mma's k slots
// 2c, 2c+1 / 2c+8, 2c+9 take physical k 8c + {0,1} / {2,3} in the first mma of the step and 8c + {4,5} / {6,7}
// in the second; A and B use the same map, so the sum is over every k once. In the tiled layout each of a warp's
// two W loads a step reads 512 contiguous bytes (rows g and g + 8 at their k), and a warp's k range is one
// contiguous run: row-major, the same loads touched 8 rows 64 bytes each. Measured on the H200 at K2.6's shapes,
// 5 rows, each launch alone over weights larger than L2: o_proj 60.8 -> 47.5 us (1.93 -> 2.47 TB/s), qkv_a 19.8 ->
// 15.9, q_b 19.8 -> 17.2, the router gate 18.3 -> 14.4; 17 rows (linear_mma_bf16_kernel) o_proj 146 -> 112 us;
// the same bits (docs/cuda-engine.md, "Stop 45").
// Each warp keeps its next steps' W and x in flight while it multiplies (a ring of D steps in registers, loaded D
// steps ahead): LMMA_DEPTH for the full tiles, LMMA_FEW_DEPTH for the few-rows one (row-major, D = 1 -> 4 took
// qkv_a from 27.8 to 20.0 us; D = 8 spilled and was slower).
// Per 32 k: hi (x0 W) starts afresh and is added to tot (rounded); lo (x1 W + x2 W) runs; the warp's result is
// tot + lo (tensor_core.cuh says why). Fixed order throughout: the same bits every run.
// Launch: grid (ceil(O / (16 MT)), ceil(T / (8 NT)), B), block BLOCK_THREADS.
#define LMMA_OUT 32                            // linear_mma_bf16_kernel: outputs per block
#define LMMA_ROWS 16                           // and x rows per block
#define LMMA_FEW_OUT 16                        // linear_mma_bf16_few_kernel: outputs per block
#define LMMA_FEW_ROWS 8                        // and x rows per block (the most rows it is launched for)
#define LMMA_DEPTH 2                           // and steps in flight per warp
#define LMMA_FEW_DEPTH 4                       // and steps in flight per warp
#define LMMA_TILE_ELEMS 512                    // bf16 per tiled 16 x 32 block of W (ops.py: LMMA_TILE)
static_assert(LMMA_OUT == 32 && LMMA_ROWS == 16 && LMMA_FEW_OUT == 16 && LMMA_FEW_ROWS == 8 && WARPS_PER_BLOCK == 8,
              "linear_mma's m16 tiles, n8 tiles and 8-warp k split assume these (ops.py too)");

// One step's operands as loaded: W of the warp's MT m tiles (rows g, g + 8 of each) and x[k .. k + 7] of its NT
// n tiles' row g (zeros past I and for rows past T).
template <int MT, int NT>
struct LmmaStep {
    unsigned w[MT][2][4];
    float x[NT][8];
};

template <int MT, int NT>
__device__ __forceinline__ void lmma_load(LmmaStep<MT, NT>& st, const bf16_t* const (&wt)[MT], const float* const (&xrow)[NT],
                                          const bool (&xok)[NT], int s, int k, int I) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {                          // rows h 8 + g: 512 contiguous bytes a warp
            const uint4 v = __ldg(reinterpret_cast<const uint4*>(wt[mt] + (size_t)s * LMMA_TILE_ELEMS + h * 256));
            st.w[mt][h][0] = v.x; st.w[mt][h][1] = v.y; st.w[mt][h][2] = v.z; st.w[mt][h][3] = v.w;
        }
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) load8(xok[nt] ? xrow[nt] + k : xrow[nt], xok[nt] ? I - k : 0, st.x[nt]);
}

// One 32-k step's products: x's terms split, then per m tile and n tile lo += x2 W + x1 W and hi = x0 W, tot += hi.
template <int MT, int NT>
__device__ __forceinline__ void lmma_step(const LmmaStep<MT, NT>& st, float (&tot)[MT][NT][4], float (&lo)[MT][NT][4]) {
    unsigned xt[NT][3][4];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
        uint4 u[3];
        split3_x8(st.x[nt], u);
#pragma unroll
        for (int i = 0; i < 3; ++i) {
            xt[nt][i][0] = u[i].x;
            xt[nt][i][1] = u[i].y;
            xt[nt][i][2] = u[i].z;
            xt[nt][i][3] = u[i].w;
        }
    }
    float hi[MT][NT][4] = {};
#pragma unroll
    for (int half = 0; half < 2; ++half)                       // the step's two mma k slots: regs 2 half, +1
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            const unsigned a[4] = {st.w[mt][0][2 * half], st.w[mt][1][2 * half], st.w[mt][0][2 * half + 1],
                                   st.w[mt][1][2 * half + 1]};
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
                mma_bf16(lo[mt][nt], a, &xt[nt][2][2 * half]);
                mma_bf16(lo[mt][nt], a, &xt[nt][1][2 * half]);
                mma_bf16(hi[mt][nt], a, &xt[nt][0][2 * half]);
            }
        }
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int i = 0; i < 4; ++i) tot[mt][nt][i] += hi[mt][nt][i];
}

template <int MT, int NT, int D>
__device__ __forceinline__ void lmma_body(const float* __restrict__ x, const bf16_t* __restrict__ W,
                                          float* __restrict__ y, int T, int I, int O, int x_stride, int y_stride,
                                          long long x_bstride, long long w_bstride, long long y_bstride) {
    __shared__ float red[WARPS_PER_BLOCK][MT][NT][4][WARP_SIZE];   // [warp][m tile][n tile][element][lane]
    const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE, g = lane / 4, c = lane % 4;
    const int o0 = blockIdx.x * (16 * MT), t0 = blockIdx.y * (8 * NT), b = blockIdx.z;
    const float* xb = x + b * x_bstride;
    const bf16_t* wb = W + b * w_bstride;
    const int steps = (I + 31) / 32, tiles = (O + 15) / 16;
    const bf16_t* wt[MT];                                       // [m tile]: its first step's 16 x 32, at this lane's 8
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)                             // (a last block's tile past O: the last tile, not stored)
        wt[mt] = wb + (size_t)min(o0 / 16 + mt, tiles - 1) * steps * LMMA_TILE_ELEMS + lane * 8;
    const float* xrow[NT];
    bool xok[NT];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
        const int t = t0 + nt * 8 + g;
        xok[nt] = t < T;
        xrow[nt] = xb + (size_t)min(t, T - 1) * x_stride;
    }
    const int s_lo = warp * steps / WARPS_PER_BLOCK, s_hi = (warp + 1) * steps / WARPS_PER_BLOCK;
    float tot[MT][NT][4] = {}, lo[MT][NT][4] = {};
    LmmaStep<MT, NT> buf[D];                                    // a ring: step s in buf[(s - s_lo) % D]
#pragma unroll
    for (int j = 0; j < D; ++j)
        if (s_lo + j < s_hi) lmma_load(buf[j], wt, xrow, xok, s_lo + j, (s_lo + j) * 32 + 8 * c, I);
    for (int s0 = s_lo; s0 < s_hi; s0 += D)
#pragma unroll
        for (int j = 0; j < D; ++j) {
            const int s = s0 + j;
            if (s >= s_hi) break;
            lmma_step(buf[j], tot, lo);
            if (s + D < s_hi) lmma_load(buf[j], wt, xrow, xok, s + D, (s + D) * 32 + 8 * c, I);   // D steps ahead
        }
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int i = 0; i < 4; ++i) red[warp][mt][nt][i][lane] = tot[mt][nt][i] + lo[mt][nt][i];
    __syncthreads();
    for (int e = threadIdx.x; e < MT * NT * 4 * WARP_SIZE; e += BLOCK_THREADS) {   // (mt, nt, i, lane) of the tile
        const int l = e % WARP_SIZE, i = (e / WARP_SIZE) % 4, nt = (e / (4 * WARP_SIZE)) % NT,
                  mt = e / (4 * NT * WARP_SIZE);
        float v = 0.0f;
#pragma unroll
        for (int w2 = 0; w2 < WARPS_PER_BLOCK; ++w2) v += red[w2][mt][nt][i][l];
        const int o = o0 + mt * 16 + l / 4 + (i / 2) * 8, t = t0 + nt * 8 + (l % 4) * 2 + i % 2;
        if (o < O && t < T) y[b * y_bstride + (size_t)t * y_stride + o] = v;
    }
}

#define LMMA_ARGS const float* __restrict__ x, const bf16_t* __restrict__ W, float* __restrict__ y, int T, int I, \
    int O, int x_stride, int y_stride, long long x_bstride, long long w_bstride, long long y_bstride
extern "C" __global__ void __launch_bounds__(BLOCK_THREADS, MIN_BLOCKS_PER_SM) linear_mma_bf16_kernel(LMMA_ARGS) {
    AFTER_PREVIOUS_GRID();
    lmma_body<LMMA_OUT / 16, LMMA_ROWS / 8, LMMA_DEPTH>(x, W, y, T, I, O, x_stride, y_stride, x_bstride, w_bstride, y_bstride);
}
extern "C" __global__ void __launch_bounds__(BLOCK_THREADS, MIN_BLOCKS_PER_SM) linear_mma_bf16_few_kernel(LMMA_ARGS) {
    AFTER_PREVIOUS_GRID();
    lmma_body<LMMA_FEW_OUT / 16, LMMA_FEW_ROWS / 8, LMMA_FEW_DEPTH>(x, W, y, T, I, O, x_stride, y_stride, x_bstride, w_bstride,
                                                    y_bstride);
}
