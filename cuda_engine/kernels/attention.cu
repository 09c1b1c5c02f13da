// MLA attention in the absorbed latent form over the latent cache, per (token, head) and split of the rows:
//   q = W_qb[h] c_q;  q_pe <- rope(q_pe);  q written out (the `q` tap)   [Q] -> [A]; rope.cuh
//   q_lat = q_nope @ W_uk[h]                                            [N] -> [C]
//   score[s] = (q_lat . c_kv[s] + q_pe . k_pe[s]) * scale + mask(t, s)
//   p = softmax(score);  o_lat = sum_s p[s] c_kv[s];  o = W_uv[h] @ o_lat   [C] -> [U]
// Contract (float32): c_q [T, Q] (the normed q latent), W_qb [H * A, Q] (q_b_proj); out q [T, H, A],
// q_nope at 0..N-1 and q_pe at N..A-1 of each head, q_pe rotated at positions[t] (int32 [T], device) with
// inv_freq float64 [R/2]; w_uk [H, N, C] and w_uv [H, U, C] (kv_b_proj split per head, as stored); this
// layer's cache c_kv [S_cap, C], k_pe [S_cap, R], rows 0 .. S-1 valid, S = meta[0] + T (meta[0] = rows
// cached before this forward, read on the device so a replayed graph follows the cache); mask: NULL =
// causal (token t sees rows s <= meta[0] + t), else additive float32 [T, mask_stride] (0 visible, -inf
// hidden: DDTree verification); scores: scratch [T * H, S_cap]; partials: scratch
// [T * H * gridDim.y, C + 2]; tickets: int [T * H], zero before the launch (the kernel leaves them zero);
// o [T, H, U].
// Launch: grid (T * H, n_split), block BLOCK_THREADS, static shared memory ~31 KB at the limits below.
// Split over the cache rows (flash-decoding): at decode there are only H blocks of (token, head), too few
// for the GPU, so the host gives each n_split (<= ATTN_MAX_SPLIT) blocks, each owning a contiguous chunk
// of rows: local max, local exp-sum and unnormalised o_lat go to `partials`; the last block of a
// (token, head) to finish (a ticket counter elects it; the counter only elects, it orders no arithmetic)
// merges the chunks in chunk order, then applies W_uv. Every split recomputes q (cheap next to the rows).
// Work split inside a block, for memory-level parallelism (the block is latency-bound): rows of W_qb,
// cache rows and rows of W_uv use 8-lane groups (4 rows per warp at once); q_lat and o_lat split their sum
// over n (resp. s) across the 8 warps, then add the 8 partial rows in order.
// Determinism: every sum has a fixed order for a given launch shape (loops, butterflies, trees, chunks).
// Limits: C <= ATTN_MAX_C, R <= ATTN_MAX_R, N <= ATTN_MAX_N, Q <= ATTN_MAX_Q (shared arrays; K2.6: 512,
// 64, 128, 1536).
#include "common.cuh"
#include "rope.cuh"

#define ATTN_MAX_C 512
#define ATTN_MAX_R 128
#define ATTN_MAX_N 256
#define ATTN_MAX_Q 2048
#define ATTN_MAX_SPLIT 8
#define ROW_LANES 8                         // lanes that share one row in the row-dot passes

