// The DFlash drafter (docs/ddtree.md §2), float32. The DDTree round's kernels (the target compaction, the
// tree builder, the verify's tree mask, the walk) are in ddtree.cu.
//
// The drafter's D-wide norms, projections and residual adds reuse norm.cu and linear.cu; these kernels do
// what is drafter-only. Every kernel reads its row offsets and positions from the drafter's small device
// `meta` block (int32), so the block forward (fixed B rows) can be captured once as a CUDA graph and
// replayed each round after the host rewrites meta (drafter_meta.cuh).
//
//   drafter_gather_kernel: feat[i, k D + d] = resid_out[layer_ids[k], rows[i], d]: the fused target features
//       of the committed rows (the target's per-layer residual outputs of the last forward, in path order).
//       Launch grid (C, nL), block BLOCK_THREADS.
//   drafter_embed_kernel: h[t] = table[ids[t]] + pe[t] (pe may be null: no block_pos_embed).
//       Launch grid (B), block BLOCK_THREADS.
//   drafter_block_qk_kernel: per block row t and head: q heads (0 .. H-1) and k heads (H .. H+G-1) of the
//       fused qkv projection [B, (H + 2G) Dh]: per-head RMSNorm (q_norm / k_norm) then NeoX RoPE at
//       blk_pos + t -> q [B, H, Dh], kb [B, G, Dh]; V stays in qkv. Launch grid (B, H + G), block WARP_SIZE.
//   drafter_ctx_kv_kernel: per context row t and kv head: kv [C, 2G Dh] -> K (k_norm, RoPE at ctx_pos + t)
//       and V (copied) into the drafter cache row ctx_row + t, for t < n_new. Launch grid (>= C, G),
//   drafter_attention_kernel: per block row t and query head h (kv head h / (H/G)): softmax(q K^T Dh^-1/2) V
//       over the n_ctx cached rows and the B block rows, no mask (every block row sees every key).
//       scores: scratch [B H, n_ctx_cap + B]; Dh <= 128. Launch grid (B H), block BLOCK_THREADS.
//   silu_mul_kernel: act[t, i] = silu(gu[t, i]) * gu[t, I + i] (gate and up of one fused projection).
//       Launch grid (T), block BLOCK_THREADS.
//
// Numerics follow refmodel/drafter.py in float32: RMSNorm as x / sqrt(mean(x^2) + eps) * w, RoPE angles and
// cos/sin in float64 rounded once to float32, the rotation without FMA contraction (as NumPy rounds it).
// Reductions are fixed-order (warp butterflies, fixed trees): every run gives the same bits.
#include "common.cuh"
#include "drafter_meta.cuh"

extern "C" __global__ void __launch_bounds__(BLOCK_THREADS, MIN_BLOCKS_PER_SM)
drafter_gather_kernel(const float* __restrict__ resid_out, long long layer_stride, int D,
                      const int* __restrict__ layer_ids, int nL, const int* __restrict__ rows,
                      float* __restrict__ feat) {
    AFTER_PREVIOUS_GRID();
    const int i = blockIdx.x, k = blockIdx.y;
    const float* src = resid_out + (size_t)layer_ids[k] * layer_stride + (size_t)rows[i] * D;
    float* dst = feat + (size_t)i * nL * D + (size_t)k * D;
    for (int d = threadIdx.x; d < D; d += blockDim.x) dst[d] = src[d];
}

// The target's embedding rows (float32, or bf16 bits in drafter_embed_bf16_kernel: common.cuh, wval)
template <typename WT>
__device__ __forceinline__ void drafter_embed_body(const int* __restrict__ ids, const WT* __restrict__ table,
                                                   const float* __restrict__ pe, float* __restrict__ h, int D) {
    const int t = blockIdx.x;
    const WT* src = table + (size_t)ids[t] * D;
    for (int d = threadIdx.x; d < D; d += blockDim.x)
        h[(size_t)t * D + d] = pe ? __fadd_rn(wval(src[d]), pe[(size_t)t * D + d]) : wval(src[d]);
}

