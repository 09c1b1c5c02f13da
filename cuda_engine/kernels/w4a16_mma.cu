// Fast W4A16: INT4 weights x float32 activations on the tensor cores (mma.sync.m16n8k32 int8 at one token,
// m16n8k16 bf16 from two; fp32 accumulation across groups).
//   y[t, n] = sum_k x[t, k] * (nibble(n, k) - 8) * scale(n, k / g)          (mode 0: a linear layer)
//   act[t, i] = silu(Wg[i] x[t]) * (Wu[i] x[t])                              (mode 1: fused SwiGLU gate+up)
// Weights are the A operand (16 output rows per m16 tile), activations the B operand (8 columns per n8 tile).
//
// Layout (cuda_engine/w4a16_pack.py repacks the bundle's .qw/.sc once at load; docs/cuda-engine.md):
// [E, Nb, G, 144] int32: Nb blocks of 32 output rows (2 m16 tiles), G groups of 32 input columns, one
// 576-byte chunk per (block, group): 512 bytes of weights, then 64 bytes of bf16 scales.
//   weights: lane l (g = l / 4, c = l % 4) holds 4 words at bytes 16 l, one 16-byte load: word 2 mt + p holds
//            8 weights of row 16 mt + g + 8 p, nibble 2 i = column 4 c + i, nibble 2 i + 1 = column
//            16 + 4 c + i, each q mod 16 (q = u - 8, 4-bit two's complement).
//            int8 path: (w << 4) & 0xF0F0F0F0 and w & 0xF0F0F0F0 are the m16n8k32 .s8 A-fragment registers
//            a_p and a_{p+2} holding 16 q, exact (one shift and two ANDs per 8 weights).
//            bf16 path: ((w >> 4 j) & 0x000F000F) ^ 0x00080008 | 0x43004300 (one lop3) is the bf16 pair
//            (128 + u) of nibbles j and j + 4, and one bf16x2 subtract of 136 gives q exactly; register a_r of
//            k-step kk is nibble pair j = 2 kk + r / 2 of word 2 mt + r % 2. Its k index kb (0..15) is group
//            column 16 (kb / 8) + 4 ((kb % 8) / 2) + kk + 2 (kb % 2): the activations are staged in that order.
//   scales:  bf16 at [g * 4 + {mt0 row g, mt0 row g + 8, mt1 row g, mt1 row g + 8}], g = lane / 4: the rows
//            of the lane's C fragment; 8 bytes per lane.
// Mode 1 packs gate rows 16 b .. 16 b + 15 as block b's mt0 and the same up rows as its mt1, so a lane holds
// the gate and up sums of one output at the same fragment position.
//
// Numerics, FP32-faithful (the default): the result is float32-accurate, by one of two exact schemes.
// One token (I8, the int8 digits path; the decode and MoE decode shape): per k split the block finds the largest
// |x| (2^(E-1) <= max < 2^E) and writes X = rn(x 2^(62-E)) (|X| < 2^62: every x within 2^-38 of the largest
// keeps all 24 bits) as eight signed 8-bit digits, X = sum d_i 256^i ((X + 0x8080..80) ^ 0x8080..80 gives them
// bytewise). The digits are the 8 B columns of one n8 tile, so one m16n8k32 .s8 mma per m-tile covers a group:
// 16 q * d summed over the group's 32 columns is exact in int32 (|sum| <= 2^19), converted exactly to float32
// (the magic add below), scaled by the group's scale and summed over groups per digit in fp32; the eight digit
// sums are added at the end, smallest first, times 2^(E-66) (the 16 of 16 q and the 2^(62-E)). Both scalings
// are exact powers of two, applied as two normal factors. A non-finite x makes the outputs NaN.
// From 2 tokens (the bf16 terms path): x = x1 + x2 + x3 with x1 = bf16(x), x2 = bf16(x - x1),
// x3 = bf16(x - x1 - x2) (each subtraction exact in fp32; the three terms hold float32's 24 bits); q * x_i is
// exact in the tensor core (4 x 8 bits). Up to 8 tokens (TCOL) the terms are B columns of their own (column
// n = term n % 3 of token n / 3), each term's group sum is scaled and summed in fp32 on its own, and the
// three sums of a token are added at the end, smallest first. From 9 tokens a column is a token and the three
// terms go into one fp32 accumulator per group, in ascending magnitude (x3 of both k-steps, x2, then x1: the
// tensor core aligns a sum to its largest term and truncates, so a small term never goes into an accumulator
// already holding a large sum), then the group's scale multiplies the group sum in fp32.
// numerics = bf16 (TERMS = 1): one mma on x rounded to bf16 (Marlin's numerics), for the benchmark only.
//
// Work split: block = W4A16_WARPS warps over 8 / WS row blocks (32 rows each); the WS warps of a row block deal
// the groups [ky G / ks, (ky + 1) G / ks) of split ky = blockIdx.y round-robin (split-K, so that every SM
// streams at batch 1) and sum in shared memory, in warp order, at the end. A warp loads its 16 bytes of
// weights and 8 of scales per chunk straight into registers (no shared-memory round trip, no pipeline
// bookkeeping), U chunks per batch, two batches in flight: the one it computes and the next. The block
// splits x into its digits or bf16 terms once and stages them in shared memory in fragment order (W4A16_XS_WORDS,
// segment by segment when the columns do not fit), while the weight stream is already in flight; the 8 / WS row
// blocks share that work (up to 5 FP32-faithful tokens: w4a16_plan.w4a16_rows_plan picks WS per launch shape). At one
// token the exponent pass reads x, and when the split's digits and x fit xs together it keeps x there for the
// staging (x read from L2 once, not twice). With ks > 1
// each block writes fp32 partials [z, ky, M, Nb * 32]; the last block of a column range to finish (a ticket
// per (z, blockIdx.x), reset by that block) adds them in split order and applies the epilogue: deterministic,
// no float atomics.
// blockIdx.z: with slot_ids, (token, slot) pair z of the MoE decode path (M = 1): expert
// slot_ids[ts] - e_base, x row t (x_by_slot = 0, the gate+up input) or ts (x_by_slot = 1, the down input),
// output row ts; without slot_ids z = 0, expert 0, x rows = the M tokens.
// With groups (the grouped MoE path of a forward over several tokens; bf16-terms entries only, slot_ids null):
// z is group z of moe_group_kernel's work list (kernels/moe.cu): groups[0] = the number of groups (z past it
// returns at once), groups[1 + 3 z ..] = (expert + e_base, first pair p, count m <= M), the pairs ts (ts = t S
// + slot) at groups[1 + 3 gridDim.z + p ..]. The z's m tokens are its pairs: token j's x row is ts_j / S (the
// gate+up input, x_by_slot = 0) or ts_j (the down input), its output row ts_j. The only change to the body is
// this indirection: token j's x row and output row are read from zrows[][j] (shared memory) instead of being
// xrow + j and orow + j; M is then the group's count, and the split-K partials keep the launch's M as their
// stride per z.
// Limits: M <= 64 tokens per launch, K a multiple of 32 (G = K / 32 <= 65535), g a multiple of 32.
#include "common.cuh"
#include "tensor_core.cuh"