// dot of the block's 8-lane group with row r of W (row length n, smem vector v); full sums on lane g == 0
__device__ __forceinline__ float group_dot(const float* __restrict__ v, const float* __restrict__ row, int n, int g) {
    float acc = 0.0f;
    for (int i = g; i < n; i += ROW_LANES) acc += v[i] * row[i];
    for (int off = ROW_LANES / 2; off > 0; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
    return acc;
}

extern "C" __global__ void __launch_bounds__(BLOCK_THREADS, MIN_BLOCKS_PER_SM)
mla_attention_kernel(const float* __restrict__ cq, int Q, const float* __restrict__ w_qb, float* __restrict__ q,
                     const int* __restrict__ positions, const double* __restrict__ inv_freq,
                     double attn_factor, const float* __restrict__ w_uk, const float* __restrict__ w_uv,
                     const float* __restrict__ c_kv, const float* __restrict__ k_pe,
                     const int* __restrict__ meta, const float* __restrict__ mask, int mask_stride,
                     float* __restrict__ scores, int S_cap, float* __restrict__ partials, int* __restrict__ tickets,
                     float* __restrict__ o, int H, int C, int R, int N, int U, float scale) {
    __shared__ float cqs[ATTN_MAX_Q];
    __shared__ float qn[ATTN_MAX_N];
    __shared__ float qs[ATTN_MAX_C + ATTN_MAX_R];   // q_lat then q_pe
    __shared__ float ol[ATTN_MAX_C];
    __shared__ float part[WARPS_PER_BLOCK][ATTN_MAX_C];
    __shared__ float buf[BLOCK_THREADS];
    __shared__ float chunk_w[ATTN_MAX_SPLIT];
    __shared__ int is_last;
    const int th = blockIdx.x, t = th / H, h = th % H, A = N + R, split = blockIdx.y, n_split = gridDim.y;
    const int T = gridDim.x / H, S0 = meta[0], S = S0 + T;
    const int chunk = (S + n_split - 1) / n_split, s_lo = min(S, split * chunk), s_hi = min(S, s_lo + chunk);
    const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
    const int g = lane % ROW_LANES, rows_per_pass = BLOCK_THREADS / ROW_LANES;
    for (int i = threadIdx.x; i < Q; i += blockDim.x) cqs[i] = cq[(size_t)t * Q + i];
    __syncthreads();
    float* qr = q + (size_t)th * A;                           // split 0 writes the q tap
    for (int a0 = 0; a0 < A; a0 += rows_per_pass) {          // q = W_qb[h] c_q
        const int a = a0 + threadIdx.x / ROW_LANES;
        const float acc = group_dot(cqs, w_qb + ((size_t)h * A + min(a, A - 1)) * Q, Q, g);
        if (a < A && g == 0) {
            if (a < N) qn[a] = acc;
            else qs[C + a - N] = acc;
            if (a < N && split == 0) qr[a] = acc;
        }
    }
    __syncthreads();
    for (int i = threadIdx.x; i < R / 2; i += blockDim.x) {  // rope on q_pe
        float y0, y1;
        rope_pair(qs[C + 2 * i], qs[C + 2 * i + 1], (double)positions[t], inv_freq[i], attn_factor, &y0, &y1);
        qs[C + 2 * i] = y0;
        qs[C + 2 * i + 1] = y1;
        if (split == 0) { qr[N + 2 * i] = y0; qr[N + 2 * i + 1] = y1; }
    }
    const float* wk = w_uk + (size_t)h * N * C;
    for (int c = lane; c < C; c += WARP_SIZE) {              // q_lat: warp w sums n = w (mod 8)
        float acc = 0.0f;
        for (int n = warp; n < N; n += WARPS_PER_BLOCK) acc += qn[n] * wk[(size_t)n * C + c];
        part[warp][c] = acc;
    }
    __syncthreads();
    for (int c = threadIdx.x; c < C; c += blockDim.x) {
        float acc = 0.0f;
        for (int w = 0; w < WARPS_PER_BLOCK; ++w) acc += part[w][c];
        qs[c] = acc;
    }
    __syncthreads();

    float* sc = scores + (size_t)th * S_cap;
    for (int s0 = s_lo; s0 < s_hi; s0 += rows_per_pass) {    // scores of this chunk's rows
        const int s = min(s0 + threadIdx.x / ROW_LANES, s_hi - 1);
        const float acc = group_dot(qs, c_kv + (size_t)s * C, C, g) + group_dot(qs + C, k_pe + (size_t)s * R, R, g);
        if (s0 + threadIdx.x / ROW_LANES < s_hi && g == 0) {
            const float m = mask ? mask[(size_t)t * mask_stride + s] : (s <= S0 + t ? 0.0f : -INFINITY);
            sc[s] = acc * scale + m;
        }
    }
    __syncthreads();
    float mx = -INFINITY;                                     // this chunk's max and exp-sum
    for (int s = s_lo + threadIdx.x; s < s_hi; s += blockDim.x) mx = fmaxf(mx, sc[s]);
    mx = block_max(mx, buf);
    float sum = 0.0f;
    for (int s = s_lo + threadIdx.x; s < s_hi; s += blockDim.x) {
        const float e = (mx == -INFINITY) ? 0.0f : expf(sc[s] - mx);
        sc[s] = e;
        sum += e;
    }
    sum = block_sum(sum, buf);                                // ends with a barrier: sc is complete
    float* mine = partials + ((size_t)th * n_split + split) * (C + 2);
    for (int c = lane; c < C; c += WARP_SIZE) {              // unnormalised o_lat of the chunk
        float acc = 0.0f;
        for (int s = s_lo + warp; s < s_hi; s += WARPS_PER_BLOCK) acc += sc[s] * c_kv[(size_t)s * C + c];
        part[warp][c] = acc;
    }
    __syncthreads();
    for (int c = threadIdx.x; c < C; c += blockDim.x) {
        float acc = 0.0f;
        for (int w = 0; w < WARPS_PER_BLOCK; ++w) acc += part[w][c];
        if (n_split == 1) ol[c] = acc; else mine[2 + c] = acc;
    }
    if (n_split > 1) {                                        // publish, elect the last block, merge
        if (threadIdx.x == 0) { mine[0] = mx; mine[1] = sum; }
        __threadfence();
        __syncthreads();
        if (threadIdx.x == 0) is_last = atomicAdd(&tickets[th], 1) == n_split - 1;
        __syncthreads();
        if (!is_last) return;
        __threadfence();
        const float* all = partials + (size_t)th * n_split * (C + 2);
        if (threadIdx.x == 0) {
            float M = -INFINITY, L = 0.0f;
            for (int j = 0; j < n_split; ++j) M = fmaxf(M, __ldcg(all + j * (C + 2)));
            for (int j = 0; j < n_split; ++j) {
                const float mj = __ldcg(all + j * (C + 2));
                chunk_w[j] = (mj == -INFINITY) ? 0.0f : expf(mj - M);
                L += chunk_w[j] * __ldcg(all + j * (C + 2) + 1);
            }
            for (int j = 0; j < n_split; ++j) chunk_w[j] = L > 0.0f ? chunk_w[j] / L : 0.0f;
            tickets[th] = 0;                                  // ready for the next launch (graph replays)
        }
        __syncthreads();
        for (int c = threadIdx.x; c < C; c += blockDim.x) {
            float acc = 0.0f;
            for (int j = 0; j < n_split; ++j) acc += chunk_w[j] * __ldcg(all + j * (C + 2) + 2 + c);
            ol[c] = acc;
        }
    } else {
        const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
        for (int c = threadIdx.x; c < C; c += blockDim.x) ol[c] *= inv;
    }
    __syncthreads();

    const float* wv = w_uv + (size_t)h * U * C;              // o = W_uv o_lat
    for (int u0 = 0; u0 < U; u0 += rows_per_pass) {
        const int u = u0 + threadIdx.x / ROW_LANES;
        const float acc = group_dot(ol, wv + (size_t)min(u, U - 1) * C, C, g);
        if (u < U && g == 0) o[(size_t)th * U + u] = acc;
    }
}
