// MLA attention in the absorbed latent form over the latent cache, as five launches after q = W_qb c_q
// (ops.linear, which writes the `q` tap's pre-rope values):
//   1. mla_qprep_kernel:  q_pe <- rope(q_pe) in place (the `q` tap); qs[t, h] = [q_nope @ W_uk[h] | q_pe], stored
//                         as its bf16 terms (split once here, not by each scores block)
//   2. mla_scores_kernel (or _wide): scores[t h, s] = qs[t, h] . [c_kv[s] | k_pe[s]] * scale + mask(t, s)
//   3a. mla_softmax_kernel: per chunk j of the rows: m_j = max_s score, p = exp(score - m_j) (as bf16 terms),
//                         l_j = sum_s p (flash-decoding's partial softmax)
//   3b. mla_pv_kernel (or _wide): o_j = sum_s p c_kv[s] over chunk j
//   4. mla_merge_uv_kernel: o_lat = sum_j exp(m_j - M) o_j / L (chunk order), o = W_uv[h] @ o_lat
// Why so: every (token, head) query shares one latent cache, so the scores and p c_kv are two GEMMs over
// all T H query rows at once; each cache tile is loaded once per 64 query rows, not once per (token, head)
// as a per-head kernel would (64 times per token at K2.6, ~23 GB at 33 rows and 4K cached rows). W_uk[h]
// and W_uv[h] are read once per 8 tokens.
// Contract (float32 unless said): q [T, H, A] (A = N + R; q_nope at 0..N-1, q_pe at N..A-1 of each head), q_pe
// rotated at positions[t] (int32 [T], device) with inv_freq float64 [R/2]; w_uk [H, N, C] and w_uv [H, U, C]
// (kv_b_proj split per head, as stored); qs: scratch, bf16 terms [3][T H][Kp] (Kp = kv_pitch(C, R), the
// cache's row layout: kv_layout.cuh); this layer's cache kv: bf16 terms [3][kv_rows][Kp], rows 0 .. S-1 valid,
// S = meta[0] + T (meta[0] = rows cached before this forward, read on the device so a replayed graph follows
// the cache); mask: NULL = causal (token t sees rows s <= meta[0] + t), else additive float32 [T, mask_stride]
// (0 visible, -inf hidden: DDTree verification); scores: scratch [T H, S_cap]; p: scratch, bf16 terms
// [3][T H][p_pitch] (p_pitch >= S_cap, a multiple of 8); partials: scratch
// [n_split, T H, C + 2] (m, l, o_j); o [T, H, U].
// Determinism: every sum has a fixed order for a given launch shape (k loops in order, fixed butterflies,
// chunks merged in chunk order); p c_kv's tiling (narrow or wide) and n_split are fixed per (T, H, C) and GPU on
// the host (ops.Ops.attn_tiling, attn_splits; the scores' tiling changes no bit) and the chunk bounds follow S
// on the device.
// Limits: C <= ATTN_MAX_C, R <= ATTN_MAX_R, N <= ATTN_MAX_N, n_split <= ATTN_MAX_SPLIT (K2.6: 512, 64, 128).
#include "common.cuh"
#include "kv_layout.cuh"
#include "rope.cuh"
#include "tensor_core.cuh"

#define ATTN_MAX_C 512
#define ATTN_MAX_R 128
#define ATTN_MAX_N 256
#define ATTN_MAX_SPLIT 32
#define ATTN_TOKENS 8                         // tokens per block in qprep and merge_uv: W_uk[h], W_uv[h] read once for them
#define KSTEP 32                              // the GEMMs' k step (staged in shared memory as bf16 terms)
#define LOADS 8                               // elements per 16-byte staging piece (bf16) or load8 (float32)
#define ROW_LANES 8                           // lanes that share one row of W_uv in merge_uv
#define MERGE_U 64                            // rows of W_uv per merge_uv block

