// Fast W4A16: INT4 weights x float32 activations on the tensor cores (mma.sync.m16n8k16 bf16, fp32 accumulate).
//   y[t, n] = sum_k x[t, k] * (nibble(n, k) - 8) * scale(n, k / g)          (mode 0: a linear layer)
//   act[t, i] = silu(Wg[i] x[t]) * (Wu[i] x[t])                              (mode 1: fused SwiGLU gate+up)
// Weights are the A operand (16 output rows per m16 tile), activations the B operand (8 tokens per n8 tile):
// at batch <= 8 one mma covers 16 x 16 weights, half the tensor work of putting the tokens on the m side.
//
// Layout (cuda_engine/w4a16_pack.py repacks the bundle's .qw/.sc once at load; docs/cuda-engine.md):
// [E, Nb, G, 144] int32: Nb blocks of 32 output rows (2 m16 tiles), G groups of 32 input columns, one
// 576-byte chunk per (block, group): 512 bytes of weights, then 64 bytes of bf16 scales.
//   weights: lane l holds words [mt0 k0..15, mt0 k16..31, mt1 k0..15, mt1 k16..31] at bytes 16 l: one
//            16-byte load gives the lane its four A fragments (a0..a3 per m16k16 tile). Word nibble j
//            (j = 0..3) and j + 4 are the low and high bf16 of fragment register a_j, so
//            ((w >> 4 j) & 0x000F000F) | 0x43004300 is the bf16 pair (128 + u) and one bf16x2 subtract of
//            136 gives q = u - 8 exactly (dequantization in registers, two instructions per two weights).
//   scales:  bf16 at [g * 4 + {mt0 row g, mt0 row g + 8, mt1 row g, mt1 row g + 8}], g = lane / 4: the rows
//            of the lane's C fragment; 8 bytes per lane.
// Mode 1 packs gate rows 16 b .. 16 b + 15 as block b's mt0 and the same up rows as its mt1, so a lane holds
// the gate and up sums of one output at the same fragment position.
//
// Numerics. TERMS = 3 (FP32-faithful, the default): x = x1 + x2 + x3 with x1 = bf16(x), x2 = bf16(x - x1),
// x3 = bf16(x - x1 - x2) (each subtraction exact in fp32; the three terms hold float32's 24 bits); three mma's
// per k-step on the same weight fragment into one fp32 accumulator per group of 32 columns, in ascending
// magnitude (x3 of both k-steps, x2, then x1: the tensor core aligns a sum to its largest term and truncates,
// so a small term never goes into an accumulator already holding a large sum); then the group's scale
// multiplies the group sum in fp32 and it joins the running fp32 sum.
// q * x_i is exact in the tensor core (4 x 8 bits), so the result is float32-accurate. TERMS = 1: one mma on
// x rounded to bf16 (Marlin's numerics), for the benchmark only.
//
// Work split: block = W4A16_WARPS warps, warp w streams block b = blockIdx.x * W4A16_WARPS + w over the groups
// [ky G / ks, (ky + 1) G / ks) of split ky = blockIdx.y (split-K, so that every SM streams at batch 1).
// Each warp runs its own cp.async pipeline of W4A16_STAGES chunks in shared memory (a lane copies the 16
// bytes it will read itself; lanes 0..3 copy the scales). The warps of a block share the split's columns:
// the block splits x into its bf16 terms once and stages them in shared memory (W4A16_XS_WORDS, segment by
// segment when the columns do not fit), while the weight stream is already in flight. With ks > 1 each block writes fp32 partials
// [z, ky, M, Nb * 32]; the last block of a column range to finish (a ticket per (z, blockIdx.x), reset by
// that block) adds them in split order and applies the epilogue: deterministic, no float atomics.
// blockIdx.z: with slot_ids, (token, slot) pair z of the MoE decode path (M = 1): expert
// slot_ids[ts] - e_base, x row t (x_by_slot = 0, the gate+up input) or ts (x_by_slot = 1, the down input),
// output row ts; without slot_ids z = 0, expert 0, x rows = the M tokens.
// Limits: M <= 8 NT tokens per launch (NT in 1, 2, 4, 8), K a multiple of 32, g a multiple of 32.
#include "common.cuh"
#include <cuda_bf16.h>

