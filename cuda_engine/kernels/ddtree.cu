// The DDTree round on the device, float32 (docs/ddtree.md; the drafter's own kernels: drafter.cu): the target
// compaction inside a captured round, the verify's tree mask, the tree builder and the greedy walk. Row
// offsets and positions come from the drafter's meta block (drafter_meta.cuh).
//
//   ddtree_compact_kernel: kv_cache.cu's in-order compaction of the TARGET cache (kv_layout.cuh: kv_move_rows)
//       with n and start from the
//       drafter's meta (keep_n, keep_start) and keep = the context rows, so it sits in a captured round.
//       Launch grid (target layers), block BLOCK_THREADS.
//   tree_mask_kernel: the verify's additive mask [T, mask_stride]: columns [0, start) 0 (committed), column
//       start + j 0 when node j is node i or one of its ancestors (parents[j] < j), else -inf; start = meta[0]
//       of the TARGET (its cached rows). Launch grid (T), block BLOCK_THREADS.
#include "common.cuh"
#include "drafter_meta.cuh"
#include "kv_layout.cuh"

extern "C" __global__ void __launch_bounds__(BLOCK_THREADS, MIN_BLOCKS_PER_SM)
ddtree_compact_kernel(unsigned short* kv, const int* __restrict__ keep, const int* __restrict__ meta, int kv_rows,
                      int Kp) {
    AFTER_PREVIOUS_GRID();
    kv_move_rows(kv + (size_t)blockIdx.x * 3 * kv_rows * Kp, keep, meta[DMETA_KEEP_N], meta[DMETA_KEEP_START],
                 kv_rows, Kp);
}

extern "C" __global__ void __launch_bounds__(BLOCK_THREADS, MIN_BLOCKS_PER_SM)
tree_mask_kernel(const int* __restrict__ parents, int T, const int* __restrict__ target_meta,
                 float* __restrict__ mask, int mask_stride) {
    AFTER_PREVIOUS_GRID();
    const int i = blockIdx.x, start = target_meta[0];
    float* row = mask + (size_t)i * mask_stride;
    for (int c = threadIdx.x; c < start + T; c += blockDim.x) {
        float v = 0.0f;
        if (c >= start) {
            const int j = c - start;
            int a = i;
            while (a > j) a = parents[a];          // parents[a] < a: climbs to the root (-1 ends below j)
            v = a == j ? 0.0f : -INFINITY;
        }
        row[c] = v;
    }
}

// ---------------------------------------------------------------------------------------------------------
// The DDTree builder on the device (docs/ddtree.md §3; refmodel.ddtree.build_ddtree's algorithm).
//
//   ddtree_topk_kernel: per drafter row d: the top-K token ids by decreasing logit, ties to the lower id (a
//       stable argsort of -x), and their float32 log-probs lp = logit - (m + log(sum(exp(x - m)))).
//       K rounds of a block argmax restricted to the ids after the previous pick in that order.
//       The log-sum-exp sums in a fixed tree order (NumPy: pairwise), so lp may differ from NumPy's in the
//       last float32 bit, equally for a whole row. Launch grid (L), block BLOCK_THREADS.
//   ddtree_heap_kernel: the best-first search over lp [L, K]: pop the entry of highest score (float64; ties:
//       the lexicographically smaller rank path, a prefix before its extension: Python's tuple order), add the
//       node, push its next-rank sibling (score formed incrementally, (s - lp[r]) + lp[r + 1]) and its rank-0
//       first child (s + lp[d][0]). Entries are unique, so any exact priority queue pops the same sequence as
//       heapq; here one warp scans the <= 2N + 1 live entries per pop. Outputs the tree as `rec`
//       ([n, ids T, parents T, depths T, ranks T, ...]; row 0 the root = block_ids[0]), and the target's
//       verify inputs: meta (cached rows = start), ids, positions = blk_pos + depth.
//       Dynamic shared memory: cap (8 + 12) + (N + 1) L 4 + L K 8 bytes (entries, node paths, lp and top_id
//       staged), cap = 2N + 2. Launch grid (1), block WARP_SIZE.