// 1. grid (H, ceil(T / ATTN_TOKENS), ceil(C / BLOCK_THREADS)): a thread per latent column c; slice z = 0 ropes
// (w_uk float32 in mla_qprep_kernel, bf16 bits in mla_qprep_bf16_kernel: common.cuh, wval)
template <typename WT>
__device__ __forceinline__ void mla_qprep_body(float* __restrict__ q, const int* __restrict__ positions,
                                               const double* __restrict__ inv_freq, double attn_factor,
                                               const WT* __restrict__ w_uk, bf16_t* __restrict__ qs, int T, int H,
                                               int N, int R, int C) {
    __shared__ float qn[ATTN_TOKENS][ATTN_MAX_N];
    const int h = blockIdx.x, t0 = blockIdx.y * ATTN_TOKENS, nt = min(ATTN_TOKENS, T - t0), A = N + R;
    const int Kp = kv_pitch(C, R);
    const size_t plane = (size_t)T * H * Kp;
    for (int i = threadIdx.x; i < ATTN_TOKENS * N; i += blockDim.x) {   // tokens past T: zeros
        const int tt = i / N, n = i % N;
        qn[tt][n] = tt < nt ? q[((size_t)(t0 + tt) * H + h) * A + n] : 0.0f;
    }
    for (int i = threadIdx.x; blockIdx.z == 0 && i < nt * (R / 2); i += blockDim.x) {   // rope q_pe: the tap, qs
        const int tt = i / (R / 2), p = i % (R / 2);
        float* qp = q + ((size_t)(t0 + tt) * H + h) * A + N + 2 * p;
        float y0, y1;
        rope_pair(qp[0], qp[1], (double)positions[t0 + tt], inv_freq[p], attn_factor, &y0, &y1);
        qp[0] = y0;
        qp[1] = y1;
        bf16_t* d = qs + ((size_t)(t0 + tt) * H + h) * Kp + C + 2 * p;
        store_terms(d, plane, y0);
        store_terms(d + 1, plane, y1);
    }
    for (int i = threadIdx.x; blockIdx.z == 0 && i < nt * (Kp - C - R); i += blockDim.x) {   // the row's padding
        const int tt = i / (Kp - C - R), j = C + R + i % (Kp - C - R);
        store_terms(qs + ((size_t)(t0 + tt) * H + h) * Kp + j, plane, 0.0f);
    }
    __syncthreads();
    const WT* wk = w_uk + (size_t)h * N * C;
    const int c = blockIdx.z * BLOCK_THREADS + threadIdx.x;
    if (c < C) {                                              // q_lat[tt, c] = sum_n q_nope[tt, n] W_uk[h, n, c]
        float acc[ATTN_TOKENS];
#pragma unroll
        for (int tt = 0; tt < ATTN_TOKENS; ++tt) acc[tt] = 0.0f;
#pragma unroll 8
        for (int n = 0; n < N; ++n) {                          // unrolled: W_uk loads in flight, sums in order
            const float w = wval(wk[(size_t)n * C + c]);
#pragma unroll
            for (int tt = 0; tt < ATTN_TOKENS; ++tt) acc[tt] += qn[tt][n] * w;
        }
#pragma unroll
        for (int tt = 0; tt < ATTN_TOKENS; ++tt)
            if (tt < nt) store_terms(qs + ((size_t)(t0 + tt) * H + h) * Kp + c, plane, acc[tt]);
    }
}

#define MLA_QPREP_ARGS(WT) float* __restrict__ q, const int* __restrict__ positions, const double* __restrict__ inv_freq, \
    double attn_factor, const WT* __restrict__ w_uk, bf16_t* __restrict__ qs, int T, int H, int N, int R, int C
extern "C" __global__ void __launch_bounds__(BLOCK_THREADS, MIN_BLOCKS_PER_SM) mla_qprep_kernel(MLA_QPREP_ARGS(float)) {
    AFTER_PREVIOUS_GRID();
    mla_qprep_body(q, positions, inv_freq, attn_factor, w_uk, qs, T, H, N, R, C);
}
extern "C" __global__ void __launch_bounds__(BLOCK_THREADS, MIN_BLOCKS_PER_SM) mla_qprep_bf16_kernel(MLA_QPREP_ARGS(bf16_t)) {
    AFTER_PREVIOUS_GRID();
    mla_qprep_body(q, positions, inv_freq, attn_factor, w_uk, qs, T, H, N, R, C);
}

// The attention GEMMs' block tiles (mla_scores_* and mla_pv_*). A block of 8 warps computes a ROWS x COLS output
// tile: WARPS_M x (8 / WARPS_M) warps, each WM m16 tiles by WN n8 tiles. Two tilings (ops.Ops.attn_tiling):
//   Narrow (64 x 64; 4 x 2 warps of 16 x 32): three blocks per SM on sm_90 (80 registers); twice the blocks of
//     the wide tile, so it fills the GPU better where the grid is small (a decode step's p c_kv, short caches);
//   Wide (64 x 128; 2 x 4 warps of 32 x 32): two blocks per SM on sm_90 (128 registers); per product it moves
//     0.75x the L2 bytes of the narrow tile at T H = 320 query rows (each operand tile is fetched by fewer
//     blocks) and issues 12 ldmatrix per 48 mma instead of 9 per 24.
// Both fold `hi` (the leading term product's accumulator, tensor_core.cuh) into `tot` after every k16, so every
// element of the scores is the same float32 sum in either tiling (p c_kv's partials too, at one chunk count):
// the scores' tiling is a matter of speed alone (p c_kv's sets its chunk count too). (Folding after every k16
// keeps `hi` to 4 registers at a time, where the wide tile has none to spare.)
#define GEMM_STAGES 2                         // cp.async stages of both operand tiles (a third costs a block per SM:
                                              // slower in both tilings, H200, docs/cuda-engine.md "Stop 42")
