// MLA attention in the absorbed latent form over the latent cache, one (token, head) per block:
//   q_pe <- rope(q_pe) (written back: q is the `q` tap)                rope.cuh
//   q_lat = q_nope @ W_uk[h]                                           [N] -> [C]
//   score[s] = (q_lat . c_kv[s] + q_pe . k_pe[s]) * scale + mask(t, s)
//   p = softmax(score);  o_lat = sum_s p[s] c_kv[s];  o = W_uv[h] @ o_lat   [C] -> [U]
// Contract (float32): q [T, H, A], q_nope at 0..N-1 and q_pe at N..A-1 of each head, q_pe rotated in place
// at positions[t] (int32 [T], device) with inv_freq float64 [R/2];
// w_uk [H, N, C] and w_uv [H, U, C] (kv_b_proj split per head, as stored); this layer's cache
// c_kv [S_cap, C], k_pe [S_cap, R], rows 0 .. S-1 valid, S = meta[0] + T (meta[0] = rows cached before
// this forward, read on the device so a replayed graph follows the cache); mask: NULL = causal (token t
// sees rows s <= meta[0] + t), else additive float32 [T, mask_stride] (0 visible, -inf hidden: DDTree
// verification); scores: scratch [T * H, S_cap]; o [T, H, U].
// Launch: grid (T * H), block BLOCK_THREADS, static shared memory ~23 KB at the limits below.
// Work split, for memory-level parallelism (at decode the block is latency-bound, not bandwidth-bound):
// scores and o = W_uv o_lat use 8-lane groups per row (4 rows per warp at once: a 64..512-wide row is
// 2..16 loads per lane, so a whole warp per row would spend its time in shuffles); q_lat and o_lat split
// their sum over n (resp. s) across the 8 warps (n = w mod 8), then add the 8 partial rows in order.
// Absorbing W_uk / W_uv and the q rope here saves three launches per layer. Determinism: every sum has a fixed order (loops, fixed butterflies, fixed trees).
// Limits: C <= ATTN_MAX_C, R <= ATTN_MAX_R, N <= ATTN_MAX_N (shared arrays; K2.6: 512, 64, 128).
#include "common.cuh"
#include "rope.cuh"

#define ATTN_MAX_C 512
#define ATTN_MAX_R 128
#define ATTN_MAX_N 256
#define ROW_LANES 8                         // lanes that share one cache row in the score pass