__device__ __forceinline__ bool topk_better(float v, int i, float bv, int bi) {
    return i >= 0 && (bi < 0 || v > bv || (v == bv && i < bi));
}

extern "C" __global__ void __launch_bounds__(BLOCK_THREADS, MIN_BLOCKS_PER_SM)
ddtree_topk_kernel(const float* __restrict__ logits, int V, int K, int* __restrict__ top_id, float* __restrict__ lp) {
    AFTER_PREVIOUS_GRID();
    __shared__ float buf[BLOCK_THREADS];
    __shared__ float wv[WARPS_PER_BLOCK];
    __shared__ int wi[WARPS_PER_BLOCK];
    __shared__ float pick_v;
    __shared__ int pick_i;
    const int row = blockIdx.x, lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
    const float* x = logits + (size_t)row * V;
    float m = -INFINITY;
    for (int v = threadIdx.x; v < V; v += blockDim.x) m = fmaxf(m, x[v]);
    m = block_max(m, buf);
    float z = 0.0f;
    for (int v = threadIdx.x; v < V; v += blockDim.x) z += expf(x[v] - m);
    z = block_sum(z, buf);
    const float log_z = __fadd_rn(m, logf(z));
    float pv = INFINITY;
    int pi = -1;
    for (int r = 0; r < K; ++r) {
        float bv = -INFINITY;
        int bi = -1;
        for (int v = threadIdx.x; v < V; v += blockDim.x) {
            const float xv = x[v];
            if ((xv < pv || (xv == pv && v > pi)) && topk_better(xv, v, bv, bi)) { bv = xv; bi = v; }
        }
        for (int off = WARP_SIZE / 2; off > 0; off >>= 1) {
            const float ov = __shfl_xor_sync(0xffffffffu, bv, off);
            const int oi = __shfl_xor_sync(0xffffffffu, bi, off);
            if (topk_better(ov, oi, bv, bi)) { bv = ov; bi = oi; }
        }
        if (lane == 0) { wv[warp] = bv; wi[warp] = bi; }
        __syncthreads();
        if (threadIdx.x == 0) {
            for (int w = 1; w < WARPS_PER_BLOCK; ++w)
                if (topk_better(wv[w], wi[w], bv, bi)) { bv = wv[w]; bi = wi[w]; }
            top_id[(size_t)row * K + r] = bi;
            lp[(size_t)row * K + r] = __fsub_rn(bv, log_z);
            pick_v = bv;
            pick_i = bi;
        }
        __syncthreads();
        pv = pick_v;
        pi = pick_i;
    }
}

// Bitonic variant for V <= TOPK_SORT_MAX: the row's (value, id) pairs sorted in shared memory as 64-bit
// keys (order-preserving float bits, then the complemented id: larger value first, lower id on ties; -0.0
// counted as +0.0 as NumPy compares them), descending. Dynamic shared memory P2 * 8 bytes, P2 = the next
// power of two >= V. Same outputs as ddtree_topk_kernel. Launch grid (L), block BLOCK_THREADS.
#define TOPK_SORT_MAX 4096
extern "C" __global__ void __launch_bounds__(BLOCK_THREADS, MIN_BLOCKS_PER_SM)
ddtree_topk_sort_kernel(const float* __restrict__ logits, int V, int K, int P2, int* __restrict__ top_id,
                        float* __restrict__ lp) {
    AFTER_PREVIOUS_GRID();
    __shared__ float buf[BLOCK_THREADS];
    extern __shared__ unsigned long long key[];
    const int row = blockIdx.x;
    const float* x = logits + (size_t)row * V;
    float m = -INFINITY;
    for (int v = threadIdx.x; v < V; v += blockDim.x) m = fmaxf(m, x[v]);
    m = block_max(m, buf);
    float z = 0.0f;
    for (int v = threadIdx.x; v < V; v += blockDim.x) z += expf(x[v] - m);
    z = block_sum(z, buf);
    const float log_z = __fadd_rn(m, logf(z));
    for (int i = threadIdx.x; i < P2; i += blockDim.x) {
        unsigned long long k = 0ull;                        // padding sorts last
        if (i < V) {
            const float xv = x[i] == 0.0f ? 0.0f : x[i];
            const unsigned int u = __float_as_uint(xv);
            const unsigned int o = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
            k = ((unsigned long long)o << 32) | (unsigned long long)(0xFFFFFFFFu - (unsigned int)i);
        }
        key[i] = k;
    }
    __syncthreads();
    for (int k = 2; k <= P2; k <<= 1) {
        for (int j = k >> 1; j > 0; j >>= 1) {
            for (int i = threadIdx.x; i < P2; i += blockDim.x) {
                const int p = i ^ j;
                if (p > i) {
                    const unsigned long long a = key[i], b = key[p];
                    if (((i & k) == 0) ? (a < b) : (a > b)) { key[i] = b; key[p] = a; }
                }
            }
            __syncthreads();
        }
    }
    for (int r = threadIdx.x; r < K; r += blockDim.x) {
        const int id = (int)(0xFFFFFFFFu - (unsigned int)(key[r] & 0xFFFFFFFFull));
        top_id[(size_t)row * K + r] = id;
        lp[(size_t)row * K + r] = __fsub_rn(x[id], log_z);
    }
}