#define W4A16_WARPS WARPS_PER_BLOCK          // BLOCK_THREADS threads per block
#define W4A16_STAGES 6
#define W4A16_XS_WORDS 4096                 // 16 KB of staged activations (bf16 terms) per block
#define W4A16_CHUNK_WORDS 144

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
    const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

__device__ __forceinline__ void mma_bf16(float* c, const unsigned* a, const unsigned* b) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

__device__ __forceinline__ unsigned bf2_bits(__nv_bfloat162 h) { return *reinterpret_cast<unsigned*>(&h); }

// nibbles j and j + 4 of w -> bf16 pair (q_lo, q_hi), q = u - 8, exact
__device__ __forceinline__ unsigned dequant2(unsigned w) {
    unsigned v = (w & 0x000F000Fu) | 0x43004300u;                      // bf16 128 + u
    __nv_bfloat162 h = *reinterpret_cast<__nv_bfloat162*>(&v);
    return bf2_bits(__hsub2(h, __floats2bfloat162_rn(136.0f, 136.0f)));  // exact: small integers
}

// sum over y = 0 .. ks-1 of p[y * stride], in split order, eight loads in flight (L2: other blocks wrote them)
__device__ __forceinline__ float split_sum(const float* p, size_t stride, int ks) {
    float sum = 0.0f;
    for (int y0 = 0; y0 < ks; y0 += 8) {
        float v[8];
#pragma unroll
        for (int j = 0; j < 8; ++j) v[j] = y0 + j < ks ? __ldcg(p + (y0 + j) * stride) : 0.0f;
#pragma unroll
        for (int j = 0; j < 8; ++j) sum += v[j];
    }
    return sum;
}

template <int NT, int TERMS>
__device__ __forceinline__ void w4a16_mma_body(const float* __restrict__ x, int x_stride, const int* __restrict__ wq,
                                               const int* __restrict__ slot_ids, int S, int k0, int nk, int e_base,
                                               int x_by_slot, int M, int N, int Nb, int G, int ks,
                                               float* __restrict__ out, int out_stride, float* __restrict__ partials,
                                               int* __restrict__ tickets, int mode) {
    __shared__ __align__(16) int smem[W4A16_WARPS][W4A16_STAGES][W4A16_CHUNK_WORDS];
    __shared__ __align__(16) unsigned xs[W4A16_XS_WORDS];
    __shared__ int is_last;
    const int warp = threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE, g = lane >> 2, c = lane & 3;
    const int bx = blockIdx.x, ky = blockIdx.y, z = blockIdx.z;
    // WS warps share one block of 32 rows (groups dealt round-robin, summed in shared memory at the end);
    // the block covers RPB row blocks. NT = 1 (<= 8 tokens): all 8 warps on one row block, so a block reads
    // few partials and many blocks stream at once; NT > 1: 8 row blocks, one warp each.
    constexpr int WS = NT == 1 ? W4A16_WARPS : 1, RPB = W4A16_WARPS / WS;
    const int rb = warp / WS, kw = warp % WS;
    const int b = bx * RPB + rb;
    int e = 0, xrow = 0, orow = 0;
    if (slot_ids != nullptr) {
        const int t = z / nk, ts = t * S + k0 + z % nk;
        e = slot_ids[ts] - e_base;
        xrow = x_by_slot ? ts : t;
        orow = ts;
    }
    const float* xb = x + (size_t)xrow * x_stride;
    float* ob = out + (size_t)orow * out_stride;
    const int g0 = (int)((long long)ky * G / ks), g1 = (int)((long long)(ky + 1) * G / ks);

    float acc[2][NT][4];
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int q = 0; q < 4; ++q) acc[mt][nt][q] = 0.0f;

    // x, split into its bf16 terms once per block for the block's columns (all its warps share the split's
    // column range), staged segment by segment in fragment order: for token tok, group i of the segment and
    // lane column c, the TW = 4 TERMS words xs[tok * xrs + (4 i + c) TW + 4 t + 2 kk + r] are the B fragment
    // registers (term t, k-step kk, register r) = bf16 pair of columns 32 i + 16 kk + 8 r + 2 c, + 1: one
    // 16-byte load per term. xrs pads a token's row so the 8 lanes of a 16-byte load phase hit distinct banks.
    const int n = g1 - g0;
    constexpr int TW = 4 * TERMS;
    const int seg = max(1, (W4A16_XS_WORDS / M - 16) / (4 * TW));
    const int xrs = 4 * TW * seg + ((4 * TW * seg) % 32 == 0 ? 16 : 0);
    const bool active = b < Nb;
    const int nw = n > kw ? (n - kw + WS - 1) / WS : 0;    // this warp's groups: kw + j WS, j < nw
    const int* src = wq + (((size_t)e * Nb + (active ? b : 0)) * G + g0 + kw) * W4A16_CHUNK_WORDS;
    int* sw = &smem[warp][0][0];
    auto issue = [&](int j) {
        const int* s = src + (size_t)j * WS * W4A16_CHUNK_WORDS;
        int* d = sw + (j % W4A16_STAGES) * W4A16_CHUNK_WORDS;
        cp_async16(d + lane * 4, s + lane * 4);
        if (lane < 4) cp_async16(d + 128 + lane * 4, s + 128 + lane * 4);
    };