#define DRAFTER_EMBED_ARGS(WT) const int* __restrict__ ids, const WT* __restrict__ table, const float* __restrict__ pe, \
    float* __restrict__ h, int D
extern "C" __global__ void __launch_bounds__(BLOCK_THREADS, MIN_BLOCKS_PER_SM) drafter_embed_kernel(DRAFTER_EMBED_ARGS(float)) {
    AFTER_PREVIOUS_GRID();
    drafter_embed_body(ids, table, pe, h, D);
}
extern "C" __global__ void __launch_bounds__(BLOCK_THREADS, MIN_BLOCKS_PER_SM)
drafter_embed_bf16_kernel(DRAFTER_EMBED_ARGS(bf16_t)) {
    AFTER_PREVIOUS_GRID();
    drafter_embed_body(ids, table, pe, h, D);
}

// One warp: RMSNorm of one head x[0 .. Dh) with weight w, then NeoX rotate-half RoPE at `pos`, into y.
__device__ __forceinline__ void head_norm_rope(const float* x, const float* w, int Dh, float eps, double pos,
                                               const double* inv_freq, float* y) {
    const int lane = threadIdx.x;
    float ss = 0.0f;
    for (int i = lane; i < Dh; i += WARP_SIZE) ss += x[i] * x[i];
    const float s = sqrtf(warp_sum(ss) / (float)Dh + eps);
    const int half = Dh / 2;
    for (int i = lane; i < half; i += WARP_SIZE) {
        const float x1 = __fmul_rn(__fdiv_rn(x[i], s), w[i]), x2 = __fmul_rn(__fdiv_rn(x[i + half], s), w[i + half]);
        const double ang = pos * inv_freq[i];
        const float c = (float)cos(ang), sn = (float)sin(ang);
        y[i] = __fsub_rn(__fmul_rn(x1, c), __fmul_rn(x2, sn));
        y[i + half] = __fadd_rn(__fmul_rn(x2, c), __fmul_rn(x1, sn));
    }
}

extern "C" __global__ void drafter_block_qk_kernel(const float* __restrict__ qkv, int H, int G, int Dh,
                                                   const float* __restrict__ wq, const float* __restrict__ wk,
                                                   float eps, const int* __restrict__ meta,
                                                   const double* __restrict__ inv_freq, float* __restrict__ q,
                                                   float* __restrict__ kb) {
    AFTER_PREVIOUS_GRID();
    const int t = blockIdx.x, hd = blockIdx.y;
    const float* x = qkv + (size_t)t * (H + 2 * G) * Dh + (size_t)hd * Dh;
    const double pos = (double)meta[DMETA_BLK_POS] + t;
    if (hd < H) head_norm_rope(x, wq, Dh, eps, pos, inv_freq, q + ((size_t)t * H + hd) * Dh);
    else head_norm_rope(x, wk, Dh, eps, pos, inv_freq, kb + ((size_t)t * G + hd - H) * Dh);
}

extern "C" __global__ void drafter_ctx_kv_kernel(const float* __restrict__ kv, int G, int Dh,
                                                 const float* __restrict__ wk, float eps,
                                                 const int* __restrict__ meta, const double* __restrict__ inv_freq,
                                                 float* __restrict__ kcache, float* __restrict__ vcache) {
    AFTER_PREVIOUS_GRID();
    const int t = blockIdx.x, g = blockIdx.y;
    if (t >= meta[DMETA_N_NEW]) return;                    // padding rows of a fixed-shape launch
    const float* x = kv + (size_t)t * 2 * G * Dh;
    const size_t row = (size_t)meta[DMETA_CTX_ROW] + t;
    head_norm_rope(x + (size_t)g * Dh, wk, Dh, eps, (double)meta[DMETA_CTX_POS] + t, inv_freq,
                   kcache + (row * G + g) * Dh);
    for (int i = threadIdx.x; i < Dh; i += WARP_SIZE)
        vcache[(row * G + g) * Dh + i] = x[(size_t)(G + g) * Dh + i];
}