template <int WARPS_M_, int WM_, int WN_>
struct Tiling {
    static constexpr int WARPS_M = WARPS_M_, WM = WM_, WN = WN_;
    static constexpr int ROWS = WARPS_M * 16 * WM, COLS = WARPS_PER_BLOCK / WARPS_M * 8 * WN;
    static constexpr int VPITCH = COLS + 8;   // bf16 per [k][col] staging row (p c_kv's c_kv): ldmatrix conflict-free
    static_assert(WARPS_PER_BLOCK % WARPS_M == 0 && WN % 2 == 0, "whole warps; n8 tiles in ldmatrix.x4 pairs");
    __device__ static int wm() { return (threadIdx.x / WARP_SIZE % WARPS_M) * 16 * WM; }
    __device__ static int wn() { return (threadIdx.x / WARP_SIZE / WARPS_M) * 8 * WN; }
    // Element i of the thread's accumulator tile (mi, ni): its (row, column) in the block tile.
    __device__ static int row(int mi, int i) { return wm() + mi * 16 + (threadIdx.x % WARP_SIZE) / 4 + (i / 2) * 8; }
    __device__ static int col(int ni, int i) { return wn() + ni * 8 + (threadIdx.x % 4) * 2 + i % 2; }
};
typedef Tiling<4, 1, 4> Narrow;
typedef Tiling<2, 2, 4> Wide;

// The tensor-core k step of a tile GEMM, FP32-faithful: the tiles are staged in shared memory as the three bf16
// terms of split3 (tensor_core.cuh), A row-major [term][row][k] (TL::ROWS rows), B [term][col][k] (B_KN = false:
// the scores' cache rows, TL::COLS of them) or [term][k][col] (B_KN = true: p c_kv's c_kv rows, pitch
// TL::VPITCH, read with ldmatrix.trans). Six mma per m16n8 tile and 16 k (mma_split6): `hi` starts afresh
// every k16 and is added to `tot` (rounded), `lo` runs over the whole k loop; the element is tot + lo. Fixed
// order: the same bits every run, and in either tiling.
#define SPITCH (KSTEP + 8)                    // bf16 per [row][k] staging row: 80 bytes, ldmatrix conflict-free
static_assert(WARPS_PER_BLOCK == 8 && KSTEP == 32 && LOADS == 8,
              "the tilings and the 8-element (16-byte) staging pieces assume these");
template <typename TL, bool B_KN>
__device__ __forceinline__ void tile_mma(const bf16_t* As, const bf16_t* Bs, float (&tot)[TL::WM][TL::WN][4],
                                         float (&lo)[TL::WM][TL::WN][4]) {
    const int lane = threadIdx.x % WARP_SIZE, wm = TL::wm(), wn = TL::wn();
#pragma unroll
    for (int ks = 0; ks < KSTEP; ks += 16) {
        unsigned a[TL::WM][3][4];
#pragma unroll
        for (int mi = 0; mi < TL::WM; ++mi)
#pragma unroll
            for (int t = 0; t < 3; ++t)
                ldsm_x4(a[mi][t],
                        As + ((size_t)t * TL::ROWS + wm + mi * 16 + lane % 16) * SPITCH + ks + (lane / 16) * 8);
#pragma unroll
        for (int np = 0; np < TL::WN / 2; ++np) {             // two n8 tiles per ldmatrix.x4: regs {b0, b1} each
            unsigned b[3][4];
            const int n = wn + np * 16;
#pragma unroll
            for (int t = 0; t < 3; ++t) {
                if (B_KN)
                    ldsm_x4_trans(b[t], Bs + ((size_t)t * KSTEP + ks + lane % 8 + ((lane / 8) % 2) * 8) * TL::VPITCH
                                          + n + (lane / 16) * 8);
                else
                    ldsm_x4(b[t], Bs + ((size_t)t * TL::COLS + n + (lane / 16) * 8 + lane % 8) * SPITCH + ks
                                    + ((lane / 8) % 2) * 8);
            }
#pragma unroll
            for (int h = 0; h < 2; ++h)
#pragma unroll
                for (int mi = 0; mi < TL::WM; ++mi) {
                    const int ni = np * 2 + h;
                    float hi[4] = {};
                    mma_split6(hi, lo[mi][ni], a[mi], &b[0][2 * h], &b[1][2 * h], &b[2][2 * h]);
#pragma unroll
                    for (int i = 0; i < 4; ++i) tot[mi][ni][i] += hi[i];
                }
        }
    }
}

// Eight consecutive float32 staged as their three bf16 terms: 16 bytes per term at dst, dst + plane, dst + 2 plane.
__device__ __forceinline__ void stage3_x8(const float (&v)[8], bf16_t* dst, size_t plane) {
    uint4 t[3];
    split3_x8(v, t);
    *reinterpret_cast<uint4*>(dst) = t[0];
    *reinterpret_cast<uint4*>(dst + plane) = t[1];
    *reinterpret_cast<uint4*>(dst + 2 * plane) = t[2];
}

// The rows of one p c_kv chunk (mla_pv_*) for S rows in n_split chunks: ceil(S / n_split) rounded up to
// KSTEP; chunks at or past ceil(S / chunk) hold no row (mla_softmax_kernel writes m = -inf, l = 0 there and
// mla_pv_* o = 0; mla_merge_uv_kernel leaves them out, where they would add exactly 0).
__device__ __forceinline__ int pv_chunk(int S, int n_split) {
    const int per = (S + n_split - 1) / n_split;
    return (per + KSTEP - 1) / KSTEP * KSTEP;
}