#define W4A16_WARPS WARPS_PER_BLOCK          // BLOCK_THREADS threads per block
#define W4A16_XS_WORDS 11264                // 44 KB of staged activations per block: at one token (int8 digits:
                                            // 64 words per group) 176 groups per segment, K2.6's 7168 columns
                                            // (224 groups) unsplit in two
#define W4A16_CHUNK_WORDS 144

__device__ __forceinline__ void mma_s8(int* c, const unsigned* a, uint2 b) {
    asm("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
                 : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b.x), "r"(b.y));
}

__device__ __forceinline__ unsigned bf2_bits(__nv_bfloat162 h) { return *reinterpret_cast<unsigned*>(&h); }

// nibbles j and j + 4 of w (q mod 16) -> bf16 pair (q_lo, q_hi), exact
__device__ __forceinline__ unsigned dequant2(unsigned w) {
    unsigned v;                     // bf16 128 + u, u = nibble ^ 8: mask ? (w ^ c) : c with c = 0x43084308, one lop3
    asm("lop3.b32 %0, %1, %2, %3, 0x6A;\n" : "=r"(v) : "r"(w), "r"(0x000F000Fu), "r"(0x43084308u));
    __nv_bfloat162 h = *reinterpret_cast<__nv_bfloat162*>(&v);
    return bf2_bits(__hsub2(h, __floats2bfloat162_rn(136.0f, 136.0f)));  // exact: small integers
}

// sum over y = 0 .. ks-1 of p[y * stride], in split order: eight loads in flight (L2: other blocks wrote them),
// each eight summed as a tree, the eights' sums added in order (adding a zero past ks is exact). Where one
// partial dominates the sum this rounds at log2(8) + ks / 8 steps, not ks.
__device__ __forceinline__ float split_sum(const float* p, size_t stride, int ks) {
    float sum = 0.0f;
    for (int y0 = 0; y0 < ks; y0 += 8) {
        float v[8];
#pragma unroll
        for (int j = 0; j < 8; ++j) v[j] = y0 + j < ks ? __ldcg(p + (y0 + j) * stride) : 0.0f;
        sum += ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7]));
    }
    return sum;
}