extern "C" __global__ void __launch_bounds__(BLOCK_THREADS, MIN_BLOCKS_PER_SM)
drafter_attention_kernel(const float* __restrict__ q, const float* __restrict__ kb, const float* __restrict__ qkv,
                         const float* __restrict__ kcache, const float* __restrict__ vcache,
                         const int* __restrict__ meta, int B, int H, int G, int Dh, float scale,
                         float* __restrict__ scores, int scores_stride, float* __restrict__ out) {
    AFTER_PREVIOUS_GRID();
    __shared__ float buf[BLOCK_THREADS];
    const int t = blockIdx.x / H, h = blockIdx.x % H, g = h / (H / G);
    const int n_ctx = meta[DMETA_N_CTX], n = n_ctx + B;
    const float* qr = q + ((size_t)t * H + h) * Dh;
    float* s = scores + (size_t)blockIdx.x * scores_stride;
    float m = -INFINITY;
    for (int j = threadIdx.x; j < n; j += blockDim.x) {
        const float* k = j < n_ctx ? kcache + ((size_t)j * G + g) * Dh : kb + ((size_t)(j - n_ctx) * G + g) * Dh;
        float acc = 0.0f;
        for (int d = 0; d < Dh; ++d) acc += qr[d] * k[d];
        acc *= scale;
        s[j] = acc;
        m = fmaxf(m, acc);
    }
    m = block_max(m, buf);
    float z = 0.0f;
    for (int j = threadIdx.x; j < n; j += blockDim.x) {
        const float e = expf(s[j] - m);
        s[j] = e;
        z += e;
    }
    z = block_sum(z, buf);                          // also a barrier: every s[j] is written
    // out[d] = sum_j (s[j] / z) v[j, d]: warp w takes keys j = w, w + 8, ..., its lanes the head dims; the 8
    // partial sums are added in warp order (fixed). Dh <= 4 * WARP_SIZE (the host checks).
    const int vstride = (H + 2 * G) * Dh, warp = threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE;
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int j = warp; j < n; j += WARPS_PER_BLOCK) {
        const float p = s[j] / z;
        const float* v = j < n_ctx ? vcache + ((size_t)j * G + g) * Dh
                                   : qkv + (size_t)(j - n_ctx) * vstride + (size_t)(H + G + g) * Dh;
#pragma unroll
        for (int c = 0; c < 4; ++c) {
            const int d = lane + c * WARP_SIZE;
            if (d < Dh) acc[c] += p * v[d];
        }
    }
    __syncthreads();                                // buf is reused for the cross-warp sum
#pragma unroll
    for (int c = 0; c < 4; ++c) {
        const int d = lane + c * WARP_SIZE;
        buf[threadIdx.x] = acc[c];
        __syncthreads();
        if (warp == 0 && d < Dh) {
            float o = 0.0f;
            for (int w = 0; w < WARPS_PER_BLOCK; ++w) o += buf[w * WARP_SIZE + lane];
            out[((size_t)t * H + h) * Dh + d] = o;
        }
        __syncthreads();
    }
}

extern "C" __global__ void __launch_bounds__(BLOCK_THREADS, MIN_BLOCKS_PER_SM)
silu_mul_kernel(const float* __restrict__ gu, float* __restrict__ act, int I) {
    AFTER_PREVIOUS_GRID();
    const int t = blockIdx.x;
    for (int i = threadIdx.x; i < I; i += blockDim.x) {
        const float g = gu[(size_t)t * 2 * I + i];
        act[(size_t)t * I + i] = __fmul_rn(__fdiv_rn(g, __fadd_rn(1.0f, expf(-g))), gu[(size_t)t * 2 * I + I + i]);
    }
}