// Both GEMMs' k loop: `steps` k steps through GEMM_STAGES cp.async stages in shared memory. load(stage, i) issues
// step i's copies into a stage; mma(stage) multiplies the step staged there. The first GEMM_STAGES - 1 steps go in
// flight first; then step i computes while the next ones load, and no load overwrites a stage before every warp
// is done with it.
template <typename Load, typename Mma>
__device__ __forceinline__ void staged_k_steps(int steps, Load load, Mma mma) {
#pragma unroll
    for (int i = 0; i < GEMM_STAGES - 1; ++i) {
        if (i < steps) load(i, i);
        cp_async_commit();
    }
    for (int i = 0; i < steps; ++i) {
        const int ahead = i + GEMM_STAGES - 1;
        if (ahead < steps) load(ahead % GEMM_STAGES, ahead);
        cp_async_commit();
        cp_async_wait<GEMM_STAGES - 1>();
        __syncthreads();
        mma(i % GEMM_STAGES);
        __syncthreads();                                      // before the next load overwrites this stage
    }
}

// The GEMMs' blocks per SM (__launch_bounds__; ops.AttnTiling.blocks_per_sm sizes p c_kv's chunk count from them)
// and their dynamic shared memory: GEMM_STAGES-deep cp.async stages of both operand tiles, over the 48 KB a static
// array may take (ops.AttnTiling.scores_smem and .pv_smem compute the same bytes; each body static_asserts that
// its layout is this size).
#define SCORES_SMEM(TL) (GEMM_STAGES * 3 * (TL::ROWS + TL::COLS) * SPITCH * 2)
#define PV_SMEM(TL) (GEMM_STAGES * 3 * (TL::ROWS * SPITCH + KSTEP * TL::VPITCH) * 2)
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 1000
#define NARROW_BLOCKS_PER_SM 1                // sm_120: its 100 KB of shared memory per SM holds one block
#define WIDE_BLOCKS_PER_SM 1
#else
#define NARROW_BLOCKS_PER_SM 3                // sm_90: three blocks (80 registers a thread, no spill): 12 warps per SM
#define WIDE_BLOCKS_PER_SM 2                  // sm_90: two blocks (<= 128 registers a thread, no spill)
#endif

// 2. grid (ceil(T H / TL::ROWS), ceil(S_cap / TL::COLS)): query tiles vary fastest, so the blocks in flight share
// their cache tiles through L2. Tiles at or past S = meta[0] + T exit. Both operands arrive as bf16 terms
// (qs from mla_qprep, the cache as appended), so a k step is GEMM_STAGES-deep cp.async copies straight into the
// shared-memory planes and the MMAs: no registers hold the next tile and no block rounds anything.
template <typename TL>
__device__ __forceinline__ void mla_scores_body(unsigned char* smem, const bf16_t* __restrict__ qs,
                                                const bf16_t* __restrict__ kv, int kv_rows,
                                                const int* __restrict__ meta, const float* __restrict__ mask,
                                                int mask_stride, float* __restrict__ scores, int S_cap, int T, int H,
                                                int C, int R, float scale) {
    constexpr int A_ELEMS = 3 * TL::ROWS * SPITCH, B_ELEMS = 3 * TL::COLS * SPITCH;
    static_assert(GEMM_STAGES * (A_ELEMS + B_ELEMS) * 2 == SCORES_SMEM(TL), "SCORES_SMEM is not the scores' layout");
    constexpr int AP = TL::ROWS * KSTEP / LOADS / BLOCK_THREADS, BP = TL::COLS * KSTEP / LOADS / BLOCK_THREADS;
    bf16_t* As = reinterpret_cast<bf16_t*>(smem);             // [stage][term][query row][k]
    bf16_t* Bs = As + GEMM_STAGES * A_ELEMS;                  // [stage][term][cache row][k]
    const int S0 = meta[0], S = S0 + T, TH = T * H, Kp = kv_pitch(C, R);
    const int r0 = blockIdx.x * TL::ROWS, s0 = blockIdx.y * TL::COLS;
    if (s0 >= S) return;
    const size_t qplane = (size_t)TH * Kp, kplane = (size_t)kv_rows * Kp;
    const int i0 = threadIdx.x / (KSTEP / LOADS), ka = (threadIdx.x % (KSTEP / LOADS)) * LOADS;   // 8 in a row
    const bf16_t* qrow[AP];
    const bf16_t* krow[BP];
    bool qok[AP], kok[BP];
#pragma unroll
    for (int j = 0; j < AP; ++j) {                            // rows past TH or S: zeros, a valid row named
        const int i = i0 + j * (BLOCK_THREADS / (KSTEP / LOADS));
        qok[j] = r0 + i < TH;
        qrow[j] = qs + (size_t)(qok[j] ? r0 + i : 0) * Kp;
    }
#pragma unroll
    for (int j = 0; j < BP; ++j) {
        const int i = i0 + j * (BLOCK_THREADS / (KSTEP / LOADS));
        kok[j] = s0 + i < S;
        krow[j] = kv + (size_t)(kok[j] ? s0 + i : 0) * Kp;
    }
    auto load = [&](int stage, int k0) {                      // one 16-byte piece per term, operand and row
        const int k = k0 + ka, kk = k < Kp ? k : 0;
#pragma unroll
        for (int j = 0; j < AP; ++j) {
            const int i = i0 + j * (BLOCK_THREADS / (KSTEP / LOADS)), n = qok[j] && k < Kp ? 16 : 0;
#pragma unroll
            for (int t = 0; t < 3; ++t)
                cp_async16(As + stage * A_ELEMS + ((size_t)t * TL::ROWS + i) * SPITCH + ka,
                           qrow[j] + t * qplane + kk, n);
        }
#pragma unroll
        for (int j = 0; j < BP; ++j) {
            const int i = i0 + j * (BLOCK_THREADS / (KSTEP / LOADS)), n = kok[j] && k < Kp ? 16 : 0;
#pragma unroll
            for (int t = 0; t < 3; ++t)
                cp_async16(Bs + stage * B_ELEMS + ((size_t)t * TL::COLS + i) * SPITCH + ka,
                           krow[j] + t * kplane + kk, n);
        }
    };
    float tot[TL::WM][TL::WN][4] = {}, lo[TL::WM][TL::WN][4] = {};
    staged_k_steps((Kp + KSTEP - 1) / KSTEP, [&](int stage, int i) { load(stage, i * KSTEP); }, [&](int stage) {
        tile_mma<TL, false>(As + stage * A_ELEMS, Bs + stage * B_ELEMS, tot, lo);
    });
#pragma unroll
    for (int mi = 0; mi < TL::WM; ++mi)
#pragma unroll
        for (int ni = 0; ni < TL::WN; ++ni)
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int r = r0 + TL::row(mi, i), s = s0 + TL::col(ni, i), t = r / H;
                if (r >= TH || s >= S) continue;
                const float m = mask ? mask[(size_t)t * mask_stride + s] : (s <= S0 + t ? 0.0f : -INFINITY);
                scores[(size_t)r * S_cap + s] = (tot[mi][ni][i] + lo[mi][ni][i]) * scale + m;
            }
}