struct HeapView {
    double* s;
    int *par, *dep, *rank, *path;
    int L;
    // entry a pops before entry b (heapq order of (-score, rank path))
    __device__ __forceinline__ bool before(int a, int b) const {
        if (s[a] != s[b]) return s[a] > s[b];
        const int da = dep[a], db = dep[b], m = da < db ? da : db;
        for (int i = 0; i < m; ++i) {
            const int ra = i < da - 1 ? path[par[a] * L + i] : rank[a];
            const int rb = i < db - 1 ? path[par[b] * L + i] : rank[b];
            if (ra != rb) return ra < rb;
        }
        return da < db;
    }
};

extern "C" __global__ void ddtree_heap_kernel(const int* __restrict__ top_id, const float* __restrict__ lp, int L, int K,
                                              int N, int T, const int* __restrict__ dmeta,
                                              const int* __restrict__ block_ids, int* __restrict__ rec,
                                              int* __restrict__ t_meta, int* __restrict__ t_ids,
                                              int* __restrict__ t_pos) {
    AFTER_PREVIOUS_GRID();
    extern __shared__ double smem[];
    const int cap = 2 * N + 2, lane = threadIdx.x;
    HeapView h;
    h.s = smem;
    h.par = (int*)(smem + cap);
    h.dep = h.par + cap;
    h.rank = h.dep + cap;
    h.path = h.rank + cap;
    h.L = L;
    float* slp = (float*)(h.path + (size_t)(N + 1) * L);   // lp and top_id staged in shared memory
    int* sid = (int*)(slp + (size_t)L * K);
    for (int i = lane; i < L * K; i += WARP_SIZE) { slp[i] = lp[i]; sid[i] = top_id[i]; }
    int* ids = rec + 1;
    int* parents = ids + T;
    int* depths = parents + T;
    int* ranks = depths + T;
    if (lane == 0) { h.s[0] = (double)slp[0]; h.par[0] = 0; h.dep[0] = 1; h.rank[0] = 0; }
    int n_e = 1, n = 0;
    __syncwarp();
    while (n_e > 0 && n < N) {
        int best = -1;
        for (int j = lane; j < n_e; j += WARP_SIZE)
            if (best < 0 || h.before(j, best)) best = j;
        for (int off = WARP_SIZE / 2; off > 0; off >>= 1) {
            const int o = __shfl_xor_sync(0xffffffffu, best, off);
            if (o >= 0 && (best < 0 || h.before(o, best))) best = o;
        }
        if (lane == 0) {
            const double logw = h.s[best];
            const int par = h.par[best], d = h.dep[best], r = h.rank[best];
            --n_e;                                              // remove: the last entry takes its slot
            if (best != n_e) { h.s[best] = h.s[n_e]; h.par[best] = h.par[n_e]; h.dep[best] = h.dep[n_e]; h.rank[best] = h.rank[n_e]; }
            const int idx = n + 1;
            ids[idx] = sid[(d - 1) * K + r];
            parents[idx] = par;
            depths[idx] = d;
            ranks[idx] = r;
            for (int i = 0; i < d - 1; ++i) h.path[idx * L + i] = h.path[par * L + i];
            h.path[idx * L + d - 1] = r;
            ++n;
            if (r + 1 < K) {                                    // next sibling
                h.s[n_e] = __dadd_rn(__dsub_rn(logw, (double)slp[(d - 1) * K + r]), (double)slp[(d - 1) * K + r + 1]);
                h.par[n_e] = par; h.dep[n_e] = d; h.rank[n_e] = r + 1;
                ++n_e;
            }
            if (d < L) {                                        // first child
                h.s[n_e] = __dadd_rn(logw, (double)slp[d * K]);
                h.par[n_e] = idx; h.dep[n_e] = d + 1; h.rank[n_e] = 0;
                ++n_e;
            }
        }
        n_e = __shfl_sync(0xffffffffu, n_e, 0);
        n = __shfl_sync(0xffffffffu, n, 0);
        __syncwarp();
    }
    const int start = dmeta[DMETA_N_CTX], bpos = dmeta[DMETA_BLK_POS];
    if (lane == 0) {
        rec[0] = n;
        ids[0] = block_ids[0];
        parents[0] = -1;
        depths[0] = 0;
        ranks[0] = 0;
        t_meta[0] = start; t_meta[1] = 0; t_meta[2] = 0; t_meta[3] = 0;
    }
    __syncwarp();
    for (int i = lane; i < T; i += WARP_SIZE) {          // rows past n (never, for a T the host sized) pad
        if (i > n) { ids[i] = 0; parents[i] = 0; depths[i] = 1; ranks[i] = 0; }
        t_ids[i] = ids[i];
        t_pos[i] = bpos + depths[i];
    }
}