// Weights are read once: straight to registers through the non-coherent path, not kept in L1.
__device__ __forceinline__ int4 ld_stream_v4(const int* p) {
    int4 v;
    asm("ld.global.nc.L1::no_allocate.v4.s32 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}
__device__ __forceinline__ uint2 ld_stream_v2(const int* p) {
    uint2 v;
    asm("ld.global.nc.L1::no_allocate.v2.u32 {%0,%1}, [%2];\n" : "=r"(v.x), "=r"(v.y) : "l"(p));
    return v;
}

// One launch configuration: MT tokens at most, TERMS bf16 terms (I8: eight int8 digits instead, TERMS unused),
// CT column tiles of the mma's B operand (8 columns each), TCOL: the terms (digits) are columns of their own
// (column n = token n / TC, term n % TC), else column n = token n and the terms of a group go into one
// accumulator (three mma's per k-step). WS warps split the k range of one block of 32 rows (summed in shared
// memory at the end), the block covers 8 / WS row blocks. U chunks per batch: a warp holds two batches of
// weights in registers (the one it computes, the next one in flight).
template <int MT, int TERMS, bool TCOL, int WS, int U, bool I8>
struct W4Config {
    static constexpr int TC = I8 ? 8 : TCOL ? TERMS : 1;         // B columns per token (I8: its 8 digits)
    static constexpr int CT = (MT * TC + 7) / 8;
    static constexpr int RPB = W4A16_WARPS / WS;
    static constexpr int TW = 4 * TERMS;                         // bf16: staged words per (token, group, lane column)
    static constexpr int COLS = MT * TC < 8 ? MT * TC : 8;       // I8: staged columns per tile (lane g reads g % COLS)
    static constexpr int GW = 8 * COLS * CT;                     // I8: staged words per group
    // the widest token count must still stage one batch of every warp (U WS groups) per segment
    static_assert(I8 ? W4A16_XS_WORDS / GW >= U * WS : ((W4A16_XS_WORDS / MT - 16) / (4 * TW)) >= U * WS,
                  "activation staging too small");
    static_assert(!I8 || TCOL, "int8 digits: the 8 digit columns of a token are one column tile");
};

template <int MT, int TERMS, bool TCOL, int WS, int U, bool I8>
__device__ __forceinline__ void w4a16_mma_body(const float* __restrict__ x, int x_stride, const int* __restrict__ wq,
                                               const int* __restrict__ slot_ids, int S, int k0, int nk, int e_base,
                                               int x_by_slot, int M, int N, int Nb, int G, int ks,
                                               float* __restrict__ out, int out_stride, float* __restrict__ partials,
                                               int* __restrict__ tickets, int mode, const int* __restrict__ groups) {
    using C = W4Config<MT, TERMS, TCOL, WS, U, I8>;
    constexpr int CT = C::CT, RPB = C::RPB, TW = C::TW, TC = C::TC, COLS = C::COLS, GW = C::GW;
    __shared__ __align__(16) unsigned xs[W4A16_XS_WORDS];
    __shared__ int is_last;
    __shared__ unsigned xmax[MT];                                // I8: a token's largest |x| (float bits), this split
    __shared__ float xfac[MT][2];                                // I8: 2^(E-66) in two factors: digit sums -> float
    // after the main loop xs is free: red = one column tile of every warp's accumulators [warp][8][lane];
    // TCOL: colsum = [row block][row][column], the warps summed
    float (*red)[8][WARP_SIZE] = reinterpret_cast<float (*)[8][WARP_SIZE]>(xs);
    float* colsum = reinterpret_cast<float*>(xs) + W4A16_WARPS * 8 * WARP_SIZE;
    static_assert(W4A16_WARPS * 8 * WARP_SIZE + (TCOL ? RPB * 32 * 8 * CT : 0) <= W4A16_XS_WORDS, "epilogue does not fit xs");
    const int warp = threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE, g = lane >> 2, c = lane & 3;
    const int bx = blockIdx.x, ky = blockIdx.y, z = blockIdx.z;
    const int rb = warp / WS, kw = warp % WS;
    const int b = bx * RPB + rb;
    int e = 0, xrow = 0, orow = 0;
    if (slot_ids != nullptr) {
        const int t = z / nk, ts = t * S + k0 + z % nk;
        e = slot_ids[ts] - e_base;
        xrow = x_by_slot ? ts : t;
        orow = ts;
    }
    const int Mz = M;                                           // the launch's tokens per z: the partials' stride
    // token tok's x row and output row (zrows[0][tok], zrows[1][tok]); the one-token entries (the decode path,
    // never grouped) keep xrow and orow
    constexpr bool ONE = MT == 1;
    __shared__ int zrows[2][MT];
    if constexpr (!ONE) {
        if (groups != nullptr) {                               // the grouped MoE path: z is a group of pairs
            if (z >= groups[0]) return;                        // past the work list (block-uniform)
            const int* gz = groups + 1 + 3 * z;
            e = gz[0] - e_base;
            M = gz[2];
            const int* pairs = groups + 1 + 3 * gridDim.z + gz[1];
            for (int tok = threadIdx.x; tok < M; tok += blockDim.x) {
                const int ts = pairs[tok];
                zrows[0][tok] = x_by_slot ? ts : ts / S;
                zrows[1][tok] = ts;
            }
        } else {
            for (int tok = threadIdx.x; tok < MT; tok += blockDim.x) zrows[0][tok] = xrow + tok, zrows[1][tok] = orow + tok;
        }
        __syncthreads();
    }
    auto xrow_of = [&](int tok) -> const float* { return x + (size_t)(ONE ? xrow + tok : zrows[0][tok]) * x_stride; };
    auto orow_of = [&](int tok) -> float* { return out + (size_t)(ONE ? orow + tok : zrows[1][tok]) * out_stride; };
    // the split's groups (32-bit: the wrapper keeps G <= 65535, so ky G fits)
    const int g0 = (int)((unsigned)(ky * G) / (unsigned)ks), g1 = (int)((unsigned)((ky + 1) * G) / (unsigned)ks);
    const int n = g1 - g0;
    const bool active = b < Nb;
    const int nw = active && n > kw ? (n - kw + WS - 1) / WS : 0;   // this warp's groups: kw + j WS, j < nw
    const int* src = wq + (((size_t)e * Nb + (active ? b : 0)) * G + g0 + kw) * W4A16_CHUNK_WORDS;

    // The batches: batch q holds this warp's chunks j = q U .. q U + U - 1 (groups kw + j WS); every warp of
    // the block has the same number of batches (block-uniform, so the staging below may __syncthreads).
    constexpr int UW = U * WS;
    const int nbatch = (n + UW - 1) / UW;
    int4 wa[U], wb[U];
    uint2 sa[U], sb[U];
    auto load = [&](int4* w, uint2* s, int q) {
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int j = q * U + u;
            if (j < nw) {
                const int* p = src + j * (WS * W4A16_CHUNK_WORDS);   // (32-bit: G 144 < 2^31)
                w[u] = ld_stream_v4(p + lane * 4);
                s[u] = ld_stream_v2(p + 128 + g * 2);
            }
        }
    };
    load(wa, sa, 0);                                            // the weight stream starts before x is staged:
    load(wb, sb, 1);                                            // two batches in flight from the start

    // x's quad (tok, unit): unit = 8 i + 4 r + cc is columns 32 i + 16 r + 4 cc .. + 3 of group i of the split
    auto quad = [&](int tok, int unit) -> float4 {
        const float* p = xrow_of(tok) + (size_t)(g0 + (unit >> 3)) * 32 + 16 * ((unit >> 2) & 1) + 4 * (unit & 3);
        const float2 lo = __ldg(reinterpret_cast<const float2*>(p)), hi = __ldg(reinterpret_cast<const float2*>(p + 2));
        return make_float4(lo.x, lo.y, hi.x, hi.y);
    };
    // x is read in rounds: each thread issues the loads of up to XR quads (units u, u + blockDim.x, ...) before
    // using any, so a block's staging costs one L2 round trip per round, not one per quad
    constexpr int XR = 4;
    const float4 zero4 = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    float xin[MT][2];                                           // I8: 2^(62-E) per token, in two factors
    // I8: when the split's digits (GW words a group) and its x (32 words a group) fit xs together, the exponent
    // pass also keeps x in xs, past the digits, and the staging converts it from there: x is read from L2 once,
    // one round trip less per block (then the split is one segment: n <= W4A16_XS_WORDS / (GW + 32) < seg)
    const bool one_read = I8 && MT == 1 && (GW + 32) * n <= W4A16_XS_WORDS;
    static_assert(!I8 || MT > 1 || W4A16_XS_WORDS / (GW + 32) < W4A16_XS_WORDS / GW / (U * WS) * (U * WS),
                  "one_read must imply a single staging segment (the staging reads xraw from the split's start)");
    float4* xraw = reinterpret_cast<float4*>(xs + GW * n);     // quad u at xraw[u]
    if constexpr (I8) {                                         // each token's largest |x| over the whole split
        if (threadIdx.x < MT) xmax[threadIdx.x] = 0u;
        __syncthreads();
#pragma unroll
        for (int tok = 0; tok < MT; ++tok) {
            unsigned m = 0u;
            if (tok < M)
                for (int u0 = threadIdx.x; u0 < 8 * n; u0 += XR * (int)blockDim.x) {
                    float4 v[XR];
#pragma unroll
                    for (int k = 0; k < XR; ++k) v[k] = u0 + k * (int)blockDim.x < 8 * n ? quad(tok, u0 + k * blockDim.x) : zero4;
#pragma unroll
                    for (int k = 0; k < XR; ++k)
                        if (one_read && u0 + k * (int)blockDim.x < 8 * n) xraw[u0 + k * blockDim.x] = v[k];
#pragma unroll
                    for (int k = 0; k < XR; ++k)
                        m = max(max(m, max(__float_as_uint(v[k].x) & 0x7FFFFFFFu, __float_as_uint(v[k].y) & 0x7FFFFFFFu)),
                                max(__float_as_uint(v[k].z) & 0x7FFFFFFFu, __float_as_uint(v[k].w) & 0x7FFFFFFFu));
                }
            m = __reduce_max_sync(0xffffffffu, m);
            if (lane == 0 && m) atomicMax(&xmax[tok], m);       // (a max: the same whatever the order)
        }
        __syncthreads();
#pragma unroll
        for (int tok = 0; tok < MT; ++tok) {
            // max < 2^E, E in [-126, 128]; 2^k as two normal factors 2^(k >> 1) 2^(k - (k >> 1)): each product
            // stays normal, so the scalings are exact
            const unsigned m = xmax[tok];
            const int E = (int)(m >> 23) - 126, up = 62 - E, down = E - 66;
            const bool finite = m < 0x7F800000u;
            xin[tok][0] = finite ? __uint_as_float((unsigned)(127 + (up >> 1)) << 23) : 0.0f;
            xin[tok][1] = __uint_as_float((unsigned)(127 + up - (up >> 1)) << 23);
            if (threadIdx.x == 0) {
                xfac[tok][0] = finite ? __uint_as_float((unsigned)(127 + (down >> 1)) << 23) : __uint_as_float(0x7FC00000u);
                xfac[tok][1] = __uint_as_float((unsigned)(127 + down - (down >> 1)) << 23);
            }
        }
    }

    // x, split into its digits or bf16 terms once per block for the block's columns, staged segment by segment
    // in fragment order.
    // bf16: for token tok, group i of the segment and lane column c, the TW = 4 TERMS words
    // xs[tok * xrs + (4 i + c) TW + 4 t + 2 kk + r] are the B fragment registers (term t, k-step kk, register r):
    // the bf16 pair of group columns 16 r + 4 c + kk and + 2 (the k order of the weights' bf16 path); one
    // 16-byte load per term. xrs pads a token's row so the 8 lanes of a 16-byte load phase hit distinct banks.
    // I8: uint2 [i][nt][c][COLS] is lane (g, c)'s B fragment of tile nt, column g = digit (one token):
    // the digits of group columns 4 c .. 4 c + 3 and 16 + 4 c .. + 3 (the m16n8k32 .s8 B fragment).
    // A segment is a whole number of batches.
    const int seg = I8 ? max(UW, W4A16_XS_WORDS / GW / UW * UW) : max(UW, (W4A16_XS_WORDS / M - 16) / (4 * TW) / UW * UW);
    const int xrs = 4 * TW * seg + ((4 * TW * seg) % 32 == 0 ? 16 : 0);
    // this lane's B columns: the uint4 (bf16) or uint2 (I8) offset of its column in a group's staged words
    // (bf16: invalid columns read the last token: finite values whose sums are never written)
    int xoff[CT];
#pragma unroll
    for (int nt = 0; nt < CT; ++nt) {
        const int col = nt * 8 + g, tok = min(col / TC, M - 1), t = TCOL ? col % TC : 0;
        xoff[nt] = I8 ? (nt * 4 + c) * COLS + g % COLS : (tok * xrs + c * TW + 4 * t) / 4;
    }

    float acc[2][CT][4];
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int nt = 0; nt < CT; ++nt)
#pragma unroll
            for (int q = 0; q < 4; ++q) acc[mt][nt][q] = 0.0f;

    int s0 = -seg, qseg = 0;                                    // the next segment starts at batch qseg
    auto step = [&](int4* w, uint2* s, int q) {
        if (q == qseg) {                                       // a new segment of x (block-uniform)
            s0 += seg;
            qseg += seg / UW;
            const int units = 8 * (min(n, s0 + seg) - s0);
            __syncthreads();                                   // every warp is done with the previous segment
            if constexpr (I8) {
#pragma unroll
                for (int tok = 0; tok < MT; ++tok)
                    for (int u0 = threadIdx.x; tok < M && u0 < units; u0 += XR * (int)blockDim.x) {
                        float4 xv[XR];
#pragma unroll
                        for (int k = 0; k < XR; ++k)
                            xv[k] = tok >= M || u0 + k * (int)blockDim.x >= units ? zero4
                                  : one_read ? xraw[u0 + k * blockDim.x] : quad(tok, 8 * s0 + u0 + k * blockDim.x);
#pragma unroll
                        for (int k = 0; k < XR; ++k) {
                          const int u = u0 + k * (int)blockDim.x;
                          if (u >= units) break;
                          unsigned dl[4], dh[4];                 // value j's 8 digits: bytes of dl (0..3), dh (4..7)
                          const float vv[4] = {xv[k].x, xv[k].y, xv[k].z, xv[k].w};
#pragma unroll
                          for (int j = 0; j < 4; ++j) {
                              const unsigned long long X = (unsigned long long)__float2ll_rn(vv[j] * xin[tok][0] * xin[tok][1]);
                              const unsigned long long D = (X + 0x8080808080808080ull) ^ 0x8080808080808080ull;
                              dl[j] = (unsigned)D;
                              dh[j] = (unsigned)(D >> 32);
                          }
                          unsigned dg[8];                        // digit d of values 0..3, one byte each
#pragma unroll
                          for (int h = 0; h < 2; ++h) {
                              const unsigned* dw = h ? dh : dl;
                              const unsigned lo01 = __byte_perm(dw[0], dw[1], 0x5140), hi01 = __byte_perm(dw[0], dw[1], 0x7362);
                              const unsigned lo23 = __byte_perm(dw[2], dw[3], 0x5140), hi23 = __byte_perm(dw[2], dw[3], 0x7362);
                              dg[4 * h] = __byte_perm(lo01, lo23, 0x5410), dg[4 * h + 1] = __byte_perm(lo01, lo23, 0x7632);
                              dg[4 * h + 2] = __byte_perm(hi01, hi23, 0x5410), dg[4 * h + 3] = __byte_perm(hi01, hi23, 0x7632);
                          }
                          const int i = u >> 3, r = (u >> 2) & 1, cc = u & 3;
                          const int base = ((i * CT + tok) * 4 + cc) * COLS;   // token tok: column tile tok
#pragma unroll
                          for (int d = 0; d < 8; ++d) xs[2 * (base + d) + r] = dg[d];
                        }
                    }
            } else {
                auto stage = [&](int idx, float4 v) {          // quad u of token tok -> its TERMS x 2 bf16 pairs
                    const int tok = idx / units, u = idx % units;
                    float2 p0 = make_float2(v.x, v.z), p1 = make_float2(v.y, v.w);   // k-step 0, k-step 1
                    const int i = u >> 3, r = (u >> 2) & 1, cc = u & 3;
                    unsigned* dst = xs + tok * xrs + (4 * i + cc) * TW + r;
#pragma unroll
                    for (int t = 0; t < TERMS; ++t) {          // x -> bf16 terms, largest first
                        const __nv_bfloat162 h0 = __floats2bfloat162_rn(p0.x, p0.y), h1 = __floats2bfloat162_rn(p1.x, p1.y);
                        dst[4 * t] = bf2_bits(h0);
                        dst[4 * t + 2] = bf2_bits(h1);
                        const float2 f0 = __bfloat1622float2(h0), f1 = __bfloat1622float2(h1);
                        p0.x -= f0.x, p0.y -= f0.y, p1.x -= f1.x, p1.y -= f1.y;   // exact: a float's rounding error
                    }
                };
                for (int i0 = threadIdx.x; i0 < M * units; i0 += XR * (int)blockDim.x) {
                    float4 xv[XR];
#pragma unroll
                    for (int k = 0; k < XR; ++k) {
                        const int idx = i0 + k * (int)blockDim.x;
                        xv[k] = idx < M * units ? quad(idx / units, 8 * s0 + idx % units) : zero4;
                    }
#pragma unroll
                    for (int k = 0; k < XR; ++k)
                        if (i0 + k * (int)blockDim.x < M * units) stage(i0 + k * (int)blockDim.x, xv[k]);
                }
            }
            __syncthreads();
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int j = q * U + u;
            if (j >= nw) break;
            const int i = kw + j * WS - s0;                    // the group, relative to the segment
            const unsigned wv[4] = {(unsigned)w[u].x, (unsigned)w[u].y, (unsigned)w[u].z, (unsigned)w[u].w};
            const float sc[2][2] = {{__uint_as_float(s[u].x << 16), __uint_as_float(s[u].x & 0xFFFF0000u)},
                                    {__uint_as_float(s[u].y << 16), __uint_as_float(s[u].y & 0xFFFF0000u)}};
            if constexpr (I8) {
                unsigned a[2][4];                              // [mt][fragment register]: 16 q, int8
#pragma unroll
                for (int mt = 0; mt < 2; ++mt) {
                    a[mt][0] = (wv[2 * mt] << 4) & 0xF0F0F0F0u;
                    a[mt][1] = (wv[2 * mt + 1] << 4) & 0xF0F0F0F0u;
                    a[mt][2] = wv[2 * mt] & 0xF0F0F0F0u;
                    a[mt][3] = wv[2 * mt + 1] & 0xF0F0F0F0u;
                }
                const uint2* xf = reinterpret_cast<const uint2*>(xs) + i * (GW / 2);
#pragma unroll
                for (int nt = 0; nt < CT; ++nt) {
                    if (nt >= M) break;                        // tile nt is token nt: none past the z's M
                    const uint2 v = xf[xoff[nt]];
#pragma unroll
                    for (int mt = 0; mt < 2; ++mt) {
                        // the group's exact sums of 16 q * digit (|sum| <= 2^19), on top of 0x4B400000, the bits of
                        // 1.5 2^23: the sum's bits are then the float 1.5 2^23 + sum, and one subtract gives the sum
                        // exactly (no integer-to-float conversion: those issue at a quarter of the FMA rate)
                        int d[4] = {0x4B400000, 0x4B400000, 0x4B400000, 0x4B400000};
                        mma_s8(d, a[mt], v);
#pragma unroll
                        for (int r = 0; r < 4; ++r)
                            acc[mt][nt][r] = fmaf(sc[mt][r >> 1], __int_as_float(d[r]) - 12582912.0f, acc[mt][nt][r]);
                    }
                }
            } else {
                unsigned a[2][2][4];                               // [mt][k-step][fragment register]
#pragma unroll
                for (int mt = 0; mt < 2; ++mt)
#pragma unroll
                    for (int kk = 0; kk < 2; ++kk)
#pragma unroll
                        for (int r = 0; r < 4; ++r) a[mt][kk][r] = dequant2(wv[2 * mt + (r & 1)] >> (4 * (2 * kk + (r >> 1))));
                const uint4* xf = reinterpret_cast<const uint4*>(xs) + i * TW;    // group i: 4 TW words = TW uint4
#pragma unroll
                for (int nt = 0; nt < CT; ++nt) {
                    float cg[2][4] = {{0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}};
                    if (TCOL) {                                    // one term per column: one mma per k-step
                        const uint4 v = xf[xoff[nt]];
                        const unsigned b0[2] = {v.x, v.y}, b1[2] = {v.z, v.w};
#pragma unroll
                        for (int mt = 0; mt < 2; ++mt) {
                            mma_bf16(cg[mt], a[mt][0], b0);
                            mma_bf16(cg[mt], a[mt][1], b1);
                        }
                    } else {
                        unsigned bf[TERMS][2][2];                  // [term][k-step][register]
#pragma unroll
                        for (int t = 0; t < TERMS; ++t) {
                            const uint4 v = xf[xoff[nt] + t];
                            bf[t][0][0] = v.x, bf[t][0][1] = v.y, bf[t][1][0] = v.z, bf[t][1][1] = v.w;
                        }
                        // The tensor core aligns a sum to its largest term and truncates, so the group's terms go
                        // into its accumulator in ascending magnitude: x3 and x2 of both k-steps, then x1 of both.
#pragma unroll
                        for (int t = TERMS - 1; t >= 0; --t)
#pragma unroll
                            for (int kk = 0; kk < 2; ++kk)
#pragma unroll
                                for (int mt = 0; mt < 2; ++mt) mma_bf16(cg[mt], a[mt][kk], bf[t][kk]);
                    }
#pragma unroll
                    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
                        for (int r = 0; r < 4; ++r) acc[mt][nt][r] = fmaf(sc[mt][r >> 1], cg[mt][r], acc[mt][nt][r]);
                }
            }
        }
        load(w, s, q + 2);                                     // refill: batch q + 2 flies while q + 1 computes
    };
    for (int q = 0; q < nbatch; q += 2) {                      // two batches per trip: the buffers alternate
        step(wa, sa, q);
        if (q + 1 < nbatch) step(wb, sb, q + 1);
    }

    // The WS warps of a row block: sum in warp order, one column tile at a time (8 KB of shared memory), by all
    // threads of the block. Thread entry (rb, r = q and lane): rows r16 = lane / 4 + 8 (q / 2) of both m-tiles
    // (mode 1: the gate and the up sum of one output), column 8 nt + 2 (lane % 4) + q % 2.
    const int Nb32 = Nb * 32;
    float* part = partials + ((size_t)z * ks + ky) * Mz * Nb32;
    auto emit = [&](int rbk, int r16, int tok, float v0, float v1) {    // block row r16 of both m-tiles
        const int bb = bx * RPB + rbk;
        if (bb >= Nb || tok >= M) return;
        if (ks > 1) {
            part[(size_t)tok * Nb32 + bb * 32 + r16] = v0;
            part[(size_t)tok * Nb32 + bb * 32 + 16 + r16] = v1;
        } else if (mode == 0) {
            if (bb * 32 + r16 < N) orow_of(tok)[bb * 32 + r16] = v0;
            if (bb * 32 + 16 + r16 < N) orow_of(tok)[bb * 32 + 16 + r16] = v1;
        } else if (bb * 16 + r16 < N) {
            orow_of(tok)[bb * 16 + r16] = silu(v0) * v1;
        }
    };
#pragma unroll
    for (int nt = 0; nt < CT; ++nt) {
        __syncthreads();                                       // red is free (previous tile summed)
#pragma unroll
        for (int mt = 0; mt < 2; ++mt)
#pragma unroll
            for (int r = 0; r < 4; ++r) red[warp][mt * 4 + r][lane] = acc[mt][nt][r];
        __syncthreads();
        for (int idx = threadIdx.x; idx < RPB * 4 * WARP_SIZE; idx += blockDim.x) {
            const int rbk = idx / (4 * WARP_SIZE), r = idx / WARP_SIZE % 4, ln = idx % WARP_SIZE;
            float v0 = 0.0f, v1 = 0.0f;
#pragma unroll
            for (int w = 0; w < WS; ++w) {
                v0 += red[rbk * WS + w][r][ln];
                v1 += red[rbk * WS + w][4 + r][ln];
            }
            const int r16 = ln / 4 + 8 * (r >> 1), col = nt * 8 + 2 * (ln % 4) + (r & 1);
            if (TCOL) {
                colsum[(rbk * 32 + r16) * 8 * CT + col] = v0;
                colsum[(rbk * 32 + 16 + r16) * 8 * CT + col] = v1;
            } else {
                emit(rbk, r16, col, v0, v1);
            }
        }
    }
    if (TCOL) {                                                // a token's terms (digits), smallest first, in fp32
        __syncthreads();
        for (int idx = threadIdx.x; idx < RPB * 16 * M; idx += blockDim.x) {
            const int r16 = idx % 16, tok = idx / 16 % M, rbk = idx / (16 * M);
            const float* c0 = colsum + (rbk * 32 + r16) * 8 * CT + tok * TC;
            const float* c1 = colsum + (rbk * 32 + 16 + r16) * 8 * CT + tok * TC;
            float v0 = 0.0f, v1 = 0.0f;
            if (I8) {                                          // digit d weighs 256^d; then 2^(E-66): exact scalings
#pragma unroll
                for (int d = 0; d < TC; ++d) {
                    const float w = __uint_as_float((unsigned)(127 + 8 * d) << 23);     // 256^d
                    v0 += c0[d] * w, v1 += c1[d] * w;
                }
                v0 = v0 * xfac[tok][0] * xfac[tok][1], v1 = v1 * xfac[tok][0] * xfac[tok][1];
            } else {
#pragma unroll
                for (int t = TC - 1; t >= 0; --t) v0 += c0[t], v1 += c1[t];
            }
            emit(rbk, r16, tok, v0, v1);
        }
    }
    if (ks == 1) return;

    // split-K: the last block of this column range to finish adds the ks partials in split order
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) is_last = atomicAdd(&tickets[z * gridDim.x + bx], 1) == ks - 1;
    __syncthreads();
    if (!is_last) return;
    __threadfence();
    const float* p0 = partials + (size_t)z * ks * Mz * Nb32;
    const size_t pstride = (size_t)Mz * Nb32;
    const int rows = RPB * 32;
    if (mode == 0) {
        for (int idx = threadIdx.x; idx < M * rows; idx += blockDim.x) {
            const int tok = idx / rows, nn = bx * rows + idx % rows;
            if (nn >= N) continue;
            orow_of(tok)[nn] = split_sum(p0 + (size_t)tok * Nb32 + nn, pstride, ks);
        }
    } else {
        for (int idx = threadIdx.x; idx < M * rows / 2; idx += blockDim.x) {
            const int tok = idx / (rows / 2), jj = idx % (rows / 2), bl = bx * RPB + jj / 16, j = jj % 16;
            if (bl >= Nb || bl * 16 + j >= N) continue;
            const float* pr = p0 + (size_t)tok * Nb32 + bl * 32 + j;
            orow_of(tok)[bl * 16 + j] = silu(split_sum(pr, pstride, ks)) * split_sum(pr + 16, pstride, ks);
        }
    }
    if (threadIdx.x == 0) tickets[z * gridDim.x + bx] = 0;    // ready for the next launch (graph replays)
}