#pragma unroll
    for (int j = 0; j < W4A16_STAGES - 1; ++j) {           // the weight stream starts before x is staged
        if (active && j < nw) issue(j);
        cp_async_commit();
    }
    int j = 0;
    for (int s0 = 0; s0 < n; s0 += seg) {
        const int s1 = min(n, s0 + seg), pairs = 16 * (s1 - s0);
        __syncthreads();                                   // every warp is done with the previous segment
        for (int idx = threadIdx.x; idx < M * pairs; idx += blockDim.x) {
            const int tok = idx / pairs, p = idx % pairs;
            float2 v = __ldg(reinterpret_cast<const float2*>(xb + (size_t)tok * x_stride + (g0 + s0) * 32 + 2 * p));
#pragma unroll
            for (int t = 0; t < TERMS; ++t) {              // x -> bf16 terms, largest first
                const __nv_bfloat162 h = __floats2bfloat162_rn(v.x, v.y);
                xs[tok * xrs + (4 * (p >> 4) + (p & 3)) * TW + 4 * t + 2 * ((p >> 3) & 1) + ((p >> 2) & 1)] = bf2_bits(h);
                const float2 f = __bfloat1622float2(h);
                v.x -= f.x;                                // exact: the rounding error of a float
                v.y -= f.y;
            }
        }
        __syncthreads();
        if (!active) continue;
        for (; j < nw && kw + j * WS < s1; ++j) {
            const int i = kw + j * WS;                     // the group, relative to g0
            __syncwarp();                                  // every lane has read the stage issue() refills
            if (j + W4A16_STAGES - 1 < nw) issue(j + W4A16_STAGES - 1);
            cp_async_commit();
            cp_async_wait<W4A16_STAGES - 1>();             // chunk j has landed
            __syncwarp();
            const int* st = sw + (j % W4A16_STAGES) * W4A16_CHUNK_WORDS;
            const int4 wv = *reinterpret_cast<const int4*>(st + lane * 4);
            const uint2 sv = *reinterpret_cast<const uint2*>(st + 128 + g * 2);
            const unsigned w[4] = {(unsigned)wv.x, (unsigned)wv.y, (unsigned)wv.z, (unsigned)wv.w};
            unsigned a[2][2][4];                           // [mt][k-step][fragment register]
#pragma unroll
            for (int mt = 0; mt < 2; ++mt)
#pragma unroll
                for (int kk = 0; kk < 2; ++kk)
#pragma unroll
                    for (int j = 0; j < 4; ++j) a[mt][kk][j] = dequant2(w[mt * 2 + kk] >> (4 * j));
            const float s[2][2] = {{__uint_as_float(sv.x << 16), __uint_as_float(sv.x & 0xFFFF0000u)},
                                   {__uint_as_float(sv.y << 16), __uint_as_float(sv.y & 0xFFFF0000u)}};
            const uint4* xf = reinterpret_cast<const uint4*>(xs + (4 * (i - s0) + c) * TW);
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
                const int tok = nt * 8 + g;                // the B fragment's token (column)
                unsigned bf[TERMS][2][2];                  // [term][k-step][register]: pairs kk 8 + 4 r
#pragma unroll
                for (int t = 0; t < TERMS; ++t) {
                    const uint4 v = tok < M ? xf[(tok * xrs) / 4 + t] : make_uint4(0u, 0u, 0u, 0u);
                    bf[t][0][0] = v.x, bf[t][0][1] = v.y, bf[t][1][0] = v.z, bf[t][1][1] = v.w;
                }
                // The tensor core aligns a sum to its largest term and truncates, so the group's terms go into
                // its accumulator in ascending magnitude: x3 and x2 of both k-steps, then x1 of both.
                float cg[2][4] = {{0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}};
#pragma unroll
                for (int t = TERMS - 1; t >= 0; --t)
#pragma unroll
                    for (int kk = 0; kk < 2; ++kk)
#pragma unroll
                        for (int mt = 0; mt < 2; ++mt) mma_bf16(cg[mt], a[mt][kk], bf[t][kk]);
#pragma unroll
                for (int mt = 0; mt < 2; ++mt)
#pragma unroll
                    for (int q = 0; q < 4; ++q) acc[mt][nt][q] = fmaf(s[mt][q >> 1], cg[mt][q], acc[mt][nt][q]);
            }
        }
    }
    cp_async_wait<0>();
    bool writer = active;
    if (WS > 1) {                                          // the WS warps of a row block: sum in warp order
        __syncthreads();                                   // every warp is done with its pipeline stages
        float* red = reinterpret_cast<float*>(&smem[0][0][0]);   // [warp][2 NT 4][lane]: 8 NT KB
#pragma unroll
        for (int mt = 0; mt < 2; ++mt)
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                for (int q = 0; q < 4; ++q) red[((warp * 2 + mt) * NT * 4 + nt * 4 + q) * WARP_SIZE + lane] = acc[mt][nt][q];
        __syncthreads();
        writer = active && kw == 0;
        if (writer) {
#pragma unroll
            for (int mt = 0; mt < 2; ++mt)
#pragma unroll
                for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                    for (int q = 0; q < 4; ++q) {
                        float sum = 0.0f;
                        for (int w = 0; w < WS; ++w) sum += red[(((rb * WS + w) * 2 + mt) * NT * 4 + nt * 4 + q) * WARP_SIZE + lane];
                        acc[mt][nt][q] = sum;
                    }
        }
    }

    const int Nb32 = Nb * 32;
    if (ks == 1) {                                         // the epilogue straight from the fragments
        if (!writer) return;
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int q = 0; q < 4; ++q) {
                const int tok = nt * 8 + 2 * c + (q & 1), r = g + (q >> 1) * 8;
                if (tok >= M) continue;
                if (mode == 0) {
                    if (b * 32 + r < N) ob[(size_t)tok * out_stride + b * 32 + r] = acc[0][nt][q];
                    if (b * 32 + 16 + r < N) ob[(size_t)tok * out_stride + b * 32 + 16 + r] = acc[1][nt][q];
                } else if (b * 16 + r < N) {
                    ob[(size_t)tok * out_stride + b * 16 + r] = silu(acc[0][nt][q]) * acc[1][nt][q];
                }
            }
        return;
    }
    float* part = partials + ((size_t)z * ks + ky) * M * Nb32;
    if (writer) {
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int q = 0; q < 4; ++q) {
                const int tok = nt * 8 + 2 * c + (q & 1), r = g + (q >> 1) * 8;
                if (tok >= M) continue;
                part[(size_t)tok * Nb32 + b * 32 + r] = acc[0][nt][q];
                part[(size_t)tok * Nb32 + b * 32 + 16 + r] = acc[1][nt][q];
            }
    }
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) is_last = atomicAdd(&tickets[z * gridDim.x + bx], 1) == ks - 1;
    __syncthreads();
    if (!is_last) return;
    __threadfence();
    const float* p0 = partials + (size_t)z * ks * M * Nb32;
    const size_t pstride = (size_t)M * Nb32;
    const int rows = RPB * 32;
    if (mode == 0) {
        for (int idx = threadIdx.x; idx < M * rows; idx += blockDim.x) {
            const int tok = idx / rows, n = bx * rows + idx % rows;
            if (n >= N) continue;
            ob[(size_t)tok * out_stride + n] = split_sum(p0 + (size_t)tok * Nb32 + n, pstride, ks);
        }
    } else {
        for (int idx = threadIdx.x; idx < M * rows / 2; idx += blockDim.x) {
            const int tok = idx / (rows / 2), jj = idx % (rows / 2), bl = bx * RPB + jj / 16, j = jj % 16;
            if (bl >= Nb || bl * 16 + j >= N) continue;
            const float* pr = p0 + (size_t)tok * Nb32 + bl * 32 + j;
            ob[(size_t)tok * out_stride + bl * 16 + j] = silu(split_sum(pr, pstride, ks)) * split_sum(pr + 16, pstride, ks);
        }
    }
    if (threadIdx.x == 0) tickets[z * gridDim.x + bx] = 0;    // ready for the next launch (graph replays)
}