// (one name per dynamic shared array in the umbrella build)
#define MLA_SCORES_ARGS const bf16_t* __restrict__ qs, const bf16_t* __restrict__ kv, int kv_rows, \
    const int* __restrict__ meta, const float* __restrict__ mask, int mask_stride, float* __restrict__ scores, \
    int S_cap, int T, int H, int C, int R, float scale
extern "C" __global__ void __launch_bounds__(BLOCK_THREADS, NARROW_BLOCKS_PER_SM) mla_scores_kernel(MLA_SCORES_ARGS) {
    AFTER_PREVIOUS_GRID();
    extern __shared__ __align__(16) unsigned char scores_smem[];
    mla_scores_body<Narrow>(scores_smem, qs, kv, kv_rows, meta, mask, mask_stride, scores, S_cap, T, H, C, R, scale);
}
extern "C" __global__ void __launch_bounds__(BLOCK_THREADS, WIDE_BLOCKS_PER_SM) mla_scores_wide_kernel(MLA_SCORES_ARGS) {
    AFTER_PREVIOUS_GRID();
    extern __shared__ __align__(16) unsigned char scores_wide_smem[];
    mla_scores_body<Wide>(scores_wide_smem, qs, kv, kv_rows, meta, mask, mask_stride, scores, S_cap, T, H, C, R, scale);
}

// 3a. grid (ceil(T H / WARPS_PER_BLOCK), n_split): chunk j's partial softmax, a warp per query row (lane l takes
// the columns s_lo + 8 l + 256 i .. + 7): m_j = max_s score, p = exp(score - m_j) stored as its bf16 terms in
// p [3][T H][p_pitch] (zeros from S to the next multiple of 8), l_j = sum_s p (each lane's sum in column order,
// then the warp's fixed butterfly) -> partials[j, row, 0..1]. Once per element here, not again by each of p
// c_kv's column tiles. Chunk j owns rows [j chunk, (j + 1) chunk) of the S rows, chunk = pv_chunk(S, n_split).
// Each warp loads its columns in batches of SOFTMAX_HELD spans, every load of a batch issued before any is used. A
// chunk of one batch (up to 2560 columns: K2.6's 5-row verify at 32768 rows has 13 chunks, 12 of 2528 columns and
// one of 2437) is read once and held in registers between the max and the exponentials; a longer one is read twice,
// a batch at a time.
// Every way computes the same values in the same order (each lane's columns in increasing order): the bits of the
// plain two-pass loop it replaced (stop 46). Why: read twice, the second pass went back to DRAM for most of the
// scores (Nsight Compute, that verify: 76 MB read for 42 MB of scores, 49% of L2 sectors hit). Why 10 spans at two
// blocks per SM (120 registers on sm_90, no spill): 12 spans at one block per SM (137 registers) ran a decode
// step's 256 blocks in two waves, and 12 at two (128) or 6 at three were slower at 9 tokens (measured on the H200,
// docs/cuda-engine.md "Stop 46"; which other token count the lost notes named is not known).
#define SOFTMAX_SPAN (WARP_SIZE * LOADS)      // columns a warp takes per step
#define SOFTMAX_HELD 10                       // spans a warp holds (2560 columns)
#define SOFTMAX_BLOCKS_PER_SM 2               // so at most 128 registers: a decode step's blocks in one wave