// ---------------------------------------------------------------------------------------------------------
// The greedy walk on the device, so the next round needs no host (docs/ddtree.md §4, refmodel.ddtree.walk):
//   ddtree_walk_kernel: from rec (ids, parents, verify argmax of the tree just verified) follow the argmax
//       down the tree while it names a child (siblings have distinct tokens: at most one match); write the
//       accepted path and the bonus to rec (section 5 [T], then n_acc, bonus), and the next round's drafter
//       inputs in place: meta (context rows = the path at the end of the cache, the block after them, the
//       target compaction keeping the path), block ids[0] = the bonus, the context rows = the path.
//       Launch grid (1), block (1).
extern "C" __global__ void ddtree_walk_kernel(int* __restrict__ rec, int T, int* __restrict__ inp, int B) {
    AFTER_PREVIOUS_GRID();
    const int* ids = rec + 1;
    const int* parents = ids + T;
    const int* post = rec + 1 + 4 * T;
    int* acc = rec + 1 + 5 * T;
    int cur = 0, n = 1, nxt = post[0];
    acc[0] = 0;
    for (;;) {
        int child = -1;
        for (int k = cur + 1; k < T; ++k)
            if (parents[k] == cur && ids[k] == nxt) { child = k; break; }
        if (child < 0) break;
        cur = child;
        acc[n++] = cur;
        nxt = post[cur];
    }
    rec[1 + 6 * T] = n;
    rec[2 + 6 * T] = nxt;
    const int start = inp[DMETA_N_CTX], bpos = inp[DMETA_BLK_POS];
    inp[DMETA_CTX_ROW] = start;
    inp[DMETA_CTX_POS] = bpos;
    inp[DMETA_N_CTX] = start + n;
    inp[DMETA_BLK_POS] = bpos + n;
    inp[DMETA_KEEP_N] = n;
    inp[DMETA_KEEP_START] = start;
    inp[DMETA_N_NEW] = n;
    inp[8] = nxt;                                           // block ids: [bonus, MASK...]
    for (int i = 0; i < B; ++i) inp[8 + B + i] = i < n ? acc[i] : 0;
}