#define W4A16_ARGS                                                                                               \
    const float *__restrict__ x, int x_stride, const int *__restrict__ wq, const int *__restrict__ slot_ids, int S, \
        int k0, int nk, int e_base, int x_by_slot, int M, int N, int Nb, int G, int ks, float *__restrict__ out,   \
        int out_stride, float *__restrict__ partials, int *__restrict__ tickets, int mode, const int *__restrict__ groups
#define W4A16_PASS x, x_stride, wq, slot_ids, S, k0, nk, e_base, x_by_slot, M, N, Nb, G, ks, out, out_stride, partials, \
                   tickets, mode, groups

// One entry per (numerics, most tokens per launch); template <MT, TERMS, TCOL, WS, U, I8>. FP32-faithful:
// w4a16_mma_i8_m1_r<R> (the 8 int8 digits of one token as columns; TERMS does not apply), then
// w4a16_mma_t3_m<MT> (bf16 terms as columns at 2..8 tokens; from 9 tokens one column per token, fewer warps per
// row block: the staged x of more tokens holds fewer groups); bf16 activations: w4a16_mma_t1_m<MT>. Up to 16
// tokens a family of entries covers R = 8 / WS row blocks per block (one token: 1, 2, 4, 8; the bf16 terms:
// 1, 2, 4, at 16 tokens 2, 4; the int8 digits of up to 4 tokens, the grouped MoE path's: 1, 8; the family's
// first entry has no _r suffix), chosen per launch shape by
// w4a16_plan.w4a16_rows_plan: more rows share one block's staged x, fewer blocks to fill the GPU.
extern "C" __global__ void __launch_bounds__(BLOCK_THREADS, 3)
w4a16_mma_i8_m1_r1(W4A16_ARGS) { AFTER_PREVIOUS_GRID(); w4a16_mma_body<1, 1, true, 8, 2, true>(W4A16_PASS); }
extern "C" __global__ void __launch_bounds__(BLOCK_THREADS, 3)
w4a16_mma_i8_m1_r2(W4A16_ARGS) { AFTER_PREVIOUS_GRID(); w4a16_mma_body<1, 1, true, 4, 2, true>(W4A16_PASS); }
extern "C" __global__ void __launch_bounds__(BLOCK_THREADS, 3)
w4a16_mma_i8_m1_r4(W4A16_ARGS) { AFTER_PREVIOUS_GRID(); w4a16_mma_body<1, 1, true, 2, 2, true>(W4A16_PASS); }
extern "C" __global__ void __launch_bounds__(BLOCK_THREADS, 3)
w4a16_mma_i8_m1_r8(W4A16_ARGS) { AFTER_PREVIOUS_GRID(); w4a16_mma_body<1, 1, true, 1, 2, true>(W4A16_PASS); }
extern "C" __global__ void __launch_bounds__(BLOCK_THREADS, 2)
w4a16_mma_i8_m4(W4A16_ARGS) { AFTER_PREVIOUS_GRID(); w4a16_mma_body<4, 1, true, 8, 2, true>(W4A16_PASS); }
extern "C" __global__ void __launch_bounds__(BLOCK_THREADS, 2)
w4a16_mma_i8_m4_r8(W4A16_ARGS) { AFTER_PREVIOUS_GRID(); w4a16_mma_body<4, 1, true, 1, 2, true>(W4A16_PASS); }
extern "C" __global__ void __launch_bounds__(BLOCK_THREADS, 2)
w4a16_mma_t3_m2(W4A16_ARGS) { AFTER_PREVIOUS_GRID(); w4a16_mma_body<2, 3, true, 8, 4, false>(W4A16_PASS); }
extern "C" __global__ void __launch_bounds__(BLOCK_THREADS, 2)
w4a16_mma_t3_m2_r2(W4A16_ARGS) { AFTER_PREVIOUS_GRID(); w4a16_mma_body<2, 3, true, 4, 4, false>(W4A16_PASS); }
extern "C" __global__ void __launch_bounds__(BLOCK_THREADS, 2)
w4a16_mma_t3_m2_r4(W4A16_ARGS) { AFTER_PREVIOUS_GRID(); w4a16_mma_body<2, 3, true, 2, 4, false>(W4A16_PASS); }
extern "C" __global__ void __launch_bounds__(BLOCK_THREADS, 2)
w4a16_mma_t3_m5(W4A16_ARGS) { AFTER_PREVIOUS_GRID(); w4a16_mma_body<5, 3, true, 8, 2, false>(W4A16_PASS); }
extern "C" __global__ void __launch_bounds__(BLOCK_THREADS, 2)
w4a16_mma_t3_m5_r2(W4A16_ARGS) { AFTER_PREVIOUS_GRID(); w4a16_mma_body<5, 3, true, 4, 2, false>(W4A16_PASS); }
extern "C" __global__ void __launch_bounds__(BLOCK_THREADS, 2)
w4a16_mma_t3_m5_r4(W4A16_ARGS) { AFTER_PREVIOUS_GRID(); w4a16_mma_body<5, 3, true, 2, 2, false>(W4A16_PASS); }
extern "C" __global__ void __launch_bounds__(BLOCK_THREADS, 2)
w4a16_mma_t3_m8(W4A16_ARGS) { AFTER_PREVIOUS_GRID(); w4a16_mma_body<8, 3, true, 8, 2, false>(W4A16_PASS); }
extern "C" __global__ void __launch_bounds__(BLOCK_THREADS, 2)
w4a16_mma_t3_m8_r2(W4A16_ARGS) { AFTER_PREVIOUS_GRID(); w4a16_mma_body<8, 3, true, 4, 2, false>(W4A16_PASS); }
extern "C" __global__ void __launch_bounds__(BLOCK_THREADS, 2)
w4a16_mma_t3_m8_r4(W4A16_ARGS) { AFTER_PREVIOUS_GRID(); w4a16_mma_body<8, 3, true, 2, 2, false>(W4A16_PASS); }
extern "C" __global__ void __launch_bounds__(BLOCK_THREADS, 2)
w4a16_mma_t3_m16(W4A16_ARGS) { AFTER_PREVIOUS_GRID(); w4a16_mma_body<16, 3, false, 4, 1, false>(W4A16_PASS); }
extern "C" __global__ void __launch_bounds__(BLOCK_THREADS, 2)
w4a16_mma_t3_m16_r4(W4A16_ARGS) { AFTER_PREVIOUS_GRID(); w4a16_mma_body<16, 3, false, 2, 1, false>(W4A16_PASS); }
extern "C" __global__ void __launch_bounds__(BLOCK_THREADS, 1)
w4a16_mma_t3_m32(W4A16_ARGS) { AFTER_PREVIOUS_GRID(); w4a16_mma_body<32, 3, false, 2, 2, false>(W4A16_PASS); }
extern "C" __global__ void __launch_bounds__(BLOCK_THREADS, 1)
w4a16_mma_t3_m64(W4A16_ARGS) { AFTER_PREVIOUS_GRID(); w4a16_mma_body<64, 3, false, 1, 2, false>(W4A16_PASS); }
extern "C" __global__ void __launch_bounds__(BLOCK_THREADS, 2)
w4a16_mma_t1_m8(W4A16_ARGS) { AFTER_PREVIOUS_GRID(); w4a16_mma_body<8, 1, false, 8, 4, false>(W4A16_PASS); }
extern "C" __global__ void __launch_bounds__(BLOCK_THREADS, 2)
w4a16_mma_t1_m16(W4A16_ARGS) { AFTER_PREVIOUS_GRID(); w4a16_mma_body<16, 1, false, 4, 2, false>(W4A16_PASS); }
extern "C" __global__ void __launch_bounds__(BLOCK_THREADS, 1)
w4a16_mma_t1_m32(W4A16_ARGS) { AFTER_PREVIOUS_GRID(); w4a16_mma_body<32, 1, false, 2, 4, false>(W4A16_PASS); }
extern "C" __global__ void __launch_bounds__(BLOCK_THREADS, 1)
w4a16_mma_t1_m64(W4A16_ARGS) { AFTER_PREVIOUS_GRID(); w4a16_mma_body<64, 1, false, 1, 4, false>(W4A16_PASS); }

// The benchmark's floor (kdtr bench w4a16): read n16 16-byte words once (grid-stride, 16-byte loads that skip
// L1), the same bytes a W4A16 launch streams; one store per thread only if an impossible XOR shows up, so
// the loads cannot be optimised away. Launch: grid (enough blocks to fill the GPU), block BLOCK_THREADS.
extern "C" __global__ void __launch_bounds__(BLOCK_THREADS, MIN_BLOCKS_PER_SM)
stream_read_kernel(const int4* __restrict__ src, long long n16, int* __restrict__ out) {
    AFTER_PREVIOUS_GRID();
    int acc = 0;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n16; i += (long long)gridDim.x * blockDim.x) {
        const int4 v = __ldcg(src + i);
        acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    if (acc == 0x7ead1e55) out[0] = acc;
}