// One span's exponentials at s (v: its scores, n = s_hi - s of them valid), stored as terms, added to lsum.
__device__ __forceinline__ void softmax_span(float (&v)[LOADS], int n, float m, float& lsum, bf16_t* dst,
                                             size_t plane) {
#pragma unroll
    for (int j = 0; j < LOADS; ++j) {                         // p = 0 past the chunk, for a row of no visible entry
        v[j] = (j < n && m != -INFINITY) ? expf(v[j] - m) : 0.0f;
        lsum += v[j];
    }
    stage3_x8(v, dst, plane);                                 // (a chunk ends on a piece, or at S)
}

extern "C" __global__ void __launch_bounds__(BLOCK_THREADS, SOFTMAX_BLOCKS_PER_SM)
mla_softmax_kernel(const float* __restrict__ scores, int S_cap, const int* __restrict__ meta, bf16_t* __restrict__ p,
                   int p_pitch, float* __restrict__ partials, int T, int H, int C) {
    AFTER_PREVIOUS_GRID();
    const int S = meta[0] + T, TH = T * H, n_split = gridDim.y, split = blockIdx.y;
    const int chunk = pv_chunk(S, n_split);
    const int s_lo = min(S, split * chunk), s_hi = min(S, s_lo + chunk);
    const int lane = threadIdx.x % WARP_SIZE, r = blockIdx.x * WARPS_PER_BLOCK + threadIdx.x / WARP_SIZE;
    if (r >= TH) return;                                      // a whole warp (no barrier below)
    const float* row = scores + (size_t)r * S_cap;
    bf16_t* prow = p + (size_t)r * p_pitch;
    const size_t plane = (size_t)TH * p_pitch;
    float m = -INFINITY, lsum = 0.0f;
    float v[SOFTMAX_HELD][LOADS];                             // a batch of spans: every load issued before any use
    const int batch = SOFTMAX_HELD * SOFTMAX_SPAN;
    for (int s0 = s_lo; s0 < s_hi; s0 += batch) {             // the max: the same value in any order
#pragma unroll
        for (int u = 0; u < SOFTMAX_HELD; ++u) {
            const int s = s0 + lane * LOADS + u * SOFTMAX_SPAN;
            if (s < s_hi) load8(row + s, s_hi - s, v[u]);
        }
#pragma unroll
        for (int u = 0; u < SOFTMAX_HELD; ++u) {
            const int s = s0 + lane * LOADS + u * SOFTMAX_SPAN;
#pragma unroll
            for (int j = 0; j < LOADS; ++j)
                if (j < s_hi - s) m = fmaxf(m, v[u][j]);
        }
    }
    m = warp_max(m);
    const bool held = chunk <= batch;                         // one batch: still in v (the same for every block)
    for (int s0 = s_lo; s0 < s_hi; s0 += batch) {
        if (!held) {
#pragma unroll
            for (int u = 0; u < SOFTMAX_HELD; ++u) {
                const int s = s0 + lane * LOADS + u * SOFTMAX_SPAN;
                if (s < s_hi) load8(row + s, s_hi - s, v[u]);
            }
        }
#pragma unroll
        for (int u = 0; u < SOFTMAX_HELD; ++u) {              // each lane's sum in column order
            const int s = s0 + lane * LOADS + u * SOFTMAX_SPAN;
            if (s < s_hi) softmax_span(v[u], s_hi - s, m, lsum, prow + s, plane);
        }
    }
    lsum = warp_sum(lsum);
    if (lane == 0) {
        float* part = partials + ((size_t)split * TH + r) * (C + 2);
        part[0] = m;
        part[1] = lsum;
    }
}