#define W4A16_ARGS                                                                                               \
    const float *__restrict__ x, int x_stride, const int *__restrict__ wq, const int *__restrict__ slot_ids, int S, \
        int k0, int nk, int e_base, int x_by_slot, int M, int N, int Nb, int G, int ks, float *__restrict__ out,   \
        int out_stride, float *__restrict__ partials, int *__restrict__ tickets, int mode
#define W4A16_PASS x, x_stride, wq, slot_ids, S, k0, nk, e_base, x_by_slot, M, N, Nb, G, ks, out, out_stride, partials, \
                   tickets, mode

// One entry per (tokens per launch, numerics): w4a16_mma_t<TERMS>_n<NT>, M <= 8 NT. Two blocks per SM (<= 128
// registers) for NT <= 2 (and t1_n4); t3_n4 and NT = 8 get the registers of one block per SM (no spills).
extern "C" __global__ void __launch_bounds__(BLOCK_THREADS, 2)
w4a16_mma_t3_n1(W4A16_ARGS) { w4a16_mma_body<1, 3>(W4A16_PASS); }
extern "C" __global__ void __launch_bounds__(BLOCK_THREADS, 2)
w4a16_mma_t3_n2(W4A16_ARGS) { w4a16_mma_body<2, 3>(W4A16_PASS); }
extern "C" __global__ void __launch_bounds__(BLOCK_THREADS, 1)
w4a16_mma_t3_n4(W4A16_ARGS) { w4a16_mma_body<4, 3>(W4A16_PASS); }
extern "C" __global__ void __launch_bounds__(BLOCK_THREADS, 1)
w4a16_mma_t3_n8(W4A16_ARGS) { w4a16_mma_body<8, 3>(W4A16_PASS); }
extern "C" __global__ void __launch_bounds__(BLOCK_THREADS, 2)
w4a16_mma_t1_n1(W4A16_ARGS) { w4a16_mma_body<1, 1>(W4A16_PASS); }
extern "C" __global__ void __launch_bounds__(BLOCK_THREADS, 2)
w4a16_mma_t1_n2(W4A16_ARGS) { w4a16_mma_body<2, 1>(W4A16_PASS); }
extern "C" __global__ void __launch_bounds__(BLOCK_THREADS, 2)
w4a16_mma_t1_n4(W4A16_ARGS) { w4a16_mma_body<4, 1>(W4A16_PASS); }
extern "C" __global__ void __launch_bounds__(BLOCK_THREADS, 1)
w4a16_mma_t1_n8(W4A16_ARGS) { w4a16_mma_body<8, 1>(W4A16_PASS); }

// The benchmark's floor (kdtr bench w4a16): read n16 16-byte words once (grid-stride, 16-byte loads that skip
// L1), the same bytes a W4A16 launch streams; one store per thread only if an impossible XOR shows up, so
// the loads cannot be optimised away. Launch: grid (enough blocks to fill the GPU), block BLOCK_THREADS.
extern "C" __global__ void __launch_bounds__(BLOCK_THREADS, MIN_BLOCKS_PER_SM)
stream_read_kernel(const int4* __restrict__ src, long long n16, int* __restrict__ out) {
    int acc = 0;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n16; i += (long long)gridDim.x * blockDim.x) {
        const int4 v = __ldcg(src + i);
        acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    if (acc == 0x7ead1e55) out[0] = acc;
}