extern "C" __global__ void __launch_bounds__(BLOCK_THREADS, MIN_BLOCKS_PER_SM)
mla_attention_kernel(float* __restrict__ q, const int* __restrict__ positions, const double* __restrict__ inv_freq,
                     double attn_factor, const float* __restrict__ w_uk, const float* __restrict__ w_uv,
                     const float* __restrict__ c_kv, const float* __restrict__ k_pe,
                     const int* __restrict__ meta, const float* __restrict__ mask, int mask_stride,
                     float* __restrict__ scores, int S_cap, float* __restrict__ o,
                     int H, int C, int R, int N, int U, float scale) {
    __shared__ float qn[ATTN_MAX_N];
    __shared__ float qs[ATTN_MAX_C + ATTN_MAX_R];   // q_lat then q_pe
    __shared__ float ol[ATTN_MAX_C];
    __shared__ float part[WARPS_PER_BLOCK][ATTN_MAX_C];
    __shared__ float buf[BLOCK_THREADS];
    const int th = blockIdx.x, t = th / H, h = th % H, A = N + R;
    const int T = gridDim.x / H, S0 = meta[0], S = S0 + T;
    const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
    float* qr = q + (size_t)th * A;
    for (int i = threadIdx.x; i < N; i += blockDim.x) qn[i] = qr[i];
    for (int i = threadIdx.x; i < R / 2; i += blockDim.x) {  // rope on q_pe: this block owns q[t, h]
        float y0, y1;
        rope_pair(qr[N + 2 * i], qr[N + 2 * i + 1], (double)positions[t], inv_freq[i], attn_factor, &y0, &y1);
        qs[C + 2 * i] = qr[N + 2 * i] = y0;
        qs[C + 2 * i + 1] = qr[N + 2 * i + 1] = y1;
    }
    __syncthreads();
    const float* wk = w_uk + (size_t)h * N * C;
    for (int c = lane; c < C; c += WARP_SIZE) {              // 0. q_lat: warp w sums n = w (mod 8), lanes
        float acc = 0.0f;                                     //    over c (coalesced W_uk rows); the loads of
        for (int n = warp; n < N; n += WARPS_PER_BLOCK) acc += qn[n] * wk[(size_t)n * C + c];  // a thread are
        part[warp][c] = acc;                                  //    independent: one memory round trip, not N
    }
    __syncthreads();
    for (int c = threadIdx.x; c < C; c += blockDim.x) {
        float acc = 0.0f;
        for (int w = 0; w < WARPS_PER_BLOCK; ++w) acc += part[w][c];
        qs[c] = acc;
    }
    __syncthreads();
    float* sc = scores + (size_t)th * S_cap;

    const int g = lane % ROW_LANES, rows_per_pass = BLOCK_THREADS / ROW_LANES;
    for (int s0 = 0; s0 < S; s0 += rows_per_pass) {          // 1. scores, 8 lanes per cache row
        const int s = s0 + threadIdx.x / ROW_LANES;
        float acc = 0.0f;
        if (s < S) {
            for (int i = g; i < C; i += ROW_LANES) acc += qs[i] * c_kv[(size_t)s * C + i];
            for (int i = g; i < R; i += ROW_LANES) acc += qs[C + i] * k_pe[(size_t)s * R + i];
        }
        for (int off = ROW_LANES / 2; off > 0; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
        if (s < S && g == 0) {
            const float m = mask ? mask[(size_t)t * mask_stride + s] : (s <= S0 + t ? 0.0f : -INFINITY);
            sc[s] = acc * scale + m;
        }
    }
    __syncthreads();

    float mx = -INFINITY;                                     // 2. softmax, fixed-order reductions
    for (int s = threadIdx.x; s < S; s += blockDim.x) mx = fmaxf(mx, sc[s]);
    mx = block_max(mx, buf);
    float sum = 0.0f;
    for (int s = threadIdx.x; s < S; s += blockDim.x) {
        const float e = (mx == -INFINITY) ? 0.0f : expf(sc[s] - mx);
        sc[s] = e;
        sum += e;
    }
    sum = block_sum(sum, buf);
    const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
    for (int s = threadIdx.x; s < S; s += blockDim.x) sc[s] = sc[s] * inv;
    __syncthreads();

    for (int c = lane; c < C; c += WARP_SIZE) {              // 3. o_lat: warp w sums rows s = w (mod 8)
        float acc = 0.0f;
        for (int s = warp; s < S; s += WARPS_PER_BLOCK) acc += sc[s] * c_kv[(size_t)s * C + c];
        part[warp][c] = acc;
    }
    __syncthreads();
    for (int c = threadIdx.x; c < C; c += blockDim.x) {
        float acc = 0.0f;
        for (int w = 0; w < WARPS_PER_BLOCK; ++w) acc += part[w][c];
        ol[c] = acc;
    }
    __syncthreads();

    const float* wv = w_uv + (size_t)h * U * C;              // 4. o = W_uv o_lat, 8 lanes per output u
    for (int u0 = 0; u0 < U; u0 += rows_per_pass) {
        const int u = u0 + threadIdx.x / ROW_LANES;
        float acc = 0.0f;
        if (u < U)
            for (int c = g; c < C; c += ROW_LANES) acc += ol[c] * wv[(size_t)u * C + c];
        for (int off = ROW_LANES / 2; off > 0; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
        if (u < U && g == 0) o[(size_t)th * U + u] = acc;
    }
}