// 3b. grid (ceil(T H / TL::ROWS) * ceil(C / TL::COLS), n_split): o_j = sum_s p c_kv[s] over chunk j, both
// operands bf16 terms already (p from 3a, c_kv as appended), by GEMM_STAGES-deep cp.async copies as in the scores.
// Blocks of one (row tile, chunk) share their p; the column tiles vary fastest, so the cache chunk is shared
// through L2.
template <typename TL>
__device__ __forceinline__ void mla_pv_body(unsigned char* smem, const bf16_t* __restrict__ p, int p_pitch,
                                            const bf16_t* __restrict__ kv, int kv_rows, const int* __restrict__ meta,
                                            float* __restrict__ partials, int T, int H, int C, int R) {
    constexpr int A_ELEMS = 3 * TL::ROWS * SPITCH, B_ELEMS = 3 * KSTEP * TL::VPITCH;
    static_assert(GEMM_STAGES * (A_ELEMS + B_ELEMS) * 2 == PV_SMEM(TL), "PV_SMEM is not p c_kv's layout");
    constexpr int AP = TL::ROWS * KSTEP / LOADS / BLOCK_THREADS, BP = KSTEP * TL::COLS / LOADS / BLOCK_THREADS;
    constexpr int B_ROW_PIECES = TL::COLS / LOADS;
    bf16_t* As = reinterpret_cast<bf16_t*>(smem);             // [stage][term][row][s]
    bf16_t* Bs = As + GEMM_STAGES * A_ELEMS;                  // [stage][term][s][c]
    const int S = meta[0] + T, TH = T * H, n_split = gridDim.y, split = blockIdx.y, Kp = kv_pitch(C, R);
    const size_t pplane = (size_t)TH * p_pitch, kplane = (size_t)kv_rows * Kp;
    const int c_tiles = (C + TL::COLS - 1) / TL::COLS;
    const int r0 = (blockIdx.x / c_tiles) * TL::ROWS, c0 = (blockIdx.x % c_tiles) * TL::COLS;
    const int chunk = pv_chunk(S, n_split);
    const int s_lo = min(S, split * chunk), s_hi = min(S, s_lo + chunk);
    const int ia = threadIdx.x / (KSTEP / LOADS), ka = (threadIdx.x % (KSTEP / LOADS)) * LOADS;   // A: 8 in a row
    const int kb = threadIdx.x / B_ROW_PIECES, cb = (threadIdx.x % B_ROW_PIECES) * LOADS;        // B: 8 in a row
    const int cbytes = max(0, min(LOADS, C - c0 - cb)) * 2;   // the piece's c_kv columns (k_pe's: zeros)
    const bf16_t* prow[AP];
    bool rok[AP];
#pragma unroll
    for (int j = 0; j < AP; ++j) {
        const int i = ia + j * (BLOCK_THREADS / (KSTEP / LOADS));
        rok[j] = r0 + i < TH;
        prow[j] = p + (size_t)(rok[j] ? r0 + i : 0) * p_pitch;
    }
    auto load = [&](int stage, int k0) {                      // one 16-byte piece per term, operand and row
        const int k = k0 + ka, na = max(0, min(LOADS, s_hi - k)) * 2;
#pragma unroll
        for (int j = 0; j < AP; ++j) {
            const int i = ia + j * (BLOCK_THREADS / (KSTEP / LOADS)), n = rok[j] ? na : 0;
            const bf16_t* pa = prow[j] + (n ? k : 0);
#pragma unroll
            for (int t = 0; t < 3; ++t)
                cp_async16(As + stage * A_ELEMS + ((size_t)t * TL::ROWS + i) * SPITCH + ka, pa + t * pplane, n);
        }
#pragma unroll
        for (int j = 0; j < BP; ++j) {
            const int kr = kb + j * (BLOCK_THREADS / B_ROW_PIECES), s = k0 + kr, n = s < s_hi ? cbytes : 0;
            const bf16_t* pb = kv + (n ? (size_t)s * Kp + c0 + cb : 0);
#pragma unroll
            for (int t = 0; t < 3; ++t)
                cp_async16(Bs + stage * B_ELEMS + ((size_t)t * KSTEP + kr) * TL::VPITCH + cb, pb + t * kplane, n);
        }
    };
    float tot[TL::WM][TL::WN][4] = {}, lo[TL::WM][TL::WN][4] = {};
    staged_k_steps((s_hi - s_lo + KSTEP - 1) / KSTEP, [&](int stage, int i) { load(stage, s_lo + i * KSTEP); },
                   [&](int stage) { tile_mma<TL, true>(As + stage * A_ELEMS, Bs + stage * B_ELEMS, tot, lo); });
    float* part = partials + (size_t)split * TH * (C + 2);
#pragma unroll
    for (int mi = 0; mi < TL::WM; ++mi)
#pragma unroll
        for (int ni = 0; ni < TL::WN; ++ni)
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int r = r0 + TL::row(mi, i), c = c0 + TL::col(ni, i);
                if (r < TH && c < C) part[(size_t)r * (C + 2) + 2 + c] = tot[mi][ni][i] + lo[mi][ni][i];
            }
}

#define MLA_PV_ARGS const bf16_t* __restrict__ p, int p_pitch, const bf16_t* __restrict__ kv, int kv_rows, \
    const int* __restrict__ meta, float* __restrict__ partials, int T, int H, int C, int R
extern "C" __global__ void __launch_bounds__(BLOCK_THREADS, NARROW_BLOCKS_PER_SM) mla_pv_kernel(MLA_PV_ARGS) {
    AFTER_PREVIOUS_GRID();
    extern __shared__ __align__(16) unsigned char pv_smem[];
    mla_pv_body<Narrow>(pv_smem, p, p_pitch, kv, kv_rows, meta, partials, T, H, C, R);
}
extern "C" __global__ void __launch_bounds__(BLOCK_THREADS, WIDE_BLOCKS_PER_SM) mla_pv_wide_kernel(MLA_PV_ARGS) {
    AFTER_PREVIOUS_GRID();
    extern __shared__ __align__(16) unsigned char pv_wide_smem[];
    mla_pv_body<Wide>(pv_wide_smem, p, p_pitch, kv, kv_rows, meta, partials, T, H, C, R);
}

// 4. grid (H, ceil(T / ATTN_TOKENS), ceil(U / MERGE_U)): each block merges its tokens' chunks that hold rows
// (cheap, from L2), in chunk order, and applies MERGE_U rows of W_uv[h]
// (w_uv float32 in mla_merge_uv_kernel, bf16 bits in mla_merge_uv_bf16_kernel)
template <typename WT>
__device__ __forceinline__ void mla_merge_uv_body(const float* __restrict__ partials, int n_split,
                                                  const int* __restrict__ meta, const WT* __restrict__ w_uv,
                                                  float* __restrict__ o, int T, int H, int C, int U) {
    __shared__ float ol[ATTN_TOKENS][ATTN_MAX_C];
    __shared__ float wts[ATTN_TOKENS][ATTN_MAX_SPLIT];
    const int h = blockIdx.x, t0 = blockIdx.y * ATTN_TOKENS, nt = min(ATTN_TOKENS, T - t0), TH = T * H;
    {                                                         // the chunks that hold rows (the others were
        const int S = meta[0] + T, chunk = pv_chunk(S, n_split);   // skipped: each would add exactly 0)
        n_split = min(n_split, (S + chunk - 1) / chunk);
    }
    const size_t pstride = (size_t)TH * (C + 2);
    const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
    for (int tt = warp; tt < nt; tt += WARPS_PER_BLOCK) {      // chunk weights exp(m_j - M) / L: a warp per token,
        const float* p = partials + ((size_t)(t0 + tt) * H + h) * (C + 2);   // lane j' holds chunks j' + 32 i
        float M = -INFINITY;
        for (int j = lane; j < n_split; j += WARP_SIZE) M = fmaxf(M, p[j * pstride]);
        M = warp_max(M);
        float L = 0.0f;
        for (int j = lane; j < n_split; j += WARP_SIZE) {
            const float mj = p[j * pstride], w = (mj == -INFINITY) ? 0.0f : expf(mj - M);
            wts[tt][j] = w;
            L += w * p[j * pstride + 1];
        }
        L = warp_sum(L);
        for (int j = lane; j < n_split; j += WARP_SIZE) wts[tt][j] = L > 0.0f ? wts[tt][j] / L : 0.0f;
    }
    __syncthreads();
    for (int i = threadIdx.x; i < ATTN_TOKENS * C; i += blockDim.x) {   // tokens past T: zeros
        const int tt = i / C, c = i % C;
        float acc = 0.0f;
        if (tt < nt) {
            const float* p = partials + ((size_t)(t0 + tt) * H + h) * (C + 2) + 2 + c;
#pragma unroll 4
            for (int j = 0; j < n_split; ++j) acc += wts[tt][j] * p[j * pstride];
        }
        ol[tt][c] = acc;
    }
    __syncthreads();
    const int g = threadIdx.x % ROW_LANES, rows_per_pass = BLOCK_THREADS / ROW_LANES;
    const WT* wv = w_uv + (size_t)h * U * C;
    const int u_end = min(U, (int)(blockIdx.z + 1) * MERGE_U);
    for (int u0 = blockIdx.z * MERGE_U; u0 < u_end; u0 += rows_per_pass) {   // o[t, h, u] = W_uv[h, u] . o_lat[t]
        const int u = u0 + threadIdx.x / ROW_LANES;
        const WT* row = wv + (size_t)min(u, u_end - 1) * C;
        float acc[ATTN_TOKENS];
#pragma unroll
        for (int tt = 0; tt < ATTN_TOKENS; ++tt) acc[tt] = 0.0f;
#pragma unroll 8
        for (int c = g; c < C; c += ROW_LANES) {              // unrolled: W_uv loads in flight, sums in order
            const float w = wval(row[c]);
#pragma unroll
            for (int tt = 0; tt < ATTN_TOKENS; ++tt) acc[tt] += ol[tt][c] * w;
        }
#pragma unroll
        for (int tt = 0; tt < ATTN_TOKENS; ++tt) {
            float a = acc[tt];
            for (int off = ROW_LANES / 2; off > 0; off >>= 1) a += __shfl_xor_sync(0xffffffffu, a, off);
            if (u < u_end && g == 0 && tt < nt) o[((size_t)(t0 + tt) * H + h) * U + u] = a;
        }
    }
}

#define MLA_MERGE_UV_ARGS(WT) const float* __restrict__ partials, int n_split, const int* __restrict__ meta, \
    const WT* __restrict__ w_uv, float* __restrict__ o, int T, int H, int C, int U
extern "C" __global__ void __launch_bounds__(BLOCK_THREADS, MIN_BLOCKS_PER_SM) mla_merge_uv_kernel(MLA_MERGE_UV_ARGS(float)) {
    AFTER_PREVIOUS_GRID();
    mla_merge_uv_body(partials, n_split, meta, w_uv, o, T, H, C, U);
}
extern "C" __global__ void __launch_bounds__(BLOCK_THREADS, MIN_BLOCKS_PER_SM)
mla_merge_uv_bf16_kernel(MLA_MERGE_UV_ARGS(bf16_t)) {
    AFTER_PREVIOUS_GRID();
    mla_merge_uv_body(partials, n_split, meta, w_uv, o, T, H, C, U);
}
